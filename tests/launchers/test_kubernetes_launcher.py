"""The Kubernetes launcher.

- its objects (pure functions) equal the expected manifests and pass the official client's models (the API
  schema: unknown fields and wrong types are refused), for a two-node GPU group and a CPU group;
- a bad toleration in the config is refused naming the field;
- the pod-side node supervisor (a real process) starts its node's ranks and multiplexes their output,
  exit statuses included, into the pod log's line format;
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

import pytest

from agent.config import KubernetesConfig
from agent.launchers.base import StageGroup
from agent.launchers.kubernetes import config_map, headless_service, indexed_job, validate
from agent.launchers.node import decode_line, encode_line, node_ranks
from spiderflow.errors import ValidationError
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
