"""The memo tables of placement decisions on one network snapshot.

A :class:`SnapshotMemo` belongs to a :class:`~spiderflow.core.domain.Topology` (``topology.memo``). The
snapshot and every copy of it that differs only in free GPUs (:meth:`~spiderflow.core.domain.Topology.
with_free`, made per decision and per candidate) share its tables, because their clusters' figures and
path matrices are the same; a sub-topology (:meth:`~spiderflow.core.domain.Topology.only`) has its own.
The tables die with the snapshot: a new topology revision (a link or cluster changed) starts empty, and
nothing is kept in module globals or keyed by object identity.

- ``arrays``: this topology object's per-cluster arrays
  (:func:`spiderflow.core.placement.common.topo_arrays`; each ``with_free`` copy has its own);
- ``hops`` (shared, bounded): SpinSearch's transfer matrix and per-cluster hop order by activation size;
- ``searches`` (shared, bounded, oldest dropped first): SpinSearch's finished chain searches by job
  shape, clusters with their free GPUs and search parameters.

Pure functions memoised on their values alone (the chain-plan cache keyed by the allocated clusters'
figures, the level-1 planner's position rows, the level-2 block solves, the timeline's orders) are not tied
to a snapshot and keep their own bounded tables, each with a public ``cache_clear``; docs/architecture.md
lists every one with its key and why it is process-wide.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from spiderflow.core.placement.common import TopoArrays
    from spiderflow.core.placement.spinsearch import ChainCandidate, Hops

__all__ = ["BoundedTable", "SnapshotMemo"]

V = TypeVar("V")


class BoundedTable(Generic[V]):
    """A dict of at most ``limit`` entries; inserting into a full table drops the oldest entry."""

    __slots__ = ("_data", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._data: dict[Hashable, V] = {}

    def get(self, key: Hashable) -> V | None:
        return self._data.get(key)

    def put(self, key: Hashable, value: V) -> None:
        if len(self._data) >= self.limit and key not in self._data:
            del self._data[next(iter(self._data))]
        self._data[key] = value

    def clear(self) -> None:
        self._data.clear()

    def __len__(self) -> int:
        return len(self._data)


class SnapshotMemo:
    """Memo tables of one network snapshot (see the module docstring)."""

    __slots__ = ("__weakref__", "arrays", "hops", "searches")

    def __init__(self) -> None:
        self.arrays: TopoArrays | None = None
        self.hops: BoundedTable[Hops] = BoundedTable(64)
        self.searches: BoundedTable[tuple[list[ChainCandidate], dict[str, float]]] = BoundedTable(2048)

    def derive(self) -> SnapshotMemo:
        """The memo of a copy with other free GPUs: the shared tables, no arrays yet."""
        out = SnapshotMemo.__new__(SnapshotMemo)
        out.arrays = None
        out.hops = self.hops
        out.searches = self.searches
        return out

    def clear(self) -> None:
        """Forget the shared searches and hop orders (benchmarks time cold decisions this way); the
        arrays, a function of this topology object alone, are kept."""
        self.hops.clear()
        self.searches.clear()
