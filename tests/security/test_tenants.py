"""Tenants are isolated in ids, request ids, quotas and the queue: the id probe, the ``..`` id, oversized
ids and reasons, per-tenant quotas, and one tenant flooding the queue, against a real etcd and a Scheduler
service serving mTLS (certificates of ``spiderflow certs init``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from services.scheduler.cycle import DecisionKind, SchedulingCycle
from services.scheduler.repo import JobRepository
from services.scheduler.service import SchedulerService
from services.scheduler.topology_source import StaticTopologySource
from spiderflow.core.errors import ValidationError
from spiderflow.core.placement import Budget
from spiderflow.core.tenancy import Entry, TenantQuota, arrange
from spiderflow.formats import job_from_dict, topology_from_dict
from spiderflow.jobs import JobState
from spiderflow.proto.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from spiderflow.proto.types.v1 import types_pb2
from spiderflow.rpc import convert
from spiderflow.rpc.server import RpcServer, open_channel, serve
from spiderflow.security import ids
from spiderflow.security.auth import Authenticator, AuthInterceptor
from spiderflow.security.tls import channel_credentials, server_credentials
from spiderflow.store import keys
from spiderflow.store.etcd import EtcdStore
from spiderflow.store.process import EtcdProcess

Code = grpc.StatusCode
POOL = topology_from_dict({"clusters": [{"name": "solo", "gpu": "A100-80G", "nodes": 1, "gpus_per_node": 2}],
                           "links": []})


@dataclass(kw_only=True)
class Mesh:
    repo: JobRepository
    server: RpcServer
    certs: Path

    def stub(self, bundle: str) -> tuple[grpc.aio.Channel, scheduler_pb2_grpc.SchedulerStub]:
        ch = open_channel(self.server.address, credentials=channel_credentials(self.certs / bundle))
        return ch, scheduler_pb2_grpc.SchedulerStub(ch)


@pytest.fixture
async def mesh(module_etcd: EtcdProcess, certs: Path) -> AsyncIterator[Mesh]:
    store = EtcdStore(module_etcd.endpoint)
    await store.delete_prefix(keys.ROOT)
    repo = JobRepository(store)
    service = SchedulerService(repo, tenant_quota=TenantQuota(max_queued=12, max_watches=2))
    server = await serve([service], credentials=server_credentials(certs / "scheduler"),
                         interceptors=[AuthInterceptor(Authenticator(certificates=True))])
    try:
        yield Mesh(repo=repo, server=server, certs=certs)
    finally:
        await server.stop(grace_s=0)
        await store.close()


def _job(job_id: str, *, gpus: int = 1, max_gpus: int | None = None) -> types_pb2.JobSpec:
    doc: dict[str, Any] = {"id": "x", "model": "gpt-tiny", "global_batch": 8, "seq_len": 64, "steps": 5,
                           "gpus": {"min": gpus, "max": max_gpus or gpus}}
    spec = convert.job_to_proto(job_from_dict(doc))
    spec.id = job_id  # unvalidated on the client: the server must refuse what breaks the grammar
    spec.tenant = ""
    return spec


async def _code(coro: Any) -> Code:
    try:
        await coro
    except grpc.aio.AioRpcError as e:
        return e.code()
    return Code.OK


async def test_no_id_oracle_and_request_ids_scoped_per_tenant(mesh: Mesh) -> None:
    ca, alice = mesh.stub("tenant-alice")
    cb, bob = mesh.stub("tenant-bob")
    async with ca, cb:
        a = await alice.SubmitJob(scheduler_pb2.SubmitJobRequest(request_id="r-1", job=_job("train")), timeout=10)
        assert a.created and a.job.spec.id == "alice~train"
        # Bob picks the same job id and even the same request id: he gets his own job, learns nothing.
        b = await bob.SubmitJob(scheduler_pb2.SubmitJobRequest(request_id="r-1", job=_job("train")), timeout=10)
        assert b.created and b.job.spec.id == "bob~train" and b.job.spec.tenant == "bob"
        # Alice's retry is idempotent; her own job by bare or qualified id.
        again = await alice.SubmitJob(scheduler_pb2.SubmitJobRequest(request_id="r-1", job=_job("train")), timeout=10)
        assert not again.created and again.job.spec.id == "alice~train"
        for name in ("train", "alice~train"):
            got = await alice.GetJob(scheduler_pb2.GetJobRequest(job_id=name), timeout=10)
            assert got.job.spec.id == "alice~train"
        # Another tenant's existing job and a job that does not exist give the same answer.
        answers = []
        for name in ("alice~train", "alice~no-such-job"):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await bob.GetJob(scheduler_pb2.GetJobRequest(job_id=name), timeout=10)
            answers.append((err.value.code(), (err.value.details() or "").replace(name, "<id>")))
            assert await _code(bob.CancelJob(scheduler_pb2.CancelJobRequest(job_id=name), timeout=10)) is Code.NOT_FOUND
        assert answers[0] == answers[1] and answers[0][0] is Code.NOT_FOUND
    assert (await mesh.repo.get("alice~train")).record.state is JobState.PENDING


@pytest.mark.parametrize("bad", ["..", ".", ".hidden", "a/b", "a\x00b", "a\nb", "a b", "", "é", "x" * 129,
                                 "bob~x", "default~x"])
async def test_ids_outside_the_grammar_are_refused(mesh: Mesh, bad: str) -> None:
    ca, alice = mesh.stub("tenant-alice")
    async with ca:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await alice.SubmitJob(scheduler_pb2.SubmitJobRequest(request_id="r-1", job=_job(bad)), timeout=10)
        assert err.value.code() is Code.INVALID_ARGUMENT
        assert "id" in (err.value.details() or "")
        if bad:
            code = await _code(alice.SubmitJob(scheduler_pb2.SubmitJobRequest(request_id=bad, job=_job("ok")),
                                               timeout=10))
            assert code is Code.INVALID_ARGUMENT
    assert (await mesh.repo.list())[0] == []


async def test_huge_ids_and_reasons_are_invalid_argument(mesh: Mesh) -> None:
    ca, alice = mesh.stub("tenant-alice")
    async with ca:
        await alice.SubmitJob(scheduler_pb2.SubmitJobRequest(request_id="r-1", job=_job("j")), timeout=10)
        huge = "j" * (2 << 20)
        for call in (alice.GetJob(scheduler_pb2.GetJobRequest(job_id=huge), timeout=10),
                     alice.CancelJob(scheduler_pb2.CancelJobRequest(job_id=huge), timeout=10),
                     alice.CancelJob(scheduler_pb2.CancelJobRequest(job_id="j", reason="r" * (1 << 20)), timeout=10)):
            assert await _code(call) is Code.INVALID_ARGUMENT
        stream = alice.WatchJob(scheduler_pb2.WatchJobRequest(job_id=huge), timeout=10)
        assert await _code(stream.read()) is Code.INVALID_ARGUMENT
    assert (await mesh.repo.get("alice~j")).record.state is JobState.PENDING


async def test_quotas_are_per_tenant(mesh: Mesh) -> None:
    ca, alice = mesh.stub("tenant-alice")
    cb, bob = mesh.stub("tenant-bob")
    async with ca, cb:
        codes = [await _code(alice.SubmitJob(scheduler_pb2.SubmitJobRequest(request_id=f"r-{i}", job=_job(f"j{i}")),
                                             timeout=10)) for i in range(14)]
        assert codes[:12] == [Code.OK] * 12 and set(codes[12:]) == {Code.RESOURCE_EXHAUSTED}
        # Bob is not affected by Alice's full queue.
        assert await _code(bob.SubmitJob(scheduler_pb2.SubmitJobRequest(request_id="r-0", job=_job("j0")),
                                         timeout=10)) is Code.OK
        # Watches: two per caller.
        streams = [alice.WatchJob(scheduler_pb2.WatchJobRequest(job_id="j0")) for _ in range(2)]
        for s in streams:
            assert (await s.read()).job.spec.id == "alice~j0"
        third = alice.WatchJob(scheduler_pb2.WatchJobRequest(job_id="j1"), timeout=10)
        assert await _code(third.read()) is Code.RESOURCE_EXHAUSTED
        mine = bob.WatchJob(scheduler_pb2.WatchJobRequest(job_id="j0"), timeout=10)
        assert (await mine.read()).job.spec.id == "bob~j0"
        for s in [*streams, mine]:
            s.cancel()


async def test_a_flooding_tenant_does_not_block_another(mesh: Mesh) -> None:
    """Alice holds the whole 2-GPU pool and floods the queue with jobs needing 64 GPUs (never placeable)
    and jobs needing the whole pool; Bob's 1-GPU job is placed by the first cycle after GPUs are free."""
    cycle = SchedulingCycle(mesh.repo, StaticTopologySource(POOL), default_policy="spinsearch",
                            budget=Budget(time_limit_s=5.0))
    ca, alice = mesh.stub("tenant-alice")
    cb, bob = mesh.stub("tenant-bob")
    async with ca, cb:
        await alice.SubmitJob(scheduler_pb2.SubmitJobRequest(request_id="big-0", job=_job("big-0", gpus=2)),
                              timeout=10)
        assert (await cycle.run()).placed == ["alice~big-0"]
        for i in range(5):
            await alice.SubmitJob(scheduler_pb2.SubmitJobRequest(request_id=f"huge-{i}",
                                                                 job=_job(f"huge-{i}", gpus=64)), timeout=10)
        for i in range(1, 6):
            await alice.SubmitJob(scheduler_pb2.SubmitJobRequest(request_id=f"big-{i}",
                                                                 job=_job(f"big-{i}", gpus=2)), timeout=10)
        await bob.SubmitJob(scheduler_pb2.SubmitJobRequest(request_id="small", job=_job("small", max_gpus=1)),
                            timeout=10)
        report = await cycle.run()  # no GPU free: nothing placed; the 64-GPU jobs are parked as unresolvable
        assert report.placed == []
        kinds = {d.job_id: d.kind for d in report.decisions}
        assert all(kinds[f"alice~huge-{i}"] is DecisionKind.UNRESOLVABLE for i in range(5))
        huge = await alice.GetJob(scheduler_pb2.GetJobRequest(job_id="huge-0"), timeout=10)
        assert "cannot run until clusters join" in huge.job.reason
        # Alice's running job ends: its GPUs are free.
        running = await mesh.repo.get("alice~big-0")
        await mesh.repo.transition(running, running.record.to(JobState.SUCCEEDED, "done", now=mesh.repo.clock()))
        report = await cycle.run()
        assert report.placed[0] == "bob~small"
        got = await bob.GetJob(scheduler_pb2.GetJobRequest(job_id="small"), timeout=10)
        assert got.job.state == types_pb2.JOB_STATE_PLACED


# -- pure parts ------------------------------------------------------------------------------------------


def test_id_grammar_and_paths(tmp_path: Path) -> None:
    assert ids.qualify("alice", "train") == "alice~train" and ids.qualify("default", "train") == "train"
    assert ids.split_job_id("job_id", "alice~train") == ("alice", "train")
    for bad in ("..", ".", "a\x00", "a\n", "/etc", "", "~x", "a~", "a~b~c", "default~x", "x" * 200):
        with pytest.raises(ValidationError):
            ids.check_job_id("job_id", bad)
    root = tmp_path / "work"
    root.mkdir()
    assert ids.inside(root, "alice~j", "attempt-1") == root.resolve() / "alice~j" / "attempt-1"
    for bad in ("..", ".", "../x", "a/../../b"):
        with pytest.raises(ValidationError, match="path"):
            ids.inside(root, bad, "attempt-1")
    (root / "link").symlink_to(tmp_path)  # a link placed inside the root that points out of it
    with pytest.raises(ValidationError, match="escapes"):
        ids.inside(root, "link", "x")
    with pytest.raises(ValidationError, match="id"):
        job_from_dict({"id": "..", "model": "gpt-tiny", "global_batch": 8, "gpus": {"min": 1, "max": 1}})
    with pytest.raises(ValidationError):
        keys.job_key("..")


def test_arrange_parks_and_shares_fairly() -> None:
    q = [Entry(job_id=f"a{i}", tenant="a", min_gpus=2) for i in range(4)] + \
        [Entry(job_id="huge", tenant="a", min_gpus=64), Entry(job_id="b0", tenant="b", min_gpus=1),
         Entry(job_id="b1", tenant="b", min_gpus=1), Entry(job_id="c0", tenant="c", min_gpus=4)]
    out = arrange(q, held={}, capacity=8)
    assert out.parked.keys() == {"huge"} and out.unresolvable == {"huge"}
    assert out.order[:4] == ["b0", "c0", "a0", "b1"]  # least share first; on equal shares, least demand
    assert sorted(out.order) == sorted(e.job_id for e in q if e.job_id != "huge")
    # A tenant holding GPUs yields to one that holds none.
    assert arrange(q, held={"b": 6}, capacity=8).order[:2] == ["c0", "a0"]
    # GPU quota: a tenant never queues past it in one cycle.
    quota = arrange(q, held={"a": 2}, capacity=8, quota=TenantQuota(max_gpus=6))
    assert [j for j in quota.order if j.startswith("a")] == ["a0", "a1"] and "a2" in quota.parked
    with pytest.raises(ValidationError, match="max_gpus"):
        TenantQuota(max_gpus=0)
