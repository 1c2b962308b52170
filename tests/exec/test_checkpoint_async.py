"""Asynchronous DCP saves on gloo (the CPU backend async_save needs): the state is staged when the save
starts (training may change it at once), the files are written in the background, and the manifest is built
only after every rank's write has finished and been hashed."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from spiderflow.catalog import model_preset
from spiderflow.domain import Plan, Stage
from spiderflow.exec import checkpoint as ckpt
from spiderflow.exec.spec import TrainSpec


def _spec(root: Path) -> TrainSpec:
    plan = Plan(stages=(Stage(cluster="a", first_layer=0, last_layer=5, dp=2),), micro_batches=2)
    return TrainSpec(job_id="t", model=model_preset("gpt-tiny"), plan=plan, seq_len=8, global_batch=2, steps=1,
                     checkpoint_dir=str(root), checkpoint_every=1)


def _rank(rank: int, root: str, out: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=2)
    try:
        spec = _spec(Path(root) / "ck")
        torch.manual_seed(0)  # replicated (data-parallel) state: DCP writes each value once
        mod = nn.Linear(4, 4)
        opt = torch.optim.Adam(mod.parameters())
        mod(torch.ones(1, 4)).sum().backward()
        opt.step()
        saver = ckpt.AsyncCheckpointer(spec, [[(0, 5)]])
        saved = {k: v.clone() for k, v in mod.state_dict().items()}
        assert saver.start(1, [mod], [opt]) is None  # in flight: nothing finished yet
        with torch.no_grad():  # training goes on at once: the staged copy must not see this
            for p in mod.parameters():
                p.add_(100.0)
        manifest = saver.finish()
        assert manifest is not None and saver.finish() is None
        saver.close()
        fresh = nn.Linear(4, 4)
        fresh_opt = torch.optim.Adam(fresh.parameters())
        fresh(torch.ones(1, 4)).sum().backward()
        fresh_opt.step()
        ckpt.load_dcp(manifest, [fresh], [fresh_opt], spec.model)
        same = all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())
        out.put((rank, saver.why_sync, same, ckpt.verify(manifest), len(manifest.files), manifest.step))
    finally:
        dist.destroy_process_group()


def test_async_save_stages_then_commits_after_every_rank(tmp_path: Path) -> None:
    ctx = mp.get_context("forkserver")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path), out)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank, why_sync, same, bad, n_files, step in got:
        assert why_sync is None, why_sync  # gloo: asynchronous
        assert same, f"rank {rank} loaded values changed after the save started"
        assert bad is None and step == 1
        assert n_files >= 2  # the metadata and the shard files, all hashed into the manifest
    assert (tmp_path / "ck" / "step-00000001" / ".metadata").exists()
