"""What an operator does on day one, against one real mesh (`spiderflow up --keep --no-job`: etcd, the
services, two agents and their torch.distributed workers, all separate processes), through the CLI, the SDK
and the web dashboard:

- the web dashboard in headless Chromium (Selenium, Debian's chromium and chromium-driver): the cluster map,
  a job submitted while it is open (`submit FILE --id ... --steps ... --watch`, piped) appears and reaches
  SUCCEEDED on screen with its loss curve, step times, per-stage busy times, Gantt chart and logs, and the
  page logs no console error (screenshots under ``.artifacts/dashboard``);
- that job's logs, per attempt, cluster and rank, relayed by the scheduler from the agents, filtered and
  followed, and still on disk after the mesh is gone;
- its metrics history (every step: loss, tokens/s, measured and predicted step time, each stage's measured
  and predicted busy time), `status --history` and a TensorBoard export read back with TensorBoard's reader;
- contexts: `up` adds one and removes it when it stops; an unreachable endpoint is named with what to do;
- Ctrl-C on `watch`, `delete` of a finished job, completion of job ids;
- every command's output, piped at 80 columns, has no line over 80 characters, no cut id and no cut figure.

One mesh and one training job (two stages, three steps) serve the whole module. Commands other than `up`,
the piped `watch` and the interrupted `watch` run in this process (``spiderflow.cli.main.main`` with its
output captured as a pipe at 80 columns): the same code as the executable, without an interpreter start each.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ARTIFACTS = Path(os.environ.get("SPIDERFLOW_TEST_ARTIFACTS", ROOT / ".artifacts")) / "dashboard"
"""Screenshots of the dashboard test (kept after the run; ``.artifacts/`` is not tracked)."""
JOB = "ovr-1"
STEPS = 3


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


@dataclass
class Mesh:
    proc: subprocess.Popen[str]
    env: dict[str, str]
    out: Path
    config: Path
    state: Path
    tmp: Path
    shown: dict[str, Any] = field(default_factory=dict)
    """What the dashboard showed of the submitted job (filled by the ``shown`` fixture)."""

    def cli(self, *args: str) -> Result:
        """``spiderflow ARGS`` in this process, its output a pipe (not a terminal) at 80 columns."""
        from spiderflow.cli import common
        from spiderflow.cli.main import main

        out, err = io.StringIO(), io.StringIO()
        saved_env = {k: os.environ.get(k) for k in self.env}
        saved_width = (common.console.width, common.err_console.width)
        handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        os.environ.update(self.env)
        common.console.width = common.err_console.width = 80
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = main(list(args))
                except SystemExit as e:  # argparse
                    code = int(e.code or 0)
        finally:
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            common.console.width, common.err_console.width = saved_width
            for s, h in handlers.items():
                signal.signal(s, h)
        return Result(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())

    def spawn(self, *args: str) -> subprocess.Popen[str]:
        """``spiderflow ARGS`` as its own process, stdout and stderr piped."""
        return subprocess.Popen([sys.executable, "-m", "spiderflow.cli.main", *args], cwd=ROOT, env=self.full_env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    @property
    def full_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPIDERFLOW_")}
        return {**env, **self.env}

    @property
    def context(self) -> dict[str, Any]:
        return dict(yaml.safe_load(self.config.read_text())["contexts"]["local"])


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    tmp = tmp_path_factory.mktemp("operator")
    env = {"SPIDERFLOW_CONFIG": str(tmp / "config.yaml"), "SPIDERFLOW_STATE_DIR": str(tmp / "state"),
           "COLUMNS": "80", "PYTHONPATH": str(ROOT)}
    out = tmp / "up.out"
    m = Mesh(proc=None, env=env, out=out, config=tmp / "config.yaml", state=tmp / "state", tmp=tmp)  # type: ignore[arg-type]
    with out.open("w") as f:
        # a short calibration: nothing here depends on its precision
        m.proc = subprocess.Popen([sys.executable, "-m", "spiderflow.cli.main", "up", "--clusters", "2", "--keep",
                                   "--no-job", "--timeout", "120", "--profile-seconds", "0.3"], cwd=ROOT,
                                  env=m.full_env, stdout=f, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 150
        while "mesh is up as context" not in out.read_text():
            assert m.proc.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.2)
        yield m
    finally:
        if m.proc.poll() is None:
            m.proc.send_signal(signal.SIGINT)
            try:
                m.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                m.proc.kill()


def _fits(text: str, width: int = 80) -> None:
    long = [line for line in text.splitlines() if len(line) > width]
    assert not long, "\n".join(long)
    assert "…" not in text, text  # rich's mark of a cut cell


def _whole_ids(text: str, ids: list[str]) -> None:
    """Every line that shows the start of one of ``ids`` shows all of it (no id wrapped or cut)."""
    for line in text.splitlines():
        for i in ids:
            if i[: max(4, len(i) - 2)] in line:
                assert i in line, (i, line)


def _browser() -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.skip("chromium and chromium-driver are not installed (scripts/bootstrap.sh installs them)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,2200", "--disable-extensions", "--no-first-run"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


def _wait(driver: Any, what: str, cond: Any, timeout: float = 90.0) -> Any:
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.25).until(cond)
    except WebDriverException:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(ARTIFACTS / "failed.png"))
        raise AssertionError(f"the dashboard never showed {what} (screenshot: {ARTIFACTS / 'failed.png'})") from None


def _state_of(driver: Any, job: str) -> str:
    """The state shown in the job's row ("" while it has none); read in the page, which redraws every 2 s."""
    return str(driver.execute_script(
        "const c = document.querySelector(`tr[data-job='${arguments[0]}'] td.state`); return c ? c.textContent : ''",
        job))


@pytest.fixture(scope="module")
def shown(mesh: Mesh) -> dict[str, Any]:
    """The dashboard of `up` in headless Chromium while a job is submitted with `submit FILE --id ... --steps
    ... --watch` (piped): what it showed, the piped watch's output, the console's errors."""
    from selenium.webdriver.common.by import By

    url = mesh.context["dashboard"]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    driver = _browser()
    try:
        driver.get(url)
        _wait(driver, "the cluster map", lambda d: len(d.find_elements(By.CSS_SELECTOR, "#map g.cluster")) == 2)
        mesh.shown["map"] = driver.find_element(By.ID, "map").text
        f = mesh.tmp / "job.yaml"
        f.write_text(yaml.safe_dump({"id": "from-file", "model": "gpt-tiny", "global_batch": 4, "seq_len": 64,
                                     "steps": 50, "gpus": {"min": 2, "max": 2}}))
        watch = mesh.spawn("submit", str(f), "--id", JOB, "--steps", str(STEPS), "--watch")
        _wait(driver, "the submitted job", lambda d: _state_of(d, JOB) != "", timeout=60)
        driver.execute_script(f"document.querySelector(`tr[data-job='{JOB}']`).click()")
        _wait(driver, f"{JOB} SUCCEEDED", lambda d: _state_of(d, JOB) == "SUCCEEDED", timeout=150)
        out, err = watch.communicate(timeout=60)
        mesh.shown.update(watch_rc=watch.returncode, watch_out=out, watch_err=err)
        _wait(driver, "the loss curve", lambda d: d.find_elements(By.CSS_SELECTOR, "#loss-chart polyline"))
        _wait(driver, "the Gantt chart", lambda d: d.execute_script(
            "const i = document.querySelector('#gantt img'); return i && i.complete && i.naturalWidth > 0"))
        _wait(driver, "the logs", lambda d: '"event": "step"' in d.find_element(By.ID, "logs").text)
        _wait(driver, f"{JOB}'s detail", lambda d: d.execute_script(
            "const s = document.getElementById('job-state'); return s && s.textContent === 'SUCCEEDED' && "
            f"document.getElementById('job-title').textContent.includes('{JOB}')"))
        _wait(driver, "the stage busy times",
              lambda d: len(d.find_elements(By.CSS_SELECTOR, "#stages-chart rect.stage-bar")) == 4)
        mesh.shown["steptime_lines"] = len(driver.find_elements(By.CSS_SELECTOR, "#steptime-chart polyline"))
        mesh.shown["tallest_stage_bar_px"] = driver.execute_script(
            "return Math.max(...[...document.querySelectorAll('#stages-chart rect.stage-bar')]"
            ".map((r) => r.getBoundingClientRect().height))")
        driver.save_screenshot(str(ARTIFACTS / "dashboard-job.png"))
        driver.execute_script("window.scrollTo(0, 0)")
        driver.save_screenshot(str(ARTIFACTS / "dashboard.png"))
        mesh.shown["severe"] = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
    finally:
        driver.quit()
    return mesh.shown


def test_up_prints_its_dashboard_and_adds_its_context(mesh: Mesh) -> None:
    text = mesh.out.read_text()
    doc = yaml.safe_load(mesh.config.read_text())
    assert doc["current-context"] == "local"
    ctx = doc["contexts"]["local"]
    assert ctx["owner_pid"] == mesh.proc.pid and ctx["scheduler"].startswith("127.0.0.1:")
    assert ctx["dashboard"].startswith("http://127.0.0.1:") and ctx["dashboard"] in text
    r = mesh.cli("context", "list")
    assert r.returncode == 0 and "local" in r.stdout and "*" in r.stdout
    r = mesh.cli("context", "show", "--json")
    assert json.loads(r.stdout)["resolved"]["scheduler"] == {"address": ctx["scheduler"], "source": "context local"}


def test_dashboard_follows_a_submitted_job_to_succeeded(mesh: Mesh, shown: dict[str, Any]) -> None:
    assert "Gbit/s" in shown["map"]
    assert shown["steptime_lines"] == 2  # measured and predicted
    assert shown["tallest_stage_bar_px"] > 60  # bars drawn to their value (no page style squashes them)
    assert not shown["severe"], shown["severe"]
    assert (ARTIFACTS / "dashboard-job.png").stat().st_size > 0
    # The piped watch of the same job: plain lines with steps and loss, ending with a newline.
    out = shown["watch_out"]
    assert shown["watch_rc"] == 0, shown["watch_err"] + out
    assert out.endswith("\n") and f"{JOB} step {STEPS}/{STEPS} loss " in out and "-> SUCCEEDED" in out
    _fits(out)
    r = mesh.cli("status", JOB, "--json")
    assert json.loads(r.stdout)["spec"]["steps"] == STEPS  # the file said 50: the command line wins
    r = mesh.cli("watch", JOB)  # a finished job: its final step count, not 0
    assert r.returncode == 0 and f"SUCCEEDED step {STEPS}/{STEPS}" in r.stdout


def test_logs_per_rank_relayed_by_the_scheduler(mesh: Mesh, shown: dict[str, Any]) -> None:
    r = mesh.cli("logs", JOB)
    assert r.returncode == 0, r.stderr
    labels = {line.split(" | ", 1)[0] for line in r.stdout.splitlines()}
    clusters = {label.split("/")[0] for label in labels}
    assert len(clusters) == 2 and {label.split("/")[2] for label in labels} == {"r0", "r1"}
    assert any(label.endswith("/out") for label in labels)
    # One rank's stdout: its step events, nothing else.
    r = mesh.cli("logs", JOB, "--rank", "1", "--stream", "stdout", "--no-prefix")
    events = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [e["step"] for e in events if e.get("event") == "step"] == list(range(1, STEPS + 1))
    assert all(e.get("rank") == 1 for e in events if "rank" in e)
    # --follow on a finished job prints everything and ends by itself.
    cluster = sorted(clusters)[0]
    r = mesh.cli("logs", JOB, "--follow", "--cluster", cluster)
    assert r.returncode == 0 and r.stdout and all(line.startswith(cluster + "/") for line in r.stdout.splitlines())
    # The SDK, the same stream.
    from spiderflow.sdk import Client

    with Client(mesh.context["scheduler"]) as sf:
        chunks = list(sf.logs(JOB, rank=0, stream="stdout"))
    assert chunks and all(c.rank == 0 and c.stream == "stdout" for c in chunks)
    assert '"event": "step"' in "".join(c.text for c in chunks)
    # A cluster whose agent is not registered: UNAVAILABLE, said in one line.
    r = mesh.cli("logs", JOB, "--cluster", "atlantis")
    assert r.returncode == 3 and "atlantis" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_metrics_history_per_stage_status_history_and_tensorboard(mesh: Mesh, shown: dict[str, Any]) -> None:
    r = mesh.cli("metrics", JOB, "--json")
    assert r.returncode == 0, r.stderr
    points = json.loads(r.stdout)["points"]
    assert [p["step"] for p in points] == list(range(1, STEPS + 1))
    assert all(p["loss"] > 0 and p["step_time_s"] > 0 and p["tokens_per_s"] > 0 for p in points)
    assert len({p["predicted_step_time_s"] for p in points}) == 1 and points[0]["predicted_step_time_s"] > 0
    # each of the two stages measured its busy time, next to the cost model's
    for p in points[:-1]:  # the last step of the first stage may arrive after the job ended
        assert len(p["stage_busy_s"]) == 2 and all(0 < b < 60 for b in p["stage_busy_s"]), p
    assert points[-1]["stage_busy_s"][-1] > 0
    assert len(points[0]["predicted_stage_busy_s"]) == 2 and all(v > 0 for v in points[0]["predicted_stage_busy_s"])
    r = mesh.cli("metrics", JOB)
    assert "STAGE BUSY MS" in r.stdout and "measured/predicted" in r.stdout
    _fits(r.stdout)
    r = mesh.cli("status", JOB, "--history")
    assert r.returncode == 0 and f"{STEPS}/{STEPS}" in r.stdout and "PREDICTED S" in r.stdout
    _fits(r.stdout)
    tb = mesh.tmp / "tb"
    r = mesh.cli("metrics", JOB, "--tensorboard", str(tb))
    assert r.returncode == 0, r.stderr
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb / "attempt-1"))
    acc.Reload()
    losses = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert [s for s, _ in losses] == list(range(1, STEPS + 1))
    assert [round(v, 4) for _, v in losses] == [round(p["loss"], 4) for p in points]
    assert "predicted_stage_busy_s/1" in acc.Tags()["scalars"]


def test_watch_ctrl_c_leaves_the_job_running_and_says_how_to_reattach(mesh: Mesh) -> None:
    r = mesh.cli("submit", "--model", "gpt-tiny", "--id", "waits-1", "--gpus", "500", "--seq-len", "64")
    assert r.returncode == 0, r.stderr
    proc = mesh.spawn("watch", "waits-1")
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


def test_every_command_fits_80_columns_piped(mesh: Mesh, shown: dict[str, Any]) -> None:
    """Every command of the CLI (those that talk to the mesh and the offline ones), piped at 80 columns: no
    line over 80 characters, no id cut or wrapped, no figure cut, no traceback."""
    ctx = mesh.context
    topo, trace = mesh.tmp / "topo8.json", mesh.tmp / "trace.json"
    plan = mesh.tmp / "plan.json"
    parked = "a-rather-long-job-id-0123456789"
    ids = [JOB, parked]
    commands: list[tuple[str, ...]] = [
        ("--version",), ("submit", "--model", "gpt-tiny", "--id", parked, "--gpus", "500", "--seq-len", "64"),
        ("jobs",), ("status", JOB), ("status", JOB, "--history"), ("status", parked), ("metrics", JOB),
        ("logs", JOB, "--rank", "0", "--stream", "stderr"), ("watch", JOB), ("cancel", parked), ("cancel", JOB),
        ("delete", parked), ("context", "list"), ("context", "show"), ("topology", "show"),
        ("completion", "--job-ids"), ("model", "show", "gpt3-1.3b"),
        ("topology", "generate", "--clusters", "8", "--seed", "1", "--out", str(topo)),
        ("topology", "validate", str(topo)),
        ("trace", "generate", "--jobs", "4", "--seed", "1", "--out", str(trace)),
        ("plan", "--topology", "examples/topology-3.yaml", "--model", "gpt3-1.3b", "--gpus", "8:24"),
        ("plan", "--topology", "aws-10-dtfm", "--model", "gpt3-1.3b", "--gpus", "16", "--json"),
        ("simulate", "--topology", str(topo), "--trace", str(trace), "--policies", "spinsearch,firstfit",
         "--json", str(mesh.tmp / "results.json")),
    ]
    for cmd in commands:
        with contextlib.chdir(ROOT):
            r = mesh.cli(*cmd)
        assert "Traceback" not in r.stderr, (cmd, r.stderr)
        if cmd[0] == "plan" and "--json" in cmd:
            plan.write_text(r.stdout)
            continue
        assert r.returncode in (0, 1), (cmd, r.returncode, r.stderr)  # 1: cancel/delete of a finished job
        _fits(r.stdout)
        _fits(r.stderr)
        _whole_ids(r.stdout + r.stderr, ids)
        if cmd[0] in ("jobs", "metrics", "watch") or cmd[:2] == ("status", JOB):
            assert JOB in r.stdout, (cmd, r.stdout)
    r = mesh.cli("estimate", "--topology", "aws-10-dtfm", "--plan", str(plan), "--model", "gpt3-1.3b")
    assert r.returncode == 0, r.stderr
    _fits(r.stdout)
    assert ctx["scheduler"] in mesh.cli("context", "show").stdout


def test_completion_knows_job_ids_models_and_policies(mesh: Mesh, shown: dict[str, Any]) -> None:
    r = mesh.cli("completion", "--job-ids")
    assert r.returncode == 0 and JOB in r.stdout.split()
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
    env = {**mesh.full_env, "PATH": f"{shim}:{os.environ['PATH']}"}
    probe = (f"source {script}; complete -C 'spiderflow status '; echo ---;"
             " complete -C 'spiderflow submit --model gpt-t'; echo ---; complete -C 'spiderflow cont'")
    r2 = subprocess.run([fish, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    jobs, models, commands = r2.stdout.split("---\n")
    assert JOB in jobs.split() and models.split() == ["gpt-tiny"]
    assert commands.startswith("context\t")


def test_unreachable_endpoint_is_named_with_what_to_do(mesh: Mesh) -> None:
    r = mesh.cli("jobs", "--address", "127.0.0.1:1")
    assert r.returncode == 3
    assert "no SpiderFlow scheduler answers at 127.0.0.1:1 (--address)" in r.stderr and "spiderflow up" in r.stderr


def test_stopping_up_removes_its_context_and_keeps_the_logs(mesh: Mesh, shown: dict[str, Any]) -> None:
    r = mesh.cli("delete", JOB)
    assert r.returncode == 0 and f"deleted {JOB}" in r.stdout
    assert mesh.cli("status", JOB).returncode == 4
    mesh.proc.send_signal(signal.SIGINT)
    assert mesh.proc.wait(timeout=90) == 130
    doc = yaml.safe_load(mesh.config.read_text()) or {}
    assert "local" not in (doc.get("contexts") or {}) and "current-context" not in doc
    kept = sorted(mesh.state.glob(f"agents/*/logs/{JOB}/attempt-1/*/rank-*.out"))
    assert len(kept) == 2 and all(p.stat().st_size > 0 for p in kept)
