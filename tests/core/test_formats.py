"""The file formats: valid files load; each kind of invalid value is named by field and value."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from spiderflow.core.errors import ValidationError
from spiderflow.formats import (
    job_from_dict,
    job_to_dict,
    load_topology,
    load_trace,
    topology_from_dict,
    topology_to_dict,
    trace_from_dict,
)

ROOT = Path(__file__).resolve().parents[2]


def _topo(**over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "clusters": [
            {"name": "virginia", "gpu": "A100-80G", "nodes": 2, "gpus_per_node": 8},
            {"name": "ohio", "gpu": "V100-32G", "nodes": 1, "gpus_per_node": 8, "free_gpus": 4},
        ],
        "links": [{"a": "virginia", "b": "ohio", "bandwidth_gbps": 1.12, "latency_ms": 11}],
    }
    doc.update(over)
    return doc


def _job(**over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "id": "j1", "model": "gpt3-6.7b", "global_batch": 512, "micro_batch": 1, "seq_len": 2048,
        "steps": 1000, "gpus": {"min": 8, "max": 64}, "arrival_s": 0, "priority": 0, "tenant": "a",
    }
    doc.update(over)
    return doc


def test_examples_load() -> None:
    topo = load_topology(ROOT / "examples/topology-3.yaml")
    assert topo.names == ("virginia", "ohio", "oregon")
    assert topo.cluster("ohio").free == 16  # defaults to all GPUs
    jobs = load_trace(ROOT / "examples/trace-3.json")
    assert [j.id for j in jobs] == ["j1", "j2", "j3"]
    assert jobs[2].model.layers == 12


def test_roundtrip() -> None:
    topo = topology_from_dict(_topo())
    assert topology_from_dict(json.loads(json.dumps(topology_to_dict(topo)))) == topo
    job = job_from_dict(_job())
    assert job_from_dict(job_to_dict(job)) == job


@pytest.mark.parametrize(
    ("doc", "field", "value"),
    [
        (_topo(links=[{"a": "virginia", "b": "tokyo", "bandwidth_gbps": 1, "latency_ms": 1}]), "links[0].b", "tokyo"),
        (_topo(links=[{"a": "virginia", "b": "ohio", "bandwidth_gbps": -1, "latency_ms": 1}]),
         "links[0].bandwidth_gbps", -1.0),
        (_topo(clusters=[{"name": "x", "gpu": "B200", "nodes": 1, "gpus_per_node": 8}], links=[]),
         "clusters[0].gpu", "B200"),
        (_topo(clusters=[{"name": "x", "gpu": "T4", "nodes": 1, "gpus_per_node": 8, "free_gpus": 9}], links=[]),
         "clusters[0].free_gpus", 9),
        (_topo(clusters=[{"name": "x", "gpu": "T4", "nodes": 0, "gpus_per_node": 8}], links=[]),
         "clusters[0].nodes", 0),
        (_topo(clusters=[{"name": "x", "gpu": "T4", "nodes": 1, "gpus_per_node": 8, "colour": "red"}], links=[]),
         "clusters[0].colour", "red"),
        (_topo(clusters=[]), "clusters", []),
        (_topo(clusters=[{"name": "x", "gpu": "cpu", "nodes": 1, "gpus_per_node": 1, "layer_overhead_ms": -1}],
               links=[]), "clusters[0].layer_overhead_ms", -1.0),
        (_topo(clusters=[{"name": "x", "gpu": "cpu", "nodes": 1, "gpus_per_node": 1, "optimizer_ms_per_layer": -2}],
               links=[]), "clusters[0].optimizer_ms_per_layer", -2.0),
    ],
)
def test_topology_rejections_name_field_and_value(doc: dict[str, Any], field: str, value: object) -> None:
    with pytest.raises(ValidationError) as e:
        topology_from_dict(doc)
    assert e.value.field == field
    assert e.value.value == value
    assert field in str(e.value)


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"model": "gpt5"}, "jobs[0].model"),
        ({"steps": 0}, "jobs[0].steps"),
        ({"gpus": {"min": 9, "max": 8}}, "jobs[0].gpus.min"),
        ({"arrival_s": -1}, "jobs[0].arrival_s"),
        ({"global_batch": "big"}, "jobs[0].global_batch"),
        ({"global_batch": 10, "micro_batch": 3}, "jobs[0].global_batch"),
        ({"model": {"layers": 2, "hidden": 10, "heads": 3, "vocab": 5}}, "jobs[0].model.heads"),
        ({"gpus": {"min": 1}}, "jobs[0].gpus.max"),
        ({"nodes": 3}, "jobs[0].nodes"),
    ],
)
def test_trace_rejections_name_the_field(over: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as e:
        trace_from_dict({"jobs": [_job(**over)]})
    assert e.value.field == field


def test_duplicate_job_ids_rejected() -> None:
    with pytest.raises(ValidationError, match=r"jobs\[1\]\.id"):
        trace_from_dict({"jobs": [_job(), _job()]})


def test_bad_yaml_is_one_line(tmp_path: Path) -> None:
    p = tmp_path / "t.yaml"
    p.write_text("clusters: [\n")
    with pytest.raises(ValidationError) as e:
        load_topology(p)
    assert e.value.field == "file"
    assert "\n" not in str(e.value)


def test_layer_overhead_roundtrips_and_defaults_to_zero() -> None:
    doc = _topo(clusters=[{"name": "x", "gpu": "cpu", "nodes": 1, "gpus_per_node": 1, "tflops": 0.05, "mfu": 0.8,
                           "layer_overhead_ms": 0.75, "optimizer_ms_per_layer": 0.25},
                          {"name": "y", "gpu": "cpu", "nodes": 1, "gpus_per_node": 1}],
                links=[])
    topo = topology_from_dict(doc)
    assert topo.cluster("x").layer_overhead_ms == 0.75 and topo.cluster("y").layer_overhead_ms == 0.0
    assert topo.cluster("x").optimizer_ms_per_layer == 0.25 and topo.cluster("y").optimizer_ms_per_layer == 0.0
    out = topology_to_dict(topo)
    assert out["clusters"][0]["layer_overhead_ms"] == 0.75 and out["clusters"][0]["optimizer_ms_per_layer"] == 0.25
    # files without them keep reading (and writing) as before
    assert "layer_overhead_ms" not in out["clusters"][1] and "optimizer_ms_per_layer" not in out["clusters"][1]
    assert topology_from_dict(json.loads(json.dumps(out))) == topo


def test_layer_overhead_crosses_the_proto() -> None:
    from spiderflow.rpc.convert import cluster_from_proto, cluster_to_proto

    topo = topology_from_dict(_topo(clusters=[
        {"name": "x", "gpu": "cpu", "nodes": 1, "gpus_per_node": 1, "layer_overhead_ms": 0.5,
         "optimizer_ms_per_layer": 0.2},
        {"name": "y", "gpu": "cpu", "nodes": 1, "gpus_per_node": 1}], links=[]))
    for c in topo.clusters:
        msg = cluster_to_proto(c)
        assert msg.HasField("layer_overhead_ms") == (c.layer_overhead_ms > 0)
        assert msg.HasField("optimizer_ms_per_layer") == (c.optimizer_ms_per_layer > 0)
        assert cluster_from_proto(msg) == c


def test_the_core_codec_reads_no_file_and_the_adapter_reads_the_hf_config(tmp_path: Path) -> None:
    from spiderflow.core import codec

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
                               "num_attention_heads": 4, "vocab_size": 128, "intermediate_size": 256}))
    raw = {"id": "j", "model": str(cfg), "global_batch": 8, "gpus": {"min": 1, "max": 2}}
    with pytest.raises(ValidationError) as e:
        codec.job_from_dict(raw, where="jobs[0]")
    assert e.value.field == "jobs[0].model" and e.value.value == str(cfg)
    with pytest.raises(ValidationError) as e:
        codec.model_from_value({"hf_config": str(cfg)})
    assert e.value.field == "model.hf_config"
    job = job_from_dict(raw)  # the adapter passes a reader of the file
    assert job.model.layers == 2 and job.model.hidden == 64
    assert codec.job_from_dict(job_to_dict(job)) == job  # what is written back needs no file
