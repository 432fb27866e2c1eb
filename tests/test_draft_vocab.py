"""A DFlash draft with its own vocabulary (mimo_fn.speculative.draft_vocab): its drafts are the
argmax of the full draft logits over those tokens, decoding stays greedy's, its copy of the LM
head's rows follows a weight update, it trains on those rows and round-trips through a checkpoint.
"""

from dataclasses import replace

import pytest
import torch

import mimo_fn as mf
from mimo_fn.quant import dequantize, quantize_fp8_block
from mimo_fn.speculative import dflash, dflash_checkpoint, train_dflash
from mimo_fn.speculative.dflash import DFlashConfig, DFlashProposer, init_dflash
from mimo_fn.speculative.dflash_distill import TrainConfig, block_logits, block_loss, greedy_data, train
from mimo_fn.speculative.draft_vocab import coverage, frequent_tokens, head_rows, to_draft_ids

CFG = mf.ModelConfig.tiny()
DCFG = DFlashConfig(target_layers=(1, 3), mask_token_id=CFG.vocab_size - 1, block_size=4, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [11, 12]]


def _vocab(n: int, seed: int) -> torch.Tensor:
    return torch.randperm(CFG.vocab_size, generator=torch.Generator().manual_seed(seed))[:n].sort().values.to(DEVICE)


def test_the_most_frequent_continuation_tokens():
    seqs = [torch.tensor([9, 9, 1, 2, 2, 2, 5]), torch.tensor([0, 5, 5, 2])]
    starts = [2, 1]  # continuations [1, 2, 2, 2, 5] and [5, 5, 2]: 2 x 4, 5 x 3, 1 x 1
    assert frequent_tokens(seqs, starts, 2).tolist() == [2, 5]
    assert frequent_tokens(seqs, starts, 9).tolist() == [1, 2, 5]
    assert coverage(torch.tensor([2, 5]), seqs, starts) == pytest.approx(7 / 8)
    with pytest.raises(ValueError, match="draft vocabulary of 0 tokens"):
        frequent_tokens(seqs, starts, 0)
    labels = torch.tensor([[5, 1], [2, 9]])
    assert to_draft_ids(labels, torch.tensor([2, 5]), 16).tolist() == [[1, -100], [0, -100]]
    assert to_draft_ids(labels, None, 16) is labels


def test_drafts_are_the_argmax_over_the_vocabulary():
    """propose, propose_many and propose_device give, for every sequence, the argmax of the
    plain draft_logits' columns of the vocabulary, as target ids."""
    params = mf.init_params(CFG, seed=3, device=DEVICE)
    drafter = replace(init_dflash(CFG, DCFG, seed=1, device=DEVICE), vocab=_vocab(40, 0))
    proposer = DFlashProposer(drafter, DCFG, params, CFG)
    gen = torch.Generator().manual_seed(2)
    asks = []
    for rid, n in ((0, 9), (1, 21), (2, 4)):
        proposer.observe(rid, torch.randn(n, 2, CFG.hidden_size, generator=gen).to(DEVICE))
        asks.append((rid, torch.randint(0, CFG.vocab_size, (n + 1,), generator=gen).tolist(), 3))
    want = []
    for rid, tokens, k in asks:
        n = len(tokens) - 1
        block = torch.tensor([tokens[-1]] + [DCFG.mask_token_id] * 3, device=DEVICE)
        full = dflash.draft_logits(drafter, DCFG, params, proposer.context(rid), block,
                                   torch.arange(n, n + 4, device=DEVICE))
        want.append(drafter.vocab[full[1:, drafter.vocab].argmax(-1)].tolist())
        assert want[-1] != full[1:].argmax(-1).tolist()  # (the whole vocabulary's argmax is another)
    assert proposer.propose_many(asks) == want
    assert proposer.propose_device(asks).tolist() == want
    assert [proposer.propose(*ask) for ask in asks] == want
    with pytest.raises(ValueError, match=r"DFlashParams.vocab: expected int64 \[Vd\] token ids, strictly increasing"):
        DFlashProposer(replace(drafter, vocab=torch.tensor([3, 2], device=DEVICE)), DCFG, params, CFG)


def test_decoding_with_a_vocabulary_is_greedys():
    params = mf.init_params(CFG, seed=3, device=DEVICE)
    plain = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=512, page_size=4)).generate(PROMPTS, 16)
    # the vocabulary holds half of greedy's tokens, so some drafts are right and some cannot be
    seen = sorted({t for o in plain for t in o.tokens})
    vocab = torch.tensor(sorted(set(seen[::2]) | set(_vocab(30, 1).tolist())), device=DEVICE)
    proposer = DFlashProposer(replace(init_dflash(CFG, DCFG, seed=1, device=DEVICE), vocab=vocab), DCFG, params, CFG)
    engine = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=512, page_size=4, num_draft_tokens=3,
                                                    proposer=proposer))
    assert [o.tokens for o in engine.generate(PROMPTS, 16)] == [o.tokens for o in plain]
    assert engine.spec_stats()["drafted"] > 0


def test_the_draft_head_follows_a_weight_update():
    """The draft's copy of the LM head's rows is taken again after the target's head is written
    in place (update_weights writes in place): the drafts are the new head's."""
    params = mf.init_params(CFG, seed=3, device=DEVICE)
    drafter = replace(init_dflash(CFG, DCFG, seed=1, device=DEVICE), vocab=_vocab(40, 0))
    proposer = DFlashProposer(drafter, DCFG, params, CFG)
    proposer.observe(0, torch.randn(6, 2, CFG.hidden_size, generator=torch.Generator().manual_seed(4)).to(DEVICE))
    ask = [(0, [1, 2, 3, 4, 5, 6, 7], 3)]
    before = proposer.propose_many(ask)
    params.lm_head.copy_(torch.randn(params.lm_head.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE))
    after = proposer.propose_many(ask)
    assert torch.equal(proposer.head.params.lm_head, params.lm_head[drafter.vocab])
    fresh = DFlashProposer(drafter, DCFG, params, CFG)  # built after the update
    fresh.observe(0, torch.randn(6, 2, CFG.hidden_size, generator=torch.Generator().manual_seed(4)).to(DEVICE))
    assert after == fresh.propose_many(ask) and after != before
    assert proposer.head.params.lm_head.data_ptr() in {t.data_ptr() for t in proposer.weight_tensors()}


def test_an_fp8_head_gives_its_dequantised_rows():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(6))
    vocab = torch.tensor([0, 5, 17, 63])
    q = quantize_fp8_block(w)
    assert torch.equal(head_rows(q, vocab, torch.float32), dequantize(q, torch.float32)[vocab])


def test_training_scores_the_vocabulary_alone(tmp_path):
    """block_logits with the vocabulary's rows are the full logits' columns; labels outside it
    count nothing in the loss; a few training steps and the CLI keep the vocabulary, and a
    checkpoint holds it (a bad one is refused, naming the tensor)."""
    dparams = init_dflash(CFG, DCFG, seed=2)
    params = mf.init_params(CFG, seed=1)
    vocab = _vocab(50, 3).cpu()
    gen = torch.Generator().manual_seed(0)
    hidden, tokens = torch.randn(2, 12, 2, CFG.hidden_size, generator=gen), torch.randint(0, CFG.vocab_size, (2, 12),
                                                                                            generator=gen)
    anchors = torch.tensor([[2, 7], [0, 5]])
    full = block_logits(dparams, DCFG, params, hidden, tokens, anchors)
    cut = block_logits(dparams, DCFG, replace(params, lm_head=head_rows(params.lm_head, vocab, torch.float32)),
                       hidden, tokens, anchors)
    torch.testing.assert_close(cut, full[..., vocab], atol=1e-6, rtol=0)
    labels = torch.randint(0, CFG.vocab_size, (2, 2, 3), generator=gen)
    labels[0, 0] = vocab[:3]  # some inside
    ids = to_draft_ids(labels, vocab, CFG.vocab_size)
    inside = ids >= 0
    ce = torch.nn.functional.cross_entropy(cut.flatten(0, 2), ids.flatten().clamp(min=0), reduction="none").view(2, 2, 3)
    w = torch.ones(3) / 3
    torch.testing.assert_close(block_loss(cut, ids, 0.0), ((ce * inside).mean(dim=(0, 1)) * w).sum())

    data = greedy_data(CFG, params, [[1, 2, 3, 4], [5, 6, 7, 8]], 12, DCFG.target_layers)
    trained, history = train(CFG, params, replace(dparams, vocab=frequent_tokens(data.tokens, data.prompt_lens, 8)),
                             DCFG, data, TrainConfig(steps=3, seqs=2, anchors=2, eval_every=3), progress=False)
    assert trained.vocab.numel() <= 8 and all(h["loss"] is None or h["loss"] > 0 for h in history)
    dflash_checkpoint.save_dflash(trained, DCFG, CFG, tmp_path / "d")
    _, loaded = dflash_checkpoint.load_dflash(tmp_path / "d", CFG, dtype=torch.float32)
    assert torch.equal(loaded.vocab, trained.vocab)
    dflash_checkpoint.save_dflash(replace(trained, vocab=torch.tensor([4, 4])), DCFG, CFG, tmp_path / "bad")
    with pytest.raises(ValueError, match="draft_vocab: expected int64"):
        dflash_checkpoint.load_dflash(tmp_path / "bad", CFG)

    out = train_dflash.main(["--out", str(tmp_path / "cli"), "--device", "cpu", "--steps", "1", "--eval-every", "1",
                             "--num-prompts", "4", "--prompt-len", "8", "--new-tokens", "12", "--eval-prompts", "2",
                             "--block-size", "4", "--batch-seqs", "2", "--anchors", "2", "--draft-vocab", "20"])
    assert [h["step"] for h in out["history"]] == [0, 1]
    _, cli = dflash_checkpoint.load_dflash(tmp_path / "cli", CFG, dtype=torch.float32)
    assert 0 < cli.vocab.numel() <= 20
