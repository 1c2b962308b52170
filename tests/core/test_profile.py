"""Hardware profiles: parsing, errors naming the field, folding into a topology, block interpolation; and
``spiderflow estimate``/``plan --profile`` through the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from spiderflow.cli.main import main
from spiderflow.core.catalog import ModelSpec
from spiderflow.core.costmodel import layer_fwd_flops
from spiderflow.core.domain import Cluster, Precision, Topology
from spiderflow.core.errors import ValidationError
from spiderflow.profile import apply_profile, block_rate_tflops, parse_profile, profile_to_dict

M = ModelSpec(name="t", layers=4, hidden=1024, heads=8, vocab=1000)


def _doc() -> dict[str, object]:
    return {
        "version": 1,
        "gpus": {"A100-80G": {
            "matmul_tflops": {"bf16": 250.0, "fp32": 19.0}, "mfu": 0.5, "layer_overhead_ms": 0.1,
            "memory_overhead_gib": 4.5,
            "nccl": {"intra_node": {"allreduce_gbps": 1500.0, "latency_us": 10.0},
                     "inter_node": {"allreduce_gbps": 180.0}},
            "blocks": [
                {"hidden": 1024, "heads": 8, "precision": "bf16", "micro_batch": 1, "seq_len": 512, "tp": 1,
                 "forward_ms": 1.0, "backward_ms": 2.0},
                {"hidden": 1024, "heads": 8, "precision": "bf16", "micro_batch": 4, "seq_len": 512, "tp": 1,
                 "forward_ms": 2.0, "backward_ms": 4.0},
            ],
        }},
        "clusters": {"b": {"nccl": {"inter_node": {"allreduce_gbps": 50.0}}}},
    }


def test_parse_round_trip_and_errors() -> None:
    p = parse_profile(_doc())
    assert parse_profile(profile_to_dict(p)) == p
    bad = _doc()
    bad["gpus"]["A100-80G"]["mfu"] = 1.5  # type: ignore[index]
    with pytest.raises(ValidationError, match=r"profile\.gpus\.A100-80G\.mfu"):
        parse_profile(bad)
    with pytest.raises(ValidationError, match=r"profile\.gpus\.Z9"):
        parse_profile({"gpus": {"Z9": {}}})
    with pytest.raises(ValidationError, match=r"blocks\[0\]\.forward_ms"):
        parse_profile({"gpus": {"L4": {"blocks": [{"hidden": 8, "heads": 2, "micro_batch": 1, "seq_len": 4,
                                                   "backward_ms": 1.0}]}}})
    with pytest.raises(ValidationError, match=r"nccl\.inter_node\.bogus"):
        parse_profile({"gpus": {"L4": {"nccl": {"inter_node": {"bogus": 1}}}}})


def test_block_rate_interpolates_log_linearly_and_clamps() -> None:
    p = parse_profile(_doc())
    blocks = p.gpus["A100-80G"].blocks
    r1 = 3 * layer_fwd_flops(M, 1, 512) / 3e-3 / 1e12
    r4 = 3 * layer_fwd_flops(M, 4, 512) / 6e-3 / 1e12
    assert block_rate_tflops(blocks, M, Precision.BF16, 1, 512) == pytest.approx(r1)
    assert block_rate_tflops(blocks, M, Precision.BF16, 2, 512) == pytest.approx((r1 + r4) / 2)
    assert block_rate_tflops(blocks, M, Precision.BF16, 64, 512) == pytest.approx(r4)
    assert block_rate_tflops(blocks, M, Precision.FP32, 1, 512) is None
    assert math.isclose(block_rate_tflops(blocks, M, Precision.BF16, 1, 256) or 0, r1)


def test_apply_profile_folds_rates_bandwidths_and_memory() -> None:
    topo = Topology(clusters=(Cluster(name="a", gpu="A100-80G", nodes=2, gpus_per_node=8),
                              Cluster(name="b", gpu="A100-80G", nodes=2, gpus_per_node=8),
                              Cluster(name="c", gpu="H100-80G", nodes=1, gpus_per_node=8)))
    p = parse_profile(_doc())
    out = apply_profile(topo, p)
    a, b, c = out.clusters
    assert a.tflops == 250.0 and a.mfu == 0.5 and a.layer_overhead_ms == 0.1
    assert a.intra_node_gbps == 1500.0 and a.inter_node_gbps == 180.0 and b.inter_node_gbps == 50.0
    assert a.gpu_memory_gib == pytest.approx(80 - 4.0)
    assert c == topo.clusters[2]  # not in the profile
    with_blocks = apply_profile(topo, p, model=M, micro_batch=1, seq_len=512).clusters[0]
    assert with_blocks.mfu == 1.0
    assert with_blocks.effective_tflops == pytest.approx(3 * layer_fwd_flops(M, 1, 512) / 3e-3 / 1e12)


def test_estimate_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    topo = tmp_path / "topo.json"
    topo.write_text(json.dumps({"clusters": [{"name": "a", "gpu": "A100-80G", "nodes": 2, "gpus_per_node": 8}]}))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"stages": [
        {"cluster": "a", "first_layer": 0, "last_layer": 11, "tp": 2, "dp": 4},
        {"cluster": "a", "first_layer": 12, "last_layer": 23, "tp": 2, "dp": 4, "sharding": "fsdp",
         "recompute": True}], "micro_batches": 16, "schedule": "1f1b"}))
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(_doc()))
    args = ["estimate", "--topology", str(topo), "--plan", str(plan), "--model", "gpt3-1.3b", "--global-batch", "32",
            "--json"]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["step_time_s"] > 0 and set(doc["parts"]) == {"compute_s", "transfer_s", "bubble_s", "allreduce_s"}
    assert doc["stages"][1]["sharding"] == "fsdp" and doc["stages"][1]["recompute"] is True
    assert main([*args, "--profile", str(prof)]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] != doc["step_time_s"]
    assert main([*args, "--precision", "fp32"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] > doc["step_time_s"]
    plan.write_text(json.dumps({"stages": [{"cluster": "zz", "first_layer": 0, "last_layer": 23}],
                                "micro_batches": 4}))
    assert main(args) != 0
    assert "plan.stages[0].cluster" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"gpus": {"A100-80G": {"mfu": -1}}}))
    assert main([*args[:-1], "--profile", str(bad)]) != 0
    assert "profile.gpus.A100-80G.mfu" in capsys.readouterr().err
