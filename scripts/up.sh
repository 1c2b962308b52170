#!/usr/bin/env bash
# The main job: bootstrap, then `spiderflow up` (a local mesh trains a sample job and tears down).
# Arguments are passed to `spiderflow up` (see `spiderflow up --help`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
exec .venv/bin/spiderflow up "$@"
