"""``spiderflow profile``: measure this node and write a hardware profile (``docs/profiles.md``).

On a CPU node: the agent's calibration in ``--precision`` (matmul TFLOPS, mfu, per-layer and optimizer times)
plus the blocks of ``--model`` (or ``--block HIDDEN:HEADS``) timed at every ``--micro-batches`` ×
``--seq-lens``. On a CUDA node: matmul TFLOPS of ``cuda:0`` in ``--precision`` and the same blocks timed
there. Launched by ``torchrun`` (``WORLD_SIZE > 1``) every rank joins the process group (NCCL on GPUs, gloo on
CPUs) and the collective micro-benchmarks fill the profile's ``nccl`` entry (``intra_node`` when all ranks
share the node, else ``inter_node``); rank 0 writes the file.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from spiderflow.cli.common import EXIT_USAGE, CliError, print_json
from spiderflow.core.catalog import model_preset
from spiderflow.core.domain import Precision

__all__ = ["register"]


def _ints(flag: str, value: str) -> list[int]:
    try:
        out = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"{flag}: expected comma-separated positive integers (got {value!r})", EXIT_USAGE) from None
    if not out or any(x <= 0 for x in out):
        raise CliError(f"{flag}: expected comma-separated positive integers (got {value!r})", EXIT_USAGE)
    return out


def _blocks(args: argparse.Namespace) -> list[tuple[int, int]]:
    out = []
    if args.model:
        m = model_preset(args.model)
        out.append((m.hidden, m.heads))
    for spec in args.block or []:
        try:
            h, a = (int(x) for x in spec.split(":"))
        except ValueError:
            raise CliError(f"--block: expected HIDDEN:HEADS (got {spec!r})", EXIT_USAGE) from None
        if h <= 0 or a <= 0 or h % a:
            raise CliError(f"--block: HEADS must divide HIDDEN, both positive (got {spec!r})", EXIT_USAGE)
        out.append((h, a))
    return out


def _outer(args: argparse.Namespace) -> list[tuple[int, int]]:
    """``(hidden, vocab)`` of ``--model``: its embedding and head are timed beside its blocks."""
    if not args.model:
        return []
    m = model_preset(args.model)
    return [(m.hidden, m.vocab)]


def _profile(args: argparse.Namespace) -> int:
    from agent.profiler import build_profile, measure_collectives
    from spiderflow.profile import parse_profile

    if not args.seconds > 0:
        raise CliError(f"--seconds: must be > 0 (got {args.seconds})", EXIT_USAGE)
    blocks = _blocks(args)
    mbs, seqs = _ints("--micro-batches", args.micro_batches), _ints("--seq-lens", args.seq_lens)
    collectives: dict[str, dict[str, float]] | None = None
    rank = 0
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch
        import torch.distributed as dist

        cuda = torch.cuda.is_available()
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if cuda else "gloo")
        rank = dist.get_rank()
        figures = measure_collectives(nbytes=args.collective_mib << 20, device=f"cuda:{local}" if cuda else "cpu")
        same_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(world))) == world
        collectives = {"intra_node" if same_node else "inter_node": figures}
    try:
        doc: dict[str, Any] = (
            build_profile(blocks=blocks, micro_batches=mbs, seq_lens=seqs, precision=args.precision,
                          seconds=args.seconds, collectives=collectives, outer=_outer(args)) if rank == 0 else {}
        )
    finally:
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
    if rank != 0:
        return 0
    parse_profile(doc)  # what is written reads back
    if args.out is not None:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    if args.json or args.out is None:
        print_json(doc)
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("profile", help="measure this node and write a hardware profile (docs/profiles.md)")
    p.add_argument("--model", help="time the blocks, embedding and head (with its loss) of this model preset "
                   "(e.g. gpt3-1.3b)")
    p.add_argument("--block", action="append", help="time a block of HIDDEN:HEADS (repeatable)")
    p.add_argument("--micro-batches", default="1", help="micro-batch sizes to time, comma-separated (default 1)")
    p.add_argument("--seq-lens", default="2048", help="sequence lengths to time, comma-separated (default 2048)")
    p.add_argument("--precision", choices=[v.value for v in Precision], default=Precision.BF16.value,
                   help="precision of the GPU measurements (CPU nodes measure fp32)")
    p.add_argument("--seconds", type=float, default=0.5, help="seconds per calibration measurement (default 0.5)")
    p.add_argument("--collective-mib", type=int, default=16, help="message size of the collective benchmark (MiB)")
    p.add_argument("--out", type=Path, default=None, help="write the profile here (JSON)")
    p.add_argument("--json", action="store_true", help="also print the profile")
    p.set_defaults(func=_profile)
