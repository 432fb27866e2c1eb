"""Routing replay: mf.forward(..., routed_experts=...) routes each token to given experts (the
engine's, from a rollout) with gate weights from its own routers, so that a trainer's log-probs
are the engine's and its gradient reaches the routers.

Legend: T tokens, M MoE layers, K experts per token, V vocab.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import mimo_fn as mf
import mimo_fn.model as model_mod

CFG = mf.ModelConfig.tiny()
NUM_MOE = sum(CFG.is_moe(i) for i in range(CFG.num_layers))


def random_tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def random_routing(num_tokens: int) -> torch.Tensor:
    """K distinct experts for each token and MoE layer, [T, M, K] int32."""
    return torch.stack([torch.randperm(CFG.num_experts, generator=torch.Generator().manual_seed(i))[:CFG.top_k]
                        for i in range(num_tokens * NUM_MOE)]).view(num_tokens, NUM_MOE, CFG.top_k).int()


def own_routing(params, tokens_T, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """forward's logits and the experts its own routers chose, [T, M, K] (read off moe's output)."""
    seen = []
    real = model_mod.moe

    def spy(*args, **kw):
        y, ids = real(*args, **kw)
        seen.append(ids)
        return y, ids

    monkeypatch.setattr(model_mod, "moe", spy)
    logits_TV = mf.forward(params, CFG, tokens_T)
    monkeypatch.setattr(model_mod, "moe", real)
    assert len(seen) == NUM_MOE
    return logits_TV, torch.stack(seen, dim=1).to(torch.int32)


def test_replaying_its_own_routing_changes_nothing(monkeypatch):
    params = mf.init_params(CFG, seed=3)
    tokens_T = random_tokens(37, seed=1)
    want_TV, routed_TMK = own_routing(params, tokens_T, monkeypatch)
    assert routed_TMK.shape == (37, NUM_MOE, CFG.top_k)
    shuffled_TMK = routed_TMK.flip(-1)  # the order of a token's K experts does not matter
    for ids in (routed_TMK, routed_TMK.long(), shuffled_TMK):
        got_TV = mf.forward(params, CFG, tokens_T, routed_experts=ids)
        torch.testing.assert_close(got_TV, want_TV, rtol=0, atol=1e-5)


def test_other_experts_change_the_logits_from_their_token_on(monkeypatch):
    params = mf.init_params(CFG, seed=3)
    tokens_T = random_tokens(20, seed=2)
    want_TV, routed_TMK = own_routing(params, tokens_T, monkeypatch)
    other_TMK = routed_TMK.clone()
    t = 11
    chosen = set(routed_TMK[t, 0].tolist())
    other_TMK[t, 0] = torch.tensor([e for e in range(CFG.num_experts) if e not in chosen][:CFG.top_k])
    got_TV = mf.forward(params, CFG, tokens_T, routed_experts=other_TMK)
    torch.testing.assert_close(got_TV[:t], want_TV[:t], rtol=0, atol=1e-5)  # causal: earlier tokens keep theirs
    assert (got_TV[t] - want_TV[t]).abs().max() > 1e-3
    assert (got_TV[t + 1:] - want_TV[t + 1:]).abs().amax(-1).min() > 1e-5  # later ones attend to it


def test_engine_routing_replayed_gives_the_engine_logprobs():
    """The engine's routed experts, replayed in forward over prompt + output but the last token,
    give its prompt and output log-probs (temperature 1: the log-probs of the raw logits)."""
    params = mf.init_params(CFG, seed=5)
    engine = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=512, page_size=4, chunk_size=8))
    prompts = [random_tokens(n, seed=10 + n).tolist() for n in (13, 3, 21)]
    prompts.append(prompts[0])  # a copy: the engine forks the first one's K/V
    outs = engine.generate(prompts, max_new_tokens=7, sampling=mf.SamplingParams(temperature=1.0, seed=4),
                           return_logprobs=True, return_routed_experts=True)
    for prompt, out in zip(prompts, outs):
        fed_T = torch.tensor(prompt + out.tokens[:-1])
        assert out.routed_experts.dtype == torch.int32 and out.routed_experts.shape == (len(fed_T), NUM_MOE, CFG.top_k)
        logp_TV = F.log_softmax(mf.forward(params, CFG, fed_T, routed_experts=out.routed_experts).float(), dim=-1)
        targets_T = torch.tensor(prompt[1:] + out.tokens)
        got_T = logp_TV.gather(1, targets_T[:, None])[:, 0]
        want_T = torch.tensor(out.prompt_logprobs + out.logprobs)
        torch.testing.assert_close(got_T, want_T, rtol=0, atol=1e-5)


def test_replay_is_differentiable_into_the_routers():
    """On the plain-torch path the loss reaches every weight; the routers' gradient, through the
    replayed gate weights, matches a central difference along a random direction (the routing is
    fixed, so the loss is smooth in the router weights)."""
    base = mf.init_params(CFG, seed=6)
    tokens_T = random_tokens(16, seed=3)
    routed_TMK = random_routing(16)
    params = pytree.tree_map(lambda w: w.detach().clone().requires_grad_(w.is_floating_point()), base)

    def loss_of(p) -> torch.Tensor:
        logp_TV = F.log_softmax(mf.forward(p, CFG, tokens_T, routed_experts=routed_TMK), dim=-1)
        return -logp_TV[:-1].gather(1, tokens_T[1:, None]).mean()

    loss_of(params).backward()
    for path, w in mf.params.to_flat(params).items():
        if path.endswith("router_bias"):  # shifts the choice only: no gradient, as in route()
            assert w.grad is None or not w.grad.any(), path
        else:
            assert w.grad is not None and w.grad.abs().sum() > 0, path
    moe_layers = [i for i in range(CFG.num_layers) if CFG.is_moe(i)]
    gen = torch.Generator().manual_seed(7)
    dirs = {i: torch.randn(base.layers[i].mlp.router.shape, generator=gen) for i in moe_layers}
    analytic = sum((params.layers[i].mlp.router.grad * dirs[i]).sum() for i in moe_layers)

    def moved(eps: float) -> float:
        flat = mf.params.to_flat(base)
        for i in moe_layers:
            flat[f"layers.{i}.mlp.router"] = base.layers[i].mlp.router + eps * dirs[i]
        with torch.no_grad():
            return loss_of(mf.params.from_flat(CFG, flat)).item()

    eps = 1e-2
    numeric = (moved(eps) - moved(-eps)) / (2 * eps)
    assert abs(analytic.item()) > 1e-4
    assert abs(numeric - analytic.item()) <= 2e-2 * abs(analytic.item()), (numeric, analytic.item())


@pytest.mark.parametrize("bad, match", [
    (lambda r: r[:-1], r"routed_experts is a torch.int32 tensor of shape \(15, 3, 2\); expected .* \[16, 3, 2\]"),
    (lambda r: r[:, :1], r"routed_experts is .* shape \(16, 1, 2\); expected an integer tensor of shape "
                         r"\[tokens, MoE layers, top_k\]"),
    (lambda r: r.float(), r"routed_experts is a torch.float32 tensor"),
    (lambda r: r.tolist(), r"routed_experts is a list"),
    (lambda r: torch.where(r == r[4, 1, 0], 8, r), r"routed_experts holds expert id 8, outside \[0, num_experts = 8\)"),
    (lambda r: torch.where(r == r[4, 1, 0], -1, r), r"routed_experts holds expert id -1"),
    (lambda r: torch.cat([r[:, :, :1], r[:, :, :1]], -1), r"routed_experts names an expert twice for token 0"),
])
def test_bad_routed_experts_raise_value_error(bad, match, monkeypatch):
    params = mf.init_params(CFG, seed=3)
    tokens_T = random_tokens(16, seed=4)
    _, routed_TMK = own_routing(params, tokens_T, monkeypatch)
    with pytest.raises(ValueError, match=match):
        mf.forward(params, CFG, tokens_T, routed_experts=bad(routed_TMK))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA path: Triton kernels, which have no backward")
def test_forward_with_gradients_on_cuda_runs_the_differentiable_twins():
    """On CUDA the forward runs kernels without a backward, except where a gradient is wanted
    (a trainer's forward): there their plain-torch twins run, so fp32 gradients equal the CPU's,
    the logits equal the kernels' forward, and a bf16 forward of fp32 master weights trains."""
    base = mf.init_params(CFG, seed=6)
    tokens_T = random_tokens(24, seed=5)
    own_TMK = random_routing(24)
    grads, logits = {}, {}
    for device in ("cpu", "cuda"):
        params = pytree.tree_map(lambda w: w.detach().to(device).requires_grad_(), base)
        logits[device] = mf.forward(params, CFG, tokens_T, routed_experts=own_TMK)
        F.log_softmax(logits[device], -1)[:-1].gather(1, tokens_T[1:, None].to(device)).mean().backward()
        grads[device] = {k: (w.grad if w.grad is not None else torch.zeros_like(w)).cpu()
                         for k, w in mf.params.to_flat(params).items()}
        if device == "cuda":
            with torch.no_grad():  # the kernels' forward
                torch.testing.assert_close(mf.forward(params, CFG, tokens_T, routed_experts=own_TMK), logits["cuda"],
                                           rtol=0, atol=1e-4)
    torch.testing.assert_close(logits["cuda"].detach().cpu(), logits["cpu"].detach(), rtol=0, atol=1e-4)
    for k, g in grads["cpu"].items():
        torch.testing.assert_close(grads["cuda"][k], g, rtol=1e-3, atol=1e-6, msg=k)
    master = pytree.tree_map(lambda w: w.detach().cuda().requires_grad_(), base)
    fp32_paths = {p for p, info in mf.params.describe(CFG).items() if info.fp32}
    bf16 = mf.params.from_flat(CFG, {p: w if p in fp32_paths else w.bfloat16()
                                     for p, w in mf.params.to_flat(master).items()})
    mf.forward(bf16, CFG, tokens_T, routed_experts=own_TMK).float().logsumexp(-1).mean().backward()
    for k, w in mf.params.to_flat(master).items():
        assert k.endswith("router_bias") or (w.grad is not None and w.grad.isfinite().all() and w.grad.any()), k
