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

from porting.convert.layouts import check_saved_shape
from porting.convert.layouts.base import Located
from porting.convert.layouts.registry import LAYOUTS, NAMES, locate
from porting.errors import PortingError


def foreign_manifest(loc: Located, hf_config: Path, tokenizer: Path | None):
    """A manifest for a Megatron checkpoint we did not write, from the HF ``config.json`` of its
    architecture (``hf_config``: the file or the directory holding it).

    The family is the one claiming that config; its Megatron config is checked against what the
    checkpoint saved (layers, widths, heads, norm) and against its tensors before anything is
    built. The padded vocabulary is the embedding's rows, the dtype the embedding's.
    """
    from porting.convert.checkpoint import Adopted
    from porting.convert.dist_reader import DistCheckpointReader
    from porting.convert.hf_files import family_for_hf_dir, read_hf_config_as_written
    from porting.convert.manifest import Manifest
    from porting.convert.megatron import build_config, dtype_name

    hf_config = Path(hf_config)
    if hf_config.is_file():
        if hf_config.name != "config.json":
            raise PortingError(f"{hf_config}: give an HF config.json (or the directory holding it)")
        hf_config = hf_config.parent
    family, cfg = family_for_hf_dir(hf_config)
    where = hf_config / "config.json"
    written = read_hf_config_as_written(hf_config)[1]  # a 5.x config goes back out as it came
    reader = DistCheckpointReader(loc.weights)
    emb = loc.prefix + "embedding.word_embeddings.weight"
    if emb not in reader.keys():
        raise PortingError(f"{loc.weights}: no {emb!r}; not a GPT checkpoint")
    padded = reader.global_shape(emb)[0]
    dtype = reader.dtype(emb)
    config, _ = build_config(family, cfg, dtype, 1, padded_vocab_size=padded)
    check_saved_shape(loc, config, f"{where} ({family.name})", family)
    vocab = cfg["vocab_size"]  # a positive integer: the family's config map checked it
    check_vocabulary(loc, vocab, padded, where, family)
    manifest = Manifest(
        family=family.name,
        hf_architecture=cfg["architectures"][0],
        hf_config=cfg,
        vocab_size=vocab,
        padded_vocab_size=padded,
        dtype=dtype_name(dtype),
        hf_config_as_written=written,
    )
    if tokenizer is None and any(hf_config.glob("tokenizer*")):
        tokenizer = hf_config  # the HF directory the config came from carries its tokenizer
    return Adopted(
        manifest, Path(tokenizer) if tokenizer else None, f"{where} (--hf-config)", hf_config
    )


def check_vocabulary(loc: Located, vocab: int, rows: int, where, family=None) -> None:
    """The HF config's ``vocab`` against the ``rows`` of the checkpoint's embedding (``where``:
    the config's file, for messages).

    Megatron pads the vocabulary it trains with to a multiple of make_vocab_size_divisible_by x
    tensor_model_parallel_size (Megatron-LM ``_vocab_size_with_padding``, Megatron-Bridge
    ``calculate_padded_vocab_size`` unless ``should_pad_vocab`` is off), and export keeps the
    config's first ``vocab`` rows. Where the checkpoint saved both numbers, its rows must be
    ``vocab`` itself or ``vocab`` padded so: a config whose vocabulary pads to fewer rows is smaller
    than the one trained, and export would drop the rows of real tokens (whose ids then fail on
    every rank). Otherwise ``vocab`` must at least fit the rows.
    """
    from porting.convert.megatron import padded_vocab

    if vocab > rows:
        raise PortingError(
            f"{where}: vocab_size {vocab} does not fit the checkpoint's {rows} embedding rows"
        )
    saved, source = loc.layout.saved_config(loc, family)
    divisor = saved.get("make_vocab_size_divisible_by")
    tp = saved.get("tensor_model_parallel_size")
    counts = all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (divisor, tp))
    if saved.get("should_pad_vocab") is False or not counts:
        return
    padded = padded_vocab(vocab, divisor * tp)
    if rows not in (vocab, padded):
        raise PortingError(
            f"{where}: vocab_size {vocab} pads to {padded} rows with {source}'s "
            f"make_vocab_size_divisible_by {divisor} x tensor_model_parallel_size {tp}, but the "
            f"checkpoint's embedding has {rows}: it was trained with another vocabulary; give the "
            "config of that one"
        )


def add_source_flags(p) -> None:
    """``--format``, ``--hf-config`` and ``--tokenizer``: how a command reads its checkpoint."""
    p.add_argument(
        "--format",
        dest="src_format",
        choices=NAMES,
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


def source_inputs(what: str, ckpt: Path, args) -> list[tuple[str, Path]]:
    """Every path a command with :func:`add_source_flags` reads, for
    :func:`porting.guard.check_outputs`: the checkpoint ``ckpt`` (and its root, given a part that
    a layout accepts in its place, one iteration directory: the tracker and our manifest are read
    there), ``--hf-config`` as the
    directory it is read from (its tokenizer files are carried) and ``--tokenizer``."""
    ckpt = Path(ckpt)
    inputs = [(what, ckpt)]
    root = next(filter(None, (layout.root_of(ckpt) for layout in LAYOUTS)), None)
    if root is not None:
        inputs.append((what, root))
    if args.hf_config is not None:
        config = Path(args.hf_config)
        inputs.append(("--hf-config", config.parent if config.is_file() else config))
    if args.tokenizer is not None:
        inputs.append(("--tokenizer", Path(args.tokenizer)))
    return inputs


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
    if not loc.layout.adoptable:
        raise PortingError(
            f"{ckpt}: a {loc.layout.title} checkpoint is read from its manifest only"
        )
    stand_in = foreign_manifest(loc, hf_config, tokenizer)
    with tempfile.TemporaryDirectory(prefix="porting-tokenizer-") as staging:
        if stand_in.tokenizer_dir is not None:
            files = _tokenizer_files_of(
                stand_in.tokenizer_dir, Path(staging), stand_in.manifest.vocab_size, stand_in.source
            )
            stand_in = dataclasses.replace(stand_in, tokenizer_dir=files)
        with adopt(ckpt, stand_in):
            yield loc


def _tokenizer_files_of(src: Path, staging: Path, vocab: int, where: str) -> Path:
    """The tokenizer of the HF directory ``src``
    (:func:`~porting.convert.hf_files.load_tokenizer`), as ``transformers`` saves it into
    ``staging``: only its own files (never the weights or the config beside them). Its tokens must
    all have a row of the ``vocab`` that ``where`` gives."""
    from porting.convert.hf_files import load_tokenizer

    tok = load_tokenizer(src)
    if len(tok) > vocab:
        raise PortingError(
            f"{src}: the tokenizer has {len(tok)} tokens, but {where} makes vocab_size {vocab}: "
            f"ids {vocab} and up would have no embedding row"
        )
    tok.save_pretrained(str(staging))
    return staging
