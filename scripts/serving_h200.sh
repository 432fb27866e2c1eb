#!/usr/bin/env bash
# The serving figures of docs/benchmarks.md on one GPU: the 6-layer slice of MiMo-V2-Flash at the
# released dims, FP8, random weights (--load-format dummy), prompts sent as token ids.
#   1. the bare engine on 32 x 16K prompts, 1 new token (python -m mimo_fn.bench serve-bare);
#   2. the server started with the same flags (it warms up before it reports healthy), then
#      bench_serving: one request twice (the first after start, then warm), 16K/1 C32,
#      64K/1 C8 (32 requests, 4 warm-ups), 4K/256 C64.
# Usage: scripts/serving_h200.sh OUT_DIR   (rows in OUT_DIR/rows.jsonl, logs beside them)
set -uo pipefail
out=${1:?usage: scripts/serving_h200.sh OUT_DIR}
mkdir -p "$out" /tmp/mimo_slice
python3 -c "import json, mimo_fn as mf; json.dump(mf.ModelConfig.flash().to_hf(), open('/tmp/mimo_slice/config.json', 'w'))"
flags=(--model-path /tmp/mimo_slice --load-format dummy --quantization fp8 --json-model-override-args
       '{"num_hidden_layers": 6}' --chunked-prefill-size 16384 --max-total-tokens 540672)
python3 -m mimo_fn.bench serve-bare "${flags[@]}" --num-prompts 32 --input-len 16384 --output-len 1 \
  --json "$out/rows.jsonl" 2>&1 | tee "$out/bare.log"
t0=$(date +%s)
python3 -m mimo_fn.serve "${flags[@]}" --port 30000 > "$out/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null' EXIT
get() { python3 -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen('$1', timeout=5).read().decode())" 2>/dev/null; }
until get http://127.0.0.1:30000/health > /dev/null; do
  kill -0 $server 2>/dev/null || { echo "server died"; tail -20 "$out/server.log"; exit 1; }
  sleep 2
done
echo "healthy after $(( $(date +%s) - t0 )) s (load, warm-up)"
bench() {  # name, then bench_serving's flags
  local name=$1; shift
  python3 -m mimo_fn.bench_serving --backend mimo_fn --base-url http://127.0.0.1:30000 --dataset-name random-ids \
    --vocab-size 152576 --random-range-ratio 1 --disable-tqdm --output-file "$out/serving.jsonl" "$@" 2>&1 | tee "$out/$name.log" | tail -25
}
bench first --random-input-len 16384 --random-output-len 1 --num-prompts 1 --max-concurrency 1 --warmup-requests 0 --seed 11
bench again --random-input-len 16384 --random-output-len 1 --num-prompts 1 --max-concurrency 1 --warmup-requests 0 --seed 12
bench c32_16k --random-input-len 16384 --random-output-len 1 --num-prompts 32 --max-concurrency 32 --warmup-requests 4
bench c8_64k --random-input-len 65536 --random-output-len 1 --num-prompts 32 --max-concurrency 8 --warmup-requests 4
bench c64_4k --random-input-len 4096 --random-output-len 256 --num-prompts 128 --max-concurrency 64 --warmup-requests 4
get http://127.0.0.1:30000/get_server_info > "$out/server_info.json"
