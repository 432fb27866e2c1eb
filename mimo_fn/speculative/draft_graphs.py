"""CUDA graphs of a draft model's forward, one per shape key, replayed from static input buffers.

A proposer's forward launches many small ops (per step a few norms, GEMMs, an attention call);
from Python they take longer to launch than to run, as the target's decode step does
(mimo_fn.graphs). `DraftGraphs.run(key, inputs, fn)` captures fn(*static inputs) once per key
after one eager run (Triton compiles outside the capture), then replays it: per call only the
inputs are copied in. The graphs hold the addresses of the draft's weights, its page pools and
their own buffers, so whoever moves any of them (a grown pool, released memory) calls `clear`.
A forward that cannot be captured (one that syncs with the host) warns and runs eagerly from
then on (`enabled` turns False).
"""

import warnings

import torch

from mimo_fn.graphs import capture, warm_up


class DraftGraphs:
    def __init__(self, owner: str, enabled: bool = True):
        self.owner = owner  # the proposer's name, for the warning
        self.enabled = enabled
        self._graphs: dict[tuple, tuple] = {}  # key -> (graph, static inputs, outputs)
        self._pool = None

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, key: tuple, inputs: list[torch.Tensor], fn, device: torch.device):
        """fn(*static inputs) replayed from the graph of `key`, `inputs` copied into its static
        buffers first. The outputs are the graph's own buffers: copy what must outlive the next
        replay."""
        entry = self._graphs.get(key)
        if entry is None:
            static = [h.to(device, copy=True) for h in inputs]
            warm_up(lambda: fn(*static), device)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            try:
                graph, out = capture(lambda: fn(*static), device, self._pool)
            except RuntimeError as e:  # not capturable here (e.g. a host sync): eager from now on
                warnings.warn(f"{self.owner}: capturing the draft failed ({e}); it runs eagerly from now on",
                              RuntimeWarning, stacklevel=3)
                self.enabled = False
                return fn(*static)
            entry = self._graphs[key] = (graph, static, out)
        graph, static, out = entry
        for dst, src in zip(static, inputs):
            if src.device.type == "cpu":  # from pageable memory the copy would wait for the stream (mimo_fn.upload)
                src = src.contiguous().pin_memory()  # (pin_memory refuses an expanded, stride-0 view)
            dst.copy_(src, non_blocking=True)
        graph.replay()
        return out

    def clear(self) -> None:
        """Drop every graph and their memory pool (captured again on first use). The next capture
        takes a new pool: torch's allocator refuses to capture into a pool whose graphs are all
        gone while its memory is not freed yet (seen with DFlashProposer on the H200)."""
        self._graphs.clear()
        self._pool = None
