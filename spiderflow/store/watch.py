"""The resumable watch both remote stores share: a pull-driven stream that survives its server.

:class:`ResumableWatch` is the iteration of a :class:`~spiderflow.store.base.Watch` over a server stream (etcd's
``Watch`` RPC in :mod:`spiderflow.store.etcd`, the control plane's ``Control.Watch`` in ``agent.remote_store``):

- the stream is read only when the buffer is empty, so a slow consumer applies flow control;
- every event moves ``_next`` past its revision, and :attr:`revision` is the last one delivered;
- when the stream breaks (the subclass's :meth:`_read` raises :class:`StreamBroken`), the call is dropped and
  re-established (:meth:`_connect`) from ``_next`` — the last buffered revision + 1 — so nothing is lost and
  nothing is delivered twice;
- a compacted start revision (:class:`~spiderflow.store.base.CompactedError`) and any other error are
  raised to the consumer after the call is dropped; after :meth:`aclose` iteration stops
  (``StopAsyncIteration``), also when the close interrupts a read.

Subclasses implement :meth:`_connect` (establish from ``_next``, ``None`` = from now, retrying as their store
does and raising :class:`~spiderflow.core.errors.UnavailableError` when they give up; they set ``_call`` and may
buffer the first answer's events with :meth:`_take`), :meth:`_read` (one answer of ``_call``: its events) and
:meth:`_cancel` (cancel a call); :meth:`_on_break` and :meth:`_on_close` are optional hooks.
"""

from __future__ import annotations

import abc
import asyncio
import collections
from collections.abc import Iterable
from typing import Any, Self

from spiderflow.store.base import Watch, WatchEvent

__all__ = ["ResumableWatch", "StreamBroken"]


class StreamBroken(Exception):
    """The watch's stream ended or failed in a way a reconnect may cure (raised by :meth:`ResumableWatch._read`).
    ``pause``: the subclass's :meth:`~ResumableWatch._on_break` should wait before reconnecting."""

    def __init__(self, reason: str, *, pause: bool = False) -> None:
        super().__init__(reason)
        self.pause = pause


class ResumableWatch(Watch):
    """A watch that buffers, pulls, and resumes after the last delivered revision (module docstring)."""

    def __init__(self, start_revision: int | None) -> None:
        self._next: int | None = start_revision
        self._last = (start_revision - 1) if start_revision is not None else 0
        self._buffer: collections.deque[WatchEvent] = collections.deque()
        self._call: Any = None
        self._started = False
        self._closed = False

    @property
    def revision(self) -> int:
        return self._last

    # -- what a subclass provides ------------------------------------------------------------------------

    @abc.abstractmethod
    async def _connect(self) -> None:
        """Establish the stream from ``_next`` (``None``: from now, then set ``_next`` and ``_last``), retrying
        as the store does; set ``_call``. :class:`~spiderflow.core.errors.UnavailableError` when giving up,
        :class:`~spiderflow.store.base.CompactedError` when ``_next`` is compacted."""

    @abc.abstractmethod
    async def _read(self) -> Iterable[WatchEvent]:
        """The events of the next answer of ``_call``; :class:`StreamBroken` when the stream must be
        re-established, :class:`~spiderflow.store.base.CompactedError` when history is gone."""

    @abc.abstractmethod
    def _cancel(self, call: Any) -> None:
        """Cancel a stream call."""

    async def _on_break(self, error: StreamBroken) -> None:
        """After a broken stream was dropped, before reconnecting (e.g. wait, or pick another replica)."""

    def _on_start(self) -> None:
        """Once the watch is first established."""

    def _on_close(self) -> None:
        """After :meth:`aclose`."""

    # -- the shared iteration ----------------------------------------------------------------------------

    def _take(self, events: Iterable[WatchEvent]) -> None:
        """Buffer events (in revision order) and move ``_next`` past them."""
        for ev in events:
            self._buffer.append(ev)
            self._next = max(self._next or 0, ev.mod_revision + 1)

    def _drop_call(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            self._cancel(call)

    async def start(self) -> Self:
        if self._closed or self._started:
            return self
        await self._connect()
        self._started = True
        self._on_start()
        return self

    async def __anext__(self) -> WatchEvent:
        if not self._started:
            await self.start()
        while True:
            if self._buffer:
                ev = self._buffer.popleft()
                self._last = ev.mod_revision
                return ev
            if self._closed:
                raise StopAsyncIteration
            if self._call is None:
                await self._connect()
                continue
            try:
                events = await self._read()
            except asyncio.CancelledError:
                self._drop_call()
                if self._closed:
                    raise StopAsyncIteration from None
                raise
            except StreamBroken as broken:
                self._drop_call()
                if self._closed:
                    raise StopAsyncIteration from None
                await self._on_break(broken)
                continue
            except Exception:
                self._drop_call()
                if self._closed:
                    raise StopAsyncIteration from None
                raise
            self._take(events)

    async def aclose(self) -> None:
        self._closed = True
        self._drop_call()
        self._on_close()
