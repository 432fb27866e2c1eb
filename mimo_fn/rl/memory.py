"""Release and resume GPU memory by tag, for a rollout engine colocated with a trainer.

Tags:
  "weights"   every parameter tensor (FP8 / MXFP4 data and scales included); the engine adds a draft
              model's weights, always backed up (DFlashProposer.weight_tensors)
  "kv_cache"  the page pools of both kinds of attention layer (the SWA pool included); the
              engine adds a draft model's context pages (DFlashProposer.kv_cache_tensors)
  "graphs"    the decode steps' CUDA graphs and their memory pool (mimo_fn.graphs): the
              engine drops them, and captures them again on first use after resume

How: the storage under each tensor is resized to 0 bytes and, on resume, back to its size,
the way FSDP frees and refills unsharded parameters. The memory goes back to torch's caching
allocator, and `torch.cuda.empty_cache()` then returns it to the driver, where the trainer
(this process or another) can have it. The tensor objects, shapes, strides and views all stay,
so the engine's state is untouched.

This is the engine's default, the "documented equivalent" of CUDA VMM that DESIGN.md allows.
It differs from VMM in one way: a resumed tensor may live at a new address. The only raw
pointers the engine keeps between calls are inside its decode CUDA graphs, and releasing any
tag drops those graphs (Engine.release_memory), so nothing depends on the old addresses. It
needs no package and no allocator hooks, and it works on the CPU, where the tests run.
EngineConfig(memory_saver=True) takes the VMM way instead (mimo_fn.rl.vmm, torch_memory_saver):
`release(..., saver=)` then pauses the storages in place, addresses kept, and the graphs stay.

Contents: a resumed KV cache needs none (releasing it requires that no sequence holds
pages). Resumed weights hold garbage until they are rewritten, unless `backup=True`: then
release first copies them to host memory (pinned on CUDA, and kept for the next release), and
resume copies them back.
"""

from dataclasses import dataclass

import torch

from mimo_fn.model import EngineState
from mimo_fn.params import to_flat
from mimo_fn.quant import QTensor

TAGS = ("weights", "kv_cache", "graphs")


@dataclass
class Released:
    """What one release took away: each storage's size, and its bytes when backed up."""

    storages: list[torch.UntypedStorage]
    nbytes: list[int]
    backups: list[torch.Tensor] | None  # uint8 host copies, one per storage
    paused: tuple | None = None  # (vmm.Saver, tag) that paused them in place; None: resized to 0

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes)


def check_tags(tags, what: str) -> tuple[str, ...]:
    """tags as a tuple of known names (None: all); a ValueError names an unknown one."""
    tags = TAGS if tags is None else (tags,) if isinstance(tags, str) else tuple(tags)
    unknown = [t for t in tags if t not in TAGS]
    if unknown:
        raise ValueError(f"{what}: unknown memory tag {unknown[0]!r}; expected some of {TAGS}")
    return tags


def tagged_tensors(state: EngineState, tag: str) -> list[torch.Tensor]:
    """The tensors behind a tag (views of one storage may repeat: `release` counts each storage once)."""
    if tag == "weights":
        out = []
        for w in to_flat(state.params).values():
            out += [w.data, w.scale] if isinstance(w, QTensor) else [w]
        return out
    if tag == "kv_cache":
        pools = (state.cache.full, state.cache.swa)
        return [t for pool in pools for t in (*pool.k, *pool.v)]
    if tag == "graphs":  # no tensors of the state: the engine drops its graphs (Engine.release_memory)
        return []
    raise ValueError(f"tagged_tensors: unknown memory tag {tag!r}; expected one of {TAGS}")


def bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as a flat uint8 tensor (a view: no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


def storages_of(tensors: list[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct storages under `tensors` that hold memory; a ValueError if one cannot be resized."""
    storages, seen = [], set()
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            storages.append(s)
    fixed = [s for s in storages if not s.resizable()]
    if fixed:
        raise ValueError(f"release: {len(fixed)} storages cannot be resized (e.g. {fixed[0].nbytes()} bytes on "
                         f"{fixed[0].device}, memory-mapped from a file?); give the engine tensors torch allocated")
    return storages


def release(tensors: list[torch.Tensor], backup: bool = False, reuse: list[torch.Tensor] | None = None,
            saver=None, tag: str | None = None) -> Released:
    """Free the storage under `tensors` (each storage once); with backup, keep its bytes on the host.

    Backups of CUDA memory go to pinned host buffers, which are slow to allocate and fast to
    fill: pass the previous release's `backups` as `reuse` and they are filled again where
    every size still matches. With a `saver` (mimo_fn.rl.vmm.Saver) holding these storages
    under `tag`, it pauses them: the memory goes, the addresses stay.
    """
    storages = storages_of(tensors)
    nbytes = [s.nbytes() for s in storages]
    backups = None
    if backup:
        if reuse is None or [b.numel() for b in reuse] != nbytes:
            pin = any(s.device.type == "cuda" for s in storages)
            reuse = [torch.empty(n, dtype=torch.uint8, pin_memory=pin) for n in nbytes]
        backups = [b.copy_(bytes_of(s)) for b, s in zip(reuse, storages)]
    if saver is not None:
        saver.pause(tag)
        return Released(storages, nbytes, backups, paused=(saver, tag))
    for s in storages:
        s.resize_(0)
    if any(s.device.type == "cuda" for s in storages):
        torch.cuda.empty_cache()  # hand the freed blocks back to the driver
    return Released(storages, nbytes, backups)


def resume(released: Released) -> None:
    """Give each released storage its memory back (new memory, or the saver's new pages at the
    old addresses), and its bytes when backed up."""
    if released.paused is not None:
        saver, tag = released.paused
        saver.resume(tag)
    for i, (s, n) in enumerate(zip(released.storages, released.nbytes)):
        if released.paused is None:
            s.resize_(n)
        if released.backups is not None:
            bytes_of(s).copy_(released.backups[i])
