"""What an operator does on day one, against one real mesh (`spiderflow up --keep`: etcd, the services, two
agents and their torch.distributed workers, all separate processes), through the CLI and the SDK:

- the workers' logs, per attempt, cluster and rank, relayed by the scheduler from the agents, filtered and
  followed, and still on disk after the mesh is gone;
- the metrics history (every step: loss, tokens/s, measured and predicted step time), `status --history`
  and a TensorBoard export read back with TensorBoard's own reader;
- contexts: `up` adds one and removes it when it stops; an unreachable endpoint is named with what to do;
- the web dashboard in headless Chromium (Selenium, Debian's chromium and chromium-driver): the cluster map,
  a job submitted while it is open appears and reaches SUCCEEDED on screen with its loss curve, step times,
  Gantt chart and logs, and the page logs no console error (screenshots under ``.artifacts/dashboard``);
- `submit FILE` with overrides, piped `watch` lines, Ctrl-C on `watch`, `delete` of a finished job;
- every command's output, piped at 80 columns, has no line over 80 characters and no cut id.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(420), pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ARTIFACTS = Path(os.environ.get("SPIDERFLOW_TEST_ARTIFACTS", ROOT / ".artifacts")) / "dashboard"
"""Screenshots of the dashboard test (kept after the run; ``.artifacts/`` is not tracked)."""


@dataclass
class Mesh:
    proc: subprocess.Popen[str]
    env: dict[str, str]
    job: str
    out: Path
    config: Path
    state: Path
    tmp: Path

    def cli(self, *args: str, timeout: float = 120,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "spiderflow.cli.main", *args], capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT, env=env or self.env)


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPIDERFLOW_")}
    env.update(SPIDERFLOW_CONFIG=str(tmp / "config.yaml"), SPIDERFLOW_STATE_DIR=str(tmp / "state"), COLUMNS="80",
               PYTHONPATH=str(ROOT))
    return env


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    tmp = tmp_path_factory.mktemp("operator")
    env = _env(tmp)
    out = tmp / "up.out"
    with out.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "spiderflow.cli.main", "up", "--clusters", "2", "--steps", "6",
                                 "--keep", "--timeout", "240"], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                text=True)
    try:
        deadline = time.monotonic() + 300
        while "mesh is up as context" not in out.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.5)
        text = out.read_text()
        job = text.split("submitted ", 1)[1].split(":", 1)[0].strip()
        yield Mesh(proc=proc, env=env, job=job, out=out, config=tmp / "config.yaml", state=tmp / "state", tmp=tmp)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _fits(text: str, width: int = 80) -> None:
    long = [line for line in text.splitlines() if len(line) > width]
    assert not long, "\n".join(long)


def test_up_reports_success_and_adds_its_context(mesh: Mesh) -> None:
    text = mesh.out.read_text()
    assert "SUCCEEDED" in text and mesh.job.startswith("sample-")
    doc = yaml.safe_load(mesh.config.read_text())
    assert doc["current-context"] == "local"
    ctx = doc["contexts"]["local"]
    assert ctx["owner_pid"] == mesh.proc.pid and ctx["scheduler"].startswith("127.0.0.1:")
    r = mesh.cli("context", "list")
    assert r.returncode == 0 and "local" in r.stdout and "*" in r.stdout
    _fits(r.stdout)
    r = mesh.cli("context", "show", "--json")
    assert json.loads(r.stdout)["resolved"]["scheduler"] == {"address": ctx["scheduler"], "source": "context local"}


def test_logs_per_rank_relayed_by_the_scheduler(mesh: Mesh) -> None:
    r = mesh.cli("logs", mesh.job)
    assert r.returncode == 0, r.stderr
    labels = {line.split(" | ", 1)[0] for line in r.stdout.splitlines()}
    clusters = {label.split("/")[0] for label in labels}
    assert len(clusters) == 2 and {label.split("/")[2] for label in labels} == {"r0", "r1"}
    assert any(label.endswith("/out") for label in labels)
    # One rank's stdout: its step events, nothing else.
    r = mesh.cli("logs", mesh.job, "--rank", "1", "--stream", "stdout", "--no-prefix")
    events = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [e["step"] for e in events if e.get("event") == "step"] == [1, 2, 3, 4, 5, 6]
    assert all(e.get("rank") == 1 for e in events if "rank" in e)
    # --follow on a finished job prints everything and ends by itself.
    cluster = sorted(clusters)[0]
    r = mesh.cli("logs", mesh.job, "--follow", "--cluster", cluster, timeout=60)
    assert r.returncode == 0 and r.stdout and all(line.startswith(cluster + "/") for line in r.stdout.splitlines())
    # The SDK, the same stream.
    from spiderflow.sdk import Client

    ctx = yaml.safe_load(mesh.config.read_text())["contexts"]["local"]
    with Client(ctx["scheduler"]) as sf:
        chunks = list(sf.logs(mesh.job, rank=0, stream="stdout"))
    assert chunks and all(c.rank == 0 and c.stream == "stdout" for c in chunks)
    assert '"event": "step"' in "".join(c.text for c in chunks)
    # A cluster whose agent is not registered: UNAVAILABLE, said in one line.
    r = mesh.cli("logs", mesh.job, "--cluster", "atlantis")
    assert r.returncode == 3 and "atlantis" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_metrics_history_status_history_and_tensorboard(mesh: Mesh) -> None:
    r = mesh.cli("metrics", mesh.job, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    points = doc["points"]
    assert [p["step"] for p in points] == [1, 2, 3, 4, 5, 6]
    assert all(p["loss"] > 0 and p["step_time_s"] > 0 and p["tokens_per_s"] > 0 for p in points)
    assert len({p["predicted_step_time_s"] for p in points}) == 1 and points[0]["predicted_step_time_s"] > 0
    r = mesh.cli("status", mesh.job, "--history")
    assert r.returncode == 0 and "6/6" in r.stdout and "PREDICTED S" in r.stdout
    _fits(r.stdout)
    tb = mesh.tmp / "tb"
    r = mesh.cli("metrics", mesh.job, "--tensorboard", str(tb))
    assert r.returncode == 0, r.stderr
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb / "attempt-1"))
    acc.Reload()
    losses = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert [s for s, _ in losses] == [1, 2, 3, 4, 5, 6]
    assert [round(v, 4) for _, v in losses] == [round(p["loss"], 4) for p in points]


def _browser() -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.skip("chromium and chromium-driver are not installed (scripts/bootstrap.sh installs them)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,2000"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


def _wait(driver: Any, what: str, cond: Any, timeout: float = 120.0) -> Any:
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.5).until(cond)
    except WebDriverException:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(ARTIFACTS / "failed.png"))
        raise AssertionError(f"the dashboard never showed {what} (screenshot: {ARTIFACTS / 'failed.png'})") from None


def _state_of(driver: Any, job: str) -> str:
    """The state shown in the job's row ("" while it has none); read in the page, which redraws every 2 s."""
    return str(driver.execute_script(
        "const c = document.querySelector(`tr[data-job='${arguments[0]}'] td.state`); return c ? c.textContent : ''",
        job))


def test_dashboard_follows_a_submitted_job_to_succeeded(mesh: Mesh) -> None:
    """The dashboard of `up` in headless Chromium: the map, the finished sample job, then a job submitted with
    `submit FILE --id ... --steps ... --watch` (piped) appears and reaches SUCCEEDED on screen, with its loss
    curve, step times, Gantt chart and logs; no console error; screenshots kept in ARTIFACTS."""
    from selenium.webdriver.common.by import By

    url = yaml.safe_load(mesh.config.read_text())["contexts"]["local"]["dashboard"]
    assert url.startswith("http://127.0.0.1:") and url in mesh.out.read_text()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    driver = _browser()
    try:
        driver.get(url)
        _wait(driver, "the sample job SUCCEEDED", lambda d: _state_of(d, mesh.job) == "SUCCEEDED")
        assert len(driver.find_elements(By.CSS_SELECTOR, "#map g.cluster")) == 2
        assert "Gbit/s" in driver.find_element(By.ID, "map").text
        f = mesh.tmp / "job.yaml"
        f.write_text(yaml.safe_dump({"id": "from-file", "model": "gpt-tiny", "global_batch": 4, "seq_len": 64,
                                     "steps": 50, "gpus": {"min": 2, "max": 2}}))
        watch = subprocess.Popen([sys.executable, "-m", "spiderflow.cli.main", "submit", str(f), "--id", "ovr-1",
                                  "--steps", "3", "--watch"], cwd=ROOT, env=mesh.env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        _wait(driver, "the submitted job", lambda d: _state_of(d, "ovr-1") != "", timeout=60)
        driver.execute_script("document.querySelector(`tr[data-job='ovr-1']`).click()")
        _wait(driver, "ovr-1 SUCCEEDED", lambda d: _state_of(d, "ovr-1") == "SUCCEEDED", timeout=240)
        out, err = watch.communicate(timeout=60)
        _wait(driver, "the loss curve", lambda d: d.find_elements(By.CSS_SELECTOR, "#loss-chart polyline"))
        _wait(driver, "the Gantt chart", lambda d: d.execute_script(
            "const i = document.querySelector('#gantt img'); return i && i.complete && i.naturalWidth > 0"))
        _wait(driver, "the logs", lambda d: '"event": "step"' in d.find_element(By.ID, "logs").text)
        _wait(driver, "ovr-1's detail", lambda d: d.execute_script(
            "const s = document.getElementById('job-state'); return s && s.textContent === 'SUCCEEDED' && "
            "document.getElementById('job-title').textContent.includes('ovr-1')"))
        assert len(driver.find_elements(By.CSS_SELECTOR, "#steptime-chart polyline")) == 2
        driver.save_screenshot(str(ARTIFACTS / "dashboard-job.png"))
        driver.execute_script("window.scrollTo(0, 0)")
        driver.save_screenshot(str(ARTIFACTS / "dashboard.png"))
        severe = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
        assert not severe, severe
    finally:
        driver.quit()
    # The piped watch of the same job: plain lines with steps and loss, ending with a newline.
    assert watch.returncode == 0, err + out
    assert out.endswith("\n") and "ovr-1 step 3/3 loss " in out and "-> SUCCEEDED" in out
    _fits(out)
    r = mesh.cli("status", "ovr-1", "--json")
    assert json.loads(r.stdout)["spec"]["steps"] == 3  # the file said 50: the command line wins
    r = mesh.cli("watch", "ovr-1")  # a finished job: its final step count, not 0
    assert r.returncode == 0 and "SUCCEEDED step 3/3" in r.stdout
    r = mesh.cli("delete", "ovr-1")
    assert r.returncode == 0 and "deleted ovr-1" in r.stdout
    assert mesh.cli("status", "ovr-1").returncode == 4


def test_watch_ctrl_c_leaves_the_job_running_and_says_how_to_reattach(mesh: Mesh) -> None:
    r = mesh.cli("submit", "--model", "gpt-tiny", "--id", "waits-1", "--gpus", "500", "--seq-len", "64")
    assert r.returncode == 0, r.stderr
    proc = subprocess.Popen([sys.executable, "-m", "spiderflow.cli.main", "watch", "waits-1"], cwd=ROOT, env=mesh.env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert "waits-1 PENDING step 0/10" in first
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert "the job keeps running" in err and "spiderflow watch waits-1" in err and "Traceback" not in err
    r = mesh.cli("delete", "waits-1")  # not finished: refused, with what to do
    assert r.returncode == 1 and "spiderflow cancel waits-1" in r.stderr
    assert mesh.cli("cancel", "waits-1").returncode == 0
    assert mesh.cli("delete", "waits-1").returncode == 0


def test_every_command_fits_80_columns_piped(mesh: Mesh) -> None:
    ctx = yaml.safe_load(mesh.config.read_text())["contexts"]["local"]
    commands = [
        ("jobs",), ("status", mesh.job), ("metrics", mesh.job), ("context", "list"), ("context", "show"),
        ("topology", "show"), ("watch", mesh.job), ("cancel", mesh.job),
    ]
    for cmd in commands:
        r = mesh.cli(*cmd)
        assert "Traceback" not in r.stderr, (cmd, r.stderr)
        _fits(r.stdout)
        _fits(r.stderr)
        if mesh.job in r.stdout + r.stderr or cmd[0] in ("jobs", "status", "metrics", "watch"):
            assert mesh.job in r.stdout + r.stderr, (cmd, r.stdout)
    assert ctx["scheduler"] in mesh.cli("context", "show").stdout


def test_completion_knows_job_ids_models_and_policies(mesh: Mesh) -> None:
    r = mesh.cli("completion", "--job-ids")
    assert r.returncode == 0 and mesh.job in r.stdout.split()
    r = mesh.cli("completion", "bash")
    assert "gpt-tiny" in r.stdout and "spinsearch" in r.stdout and "aws-10-dtfm" in r.stdout
    fish = shutil.which("fish")
    if fish is None:
        return
    script = mesh.tmp / "spiderflow.fish"
    script.write_text(mesh.cli("completion", "fish").stdout)
    shim = mesh.tmp / "bin"
    shim.mkdir(exist_ok=True)
    (shim / "spiderflow").write_text(f'#!/bin/sh\nexec {sys.executable} -m spiderflow.cli.main "$@"\n')
    (shim / "spiderflow").chmod(0o755)
    env = {**mesh.env, "PATH": f"{shim}:{os.environ['PATH']}"}
    probe = (f"source {script}; complete -C 'spiderflow status '; echo ---;"
             " complete -C 'spiderflow submit --model gpt-t'; echo ---; complete -C 'spiderflow cont'")
    r = subprocess.run([fish, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    jobs, models, commands = r.stdout.split("---\n")
    assert mesh.job in jobs.split() and models.split() == ["gpt-tiny"]
    assert commands.startswith("context\t")


def test_unreachable_endpoint_is_named_with_what_to_do(mesh: Mesh) -> None:
    r = mesh.cli("jobs", "--address", "127.0.0.1:1")
    assert r.returncode == 3
    assert "no SpiderFlow scheduler answers at 127.0.0.1:1 (--address)" in r.stderr and "spiderflow up" in r.stderr


def test_stopping_up_removes_its_context_and_keeps_the_logs(mesh: Mesh) -> None:
    mesh.proc.send_signal(signal.SIGINT)
    assert mesh.proc.wait(timeout=90) == 130
    doc = yaml.safe_load(mesh.config.read_text()) or {}
    assert "local" not in (doc.get("contexts") or {}) and "current-context" not in doc
    kept = sorted(mesh.state.glob(f"agents/*/logs/{mesh.job}/attempt-1/*/rank-*.out"))
    assert len(kept) == 2 and all(p.stat().st_size > 0 for p in kept)
