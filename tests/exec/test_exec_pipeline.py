"""Real multi-process training on gloo over 127.0.0.1 matches one process, for every schedule and dp × pp."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from exec_harness import Launcher, losses_of, reference_losses

from spiderflow.core.catalog import model_preset
from spiderflow.core.domain import Plan, Schedule, Stage
from spiderflow.core.errors import PreconditionError
from spiderflow.exec.checkpoint import latest_checkpoint
from spiderflow.exec.runtime import PHASES, RunResult
from spiderflow.exec.spec import TrainSpec, check_runnable

MODEL = model_preset("gpt-tiny")
SEQ, BATCH, M, STEPS, SEED, LR = 32, 8, 4, 10, 7, 3e-3


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return reference_losses(MODEL, seq_len=SEQ, global_batch=BATCH, m=M, steps=STEPS, seed=SEED, lr=LR)


def _spec(stages: list[tuple[int, int, int]], schedule: Schedule, steps: int = STEPS, **kw: Any) -> TrainSpec:
    plan = Plan(
        stages=tuple(Stage(cluster=f"c{i}", first_layer=a, last_layer=b, dp=dp) for i, (a, b, dp) in enumerate(stages)),
        micro_batches=M, schedule=schedule,
    )
    return TrainSpec(job_id="t", model=MODEL, plan=plan, seq_len=SEQ, global_batch=BATCH, steps=steps, seed=SEED,
                     lr=LR, **kw)


def _losses(results: list[RunResult]) -> list[float]:
    return next(list(r.losses) for r in results if r.losses)


def _assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want, strict=True), 1):
        assert abs(g - w) <= 1e-5 * abs(w), f"step {step}: {g} vs reference {w}"


def test_worker_cli_two_stages_with_checkpoint_events(
    launcher: Launcher, reference: list[float], tmp_path: Path
) -> None:
    # The real entry point agents start: python -m spiderflow.exec.worker --spec FILE --rank N.
    spec = _spec([(0, 2, 1), (3, 5, 1)], Schedule.ONE_F_ONE_B, checkpoint_dir=str(tmp_path / "ck"),
                 checkpoint_every=5)
    events = launcher.run(spec, 2, rank0_serves=True)
    _assert_close(losses_of(events), reference)
    # Only the last stage knows the loss; every rank reports every step with a positive time.
    for rank, evs in enumerate(events):
        steps = [e for e in evs if e["event"] == "step"]
        assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
        assert all(e["step_time_s"] > 0 and e["tokens_per_s"] > 0 for e in steps)
        assert all((e["loss"] is None) == (rank != 1) for e in steps)
        assert all(e["stage"] == rank and e["replica"] == 0 for e in steps)
    published = [e["manifest"]["step"] for e in events[0] if e["event"] == "checkpoint"]
    assert published == [5, 10] and not any(e["event"] == "checkpoint" for e in events[1])
    latest = latest_checkpoint(tmp_path / "ck")
    assert latest is not None and latest.step == 10


@pytest.mark.parametrize("schedule", [Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.LATENCY_AWARE])
def test_three_stage_pipeline_matches_single_process(
    launcher: Launcher, reference: list[float], schedule: Schedule
) -> None:
    results = launcher.run_forked(_spec([(0, 1, 1), (2, 3, 1), (4, 5, 1)], schedule))
    _assert_close(_losses(results), reference)
    assert [bool(r.losses) for r in results] == [False, False, True]
    assert all(len(r.step_times_s) == STEPS for r in results)
    for r in results:  # where the steps after the first went, wall and CPU time per phase
        assert r.phases is not None and r.phases["steps"] == STEPS - 1
        assert set(r.phases) == {f"{p}_s" for p in PHASES} | {f"{p}_cpu_s" for p in PHASES} | {"steps"}
        assert r.phases["forward_s"] > 0 and r.phases["backward_s"] > 0 and r.phases["optimizer_s"] > 0
        booked = sum(r.phases[f"{p}_s"] for p in PHASES)
        assert booked <= sum(r.step_times_s[1:]) / (STEPS - 1) * 1.05


def test_dp2_pp2_matches_single_process(launcher: Launcher, reference: list[float]) -> None:
    results = launcher.run_forked(_spec([(0, 2, 2), (3, 5, 2)], Schedule.ONE_F_ONE_B))
    assert [(r.stage, r.replica) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    _assert_close(_losses(results), reference)
    # Both last-stage replicas report the same (all-reduced) loss.
    assert results[2].losses == results[3].losses


def test_uneven_dp_and_single_rank(launcher: Launcher, reference: list[float]) -> None:
    # One replica feeding a 2-replica stage under the latency-aware schedule; then the whole model on 1 rank.
    _assert_close(_losses(launcher.run_forked(_spec([(0, 3, 1), (4, 5, 2)], Schedule.LATENCY_AWARE))), reference)
    _assert_close(_losses(launcher.run_forked(_spec([(0, 5, 1)], Schedule.GPIPE))), reference)


def test_custom_warmup_runs_and_matches(launcher: Launcher, reference: list[float]) -> None:
    spec = _spec([(0, 1, 1), (2, 3, 1), (4, 5, 1)], Schedule.LATENCY_AWARE, warmup=(4, 4, 2))
    _assert_close(_losses(launcher.run_forked(spec)), reference)


def test_tensor_parallel_degree_must_divide_the_heads(launcher: Launcher) -> None:
    plan = Plan(stages=(Stage(cluster="a", first_layer=0, last_layer=5, tp=3),), micro_batches=M)
    spec = TrainSpec(job_id="t", model=MODEL, plan=plan, seq_len=SEQ, global_batch=BATCH, steps=1)
    with pytest.raises(AssertionError, match="exited 2"):
        launcher.run(spec, 3)
    with pytest.raises(PreconditionError, match="tensor parallelism"):
        check_runnable(spec)


def test_loss_falls_on_synthetic_data(reference: list[float]) -> None:
    # The reference is what every pipeline above reproduces; it must learn the Markov structure.
    assert reference[0] > 6.0
    assert max(reference[-3:]) < reference[0] - 1.0


def test_checkpoint_under_one_split_resumes_under_another(
    launcher: Launcher, reference: list[float], tmp_path: Path
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    # Split A: 3 stages, 7 steps, a checkpoint every 5 → one complete checkpoint, at step 5.
    a = launcher.run_forked(
        _spec([(0, 1, 1), (2, 3, 1), (4, 5, 1)], Schedule.ONE_F_ONE_B, steps=7, checkpoint_dir=str(ckpt_dir),
              checkpoint_every=5)
    )
    _assert_close(_losses(a), reference[:7])
    assert [m.step for m in a[0].manifests] == [5]
    assert not any(r.manifests for r in a[1:])
    manifest = latest_checkpoint(ckpt_dir)
    assert manifest is not None and manifest.step == 5
    assert [(s.first_layer, s.last_layer) for s in manifest.shards] == [(0, 1), (2, 3), (4, 5)]
    # A later step directory whose manifest was never written is not a checkpoint.
    partial = ckpt_dir / "step-00000009"
    partial.mkdir()
    (partial / "stage-000-001.pt").write_bytes(b"truncated")
    # Split B: 2 stages, the second with 2 replicas, latency-aware; resumes at step 5 and trains to 10.
    b = launcher.run_forked(
        _spec([(0, 3, 1), (4, 5, 2)], Schedule.LATENCY_AWARE, steps=STEPS, checkpoint_dir=str(ckpt_dir),
              resume=True)
    )
    assert all(r.first_step == 5 for r in b)
    _assert_close(_losses(b), reference[5:])


def test_resume_from_explicit_manifest_on_single_rank(
    launcher: Launcher, reference: list[float], tmp_path: Path
) -> None:
    # Checkpoint a single rank at step 3, then resume from the manifest object itself (as an agent does
    # with the manifest it stored in etcd) on a 2-stage split.
    first = launcher.run_forked(
        _spec([(0, 5, 1)], Schedule.GPIPE, steps=3, checkpoint_dir=str(tmp_path), checkpoint_every=3)
    )
    manifest = first[0].manifests[0]
    second = launcher.run_forked(
        _spec([(0, 0, 1), (1, 5, 1)], Schedule.ONE_F_ONE_B, steps=6, resume_from=manifest)
    )
    _assert_close(_losses(second), reference[3:6])


def test_interleaved_1f1b_matches_and_its_checkpoint_resumes_elsewhere(
    launcher: Launcher, reference: list[float], tmp_path: Path
) -> None:
    # 2 stages × 2 chunks: stage 0 runs layers 0-1 and 4, stage 1 runs 2-3 and 5 (see chunk_ranges).
    plan = Plan(stages=(Stage(cluster="a", first_layer=0, last_layer=2), Stage(cluster="b", first_layer=3,
                                                                               last_layer=5)),
                micro_batches=M, schedule=Schedule.INTERLEAVED_1F1B, extras={"chunks": 2.0})
    spec = TrainSpec(job_id="t", model=MODEL, plan=plan, seq_len=SEQ, global_batch=BATCH, steps=STEPS, seed=SEED,
                     lr=LR, checkpoint_dir=str(tmp_path), checkpoint_every=5)
    a = launcher.run_forked(spec)
    _assert_close(_losses(a), reference)
    manifest = a[0].manifests[0]
    assert [(s.first_layer, s.last_layer) for s in manifest.shards] == [(0, 1), (4, 4), (2, 3), (5, 5)]
    # Resume at step 5 on one rank running 3 interleaved chunks (chunk hand-offs stay in the process).
    solo = Plan(stages=(Stage(cluster="c", first_layer=0, last_layer=5),), micro_batches=M,
                schedule=Schedule.INTERLEAVED_1F1B, extras={"chunks": 3.0})
    b = launcher.run_forked(TrainSpec(job_id="t", model=MODEL, plan=solo, seq_len=SEQ, global_batch=BATCH,
                                      steps=STEPS, seed=SEED, lr=LR, resume_from=manifest))
    _assert_close(_losses(b), reference[5:])


def test_a_killed_rank_fails_its_peers_promptly(launcher: Launcher) -> None:
    # A lost cluster: its rank dies mid-training. The survivors must raise (the agent reports the error
    # or re-places the job), not hang until a long timeout.
    spec = _spec([(0, 1, 1), (2, 3, 1), (4, 5, 1)], Schedule.ONE_F_ONE_B, steps=100_000)
    out, elapsed = launcher.run_forked_killing(spec, rank=1, after_s=3.0, timeout=45.0)
    assert sorted(out) == [0, 2]
    for payload in out.values():
        assert isinstance(payload, str) and "Error" in payload, payload
    assert elapsed < 10.0  # gloo sees the closed connection at once (measured: milliseconds)


def test_interleaved_with_uneven_data_parallelism(launcher: Launcher, reference: list[float]) -> None:
    plan = Plan(stages=(Stage(cluster="a", first_layer=0, last_layer=3), Stage(cluster="b", first_layer=4,
                                                                               last_layer=5, dp=2)),
                micro_batches=M, schedule=Schedule.INTERLEAVED_1F1B, extras={"chunks": 2.0})
    spec = TrainSpec(job_id="t", model=MODEL, plan=plan, seq_len=SEQ, global_batch=BATCH, steps=STEPS, seed=SEED,
                     lr=LR)
    results = launcher.run_forked(spec)
    _assert_close(_losses(results), reference)
    assert results[1].losses == results[2].losses
