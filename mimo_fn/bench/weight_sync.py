"""What RL weight sync costs: `update_weights` of every weight of the model, in place.

The 6-layer slice of MiMo-V2-Flash at the released dims (`ModelConfig.flash(num_layers=6)`) on one
GPU, or with --device cpu the tiny config. The trainer's side is a colocated one: bf16 tensors
already on the same device, named as `save_pretrained` names them, one per expert projection
(gate, up, down), as a trainer hands them over. To keep memory to the engine's weights, the
trainer's tensors of one shape cycle over a few random buffers (distinct buffers, so the reads
come from HBM, not L2). For each format of the engine's weights (bf16; FP8 128x128 blocks;
MXFP4 experts with FP8 elsewhere) it times one call after a warm-up one, and reports the
seconds, the trainer bytes read per second, and the time per tensor of the expert projections
and of everything else.

    python -m mimo_fn.bench weight-sync [--layers 6] [--formats bf16 fp8 mxfp4]
    python -m mimo_fn.bench weight-sync --device cpu
"""

import torch

import mimo_fn as mf
from mimo_fn.bench.results import print_table, record
from mimo_fn.bench.timing import wall_s
from mimo_fn.bench.workload import add_model_args, flash_slice, model_name, model_setup
from mimo_fn.params import describe, quantize_params
from mimo_fn.rl.weights import update_weights

NEEDS_CUDA = False
BUFFERS = 4  # distinct trainer buffers per shape


def add_args(ap) -> None:
    ap.add_argument("--layers", type=int, default=6, help="layers of the released-dims model (flash-slice only)")
    ap.add_argument("--formats", nargs="+", default=None, choices=["bf16", "fp8", "mxfp4"],
                    help="formats of the engine's weights (default: all three; bf16 only on the tiny model, "
                         "whose dims are not whole 128-row FP8 blocks)")
    add_model_args(ap)


def trainer_tensors(cfg, device) -> tuple[list[tuple[str, torch.Tensor]], dict]:
    """(hub name, bf16 tensor) for every weight, expert projections one by one; buffers by shape."""
    buffers: dict[tuple, list[torch.Tensor]] = {}
    named, uses = [], {}

    def src(shape):
        shape = tuple(shape)
        if shape not in buffers:
            buffers[shape] = [torch.randn(shape, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(BUFFERS)]
        uses[shape] = uses.get(shape, -1) + 1
        return buffers[shape][uses[shape] % BUFFERS]

    for info in describe(cfg).values():
        if len(info.shape) == 3:  # an expert stack: one tensor per expert and projection
            experts, rows, k = info.shape[0], info.shape[1] // len(info.hub), info.shape[2]
            named += [(key.replace("{e}", str(e)), src((rows, k))) for e in range(experts) for key in info.hub]
        else:
            named += [(key, src(info.shape)) for key in info.hub]
    return named, buffers


def main(args, run) -> None:
    cfg, device, _ = model_setup(args)
    formats = args.formats or ["bf16", "fp8", "mxfp4"]
    if cfg == flash_slice():
        cfg = mf.ModelConfig.flash(num_layers=args.layers)
    elif args.formats is None:
        formats = ["bf16"]
    elif formats != ["bf16"]:
        raise SystemExit("weight-sync: --formats fp8 / mxfp4 need --model flash-slice (the tiny model's dims are "
                         "not whole 128-row FP8 blocks)")
    named, _ = trainer_tensors(cfg, device)
    experts = [n for n, _ in named if ".experts." in n]
    read = sum(t.numel() * t.element_size() for _, t in named)
    print(f"{run.device}  torch {torch.__version__}  {model_name(cfg)}: {len(named)} "
          f"tensors ({len(experts)} expert projections), {read / 2**30:.2f} GiB of bf16 from the trainer")
    rows = []
    for fmt in formats:
        params = mf.init_params(cfg, seed=0, dtype=torch.bfloat16, device=device)
        if fmt != "bf16":
            params = quantize_params(cfg, params, experts=fmt)
        update_weights(params, cfg, named)  # warm-up: allocator, kernels
        total, _ = wall_s(lambda: update_weights(params, cfg, named))
        rest, _ = wall_s(lambda: update_weights(params, cfg, [(n, t) for n, t in named if ".experts." not in n]))
        res = {"seconds": total, "gb_s_read": read / total / 1e9,
               "us_per_expert_tensor": (total - rest) / len(experts) * 1e6,
               "us_per_other_tensor": rest / (len(named) - len(experts)) * 1e6}
        record(run, res, format=fmt, tensors=len(named), trainer_gib=read / 2**30)
        rows.append({"format": fmt, **res})
        del params
        if device == "cuda":
            torch.cuda.empty_cache()
    print_table(rows, [("weights", "format", ""), ("seconds", "seconds", ".3f"), ("GB/s read", "gb_s_read", ".1f"),
                       ("us / expert tensor", "us_per_expert_tensor", ".1f"),
                       ("us / other tensor", "us_per_other_tensor", ".1f")])
