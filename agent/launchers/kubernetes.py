"""``kubernetes``: one indexed Job per stage group, one pod per node, through the official ``kubernetes`` client.

Objects (pure functions of the group and the config, checked against the client's models by
:func:`validate`):

- a ConfigMap ``<group>`` holding the worker file (mounted at :data:`SPEC_DIR` in every pod);
- a headless Service ``<group>`` (``clusterIP: None``, ``publishNotReadyAddresses``) selecting the group's
  pods, so pod ``i`` is reachable as ``<group>-<i>.<group>.<namespace>.svc`` from the others;
- a Job ``<group>`` with ``completionMode: Indexed``, ``completions = parallelism = nodes``,
  ``backoffLimit: 0`` (a failed attempt is re-placed by the scheduler, not retried by Kubernetes); each
  pod runs :mod:`agent.launchers.node` for its ``JOB_COMPLETION_INDEX`` (``gpus_per_node`` workers, ranks
  from the group's first rank), asks for ``gpus_per_node`` GPUs as the ``gpu_resource`` extended resource
  (``nvidia.com/gpu``), runs under the configured service account with its node selector and tolerations,
  and mounts the checkpoint claim at the agent's ``checkpoint_dir``.

All ranks of the attempt meet at the TCPStore the rank-0 agent serves (the worker file names its host), so
that host must be reachable from the pods (run the agent in the cluster, or advertise a routable address).

Following (:class:`KubernetesHandle`): the Job's status and its pods are polled every ``poll_s``; each
started pod's log is streamed (``follow``) and demultiplexed into the ranks' lines and exit statuses
(:func:`agent.launchers.node.decode_line`). A pod that cannot start (an image pull failure, a bad
container configuration) or a Job whose pods cannot be created (``FailedCreate``: quota exceeded) ends
the group with Kubernetes' message; pods evicted, preempted or lost with their node (the
``DisruptionTarget`` condition, the ``Evicted`` reason) or a Job past its deadline end it as
``preempted``. :meth:`KubernetesHandle.stop` deletes the Job (foreground, the pods with it, within the
grace); :meth:`KubernetesHandle.cleanup` deletes the Job, the Service and the ConfigMap.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from agent.config import KubernetesConfig
from agent.launchers.base import GroupResult, LauncherKind, LaunchError, LineSink, StageGroup, worker_env
from agent.launchers.node import decode_line
from spiderflow.core.errors import ValidationError

__all__ = [
    "SPEC_DIR",
    "KubernetesHandle",
    "KubernetesLauncher",
    "config_map",
    "group_labels",
    "headless_service",
    "indexed_job",
    "validate",
]

log = structlog.get_logger(__name__)

SPEC_DIR = "/etc/spiderflow"
_SPEC_FILE = "worker-spec.json"
_CANNOT_START = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
                           "CreateContainerError", "ErrImageNeverPull"})
_DISRUPTED = frozenset({"Evicted", "Preempting", "NodeLost", "Shutdown", "Terminated", "NodeShutdown"})
_ENV_KEYS = ("OMP_NUM_THREADS", "PYTHONUNBUFFERED", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")


def group_labels(group: StageGroup) -> dict[str, str]:
    """Labels of every object of ``group`` (the Service selects the pods by ``spiderflow.io/group``)."""
    return {"app.kubernetes.io/name": "spiderflow-worker", "app.kubernetes.io/managed-by": "spiderflow-agent",
            "spiderflow.io/group": group.name, "spiderflow.io/attempt": str(group.attempt)}


def _metadata(group: StageGroup, config: KubernetesConfig) -> dict[str, Any]:
    return {"name": group.name, "namespace": config.namespace, "labels": group_labels(group),
            "annotations": {"spiderflow.io/job": group.job}}


def config_map(group: StageGroup, config: KubernetesConfig, spec_text: str) -> dict[str, Any]:
    """The ConfigMap carrying the worker file."""
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(group, config),
            "data": {_SPEC_FILE: spec_text}}


def headless_service(group: StageGroup, config: KubernetesConfig) -> dict[str, Any]:
    """The headless Service giving the group's pods stable DNS names."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(group, config),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {"spiderflow.io/group": group.name}}}


def indexed_job(group: StageGroup, config: KubernetesConfig, *, host: str,
                checkpoint_dir: str | None = None) -> dict[str, Any]:
    """The indexed Job of ``group`` (one pod per node; see the module docstring). ``host``: the
    rendezvous host (for the workers' environment); ``checkpoint_dir``: where the checkpoint claim is
    mounted (the agent's checkpoint root)."""
    env = worker_env(host, group.env, inherit=False)
    env_list = [{"name": k, "value": env[k]} for k in sorted(env) if k in _ENV_KEYS or k in group.env]
    per_node = group.ranks_per_node
    if config.gpus:
        resources = {"limits": {config.gpu_resource: str(per_node)}}
    else:
        resources = {"requests": {"cpu": config.cpu_per_worker}}
    mounts = [{"name": "worker-spec", "mountPath": SPEC_DIR, "readOnly": True}]
    volumes: list[dict[str, Any]] = [{"name": "worker-spec", "configMap": {"name": group.name}}]
    if config.checkpoint_claim:
        if not checkpoint_dir:
            raise ValidationError("checkpoint_dir", "is required with kubernetes.checkpoint_claim (the mount path)")
        mounts.append({"name": "checkpoints", "mountPath": checkpoint_dir})
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": config.checkpoint_claim}})
    container = {
        "name": "workers", "image": config.image,
        "command": [config.python, "-m", "agent.launchers.node", "--spec", f"{SPEC_DIR}/{_SPEC_FILE}",
                    "--first-rank", str(group.first_rank), "--ranks", str(group.size), "--per-node", str(per_node),
                    "--python", config.python],
        "env": env_list, "resources": resources, "volumeMounts": mounts,
    }
    pod_spec: dict[str, Any] = {"subdomain": group.name, "restartPolicy": "Never", "containers": [container],
                                "volumes": volumes}
    if config.service_account:
        pod_spec["serviceAccountName"] = config.service_account
    if config.node_selector:
        pod_spec["nodeSelector"] = dict(config.node_selector)
    if config.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in config.tolerations]
    return {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": _metadata(group, config),
        "spec": {"completionMode": "Indexed", "completions": group.nodes, "parallelism": group.nodes,
                 "backoffLimit": 0,
                 "template": {"metadata": {"labels": group_labels(group)}, "spec": pod_spec}},
    }


_MODELS = {"Job": "V1Job", "Service": "V1Service", "ConfigMap": "V1ConfigMap", "Toleration": "V1Toleration"}


def validate(manifest: dict[str, Any], kind: str | None = None) -> Any:
    """The ``kubernetes`` client's model of ``manifest`` (its ``kind``, or ``kind`` for a part such as a
    ``Toleration``), checked against the API schema: unknown fields and wrong types are refused, and the
    model serialises back to exactly ``manifest``. :class:`ValidationError` naming the field otherwise."""
    import pydantic
    from kubernetes import client

    name = kind or str(manifest.get("kind"))
    model = getattr(client, _MODELS.get(name, f"V1{name}"), None)
    if model is None:
        raise ValidationError("kind", "no Kubernetes model of this kind", name)
    try:
        obj = model.model_validate(manifest)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        raise ValidationError(f"{name}." + ".".join(str(x) for x in err["loc"]), err["msg"]) from None
    back = client.ApiClient().sanitize_for_serialization(obj)
    if back != manifest:
        raise ValidationError(name, "does not serialise back to the same manifest", manifest)
    return obj


def _api_message(e: Exception) -> str:
    body = getattr(e, "body", None)
    if body:
        with contextlib.suppress(ValueError, TypeError):
            doc = json.loads(body)
            if isinstance(doc, dict) and doc.get("message"):
                return str(doc["message"])
    reason = getattr(e, "reason", None)
    return str(reason or e)


class KubernetesHandle:
    """One launched indexed Job (see the module docstring)."""

    def __init__(self, group: StageGroup, config: KubernetesConfig, batch: Any, core: Any) -> None:
        self.group = group
        self.config = config
        self._batch = batch
        self._core = core
        self._stopping = False
        self._deleted = False
        self._followed: set[str] = set()

    @property
    def ident(self) -> str:
        return f"kubernetes job {self.config.namespace}/{self.group.name}"

    @property
    def pids(self) -> dict[int, int]:
        return {}  # the workers run on the workload manager's nodes

    def _follow(self, pod: str, push: Callable[[str | None], None]) -> None:
        """Stream a pod's log into ``push`` (a thread: the client is synchronous); None at the end."""
        try:
            resp = self._core.read_namespaced_pod_log(pod, self.config.namespace, follow=True,
                                                      _preload_content=False)
            buf = b""
            for chunk in resp.stream(4096):
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    push(line.decode(errors="replace") + "\n")
            if buf:
                push(buf.decode(errors="replace"))
        except Exception as e:  # a log stream that breaks ends this pod's lines, not the group
            log.info("kubernetes.log_stream_ended", pod=pod, error=str(e))
        finally:
            push(None)

    async def run(self, on_line: LineSink) -> GroupResult:
        g, cfg = self.group, self.config
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[str | None] = asyncio.Queue()
        streams = 0
        exit_codes: dict[int, int | None] = {r.rank: None for r in g.ranks}
        errs: dict[int, list[str]] = {r.rank: [] for r in g.ranks}
        outs = {r.rank: (g.run_dir / f"rank-{r.rank}.out").open("a") for r in g.ranks}
        failure = ""
        preempted = ""

        async def drain() -> None:
            nonlocal streams
            while not queue.empty():
                item = queue.get_nowait()
                if item is None:
                    streams -= 1
                    continue
                parsed = decode_line(item)
                if parsed is None:
                    continue
                rank, stream, text = parsed
                if rank not in exit_codes:
                    continue
                if stream == "out":
                    outs[rank].write(text + "\n")
                    outs[rank].flush()
                    await on_line(rank, text + "\n")
                elif stream == "err":
                    errs[rank] = [*errs[rank][-11:], text]
                else:
                    with contextlib.suppress(ValueError):
                        exit_codes[rank] = int(text)

        selector = f"spiderflow.io/group={g.name}"
        try:
            while True:
                await drain()
                job = await asyncio.to_thread(self._batch.read_namespaced_job_status, g.name, cfg.namespace)
                pods = (await asyncio.to_thread(self._core.list_namespaced_pod, cfg.namespace,
                                                label_selector=selector)).items
                for pod in pods:
                    name = pod.metadata.name
                    phase = pod.status.phase if pod.status else None
                    for cs in (pod.status.container_statuses or []) if pod.status else []:
                        waiting = cs.state.waiting if cs.state else None
                        if waiting is not None and waiting.reason in _CANNOT_START and not failure:
                            failure = f"pod {name} cannot start: {waiting.reason}: {waiting.message or ''}".strip()
                    conds = {c.type: c for c in (pod.status.conditions or [])} if pod.status else {}
                    disrupted = conds.get("DisruptionTarget")
                    if not preempted and ((disrupted is not None and disrupted.status == "True")
                                          or (pod.status and pod.status.reason in _DISRUPTED)):
                        why = disrupted.message if disrupted is not None and disrupted.message else pod.status.reason
                        preempted = f"pod {name} was stopped by Kubernetes: {why}"
                    if name not in self._followed and phase in ("Running", "Succeeded", "Failed"):
                        self._followed.add(name)
                        streams += 1

                        def push(item: str | None) -> None:
                            loop.call_soon_threadsafe(queue.put_nowait, item)

                        threading.Thread(target=self._follow, args=(name, push), daemon=True).start()
                if not pods and not failure:
                    events = await asyncio.to_thread(
                        self._core.list_namespaced_event, cfg.namespace,
                        field_selector=f"involvedObject.name={g.name},reason=FailedCreate")
                    if events.items:
                        failure = f"job {g.name}: {events.items[-1].message}"
                conditions = {c.type: c for c in (job.status.conditions or [])} if job.status else {}
                failed = conditions.get("Failed")
                if failure and not self._stopping:
                    await self.stop(5.0)
                    break
                if "Complete" in conditions or (failed is not None and failed.status == "True"):
                    if failed is not None and failed.reason == "DeadlineExceeded" and not preempted:
                        preempted = f"job {g.name}: {failed.message or failed.reason}"
                    break
                if self._deleted:
                    break
                await asyncio.sleep(cfg.poll_s)
            deadline = loop.time() + 30.0
            while streams > 0 and loop.time() < deadline:
                await drain()
                await asyncio.sleep(0.1)
            await drain()
        finally:
            for f in outs.values():
                f.close()
        for rank, lines in errs.items():
            (g.run_dir / f"rank-{rank}.log").write_text("\n".join(lines) + "\n")
        errors = {rank: failure or "\n".join(lines) for rank, lines in errs.items()}
        return GroupResult(exit_codes=exit_codes, errors=errors,
                           preempted="" if self._stopping or failure else preempted)

    async def _delete(self, grace_s: int, propagation: str) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            await asyncio.to_thread(self._batch.delete_namespaced_job, self.group.name, self.config.namespace,
                                    grace_period_seconds=grace_s, propagation_policy=propagation)
        except ApiException as e:
            if e.status != 404:
                log.warning("kubernetes.delete_failed", job=self.group.name, error=_api_message(e))
        self._deleted = True

    async def stop(self, grace_s: float) -> None:
        self._stopping = True
        if not self._deleted:
            await self._delete(max(0, int(grace_s)), "Foreground")

    async def cleanup(self) -> None:
        from kubernetes.client.exceptions import ApiException

        if not self._deleted:
            await self._delete(0, "Background")
        for call in (self._core.delete_namespaced_service, self._core.delete_namespaced_config_map):
            try:
                await asyncio.to_thread(call, self.group.name, self.config.namespace)
            except ApiException as e:
                if e.status != 404:
                    log.warning("kubernetes.delete_failed", name=self.group.name, error=_api_message(e))


class KubernetesLauncher:
    """Creates a ConfigMap, a headless Service and an indexed Job per stage group (see the module
    docstring). ``host``: the rendezvous host; ``checkpoint_dir``: where the checkpoint claim is mounted."""

    kind = LauncherKind.KUBERNETES

    def __init__(self, config: KubernetesConfig, *, host: str, checkpoint_dir: str | None = None) -> None:
        for i, t in enumerate(config.tolerations):
            try:
                validate(dict(t), "Toleration")
            except ValidationError as e:
                raise ValidationError(f"kubernetes.tolerations[{i}]", e.reason, t) from None
        self.config = config
        self.host = host
        self.checkpoint_dir = checkpoint_dir
        self._apis: tuple[Any, Any] | None = None

    def _clients(self) -> tuple[Any, Any]:
        if self._apis is None:
            from kubernetes import client, config

            if self.config.kubeconfig is None and self.config.context is None:
                try:
                    config.load_incluster_config()
                    api = client.ApiClient()
                except config.ConfigException:
                    api = config.new_client_from_config()
            else:
                api = config.new_client_from_config(config_file=self.config.kubeconfig, context=self.config.context)
            self._apis = (client.BatchV1Api(api), client.CoreV1Api(api))
        return self._apis

    async def launch(self, group: StageGroup) -> KubernetesHandle:
        from kubernetes.client.exceptions import ApiException

        cfg = self.config
        spec_text = Path(group.spec_path).read_text()
        objects = [config_map(group, cfg, spec_text), headless_service(group, cfg),
                   indexed_job(group, cfg, host=self.host, checkpoint_dir=self.checkpoint_dir)]
        for obj in objects:
            validate(obj)
        try:
            batch, core = await asyncio.to_thread(self._clients)
        except Exception as e:
            raise LaunchError(f"no Kubernetes API: {e}") from None
        handle = KubernetesHandle(group, cfg, batch, core)
        try:
            await asyncio.to_thread(core.create_namespaced_config_map, cfg.namespace, objects[0])
            await asyncio.to_thread(core.create_namespaced_service, cfg.namespace, objects[1])
            await asyncio.to_thread(batch.create_namespaced_job, cfg.namespace, objects[2])
        except ApiException as e:
            await handle.cleanup()
            raise LaunchError(_api_message(e)) from None
        log.info("kubernetes.job_created", job=group.name, namespace=cfg.namespace, pods=group.nodes,
                 per_node=group.ranks_per_node, first_rank=group.first_rank)
        return handle
