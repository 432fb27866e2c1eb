"""Host -> device copies that do not wait for the GPU.

A plain `tensor.to("cuda")` from ordinary (pageable) host memory synchronises the stream:
torch copies with cudaMemcpyAsync and then waits for the stream, i.e. for every kernel queued
before the copy. The engine builds a decode step's metadata and sampling draws on the host
while the GPU still runs the step before (EngineConfig.overlap), so those copies go through
pinned memory with non_blocking=True instead. torch's caching host allocator keeps a pinned
block from reuse until the copy that reads it has run, so the host tensors may be dropped at
once.
"""

import torch


def upload(parts: list[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """Host tensors of one dtype -> views of one device buffer, in one copy (one pinned staging
    buffer on CUDA, so the host does not wait; elsewhere a plain copy)."""
    device = torch.device(device)
    if device.type != "cuda":
        return [p.to(device) for p in parts]
    flat = torch.cat([p.reshape(-1) for p in parts]).pin_memory().to(device, non_blocking=True)
    views, offset = [], 0
    for p in parts:
        views.append(flat[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()
    return views
