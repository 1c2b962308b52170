"""Placement-constraint options shared by ``submit``, ``plan`` and ``up``, in the style of SkyPilot and Slurm:
``--gpus A100:8`` (``TYPE:COUNT``; a plain count or ``MIN:MAX`` keeps working), ``--gpu-type``,
``--cluster``/``--exclude-cluster`` and ``--region``/``--exclude-region`` (each repeatable). They become the
job's ``constraints`` (:class:`spiderflow.core.domain.Constraints`); over a job FILE they replace only the
constraint lists they name.
"""

from __future__ import annotations

import argparse
from typing import Any

from spiderflow.core.errors import ValidationError

__all__ = ["CONSTRAINT_KEYS", "add_constraint_options", "constraint_overrides", "gpu_type_arg", "merge_constraints",
           "split_gpus"]

CONSTRAINT_KEYS = ("gpu_types", "clusters", "exclude_clusters", "regions", "exclude_regions")
"""The fields of :class:`spiderflow.core.domain.Constraints`, in the order of the options."""
_OPTIONS = {"gpu_types": "gpu_type", "clusters": "cluster", "exclude_clusters": "exclude_cluster",
            "regions": "region", "exclude_regions": "exclude_region"}


def gpu_type_arg(value: str) -> str:
    """A GPU type name as the catalog spells it (``a100`` → ``A100``); an argparse error otherwise."""
    from spiderflow.core.domain import Constraints

    try:
        return Constraints(gpu_types=(value,)).gpu_types[0]
    except ValidationError as e:
        raise argparse.ArgumentTypeError(f"{e.reason} (got {value!r})") from None


def split_gpus(value: str) -> tuple[str | None, str]:
    """``--gpus`` as ``(type, count)``: ``A100:8`` → ``("A100", "8")``, ``h100:8:16`` → ``("H100", "8:16")``
    (the type as the catalog spells it), ``8`` → ``(None, "8")``, ``8:16`` → ``(None, "8:16")``."""
    head, sep, rest = value.partition(":")
    if sep and head.strip() and not head.strip().isdigit():
        return gpu_type_arg(head.strip()), rest
    return None, value


def add_constraint_options(p: argparse.ArgumentParser) -> None:
    """``--gpu-type``, ``--cluster``, ``--exclude-cluster``, ``--region``, ``--exclude-region``."""
    g = p.add_argument_group("placement constraints (default: any cluster; each option repeatable)")
    g.add_argument("--gpu-type", action="append", type=gpu_type_arg, metavar="TYPE",
                   help="allowed GPU type: a catalog name or family, any case (e.g. --gpu-type A100 "
                        "--gpu-type H100-80G; default: any)")
    g.add_argument("--cluster", action="append", metavar="NAME",
                   help="run only on these clusters (e.g. --cluster virginia; default: all)")
    g.add_argument("--exclude-cluster", action="append", metavar="NAME",
                   help="never use this cluster (e.g. --exclude-cluster ohio; default: none)")
    g.add_argument("--region", action="append", metavar="REGION",
                   help="run only on clusters of these regions (e.g. --region us-east; default: all)")
    g.add_argument("--exclude-region", action="append", metavar="REGION",
                   help="never use clusters of this region (default: none)")


def constraint_overrides(args: argparse.Namespace, gpu_type: str | None = None) -> dict[str, list[str]]:
    """The constraint lists the options name (``gpu_type``: the type of ``--gpus TYPE:N``, added to
    ``--gpu-type``); keys absent when not given."""
    out: dict[str, list[str]] = {}
    for key, dest in _OPTIONS.items():
        values: list[str] = list(getattr(args, dest, None) or ())
        if key == "gpu_types" and gpu_type is not None and gpu_type not in values:
            values.insert(0, gpu_type)
        if values:
            out[key] = values
    return out


def merge_constraints(base: Any, given: dict[str, list[str]]) -> Any:
    """A job document's ``constraints`` with the options' lists replacing the ones they name."""
    if not given:
        return base
    return {**base, **given} if isinstance(base, dict) else dict(given)
