"""What happened inside a job: ``logs`` (the workers' output), ``metrics`` (every reported step) and
``delete`` (forget a finished job).

::

    spiderflow logs JOB                      # every rank's output, each line prefixed cluster/rank
    spiderflow logs JOB --follow --rank 0    # rank 0 as it writes, until the job ends
    spiderflow metrics JOB                   # step, loss, tokens/s, measured and predicted step time
                                             # and each stage's busy time (measured/predicted)
    spiderflow metrics JOB --tensorboard runs/JOB   # TensorBoard event files (tensorboard --logdir runs)
    spiderflow delete JOB                    # a finished job's record, metrics and request id
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spiderflow.cli.commands.jobs import add_address, client
from spiderflow.cli.common import add_json_flag, console, fit_table, output_dir, print_json
from spiderflow.cli.interrupt import cancel_on_interrupt
from spiderflow.sdk import Client, LogChunk, MetricPoint, Metrics

__all__ = ["metrics_table", "register", "write_tensorboard"]


def _logs(args: argparse.Namespace) -> int:
    tails: dict[tuple[str, int, int, str], str] = {}
    with client(args) as sf:
        chunks = sf.logs(args.job_id, follow=args.follow, attempt=args.attempt, cluster=args.cluster,
                         rank=args.rank, stream=args.stream)
        try:
            with cancel_on_interrupt(chunks) as interrupted:  # Ctrl-C cancels the stream: see cli.interrupt
                for chunk in chunks:
                    _print_chunk(chunk, tails, prefix=args.prefix)
        except KeyboardInterrupt:  # before the stream was followed
            chunks.cancel()
        else:
            if not interrupted():
                _flush(tails, prefix=args.prefix)
                return 0
    _flush(tails, prefix=args.prefix)
    sys.stderr.write(f"stopped following {args.job_id}; the job keeps running "
                     f"(spiderflow logs {args.job_id} --follow resumes)\n")
    return 130


def _label(key: tuple[str, int, int, str]) -> str:
    cluster, attempt, rank, stream = key
    return f"{cluster}/a{attempt}/r{rank}/{'out' if stream == 'stdout' else 'err'}"


def _print_chunk(chunk: LogChunk, tails: dict[tuple[str, int, int, str], str], *, prefix: bool) -> None:
    key = (chunk.cluster, chunk.attempt, chunk.rank, chunk.stream)
    text = tails.pop(key, "") + chunk.text
    lines = text.split("\n")
    if lines[-1]:
        tails[key] = lines[-1]  # a line still being written: printed when it ends (or at the end)
    out = sys.stdout
    for line in lines[:-1]:
        out.write(f"{_label(key)} | {line}\n" if prefix else f"{line}\n")
    out.flush()


def _flush(tails: dict[tuple[str, int, int, str], str], *, prefix: bool) -> None:
    for key, rest in tails.items():
        sys.stdout.write(f"{_label(key)} | {rest}\n" if prefix else f"{rest}\n")
    tails.clear()
    sys.stdout.flush()


def _ms(seconds: float) -> str:
    """Milliseconds in at most 5 characters below 100 s (``1.23``, ``12.3``, ``123``, ``12345``)."""
    ms = seconds * 1e3
    return f"{ms:.2f}" if ms < 10 else f"{ms:.1f}" if ms < 100 else f"{ms:.0f}"


def _stages_cell(p: MetricPoint) -> str:
    """``measured/predicted`` busy milliseconds per stage, stage 0 first (``-`` where one is missing)."""
    n = max(len(p.stage_busy_s), len(p.predicted_stage_busy_s))
    out = []
    for i in range(n):
        meas = p.stage_busy_s[i] if i < len(p.stage_busy_s) and p.stage_busy_s[i] > 0 else None
        pred = p.predicted_stage_busy_s[i] if i < len(p.predicted_stage_busy_s) else None
        out.append(f"{_ms(meas) if meas is not None else '-'}/{_ms(pred) if pred is not None else '-'}")
    return " ".join(out) or "-"


STAGES_NOTE = ("STAGE BUSY MS: each stage's measured/predicted busy time per step in milliseconds (forward, "
               "backward, gradient sync, optimizer; stage 0 first)")


def metrics_table(m: Metrics, *, title: str) -> object:
    """The metrics history as a table that fits the terminal (columns drop from the right; the per-stage
    column folds between stages)."""
    rows = [(str(p.step), str(p.attempt), f"{p.loss:.4f}", f"{p.tokens_per_s:,.0f}", f"{p.step_time_s:.4f}",
             f"{p.predicted_step_time_s:.4f}", _stages_cell(p)) for p in m.points]
    return fit_table(title, ["STEP", "ATTEMPT", "LOSS", "TOKENS/S", "STEP S", "PREDICTED S", "STAGE BUSY MS"], rows,
                     keep=("STEP", "LOSS", "STEP S", "STAGE BUSY MS"), fold=("STAGE BUSY MS",))


def write_tensorboard(m: Metrics, directory: Path) -> Path:
    """Write ``m`` as TensorBoard scalars (``loss``, ``tokens_per_s``, ``step_time_s``,
    ``predicted_step_time_s``, per stage ``stage_busy_s/<i>`` and ``predicted_stage_busy_s/<i>``; x = step,
    one run per attempt under ``directory/attempt-<n>``); returns
    ``directory``."""
    from tensorboard.compat.proto import event_pb2, summary_pb2  # type: ignore[import-untyped]
    from tensorboard.summary.writer.event_file_writer import EventFileWriter  # type: ignore[import-untyped]

    writers: dict[int, EventFileWriter] = {}
    try:
        for p in m.points:
            w = writers.get(p.attempt)
            if w is None:
                w = writers[p.attempt] = EventFileWriter(str(directory / f"attempt-{p.attempt}"))
            scalars = [("loss", p.loss), ("tokens_per_s", p.tokens_per_s), ("step_time_s", p.step_time_s),
                       ("predicted_step_time_s", p.predicted_step_time_s)]
            scalars += [(f"stage_busy_s/{i}", v) for i, v in enumerate(p.stage_busy_s) if v > 0]
            scalars += [(f"predicted_stage_busy_s/{i}", v) for i, v in enumerate(p.predicted_stage_busy_s)]
            values = [summary_pb2.Summary.Value(tag=tag, simple_value=float(v)) for tag, v in scalars]
            w.add_event(event_pb2.Event(wall_time=p.time, step=p.step, summary=summary_pb2.Summary(value=values)))
    finally:
        for w in writers.values():
            w.close()
    return directory


def show_metrics(sf: Client, job_id: str, *, limit: int, json_out: bool, tensorboard: Path | None) -> None:
    m = sf.metrics(job_id, limit=limit)
    if tensorboard is not None:
        write_tensorboard(m, tensorboard)
    if json_out:
        print_json(m.to_dict())
        return
    console.print(metrics_table(m, title=f"{job_id}: {len(m.points)} step(s)"
                                        + (f", {m.dropped} older dropped" if m.dropped else "")))
    if any(p.stage_busy_s or p.predicted_stage_busy_s for p in m.points):
        console.print(STAGES_NOTE)
    if tensorboard is not None:
        console.print(f"TensorBoard event files written to {tensorboard} (tensorboard --logdir {tensorboard})",
                      soft_wrap=True)


def _metrics(args: argparse.Namespace) -> int:
    tb = output_dir("--tensorboard", Path(args.tensorboard)) if args.tensorboard else None
    with client(args) as sf:
        show_metrics(sf, args.job_id, limit=args.limit, json_out=args.json, tensorboard=tb)
    return 0


def _delete(args: argparse.Namespace) -> int:
    with client(args) as sf:
        job = sf.delete(args.job_id)
    if args.json:
        print_json(job.to_dict())
    else:
        console.print(f"deleted {job.id} ({job.state})", soft_wrap=True)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "logs", help="print a job's workers' output (stdout events and stderr), per attempt, cluster and rank",
        description="Print the output of a job's workers, relayed by the scheduler from the agents that keep it "
                    "(retained on each agent's disk after the job and the mesh end).",
        epilog="example: spiderflow logs sample-1a2b3c --follow --rank 0")
    p.add_argument("job_id", metavar="JOB", help="job id (spiderflow jobs lists them)")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new output until the job ends")
    p.add_argument("--rank", type=int, default=None, help="only this rank (default: every rank)")
    p.add_argument("--cluster", default=None, help="only this cluster (default: every cluster)")
    p.add_argument("--attempt", type=int, default=None, help="only this attempt (default: every attempt)")
    p.add_argument("--stream", choices=["stdout", "stderr"], default=None,
                   help="only the workers' stdout (JSON events) or stderr (log events, tracebacks) (default: both)")
    p.add_argument("--prefix", action=argparse.BooleanOptionalAction, default=True,
                   help="start each line with cluster/attempt/rank/stream")
    add_address(p)
    p.set_defaults(func=_logs)

    p = sub.add_parser(
        "metrics", help="every reported step of a job: loss, tokens/s, measured and predicted step time",
        description="Print a job's metrics history (kept by the scheduler, bounded per job), optionally as "
                    "TensorBoard event files.",
        epilog="example: spiderflow metrics sample-1a2b3c --tensorboard runs/sample")
    p.add_argument("job_id", metavar="JOB", help="job id")
    p.add_argument("--limit", type=int, default=0, help="only the newest N steps (0: every kept step)")
    p.add_argument("--tensorboard", metavar="DIR", default=None,
                   help="also write TensorBoard event files under DIR (one run per attempt)")
    add_address(p)
    add_json_flag(p)
    p.set_defaults(func=_metrics)

    p = sub.add_parser(
        "delete", help="delete a finished job (its record, metrics and request id; logs stay on the agents)",
        description="Delete a job that has finished (SUCCEEDED, FAILED or CANCELLED); cancel a running job "
                    "first.",
        epilog="example: spiderflow delete sample-1a2b3c")
    p.add_argument("job_id", metavar="JOB", help="job id")
    add_address(p)
    add_json_flag(p)
    p.set_defaults(func=_delete)
