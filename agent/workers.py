"""The workers an agent runs, as its ``GetStatus`` and ``WatchWorkers`` RPCs show them.

:class:`WorkerBoard` keeps the latest :class:`~spiderflow.proto.agent.v1.agent_pb2.WorkerStatus` of every
worker process (one per rank) of the attempts this agent runs or ran, and fans every change out to its
watchers. The executor (:mod:`agent.executor`) is its only writer:

- ``STARTING`` when a rank's launch was accepted by the workload manager;
- ``RUNNING`` from its first step event on, with ``step`` following every step it reports;
- ``SUCCEEDED`` when it exited 0 after its ``done`` event; ``FAILED`` with its exit code and error
  otherwise (a launch the workload manager refused fails every rank of the group);
- ``STOPPED`` when the agent stopped it (the assignment was removed, a newer attempt replaced it, the
  scheduler asked to stop, the agent is shutting down).

Training progress (the step events the executor forwards to the scheduler) is fanned out too, not kept.

Watchers get a bounded queue (:data:`WATCH_QUEUE`). A watcher that falls that far behind is dropped
rather than letting the agent's memory grow: its stream ends with RESOURCE_EXHAUSTED and it watches
again (it receives the current state first, as every new watcher does), the way a Kubernetes watch that
lags is closed. The board keeps the terminal states of the last :data:`KEEP_ATTEMPTS` ended attempts;
older ones are forgotten.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from spiderflow.proto.agent.v1 import agent_pb2
from spiderflow.proto.types.v1 import types_pb2

__all__ = ["KEEP_ATTEMPTS", "WATCH_QUEUE", "Watch", "WorkerBoard"]

KEEP_ATTEMPTS = 16
"""Ended attempts whose workers' final states :meth:`WorkerBoard.snapshot` still shows."""
WATCH_QUEUE = 4096
"""Events one watcher may lag behind before it is dropped."""

_TERMINAL = frozenset({agent_pb2.WORKER_STATE_SUCCEEDED, agent_pb2.WORKER_STATE_FAILED,
                       agent_pb2.WORKER_STATE_STOPPED})


@dataclass(eq=False)
class Watch:
    """One watcher: ``queue`` yields :class:`~agent_pb2.WatchWorkersResponse` events; ``overflowed`` is set
    when it fell :data:`WATCH_QUEUE` events behind (nothing more is queued for it)."""

    job: str
    queue: asyncio.Queue[agent_pb2.WatchWorkersResponse] = field(
        default_factory=lambda: asyncio.Queue(maxsize=WATCH_QUEUE))
    overflowed: asyncio.Event = field(default_factory=asyncio.Event)


class WorkerBoard:
    """The latest state of every worker of the attempts this agent runs (see the module docstring).
    Used from the agent's event loop only."""

    def __init__(self, *, keep_attempts: int = KEEP_ATTEMPTS) -> None:
        self._keep = keep_attempts
        # (job, attempt) -> rank -> status; insertion order = the order attempts started
        self._attempts: OrderedDict[tuple[str, int], dict[int, agent_pb2.WorkerStatus]] = OrderedDict()
        self._watches: set[Watch] = set()

    # -- the executor's side --------------------------------------------------------------------------

    def update(self, job: str, attempt: int, worker: agent_pb2.Worker, state: agent_pb2.WorkerState, *,
               step: int | None = None, exit_code: int | None = None, error: str = "") -> None:
        """Record ``worker``'s new state (``step``, ``exit_code``: keep the previous value when ``None``)
        and tell the watchers if anything changed. A terminal state is final: later updates of that
        worker are ignored."""
        ranks = self._attempts.setdefault((job, attempt), {})
        old = ranks.get(worker.rank)
        if old is not None and old.state in _TERMINAL:
            return
        new = agent_pb2.WorkerStatus(job_id=job, attempt=attempt, state=state,
                                     error=error or (old.error if old is not None else ""))
        new.worker.CopyFrom(worker)
        new.step = step if step is not None else (old.step if old is not None else 0)
        new.exit_code = exit_code if exit_code is not None else (old.exit_code if old is not None else 0)
        if old is not None and old == new:
            return
        ranks[worker.rank] = new
        self._publish(job, agent_pb2.WatchWorkersResponse(worker=new))
        if state in _TERMINAL:
            self._forget_old()

    def end_attempt(self, job: str, attempt: int, *, reason: str) -> None:
        """Mark every worker of the attempt not yet in a terminal state ``STOPPED`` (``reason`` as its
        error): the agent stopped it, or it is not running any more."""
        for s in list(self._attempts.get((job, attempt), {}).values()):
            if s.state not in _TERMINAL:
                self.update(job, attempt, s.worker, agent_pb2.WORKER_STATE_STOPPED, error=reason)

    def progress(self, event: types_pb2.ProgressEvent) -> None:
        """Fan a training progress event out to the watchers of its job (not kept)."""
        self._publish(event.job_id, agent_pb2.WatchWorkersResponse(progress=event))

    # -- the readers' side ----------------------------------------------------------------------------

    def snapshot(self, job: str = "") -> list[agent_pb2.WorkerStatus]:
        """Every known worker (of ``job`` only, when given), by job, attempt and rank. The messages are the
        board's own (a new one is made on every change): read them, do not modify them."""
        return [s for (j, a) in sorted(self._attempts) if not job or j == job
                for _, s in sorted(self._attempts[(j, a)].items())]

    @contextlib.contextmanager
    def watch(self, job: str = "") -> Iterator[Watch]:
        """A :class:`Watch` of ``job``'s workers (every job's when empty) for the duration of the block. Its
        queue starts with the current state of each known worker, then every change and progress event."""
        w = Watch(job=job)
        for s in self.snapshot(job):
            w.queue.put_nowait(agent_pb2.WatchWorkersResponse(worker=s))
        self._watches.add(w)
        try:
            yield w
        finally:
            self._watches.discard(w)

    @property
    def watchers(self) -> int:
        return len(self._watches)

    # -- internals ------------------------------------------------------------------------------------

    def _publish(self, job: str, event: agent_pb2.WatchWorkersResponse) -> None:
        for w in list(self._watches):
            if w.job and w.job != job:
                continue
            try:
                w.queue.put_nowait(event)
            except asyncio.QueueFull:
                w.overflowed.set()
                self._watches.discard(w)

    def _forget_old(self) -> None:
        ended = [k for k, ranks in self._attempts.items() if all(s.state in _TERMINAL for s in ranks.values())]
        for k in ended[: max(0, len(ended) - self._keep)]:
            del self._attempts[k]
