import os, sys, dataclasses as dc
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1])); sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import torch
import bench_attention as ba
from mimo_fn.kernels import attention as attn
from mimo_fn.kernels import attention_swa as sw
b0 = sw.default_band_config(64, 8, True)
CFGS = [b0, dc.replace(b0, prefetch=132), dc.replace(b0, prefetch=264), dc.replace(b0, prefetch=528), b0]
rows = []
for T in [8192, 32768, 65536]:
    p = ba.make_layer(T, **ba.LAYERS["swa"])
    mn = 2 * T * (64 * 192 + 8 * 320 + 64 * 128) / ba.HBM_BYTES_PER_S * 1e3
    if T == 8192:
        ref = ba.chunked_reference(p)
        for c in CFGS:
            out = torch.full_like(ref, float("nan")); sw.launch_swa_band(**p, config=c, out_TNE=out)
            print(c.prefetch, "err", ba.rel_err(out, ref), flush=True)
        del ref
    ms = ba.bench(lambda: attn.launch_prefill(**p)); rows.append(("loop", T, ms, ms / mn))
    for c in CFGS:
        ms = ba.bench(lambda: sw.launch_swa_band(**p, config=c)); rows.append((f"band pf{c.prefetch}", T, ms, ms / mn))
    del p; torch.cuda.empty_cache()
for r in rows: print(f"{r[0]:14} {r[1]:6d} {r[2]:8.3f} {r[3]:6.2f}")
