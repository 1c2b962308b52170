"""Smoothing of noisy measurements: an EWMA with outlier rejection and level-shift detection.

Pure (no I/O). One :class:`Series` holds the smoothed state of one measured quantity (a link's bandwidth
or latency, a cluster's matmul TFLOPS); :func:`observe` folds one new sample ``x`` into it.

Rules, with ``s`` the smoothed value and :class:`SmoothingConfig` ``c``:

1. The first sample (or the first after the series went stale) sets ``s = x``.
2. ``x`` is an **outlier** when it is far from ``s``:

   - ratio test (bandwidth, TFLOPS): ``max(x / s, s / x) > c.outlier_ratio``;
   - absolute test (latency, which may be ~0 on loopback): ``|x − s| > max((c.outlier_ratio − 1)·s,
     c.outlier_floor)``.

   An outlier does not move ``s``; it is remembered as *pending* (``pending`` samples, their mean
   ``pending_mean``).
3. **Level shift**: when ``c.shift_after`` consecutive outliers agree with each other (each within the
   same test of the previous pending mean), the quantity really changed (a link was re-shaped): ``s`` is
   reset to the newest of those outliers. The earlier ones only prove the change; they may have been
   taken while it was still settling (a bulk probe just after a link's rate went up runs on a TCP window
   still sized for the old rate and reads low), so averaging them in would leave ``s`` between the old
   and the new level. With ``shift_after = 2`` a changed link shows its new figure after two probe
   periods.
4. **Settling**: the first sample after a level shift that is not an outlier and lies further in the
   shift's direction replaces ``s`` (``s = x``): the newest outlier may itself have been taken while the
   change settled (a TCP window grows over more than one probe after a rate increase: a 50 → 200 Mbit/s
   change read 100, 103, then 188 Mbit/s on a loaded testbed). Any other sample is folded in by rule 5.
   Only that one sample is treated so: in steady state no shift happens and the rule never applies.
5. Otherwise ``s ← s + α·(x − s)`` with ``α = c.alpha``, and pending outliers are forgotten.

A sample that is not a finite number ≥ 0 must be rejected by validation before it gets here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import StrEnum

from spiderflow.store.records import Series

__all__ = ["Closeness", "Outcome", "Series", "SmoothingConfig", "observe"]


class Closeness(StrEnum):
    """How "far" is judged: by ratio (positive quantities) or by absolute difference with a floor."""

    RATIO = "ratio"
    ABSOLUTE = "absolute"


@dataclass(frozen=True, slots=True, kw_only=True)
class SmoothingConfig:
    """``alpha`` ∈ (0, 1]: EWMA weight of a new sample; ``outlier_ratio`` > 1: see the module docstring;
    ``outlier_floor`` ≥ 0: the absolute test's minimum tolerance (same unit as the samples);
    ``shift_after`` ≥ 1: consecutive agreeing outliers that are taken as a level shift."""

    alpha: float = 0.5
    outlier_ratio: float = 2.0
    outlier_floor: float = 0.0
    shift_after: int = 2

    def __post_init__(self) -> None:
        from spiderflow.core.errors import ValidationError

        if not 0 < self.alpha <= 1:
            raise ValidationError("smoothing.alpha", "must be in (0, 1]", self.alpha)
        if not self.outlier_ratio > 1:
            raise ValidationError("smoothing.outlier_ratio", "must be > 1", self.outlier_ratio)
        if not self.outlier_floor >= 0:
            raise ValidationError("smoothing.outlier_floor", "must be ≥ 0", self.outlier_floor)
        if self.shift_after < 1:
            raise ValidationError("smoothing.shift_after", "must be ≥ 1", self.shift_after)


class Outcome(StrEnum):
    """What :func:`observe` did with a sample."""

    STARTED = "started"
    SMOOTHED = "smoothed"
    REJECTED = "rejected"
    SHIFTED = "shifted"

    @property
    def accepted(self) -> bool:
        return self is not Outcome.REJECTED


def _far(x: float, s: float, config: SmoothingConfig, test: Closeness) -> bool:
    if test is Closeness.RATIO:
        if x <= 0 or s <= 0:
            return x != s
        return max(x / s, s / x) > config.outlier_ratio
    return abs(x - s) > max((config.outlier_ratio - 1) * s, config.outlier_floor)


def observe(series: Series | None, x: float, config: SmoothingConfig, test: Closeness) -> tuple[Series, Outcome]:
    """Fold sample ``x`` into ``series`` (None = no history) by the rules of the module docstring."""
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"sample must be a finite number ≥ 0, got {x!r}")
    if series is None:
        return Series(value=x), Outcome.STARTED
    if _far(x, series.value, config, test):
        if series.pending and not _far(x, series.pending_mean, config, test):
            n = series.pending + 1
            mean = series.pending_mean + (x - series.pending_mean) / n
        else:
            n, mean = 1, x
        if n >= config.shift_after:
            direction = 1 if x > series.value else -1
            return Series(value=x, samples=series.samples + 1, settling=direction), Outcome.SHIFTED
        return replace(series, pending=n, pending_mean=mean, settling=0), Outcome.REJECTED
    if series.settling and (x - series.value) * series.settling > 0:
        return Series(value=x, samples=series.samples + 1), Outcome.SHIFTED
    value = series.value + config.alpha * (x - series.value)
    return Series(value=value, samples=series.samples + 1), Outcome.SMOOTHED
