"""Worker process entry: ``python -m spiderflow.exec.worker --spec FILE.json [--rank N]``.

``FILE.json`` is a :func:`spiderflow.exec.spec.spec_to_dict` object plus::

    "rendezvous": {"host": "10.0.0.1", "port": 29500, "world_size": 4, "rank": 0,
                   "serve": null, "timeout_s": 120},
    "namespace": "job-7/attempt-2"          (optional TCPStore key prefix)

``--rank`` overrides ``rendezvous.rank`` so one file serves every rank of a cluster. The worker prints one
JSON object per line on stdout (the agent forwards them):

- ``{"event": "step", "job_id", "step", "rank", "stage", "replica", "step_time_s", "tokens_per_s", "loss",
  "busy_s"}``
- ``{"event": "checkpoint", "manifest": {...}}`` (rank 0, after every complete checkpoint; the default
  ``manifest.json`` is written too)
- ``{"event": "done", "rank", "first_step", "last_step", "losses", "step_times_s", "phases", "memory"}``
  (``phases`` and ``memory``: :attr:`spiderflow.exec.runtime.RunResult.phases` and ``.memory``, the latter
  ``null`` on CPU)
- ``{"event": "error", "rank", "type", "message"}``

Exit status: 0 done, 2 invalid spec (a :class:`~spiderflow.core.errors.SpiderFlowError`), 1 any other failure.
Logs are structlog JSON events on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import MutableMapping
from dataclasses import asdict
from typing import Any

import structlog

from spiderflow.core.errors import SpiderFlowError, ValidationError
from spiderflow.exec.spec import (
    CheckpointManifest,
    Rendezvous,
    StepReport,
    TrainSpec,
    check_runnable,
    manifest_to_dict,
    spec_from_dict,
    spec_to_dict,
)
from spiderflow.runtime import stderr_logger_factory

__all__ = ["main", "rendezvous_from_dict", "worker_argv", "worker_document"]


def worker_document(spec: TrainSpec, rendezvous: Rendezvous, *, namespace: str = "") -> dict[str, Any]:
    """The JSON object of a worker file for ``spec`` (``rendezvous.rank`` is a default; start each process
    with :func:`worker_argv`, which passes its rank)."""
    doc = spec_to_dict(spec)
    doc["rendezvous"] = {"host": rendezvous.host, "port": rendezvous.port, "world_size": rendezvous.world_size,
                         "rank": rendezvous.rank, "serve": rendezvous.serve, "timeout_s": rendezvous.timeout_s}
    if namespace:
        doc["namespace"] = namespace
    return doc


def worker_argv(spec_path: str, rank: int, *, python: str | None = None) -> list[str]:
    """The command line that starts rank ``rank`` from a worker file (``python`` defaults to this
    interpreter)."""
    return [python or sys.executable, "-m", "spiderflow.exec.worker", "--spec", spec_path, "--rank", str(rank)]


def rendezvous_from_dict(raw: Any, *, rank: int | None = None) -> Rendezvous:
    """Parse the ``rendezvous`` object of a worker file (``rank`` overrides the file's)."""
    if not isinstance(raw, dict):
        raise ValidationError("rendezvous", "must be an object", raw)
    fields = {k: raw[k] for k in ("host", "port", "world_size", "rank", "serve", "timeout_s") if k in raw}
    if rank is not None:
        fields["rank"] = rank
    for key in ("host", "port", "world_size", "rank"):
        if key not in fields:
            raise ValidationError(f"rendezvous.{key}", "is required")
    return Rendezvous(**fields)


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


CUDA_ALLOC_CONF = "expandable_segments:True"
"""The CUDA caching allocator's setting in a worker unless the user set one: segments that grow in place
instead of new fixed-size blocks, which removes most of the memory the allocator holds beyond the tensors
(fragmentation; measured up to 8 GiB on an H200, BENCHMARKS.md "On a GPU"). torchtitan and Megatron-LM
recommend it."""


def cuda_allocator_env(environ: MutableMapping[str, str]) -> None:
    """Set ``PYTORCH_CUDA_ALLOC_CONF`` to :data:`CUDA_ALLOC_CONF` in ``environ`` unless it or its newer name
    ``PYTORCH_ALLOC_CONF`` is set (the user's choice wins). Must run before the first CUDA allocation."""
    if "PYTORCH_CUDA_ALLOC_CONF" not in environ and "PYTORCH_ALLOC_CONF" not in environ:
        environ["PYTORCH_CUDA_ALLOC_CONF"] = CUDA_ALLOC_CONF


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spiderflow.exec.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="worker spec JSON file")
    parser.add_argument("--rank", type=int, default=None, help="override rendezvous.rank")
    args = parser.parse_args(argv)
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso"),
                    structlog.processors.JSONRenderer()],
        logger_factory=stderr_logger_factory(),
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
    )
    rank = args.rank
    try:
        with open(args.spec) as f:
            raw = json.load(f)
        if not isinstance(raw, dict):
            raise ValidationError("spec", "must be an object", type(raw).__name__)
        rdv = rendezvous_from_dict(raw.get("rendezvous"), rank=args.rank)
        rank = rdv.rank
        namespace = raw.get("namespace", "")
        if not isinstance(namespace, str):
            raise ValidationError("namespace", "must be a string", namespace)
        spec = spec_from_dict(raw)
        check_runnable(spec)
        if rdv.world_size != spec.world_size:
            raise ValidationError("rendezvous.world_size", f"the plan needs {spec.world_size} ranks", rdv.world_size)
    except (OSError, json.JSONDecodeError, SpiderFlowError, TypeError) as e:
        _emit({"event": "error", "rank": rank, "type": type(e).__name__, "message": str(e)})
        return 2

    cuda_allocator_env(os.environ)
    from spiderflow.exec.runtime import run  # torch is imported only once the spec is valid

    def on_step(report: StepReport) -> None:
        _emit({"event": "step", **asdict(report)})

    def on_checkpoint(manifest: CheckpointManifest) -> None:
        from spiderflow.exec.checkpoint import write_manifest_file

        if spec.checkpoint_dir is not None:
            write_manifest_file(manifest, spec.checkpoint_dir)
        _emit({"event": "checkpoint", "manifest": manifest_to_dict(manifest)})

    try:
        result = run(spec, rdv, on_step=on_step, on_checkpoint=on_checkpoint, namespace=namespace)
    except SpiderFlowError as e:
        _emit({"event": "error", "rank": rank, "type": type(e).__name__, "message": str(e)})
        return 2
    except Exception as e:
        structlog.get_logger(__name__).exception("worker failed", rank=rank)
        _emit({"event": "error", "rank": rank, "type": type(e).__name__, "message": str(e)})
        return 1
    _emit({"event": "done", "rank": result.rank, "first_step": result.first_step, "last_step": result.last_step,
           "losses": list(result.losses), "step_times_s": list(result.step_times_s),
           "phases": result.phases, "memory": result.memory})
    return 0


def exit_now(code: int) -> None:
    """End the process with ``code`` once its events are flushed, without interpreter finalisation.

    A worker's outcome is its last event and its exit code. Tearing down the interpreter after a finished run
    destroys torch's C++ objects while their threads may still be running, and gloo can then abort the process
    ("terminate called without an active exception", SIGABRT) after it reported ``done``, which the agent
    would read as a failed rank. Everything the run writes (checkpoints, exports, manifests) is closed before
    ``main`` returns, so nothing is lost by skipping finalisation."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
