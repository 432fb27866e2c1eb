"""Training a DFlash draft (mimo_fn.speculative.dflash_distill, python -m mimo_fn.speculative.train_dflash):
the training forward is the draft's forward, a trained draft is accepted for several tokens a step
through the real Engine while an untrained one is not, and speculative decoding stays greedy's.
"""

import json
import re
from dataclasses import replace

import pytest
import torch

import mimo_fn as mf
from mimo_fn.speculative import dflash, dflash_checkpoint, train_dflash
from mimo_fn.speculative.dflash import DFlashConfig, DFlashProposer, init_dflash
from mimo_fn.speculative.dflash_distill import (
    TrainConfig, accept_length, block_logits, greedy_data, train,
)
from mimo_fn.params import quiet_layers

CFG = mf.ModelConfig.tiny()


def learnable_target(quiet: float = 8.0) -> mf.Params:
    """The tiny random model with every layer's output projections (attention wo, MLP down)
    divided by `quiet` (params.quiet_layers). Why: with plain random weights its greedy
    continuations are close to chaotic (in a sample, the last token left the next one open in 85
    of 111 cases), so there is little a draft can learn in a CPU test's budget; quieter layers
    leave the residual stream to the current token's embedding, so greedy's next token is mostly
    a function of the last token and, where that is ambiguous (10 of 55 cases), of the context:
    continuations that a draft can learn, as a real model's are often predictable from the last
    few tokens."""
    return quiet_layers(mf.init_params(CFG, seed=0), quiet)


DCFG = DFlashConfig(target_layers=(1, 2, 3), mask_token_id=CFG.vocab_size - 1, block_size=8, num_layers=1,
                    num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=256)


def test_block_logits_are_the_drafts_logits():
    """Every anchor's block in the batched training forward (padding, anchors at 0) gives what
    dflash.draft_logits gives that block over its context: the draft trains what it runs."""
    dcfg = replace(DCFG, block_size=4, num_layers=2)
    params, dparams = mf.init_params(CFG, seed=1), init_dflash(CFG, dcfg, seed=2)
    gen = torch.Generator().manual_seed(0)
    hidden_SCLH = torch.randn(2, 20, 3, CFG.hidden_size, generator=gen)
    tokens_SC = torch.randint(0, CFG.vocab_size, (2, 20), generator=gen)
    anchors_SA = torch.tensor([[3, 10, 16], [0, 5, 12]])
    got = block_logits(dparams, dcfg, params, hidden_SCLH, tokens_SC, anchors_SA)
    assert got.shape == (2, 3, 3, CFG.vocab_size)
    for s in range(2):
        for a, anchor in enumerate(anchors_SA[s].tolist()):
            empty = torch.zeros(0, dcfg.num_kv_heads, dcfg.head_dim)  # (context_kv of no tokens: none)
            ctx = dflash.context_kv(dparams, dcfg, hidden_SCLH[s, :anchor], torch.arange(anchor)) if anchor else [
                (empty, empty)] * dcfg.num_layers
            block = torch.tensor([int(tokens_SC[s, anchor])] + [dcfg.mask_token_id] * 3)
            want = dflash.draft_logits(dparams, dcfg, params, ctx, block, torch.arange(anchor, anchor + 4))
            torch.testing.assert_close(got[s, a], want[1:], atol=1e-5, rtol=1e-5)


@pytest.fixture
def one_thread():
    """Torch on one thread for the test: its ops are tiny, and on a loaded machine threads only
    wait on each other (the training test took 7x longer on two threads of a busy 2-core box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow  # 300 training steps, ~40 s on CI's 2 cores: scripts/gpu_tests.py runs it
def test_a_trained_draft_is_accepted_for_three_tokens_a_step(one_thread):
    """300 steps on the learnable tiny target's greedy continuations of 128 prompts: the Engine's
    mean acceptance length on 8 held-out prompts at block 8 goes from below 3 (the untrained
    draft, measured the same way) to at least 3, and the speculative tokens are greedy's."""
    torch.manual_seed(0)
    params = learnable_target()
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, CFG.vocab_size, (128, 16), generator=gen).tolist()
    held_out = torch.randint(0, CFG.vocab_size, (8, 16), generator=gen).tolist()
    data = greedy_data(CFG, params, prompts, 48, DCFG.target_layers)
    assert [len(t) for t in data.tokens] == [64] * 128 and data.hidden[0].shape == (64, 3, CFG.hidden_size)
    outs = {}

    def evaluate(d):
        mean, outs[len(outs)] = accept_length(CFG, params, d, DCFG, held_out, 32)
        return mean

    dparams, history = train(CFG, params, init_dflash(CFG, DCFG, seed=1), DCFG, data,
                             TrainConfig(steps=300, eval_every=300, lr=1e-2), evaluate, progress=False)
    assert [h["step"] for h in history] == [0, 300]
    assert history[0]["accept_length"] < 3.0 <= history[-1]["accept_length"], history
    plain = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=2048, page_size=16)).generate(held_out, 32)
    chunked = mf.Engine(CFG, params, mf.EngineConfig(  # prompts over several passes, the draft's context too
        max_tokens=2048, page_size=4, chunk_size=8, num_draft_tokens=7,
        proposer=DFlashProposer(dparams, DCFG, params, CFG))).generate(held_out, 32)
    for trained, untrained, again, want in zip(outs[1], outs[0], chunked, plain, strict=True):
        assert trained.tokens == untrained.tokens == again.tokens == want.tokens
        assert sum(trained.accept_lengths) == 31  # every token after the prefill's first, from verify steps
    assert sum(map(len, (o.accept_lengths for o in chunked))) < 8 * 31 / 3  # the trained draft's pace there too


def test_the_cli_trains_and_writes_a_draft_the_loader_reads(tmp_path, capsys, monkeypatch, one_thread):
    out = train_dflash.main(["--out", str(tmp_path / "d"), "--device", "cpu", "--steps", "2", "--eval-every", "1",
                             "--num-prompts", "4", "--prompt-len", "8", "--new-tokens", "12", "--eval-prompts", "2",
                             "--block-size", "4", "--batch-seqs", "2", "--anchors", "2"])
    text = capsys.readouterr().out
    assert [h["step"] for h in out["history"]] == [0, 1, 2]
    assert all(1.0 <= h["accept_length"] <= 4.0 for h in out["history"])
    assert "step 2/2  loss" in text and "saved the draft to" in text
    dcfg, loaded = dflash_checkpoint.load_dflash(tmp_path / "d", CFG, dtype=torch.float32)
    assert dcfg.block_size == 4 and dcfg.target_layers == (1, 2, 3) and loaded.fc.shape == (64, 192)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--device cuda needs a CUDA GPU"):
        train_dflash.main(["--device", "cuda"])
    assert train_dflash.default_target_layers(6) == (1, 3, 5) and train_dflash.default_target_layers(1) == (0,)
    # --dummy-quiet-layers C: the target the server's flag of the name draws (the draft's target there)
    from mimo_fn.params import random_params, to_flat

    _, quiet = train_dflash.load_target(train_dflash.build_parser().parse_args(
        ["--device", "cpu", "--dummy-quiet-layers", "8"]))
    want, drawn = to_flat(random_params(CFG, 0, torch.float32, "cpu", quiet=8.0)), to_flat(quiet)
    assert want.keys() == drawn.keys() and all(torch.equal(want[k], drawn[k]) for k in want)
    assert not torch.equal(to_flat(mf.init_params(CFG, seed=0))["layers.0.attn.wo"],
                           drawn["layers.0.attn.wo"])


def test_the_spec_bench_trains_and_compares_on_the_cpu(tmp_path, capsys, one_thread):
    """`python -m mimo_fn.bench spec --trained` at CPU size (the GPU run's code path on the tiny
    model): a draft trained for a time budget and saved, then plain and speculative decoding side
    by side at each batch, as JSON rows and a table; a second run loads the saved draft."""
    from mimo_fn.bench import cli

    rows, draft = tmp_path / "rows.jsonl", tmp_path / "draft"
    argv = ["spec", "--trained", "--model", "tiny", "--device", "cpu", "--batches", "1", "2", "--prompt", "8",
            "--new", "6", "--train-prompts", "4", "--train-prompt-len", "8", "--train-new", "12", "--train-seconds",
            "1", "--train-batch", "2", "--train-anchors", "2", "--repeats", "1", "--block-size", "4", "--groups", "2",
            "--draft-path", str(draft), "--json", str(rows)]
    cli.main(argv + ["--train-eval-every", "1"])
    text = capsys.readouterr().out
    assert "decode tokens/s, greedy, plain vs a trained DFlash draft (block 4" in text
    got = [json.loads(line) for line in rows.read_text().splitlines()]
    assert [r["params"]["case"] for r in got] == ["training", "decode", "decode"]
    curve = got[0]["results"]["curve"]  # measured before the first step, after each, and after the last
    assert [c["step"] for c in curve[:2]] == [0, 1] and all(c["accept_length"] >= 1.0 for c in curve)
    assert [r["params"].get("batch") for r in got[1:]] == [1, 2]
    for r in got[1:]:
        res = r["results"]
        assert res["same"] == 2 * r["params"]["batch"] and 1.0 <= res["accept_length"] <= 4.0  # two groups
        hist = {int(n): c for n, c in res["accept_histogram"].items()}  # the mean is the histogram's
        assert abs(sum(n * c for n, c in hist.items()) / sum(hist.values()) - res["accept_length"]) < 1e-9
        assert res["plain_e2e_tok_s"] > 0 and res["spec_e2e_tok_s"] > 0
    assert (draft / "config.json").exists()
    cli.main(argv)  # the draft is loaded this time: no training row
    assert "draft loaded from" in capsys.readouterr().out
    assert len(rows.read_text().splitlines()) == 5


def test_the_spec_bench_budget_covers_data_and_training(tmp_path, capsys, one_thread):
    """--train-total-seconds: training gets what the data left of the budget; a budget the data
    alone spends is a clear error, not a run with no training."""
    from mimo_fn.bench import cli

    argv = ["spec", "--trained", "--model", "tiny", "--device", "cpu", "--batches", "1", "--prompt", "8",
            "--new", "4", "--train-prompts", "4", "--train-prompt-len", "8", "--train-new", "12", "--train-steps",
            "2", "--train-batch", "2", "--train-anchors", "2", "--repeats", "1", "--block-size", "4", "--groups", "1"]
    cli.main(argv + ["--train-total-seconds", "600"])
    text = capsys.readouterr().out
    left = float(re.search(r"training for (\d+) s: 600 s less the data's", text).group(1))
    assert 500 < left <= 600
    with pytest.raises(SystemExit, match="--train-total-seconds 1e-06: the data alone took"):
        cli.main(argv + ["--train-total-seconds", "1e-6"])


def test_quieting_in_place_and_quantising_one_weight_at_a_time_change_nothing():
    """params.random_params (the weights of `bench spec --trained --quantization fp8 --quiet-layers C`
    and of the server's --dummy-quiet-layers C: quieted in place, then quantize_flat) is bitwise the
    copying path's (quiet_layers, quantize_params), and with quiet 1 init_params' own."""
    from mimo_fn.params import quantize_params, random_params, to_flat

    def same(a, b):
        a, b = to_flat(a), to_flat(b)
        assert a.keys() == b.keys()
        for k in a:
            pairs = [(a[k], b[k])] if isinstance(a[k], torch.Tensor) else [(a[k].data, b[k].data),
                                                                          (a[k].scale, b[k].scale)]
            for x, y in pairs:
                assert x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8)), k

    want = quantize_params(CFG, quiet_layers(mf.init_params(CFG, seed=0), 8.0))
    same(random_params(CFG, 0, torch.float32, "cpu", quantize="fp8", quiet=8.0), want)
    same(random_params(CFG, 0, torch.float32, "cpu", quiet=8.0), quiet_layers(mf.init_params(CFG, seed=0), 8.0))
    same(random_params(CFG, 0, torch.float32, "cpu", quantize="fp8"), mf.init_params(CFG, seed=0, quantize="fp8"))
    params = mf.init_params(CFG, seed=0)
    assert quiet_layers(params, 8.0, inplace=True) is params


def test_training_batches_come_from_host_or_device_data_alike():
    """greedy_data(on_host=True) keeps the hidden states in pinned host memory (on a GPU; on the
    CPU where they are), and sample_batch copies a batch to the asked device: the same batch as
    from data kept on the device."""
    import random

    from mimo_fn.speculative.dflash_distill import sample_batch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    params = mf.init_params(CFG, seed=1, device=device)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10], [11, 12, 13]]
    kept, host = (greedy_data(CFG, params, prompts, 12, DCFG.target_layers, on_host=h) for h in (False, True))
    assert kept.hidden[0].device.type == device and host.hidden[0].device.type == "cpu"
    assert all(h.is_pinned() for h in host.hidden) or device == "cpu"
    for a, b in zip(kept.hidden, host.hidden, strict=True):
        assert torch.equal(a.cpu(), b)
    one_at_a_time = greedy_data(CFG, params, prompts, 12, DCFG.target_layers, decode_batch=1)
    assert [t.tolist() for t in one_at_a_time.tokens] == [t.tolist() for t in kept.tokens]
    with pytest.raises(ValueError, match="decode_batch 0, expected >= 1"):
        greedy_data(CFG, params, prompts, 12, DCFG.target_layers, decode_batch=0)
    got, want = (sample_batch(d, 8, 3, 4, random.Random(0), torch.device(device)) for d in (host, kept))
    for g, w in zip(got, want, strict=True):
        assert g.device.type == device and torch.equal(g, w)


def test_a_training_batch_takes_sequences_of_one_length():
    """Data of short and long prompts: each batch holds sequences of one length, unpadded, `seqs`
    of the shortest length and as many context rows of a longer one; both lengths come up; data of
    one length gives `seqs` sequences as before."""
    import random

    from mimo_fn.speculative.dflash_distill import GreedyData, sample_batch

    def data(lens):
        return GreedyData([torch.arange(n) % CFG.vocab_size for n in lens], [torch.randn(n, 1, 4) for n in lens],
                          [n - 12 for n in lens])

    mixed = data([20] * 6 + [80] * 2)
    assert mixed.by_length == {20: [0, 1, 2, 3, 4, 5], 80: [6, 7]}
    rng, shapes = random.Random(0), set()
    for _ in range(40):
        hidden, tokens, anchors, labels = sample_batch(mixed, 4, 8, 3, rng)
        shapes.add(tuple(tokens.shape))
        n = tokens.shape[1]
        assert all(torch.equal(t, torch.arange(n) % CFG.vocab_size) for t in tokens)  # no padding
        assert labels.shape == (tokens.shape[0], 3, 3) and bool((anchors >= n - 12).all())
    assert shapes == {(8, 20), (2, 80)}  # 8 x 20 and 160 // 80 = 2 sequences of 80 tokens
    assert sample_batch(data([30] * 5), 4, 8, 3, random.Random(0))[1].shape == (8, 30)
