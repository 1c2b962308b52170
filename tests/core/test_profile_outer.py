"""The work outside the blocks in a profile (embedding, head with its loss, their optimizer steps, the input
pipeline): parsing with errors naming the field, the round trip, interpolation, and how the cost model prices
it — only when measured, so plans priced without a profile are unchanged."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from spiderflow.core.catalog import ModelSpec
from spiderflow.core.costmodel import breakdown, stage_compute_time
from spiderflow.core.domain import Cluster, Plan, Precision, Schedule, Stage, Topology
from spiderflow.core.errors import ValidationError
from spiderflow.profile import (
    apply_profile,
    data_ms_per_sample,
    outer_us_per_token,
    parse_profile,
    profile_to_dict,
)

M = ModelSpec(name="t", layers=4, hidden=1024, heads=8, vocab=1000)


def _outer(b: int, fwd: float, bwd: float, opt: float | None = None, *, vocab: int = 1000) -> dict[str, object]:
    d: dict[str, object] = {"hidden": 1024, "vocab": vocab, "precision": "bf16", "micro_batch": b, "seq_len": 512,
                            "forward_ms": fwd, "backward_ms": bwd}
    if opt is not None:
        d["optimizer_ms"] = opt
    return d


def _doc() -> dict[str, object]:
    return {"version": 1, "gpus": {"A100-80G": {
        "matmul_tflops": {"bf16": 250.0}, "mfu": 0.5,
        "embedding": [_outer(1, 0.1, 0.4, 2.0), _outer(4, 0.2, 1.0, 2.0)],
        "head": [_outer(1, 1.0, 2.0, 3.0), _outer(4, 3.0, 6.0, 3.0), _outer(1, 9.0, 9.0, vocab=7)],
        "data": [{"seq_len": 512, "ms_per_sample": 1.5}],
    }}}


def test_outer_entries_round_trip_and_name_the_bad_field() -> None:
    p = parse_profile(_doc())
    e = p.gpus["A100-80G"]
    assert len(e.embedding) == 2 and len(e.head) == 3 and e.data[0].ms_per_sample == 1.5
    assert parse_profile(profile_to_dict(p)) == p
    for key, entry, match in (
        ("head", {**_outer(1, 1.0, 2.0), "forward_ms": -1.0}, r"gpus\.A100-80G\.head\[0\]\.forward_ms"),
        ("embedding", {**_outer(1, 1.0, 2.0), "vocab": 0}, r"embedding\[0\]\.vocab"),
        ("head", {**_outer(1, 1.0, 2.0), "tp": 2}, r"head\[0\]\.tp: unknown key"),
        ("head", {k: v for k, v in _outer(1, 1.0, 2.0).items() if k != "backward_ms"}, r"head\[0\]\.backward_ms"),
        ("embedding", {**_outer(1, 1.0, 2.0), "precision": "fp8"}, r"embedding\[0\]\.precision"),
        ("data", {"seq_len": 512}, r"data\[0\]\.ms_per_sample"),
        ("data", {"seq_len": 512, "ms_per_sample": "x"}, r"data\[0\]\.ms_per_sample"),
    ):
        with pytest.raises(ValidationError, match=match):
            parse_profile({"gpus": {"A100-80G": {key: [entry]}}})
    with pytest.raises(ValidationError, match=r"gpus\.A100-80G\.head: must be a list"):
        parse_profile({"gpus": {"A100-80G": {"head": {}}}})


def test_outer_time_is_interpolated_per_token_and_data_scales_with_the_sequence() -> None:
    e = parse_profile(_doc()).gpus["A100-80G"]
    us1, us4 = 1e3 * 3.0 / 512, 1e3 * 9.0 / 2048
    got = outer_us_per_token(e.head, M, Precision.BF16, 1, 512)
    assert got == pytest.approx((us1, 3.0))
    mid = outer_us_per_token(e.head, M, Precision.BF16, 2, 512)
    assert mid is not None and mid[0] == pytest.approx((us1 + us4) / 2)  # halfway in log tokens
    big = outer_us_per_token(e.head, M, Precision.BF16, 64, 512)
    assert big is not None and big[0] == pytest.approx(us4)  # clamped
    assert outer_us_per_token(e.head, M, Precision.FP32, 1, 512) is None  # other precision
    assert outer_us_per_token(e.head, replace(M, vocab=5), Precision.BF16, 1, 512) is None  # other vocabulary
    assert data_ms_per_sample(e.data, 1024) == pytest.approx(3.0)
    assert data_ms_per_sample((), 1024) is None


def _plan(m: int) -> Plan:
    return Plan(stages=(Stage(cluster="a", first_layer=0, last_layer=1), Stage(cluster="a", first_layer=2,
                                                                                last_layer=3)),
                micro_batches=m, schedule=Schedule.ONE_F_ONE_B)


def test_cost_model_prices_the_measured_outer_work_on_the_first_and_last_stage() -> None:
    topo = Topology(clusters=(Cluster(name="a", gpu="A100-80G", nodes=1, gpus_per_node=8),))
    prof = apply_profile(topo, parse_profile(_doc()), model=M, micro_batch=1, seq_len=512)
    c = prof.clusters[0]
    assert c.head_us_per_token == pytest.approx(1e3 * 3.0 / 512) and c.head_optimizer_ms == 3.0
    assert c.embedding_us_per_token == pytest.approx(1e3 * 0.5 / 512) and c.embedding_optimizer_ms == 2.0
    assert c.data_ms_per_sample == 1.5
    # the head's FLOPs at the blocks' rate are replaced by its measured time (not divided by tp: replicated)
    bare = replace(c, head_us_per_token=0.0, embedding_us_per_token=0.0)
    last, last_bare = (stage_compute_time(M, x, 2, 3, 2, 1, 512) for x in (c, bare))
    head_flops_s = 3.0 * 2.0 * 512 * M.hidden * M.vocab / (2 * c.effective_tflops * 1e12)
    assert last == pytest.approx(last_bare - head_flops_s + 3e-3)
    first, first_bare = (stage_compute_time(M, x, 0, 1, 1, 1, 512) for x in (c, bare))
    assert first == pytest.approx(first_bare + 0.5e-3)
    # per step: the first stage's embedding optimizer and input pipeline, the last stage's head optimizer
    bd = breakdown(_plan(4), prof, M, micro_batch=1, seq_len=512)
    assert bd.optimizer_s == pytest.approx((2e-3 + 4 * 1.5e-3, 3e-3))


def test_without_measured_outer_work_the_prices_are_unchanged() -> None:
    topo = Topology(clusters=(Cluster(name="a", gpu="A100-80G", nodes=1, gpus_per_node=8),))
    doc = _doc()
    for key in ("embedding", "head", "data"):
        del doc["gpus"]["A100-80G"][key]  # type: ignore[index]
    prof = apply_profile(topo, parse_profile(doc), model=M, micro_batch=1, seq_len=512)
    c = prof.clusters[0]
    assert (c.embedding_us_per_token, c.head_us_per_token, c.data_ms_per_sample) == (0.0, 0.0, 0.0)
    bd = breakdown(_plan(4), prof, M, micro_batch=1, seq_len=512)
    assert bd.optimizer_s == (0.0, 0.0)
    flops = 3.0 * (2 * M.layer_fwd_flops(1, 512) + 2.0 * 512 * M.hidden * M.vocab)
    assert math.isclose(bd.compute_s[1], flops / (c.effective_tflops * 1e12))


def test_cluster_refuses_negative_measured_figures() -> None:
    with pytest.raises(ValidationError, match=r"clusters\[a\]\.head_us_per_token"):
        Cluster(name="a", gpu="A100-80G", nodes=1, gpus_per_node=8, head_us_per_token=-1.0)


def test_without_a_model_only_the_blocks_rates_apply() -> None:
    # ``spiderflow simulate --profile`` folds a profile for many jobs: nothing job-specific is applied
    topo = Topology(clusters=(Cluster(name="a", gpu="A100-80G", nodes=1, gpus_per_node=8),))
    c = apply_profile(topo, parse_profile(_doc())).clusters[0]
    assert (c.embedding_us_per_token, c.head_us_per_token, c.data_ms_per_sample, c.head_optimizer_ms) == (0,) * 4
