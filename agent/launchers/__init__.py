"""Launchers: how an agent starts its cluster's workers (local processes, Slurm, Kubernetes).

The contract is in :mod:`agent.launchers.base`; :func:`launcher_for` picks the one an agent's config
names (``launcher``: ``local``, ``slurm`` or ``kubernetes``).
"""

from __future__ import annotations

from agent.config import AgentConfig, SlurmConfig
from agent.launchers.base import (
    GroupResult,
    Launcher,
    LauncherKind,
    LaunchError,
    LaunchHandle,
    StageGroup,
    stage_groups,
)

__all__ = ["GroupResult", "LaunchError", "LaunchHandle", "Launcher", "LauncherKind", "StageGroup", "launcher_for",
           "stage_groups"]


def launcher_for(config: AgentConfig, *, host: str) -> Launcher:
    """The launcher ``config.launcher`` names, set up from its section (``host``: the agent's advertised
    host, where the rank-0 store listens). The Kubernetes client is imported only for ``kubernetes``."""
    kind = LauncherKind(config.launcher)
    if kind is LauncherKind.SLURM:
        from agent.launchers.slurm import SlurmLauncher

        return SlurmLauncher(config.slurm or SlurmConfig(), host=host)
    if kind is LauncherKind.KUBERNETES:
        from agent.launchers.kubernetes import KubernetesLauncher

        assert config.kubernetes is not None  # AgentConfig requires the section
        return KubernetesLauncher(config.kubernetes, host=host,
                                  checkpoint_dir=config.checkpoint_dir)
    from agent.launchers.local import LocalLauncher

    return LocalLauncher(host=host)
