"""DP attention + attention TP + EP on gloo processes, against the 1-rank engine."""

import itertools
import subprocess
import sys

import pytest
import torch

import mimo_fn as mf
from dist_util import run_ranks
from mimo_fn.parallel.mesh import Mesh, init_mesh
from mimo_fn.parallel.sharding import slice_of
from mimo_fn.params import describe, to_flat
from mimo_fn.quant import quantize_mxfp4

CFG = mf.ModelConfig.tiny()  # 4 query heads; 1 KV head on full layers, 2 on SWA layers; 8 experts


def script(dp_rank: int, gen: torch.Generator):
    """Per DP group: a list of steps, each [(seq_id, tokens)] or [] (an idle, zero-token step).
    The groups' batches differ in size and stage; group 1 idles while group 0 works."""
    def toks(n):
        return torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist()
    if dp_rank == 0:
        return [[(0, toks(13))], [(0, toks(10)), (1, toks(7))], [(0, toks(1)), (1, toks(1))],
                [(2, toks(19)), (1, toks(1))], [(0, toks(1)), (1, toks(1)), (2, toks(1))]]
    return [[], [(5, toks(20))], [(6, toks(5)), (5, toks(1))], [], [(5, toks(1)), (6, toks(1))]]


def mesh_check(dp, tp, ep, path, device="cpu", fallbacks=(False, True), dispatches=("all_to_all", "gather")):
    """Chunked prefill and decode on this rank's mesh position equal the 1-rank engine (fp32,
    relative error <= 1e-5), including zero-token steps of an idle DP group, for each EP
    dispatch (the gather one with the groups' row counts unequal). Also run with NCCL on GPUs
    by scripts/check_parallel.py."""
    rank = torch.distributed.get_rank()
    for force_fallback, dispatch in itertools.product(fallbacks, dispatches):
        mesh = init_mesh(dp, tp, ep, force_fallback=force_fallback, ep_dispatch=dispatch)
        cfg, local = mf.load_checkpoint(path, dtype=torch.float32, mesh=mesh, progress=False, device=device)
        _, full = mf.load_checkpoint(path, dtype=torch.float32, progress=False, device=device)
        for name, w in to_flat(local).items():  # each rank holds only its slices
            info = describe(cfg)[name]
            sl = slice_of(name, info.shape, cfg, mesh)
            want = list(info.shape)
            if sl is not None:
                want[sl[0]] = sl[2] - sl[1]
            assert list(w.shape) == want, (name, list(w.shape), want)
        state = mf.init_state(cfg, local, max_tokens=256, page_size=4, mesh=mesh)
        ref = mf.init_state(cfg, full, max_tokens=256, page_size=4)
        steps = script(mesh.dp_rank, torch.Generator().manual_seed(100 + mesh.dp_rank))
        for step in steps:
            batch = mf.Batch.from_tokens([s for s, _ in step], [t for _, t in step])
            layers = (0, cfg.num_layers - 1)  # hidden states, as a DFlash drafter reads them
            state, out = mf.prefill(state, batch, capture_experts=True, capture_hidden=layers)
            if not step:
                assert out.logits_BV.shape[0] == 0
                continue
            ref, want = mf.prefill(ref, batch, capture_experts=True, capture_hidden=layers)
            err = ((out.logits_BV - want.logits_BV).abs().max() / want.logits_BV.abs().max()).item()
            where = f"rank {rank} fallback={force_fallback} {dispatch}"
            assert err <= 1e-5, f"{where}: relative error {err:.2e}"
            assert torch.equal(out.routed_experts_TLK, want.routed_experts_TLK), where
            err = ((out.hidden_TLH - want.hidden_TLH).abs().max() / want.hidden_TLH.abs().max()).item()
            assert err <= 1e-5, f"{where}: hidden states, relative error {err:.2e}"
        state = mf.release(state, list(state.seqs))
        assert len(state.cache.full.free) == state.cache.full.num_pages


def graph_script(dp_rank: int, gen: torch.Generator):
    """Per DP group, steps as in `script`, mostly decode steps: the groups' batches differ in
    size (so the ranks must agree on a bucket), one step has group 1 idle and one has it in a
    prompt chunk (every rank then runs eagerly), and the batches shrink (5 to 2, 2 to 1)."""
    def toks(n):
        return torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist()
    if dp_rank == 0:
        prompts = [[(s, toks(6 + s)) for s in range(5)]]
        return prompts + [[(s, toks(1)) for s in range(n)] for n in (5, 5, 5, 3, 3, 2, 2)]
    return [[(10, toks(9))], [(10, toks(1))], [], [(11, toks(4))], [(10, toks(1)), (11, toks(1))],
            [(10, toks(1)), (11, toks(1))], [(11, toks(1))], [(11, toks(1))]]


def graph_check(dp, tp, ep, path):
    """CUDA only (scripts/check_parallel.py): with the "gather" EP dispatch, decode steps replayed
    from CUDA graphs on every rank give the 1-rank eager engine's logits (fp32, relative error
    <= 1e-5) and routed experts, and the graphs did replay."""
    rank = torch.distributed.get_rank()
    mesh = init_mesh(dp, tp, ep, ep_dispatch="gather")
    cfg, local = mf.load_checkpoint(path, dtype=torch.float32, mesh=mesh, progress=False, device="cuda")
    _, full = mf.load_checkpoint(path, dtype=torch.float32, progress=False, device="cuda")
    state = mf.init_state(cfg, local, max_tokens=256, page_size=4, mesh=mesh)
    ref = mf.init_state(cfg, full, max_tokens=256, page_size=4)
    graphs = mf.DecodeGraphs()
    for i, step in enumerate(graph_script(mesh.dp_rank, torch.Generator().manual_seed(200 + mesh.dp_rank))):
        batch = mf.Batch.from_tokens([s for s, _ in step], [t for _, t in step])
        gone = [s for s in state.seqs if s not in batch.seq_ids and i > 0 and step]
        if gone and all(len(t) == 1 for _, t in step):  # a shrinking batch: those sequences are done
            state, ref = mf.release(state, gone), mf.release(ref, gone)
        state, out = mf.prefill(state, batch, capture_experts=True, graphs=graphs)
        if not step:
            continue
        ref, want = mf.prefill(ref, batch, capture_experts=True)
        err = ((out.logits_BV - want.logits_BV).abs().max() / want.logits_BV.abs().max()).item()
        assert err <= 1e-5, f"rank {rank} step {i}: relative error {err:.2e}"
        assert torch.equal(out.routed_experts_TLK, want.routed_experts_TLK), f"rank {rank} step {i}"
    assert graphs.failed is None, graphs.failed
    assert graphs.stats["replays"] >= 3, graphs.stats
    return graphs.stats


def _worker(rank, world, dp, tp, ep, path):
    assert dp * tp == world
    mesh_check(dp, tp, ep, path)


def write_checkpoint(d, mxfp4_experts=False):
    params = mf.init_params(CFG, seed=5)
    # random sinks and router bias so that slicing mistakes show
    params = mf.params.from_flat(CFG, {k: (v + 0.3 * torch.randn_like(v) if k.endswith(("sinks", "router_bias")) else v)
                                       for k, v in to_flat(params).items()})
    if mxfp4_experts:  # the RL release's experts, next to dense weights
        params = mf.params.from_flat(CFG, {k: quantize_mxfp4(v) if k.endswith(("mlp.w13", "mlp.w2")) else v
                                           for k, v in to_flat(params).items()})
    mf.save_checkpoint(params, CFG, d)
    return str(d)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("dp, tp, ep, experts", [(1, 2, 2, "dense"), (2, 1, 2, "dense"), (2, 1, 2, "mxfp4"),
                                                  (2, 2, 4, "dense"), (2, 4, 8, "dense")])
def test_mesh_matches_one_rank(dp, tp, ep, experts, ckpt, tmp_path):
    path = write_checkpoint(tmp_path / "mxfp4", mxfp4_experts=True) if experts == "mxfp4" else ckpt
    run_ranks(dp * tp, _worker, dp, tp, ep, path, tmp_dir=str(tmp_path))


def test_resident_bytes_follow_tp_and_ep():
    """At the released dims on DP2 / TP4 / EP8: a rank holds 1/4 of the attention weights and
    1/8 of the expert weights (computed from the rule table that loading and sharding use)."""
    cfg = mf.ModelConfig.flash()
    for rank in range(8):
        mesh = Mesh(dp=2, tp=4, ep=8, rank=rank)
        attn = [0, 0]
        experts = [0, 0]
        for name, info in describe(cfg).items():
            n = 1
            for d in info.shape:
                n *= d
            sl = slice_of(name, info.shape, cfg, mesh)
            local = n if sl is None else n // info.shape[sl[0]] * (sl[2] - sl[1])
            acc = attn if ".attn." in name else experts if name.endswith(("w13", "w2")) and ".mlp." in name else None
            if acc is not None:
                acc[0], acc[1] = acc[0] + local, acc[1] + n
        assert attn[0] * 4 == attn[1] and experts[0] * 8 == experts[1]


def test_init_mesh_is_public():
    """DESIGN.md's `mf.parallel.init_mesh` and its short name `mf.init_mesh`, in a fresh interpreter
    (nothing else imported first)."""
    code = ("import mimo_fn as mf; assert mf.init_mesh is mf.parallel.init_mesh; "
            "assert mf.init_mesh(1, 1, 1) == mf.parallel.Mesh.single()")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_mesh_validation():
    with pytest.raises(ValueError, match=r"num_heads=4 must divide by tp"):
        Mesh(1, 8, 1, 0).validate(CFG)
    with pytest.raises(ValueError, match=r"num_experts=8 must divide by ep"):
        Mesh(1, 1, 3, 0).validate(CFG)
    with pytest.raises(ValueError, match=r"needs an initialised torch.distributed"):
        init_mesh(2, 1, 2)
    with pytest.raises(ValueError, match=r"tp=0"):
        init_mesh(1, 0, 1)
    with pytest.raises(ValueError, match=r"ep_dispatch='alltoall', expected one of \('all_to_all', 'gather'\)"):
        init_mesh(1, 1, 1, ep_dispatch="alltoall")
    with pytest.raises(ValueError, match=r"ep_capacity=0, expected a positive int or None"):
        init_mesh(1, 1, 1, ep_capacity=0)


def _fp8_gather_worker(rank, world, path):
    """FP8 weights under TP 2: the packed FP8 gather (one collective) gives exactly the logits
    of the two-collective FP8 gather, and stays close to the bf16 gather."""
    logits = {}
    for mode in ("packed_fp8", "fp8_two", "bf16"):
        mesh = init_mesh(1, 2, 2, attn_gather=mode)
        cfg, local = mf.load_checkpoint(path, dtype=torch.float32, mesh=mesh, progress=False, quant="fp8")
        state = mf.init_state(cfg, local, max_tokens=128, page_size=4, mesh=mesh)
        batch = mf.Batch.from_tokens([0, 1], [list(range(3, 40)), list(range(50, 61))])
        state, out = mf.prefill(state, batch)
        state, out2 = mf.decode(state, mf.Batch.from_tokens([0, 1], [[7], [9]]))
        logits[mode] = torch.cat([out.logits_BV, out2.logits_BV])
    assert torch.equal(logits["packed_fp8"], logits["fp8_two"])
    cos = torch.nn.functional.cosine_similarity(logits["packed_fp8"], logits["bf16"], dim=-1)
    assert cos.min() >= 0.99, cos


def test_packed_fp8_gather_in_dp_attention(ckpt, tmp_path):
    run_ranks(2, _fp8_gather_worker, ckpt, tmp_dir=str(tmp_path))


CAPACITY_ERRORS = {
    "all_to_all": r"EP dispatch: rank \d would receive \d+ token copies, over the capacity of 12",
    "gather": r"EP dispatch \(gather\): every rank would receive 40 token rows \(2 ranks x 20\), over the "
              r"capacity of 12",
}


def _capacity_worker(rank, world, path, dispatch):
    """Over the EP capacity every rank raises the same clear error (the all-to-all dispatch counts
    the copies its routing sends each rank, the gather one the ep x rows every rank gathers); the
    state survives it."""
    from mimo_fn.parallel.ep import EPCapacityError

    mesh = init_mesh(1, 2, 2, ep_capacity=12, ep_dispatch=dispatch)
    cfg, local = mf.load_checkpoint(path, dtype=torch.float32, mesh=mesh, progress=False)
    _, full = mf.load_checkpoint(path, dtype=torch.float32, progress=False)
    state = mf.init_state(cfg, local, max_tokens=128, page_size=4, mesh=mesh)
    ref = mf.init_state(cfg, full, max_tokens=128, page_size=4)
    small = mf.Batch.from_tokens([0], [[5, 6, 7]])  # 2 local rows: at most 4 copies (top-2) / 4 gathered rows
    state, _ = mf.prefill(state, small)
    ref, _ = mf.prefill(ref, small)
    with pytest.raises(EPCapacityError, match=CAPACITY_ERRORS[dispatch]):
        mf.prefill(state, mf.Batch.from_tokens([1], [list(range(40))]))
    state, out = mf.prefill(state, mf.Batch.from_tokens([0], [[9]]))  # the failed step left state whole
    ref, want = mf.prefill(ref, mf.Batch.from_tokens([0], [[9]]))
    assert ((out.logits_BV - want.logits_BV).abs().max() / want.logits_BV.abs().max()).item() <= 1e-5


@pytest.mark.parametrize("dispatch", ["all_to_all", "gather"])
def test_ep_capacity_error_is_collective_and_recoverable(ckpt, tmp_path, dispatch):
    run_ranks(2, _capacity_worker, ckpt, dispatch, tmp_dir=str(tmp_path))


def _plain_reduce_scatter(x, group):
    """The reference: every rank's x gathered (point to point in effect), summed in rank order,
    padded to a multiple of the group size, this rank's rows."""
    n, r = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    parts = [torch.empty_like(x) for _ in range(n)]
    torch.distributed.all_gather(parts, x, group=group)
    total = sum(parts[1:], parts[0])
    rows = -(-x.shape[0] // n)
    total = torch.cat([total, total.new_zeros(rows * n - x.shape[0], *x.shape[1:])])
    return total[r * rows:(r + 1) * rows]


def _collective_paths_worker(rank, world):
    """reduce_scatter on the world (4 ranks) and on pairs: each path, chosen from what the group
    can do or forced, gives the plain sums: the backend's own reduce_scatter (gloo has it in this
    torch), forced all-reduce, rows that do not divide by the group, CUDA graph capture, and a
    backend without reduce_scatter_tensor (found on the first call, remembered after it); an error
    that is not a missing op still surfaces."""
    from mimo_fn.parallel import collectives as c

    pairs = [torch.distributed.new_group([0, 1]), torch.distributed.new_group([2, 3])]
    gen = torch.Generator().manual_seed(1000 + rank)
    for group in (torch.distributed.group.WORLD, pairs[rank // 2]):
        n = torch.distributed.get_world_size(group)
        even, odd = torch.randn(4 * n, 3, generator=gen), torch.randn(4 * n + 3, 3, generator=gen)

        def check(x, path, force=False):
            assert c.reduce_scatter_path(x, group, force) == path, (path, x.shape)
            got = c.reduce_scatter(x, group, force)
            want = _plain_reduce_scatter(x, group)
            assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-6, atol=1e-6), (path, x.shape)

        check(even, "reduce_scatter")
        check(even, "all_reduce", force=True)
        check(odd, "all_reduce")
        real_capturing, real_rs = c._capturing, c._reduce_scatter_single
        try:
            c._capturing = lambda: True
            check(even, "all_reduce")
            c._capturing = real_capturing
            calls = []

            def missing(*args, **kwargs):
                calls.append(1)
                raise RuntimeError("ProcessGroupGloo does not support reduce_scatter")

            c._reduce_scatter_single = missing
            assert c.reduce_scatter_path(even, group) == "reduce_scatter"  # not known yet
            assert torch.allclose(c.reduce_scatter(even, group), _plain_reduce_scatter(even, group), atol=1e-6)
            check(even, "all_reduce")  # remembered: no second attempt
            assert len(calls) == 1
            c._NO_REDUCE_SCATTER.clear()

            def broken(*args, **kwargs):
                raise RuntimeError("Connection closed by peer")

            c._reduce_scatter_single = broken
            with pytest.raises(RuntimeError, match="Connection closed by peer"):
                c.reduce_scatter(even, group)
            assert not c._NO_REDUCE_SCATTER
        finally:
            c._capturing, c._reduce_scatter_single = real_capturing, real_rs
            c._NO_REDUCE_SCATTER.clear()


def test_reduce_scatter_paths(tmp_path):
    run_ranks(4, _collective_paths_worker, tmp_dir=str(tmp_path))


def test_balanced_fake_routing_is_uniform():
    from mimo_fn.layers.moe import balanced_routing

    weights, ids = balanced_routing(64, CFG, Mesh.single(), torch.device("cpu"))
    counts = torch.bincount(ids.flatten(), minlength=CFG.num_experts)
    assert (counts == 64 * CFG.top_k // CFG.num_experts).all()
    assert torch.allclose(weights.sum(-1), torch.ones(64)) and all(len(set(r)) == CFG.top_k for r in ids.tolist())
