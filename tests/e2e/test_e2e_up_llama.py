"""``spiderflow up --model llama-tiny``: the README's sample job runs the Llama block across three
clusters (every part real, separate processes) to SUCCEEDED with the loss falling, and no process of the
run survives it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from e2e_harness import MARK, ROOT, wait_no_marked_processes

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(420)]


def test_up_with_model_llama_tiny_trains_to_succeeded(tmp_path: Path) -> None:
    token = uuid.uuid4().hex
    env = {**os.environ, MARK: token, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "spiderflow.cli.main", "up", "--model", "llama-tiny", "--steps", "20", "--json",
         "--data-dir", str(tmp_path / "mesh"), "--timeout", "300"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        out, err = proc.communicate(timeout=400)
        assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-3000:]}\n{err[-3000:]}"
        start = out.find("\n{\n")
        s, _ = json.JSONDecoder().raw_decode(out[start + 1:])
        print(json.dumps({k: s.get(k) for k in ("state", "steps", "first_loss", "last_loss", "model")}))
        assert s["state"] == "SUCCEEDED", s
        assert float(s["last_loss"]) < float(s["first_loss"]) - 1.0, s
        assert "llama-tiny" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        left = wait_no_marked_processes(token)
        assert not left, f"processes of the run survived it: {left}"
