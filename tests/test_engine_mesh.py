"""The Engine on a DP / TP / EP mesh (gloo processes) against the 1-rank engine."""

import contextlib
from dataclasses import replace

import pytest
import torch

import mimo_fn as mf
from dist_util import run_ranks
from mimo_fn.parallel.ep_gather import rows_agree
from mimo_fn.parallel.mesh import Mesh, init_mesh
from mimo_fn.params import to_flat
from test_parallel import CFG, write_checkpoint


class RepeatLast:
    """Drafts that repeat the last token: a proposal at every step, some kept, most rejected."""

    def propose(self, rid, tokens, k):
        return [tokens[-1]] * k


def engine_prompts(dp_rank: int, idle_group: bool, gen: torch.Generator, long_tail: bool = False):
    """(prompts, max_new_tokens) of one DP group for one generate call. Group 0's prompts are
    longer than the chunk and finish at different passes; group 1 has one prompt, so it idles
    while group 0 works, or (idle_group) none at all. long_tail: group 0's second prompt and
    group 1's run long enough that both groups decode at once, each with a uniform batch (the
    steps can share a graph)."""
    def toks(n):
        return torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist()
    if dp_rank == 0:
        return [toks(5), toks(19), toks(9)], [4, 16 if long_tail else 7, 3]
    return ([], []) if idle_group else ([toks(12)], [24 if long_tail else 9])


def engine_check(dp, tp, ep, path, device="cpu", cuda_graphs=False):
    """`generate` on every rank of the mesh gives each prompt the 1-rank engine's tokens,
    log-probs (fp32, within 1e-4) and routed experts: greedy, sampled, speculative with drafts
    from the host (RepeatLast) and from a DFlash draft model (random weights; again under a
    confidence cut, the 1-rank engine's verify rows past it routed to no expert, the mesh's TP
    ranks routing them all), prompts chunked, DP groups of
    different sizes, one group without prompts. Also run with NCCL (and CUDA graphs) on GPUs
    by scripts/check_parallel.py, which checks that graphs replayed wherever both DP groups
    decode at once (every round but "host drafts", whose group 1 is idle)."""
    from mimo_fn.speculative.dflash import DFlashConfig, DFlashProposer, init_dflash

    mesh = init_mesh(dp, tp, ep)
    cfg, local = mf.load_checkpoint(path, dtype=torch.float32, mesh=mesh, progress=False, device=device)
    _, full = mf.load_checkpoint(path, dtype=torch.float32, progress=False, device=device)
    dcfg = DFlashConfig(target_layers=(1, 3), mask_token_id=cfg.vocab_size - 1, block_size=4, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48)
    drafter = init_dflash(cfg, dcfg, seed=1, device=device)  # the same draft weights on every rank
    sure = replace(drafter, norm=drafter.norm * 30)  # sharper logits: beliefs a cut of 0.2 splits (test_draft_cut)
    modes = (("greedy", 0, None, None), ("sampled", 0, mf.SamplingParams(temperature=1.0, seed=3), None),
             ("host drafts", 2, None, None), ("dflash", 3, None, dcfg), ("dflash cut", 3, None, dcfg))
    stats = {}
    for round_, (name, drafts, sampling, draft_cfg) in enumerate(modes):
        gen = torch.Generator().manual_seed(300 + round_)
        prompts, new = engine_prompts(mesh.dp_rank, name == "host drafts", gen, long_tail=name.startswith("dflash"))
        config = mf.EngineConfig(max_tokens=256, page_size=4, chunk_size=8, cuda_graphs=cuda_graphs,
                                 num_draft_tokens=drafts)
        cut = 0.2 if name == "dflash cut" else 0.0
        proposers = [DFlashProposer(sure if cut else drafter, draft_cfg, p, cfg, cuda_graphs=cuda_graphs,
                                    min_confidence=cut) if draft_cfg
                     else RepeatLast() if drafts else None for p in (local, full)]
        engine = mf.Engine(cfg, local, replace(config, proposer=proposers[0]), mesh=mesh)
        with _counting(mesh) as count:
            got = engine.generate(prompts, new, sampling, return_logprobs=True, return_routed_experts=True)
        if not cuda_graphs:  # host round trips: the call's arguments, then one a pass (+ gather rows a forward)
            passes = count["passes"]
            forwards = passes - (mesh.dp > 1)  # the last pass finds every group idle and runs nothing
            want_calls = 1 + passes * (mesh.dp > 1) + forwards * (not rows_agree(mesh))
            assert count["agree"] == want_calls, f"rank {mesh.rank} {name}: {count} host agreements, want {want_calls}"
        want = mf.Engine(cfg, full, replace(config, proposer=proposers[1])).generate(
            prompts, new, sampling, return_logprobs=True, return_routed_experts=True) if prompts else []
        where = f"rank {mesh.rank} {name}"
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.tokens == w.tokens and len(g.tokens) == new[i], f"{where} prompt {i}: {g.tokens} != {w.tokens}"
            err = max(abs(a - b) for a, b in zip(g.logprobs + g.prompt_logprobs, w.logprobs + w.prompt_logprobs))
            assert err <= 1e-4, f"{where} prompt {i}: log-prob error {err:.2e}"
            assert torch.equal(g.routed_experts, w.routed_experts), f"{where} prompt {i}"
        assert not engine.state.seqs and len(engine.state.cache.full.free) == engine.state.cache.full.num_pages
        assert not (drafts and prompts) or engine.spec_stats()["drafted"] > 0, f"{where}: no drafts"
        stats[name] = dict(engine.graphs.stats) if engine.graphs is not None else None
    return stats  # graph captures and replays per mode


@contextlib.contextmanager
def _counting(mesh):
    """Count host agreements (Mesh.agree_ints) and scheduler passes while the block runs."""
    count = {"agree": 0, "passes": 0}
    agree, schedule = Mesh.agree_ints, mf.sched.schedule_pass

    def counted_agree(self, *args, **kwargs):
        count["agree"] += 1
        return agree(self, *args, **kwargs)

    def counted_schedule(*args, **kwargs):
        count["passes"] += 1
        return schedule(*args, **kwargs)

    Mesh.agree_ints, mf.sched.schedule_pass = counted_agree, counted_schedule
    try:
        yield count
    finally:
        Mesh.agree_ints, mf.sched.schedule_pass = agree, schedule


def _worker(rank, world, dp, tp, ep, path):
    engine_check(dp, tp, ep, path)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("dp, tp, ep", [(1, 2, 2), (2, 1, 2), (2, 2, 4)])
def test_engine_on_mesh_matches_one_rank(dp, tp, ep, ckpt, tmp_path):
    run_ranks(dp * tp, _worker, dp, tp, ep, ckpt, tmp_dir=str(tmp_path))


def _args_worker(rank, world, dp, tp, ep, path):
    """Arguments that one rank rejects, or that differ where ranks must agree, raise a ValueError
    on every rank (none of them waits in a collective), and the engines stay usable."""
    mesh = init_mesh(dp, tp, ep)
    cfg, local = mf.load_checkpoint(path, dtype=torch.float32, mesh=mesh, progress=False)
    _, full = mf.load_checkpoint(path, dtype=torch.float32, progress=False)
    config = mf.EngineConfig(max_tokens=128, page_size=4, chunk_size=8, cuda_graphs=False)
    engine = mf.Engine(cfg, local, config, mesh=mesh)
    prompt = [[3, 4, 5, 6, 7]]
    bad = [[3, cfg.vocab_size]] if rank == 1 else prompt
    match = r"prompt 0 holds token id" if rank == 1 else r"rank\(s\) \[1\] rejected their arguments"
    with pytest.raises(ValueError, match=match):
        engine.generate(bad, 3)
    if dp == 1:  # the two TP ranks of the one DP group pass different prompts
        with pytest.raises(ValueError, match=r"TP ranks of DP group\(s\) \[0\] passed different prompts"):
            engine.generate([[3, 4, 5 + rank]], 3)
    else:  # DP groups may pass different prompts, not different capture flags
        with pytest.raises(ValueError, match=r"return_logprobs and return_routed_experts must be the same"):
            engine.generate(prompt, 3, return_logprobs=rank == 0)
    got = engine.generate(prompt, 3, return_logprobs=True)
    want = mf.Engine(cfg, full, config).generate(prompt, 3, return_logprobs=True)
    assert got[0].tokens == want[0].tokens and len(got[0].tokens) == 3


@pytest.mark.parametrize("dp, tp, ep", [(1, 2, 2), (2, 1, 2)])
def test_engine_on_mesh_rejects_arguments_on_every_rank(dp, tp, ep, ckpt, tmp_path):
    run_ranks(dp * tp, _args_worker, dp, tp, ep, ckpt, tmp_dir=str(tmp_path))


def weights_check(dp, tp, ep, path, new_path, device="cpu", cuda_graphs=False):
    """RL weight sync and memory release on a mesh: each rank writes its slices of the full new
    weights in place, and after a release / resume with backup the engine still generates what
    the 1-rank engine generates over the new weights (with CUDA graphs: captured before the
    release, dropped by it and captured again). Also run with NCCL on GPUs by
    scripts/check_parallel.py."""
    from safetensors.torch import load_file

    mesh = init_mesh(dp, tp, ep)
    cfg, local = mf.load_checkpoint(path, dtype=torch.float32, mesh=mesh, progress=False, device=device)
    # on the CPU some loaded tensors map the file, and release_memory cannot resize those
    local = mf.params.from_flat(cfg, {k: v.clone() for k, v in to_flat(local).items()})
    _, want = mf.load_checkpoint(new_path, dtype=torch.float32, progress=False, device=device)
    config = mf.EngineConfig(max_tokens=128, page_size=4, chunk_size=8, cuda_graphs=cuda_graphs)
    engine = mf.Engine(cfg, local, config, mesh=mesh)
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6, 5]]
    engine.generate(prompt, 3)
    assert engine.update_weights(load_file(f"{new_path}/model.safetensors").items()) > 0
    assert engine.release_memory(backup=True) > 0
    engine.resume_memory()
    got = engine.generate(prompt, 5, return_logprobs=True)[0]
    ref = mf.Engine(cfg, want, config).generate(prompt, 5, return_logprobs=True)[0]
    assert got.tokens == ref.tokens, (mesh.rank, got.tokens, ref.tokens)
    assert max(abs(a - b) for a, b in zip(got.logprobs, ref.logprobs)) <= 1e-4
    return dict(engine.graphs.stats) if engine.graphs is not None else None


def _weights_worker(rank, world, dp, tp, ep, path, new_path):
    weights_check(dp, tp, ep, path, new_path)


def test_engine_on_mesh_takes_new_weights(ckpt, tmp_path):
    new_path = tmp_path / "new"
    params = mf.init_params(CFG, seed=9)
    mf.save_checkpoint(params, CFG, new_path)
    run_ranks(4, _weights_worker, 2, 2, 4, ckpt, str(new_path), tmp_dir=str(tmp_path))


def _random_worker(rank, world, dp, tp, ep, path, seeds):
    """Per seed: random prompts per DP group (none to five, 1-30 tokens, 1-12 new each, some
    repeated, in some groups all after the same 12 tokens) and a random engine config shared by
    all ranks (pool sizes, a sliding-window pool for two sequences or not, page and chunk sizes,
    batch cap, overlap, greedy, sampled or each prompt its own, host drafts or none); every
    prompt gets the 1-rank Engine's tokens and log-probs."""
    import random

    from mimo_fn.cache import swa_pool_pages

    mesh = init_mesh(dp, tp, ep)
    cfg, local = mf.load_checkpoint(path, dtype=torch.float32, mesh=mesh, progress=False)
    _, full = mf.load_checkpoint(path, dtype=torch.float32, progress=False)
    for seed in seeds:
        rng, shared = random.Random(seed * 100 + mesh.dp_rank), random.Random(seed)
        common = [rng.randrange(cfg.vocab_size) for _ in range(rng.choice([0, 0, 12]))]  # seed 3 rank 0: a group
        prompts = [common + [rng.randrange(cfg.vocab_size) for _ in range(rng.randint(1, 30))]
                   for _ in range(rng.choice([0, 1, 2, 3, 5]))]
        prompts += prompts[:rng.choice([0, 2])]  # repeats: prefilled once (EngineConfig.share_prompts)
        new = [rng.randint(1, 12) for _ in prompts]
        drafts, page, chunk = shared.choice([0, 0, 2]), shared.choice([2, 4, 8]), shared.choice([8, 9, 16])
        swa_tokens = shared.choice([None, page * swa_pool_pages(cfg, page, 2, chunk, drafts, drafts + 1)])  # 2 in flight
        config = mf.EngineConfig(max_tokens=shared.choice([96, 256]), page_size=page, chunk_size=chunk,
                                 max_swa_tokens=swa_tokens, max_batch=shared.choice([2, 4, 256]), cuda_graphs=False,
                                 overlap=shared.choice([True, False]), num_draft_tokens=drafts,
                                 proposer=RepeatLast() if drafts else None)
        sampling = shared.choice([None, mf.SamplingParams(temperature=0.8, seed=seed), "each"])
        if sampling == "each":  # one per prompt, greedy or two distributions
            sampling = [rng.choice([None, mf.SamplingParams(temperature=0.8, seed=seed),
                                    mf.SamplingParams(temperature=1.2, top_k=5, seed=seed + 1)]) for _ in prompts]
        got = mf.Engine(cfg, local, config, mesh=mesh).generate(prompts, new, sampling, return_logprobs=True)
        want = mf.Engine(cfg, full, config).generate(prompts, new, sampling, return_logprobs=True) if prompts else []
        for i, (g, w) in enumerate(zip(got, want)):
            where = f"seed {seed} rank {rank} prompt {i} ({config}, {sampling})"
            assert g.tokens == w.tokens and len(g.tokens) == new[i], f"{where}: {g.tokens} != {w.tokens}"
            err = max(abs(a - b) for a, b in zip(g.logprobs + g.prompt_logprobs, w.logprobs + w.prompt_logprobs))
            assert err <= 1e-4, f"{where}: log-prob error {err:.2e}"


def test_engine_on_mesh_random_configs(ckpt, tmp_path):
    run_ranks(2, _random_worker, 2, 1, 2, ckpt, list(range(6)), tmp_dir=str(tmp_path))


def _prefix_cache_worker(rank, world, dp, tp, ep, path):
    """Two turns of a conversation per DP group (group 1's shorter) with the prefix cache on every
    rank: the second turn forks the first on each rank, and outputs equal the 1-rank engine's
    without the cache."""
    mesh = init_mesh(dp, tp, ep)
    cfg, local = mf.load_checkpoint(path, dtype=torch.float32, mesh=mesh, progress=False)
    _, full = mf.load_checkpoint(path, dtype=torch.float32, progress=False)
    config = mf.EngineConfig(max_tokens=256, page_size=4, chunk_size=8, cuda_graphs=False)
    engine = mf.Engine(cfg, local, replace(config, prefix_cache=True), mesh=mesh)
    ref = mf.Engine(cfg, full, config)
    gen = torch.Generator().manual_seed(40 + mesh.dp_rank)
    talks = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in ((21, 13), (10,))[mesh.dp_rank]]
    for turn in range(2):
        got = engine.generate(talks, 6, return_logprobs=True, return_routed_experts=True)
        want = ref.generate(talks, 6, return_logprobs=True, return_routed_experts=True)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            where = f"rank {mesh.rank} turn {turn} prompt {i}"
            assert g.tokens == w.tokens, f"{where}: {g.tokens} != {w.tokens}"
            err = max(abs(a - b) for a, b in zip(g.logprobs + g.prompt_logprobs, w.logprobs + w.prompt_logprobs))
            assert err <= 1e-4 and torch.equal(g.routed_experts, w.routed_experts), f"{where}: log-prob error {err:.2e}"
        assert engine.prefix_stats["hits"] == (len(talks) if turn else 0), rank
        talks = [t + g.tokens + [1, 2, 3] for t, g in zip(talks, got)]


def test_engine_on_mesh_keeps_a_prefix_cache(ckpt, tmp_path):
    run_ranks(2, _prefix_cache_worker, 2, 1, 2, ckpt, tmp_dir=str(tmp_path))
