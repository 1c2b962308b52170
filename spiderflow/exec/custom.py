"""The user's own architecture: an entry point ``package.module:function`` measured on the meta device.

The function takes no arguments and returns ``(embedding, [blocks], head)``: the embedding maps token ids
``(b, s)`` to hidden states ``(b, s, h)``, every block maps hidden states to hidden states, the head maps
hidden states to logits ``(b, s, V)`` (DeepSpeed's ``PipelineModule`` takes layers the same way). It must be
importable on the machine that submits (to measure it) and on the workers (to build it).

:func:`measure_entry_point` builds the model under ``torch.device("meta")`` (no memory, no compute),
counts the parameters of the embedding, the mean block and the head, runs one forward of a block on meta
tensors under ``FlopCounterMode`` to count its FLOPs per token at ``seq_len``, and reads ``hidden`` and
``vocab`` from the shapes — the figures the planner prices (:class:`~spiderflow.core.catalog.MeasuredCost`).
:func:`resolve_model_value` turns a job's model value naming an entry point into the inline object
carrying those figures; the CLI and the SDK call it before submitting.
"""

from __future__ import annotations

import re
from typing import Any

from spiderflow.core.errors import ValidationError

__all__ = ["ENTRY_POINT", "measure_entry_point", "resolve_job_model", "resolve_model_value"]

ENTRY_POINT = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
"""``package.module:function``."""


def measure_entry_point(entry_point: str, *, seq_len: int = 128) -> dict[str, Any]:
    """The job-format model object of ``entry_point`` with its measured figures."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from spiderflow.exec.model import load_entry_point

    if not ENTRY_POINT.match(entry_point):
        raise ValidationError("model.entry_point", "must be 'package.module:function'", entry_point)
    with torch.device("meta"):
        embed, blocks, head = load_entry_point(entry_point)
        ids = torch.zeros((1, seq_len), dtype=torch.long)
        try:
            x = embed(ids)
            hidden = int(x.shape[-1])
            with FlopCounterMode(display=False) as counter:
                y = blocks[0](x)
            logits = head(y)
        except Exception as e:  # the user's code: report what failed, naming the field
            raise ValidationError("model.entry_point", f"a forward pass on the meta device failed: {e}",
                                  entry_point) from None
    vocab = int(logits.shape[-1])

    def count(m: torch.nn.Module) -> int:
        return sum(p.numel() for p in m.parameters())

    layer_params = round(sum(count(b) for b in blocks) / len(blocks))
    return {
        "name": entry_point.rsplit(":", 1)[1], "family": "custom", "entry_point": entry_point,
        "layers": len(blocks), "hidden": hidden, "heads": 1, "vocab": vocab,
        "measured": {"embed_params": count(embed), "layer_params": layer_params, "head_params": count(head),
                     "layer_flops_per_token": counter.get_total_flops() / seq_len, "seq_len": seq_len},
    }


def resolve_model_value(value: Any, *, seq_len: int = 128) -> Any:
    """``value`` with an entry point (a ``"pkg.mod:fn"`` string, or an object with ``entry_point`` and no
    ``measured``) replaced by its measured inline object; anything else unchanged."""
    if isinstance(value, str) and ENTRY_POINT.match(value):
        return measure_entry_point(value, seq_len=seq_len)
    if isinstance(value, dict) and value.get("entry_point") and "measured" not in value:
        out = measure_entry_point(str(value["entry_point"]), seq_len=seq_len)
        out.update({k: v for k, v in value.items() if k in ("name",)})
        return out
    return value


def resolve_job_model(job: dict[str, Any]) -> dict[str, Any]:
    """A job object whose model is resolved by :func:`resolve_model_value` (at the job's ``seq_len``)."""
    if "model" not in job:
        return job
    raw = job.get("seq_len")
    seq = raw if isinstance(raw, int) else 2048
    return {**job, "model": resolve_model_value(job["model"], seq_len=seq)}
