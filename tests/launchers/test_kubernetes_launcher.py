"""The Kubernetes launcher.

- its objects (pure functions) equal the expected manifests and pass the official client's models (the API
  schema: unknown fields and wrong types are refused), for a two-node GPU group and a CPU group;
- a bad toleration in the config is refused naming the field;
- the pod-side node supervisor (a real process) starts its node's ranks and multiplexes their output,
  exit statuses included, into the pod log's line format;
- the handle (against an in-memory API answering with the client's models): a completed Job's pod log is
  split into the ranks' lines, stderr and exit statuses; an image that cannot be pulled fails the group
  with Kubernetes' message and deletes the Job; an evicted pod makes the group preempted;
- marked ``kubernetes``: the same one-rank job as the Slurm test against a real cluster, where a kubeconfig
  and an image are given (``SPIDERFLOW_K8S_IMAGE``, ``SPIDERFLOW_K8S_AGENT_HOST``); skipped here.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.config import KubernetesConfig
from agent.launchers.base import GroupResult, StageGroup
from agent.launchers.kubernetes import config_map, headless_service, indexed_job, validate
from agent.launchers.node import decode_line, encode_line, node_ranks
from spiderflow.core.errors import ValidationError
from spiderflow.exec.spec import RankInfo

ROOT = Path(__file__).resolve().parents[2]


def _group(n: int = 8, per_node: int = 4, first: int = 4) -> StageGroup:
    ranks = tuple(RankInfo(rank=first + i, stage=1, replica=i, cluster="k8s") for i in range(n))
    return StageGroup(job="Job_7", attempt=3, ranks=ranks, spec_path=Path("/w/spec.json"), run_dir=Path("/w"),
                      gpus_per_node=per_node, env={"NCCL_DEBUG": "WARN"})


CFG = KubernetesConfig(image="registry.example.com/spiderflow:0.1.0", namespace="training",
                       service_account="spiderflow-worker", node_selector={"gpu": "h100"},
                       tolerations=({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},),
                       checkpoint_claim="ckpt", python="/opt/venv/bin/python")


def test_the_indexed_job_is_the_expected_manifest_and_valid() -> None:
    job = indexed_job(_group(), CFG, host="10.0.0.5", checkpoint_dir="/mnt/ckpt")
    labels = {"app.kubernetes.io/name": "spiderflow-worker", "app.kubernetes.io/managed-by": "spiderflow-agent",
              "spiderflow.io/group": "sf-job-7-a3-r4", "spiderflow.io/attempt": "3"}
    assert job == {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": "sf-job-7-a3-r4", "namespace": "training", "labels": labels,
                     "annotations": {"spiderflow.io/job": "Job_7"}},
        "spec": {
            "completionMode": "Indexed", "completions": 2, "parallelism": 2, "backoffLimit": 0,
            "template": {"metadata": {"labels": labels}, "spec": {
                "subdomain": "sf-job-7-a3-r4", "restartPolicy": "Never",
                "containers": [{
                    "name": "workers", "image": "registry.example.com/spiderflow:0.1.0",
                    "command": ["/opt/venv/bin/python", "-m", "agent.launchers.node", "--spec",
                                "/etc/spiderflow/worker-spec.json", "--first-rank", "4", "--ranks", "8",
                                "--per-node", "4", "--python", "/opt/venv/bin/python"],
                    "env": [{"name": "NCCL_DEBUG", "value": "WARN"}, {"name": "OMP_NUM_THREADS", "value": "1"},
                            {"name": "PYTHONUNBUFFERED", "value": "1"}],
                    "resources": {"limits": {"nvidia.com/gpu": "4"}},
                    "volumeMounts": [{"name": "worker-spec", "mountPath": "/etc/spiderflow", "readOnly": True},
                                     {"name": "checkpoints", "mountPath": "/mnt/ckpt"}],
                }],
                "volumes": [{"name": "worker-spec", "configMap": {"name": "sf-job-7-a3-r4"}},
                            {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ckpt"}}],
                "serviceAccountName": "spiderflow-worker", "nodeSelector": {"gpu": "h100"},
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            }},
        },
    }
    model = validate(job)
    assert type(model).__name__ == "V1Job" and model.spec.completion_mode == "Indexed"


def test_service_config_map_and_cpu_groups_are_valid() -> None:
    g = _group(n=3, per_node=1, first=0)
    svc = headless_service(g, CFG)
    assert svc["spec"] == {"clusterIP": "None", "publishNotReadyAddresses": True,
                           "selector": {"spiderflow.io/group": "sf-job-7-a3-r0"}}
    validate(svc)
    cm = config_map(g, CFG, json.dumps({"job_id": "Job_7"}))
    assert cm["data"] == {"worker-spec.json": '{"job_id": "Job_7"}'}
    validate(cm)
    cpu = KubernetesConfig(image="sf:dev", gpus=False, cpu_per_worker="2")
    job = indexed_job(g, cpu, host="127.0.0.1")
    spec = job["spec"]
    assert (spec["completions"], spec["parallelism"]) == (3, 3)
    [container] = spec["template"]["spec"]["containers"]
    assert container["resources"] == {"requests": {"cpu": "2"}}
    assert {"name": "GLOO_SOCKET_IFNAME", "value": "lo"} in container["env"]
    assert "serviceAccountName" not in spec["template"]["spec"]
    validate(job)


def test_schema_violations_are_refused_naming_the_field() -> None:
    job = indexed_job(_group(), CFG, host="10.0.0.5", checkpoint_dir="/mnt/ckpt")
    job["spec"]["parallelism"] = "two"
    with pytest.raises(ValidationError) as e:
        validate(job)
    assert e.value.field == "Job.spec.parallelism"
    job = indexed_job(_group(), CFG, host="10.0.0.5", checkpoint_dir="/mnt/ckpt")
    job["spec"]["template"]["spec"]["containers"][0]["gpus"] = 4
    with pytest.raises(ValidationError, match=r"containers\.0\.gpus"):
        validate(job)
    from agent.launchers.kubernetes import KubernetesLauncher

    bad = KubernetesConfig(image="sf:dev", tolerations=({"key": "a", "tolerationSeconds": "soon"},))
    with pytest.raises(ValidationError) as e:
        KubernetesLauncher(bad, host="127.0.0.1")
    assert e.value.field == "kubernetes.tolerations[0]"


def test_node_supervisor_multiplexes_its_ranks(tmp_path: Path) -> None:
    assert node_ranks(1, first_rank=4, ranks=7, per_node=4) == [8, 9, 10]
    assert decode_line(encode_line(9, "out", '{"event": "done"}')) == (9, "out", '{"event": "done"}')
    assert decode_line("not ours\n") is None
    # a stand-in interpreter: each "worker" prints an event and a log line, rank 9 fails
    fake = tmp_path / "python"
    fake.write_text('#!/bin/bash\nR="$6"\necho "{\\"event\\": \\"step\\", \\"rank\\": $R}"\necho "log $R" >&2\n'
                    '[ "$R" = 9 ] && exit 3\nsleep 0.2\nexit 0\n')
    fake.chmod(0o755)
    out = subprocess.run([sys.executable, "-m", "agent.launchers.node", "--spec", "/dev/null", "--first-rank", "4",
                          "--ranks", "7", "--per-node", "4", "--python", str(fake)],
                         env={**os.environ, "JOB_COMPLETION_INDEX": "1", "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out.stderr
    lines = [decode_line(x) for x in out.stdout.splitlines(keepends=True)]
    assert all(x is not None for x in lines), out.stdout
    got = {(r, s, t) for r, s, t in lines if s != "exit"}  # type: ignore[misc]
    assert got == {(r, "out", f'{{"event": "step", "rank": {r}}}') for r in (8, 9, 10)} | \
        {(r, "err", f"log {r}") for r in (8, 9, 10)}
    exits = {r: t for r, s, t in lines if s == "exit"}  # type: ignore[misc]
    assert set(exits) == {8, 9, 10} and exits[9] == "3"


def _kube_reason() -> str:
    kubeconfig = os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
    if not Path(kubeconfig).is_file() and not os.environ.get("KUBERNETES_SERVICE_HOST"):
        return f"no Kubernetes cluster: no kubeconfig at {kubeconfig} and not running in a pod"
    if not os.environ.get("SPIDERFLOW_K8S_IMAGE") or not os.environ.get("SPIDERFLOW_K8S_AGENT_HOST"):
        return "SPIDERFLOW_K8S_IMAGE (an image with SpiderFlow) and SPIDERFLOW_K8S_AGENT_HOST (this host, as the " \
               "pods reach it) are not set"
    return ""


@pytest.mark.kubernetes
@pytest.mark.timeout(600)
@pytest.mark.skipif(bool(_kube_reason()), reason=_kube_reason() or "n/a")
def test_a_stage_group_trains_as_a_kubernetes_job(tmp_path: Path) -> None:
    from test_slurm_launcher import CLUSTER, Recorder, _assignment

    from agent.executor import Executor, ExecutorSettings
    from agent.launchers.kubernetes import KubernetesLauncher
    from spiderflow.store import keys
    from spiderflow.store.memory import MemoryStore

    host = os.environ["SPIDERFLOW_K8S_AGENT_HOST"]
    cfg = KubernetesConfig(image=os.environ["SPIDERFLOW_K8S_IMAGE"], gpus=False,
                           namespace=os.environ.get("SPIDERFLOW_K8S_NAMESPACE", "default"))

    async def scenario() -> None:
        store, rec = MemoryStore(), Recorder()
        settings = ExecutorSettings(cluster=CLUSTER, host=host, work_dir=tmp_path / "work",
                                    checkpoint_dir=tmp_path / "ckpt", checkpoint_every=0, failure_grace_s=1.0)
        ex = Executor(settings, store, rec, launcher=KubernetesLauncher(cfg, host=host))
        stop = asyncio.Event()
        task = asyncio.create_task(ex.run(stop))
        try:
            await store.put(keys.assignment_key(CLUSTER, "k1"), _assignment("k1", steps=4))
            await asyncio.wait_for(rec.outcome.wait(), 500)
            [outcome] = rec.requests[-1].outcomes
            assert outcome.succeeded, outcome.error
            assert max(p.step for r in rec.requests for p in r.progress) == 4
        finally:
            stop.set()
            await asyncio.wait_for(task, 60)

    asyncio.run(scenario())


class _Stream:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def stream(self, n: int) -> list[bytes]:
        return [self.data[i:i + n] for i in range(0, len(self.data), n)]


class _FakeApi:
    """The calls of the Batch and Core APIs the handle makes, answered with the client's own models
    (an in-memory stand-in for the API server: the handle's logic, not the transport, is under test)."""

    def __init__(self, pods: list[Any], logs: dict[str, bytes], job_conditions: list[Any],
                 events: list[Any] | None = None) -> None:
        self.pods, self.logs, self.job_conditions, self.events = pods, logs, job_conditions, events or []
        self.deleted: list[tuple[str, str]] = []

    def read_namespaced_job_status(self, name: str, namespace: str) -> object:
        from kubernetes import client

        return client.V1Job(metadata=client.V1ObjectMeta(name=name),
                            status=client.V1JobStatus(conditions=self.job_conditions or None))

    def list_namespaced_pod(self, namespace: str, label_selector: str) -> object:
        from kubernetes import client

        return client.V1PodList(items=self.pods)

    def read_namespaced_pod_log(self, name: str, namespace: str, **_: object) -> _Stream:
        return _Stream(self.logs.get(name, b""))

    def list_namespaced_event(self, namespace: str, field_selector: str) -> object:
        from kubernetes import client

        return client.CoreV1EventList(items=self.events)

    def delete_namespaced_job(self, name: str, namespace: str, **_: object) -> None:
        self.deleted.append(("job", name))

    def delete_namespaced_service(self, name: str, namespace: str) -> None:
        self.deleted.append(("service", name))

    def delete_namespaced_config_map(self, name: str, namespace: str) -> None:
        self.deleted.append(("configmap", name))


def _pod(name: str, phase: str, *, waiting: tuple[str, str] | None = None,
         disrupted: str | None = None) -> Any:
    from kubernetes import client

    statuses = None
    if waiting is not None:
        statuses = [client.V1ContainerStatus(
            name="workers", image="sf:dev", image_id="", ready=False, restart_count=0,
            state=client.V1ContainerState(waiting=client.V1ContainerStateWaiting(reason=waiting[0],
                                                                                  message=waiting[1])))]
    conditions = [client.V1PodCondition(type="DisruptionTarget", status="True", reason="EvictionByEvictionAPI",
                                        message=disrupted)] if disrupted else None
    return client.V1Pod(metadata=client.V1ObjectMeta(name=name),
                        status=client.V1PodStatus(phase=phase, container_statuses=statuses, conditions=conditions))


async def _follow(tmp_path: Path, api: _FakeApi) -> tuple[GroupResult, list[tuple[int, str]]]:
    from agent.launchers.kubernetes import KubernetesHandle

    ranks = tuple(RankInfo(rank=r, stage=0, replica=r, cluster="k8s") for r in (0, 1))
    group = StageGroup(job="j", attempt=1, ranks=ranks, spec_path=tmp_path / "spec.json", run_dir=tmp_path,
                       gpus_per_node=2)
    handle = KubernetesHandle(group, KubernetesConfig(image="sf:dev", poll_s=0.05), api, api)
    lines: list[tuple[int, str]] = []

    async def on_line(rank: int, line: str) -> None:
        lines.append((rank, line))

    result = await asyncio.wait_for(handle.run(on_line), 30)
    await handle.cleanup()
    return result, lines


async def test_a_completed_job_yields_its_ranks_lines_and_statuses(tmp_path: Path) -> None:
    from kubernetes import client

    log = (encode_line(0, "out", '{"event": "step", "step": 1}') + encode_line(1, "err", "warming up")
           + encode_line(1, "out", '{"event": "done"}') + encode_line(0, "exit", "0") + encode_line(1, "exit", "0"))
    api = _FakeApi([_pod("p-0", "Succeeded")], {"p-0": log.encode()},
                   [client.V1JobCondition(type="Complete", status="True")])
    result, lines = await _follow(tmp_path, api)
    assert lines == [(0, '{"event": "step", "step": 1}\n'), (1, '{"event": "done"}\n')]
    assert result.exit_codes == {0: 0, 1: 0} and not result.preempted
    assert (tmp_path / "rank-1.log").read_text() == "warming up\n"
    assert (tmp_path / "rank-0.out").read_text() == '{"event": "step", "step": 1}\n'
    assert sorted(api.deleted) == [("configmap", "sf-j-a1-r0"), ("job", "sf-j-a1-r0"), ("service", "sf-j-a1-r0")]


async def test_an_image_that_cannot_be_pulled_fails_with_kubernetes_message(tmp_path: Path) -> None:
    api = _FakeApi([_pod("p-0", "Pending", waiting=("ErrImagePull", 'pull access denied for "sf:dev"'))], {}, [])
    result, lines = await _follow(tmp_path, api)
    assert lines == [] and result.exit_codes == {0: None, 1: None}
    assert not result.preempted
    assert result.errors[0] == 'pod p-0 cannot start: ErrImagePull: pull access denied for "sf:dev"'
    assert ("job", "sf-j-a1-r0") in api.deleted


async def test_an_evicted_pod_makes_the_group_preempted(tmp_path: Path) -> None:
    from kubernetes import client

    log = encode_line(0, "out", '{"event": "step", "step": 1}').encode()
    api = _FakeApi([_pod("p-0", "Failed", disrupted="Eviction API: evicting")], {"p-0": log},
                   [client.V1JobCondition(type="Failed", status="True", reason="BackoffLimitExceeded")])
    result, lines = await _follow(tmp_path, api)
    assert lines == [(0, '{"event": "step", "step": 1}\n')]
    assert result.preempted == "pod p-0 was stopped by Kubernetes: Eviction API: evicting"
    assert result.exit_codes == {0: None, 1: None}
