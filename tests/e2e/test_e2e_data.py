"""The user's data through the real scheduler, agents and workers (every part real, separate processes):

- a job whose ``data`` is a token file trains on that file (the batches its workers build are windows of
  the file) and its loss falls; the same for a JSONL corpus with a local tokenizer file (a Llama model,
  the corpus tokenized into its cache by the agent before the workers start);
- a missing data path is refused at submission with the field named; a token file with tokens outside the
  vocabulary fails the job at placement, before any step.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import numpy as np
import pytest
from e2e_harness import MARK, attempt_events, losses_by_step, wait_for_job, wait_no_marked_processes

from spiderflow.errors import ValidationError
from spiderflow.exec.data import micro_batch, open_data
from spiderflow.exec.spec import spec_from_dict
from spiderflow.mesh import LocalMesh, sample_topology
from spiderflow.sdk import Client

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(420)]

SEQ = 32


def _tokenizer(path: Path, words: list[str]) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel({"<unk>": 0, "<|endoftext|>": 1, **{w: i + 2 for i, w in enumerate(words)}},
                              unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path))


def _worker_spec(mesh_dir: Path, job: str) -> dict[str, object]:
    files = sorted((mesh_dir / "agents").glob(f"*/logs/{job}/attempt-1/*/worker-spec.json"))
    assert files, f"no worker spec of {job}"
    doc = json.loads(files[0].read_text())
    assert isinstance(doc, dict)
    return doc


def test_jobs_train_on_the_users_token_file_and_corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = uuid.uuid4().hex
    monkeypatch.setenv(MARK, token)
    rng = np.random.default_rng(0)
    # a token file with structure the synthetic source never has: a fixed cycle of 48 tokens, repeated
    cycle = rng.choice(512, size=48, replace=False)
    tokens = np.tile(cycle, 200).astype(np.uint16)
    np.save(tmp_path / "tokens.npy", tokens)
    words = [f"w{i}" for i in range(40)]
    _tokenizer(tmp_path / "tokenizer.json", words)
    with (tmp_path / "corpus.jsonl").open("w") as f:
        for i in range(300):
            f.write(json.dumps({"text": " ".join(words[(i + k) % 8] for k in range(24))}) + "\n")
    (tmp_path / "bad.npy").parent.mkdir(exist_ok=True)
    np.save(tmp_path / "bad.npy", np.full(100, 9999, dtype=np.uint16))
    base = {"global_batch": 4, "micro_batch": 1, "seq_len": SEQ, "steps": 12, "gpus": {"min": 2, "max": 2}}
    mesh_dir = tmp_path / "mesh"
    mesh = LocalMesh(sample_topology(2), workdir=mesh_dir)
    try:
        with mesh, Client(mesh.address("scheduler"), topology=mesh.address("topology")) as sf:
            with pytest.raises(ValidationError) as e:
                sf.submit({**base, "id": "missing", "model": "gpt-tiny",
                           "data": {"kind": "tokens", "path": str(tmp_path / "nowhere" / "*.bin")}})
            assert "job.data.path" in str(e.value)
            sf.submit({**base, "id": "file", "model": "gpt-tiny", "optimizer": {"lr": 3e-3},
                       "data": {"kind": "tokens", "path": str(tmp_path / "tokens.npy")}}, request_id="file")
            sf.submit({**base, "id": "corpus", "model": "llama-tiny", "optimizer": {"lr": 3e-3, "warmup_steps": 2},
                       "data": {"kind": "corpus", "path": str(tmp_path / "corpus.jsonl"),
                                "tokenizer": str(tmp_path / "tokenizer.json")}}, request_id="corpus")
            sf.submit({**base, "id": "vocab", "model": "gpt-tiny",
                       "data": {"kind": "tokens", "path": str(tmp_path / "bad.npy")}}, request_id="vocab")
            finals = {j: wait_for_job(sf, j, lambda x: x.done, 300, f"job {j} finishing")
                      for j in ("file", "corpus", "vocab")}
        for j in ("file", "corpus"):
            assert finals[j].state == "SUCCEEDED", (j, finals[j].reason)
            losses = losses_by_step(attempt_events(mesh_dir, j, 1))
            assert sorted(losses) == list(range(1, 13)), losses
            assert losses[12] < losses[1] - 1.0, (j, losses)
        # the workers' batches are windows of the user's file
        spec = spec_from_dict(_worker_spec(mesh_dir, "file"))
        assert spec.data.path == str(tmp_path / "tokens.npy")
        src = open_data(spec.data, vocab=spec.model.vocab, seq_len=spec.seq_len)
        for step in range(3):
            x, y = micro_batch(src, step=step, global_batch=4, micro_batch_size=1, index=0)
            start = int(np.flatnonzero(tokens[: len(tokens) - SEQ] == x[0, 0])[0])
            assert np.array_equal(x[0], tokens[start:start + SEQ]) and np.array_equal(y[0, -1], tokens[start + SEQ])
        corpus = spec_from_dict(_worker_spec(mesh_dir, "corpus"))
        assert corpus.model.family.value == "llama" and corpus.data.kind.value == "corpus"
        assert list((tmp_path / ".spiderflow-tokens").glob("*/DONE")), "the corpus cache was not written"
        # tokens outside the vocabulary: failed at placement, naming the field, before any step
        assert finals["vocab"].state == "FAILED" and "data.vocab" in finals["vocab"].reason, finals["vocab"].reason
        assert not losses_by_step(attempt_events(mesh_dir, "vocab", 1))
    finally:
        mesh.stop()
        left = wait_no_marked_processes(token)
        assert not left, f"processes of the run survived it: {left}"


def test_up_with_model_llama_tiny_trains_to_succeeded(tmp_path: Path) -> None:
    """``spiderflow up --model llama-tiny``: the sample job runs the Llama block across three clusters."""
    import os
    import subprocess
    import sys

    from e2e_harness import ROOT

    token = uuid.uuid4().hex
    env = {**os.environ, MARK: token, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "spiderflow.cli.main", "up", "--model", "llama-tiny", "--steps", "20", "--json",
         "--data-dir", str(tmp_path / "mesh"), "--timeout", "300"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        out, err = proc.communicate(timeout=400)
        assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-3000:]}\n{err[-3000:]}"
        start = out.find("\n{\n")
        s, _ = json.JSONDecoder().raw_decode(out[start + 1:])
        assert s["state"] == "SUCCEEDED", s
        assert float(s["last_loss"]) < float(s["first_loss"]) - 1.0, s
        assert "llama-tiny" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        left = wait_no_marked_processes(token)
        assert not left, f"processes of the run survived it: {left}"
