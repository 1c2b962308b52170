"""Model families, Hugging Face configs and safetensors weights.

- the Llama presets have the published parameter counts; ``model show`` of a config the test writes
  reports what the family's formula gives (and what ``transformers`` counts);
- configs and weights written by ``transformers`` (Llama, Mistral, Qwen2, GPT-2, GPT-NeoX) load into a
  2-stage split whose logits equal the unsplit ``transformers`` model's; a stage's load reads only its own
  tensors; the stages' exported files load back into ``transformers`` with the same logits;
- a tp 2 stage (DTensor Colwise/Rowwise over each block's ``tp_plan()``, two gloo processes) gives the same
  logits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from spiderflow.cli.main import main as cli
from spiderflow.core.catalog import MODEL_PRESETS, ModelFamily, ModelSpec
from spiderflow.core.errors import ValidationError
from spiderflow.exec import hf
from spiderflow.exec.model import build_full, build_stage
from spiderflow.formats import model_from_value
from spiderflow.hfconfig import load_hf_config

ROOT = Path(__file__).resolve().parents[2]

CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 5000.0,
              "rms_norm_eps": 1e-6},
    "mistral": {"model_type": "mistral", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
                "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "sliding_window": 4096},
    "qwen2": {"model_type": "qwen2", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2},
    "gpt2": {"model_type": "gpt2", "vocab_size": 97, "n_embd": 64, "n_layer": 4, "n_head": 4, "n_positions": 32},
    "gpt_neox": {"model_type": "gpt_neox", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 128,
                 "num_hidden_layers": 4, "num_attention_heads": 4, "rotary_pct": 0.25},
}


def _formula(cfg: dict[str, Any]) -> int:
    """Each family's parameter count written out from its config (the test's own arithmetic)."""
    t = cfg["model_type"]
    if t == "gpt2":
        h, f, v, p, n = cfg["n_embd"], 4 * cfg["n_embd"], cfg["vocab_size"], cfg["n_positions"], cfg["n_layer"]
        layer = (h * 3 * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
        return v * h + p * h + n * layer + 2 * h  # tied head
    h, f, v, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    if t == "gpt_neox":
        layer = (h * 3 * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
        return v * h + n * layer + 2 * h + v * h
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    bias = (h + 2 * kv) if t == "qwen2" else 0
    layer = h * h + 2 * h * kv + bias + h * h + 3 * h * f + 2 * h
    return v * h + n * layer + h + v * h


def _write_config(tmp: Path, name: str) -> Path:
    d = tmp / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(CONFIGS[name]))
    return d / "config.json"


def _cli_json(*argv: str) -> Any:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli(list(argv)) == 0
    return json.loads(buf.getvalue())


def test_llama_presets_have_the_published_parameter_counts() -> None:
    published = {"llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496}
    for name, count in published.items():
        m = MODEL_PRESETS[name]
        assert m.family is ModelFamily.LLAMA
        assert abs(m.total_params - count) / count < 0.005
        assert m.total_params == count  # exact, in fact
    tiny = MODEL_PRESETS["llama-tiny"]
    net = build_full(tiny, 0, max_seq_len=16)
    assert sum(p.numel() for p in net.parameters()) == tiny.total_params


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_model_show_of_a_hf_config_reports_its_formula(tmp_path: Path, name: str) -> None:
    path = _write_config(tmp_path, name)
    doc = _cli_json("model", "show", str(path), "--json")
    assert doc["params"] == _formula(CONFIGS[name])
    cfg = CONFIGS[name]
    assert doc["layers"] == cfg.get("num_hidden_layers", cfg.get("n_layer"))
    assert doc["kv_heads"] == cfg.get("num_key_value_heads", cfg.get("num_attention_heads", cfg.get("n_head")))
    assert doc["family"] == {"gpt2": "gpt2", "gpt_neox": "neox"}.get(name, "llama")


def test_model_show_of_a_preset_and_bad_input(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    doc = _cli_json("model", "show", "llama3-8b", "--json")
    assert (doc["params"], doc["kv_heads"], doc["ffn_hidden"], doc["vocab"]) == (8_030_261_248, 8, 14336, 128256)
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({**CONFIGS["llama"], "num_key_value_heads": 3}))
    assert cli(["model", "show", str(bad)]) == 2
    assert "model.kv_heads" in capsys.readouterr().err
    bad.write_text(json.dumps({**CONFIGS["llama"], "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}))
    assert cli(["model", "show", str(bad)]) == 2
    assert "model.rope_scaling" in capsys.readouterr().err


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family saved by ``transformers`` (config.json + model.safetensors) with perturbed weights."""
    import transformers

    classes = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "gpt2": "GPT2LMHeadModel", "gpt_neox": "GPTNeoXForCausalLM"}
    root = tmp_path_factory.mktemp("hf")
    out = {}
    torch.manual_seed(0)
    for name, cls_name in classes.items():
        cfg = transformers.AutoConfig.for_model(**CONFIGS[name])
        model = getattr(transformers, cls_name)(cfg).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


def _hf_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        out: torch.Tensor = model(ids).logits
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hf_weights_load_into_a_two_stage_split_with_the_same_logits(
    hf_models: dict[str, Path], tmp_path: Path, name: str
) -> None:
    path = hf_models[name]
    spec = model_from_value({"hf_config": str(path / "config.json"), "weights": str(path)})
    ids = torch.randint(0, spec.vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    ref = _hf_logits(path, ids)
    first, second = build_stage(spec, 0, 1, 0, max_seq_len=16), build_stage(spec, 2, 3, 0, max_seq_len=16)
    with torch.no_grad():
        logits = second(first(ids))
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
    # the trained slices go back in the same format and load in transformers
    export = tmp_path / "export"
    for st in (first, second):
        hf.export_stage_weights(st, export)
    hf.write_export_index(spec, [(0, 1), (2, 3)], export)
    torch.testing.assert_close(_hf_logits(export, ids), ref, atol=1e-5, rtol=1e-5)


def test_a_stage_reads_only_its_own_tensors(hf_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    path = hf_models["llama"]
    spec = model_from_value({"hf_config": str(path / "config.json"), "weights": str(path)})
    read: list[str] = []
    real = hf._Reader.get

    def spy(self: Any, name: str) -> torch.Tensor:
        read.append(name)
        return real(self, name)

    monkeypatch.setattr(hf._Reader, "get", spy)
    build_stage(spec, 2, 3, 0, max_seq_len=16)
    assert read and all(n.startswith(("model.layers.2.", "model.layers.3.", "model.norm.", "lm_head."))
                        for n in read), read


def test_missing_weights_are_refused_naming_the_field(tmp_path: Path) -> None:
    spec = load_hf_config(_write_config(tmp_path, "llama"))
    with pytest.raises(ValidationError, match=r"model\.weights"):
        build_stage(dataclasses.replace(spec, weights=str(tmp_path / "nothing-here")), 0, 0, 0, max_seq_len=8)
    with pytest.raises(ValidationError, match=r"model\.weights"):
        ModelSpec(name="g", layers=2, hidden=8, heads=2, vocab=8, weights="/x")  # the gpt family has no HF layout


_TP_SCRIPT = r"""
import json, os, sys, torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from spiderflow.formats import model_from_value
from spiderflow.exec.model import build_stage

path, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,))
spec = model_from_value({"hf_config": path + "/config.json", "weights": path})
stage = build_stage(spec, 0, spec.layers - 1, 0, max_seq_len=16)
styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
for i, block in stage.layers.items():
    parallelize_module(block, mesh, {k: styles[v]() for k, v in block.tp_plan().items()})
ids = torch.randint(0, spec.vocab, (2, 16), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    logits = stage(ids)
if dist.get_rank() == 0:
    torch.save(logits, out)
dist.barrier()  # neither rank tears gloo down while the other may still use a pair (an abort at exit)
dist.destroy_process_group()
from spiderflow.exec.worker import exit_now
exit_now(0)  # as a worker ends: no interpreter finalisation, where gloo's threads can abort the process
"""


@pytest.mark.parametrize("name", ["llama", "gpt_neox"])
def test_a_tp2_stage_gives_the_same_logits(hf_models: dict[str, Path], tmp_path: Path, name: str) -> None:
    path = hf_models[name]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "logits.pt"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    procs = [subprocess.Popen([sys.executable, "-c", _TP_SCRIPT, str(path), str(out)], cwd=ROOT,
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        results = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-3000:]
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(torch.load(out), _hf_logits(path, ids), atol=1e-5, rtol=1e-5)
