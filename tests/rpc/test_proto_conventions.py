"""The protos follow the API conventions: versioned packages, a Request/Response pair per RPC, enums
with a prefixed *_UNSPECIFIED = 0, and documentation on every service, RPC, message and enum."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import grpc_tools
import pytest
from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"
OURS = ("types", "topology", "scheduler", "planner", "agent")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    out = tmp_path_factory.mktemp("desc") / "set.pb"
    protos = [str(PROTOS / "spiderflow" / "proto" / s / "v1" / f"{s}.proto") for s in OURS]
    include = Path(grpc_tools.__file__).parent / "_proto"
    # protoc runs in its own process: its bundled C++ runtime must not meet others loaded here (ortools).
    r = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTOS}", f"-I{include}",
                        "--include_source_info", f"--descriptor_set_out={out}", *protos],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    return {f.name: f for f in fds.file}


def _comments(f: descriptor_pb2.FileDescriptorProto) -> dict[tuple[int, ...], str]:
    return {tuple(loc.path): loc.leading_comments.strip() for loc in f.source_code_info.location}


def _snake_upper(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper()


def test_one_versioned_package_per_service(files: dict[str, descriptor_pb2.FileDescriptorProto]) -> None:
    for s in OURS:
        f = files[f"spiderflow/proto/{s}/v1/{s}.proto"]
        assert f.package == f"spiderflow.{s}.v1"
        assert f.syntax == "proto3"
        if s != "types":
            assert [svc.name for svc in f.service] == [s.capitalize()]


def test_request_response_pair_per_rpc(files: dict[str, descriptor_pb2.FileDescriptorProto]) -> None:
    seen: set[str] = set()
    for f in files.values():
        for svc in f.service:
            for m in svc.method:
                assert m.input_type == f".{f.package}.{m.name}Request", m.name
                assert m.output_type == f".{f.package}.{m.name}Response", m.name
                assert m.input_type not in seen and m.output_type not in seen
                seen |= {m.input_type, m.output_type}


def test_enums_have_unspecified_zero_and_prefix(files: dict[str, descriptor_pb2.FileDescriptorProto]) -> None:
    def enums(f: descriptor_pb2.FileDescriptorProto) -> list[descriptor_pb2.EnumDescriptorProto]:
        out = list(f.enum_type)
        stack = list(f.message_type)
        while stack:
            m = stack.pop()
            out += list(m.enum_type)
            stack += list(m.nested_type)
        return out

    count = 0
    for f in files.values():
        for e in enums(f):
            prefix = _snake_upper(e.name) + "_"
            assert e.value[0].number == 0 and e.value[0].name == prefix + "UNSPECIFIED", e.name
            assert all(v.name.startswith(prefix) for v in e.value), e.name
            count += 1
    assert count >= 6


def test_everything_public_is_documented(files: dict[str, descriptor_pb2.FileDescriptorProto]) -> None:
    # Descriptor paths: 4 = message_type, 5 = enum_type, 6 = service, 2 = method (in a service).
    missing: list[str] = []
    for f in files.values():
        notes = _comments(f)
        for i, svc in enumerate(f.service):
            if not notes.get((6, i)):
                missing.append(svc.name)
            for j, m in enumerate(svc.method):
                if not notes.get((6, i, 2, j)):
                    missing.append(f"{svc.name}.{m.name}")
        for i, msg in enumerate(f.message_type):
            if msg.name.endswith(("Request", "Response")):
                continue  # documented by their RPC
            if not notes.get((4, i)):
                missing.append(msg.name)
        for i, e in enumerate(f.enum_type):
            if not notes.get((5, i)):
                missing.append(e.name)
        header = [loc for loc in f.source_code_info.location if list(loc.path) == [12]]  # 12 = syntax
        assert header and header[0].leading_comments.strip(), f"{f.name} has no header comment"
    assert not missing, f"undocumented: {missing}"


def test_job_spec_fields_are_the_trace_keys(files: dict[str, descriptor_pb2.FileDescriptorProto]) -> None:
    types = files["spiderflow/proto/types/v1/types.proto"]
    job = next(m for m in types.message_type if m.name == "JobSpec")
    from spiderflow.core.codec import _JOB_FIELDS

    assert [fd.name for fd in job.field][:10] == ["id", "model", "global_batch", "micro_batch", "seq_len", "steps",
                                                 "gpus", "arrival_s", "priority", "tenant"]
    assert {fd.name for fd in job.field} == set(_JOB_FIELDS)
    assert next(fd for fd in job.field if fd.name == "model").type_name == ".google.protobuf.Value"
    cluster = next(m for m in types.message_type if m.name == "Cluster")
    from spiderflow.core.codec import _CLUSTER_FIELDS, _LINK_FIELDS

    assert {fd.name for fd in cluster.field} == set(_CLUSTER_FIELDS)
    link = next(m for m in types.message_type if m.name == "Link")
    assert {fd.name for fd in link.field} == set(_LINK_FIELDS)
