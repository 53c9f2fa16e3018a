#!/usr/bin/env bash
# The GPU check in one command on the device machine (see scripts/gpu/README.md):
#   scripts/gpu/check.sh OUTDIR [--continue] [--budget-s S] [--tiny]
# Installs the carried wheelhouse (.whl/, made by scripts/gpu/wheelhouse.py) into a folder of its
# own ahead of the image's packages, then runs scripts/gpu/check.py from this checkout.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: scripts/gpu/check.sh OUTDIR [--continue] [--budget-s S] [--tiny]}
shift
python=${PYTHON:-python3}
wheels=${PORTING_WHEELHOUSE:-.whl}
site=/tmp/porting-site
if compgen -G "$wheels/*.whl" >/dev/null; then
  # once per machine: a --continue call on a warm machine finds it installed
  if [ ! -f "$site/.porting-installed" ]; then
    t=$(date +%s)
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "$wheels"/*.whl
    touch "$site/.porting-installed"
    echo "[check] installed $(ls "$wheels"/*.whl | wc -l) wheels in $(( $(date +%s) - t )) s"
  fi
  export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  # the image's real versions, for the next `wheelhouse.py build --image` (comes back with OUTDIR)
  mkdir -p "$out"
  PYTHONPATH= "$python" -m pip list --format=freeze >"$out/image-pip-freeze.txt" 2>/dev/null || true
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
exec "$python" scripts/gpu/check.py "$out" "$@"
