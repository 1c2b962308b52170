"""Asynchronous DCP saves on gloo (the CPU backend async_save needs): the state is staged when the save
starts (training may change it at once), the files are written in the background, and the manifest is built
only after every rank's write has finished and been hashed."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from spiderflow.core.catalog import model_preset
from spiderflow.core.domain import Plan, Stage
from spiderflow.exec import checkpoint as ckpt
from spiderflow.exec.spec import TrainSpec


def _spec(root: Path) -> TrainSpec:
    plan = Plan(stages=(Stage(cluster="a", first_layer=0, last_layer=5, dp=2),), micro_batches=2)
    return TrainSpec(job_id="t", model=model_preset("gpt-tiny"), plan=plan, seq_len=8, global_batch=2, steps=1,
                     checkpoint_dir=str(root), checkpoint_every=1)


def test_async_save_stages_then_commits_after_the_write(tmp_path: Path) -> None:
    """One gloo rank, in process (the multi-rank commit runs in the pipeline checkpoint tests, which save
    through the same path)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        spec = _spec(tmp_path / "ck")
        torch.manual_seed(0)
        mod = nn.Linear(4, 4)
        opt = torch.optim.Adam(mod.parameters())
        mod(torch.ones(1, 4)).sum().backward()
        opt.step()
        saver = ckpt.AsyncCheckpointer(spec, [[(0, 5)]])
        assert saver.why_sync is None  # gloo: asynchronous
        saved = {k: v.clone() for k, v in mod.state_dict().items()}
        assert saver.start(1, [mod], [opt]) is None  # in flight: nothing finished yet
        assert saver.pending_step == 1
        assert not (tmp_path / "ck" / "step-00000001" / ckpt.MANIFEST_NAME).exists()
        with torch.no_grad():  # training goes on at once: the staged copy must not see this
            for p in mod.parameters():
                p.add_(100.0)
        manifest = saver.finish()
        assert manifest is not None and saver.finish() is None and saver.pending_step is None
        assert manifest.step == 1 and ckpt.verify(manifest) is None
        assert {f.name for f in manifest.files} >= {".metadata"} and len(manifest.files) >= 2
        # The next save finishes the one in flight first and returns its manifest.
        assert saver.start(2, [mod], [opt]) is None
        second = saver.start(3, [mod], [opt])
        assert second is not None and second.step == 2
        assert saver.finish() is not None
        saver.close()
        fresh = nn.Linear(4, 4)
        fresh_opt = torch.optim.Adam(fresh.parameters())
        fresh(torch.ones(1, 4)).sum().backward()
        fresh_opt.step()
        ckpt.load_dcp(manifest, [fresh], [fresh_opt], spec.model)
        for k, v in saved.items():
            assert torch.equal(fresh.state_dict()[k], v), k  # the values at start(), not after
    finally:
        dist.destroy_process_group()
