"""Fuzzing, CI subset: every RPC of the Scheduler, Planner, Topology, Agent and Control services and the topology/trace
loaders, a few dozen derandomized hypothesis cases each (``bench/fuzz.py --cases N`` is the long run).

Oracle: :mod:`fuzz_harness` (never INTERNAL/UNKNOWN/UNAVAILABLE, the server keeps answering, a refused
request leaves etcd untouched); loaders raise only ``ValidationError``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fuzz_harness import FuzzTarget
from hypothesis import HealthCheck, given, settings
from strategies import RPCS, documents, requests

from spiderflow.core.errors import ValidationError
from spiderflow.formats import load_topology, load_trace, topology_from_dict, trace_from_dict
from spiderflow.store.process import EtcdProcess

CI = settings(max_examples=25, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def target() -> Iterator[FuzzTarget]:
    etcd = EtcdProcess()
    etcd.start()
    t = FuzzTarget(etcd.endpoint)
    try:
        yield t.start()
    finally:
        t.close()
        etcd.close()


@pytest.mark.parametrize("rpc", sorted(RPCS))
def test_rpc_fuzz(target: FuzzTarget, rpc: str) -> None:
    @CI
    @given(requests(rpc))
    def case(request: Any) -> None:
        target.check(rpc, request)

    case()
    assert sum(target.codes[rpc].values()) >= 1


@pytest.mark.parametrize(("kind", "loader"), [("topology", topology_from_dict), ("trace", trace_from_dict)])
def test_format_fuzz(kind: str, loader: Any) -> None:
    @CI
    @given(documents(kind))
    def case(doc: Any) -> None:
        with contextlib.suppress(ValidationError):
            loader(doc)

    case()


@pytest.mark.parametrize(("kind", "load"), [("topology", load_topology), ("trace", load_trace)])
def test_file_fuzz(kind: str, load: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The same documents through real files, as JSON and YAML, plus raw bytes."""
    d: Path = tmp_path_factory.mktemp("fuzz-files")

    @CI
    @given(documents(kind))
    def case(doc: Any) -> None:
        for name, body in [("f.json", json.dumps(doc, allow_nan=True).encode()),
                           ("f.yaml", yaml.safe_dump(doc, allow_unicode=True).encode()),
                           ("f.yaml", b"\xff\xfe{[" + json.dumps(doc).encode()[:50])]:
            (d / name).write_bytes(body)
            with contextlib.suppress(ValidationError):
                load(d / name)

    case()


def _spec() -> Any:
    from spiderflow.formats import job_from_dict
    from spiderflow.rpc import convert

    return convert.job_to_proto(job_from_dict({"id": "r1", "model": "gpt-tiny", "global_batch": 8,
                                               "gpus": {"min": 1, "max": 1}}))


def test_regression_watch_from_revision_overflow(target: FuzzTarget) -> None:
    """Found by bench/fuzz.py: from_revision = 2^63-1 overflowed the etcd watch's start revision."""
    from spiderflow.proto.scheduler.v1 import scheduler_pb2

    req = scheduler_pb2.WatchJobRequest(job_id="fz-1", from_revision=2**63 - 1)
    assert target.check("Scheduler/WatchJob", req).name in ("INVALID_ARGUMENT", "NOT_FOUND")


def test_regression_model_nan_is_invalid_argument(target: FuzzTarget) -> None:
    from google.protobuf import struct_pb2

    from spiderflow.proto.scheduler.v1 import scheduler_pb2

    req = scheduler_pb2.SubmitJobRequest(request_id="nan-1", job=_spec())
    req.job.model.CopyFrom(struct_pb2.Value(number_value=float("nan")))
    assert target.check("Scheduler/SubmitJob", req).name == "INVALID_ARGUMENT"


def test_regression_out_of_range_timestamp_is_invalid_argument(target: FuzzTarget) -> None:
    from google.protobuf import timestamp_pb2

    from spiderflow.proto.topology.v1 import topology_pb2
    from spiderflow.proto.types.v1 import types_pb2

    req = topology_pb2.ReportProfileRequest(
        agent_id="fz-agent", agent_address="127.0.0.1:1",
        cluster=types_pb2.Cluster(name="fz", gpu="A100-80G", nodes=1, gpus_per_node=8, free_gpus=4),
        measured_at=timestamp_pb2.Timestamp(seconds=2**63 - 1))
    assert target.check("Topology/ReportProfile", req).name in ("INVALID_ARGUMENT", "PERMISSION_DENIED")


def test_regression_read_logs_offsets_are_invalid_argument(target: FuzzTarget) -> None:
    """Found by bench/fuzz.py: a negative or huge resume offset made the agent's ReadLogs seek fail
    (INTERNAL); an offset past the end of a file reads nothing."""
    from spiderflow.proto.agent.v1 import agent_pb2

    for off in (-5, 2**63 - 1):
        req = agent_pb2.ReadLogsRequest(job_id="fz-1", offsets=[
            agent_pb2.ReadLogsOffset(attempt=1, rank=0, stream="stdout", offset=off)])
        assert target.check("Agent/ReadLogs", req).name == "INVALID_ARGUMENT"
    req = agent_pb2.ReadLogsRequest(job_id="fz-1", attempt=-1)
    assert target.check("Agent/ReadLogs", req).name == "INVALID_ARGUMENT"
    req = agent_pb2.ReadLogsRequest(job_id="fz-1", offsets=[
        agent_pb2.ReadLogsOffset(attempt=1, rank=0, stream="stdout", offset=2**53)])
    assert target.check("Agent/ReadLogs", req).name == "OK"
    assert target.codes["Agent/ReadLogs (wrong identity)"]["PERMISSION_DENIED"] >= 4
