"""``python -m infer.cache_plan``: rows that fit from the shapes alone, slots vs pages, consistent with the engine's
own sizes (a dense target's slot row is its max-context K/V; a paged row of the max context costs what a slot
costs, shorter rows less)."""
import json

import pytest

from infer import cache_plan


def test_slot_and_paged_rows_follow_the_shapes(capsys):
    assert cache_plan.main(["--preset", "qwen3-8b", "--memory", "80", "--context", "8192",
                            "--mean-lengths", "1024,8000", "--json"]) == 0
    short, full = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert full["token_bytes"] == (36 + 5) * 8 * 128 * 2 * 2  # target + draft layers x KV heads x dim x K,V x bf16
    lengths = 2 * 4  # the two caches' int32 length of the row
    assert full["slot_row_bytes"] == full["cache_len"] * full["token_bytes"] + lengths
    assert full["paged_row_bytes"] == lengths
    assert 0 < full["paged_rows"] <= full["slots_rows"] * full["cache_len"] / 8016 + 1
    assert short["paged_rows"] >= 7 * full["slots_rows"]  # an eighth of the context: about 8x the rows
    assert full["free_bytes"] == 80e9 - full["weights_bytes"]


def test_sliding_rings_stay_per_row_and_bad_input_dies(capsys):
    assert cache_plan.main(["--preset", "tiny", "--memory", "1", "--json"]) == 0
    assert all(json.loads(x)["paged_rows"] > 0 for x in capsys.readouterr().out.splitlines())
    with pytest.raises(SystemExit):
        cache_plan.main(["--memory", "0"])
    with pytest.raises(SystemExit):
        cache_plan.main(["--mean-lengths", "9000", "--context", "8192"])
