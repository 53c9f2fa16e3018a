"""Reading a Hugging Face model directory we do not trust: its files checked before any is opened,
``config.json`` parsed within bounds, the tokenizer loaded without running the directory's code.

The engine's edge for an HF source; the family contract (:mod:`porting.contract`) never touches a
file.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from porting.contract import hf_spelling, registry
from porting.contract.container import ContainerSource
from porting.contract.family import Family
from porting.errors import PortingError


def _hub_blobs(model_dir: Path) -> Path | None:
    """The ``blobs`` folder of a Hugging Face hub cache entry when ``model_dir`` is one of its
    snapshots (``models--org--name/snapshots/<revision>``), else ``None``.

    ``huggingface_hub`` stores every snapshot file as a symlink to ``../../blobs/<hash>``, so a
    snapshot's files legitimately resolve outside the snapshot folder, into that one place.
    """
    if model_dir.parent.name == "snapshots" and model_dir.parent.parent.name.startswith("models--"):
        return (model_dir.parent.parent / "blobs").resolve()
    return None


_NOT_REGULAR = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def model_file(path: str | Path, model_dir: str | Path) -> Path:
    """Check that ``path`` may be read as a file of the HF directory ``model_dir``; return it.

    Refuses, naming the file, what ``open()`` would block on or misread (a FIFO, a device, a
    socket, a directory) and a symlink that leaves the model directory (a checkpoint's files must
    not reach elsewhere on the machine). The one exception is a Hugging Face hub cache snapshot,
    whose files are symlinks into the entry's ``blobs`` folder (:func:`_hub_blobs`).
    Call it before every ``open()`` of a file named by the checkpoint.
    """
    path = Path(path)
    root = Path(model_dir).resolve()
    try:
        st = os.stat(path)  # follows symlinks: the kind of what open() would reach
    except FileNotFoundError as err:
        raise PortingError(f"{path}: missing (or a dangling symlink)") from err
    except OSError as err:
        raise PortingError(f"{path}: cannot be read ({err.strerror})") from err
    if not stat.S_ISREG(st.st_mode):
        kind = next((k for test, k in _NOT_REGULAR if test(st.st_mode)), "a special file")
        raise PortingError(f"{path}: is {kind}, not a regular file; refusing to open it")
    real = path.resolve()
    blobs = _hub_blobs(root)
    if not real.is_relative_to(root) and not (blobs is not None and real.is_relative_to(blobs)):
        raise PortingError(
            f"{path}: resolves to {real}, outside the model directory {root}; refusing to read it"
        )
    return path


# What transformers' tokenizer loading parses in a model directory (tokenization_utils_base: the
# tokenizer, its config, special and added tokens, chat templates; each class's vocabulary files:
# vocab.json, merges.txt, tokenizer.model, spiece.model, ...).
TOKENIZER_FILE = re.compile(
    r"(tokenizer|special_tokens_map|added_tokens|chat_template|vocab|merges|spiece|"
    r"sentencepiece).*"
)


def check_model_files(model_dir: str | Path) -> None:
    """Every file of the HF directory ``model_dir`` may be read: each passes :func:`model_file`,
    and each tokenizer file (:data:`TOKENIZER_FILE`) is at most
    :data:`~porting.convert.checkpoint.MAX_TOKENIZER_JSON_BYTES` and, if JSON, parses within
    :mod:`porting.untrusted`'s bounds (UTF-8, depth, numbers): ``transformers`` and the
    ``tokenizers`` library answer such files with a traceback, a hang or all the memory there is.
    Subfolders are skipped: only an index reaches them, and it is checked there.
    """
    from porting import untrusted
    from porting.convert.checkpoint import MAX_TOKENIZER_JSON_BYTES

    for entry in sorted(Path(model_dir).iterdir()):
        if entry.is_dir():
            continue
        real = model_file(entry, model_dir).resolve()  # a hub snapshot's files link to its blobs
        if not TOKENIZER_FILE.fullmatch(entry.name):
            continue
        size = real.stat().st_size
        if size > MAX_TOKENIZER_JSON_BYTES:
            raise PortingError(
                f"{entry}: {size} bytes, more than the {MAX_TOKENIZER_JSON_BYTES} a tokenizer file "
                "may hold"
            )
        if entry.suffix == ".json":
            try:
                untrusted.read_json(real, real.parent, max_bytes=MAX_TOKENIZER_JSON_BYTES)
            except PortingError as err:
                if not entry.is_symlink():
                    raise
                raise PortingError(f"{entry} -> {err}") from None


def load_tokenizer(model_dir: str | Path, hf_config: dict | None = None):
    """The ``transformers`` tokenizer of the HF directory ``model_dir``, its files checked first
    (:func:`check_model_files`), never fetched and never running the directory's own code. A
    failure to load is one :class:`PortingError` naming the directory: the ``tokenizers`` library
    raises plain ``Exception`` for a ``tokenizer.json`` it cannot use, transformers ``OSError``,
    ``ValueError`` or ``RecursionError`` for its other files."""
    import transformers

    if not Path(model_dir).is_dir():
        raise PortingError(f"{model_dir}: not a tokenizer directory")
    check_model_files(model_dir)
    loader, said = transformers.AutoTokenizer, logging.getLogger(_TOKENIZER_LOGGER)
    level = said.level
    if _tokenizer_class(model_dir) == "TokenizersBackend" and not hasattr(
        transformers, "TokenizersBackend"
    ):
        # transformers 5's class for a tokenizer that is its tokenizer.json alone, which 4.x
        # calls PreTrainedTokenizerFast (and 5.x reads under that name too); the warning that
        # the class named differs from the one loading it is about exactly this
        loader = transformers.PreTrainedTokenizerFast
        said.setLevel(logging.ERROR)
    extra = {}
    if loader is transformers.AutoTokenizer and _needs_remote_config(model_dir, hf_config):
        # transformers 5's AutoTokenizer reads the model's config first, and a config that needs
        # its own code (auto_map) then fails in the generic class's rope set-up; the tokenizer
        # class is named in tokenizer_config.json, so the model's config decides nothing here
        extra["config"] = transformers.PretrainedConfig()
    try:
        return loader.from_pretrained(
            str(model_dir), local_files_only=True, trust_remote_code=False, **extra
        )
    except Exception as err:
        why = (str(err).strip().splitlines() or [""])[0][:300]
        raise PortingError(
            f"{model_dir}: transformers cannot load its tokenizer ({type(err).__name__}: {why})"
        ) from err
    finally:
        said.setLevel(level)


_TOKENIZER_LOGGER = "transformers.tokenization_utils_base"


def _needs_remote_config(model_dir: str | Path, hf_config: dict | None = None) -> bool:
    """Whether the directory's ``config.json`` (``hf_config`` where the caller read it) maps its
    classes to its own code (``auto_map``) while ``tokenizer_config.json`` names the tokenizer's
    class."""
    path = Path(model_dir) / "config.json"
    if (hf_config is None and not path.is_file()) or not _tokenizer_class(model_dir):
        return False
    cfg = read_json(path, model_dir) if hf_config is None else hf_config
    return isinstance(cfg, dict) and "auto_map" in cfg


def _tokenizer_class(model_dir: str | Path) -> str | None:
    """``tokenizer_class`` of the directory's ``tokenizer_config.json`` (checked by
    :func:`check_model_files` first), None without one."""
    from porting import untrusted
    from porting.convert.checkpoint import MAX_TOKENIZER_JSON_BYTES

    path = Path(model_dir) / "tokenizer_config.json"
    if not path.is_file():
        return None
    cfg = untrusted.read_json(path, Path(model_dir), max_bytes=MAX_TOKENIZER_JSON_BYTES)
    return cfg.get("tokenizer_class") if isinstance(cfg, dict) else None


def read_json(path: Path, model_dir: str | Path) -> Any:
    """Parse a JSON file of the HF directory, naming the file on any failure.

    Duplicate keys are refused (``json`` would silently keep the last one).
    """
    from porting.untrusted import MAX_TEXT_BYTES, parse_json, read_named_text

    model_file(path, model_dir)
    # The bounds our checkpoint reader applies (size, depth, number length, duplicate keys):
    # what import carries into the manifest, export must be able to read back.
    return parse_json(read_named_text(path, str(path), MAX_TEXT_BYTES), path)


def read_hf_config(hf_dir: str | Path) -> dict:
    """``config.json`` of an HF model directory in transformers 4.x's spelling
    (:func:`read_hf_config_as_written`)."""
    return read_hf_config_as_written(hf_dir)[0]


def read_hf_config_as_written(hf_dir: str | Path) -> tuple[dict, dict | None]:
    """Read ``config.json`` of an HF model directory and check its shape: the config in
    transformers 4.x's spelling, and the file's own content where it is spelled as transformers 5
    writes it (:mod:`porting.contract.hf_spelling`; None otherwise), for export to write back.
    A vision-language container of a family's language model (``Family.containers``) reads as
    its language model's config (:meth:`porting.contract.container.Container.text_view`).

    Every file of the directory must pass :func:`check_model_files` first: the tokenizer and
    generation files are opened by ``transformers`` and copied by us, and a FIFO among them would
    hang the command. ``config.json`` must be a JSON object whose ``architectures`` names exactly one
    architecture: porting converts one architecture per checkpoint, and a second entry would
    otherwise be ignored.
    """
    return _view(_config_file(hf_dir), Path(hf_dir) / "config.json")[:2]


def read_container(hf_dir: str | Path) -> ContainerSource | None:
    """The container a model directory's ``config.json`` is (its family's
    :class:`~porting.contract.container.Container` and the file as written), None for any other
    checkpoint; the directory checked as :func:`read_hf_config_as_written` checks it."""
    return _view(_config_file(hf_dir), Path(hf_dir) / "config.json")[2]


def _config_file(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if not Path(hf_dir).is_dir():
        raise PortingError(f"{hf_dir}: not a directory")
    if not path.exists() and not path.is_symlink():
        raise PortingError(f"{path}: missing (is {hf_dir} a Hugging Face model directory?)")
    check_model_files(hf_dir)
    cfg = read_json(path, hf_dir)
    if not isinstance(cfg, dict):
        raise PortingError(f"{path}: must be a JSON object, not a JSON {_json_kind(cfg)}")
    archs = cfg.get("architectures")
    if not archs or not isinstance(archs, list):
        raise PortingError(f"{path}: no 'architectures' list; cannot tell the model family")
    if len(archs) != 1 or not isinstance(archs[0], str):
        raise PortingError(
            f"{path}: architectures={archs!r} must name exactly one architecture (a string); "
            "porting converts one architecture per checkpoint"
        )
    return cfg


def _view(cfg: dict, path: Path) -> tuple[dict, dict | None, ContainerSource | None]:
    found = registry.container_for(cfg)
    if found is not None:  # a vision-language class: its language model is what is converted
        held = ContainerSource(*found, cfg)
        view = held.container.text_view(cfg, str(path))
        # the file as it came is the container's (held.config), which export writes back
        return _completed(view, held, f"{path}: {held.container.text_config}"), None, held
    if not hf_spelling.is_v5(cfg):
        return cfg, None, None
    return hf_spelling.internal(cfg, str(path)), cfg, None


def _completed(view: dict, held: ContainerSource, where: str) -> dict:
    """A container's text config as the installed transformers reads it: transformers writes a
    composite config's parts as their differences from the part's class defaults (Gemma 3's
    releases keep six keys of their language model's), so the keys left out are the defaults
    of the family's text class's config, filled in here as a text checkpoint of that class
    would hold them. A text config of another ``model_type`` is left to the family's checks to
    refuse by name."""
    cls = held.family.hf_class(held.container.text_architecture).config_class
    if view.get("model_type") != cls.model_type:
        return view
    try:
        full = cls.from_dict(copy.deepcopy(view)).to_diff_dict()
    except Exception as err:  # transformers' validators raise their own kinds
        raise PortingError(
            f"{where}: transformers' {cls.__name__} cannot read it "
            f"({type(err).__name__}: {str(err).strip()[:200]})"
        ) from err
    full.pop("transformers_version", None)
    if hf_spelling.is_v5(full):
        full = hf_spelling.internal(full, where)
    return {**full, **view}


def _json_kind(value: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )


@dataclass(frozen=True)
class HFSource:
    """One HF model directory as a command reads it, once (:func:`open_hf`): ``config.json`` in
    transformers 4.x's spelling (what families and the gate read, whichever version wrote it),
    the file as written where transformers 5 spelled it (for export to write back key for key)
    and the family that claims it. Import, its gate and the tokenizer load take it, so that none
    reads the directory's config again."""

    path: Path
    config: dict
    as_written: dict | None
    family: Family
    # a vision-language class holding the family's language model (config and as_written are
    # then its text config's): porting.convert.container
    container: ContainerSource | None = None

    @property
    def config_path(self) -> Path:
        return self.path / "config.json"

    @property
    def raw_config(self) -> dict:
        """``config.json`` as the file holds it."""
        if self.container is not None:
            return self.container.config
        return self.as_written if self.as_written is not None else self.config


def open_hf(hf: HFSource | str | os.PathLike, family: str | None = None) -> HFSource:
    """The :class:`HFSource` of an HF directory (its files checked, its config read and claimed
    by a family: :func:`family_for_hf_dir`); an :class:`HFSource` is returned as it is."""
    if isinstance(hf, HFSource):
        return hf
    where = Path(hf) / "config.json"
    cfg, written, held = _view(_config_file(hf), where)
    fam = registry.family_for_hf_config(cfg, str(where), family)
    return HFSource(Path(hf), cfg, written, fam, held)


def hf_config_of(hf: HFSource | str | os.PathLike) -> tuple[Path, dict, dict | None]:
    """``(directory, config, config as written)`` of an HF directory: an :class:`HFSource`'s own,
    else read (:func:`read_hf_config_as_written`; no family is asked to claim it)."""
    if isinstance(hf, HFSource):
        return hf.path, hf.config, hf.as_written
    return Path(hf), *read_hf_config_as_written(hf)


def family_for_hf_dir(hf_dir: str | Path, family: str | None = None) -> tuple[Family, dict]:
    """The family and parsed config of an HF model directory (:func:`read_hf_config`), the config
    checked by the family's config map (:func:`~porting.contract.registry.family_for_hf_config`);
    errors name its ``config.json``."""
    cfg = read_hf_config(hf_dir)  # checks that architectures holds exactly one name
    where = str(Path(hf_dir) / "config.json")
    return registry.family_for_hf_config(cfg, where, family), cfg
