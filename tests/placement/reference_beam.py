"""One level of SpinSearch's beam as plain Python: the reference the compiled
:func:`spiderflow.core.kernels.search.neighbour_table` and :func:`~spiderflow.core.kernels.search.extend_beam` must
match exactly."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["extend_reference", "neighbours_reference"]


def neighbours_reference(order: npt.NDArray[np.int64], p: npt.NDArray[np.float64], usable: npt.NDArray[np.bool_],
                         theta: float, neighbours: int, u: int) -> list[int]:
    """The next hops of a chain ending at ``u``: usable clusters by ascending ``p[u, ·]`` while within
    ``theta``, at most ``neighbours``."""
    hit: list[int] = []
    for v in order[u]:
        v = int(v)
        if p[u, v] > theta:
            break
        if usable[v]:
            hit.append(v)
            if len(hit) >= neighbours:
                break
    return hit


def extend_reference(beam: Sequence[tuple[int, ...]], nbrs: dict[int, list[int]]) -> list[tuple[int, ...]]:
    """Each beam chain's tail extensions, then its head extensions; skipping members and repeats."""
    seen: set[tuple[int, ...]] = set()
    cands: list[tuple[int, ...]] = []
    for c in beam:
        members = set(c)
        for v in nbrs[c[-1]]:
            if v not in members:
                n = (*c, v)
                if n not in seen:
                    seen.add(n)
                    cands.append(n)
        for v in nbrs[c[0]]:
            if v not in members:
                n = (v, *c)
                if n not in seen:
                    seen.add(n)
                    cands.append(n)
    return cands
