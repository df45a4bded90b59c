"""``python -m train --target T --data D --out O [...]``: train a DFlash draft (see train/config.py for flags)."""
from __future__ import annotations

import sys

from dflash_jax.launch import launch


def main(argv=None) -> int:
    launch()
    from train.config import parse_args

    cfg = parse_args(argv)
    from dflash_jax.sharding import maybe_initialize_distributed

    maybe_initialize_distributed()  # one process of a TPU pod slice / multi-node launch: before any device use
    from train.orbax_checkpoints import CheckpointError
    from train.data import DataError
    from train.errors import TrainingDiverged, TrainingError
    from train.loop import train

    try:
        train(cfg)
    except TrainingDiverged as e:  # the run itself failed (non-finite loss)
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (DataError, TrainingError, CheckpointError, OSError, ValueError) as e:  # bad input: data, checkpoints, options
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
