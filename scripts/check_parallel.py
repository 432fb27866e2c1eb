"""The parallel equivalence test of tests/test_parallel.py on GPUs with NCCL.

    torchrun --nproc-per-node 2 scripts/check_parallel.py [--dp 1 2]

Runs every (dp, tp, ep) layout that fits the world size on the tiny config: per-sequence
logits of chunked prefill and decode (with an idle DP group) against the 1-rank engine on
the same GPU, fp32, relative error <= 1e-5; native reduce-scatter and the forced fallback,
both EP dispatches. Then decode steps replayed from CUDA graphs on the mesh ("gather"
dispatch) against the same eager 1-rank engine (test_parallel.graph_check), and the Engine on
the mesh with CUDA graphs and overlap against the 1-rank Engine (test_engine_mesh.engine_check),
and its RL weight sync plus memory release / resume (test_engine_mesh.weights_check).
"""

import argparse
import gc
import os
import sys
import tempfile

import torch
import torch.distributed as dist

import mimo_fn as mf
from mimo_fn.bench.cli import HelpFormatter

TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4, 8],
                    help="DP sizes to check, those that divide the world size (tp = world / dp, ep = world)")
    ap.add_argument("--checkpoint-dir", default=os.path.join(tempfile.gettempdir(), "mimo_fn_check_parallel"),
                    help="where rank 0 writes the tiny checkpoint (and, with suffix _new, the trainer's weights)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("check_parallel.py: needs a CUDA GPU per rank (none is visible to torch)")
    if "WORLD_SIZE" not in os.environ:
        raise SystemExit("check_parallel.py: run under torchrun (torchrun --nproc-per-node 2 scripts/check_parallel.py)")
    sys.path.insert(0, TESTS)  # the checks are the tests' own, run here on NCCL
    from test_engine_mesh import engine_check, weights_check
    from test_parallel import CFG, graph_check, mesh_check, write_checkpoint

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    path = args.checkpoint_dir
    new_path = path + "_new"  # the weights a trainer hands over in weights_check
    if rank == 0:
        write_checkpoint(path)
        mf.save_checkpoint(mf.init_params(CFG, seed=9), CFG, new_path)
    dist.barrier()
    layouts = [(dp, world // dp, ep) for dp in args.dp if world % dp == 0 for ep in (world,)]
    for dp, tp, ep in layouts:
        mesh_check(dp, tp, ep, path, device="cuda")
        if rank == 0:
            print(f"NCCL world {world} dp={dp} tp={tp} ep={ep}: logits equal the 1-rank engine (rel err <= 1e-5) "
                  "with native reduce-scatter and the forced fallback, all_to_all and gather EP", flush=True)
        stats = graph_check(dp, tp, ep, path)
        if rank == 0:
            print(f"NCCL world {world} dp={dp} tp={tp} ep={ep}: CUDA graph decode steps (gather EP) equal the 1-rank "
                  f"eager engine; {stats}", flush=True)
        stats = engine_check(dp, tp, ep, path, device="cuda", cuda_graphs=True)
        # every round has steps where all DP groups decode (verify) with the same tokens per
        # sequence, except "host drafts" at DP > 1, whose second group has no prompts
        idle = {"host drafts"} if dp > 1 else set()
        silent = [m for m, st in stats.items() if m not in idle and not st["replays"]]
        assert not silent, f"rank {rank} dp={dp}: no graph replays in rounds {silent}: {stats}"
        if rank == 0:
            print(f"NCCL world {world} dp={dp} tp={tp} ep={ep}: Engine.generate equals the 1-rank Engine; graphs "
                  f"{stats}", flush=True)
        stats = weights_check(dp, tp, ep, path, new_path, device="cuda", cuda_graphs=True)
        if rank == 0:
            print(f"NCCL world {world} dp={dp} tp={tp} ep={ep}: after update_weights and a release / resume with "
                  f"backup, generate equals the 1-rank Engine over the new weights; graphs {stats}", flush=True)
    gc.collect()  # graphs holding NCCL work must go before the communicators (docs/parallel.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
