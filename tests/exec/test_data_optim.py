"""The user's data and optimizer: token shards by glob, a JSONL/text corpus tokenized once and cached, the
same sample sequence whatever the split or a resume, paths refused naming the field; AdamW, its schedule
and global gradient clipping."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from spiderflow.core.domain import DataKind, DataSpec, OptimizerSpec
from spiderflow.core.errors import ValidationError
from spiderflow.exec.data import TokenShards, micro_batch, open_data, prepare_corpus
from spiderflow.exec.optim import build_optimizer, clip_grad_norm_
from spiderflow.exec.preflight import check_job_paths
from spiderflow.formats import job_from_dict, job_to_dict
from spiderflow.rpc import convert


def write_tokenizer(path: Path, words: list[str]) -> Path:
    """A word-level tokenizer.json (``<unk>`` 0, ``<|endoftext|>`` 1, then ``words``)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"<unk>": 0, "<|endoftext|>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path))
    return path


def test_token_shards_by_glob_give_the_same_samples_whatever_the_split(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 500, 1000).astype(np.uint16), rng.integers(0, 500, 700).astype(np.uint16)
    a.tofile(tmp_path / "part-0.bin")
    b.tofile(tmp_path / "part-1.bin")
    data = DataSpec(kind=DataKind.TOKENS, path=str(tmp_path / "part-*.bin"), seed=3)
    src = open_data(data, vocab=512, seq_len=16)
    joined = [a, b]
    for i in range(200):  # every sample is a contiguous window of one shard
        s = src.sample(i)
        assert len(s) == 17
        assert any(any(np.array_equal(s, t[k:k + 17]) for k in range(0, len(t) - 16, 16)) for t in joined)
    # steps are pure functions of (seed, step): one micro-batch of 4 == two of 2 == a reopened source
    again = open_data(data, vocab=512, seq_len=16)
    for step in (0, 5, 61):  # 61·4 > one epoch of windows: the next epoch's order
        x1, y1 = micro_batch(src, step=step, global_batch=4, micro_batch_size=4, index=0)
        parts = [micro_batch(again, step=step, global_batch=4, micro_batch_size=2, index=j) for j in range(2)]
        assert np.array_equal(x1, np.concatenate([p[0] for p in parts]))
        assert np.array_equal(y1, np.concatenate([p[1] for p in parts]))


def test_a_jsonl_corpus_is_tokenized_once_and_cached(tmp_path: Path) -> None:
    words = ["the", "cat", "sat", "on", "mat", "a", "dog"]
    tok = write_tokenizer(tmp_path / "tokenizer.json", words)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"body": "the cat sat on the mat"}) + "\n" for _ in range(40)))
    data = DataSpec(kind=DataKind.CORPUS, path=str(corpus), tokenizer=str(tok), text_field="body")
    shards = prepare_corpus(data)
    ids = np.load(shards[0])
    assert ids[:7].tolist() == [2, 3, 4, 5, 2, 6, 1]  # words, then end-of-text
    mtime = shards[0].stat().st_mtime_ns
    assert prepare_corpus(data) == shards and shards[0].stat().st_mtime_ns == mtime  # cached, not redone
    src = open_data(data, vocab=16, seq_len=8)
    assert set(src.sample(0).tolist()) <= set(range(7))
    with pytest.raises(ValidationError, match=r"data\.text_field"):
        prepare_corpus(DataSpec(kind=DataKind.CORPUS, path=str(corpus), tokenizer=str(tok)))
    with pytest.raises(ValidationError, match=r"data\.vocab"):
        open_data(data, vocab=4, seq_len=8)


def test_missing_paths_are_refused_naming_the_field(tmp_path: Path) -> None:
    job = {"id": "j", "model": "gpt-tiny", "global_batch": 4, "gpus": {"min": 1, "max": 1}}
    for data, fld in (({"kind": "tokens", "path": str(tmp_path / "none-*.bin")}, "data.path"),
                      ({"kind": "corpus", "path": str(tmp_path / "c.jsonl"), "tokenizer": "t.json"}, "data.path"),
                      ({"kind": "tokens"}, "data.path"), ({"kind": "corpus", "path": "x"}, "data.tokenizer"),
                      ({"kind": "nope"}, "data.kind")):
        with pytest.raises(ValidationError) as e:
            check_job_paths(job_from_dict({**job, "data": data}))
        assert e.value.field == fld, e.value
    (tmp_path / "c.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ValidationError) as e:
        check_job_paths(job_from_dict({**job, "data": {"kind": "corpus", "path": str(tmp_path / "c.jsonl"),
                                                       "tokenizer": str(tmp_path / "missing.json")}}))
    assert e.value.field == "data.tokenizer"


def test_optimizer_fields_validate_and_round_trip() -> None:
    job = {"id": "j", "model": "llama-tiny", "global_batch": 4, "gpus": {"min": 1, "max": 1},
           "optimizer": {"lr": 3e-4, "warmup_steps": 10, "schedule": "cosine", "weight_decay": 0.1,
                         "betas": [0.9, 0.99], "grad_clip": 1.0},
           "data": {"kind": "tokens", "path": "/data/*.bin", "dtype": "uint32"}}
    spec = job_from_dict(job)
    assert job_from_dict(job_to_dict(spec)) == spec
    assert convert.job_from_proto(convert.job_to_proto(spec)) == spec
    for bad, fld in (({"betas": [0.9, 1.5]}, "optimizer.betas[1]"), ({"lr": 0}, "optimizer.lr"),
                     ({"schedule": "step"}, "optimizer.schedule"), ({"momentum": 1}, "optimizer.momentum")):
        with pytest.raises(ValidationError) as e:
            job_from_dict({**job, "optimizer": bad})
        assert e.value.field == fld


def test_lr_schedule_and_adamw() -> None:
    cfg = OptimizerSpec(lr=1.0, warmup_steps=4, schedule="cosine", min_lr_ratio=0.1)  # type: ignore[arg-type]
    f = [cfg.lr_factor(t, 14) for t in range(16)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert f[4] == 1.0 and f[9] == pytest.approx(0.55) and f[14] == pytest.approx(0.1) and f[15] == f[14]
    lin = OptimizerSpec(lr=1.0, schedule="linear", min_lr_ratio=0.0, decay_steps=10)  # type: ignore[arg-type]
    assert [lin.lr_factor(t, 99) for t in (0, 5, 10, 20)] == [1.0, 0.5, 0.0, 0.0]
    # weight_decay 0: AdamW's update is Adam's, bit for bit
    torch.manual_seed(0)
    w1 = torch.nn.Parameter(torch.randn(5, 5))
    w2 = torch.nn.Parameter(w1.detach().clone())
    opt, sched = build_optimizer([w1], OptimizerSpec(lr=0.01))
    ref = torch.optim.Adam([w2], lr=0.01, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    for _ in range(3):
        for w, o in ((w1, opt), (w2, ref)):
            (w ** 3).sum().backward()
            o.step()
            o.zero_grad()
    assert torch.equal(w1, w2)
    assert sched.at(0) == 0.01


def test_clip_grad_norm_matches_torch_in_one_process() -> None:
    a = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for ps in (a, b):
        sum((p ** 2).sum() * (i + 1) for i, p in enumerate(ps)).backward()
    norm = clip_grad_norm_(a, 0.5)
    ref = torch.nn.utils.clip_grad_norm_(b, 0.5)
    assert norm == pytest.approx(float(ref), rel=1e-6)
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_a_pipeline_with_the_full_optimizer_equals_one_process(tmp_path: Path) -> None:
    """Warm-up, cosine decay, weight decay and global clipping on a 2-stage × dp 2 llama-tiny pipeline
    reading a token file: the losses equal one process running the same optimizer on the same batches."""
    from exec_harness import Launcher

    from spiderflow.core.catalog import MODEL_PRESETS
    from spiderflow.core.domain import Plan, Stage
    from spiderflow.exec.model import build_full
    from spiderflow.exec.spec import TrainSpec

    rng = np.random.default_rng(1)
    np.save(tmp_path / "t.npy", np.tile(rng.integers(0, 512, 40), 30).astype(np.uint16))
    data = DataSpec(kind=DataKind.TOKENS, path=str(tmp_path / "t.npy"), seed=2)
    cfg = OptimizerSpec(lr=3e-3, warmup_steps=2, schedule="cosine", weight_decay=0.1,  # type: ignore[arg-type]
                        grad_clip=0.5)
    model = MODEL_PRESETS["llama-tiny"]
    seq, batch, m, steps = 16, 8, 4, 5
    plan = Plan(stages=(Stage(cluster="a", first_layer=0, last_layer=1, dp=2),
                        Stage(cluster="b", first_layer=2, last_layer=3)), micro_batches=m)
    spec = TrainSpec(job_id="opt", model=model, plan=plan, seq_len=seq, global_batch=batch, steps=steps,
                     data=data, optimizer=cfg)
    launcher = Launcher(tmp_path)
    try:
        results = launcher.run_forked(spec)
    finally:
        launcher.close()
    losses = list(results[-1].losses)
    net = build_full(model, 0, max_seq_len=seq)
    opt, sched = build_optimizer(net.parameters(), cfg, total_steps=steps)
    src = open_data(data, vocab=model.vocab, seq_len=seq)
    ref = []
    for step in range(steps):
        total = 0.0
        for j in range(m):
            x, y = micro_batch(src, step=step, global_batch=batch, micro_batch_size=batch // m, index=j)
            loss = net(torch.from_numpy(x), torch.from_numpy(y))
            (loss / m).backward()
            total += float(loss.detach())
        clip_grad_norm_(list(net.parameters()), cfg.grad_clip)
        sched.at(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref.append(total / m)
    assert losses == pytest.approx(ref, rel=1e-4, abs=1e-5)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("kind", ["synthetic", "tokens", "corpus"])
def test_a_resumed_and_re_split_job_sees_the_same_sample_sequence(tmp_path: Path, kind: str) -> None:
    """One job run straight through (1 stage, 4 micro-batches) against the same job stopped after step 3
    and resumed on another split (2 stages × dp 2, 2 micro-batches; then 1 micro-batch) from a freshly
    opened source: every step trains on the same samples in the same order, across epochs of the data."""
    from spiderflow.core.catalog import MODEL_PRESETS
    from spiderflow.core.domain import Plan, Stage
    from spiderflow.exec.spec import TrainSpec

    if kind == "tokens":
        np.random.default_rng(4).integers(0, 500, 900).astype(np.uint16).tofile(tmp_path / "a.bin")
        np.random.default_rng(5).integers(0, 500, 500).astype(np.uint16).tofile(tmp_path / "b.bin")
        data = DataSpec(kind=DataKind.TOKENS, path=str(tmp_path / "*.bin"), seed=7)
    elif kind == "corpus":
        words = [f"w{i}" for i in range(30)]
        tok = write_tokenizer(tmp_path / "tokenizer.json", words)
        rng = np.random.default_rng(6)
        (tmp_path / "c.jsonl").write_text("".join(
            json.dumps({"text": " ".join(rng.choice(words, 20))}) + "\n" for _ in range(60)))
        data = DataSpec(kind=DataKind.CORPUS, path=str(tmp_path / "c.jsonl"), tokenizer=str(tok), seed=7)
    else:
        data = DataSpec(seed=7)

    def spec(*stages: Stage, m: int) -> TrainSpec:
        return TrainSpec(job_id="j", model=MODEL_PRESETS["llama-tiny"], plan=Plan(stages=stages, micro_batches=m),
                         seq_len=16, global_batch=8, steps=12, data=data)

    def batches(s: TrainSpec, steps: range) -> list[np.ndarray]:
        """Per step: the inputs of micro-batches 0 … m−1 (whichever dp replica runs each), in order."""
        src = open_data(s.data, vocab=s.model.vocab, seq_len=s.seq_len)  # a fresh source, as a new worker has
        return [np.concatenate([micro_batch(src, step=t, global_batch=s.global_batch,
                                            micro_batch_size=s.micro_batch_size, index=j)[0]
                                for j in range(s.plan.micro_batches)]) for t in steps]

    straight = batches(spec(Stage(cluster="a", first_layer=0, last_layer=3), m=4), range(12))
    first = batches(spec(Stage(cluster="a", first_layer=0, last_layer=3), m=4), range(3))
    resplit = spec(Stage(cluster="b", first_layer=0, last_layer=0, dp=2),
                   Stage(cluster="c", first_layer=1, last_layer=3, dp=2), m=2)
    resumed = batches(resplit, range(3, 8)) + batches(spec(Stage(cluster="c", first_layer=0, last_layer=3), m=1),
                                                      range(8, 12))
    src = open_data(data, vocab=512, seq_len=16)
    if kind != "synthetic":
        assert isinstance(src, TokenShards) and src.windows < 12 * 8  # the run crosses an epoch boundary of the data
    assert len(first + resumed) == len(straight) == 12
    for t, (a, b) in enumerate(zip(straight, first + resumed, strict=True)):
        assert np.array_equal(a, b), f"step {t}"
    assert not np.array_equal(straight[0], straight[1])
