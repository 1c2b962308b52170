"""``bench/gpu_check.py --cpu``: the device check's smoke form, the same code on CPU with a tiny model (its
default parts: env, profile, agent, runs), and its refusal of an unknown part."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from spiderflow.profile import load_profile

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"


def test_unknown_part_is_refused_by_name() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--parts", "env,bogus"], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 2
    assert "--parts: unknown bogus" in proc.stderr


@pytest.mark.heavy
def test_cpu_smoke_runs_the_default_parts(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(doc["parts"]) == {"env", "profile", "agent", "runs"}
    assert doc["parts"]["env"]["alloc_conf"] == "expandable_segments:True"
    entry = load_profile(tmp_path / "profile-fp32.json").gpus["cpu"]
    assert entry.blocks and entry.embedding and entry.head and entry.data
    runs = doc["parts"]["runs"]
    assert [r["name"] for r in runs] == ["tiny-m2", "tiny-m4"]
    assert all(r["step_time_s"] > 0 and len(r["losses"]) == 4 for r in runs)
