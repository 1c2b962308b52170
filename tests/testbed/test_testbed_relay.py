"""The relay's delay line on a real event loop with a recording sink (no namespaces needed)."""

from __future__ import annotations

import asyncio
from typing import Any

from spiderflow.testbed.relay import TIMER_LEAD_S, DelayLine, PairTable


class _Sink(asyncio.WriteTransport):
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.loop = loop
        self.writes: list[tuple[float, bytes]] = []
        self.eof_at: float | None = None
        self.line: DelayLine | None = None
        self.pause_after: int | None = None

    def write(self, data: Any) -> None:
        self.writes.append((self.loop.time(), bytes(data)))
        if self.pause_after is not None and len(self.writes) >= self.pause_after and self.line:
            self.pause_after = None
            self.line.pause()

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof_at = self.loop.time()


def _line(loop: asyncio.AbstractEventLoop, latency: float, bound: int, events: list[str]) -> DelayLine:
    return DelayLine(
        loop,
        latency_s=lambda: latency,
        bound=lambda: bound,
        pause_source=lambda: events.append("pause"),
        resume_source=lambda: events.append("resume"),
        on_eof=lambda: events.append("eof"),
        on_reset=lambda: events.append("reset"),
    )


async def test_chunks_are_released_in_order_no_earlier_than_arrival_plus_latency() -> None:
    loop = asyncio.get_running_loop()
    events: list[str] = []
    line = _line(loop, 0.05, 1 << 20, events)
    sink = _Sink(loop)
    line.attach(sink)
    arrivals = []
    for i in range(5):
        arrivals.append(loop.time())
        line.feed(bytes([i]) * 10)
        await asyncio.sleep(0.01)
    line.feed(b"")
    await asyncio.sleep(0.12)
    assert [w[1][0] for w in sink.writes] == [0, 1, 2, 3, 4]
    for (t, _), arrived in zip(sink.writes, arrivals, strict=True):
        assert arrived + 0.05 - TIMER_LEAD_S <= t + 1e-4  # never earlier than the timer lead
        assert t - (arrived + 0.05) < 0.03  # and not much late
    assert sink.eof_at is not None and sink.eof_at >= sink.writes[-1][0]
    assert events == ["eof"]
    assert line.delivered == 50 and line.queued_bytes == 0


async def test_backpressure_pauses_the_source_past_the_bound_and_resumes_after_draining() -> None:
    loop = asyncio.get_running_loop()
    events: list[str] = []
    line = _line(loop, 0.02, 1000, events)
    sink = _Sink(loop)
    line.attach(sink)
    for _ in range(4):
        line.feed(b"x" * 400)
    assert events == ["pause"]
    assert line.queued_bytes == 1600
    await asyncio.sleep(0.06)
    assert events == ["pause", "resume"]
    assert line.queued_bytes == 0 and len(sink.writes) == 4


async def test_a_paused_sink_holds_due_chunks_until_resumed() -> None:
    loop = asyncio.get_running_loop()
    events: list[str] = []
    line = _line(loop, 0.0, 1 << 20, events)
    sink = _Sink(loop)
    sink.line = line
    sink.pause_after = 1
    line.attach(sink)
    line.feed(b"a")
    line.feed(b"b")
    await asyncio.sleep(0.03)
    assert [w[1] for w in sink.writes] == [b"a"]
    line.resume()
    await asyncio.sleep(0.01)
    assert [w[1] for w in sink.writes] == [b"a", b"b"]


async def test_a_reset_is_delivered_after_the_data_queued_before_it() -> None:
    loop = asyncio.get_running_loop()
    events: list[str] = []
    line = _line(loop, 0.03, 1 << 20, events)
    sink = _Sink(loop)
    line.attach(sink)
    line.feed(b"data")
    line.reset()
    await asyncio.sleep(0.01)
    assert events == [] and sink.writes == []
    await asyncio.sleep(0.05)
    assert [w[1] for w in sink.writes] == [b"data"]
    assert events == ["reset"]


def test_pair_table_bound_covers_the_bandwidth_delay_product() -> None:
    t = PairTable()
    t.set([[0, 1, 0.4, 80.0], [1, 0, 0.05, 5.0]])
    assert t.bound(0, 1) >= 0.4e9 / 8 * 0.080
    assert t.latency_s(0, 1) == 0.08 and t.bandwidth_gbps(1, 0) == 0.05
    assert t.bound(1, 0) < t.bound(0, 1)
