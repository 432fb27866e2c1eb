"""CUDA graphs for decode and verify steps: one captured forward per batch shape, replayed.

Legend: B sequences, Q tokens per sequence (1 in a decode step, 1 + drafts in a speculative
verify step), W page-table width (a power of two, at least the widest table of the step), V
vocabulary, L layers, K experts per token, H hidden.

A decode step launches several hundred kernels (per layer the norms, projections, rotary
embedding, KV write, attention, router, the MoE's alignment, GEMMs and sum), each with a few
microseconds of Python and driver work; at small batches the host then takes longer than the
GPU. `DecodeGraphs` captures a step's forward once per shape and replays it: per step the
host only copies the step's inputs (tokens, positions, KV lengths, page tables, KV slots) into
static buffers and launches one graph. It takes steps where every sequence feeds the same
Q <= MAX_TOKENS_PER_SEQ tokens; other steps (prompt chunks) run eagerly.

Shapes are bucketed so that a batch shrinking from 256 sequences to 1 (an RL rollout) needs
few captures: B is padded up to the next of BATCH_BUCKETS (past 256, the next multiple of 32:
`batch_bucket`) and the page tables to W. A padding
sequence repeats sequence 0 (its tokens, positions, KV slots and page table), so it computes
the same keys and values and writes them to the same slots, reads only live pages, and routes
to the same experts; its outputs are dropped.

The first step of a shape runs the forward eagerly (compiling and autotuning every kernel
outside the capture), captures it, and replays it: its KV writes go to the same slots twice
with the same values. The graphs share one memory pool for their intermediates, and their
inputs and outputs live in shared buffers (each graph uses a prefix), so memory does not grow
with the number of graphs; a step's outputs are copied out before the next replay. What stays
reserved is about the largest captured step's working memory (for a verify step of 256 x 16
tokens, the [4096, V] logits alone are 1.25 GB in bf16); `release_memory(["graphs"])` frees it.

A graph holds raw addresses: of the weights, the KV pools and its own buffers. Weight sync
writes in place, so graphs stay valid across it. `release_memory` drops every graph (resumed
memory may come back at new addresses; mimo_fn.rl.memory), and they are captured again on
first use; with EngineConfig(memory_saver=True) the addresses stay (mimo_fn.rl.vmm) and only a
release of "graphs" drops them. A step on another state (a new init_state, other params) drops them too (`bind`).

A forward that cannot be captured (one that syncs with the host, as the reference attention of
MIMO_FN_ATTENTION_REF=1 does) fails its first capture: a RuntimeWarning, and every step runs
eagerly from then on (`DecodeGraphs.failed` says why).

Numerics: the eager step's kernels on the same inputs, except for two things that can change
rounding (not the math): a padded batch has more rows, and cuBLAS picks its GEMM kernel by the
row count; decode attention sizes its key splits from B and the table width
(kernels/attention/decode.py), both padded here. Without padding an H200 gave the eager step's
logits bit for bit (docs/benchmarks.md). Replays are deterministic.

On a mesh the collectives are captured too, so every rank that shares one must replay a graph
of the same shape at the same step (or all run eagerly). That takes a mesh whose MoE dispatch
has fixed sizes: no EP, or Mesh.ep_dispatch "gather" (the all-to-all one syncs with the host
in every layer and is never captured). Where an EP group lies inside one DP group, its ranks
split the same batch and pick the same shape by themselves. Otherwise (EP across DP groups,
as in DP2 / TP4 / EP8) the ranks agree on each step first, in one small all-gather: the step
replays if every rank can (no DP group idle or in a prompt chunk, the same tokens per
sequence), at the largest batch bucket and table width of them all; else every rank runs it
eagerly. Every rank must pass the same all_logits / capture flags.
"""

import gc
import warnings
from dataclasses import dataclass, fields

import torch

from mimo_fn.batch import Batch, StepMeta
from mimo_fn.parallel.dp_attention import rows_per_rank
from mimo_fn.parallel.ep_gather import rows_agree

MIN_TABLE_WIDTH = 16  # pages: tables narrower than this share one graph width
MAX_TOKENS_PER_SEQ = 16  # a verify step of up to 15 drafts; longer uniform steps run eagerly
BATCH_BUCKETS = (1, 2, 4) + tuple(range(8, 257, 8))  # sequences per graph; larger batches: multiples of 32
_TOKEN_FIELDS = ("logits_TV", "routed_experts_TLK", "hidden_TLH")  # StepOutput fields with a row per token


def warm_up(fn, device: torch.device):
    """fn() run once eagerly before it is captured, on a side stream as torch asks: it compiles
    and autotunes every Triton kernel, which must not happen inside a capture."""
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        out = fn()
    torch.cuda.current_stream(device).wait_stream(side)
    return out


def capture(fn, device: torch.device, pool) -> tuple[torch.cuda.CUDAGraph, object]:
    """(a new CUDA graph of fn() in memory pool `pool`, what fn returned inside it). A forward
    that cannot be captured (one that syncs with the host) raises RuntimeError, after a
    synchronize."""
    graph = torch.cuda.CUDAGraph()
    # No garbage collection inside the capture: one could free an unreachable old graph (an
    # engine dropped in a reference cycle), and destroying a graph is an operation a capture
    # forbids: it fails and invalidates this capture (test_a_capture_survives_garbage_graphs).
    was_on = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
    except RuntimeError:
        torch.cuda.synchronize(device)
        raise
    finally:
        if was_on:
            gc.enable()
    return graph, out


def batch_bucket(num_seqs: int) -> int:
    """The graph batch size a step of num_seqs sequences pads to. Past 256 (EngineConfig.max_batch
    raised for RL rollouts) the next multiple of 32: a batch shrinking from 1024 to 257 sequences
    captures 24 graphs there, not one per size, and pads by at most 31 sequences (12% of 257)."""
    return next((b for b in BATCH_BUCKETS if b >= num_seqs), -(-num_seqs // 32) * 32)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None until captured
    q: int  # tokens per sequence
    tokens_T: torch.Tensor  # static inputs: [Bp*Q] (Bp = bucketed B), tables [Bp, W]
    meta: StepMeta
    out: object  # StepOutput whose tensors are views of the shared output buffers, Bp (or Bp*Q) rows
    moe_rows_T: torch.Tensor | None = None  # static [Bp*Q] bool: Batch.moe_rows_T, where the key has one

    def load(self, batch: Batch, meta: StepMeta) -> None:
        """Copy one step's inputs into the static buffers; padding rows repeat sequence 0."""
        s, q = self.meta, self.q
        n, w = batch.num_tokens, meta.full_table_BL.shape[1]
        num_seqs, pad = n // q, (self.tokens_T.numel() - n) // q
        rows = ((self.moe_rows_T, batch.moe_rows_T),) if self.moe_rows_T is not None else ()
        for dst, src in ((self.tokens_T, batch.tokens_T), (s.pos_T, meta.pos_T), (s.full_slot_T, meta.full_slot_T),
                         (s.swa_slot_T, meta.swa_slot_T), *rows):  # a row per token
            dst[:n].copy_(src, non_blocking=True)
            if pad:
                dst[n:].view(pad, q).copy_(dst[:q].expand(pad, q))
        s.kv_lens_B[:num_seqs].copy_(meta.kv_lens_B, non_blocking=True)
        for dst, src in ((s.full_table_BL, meta.full_table_BL), (s.swa_table_BL, meta.swa_table_BL)):
            dst[:num_seqs, :w].copy_(src, non_blocking=True)
            dst[:num_seqs, w:].fill_(-1)
        if pad:
            for dst in (s.kv_lens_B, s.full_table_BL, s.swa_table_BL):
                dst[num_seqs:].copy_(dst[:1].expand_as(dst[num_seqs:]))


def _shallow_fields(obj) -> dict:
    """A dataclass's fields by name (not recursing into them, as dataclasses.asdict does)."""
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


class DecodeGraphs:
    """Captured step forwards by shape; see the module docstring."""

    def __init__(self):
        self._graphs: dict[tuple, _Graph] = {}
        self._pool = None
        self._shared: dict[str, torch.Tensor] = {}  # name -> flat buffer whose prefixes the graphs use
        self._bound = None  # (weights, KV pools, their addresses) the graphs were captured against
        self.stats = {"captures": 0, "replays": 0}
        self.failed: str | None = None  # why a capture failed (every step then runs eagerly)

    def clear(self) -> None:
        """Drop every graph, the shared buffers and the memory pool (captured again on first use)."""
        self.failed = None
        self._graphs.clear()
        self._shared.clear()
        self._pool = None
        self._bound = None

    def bind(self, state, cache) -> None:
        """Drop the graphs when the step's weights or KV pools are not the ones they were captured
        against: another state (a new init_state, other params), or memory that came back at new
        addresses. Holds the bound objects, so their ids stay theirs while compared."""
        objs = (state.params, cache.full.k, cache.swa.k)
        ptrs = tuple(t.data_ptr() for t in (state.params.embed, *cache.full.k[:1], *cache.swa.k[:1]))
        if self._bound is not None and all(a is b for a, b in zip(objs, self._bound[0])) and ptrs == self._bound[1]:
            return
        if self._graphs:
            self.clear()
        self._bound = (objs, ptrs)

    def __len__(self) -> int:
        return len(self._graphs)

    @staticmethod
    def usable(state, batch: Batch, meta: StepMeta) -> bool:
        """On CUDA, a mesh whose collectives have fixed sizes (module docstring), and every
        sequence feeds the same Q <= MAX_TOKENS_PER_SEQ tokens."""
        num_seqs, q, mesh = len(batch.seq_ids), meta.max_q_len, state.mesh
        return (state.params.embed.is_cuda and (mesh.ep == 1 or mesh.ep_dispatch == "gather") and num_seqs > 0
                and q <= MAX_TOKENS_PER_SEQ and batch.num_tokens == num_seqs * q)

    @staticmethod
    def agree_on(mesh) -> bool:
        """Whether this mesh's ranks agree on every step's graph shape (EP across DP groups with
        the "gather" dispatch): then every rank's every step must go through `run`."""
        return mesh.world > 1 and not rows_agree(mesh) and mesh.ep_dispatch == "gather"

    def _shape(self, state, batch: Batch, meta: StepMeta) -> tuple[int, int] | None:
        """(batch bucket, table width) of the graph this step replays, or None: run it eagerly.
        Ranks whose EP group spans DP groups agree on it in one all-gather (a host sync)."""
        ok = not self.failed and self.usable(state, batch, meta)
        num_seqs, q, w = len(batch.seq_ids), meta.max_q_len, meta.full_table_BL.shape[1]
        if self.agree_on(state.mesh):
            rows = state.mesh.agree_ints([int(ok), num_seqs, q, w], state.params.embed.device)
            ok = all(r[0] for r in rows) and len({r[2] for r in rows}) == 1
            num_seqs, w = max(r[1] for r in rows), max(r[3] for r in rows)
        if not ok:
            return None
        return batch_bucket(num_seqs), max(MIN_TABLE_WIDTH, 1 << (w - 1).bit_length())

    def run(self, run_layers, state, batch: Batch, cache, meta: StepMeta, all_logits: bool, capture_experts: bool,
            capture_hidden=()):
        """`run_layers(state, batch, cache, meta, ...)` (model._run_layers), replayed from a
        graph where `usable` (on a mesh: on every rank), else run eagerly."""
        shape = self._shape(state, batch, meta)
        if shape is None:
            return run_layers(state, batch, cache, meta, all_logits, capture_experts, capture_hidden)
        self.bind(state, cache)
        num_seqs, (bucket, width) = len(batch.seq_ids), shape
        key = (bucket, meta.max_q_len, width, bool(all_logits), bool(capture_experts), tuple(capture_hidden),
               batch.moe_rows_T is not None)
        g = self._graphs.get(key)
        if g is None:
            g = self._capture(run_layers, state, batch, cache, meta, key)
        if g is None:  # the forward cannot be captured here: eager from now on
            return run_layers(state, batch, cache, meta, all_logits, capture_experts, capture_hidden)
        g.load(batch, meta)
        g.graph.replay()
        self.stats["replays"] += 1
        out = {name: None if t is None else t[:num_seqs * meta.max_q_len if name in _TOKEN_FIELDS else num_seqs].clone()
               for name, t in _shallow_fields(g.out).items()}
        return type(g.out)(**out)

    def _buffer(self, name: str, shape, dtype: torch.dtype, device) -> torch.Tensor:
        """A prefix of the shared buffer `name` viewed as `shape`; a bigger buffer (doubled) for
        this and later captures when it is too small (graphs keep the one they captured)."""
        numel = 1
        for d in shape:
            numel *= d
        buf = self._shared.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            grown = max(numel, 2 * buf.numel()) if buf is not None and buf.dtype == dtype else numel
            buf = self._shared[name] = torch.empty(grown, dtype=dtype, device=device)
        return buf[:numel].view(shape)

    def _capture(self, run_layers, state, batch: Batch, cache, meta: StepMeta, key) -> _Graph | None:
        """The graph of `key`, captured after one eager run of this step; None (and a warning)
        when the forward cannot be captured, e.g. a reference path that reads lengths on the
        host (MIMO_FN_ATTENTION_REF=1)."""
        padded, q, width, all_logits, capture_experts, capture_hidden, masked = key
        dev = meta.pos_T.device
        rows = padded * q
        static = StepMeta(
            pos_T=self._buffer("pos", (rows,), meta.pos_T.dtype, dev),
            cu_q_B1=torch.arange(0, rows + 1, q, dtype=torch.int32, device=dev),  # constant: its own
            kv_lens_B=self._buffer("kv_lens", (padded,), meta.kv_lens_B.dtype, dev),
            full_table_BL=self._buffer("full_table", (padded, width), torch.int32, dev),
            swa_table_BL=self._buffer("swa_table", (padded, width), torch.int32, dev),
            full_slot_T=self._buffer("full_slot", (rows,), meta.full_slot_T.dtype, dev),
            swa_slot_T=self._buffer("swa_slot", (rows,), meta.swa_slot_T.dtype, dev), max_q_len=q)
        g = _Graph(None, q, self._buffer("tokens", (rows,), torch.long, dev), static, None,
                   self._buffer("moe_rows", (rows,), torch.bool, dev) if masked else None)
        g.load(batch, meta)
        static_batch = Batch(tuple(range(padded)), g.tokens_T, (q,) * padded, moe_rows_T=g.moe_rows_T)

        mesh = state.mesh  # every rank of the EP group runs padded * q tokens: their rows agree
        ep_rows = rows_per_rank(rows, mesh) if mesh.ep > 1 else None

        def forward():
            return run_layers(state, static_batch, cache, static, all_logits, capture_experts, capture_hidden,
                              ep_rows=ep_rows)

        eager = warm_up(forward, dev)
        outs = {name: None if t is None else self._buffer("out_" + name, t.shape, t.dtype, dev)
                for name, t in _shallow_fields(eager).items()}
        out_type = type(eager)
        del eager

        def forward_into_outs():  # the forward's own outputs are pool memory, freed once captured
            for name, t in _shallow_fields(forward()).items():
                if t is not None:
                    outs[name].copy_(t)

        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        try:
            g.graph, _ = capture(forward_into_outs, dev, self._pool)
        except RuntimeError as e:  # e.g. a host sync inside the forward: not capturable
            self.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            warnings.warn(f"DecodeGraphs: capturing a step failed ({self.failed}); steps run eagerly from now on",
                          RuntimeWarning, stacklevel=2)
            return None
        g.out = out_type(**outs)
        self._graphs[key] = g
        self.stats["captures"] += 1
        return g
