"""Hugging Face ``config.json`` files as :class:`~spiderflow.core.catalog.ModelSpec` values (pure: no torch).

Families read (``model_type``): ``llama``, ``mistral``, ``qwen2`` (→ ``llama``; Qwen2 with q/k/v biases),
``gpt2`` (→ ``gpt2``) and ``gpt_neox`` (→ ``neox``). Both the older flat keys (``rope_theta``,
``rotary_pct``, ``rotary_emb_base``) and the ``rope_parameters`` object of recent ``transformers`` are
understood. A setting the executor does not implement (RoPE scaling, MLP biases, a head dimension other
than ``hidden / heads``, an activation other than the family's) is refused with the key named rather than
silently changing the model: a model that loads must give the logits the original gives.

:func:`hf_config_document` writes the config back (the ``config.json`` saved with trained weights).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from spiderflow.core.catalog import ModelFamily, ModelSpec
from spiderflow.core.errors import ValidationError

__all__ = ["HF_MODEL_TYPES", "hf_config_document", "load_hf_config", "model_from_hf_config"]

HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "gpt2", "gpt_neox")
"""``model_type`` values :func:`model_from_hf_config` reads."""

_ACTS = {"llama": ("silu",), "gpt2": ("gelu_new", "gelu_pytorch_tanh"), "neox": ("gelu",)}


def _req(raw: dict[str, Any], key: str, field: str) -> int:
    v = raw.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValidationError(f"{field}.{key}", "must be a positive integer", v)
    return v


def _rope(raw: dict[str, Any], field: str, *, theta_keys: tuple[str, ...], default_theta: float) -> dict[str, Any]:
    params = raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ValidationError(f"{field}.rope_parameters", "must be an object", params)
    scaling = raw.get("rope_scaling")
    kind = params.get("rope_type", "default")
    if (scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default")) or kind != "default":
        raise ValidationError(f"{field}.rope_scaling", "RoPE scaling is not supported", scaling or kind)
    theta = params.get("rope_theta")
    for key in theta_keys:
        if theta is None and raw.get(key) is not None:
            theta = raw[key]
    return {"rope_theta": float(theta if theta is not None else default_theta),
            "rotary_pct": float(params.get("partial_rotary_factor", raw.get("rotary_pct",
                                                                            raw.get("partial_rotary_factor", 1.0))))}


def model_from_hf_config(raw: Any, *, path: str = "", field: str = "model.hf_config", name: str = "") -> ModelSpec:
    """The :class:`ModelSpec` of a parsed ``config.json``; errors name ``{field}.<key>``."""
    if not isinstance(raw, dict):
        raise ValidationError(field, "must be a JSON object", type(raw).__name__)
    mtype = raw.get("model_type")
    if mtype not in HF_MODEL_TYPES:
        raise ValidationError(f"{field}.model_type", f"must be one of {list(HF_MODEL_TYPES)}", mtype)
    label = name or str(raw.get("_name_or_path") or "") or (Path(path).parent.name if path else "") or mtype
    common: dict[str, Any] = {"name": label, "hf_config": path}
    if mtype in ("llama", "mistral", "qwen2"):
        h, heads = _req(raw, "hidden_size", field), _req(raw, "num_attention_heads", field)
        if raw.get("head_dim") not in (None, h // heads):
            raise ValidationError(f"{field}.head_dim", f"must be hidden_size / num_attention_heads = {h // heads}",
                                  raw.get("head_dim"))
        if raw.get("mlp_bias"):
            raise ValidationError(f"{field}.mlp_bias", "MLP biases are not supported", True)
        if raw.get("hidden_act", "silu") not in _ACTS["llama"]:
            raise ValidationError(f"{field}.hidden_act", "must be silu", raw.get("hidden_act"))
        if mtype == "qwen2" and raw.get("use_sliding_window"):
            raise ValidationError(f"{field}.use_sliding_window", "sliding-window attention is not supported", True)
        rope = _rope(raw, field, theta_keys=("rope_theta",), default_theta=10000.0)
        spec = ModelSpec(
            family=ModelFamily.LLAMA, layers=_req(raw, "num_hidden_layers", field), hidden=h, heads=heads,
            kv_heads=raw.get("num_key_value_heads") or heads, ffn_hidden=_req(raw, "intermediate_size", field),
            vocab=_req(raw, "vocab_size", field), norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            qkv_bias=mtype == "qwen2" or bool(raw.get("attention_bias", False)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)), rope_theta=rope["rope_theta"], **common,
        )
    elif mtype == "gpt2":
        if raw.get("activation_function", "gelu_new") not in _ACTS["gpt2"]:
            raise ValidationError(f"{field}.activation_function", "must be gelu_new", raw.get("activation_function"))
        if raw.get("scale_attn_by_inverse_layer_idx") or raw.get("scale_attn_weights") is False:
            raise ValidationError(f"{field}.scale_attn_weights", "only 1/sqrt(head_dim) scaling is supported",
                                  raw.get("scale_attn_weights"))
        h = _req(raw, "n_embd", field)
        spec = ModelSpec(
            family=ModelFamily.GPT2, layers=_req(raw, "n_layer", field), hidden=h, heads=_req(raw, "n_head", field),
            ffn_hidden=raw.get("n_inner") or 4 * h, vocab=_req(raw, "vocab_size", field),
            max_positions=_req(raw, "n_positions", field), norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", True)), **common,
        )
    else:
        if raw.get("hidden_act", "gelu") not in _ACTS["neox"]:
            raise ValidationError(f"{field}.hidden_act", "must be gelu", raw.get("hidden_act"))
        if raw.get("attention_bias") is False:
            raise ValidationError(f"{field}.attention_bias", "must be true (NeoX attention has biases)", False)
        rope = _rope(raw, field, theta_keys=("rope_theta", "rotary_emb_base"), default_theta=10000.0)
        spec = ModelSpec(
            family=ModelFamily.NEOX, layers=_req(raw, "num_hidden_layers", field),
            hidden=_req(raw, "hidden_size", field), heads=_req(raw, "num_attention_heads", field),
            ffn_hidden=_req(raw, "intermediate_size", field), vocab=_req(raw, "vocab_size", field),
            norm_eps=float(raw.get("layer_norm_eps", 1e-5)), rope_theta=rope["rope_theta"],
            rotary_pct=rope["rotary_pct"], parallel_residual=bool(raw.get("use_parallel_residual", True)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)), **common,
        )
    return spec


def load_hf_config(path: str | Path, *, field: str = "model.hf_config", name: str = "") -> ModelSpec:
    """Read and parse a ``config.json`` (a directory means its ``config.json``)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValidationError(field, "no such file", str(p)) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValidationError(field, f"cannot read: {e}", str(p)) from None
    return model_from_hf_config(raw, path=str(p.resolve()), field=field, name=name)


def hf_config_document(model: ModelSpec) -> dict[str, Any]:
    """A ``config.json`` object for ``model`` (``llama``, ``gpt2`` or ``neox``). Pipelines train a tied head
    as an untied copy, so the saved config says ``tie_word_embeddings: false`` and the weights hold both."""
    fam = model.family
    if fam is ModelFamily.LLAMA:
        return {"model_type": "qwen2" if model.qkv_bias else "llama",
                "architectures": ["Qwen2ForCausalLM" if model.qkv_bias else "LlamaForCausalLM"],
                "hidden_size": model.hidden, "num_hidden_layers": model.layers,
                "num_attention_heads": model.heads, "num_key_value_heads": model.kv_heads,
                "intermediate_size": model.ffn, "vocab_size": model.vocab, "rms_norm_eps": model.norm_eps,
                "rope_theta": model.rope_theta, "hidden_act": "silu", "tie_word_embeddings": False,
                "head_dim": model.head_dim, "torch_dtype": "float32"}
    if fam is ModelFamily.GPT2:
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": model.hidden,
                "n_layer": model.layers, "n_head": model.heads, "n_inner": model.ffn, "vocab_size": model.vocab,
                "n_positions": model.max_positions, "layer_norm_epsilon": model.norm_eps,
                "activation_function": "gelu_new", "tie_word_embeddings": False, "torch_dtype": "float32"}
    if fam is ModelFamily.NEOX:
        return {"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], "hidden_size": model.hidden,
                "num_hidden_layers": model.layers, "num_attention_heads": model.heads,
                "intermediate_size": model.ffn, "vocab_size": model.vocab, "layer_norm_eps": model.norm_eps,
                "rotary_pct": model.rotary_pct, "rope_theta": model.rope_theta, "hidden_act": "gelu",
                "use_parallel_residual": model.parallel_residual, "tie_word_embeddings": False,
                "attention_bias": True, "torch_dtype": "float32"}
    raise ValidationError("model.family", "has no Hugging Face config form", fam.value)
