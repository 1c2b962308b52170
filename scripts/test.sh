#!/usr/bin/env bash
# The test command: bootstrap, then lint, type-check and run the whole suite against real parts
# (etcd processes, gRPC servers on ports, torch.distributed workers, network namespaces when root).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
exec .venv/bin/python -m pytest "$@"
