#!/usr/bin/env bash
# Rehearse the GPU machine's install on this CPU machine: does the wheelhouse miss anything?
#
# A Python 3.11 venv stands in for the GPU image: torch 2.13 CPU (the image has 2.11+cu130, which
# this machine cannot run), then, without their dependencies, the image's packages that
# scripts/gpu/needed.txt names or that the traced commands try to import, at the version
# image-packages.txt gives where a cp311 wheel of it exists, else the newest pip finds (what a
# fresh image has). The cp311 wheelhouse made by the same recipe is installed with the GPU
# machine's own line into /tmp/site, and every traced command runs with that interpreter.
#
#   scripts/gpu/rehearse-here.sh [SCRATCH]      (default /tmp/wheelhouse-rehearsal; about 4 min)
set -euo pipefail
cd "$(dirname "$0")/../.."
scratch=${1:-/tmp/wheelhouse-rehearsal}
venv=$scratch/venv
mkdir -p "$scratch"

if [ ! -x "$venv/bin/python" ]; then
  python3.11 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  # Alone and first: the CPU build on this machine's disk; otherwise pip pulls a CUDA build.
  "$venv/bin/python" -m pip install -q torch==2.13.0
fi

# The image's share: needed.txt names it, or a traced command tries it and the image has it
# ('image' in needed.txt's list of absent imports). Triton stays out: the image's pairs with its
# CUDA torch, and on this CPU torch it would only change what torch tries.
.venv/bin/python - "$scratch/image-share.txt" <<'EOF'
import re, sys
from packaging.utils import canonicalize_name
sys.path.insert(0, "scripts/gpu")
import wheelhouse as w

image, needed = w.read_image(), w.read_needed()
names = {n for n in needed if n in image} - {"torch"}
for line in w.NEEDED.read_text().splitlines():
    if m := re.match(r"#   (\S+) image ", line):
        names.add(canonicalize_name(m.group(1)))
names -= {"triton"}
with open(sys.argv[1], "w") as f:
    f.writelines(f"{n}=={image[n]}\n" if image[n] else f"{n}\n" for n in sorted(names))
EOF
cp "$scratch/image-share.txt" "$scratch/req.txt"
# A known version without a cp311 wheel (numpy 2.5.2 wants Python 3.12) falls back to the newest.
for _ in 1 2 3 4 5 6 7 8; do
  if out=$("$venv/bin/python" -m pip install -q --no-deps -r "$scratch/req.txt" 2>&1); then break; fi
  bad=$(grep -o 'No matching distribution found for [^ ]*' <<<"$out" | awk '{print $NF}' || true)
  [ -n "$bad" ] || { echo "$out" >&2; exit 1; }
  echo "[rehearse] no cp311 wheel of $bad: taking the newest ${bad%%==*}" >&2
  sed -i "s/^${bad}\$/${bad%%==*}/" "$scratch/req.txt"
done

rm -rf "$scratch/whl"
.venv/bin/python scripts/gpu/wheelhouse.py build --python-version 3.11 --out "$scratch/whl"

# The GPU machine's install line (device README), with this venv's python as python3.
rm -rf /tmp/site
"$venv/bin/python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$scratch"/whl/*.whl
rm -rf "$scratch/run"
PYTHONPATH=/tmp/site "$venv/bin/python" scripts/gpu/wheelhouse.py rehearse --workdir "$scratch/run"
