"""Regenerate the pictures the README shows (``docs/images/``) with the commands the README gives:

- ``gantt.png``: ``spiderflow plan --topology examples/topology-3.yaml --model gpt3-13b --gpus 24:40
  --global-batch 32 --micro-batch 2 --gantt ...`` (a pipeline from ohio to virginia);
- ``map.png``: the cluster map of ``examples/topology-3.yaml`` (what ``spiderflow topology show --png`` draws);
- ``jct_cdf.png``, ``throughput_cost.png``, ``overhead_vs_clusters.png`` and ``report.html``: ``spiderflow
  simulate --topology examples/topology-3.yaml --trace examples/trace-3.json --policies ... --plots ...``.

Usage: ``.venv/bin/python scripts/readme_images.py [--out docs/images]`` (about a minute).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGY = "examples/topology-3.yaml"
GANTT = ["plan", "--topology", TOPOLOGY, "--model", "gpt3-13b", "--gpus", "24:40", "--global-batch", "32",
         "--micro-batch", "2"]
POLICIES = "spinsearch,bace,firstfit,genetic"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from spiderflow.cli.commands.topology import draw_map
    from spiderflow.cli.main import main as cli
    from spiderflow.formats import load_topology

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    steps = [
        [*GANTT, "--gantt", str(out / "gantt.png")],
        ["simulate", "--topology", TOPOLOGY, "--trace", "examples/trace-3.json", "--policies", POLICIES,
         "--json", str(Path(tempfile.mkdtemp()) / "results.json"), "--plots", str(out)],
    ]
    for argv_ in steps:
        print("spiderflow", " ".join(argv_), flush=True)
        code = cli(argv_)
        if code:
            return code
    draw_map(load_topology(ROOT / TOPOLOGY), out / "map.png", title="examples/topology-3.yaml: three regions")
    print(f"wrote {out}/map.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
