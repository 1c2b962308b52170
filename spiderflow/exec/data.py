"""Training data: a seeded synthetic token source with learnable structure, and token files.

Every source is *indexed*: sample ``i`` (a window of ``seq_len + 1`` tokens: inputs are the first
``seq_len``, targets the last ``seq_len``) is a pure function of the source's seed and ``i``, so any
process can build exactly the micro-batches it runs without coordination, and a resumed or re-split job
sees the same data. Step ``t`` of a job with global batch ``B`` uses samples ``t·B … t·B + B − 1``;
micro-batch ``j`` of size ``b`` is samples ``t·B + j·b … t·B + j·b + b − 1`` (:func:`micro_batch`).

Sources:

- :class:`SyntheticTokens` — a noisy first-order Markov chain on ``active`` tokens of the vocabulary (a
  seeded subset): each active token ``u`` has ``branching`` active successors drawn once from the seed,
  with Dirichlet-drawn probabilities; with probability ``noise`` the next token is a uniform active token
  instead. An untrained model starts near ``ln V``; learning which tokens occur brings it near ``ln
  active`` within a few steps, learning the transitions towards :meth:`SyntheticTokens.entropy_rate`
  (≈ ``ln branching`` plus the noise term), so the loss falls fast.
- :class:`TokenFile` — a flat token array from ``.npy`` (any integer dtype) or raw ``.bin`` (``uint16``
  or ``uint32``, memory-mapped). Windows are non-overlapping, visited in a seeded random order per epoch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import numpy as np
import numpy.typing as npt

from spiderflow.errors import ValidationError

__all__ = [
    "SyntheticTokens",
    "TokenFile",
    "TokenSource",
    "micro_batch",
    "open_source",
]


class TokenSource(Protocol):
    """``sample(i)`` → ``int64`` array of ``seq_len + 1`` tokens in ``[0, vocab)``; deterministic in ``i``."""

    @property
    def vocab(self) -> int: ...

    @property
    def seq_len(self) -> int: ...

    def sample(self, index: int) -> npt.NDArray[np.int64]: ...


def micro_batch(
    source: TokenSource, *, step: int, global_batch: int, micro_batch_size: int, index: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """``(inputs, targets)``, each ``(micro_batch_size, seq_len)`` ``int64``, of micro-batch ``index`` of
    step ``step`` (see the module docstring for the sample numbering)."""
    if index < 0 or (index + 1) * micro_batch_size > global_batch:
        raise ValidationError("micro_batch.index", f"out of range for global batch {global_batch}", index)
    base = step * global_batch + index * micro_batch_size
    rows = np.stack([source.sample(base + k) for k in range(micro_batch_size)])
    return rows[:, :-1].copy(), rows[:, 1:].copy()


@dataclass(frozen=True, slots=True, kw_only=True)
class SyntheticTokens:
    """A noisy Markov chain over ``vocab`` tokens (see the module docstring). ``O(seq_len)`` per sample."""

    vocab: int
    seq_len: int
    seed: int = 0
    branching: int = 4
    noise: float = 0.05
    active: int = 64
    _tokens: npt.NDArray[np.int64] = field(init=False, repr=False)
    _successors: npt.NDArray[np.int64] = field(init=False, repr=False)
    _cdf: npt.NDArray[np.float64] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.vocab < 2:
            raise ValidationError("data.vocab", "must be ≥ 2", self.vocab)
        if self.seq_len < 1:
            raise ValidationError("data.seq_len", "must be ≥ 1", self.seq_len)
        if self.active < 1:
            raise ValidationError("data.active", "must be ≥ 1", self.active)
        n = min(self.active, self.vocab)
        if not 1 <= self.branching <= n:
            raise ValidationError("data.branching", f"must be in [1, {n}]", self.branching)
        if not 0.0 <= self.noise <= 1.0:
            raise ValidationError("data.noise", "must be in [0, 1]", self.noise)
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 0x5EED]))
        tokens = np.sort(rng.choice(self.vocab, size=n, replace=False)).astype(np.int64)
        succ = np.stack([rng.choice(n, size=self.branching, replace=False) for _ in range(n)])
        probs = rng.dirichlet(np.ones(self.branching), size=n)
        object.__setattr__(self, "_tokens", tokens)
        object.__setattr__(self, "_successors", succ.astype(np.int64))
        object.__setattr__(self, "_cdf", np.cumsum(probs, axis=1))

    def sample(self, index: int) -> npt.NDArray[np.int64]:
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 1, index]))
        n = self.seq_len + 1
        pick = rng.random(n)
        jump = rng.random(n) < self.noise
        uniform = rng.integers(0, len(self._tokens), size=n)
        state = np.empty(n, dtype=np.int64)  # index into the active tokens
        state[0] = uniform[0]
        for t in range(1, n):
            if jump[t]:
                state[t] = uniform[t]
            else:
                u = state[t - 1]
                k = min(int(np.searchsorted(self._cdf[u], pick[t], side="right")), self.branching - 1)
                state[t] = self._successors[u, k]
        return self._tokens[state]

    def entropy_rate(self) -> float:
        """Expected per-token loss (nats) of the best possible predictor, averaged over current tokens
        uniformly: the entropy of the successor distribution mixed with the uniform noise. An untrained
        model starts near ``ln vocab``."""
        n = len(self._tokens)
        probs = np.diff(np.concatenate([np.zeros((n, 1)), self._cdf], axis=1), axis=1)
        mixed = (1 - self.noise) * probs + self.noise / n
        h = -(mixed * np.log(mixed)).sum(axis=1).mean()
        rest = self.noise * (n - self.branching) / n
        if rest > 0:
            h += -rest * math.log(self.noise / n)
        return float(h)


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenFile:
    """Tokens from a ``.npy`` or raw ``.bin`` file (``dtype`` ``uint16``/``uint32`` for ``.bin``).

    ``vocab`` is checked against the file's largest token on open (``ValidationError`` if exceeded)."""

    path: str
    vocab: int
    seq_len: int
    seed: int = 0
    dtype: Literal["uint16", "uint32"] = "uint16"
    _tokens: npt.NDArray[np.integer] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        p = Path(self.path)
        if not p.is_file():
            raise ValidationError("data.path", "no such file", self.path)
        if p.suffix == ".npy":
            tokens = np.load(p, mmap_mode="r")
            if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
                raise ValidationError("data.path", "must hold a 1-D integer array", f"{tokens.dtype}{tokens.shape}")
        elif p.suffix == ".bin":
            if self.dtype not in ("uint16", "uint32"):
                raise ValidationError("data.dtype", "must be uint16 or uint32", self.dtype)
            tokens = np.memmap(p, dtype=np.dtype(self.dtype), mode="r")
        else:
            raise ValidationError("data.path", "must end in .npy or .bin", self.path)
        if len(tokens) < self.seq_len + 1:
            raise ValidationError("data.path", f"holds fewer than seq_len + 1 = {self.seq_len + 1} tokens", len(tokens))
        top = int(tokens.max())
        if top >= self.vocab or int(tokens.min()) < 0:
            raise ValidationError("data.vocab", f"file holds token {top}, outside [0, {self.vocab})", self.vocab)
        object.__setattr__(self, "_tokens", tokens)

    @property
    def windows(self) -> int:
        """Non-overlapping windows per epoch."""
        return (len(self._tokens) - 1) // self.seq_len

    def sample(self, index: int) -> npt.NDArray[np.int64]:
        epoch, k = divmod(index, self.windows)
        order = _epoch_order(self.seed, epoch, self.windows)
        start = int(order[k]) * self.seq_len
        return np.asarray(self._tokens[start : start + self.seq_len + 1], dtype=np.int64)


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, windows: int) -> npt.NDArray[np.int64]:
    return np.random.default_rng(np.random.SeedSequence([seed, 2, epoch])).permutation(windows)


def open_source(
    kind: str, *, vocab: int, seq_len: int, seed: int, path: str | None = None, dtype: str = "uint16"
) -> TokenSource:
    """Build a source from a spec: ``kind`` ``"synthetic"`` or ``"file"`` (``path`` required)."""
    if kind == "synthetic":
        return SyntheticTokens(vocab=vocab, seq_len=seq_len, seed=seed)
    if kind == "file":
        if not path:
            raise ValidationError("data.path", "is required for token files", path)
        if dtype not in ("uint16", "uint32"):
            raise ValidationError("data.dtype", "must be uint16 or uint32", dtype)
        return TokenFile(path=path, vocab=vocab, seq_len=seq_len, seed=seed, dtype=dtype)  # type: ignore[arg-type]
    raise ValidationError("data.kind", "must be 'synthetic' or 'file'", kind)
