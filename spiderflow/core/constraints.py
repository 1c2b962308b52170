"""A job's resource constraints applied to a topology snapshot: which clusters it may use, the view of the
topology its placement policy is given, and why a job can never be satisfied.

Every placement decision of a constrained job (:class:`~spiderflow.core.domain.Constraints`: GPU types, clusters
and regions allowed or excluded) is made on :func:`view`: the sub-topology of the allowed clusters, the
links among them and the whole snapshot's pairwise figures between them
(:meth:`~spiderflow.core.domain.Topology.only`). A policy therefore cannot place the job elsewhere, whichever
policy it is. The pairwise figures are kept so that two allowed clusters joined through an excluded one stay
as reachable as for any other job: constraints say where a job computes and keeps state, while its traffic
is relayed along the network's widest path like every job's.
The scheduling cycle (:func:`spiderflow.core.cycle.run_cycle`, shared by the scheduler service and the
simulator) and ``spiderflow plan`` both go through here.

The view is cheap: its structure (clusters, links, the sub-matrices of the widest paths, O(k²)) is built
once per snapshot and set of allowed names and shared by the snapshot's
:meth:`~spiderflow.core.domain.Topology.with_free` copies, so the placement memos keyed on path matrices keep
hitting across decisions, and never mix the view with the whole topology (they key on the matrix object
itself).

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping

from spiderflow.core.domain import Constraints, JobSpec, Topology

__all__ = ["allowed_clusters", "unsatisfiable", "view"]


def allowed_clusters(topo: Topology, constraints: Constraints) -> tuple[str, ...]:
    """The names of the clusters of ``topo`` that ``constraints`` allow, in the topology's order."""
    if constraints.empty:
        return topo.names
    return tuple(c.name for c in topo.clusters if constraints.allows(c))


def view(topo: Topology, job: JobSpec) -> Topology:
    """The topology ``job``'s placement policy sees: ``topo`` itself when unconstrained, else the allowed
    clusters (``topo``'s free GPUs and pairwise figures) and the links among them."""
    if job.constraints.empty:
        return topo
    return topo.only(allowed_clusters(topo, job.constraints))


def unsatisfiable(topo: Topology, job: JobSpec, *, held: Mapping[str, int] | None = None) -> str:
    """Why ``job`` can never run on ``topo`` because of its constraints ("" when it may): no cluster is
    allowed, or the allowed clusters offer fewer than ``job.gpus.min`` GPUs in all (free ones plus
    ``held``: GPUs other jobs hold there now, which come back)."""
    c = job.constraints
    if c.empty:
        return ""
    names = allowed_clusters(topo, c)
    if not names:
        missing = [n for n in c.clusters if n not in topo.index]
        extra = f" (not in the topology: {', '.join(missing)})" if missing else ""
        return f"its constraints ({c.describe()}) allow no cluster of the topology{extra}"
    held = held or {}
    offer = sum(topo.cluster(n).free + held.get(n, 0) for n in names)
    if offer < job.gpus.min:
        return (f"needs at least {job.gpus.min} GPUs and the clusters its constraints ({c.describe()}) allow "
                f"({', '.join(names)}) offer {offer}")
    return ""
