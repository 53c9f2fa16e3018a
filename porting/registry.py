"""The family registry, keyed by the HF ``architectures[0]`` name.

Each value is the family's converter module, which defines its ``FAMILY`` object and registers its
NeMo ``io.ModelConnector`` importer/exporter on the model class. This is the one place that imports
converters: user code that calls ``llm.import_ckpt`` / ``llm.export_ckpt`` imports the converter
module itself (``import converters.tsuzumi``) or goes through :func:`family_for_architecture`.
Modules are imported only when a family is used, which keeps NeMo (slow to import) out of
commands that do not need it.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from porting.convert.config_map import read_hf_config
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


def family_for_hf_dir(hf_dir: str | Path) -> tuple[Family, dict]:
    """The family and parsed config of an HF model directory (errors name its ``config.json``)."""
    cfg = read_hf_config(hf_dir)  # checks that architectures holds exactly one name
    try:
        return family_for_architecture(cfg["architectures"][0]), cfg
    except PortingError as err:
        raise PortingError(f"{Path(hf_dir) / 'config.json'}: architectures: {err}") from err
