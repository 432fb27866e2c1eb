"""Packed FP8 all-gather == two separate all-gathers, bit for bit, on gloo CPU processes.

Legend: W ranks, T tokens per rank, H hidden, G = ceil(H / 128), M = W * T.

Each rank quantises its own random tokens; every variant must return, on every rank, the
rank-major concatenation of all ranks' tokens, and the two FP8 variants the same bytes.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if not torch.cuda.is_available():
    # before triton.language is first imported (mimo_fn imports it): spawned workers
    # inherit the variable and re-import this module, so it holds there too
    os.environ["TRITON_INTERPRET"] = "1"

from mimo_fn.quant import quantize_fp8_act_ref  # noqa: E402

T, H = 6, 1000  # H off a multiple of 128: the last group of every token is partial


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tokens(rank: int, h: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(T, h, generator=g) * (rank + 1)
    x[rank % T, :128] = 0.0  # a zero group somewhere
    return x.to(torch.bfloat16)


def _worker(rank: int, world: int, port: int, h: int, use_kernel: bool) -> None:
    from mimo_fn.parallel.packed_fp8 import all_gather_bf16, all_gather_fp8_two_collectives, all_gather_packed_fp8

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        group = dist.new_group(list(range(world)))  # an explicit group, as the TP axis would pass
        x_TH = _tokens(rank, h)
        q_MH, s_MG = all_gather_packed_fp8(x_TH, group, use_kernel=use_kernel)
        q2_MH, s2_MG = all_gather_fp8_two_collectives(x_TH, group, use_kernel=use_kernel)
        x_MH = all_gather_bf16(x_TH, None)  # None = the world group

        m, g = world * T, -(-h // 128)
        assert q_MH.shape == (m, h) and s_MG.shape == (m, g)
        assert s_MG.stride() == (1, m), "scales must come back M-major"
        assert torch.equal(q_MH.view(torch.uint8), q2_MH.view(torch.uint8))
        assert torch.equal(s_MG.view(torch.int32), s2_MG.view(torch.int32))

        x_ref = torch.cat([_tokens(r, h) for r in range(world)])
        assert torch.equal(x_MH, x_ref)
        if not use_kernel:  # the interpreter's fp8 cast is not exact; the kernel test covers it
            q_ref, s_ref = quantize_fp8_act_ref(x_ref)
            assert torch.equal(q_MH.view(torch.uint8), q_ref.view(torch.uint8))
            assert torch.equal(s_MG, s_ref)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "world,h,use_kernel",
    [
        (2, H, False),
        (4, H, False),
        # gloo holds CPU tensors: the kernel can only run on them in the interpreter
        pytest.param(2, 256, True, marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only case")),
    ],
)
def test_packed_equals_two_collectives(world, h, use_kernel):
    mp.spawn(_worker, args=(world, _free_port(), h, use_kernel), nprocs=world, join=True)
