"""Every plan the planner makes for the bundled models, on the bundled presets and generated topologies,
is one the executor runs (``spiderflow plan --dry-run``: nothing refused for tp, dp, FSDP, recomputation
or cross-cluster dp), with one launch entry per GPU. Long-sequence jobs that fit only with recomputation
and FSDP are in the sweep, and an fp32 job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spiderflow.cli.main import main
from spiderflow.core.catalog import MODEL_PRESETS
from spiderflow.core.topogen import generate_topology
from spiderflow.formats import topology_to_dict
from spiderflow.presets import PRESETS

GPUS = {"gpt-tiny": "1:8", "llama-tiny": "1:8", "gpt3-1.3b": "8", "gpt3-2.7b": "8:16", "gpt3-6.7b": "32",
        "gpt3-13b": "64", "llama3-8b": "64", "llama3-70b": "128"}
# (model, GPUs, extra arguments): activations that fit only with recomputation (and FSDP), and fp32.
EXTRA = (("gpt3-13b", "16", ("--seq-len", "8192")), ("llama3-70b", "64", ("--seq-len", "8192")),
         ("gpt3-1.3b", "8", ("--precision", "fp32")))


@pytest.fixture(scope="module")
def topologies(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    out = list(PRESETS)
    for kind, seed in (("geo", 1), ("hub", 2)):
        path = Path(tmp_path_factory.mktemp("topo")) / f"{kind}.json"
        path.write_text(json.dumps(topology_to_dict(generate_topology(12, seed, kind))))  # type: ignore[arg-type]
        out.append(str(path))
    return out


def test_every_plan_of_every_bundled_model_is_runnable(
    topologies: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert set(GPUS) == set(MODEL_PRESETS)
    planned = 0
    shardings: set[str] = set()
    recomputes: set[bool] = set()
    cases = [(m, g, ()) for m, g in GPUS.items()] + list(EXTRA)
    for topo in topologies:
        for model, gpus, extra in cases:
            code = main(["plan", "--topology", topo, "--model", model, "--gpus", gpus, *extra, "--dry-run", "--json"])
            cap = capsys.readouterr()
            assert "executor refuses" not in cap.err, f"{model} on {topo}: {cap.err}"
            if code != 0:  # unschedulable on this topology (not enough free GPUs or memory)
                assert code == 1 and cap.err, (model, topo)
                continue
            doc = json.loads(cap.out)
            assert doc["world_size"] == len(doc["ranks"]) == doc["gpus"], (model, topo)
            want = "fp32" if "fp32" in extra else "bf16"
            assert {r["precision"] for r in doc["ranks"]} == {want}
            shardings.update(s["sharding"] for s in doc["plan"]["stages"])
            recomputes.update(s["recompute"] for s in doc["plan"]["stages"])
            planned += 1
    assert planned >= len(cases) * len(topologies) // 2
    assert shardings == {"replicate", "fsdp"} and recomputes == {False, True}  # the sweep sees both options
