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
- :class:`TokenShards` — several such files (a directory or a glob, in sorted path order): the windows of
  all shards form one sequence, visited in a seeded random order per epoch (one shard reads exactly as
  :class:`TokenFile`).
- a *corpus* (:func:`prepare_corpus`): ``.jsonl`` (text under a key) or ``.txt`` (one document per line)
  files tokenized once with a local ``tokenizer.json`` and cached as ``.npy`` shards in a directory named
  by a digest of the inputs (paths, sizes, modification times, the tokenizer file, the key), written
  under a temporary name and renamed, so concurrent preparers never expose a partial cache.

:func:`open_data` builds the source of a :class:`~spiderflow.core.domain.DataSpec`; :func:`check_data_access`
is the cheap check of the paths (submission), :func:`open_data` the full one (placement: the agent opens
the source before starting workers, so a bad file fails the job before any step).
"""

from __future__ import annotations

import bisect
import functools
import glob
import hashlib
import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import numpy as np
import numpy.typing as npt

from spiderflow.core.domain import DataKind, DataSpec
from spiderflow.core.errors import ValidationError

__all__ = [
    "SyntheticTokens",
    "TokenFile",
    "TokenShards",
    "TokenSource",
    "check_data_access",
    "micro_batch",
    "open_data",
    "open_source",
    "prepare_corpus",
    "resolve_paths",
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
    _cdf_rows: list[list[float]] = field(init=False, repr=False)
    _successor_rows: list[list[int]] = field(init=False, repr=False)

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
        object.__setattr__(self, "_cdf_rows", self._cdf.tolist())
        object.__setattr__(self, "_successor_rows", self._successors.tolist())

    def sample(self, index: int) -> npt.NDArray[np.int64]:
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 1, index]))
        n = self.seq_len + 1
        pick = rng.random(n)
        jump = rng.random(n) < self.noise
        uniform = rng.integers(0, len(self._tokens), size=n)
        # The chain is sequential, so it is followed in plain Python numbers (a numpy call per token cost
        # ~0.6 ms per 257-token sample, the end stages' largest per-step cost on a CPU testbed): the
        # successor is the first whose cumulative probability exceeds the draw (``bisect_right``, as
        # ``searchsorted(side="right")`` on the same float64 values), capped at the last successor.
        cdf, succ, last = self._cdf_rows, self._successor_rows, self.branching - 1
        picks, jumps, uniforms = pick.tolist(), jump.tolist(), uniform.tolist()
        u = uniforms[0]
        states = [u]  # indices into the active tokens
        for t in range(1, n):
            if jumps[t]:
                u = uniforms[t]
            else:
                k = bisect.bisect_right(cdf[u], picks[t])
                u = succ[u][k if k < last else last]
            states.append(u)
        return self._tokens[np.asarray(states, dtype=np.int64)]

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


def resolve_paths(pattern: str, suffixes: tuple[str, ...], *, field: str = "data.path") -> list[Path]:
    """The readable files ``pattern`` names: a file, a directory (its files ending in ``suffixes``) or a
    glob; sorted. :class:`ValidationError` naming ``field`` when nothing matches or a file is unreadable."""
    p = Path(pattern)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in suffixes)
    elif p.is_file():
        files = [p]
    else:
        files = sorted(Path(f) for f in glob.glob(pattern) if Path(f).is_file())
    if not files:
        raise ValidationError(field, f"matches no {'/'.join(suffixes)} file", pattern)
    for f in files:
        if f.suffix not in suffixes:
            raise ValidationError(field, f"must name {'/'.join(suffixes)} files", str(f))
        if not os.access(f, os.R_OK):
            raise ValidationError(field, "is not readable", str(f))
    return files


def _open_tokens(path: Path, dtype: str) -> npt.NDArray[np.integer]:
    if path.suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise ValidationError("data.path", f"cannot read: {e}", str(path)) from None
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValidationError("data.path", "must hold a 1-D integer array", f"{path}: {tokens.dtype}{tokens.shape}")
        out: npt.NDArray[np.integer] = tokens
        return out
    return np.memmap(path, dtype=np.dtype(dtype), mode="r")


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenShards:
    """Token shards (``.npy`` / ``.bin``) read as one sequence of windows (see the module docstring).

    Every shard's tokens are checked against ``vocab`` on open (``ValidationError`` naming ``data.vocab``)."""

    paths: tuple[str, ...]
    vocab: int
    seq_len: int
    seed: int = 0
    dtype: str = "uint16"
    _shards: tuple[npt.NDArray[np.integer], ...] = field(init=False, repr=False)
    _starts: npt.NDArray[np.int64] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.paths:
            raise ValidationError("data.path", "names no shard", self.paths)
        shards, counts = [], []
        for path in self.paths:
            tokens = _open_tokens(Path(path), self.dtype)
            if len(tokens) < self.seq_len + 1:
                continue
            top, low = int(tokens.max()), int(tokens.min())
            if top >= self.vocab or low < 0:
                raise ValidationError("data.vocab", f"{path} holds token {top if low >= 0 else low}, outside "
                                      f"[0, {self.vocab})", self.vocab)
            shards.append(tokens)
            counts.append((len(tokens) - 1) // self.seq_len)
        if not shards:
            raise ValidationError("data.path", f"no shard holds seq_len + 1 = {self.seq_len + 1} tokens",
                                  self.paths[0])
        object.__setattr__(self, "_shards", tuple(shards))
        object.__setattr__(self, "_starts", np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))

    @property
    def windows(self) -> int:
        return int(self._starts[-1])

    def sample(self, index: int) -> npt.NDArray[np.int64]:
        epoch, k = divmod(index, self.windows)
        w = int(_epoch_order(self.seed, epoch, self.windows)[k])
        shard = int(np.searchsorted(self._starts, w, side="right")) - 1
        start = (w - int(self._starts[shard])) * self.seq_len
        return np.asarray(self._shards[shard][start : start + self.seq_len + 1], dtype=np.int64)


_CORPUS_SUFFIXES = (".jsonl", ".txt")
_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


def _corpus_inputs(data: DataSpec) -> tuple[list[Path], Path]:
    assert data.path is not None
    files = resolve_paths(data.path, _CORPUS_SUFFIXES)
    tok = Path(data.tokenizer)
    if not tok.is_file():
        raise ValidationError("data.tokenizer", "no such file", data.tokenizer)
    if not os.access(tok, os.R_OK):
        raise ValidationError("data.tokenizer", "is not readable", data.tokenizer)
    return files, tok


def _documents(path: Path, text_field: str) -> list[str]:
    docs = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            if path.suffix == ".txt":
                docs.append(line.rstrip("\n"))
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValidationError("data.path", f"{path}:{n} is not JSON: {e.msg}", str(path)) from None
            text = obj.get(text_field) if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise ValidationError("data.text_field", f"{path}:{n} has no string under this key", text_field)
            docs.append(text)
    return docs


def prepare_corpus(data: DataSpec, *, progress: bool = False) -> list[Path]:
    """Tokenize ``data``'s corpus with its tokenizer file once and return the cached ``.npy`` shards (one per
    corpus file; documents joined by the tokenizer's end-of-text token when it has one). A cache that
    exists is reused without reading the corpus. ``progress`` shows a progress bar on stderr."""
    from tokenizers import Tokenizer

    files, tok_path = _corpus_inputs(data)
    digest = hashlib.blake2b(digest_size=12)
    digest.update(tok_path.read_bytes())
    digest.update(data.text_field.encode())
    for f in files:
        st = f.stat()
        digest.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    root = Path(data.cache_dir) if data.cache_dir else files[0].parent / ".spiderflow-tokens"
    cache = root / digest.hexdigest()
    if (cache / "DONE").is_file():
        return sorted(cache.glob("shard-*.npy"))
    try:
        tokenizer = Tokenizer.from_file(str(tok_path))
    except Exception as e:  # the tokenizers library raises its own exception type
        raise ValidationError("data.tokenizer", f"cannot be loaded: {e}", data.tokenizer) from None
    eos = next((i for i in (tokenizer.token_to_id(t) for t in _EOS_NAMES) if i is not None), None)
    dtype = np.uint16 if tokenizer.get_vocab_size() <= 1 << 16 else np.uint32
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".tmp-{os.getpid()}-{digest.hexdigest()}"
        tmp.mkdir(exist_ok=True)
    except OSError as e:
        raise ValidationError("data.cache_dir", f"cannot be written: {e}", str(root)) from None
    from rich.progress import Progress

    total = sum(f.stat().st_size for f in files)
    with Progress(disable=not progress, transient=False) as bar:
        task = bar.add_task("tokenizing", total=total)
        for i, f in enumerate(files):
            ids: list[int] = []
            docs = _documents(f, data.text_field)
            for start in range(0, len(docs), 1024):
                for enc in tokenizer.encode_batch(docs[start : start + 1024]):
                    ids.extend(enc.ids)
                    if eos is not None:
                        ids.append(eos)
            np.save(tmp / f"shard-{i:05d}.npy", np.asarray(ids, dtype=dtype))
            bar.advance(task, f.stat().st_size)
    (tmp / "DONE").write_text(json.dumps({"files": [str(f) for f in files], "tokenizer": str(tok_path)}))
    try:
        os.rename(tmp, cache)
    except OSError:  # another preparer finished first: its cache is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return sorted(cache.glob("shard-*.npy"))


def check_data_access(data: DataSpec) -> None:
    """The cheap submission-time check: the paths exist and are readable (``ValidationError`` naming
    ``data.path`` / ``data.tokenizer``). Contents are checked by :func:`open_data`."""
    if data.kind is DataKind.TOKENS:
        assert data.path is not None
        resolve_paths(data.path, (".bin", ".npy"))
    elif data.kind is DataKind.CORPUS:
        _corpus_inputs(data)


def open_data(data: DataSpec, *, vocab: int, seq_len: int, progress: bool = False) -> TokenSource:
    """The token source of ``data`` (tokenizing a corpus first if its cache does not exist yet)."""
    if data.kind is DataKind.SYNTHETIC:
        return SyntheticTokens(vocab=vocab, seq_len=seq_len, seed=data.seed)
    if data.kind is DataKind.TOKENS:
        assert data.path is not None
        paths = resolve_paths(data.path, (".bin", ".npy"))
    else:
        paths = prepare_corpus(data, progress=progress)
    return TokenShards(paths=tuple(str(p) for p in paths), vocab=vocab, seq_len=seq_len, seed=data.seed,
                       dtype=data.dtype)
