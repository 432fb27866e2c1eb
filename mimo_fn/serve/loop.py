"""The engine behind the server: one thread owns the Engine (it is not thread-safe) and runs passes.

Each pass, the loop drains what the HTTP handlers asked for (add / abort / flush / info), plans
it, runs it (adds, aborts, then one `engine.step()` while anything is in flight) and hands each
request its new tokens: one `call_soon_threadsafe` per pass carries every request's delta into its
Stream (not one per request: a self-pipe write each, between two steps). Requests beyond what the
pool holds wait in the engine's queue; none is dropped.

On a mesh (torchrun) rank 0 plans and every rank runs the pass: the plan goes from rank 0 to all
(`broadcast_object_list` over the mesh's gloo host group), the TP ranks of the DP group a request
is given to add it (DP groups take requests least loaded first), every rank steps together, and
what each DP group's first rank saw comes back to rank 0 (`gather_object`). Requests are known to
the loop by a server id (`sid`), since each DP group's engine numbers its own.

A flush stops admitting new requests (they wait here, in order), runs those in flight to their
end for at most its timeout, then empties the prefix cache on every rank once none is left.
A trainer's calls (weight updates, memory release / resume, pause) run on every rank too, in a
pass of their own choosing (commands.py says when).
"""

import asyncio
import concurrent.futures
import logging
import queue
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from mimo_fn.layers.sampling import SamplingParams
from mimo_fn.serve.commands import Command, Commands, Outcome, run_command
from mimo_fn.serve.commands import settle as _settle

log = logging.getLogger("mimo_fn.serve")
HEARTBEAT_S = 60.0  # an idle mesh still passes this often: the ranks' blocking broadcast never times out


class EngineError(RuntimeError):
    """A pass failed: the requests it ran end with this (the server answers 500)."""


@dataclass(frozen=True)
class Job:
    """One request as the engine takes it (Engine.add_request's arguments)."""

    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams | None  # None: greedy
    return_logprobs: bool = False
    return_routed_experts: bool = False
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Delta:
    """What one pass gave a request: its new tokens, and once it finished, the rest of its result."""

    tokens: list[int]
    logprobs: list[float] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"; "error" when the engine failed
    prompt_logprobs: list[float] | None = None  # at the finish, when asked
    routed_experts: torch.Tensor | None = None  # [prompt + generated - 1, MoE layers, K] int32, at the finish
    error: str | None = None  # finish_reason "error": what failed


def engine_sampling(temperature: float, top_p: float, top_k: int, seed: int | None) -> SamplingParams | None:
    """The engine's sampling of an API request: temperature 0 is greedy (None); top_k -1 (no
    limit) is the engine's 0; a request without a seed draws from a fresh one."""
    if temperature == 0:
        return None
    return SamplingParams(temperature=float(temperature), top_k=max(top_k, 0), top_p=float(top_p),
                          seed=seed if seed is not None else random.getrandbits(63))


class Stream:
    """A request's side of the loop: its server id and the deltas that arrived for it, for one reader
    (a deque and its future: cheaper per token than an asyncio.Queue)."""

    def __init__(self, sid: int):
        self.sid = sid
        self.finished = False
        self._deltas: deque[Delta] = deque()
        self._waiter: asyncio.Future | None = None

    def put(self, delta: Delta) -> None:  # on the event loop's thread
        self._deltas.append(delta)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next(self) -> Delta:
        while not self._deltas:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        delta = self._deltas.popleft()
        self.finished = delta.finish_reason is not None
        return delta


@dataclass(frozen=True)
class Pass:
    """What rank 0 asks every rank to do in one pass."""

    adds: tuple = ()  # (sid, DP group, Job)
    aborts: tuple = ()  # (sid, DP group)
    step: bool = False
    flush: float | None = None  # timeout: empty the prefix cache (nothing is in flight)
    info: bool = False
    command: Command | None = None  # a trainer's call, run on every rank after the step
    stop: bool = False


@dataclass
class Reply:
    """What one DP group's first rank reports after a pass."""

    errors: dict = field(default_factory=dict)  # sid -> ValueError message of a rejected add
    deltas: list = field(default_factory=list)  # (sid, Delta)
    busy: bool = False
    info: dict | None = None
    flushed: bool | None = None
    command: Outcome | None = None  # every rank's, not only a DP group's first


class Transport:
    """One rank: the plan and the replies go nowhere."""

    world = 1

    def broadcast(self, plan: Pass | None) -> Pass:
        return plan

    def gather(self, reply: Reply) -> list[Reply]:
        return [reply]


class MeshTransport(Transport):
    """Rank 0's plan to every rank, every rank's reply to rank 0, over a gloo group."""

    def __init__(self, group, world: int, rank: int):
        self.group, self.world, self.rank = group, world, rank

    def broadcast(self, plan: Pass | None) -> Pass:
        import torch.distributed as dist

        box = [plan]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, reply: Reply) -> list[Reply] | None:
        import torch.distributed as dist

        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(reply, out, dst=0, group=self.group)
        return out


class Runner:
    """What every rank does with a pass: its engine, its DP group's requests (sid <-> engine rid)."""

    def __init__(self, engine, dp_rank: int = 0, tp_rank: int = 0):
        self.engine, self.dp_rank, self.tp_rank = engine, dp_rank, tp_rank
        self.rid_of: dict[int, int] = {}
        self.sid_of: dict[int, int] = {}

    def run(self, plan: Pass) -> Reply:
        reply = Reply()
        for sid, group, job in plan.adds:
            if group != self.dp_rank:
                continue
            try:
                rid = self.engine.add_request(job.prompt, max_new_tokens=job.max_new_tokens, sampling=job.sampling,
                                              return_logprobs=job.return_logprobs,
                                              return_routed_experts=job.return_routed_experts,
                                              stop_token_ids=job.stop_token_ids)
            except ValueError as e:
                reply.errors[sid] = str(e)
                continue
            self.rid_of[sid], self.sid_of[rid] = rid, sid
        for sid, group in plan.aborts:
            if group == self.dp_rank and sid in self.rid_of:
                self.engine.abort(self.rid_of[sid])
        if plan.step:
            for ro in self.engine.step():
                sid = self.sid_of.get(ro.rid)
                if sid is None:  # not a server request (none today; kept out of the replies)
                    continue
                out = ro.output if ro.finished else None
                reply.deltas.append((sid, Delta(
                    list(ro.tokens), None if ro.logprobs is None else list(ro.logprobs), ro.finish_reason,
                    None if out is None else out.prompt_logprobs, None if out is None else out.routed_experts)))
                if ro.finished:
                    del self.sid_of[ro.rid], self.rid_of[sid]
        if plan.flush is not None:
            reply.flushed = bool(self.engine.flush_cache(timeout=plan.flush))
        if plan.info:
            reply.info = dict(self.engine.server_info())
        if plan.command is not None:
            reply.command = run_command(self.engine, plan.command)
        reply.busy = bool(self.engine.has_unfinished())
        # a group's ranks agree: one reports (a command's outcome: each rank, its error may be its own)
        return reply if self.tp_rank == 0 else Reply(busy=reply.busy, command=reply.command)


def follow(runner: Runner, transport: Transport, warmup: bool) -> None:
    """A rank other than 0: run rank 0's passes until it says stop."""
    if warmup:
        runner.engine.warmup()
    while True:
        plan = transport.broadcast(None)
        if plan.stop:
            return
        transport.gather(runner.run(plan))


def merge_info(infos: list[dict]) -> dict:
    """server_info of the whole server from each DP group's: counts and pages add up."""
    if len(infos) == 1:
        return dict(infos[0])
    out = dict(infos[0])
    for key in ("num_running_reqs", "num_waiting_reqs", "num_used_pages", "num_free_pages", "num_total_pages",
                "max_total_num_tokens", "prefix_cache_entries"):
        if all(isinstance(i.get(key), int) for i in infos):
            out[key] = sum(i[key] for i in infos)
    accept = [i["avg_spec_accept_length"] for i in infos if i.get("avg_spec_accept_length") is not None]
    out["avg_spec_accept_length"] = sum(accept) / len(accept) if accept else None
    out["dp_groups"] = infos
    return out


class EngineLoop:
    """Rank 0's loop thread (the only one on one rank) and the asyncio side's handle on it."""

    def __init__(self, runner: Runner, transport: Transport | None = None, dp_size: int = 1, tp_size: int = 1,
                 warmup: bool = True, device: torch.device | None = None):
        self.runner, self.transport = runner, transport or Transport()
        self.dp_size, self.tp_size, self.warmup, self.device = dp_size, tp_size, warmup, device
        self.ready = threading.Event()  # warmed up
        self.failed: str | None = None  # the engine raised: what (the server reports unhealthy)
        self._commands: queue.Queue = queue.Queue()
        self._aio: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._next_sid = 0
        self._sid_lock = threading.Lock()
        # loop-thread state
        self._streams: dict[int, Stream] = {}
        self._group_of: dict[int, int] = {}  # sid -> its DP group
        self._load = [0] * dp_size  # requests in flight per DP group
        self._assigned = [0] * dp_size  # requests given to each DP group since the start
        self._busy = False  # some rank had work after the last pass
        self._deferred: list = []  # adds held back while a flush waits
        self._flush: tuple[float, list[concurrent.futures.Future]] | None = None  # (deadline, its callers)
        self._outbox: list[tuple[Stream, Delta]] = []  # this pass's deltas, posted to the asyncio side at its end
        self.commands = Commands(runner.engine.weight_version)  # a trainer's calls (commands.py)

    # ---- the asyncio side (any thread) ----
    def start(self, aio: asyncio.AbstractEventLoop) -> None:
        self._aio = aio
        self._thread = threading.Thread(target=self._main, name="mimo_fn-engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(("stop", None, None))
            self._thread.join(timeout)

    def new_sid(self) -> int:
        with self._sid_lock:
            self._next_sid += 1
            return self._next_sid

    async def submit(self, job: Job, sid: int) -> Stream:
        """Queue a request under a sid from new_sid(); a ValueError if the engine rejects it (nothing
        admitted). A caller cancelled while it waits must abort(sid): it may be admitted already."""
        self._check_alive()
        stream = Stream(sid)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("add", (stream, job), fut))
        await asyncio.wrap_future(fut)
        return stream

    def abort(self, sid: int) -> None:
        """Abort a request (its pages come back at once); its stream then ends with "abort"."""
        self._commands.put(("abort", sid, None))

    async def flush(self, timeout: float) -> bool:
        """Wait (at most timeout s) until no request is in flight, then empty the prefix cache."""
        self._check_alive()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("flush", timeout, fut))
        return await asyncio.wrap_future(fut)

    async def command(self, command: Command) -> str:
        """Run a trainer's call on every rank when its turn comes (commands.py); the weight version
        after it, or a ValueError with the reason it failed (nothing changed)."""
        self._check_alive()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("command", command, fut))
        return await asyncio.wrap_future(fut)

    @property
    def weight_version(self) -> str:
        return self.commands.weight_version

    async def info(self) -> dict:
        self._check_alive()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("info", None, fut))
        return await asyncio.wrap_future(fut)

    def _check_alive(self) -> None:
        if self.failed is not None:
            raise RuntimeError(f"the engine failed: {self.failed}")

    # ---- the loop thread ----
    def _main(self) -> None:
        try:
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # the current device is per thread
            if self.warmup:
                t0 = time.perf_counter()
                self.runner.engine.warmup()
                log.info("warmed up in %.1f s", time.perf_counter() - t0)
            self.ready.set()
            while self._pass():
                self._post()  # a pass that stops or raises ends in _fail_all, which posts
        except BaseException as e:  # the engine raised: fail everything in flight, report unhealthy
            log.exception("the engine loop failed")
            self.failed = f"{type(e).__name__}: {e}"
            self._fail_all()

    def _take(self) -> list:
        """The commands waiting now; blocks for the first one while nothing runs."""
        cmds = []
        admissible = self._deferred and not self.commands.holds_requests()
        if not self._busy and not admissible and self._flush is None and not self.commands.queue:
            try:
                cmds.append(self._commands.get(timeout=HEARTBEAT_S if self.transport.world > 1 else None))
            except queue.Empty:
                return cmds
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _pass(self) -> bool:
        """Plan, run and dispatch one pass (its deltas posted after it); False once told to stop."""
        adds, aborts, infos, stop = [], [], [], False
        for kind, arg, fut in self._take():
            if kind == "add":
                self._deferred.append((arg, fut))
            elif kind == "abort" and arg in self._group_of:
                aborts.append((arg, self._group_of[arg]))
            elif kind == "abort":  # not admitted yet (held back by a flush): it never will be
                self._abort_deferred(arg)
            elif kind == "flush":
                if self._flush is not None:  # one at a time: a later one shares the pending one's deadline
                    self._flush[1].append(fut)
                else:
                    self._flush = (time.monotonic() + arg, [fut])
            elif kind == "info":
                infos.append(fut)
            elif kind == "command":
                self.commands.add(arg, fut)
            elif kind == "stop":
                stop = True
        if self._flush is not None and self._busy and time.monotonic() >= self._flush[0]:
            for fut in self._flush[1]:
                _settle(fut, False)  # requests still in flight: nothing emptied
            self._flush = None
        command, stopping = self.commands.take(self._busy, list(self._group_of))
        aborts += [(sid, self._group_of[sid]) for sid in stopping if (sid, self._group_of[sid]) not in aborts]
        flush = None
        if self._flush is not None and not self._busy:
            flush = max(0.0, self._flush[0] - time.monotonic())
        elif self._flush is None and command is None and not self.commands.holds_requests():
            load = list(self._load)
            for (stream, job), fut in self._deferred:
                if fut.set_running_or_notify_cancel():  # else its caller is gone (it aborts the sid too)
                    group = min(range(self.dp_size), key=lambda g: load[g])
                    load[group] += 1
                    adds.append((stream.sid, group, job, stream, fut))
            self._deferred = []
        plan = Pass(tuple((sid, g, job) for sid, g, job, _, _ in adds), tuple(aborts),
                    step=self._busy or bool(adds) or bool(aborts), flush=flush, info=bool(infos), command=command,
                    stop=stop)
        plan = self.transport.broadcast(plan)
        if stop:
            self.failed = "the server is shutting down"
            for *_, fut in adds:
                fut.set_exception(RuntimeError(self.failed))
            self._fail_all()
            return False
        try:
            every = self.transport.gather(self.runner.run(plan))
        except Exception as e:
            if self.transport.world > 1:  # the ranks may disagree on what ran: the server stops serving
                raise
            self._pass_failed(e, adds, infos)
            return True
        replies = every[::self.tp_size]  # each DP group's first rank
        self.commands.finish([r.command for r in every] if command is not None else None)
        errors = {sid: msg for r in replies for sid, msg in r.errors.items()}
        for sid, group, _, stream, fut in adds:
            if sid in errors:
                fut.set_exception(ValueError(errors[sid]))
            else:
                self._streams[sid], self._group_of[sid] = stream, group
                self._load[group] += 1
                self._assigned[group] += 1
                fut.set_result(None)
        for r in replies:
            for sid, delta in r.deltas:
                self._deliver(sid, delta)
        self._busy = any(r.busy for r in replies)
        if flush is not None:
            for fut in self._flush[1]:
                _settle(fut, all(r.flushed for r in replies))
            self._flush = None
        if infos:
            merged = {**merge_info([r.info for r in replies]), "dp_requests_total": list(self._assigned)}
            for fut in infos:
                _settle(fut, merged)
        return True

    def _pass_failed(self, e: Exception, adds: list, infos: list) -> None:
        """A pass raised on one rank: the engine dropped every request in flight and stays usable
        (Engine.step), so those requests end with the error and the loop goes on."""
        log.exception("a pass failed; the requests in flight end with its error")
        msg = f"the engine failed on this pass: {type(e).__name__}: {e}"
        for *_, fut in adds:
            _settle(fut, error=EngineError(msg))
        for fut in infos:
            _settle(fut, error=EngineError(msg))
        self.commands.failed_pass(EngineError(msg), self.runner.engine)
        for sid in list(self._streams):
            self._deliver(sid, Delta([], finish_reason="error", error=msg))
        self.runner.rid_of.clear()
        self.runner.sid_of.clear()
        self._busy = bool(self.runner.engine.has_unfinished())

    def _abort_deferred(self, sid: int) -> None:
        for (stream, job), fut in [d for d in self._deferred if d[0][0].sid == sid]:
            self._deferred.remove(((stream, job), fut))
            if fut.set_running_or_notify_cancel():  # its caller still waits: it hears the abort
                self._streams[sid], self._group_of[sid] = stream, 0
                self._load[0] += 1
                fut.set_result(None)
                self._deliver(sid, Delta([], finish_reason="abort"))

    def _deliver(self, sid: int, delta: Delta) -> None:
        """Queue a request's delta for the asyncio side (`_post` sends them)."""
        stream = self._streams.get(sid)
        if stream is None:
            return
        if delta.finish_reason is not None:
            del self._streams[sid]
            self._load[self._group_of.pop(sid)] -= 1
        self._outbox.append((stream, delta))

    def _post(self) -> None:
        """The deltas queued since the last post into their streams, in order, in one call."""
        if not self._outbox:
            return
        batch, self._outbox = self._outbox, []
        try:
            self._aio.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the event loop is closed: the server is gone
            pass

    def _fail_all(self) -> None:
        msg = self.failed or "the engine loop stopped"
        for sid in list(self._streams):
            self._deliver(sid, Delta([], finish_reason="error", error=msg))
        pending = [fut for _, fut in self._deferred] + (self._flush[1] if self._flush is not None else [])
        self._deferred, self._flush = [], None
        while True:
            try:
                pending.append(self._commands.get_nowait()[2])
            except queue.Empty:
                break
        for fut in pending:
            _settle(fut, error=RuntimeError(msg))
        self.commands.fail(RuntimeError(msg))
        self._post()


def _put_all(batch: list[tuple[Stream, Delta]]) -> None:  # on the event loop's thread
    for stream, delta in batch:
        stream.put(delta)
