"""Job commands: ``submit``, ``jobs``, ``status``, ``watch``, ``cancel`` (through the scheduler service).

The scheduler address comes from ``--address``, else ``SPIDERFLOW_SCHEDULER``, else the config file (see
:func:`spiderflow.sdk.resolve_address`). ``watch`` exits 0 when the job succeeds and 1 when it fails or is
cancelled, so scripts can chain on it. ``--tls-dir``/``SPIDERFLOW_TLS_DIR`` (a bundle from ``spiderflow certs
init``) switches to mTLS; ``--token``/``SPIDERFLOW_TOKEN`` sends a bearer token.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from collections.abc import Iterable
from typing import Any

from rich.live import Live
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from spiderflow.cli.common import EXIT_FAILED, EXIT_USAGE, CliError, add_json_flag, console, fit_table, print_json
from spiderflow.cli.constraints import add_constraint_options, constraint_overrides, merge_constraints, split_gpus
from spiderflow.cli.interrupt import cancel_on_interrupt
from spiderflow.core.domain import JobSpec, Precision
from spiderflow.core.errors import ValidationError
from spiderflow.jobs import JobState
from spiderflow.sdk import Client, Job, JobEvent

__all__ = [
    "add_address",
    "add_data_and_optimizer_options",
    "client",
    "data_and_optimizer",
    "parse_gpus",
    "prepare_data",
    "register",
]

_STYLE = {"SUCCEEDED": "green", "FAILED": "red", "CANCELLED": "yellow", "RUNNING": "cyan", "PLACED": "blue",
          "PENDING": "white", "RESCHEDULING": "magenta"}


def parse_gpus(value: str) -> dict[str, Any]:
    """``[TYPE:]N`` or ``[TYPE:]MIN:MAX`` → ``{"min", "max"}`` (and ``"type"`` when a GPU type is given)."""
    kind, count = split_gpus(value)
    try:
        if ":" in count:
            lo, hi = count.split(":", 1)
            out: dict[str, Any] = {"min": int(lo), "max": int(hi)}
        else:
            n = int(count)
            out = {"min": n, "max": n}
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus must be [TYPE:]N or [TYPE:]MIN:MAX, e.g. A100:8 (got {value!r})"
                                         ) from None
    if kind is not None:
        out["type"] = kind
    return out


def client(args: argparse.Namespace) -> Client:
    """The scheduler client of a command's ``--address``/``--tls-dir``/``--token`` (see :func:`add_address`)."""
    sf = Client(args.address, tls_dir=args.tls_dir, token=args.token)
    args._endpoint = sf.scheduler_address
    return sf


SUBMIT_DEFAULTS: dict[str, Any] = {"global_batch": 8, "micro_batch": 1, "seq_len": 2048, "steps": 10,
                                   "gpus": {"min": 1, "max": 8}, "priority": 0, "tenant": "default"}
"""What ``submit --model`` uses for the options not given (a job FILE's own values win over these)."""
_OVERRIDES = ("id", "global_batch", "micro_batch", "seq_len", "steps", "gpus", "priority", "tenant", "precision",
              "checkpoint_every")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The job fields given on the command line (data and optimizer options included)."""
    out = {k: getattr(args, k) for k in _OVERRIDES if getattr(args, k) is not None}
    out.update(data_and_optimizer(args))
    gpus = out.get("gpus")
    kind: str | None = None
    if isinstance(gpus, dict) and "type" in gpus:  # --gpus TYPE:N
        kind = gpus["type"]
        out["gpus"] = {k: v for k, v in gpus.items() if k != "type"}
    if given := constraint_overrides(args, kind):
        out["constraints"] = given
    return out


def _id_stem(model: str) -> str:
    stem = model.rsplit("/", 2)[-2] if model.endswith(".json") and "/" in model else model.rsplit(":", 1)[-1]
    return "".join(c if c.isalnum() or c == "-" else "-" for c in stem)[:64] or "job"


def _job_from_args(args: argparse.Namespace) -> dict[str, Any]:
    if args.model is None:
        given = ", ".join(f"--{k.replace('_', '-')}" for k in _overrides(args))
        raise CliError("give a job FILE or --model (see spiderflow submit --help)"
                       + (f"; {given} only adjust one" if given else ""), EXIT_USAGE)
    job: dict[str, Any] = {**SUBMIT_DEFAULTS, "model": args.model, **_overrides(args)}
    job.setdefault("id", f"{_id_stem(args.model)}-{uuid.uuid4().hex[:8]}")
    if args.weights or args.save_to:
        model: dict[str, Any] = {"hf_config": args.model} if args.model.endswith(".json") else {"name": args.model}
        model.update({k: v for k, v in (("weights", args.weights), ("save_to", args.save_to)) if v})
        job["model"] = model
    return job


def _job_from_file(args: argparse.Namespace) -> JobSpec:
    """The job FILE with the command line's options applied over it (a file holding a one-job trace is
    accepted too); errors name the file and the field."""
    from spiderflow.formats import in_file, job_from_dict, load_document

    doc = load_document(args.file)
    if isinstance(doc, dict) and isinstance(doc.get("jobs"), list) and len(doc["jobs"]) == 1:
        doc = doc["jobs"][0]

    def parse(d: Any) -> JobSpec:
        if not isinstance(d, dict):
            raise ValidationError("job", "must be an object (a trace job)")
        given = _overrides(args)
        if "constraints" in given:  # the options replace only the constraint lists they name
            given["constraints"] = merge_constraints(d.get("constraints"), given["constraints"])
        return job_from_dict({**d, **given})

    return in_file(args.file, parse, doc)


def data_and_optimizer(args: argparse.Namespace) -> dict[str, Any]:
    """The ``data`` and ``optimizer`` objects the options of :func:`add_data_and_optimizer_options` give
    (keys absent when no option of the group is set)."""
    job: dict[str, Any] = {}
    if args.data:
        corpus = args.tokenizer is not None
        data: dict[str, Any] = {"kind": "corpus" if corpus else "tokens", "path": args.data}
        for key in ("tokenizer", "text_field", "dtype", "cache_dir", "data_seed"):
            if getattr(args, key) is not None:
                data["seed" if key == "data_seed" else key] = getattr(args, key)
        job["data"] = data
    optimizer = {k: getattr(args, k) for k in ("lr", "warmup_steps", "schedule", "min_lr_ratio", "decay_steps",
                                               "weight_decay", "grad_clip", "eps") if getattr(args, k) is not None}
    if args.betas is not None:
        optimizer["betas"] = args.betas
    if optimizer:
        job["optimizer"] = optimizer
    return job


def prepare_data(job: dict[str, Any]) -> None:
    """Tokenize a job's corpus here, with a progress bar, into the cache the agents read (a no-op for other
    data and for a corpus already cached)."""
    data = job.get("data")
    if isinstance(data, dict) and data.get("kind") == "corpus":
        from spiderflow.core.domain import DataSpec
        from spiderflow.exec.data import prepare_corpus
        from spiderflow.formats import data_from_value

        spec: DataSpec = data_from_value(data)
        shards = prepare_corpus(spec, progress=True)
        console.print(f"corpus tokenized: {len(shards)} shard(s) in {shards[0].parent}")


def _betas(value: str) -> list[float]:
    try:
        b1, b2 = (float(x) for x in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--betas must be B1,B2 (got {value!r})") from None
    return [b1, b2]


def add_data_and_optimizer_options(p: argparse.ArgumentParser) -> None:
    """``--data``/``--tokenizer``/... and ``--lr``/``--warmup-steps``/... (shared by ``submit`` and ``up``)."""
    d = p.add_argument_group("data (default: synthetic tokens)")
    d.add_argument("--data", metavar="PATH", help="token shards (.bin/.npy file, directory or glob), or with "
                   "--tokenizer a JSONL/text corpus (tokenized once, cached)")
    d.add_argument("--tokenizer", metavar="FILE", help="local tokenizer.json for a corpus")
    d.add_argument("--text-field", help="JSONL key holding the text (default text)")
    d.add_argument("--dtype", choices=["uint16", "uint32"], help=".bin token type (default uint16)")
    d.add_argument("--cache-dir", help="where tokenized shards are cached")
    d.add_argument("--data-seed", type=int, help="seed of the window order")
    o = p.add_argument_group("optimizer (AdamW; default lr 1e-3 constant)")
    o.add_argument("--lr", type=float)
    o.add_argument("--warmup-steps", type=int)
    o.add_argument("--schedule", choices=["constant", "cosine", "linear"])
    o.add_argument("--min-lr-ratio", type=float, help="final lr as a fraction of --lr (default 0.1)")
    o.add_argument("--decay-steps", type=int, help="step where the decay ends (default: the job's steps)")
    o.add_argument("--weight-decay", type=float)
    o.add_argument("--betas", type=_betas, metavar="B1,B2")
    o.add_argument("--eps", type=float)
    o.add_argument("--grad-clip", type=float, metavar="NORM", help="clip the global gradient norm (0: off)")


def _plan_summary(job: Job) -> str:
    if job.plan is None:
        return "-"
    return " → ".join(f"{s.cluster}[{s.first_layer}-{s.last_layer}]×{s.gpus}" for s in job.plan.stages)


def _submit(args: argparse.Namespace) -> int:
    if args.file and args.model:
        raise CliError("give either a job FILE or --model, not both", EXIT_USAGE)
    job_input: Any = _job_from_file(args) if args.file else _job_from_args(args)
    if isinstance(job_input, dict):
        prepare_data(job_input)
    with client(args) as sf:
        job = sf.submit(job_input, request_id=args.request_id, policy=args.policy)
        if args.json and not args.watch:
            print_json(job.to_dict())
            return 0
        if not args.json:
            console.print(f"submitted [bold]{job.id}[/bold] ({job.state})")
        if args.watch:
            return _follow(sf, job.id, json_out=args.json)
    return 0


def _jobs(args: argparse.Namespace) -> int:
    with client(args) as sf:
        jobs = sf.list(states=args.state or None, tenant=args.tenant)
    if args.json:
        print_json([j.to_dict() for j in jobs])
        return 0
    rows = [(j.id, j.spec.tenant, j.spec.model.name, j.state, str(j.plan.gpus) if j.plan else "-", _steps(j),
             _plan_summary(j), j.reason) for j in jobs]
    console.print(fit_table(f"{len(jobs)} job(s)", ["ID", "STATE", "STEP", "GPUS", "MODEL", "TENANT", "PLAN",
                                                    "REASON"],
                            [(r[0], r[3], r[5], r[4], r[2], r[1], r[6], r[7]) for r in rows],
                            keep=("ID", "STATE", "STEP", "REASON"), fold=("PLAN", "REASON")))
    return 0


def _steps(j: Job) -> str:
    """``done/total`` steps: the total once a job succeeded, the last reported step otherwise."""
    done = j.spec.steps if j.state == JobState.SUCCEEDED else int(j.progress.get("step", 0))
    return f"{done}/{j.spec.steps}"


def _status(args: argparse.Namespace) -> int:
    with client(args) as sf:
        job = sf.get(args.job_id)
        if args.json:
            doc = job.to_dict()
            if args.history:
                doc["metrics"] = sf.metrics(job.id).to_dict()
            print_json(doc)
            return 0
        rows = [("id", job.id), ("state", f"{job.state}: {job.reason}"),
                ("model", f"{job.spec.model.name} ({job.spec.model.layers} layers)"),
                ("tenant", job.spec.tenant), ("policy", job.policy or "default"), ("attempt", str(job.attempt)),
                ("steps", _steps(job))]
        if not job.spec.constraints.empty:
            rows.append(("constraints", job.spec.constraints.describe()))
        if job.plan is not None:
            rows += [("plan", _plan_summary(job)),
                     ("schedule", f"{job.plan.schedule}, {job.plan.micro_batches} micro-batches"),
                     ("predicted", f"{job.plan.step_time_s:.4g} s/step, "
                                   f"{job.plan.throughput_tokens_per_s:,.0f} tok/s")]
        if job.progress:
            p = job.progress
            rows.append(("last step", f"{int(p['step'])}: loss {p['loss']:.4f}, {p['step_time_s']:.4g} s/step, "
                                      f"{p['tokens_per_s']:,.0f} tok/s"))
        for t in job.history:
            rows.append((time.strftime("%H:%M:%S", time.localtime(t.time)),
                         f"{t.from_state or '-'} → {t.to_state}: {t.reason}"))
        console.print(fit_table(None, ["FIELD", "VALUE"], rows, keep=("FIELD", "VALUE"), fold=("VALUE",),
                                show_header=False))
        if args.history:
            from spiderflow.cli.commands.observe import show_metrics

            show_metrics(sf, job.id, limit=0, json_out=False, tensorboard=None)
    return 0


def _progress_line(job_id: str, p: dict[str, float]) -> str:
    return (f"{job_id} step {int(p['step'])}/{int(p['steps'])} loss {p['loss']:.4f} "
            f"{p['tokens_per_s']:,.0f} tok/s {p['step_time_s']:.3g} s/step")


def _follow(sf: Client, job_id: str, *, json_out: bool) -> int:
    """Follow a job to its end; exit 0 on SUCCEEDED, 1 otherwise. Ctrl-C cancels the watch stream (exit 130)
    and says that the job keeps running."""
    stream = sf.watch(job_id)
    try:
        with cancel_on_interrupt(stream) as interrupted:
            code = _follow_events(stream, job_id, json_out=json_out)
        if not interrupted():
            return code
    except KeyboardInterrupt:  # before the stream was followed
        stream.cancel()
    sys.stdout.flush()
    sys.stderr.write(f"\nstopped watching {job_id}; the job keeps running "
                     f"(re-attach: spiderflow watch {job_id}; stop it: spiderflow cancel {job_id})\n")
    return 130


def _follow_events(events: Iterable[JobEvent], job_id: str, *, json_out: bool) -> int:
    final = ""
    if json_out:
        for ev in events:
            doc: dict[str, Any] = {"kind": ev.kind, "revision": ev.revision}
            if ev.job:
                doc["job"] = ev.job.to_dict()
                final = ev.job.state
            if ev.transition:
                doc["transition"] = {"from": ev.transition.from_state, "to": ev.transition.to_state,
                                     "reason": ev.transition.reason}
                final = ev.transition.to_state
            if ev.progress:
                doc["progress"] = ev.progress
            print_json(doc)
        return 0 if final == JobState.SUCCEEDED else EXIT_FAILED
    if not console.is_terminal:  # piped: plain lines, one per event, ending with a newline
        for ev in events:
            if ev.job is not None:
                final = ev.job.state
                print(f"{job_id} {ev.job.state} step {_steps(ev.job)}: {ev.job.reason}", flush=True)
            if ev.transition is not None:
                final = ev.transition.to_state
                print(f"{job_id} {ev.transition.from_state} -> {final}: {ev.transition.reason}", flush=True)
            if ev.progress:
                print(_progress_line(job_id, ev.progress), flush=True)
        return 0 if final == JobState.SUCCEEDED else EXIT_FAILED
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(bar_width=20),
                        TextColumn("{task.completed}/{task.fields[steps]}"), TextColumn("{task.fields[info]}"),
                        TimeElapsedColumn(), console=console)
    task = progress.add_task(job_id, total=None, info="", steps="?")
    with Live(progress, console=console, refresh_per_second=8, transient=False):
        for ev in events:
            if ev.job is not None:
                j = ev.job
                final = j.state
                done = j.spec.steps if j.state == JobState.SUCCEEDED else int(j.progress.get("step", 0))
                progress.update(task, total=j.spec.steps, completed=done, steps=j.spec.steps,
                                info=f"{j.state}: {j.reason}")
            if ev.transition is not None:
                final = ev.transition.to_state
                progress.update(task, info=final)
                console.print(f"{ev.transition.from_state} → [{_STYLE.get(final, '')}]{final}[/]: "
                              f"{ev.transition.reason}")
            if ev.progress:
                p = ev.progress
                progress.update(task, completed=int(p["step"]), total=int(p["steps"]) or None,
                                steps=int(p["steps"]) or "?",
                                info=f"loss {p['loss']:.4f} · {p['step_time_s']:.3g} s/step")
    return 0 if final == JobState.SUCCEEDED else EXIT_FAILED


def _watch(args: argparse.Namespace) -> int:
    with client(args) as sf:
        return _follow(sf, args.job_id, json_out=args.json)


def _cancel(args: argparse.Namespace) -> int:
    with client(args) as sf:
        job = sf.cancel(args.job_id, args.reason or "")
    if args.json:
        print_json(job.to_dict())
    else:
        console.print(f"{job.id}: {job.state} ({job.reason})")
    return 0


def add_address(p: argparse.ArgumentParser) -> None:
    """``--address``/``--tls-dir``/``--token``: how every command reaches the scheduler."""
    p.add_argument("--address", help="scheduler host:port (default: $SPIDERFLOW_SCHEDULER, else the current "
                                     "context, else 127.0.0.1:50051; no port: :50051)")
    p.add_argument("--tls-dir", help="client certificate bundle for mTLS (default: $SPIDERFLOW_TLS_DIR, else "
                                     "the context's; none: plaintext)")
    p.add_argument("--token", help="bearer token (default: $SPIDERFLOW_TOKEN, else the context's)")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("submit", help="submit a training job (a job file, or --model ...)",
                       description="Queue a training job: a job FILE (JSON/YAML trace job; the options below "
                                   "override its fields) or --model with options.",
                       epilog="examples:\n  spiderflow submit --model gpt-tiny --seq-len 64 --steps 20 --watch\n"
                              "  spiderflow submit job.yaml --id run-2 --steps 50\n"
                              "  spiderflow submit --model gpt-tiny --gpus A100:8 --exclude-cluster ohio",
                       )
    p.add_argument("file", nargs="?", help="job file (JSON/YAML: a trace job object)")
    p.add_argument("--id", help="job id (default: <model>-<random hex>; over FILE: replaces its id)")
    p.add_argument("--model", help="model preset (gpt-tiny, llama-tiny, llama3-8b, ...; spiderflow completion "
                   "lists them), a Hugging Face config.json, or an entry point package.module:function")
    p.add_argument("--weights", help="initial weights: local safetensors file, directory or glob")
    p.add_argument("--save-to", metavar="DIR", help="write the trained weights here (safetensors) at the end")
    p.add_argument("--global-batch", type=int, help=f"sequences per step (default {SUBMIT_DEFAULTS['global_batch']})")
    p.add_argument("--micro-batch", type=int,
                   help=f"sequences per micro-batch (default {SUBMIT_DEFAULTS['micro_batch']})")
    p.add_argument("--seq-len", type=int, help=f"tokens per sequence (default {SUBMIT_DEFAULTS['seq_len']})")
    p.add_argument("--steps", type=int, help=f"optimizer steps (default {SUBMIT_DEFAULTS['steps']})")
    p.add_argument("--gpus", type=parse_gpus, metavar="[TYPE:]N",
                   help="GPUs: N, MIN:MAX, or with a GPU type A100:8 / H100:8:16 (default 1:8, any type)")
    p.add_argument("--priority", type=int, help="higher runs first (default 0)")
    p.add_argument("--tenant", help="tenant the job is billed to (default: default, or your certificate's)")
    p.add_argument("--precision", choices=[v.value for v in Precision],
                   help="training precision (default bf16: fp32 master weights and optimizer state)")
    p.add_argument("--checkpoint-every", type=int, metavar="K",
                   help="steps between checkpoints (0: none; default: the agents' setting)")
    p.add_argument("--policy", help="placement policy (default: the scheduler's, spinsearch)")
    p.add_argument("--request-id", help="idempotency key; a retry with the same key creates nothing (default: "
                                        "a random one)")
    p.add_argument("--watch", action="store_true", help="follow the job until it ends")
    add_constraint_options(p)
    add_data_and_optimizer_options(p)
    add_address(p)
    add_json_flag(p)
    p.set_defaults(func=_submit)

    p = sub.add_parser("jobs", help="list jobs")
    p.add_argument("--state", action="append", choices=[s.value for s in JobState], metavar="STATE",
                   help=f"only jobs in this state (repeatable): {', '.join(s.value for s in JobState)}")
    p.add_argument("--tenant")
    add_address(p)
    add_json_flag(p)
    p.set_defaults(func=_jobs)

    p = sub.add_parser("status", help="show one job: state, plan, progress, history")
    p.add_argument("job_id", metavar="JOB", help="job id (spiderflow jobs lists them)")
    p.add_argument("--history", action="store_true",
                   help="also print every reported step (spiderflow metrics JOB)")
    add_address(p)
    add_json_flag(p)
    p.set_defaults(func=_status)

    p = sub.add_parser("watch", help="follow a job live (steps, loss, tokens/s) until it ends")
    p.add_argument("job_id", metavar="JOB", help="job id (spiderflow jobs lists them)")
    add_address(p)
    add_json_flag(p)
    p.set_defaults(func=_watch)

    p = sub.add_parser("cancel", help="cancel a job")
    p.add_argument("job_id", metavar="JOB", help="job id (spiderflow jobs lists them)")
    p.add_argument("--reason")
    add_address(p)
    add_json_flag(p)
    p.set_defaults(func=_cancel)
