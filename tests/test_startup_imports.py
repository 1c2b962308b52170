"""What a process of the mesh imports at start: the agents, the topology service and the CLI's commands leave
out the planner and its compiled kernels (numba, pandas, ortools: over a second of CPU apiece on a 2-core
machine, paid by every process the suite and ``spiderflow up`` start), and ``spiderflow COMMAND`` loads only
that command's module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHECK = """
import sys
sys.argv = ["spiderflow", "jobs", "--help"]
import agent.agent, agent.executor, services.topology.main
from spiderflow.cli.main import build_parser
build_parser("jobs")
heavy = sorted(m for m in ("numba", "pandas", "ortools", "torch", "spiderflow.core.tpa", "spiderflow.core.cycle",
                           "spiderflow.cli.commands.up", "spiderflow.cli.commands.testbed") if m in sys.modules)
print(",".join(heavy))
"""


def test_agents_topology_service_and_cli_commands_start_without_the_planner() -> None:
    r = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "", f"imported at start: {r.stdout.strip()}"


_SCHEDULER = """
import sys
import services.scheduler.main
heavy = sorted(m for m in ("ortools", "pandas", "spiderflow.core.tpa", "spiderflow.core.tpa.timeline")
               if m in sys.modules)
print(",".join(heavy))
"""


def test_the_scheduler_service_starts_without_the_tpa_planner_and_ortools() -> None:
    """The cycle re-scores a decision's plan on TPA's timeline only when it has one: the scheduler's start
    leaves out the planner, CP-SAT and pandas (about 2 s of CPU on a 2-core machine); its first placement
    loads them."""
    r = subprocess.run([sys.executable, "-c", _SCHEDULER], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "", f"imported at start: {r.stdout.strip()}"
