"""Hugging Face safetensors weights in and out of a stage's layer slice.

:func:`load_stage_weights` fills a :class:`~spiderflow.exec.model.StageModule` from local safetensors
files (a file, a directory of ``*.safetensors``, or a glob) written by ``transformers``: only the tensors of
the stage's own layers are read (``safe_open`` reads a file's header, then each requested tensor alone), so
a rank never reads another stage's weights. :func:`export_stage_weights` writes a stage's slice back under
the same Hugging Face names, one ``model-{first:05d}-{last:05d}.safetensors`` per stage, and
:func:`write_export_index` (once every stage has written) adds ``model.safetensors.index.json`` and
``config.json``, so ``from_pretrained(DIR)`` loads the trained model.

Name mapping (ours → Hugging Face), ``i`` the global layer:

- ``llama`` (Llama, Mistral, Qwen2): ``layers.i.{q,k,v,o}`` ↔ ``model.layers.i.self_attn.{q,k,v,o}_proj``,
  ``w1/w3/w2`` ↔ ``mlp.gate_proj/up_proj/down_proj``, ``attn_norm/mlp_norm`` ↔
  ``input_layernorm/post_attention_layernorm``; ``embed.tok`` ↔ ``model.embed_tokens``, ``head.norm`` ↔
  ``model.norm``, ``head.out`` ↔ ``lm_head`` (the token embedding when the head is tied);
- ``gpt2``: q, k, v are the three column blocks of ``transformer.h.i.attn.c_attn`` (``Conv1D`` weights
  are stored transposed), ``o`` ↔ ``attn.c_proj``, ``fc1/fc2`` ↔ ``mlp.c_fc/c_proj``;
- ``neox``: q, k, v are interleaved per head in ``gpt_neox.layers.i.attention.query_key_value``
  (rows ``[head][q|k|v][head_dim]``), ``o`` ↔ ``attention.dense``, ``fc1/fc2`` ↔
  ``mlp.dense_h_to_4h/dense_4h_to_h``, ``head.out`` ↔ ``embed_out``.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from spiderflow.catalog import ModelFamily, ModelSpec
from spiderflow.errors import ValidationError
from spiderflow.exec.model import StageModule
from spiderflow.hfconfig import hf_config_document

__all__ = [
    "export_stage_weights",
    "hf_names",
    "load_stage_weights",
    "weight_files",
    "write_export_index",
]

INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True, slots=True)
class _Src:
    """Our tensor is ``part`` of Hugging Face tensor ``name``: ``"all"``, ``"t"`` (transposed), ``"c_attn:k"``
    (block ``k`` of a GPT-2 fused Conv1D), ``"neox:k"`` (slot ``k`` of NeoX's per-head interleaving)."""

    name: str
    part: str = "all"


def weight_files(weights: str, *, field: str = "model.weights") -> list[Path]:
    """The safetensors files ``weights`` names (a file, a directory's ``*.safetensors``, or a glob)."""
    p = Path(weights)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
    elif p.is_file():
        files = [p]
    else:
        files = sorted(Path(f) for f in glob.glob(weights))
    if not files:
        raise ValidationError(field, "names no safetensors file", weights)
    for f in files:
        if not os.access(f, os.R_OK):
            raise ValidationError(field, "is not readable", str(f))
    return files


def _layer_map(model: ModelSpec, i: int) -> dict[str, _Src]:
    fam = model.family
    if fam is ModelFamily.LLAMA:
        p = f"model.layers.{i}."
        out = {"attn_norm.weight": _Src(p + "input_layernorm.weight"),
               "mlp_norm.weight": _Src(p + "post_attention_layernorm.weight"),
               "o.weight": _Src(p + "self_attn.o_proj.weight"), "w1.weight": _Src(p + "mlp.gate_proj.weight"),
               "w3.weight": _Src(p + "mlp.up_proj.weight"), "w2.weight": _Src(p + "mlp.down_proj.weight")}
        for x in "qkv":
            out[f"{x}.weight"] = _Src(f"{p}self_attn.{x}_proj.weight")
            if model.qkv_bias:
                out[f"{x}.bias"] = _Src(f"{p}self_attn.{x}_proj.bias")
        return out
    if fam is ModelFamily.GPT2:
        p = f"transformer.h.{i}."
        out = {"ln1.weight": _Src(p + "ln_1.weight"), "ln1.bias": _Src(p + "ln_1.bias"),
               "ln2.weight": _Src(p + "ln_2.weight"), "ln2.bias": _Src(p + "ln_2.bias"),
               "o.weight": _Src(p + "attn.c_proj.weight", "t"), "o.bias": _Src(p + "attn.c_proj.bias"),
               "fc1.weight": _Src(p + "mlp.c_fc.weight", "t"), "fc1.bias": _Src(p + "mlp.c_fc.bias"),
               "fc2.weight": _Src(p + "mlp.c_proj.weight", "t"), "fc2.bias": _Src(p + "mlp.c_proj.bias")}
        for k, x in enumerate("qkv"):
            out[f"{x}.weight"] = _Src(p + "attn.c_attn.weight", f"c_attn:{k}")
            out[f"{x}.bias"] = _Src(p + "attn.c_attn.bias", f"c_attn:{k}")
        return out
    if fam is ModelFamily.NEOX:
        p = f"gpt_neox.layers.{i}."
        out = {"ln1.weight": _Src(p + "input_layernorm.weight"), "ln1.bias": _Src(p + "input_layernorm.bias"),
               "ln2.weight": _Src(p + "post_attention_layernorm.weight"),
               "ln2.bias": _Src(p + "post_attention_layernorm.bias"),
               "o.weight": _Src(p + "attention.dense.weight"), "o.bias": _Src(p + "attention.dense.bias"),
               "fc1.weight": _Src(p + "mlp.dense_h_to_4h.weight"), "fc1.bias": _Src(p + "mlp.dense_h_to_4h.bias"),
               "fc2.weight": _Src(p + "mlp.dense_4h_to_h.weight"), "fc2.bias": _Src(p + "mlp.dense_4h_to_h.bias")}
        for k, x in enumerate("qkv"):
            out[f"{x}.weight"] = _Src(p + "attention.query_key_value.weight", f"neox:{k}")
            out[f"{x}.bias"] = _Src(p + "attention.query_key_value.bias", f"neox:{k}")
        return out
    raise ValidationError("model.family", "has no Hugging Face weight layout", fam.value)


def _edge_map(model: ModelSpec) -> dict[str, _Src]:
    fam = model.family
    if fam is ModelFamily.LLAMA:
        return {"embed.tok.weight": _Src("model.embed_tokens.weight"), "head.norm.weight": _Src("model.norm.weight"),
                "head.out.weight": _Src("lm_head.weight")}
    if fam is ModelFamily.GPT2:
        return {"embed.tok.weight": _Src("transformer.wte.weight"), "embed.pos.weight": _Src("transformer.wpe.weight"),
                "head.ln_f.weight": _Src("transformer.ln_f.weight"), "head.ln_f.bias": _Src("transformer.ln_f.bias"),
                "head.out.weight": _Src("lm_head.weight")}
    if fam is ModelFamily.NEOX:
        return {"embed.tok.weight": _Src("gpt_neox.embed_in.weight"),
                "head.ln_f.weight": _Src("gpt_neox.final_layer_norm.weight"),
                "head.ln_f.bias": _Src("gpt_neox.final_layer_norm.bias"), "head.out.weight": _Src("embed_out.weight")}
    raise ValidationError("model.family", "has no Hugging Face weight layout", fam.value)


def _tied_source(model: ModelSpec) -> str:
    return {ModelFamily.LLAMA: "model.embed_tokens.weight", ModelFamily.GPT2: "transformer.wte.weight",
            ModelFamily.NEOX: "gpt_neox.embed_in.weight"}[model.family]


def _stage_map(module: StageModule) -> dict[str, _Src]:
    spec = module.spec
    out: dict[str, _Src] = {}
    edges = _edge_map(spec)
    for name in module.state_dict():
        if name.startswith("layers."):
            _, i, leaf = name.split(".", 2)
            out[name] = _layer_map(spec, int(i))[leaf]
        else:
            out[name] = edges[name]
    return out


def hf_names(model: ModelSpec, first: int, last: int) -> list[str]:
    """The Hugging Face tensor names a stage ``[first, last]`` writes (sorted, each once)."""
    names: set[str] = set()
    for i in range(first, last + 1):
        names.update(s.name for s in _layer_map(model, i).values())
    edges = _edge_map(model)
    for k, src in edges.items():
        if (k.startswith("embed.") and first == 0) or (k.startswith("head.") and last == model.layers - 1):
            names.add(src.name)
    return sorted(names)


class _Reader:
    """Reads single tensors from a set of safetensors files, opening each file once (lazily)."""

    def __init__(self, files: list[Path]) -> None:
        self.where: dict[str, Path] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                for key in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                    self.where.setdefault(self._norm(key), f)
        self._cache: dict[str, torch.Tensor] = {}

    @staticmethod
    def _norm(key: str) -> str:
        # Original GPT-2 files name tensors without the ``transformer.`` prefix.
        if key.startswith(("h.", "wte.", "wpe.", "ln_f.")):
            return "transformer." + key
        return key

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._cache:
            f = self.where[name]
            with safe_open(str(f), framework="pt") as fh:
                keys = {self._norm(k): k for k in fh.keys()}  # noqa: SIM118
                self._cache[name] = fh.get_tensor(keys[name])
        return self._cache[name]


def _take(t: torch.Tensor, part: str, model: ModelSpec) -> torch.Tensor:
    if part == "all":
        return t
    if part == "t":
        return t.t()
    kind, k = part.split(":")
    idx = int(k)
    h, d = model.hidden, model.head_dim
    if kind == "c_attn":
        return t[:, idx * h:(idx + 1) * h].t() if t.dim() == 2 else t[idx * h:(idx + 1) * h]
    # neox: rows [head][q|k|v][head_dim]
    if t.dim() == 2:
        return t.view(model.heads, 3, d, h)[:, idx].reshape(h, h)
    return t.view(model.heads, 3, d)[:, idx].reshape(h)


def load_stage_weights(module: StageModule, weights: str, *, field: str = "model.weights") -> int:
    """Copy the stage's tensors from ``weights`` into ``module``; returns how many tensors were set.
    :class:`ValidationError` naming ``field`` for a missing tensor or a shape mismatch."""
    spec = module.spec
    reader = _Reader(weight_files(weights, field=field))
    params = module.state_dict()
    n = 0
    with torch.no_grad():
        for ours, src in _stage_map(module).items():
            name = src.name
            if name not in reader and ours == "head.out.weight" and spec.tie_embeddings:
                name = _tied_source(spec)
            if name not in reader:
                raise ValidationError(field, f"has no tensor {name} (for {ours})", weights)
            t = _take(reader.get(name), src.part, spec)
            if tuple(t.shape) != tuple(params[ours].shape):
                raise ValidationError(field, f"{name} has shape {tuple(t.shape)}, the model needs "
                                      f"{tuple(params[ours].shape)} for {ours}", weights)
            params[ours].copy_(t.to(params[ours].dtype))
            n += 1
    return n


def _hf_tensors(module: StageModule) -> Iterator[tuple[str, torch.Tensor]]:
    spec = module.spec
    state = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    fused: dict[str, dict[int, torch.Tensor]] = {}
    for ours, src in _stage_map(module).items():
        t = state[ours]
        if src.part == "all":
            yield src.name, t
        elif src.part == "t":
            yield src.name, t.t()
        else:
            fused.setdefault(src.name, {})[int(src.part.split(":")[1])] = t
    h, d = spec.hidden, spec.head_dim
    for name, parts in fused.items():
        qkv = [parts[k] for k in range(3)]
        if spec.family is ModelFamily.GPT2:
            yield name, (torch.cat([p.t() for p in qkv], dim=1) if qkv[0].dim() == 2 else torch.cat(qkv))
        elif qkv[0].dim() == 2:
            yield name, torch.stack([p.view(spec.heads, d, h) for p in qkv], dim=1).reshape(3 * h, h)
        else:
            yield name, torch.stack([p.view(spec.heads, d) for p in qkv], dim=1).reshape(3 * h)


def export_file_name(first: int, last: int) -> str:
    return f"model-{first:05d}-{last:05d}.safetensors"


def export_stage_weights(module: StageModule, directory: str | Path) -> Path:
    """Write the stage's tensors under their Hugging Face names (written to a temporary name, then
    renamed)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    out = d / export_file_name(module.first_layer, module.last_layer)
    tmp = out.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in _hf_tensors(module)}, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out)
    return out


def write_export_index(model: ModelSpec, ranges: list[tuple[int, int]], directory: str | Path) -> None:
    """``model.safetensors.index.json`` (every tensor → its stage's file) and ``config.json``."""
    d = Path(directory)
    weight_map = {name: export_file_name(first, last) for first, last in ranges
                  for name in hf_names(model, first, last)}
    (d / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    (d / "config.json").write_text(json.dumps(hf_config_document(model), indent=1))
