"""Hugging Face tensor names of each of our layer-indexed parameters (torch-free; see
:mod:`spiderflow.exec.hf` for the mapping table and the loaders)."""

from __future__ import annotations

from dataclasses import dataclass

from spiderflow.core.catalog import ModelFamily, ModelSpec
from spiderflow.core.errors import ValidationError

__all__ = ["Src", "edge_map", "hf_names", "layer_map", "tied_source"]


@dataclass(frozen=True, slots=True)
class Src:
    """Our tensor is ``part`` of Hugging Face tensor ``name``: ``"all"``, ``"t"`` (transposed), ``"c_attn:k"``
    (block ``k`` of a GPT-2 fused Conv1D), ``"neox:k"`` (slot ``k`` of NeoX's per-head interleaving)."""

    name: str
    part: str = "all"


def layer_map(model: ModelSpec, i: int) -> dict[str, Src]:
    fam = model.family
    if fam is ModelFamily.LLAMA:
        p = f"model.layers.{i}."
        out = {"attn_norm.weight": Src(p + "input_layernorm.weight"),
               "mlp_norm.weight": Src(p + "post_attention_layernorm.weight"),
               "o.weight": Src(p + "self_attn.o_proj.weight"), "w1.weight": Src(p + "mlp.gate_proj.weight"),
               "w3.weight": Src(p + "mlp.up_proj.weight"), "w2.weight": Src(p + "mlp.down_proj.weight")}
        for x in "qkv":
            out[f"{x}.weight"] = Src(f"{p}self_attn.{x}_proj.weight")
            if model.qkv_bias:
                out[f"{x}.bias"] = Src(f"{p}self_attn.{x}_proj.bias")
        return out
    if fam is ModelFamily.GPT2:
        p = f"transformer.h.{i}."
        out = {"ln1.weight": Src(p + "ln_1.weight"), "ln1.bias": Src(p + "ln_1.bias"),
               "ln2.weight": Src(p + "ln_2.weight"), "ln2.bias": Src(p + "ln_2.bias"),
               "o.weight": Src(p + "attn.c_proj.weight", "t"), "o.bias": Src(p + "attn.c_proj.bias"),
               "fc1.weight": Src(p + "mlp.c_fc.weight", "t"), "fc1.bias": Src(p + "mlp.c_fc.bias"),
               "fc2.weight": Src(p + "mlp.c_proj.weight", "t"), "fc2.bias": Src(p + "mlp.c_proj.bias")}
        for k, x in enumerate("qkv"):
            out[f"{x}.weight"] = Src(p + "attn.c_attn.weight", f"c_attn:{k}")
            out[f"{x}.bias"] = Src(p + "attn.c_attn.bias", f"c_attn:{k}")
        return out
    if fam is ModelFamily.NEOX:
        p = f"gpt_neox.layers.{i}."
        out = {"ln1.weight": Src(p + "input_layernorm.weight"), "ln1.bias": Src(p + "input_layernorm.bias"),
               "ln2.weight": Src(p + "post_attention_layernorm.weight"),
               "ln2.bias": Src(p + "post_attention_layernorm.bias"),
               "o.weight": Src(p + "attention.dense.weight"), "o.bias": Src(p + "attention.dense.bias"),
               "fc1.weight": Src(p + "mlp.dense_h_to_4h.weight"), "fc1.bias": Src(p + "mlp.dense_h_to_4h.bias"),
               "fc2.weight": Src(p + "mlp.dense_4h_to_h.weight"), "fc2.bias": Src(p + "mlp.dense_4h_to_h.bias")}
        for k, x in enumerate("qkv"):
            out[f"{x}.weight"] = Src(p + "attention.query_key_value.weight", f"neox:{k}")
            out[f"{x}.bias"] = Src(p + "attention.query_key_value.bias", f"neox:{k}")
        return out
    raise ValidationError("model.family", "has no Hugging Face weight layout", fam.value)


def edge_map(model: ModelSpec) -> dict[str, Src]:
    fam = model.family
    if fam is ModelFamily.LLAMA:
        return {"embed.tok.weight": Src("model.embed_tokens.weight"), "head.norm.weight": Src("model.norm.weight"),
                "head.out.weight": Src("lm_head.weight")}
    if fam is ModelFamily.GPT2:
        return {"embed.tok.weight": Src("transformer.wte.weight"), "embed.pos.weight": Src("transformer.wpe.weight"),
                "head.ln_f.weight": Src("transformer.ln_f.weight"), "head.ln_f.bias": Src("transformer.ln_f.bias"),
                "head.out.weight": Src("lm_head.weight")}
    if fam is ModelFamily.NEOX:
        return {"embed.tok.weight": Src("gpt_neox.embed_in.weight"),
                "head.ln_f.weight": Src("gpt_neox.final_layer_norm.weight"),
                "head.ln_f.bias": Src("gpt_neox.final_layer_norm.bias"), "head.out.weight": Src("embed_out.weight")}
    raise ValidationError("model.family", "has no Hugging Face weight layout", fam.value)


def tied_source(model: ModelSpec) -> str:
    return {ModelFamily.LLAMA: "model.embed_tokens.weight", ModelFamily.GPT2: "transformer.wte.weight",
            ModelFamily.NEOX: "gpt_neox.embed_in.weight"}[model.family]


def hf_names(model: ModelSpec, first: int, last: int) -> list[str]:
    """The Hugging Face tensor names a stage ``[first, last]`` writes (sorted, each once)."""
    names: set[str] = set()
    for i in range(first, last + 1):
        names.update(s.name for s in layer_map(model, i).values())
    edges = edge_map(model)
    for k, src in edges.items():
        if (k.startswith("embed.") and first == 0) or (k.startswith("head.") and last == model.layers - 1):
            names.add(src.name)
    return sorted(names)
