"""Release and resume GPU memory at the same addresses: CUDA virtual memory via torch_memory_saver.

mimo_fn.rl.memory frees a tag's storages by resizing them to 0 bytes. Resumed, they may sit at
new addresses, so the engine drops its decode CUDA graphs at every release and captures them
again afterwards (0.24-0.39 s of a 6-layer RL step on one H200; docs/benchmarks.md). A Saver keeps
the addresses instead. Every storage of a tag moves once, at Engine init, into memory that
torch_memory_saver takes from the CUDA driver's virtual memory API: a range of addresses
reserved for good, with physical pages mapped under it. Pausing the tag unmaps the pages and
frees them, keeping the range; resuming maps new pages under the same addresses. Tensors, their
views and the raw pointers inside captured graphs all stay valid. The bytes come back only from
a backup (mimo_fn.rl.memory.release(backup=True) keeps one on the host).

How a storage moves: a storage's resize takes its memory from the pool that torch's caching
allocator is using on this thread, so resizing the storage to 0 and back to its size inside the
tag's torch_memory_saver region (a torch MemPool over its allocator) moves it, views and all.

Costs: the package (`pip install torch_memory_saver`; its "torch" hook mode needs no LD_PRELOAD),
CUDA, and torch's allocator without expandable segments. Memory moved into a region stays with
torch_memory_saver's pools for the life of the process: a discarded Engine's weights and pages
go back to that pool, not to the driver. A resume that finds too little free memory ends the
process (the package aborts where the resize method raises torch's OutOfMemoryError): the
trainer must have freed what the engine takes back.

One trap, handled here: the package's free callback ends the process (exit(1)) when it runs
outside a region, and torch calls it for a pool's cached blocks when the pool is destroyed, at
interpreter exit after a discarded engine's blocks went back to it. An exit hook therefore
marks the main thread as inside a region from then on, so those frees go through.
"""

import atexit
import itertools
import os

import torch

from mimo_fn.rl.memory import bytes_of, storages_of

_engines = itertools.count()  # torch_memory_saver's tags are process-wide: one prefix per engine
_MARGIN = 256 << 20  # bytes left free beside a move's allocations (the driver's own, rounding to 2 MiB pages)


def load_package():
    """torch_memory_saver's singleton, set to its in-process "torch" hook mode; a ValueError says
    why it cannot be used."""
    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        raise ValueError("memory_saver: torch_memory_saver does not work with PYTORCH_CUDA_ALLOC_CONF="
                         "expandable_segments:True; unset it or use memory_saver=False")
    try:
        from torch_memory_saver import torch_memory_saver as tms
    except ImportError as e:
        raise ValueError("memory_saver: the torch_memory_saver package is not installed (pip install "
                         "torch_memory_saver), or use memory_saver=False") from e
    if getattr(tms, "_impl", None) is None:  # not used yet in this process: pick the hook mode
        tms.hook_mode = "torch"  # a MemPool over its allocator; "preload" needs LD_PRELOAD at start
        atexit.register(_frees_allowed_at_exit, tms)
    return tms


def _frees_allowed_at_exit(tms) -> None:
    """Runs before the interpreter tears modules down: from here on this thread counts as inside
    a region, so the pools' frees at teardown are ones the package accepts (module docstring).
    The flag is what region() sets, set for good: a region() entered here and never left would
    be left anyway once its generator is collected, at the latest during teardown."""
    tms._ensure_initialized()
    tms._impl._binary_wrapper.cdll.tms_set_interesting_region(True)


class Saver:
    """One engine's tags in torch_memory_saver: `adopt` moves storages in, `pause` frees their
    pages, `resume` maps new ones at the same addresses."""

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise ValueError(f"memory_saver: needs the engine's weights on a CUDA device, got {device}; "
                             "use memory_saver=False")
        self.tms = load_package()
        self.device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        self.prefix = f"mimo_fn{next(_engines)}."
        self.tags: dict[str, int] = {}  # tag -> bytes adopted

    def adopt(self, tag: str, tensors: list[torch.Tensor], keep_bytes: bool = True) -> int:
        """Move the storages under `tensors` into the tag's region; returns the bytes moved. Their
        bytes are kept (copied aside and back: on the GPU where it has room for the copy and the
        new pages, else through the host) unless keep_bytes is False (a fresh KV cache holds none).
        One storage at a time, so the move needs at most one storage's size more: the package ends
        the process (exit(1)) where the driver has no memory for a region's allocation."""
        storages = storages_of(tensors)
        elsewhere = [s.device for s in storages if s.device != self.device]
        if elsewhere:
            raise ValueError(f"memory_saver: a {tag!r} storage is on {elsewhere[0]}, the engine on {self.device}")
        moved = 0
        with torch.cuda.device(self.device):
            for s in storages:
                n = s.nbytes()
                keep = None
                if keep_bytes:
                    if torch.cuda.mem_get_info()[0] < 2 * n + _MARGIN:  # earlier moves' old blocks, cached by
                        torch.cuda.empty_cache()  # torch, back to the driver: the region allocates from there
                    room = torch.cuda.mem_get_info()[0] > 2 * n + _MARGIN
                    keep = bytes_of(s).to("cuda" if room else "cpu", copy=True)
                s.resize_(0)
                if torch.cuda.mem_get_info()[0] < n + _MARGIN:
                    torch.cuda.empty_cache()  # the old block is cached by torch: back to the driver first
                with self.tms.region(self.prefix + tag):
                    s.resize_(n)
                if keep is not None:
                    bytes_of(s).copy_(keep)
                del keep
                moved += n
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the storages' old blocks back to the driver
        self.tags[tag] = self.tags.get(tag, 0) + moved
        return moved

    def pause(self, tag: str) -> None:
        """Free the physical pages under the tag's storages; their addresses stay reserved. Any
        kernel still reading them must be done: this waits for the device first."""
        torch.cuda.synchronize(self.device)
        self.tms.pause(self.prefix + tag)

    def resume(self, tag: str) -> None:
        """New physical pages under the tag's addresses (their bytes undefined)."""
        self.tms.resume(self.prefix + tag)
