"""The emulated multi-region testbed: network namespaces per cluster, kernel-shaped bandwidth, a
user-space delay relay for latency (see :mod:`spiderflow.testbed.netns` for the contract)."""

from spiderflow.testbed.layout import CLUSTER_IFACE, Layout, PairShaping, pair_figures, plan_layout
from spiderflow.testbed.netns import (
    DEFAULT_RELAY_PORT,
    Testbed,
    TestbedError,
    check_environment,
    cleanup,
    default_state_dir,
    list_testbeds,
)

__all__ = [
    "CLUSTER_IFACE",
    "DEFAULT_RELAY_PORT",
    "Layout",
    "PairShaping",
    "Testbed",
    "TestbedError",
    "check_environment",
    "cleanup",
    "default_state_dir",
    "list_testbeds",
    "pair_figures",
    "plan_layout",
]
