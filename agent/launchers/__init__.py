"""Launchers: how an agent starts its cluster's workers (local processes, Slurm, Kubernetes).

The contract is in :mod:`agent.launchers.base`; :func:`launcher_for` picks the one an agent's config
names (``launcher``: ``local``, ``slurm`` or ``kubernetes``).
"""

from __future__ import annotations

from agent.launchers.base import (
    GroupResult,
    Launcher,
    LauncherKind,
    LaunchError,
    LaunchHandle,
    StageGroup,
    stage_groups,
)

__all__ = ["GroupResult", "LaunchError", "LaunchHandle", "Launcher", "LauncherKind", "StageGroup", "stage_groups"]
