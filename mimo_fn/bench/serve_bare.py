"""The server's work without the server: the engine `python -m mimo_fn.serve` builds from the same
flags, driven in-process by Engine.generate, for a side-by-side with bench_serving over HTTP.

It takes the server's own flags (model, quantization, pool, chunk; `--load-format dummy` makes
random weights from config.json alone) and runs --num-prompts prompts of --input-len random token
ids (seeded), --output-len new tokens each, all in one generate call: the scheduler admits them
as the server's would, so the input tok/s here is what the server's HTTP shell, tokenizer-free
path and its one loop thread add to. Several cases run in one process when the three flags take
several values (one case each, a single value standing for all). Per case a warm-up call first
(compile, autotune, graphs; the server's warmup() does the same), then --repeats timed calls, the
best counted. --max-running-requests caps what runs at once, as a client's concurrency caps the
server's requests.

    python -m mimo_fn.bench serve-bare --model-path DIR --load-format dummy --quantization fp8 \\
        --json-model-override-args '{"num_hidden_layers": 6}' --num-prompts 32 --input-len 16384 --output-len 1
    ... --num-prompts 32 32 128 --input-len 16384 65536 4096 --output-len 1 1 256 --max-running-requests 64
"""

import torch

from mimo_fn.bench.results import print_table, record
from mimo_fn.bench.timing import wall_s

NEEDS_CUDA = False


def add_args(ap) -> None:
    from mimo_fn.serve.args import add_server_args

    add_server_args(ap)
    ap.add_argument("--num-prompts", type=int, nargs="+", default=[32], help="prompts in the generate call, per case")
    ap.add_argument("--input-len", type=int, nargs="+", default=[16384], help="tokens per prompt (random ids), per case")
    ap.add_argument("--output-len", type=int, nargs="+", default=[1], help="new tokens per prompt, per case")
    ap.add_argument("--repeats", type=int, default=2, help="timed calls after the warm-up (the best counts)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the prompts' token ids")


def main(args, run) -> None:
    from mimo_fn.serve.args import server_args
    from mimo_fn.serve.launch import build_engine, init_distributed, mesh_for

    sargs = server_args(args)
    device = init_distributed(sargs)
    engine, cfg, _, max_tokens = build_engine(sargs, device, mesh_for(sargs))
    lists = (args.num_prompts, args.input_len, args.output_len)
    n = max(map(len, lists))
    if any(len(v) not in (1, n) for v in lists):
        raise ValueError(f"--num-prompts / --input-len / --output-len: {[len(v) for v in lists]} values; expected "
                         f"one or {n} each (one value stands for every case)")
    rows = []
    for num, isl, osl in zip(*(v * n if len(v) == 1 else v for v in lists)):
        gen = torch.Generator().manual_seed(args.seed)
        prompts = torch.randint(0, cfg.vocab_size, (num, isl), generator=gen).tolist()
        engine.generate(prompts[:1], max_new_tokens=osl)  # compile, tune, capture
        best = min(wall_s(lambda: engine.generate(prompts, max_new_tokens=osl))[0] for _ in range(args.repeats))
        row = record(run, {"seconds": best, "input_tok_s": num * isl / best, "output_tok_s": num * osl / best},
                     num_prompts=num, input_len=isl, output_len=osl, layers=cfg.num_layers, pool_tokens=max_tokens,
                     chunk=engine.config.chunk_size, max_running=engine.config.max_batch)
        rows.append({**row["params"], **row["results"]})
    print_table(rows, [("prompts", "num_prompts", "d"), ("ISL", "input_len", "d"), ("OSL", "output_len", "d"),
                       ("running", "max_running", "d"), ("layers", "layers", "d"), ("chunk", "chunk", "d"),
                       ("s", "seconds", ".3f"), ("input tok/s", "input_tok_s", ",.0f"),
                       ("output tok/s", "output_tok_s", ",.0f")], title="the server's engine, in-process")
