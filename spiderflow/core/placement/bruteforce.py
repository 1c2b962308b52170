r"""``bruteforce``: the exact reference for tiny instances (≤ :data:`MAX_CLUSTERS` clusters).

Search space (documented so that differential tests know what "exact" means):

- every ordered subset ``c_1 … c_k`` of the clusters with free GPUs (``1 ≤ k ≤ min(n, L)``);
- per cluster one pipeline stage with tensor degree ``tp ∈ {1, 2, 4, 8}``, ``tp ≤ min(GPUs/node,
  free)``, and data degree ``dp ∈ {1, 2, 4, …} ∪ {⌊free/tp⌋}`` with ``tp·dp ≤ free`` — the coarse but
  exhaustive GPU grid (``g = tp·dp``);
- every layer split into ``k`` non-empty contiguous blocks (all ``C(L−1, k−1)`` compositions);
- ``m = global_batch / micro_batch`` micro-batches, 1F1B.

Objective (``Budget.objective``): minimise step time, dollars per step, or ``step·√usd``; ties go to
fewer GPUs. Constraints: (1) ``tp·dp ≤ free`` per cluster; (2) ``G_min ≤ Σ tp·dp ≤ G_max``;
(3) every stage fits its GPUs' memory (exact 1F1B in-flight counts); (4) ``k ≤ L``.
Scores use the cost model's formulas exactly (the winner is re-evaluated by
:func:`spiderflow.core.costmodel.evaluate`), the clusters' calibrated terms included (``layer_overhead_ms`` per
layer in ``T``, ``optimizer_ms_per_layer`` per layer with the stage's gradient sync in ``Y``, as
:func:`~spiderflow.core.costmodel.stage_compute_time` and :func:`~spiderflow.core.costmodel.breakdown` price
them), and so is the work outside the blocks that a profile measured (the embedding's and the head's time per
micro-batch, their optimizer steps and the input pipeline, as
:func:`~spiderflow.core.costmodel.measured_outer_time` and :func:`~spiderflow.core.costmodel.measured_step_extra`
price them); ``optimal`` is reported ``True``: optimal within this space.

Complexity: ``Σ_k P(n, k) · Π_i |options_i| · C(L−1, k−1)`` evaluations, vectorised per chain. Refuses more
than :data:`MAX_CLUSTERS` clusters, and instances whose count exceeds :data:`MAX_EVALUATIONS`, with
:class:`~spiderflow.core.errors.ValidationError`.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import replace

import numpy as np

from spiderflow.core.costmodel import GIB, RESERVED_GIB, compute_rate_tflops, evaluate
from spiderflow.core.domain import Cluster, JobSpec, Plan, Schedule, Stage, Topology
from spiderflow.core.errors import UnschedulableError, ValidationError
from spiderflow.core.kernels.formulas import allreduce_times
from spiderflow.core.placement.base import Budget, PlacementResult, PlacementStatus, register_policy
from spiderflow.core.placement.common import (
    FArr,
    IArr,
    JobConsts,
    check_plan,
    diagnose,
    job_consts,
    objective_value,
    topo_arrays,
    transfer_matrix,
    unschedulable,
)

__all__ = ["MAX_CLUSTERS", "MAX_EVALUATIONS", "BruteForce", "cluster_options", "count_evaluations"]

MAX_CLUSTERS = 6
MAX_EVALUATIONS = 400_000_000
_CHUNK = 1_000_000


def cluster_options(c: Cluster) -> list[tuple[int, int]]:
    """The ``(tp, dp)`` grid of one cluster (module docstring)."""
    out: list[tuple[int, int]] = []
    tp = 1
    while tp <= min(8, c.gpus_per_node, c.free):
        top = c.free // tp
        dps = {top}
        d = 1
        while d <= top:
            dps.add(d)
            d *= 2
        out.extend((tp, d) for d in sorted(dps))
        tp *= 2
    return out


def count_evaluations(topo: Topology, job: JobSpec) -> int:
    """The number of (chain, options, split) combinations the search visits."""
    usable = [c for c in topo.clusters if c.free > 0]
    sizes = [len(cluster_options(c)) for c in usable]
    total = 0
    for k in range(1, min(len(usable), job.model.layers) + 1):
        comps = math.comb(job.model.layers - 1, k - 1)
        for combo in itertools.permutations(sizes, k):
            total += math.prod(combo) * comps
    return total


def _tables(c: Cluster, opts: list[tuple[int, int]], jc: JobConsts, i: int, k: int) -> tuple[FArr, ...]:
    """Per option × block length ``ℓ = 0..L``: T, T/dp, Y, memory-ok (as float 0/1), GPUs, watts·price
    (``T`` with the cluster's calibrated fixed time per layer, ``Y`` the gradient sync with the calibrated
    optimizer step per layer and the measured per-step work)."""
    tp = np.array([o[0] for o in opts], dtype=np.int64)[:, None]
    dp = np.array([o[1] for o in opts], dtype=np.int64)[:, None]
    ell = np.arange(jc.layers + 1, dtype=np.float64)[None, :]
    first, last = i == 0, i == k - 1
    fl = compute_rate_tflops(c, jc.precision) * 1e12  # the job's precision, as the cost model
    b_tp = np.where(tp <= c.gpus_per_node, c.intra_node_gbps, c.inter_node_gbps).astype(np.float64)
    ar_tp = allreduce_times(jc.act, tp, b_tp)
    # the head and its loss: their measured time where a profile measured it (not divided by tp), else FLOPs
    head = (c.head_us_per_token * jc.b * jc.s / 1e6 if c.head_us_per_token else 3.0 * jc.head_f / (tp * fl))
    per_layer = 3.0 * jc.f / (tp * fl) + 4.0 * ar_tp
    if c.layer_overhead_ms:  # the calibrated fixed time per layer and micro-batch (costmodel.stage_compute_time)
        per_layer = per_layer + c.layer_overhead_ms / 1e3
    t = ell * per_layer + (head if last else 0.0)
    if first and c.embedding_us_per_token:  # the measured embedding (costmodel.measured_outer_time)
        t = t + c.embedding_us_per_token * jc.b * jc.s / 1e6
    params = ell * jc.p_layer + (jc.p_embed if first else 0.0) + (jc.head_params if last else 0.0)
    b_dp = np.where(tp * dp <= c.gpus_per_node, c.intra_node_gbps, c.inter_node_gbps).astype(np.float64)
    y = allreduce_times(jc.grad_bytes * params / tp, dp, b_dp)
    if c.optimizer_ms_per_layer:  # the calibrated optimizer step per layer, with the gradient sync (breakdown)
        y = y + ell * (c.optimizer_ms_per_layer / 1e3)
    # the measured per-step work with the stage's gradient sync (costmodel.measured_step_extra)
    extra = np.zeros_like(dp, dtype=np.float64)
    if first and (c.embedding_optimizer_ms or c.data_ms_per_sample):
        extra = extra + (c.embedding_optimizer_ms / 1e3 + c.data_ms_per_sample * (jc.b * np.ceil(jc.m / dp)) / 1e3)
    if last and c.head_optimizer_ms:
        extra = extra + c.head_optimizer_ms / 1e3
    if extra.any():
        y = y + extra
    inflight = np.minimum(np.ceil(jc.m / dp), k - i)
    tpf = tp.astype(np.float64)
    act = ell * jc.act_layer(tpf) + (jc.act_head(tpf) if last else 0.0)
    mem = jc.state_bytes * params / tp + inflight * act + RESERVED_GIB * GIB
    ok = (mem <= c.gpu_memory_gib * GIB) & (ell >= 1)
    gpus = (tp * dp).astype(np.float64)
    wp = gpus * c.power_w * c.electricity_usd_per_kwh
    shape = (len(opts), jc.layers + 1)
    return (np.broadcast_to(t, shape), np.broadcast_to(t / dp, shape), np.broadcast_to(y, shape),
            np.broadcast_to(ok.astype(np.float64), shape), gpus[:, 0], wp[:, 0])


def _compositions(layers: int, k: int) -> IArr:
    rows = [
        np.diff(np.array((0, *cuts, layers)))
        for cuts in itertools.combinations(range(1, layers), k - 1)
    ]
    return np.array(rows, dtype=np.int64).reshape(len(rows), k)


class BruteForce:
    """Exhaustive reference policy (see the module docstring)."""

    name = "bruteforce"

    def place(self, topo: Topology, job: JobSpec, budget: Budget | None = None) -> PlacementResult:
        budget = budget or Budget()
        t0 = time.perf_counter()
        if len(topo.clusters) > MAX_CLUSTERS:
            raise ValidationError(
                "topology.clusters", f"bruteforce handles at most {MAX_CLUSTERS} clusters", len(topo.clusters)
            )
        evaluations = count_evaluations(topo, job)
        if evaluations > MAX_EVALUATIONS:
            raise ValidationError(
                "topology", f"bruteforce would visit {evaluations} combinations (limit {MAX_EVALUATIONS})",
                len(topo.clusters),
            )
        bad = diagnose(topo, job, self.name)
        if bad is not None:
            return replace(bad, planning_seconds=time.perf_counter() - t0)
        jc = job_consts(job)
        ta = topo_arrays(topo)
        p = transfer_matrix(ta, jc)
        usable = [i for i, c in enumerate(topo.clusters) if c.free > 0]
        opts = {i: cluster_options(topo.clusters[i]) for i in usable}
        best_key: tuple[float, float] = (math.inf, math.inf)
        best: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None = None
        memory_blocked = False
        for k in range(1, min(len(usable), jc.layers) + 1):
            comps = _compositions(jc.layers, k)
            for chain in itertools.permutations(usable, k):
                hops = [float(p[a, b]) for a, b in itertools.pairwise(chain)]
                if any(not math.isfinite(h) for h in hops):
                    continue
                pmax, psum = max(hops, default=0.0), sum(hops)
                tabs = [_tables(topo.clusters[c], opts[c], jc, i, k) for i, c in enumerate(chain)]
                grids = np.array(
                    list(itertools.product(*[range(len(opts[c])) for c in chain])), dtype=np.int64
                ).reshape(-1, k)
                gp = np.zeros(len(grids))
                wp = np.zeros(len(grids))
                for i in range(k):
                    gp += tabs[i][4][grids[:, i]]
                    wp += tabs[i][5][grids[:, i]]
                keep = (gp >= jc.gpus_min) & (gp <= jc.gpus_max)
                grids, gp, wp = grids[keep], gp[keep], wp[keep]
                if len(grids) == 0:
                    continue
                step_per = max(1, _CHUNK // max(1, len(comps)))
                for s0 in range(0, len(grids), step_per):
                    g = grids[s0 : s0 + step_per]
                    t_sum = np.zeros((len(g), len(comps)))
                    bott = np.full((len(g), len(comps)), pmax)
                    ymax = np.zeros((len(g), len(comps)))
                    ok = np.ones((len(g), len(comps)), dtype=bool)
                    for i in range(k):
                        t, td, y, mok, _, _ = tabs[i]
                        oi, li = g[:, i][:, None], comps[None, :, i]
                        t_sum += t[oi, li]
                        bott = np.maximum(bott, td[oi, li])
                        ymax = np.maximum(ymax, y[oi, li])
                        ok &= mok[oi, li] > 0
                    if not ok.any():
                        memory_blocked = True
                        continue
                    step = (jc.m - 1) * bott + t_sum + 2.0 * psum + ymax
                    usd = step * wp[s0 : s0 + step_per, None] / 3.6e6
                    score = np.where(ok, objective_value(step, usd, budget.objective), np.inf)
                    flat = int(np.argmin(score))
                    gi, ci = divmod(flat, len(comps))
                    # Ties (within 1e-12 relative) go to fewer GPUs.
                    sc = float(score[gi, ci])
                    if not math.isfinite(sc):
                        continue
                    ties = np.argwhere(score <= sc * (1 + 1e-12))
                    gi, ci = min(((int(a), int(b)) for a, b in ties), key=lambda ab: (gp[s0 + ab[0]], ab))
                    key = (float(score[gi, ci]), float(gp[s0 + gi]))
                    if key < best_key:
                        best_key = key
                        best = (chain, tuple(int(x) for x in g[gi]), tuple(int(x) for x in comps[ci]))
        elapsed = time.perf_counter() - t0
        if best is None:
            constraint = "memory" if memory_blocked else "gpus"
            return unschedulable(self.name, UnschedulableError(
                "no chain, GPU grid point and layer split satisfies the job", constraint=constraint), elapsed)
        chain, options, sizes = best
        stages: list[Stage] = []
        first = 0
        for c, o, sz in zip(chain, options, sizes, strict=True):
            tp, dp = opts[c][o]
            stages.append(Stage(cluster=topo.names[c], first_layer=first, last_layer=first + sz - 1, tp=tp, dp=dp))
            first += sz
        plan = evaluate(Plan(stages=tuple(stages), micro_batches=jc.m, schedule=Schedule.ONE_F_ONE_B), topo, job)
        problems = check_plan(plan, topo, job)
        if problems:  # the tables mirror the cost model; a mismatch is a bug, not an unschedulable job
            return PlacementResult(status=PlacementStatus.ERROR, policy=self.name, reason=problems[0],
                                   planning_seconds=elapsed)
        return PlacementResult(
            status=PlacementStatus.SUCCESS, policy=self.name, plan=plan, planning_seconds=elapsed, optimal=True,
            stats={"evaluations": float(evaluations), "objective": best_key[0]},
        )


register_policy("bruteforce", BruteForce)
