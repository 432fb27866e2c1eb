"""Engine's colocated-RL calls: weight sync, memory release / resume, pausing generation.

Named and keyworded as SGLang's Engine names them (update_weights_from_tensor,
release_memory_occupation, ...), and mimo_fn.client.EngineClient carries the same methods over
HTTP, so a trainer moves between an in-process Engine and a server by one line.

Every call that changes the engine applies whole or not at all, on every rank of a mesh: each
rank first checks what it would do (names, shapes, dtypes, tags, a payload it cannot read),
the ranks agree over the mesh's host group, and only then does any rank write or free. A rank
that accepted a call another rank rejected raises RejectedElsewhere, so every rank raises
together and none waits in a collective that the others left.

The weight version ("0" at start) goes up by one with each update; an update may set it instead
(weight_version="step-7"), and one that is not a number gets "+1" appended by the next.
"""

import torch

from mimo_fn.checkpoint import load_checkpoint
from mimo_fn.model import renew
from mimo_fn.rl import transfer
from mimo_fn.rl.memory import TAGS
from mimo_fn.rl.weights import named_pairs, plan_params, plan_update, write_planned

# SGLang's memory tags and the engine's names for them (mimo_fn.rl.memory.TAGS)
SGLANG_TAGS = {"weights": "weights", "kv_cache": "kv_cache", "cuda_graph": "graphs"}
WEIGHT_UPDATE_GROUP = "weight_update_group"


class RejectedElsewhere(ValueError):
    """This rank accepted a call that another rank rejected (that rank's error says why)."""


def engine_tags(tags, what: str) -> tuple[str, ...] | None:
    """SGLang's tags ("cuda_graph"; the engine's "graphs" too) as the engine's; None stays None
    (every tag); a ValueError names an unknown one."""
    if tags is None:
        return None
    tags = [tags] if isinstance(tags, str) else list(tags)
    unknown = [t for t in tags if t not in SGLANG_TAGS and t not in TAGS]
    if unknown:
        raise ValueError(f"{what}: unknown memory tag {unknown[0]!r}; expected some of {list(SGLANG_TAGS)} "
                         "(or None: all of them)")
    return tuple(dict.fromkeys(SGLANG_TAGS.get(t, t) for t in tags))


def tensor_specs(names, dtypes, shapes, what: str = "update_weights_from_distributed") -> list:
    """[(name, torch dtype, shape)] from the parallel lists of /update_weights_from_distributed."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"{what}: {len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes; expected "
                         "one of each per tensor")
    specs = []
    for name, dt, shape in zip(names, dtypes, shapes):
        dtype = getattr(torch, str(dt).removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{what}: {name!r} has dtype {dt!r}; expected a torch dtype name such as 'bfloat16'")
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"{what}: {name!r} has shape {shape!r}; expected a list of sizes")
        specs.append((name, dtype, tuple(shape)))
    return specs


class RLApi:
    """The RL methods of mimo_fn.engine.engine.Engine (it mixes them in)."""

    def _init_rl(self) -> None:
        self.weight_version = "0"
        self._weight_groups: dict[str, tuple] = {}  # group_name -> (process group, backend, store)
        self._paused = False

    # ---- weights ----

    def update_weights(self, named_tensors) -> int:
        """RL weight sync: write (hub name, full tensor) pairs, or a dict of them (a state_dict), into
        the weights in place (same storage; FP8 and MXFP4 weights re-quantised in their own format).
        Call between generate calls. Returns the count. The prefix cache empties (its K/V is the old
        weights'; EngineConfig.prefix_cache)."""
        return self._update("update_weights", lambda: plan_update(
            self.state.params, self.cfg, named_pairs(named_tensors), self.state.mesh), None)

    def update_weights_from_tensor(self, named_tensors, load_format: str | None = None, flush_cache: bool = True,
                                   weight_version: str | None = None) -> None:
        """SGLang's name for update_weights: named_tensors is (hub name, tensor) pairs or a dict,
        a bucket (load_format="flattened_bucket": mimo_fn.rl.transfer.flatten), or either one as
        mimo_fn.rl.transfer.serialize made it (tensors by handle; the server passes each rank its
        string). The engine keeps no reference to them afterwards, so a trainer's shared memory
        goes when the trainer lets go. The prefix cache always empties, whatever flush_cache says:
        its K/V was computed with the old weights."""
        def plan():
            obj = transfer.deserialize(named_tensors) if isinstance(named_tensors, (str, bytes)) else named_tensors
            named = named_pairs(transfer.named_tensors(obj, load_format))
            return plan_update(self.state.params, self.cfg, named, self.state.mesh)

        self._update("update_weights_from_tensor", plan, weight_version)

    def update_weights_from_disk(self, model_path: str, flush_cache: bool = True,
                                 weight_version: str | None = None) -> None:
        """Every weight from a hub-layout checkpoint of this model (what load_checkpoint reads:
        bf16, FP8, MXFP4, fused qkv), each rank reading its own slices; quantised weights of the
        engine are re-quantised from the checkpoint's values. A checkpoint of another model
        (config.json differs) is a ValueError naming the field, before anything is written."""
        what = "update_weights_from_disk"

        def plan():
            try:
                cfg, new = load_checkpoint(model_path, dtype=self.state.params.embed.dtype, device="cpu",
                                           progress=False, mesh=self.state.mesh, quant="dequantize")
            except (ValueError, OSError) as e:
                raise ValueError(f"{what}: model_path {model_path!r}: {e}") from None
            if cfg != self.cfg:
                field = next(f for f in vars(cfg) if getattr(cfg, f) != getattr(self.cfg, f))
                raise ValueError(f"{what}: model_path {model_path!r} holds another model: its {field} is "
                                 f"{getattr(cfg, field)!r}, this engine's {getattr(self.cfg, field)!r}")
            return plan_params(self.state.params, self.cfg, new)

        self._update(what, plan, weight_version, everything=True)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = WEIGHT_UPDATE_GROUP, backend: str | None = None) -> None:
        """Join the process group of a trainer's weight broadcasts: the trainer is rank 0 (it
        hosts the group's store at master_address:master_port, mimo_fn.rl.transfer.init_trainer_group)
        and this engine's ranks are rank_offset + their world rank. backend: "nccl" (CUDA) or
        "gloo"; None: the one this engine's device takes. Returns once every rank of the group has
        joined (the trainer joins meanwhile, from another thread or process)."""
        what = "init_weights_update_group"
        cuda = self.state.params.embed.is_cuda
        rank, error = rank_offset + self.mesh.rank, None
        try:
            backend = backend or transfer.default_backend(cuda)
            if group_name in self._weight_groups:
                raise ValueError(f"{what}: group_name {group_name!r} exists already; destroy_weights_update_group "
                                 "first")
            if backend not in ("gloo", "nccl") or (backend == "nccl" and not cuda):
                raise ValueError(f"{what}: backend {backend!r}; expected 'gloo'" + (" or 'nccl'" if cuda else
                                 " (this engine runs on the CPU)"))
            if rank_offset < 1 or rank_offset + self.mesh.world > world_size:
                raise ValueError(f"{what}: rank_offset {rank_offset} and world_size {world_size}: the trainer is rank "
                                 f"0 and this engine's {self.mesh.world} ranks are rank_offset.. rank_offset + "
                                 f"{self.mesh.world - 1}, so expected 1 <= rank_offset <= world_size - "
                                 f"{self.mesh.world}")
        except ValueError as e:
            error = e
        self._agree(what, error)  # a rank that never joins would leave the others waiting for it
        try:
            store = transfer.engine_store(master_address, master_port, world_size)
            group = transfer.join_group(store, rank, world_size, backend, group_name)
        except (RuntimeError, OSError, ValueError) as e:  # no store there, a timeout, ...
            error = ValueError(f"{what}: rank {rank} could not join the group at {master_address}:{master_port} "
                               f"({type(e).__name__}: {e})")
        self._agree(what, error)
        self._weight_groups[group_name] = (group, backend, store)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = WEIGHT_UPDATE_GROUP, flush_cache: bool = True,
                                        weight_version: str | None = None) -> None:
        """Receive tensors that rank 0 of group_name (the trainer) broadcasts, one per name, in
        order, with the given dtypes and shapes, then write them as update_weights does. Every
        tensor is received before any check of its name or shape, so a bad one leaves neither the
        trainer nor the group stuck; a bad dtype name or group name fails before any, and the
        trainer's broadcast then waits for the group's timeout."""
        what = "update_weights_from_distributed"
        error, specs, group, backend = None, [], None, None
        try:
            if group_name not in self._weight_groups:
                raise ValueError(f"{what}: no group {group_name!r}; known: {sorted(self._weight_groups)} "
                                 "(init_weights_update_group first)")
            group, backend, _ = self._weight_groups[group_name]
            specs = tensor_specs(names, dtypes, shapes, what)
        except ValueError as e:
            error = e
        self._agree(what, error)
        device = self.state.params.embed.device if backend == "nccl" else torch.device("cpu")
        received = []
        try:
            for name, dtype, shape in specs:
                t = torch.empty(shape, dtype=dtype, device=device)
                transfer.broadcast(group, t)
                received.append((name, t))
        except RuntimeError as e:
            error = ValueError(f"{what}: the broadcast of {specs[len(received)][0]!r} failed ({e}); nothing "
                               "was written")

        def plan():
            if error is not None:
                raise error
            return plan_update(self.state.params, self.cfg, received, self.state.mesh)

        self._update(what, plan, weight_version)

    def destroy_weights_update_group(self, group_name: str = WEIGHT_UPDATE_GROUP) -> None:
        """Leave a group that init_weights_update_group joined."""
        error = None if group_name in self._weight_groups else ValueError(
            f"destroy_weights_update_group: no group {group_name!r}; known: {sorted(self._weight_groups)}")
        self._agree("destroy_weights_update_group", error)
        del self._weight_groups[group_name]

    def get_weight_version(self) -> str:
        return self.weight_version

    # ---- memory ----

    def release_memory_occupation(self, tags=None) -> None:
        """SGLang's name for release_memory: tags "weights", "kv_cache", "cuda_graph" (the engine's
        "graphs"); None: all. The weights' bytes are kept in host memory when
        EngineConfig.weights_cpu_backup says so; without, every weight must be written again
        (update_weights_*) after the resume, before the next generate."""
        what, error = "release_memory_occupation", None
        try:
            tags = engine_tags(tags, what)
            self._check_no_requests(what)
            self.memory.check_release(tags)
        except ValueError as e:
            error = e
        self._agree(what, error)
        self.release_memory(tags, backup=self.config.weights_cpu_backup)

    def resume_memory_occupation(self, tags=None) -> None:
        """SGLang's name for resume_memory (tags as release_memory_occupation's; None: every
        released one)."""
        what, error = "resume_memory_occupation", None
        try:
            tags = engine_tags(tags, what)
            missing = [t for t in tags or () if t not in self.memory.released]
            if missing:
                raise ValueError(f"{what}: {missing[0]!r} is not released (released: {list(self.memory.released)})")
        except ValueError as e:
            error = e
        self._agree(what, error)
        self.resume_memory(tags)

    def release_memory(self, tags=None, backup: bool = False) -> int:
        """Free the GPU memory behind tags ("weights", "kv_cache", "graphs"; None: all) for a
        colocated trainer; returns the bytes freed. backup=True keeps the weights' bytes in host
        memory (pinned on CUDA; the buffers stay with the engine for the next backup) so
        resume_memory restores them; without it, update_weights must rewrite every weight after
        resume_memory before the next generate. A draft model's (DFlashProposer's) context pages
        go with "kv_cache", and its weights with "weights", always through a host backup, since
        update_weights does not write them. A release drops the decode CUDA graphs (they hold the
        old addresses; captured again on first use), except with EngineConfig.memory_saver, which
        keeps every address and drops them only under "graphs"; a draft model's graphs go at any
        release. mimo_fn.rl.memory and mimo_fn.rl.vmm explain the two methods. The prefix cache's
        entries go (EngineConfig.prefix_cache). Weights memory-mapped from a checkpoint file
        (load_checkpoint on the CPU) cannot be freed: a ValueError before anything is touched,
        as while requests are queued or running (their next pass would read the freed memory)."""
        busy = sum(r.cohort is not None and not r.done for r in self._live.values())
        if busy:
            raise ValueError(f"release_memory: {busy} requests are queued or running; call it once they have "
                             "finished (flush_cache runs them to the end) or abort them")
        self.memory.check_release(tags)
        self._drop_cache()
        self._ahead = None  # (drafts read from memory about to go)
        freed = self.memory.release(tags, backup)
        self.state = renew(self.state)  # a state taken before the release is stale (its memory went)
        return freed

    def resume_memory(self, tags=None) -> None:
        """Bring back the memory of released tags (None: every released tag)."""
        self.memory.resume(tags)
        self.state = renew(self.state)

    # ---- generation ----

    def pause_generation(self) -> None:
        """Abort every request in flight (the next step() reports each with finish_reason
        "abort"); requests added from now on wait in the queue until continue_generation, and
        generate raises meanwhile."""
        for rid in list(self._live):
            self.abort(rid)
        self._paused = True

    def continue_generation(self) -> None:
        self._paused = False

    # ---- shared ----

    def _check_no_requests(self, what: str) -> None:
        live = [s for s in self.state.seqs if not self._caching(s)]
        if live:
            raise ValueError(f"{what}: {len(live)} sequences hold KV pages (requests in flight); call it between "
                             "generate calls")

    def _update(self, what: str, make_plan, weight_version: str | None, everything: bool = False) -> int:
        """Check (make_plan: plan_update's or plan_params' plan, or a ValueError), agree on every
        rank, then write; returns the count."""
        plan, error = None, None
        try:
            self._check_no_requests(what)
            if "weights" in self.memory.released:
                raise ValueError(f"{what}: the weights' memory is released; call resume_memory(['weights']) first "
                                 "(resume_memory_occupation over HTTP)")
            if weight_version is not None and not isinstance(weight_version, str):
                raise ValueError(f"{what}: weight_version = {weight_version!r}; expected a string or None")
            plan = make_plan()
        except ValueError as e:
            error = e
        self._agree(what, error)
        self._drop_cache()  # its K/V was computed with the old weights
        self._ahead = None  # drafts too
        count = write_planned(plan)
        if everything:
            self.memory.unsynced.clear()
        else:
            self.memory.unsynced.difference_update(entry[-1] for entry in plan)
        if weight_version is not None:
            self.weight_version = weight_version
        elif self.weight_version.isdecimal():
            self.weight_version = str(int(self.weight_version) + 1)
        else:
            self.weight_version += "+1"
        return count

    def _agree(self, what: str, error: ValueError | None) -> None:
        """Raise error; on a mesh first learn (one host all-gather) whether every rank had none,
        and raise RejectedElsewhere on the ranks that had none if another had one."""
        failed = []
        if self.mesh.world > 1:
            rows = self.mesh.agree_ints([int(error is None)], self.state.params.embed.device)
            failed = [r for r, row in enumerate(rows) if not row[0]]
        if error is not None:
            raise error
        if failed:
            raise RejectedElsewhere(f"{what}: rank(s) {failed} rejected it (their errors say why); nothing changed "
                                    "on any rank")
