"""Reading a Megatron-LM or Megatron-Bridge checkpoint that `porting` did not write.

Such a checkpoint has no ``porting/`` directory: the user names the HF ``config.json`` of its
architecture (``--hf-config``); the family claiming it gives the Megatron config, which is checked
against what the checkpoint saved and against its tensors before anything is built
(:func:`foreign_manifest`), and the checkpoint is then read as if that manifest were inside it
(:func:`reading`, :func:`porting.convert.checkpoint.adopt`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from pathlib import Path

from porting.convert.checkpoint import FORMATS, Located, locate
from porting.convert.layouts import check_saved_shape
from porting.errors import PortingError


def foreign_manifest(loc: Located, hf_config: Path, tokenizer: Path | None):
    """A manifest for a Megatron checkpoint we did not write, from the HF ``config.json`` of its
    architecture (``hf_config``: the file or the directory holding it).

    The family is the one claiming that config; its Megatron config is checked against what the
    checkpoint saved (layers, widths, heads, norm) and against its tensors before anything is
    built. The padded vocabulary is the embedding's rows, the dtype the embedding's.
    """
    from porting.convert.checkpoint import Adopted, Manifest
    from porting.convert.dist_reader import DistCheckpointReader
    from porting.convert.megatron import build_config, dtype_name
    from porting.registry import family_for_hf_dir

    hf_config = Path(hf_config)
    if hf_config.is_file():
        if hf_config.name != "config.json":
            raise PortingError(f"{hf_config}: give an HF config.json (or the directory holding it)")
        hf_config = hf_config.parent
    family, cfg = family_for_hf_dir(hf_config)
    where = hf_config / "config.json"
    reader = DistCheckpointReader(loc.weights)
    emb = loc.prefix + "embedding.word_embeddings.weight"
    if emb not in reader.keys():
        raise PortingError(f"{loc.weights}: no {emb!r}; not a GPT checkpoint")
    padded = reader.global_shape(emb)[0]
    dtype = reader.dtype(emb)
    config, _ = build_config(family, cfg, dtype, 1, padded_vocab_size=padded)
    check_saved_shape(loc, config, f"{where} ({family.name})")
    vocab = cfg.get("vocab_size")
    if not isinstance(vocab, int) or vocab > padded:
        raise PortingError(
            f"{where}: vocab_size {vocab!r} does not fit the checkpoint's {padded} embedding rows"
        )
    manifest = Manifest(
        family=family.name,
        hf_architecture=cfg["architectures"][0],
        hf_config=cfg,
        vocab_size=vocab,
        padded_vocab_size=padded,
        dtype=dtype_name(dtype),
    )
    if tokenizer is None and any(hf_config.glob("tokenizer*")):
        tokenizer = hf_config  # the HF directory the config came from carries its tokenizer
    return Adopted(
        manifest, Path(tokenizer) if tokenizer else None, f"{where} (--hf-config)", hf_config
    )


def add_source_flags(p) -> None:
    """``--format``, ``--hf-config`` and ``--tokenizer``: how a command reads its checkpoint."""
    p.add_argument(
        "--format",
        dest="src_format",
        choices=FORMATS,
        help="the checkpoint's layout (default: found from the directory; docs/formats.md)",
    )
    p.add_argument(
        "--hf-config",
        type=Path,
        metavar="PATH",
        help="for a Megatron-LM or Megatron-Bridge checkpoint not written by porting: the HF "
        "config.json of its architecture (or the directory holding it); checked against the "
        "checkpoint's saved arguments and tensors. Nothing is fetched",
    )
    p.add_argument(
        "--tokenizer",
        type=Path,
        metavar="DIR",
        help="with --hf-config: the HF tokenizer directory to carry (default: the --hf-config "
        "directory's tokenizer files, if any)",
    )


@contextlib.contextmanager
def reading(ckpt, fmt: str | None = None, hf_config=None, tokenizer=None):
    """Read the checkpoint ``ckpt`` for the block: its layout checked against ``fmt``, and a
    checkpoint trained elsewhere adopted with ``hf_config`` (:func:`foreign_manifest`)."""
    from porting.convert.checkpoint import adopt

    loc = locate(ckpt, fmt)
    if hf_config is None:
        if tokenizer is not None:
            raise PortingError("--tokenizer goes with --hf-config (a checkpoint trained elsewhere)")
        yield loc
        return
    if loc.manifest_path.exists():
        raise PortingError(
            f"{ckpt}: carries its own {loc.manifest_path.name}; --hf-config is for checkpoints "
            "trained elsewhere"
        )
    if loc.format == "nemo2":
        raise PortingError(f"{ckpt}: a NeMo 2 checkpoint is read from its manifest only")
    stand_in = foreign_manifest(loc, hf_config, tokenizer)
    with tempfile.TemporaryDirectory(prefix="porting-tokenizer-") as staging:
        if stand_in.tokenizer_dir is not None:
            stand_in = dataclasses.replace(
                stand_in, tokenizer_dir=_tokenizer_files_of(stand_in.tokenizer_dir, Path(staging))
            )
        with adopt(ckpt, stand_in):
            yield loc


def _tokenizer_files_of(src: Path, staging: Path) -> Path:
    """The tokenizer of the HF directory ``src``, as ``transformers`` saves it into ``staging``:
    only its own files (never the weights or the config beside them)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
    except (OSError, ValueError) as err:
        raise PortingError(f"{src}: no usable tokenizer ({err})") from err
    tok.save_pretrained(str(staging))
    return staging
