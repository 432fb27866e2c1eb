"""Proposers by name: what `EngineConfig(proposer="mtp" | "dflash" | "ngram", draft_path=...)` and
the server's `--speculative-algorithm` build.

  ngram   prompt lookup (mimo_fn.speculative.ngram): no weights
  dflash  a DFlash block draft read from draft_path (mimo_fn.speculative.dflash_checkpoint)
  mtp     the MTP layers a checkpoint is released with (`model.mtp.*`), read from draft_path,
          usually the target's own checkpoint directory (mimo_fn.speculative.mtp_checkpoint)

`random_draft=True` draws random MTP layers instead of reading them (the server's
`--load-format dummy`, whose checkpoint has none: the path's speed, with next to nothing accepted).
`min_confidence` > 0 puts a DFlash or MTP draft under a confidence cut (mimo_fn.speculative.draft_cut).
"""

from mimo_fn.config import ModelConfig
from mimo_fn.params import Params
from mimo_fn.speculative.dflash import DFlashProposer
from mimo_fn.speculative.dflash_checkpoint import load_dflash
from mimo_fn.speculative.draft_cut import check_cut
from mimo_fn.speculative.mtp import MTPProposer, init_mtp
from mimo_fn.speculative.mtp_checkpoint import load_mtp
from mimo_fn.speculative.ngram import NgramProposer
from mimo_fn.speculative.proposer import Proposer

PROPOSERS = ("ngram", "dflash", "mtp")
RANDOM_MTP_LAYERS = 1  # drawn where a random MTP draft's config.json declares none


def check_name(name: str, draft_path: str | None, where: str, min_confidence: float = 0.0) -> None:
    """ValueError unless name is a known proposer, has the draft weights it needs and, with a
    confidence cut, drafts with probabilities (dflash, mtp)."""
    if name not in PROPOSERS:
        raise ValueError(f"{where}: proposer {name!r}, expected one of {PROPOSERS} or a Proposer object")
    check_cut(min_confidence, where)
    if min_confidence and name == "ngram":
        raise ValueError(f"{where}: min_confidence {min_confidence} with proposer 'ngram': a confidence cut "
                         "needs a draft model's probabilities (proposer 'dflash' or 'mtp')")
    if name == "dflash" and draft_path is None:
        raise ValueError(f"{where}: proposer 'dflash' reads a DFlash draft: give its directory as draft_path "
                         "(python -m mimo_fn.speculative.train_dflash writes one)")
    if name == "mtp" and draft_path is None:
        raise ValueError(f"{where}: proposer 'mtp' reads the checkpoint's MTP layers (model.mtp.*): give that "
                         "checkpoint directory as draft_path")


def build_proposer(name: str, cfg: ModelConfig, params: Params, draft_path: str | None = None, *,
                   cuda_graphs: bool = True, random_draft: bool = False, num_mtp_layers: int = RANDOM_MTP_LAYERS,
                   seed: int = 0, min_confidence: float = 0.0) -> Proposer:
    """The proposer `name` over the target (cfg, params), its weights on the target's device in the
    target's dtype (embed's)."""
    check_name(name, "random" if random_draft and name == "mtp" else draft_path, "build_proposer", min_confidence)
    dtype, device = params.embed.dtype, params.embed.device
    if name == "ngram":
        return NgramProposer()
    if name == "dflash":
        dcfg, dparams = load_dflash(draft_path, cfg, dtype=dtype, device=device)
        return DFlashProposer(dparams, dcfg, params, cfg, cuda_graphs=cuda_graphs, min_confidence=min_confidence)
    if random_draft:
        mparams = init_mtp(cfg, num_mtp_layers, seed=seed, dtype=dtype, device=device)
    else:
        _, mparams = load_mtp(draft_path, cfg, dtype=dtype, device=device)
    return MTPProposer(mparams, params, cfg, cuda_graphs=cuda_graphs, min_confidence=min_confidence)

