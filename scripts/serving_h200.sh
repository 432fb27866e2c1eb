#!/usr/bin/env bash
# The serving figures of docs/benchmarks.md on one GPU: the 6-layer slice of MiMo-V2-Flash at the
# released dims, FP8, random weights (--load-format dummy), fake balanced routing
# (--ep-dispatch-algorithm fake: every expert gets the same tokens, as the reference run),
# prompts sent as token ids, at most 64 requests running.
#   0. the bare prefill step (python -m mimo_fn.bench prefill, one sequence, and its 48-layer extrapolation);
#   1. the bare engine (python -m mimo_fn.bench serve-bare) on the three shapes below, in one process;
#   2. the server started with the same flags (it warms up before it reports healthy), then
#      bench_serving: one request twice (the first after start, then warm), 16K/1 C32,
#      64K/1 C8 (32 requests, 4 warm-ups), 4K/256 C64 (128 requests);
#   3. with DRAFT_DIR (a DFlash draft trained for this target: python -m mimo_fn.bench spec --trained
#      --quantization fp8 --quiet-layers $QUIET --draft-path DRAFT_DIR), an FP8 server of the same
#      random weights (--dummy-quiet-layers $QUIET: a target whose continuations a draft can learn),
#      --speculative-algorithm DFLASH and real routing: 32 x 512/128 at C8, its acceptance length.
# Usage: scripts/serving_h200.sh OUT_DIR [DRAFT_DIR]   (rows in OUT_DIR/rows.jsonl and serving.jsonl)
# PARTS="prefill bare server dflash" (the default: all) picks steps, to split the run over device calls;
# QUIET (default 8192: scripts/quiet_probe.py says why) is the draft's target's --quiet-layers.
set -uo pipefail
out=${1:?usage: scripts/serving_h200.sh OUT_DIR [DRAFT_DIR]}
draft=${2:-}
parts=" ${PARTS:-prefill bare server dflash} "
quiet=${QUIET:-8192}
want() { [[ $parts == *" $1 "* ]]; }
mkdir -p "$out" /tmp/mimo_slice
python3 -c "import json, mimo_fn as mf; json.dump(mf.ModelConfig.flash().to_hf(), open('/tmp/mimo_slice/config.json', 'w'))"
slice=(--model-path /tmp/mimo_slice --load-format dummy --json-model-override-args '{"num_hidden_layers": 6}'
       --chunked-prefill-size 16384 --max-total-tokens 540672 --max-running-requests 64)
flags=("${slice[@]}" --quantization fp8 --ep-dispatch-algorithm fake)
want prefill && python3 -m mimo_fn.bench prefill --isl 4096 16384 65536 --dtypes fp8 --no-hf --routing fake --json "$out/rows.jsonl" \
  2>&1 | tee "$out/prefill.log" | tail -30
want bare && python3 -m mimo_fn.bench serve-bare "${flags[@]}" --num-prompts 32 32 128 --input-len 16384 65536 4096 \
  --output-len 1 1 256 --json "$out/rows.jsonl" 2>&1 | tee "$out/bare.log"
get() { python3 -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen('$1', timeout=5).read().decode())" 2>/dev/null; }
start() {  # log name, then the server's flags; waits until healthy
  local log=$1; shift
  t0=$(date +%s)
  python3 -m mimo_fn.serve "$@" --port 30000 > "$out/$log" 2>&1 &
  server=$!
  until get http://127.0.0.1:30000/health > /dev/null; do
    kill -0 $server 2>/dev/null || { echo "server died"; tail -20 "$out/$log"; exit 1; }
    sleep 2
  done
  echo "healthy after $(( $(date +%s) - t0 )) s (load, warm-up)"
}
server=
trap '[ -n "$server" ] && kill $server 2>/dev/null' EXIT
bench() {  # name, then bench_serving's flags
  local name=$1; shift
  python3 -m mimo_fn.bench_serving --backend mimo_fn --base-url http://127.0.0.1:30000 --dataset-name random-ids \
    --vocab-size 152576 --random-range-ratio 1 --disable-tqdm --output-file "$out/serving.jsonl" "$@" 2>&1 | tee "$out/$name.log" | tail -25
}
if want server; then
start server.log "${flags[@]}"
bench first --random-input-len 16384 --random-output-len 1 --num-prompts 1 --max-concurrency 1 --warmup-requests 0 --seed 11
bench again --random-input-len 16384 --random-output-len 1 --num-prompts 1 --max-concurrency 1 --warmup-requests 0 --seed 12
bench c32_16k --random-input-len 16384 --random-output-len 1 --num-prompts 32 --max-concurrency 32 --warmup-requests 4
bench c8_64k --random-input-len 65536 --random-output-len 1 --num-prompts 32 --max-concurrency 8 --warmup-requests 4
bench c64_4k --random-input-len 4096 --random-output-len 256 --num-prompts 128 --max-concurrency 64 --warmup-requests 4
get http://127.0.0.1:30000/get_server_info > "$out/server_info.json"
kill $server; wait $server 2>/dev/null; server=
fi
if [ -n "$draft" ] && want dflash; then
  start server_dflash.log "${slice[@]}" --quantization fp8 --dummy-quiet-layers "$quiet" --speculative-algorithm DFLASH --speculative-draft-model-path "$draft"
  bench dflash_512 --random-input-len 512 --random-output-len 128 --num-prompts 32 --max-concurrency 8 --warmup-requests 2
  get http://127.0.0.1:30000/get_server_info > "$out/server_info_dflash.json"
fi
