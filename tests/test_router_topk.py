"""The fused router top-k kernel against `router_topk_ref`, and route()'s paths against both.

Without CUDA the kernel runs under TRITON_INTERPRET=1 (set before triton is imported).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

import mimo_fn as mf  # noqa: E402
from mimo_fn.kernels.router_topk import router_topk, router_topk_ref  # noqa: E402
from mimo_fn.layers import router as router_mod  # noqa: E402
from mimo_fn.layers.router import _route_logits, gate_weights, route  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty hands out NaN / -1 filled tensors: an output element the kernel does not write shows."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -1)

    monkeypatch.setattr(torch, "empty", empty)


def _inputs(num_tokens: int, num_experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits_TX = torch.randn(num_tokens, num_experts, generator=gen) * 2
    bias_X = torch.randn(num_experts, generator=gen) * 0.1  # large enough to change the choice
    return logits_TX.to(DEVICE), bias_X.to(DEVICE)


def assert_same_topk(w_TK, ids_TK, w_ref_TK, ids_ref_TK, choice_TX):
    """ids equal, position by position, except between choices within 1e-6 of each other (the
    two sigmoids may differ in their last bits); each token's weights within 1e-6 relative."""
    near_TK = (choice_TX.gather(1, ids_TK) - choice_TX.gather(1, ids_ref_TK)).abs() <= 1e-6
    assert ((ids_TK == ids_ref_TK) | near_TK).all()
    order_TK, order_ref_TK = ids_TK.argsort(-1), ids_ref_TK.argsort(-1)
    same_T = (ids_TK.gather(1, order_TK) == ids_ref_TK.gather(1, order_ref_TK)).all(-1)  # a near tie at K: skip
    assert same_T.float().mean() >= 0.9
    torch.testing.assert_close(w_TK.gather(1, order_TK)[same_T], w_ref_TK.gather(1, order_ref_TK)[same_T],
                               rtol=1e-6, atol=0)


@pytest.mark.parametrize("num_tokens,num_experts", [(1, 256), (37, 256), (37, 16), (5, 20), (3, 1000)])
@pytest.mark.parametrize("top_k", [8, 2])
@pytest.mark.parametrize("norm", [True, False])
def test_kernel_matches_reference(num_tokens, num_experts, top_k, norm, poisoned_empty):
    logits_TX, bias_X = _inputs(num_tokens, num_experts, seed=num_tokens * num_experts + top_k)
    w_TK, ids_TK = router_topk(logits_TX, bias_X, top_k, norm, 2.5)
    w_ref_TK, ids_ref_TK = router_topk_ref(logits_TX, bias_X, top_k, norm, 2.5)
    assert w_TK.shape == ids_TK.shape == (num_tokens, top_k)
    assert (w_TK.dtype, ids_TK.dtype) == (torch.float32, torch.int64)
    choice_TX = torch.sigmoid(logits_TX) + bias_X
    assert_same_topk(w_TK, ids_TK, w_ref_TK, ids_ref_TK, choice_TX)
    # the reference's own contract: descending choice, the K largest
    picked_TK = choice_TX.gather(1, ids_ref_TK)
    assert (picked_TK[:, :-1] >= picked_TK[:, 1:]).all()
    torch.testing.assert_close(picked_TK, choice_TX.topk(top_k, dim=-1).values, rtol=0, atol=0)
    if norm:
        torch.testing.assert_close(w_ref_TK.sum(-1), torch.full_like(w_ref_TK[:, 0], 2.5), rtol=1e-6, atol=0)


def test_strided_rows_and_no_tokens():
    logits_TX, bias_X = _inputs(6, 48, seed=3)
    view_TX = logits_TX[:, :40]  # rows strided, as a view of a wider buffer
    w_TK, ids_TK = router_topk(view_TX, bias_X[:40], 4, True, 1.0)
    w_ref_TK, ids_ref_TK = router_topk_ref(view_TX.contiguous(), bias_X[:40].contiguous(), 4, True, 1.0)
    assert_same_topk(w_TK, ids_TK, w_ref_TK, ids_ref_TK, torch.sigmoid(view_TX) + bias_X[:40])
    w0, ids0 = router_topk(logits_TX[:0], bias_X, 4, True, 1.0)
    assert w0.shape == ids0.shape == (0, 4)


def _tie_rule(choice_TX: torch.Tensor, top_k: int) -> torch.Tensor:
    """The documented rule, spelled out in Python: descending choice, equal choices lowest id first."""
    rows = [sorted(range(len(row)), key=lambda e: (-row[e], e))[:top_k] for row in choice_TX.tolist()]
    return torch.tensor(rows, dtype=torch.int64)


@pytest.mark.parametrize("top_k", [1, 3, 8])
def test_ties_go_to_the_lowest_id(top_k, poisoned_empty):
    """Logits of a few integer values and a bias of two values: many exactly equal choices, and
    the K-th place cut through a group of them. A row of zero logits ties every expert of one bias."""
    gen = torch.Generator().manual_seed(top_k)
    num_experts = 16
    logits_TX = torch.randint(-2, 3, (9, num_experts), generator=gen).float()
    logits_TX[4] = 0.0
    bias_X = (torch.arange(num_experts) % 3 == 0).float() * 0.5
    choice_TX = torch.sigmoid(logits_TX) + bias_X
    want_TK = _tie_rule(choice_TX, top_k)
    assert want_TK[4].tolist() == [0, 3, 6, 9, 12, 15, 1, 2][:top_k]  # the 0.5-bias experts, then the rest
    w_ref_TK, ids_ref_TK = router_topk_ref(logits_TX, bias_X, top_k, True, 2.5)
    assert torch.equal(ids_ref_TK, want_TK)
    w_TK, ids_TK = router_topk(logits_TX.to(DEVICE), bias_X.to(DEVICE), top_k, True, 2.5)
    assert torch.equal(ids_TK.cpu(), want_TK)
    torch.testing.assert_close(w_TK.cpu(), w_ref_TK, rtol=1e-6, atol=0)


@pytest.mark.parametrize("fn", [router_topk, router_topk_ref], ids=["kernel", "ref"])
def test_bad_inputs_raise_value_error(fn):
    name = fn.__name__
    logits_TX, bias_X = torch.randn(3, 16, device=DEVICE), torch.randn(16, device=DEVICE)
    cases = [
        (lambda: fn(logits_TX[0], bias_X, 2, True, 1.0), rf"{name}: logits_TX"),
        (lambda: fn(logits_TX[None], bias_X, 2, True, 1.0), rf"{name}: logits_TX"),
        (lambda: fn(logits_TX.bfloat16(), bias_X, 2, True, 1.0), rf"{name}: logits_TX is a torch.bfloat16 .*float32"),
        (lambda: fn(logits_TX, bias_X.double(), 2, True, 1.0), rf"{name}: bias_X is a torch.float64 .*float32"),
        (lambda: fn(logits_TX, bias_X[:8], 2, True, 1.0), rf"{name}: bias_X"),
        (lambda: fn(logits_TX, bias_X, 17, True, 1.0), rf"{name}: top_k = 17; expected an int in \[1, X=16\]"),
        (lambda: fn(logits_TX, bias_X, 0, True, 1.0), rf"{name}: top_k = 0"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    if fn is router_topk:
        with pytest.raises(ValueError, match="router_topk: X = 2048 experts; expected at most 1024"):
            fn(torch.empty(1, 2048, device=DEVICE), torch.empty(2048, device=DEVICE), 8, True, 1.0)
        with pytest.raises(ValueError, match="router_topk: logits_TX has strides .* contiguous rows"):
            fn(logits_TX.t().contiguous().t(), bias_X, 2, True, 1.0)


def _router_case(num_experts: int, top_k: int, norm: bool, seed: int):
    cfg = mf.ModelConfig.tiny(num_experts=num_experts, top_k=top_k, n_group=1, topk_group=1, norm_topk_prob=norm,
                              routed_scaling_factor=2.5)
    gen = torch.Generator().manual_seed(seed)
    x_TH = torch.randn(29, cfg.hidden_size, generator=gen)
    router_XH = torch.randn(num_experts, cfg.hidden_size, generator=gen) * 0.2
    bias_X = torch.randn(num_experts, generator=gen) * 0.1
    return cfg, x_TH, router_XH, bias_X


@pytest.mark.parametrize("num_experts,top_k", [(256, 8), (16, 2)])
@pytest.mark.parametrize("norm", [True, False])
def test_route_paths_agree_per_token(num_experts, top_k, norm):
    """route's torch path (unchanged: the CPU's) gives per token the reference's experts and
    weights, and so does its kernel path (here on the CPU tensors, in the interpreter)."""
    cfg, x_TH, router_XH, bias_X = _router_case(num_experts, top_k, norm, seed=num_experts + norm)
    w_TK, ids_TK = route(x_TH, router_XH, bias_X, cfg)
    # the CPU path is torch's, as before the kernel: topk(sorted=False), then gate_weights
    scores_TX = torch.sigmoid(x_TH @ router_XH.T)
    want_ids_TK = (scores_TX + bias_X).topk(top_k, dim=-1, sorted=False).indices
    assert torch.equal(ids_TK, want_ids_TK)
    assert torch.equal(w_TK, gate_weights(scores_TX, want_ids_TK, cfg))
    logits_TX = x_TH @ router_XH.T
    w_ref_TK, ids_ref_TK = router_topk_ref(logits_TX, bias_X, top_k, norm, 2.5)
    choice_TX = scores_TX + bias_X
    # as sets per token (the orders differ), weights within 1e-6
    order_TK = ids_TK.argsort(-1)
    ref_order_TK = ids_ref_TK.argsort(-1)
    assert torch.equal(ids_TK.gather(1, order_TK), ids_ref_TK.gather(1, ref_order_TK))
    torch.testing.assert_close(w_TK.gather(1, order_TK), w_ref_TK.gather(1, ref_order_TK), rtol=1e-6, atol=0)
    w_k_TK, ids_k_TK = _route_logits(logits_TX.to(DEVICE), bias_X.to(DEVICE), cfg, False, fused=True)
    assert_same_topk(w_k_TK.cpu(), ids_k_TK.cpu(), w_ref_TK, ids_ref_TK, choice_TX)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="route takes the kernel on CUDA only")
def test_route_takes_the_kernel_where_it_applies(monkeypatch):
    calls = []
    real = router_mod.router_topk

    def spy(*args, **kw):
        calls.append(args[0].shape)
        return real(*args, **kw)

    monkeypatch.setattr(router_mod, "router_topk", spy)
    cfg, x_TH, router_XH, bias_X = _router_case(256, 8, True, seed=5)
    x_TH, router_XH, bias_X = x_TH.cuda(), router_XH.cuda(), bias_X.cuda()
    w_TK, ids_TK = route(x_TH, router_XH, bias_X, cfg)
    assert calls == [(29, 256)]
    w_ref_TK, ids_ref_TK = router_topk_ref(router_mod.router_logits(x_TH, router_XH), bias_X, 8, True, 2.5)
    choice_TX = torch.sigmoid(router_mod.router_logits(x_TH, router_XH)) + bias_X
    assert_same_topk(w_TK, ids_TK, w_ref_TK, ids_ref_TK, choice_TX)
    route(x_TH, router_XH, bias_X, cfg, deterministic=True)  # the sorted, fixed-order path
    route(x_TH, router_XH.clone().requires_grad_(), bias_X, cfg)  # a gradient is wanted: torch's
    grouped = mf.ModelConfig.tiny(num_experts=256, top_k=8, n_group=4, topk_group=2)
    route(x_TH, router_XH, bias_X, grouped)
    assert calls == [(29, 256)]
    with torch.no_grad():
        route(x_TH, router_XH.clone().requires_grad_(), bias_X, cfg)
    assert len(calls) == 2
