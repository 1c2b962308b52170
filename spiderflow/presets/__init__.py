"""Bundled real-world topologies (topology file format, each citing its source in a ``"source"`` key).

=================  ==========================================================================================
name               what was measured
=================  ==========================================================================================
``aws-10-dtfm``    10 AWS regions, pairwise delay (ms) and bandwidth (Gbit/s) measured by Yuan et al.,
                   "Decentralized Training of Foundation Models in Heterogeneous Environments", NeurIPS 2022
                   (github.com/DS3Lab/DT-FM, ``scheduler/generate_sim_com_matrices.py``).
``ibm-10-latency`` 10 IBM Cloud VPC regions, monthly average inter-region round-trip latency (27 Jul – 25 Aug
                   2024), IBM Cloud docs (github.com/ibm-cloud-docs/vpc,
                   ``_include-segments/network-latency.md``); bandwidth is an assumption, see the file.
=================  ==========================================================================================

GPU inventories and electricity prices are not part of either measurement; each file's ``source`` says
what was assumed.
"""

from __future__ import annotations

from pathlib import Path

from spiderflow.core.domain import Topology
from spiderflow.core.errors import ValidationError
from spiderflow.formats import load_document, load_topology

__all__ = ["PRESETS", "preset_path", "preset_source", "resolve_topology"]

_DIR = Path(__file__).resolve().parent

PRESETS: tuple[str, ...] = ("aws-10-dtfm", "ibm-10-latency")


def preset_path(name: str) -> Path:
    """Path of a bundled preset; :class:`ValidationError` on ``topology`` for an unknown name."""
    if name not in PRESETS:
        raise ValidationError("topology", f"neither a file nor a preset; presets: {', '.join(PRESETS)}", name)
    return _DIR / f"{name}.json"


def preset_source(name: str) -> str:
    """The citation stored in a preset's ``source`` key."""
    doc = load_document(preset_path(name))
    return str(doc.get("source", ""))


def resolve_topology(arg: str | Path) -> Topology:
    """Load ``arg`` as a topology file if it exists, else as a preset name. Something that reads as a path
    (a directory part or a ``.json``/``.yaml``/``.yml`` suffix) and does not exist is "no such file"."""
    p = Path(arg)
    if p.exists() or (str(arg) not in PRESETS and (len(p.parts) > 1 or p.suffix.lower() in _SUFFIXES)):
        return load_topology(p)
    return load_topology(preset_path(str(arg)))


_SUFFIXES = (".json", ".yaml", ".yml")
