"""A colocated RL step on one GPU in two processes: this process is the trainer, a
`python -m mimo_fn.serve` process on the same GPU the rollout engine, driven over HTTP by
`mimo_fn.client.EngineClient` with SGLang's endpoint names.

The 6-layer slice at the released dims. The trainer holds bf16 weights (seed 0) on the GPU; the
server makes the same weights (`--load-format dummy --random-seed 0`) in each --formats format
(bf16; FP8 128x128 blocks; MXFP4 experts with FP8 elsewhere), with the memory saver on, so its
decode CUDA graphs keep their addresses over a release. For each format, one step:

  rollout   --prompts prompts of --prompt-len random ids, --new tokens each (temperature 1,
            seeded), with log-probs and routed experts; the second of two calls is timed
  release   POST /release_memory_occupation of weights and kv_cache; the GPU memory it gave
            back is read from the driver (torch.cuda.mem_get_info in this process) before and after
  logprobs  the trainer's log-probs of the rollout's tokens, mf.forward with routing replay
            (the engine's experts), against the engine's: mean / max absolute difference
  resume    POST /resume_memory_occupation
  sync      every weight by CUDA IPC handle (POST /update_weights_from_tensor, hub names, one
            handle a tensor), bf16 into the server's format
  again     the rollout after the sync: the same weights went back, so the same tokens must
            come out, and the server's graph captures must not have grown (graphs kept)

`python -m mimo_fn.bench weight-sync` times the in-process `update_weights` of the same weights.

    python -m mimo_fn.bench colocated [--formats fp8 mxfp4 bf16] [--prompts 8] [--prompt-len 512] [--new 64]
"""

import base64
import json
import os
import tempfile
import time

import torch

import mimo_fn as mf
from mimo_fn.bench.results import print_table, record
from mimo_fn.bench.workload import flash_slice
from mimo_fn.rl.weights import hub_tensors
from mimo_fn.serve.process import launch_server

NEEDS_CUDA = True
GiB = 2**30
SERVER_START_S = 900  # loading, compiling, tuning and capturing the slice's kernels and graphs


def add_args(ap) -> None:
    ap.add_argument("--formats", nargs="+", choices=("bf16", "fp8", "mxfp4"), default=["fp8", "mxfp4", "bf16"],
                    help="the server's weight formats, one server each")
    ap.add_argument("--prompts", type=int, default=8, help="prompts a rollout")
    ap.add_argument("--prompt-len", type=int, default=512, help="tokens a prompt (random ids)")
    ap.add_argument("--new", type=int, default=64, help="tokens generated a prompt")
    ap.add_argument("--port", type=int, default=0, help="the server's port (0: a free one)")


def _server_flags(model_dir: str, fmt: str) -> list[str]:
    flags = ["--model-path", model_dir, "--load-format", "dummy", "--random-seed", "0",
             "--json-model-override-args", json.dumps({"num_hidden_layers": 6}), "--enable-memory-saver",
             "--max-total-tokens", "16384", "--chunked-prefill-size", "4096", "--dtype", "bfloat16"]
    return flags + (["--quantization", fmt] if fmt != "bf16" else [])


def _rollout(client, prompts, new: int, num_moe: int, top_k: int):
    sampling = [{"temperature": 1.0, "max_new_tokens": new, "ignore_eos": True, "seed": 1000 + i}
                for i in range(len(prompts))]
    t0 = time.perf_counter()
    outs = client.generate(prompts, sampling, return_logprob=True, return_routed_experts=True)
    seconds = time.perf_counter() - t0
    got = [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]],
            torch.frombuffer(bytearray(base64.b64decode(o["meta_info"]["routed_experts"])), dtype=torch.int32)
            .view(-1, num_moe, top_k)) for o in outs]
    return got, seconds


def _driver_free() -> int:
    """Free GPU memory as the driver sees it (every process's allocations count); 0 on the CPU."""
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


@torch.no_grad()
def _logprob_diff(params, cfg, prompts, got) -> tuple[float, float]:
    """Mean and max |trainer - engine| log-prob of the generated tokens (the trainer: mf.forward
    with the engine's experts replayed, one sequence at a time)."""
    diffs, device = [], params.embed.device
    for prompt, (tokens, lps, experts_TMK) in zip(prompts, got):
        fed_T = torch.tensor(prompt + tokens[:-1], device=device)
        logits_TV = mf.forward(params, cfg, fed_T, routed_experts=experts_TMK.to(device))
        logp = torch.log_softmax(logits_TV[len(prompt) - 1:].float(), -1)
        mine = logp.gather(1, torch.tensor(tokens, device=device)[:, None])[:, 0]
        diffs.append((mine.cpu() - torch.tensor(lps)).abs())
    d = torch.cat(diffs)
    return d.mean().item(), d.max().item()


def _step(client, params, cfg, prompts, args) -> dict:
    num_moe = sum(cfg.is_moe(i) for i in range(cfg.num_layers))
    _rollout(client, prompts, args.new, num_moe, cfg.top_k)  # decode graphs captured at these sizes
    got, rollout_s = _rollout(client, prompts, args.new, num_moe, cfg.top_k)
    captures = client.get_server_info()["cuda_graph_captures"]
    free0 = _driver_free()
    t0 = time.perf_counter()
    client.release_memory_occupation(["weights", "kv_cache"])
    release_s = time.perf_counter() - t0
    freed = _driver_free() - free0
    t0 = time.perf_counter()
    lp_mean, lp_max = _logprob_diff(params, cfg, prompts, got)
    logprobs_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    client.resume_memory_occupation(["weights", "kv_cache"])
    resume_s = time.perf_counter() - t0
    named = hub_tensors(params, cfg)
    t0 = time.perf_counter()
    client.update_weights_from_tensor(named)
    sync_s = time.perf_counter() - t0
    again, again_s = _rollout(client, prompts, args.new, num_moe, cfg.top_k)
    return dict(rollout_s=rollout_s, release_s=release_s, freed_gib=freed / GiB, logprobs_s=logprobs_s,
                resume_s=resume_s, sync_s=sync_s, tensors=len(named),
                sync_gb_s=sum(t.numel() * t.element_size() for _, t in named) / sync_s / 1e9,
                again_s=again_s, same_tokens=[g[0] for g in again] == [g[0] for g in got],
                graphs_kept=client.get_server_info()["cuda_graph_captures"] == captures,
                logprob_diff_mean=lp_mean, logprob_diff_max=lp_max)


def main(args, run) -> None:
    from mimo_fn.client import EngineClient

    cfg = flash_slice()
    params = mf.init_params(cfg, seed=0, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.prompts)]
    model_dir = tempfile.mkdtemp(prefix="mimo_fn_colocated_")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(mf.ModelConfig.flash().to_hf(), f)
    print(f"{run.device}  torch {torch.__version__}  the 6-layer slice; trainer bf16 on the GPU "
          f"({torch.cuda.memory_allocated() / GiB:.1f} GiB); {args.prompts} prompts x {args.prompt_len} + "
          f"{args.new} new", flush=True)
    rows = []
    for fmt in args.formats:
        log_path = os.path.join(model_dir, f"server_{fmt}.log")
        server = client = None
        try:
            server = launch_server(_server_flags(model_dir, fmt), port=args.port or None, log_path=log_path,
                                   timeout=SERVER_START_S)
            client = EngineClient(server.url, timeout=900)
            row = {"format": fmt, **_step(client, params, cfg, prompts, args)}
        except Exception as e:  # noqa: BLE001  (one format failing leaves the others' rows)
            row = {"format": fmt, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            with open(log_path) as f:
                print(f.read()[-3000:], flush=True)
        finally:
            if client is not None:
                client.close()
            if server is not None:
                server.stop(60)
        print(row, flush=True)
        rows.append(row)
        record(run, {k: v for k, v in row.items() if k != "format"}, format=fmt)
    print_table(rows, [("engine", "format", "s"), ("rollout s", "rollout_s", ".2f"), ("release s", "release_s", ".2f"),
                       ("freed GiB", "freed_gib", ".1f"), ("resume s", "resume_s", ".2f"), ("sync s", "sync_s", ".2f"),
                       ("tensors", "tensors", "d"), ("GB/s", "sync_gb_s", ".1f"), ("same tokens", "same_tokens", ""),
                       ("graphs kept", "graphs_kept", ""), ("lp diff mean", "logprob_diff_mean", ".2e"),
                       ("lp diff max", "logprob_diff_max", ".2e"), ("error", "error", "s")],
                "a colocated step, trainer and server on one H200")
