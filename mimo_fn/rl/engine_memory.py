"""An engine's memory by tag while a colocated trainer has it: what each release took, the host
buffers its backups keep for the next one, and which weights must be rewritten before the next
generate. Engine.release_memory / resume_memory / update_weights drive it; the two ways a tag is
freed are in mimo_fn.rl.memory (storages resized to 0) and mimo_fn.rl.vmm (pages unmapped, the
addresses kept, with EngineConfig.memory_saver)."""

import torch

from mimo_fn.rl import memory, vmm
from mimo_fn.rl.weights import hub_names


class EngineMemory:
    def __init__(self, engine, saver: bool):
        self.engine = engine
        self.released: dict[str, list[memory.Released]] = {}  # tag -> what release took (its parts)
        self.unsynced: set[str] = set()  # hub names to rewrite after weights resumed without backup
        self.backups: list[torch.Tensor] | None = None  # host buffers of the last weight backup, for reuse
        self.draft_weights: memory.Released | None = None  # a draft model's weights while released
        self.draft_backups: list[torch.Tensor] | None = None  # their host buffers, for reuse
        self.saver = vmm.Saver(engine.state.params.embed.device) if saver else None
        if self.saver is not None:  # before any graph holds their addresses; fresh pages hold nothing
            self.saver.adopt("weights", memory.tagged_tensors(engine.state, "weights"))
            self.saver.adopt("kv_cache", memory.tagged_tensors(engine.state, "kv_cache"), keep_bytes=False)

    def tagged(self, tag: str) -> list[torch.Tensor]:
        """The tensors behind a memory tag: the state's (mimo_fn.rl.memory), and under "kv_cache"
        a draft model's context pages (Proposer.kv_cache_tensors, e.g. DFlashProposer's)."""
        tensors = memory.tagged_tensors(self.engine.state, tag)
        proposer = self.engine.proposer
        if tag == "kv_cache":
            tensors = tensors + proposer.kv_cache_tensors()
        return tensors

    def check_release(self, tags) -> tuple[str, ...]:
        """The checks of `release` that need no prefix cache dropped first: Engine.release_memory
        runs them before it touches anything. Returns the tags."""
        tags = memory.check_tags(tags, "release_memory")
        again = [t for t in tags if t in self.released]
        if again:
            raise ValueError(f"release_memory: {again[0]!r} is released already")
        for tag in tags:
            try:
                memory.storages_of(self.tagged(tag) + (self.engine.proposer.weight_tensors() if tag == "weights"
                                                       else []))
            except ValueError as e:
                raise ValueError(f"release_memory: the {tag!r} tensors cannot be freed ({e}). load_checkpoint on "
                                 "the CPU maps the weights from the file; copy them first, e.g. params = "
                                 "torch.utils._pytree.tree_map(torch.clone, params), or load them to a GPU") from None
        return tags

    def release(self, tags, backup: bool) -> int:
        """Engine.release_memory (its docstring); returns the bytes freed."""
        engine, proposer = self.engine, self.engine.proposer
        tags = self.check_release(tags)
        if engine.state.seqs:  # generate frees every sequence it made; these came from elsewhere
            raise ValueError(f"release_memory: {len(engine.state.seqs)} sequences hold KV pages")
        draft_weights = proposer.weight_tensors() if "weights" in tags else []
        for tensors in [self.tagged(tag) for tag in tags] + [draft_weights]:  # all checked before anything is freed
            memory.storages_of(tensors)
        freed = 0
        draft_graphs = proposer.has_graphs  # a draft model's (DFlashProposer): its tensors move
        drop = engine.graphs is not None and len(engine.graphs) and (self.saver is None or "graphs" in tags)
        if draft_graphs or drop:
            cuda = engine.state.params.embed.is_cuda
            reserved = torch.cuda.memory_reserved() if cuda else 0
            if draft_graphs:
                proposer.clear_graphs()
            if drop:
                engine.graphs.clear()
            if cuda:  # the graphs' pools, now cached, back to the driver
                torch.cuda.empty_cache()
                freed += reserved - torch.cuda.memory_reserved()
        for tag in tags:
            keep = backup and tag == "weights"
            reuse = self.backups if keep else None
            tensors = self.tagged(tag)
            n = len(memory.tagged_tensors(engine.state, tag)) if self.saver and tag in self.saver.tags else 0
            # the saver's storages (the state's) are paused in place; the rest (a draft's pages) resized to 0
            parts = [memory.release(tensors[:n], keep, reuse, saver=self.saver, tag=tag)] if n else []
            self.released[tag] = parts + [memory.release(tensors[n:], keep and not n, reuse)]
            freed += sum(p.total_bytes for p in self.released[tag])
        if draft_weights:
            self.draft_weights = memory.release(draft_weights, backup=True, reuse=self.draft_backups)
            freed += self.draft_weights.total_bytes
        return freed

    def resume(self, tags) -> None:
        """Engine.resume_memory."""
        tags = tuple(self.released) if tags is None else memory.check_tags(tags, "resume_memory")
        missing = [t for t in tags if t not in self.released]
        if missing:
            raise ValueError(f"resume_memory: {missing[0]!r} is not released (released: {tuple(self.released)})")
        for tag in tags:
            parts = self.released.pop(tag)
            for part in parts:
                memory.resume(part)
            if tag == "weights" and parts[0].backups is None:
                self.unsynced = hub_names(self.engine.cfg, self.engine.state.mesh)
            elif tag == "weights":
                self.backups = parts[0].backups
            if tag == "weights" and self.draft_weights is not None:
                memory.resume(self.draft_weights)
                self.draft_backups, self.draft_weights = self.draft_weights.backups, None

    def check(self, what: str) -> None:
        """A ValueError if `what` (a generate) would read released or not yet rewritten memory."""
        if self.released:
            raise ValueError(f"{what}: memory is released for {tuple(self.released)}; call resume_memory first")
        if self.unsynced:
            raise ValueError(f"{what}: the weights were resumed without a backup and {len(self.unsynced)} of them "
                             f"are not rewritten yet (e.g. {min(self.unsynced)!r}); call update_weights with them")
