#!/usr/bin/env bash
# Issue 46's figures in one device call (~9 minutes on one H200; each step capped, the later ones
# skipped when the budget runs out), logs and JSON rows in OUT_DIR:
#   1. the 48-layer FP8 prefill extrapolation at ISL 64K with FP8 attention, 32K and 64K chunks,
#      main against BASE (a checkout of an earlier commit's mimo_fn/, if given), alternating;
#   2. one layer of each type by kernel (--profile-layers);
#   3. full attention TFLOP/s, bf16 and FP8 (item 2), and FP8 attention's accuracy on the slice;
#   4. 12 real layers against the 6-layer extrapolation (item 4, MXFP4 experts);
#   5. a fresh process's first call against its steady one (item 3);
#   6. the FP8 MoE GEMMs with and without their per-K-step scaling (item 1: bench moe --mode promotion);
#   7. the FP8 MoE layer at the power cap, its up GEMM warp-specialised (the default) and in Triton.
# Usage: scripts/prefill_h200.sh OUT_DIR [BASE_DIR] [BUDGET_S]   (BUDGET_S default 540)
set -uo pipefail
out=${1:?usage: scripts/prefill_h200.sh OUT_DIR [BASE_DIR] [BUDGET_S]}
base=${2:-}
budget=${3:-540}
t0=$(date +%s)
left() { echo $(( budget - ($(date +%s) - t0) )); }
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MIMO_FN_TYPECHECK=0
step() {  # name cap command...: the command with at most cap seconds (less when the budget is short)
  local name=$1 cap=$2; shift 2
  local t=$(( $(left) - 5 )); (( t > cap )) && t=$cap
  if (( t < 20 )); then echo "== $name: skipped (budget)"; return; fi
  echo "== $name"; timeout "$t" "$@" > "$out/$name.log" 2>&1; echo "rc=$?"
  grep -a -E "T48|T12|TFLOP/s|first|cosine" "$out/$name.log" | tail -6
}
p=(-m mimo_fn.bench prefill --isl 65536 --batch 1 --no-hf --dtypes fp8 --json "$out/rows.jsonl")
for round in 1 2; do
  [ -n "$base" ] && step "base_32k_$round" 100 env -C "$base" PYTHONPATH="$base:${PYTHONPATH:-}" MIMO_FN_ATTENTION_FP8=1 \
    python3 "${p[@]}" --chunk 32768
  step "main_32k_$round" 100 env MIMO_FN_ATTENTION_FP8=1 python3 "${p[@]}" --chunk 32768 $([ $round = 1 ] && echo --profile-layers)
done
step main_64k 100 env MIMO_FN_ATTENTION_FP8=1 python3 "${p[@]}" --chunk 65536
step attention 90 python3 -m mimo_fn.bench attention --fp8 --tokens 16384 32768 65536 --json "$out/rows.jsonl"
step attention_fp8_accuracy 100 python3 -m mimo_fn.bench attention-fp8 --prompts 4 --prompt-len 8192 --ref-len 2048 --new 32
step check_12_layers 140 python3 -m mimo_fn.bench prefill --dtypes mxfp4 --isl 65536 --chunk 32768 --no-hf --check-layers 12
step coldstart 240 python3 -m mimo_fn.bench coldstart --autotune-cache-ab
step moe_promotion 90 python3 -m mimo_fn.bench moe --mode promotion --tokens 65536 16384 --json "$out/rows.jsonl"
step moe_energy 90 python3 -m mimo_fn.bench moe-energy --tokens 65536 32768 --seconds 2 --methods fp8 \
  --json "$out/rows.jsonl"
echo "left $(left) s"
