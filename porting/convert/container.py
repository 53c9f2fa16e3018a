"""A container checkpoint (a vision-language class holding a family's language model): the
language model as its family reads it, everything else carried byte for byte.

Import reads the container's ``text_config`` as the family's config
(:meth:`porting.contract.container.Container.text_view`) and the language model's tensors under
the names of the family's text class (:class:`porting.convert.safetensors_io.RenamedSource`);
the other tensors (vision tower, projector) are copied into the checkpoint's
``hf_extra/carried/`` as stored (:func:`write_carried`), and the manifest records the container,
its ``config.json`` as it came and how it spells the language model's tensors (:func:`record`).
Export writes the container back (:class:`ExportedContainer`): the language model's tensors under
the names they came with, the carried ones as they were, and ``config.json`` with the text config
regenerated in place (:func:`container_config`). The gate's reference is the container class
itself, run on text (:func:`reference_config`). One mechanism for every family that names
containers (:attr:`porting.contract.family.Family.containers`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from porting.contract import hf_spelling
from porting.contract.container import Container, ContainerSource, renamed, reversed_pairs
from porting.contract.family import Family
from porting.convert.safetensors_io import (
    _RAW_TORCH,
    RenamedSource,
    SafetensorsSource,
    StreamingShardWriter,
)
from porting.errors import PortingError

CARRIED = "carried"  # under the checkpoint's hf_extra/


def container_config(
    held_config: dict, container: Container, now: dict, read: dict, where: str
) -> dict:
    """The container's ``config.json`` as export writes it: as it came, its text config too
    (a nested config keeps only the keys it was written with), but for a value of the language
    model's config (``now``, transformers 4.x's spelling) that differs from the one import read
    (``read``)."""
    out = copy.deepcopy(held_config)
    original = held_config[container.text_config]
    missing = object()
    changed = {k: v for k, v in now.items() if k != "architectures" and read.get(k, missing) != v}
    if changed:
        if hf_spelling.is_v5(original):
            raise PortingError(
                f"{where}: {', '.join(sorted(changed))} changed since import; the "
                f"{container.text_config} came in transformers 5's spelling and is written back "
                "only as it came"
            )
        out[container.text_config] = {**original, **copy.deepcopy(changed)}
    return out


def record(held: ContainerSource, weights: RenamedSource) -> dict:
    """The manifest's ``container``: what export needs to write the container back."""
    return {
        "architecture": held.container.architecture,
        "config": held.config,
        "spelling": [list(pair) for pair in weights.spelling],
    }


def of_manifest(family: Family, recorded: dict, where: str) -> tuple[Container, tuple]:
    """The family's container a manifest names and the spelling it recorded, both checked
    against the family (the manifest may be hostile: a spelling is only ever one the family
    declares)."""
    arch = recorded.get("architecture")
    container = next((c for c in family.containers if c.architecture == arch), None)
    if container is None:
        raise PortingError(
            f"{where}: container {arch!r:.80} is not one of family {family.name}'s "
            f"({', '.join(c.architecture for c in family.containers) or 'none'})"
        )
    spelling = tuple(tuple(p) for p in recorded.get("spelling") or ())
    if spelling not in container.spellings:
        raise PortingError(f"{where}: container spelling {spelling!r:.160} is not {arch}'s")
    if not isinstance(recorded.get("config"), dict):
        raise PortingError(f"{where}: container config must be an object")
    return container, spelling


def unapplied_note(held: ContainerSource) -> str:
    """What of the text config the container class does not apply, said with the import."""
    text = held.config.get(held.container.text_config) or {}
    set_ = [f"{k}={text[k]!r}" for k in held.container.unapplied if text.get(k) is not None]
    if not set_:
        return ""
    return (
        f"; {', '.join(set_)} read as null: {held.container.architecture} does not apply it "
        "(written back as it came)"
    )


def carried_dir(meta: Path) -> Path:
    """Where a checkpoint keeps a container's carried tensors (``meta``: its layout's folder of
    our files, NeMo 2's ``context/``)."""
    return meta / "hf_extra" / CARRIED


def write_carried(weights: RenamedSource, dest: Path, allow_pickle: bool) -> int:
    """Copy every tensor of the container that is not its language model's into ``dest`` as
    stored (its dtype and bytes, quantized parts included); the count."""
    # the files' own tensors, with no dequantizing view: the carried ones go back as they came
    raw = SafetensorsSource(weights.dir, allow_pickle=allow_pickle, hf_config={})
    keys = [k for k in raw.keys() if renamed(k, weights.spelling) is None]
    if not keys:
        return 0
    specs = []
    for key in keys:
        name, path = raw.stored_dtype(key)
        if name not in _RAW_TORCH:
            raise PortingError(f"{path}: tensor {key!r} is {name}, which porting cannot carry")
        specs.append((key, raw.shape(key)[0], _RAW_TORCH[name]))
    dest.mkdir(parents=True, exist_ok=True)
    writer = StreamingShardWriter(dest, specs)
    for key in keys:
        writer.write(key, raw.get(key))
    writer.close()
    raw.close()
    return len(keys)


@dataclass
class ExportedContainer:
    """A checkpoint's container as export writes it back: the language model's tensors renamed
    to the spelling they came in, the carried tensors beside them."""

    container: Container
    spelling: tuple
    carried: object  # a SafetensorsSource over hf_extra/carried/, or None where none was carried

    @classmethod
    def of(cls, checkpoint, family: Family, recorded: dict) -> ExportedContainer:
        container, spelling = of_manifest(family, recorded, str(checkpoint.located.manifest_path))
        where = carried_dir(checkpoint.located.meta)
        carried = SafetensorsSource(where, hf_config={}) if where.is_dir() else None
        return cls(container, spelling, carried)

    def stored_name(self, key: str) -> str:
        """The name a language-model tensor (its family's text name) is written under."""
        name = renamed(key, reversed_pairs(self.spelling))
        if name is None:
            raise PortingError(
                f"export produced {key!r}, which no prefix of the {self.container.architecture} "
                "spelling it came in names"
            )
        return name

    def renamed(self, stored: list, parts: dict | None, mine: set | None, first: bool):
        """The writer's plan in the container's names, the carried tensors added (written by
        the ``first`` rank)."""
        name = self.stored_name
        stored = [(name(k), shape, dtype) for k, shape, dtype in stored]
        if parts:
            parts = {name(k): (name(into), at, shape) for k, (into, at, shape) in parts.items()}
        if mine is not None:
            mine = {name(k) for k in mine}
        carried = []
        if self.carried is not None:
            for key in self.carried.keys():
                dtype = _RAW_TORCH[self.carried.stored_dtype(key)[0]]
                carried.append((key, self.carried.shape(key)[0], dtype))
        if mine is not None and first:
            mine |= {k for k, _, _ in carried}
        return stored + carried, parts, mine

    def write_carried(self, writer) -> None:
        """Every carried tensor into its planned place, as stored."""
        if self.carried is None:
            return
        for key in self.carried.keys():
            writer.write(key, self.carried.get(key))


def reference_architecture(manifest) -> str:
    """The HF class a checkpoint's reference runs as: the container's, where it came in one
    (its language model run on text), else the one its family converted."""
    return manifest.container["architecture"] if manifest.container else manifest.hf_architecture


def reference_config(cls, held: ContainerSource, text: dict):
    """The installed transformers' config of the container class ``cls`` for the gate's
    reference: the container's own, its text config the one import read (``text``: complete,
    in transformers 4.x's spelling, which transformers 4.57 and 5 both read alike)."""
    view = {k: v for k, v in text.items() if k != "architectures"}
    return cls.config_class.from_dict({**held.config, held.container.text_config: view})
