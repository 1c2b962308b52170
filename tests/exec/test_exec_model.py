"""The stage model, the data sources, layer-indexed state re-slicing and the worker spec (in one process)."""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from exec_harness import reference_losses

from spiderflow.core.catalog import ModelSpec, model_preset
from spiderflow.core.domain import Plan, Schedule, Stage
from spiderflow.core.errors import PreconditionError, ValidationError
from spiderflow.exec.checkpoint import (
    latest_checkpoint,
    load_dcp,
    resume_point,
    retain,
    save_dcp,
    verify,
    write_manifest_file,
)
from spiderflow.exec.data import SyntheticTokens, TokenFile, micro_batch, open_source
from spiderflow.exec.model import build_full, build_stage, merge_state_dicts, param_layer, slice_state_dict
from spiderflow.exec.spec import (
    CheckpointManifest,
    DataSpec,
    TrainSpec,
    check_runnable,
    chunk_ranges,
    plan_chunks,
    rank_layout,
    ranks_of_cluster,
    spec_from_dict,
    spec_to_dict,
)
from spiderflow.exec.worker import main as worker_main

MODEL = model_preset("gpt-tiny")
SMALL = ModelSpec(name="small", layers=4, hidden=32, heads=2, vocab=64)


@pytest.mark.parametrize("split", [[(0, 5)], [(0, 1), (2, 3), (4, 5)], [(0, 0), (1, 4), (5, 5)]])
def test_stages_equal_the_full_model(split: list[tuple[int, int]]) -> None:
    full = build_full(MODEL, 11, max_seq_len=16)
    stages = [build_stage(MODEL, a, b, 11, max_seq_len=16) for a, b in split]
    ref = full.state_dict()
    merged = merge_state_dicts(st.state_dict() for st in stages)
    assert merged.keys() == ref.keys()
    assert all(torch.equal(merged[k], ref[k]) for k in ref)  # type: ignore[arg-type]
    # Chaining the stages is the full forward, bit for bit.
    src = SyntheticTokens(vocab=MODEL.vocab, seq_len=16, seed=1)
    x, y = (torch.from_numpy(a) for a in micro_batch(src, step=0, global_batch=2, micro_batch_size=2, index=0))
    h = x
    for st in stages[:-1]:
        h = st(h)
    assert torch.equal(stages[-1](h, y), full(x, y))
    # Only the first stage embeds, only the last has the head.
    assert [st.embed is not None for st in stages] == [i == 0 for i in range(len(stages))]
    assert [st.head is not None for st in stages] == [i == len(stages) - 1 for i in range(len(stages))]


def test_synthetic_data_stream_is_pinned() -> None:
    """The stream is part of a job's identity (a resumed or re-split job must see the same samples): these
    values were drawn before the chain was followed in plain Python numbers and must never change."""
    a = SyntheticTokens(vocab=512, seq_len=256)
    samples = [a.sample(i) for i in [*range(50), 10**6, 2**40]]
    assert samples[0][:12].tolist() == [357, 426, 309, 442, 496, 161, 411, 494, 350, 157, 432, 157]
    assert samples[49][-8:].tolist() == [471, 16, 67, 48, 181, 215, 201, 67]
    digest = hashlib.sha256(b"".join(x.tobytes() for x in samples)).hexdigest()
    assert digest == "1974f5cadd8f8e9f66d4d13c2f42f26b0a66fc8d0231a17bd7fd20f1b68c99ec"
    uniform = SyntheticTokens(vocab=8, seq_len=33, active=8, branching=8, noise=1.0)
    assert uniform.sample(0).tolist() == [7, 6, 1, 1, 4, 6, 5, 0, 0, 6, 0, 7, 5, 4, 2, 2, 3, 5, 0, 5, 4, 4, 3, 0, 5,
                                          1, 6, 5, 7, 3, 3, 2, 2, 6]


def test_seed_changes_parameters_and_init_uses_no_global_rng() -> None:
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    a = build_full(SMALL, 1, max_seq_len=8).state_dict()
    assert torch.equal(before, torch.random.get_rng_state())
    b = build_full(SMALL, 2, max_seq_len=8).state_dict()
    assert not torch.equal(a["layers.0.q.weight"], b["layers.0.q.weight"])
    assert torch.equal(a["layers.0.ln1.weight"], torch.ones(32))


def test_slice_state_dict_selects_by_layer() -> None:
    full = build_full(SMALL, 0, max_seq_len=8).state_dict()
    mid = slice_state_dict(full, SMALL, 1, 2)
    assert {param_layer(k, SMALL.layers) for k in mid} == {1, 2}
    assert not any(k.startswith(("embed.", "head.")) for k in mid)
    first = slice_state_dict(full, SMALL, 0, 0)
    assert any(k.startswith("embed.") for k in first)
    with pytest.raises(ValidationError, match="layer 3"):
        slice_state_dict(mid, SMALL, 1, 3)
    with pytest.raises(ValidationError, match="embedding"):
        slice_state_dict({k: v for k, v in full.items() if not k.startswith("embed.")}, SMALL, 0, 1)


def test_synthetic_data_is_deterministic_and_structured() -> None:
    a = SyntheticTokens(vocab=512, seq_len=64, seed=3)
    b = SyntheticTokens(vocab=512, seq_len=64, seed=3)
    assert np.array_equal(a.sample(17), b.sample(17))
    assert not np.array_equal(a.sample(17), a.sample(18))
    assert not np.array_equal(a.sample(17), SyntheticTokens(vocab=512, seq_len=64, seed=4).sample(17))
    toks = np.concatenate([a.sample(i) for i in range(50)])
    assert toks.min() >= 0 and toks.max() < 512 and len(np.unique(toks)) <= 64
    # Bigram structure: most transitions come from a handful of successors per token.
    pairs = {(int(u), int(v)) for s in (a.sample(i) for i in range(50)) for u, v in itertools.pairwise(s)}
    assert len(pairs) < 64 * 16
    assert 1.0 < a.entropy_rate() < np.log(64)
    x, y = micro_batch(a, step=2, global_batch=8, micro_batch_size=4, index=1)
    assert x.shape == y.shape == (4, 64) and x.dtype == np.int64
    assert np.array_equal(x[0], a.sample(2 * 8 + 4)[:-1]) and np.array_equal(y[0], a.sample(2 * 8 + 4)[1:])
    with pytest.raises(ValidationError):
        micro_batch(a, step=0, global_batch=8, micro_batch_size=4, index=2)


def test_token_files(tmp_path: Path) -> None:
    tokens = np.arange(1000)  # token value == file offset, so a window shows where it came from
    np.save(tmp_path / "t.npy", tokens.astype(np.int32))
    tokens.astype(np.uint16).tofile(tmp_path / "t16.bin")
    tokens.astype(np.uint32).tofile(tmp_path / "t32.bin")
    srcs = [
        TokenFile(path=str(tmp_path / "t.npy"), vocab=1000, seq_len=10, seed=1),
        TokenFile(path=str(tmp_path / "t16.bin"), vocab=1000, seq_len=10, seed=1, dtype="uint16"),
        open_source("file", vocab=1000, seq_len=10, seed=1, path=str(tmp_path / "t32.bin"), dtype="uint32"),
    ]
    for src in srcs:
        assert all(np.array_equal(src.sample(i), srcs[0].sample(i)) for i in (0, 5, 150))
    src = srcs[0]
    assert src.windows == 99
    # One epoch visits every non-overlapping window once, in a seeded order; windows are contiguous.
    starts = [int(src.sample(i)[0]) for i in range(99)]
    assert sorted(starts) == list(range(0, 990, 10)) and starts != sorted(starts)
    assert all(np.array_equal(src.sample(i), np.arange(starts[i], starts[i] + 11)) for i in range(99))
    assert [int(src.sample(99 + i)[0]) for i in range(99)] != starts  # the next epoch reshuffles
    other = TokenFile(path=str(tmp_path / "t.npy"), vocab=1000, seq_len=10, seed=2)
    assert [int(other.sample(i)[0]) for i in range(99)] != starts
    with pytest.raises(ValidationError, match="vocab"):
        TokenFile(path=str(tmp_path / "t.npy"), vocab=999, seq_len=10)
    with pytest.raises(ValidationError, match="no such file"):
        TokenFile(path=str(tmp_path / "missing.npy"), vocab=1000, seq_len=10)
    (tmp_path / "t.txt").write_text("1 2 3")
    with pytest.raises(ValidationError, match=r"\.npy or \.bin"):
        TokenFile(path=str(tmp_path / "t.txt"), vocab=1000, seq_len=10)


def test_loss_falls_well_below_the_active_vocabulary() -> None:
    # 25 single-process steps: from ≈ ln 512 to below ln 64 (the model learned which tokens occur and
    # started on the transitions).
    losses = reference_losses(MODEL, seq_len=32, global_batch=8, m=2, steps=25, seed=5, lr=3e-3)
    assert losses[0] > 6.0
    assert np.mean(losses[-5:]) < np.log(64)


def _chain(stages: list[torch.nn.Module], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = x
    for st in stages[:-1]:
        h = st(h)
    out: torch.Tensor = stages[-1](h, y)
    return out


def test_checkpoint_reslices_model_and_optimizer(tmp_path: Path) -> None:
    """Train under split A, checkpoint with DCP (one gloo rank), resume under split B: parameters match an
    uninterrupted run; a damaged newest checkpoint is refused; retention keeps the newest N."""
    import torch.distributed as dist

    src = SyntheticTokens(vocab=SMALL.vocab, seq_len=8, seed=0)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = micro_batch(src, step=step, global_batch=4, micro_batch_size=4, index=0)
        return torch.from_numpy(x), torch.from_numpy(y)

    def train(stages: list[torch.nn.Module], opts: list[torch.optim.Optimizer], steps: range) -> None:
        for step in steps:
            _chain(stages, *batch(step)).backward()  # type: ignore[no-untyped-call]
            for o in opts:
                o.step()
                o.zero_grad()

    def make(split: list[tuple[int, int]]) -> tuple[list[torch.nn.Module], list[torch.optim.Optimizer]]:
        stages: list[torch.nn.Module] = [build_stage(SMALL, a, b, 9, max_seq_len=8) for a, b in split]
        return stages, [torch.optim.Adam(st.parameters(), lr=1e-2, foreach=False) for st in stages]

    plan = Plan(stages=(Stage(cluster="a", first_layer=0, last_layer=1), Stage(cluster="a", first_layer=2,
                                                                               last_layer=3)), micro_batches=1)
    spec = TrainSpec(job_id="j", model=SMALL, plan=plan, seq_len=8, global_batch=4, steps=6,
                     checkpoint_dir=str(tmp_path), checkpoint_every=1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        full, full_opt = make([(0, 3)])
        train(full, full_opt, range(6))
        a, a_opt = make([(0, 1), (2, 3)])
        for step in (1, 2, 3):
            train(a, a_opt, range(step - 1, step))
            write_manifest_file(save_dcp(spec, step, a, a_opt, [[(0, 1)], [(2, 3)]]), tmp_path)
        assert retain(str(tmp_path), 2) == [1]
        loaded = latest_checkpoint(str(tmp_path))
        assert loaded is not None and loaded.step == 3 and verify(loaded) is None
        assert [(s.first_layer, s.last_layer) for s in loaded.shards] == [(0, 1), (2, 3)]
        b, b_opt = make([(0, 0), (1, 2), (3, 3)])
        load_dcp(loaded, b, b_opt, SMALL)
        train(b, b_opt, range(3, 6))
        ref = full[0].state_dict()
        got = merge_state_dicts(st.state_dict() for st in b)
        for k, v in ref.items():
            assert torch.allclose(got[k], v, rtol=1e-5, atol=1e-7), k  # type: ignore[arg-type]
        with pytest.raises(ValidationError, match=r"checkpoint\.model"):
            load_dcp(loaded, [build_stage(MODEL, 0, 0, 0)], [b_opt[0]], MODEL)
        # Truncate a shard of step 3: refused, step 2 is the resume point.
        shard = tmp_path / "step-00000003" / next(f.name for f in loaded.files if f.name.endswith(".distcp"))
        shard.write_bytes(shard.read_bytes()[:-7])
        assert "bytes" in (verify(loaded) or "")
        fallback = resume_point(TrainSpec(job_id="j", model=SMALL, plan=plan, seq_len=8, global_batch=4,
                                          steps=6, resume_from=loaded))
        assert fallback is not None and fallback.step == 2
    finally:
        dist.destroy_process_group()


def test_manifest_must_cover_every_layer() -> None:
    from spiderflow.exec.spec import ShardInfo

    with pytest.raises(ValidationError, match="layer 2"):
        CheckpointManifest(job_id="j", step=1, model=SMALL, shards=(
            ShardInfo(first_layer=0, last_layer=1, path="a"), ShardInfo(first_layer=3, last_layer=3, path="b")))
    with pytest.raises(ValidationError, match="cover 2 of 4"):
        CheckpointManifest(job_id="j", step=1, model=SMALL, shards=(ShardInfo(first_layer=0, last_layer=1, path="a"),))


def test_spec_round_trip_and_rank_layout() -> None:
    plan = Plan(stages=(Stage(cluster="a", first_layer=0, last_layer=1, dp=2),
                        Stage(cluster="b", first_layer=2, last_layer=5, dp=1),
                        Stage(cluster="a", first_layer=6, last_layer=7, dp=3)),
                micro_batches=6, schedule=Schedule.LATENCY_AWARE, extras={"chunks": 1.0})
    model = ModelSpec(name="m", layers=8, hidden=32, heads=2, vocab=64)
    spec = TrainSpec(job_id="j", model=model, plan=plan, seq_len=16, global_batch=12, steps=4,
                     data=DataSpec(kind="synthetic", seed=3), warmup=(6, 4, 1))
    again = spec_from_dict(json.loads(json.dumps(spec_to_dict(spec))))
    assert again == spec
    assert spec.world_size == 6 and spec.micro_batch_size == 2
    assert [(r.rank, r.stage, r.replica) for r in rank_layout(plan)] == [
        (0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 2, 0), (4, 2, 1), (5, 2, 2)]
    assert [r.rank for r in ranks_of_cluster(plan, "a")] == [0, 1, 3, 4, 5]
    with pytest.raises(ValidationError, match="global_batch"):
        TrainSpec(job_id="j", model=model, plan=plan, seq_len=16, global_batch=7, steps=1)
    with pytest.raises(ValidationError, match="warmup"):
        TrainSpec(job_id="j", model=model, plan=plan, seq_len=16, global_batch=12, steps=1, warmup=(1, 2, 0))
    with pytest.raises(ValidationError, match=r"plan\.stages"):
        TrainSpec(job_id="j", model=MODEL, plan=plan, seq_len=16, global_batch=12, steps=1)
    with pytest.raises(ValidationError, match=r"plan\.stages\[1\]\.last_layer"):
        stages = [{"cluster": "a", "first_layer": 0, "last_layer": 0}, {"cluster": "a", "first_layer": 1}]
        spec_from_dict({**spec_to_dict(spec), "plan": {"stages": stages, "micro_batches": 2}})


def test_worker_rejects_bad_specs_without_training(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"model": "gpt-tiny", "plan": {"stages": [], "micro_batches": 1}}))
    assert worker_main(["--spec", str(path), "--rank", "0"]) == 2
    event = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert event["event"] == "error" and "rendezvous" in event["message"]


def test_chunk_ranges_deal_layers_in_virtual_stage_order() -> None:
    model = ModelSpec(name="m", layers=10, hidden=32, heads=2, vocab=64)
    plan = Plan(stages=(Stage(cluster="a", first_layer=0, last_layer=4), Stage(cluster="b", first_layer=5,
                                                                               last_layer=9)),
                micro_batches=4, schedule=Schedule.INTERLEAVED_1F1B, extras={"chunks": 2.0})
    # Stage 0 keeps 5 layers as blocks of 3 + 2, stage 1 likewise; virtual order (c0,s0),(c0,s1),(c1,s0),(c1,s1).
    assert chunk_ranges(plan) == (((0, 2), (6, 7)), ((3, 5), (8, 9)))
    assert plan_chunks(plan) == 2
    flat = sorted(r for stage in chunk_ranges(plan) for r in stage)
    assert flat[0][0] == 0 and flat[-1][1] == 9 and all(a[1] + 1 == b[0] for a, b in itertools.pairwise(flat))
    one = Plan(stages=plan.stages, micro_batches=4, schedule=Schedule.ONE_F_ONE_B)
    assert chunk_ranges(one) == (((0, 4),), ((5, 9),))
    spec = TrainSpec(job_id="j", model=model, plan=Plan(stages=plan.stages, micro_batches=3,
                     schedule=Schedule.INTERLEAVED_1F1B), seq_len=8, global_batch=3, steps=1)
    with pytest.raises(PreconditionError, match="multiple of the stage count"):
        check_runnable(spec)
    thin = Plan(stages=(Stage(cluster="a", first_layer=0, last_layer=0), Stage(cluster="b", first_layer=1,
                                                                               last_layer=9)),
                micro_batches=4, schedule=Schedule.INTERLEAVED_1F1B)
    with pytest.raises(PreconditionError, match="fewer than 2 chunks"):
        check_runnable(TrainSpec(job_id="j", model=model, plan=thin, seq_len=8, global_batch=4, steps=1))
