"""The trainer's calls in the server's loop: weight updates, memory release / resume, pausing.

A command runs on every rank of the server, inside a pass (loop.py): rank 0 puts it in the pass
it broadcasts, each rank's Runner calls the engine method of the same name (mimo_fn.engine.rl_api,
which checks on every rank before any rank changes anything), and each rank's outcome comes back
with the pass's replies.

When a command runs, on rank 0's side (`Commands`):
- an update or a release waits until no request is in flight, as a flush does: requests that
  arrive meanwhile are held back, in order, and run after it. It waits at most its timeout, then
  fails naming it (nothing changed); abort_all_requests aborts those in flight first;
- pause_generation aborts every request in flight (finish_reason "abort") and holds new ones back
  until continue_generation; both take effect at the next pass, also ahead of an update that
  waits for requests in flight (a pause then ends its wait);
- while any memory is released, new requests are held back until the resume that brings all of
  it back;
- the other commands run one at a time, in the order they came.
"""

import concurrent.futures
import time
from collections import deque
from dataclasses import dataclass, field

from mimo_fn.engine.rl_api import RejectedElsewhere

# commands that need the engine idle first (they rewrite or free what running requests use)
WAIT_FOR_IDLE = ("update_weights_from_tensor", "update_weights_from_disk", "update_weights_from_distributed",
                 "release_memory_occupation")
ENGINE_COMMANDS = WAIT_FOR_IDLE + ("resume_memory_occupation", "init_weights_update_group",
                                   "destroy_weights_update_group")
LOOP_COMMANDS = ("pause_generation", "continue_generation")  # rank 0's loop alone carries these out


@dataclass(frozen=True)
class Command:
    """One trainer call: the engine method's name and keywords (for update_weights_from_tensor,
    serialized_named_tensors: one string per rank, or one for a 1-rank server)."""

    name: str
    kwargs: dict = field(default_factory=dict)
    timeout: float = 60.0  # seconds an update or release waits for the requests in flight
    abort_all: bool = False  # SGLang's abort_all_requests: abort them instead of waiting


@dataclass(frozen=True)
class Outcome:
    """One rank's result of a command, and the engine's state after it."""

    ok: bool
    message: str | None  # the error
    own: bool  # the error is this rank's own (not RejectedElsewhere: another rank's)
    weight_version: str
    released: tuple[str, ...]  # memory tags released now


def run_command(engine, command: Command) -> Outcome:
    """A command on this rank's engine (every rank runs it in the same pass)."""
    kwargs = dict(command.kwargs)
    if command.name == "update_weights_from_tensor":  # each rank opens its own handles
        strings = kwargs.pop("serialized_named_tensors")
        kwargs["named_tensors"] = strings[engine.mesh.rank] if len(strings) > 1 else strings[0]
    ok, message, own = True, None, True
    try:
        getattr(engine, command.name)(**kwargs)
    except RejectedElsewhere as e:
        ok, message, own = False, str(e), False
    except ValueError as e:
        ok, message = False, str(e)
    return Outcome(ok, message, own, engine.weight_version, tuple(engine.memory.released))


@dataclass
class Queued:
    command: Command
    fut: concurrent.futures.Future
    deadline: float
    aborted: bool = False  # abort_all_requests went out


class Commands:
    """Rank 0's side: the queue of commands, whether generation is paused, what memory is released."""

    def __init__(self, weight_version: str):
        self.queue: deque[Queued] = deque()
        self.paused = False
        self.released: tuple[str, ...] = ()
        self.weight_version = weight_version
        self._running: Queued | None = None  # the command of the pass in progress
        self._settle_after: list[concurrent.futures.Future] = []  # pause / continue: settled after their pass

    def add(self, command: Command, fut: concurrent.futures.Future) -> None:
        self.queue.append(Queued(command, fut, time.monotonic() + command.timeout))

    def holds_requests(self) -> bool:
        """New requests wait: a command is queued, generation is paused, or memory is released."""
        return bool(self.queue) or self.paused or bool(self.released)

    def take(self, busy: bool, in_flight) -> tuple[Command | None, list]:
        """(the command to run in this pass, or None; the sids to abort in it). in_flight: the
        sids in flight now."""
        aborts = []
        for q in [q for q in self.queue if q.command.name in LOOP_COMMANDS]:  # they do not queue behind an
            self.queue.remove(q)  # update that waits for the very requests a pause would abort
            if q.command.name == "pause_generation":
                aborts += [sid for sid in in_flight if sid not in aborts]
            self.paused = q.command.name == "pause_generation"
            self._settle_after.append(q.fut)
        while self.queue:
            q = self.queue[0]
            name = q.command.name
            if name in WAIT_FOR_IDLE and busy:
                if q.command.abort_all and not q.aborted:
                    q.aborted = True
                    aborts += [sid for sid in in_flight if sid not in aborts]
                elif time.monotonic() >= q.deadline:
                    self.queue.popleft()
                    settle(q.fut, error=ValueError(
                        f"{name}: requests were still in flight after {q.command.timeout:g} s (timeout); nothing "
                        "changed. Let them finish first, give a larger timeout, or abort_all_requests: true"))
                    continue
                return None, aborts
            self.queue.popleft()
            self._running = q
            return q.command, aborts
        return None, aborts

    def finish(self, outcomes: list[Outcome] | None) -> None:
        """After the pass: settle the command it ran with every rank's outcome (None: no command
        ran), and the pause / continue calls it carried out."""
        for fut in self._settle_after:
            settle(fut, None)
        self._settle_after = []
        if outcomes is None:
            return
        q, self._running = self._running, None
        first = outcomes[0]  # rank 0's: the ranks agree on what changed
        self.weight_version, self.released = first.weight_version, first.released
        if all(o.ok for o in outcomes):
            settle(q.fut, first.weight_version)
            return
        message = next((o.message for o in outcomes if not o.ok and o.own), None) or next(
            o.message for o in outcomes if not o.ok)
        settle(q.fut, error=ValueError(message))

    def failed_pass(self, error: BaseException, engine) -> None:
        """The pass raised on a 1-rank server: its pause / continue took effect, its command ends
        with error, and what the engine holds now is read from it."""
        for fut in self._settle_after:
            settle(fut, None)
        self._settle_after = []
        if self._running is not None:
            settle(self._running.fut, error=error)
            self._running = None
        self.weight_version, self.released = engine.weight_version, tuple(engine.memory.released)

    def fail(self, error: BaseException) -> None:
        """Every command waiting or running ends with error (the pass failed, the server stops)."""
        running = self._running
        futs = [q.fut for q in self.queue] + self._settle_after + ([running.fut] if running else [])
        self.queue.clear()
        self._settle_after, self._running = [], None
        for fut in futs:
            settle(fut, error=error)


def settle(fut: concurrent.futures.Future | None, value=None, error: BaseException | None = None) -> None:
    """Resolve a future its caller may have cancelled meanwhile (then nothing happens)."""
    if fut is None:
        return
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)
    except concurrent.futures.InvalidStateError:
        pass
