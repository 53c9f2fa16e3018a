"""Our ``porting.json``: what a checkpoint written by ``porting import`` records beside its layout's
own files (the family, the original HF ``config.json``, the vocabulary padding, the weight dtype,
where the tokenizer lives). With it, export needs no HF model and no hub.

Data only: the layouts (:mod:`porting.convert.layouts`) write it where each keeps our files, and
:func:`porting.convert.checkpoint.open_checkpoint` reads it back.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from porting.errors import PortingError

MANIFEST = "porting.json"
FORMAT = "porting-nemo2"
VERSION = 1
# HF files other than weights, config and tokenizer that export should hand back unchanged.
EXTRA_HF_FILES = ("generation_config.json", "preprocessor_config.json", "processor_config.json")
_DTYPE_NAMES = ("float32", "bfloat16", "float16")


@dataclass
class Manifest:
    """What ``porting.json`` records."""

    family: str
    hf_architecture: str
    hf_config: dict
    vocab_size: int
    padded_vocab_size: int
    dtype: str
    tokenizer: dict = field(default_factory=dict)
    extra_files: list[str] = field(default_factory=list)
    # HF tensors the source stored in float32 beside weights of ``dtype`` (Family.fp32_tensors)
    fp32_tensors: list[str] = field(default_factory=list)
    # the source's config.json as it came, where transformers 5 spelled it (hf_config holds the
    # 4.x spelling everything reads; export writes this form back: porting.contract.hf_spelling)
    hf_config_as_written: dict | None = None
    # "stacked" where the source stored a mixture of experts' tensors as transformers 5 does with
    # save_original_format=False (export writes that form back unless asked otherwise)
    hf_experts: str | None = None
    # a vision-language container holding the family's language model: its class, config.json
    # as it came and how it spells the language model's tensors (porting.convert.container);
    # hf_config is then the language model's config, the other tensors are in hf_extra/carried/
    container: dict | None = None
    format: str = FORMAT
    version: int = VERSION


def write_manifest(
    ckpt: str | os.PathLike, manifest: Manifest, meta: str | os.PathLike | None = None
) -> None:
    """Write ``porting.json`` (atomically) into ``meta``: by default the NeMo 2 ``context/``."""
    path = Path(meta if meta is not None else Path(ckpt) / "context") / MANIFEST
    tmp = path.with_suffix(".json.tmp")
    data = asdict(manifest)
    for name in ("hf_config_as_written", "hf_experts", "container"):  # unset: as before it
        if data[name] is None:
            del data[name]
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def check_manifest(data, path: Path) -> Manifest:
    """A :class:`Manifest` from parsed JSON, every field checked (the file may be hostile)."""

    def bad(field_name: str, why: str) -> PortingError:
        return PortingError(f"{path}: field {field_name!r} {why}")

    if not isinstance(data, dict):
        raise PortingError(f"{path}: not a JSON object")
    if data.get("format") != FORMAT:
        raise PortingError(f"{path}: unknown format {data.get('format')!r}")
    known = set(Manifest.__dataclass_fields__)
    unknown = sorted(set(data) - known)
    if unknown:
        raise PortingError(f"{path}: unknown field(s) {', '.join(unknown)}")
    for name in ("family", "hf_architecture", "dtype"):
        if not isinstance(data.get(name), str):
            raise bad(name, "must be a string")
    if not isinstance(data.get("hf_config"), dict):
        raise bad("hf_config", "must be an object")
    for name in ("vocab_size", "padded_vocab_size", "version"):
        v = data.get(name)
        if type(v) is not int or v <= 0:
            raise bad(name, f"must be a positive integer, not {v!r}")
    if data["version"] > VERSION:
        raise bad("version", f"is {data['version']}; this porting reads up to {VERSION}")
    if data["padded_vocab_size"] < data["vocab_size"]:
        raise bad("padded_vocab_size", "is smaller than vocab_size")
    if data["dtype"] not in _DTYPE_NAMES:
        raise bad("dtype", f"must be one of {', '.join(_DTYPE_NAMES)}, not {data['dtype']!r}")
    tok = data.get("tokenizer", {})
    if not isinstance(tok, dict) or set(tok) - {"kind", "path"}:
        raise bad("tokenizer", "must be an object with 'kind' and 'path'")
    if tok and (tok.get("kind") != "hf" or not isinstance(tok.get("path"), str)):
        raise bad("tokenizer", f"must be {{'kind': 'hf', 'path': DIR}}, not {tok!r}")
    extras = data.get("extra_files", [])
    if not isinstance(extras, list) or any(e not in EXTRA_HF_FILES for e in extras):
        raise bad("extra_files", f"may only list {', '.join(EXTRA_HF_FILES)}, not {extras!r}")
    fp32 = data.get("fp32_tensors", [])
    if not isinstance(fp32, list) or not all(isinstance(k, str) for k in fp32):
        raise bad("fp32_tensors", f"must be a list of tensor names, not {fp32!r:.80}")
    written = data.get("hf_config_as_written")
    if written is not None and not isinstance(written, dict):
        raise bad("hf_config_as_written", "must be an object")
    held = data.get("container")
    if held is not None and (
        not isinstance(held, dict)
        or set(held) != {"architecture", "config", "spelling"}
        or not isinstance(held["architecture"], str)
        or not isinstance(held["config"], dict)
        or not isinstance(held["spelling"], list)
        or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p)
            for p in held["spelling"]
        )
    ):
        raise bad("container", "must be {'architecture': NAME, 'config': {...}, 'spelling': "
                  "[[PREFIX, PREFIX], ...]}")  # fmt: skip
    if data.get("hf_experts") not in (None, "stacked"):
        raise bad("hf_experts", f"must be 'stacked' or absent, not {data['hf_experts']!r:.80}")
    return Manifest(**data)
