"""``spiderflow model``: what a model name, a Hugging Face ``config.json`` or an entry point resolves to.

``model show NAME|config.json|package.module:function [--json]`` prints the family, layers, hidden size,
heads, key/value heads, feed-forward size, vocabulary and parameter count (exact for every family but
``gpt``, whose count is the planner's ``12·h²`` per layer; measured on the meta device for an entry
point); ``model list`` lists the presets.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from spiderflow.cli.common import add_json_flag, console, print_json
from spiderflow.core.catalog import MODEL_PRESETS, ModelSpec
from spiderflow.formats import model_from_value

__all__ = ["model_summary", "register"]


def model_summary(model: ModelSpec) -> dict[str, Any]:
    """The figures ``model show`` prints."""
    out: dict[str, Any] = {
        "name": model.name, "family": model.family.value, "layers": model.layers, "hidden": model.hidden,
        "heads": model.heads, "kv_heads": model.kv_heads, "ffn_hidden": model.ffn_hidden, "vocab": model.vocab,
        "params": model.total_params, "params_per_layer": model.params_per_layer,
        "embedding_params": model.embedding_params, "head_params": model.head_params,
    }
    if model.hf_config:
        out["hf_config"] = model.hf_config
    if model.entry_point:
        out["entry_point"] = model.entry_point
        assert model.measured is not None
        out["layer_flops_per_token"] = model.measured.layer_flops_per_token
        out["measured_at_seq_len"] = model.measured.seq_len
    return out


def _resolve(name: str, seq_len: int) -> ModelSpec:
    from spiderflow.exec.custom import resolve_model_value

    return model_from_value(resolve_model_value(name, seq_len=seq_len), field="model")


def _show(args: argparse.Namespace) -> int:
    s = model_summary(_resolve(args.model, args.seq_len))
    if args.json:
        print_json(s)
        return 0
    t = Table(title=f"model {s['name']}", show_header=False)
    for key, value in s.items():
        if key == "name":
            continue
        t.add_row(key, f"{value:,}" if isinstance(value, int) else str(value))
    console.print(t)
    return 0


def _list(args: argparse.Namespace) -> int:
    rows = [model_summary(m) for m in MODEL_PRESETS.values()]
    if args.json:
        print_json(rows)
        return 0
    t = Table(title="model presets")
    for col in ("name", "family", "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "params"):
        t.add_column(col, justify="left" if col in ("name", "family") else "right")
    for r in rows:
        t.add_row(*(f"{r[c]:,}" if c == "params" else str(r[c]) for c in
                    ("name", "family", "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "params")))
    console.print(t)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("model", help="show what a model preset, config.json or entry point is")
    msub = p.add_subparsers(dest="model_command", metavar="SUBCOMMAND", required=True)
    show = msub.add_parser("show", help="family, sizes and parameter count of one model")
    show.add_argument("model", help="preset name, Hugging Face config.json, or package.module:function")
    show.add_argument("--seq-len", type=int, default=2048, help="sequence length an entry point is measured at")
    add_json_flag(show)
    show.set_defaults(func=_show)
    lst = msub.add_parser("list", help="the model presets")
    add_json_flag(lst)
    lst.set_defaults(func=_list)
