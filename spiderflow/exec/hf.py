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

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from spiderflow.core.catalog import ModelFamily, ModelSpec
from spiderflow.core.errors import ValidationError
from spiderflow.exec.hfnames import Src, edge_map, hf_names, layer_map, tied_source
from spiderflow.exec.model import StageModule
from spiderflow.exec.preflight import weight_files
from spiderflow.hfconfig import hf_config_document

__all__ = [
    "export_stage_weights",
    "load_stage_weights",
    "write_export_index",
]

INDEX_NAME = "model.safetensors.index.json"


def _stage_map(module: StageModule) -> dict[str, Src]:
    spec = module.spec
    out: dict[str, Src] = {}
    edges = edge_map(spec)
    for name in module.state_dict():
        if name.startswith("layers."):
            _, i, leaf = name.split(".", 2)
            out[name] = layer_map(spec, int(i))[leaf]
        else:
            out[name] = edges[name]
    return out


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
                name = tied_source(spec)
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
