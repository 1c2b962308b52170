"""Precision on the job and sharding/recomputation on a stage: defaults, validation, round trips."""

from __future__ import annotations

import pytest

from spiderflow.core.catalog import model_preset
from spiderflow.core.domain import GpuRange, JobSpec, Plan, Precision, Sharding, Stage
from spiderflow.core.errors import ValidationError
from spiderflow.formats import job_from_dict, job_to_dict, plan_from_dict, plan_to_dict


def _job(**kw: object) -> JobSpec:
    return JobSpec(id="j", model=model_preset("gpt-tiny"), global_batch=8, gpus=GpuRange(min=1, max=2), **kw)  # type: ignore[arg-type]


def test_precision_defaults_to_bf16_and_accepts_strings() -> None:
    assert _job().precision is Precision.BF16
    assert _job(precision="fp32").precision is Precision.FP32
    assert Precision.FP16.value_bytes == 2 and Precision.TF32.value_bytes == 4


def test_bad_precision_names_the_field() -> None:
    with pytest.raises(ValidationError) as e:
        _job(precision="fp8")
    assert e.value.field == "precision"
    with pytest.raises(ValidationError) as e2:
        job_from_dict({"id": "j", "model": "gpt-tiny", "global_batch": 8, "gpus": {"min": 1, "max": 1},
                       "precision": "int4"}, where="jobs[0]")
    assert e2.value.field == "jobs[0].precision"


def test_job_file_round_trip_keeps_precision() -> None:
    job = _job(precision="fp16")
    assert job_from_dict(job_to_dict(job)) == job


def test_stage_sharding_and_recompute() -> None:
    st = Stage(cluster="a", first_layer=0, last_layer=3, dp=2, sharding="fsdp", recompute=True)  # type: ignore[arg-type]
    assert st.sharding is Sharding.FSDP and st.recompute
    assert Stage(cluster="a", first_layer=0, last_layer=0).sharding is Sharding.REPLICATE
    with pytest.raises(ValidationError) as e:
        Stage(cluster="a", first_layer=0, last_layer=0, sharding="zero3")  # type: ignore[arg-type]
    assert e.value.field == "stage.sharding"
    with pytest.raises(ValidationError):
        Stage(cluster="a", first_layer=0, last_layer=0, recompute=1)  # type: ignore[arg-type]
    plan = Plan(stages=(st,), micro_batches=2)
    assert plan_from_dict(plan_to_dict(plan)).stages == (st,)
