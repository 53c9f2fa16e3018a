"""Whether pyproject.toml's ranges admit a lock set's exact versions.

    python scripts/check_lock.py                      # this environment, as scripts/env.sh built it
    python scripts/check_lock.py scripts/locks/*.lock # the lock files themselves, no install needed

The package declares ranges (what the code supports); each lock set (scripts/locks/) pins one
tested closure. A lock is installed with --no-deps, so nothing but this check would notice a pin
outside porting's own range, or a requirement the lock forgot. With no argument it reads the
installed distributions; with lock files, their pins, each against the Python its header names.
The extras checked are those the lock's environment is for: `current` carries `bridge`, `ray`
and `test`, `nemo2` carries `nemo2`, `ray` and `test` (ENV_EXTRAS). Exits 1 naming every unmet
requirement.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
# lock name -> (its Python, the extras its environment installs porting with)
ENV_EXTRAS = {
    "current": ("3.12", ("bridge", "ray", "test")),
    "nemo2": ("3.11", ("nemo2", "ray", "test")),
}


def requirements(extras: tuple[str, ...], pyproject: Path = ROOT / "pyproject.toml") -> list:
    """porting's own requirements and those of ``extras``, parsed."""
    project = tomllib.loads(pyproject.read_text())["project"]
    texts = list(project["dependencies"])
    for extra in extras:
        texts += project["optional-dependencies"][extra]
    return [Requirement(t) for t in texts]


def read_lock(path: Path) -> dict[str, str]:
    """``{canonical name: version}`` of a lock file's ``name==version`` lines."""
    pins = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)(\[[^\]]*\])?==([^\s;]+)", line)
        if m is None:
            raise ValueError(f"{path}:{n}: {line!r} is not name==version")
        pins[canonicalize_name(m[1])] = m[3]
    return pins


def unmet(reqs: list, pins: dict[str, str], python: str) -> list[str]:
    """Each requirement ``pins`` (name -> version) leaves unmet under ``python``, said."""
    env = {"python_version": python, "python_full_version": f"{python}.0", "extra": ""}
    said = []
    for req in reqs:
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonicalize_name(req.name)
        version = pins.get(name)
        if version is None:
            said.append(f"{req}: not in the set")
        elif not req.specifier.contains(Version(version), prereleases=True):
            said.append(f"{req}: the set has {version}")
    return said


def installed() -> dict[str, str]:
    from importlib import metadata

    return {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}


def main(argv: list[str]) -> int:
    checks = []
    if argv:
        for arg in argv:
            path = Path(arg)
            python, extras = ENV_EXTRAS[path.stem]
            checks.append((str(path), read_lock(path), python, extras))
    else:
        python = f"{sys.version_info.major}.{sys.version_info.minor}"
        name = next(k for k, (py, _) in ENV_EXTRAS.items() if py == python)
        checks.append((sys.prefix, installed(), python, ENV_EXTRAS[name][1]))
    bad = 0
    for where, pins, python, extras in checks:
        for line in unmet(requirements(extras), pins, python):
            print(f"{where}: {line}", file=sys.stderr)
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
