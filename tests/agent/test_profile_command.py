"""``spiderflow profile`` on a CPU node (real calibration and a real timed block, tiny shapes) and the
collective micro-benchmark on a one-rank gloo group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spiderflow.cli.main import main
from spiderflow.profile import parse_profile

pytestmark = pytest.mark.heavy


def test_profile_command_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "cpu.json"
    code = main(["profile", "--block", "64:4", "--micro-batches", "1,2", "--seq-lens", "32", "--seconds", "0.05",
                 "--out", str(out)])
    assert code == 0
    doc = json.loads(out.read_text())
    prof = parse_profile(doc)
    entry = prof.gpus["cpu"]
    assert entry.matmul_tflops["bf16"] > 0 and entry.mfu is not None  # the default precision, on CPU too
    assert [(b.micro_batch, b.seq_len) for b in entry.blocks] == [(1, 32), (2, 32)]
    assert all(b.forward_ms > 0 and b.backward_ms > 0 for b in entry.blocks)


def test_profile_command_refuses_bad_shapes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "--block", "64:5"]) == 2
    assert "--block" in capsys.readouterr().err
    assert main(["profile", "--seq-lens", "0"]) == 2
    assert "--seq-lens" in capsys.readouterr().err


def test_collectives_on_a_one_rank_gloo_group(tmp_path: Path) -> None:
    import torch.distributed as dist

    from agent.profiler import measure_collectives

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        figures = measure_collectives(nbytes=1 << 16, repeats=2)
    finally:
        dist.destroy_process_group()
    assert figures["allreduce_gbps"] == 0.0 and figures["p2p_gbps"] == 0.0 and figures["latency_us"] > 0
