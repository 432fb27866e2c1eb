"""What several benchmarks (and scripts/prefill.py) run: the 6-layer slice of MiMo-V2-Flash at the
released dims, sub-models of its layers, and a chunked prefill of fresh sequences.

Legend: B sequences, V vocabulary.
"""

from dataclasses import replace

import torch

import mimo_fn as mf
from mimo_fn.cache import DEFAULT_PAGE_SIZE
from mimo_fn.params import Params
from mimo_fn.bench.timing import wall_s


def flash_slice() -> mf.ModelConfig:
    """6 layers at the released dims: full dense, SWA MoE x4, full MoE."""
    return mf.ModelConfig.flash(num_layers=6)


def slice_params(cfg: mf.ModelConfig, dtype: str, device: str = "cuda") -> Params:
    """The benchmarks' random weights (seed 0) in "bf16", or with "fp8" / "mxfp4" experts quantised
    as drawn: no bf16 copy is held beside them (the slice in bf16 fills most of an 80 GB card)."""
    quantize = None if dtype == "bf16" else dtype
    return mf.init_params(cfg, seed=0, dtype=torch.bfloat16, device=device, quantize=quantize)


def sub_model(cfg: mf.ModelConfig, params: Params, layers: list[int]) -> tuple[mf.ModelConfig, Params]:
    """A model made of some of the slice's layers (for per-layer-type timing)."""
    sub_cfg = replace(cfg, num_layers=len(layers), layer_types=tuple(cfg.layer_types[i] for i in layers),
                      mlp_types=tuple(cfg.mlp_types[i] for i in layers))
    return sub_cfg, Params(params.embed, tuple(params.layers[i] for i in layers), params.norm, params.lm_head)


def pool_tokens(prompt_lens: list[int], page_size: int) -> int:
    """KV pool for these prompts: their tokens and a page of slack each, plus one."""
    return max(1, sum(prompt_lens)) + page_size * (len(prompt_lens) + 1)


def prefill_state(cfg, params, prompt_lens: list[int], page_size: int = DEFAULT_PAGE_SIZE, mesh=None,
                  max_swa_tokens: int | None = None):
    """A fresh state with room for these prompts."""
    return mf.init_state(cfg, params, max_tokens=pool_tokens(prompt_lens, page_size), page_size=page_size,
                         mesh=mesh, max_swa_tokens=max_swa_tokens)


def prefill_chunks(state, prompts, chunk: int):
    """Prefill `prompts` (possibly none: an idle DP group still joins every step) in chunks of
    `chunk` tokens each; returns the last-token logits_BV in prompt order, or None without prompts."""
    num_steps = max(1, -(-max((len(p) for p in prompts), default=0) // chunk))
    logits = {}
    for step in range(num_steps):
        start = step * chunk
        ids = [i for i, p in enumerate(prompts) if start < len(p)]
        state, out = mf.prefill(state, mf.Batch.from_tokens(ids, [prompts[i][start:start + chunk] for i in ids]))
        for b, i in enumerate(ids):
            logits[i] = out.logits_BV[b]
    return torch.stack([logits[i] for i in range(len(prompts))]) if prompts else None


def chunked_prefill(cfg, params, prompts, chunk: int, page_size: int = DEFAULT_PAGE_SIZE, mesh=None):
    """A fresh state, then `prefill_chunks` of the prompts (what scripts/prefill.py times)."""
    return prefill_chunks(prefill_state(cfg, params, [len(p) for p in prompts], page_size, mesh), prompts, chunk)


def timed_prefill(cfg, params, seq_lens: list[int], chunk: int, page_size: int = DEFAULT_PAGE_SIZE, gen=None,
                  mesh=None):
    """One chunked prefill of fresh random sequences of these lengths, its sliding-window pool
    sized for one chunk of each; the state is made before the clock starts. Returns (seconds,
    last-token logits_BV, prompts)."""
    gen = gen or torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in seq_lens]
    swa = len(seq_lens) * (chunk + cfg.sliding_window + 2 * page_size)
    state = prefill_state(cfg, params, seq_lens, page_size, mesh=mesh, max_swa_tokens=swa)
    seconds, logits = wall_s(lambda: prefill_chunks(state, prompts, chunk))
    return seconds, logits, prompts


def add_model_args(ap) -> None:
    """--model and --device, for the benchmarks that run on the CPU too."""
    cuda = torch.cuda.is_available()
    ap.add_argument("--model", choices=["flash-slice", "tiny"], default=None,
                    help="flash-slice: the 6-layer slice at the released dims; tiny: the CPU-test config "
                         "(default: flash-slice on CUDA, tiny on the CPU)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if cuda else "cpu",
                    help="where the model runs (bf16 on CUDA, fp32 on the CPU)")


def model_setup(args) -> tuple[mf.ModelConfig, str, torch.dtype]:
    """(config, device, dtype) from --model / --device; one line and exit where CUDA is asked for
    and missing."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU (none is visible to torch); --device cpu runs the tiny model")
    model = args.model or ("flash-slice" if args.device == "cuda" else "tiny")
    cfg = flash_slice() if model == "flash-slice" else mf.ModelConfig.tiny()
    return cfg, args.device, torch.bfloat16 if args.device == "cuda" else torch.float32


def model_name(cfg: mf.ModelConfig) -> str:
    if cfg == mf.ModelConfig.flash(num_layers=cfg.num_layers):
        return f"{cfg.num_layers}-layer slice"
    return "tiny model" if cfg == mf.ModelConfig.tiny() else f"{cfg.num_layers}-layer model"
