"""A GPT-style decoder in torch, built per pipeline stage from a :class:`~spiderflow.core.catalog.ModelSpec`.

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

Families (:class:`~spiderflow.core.catalog.ModelFamily`) other than ``gpt`` use the same layer-indexed scheme
with their own leaf names: ``llama`` blocks hold ``attn_norm, q, k, v, o, mlp_norm, w1, w2, w3`` (RMSNorm,
rotary positions, grouped-query attention, SwiGLU ``w2(silu(w1 x) · w3 x)``), the head ``head.norm`` and
``head.out``; ``gpt2`` and ``neox`` blocks hold ``ln1, q, k, v, o, ln2, fc1, fc2``; a ``custom`` model's
embedding, blocks and head are the user's modules under ``embed.``, ``layers.{i}.`` and ``head.``. Every
block keeps q, k and v as separate linear layers, derives its local head counts from the projected
width (so the same forward runs when q/k/v are column-sharded over tensor-parallel ranks) and names its
tensor-parallel layout in ``tp_plan()``.

Contract of :class:`StageModule.forward`: the first stage takes ``int64`` token ids ``(b, s)``, any other
stage the float hidden states ``(b, s, h)`` of its predecessor; a non-last stage returns hidden states
``(b, s, h)``, the last stage returns the scalar mean cross-entropy against ``targets`` ``(b, s)`` (the
logits ``(b, s, V)`` when ``targets`` is ``None``).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from spiderflow.core.catalog import ModelFamily, ModelSpec
from spiderflow.core.errors import ValidationError

__all__ = [
    "DEFAULT_MAX_SEQ_LEN",
    "Block",
    "GPT2Block",
    "LlamaBlock",
    "NeoXBlock",
    "StageModule",
    "build_full",
    "build_stage",
    "load_entry_point",
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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _rope(q: torch.Tensor, k: torch.Tensor, rot_dims: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary positions on the first ``rot_dims`` dimensions of each head of ``q``, ``k`` ``(b, n, s, d)``
    (the half-rotation layout Hugging Face checkpoints use)."""
    s = q.shape[2]
    inv = 1.0 / (theta ** (torch.arange(0, rot_dims, 2, dtype=torch.float32, device=q.device) / rot_dims))
    freqs = torch.outer(torch.arange(s, dtype=torch.float32, device=q.device), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)

    def apply(t: torch.Tensor) -> torch.Tensor:
        r, rest = t[..., :rot_dims], t[..., rot_dims:]
        return torch.cat((r * cos + _rotate_half(r) * sin, rest), dim=-1)

    return apply(q), apply(k)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int, *, rot_dims: int = 0, theta: float = 1e4
) -> torch.Tensor:
    """Causal attention of projected ``q`` ``(b, s, n·d)`` and ``k``, ``v`` ``(b, s, n_kv·d)``; head counts
    come from the widths, so column-sharded projections give the rank's local heads. Returns
    ``(b, s, n·d)``."""
    b, s, _ = q.shape
    qh = q.reshape(b, s, -1, head_dim).transpose(1, 2)
    kh = k.reshape(b, s, -1, head_dim).transpose(1, 2)
    vh = v.reshape(b, s, -1, head_dim).transpose(1, 2)
    if rot_dims:
        qh, kh = _rope(qh, kh, rot_dims, theta)
    gqa = qh.shape[1] != kh.shape[1]
    att = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=gqa)
    return att.transpose(1, 2).reshape(b, s, -1)


class LlamaBlock(nn.Module):
    """A Llama layer: ``x + o(attn(RMSNorm(x)))`` with rotary grouped-query attention, then
    ``x + w2(silu(w1 y) · w3 y)`` with ``y = RMSNorm(x)``. ``qkv_bias`` adds biases to q, k, v (Qwen2)."""

    def __init__(self, spec: ModelSpec, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        h, kv, f = spec.hidden, spec.kv_dim, spec.ffn
        self.head_dim = spec.head_dim
        self.theta = spec.rope_theta
        self.attn_norm = nn.RMSNorm(h, eps=spec.norm_eps, device=device)
        self.q = nn.Linear(h, h, bias=spec.qkv_bias, device=device)
        self.k = nn.Linear(h, kv, bias=spec.qkv_bias, device=device)
        self.v = nn.Linear(h, kv, bias=spec.qkv_bias, device=device)
        self.o = nn.Linear(h, h, bias=False, device=device)
        self.mlp_norm = nn.RMSNorm(h, eps=spec.norm_eps, device=device)
        self.w1 = nn.Linear(h, f, bias=False, device=device)
        self.w3 = nn.Linear(h, f, bias=False, device=device)
        self.w2 = nn.Linear(f, h, bias=False, device=device)

    @staticmethod
    def tp_plan() -> dict[str, str]:
        """Tensor-parallel layout: q, k, v, w1, w3 column-sharded; o, w2 row-sharded."""
        return {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise",
                "w1": "colwise", "w3": "colwise", "w2": "rowwise"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.attn_norm(x)
        att = _attend(self.q(y), self.k(y), self.v(y), self.head_dim, rot_dims=self.head_dim, theta=self.theta)
        x = x + self.o(att)
        y = self.mlp_norm(x)
        out: torch.Tensor = x + self.w2(F.silu(self.w1(y)) * self.w3(y))
        return out


class GPT2Block(nn.Module):
    """A Hugging Face GPT-2 layer: pre-LN attention and tanh-GELU MLP ``h → ffn → h``, biases everywhere."""

    def __init__(self, spec: ModelSpec, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        h, f = spec.hidden, spec.ffn
        self.head_dim = spec.head_dim
        self.ln1 = nn.LayerNorm(h, eps=spec.norm_eps, device=device)
        self.q = nn.Linear(h, h, device=device)
        self.k = nn.Linear(h, h, device=device)
        self.v = nn.Linear(h, h, device=device)
        self.o = nn.Linear(h, h, device=device)
        self.ln2 = nn.LayerNorm(h, eps=spec.norm_eps, device=device)
        self.fc1 = nn.Linear(h, f, device=device)
        self.fc2 = nn.Linear(f, h, device=device)

    @staticmethod
    def tp_plan() -> dict[str, str]:
        return {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise", "fc1": "colwise",
                "fc2": "rowwise"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln1(x)
        x = x + self.o(_attend(self.q(y), self.k(y), self.v(y), self.head_dim))
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))
        return out


class NeoXBlock(GPT2Block):
    """A GPT-NeoX layer: rotary on ``rotary_pct`` of each head, exact GELU MLP, and the parallel residual
    ``x + attn(LN1(x)) + mlp(LN2(x))`` (sequential when ``parallel_residual`` is off). Its modules are
    GPT-2's (same names, shapes and tensor-parallel plan)."""

    def __init__(self, spec: ModelSpec, *, parallel: bool = True, device: torch.device | str | None = None) -> None:
        super().__init__(spec, device=device)
        self.rot = int(spec.head_dim * spec.rotary_pct)
        self.theta = spec.rope_theta
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln1(x)
        att = self.o(_attend(self.q(y), self.k(y), self.v(y), self.head_dim, rot_dims=self.rot, theta=self.theta))
        if self.parallel:
            out: torch.Tensor = x + att + self.fc2(F.gelu(self.fc1(self.ln2(x))))
            return out
        x = x + att
        out = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return out


class _TokEmbed(nn.Module):
    def __init__(self, vocab: int, hidden: int, positions: int, *, device: torch.device | str | None) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden, device=device)
        self.pos = nn.Embedding(positions, hidden, device=device) if positions else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.tok(ids)
        if self.pos is not None:
            out = out + self.pos(torch.arange(ids.shape[1], device=ids.device))[None, :, :]
        return out


class _NormHead(nn.Module):
    """Final norm (RMSNorm as ``norm`` or LayerNorm as ``ln_f``) and the output projection ``out``."""

    def __init__(self, spec: ModelSpec, *, device: torch.device | str | None) -> None:
        super().__init__()
        if spec.family is ModelFamily.LLAMA:
            self.norm: nn.Module | None = nn.RMSNorm(spec.hidden, eps=spec.norm_eps, device=device)
            self.ln_f: nn.Module | None = None
        else:
            self.norm = None
            self.ln_f = nn.LayerNorm(spec.hidden, eps=spec.norm_eps, device=device)
        self.out = nn.Linear(spec.hidden, spec.vocab, bias=False, device=device)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.norm if self.norm is not None else self.ln_f
        assert norm is not None
        out: torch.Tensor = self.out(norm(x))
        return out

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class _UserHead(nn.Module):
    """The user's head (hidden states → logits) followed by the mean token cross-entropy."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.mod = head

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mod(x)
        return out

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


UserModel = tuple[nn.Module, list[nn.Module], nn.Module]
"""What a custom entry point returns: the embedding (token ids → hidden states), the blocks (hidden →
hidden) and the head (hidden → logits), as DeepSpeed's ``PipelineModule`` takes layers."""


def load_entry_point(entry_point: str) -> UserModel:
    """Import ``package.module:function`` and call it; :class:`ValidationError` naming ``model.entry_point``
    if it cannot be imported or does not return ``(embedding, [blocks], head)``."""
    import importlib

    mod_name, _, fn_name = entry_point.partition(":")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise ValidationError("model.entry_point", f"cannot be imported: {e}", entry_point) from None
    built = fn()
    if not (isinstance(built, tuple | list) and len(built) == 3 and isinstance(built[0], nn.Module)
            and isinstance(built[2], nn.Module) and isinstance(built[1], list | tuple | nn.ModuleList)
            and all(isinstance(b, nn.Module) for b in built[1]) and len(built[1]) > 0):
        raise ValidationError("model.entry_point", "must return (embedding module, [block modules], head module)",
                              entry_point)
    return built[0], list(built[1]), built[2]


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

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(self.ln_f(x))
        return out

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(x)
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
        fam = spec.family
        span = range(first_layer, last_layer + 1)
        self.embed: nn.Module | None = None
        self.head: nn.Module | None = None
        if fam is ModelFamily.GPT:
            self.embed = _Embed(spec.vocab, spec.hidden, max_seq_len, device=device) if self.is_first else None
            self.layers = nn.ModuleDict({str(i): Block(spec.hidden, spec.heads, device=device) for i in span})
            self.head = _Head(spec.vocab, spec.hidden, device=device) if self.is_last else None
            return
        if fam is ModelFamily.CUSTOM:
            embed, blocks, head = load_entry_point(spec.entry_point)
            if len(blocks) != spec.layers:
                raise ValidationError("model.layers", f"the entry point returns {len(blocks)} blocks", spec.layers)
            self.embed = embed if self.is_first else None
            self.layers = nn.ModuleDict({str(i): blocks[i] for i in span})
            self.head = _UserHead(head) if self.is_last else None
            return
        positions = (spec.max_positions or max_seq_len) if fam is ModelFamily.GPT2 else 0
        self.embed = _TokEmbed(spec.vocab, spec.hidden, positions, device=device) if self.is_first else None
        block: dict[ModelFamily, type[LlamaBlock | GPT2Block | NeoXBlock]] = {
            ModelFamily.LLAMA: LlamaBlock, ModelFamily.GPT2: GPT2Block, ModelFamily.NEOX: NeoXBlock}
        self.layers = nn.ModuleDict({str(i): block[fam](spec, device=device) for i in span})
        for layer in self.layers.values():
            if isinstance(layer, NeoXBlock):
                layer.parallel = spec.parallel_residual
        self.head = _NormHead(spec, device=device) if self.is_last else None

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
            logits: torch.Tensor = self.head.logits(x)  # type: ignore[operator]
            return logits
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


_NORMS = (nn.LayerNorm, nn.RMSNorm)
_RESIDUAL_OUT = ("o", "w2", "fc2")


def _init_family_(module: StageModule, seed: int) -> None:
    """Deterministic per-parameter initialisation of the non-``gpt`` families: N(0, 0.02) for weights and
    embeddings (residual outputs ``o``, ``w2``, ``fc2`` scaled by ``1/sqrt(2L)``), zero biases, unit
    norm gains; every tensor from its own generator seeded by ``(seed, name)``."""
    std = 0.02
    resid_std = std / math.sqrt(2 * module.spec.layers)
    norm_params = {f"{mn}.{pn}" if mn else pn for mn, m in module.named_modules() if isinstance(m, _NORMS)
                   for pn, _ in m.named_parameters(recurse=False)}
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name in norm_params:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                g = torch.Generator(device="cpu").manual_seed(_param_seed(seed, name))
                s = resid_std if name.rsplit(".", 2)[-2] in _RESIDUAL_OUT else std
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

    Parameters equal the same-named parameters of ``build_full(model_spec, seed)`` exactly; with
    ``model_spec.weights`` they are then read from those safetensors files (the stage's tensors only). The modules'
    default initialisation runs under ``torch.random.fork_rng`` and is then overwritten, so building a
    stage leaves the global RNG untouched and does not depend on it. (Not the meta device: materialising
    from it imports sympy, seconds per process.)
    """
    with torch.random.fork_rng(devices=[]):
        if model_spec.family is ModelFamily.CUSTOM:
            # The user's constructors initialise their layers: every rank seeds the global RNG alike and
            # builds the full list, so a stage's parameters equal the full model's whatever the split.
            torch.manual_seed(seed)
        module = StageModule(model_spec, first_layer, last_layer, max_seq_len=max_seq_len)
    if model_spec.family is ModelFamily.GPT:
        _init_(module, seed)
    elif model_spec.family is not ModelFamily.CUSTOM:
        _init_family_(module, seed)
    if model_spec.weights:
        from spiderflow.exec.hf import load_stage_weights

        load_stage_weights(module, model_spec.weights)
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
