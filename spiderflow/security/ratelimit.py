"""Per-client token buckets (rate limits on SubmitJob).

A bucket holds up to ``burst`` tokens and refills at ``rate`` tokens per second; a request takes one
token or is refused with the time until the next token. :class:`RateLimiter` keeps one bucket per key
(the caller's principal, or its address when unauthenticated) and forgets the least recently used keys
beyond ``max_keys``, so the memory a flood of distinct callers can take is bounded.

Pure: the clock is passed in.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["RateLimiter", "TokenBucket"]


@dataclass(slots=True, kw_only=True)
class TokenBucket:
    """``tokens`` available at time ``at``. Mutable: :meth:`take` updates it."""

    rate: float
    burst: float
    tokens: float
    at: float

    def take(self, now: float) -> float:
        """Take one token: 0.0 when granted, else the seconds until one is available (nothing taken)."""
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class RateLimiter:
    """One :class:`TokenBucket` per key. ``rate`` ≤ 0 disables limiting (every call is granted)."""

    def __init__(self, *, rate: float, burst: float, max_keys: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if burst < 1 and rate > 0:
            raise ValueError("burst must be ≥ 1")
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self.clock = clock
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def take(self, key: str) -> float:
        """0.0 when ``key`` may go on, else the seconds it should wait before retrying."""
        if self.rate <= 0:
            return 0.0
        now = self.clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = TokenBucket(rate=self.rate, burst=self.burst, tokens=self.burst, at=now)
            self._buckets[key] = bucket
            if len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        return bucket.take(now)

    def __len__(self) -> int:
        return len(self._buckets)
