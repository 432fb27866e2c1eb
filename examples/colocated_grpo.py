"""Colocated GRPO on the tiny model: a trainer and a rollout engine sharing one device.

    python examples/colocated_grpo.py                    # the engine: a server in its own process (default)
    python examples/colocated_grpo.py --in-process       # the engine: mf.Engine in this process
    python examples/colocated_grpo.py --device cuda      # on a GPU, in bf16
    python examples/colocated_grpo.py --url http://127.0.0.1:30000   # a server started elsewhere

The task is verifiable: a prompt "a+b=" earns 1 for the right sum and partial credit for right
digits (a random model must earn something, or every advantage is 0). Each step:
  rollout  the engine samples n completions a prompt (temperature 1, seeded), with their log-probs
           and the experts every MoE layer routed each token to
  release  the engine gives its memory back (weights, KV cache, CUDA graphs) for the trainer
  train    the trainer's log-probs of the same tokens, through the same experts (routing replay:
           mf.forward(..., routed_experts=...)), and one GRPO step: advantages normalised within
           each prompt's group, the ratio against the engine's log-probs as the old policy, clipped
  resume   the engine takes its memory back
  sync     the trainer pushes every weight, by hub name, into the engine's storage (also once
           before the first step: the engine starts from the trainer's weights)
The engine is driven through the colocated-RL API (SGLang's names), the same on mf.Engine and on
mf.client.EngineClient; only `generate` differs (Outputs in-process, SGLang's JSON over HTTP), and
`rollout` reads either. The trainer is plain torch over mimo_fn's params: fp32 master weights,
the forward in the engine's dtype. Printed per step: each phase's seconds, the mean reward, the
trainer-vs-engine log-prob difference over the sampled tokens (mean and max |diff|: the gate RL
users watch; ~1e-6 in fp32, as both compute the same function), and the engine's mean log-prob
of the right answers of held-out problems after the sync.

Legend: T tokens fed (prompt + completion - 1), G completion tokens, M MoE layers, K experts per
token, V vocab, P prompts a step, S samples a prompt.
"""

import argparse
import base64
import contextlib
import random
import re
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import mimo_fn as mf
from mimo_fn.cli_help import HelpFormatter
from mimo_fn.params import describe, from_flat, to_flat
from mimo_fn.rl.weights import hub_tensors
from mimo_fn.serve.process import ServerProcess, launch_server
from mimo_fn.serve.tokenizer import tiny_tokenizer

# the server's endpoints this loop needs beyond /generate (the colocated-RL API, issue 42)
RL_ENDPOINTS = ("/update_weights_from_tensor", "/release_memory_occupation", "/resume_memory_occupation")


class MissingEndpoint(RuntimeError):
    """The server has no colocated-RL endpoints (an older mimo_fn, or another server)."""


@dataclass(frozen=True)
class Sample:
    group: int  # which prompt of the step
    prompt: list[int]
    tokens: list[int]  # the completion
    logprobs: list[float]  # the engine's log-prob of each completion token
    routed_TMK: torch.Tensor  # int32: the experts the engine routed each fed token to


def make_problems(rng: random.Random, n: int) -> list[tuple[str, int]]:
    return [(f"{a}+{b}=", a + b) for a, b in ((rng.randint(0, 49), rng.randint(0, 49)) for _ in range(n))]


def reward(completion: str, answer: int) -> float:
    """1 for the answer (the completion's leading digits); else half a point spread over the
    answer's digits it has in place, and a fifth for a number at all, so that a random model's
    samples differ and their advantages do not all vanish."""
    want, digits = str(answer), re.match(r"\d*", completion).group()
    if digits == want:
        return 1.0
    return 0.5 * sum(a == b for a, b in zip(digits, want)) / len(want) + 0.2 * bool(digits)


def rollout(engine, prompts: list[list[int]], n: int, max_new: int, seed: int, stop_ids, cfg) -> list[Sample]:
    """n samples a prompt; sample i draws from seed + i on either engine."""
    batch = [p for p in prompts for _ in range(n)]
    if isinstance(engine, mf.Engine):
        outs = engine.generate(batch, max_new, mf.SamplingParams(temperature=1.0, seed=seed), return_logprobs=True,
                               return_routed_experts=True, stop_token_ids=list(stop_ids))
        got = [(o.tokens, o.logprobs, o.routed_experts) for o in outs]
    else:
        sampling = [{"temperature": 1.0, "max_new_tokens": max_new, "seed": seed + i} for i in range(len(batch))]
        outs = engine.generate(batch, sampling, return_logprob=True, return_routed_experts=True)
        num_moe = sum(cfg.is_moe(i) for i in range(cfg.num_layers))
        got = [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]],
                torch.frombuffer(bytearray(base64.b64decode(o["meta_info"]["routed_experts"])), dtype=torch.int32)
                .view(-1, num_moe, cfg.top_k)) for o in outs]
    return [Sample(i // n, batch[i], *g) for i, g in enumerate(got)]


def answer_logprob(engine, problems: list[tuple[list[int], list[int]]]) -> float:
    """The engine's mean log-prob of each answer's tokens after its problem (prompt log-probs)."""
    seqs = [q + a for q, a in problems]
    if isinstance(engine, mf.Engine):
        outs = engine.generate(seqs, 1, return_logprobs=True)
        lps = [o.prompt_logprobs[len(q) - 1:] for o, (q, _) in zip(outs, problems)]
    else:
        outs = [engine.generate(s, {"max_new_tokens": 1, "temperature": 0}, return_logprob=True,
                                logprob_start_len=len(q)) for s, (q, _) in zip(seqs, problems)]
        lps = [[lp for lp, _, _ in o["meta_info"]["input_token_logprobs"]] for o in outs]
    return sum(map(sum, lps)) / sum(map(len, lps))


def token_logprobs(params: mf.Params, cfg: mf.ModelConfig, s: Sample) -> torch.Tensor:
    """The trainer's log-probs [G] of the sample's completion, routed as the engine routed it."""
    device = params.embed.device
    fed_T = torch.tensor(s.prompt + s.tokens[:-1], device=device)
    logits_TV = mf.forward(params, cfg, fed_T, routed_experts=s.routed_TMK)
    logp_GV = F.log_softmax(logits_TV[len(s.prompt) - 1:].float(), dim=-1)
    return logp_GV.gather(1, torch.tensor(s.tokens, device=device)[:, None])[:, 0]


def grpo_loss(samples: list[Sample], logps: list[torch.Tensor], rewards_PS: torch.Tensor, clip: float) -> torch.Tensor:
    """GRPO: each sample's advantage is its reward normalised within its prompt's group; the
    clipped PPO surrogate per token against the engine's log-probs, averaged per sample, then
    over samples (no KL term)."""
    adv_PS = (rewards_PS - rewards_PS.mean(-1, keepdim=True)) / (rewards_PS.std(-1, keepdim=True) + 1e-4)
    adv_PS = adv_PS.to(logps[0].device)
    n = rewards_PS.shape[1]
    losses = []
    for i, (s, logp_G) in enumerate(zip(samples, logps)):
        adv = adv_PS[s.group, i % n]
        ratio_G = torch.exp(logp_G - torch.tensor(s.logprobs, device=logp_G.device))
        surrogate_G = torch.minimum(ratio_G * adv, ratio_G.clamp(1 - clip, 1 + clip) * adv)
        losses.append(-surrogate_G.mean())
    return torch.stack(losses).mean()


def in_dtype(master: mf.Params, cfg: mf.ModelConfig, dtype: torch.dtype) -> mf.Params:
    """The master weights in the engine's dtype, differentiably (weights kept in fp32 stay)."""
    keep = {path for path, info in describe(cfg).items() if info.fp32}
    return from_flat(cfg, {p: w if p in keep else w.to(dtype) for p, w in to_flat(master).items()})


def start_server(args: argparse.Namespace, dtype: str) -> ServerProcess:
    """`python -m mimo_fn.serve` on a free port of 127.0.0.1, serving the tiny model with the
    trainer's initial weights (the same seed); returns once /health answers (RuntimeError, with
    the end of the server's log, if it does not)."""
    return launch_server(["--device", args.device, "--dtype", dtype, "--random-seed", str(args.seed),
                          "--max-total-tokens", str(args.max_total_tokens), "--log-level", "warning"])


def check_endpoints(url: str) -> None:
    """MissingEndpoint unless the server routes RL_ENDPOINTS (POST only: a GET of one is a 405, not a 404)."""
    import httpx

    missing = [p for p in RL_ENDPOINTS if httpx.get(url + p, timeout=30).status_code == 404]
    if missing:
        raise MissingEndpoint(f"the server at {url} has no {', '.join(missing)}: it does not serve the colocated-RL "
                              "API (issue 42)")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=4, help="prompts a step")
    ap.add_argument("--samples", type=int, default=8, help="samples a prompt (the GRPO group)")
    ap.add_argument("--max-new-tokens", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--clip", type=float, default=0.2, help="PPO ratio clip")
    ap.add_argument("--seed", type=int, default=0, help="weights, problems and sampling")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="the engine's and the trainer's forward (auto: bfloat16 on CUDA, float32 on the CPU)")
    ap.add_argument("--max-total-tokens", type=int, default=4096, help="the engine's KV pool")
    ap.add_argument("--in-process", action="store_true", help="mf.Engine in this process instead of a server")
    ap.add_argument("--url", help="use the server (of the tiny model) at this URL instead of starting one")
    return ap.parse_args(argv)


@contextlib.contextmanager
def phase(times: dict, name: str, device: torch.device):
    """Times the block into times[name], the device's queued work included."""
    t0 = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times[name] = time.perf_counter() - t0


def main(argv=None) -> list[dict]:
    """Runs the loop; returns each step's numbers (what it prints)."""
    args = parse_args(argv)
    dtype_name = args.dtype if args.dtype != "auto" else "bfloat16" if args.device == "cuda" else "float32"
    dtype, device = getattr(torch, dtype_name), torch.device(args.device)
    cfg = mf.ModelConfig.tiny()
    tok = tiny_tokenizer(cfg.vocab_size)
    master = pytree.tree_map(lambda w: w.requires_grad_(), mf.init_params(cfg, args.seed, torch.float32, device))
    opt = torch.optim.AdamW(pytree.tree_leaves(master), lr=args.lr, weight_decay=0.0)
    server = url = None
    if args.in_process:
        params = mf.init_params(cfg, args.seed, dtype, device)  # the engine's own copy: release frees it
        engine = mf.Engine(cfg, params, mf.EngineConfig(max_tokens=args.max_total_tokens))
    else:
        from mimo_fn.client import EngineClient

        url = args.url
        if url is None:
            server = start_server(args, dtype_name)
            url = server.url
        engine = EngineClient(url)
    rng = random.Random(args.seed)
    held_out = [(tok.encode(q), tok.encode(str(a))) for q, a in make_problems(rng, 8)]
    history = []
    try:
        if url is not None:
            check_endpoints(url)
        with torch.no_grad():  # whatever the engine loaded, it starts from the trainer's weights
            engine.update_weights_from_tensor(list(hub_tensors(in_dtype(master, cfg, dtype), cfg)))
        for step in range(1, args.steps + 1):
            problems = make_problems(rng, args.prompts)
            times = {}
            with phase(times, "rollout", device):
                samples = rollout(engine, [tok.encode(q) for q, _ in problems], args.samples, args.max_new_tokens,
                                  args.seed * 1_000_003 + step * 1000, tok.eos_token_ids, cfg)
            with phase(times, "release", device):
                engine.release_memory_occupation()
            with phase(times, "train", device):
                rewards_PS = torch.tensor([reward(tok.decode(s.tokens), problems[s.group][1]) for s in samples]
                                          ).view(args.prompts, args.samples)
                params = in_dtype(master, cfg, dtype)
                logps = [token_logprobs(params, cfg, s) for s in samples]
                loss = grpo_loss(samples, logps, rewards_PS, args.clip)
                opt.zero_grad()
                loss.backward()
                opt.step()
            with phase(times, "resume", device):
                engine.resume_memory_occupation()
            with phase(times, "sync", device), torch.no_grad():
                engine.update_weights_from_tensor(list(hub_tensors(in_dtype(master, cfg, dtype), cfg)))
            diff_G = torch.cat([(lp.detach().cpu() - torch.tensor(s.logprobs)).abs() for lp, s in zip(logps, samples)])
            row = {"step": step, **times, "reward": rewards_PS.mean().item(), "loss": loss.item(),
                   "logprob_diff_mean": diff_G.mean().item(), "logprob_diff_max": diff_G.max().item(),
                   "heldout_answer_logprob": answer_logprob(engine, held_out)}
            history.append(row)
            print(f"step {step:3d}  " + " ".join(f"{k} {times[k]:.2f}s" for k in times) +
                  f"  reward {row['reward']:.3f}  logprob diff mean {row['logprob_diff_mean']:.1e} "
                  f"max {row['logprob_diff_max']:.1e}  held-out log p(answer) {row['heldout_answer_logprob']:.3f}",
                  flush=True)
    finally:
        if not args.in_process:
            engine.close()
        if server is not None:
            server.stop()
    return history


if __name__ == "__main__":
    main()
