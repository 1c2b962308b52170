"""A GPT-style decoder in torch, built per pipeline stage from a :class:`~spiderflow.catalog.ModelSpec`.

The full model is token + learned position embedding, ``L`` pre-LN blocks (``x + attn(LN(x))``, then
``x + mlp(LN(x))``; causal multi-head self-attention; MLP ``h → 4h → h`` with GELU), a final LayerNorm, an
untied linear head and the mean token cross-entropy. No dropout, so a step is a deterministic function of
parameters and data.

A *stage* (:func:`build_stage`) holds exactly layers ``[first_layer, last_layer]``; the stage holding layer
0 also holds the embedding, the stage holding layer ``L − 1`` the final LayerNorm, the head and the loss.
Parameter names are *layer-indexed* and identical in every split::

    embed.tok.weight, embed.pos.weight                      (with layer 0)
    layers.{i}.ln1.weight … layers.{i}.mlp.fc2.bias           (layer i, its global index)
    head.ln_f.weight, head.ln_f.bias, head.out.weight         (with layer L−1)

so a full state dict is the union of the stages' state dicts and re-slicing is key selection
(:func:`merge_state_dicts`, :func:`slice_state_dict`). Initialisation is keyed the same way: every
parameter tensor is drawn from its own generator seeded from ``(seed, parameter name)``, so a stage's
parameters equal the same parameters of the full model bit for bit, whatever the split.

Contract of :class:`StageModule.forward`: the first stage takes ``int64`` token ids ``(b, s)``, any other
stage the float hidden states ``(b, s, h)`` of its predecessor; a non-last stage returns hidden states
``(b, s, h)``, the last stage returns the scalar mean cross-entropy against ``targets`` ``(b, s)``.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from spiderflow.catalog import ModelSpec
from spiderflow.errors import ValidationError

__all__ = [
    "DEFAULT_MAX_SEQ_LEN",
    "Block",
    "StageModule",
    "build_full",
    "build_stage",
    "merge_state_dicts",
    "param_layer",
    "slice_state_dict",
]

DEFAULT_MAX_SEQ_LEN = 1024
"""Rows of the position embedding unless ``max_seq_len`` is given."""

_LAYER_KEY = re.compile(r"^layers\.(\d+)\.")


def _param_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class Block(nn.Module):
    """One pre-LN transformer layer: causal self-attention and an MLP, each with a residual.

    The shared block contract (every model family's block follows it so the runtime can parallelise any
    of them): q, k and v are separate ``nn.Linear`` projections; the head count used in ``forward`` is
    computed from the projected tensor's last dimension (``q.shape[-1] // head_dim``), so the block runs
    unchanged when its projections are column-sharded over a tensor-parallel group; :meth:`tp_plan` maps
    submodule paths to ``"colwise"`` / ``"rowwise"``."""

    def __init__(self, hidden: int, heads: int, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        if hidden % heads:
            raise ValidationError("model.heads", f"must divide hidden ({hidden})", heads)
        self.heads = heads
        self.head_dim = hidden // heads
        self.ln1 = nn.LayerNorm(hidden, device=device)
        self.q = nn.Linear(hidden, hidden, device=device)
        self.k = nn.Linear(hidden, hidden, device=device)
        self.v = nn.Linear(hidden, hidden, device=device)
        self.proj = nn.Linear(hidden, hidden, device=device)
        self.ln2 = nn.LayerNorm(hidden, device=device)
        self.fc1 = nn.Linear(hidden, 4 * hidden, device=device)
        self.fc2 = nn.Linear(4 * hidden, hidden, device=device)

    def tp_plan(self) -> dict[str, str]:
        """Megatron-style tensor parallelism: q, k, v and fc1 column-sharded (whole heads per rank),
        proj and fc2 row-sharded (their outputs summed over the group); LayerNorms replicated."""
        return {"q": "colwise", "k": "colwise", "v": "colwise", "proj": "rowwise",
                "fc1": "colwise", "fc2": "rowwise"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        a = self.ln1(x)
        q, k, v = self.q(a), self.k(a), self.v(a)
        heads = q.shape[-1] // self.head_dim  # local heads when column-sharded
        q, k, v = (t.reshape(b, s, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, heads * self.head_dim))
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return out


class _Embed(nn.Module):
    def __init__(self, vocab: int, hidden: int, max_seq_len: int, *, device: torch.device | str | None) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden, device=device)
        self.pos = nn.Embedding(max_seq_len, hidden, device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        out: torch.Tensor = self.tok(ids) + self.pos(positions)[None, :, :]
        return out


class _Head(nn.Module):
    def __init__(self, vocab: int, hidden: int, *, device: torch.device | str | None) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(hidden, device=device)
        self.out = nn.Linear(hidden, vocab, bias=False, device=device)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.out(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class StageModule(nn.Module):
    """Layers ``[first_layer, last_layer]`` of the model (see the module docstring for the contract)."""

    def __init__(
        self, spec: ModelSpec, first_layer: int, last_layer: int, *, max_seq_len: int, device: str = "cpu"
    ) -> None:
        super().__init__()
        if not 0 <= first_layer <= last_layer < spec.layers:
            raise ValidationError(
                "stage.layers", f"must satisfy 0 ≤ first ≤ last < {spec.layers}", (first_layer, last_layer)
            )
        self.spec = spec
        self.first_layer = first_layer
        self.last_layer = last_layer
        self.max_seq_len = max_seq_len
        self.embed = _Embed(spec.vocab, spec.hidden, max_seq_len, device=device) if self.is_first else None
        self.layers = nn.ModuleDict(
            {str(i): Block(spec.hidden, spec.heads, device=device) for i in range(first_layer, last_layer + 1)}
        )
        self.head = _Head(spec.vocab, spec.hidden, device=device) if self.is_last else None

    @property
    def is_first(self) -> bool:
        return self.first_layer == 0

    @property
    def is_last(self) -> bool:
        return self.last_layer == self.spec.layers - 1

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(inputs) if self.embed is not None else inputs
        for i in range(self.first_layer, self.last_layer + 1):
            x = self.layers[str(i)](x)
        if self.head is None:
            return x
        if targets is None:
            raise ValueError("the last stage needs targets to compute the loss")
        loss: torch.Tensor = self.head(x, targets)
        return loss


def _init_(module: StageModule, seed: int) -> None:
    """Deterministic per-parameter initialisation (GPT-2 style): N(0, 0.02) for weights and embeddings,
    residual output projections scaled by ``1/sqrt(2L)``, zero biases, unit LayerNorm gains."""
    std = 0.02
    resid_std = std / math.sqrt(2 * module.spec.layers)
    with torch.no_grad():
        for name, p in module.named_parameters():
            leaf = name.rsplit(".", 2)
            if name.endswith(".bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("head.ln_f"):
                p.fill_(1.0)
            else:
                g = torch.Generator(device="cpu").manual_seed(_param_seed(seed, name))
                s = resid_std if leaf[-2] in ("proj", "fc2") else std
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * s)


def build_stage(
    model_spec: ModelSpec,
    first_layer: int,
    last_layer: int,
    seed: int,
    *,
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
) -> StageModule:
    """The stage holding layers ``[first_layer, last_layer]`` with parameters initialised from ``seed``.

    Parameters equal the same-named parameters of ``build_full(model_spec, seed)`` exactly. The modules'
    default initialisation runs under ``torch.random.fork_rng`` and is then overwritten, so building a
    stage leaves the global RNG untouched and does not depend on it. (Not the meta device: materialising
    from it imports sympy, seconds per process.)
    """
    with torch.random.fork_rng(devices=[]):
        module = StageModule(model_spec, first_layer, last_layer, max_seq_len=max_seq_len)
    _init_(module, seed)
    return module


def build_full(model_spec: ModelSpec, seed: int, *, max_seq_len: int = DEFAULT_MAX_SEQ_LEN) -> StageModule:
    """The whole model as one stage."""
    return build_stage(model_spec, 0, model_spec.layers - 1, seed, max_seq_len=max_seq_len)


def param_layer(name: str, n_layers: int) -> int:
    """The global layer a parameter name belongs to: ``embed.*`` → 0, ``head.*`` → ``L − 1``."""
    m = _LAYER_KEY.match(name)
    if m:
        return int(m.group(1))
    if name.startswith("embed."):
        return 0
    if name.startswith("head."):
        return n_layers - 1
    raise ValidationError("state_dict", "not a layer-indexed parameter name", name)


def _owned(name: str, first: int, last: int, n_layers: int) -> bool:
    m = _LAYER_KEY.match(name)
    if m:
        return first <= int(m.group(1)) <= last
    if name.startswith("embed."):
        return first == 0
    if name.startswith("head."):
        return last == n_layers - 1
    raise ValidationError("state_dict", "not a layer-indexed parameter name", name)


def merge_state_dicts(parts: Iterable[Mapping[str, object]]) -> dict[str, object]:
    """Union of layer-indexed dicts (state or optimizer state keyed by parameter name).

    A key present in two parts must not differ in identity of meaning; the first occurrence wins only if
    the parts come from one consistent checkpoint (callers pass the stages of one step)."""
    out: dict[str, object] = {}
    for part in parts:
        for k, v in part.items():
            out.setdefault(k, v)
    return out


def slice_state_dict(
    state: Mapping[str, object], model_spec: ModelSpec, first_layer: int, last_layer: int, *, strict: bool = True
) -> dict[str, object]:
    """The entries of a layer-indexed dict that a stage ``[first_layer, last_layer]`` owns.

    With ``strict`` every layer of the range must be present (``ValidationError`` naming the missing
    layer otherwise), as must the embedding/head when the range includes the first/last layer."""
    out = {k: v for k, v in state.items() if _owned(k, first_layer, last_layer, model_spec.layers)}
    if strict:
        have = {param_layer(k, model_spec.layers) for k in out}
        for i in range(first_layer, last_layer + 1):
            if i not in have:
                raise ValidationError("checkpoint", f"has no parameters of layer {i}", i)
        if first_layer == 0 and not any(k.startswith("embed.") for k in out):
            raise ValidationError("checkpoint", "has no embedding", first_layer)
        if last_layer == model_spec.layers - 1 and not any(k.startswith("head.") for k in out):
            raise ValidationError("checkpoint", "has no head", last_layer)
    return out
