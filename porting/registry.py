"""The family registry, keyed by the HF ``architectures[0]`` name.

Each value is the module that defines the family's ``FAMILY`` object. The list is explicit so that
registration is never an import side effect; modules are imported only when a family is used, which
keeps NeMo (slow to import) out of commands that do not need it.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from porting.errors import PortingError
from porting.family import Family

FAMILIES: dict[str, str] = {
    "FalconForCausalLM": "converters.falcon",
    "LlamaForCausalLM": "converters.tsuzumi",
}


def known_architectures() -> list[str]:
    """The HF architecture names we can convert."""
    return sorted(FAMILIES)


def family_for_architecture(arch: str) -> Family:
    """Return the family registered for ``arch`` or raise naming the known ones."""
    if arch not in FAMILIES:
        raise PortingError(
            f"unknown architecture {arch!r}; known: {', '.join(known_architectures())}"
        )
    return importlib.import_module(FAMILIES[arch]).FAMILY


def family_by_name(name: str) -> Family:
    """Return the family whose ``Family.name`` is ``name`` (used when reading our checkpoints)."""
    for arch in FAMILIES:
        fam = family_for_architecture(arch)
        if fam.name == name:
            return fam
    raise PortingError(f"unknown family {name!r}")


def read_hf_config(hf_dir: str | Path) -> dict:
    """Read and minimally validate ``config.json`` of an HF model directory."""
    path = Path(hf_dir) / "config.json"
    if not Path(hf_dir).is_dir():
        raise PortingError(f"{hf_dir}: not a directory")
    if not path.exists():
        raise PortingError(f"{path}: missing (is {hf_dir} a Hugging Face model directory?)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise PortingError(f"{path}: invalid JSON ({err})") from err
    archs = cfg.get("architectures")
    if not archs or not isinstance(archs, list):
        raise PortingError(f"{path}: no 'architectures' list; cannot tell the model family")
    return cfg


def family_for_hf_dir(hf_dir: str | Path) -> tuple[Family, dict]:
    """The family and parsed config of an HF model directory."""
    cfg = read_hf_config(hf_dir)
    return family_for_architecture(cfg["architectures"][0]), cfg
