#!/usr/bin/env bash
# The GPU measurements the README asks for, in one command (about 30 minutes on one H200, most of it
# compiling the 8B shapes; name steps to run a subset within a shorter budget):
#
#   bash scripts/gpu_benchmarks.sh [OUT_DIR [STEP ...]]   # default: gpu_results/, every step
#   bash scripts/gpu_benchmarks.sh "$OUT" synthetic context  # two of them
#
# Each step writes OUT_DIR/<step>.json (JSON lines) and OUT_DIR/<step>.log; a step that fails or runs past
# its time limit is reported and the next one runs. Run it with the machine otherwise idle.
#   kernel       the draft's block attention: Pallas kernel vs dense reference (training shape)
#   synthetic    Qwen3-8B shapes, replayed tau 6.5, block 16: step split, speedup, efficiency (paper: 0.75)
#   context      step time vs context 1K-32K at one 33K bucket: length-bounded vs dense decode attention
#   train        one training step at the paper's shape (Qwen3-8B, 5-layer draft, S 3072, 512 anchors,
#                16 sequences): tokens/s, target features vs draft step, MFU, peak memory
#   adaptive     the demo pair: plain vs fixed block 16 vs adaptive verify lengths 4,8,16
#   tree16, tree64, tree256   the demo pair: plain vs chain vs tree verification at 16 / 64 / 256 nodes
#   gdntree      one Gated DeltaNet layer at Qwen3.5-4B's shape: chain verify of 16 vs tree verifies of 16 / 64
#                nodes, forward + commit (scripts/gdn_verify_cost.py)
#   serve        the demo pair served with --max-batch 64: output tokens/s at concurrency 1 and 16 beside the
#                engine's own batch-1 speed, plain and DFlash (server_vs_engine: one user's share)
#   load         the demo pair served with --max-batch 64 at concurrency 1, 4, 16, 64: DFlash whose block follows the
#                load (--block-size auto: block per bucket of live rows, block_per_bucket) vs plain decoding
#   paged        the demo pair, 64 requests of 16-900 new tokens (its context is 1024) through 32 rows at one cache
#                budget (64 MB): the paged engine vs unpaged max-length rows in the same memory (paged_vs_slots)
#   prefix       the demo pair served, every prompt opening with the same ~200 words: first vs second wave's TTFT
#   group        sample groups (32 prompts x 8 samples) with vs without prefix caching
#   compile8b, compiledsv3   seconds to trace / lower / compile one decode step at Qwen3-8B's and DeepSeek-V3's
#                shapes (abstract weights: nothing allocated; issue #52's yardstick for scanned layers)
#   compile8bscan, compiledsv3scan   the same with the target's layers scanned (--scan-layers)
#   synthscan    the synthetic step with scanned layers (--scan-layers): its tokens/s beside "synthetic"'s
#   cacheplan    Qwen3-8B + draft at 8K context: rows that fit 16 / 32 / 80 / 141 GB, slots vs paged (shapes only)
#   plan8b       the planner on this GPU (--topology local): Qwen3-8B + draft, every server program compiled, memory,
#                HBM bytes, roofline tokens/s at batch 1 / 8 / 64, to hold against "synthetic"'s measured tokens/s
#   structured   the demo pair, 16 prompts through 16 rows: plain vs DFlash, each with and without a JSON schema
#                (constrained DFlash identical to constrained plain; the cost of the masks)
#   grpo, grpofrozen, grpoplain   examples/grpo.py, 20 GRPO updates on the demo target: the draft adapted online,
#                frozen, and plain rollouts (tau and rollout tokens/s per update; engine logprobs checked)
set -u
OUT=${1:-gpu_results}
shift || true
STEPS=${*:-kernel synthetic context train adaptive tree16 tree64 tree256 gdntree serve load paged prefix group compile8b compiledsv3 compile8bscan compiledsv3scan synthscan cacheplan plan8b structured grpo grpofrozen grpoplain}
mkdir -p "$OUT"
python - <<'EOF' > "$OUT/devices.txt" 2>&1
import jax
print(jax.__version__, jax.default_backend(), jax.devices())
EOF
cat "$OUT/devices.txt"

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  case " $STEPS " in *" $name "*) ;; *) return ;; esac
  echo "== $name: $*"
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.json" 2> "$OUT/$name.log"
  local rc=$?
  echo "   exit $rc after $((SECONDS - start)) s (load average: $(cut -d' ' -f1-3 /proc/loadavg))"
  [ $rc -eq 0 ] || tail -5 "$OUT/$name.log"
}

step kernel 120 python -m dflash_jax.kernels.bench --backend gpu --q-tile 64 --k-tile 64 --time-seq 3072 --time-blocks 512 \
  --heads 32 --kv-heads 8 --head-dim 128 --iters 10 --json
step synthetic 240 python -m infer.benchmark --synthetic qwen3-8b --replay-tau 6.5 --block-size 16 \
  --batch-size 1,8 --context 1024,8192 --json
step context 150 python -m infer.context_sweep --synthetic qwen3-8b --context 1024,4096,16384,32768 \
  --bucket 33024 --attention auto,reference --json
step train 600 python -m train.bench --preset qwen3-8b-paper --impl kernel --json
step adaptive 120 python -m infer.benchmark --verify-lengths 4,8,16 --verify-threshold 0.1 --json
step tree16 150 python -m infer.benchmark --tree-budget 16 --json
step tree64 150 python -m infer.benchmark --tree-budget 64 --json
step tree256 200 python -m infer.benchmark --tree-budget 256 --json
step gdntree 120 python scripts/gdn_verify_cost.py
step serve 300 python -m infer.serve_benchmark --max-batch 64 --concurrency 1,16 --num-requests 16 \
  --max-new-tokens 128 --json
step load 400 python -m infer.serve_benchmark --max-batch 64 --concurrency 1,4,16,64 --num-requests 64 \
  --max-new-tokens 128 --json
step paged 400 python -m infer.benchmark --max-batch 32 --num-prompts 64 --mixed-budgets 16,900 \
  --kv-cache-memory 64MB --ignore-eos --json
step prefix 300 python -m infer.serve_benchmark --max-batch 64 --concurrency 8 --num-requests 16 \
    --max-new-tokens 64 --shared-prefix 200 --json
step group 300 python -m infer.group_benchmark --num-prompts 32 --group 8 --max-batch 64 --json
step compile8b 300 python scripts/compile_time.py --synthetic qwen3-8b --json
step compiledsv3 400 python scripts/compile_time.py --hf-config deepseek-v3 --repeat 1 --json
step compile8bscan 300 python scripts/compile_time.py --synthetic qwen3-8b --scan-layers --json
step compiledsv3scan 400 python scripts/compile_time.py --hf-config deepseek-v3 --repeat 1 --scan-layers --json
step synthscan 240 python -m infer.benchmark --synthetic qwen3-8b --replay-tau 6.5 --block-size 16 \
  --batch-size 1,8 --context 1024,8192 --scan-layers --json
step cacheplan 60 python -m infer.cache_plan --preset qwen3-8b --memory 16,32,80,141 --context 8192 --json
step plan8b 900 python -m infer.plan --target qwen3-8b --topology local --max-batch 64 --json
step structured 300 python -m infer.structured_benchmark --max-batch 16 --num-prompts 16 --max-new-tokens 128 --json
step grpo 600 python examples/grpo.py --updates 20 --adapt-draft --check --json
step grpofrozen 600 python examples/grpo.py --updates 20 --json
step grpoplain 600 python examples/grpo.py --updates 20 --plain --json
echo "results in $OUT/"
