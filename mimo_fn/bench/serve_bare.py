"""The server's work without the server: the engine `python -m mimo_fn.serve` builds from the same
flags, driven in-process by Engine.generate, for a side-by-side with bench_serving over HTTP.

It takes the server's own flags (model, quantization, pool, chunk; `--load-format dummy` makes
random weights from config.json alone) and runs --num-prompts prompts of --input-len random token
ids (seeded), --output-len new tokens each, all in one generate call: the scheduler admits them
as the server's would, so the input tok/s here is what the server's HTTP shell, tokenizer-free
path and its one loop thread add to. A warm-up call first (compile, autotune, graphs; the
server's warmup() does the same), then --repeats timed calls, the best counted.

    python -m mimo_fn.bench serve-bare --model-path DIR --load-format dummy --quantization fp8 \\
        --json-model-override-args '{"num_hidden_layers": 6}' --num-prompts 32 --input-len 16384 --output-len 1
"""

import torch

from mimo_fn.bench.results import print_table, record
from mimo_fn.bench.timing import wall_s

NEEDS_CUDA = False


def add_args(ap) -> None:
    from mimo_fn.serve.args import add_server_args

    add_server_args(ap)
    ap.add_argument("--num-prompts", type=int, default=32, help="prompts in the generate call")
    ap.add_argument("--input-len", type=int, default=16384, help="tokens per prompt (random ids)")
    ap.add_argument("--output-len", type=int, default=1, help="new tokens per prompt")
    ap.add_argument("--repeats", type=int, default=2, help="timed calls after the warm-up (the best counts)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the prompts' token ids")


def main(args, run) -> None:
    from mimo_fn.parallel import init_mesh
    from mimo_fn.serve.args import server_args
    from mimo_fn.serve.launch import build_engine, init_distributed

    sargs = server_args(args)
    device = init_distributed(sargs)
    engine, cfg, _, max_tokens = build_engine(sargs, device, init_mesh(1, 1, 1))
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, cfg.vocab_size, (args.num_prompts, args.input_len), generator=gen).tolist()
    engine.generate(prompts[:1], max_new_tokens=args.output_len)  # compile, tune, capture
    best = min(wall_s(lambda: engine.generate(prompts, max_new_tokens=args.output_len))[0]
               for _ in range(args.repeats))
    tokens = args.num_prompts * args.input_len
    row = record(run, {"seconds": best, "input_tok_s": tokens / best,
                       "output_tok_s": args.num_prompts * args.output_len / best},
                 layers=cfg.num_layers, pool_tokens=max_tokens, chunk=engine.config.chunk_size)
    print_table([{**row["params"], **row["results"]}],
                [("prompts", "num_prompts", "d"), ("ISL", "input_len", "d"), ("OSL", "output_len", "d"),
                 ("layers", "layers", "d"), ("chunk", "chunk", "d"), ("s", "seconds", ".3f"),
                 ("input tok/s", "input_tok_s", ",.0f")], title="the server's engine, in-process")
