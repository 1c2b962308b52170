"""The pure decision core: domain types, cost model, schedules, queueing, the scheduling cycle,
placement, planning (TPA), kernels and the simulator.

Nothing under this package imports gRPC, etcd, torch, the OS (``os``, ``pathlib``, ``subprocess``,
``socket``, ``shutil``, threads, processes) or any SpiderFlow adapter; ``tests/test_lint.py`` enforces it.
Adapters (store, rpc, security, exec, testbed, gateway proxy, CLI, SDK, mesh, services, agent) sit beside
it and call into it.
"""
