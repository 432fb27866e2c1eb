"""CUDA checks of a trainer's weight sync into an engine in another process (mimo_fn.rl.transfer
and Engine's SGLang-named RL calls), on one GPU, as a colocated trainer and server share one.

This process is the trainer: it makes the tiny model's weights on the GPU (fp32) and starts an
engine process (a plain subprocess, unrelated to it, as the server is) on the same GPU. It sends
weights by CUDA IPC handle (transfer.serialize, what /update_weights_from_tensor carries), as a
flattened bucket, and by a gloo broadcast of CUDA tensors (a group of two: NCCL refuses two ranks
on one GPU); after each, the engine's greedy tokens and log-probs must equal mf.forward on the
trainer's weights (fp32, 1e-4), and the trainer's tensors stay as they were. Then a release / resume
of the engine's memory, read from the driver. Prints each step's seconds; exits non-zero on a
mismatch.

    python scripts/check_rl_transfer.py [--device cpu]     (cpu: the same steps, shared memory for handles)
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import torch

import mimo_fn as mf
from mimo_fn.rl import transfer
from mimo_fn.rl.weights import hub_tensors

CFG = mf.ModelConfig.tiny()
PROMPTS = [[5, 6, 7, 8, 9], [40, 3, 3, 77, 12, 100, 9, 31]]


def engine_side(device: str) -> None:
    """The engine process: one JSON command a line on stdin, one JSON answer a line on stdout."""
    engine = mf.Engine(CFG, mf.init_params(CFG, seed=0, device=device),
                       mf.EngineConfig(max_tokens=4096, page_size=16, weights_cpu_backup=True))
    for line in sys.stdin:
        cmd = json.loads(line)
        op, out = cmd.pop("op"), {}
        try:
            if op == "generate":
                outs = engine.generate(PROMPTS, 5, return_logprobs=True)
                out = {"tokens": [o.tokens for o in outs], "logprobs": [o.logprobs for o in outs]}
            elif op == "release":
                free = torch.cuda.mem_get_info()[0] if device == "cuda" else 0
                engine.release_memory_occupation()
                out = {"freed": torch.cuda.mem_get_info()[0] - free if device == "cuda" else None}
            else:
                getattr(engine, op)(**cmd)
            out["version"] = engine.get_weight_version()
        except ValueError as e:
            out = {"error": str(e)}
        print(json.dumps(out), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="where both processes hold tensors (a GPU script: without one it says so); cpu: the same "
                         "steps, shared memory for the handles (default: %(default)s)")
    ap.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)  # the engine process itself
    args = ap.parse_args()
    device = args.device
    if args.engine:
        engine_side(device)
        return 0
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("check_rl_transfer.py: needs a CUDA GPU (none is visible to torch)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    child = subprocess.Popen([sys.executable, __file__, "--engine", "--device", device], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
    failures = []

    def ask(op, **kw):
        child.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        child.stdin.flush()
        return json.loads(child.stdout.readline())

    def check(what, params, t0):
        took = time.perf_counter() - t0
        got = ask("generate")
        for prompt, tokens, lps in zip(PROMPTS, got["tokens"], got["logprobs"]):
            rows = mf.forward(params, CFG, torch.tensor(prompt + tokens, device=device)).float()[len(prompt) - 1:-1]
            want = torch.log_softmax(rows, -1).gather(1, torch.tensor(tokens, device=device)[:, None])[:, 0].cpu()
            diff = (torch.tensor(lps) - want).abs().max().item()
            ok = tokens == rows.argmax(-1).tolist() and diff <= 1e-4
            if not ok:
                failures.append(what)
        print(f"{what:<28} {took:6.3f} s  version {got['version']}  max |log-prob - forward| {diff:.2e}  "
              f"{'ok' if ok else 'MISMATCH'}", flush=True)

    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"{where}  torch {torch.__version__}  tiny model, fp32, trainer and engine in two processes", flush=True)
    ask("generate")  # the engine's first steps (kernels compile) outside the timings
    for seed, fmt in ((1, None), (2, "flattened_bucket")):
        params = mf.init_params(CFG, seed=seed, device=device)
        named = hub_tensors(params, CFG)
        kept = [t.clone() for _, t in named]
        t0 = time.perf_counter()
        payload = transfer.serialize(transfer.flatten(named) if fmt else named)
        answer = ask("update_weights_from_tensor", named_tensors=payload, load_format=fmt)
        if "error" in answer:
            raise SystemExit(f"update_weights_from_tensor ({fmt}): {answer['error']}")
        check(f"handles{' (bucket)' if fmt else ''}", params, t0)
        if not all(torch.equal(a, t) for a, (_, t) in zip(kept, named)):
            failures.append("trainer tensors changed")

    params = mf.init_params(CFG, seed=3, device=device)
    named = hub_tensors(params, CFG)
    port = free_port()
    t0 = time.perf_counter()
    child.stdin.write(json.dumps({"op": "init_weights_update_group", "master_address": "127.0.0.1",
                                  "master_port": port, "rank_offset": 1, "world_size": 2, "backend": "gloo"}) + "\n")
    child.stdin.flush()
    group = transfer.init_trainer_group("127.0.0.1", port, 2, backend="gloo")
    assert "error" not in json.loads(child.stdout.readline())
    child.stdin.write(json.dumps({"op": "update_weights_from_distributed", "names": [n for n, _ in named],
                                  "dtypes": [str(t.dtype) for _, t in named],
                                  "shapes": [list(t.shape) for _, t in named]}) + "\n")
    child.stdin.flush()
    for _, t in named:
        transfer.broadcast(group, t)
    answer = json.loads(child.stdout.readline())
    if "error" in answer:
        raise SystemExit(f"update_weights_from_distributed: {answer['error']}")
    check("gloo broadcast", params, t0)

    t0 = time.perf_counter()
    freed = ask("release")["freed"]
    released = time.perf_counter() - t0
    ask("resume_memory_occupation")
    if device == "cuda":
        print(f"release / resume: the driver's free memory rose {freed / 2**20:.1f} MiB at the release "
              f"({released:.3f} s)", flush=True)
        if freed <= 0:
            failures.append("release freed nothing")
    check("after release / resume", params, time.perf_counter())
    child.stdin.close()
    child.wait(60)
    print("FAILED: " + ", ".join(failures) if failures else "all ok")
    return 1 if failures else 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
