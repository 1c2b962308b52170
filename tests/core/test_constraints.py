"""Resource constraints of a job (GPU types, clusters, regions allowed or excluded): the type, its file and
proto forms, the topology view a policy gets, and the shared scheduling cycle honouring them for every
registered policy."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spiderflow.core.catalog import model_preset
from spiderflow.core.constraints import allowed_clusters, unsatisfiable, view
from spiderflow.core.cycle import CycleDecision, CycleInput, CycleOptions, Holder, Outcome, QueueEntry, run_cycle
from spiderflow.core.domain import Cluster, Constraints, GpuRange, JobSpec, Link, Topology
from spiderflow.core.errors import ValidationError
from spiderflow.core.placement import REGISTRY, get_policy, load_builtin_policies
from spiderflow.core.placement.base import Budget
from spiderflow.formats import job_from_dict, job_to_dict
from spiderflow.rpc.convert import job_from_proto, job_to_proto

CLUSTERS = (
    Cluster(name="a", gpu="A100-80G", nodes=1, gpus_per_node=8, region="us-east"),
    Cluster(name="b", gpu="H100-80G", nodes=1, gpus_per_node=8, region="us-east"),
    Cluster(name="c", gpu="V100-32G", nodes=1, gpus_per_node=8, region="eu-west"),
    Cluster(name="d", gpu="A100-40G", nodes=1, gpus_per_node=8, region="eu-west"),
    Cluster(name="e", gpu="H100-80G", nodes=1, gpus_per_node=8, region="ap-south"),
)
# A ring a-b-c-d-e-a plus a fast shortcut a-c: the widest path a → d relays through c.
LINKS = tuple(Link(a=x, b=y, bandwidth_gbps=bw, latency_ms=5) for x, y, bw in
              (("a", "b", 10), ("b", "c", 10), ("c", "d", 10), ("d", "e", 10), ("e", "a", 1), ("a", "c", 50)))
TOPO = Topology(clusters=CLUSTERS, links=LINKS, revision=7)


def _job(jid: str = "j", *, gmin: int = 4, gmax: int = 16, **constraints: tuple[str, ...]) -> JobSpec:
    return JobSpec(id=jid, model=model_preset("gpt3-1.3b"), global_batch=32, seq_len=1024,
                   gpus=GpuRange(min=gmin, max=gmax), constraints=Constraints(**constraints))


# ---------------------------------------------------------------------------------------------- the type


def test_default_is_no_restriction_and_names_are_canonical() -> None:
    assert JobSpec(id="x", model=model_preset("gpt-tiny"), global_batch=8, gpus=GpuRange(min=1, max=1)
                   ).constraints.empty
    c = Constraints(gpu_types=["a100", "H100-80G", "A100"], exclude_clusters=("ohio", "ohio"))  # type: ignore[arg-type]
    assert c.gpu_types == ("A100", "H100-80G") and c.exclude_clusters == ("ohio",)
    assert c.describe() == "gpu_types A100, H100-80G; exclude_clusters ohio"
    assert [x.name for x in CLUSTERS if c.allows(x)] == ["a", "b", "d", "e"]  # a family matches both A100s
    assert allowed_clusters(TOPO, Constraints(regions=("eu-west",), exclude_clusters=("c",))) == ("d",)
    assert allowed_clusters(TOPO, Constraints(exclude_regions=("us-east", "eu-west"))) == ("e",)


@pytest.mark.parametrize(("raw", "field"), [
    ({"gpu_types": ["B999"]}, "job.constraints.gpu_types[0]"),
    ({"gpu_types": ["A100", ""]}, "job.constraints.gpu_types[1]"),
    ({"clusters": ["a"], "exclude_clusters": ["b", "a"]}, "job.constraints.exclude_clusters[1]"),
    ({"regions": ["eu"], "exclude_regions": ["eu"]}, "job.constraints.exclude_regions[0]"),
    ({"regions": "eu"}, "job.constraints.regions"),
    ({"zones": ["x"]}, "job.constraints.zones"),
])
def test_bad_constraints_name_the_field(raw: dict[str, object], field: str) -> None:
    doc = {"id": "j", "model": "gpt-tiny", "global_batch": 8, "gpus": {"min": 1, "max": 1}, "constraints": raw}
    with pytest.raises(ValidationError) as e:
        job_from_dict(doc, where="job")
    assert e.value.field == field
    if "B999" in str(raw):
        assert "unknown GPU type" in str(e.value) and "'B999'" in str(e.value)


def test_file_and_proto_forms_round_trip() -> None:
    job = _job(gpu_types=("A100", "H100-80G"), exclude_clusters=("d",), regions=("us-east", "eu-west"),
               exclude_regions=("ap-south",), clusters=("a", "b", "c"))
    doc = job_to_dict(job)
    assert doc["constraints"] == {"gpu_types": ["A100", "H100-80G"], "clusters": ["a", "b", "c"],
                                  "exclude_clusters": ["d"], "regions": ["us-east", "eu-west"],
                                  "exclude_regions": ["ap-south"]}
    assert job_from_dict(doc) == job
    assert job_from_proto(job_to_proto(job)) == job
    plain = _job()
    assert "constraints" not in job_to_dict(plain) and not job_to_proto(plain).HasField("constraints")
    msg = job_to_proto(job)
    msg.constraints.gpu_types.append("B999")
    with pytest.raises(ValidationError) as e:
        job_from_proto(msg)
    assert e.value.field == "job.constraints.gpu_types[2]"


# ------------------------------------------------------------------------------------------------ the view


def test_view_keeps_allowed_clusters_and_links_among_them_only() -> None:
    snap = TOPO.with_free({"a": 3})
    v = view(snap, _job(exclude_clusters=("c",)))
    assert v.names == ("a", "b", "d", "e") and v.revision == 7
    assert v.cluster("a").free == 3
    assert {(lk.a, lk.b) for lk in v.links} == {("a", "b"), ("d", "e"), ("e", "a")}
    # Pairwise figures are the whole snapshot's: a → d still relays through c (which gives no GPUs).
    assert v.bandwidth_gbps("a", "d") == TOPO.bandwidth_gbps("a", "d") == 10
    assert v.latency_ms("a", "d") == TOPO.latency_ms("a", "d") == 10
    assert view(snap, _job()) is snap


def test_views_of_one_snapshot_share_their_structure() -> None:
    topo = Topology(clusters=CLUSTERS, links=LINKS)
    job = _job(gpu_types=("H100", "A100-80G"))
    first = view(topo.with_free({"a": 4}), job)
    later = view(topo.with_free({"a": 2}).with_free({"b": 1}), job)
    assert first.bandwidth_matrix is later.bandwidth_matrix  # built once: the placement memos keep hitting
    assert (first.cluster("a").free, later.cluster("a").free, later.cluster("b").free) == (4, 2, 1)


def test_a_view_does_not_poison_spinsearch_memos() -> None:
    """SpinSearch memoises searches by path matrix: the same job on the whole topology and on a view gets
    each its own answer, in either order, equal to a cold decision."""
    from spiderflow.core.placement import clear_memos

    spin = get_policy("spinsearch")
    free = _job(gmin=12, gmax=16)
    constrained = _job(gmin=12, gmax=16, exclude_clusters=("a", "b"))

    def decided(topo: Topology, job: JobSpec) -> tuple[object, ...]:
        plan = spin.place(topo, job).plan
        assert plan is not None
        return plan.stages, plan.micro_batches, plan.schedule, plan.step_time_s

    clear_memos(TOPO, view(TOPO, constrained))
    cold_free = decided(TOPO, free)
    clear_memos(TOPO, view(TOPO, constrained))
    cold_view = decided(view(TOPO, constrained), constrained)
    for _ in range(2):
        assert decided(TOPO, free) == cold_free
        assert decided(view(TOPO, constrained), constrained) == cold_view
    assert {s.cluster for s in cold_view[0]} <= {"c", "d", "e"}  # type: ignore[attr-defined]
    clear_memos(view(TOPO, constrained))
    for i in range(6):  # decisions on fresh with_free copies of the view share its matrices: memo hits
        spin.place(view(TOPO.with_free({"c": 8 - i % 2}), constrained), constrained)
    assert len(view(TOPO, constrained).memo.searches) == 2  # one search per free-GPU state, not one per copy


def test_unsatisfiable_reasons() -> None:
    assert unsatisfiable(TOPO, _job(gpu_types=("T4",))).startswith("its constraints (gpu_types T4) allow no cluster")
    assert "not in the topology: zz" in unsatisfiable(TOPO, _job(clusters=("zz",)))
    small = TOPO.with_free({"e": 2})
    why = unsatisfiable(small, _job(gmin=12, regions=("ap-south",)))
    assert why == ("needs at least 12 GPUs and the clusters its constraints (regions ap-south) allow (e) offer 2")
    assert unsatisfiable(small, _job(gmin=8, regions=("ap-south",)), held={"e": 6}) == ""  # held GPUs come back
    assert unsatisfiable(TOPO, _job(regions=("eu-west",))) == ""


# ----------------------------------------------------------------------------------------------- the cycle

load_builtin_policies()
ALL_POLICIES = sorted(REGISTRY)
FAST_POLICIES = ("spinsearch", "firstfit", "greedy", "bruteforce")


def _cycle(policy_name: str, topo: Topology, jobs: list[JobSpec], *, holding: tuple[Holder, ...] = (),
           final: bool = False) -> dict[str, CycleDecision]:
    options = CycleOptions(budget=Budget(time_limit_s=0.5, seed=3))
    state = CycleInput(topology=topo, queue=[QueueEntry(spec=j, enqueued_s=float(i)) for i, j in enumerate(jobs)],
                       holding=holding, now=0.0, topology_may_change=not final)
    result = run_cycle(state, get_policy(policy_name), options)
    return {d.job_id: d for d in result.decisions}


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_every_policy_places_only_on_allowed_clusters(policy: str) -> None:
    jobs = [
        _job("gpu-type", gmin=8, gmax=12, gpu_types=("H100", "A100-80G")),  # a, b, e
        _job("not-us", gmin=4, gmax=8, exclude_regions=("us-east",), exclude_clusters=("e",)),  # c, d
        _job("nowhere", gmin=1, gmax=4, gpu_types=("T4",)),
        _job("too-few", gmin=12, gmax=16, clusters=("a",)),
    ]
    out = _cycle(policy, TOPO, jobs)
    for jid, allowed in (("gpu-type", {"a", "b", "e"}), ("not-us", {"c", "d"})):
        d = out[jid]
        assert d.outcome is Outcome.PLACE, (policy, jid, d.reason)
        assert set(d.plan.gpus_by_cluster()) <= allowed, (policy, jid, d.plan)
    for jid in ("nowhere", "too-few"):
        d = out[jid]
        assert (d.outcome, d.constraint, d.tried) == (Outcome.PENDING, "constraints", False)
    assert "allow no cluster" in out["nowhere"].reason
    assert "offer 8" in out["too-few"].reason
    final = _cycle(policy, TOPO, jobs[2:], final=True)
    assert {d.outcome for d in final.values()} == {Outcome.REJECT}


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(FAST_POLICIES),
       gpu=st.lists(st.sampled_from(["A100", "H100", "V100-32G", "A100-40G"]), max_size=2),
       only=st.lists(st.sampled_from("abcde"), max_size=3), exclude=st.lists(st.sampled_from("abcde"), max_size=2),
       region=st.lists(st.sampled_from(["us-east", "eu-west", "ap-south"]), max_size=2),
       busy=st.dictionaries(st.sampled_from("abcde"), st.integers(0, 8)), gmin=st.integers(1, 20))
def test_cycle_honours_random_constraints(policy: str, gpu: list[str], only: list[str], exclude: list[str],
                                          region: list[str], busy: dict[str, int], gmin: int) -> None:
    only = [c for c in only if c not in exclude]
    c = Constraints(gpu_types=tuple(gpu), clusters=tuple(only), exclude_clusters=tuple(exclude),
                    regions=tuple(region))
    topo = TOPO.with_free({k: 8 - v for k, v in busy.items()})
    job = JobSpec(id="p", model=model_preset("gpt3-1.3b"), global_batch=32, seq_len=1024,
                  gpus=GpuRange(min=gmin, max=gmin + 8), constraints=c)
    allowed = set(allowed_clusters(topo, c))
    holding = (Holder(job_id="h", end_s=100.0, gpus=tuple((k, v) for k, v in busy.items() if v)),) if busy else ()
    d = _cycle(policy, topo, [job], holding=holding)["p"]
    offer = sum(8 for n in allowed)  # free + held: every cluster has 8 GPUs
    if offer < gmin:
        assert (d.outcome, d.constraint) == (Outcome.PENDING, "constraints")
    elif d.outcome is Outcome.PLACE:
        assert set(d.plan.gpus_by_cluster()) <= allowed
    else:
        assert d.constraint != "constraints"
    if d.tried:
        assert d.total_free == sum(topo.cluster(n).free for n in allowed)
