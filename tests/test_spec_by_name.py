"""Proposers by name (EngineConfig(proposer="mtp" | "dflash", draft_path=...)) and the server's
--speculative-algorithm / --speculative-draft-model-path / --ep-dispatch-algorithm, built as the
server builds its engine (serve.launch.build_engine, in process: the flags' wiring, not HTTP)."""

import json

import pytest
import torch

import mimo_fn as mf
from mimo_fn.layers.moe import balanced_routing
from mimo_fn.serve.args import ServerArgs, parse_args
from mimo_fn.serve.launch import build_engine, mesh_for
from mimo_fn.speculative import mtp_checkpoint
from mimo_fn.speculative.dflash import DFlashProposer, init_dflash
from mimo_fn.speculative.dflash_checkpoint import save_dflash
from mimo_fn.speculative.mtp import MTPProposer, init_mtp
from mimo_fn.speculative.train_dflash import draft_config

CFG = mf.ModelConfig.tiny()
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [11, 12]]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A checkpoint dir with MTP layers, a DFlash draft dir, and a config-only dir (--load-format dummy)."""
    root = tmp_path_factory.mktemp("spec_by_name")
    params = mf.init_params(CFG, seed=0)  # what --load-format dummy draws (--random-seed 0)
    mf.save_checkpoint(params, CFG, root / "model")
    mtp_checkpoint.save_mtp(init_mtp(CFG, 2, seed=5), CFG, root / "model")
    dcfg = draft_config(CFG, 4)
    save_dflash(init_dflash(CFG, dcfg, seed=6), dcfg, CFG, root / "draft")
    (root / "dummy").mkdir()
    (root / "dummy" / "config.json").write_text(json.dumps(CFG.to_hf()))
    return root, params


def _engine(*flags):
    args = parse_args(["--device", "cpu", "--max-total-tokens", "512", "--page-size", "4", *flags])
    return build_engine(args, CPU, mesh_for(args))[0]


def test_named_proposers_equal_plain_greedy(ckpt):
    """proposer="mtp" reads the checkpoint's MTP layers and drafts as a hand-built MTPProposer;
    "dflash" reads a draft dir; both keep greedy's tokens and log-probs."""
    root, params = ckpt
    base = dict(max_tokens=512, page_size=4, chunk_size=8)
    plain = mf.Engine(CFG, params, mf.EngineConfig(**base)).generate(PROMPTS, 12, return_logprobs=True)
    by_hand = mf.Engine(CFG, params, mf.EngineConfig(**base, num_draft_tokens=2, proposer=MTPProposer(
        init_mtp(CFG, 2, seed=5), params, CFG)))
    by_hand.generate(PROMPTS, 12)
    for name, path in (("mtp", root / "model"), ("dflash", root / "draft")):
        engine = mf.Engine(CFG, params, mf.EngineConfig(**base, num_draft_tokens=2, proposer=name,
                                                        draft_path=str(path)))
        assert isinstance(engine.proposer, MTPProposer if name == "mtp" else DFlashProposer)
        got = engine.generate(PROMPTS, 12, return_logprobs=True)
        for g, w in zip(got, plain):
            assert g.tokens == w.tokens
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)
        if name == "mtp":  # the same layers as by hand: the same drafts, so the same acceptance
            assert engine.spec_stats() == by_hand.spec_stats()


@pytest.mark.parametrize("config, match", [
    (dict(proposer="eagle"), "expected one of"),
    (dict(proposer="mtp", num_draft_tokens=2), "draft_path"),
    (dict(proposer="dflash", num_draft_tokens=2), "DFlash draft"),
    (dict(proposer=type("Drafts", (), {"propose": lambda self, rid, tokens, k: []})()),
     "proposer = Drafts with num_draft_tokens = 0"),
    (dict(proposer="ngram", num_draft_tokens=2, draft_min_confidence=0.3), "needs a draft model's probabilities"),
    (dict(proposer="dflash", draft_path="x", num_draft_tokens=2, draft_min_confidence=1.0), "in \\[0, 1\\)"),
    (dict(draft_min_confidence=0.3), "applies to proposer='dflash' or 'mtp', not NoneType"),
])
def test_named_proposer_errors(config, match):
    with pytest.raises(ValueError, match=match):
        mf.EngineConfig(max_tokens=64, **config)


def test_server_speculative_flags(ckpt):
    """NEXTN reads --model-path's MTP layers (one draft token a layer by default), or random ones
    under --load-format dummy; DFLASH reads the draft (block - 1 drafts); the tokens stay greedy's."""
    root, _ = ckpt
    model, dummy = str(root / "model"), str(root / "dummy")
    want = [o.tokens for o in _engine("--model-path", model).generate(PROMPTS, 10)]
    for flags, k, kind in [
        (("--model-path", model, "--speculative-algorithm", "NEXTN"), 2, MTPProposer),
        (("--model-path", model, "--speculative-algorithm", "NEXTN", "--speculative-min-confidence", "0.25"), 2,
         MTPProposer),
        (("--model-path", dummy, "--load-format", "dummy", "--speculative-algorithm", "MTP",
          "--speculative-num-draft-tokens", "3"), 3, MTPProposer),
        (("--model-path", model, "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path",
          str(root / "draft")), 3, DFlashProposer),
        (("--model-path", model, "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path",
          str(root / "draft"), "--speculative-min-confidence", "0.25"), 3, DFlashProposer),
    ]:
        engine = _engine(*flags)
        assert isinstance(engine.proposer, kind) and engine.config.num_draft_tokens == k, flags
        assert getattr(engine.proposer, "min_confidence", 0.0) == (0.25 if "0.25" in flags else 0.0)
        assert [o.tokens for o in engine.generate(PROMPTS, 10)] == want, flags
    for bad, match in [(dict(speculative_algorithm="DFLASH"), "--speculative-draft-model-path"),
                       (dict(speculative_draft_model_path=model), "DFLASH or NEXTN"),
                       (dict(speculative_algorithm="EAGLE3"), "expected one of NGRAM, DFLASH"),
                       (dict(speculative_algorithm="NGRAM"), "--speculative-num-draft-tokens N > 0"),
                       (dict(ep_dispatch_algorithm="dynamic"), "expected one of static, fake"),
                       (dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=2,
                             speculative_min_confidence=0.2), "is read by --speculative-algorithm DFLASH or NEXTN"),
                       (dict(speculative_min_confidence=1.5), "expected a probability in")]:
        with pytest.raises(ValueError, match=match):
            ServerArgs(**bad)


def test_fake_balanced_routing_flag(ckpt):
    """--ep-dispatch-algorithm fake routes every token round-robin over the experts (as
    layers.moe.balanced_routing deals them), whatever the router says."""
    root, _ = ckpt
    engine = _engine("--model-path", str(root / "dummy"), "--load-format", "dummy", "--ep-dispatch-algorithm", "fake")
    assert engine.mesh.fake_balanced_routing
    prompt = list(range(3, 3 + 13))
    out = engine.generate([prompt], 2, return_routed_experts=True)[0]
    experts = out.routed_experts  # [tokens, MoE layers, K]
    _, ids_TK = balanced_routing(len(prompt), CFG, engine.mesh, CPU)
    for layer in range(experts.shape[1]):
        assert torch.equal(experts[:len(prompt), layer].to(torch.int64), ids_TK)
    static = _engine("--model-path", str(root / "dummy"), "--load-format", "dummy")
    assert not static.mesh.fake_balanced_routing
    assert not torch.equal(static.generate([prompt], 2, return_routed_experts=True)[0].routed_experts, experts)


def test_dummy_quiet_layers_serves_the_bench_target(ckpt):
    """--dummy-quiet-layers C serves params.random_params(quiet=C), the target `bench spec --trained
    --quiet-layers C` trains its draft on (FP8 too); it refuses a real checkpoint and C <= 0."""
    from mimo_fn.params import random_params

    root, _ = ckpt
    dummy = ["--model-path", str(root / "dummy"), "--load-format", "dummy"]
    for quant in ([], ["--quantization", "fp8"]):
        engine = _engine(*dummy, *quant, "--dummy-quiet-layers", "8")
        want = random_params(CFG, 0, torch.float32, CPU, quantize="fp8" if quant else None, quiet=8.0)
        ref = mf.Engine(CFG, want, mf.EngineConfig(max_tokens=512, page_size=4))
        got = engine.generate(PROMPTS, 6)
        assert [o.tokens for o in got] == [o.tokens for o in ref.generate(PROMPTS, 6)], quant
    loud = [o.tokens for o in _engine(*dummy).generate(PROMPTS, 6)]
    assert loud != [o.tokens for o in _engine(*dummy, "--dummy-quiet-layers", "8").generate(PROMPTS, 6)]
    with pytest.raises(ValueError, match="random weights"):
        ServerArgs(model_path=str(root / "model"), dummy_quiet_layers=8.0)
    with pytest.raises(ValueError, match="expected > 0"):
        ServerArgs(dummy_quiet_layers=0.0)
