"""The user's data through the real scheduler, agents and workers (every part real, separate processes),
on one mesh shared by the module:

- a job whose ``data`` is a token file trains on that file: the batches its workers build are windows of
  the file, and the loss of their first step is the loss the seeded model gives on exactly those windows;
  its loss falls;
- the same for a JSONL corpus with a local tokenizer file (a Llama model, the corpus tokenized into its
  cache by the agent before the workers start);
- a missing data path is refused at submission with the field named; a token file with tokens outside the
  vocabulary fails the job at placement, before any step.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from e2e_harness import MARK, attempt_events, losses_by_step, wait_for_job, wait_no_marked_processes

from spiderflow.core.errors import ValidationError
from spiderflow.exec.data import micro_batch, open_data
from spiderflow.exec.spec import TrainSpec, spec_from_dict
from spiderflow.mesh import LocalMesh, sample_topology
from spiderflow.sdk import Client, Job

pytestmark = pytest.mark.timeout(300)

SEQ = 32
STEPS = 10
WORDS = [f"w{i}" for i in range(40)]
BASE = {"global_batch": 4, "micro_batch": 2, "seq_len": SEQ, "steps": STEPS, "gpus": {"min": 1, "max": 1}}


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    """The module's mesh after its jobs finished."""

    dir: Path
    mesh_dir: Path
    tokens: np.ndarray
    client: Client
    finals: dict[str, Job]


def _tokenizer(path: Path, words: list[str]) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel({"<unk>": 0, "<|endoftext|>": 1, **{w: i + 2 for i, w in enumerate(words)}},
                              unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path))


def _worker_spec(mesh_dir: Path, job: str) -> TrainSpec:
    files = sorted((mesh_dir / "agents").glob(f"*/logs/{job}/attempt-1/*/worker-spec.json"))
    assert files, f"no worker spec of {job}"
    return spec_from_dict(json.loads(files[0].read_text()))


def _first_step_loss(spec: TrainSpec) -> float:
    """The loss of step 1 computed here: the seeded model on the micro-batches of the job's data source."""
    import torch

    from spiderflow.exec.model import build_full

    net = build_full(spec.model, spec.seed, max_seq_len=spec.seq_len)
    src = open_data(spec.data, vocab=spec.model.vocab, seq_len=spec.seq_len)
    m = spec.plan.micro_batches
    with torch.no_grad():
        losses = [float(net(*(torch.from_numpy(a) for a in micro_batch(
            src, step=0, global_batch=spec.global_batch, micro_batch_size=spec.global_batch // m, index=j))))
            for j in range(m)]
    return sum(losses) / m


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """One 2-cluster mesh; the token-file, corpus and out-of-vocabulary jobs submitted side by side and
    awaited. Every process of the mesh carries a tag; none may survive the module."""
    d = tmp_path_factory.mktemp("data")
    token = uuid.uuid4().hex
    old = os.environ.get(MARK)
    os.environ[MARK] = token
    rng = np.random.default_rng(0)
    # a token file with structure the synthetic source never has: a fixed cycle of 48 tokens, repeated
    tokens = np.tile(rng.choice(512, size=48, replace=False), 200).astype(np.uint16)
    np.save(d / "tokens.npy", tokens)
    _tokenizer(d / "tokenizer.json", WORDS)
    with (d / "corpus.jsonl").open("w") as f:
        for i in range(300):
            f.write(json.dumps({"text": " ".join(WORDS[(i + k) % 8] for k in range(24))}) + "\n")
    np.save(d / "bad.npy", np.full(100, 9999, dtype=np.uint16))
    mesh_dir = d / "mesh"
    # the clusters declare their speed: the agents skip their CPU calibration
    mesh = LocalMesh(sample_topology(2), workdir=mesh_dir, agent_args=("--tflops", "0.02"))
    try:
        with mesh, Client(mesh.address("scheduler"), topology=mesh.address("topology")) as sf:
            sf.submit({**BASE, "id": "file", "model": "gpt-tiny", "optimizer": {"lr": 3e-3},
                       "data": {"kind": "tokens", "path": str(d / "tokens.npy")}}, request_id="file")
            sf.submit({**BASE, "id": "corpus", "model": "llama-tiny", "optimizer": {"lr": 3e-3, "warmup_steps": 2},
                       "data": {"kind": "corpus", "path": str(d / "corpus.jsonl"),
                                "tokenizer": str(d / "tokenizer.json")}}, request_id="corpus")
            sf.submit({**BASE, "id": "vocab", "model": "gpt-tiny",
                       "data": {"kind": "tokens", "path": str(d / "bad.npy")}}, request_id="vocab")
            finals = {j: wait_for_job(sf, j, lambda x: x.done, 180, f"job {j} finishing")
                      for j in ("file", "corpus", "vocab")}
            yield Run(dir=d, mesh_dir=mesh_dir, tokens=tokens, client=sf, finals=finals)
    finally:
        mesh.stop()
        left = wait_no_marked_processes(token)
        if old is None:
            os.environ.pop(MARK, None)
        else:
            os.environ[MARK] = old
        assert not left, f"processes of the run survived it: {left}"


def test_a_missing_data_path_is_refused_at_submission_naming_the_field(run: Run) -> None:
    with pytest.raises(ValidationError) as e:
        run.client.submit({**BASE, "id": "missing", "model": "gpt-tiny",
                           "data": {"kind": "tokens", "path": str(run.dir / "nowhere" / "*.bin")}})
    assert "job.data.path" in str(e.value)


def test_a_job_trains_on_the_users_token_file(run: Run) -> None:
    assert run.finals["file"].state == "SUCCEEDED", run.finals["file"].reason
    losses = losses_by_step(attempt_events(run.mesh_dir, "file", 1))
    assert sorted(losses) == list(range(1, STEPS + 1)), losses
    assert losses[STEPS] < losses[1] - 1.0, losses
    spec = _worker_spec(run.mesh_dir, "file")
    assert spec.data.path == str(run.dir / "tokens.npy")
    # the batches are windows of the user's file ...
    src = open_data(spec.data, vocab=spec.model.vocab, seq_len=spec.seq_len)
    tokens = run.tokens
    for step in range(3):
        x, y = micro_batch(src, step=step, global_batch=4, micro_batch_size=2, index=0)
        for row_x, row_y in zip(x, y, strict=True):
            start = int(np.flatnonzero(tokens[: len(tokens) - SEQ] == row_x[0])[0])
            assert np.array_equal(row_x, tokens[start:start + SEQ]) and row_y[-1] == tokens[start + SEQ]
    # ... and they are what the workers trained on: their first loss is the seeded model's on these windows
    assert losses[1] == pytest.approx(_first_step_loss(spec), rel=1e-4)


def test_a_job_trains_on_a_jsonl_corpus_with_a_tokenizer_file(run: Run) -> None:
    assert run.finals["corpus"].state == "SUCCEEDED", run.finals["corpus"].reason
    losses = losses_by_step(attempt_events(run.mesh_dir, "corpus", 1))
    assert sorted(losses) == list(range(1, STEPS + 1)), losses
    assert losses[STEPS] < losses[1] - 1.0, losses
    spec = _worker_spec(run.mesh_dir, "corpus")
    assert spec.model.family.value == "llama" and spec.data.kind.value == "corpus"
    assert list((run.dir / ".spiderflow-tokens").glob("*/DONE")), "the corpus cache was not written"
    src = open_data(spec.data, vocab=spec.model.vocab, seq_len=spec.seq_len)
    x, _ = micro_batch(src, step=0, global_batch=4, micro_batch_size=4, index=0)
    assert set(np.unique(x)) <= {1, *range(2, 10)}  # the corpus's eight words and the document separator
    assert losses[1] == pytest.approx(_first_step_loss(spec), rel=1e-4)


def test_tokens_outside_the_vocabulary_fail_the_job_at_placement(run: Run) -> None:
    final = run.finals["vocab"]
    assert final.state == "FAILED" and "data.vocab" in final.reason, final.reason
    assert not losses_by_step(attempt_events(run.mesh_dir, "vocab", 1))
