"""What RL weight sync costs: `update_weights` of every weight of the model, in place, on one GPU.

The 6-layer slice of MiMo-V2-Flash at the released dims (`ModelConfig.flash(num_layers=6)`). The
trainer's side is a colocated one: bf16 tensors already on the same GPU, named as
`save_pretrained` names them, one per expert projection (gate, up, down), as a trainer hands
them over. To keep memory to the engine's weights, the trainer's tensors of one shape cycle over
a few random buffers (distinct buffers, so the reads come from HBM, not L2). For each format of
the engine's weights (bf16; FP8 128x128 blocks; MXFP4 experts with FP8 elsewhere) it times one
call after a warm-up one, and reports the seconds, the trainer bytes read per second, and the
time per tensor of the expert projections and of everything else.

    python scripts/bench_weight_sync.py [--layers 6] [--formats bf16 fp8 mxfp4]
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import mimo_fn as mf  # noqa: E402
from mimo_fn.params import describe, quantize_params  # noqa: E402
from mimo_fn.rl.weights import update_weights  # noqa: E402

BUFFERS = 4  # distinct trainer buffers per shape


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--formats", nargs="+", default=["bf16", "fp8", "mxfp4"], choices=["bf16", "fp8", "mxfp4"])
    args = ap.parse_args()
    cfg = mf.ModelConfig.flash(num_layers=args.layers)
    named, _ = trainer_tensors(cfg, "cuda")
    experts = [n for n, _ in named if ".experts." in n]
    read = sum(t.numel() * t.element_size() for _, t in named)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  {args.layers}-layer slice: {len(named)} "
          f"tensors ({len(experts)} expert projections), {read / 2**30:.2f} GiB of bf16 from the trainer")
    rows = []
    for fmt in args.formats:
        params = mf.init_params(cfg, seed=0, dtype=torch.bfloat16, device="cuda")
        if fmt != "bf16":
            params = quantize_params(cfg, params, experts=fmt)
        update_weights(params, cfg, named)  # warm-up: allocator, kernels
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        update_weights(params, cfg, named)
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
        t0 = time.perf_counter()
        update_weights(params, cfg, [(n, t) for n, t in named if ".experts." not in n])
        torch.cuda.synchronize()
        rest = time.perf_counter() - t0
        rows.append((fmt, total, read / total / 1e9, (total - rest) / len(experts) * 1e6,
                     rest / (len(named) - len(experts)) * 1e6))
        del params
        torch.cuda.empty_cache()
    print(f"{'weights':8} {'seconds':>8} {'GB/s read':>10} {'us / expert tensor':>19} {'us / other tensor':>18}")
    for fmt, total, gbs, per_expert, per_other in rows:
        print(f"{fmt:8} {total:8.3f} {gbs:10.1f} {per_expert:19.1f} {per_other:18.1f}")


if __name__ == "__main__":
    main()
