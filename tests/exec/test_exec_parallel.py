"""Tensor, sharded and cross-cluster data parallelism, recomputation, mixed precision and reshardable
checkpoints: real multi-process training on gloo (the GPU code path on CPU) equals one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from exec_harness import Launcher, reference_losses

from spiderflow.core.catalog import model_preset
from spiderflow.core.domain import Plan, Precision, ReplicaShare, Schedule, Sharding, Stage
from spiderflow.exec.checkpoint import complete_checkpoints, latest_checkpoint
from spiderflow.exec.runtime import RunResult
from spiderflow.exec.spec import TrainSpec

pytestmark = pytest.mark.heavy

MODEL = model_preset("gpt-tiny")
SEQ, BATCH, M, STEPS, SEED, LR = 32, 8, 4, 10, 7, 3e-3
FSDP = Sharding.FSDP


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return reference_losses(MODEL, seq_len=SEQ, global_batch=BATCH, m=M, steps=STEPS, seed=SEED, lr=LR)


def _spec(stages: list[Stage], schedule: Schedule, steps: int = STEPS, **kw: Any) -> TrainSpec:
    plan = Plan(stages=tuple(stages), micro_batches=M, schedule=schedule)
    return TrainSpec(job_id="t", model=MODEL, plan=plan, seq_len=SEQ, global_batch=BATCH, steps=steps, seed=SEED,
                     lr=LR, **kw)


def _losses(results: list[RunResult]) -> list[float]:
    return next(list(r.losses) for r in results if r.losses)


def _assert_close(got: list[float], want: list[float], rel: float = 1e-5) -> None:
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want, strict=True), 1):
        assert abs(g - w) <= rel * abs(w), f"step {step}: {g} vs reference {w}"


# Every schedule runs a pipeline with tensor parallelism, a recomputed stage and a stage whose two replicas
# are on two clusters (hierarchical all-reduce); 1F1B and the latency-aware schedule with a tp 2 × dp 2
# stage and FSDP (GPipe with 4 ranks, to keep the suite's process count down).
LAYOUTS = {
    Schedule.GPIPE: [
        Stage(cluster="a", first_layer=0, last_layer=1, dp=2, replicas=(ReplicaShare(cluster="a", dp=1),
                                                                        ReplicaShare(cluster="b", dp=1))),
        Stage(cluster="c", first_layer=2, last_layer=5, tp=2, recompute=True),
    ],
    Schedule.ONE_F_ONE_B: [
        Stage(cluster="a", first_layer=0, last_layer=2, tp=2, dp=2, sharding=FSDP),
        Stage(cluster="b", first_layer=3, last_layer=5, dp=2, recompute=True,
              replicas=(ReplicaShare(cluster="b", dp=1), ReplicaShare(cluster="c", dp=1))),
    ],
    Schedule.LATENCY_AWARE: [
        Stage(cluster="a", first_layer=0, last_layer=2, tp=2, dp=2, recompute=True,
              replicas=(ReplicaShare(cluster="a", dp=1), ReplicaShare(cluster="b", dp=1))),
        Stage(cluster="c", first_layer=3, last_layer=5, dp=2, sharding=FSDP),
    ],
}


@pytest.mark.timeout(600)  # 4–6 processes on a loaded 2-core machine
@pytest.mark.parametrize("schedule", list(LAYOUTS))
def test_tp_fsdp_recompute_and_cross_cluster_dp_match_single_process(
    launcher: Launcher, reference: list[float], schedule: Schedule
) -> None:
    results = launcher.run_forked(_spec(LAYOUTS[schedule], schedule))
    _assert_close(_losses(results), reference)
    last = [r for r in results if r.stage == 1]
    assert all(r.losses == last[0].losses for r in last)  # every tp rank and replica reports the same loss


def test_bf16_tracks_the_fp32_reference(launcher: Launcher, reference: list[float]) -> None:
    # bf16 keeps 8 significant bits (relative rounding 2^-9 ≈ 0.2 %) in every matmul and in the
    # activations and gradients crossing the link; with fp32 master weights and Adam state the loss stays
    # within 2 % of the fp32 run over 10 steps (the bound asserted; the gap seen is far smaller), far below the 1.5-nat
    # drop the model makes in those steps, so a wrong gradient or a lost update would still be caught.
    stages = [Stage(cluster="a", first_layer=0, last_layer=2), Stage(cluster="b", first_layer=3, last_layer=5)]
    results = launcher.run_forked(_spec(stages, Schedule.ONE_F_ONE_B, precision=Precision.BF16))
    got = _losses(results)
    _assert_close(got, reference, rel=2e-2)
    assert got != reference


def test_checkpoint_reshards_to_another_plan_and_skips_a_corrupt_newest(
    launcher: Launcher, reference: list[float], tmp_path: Path
) -> None:
    root = tmp_path / "ck"
    # Plan A: 3 stages, tp 1, the first with 2 replicas; checkpoints after steps 3 and 6 (fsspec URL).
    plan_a = [Stage(cluster="a", first_layer=0, last_layer=1, dp=2), Stage(cluster="a", first_layer=2, last_layer=3),
              Stage(cluster="b", first_layer=4, last_layer=5)]
    a = launcher.run_forked(_spec(plan_a, Schedule.ONE_F_ONE_B, steps=7, checkpoint_dir=f"file://{root}",
                                  checkpoint_every=3))
    _assert_close(_losses(a), reference[:7])
    assert [m.step for m in a[0].manifests] == [3, 6]
    assert [m.step for m in complete_checkpoints(str(root))] == [6, 3]
    newest = latest_checkpoint(str(root))
    assert newest is not None and newest.step == 6 and len(newest.files) >= 5  # metadata + one file per rank
    # Damage one shard of the newest checkpoint: it must be refused and step 3 used instead.
    victim = root / "step-00000006" / newest.files[-1].name
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    fallback = latest_checkpoint(str(root))
    assert fallback is not None and fallback.step == 3
    # Plan B: 2 stages, tp 2 in the first, FSDP over 2 replicas in the second; resumes at step 3.
    plan_b = [Stage(cluster="c", first_layer=0, last_layer=2, tp=2),
              Stage(cluster="c", first_layer=3, last_layer=5, dp=2, sharding=FSDP)]
    b = launcher.run_forked(_spec(plan_b, Schedule.LATENCY_AWARE, steps=STEPS, checkpoint_dir=str(root),
                                  resume=True, checkpoint_every=5, checkpoint_keep=2))
    assert all(r.first_step == 3 for r in b)
    _assert_close(_losses(b), reference[3:])
    # Retention keeps the newest two complete checkpoints by step (the damaged step 6 counts: resuming
    # skips it, retention does not re-hash), so steps 3 and 5 are gone.
    assert [m.step for m in complete_checkpoints(str(root))] == [10, 6]
