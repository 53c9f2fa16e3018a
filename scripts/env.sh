#!/usr/bin/env bash
# Creates or reuses the project virtualenv at .venv, installs what it needs, then runs one job:
#   scripts/env.sh demo   - the end-to-end demo (`porting demo`)
#   scripts/env.sh test   - the whole test suite
#   scripts/env.sh -- CMD - any command inside the environment
set -euo pipefail
cd "$(dirname "$0")/.."

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
  test) exec .venv/bin/python -m pytest -q "$@" ;;
  --) exec "$@" ;;
  *) echo "usage: scripts/env.sh demo|test|-- CMD" >&2; exit 2 ;;
esac
