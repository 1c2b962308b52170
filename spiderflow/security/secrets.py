"""Which secrets a process started by the agent inherits: none of the agent's own.

An agent holds credentials for the control plane (its bearer token, its TLS bundle) and, where it still
has them, for etcd (user, password, TLS bundle). A training worker needs none of them: it talks only to
its peers (torch.distributed) and writes its checkpoints and events locally, and a worker runs user
code. :func:`worker_environment` is the environment a worker is started with: the agent's, minus every
variable of :data:`SECRET_VARIABLES` and every ``ETCDCTL_*`` variable.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["SECRET_VARIABLES", "worker_environment"]

SECRET_VARIABLES = frozenset({
    "SPIDERFLOW_TOKEN", "SPIDERFLOW_TLS_DIR", "SPIDERFLOW_ETCD_USER", "SPIDERFLOW_ETCD_PASSWORD",
    "SPIDERFLOW_ETCD_TLS_DIR",
})


def worker_environment(base: Mapping[str, str], **extra: str) -> dict[str, str]:
    """``base`` without the agent's secrets, plus ``extra``."""
    env = {k: v for k, v in base.items() if k not in SECRET_VARIABLES and not k.startswith("ETCDCTL_")}
    env.update(extra)
    return env
