#!/usr/bin/env bash
# Creates or reuses the project's two environments, each from its lock set (scripts/locks/,
# docs/environments.md), with porting installed into it, then runs one job:
#   scripts/env.sh demo        - the end-to-end demo (`porting demo`) on the current stack
#   scripts/env.sh test        - the whole test suite: every test on the NeMo 2 stack, and the
#                                files tests/conftest.py lists for the current stack there too
#   scripts/env.sh current     - only build or refresh .venv (below)
#   scripts/env.sh nemo2       - only build or refresh .venv-nemo2 (below)
#   scripts/env.sh -- CMD      - any command with .venv/bin first on the PATH
#   scripts/env.sh nemo2 -- CMD - the same in .venv-nemo2
# .venv is `current` (the default): Python 3.12, Megatron-Core 0.19, Megatron-Bridge 0.6,
# transformers 5. .venv-nemo2 is `nemo2`: Python 3.11, NeMo 2.7.3, Megatron-Core 0.15,
# transformers 4.57, for training with NeMo 2 and NeMo 2's own loader. `test` also installs
# Debian's Slurm (apt, as root) for the tests that submit to a local two-node cluster
# (scripts/slurm_local.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

python_of() {
  # A pyenv shim answers `command -v` for a version it does not select; ask each to run.
  local want=$1 candidate
  for candidate in "python$want" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$want".*/bin/python; do
    if "$candidate" -c "import sys; assert sys.version_info[:2] == tuple(map(int, '$want'.split('.')))" 2>/dev/null; then
      echo "$candidate"
      return
    fi
  done
  echo "[env] Python $want not found (needed for $2)" >&2
  exit 1
}

build_env() {
  # DIR LOCK PYTHON-VERSION: the lock's exact versions with --no-deps (a lock is a whole closure:
  # megatron-bridge declares one that does not install on a CPU), then porting itself, editable;
  # rebuilt whenever the lock or pyproject.toml changes.
  local dir=$1 lock=$2 version=$3 stamp want py
  stamp=$dir/.porting-installed
  want=$(cat "$lock" pyproject.toml | sha256sum | cut -d' ' -f1)
  if [ -x "$dir/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then return; fi
  py=$(python_of "$version" "$dir")
  echo "[env] installing $lock into $dir (first run takes a few minutes)" >&2
  # measured: .venv 6.4 GB (torch's CUDA build and its nvidia libraries), .venv-nemo2 2.9 GB, and
  # pip unpacks each wheel beside its install; said before pip fails on it mid-way
  local free_gb
  free_gb=$(df -Pk . | awk 'NR == 2 {print int($4 / 1048576)}')
  if [ "${free_gb:-0}" -lt 10 ]; then
    echo "[env] only ${free_gb} GB free here; $dir takes up to 7 GB and pip's unpacked wheels" \
      "more: the install may run out of space" >&2
  fi
  rm -rf "$dir"
  "$py" -m venv "$dir"
  "$dir/bin/python" -m pip install -q --upgrade pip
  # torch first, alone: the build on this machine's disk; otherwise a multi-GB CUDA build is pulled
  "$dir/bin/python" -m pip install -q "$(grep -E '^torch==' "$lock")"
  "$dir/bin/python" -m pip install -q --no-deps -r "$lock"
  # (setuptools warns every editable build that a folder named like the package may shadow it:
  # here that folder is the package)
  PYTHONWARNINGS=ignore "$dir/bin/python" -m pip install -q --no-deps -e .
  # every requirement porting declares is met by the lock (pip check would also report what
  # megatron-bridge declares and the lock leaves out on purpose)
  "$dir/bin/python" scripts/check_lock.py
  echo "$want" > "$stamp"
}

current_env() { build_env .venv scripts/locks/current.lock 3.12; }
nemo2_env() { build_env .venv-nemo2 scripts/locks/nemo2.lock 3.11; }

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

job=${1:-}
shift || true
case "$job" in
  demo) current_env; exec .venv/bin/porting demo "$@" ;;
  # Two workers, a file at a time, the longest files first (tests/conftest.py, docs/testing.md).
  # The tests start hundreds of interpreters; with bytecode kept, none compiles our modules again.
  test) nemo2_env; current_env; slurm_env; unset PYTHONDONTWRITEBYTECODE
    # the workers share the cores: a second OpenMP thread per process would only spin and wait
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    echo "[env] environments ready after ${SECONDS} s; the tests start" >&2
    # the wall time, whatever the verdict, so each landing shows the trend against CI's 90 min
    rc=0
    .venv-nemo2/bin/python -m pytest -q -n "${PORTING_TEST_WORKERS:-2}" --dist loadfile \
      --no-loadscope-reorder "$@" || rc=$?
    # 5: pytest collected nothing, which is right when the files asked for are the current stack's
    none=""
    if [ "$rc" = 5 ] && [ $# -gt 0 ]; then
      echo "[env] none of the tests asked for runs on the nemo2 stack" >&2
      rc=0 none=1
    fi
    echo "[env] the current stack's files (.venv, tests/conftest.py: CURRENT_STACK_FILES)" >&2
    # its own report beside a --junitxml one, so that neither run overwrites the other's
    args=()
    for arg in "$@"; do
      if [[ $arg == --junitxml=* ]]; then
        path=${arg#--junitxml=}
        arg="--junitxml=$(dirname "$path")/current-$(basename "$path")"
      fi
      args+=("$arg")
    done
    crc=0
    .venv/bin/python -m pytest -q -n "${PORTING_TEST_WORKERS:-2}" --dist loadfile \
      --no-loadscope-reorder "${args[@]}" || crc=$?
    # 5: pytest collected nothing, which is right when the files asked for are nemo2's only
    if [ "$crc" = 5 ] && [ -n "$none" ]; then
      echo "[env] none of the tests asked for runs on either stack" >&2
      rc=5
    elif [ "$crc" = 5 ] && [ $# -gt 0 ]; then
      echo "[env] none of the tests asked for runs on the current stack" >&2
    elif [ "$crc" != 0 ]; then rc=$crc; fi
    echo "[env] wall time $((SECONDS / 60)) min $((SECONDS % 60)) s, set-up and tests (exit $rc)" >&2
    exit "$rc" ;;
  current) current_env ;;
  nemo2) nemo2_env
    if [ "${1:-}" = "--" ]; then shift; PATH="$PWD/.venv-nemo2/bin:$PATH" exec "$@"; fi ;;
  --) current_env; PATH="$PWD/.venv/bin:$PATH" exec "$@" ;;
  *) echo "usage: scripts/env.sh demo|test|current|nemo2|-- CMD|nemo2 -- CMD" >&2; exit 2 ;;
esac
