"""Helpers for the execution tests: a reference single-process trainer, a real multi-process launcher."""

from __future__ import annotations

import json
import os
import queue as queue_mod
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from spiderflow.core.catalog import ModelSpec
from spiderflow.exec.data import SyntheticTokens, micro_batch
from spiderflow.exec.model import build_full
from spiderflow.exec.runtime import RunResult
from spiderflow.exec.spec import Rendezvous, TrainSpec
from spiderflow.exec.worker import worker_argv, worker_document

ROOT = Path(__file__).resolve().parents[2]

torch.set_num_threads(1)


def reference_losses(
    model: ModelSpec, *, seq_len: int, global_batch: int, m: int, steps: int, seed: int, lr: float,
    data_seed: int = 0, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
) -> list[float]:
    """One process, the whole model, gradient accumulation over ``m`` micro-batches: the ground truth."""
    net = build_full(model, seed, max_seq_len=seq_len)
    opt = torch.optim.Adam(net.parameters(), lr=lr, betas=betas, eps=eps, foreach=False)
    src = SyntheticTokens(vocab=model.vocab, seq_len=seq_len, seed=data_seed)
    b = global_batch // m
    out = []
    for step in range(steps):
        total = 0.0
        for j in range(m):
            x, y = micro_batch(src, step=step, global_batch=global_batch, micro_batch_size=b, index=j)
            loss = net(torch.from_numpy(x), torch.from_numpy(y))
            (loss / m).backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(total / m)
    return out


class Launcher:
    """Starts worker processes (``python -m spiderflow.exec.worker``) and guarantees they are gone after."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[str]] = []
        self.forked: list[Any] = []
        self.runs = 0

    def run(
        self, spec: TrainSpec, world_size: int, *, timeout: float = 180.0, rank0_serves: bool = False
    ) -> list[list[dict[str, Any]]]:
        """Run every rank of ``spec`` as ``python -m spiderflow.exec.worker`` processes; returns each rank's
        stdout events. Fails on a non-zero exit. By default the TCPStore is hosted here (port 0, no port
        race); with ``rank0_serves`` rank 0 hosts it on a free port probed here (as agents run it)."""
        import torch.distributed as dist

        store = None
        if rank0_serves:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
        else:
            store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
            port = store.port
        self.runs += 1
        path = self.tmp / f"spec-{self.runs}.json"
        rdv = Rendezvous(host="127.0.0.1", port=port, world_size=world_size, rank=0,
                         serve=None if rank0_serves else False, timeout_s=60)
        path.write_text(json.dumps(worker_document(spec, rdv, namespace=f"run-{self.runs}")))
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
        procs = [
            subprocess.Popen(
                worker_argv(str(path), r), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                cwd=ROOT,
            )
            for r in range(world_size)
        ]
        self.procs.extend(procs)
        outs: list[tuple[str, str]] = []
        try:
            for p in procs:
                outs.append(p.communicate(timeout=timeout))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=10)
            del store
        events = []
        for r, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
            assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{out}\n{err[-3000:]}"
            events.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
        return events

    def run_forked(self, spec: TrainSpec, *, timeout: float = 180.0) -> list[RunResult]:
        """Run every rank of ``spec`` in processes forked from a single-threaded fork server that has torch
        imported already (so they start in milliseconds, without the hazards of forking this threaded
        process), each calling :func:`spiderflow.exec.runtime.run`; returns their results in rank order.
        Fails if a rank raises or exits abnormally."""
        world = spec.world_size
        store, procs, queue = self._start_forked(spec)
        results: dict[int, Any] = {}
        try:
            deadline = time.monotonic() + timeout
            while len(results) < world:
                try:
                    rank, payload = queue.get(timeout=0.5)
                except queue_mod.Empty:
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                    if dead or time.monotonic() > deadline:
                        late = sorted(set(range(world)) - set(results))
                        raise AssertionError(f"ranks {late} did not finish (exited abnormally: {dead})") from None
                    continue
                if isinstance(payload, str):
                    raise AssertionError(f"rank {rank} failed:\n{payload}")
                results[rank] = payload
            for p in procs:
                p.join(timeout=30)
                assert p.exitcode == 0, f"rank exited with {p.exitcode}"
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=10)
            del store
        return [results[r] for r in range(world)]

    def _start_forked(self, spec: TrainSpec) -> tuple[Any, list[Any], Any]:
        import multiprocessing as mp

        import torch.distributed as dist

        world = spec.world_size
        store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch._dynamo", "spiderflow.exec.runtime", "exec_harness"])
        queue: Any = ctx.Queue()
        procs = [ctx.Process(target=_forked_rank, args=(spec, store.port, world, r, queue)) for r in range(world)]
        for p in procs:
            p.start()
        self.forked.extend(procs)
        return store, procs, queue

    def run_forked_killing(
        self, spec: TrainSpec, *, rank: int, after_s: float, timeout: float = 60.0
    ) -> tuple[dict[int, Any], float]:
        """Start every rank of ``spec``, SIGKILL ``rank`` after ``after_s`` seconds, and collect what the
        others report (a :class:`RunResult` or a traceback string); also returns the seconds from the kill
        until the last survivor reported. Survivors still silent after ``timeout`` fail the test."""
        world = spec.world_size
        store, procs, queue = self._start_forked(spec)
        out: dict[int, Any] = {}
        try:
            time.sleep(after_s)
            procs[rank].kill()
            procs[rank].join(timeout=10)
            killed_at = time.monotonic()
            while len(out) < world - 1:
                try:
                    r, payload = queue.get(timeout=max(0.1, killed_at + timeout - time.monotonic()))
                except queue_mod.Empty:
                    raise AssertionError(f"survivors silent {timeout} s after the kill: {sorted(out)}") from None
                out[r] = payload
            elapsed = time.monotonic() - killed_at
            for p in procs:
                p.join(timeout=30)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=10)
            del store
        return out, elapsed

    def close(self) -> None:
        for p in self.forked:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def stop_fork_server() -> None:
    """Stop the multiprocessing fork server (started by :meth:`Launcher.run_forked`), if running."""
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is not None:
        stop()


def _forked_rank(spec: TrainSpec, port: int, world: int, rank: int, queue: Any) -> None:
    import traceback

    from spiderflow.exec.runtime import run

    try:
        rdv = Rendezvous(host="127.0.0.1", port=port, world_size=world, rank=rank, serve=False, timeout_s=60)
        queue.put((rank, run(spec, rdv)))
    except BaseException:
        queue.put((rank, traceback.format_exc()))
        raise


def losses_of(events: list[list[dict[str, Any]]]) -> list[float]:
    """Losses reported by the first rank that reports them (a last-stage rank)."""
    for rank_events in events:
        done = [e for e in rank_events if e["event"] == "done"]
        assert done, rank_events
        if done[0]["losses"]:
            return [float(x) for x in done[0]["losses"]]
    raise AssertionError("no rank reported losses")
