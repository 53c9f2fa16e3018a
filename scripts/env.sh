#!/usr/bin/env bash
# Creates or reuses the project virtualenv at .venv, installs what it needs, then runs one job:
#   scripts/env.sh demo   - the end-to-end demo (`porting demo`)
#   scripts/env.sh test   - the whole test suite
#   scripts/env.sh owners - only build or refresh .venv-owners (below)
#   scripts/env.sh -- CMD - any command inside the environment
# `test` also builds or reuses .venv-owners (Python 3.12, Megatron-LM's and Megatron-Bridge's own
# packages pinned in scripts/owners.lock), where the tests load our checkpoints with the owners'
# loaders (docs/formats.md), and installs Debian's Slurm (apt, as root) for the tests that submit
# to a local two-node cluster (scripts/slurm_local.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

owners_env() {
  local lock=scripts/owners.lock stamp=.venv-owners/.porting-installed want
  want=$(sha256sum "$lock" | cut -d' ' -f1)
  if [ -x .venv-owners/bin/python ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then return; fi
  local py="" candidate
  # A pyenv shim answers `command -v` for a version it does not select; ask each to run.
  for candidate in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python; do
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      py=$candidate
      break
    fi
  done
  if [ -z "$py" ]; then
    echo "[env] Python 3.12 not found (needed for .venv-owners: Megatron-Core 0.19, Megatron-Bridge)" >&2
    exit 1
  fi
  echo "[env] installing the owners' environment into .venv-owners (first run takes a few minutes)" >&2
  rm -rf .venv-owners
  "$py" -m venv .venv-owners
  .venv-owners/bin/python -m pip install -q --upgrade pip
  .venv-owners/bin/python -m pip install -q --no-deps -r "$lock"
  echo "$want" > "$stamp"
}

slurm_env() {
  # The tests submit to a real two-node Slurm that scripts/slurm_local.sh starts on this host.
  local tool missing=""
  for tool in munged slurmctld slurmd sbatch; do command -v "$tool" >/dev/null || missing=1; done
  [ -z "$missing" ] && return
  local pkgs="slurmctld slurmd slurm-client munge"
  if [ "$(id -u)" != 0 ]; then
    echo "[env] the Slurm tests need Debian's $pkgs: install them as root" >&2
    exit 1
  fi
  echo "[env] installing $pkgs (Debian's Slurm, for the tests' local cluster)" >&2
  export DEBIAN_FRONTEND=noninteractive
  # shellcheck disable=SC2086
  apt-get install -y -q --no-install-recommends $pkgs >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends $pkgs >/dev/null; }
}

stamp=.venv/.porting-installed
want=$(cat pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -x .venv/bin/python ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[env] installing into .venv (first run takes a few minutes)" >&2
  python3.11 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first: the CPU build on this machine's disk; otherwise a multi-GB CUDA build is pulled.
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -e '.[test]'
  echo "$want" > "$stamp"
fi

job=${1:-}
shift || true
case "$job" in
  demo) exec .venv/bin/porting demo "$@" ;;
  # Two workers, a file at a time, the longest files first (tests/conftest.py, docs/testing.md).
  # The tests start hundreds of interpreters; with bytecode kept, none compiles our modules again.
  test) owners_env; slurm_env; unset PYTHONDONTWRITEBYTECODE
    # the workers share the cores: a second OpenMP thread per process would only spin and wait
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    echo "[env] environments ready after ${SECONDS} s; the tests start" >&2
    # the wall time, whatever the verdict, so each landing shows the trend against CI's 90 min
    rc=0
    .venv/bin/python -m pytest -q -n "${PORTING_TEST_WORKERS:-2}" --dist loadfile \
      --no-loadscope-reorder "$@" || rc=$?
    echo "[env] wall time $((SECONDS / 60)) min $((SECONDS % 60)) s, set-up and tests (exit $rc)" >&2
    exit "$rc" ;;
  owners) owners_env ;;
  --) exec "$@" ;;
  *) echo "usage: scripts/env.sh demo|test|owners|-- CMD" >&2; exit 2 ;;
esac
