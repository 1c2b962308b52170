#!/usr/bin/env bash
# Idempotent setup: system packages (etcd, iproute2, iptables) when missing, a virtualenv in .venv with
# the pinned dependencies of requirements.lock.txt, and this project installed in editable mode.
# Sourced by scripts/up.sh and scripts/test.sh; safe to run again (it only does what is missing).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

need_apt=()
command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server etcd-client)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
command -v iptables >/dev/null 2>&1 || need_apt+=(iptables)
command -v setpriv >/dev/null 2>&1 || need_apt+=(util-linux)
# Validates deploy/compose files in the tests (no Docker engine needed).
command -v docker-compose >/dev/null 2>&1 || need_apt+=(docker-compose)
# A real single-node Slurm cluster for the slurm launcher's tests (tests/launchers: munge, slurmctld, slurmd).
command -v munged >/dev/null 2>&1 || [ -x /usr/sbin/munged ] || need_apt+=(munge)
command -v slurmctld >/dev/null 2>&1 || [ -x /usr/sbin/slurmctld ] || need_apt+=(slurmctld)
command -v slurmd >/dev/null 2>&1 || [ -x /usr/sbin/slurmd ] || need_apt+=(slurmd)
command -v sbatch >/dev/null 2>&1 || need_apt+=(slurm-client)
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)
command -v chromedriver >/dev/null 2>&1 || need_apt+=(chromium-driver)
if [ "${#need_apt[@]}" -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "bootstrap: installing ${need_apt[*]}" >&2
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  else
    echo "bootstrap: please install: ${need_apt[*]} (apt-get needs root)" >&2
    exit 1
  fi
fi

PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv" >&2
  "$PY" -m venv .venv
fi
stamp=.venv/.spiderflow-deps
want="$(sha256sum requirements.lock.txt pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "bootstrap: installing pinned dependencies (first run takes a few minutes)" >&2
  .venv/bin/pip install -q --disable-pip-version-check -r requirements.lock.txt 2>&1 | grep -v '^WARNING: Location' || true
  .venv/bin/pip install -q --disable-pip-version-check --no-deps -e . 2>&1 | grep -v '^WARNING: Location' || true
  .venv/bin/python -c "import grpc, torch, ortools, aetcd, spiderflow" \
    || { echo "bootstrap: dependency installation failed" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
