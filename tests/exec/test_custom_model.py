"""The user's own architecture by entry point: measured on the meta device (parameters and FLOPs the
planner prices), and trained as a 2-stage pipeline equal to single-process training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from exec_harness import Launcher

from spiderflow.core.catalog import ModelFamily
from spiderflow.core.costmodel import layer_fwd_flops, stage_params
from spiderflow.core.domain import Plan, Stage
from spiderflow.exec.custom import measure_entry_point
from spiderflow.exec.data import SyntheticTokens, micro_batch
from spiderflow.exec.model import build_full
from spiderflow.exec.spec import TrainSpec
from spiderflow.formats import model_from_value

ROOT = str(Path(__file__).resolve().parents[2])
ENTRY = "tests.exec.usermodels.tinynet:build"  # importable from the repository root, as on the workers


@pytest.fixture(autouse=True)
def _root_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(ROOT)


def test_an_entry_point_is_measured_on_the_meta_device() -> None:
    from tests.exec.usermodels import tinynet

    model = model_from_value(measure_entry_point(ENTRY, seq_len=16))
    assert model.family is ModelFamily.CUSTOM
    assert (model.layers, model.hidden, model.vocab) == (tinynet.LAYERS, tinynet.HIDDEN, tinynet.VOCAB)
    embed, blocks, head = tinynet.build()
    assert model.embedding_params == sum(p.numel() for p in embed.parameters())
    assert model.params_per_layer == sum(p.numel() for p in blocks[0].parameters())
    assert model.total_params == sum(p.numel() for m in (embed, *blocks, head) for p in m.parameters())
    h = tinynet.HIDDEN
    assert model.measured is not None
    assert model.measured.layer_flops_per_token == pytest.approx(2 * (h * 2 * h) * 2)  # two matmuls
    assert layer_fwd_flops(model, 2, 16) == pytest.approx(2 * 16 * model.measured.layer_flops_per_token)
    assert stage_params(model, 0, model.layers - 1) == model.total_params


def test_an_entry_point_trains_as_a_two_stage_pipeline_equal_to_one_process(launcher: Launcher) -> None:
    model = model_from_value(measure_entry_point(ENTRY, seq_len=16))
    seq, batch, m, steps, lr = 16, 4, 2, 4, 3e-3
    plan = Plan(stages=(Stage(cluster="a", first_layer=0, last_layer=1), Stage(cluster="b", first_layer=2,
                                                                              last_layer=3)), micro_batches=m)
    spec = TrainSpec(job_id="custom", model=model, plan=plan, seq_len=seq, global_batch=batch, steps=steps, lr=lr)
    events = launcher.run(spec, 2)
    losses = [e["loss"] for e in events[1] if e["event"] == "step"]
    # the reference: one process, the whole user model, gradient accumulation over m micro-batches
    net = build_full(model, 0, max_seq_len=seq)
    opt = torch.optim.Adam(net.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    src = SyntheticTokens(vocab=model.vocab, seq_len=seq)
    ref = []
    for step in range(steps):
        total = 0.0
        for j in range(m):
            x, y = micro_batch(src, step=step, global_batch=batch, micro_batch_size=batch // m, index=j)
            loss = net(torch.from_numpy(x), torch.from_numpy(y))
            (loss / m).backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref.append(total / m)
    assert losses == pytest.approx(ref, rel=1e-5, abs=1e-6)
    assert losses[-1] < losses[0]
