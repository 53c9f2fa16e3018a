"""Which tokenizer, what Megatron would make of it, and the fast backend that must agree with it.

The *reference* is Megatron-Core's own tokenizer object, built the way Megatron-LM's
``tools/preprocess_data.py`` builds it (``MegatronTokenizer.from_pretrained`` with library
``huggingface`` or ``sentencepiece``): its ``tokenize`` decides the token ids, its ``eod`` the EOD
id, its ``vocab_size`` the token dtype. It is loaded once, in a short-lived process, and asked
for everything a run needs (:class:`Facts`), including its ids for probe texts and for the head
of the corpus. A fast *backend* (``tokenizers``, sentencepiece's batch encode, gigatoken) does
the bulk of the work; it must give the same ids on those texts, and gigatoken is also checked on
samples of every chunk against the ``tokenizers``/sentencepiece object Megatron's tokenizer wraps
(:class:`data_prep.backends.LightReference`). A difference stops the run.

Hugging Face special tokens: Megatron's ``HuggingFaceTokenizer`` has ``include_special_tokens``
(ids from ``tokenizer(text).input_ids``, so the post-processor's BOS is there) and ``use_fast``.
Both default to True from megatron-core 0.17 on, as in the legacy ``_HuggingFaceTokenizer``;
megatron-core 0.15/0.16 default both to False. We default to True, as the issue asks, and take
Megatron's ``--tokenizer-hf-no-include-special-tokens`` / ``--tokenizer-hf-no-use-fast`` to
reproduce the 0.15 script's output.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from data_prep.backends import BackendSpec
from data_prep.reference import load_reference
from porting.cache import cache_dir
from porting.errors import PortingError

log = logging.getLogger(__name__)

MANIFEST = Path("context") / "porting.json"

#: Megatron ``--tokenizer-type`` values we serve, by library (``build_tokenizer``'s grouping).
HF_TYPES = ("HuggingFaceTokenizer",)
SP_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")

# Texts on which a fast backend must agree with the reference before any corpus text is seen:
# whitespace runs, newlines, full-width forms, emoji, literal special-token strings.
PROBES = (
    "",
    " ",
    "  leading and trailing  ",
    "line\nbreaks\n\nand\ttabs\r\n",
    "東京は日本の首都です。京都には古い寺がたくさんあります。",
    "ＧＰＵ１２８ full-width and　ideographic space",
    "emoji 🤖🎉 and combining e\u0301",
    "<s> literal special tokens </s> <unk> <pad> <|endoftext|>",
    "zero\u200bwidth",
    "x" * 300,
)


@dataclass(frozen=True)
class Contract:
    """What an imported checkpoint asks of its training data (``context/porting.json``)."""

    checkpoint: Path
    padded_vocab_size: int
    eos_token_id: int | list[int] | None
    # The HF vocabulary: the bound on data ids. The padded rows past it exist only to divide
    # evenly across tensor-parallel ranks; export drops them, and what trains onto them is lost.
    vocab_size: int | None = None

    @property
    def id_limit(self) -> int:
        """Every token id of the data must be below this."""
        return self.vocab_size or self.padded_vocab_size


@dataclass(frozen=True)
class TokenizerSource:
    """A resolved tokenizer: ``kind`` is ``hf`` (a directory) or ``sentencepiece`` (a ``.model``)."""

    kind: str
    path: Path
    contract: Contract | None = None


def read_checkpoint(ckpt: Path) -> TokenizerSource:
    """The tokenizer and the contract recorded in a checkpoint written by ``porting import``."""
    manifest = ckpt / MANIFEST
    try:
        data = json.loads(manifest.read_text())
    except json.JSONDecodeError as err:
        raise PortingError(f"{manifest}:{err.lineno}: not valid JSON ({err.msg})") from err
    for name in ("padded_vocab_size", "hf_config", "tokenizer"):
        if name not in data:
            raise PortingError(f"{manifest}: no {name!r} field")
    tok = data["tokenizer"]
    if (
        not isinstance(tok, dict)
        or tok.get("kind") not in ("hf", "sentencepiece")
        or not tok.get("path")
    ):
        raise PortingError(
            f'{manifest}: \'tokenizer\' must be {{"kind": "hf"|"sentencepiece", "path": ...}}, '
            f"got {tok!r}"
        )
    # The manifest may come from anyone: its path must stay inside the checkpoint's context/
    # and name only regular files (a symlink out of it would read files elsewhere).
    rel = Path(str(tok["path"]))
    path = (ckpt / rel).resolve()
    context = (ckpt / "context").resolve()
    if rel.is_absolute() or ".." in rel.parts or not path.is_relative_to(context):
        raise PortingError(
            f"{manifest}: tokenizer path {tok['path']!r} must be a relative path inside "
            f"{ckpt / 'context'}"
        )
    if not path.exists():
        raise PortingError(
            f"{manifest}: tokenizer path {tok['path']!r} does not exist under {ckpt}"
        )
    inside = path.iterdir() if path.is_dir() else [path]
    for f in inside:
        if f.is_symlink() or not (f.is_file() or f.is_dir()):
            raise PortingError(f"{f}: a tokenizer file must be a regular file, not a link")
    padded = data["padded_vocab_size"]
    if not isinstance(padded, int) or padded <= 0:
        raise PortingError(
            f"{manifest}: padded_vocab_size must be a positive integer, got {padded!r}"
        )
    hf_config = data.get("hf_config") or {}
    eos = hf_config.get("eos_token_id")
    vocab = hf_config.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or not 0 < vocab <= padded:
        raise PortingError(
            f"{manifest}: hf_config.vocab_size must be a positive integer no larger than "
            f"padded_vocab_size {padded}, got {vocab!r}"
        )
    return TokenizerSource(tok["kind"], path, Contract(ckpt, padded, eos, vocab))


def resolve(
    tokenizer: str | None = None,
    tokenizer_type: str | None = None,
    tokenizer_model: str | None = None,
    tokenizer_library: str | None = None,
) -> TokenizerSource:
    """Turn the command-line spellings into one tokenizer.

    ``tokenizer`` is ours (a checkpoint, an HF tokenizer directory or a ``.model``, told apart by
    what is on disk); ``tokenizer_type``/``tokenizer_model`` are Megatron's; ``tokenizer_library``
    with ``tokenizer_type`` (HF) or ``tokenizer_model`` (sentencepiece) is NeMo's.
    """
    if tokenizer is not None:
        path = Path(tokenizer)
        if (path / MANIFEST).is_file():
            return read_checkpoint(path)
        if path.is_dir():
            if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
                return TokenizerSource("hf", path)
            raise PortingError(
                f"{path}: neither a checkpoint (no {MANIFEST}) nor an HF tokenizer directory "
                "(no tokenizer.json / tokenizer_config.json)"
            )
        if path.is_file() and path.suffix == ".model":
            return TokenizerSource("sentencepiece", path)
        if path.is_file() and path.name == "tokenizer.json":
            raise PortingError(f"{path}: pass the directory that holds tokenizer.json")
        raise PortingError(f"{path}: no such tokenizer (a checkpoint, an HF dir or a .model)")
    if tokenizer_library is not None:
        if tokenizer_library == "huggingface":
            where = tokenizer_model or tokenizer_type
            kind = "hf"
        elif tokenizer_library == "sentencepiece":
            where, kind = tokenizer_model, "sentencepiece"
        else:
            raise PortingError(
                f"--tokenizer-library {tokenizer_library}: only huggingface and sentencepiece"
            )
    elif tokenizer_type is not None:
        if tokenizer_type in HF_TYPES:
            kind = "hf"
        elif tokenizer_type in SP_TYPES:
            kind = "sentencepiece"
        else:
            raise PortingError(
                f"--tokenizer-type {tokenizer_type}: not supported; use one of "
                f"{', '.join(HF_TYPES + SP_TYPES)}"
            )
        where = tokenizer_model
    else:
        raise PortingError("no tokenizer: pass --tokenizer (or --tokenizer-type/--tokenizer-model)")
    if not where:
        raise PortingError("--tokenizer-model is required with that tokenizer type")
    path = Path(where)
    if not path.exists():
        raise PortingError(
            f"{path}: no such tokenizer (names on the Hugging Face Hub are not fetched; pass a "
            "local directory)"
        )
    return TokenizerSource(kind, path)


def fingerprint(source: TokenizerSource, include_special_tokens: bool, use_fast: bool) -> str:
    """sha256 over the tokenizer's files and the settings that change its ids."""
    h = hashlib.sha256()
    h.update(f"{source.kind}|{include_special_tokens}|{use_fast}".encode())
    files = (
        sorted(p for p in source.path.iterdir() if p.is_file())
        if source.path.is_dir()
        else [source.path]
    )
    for p in files:
        h.update(p.name.encode() + b"\0")
        h.update(hashlib.sha256(p.read_bytes()).digest())
    if source.contract is not None:
        h.update(f"|padded={source.contract.padded_vocab_size}".encode())
    return h.hexdigest()


def special_wrapping(backend) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids a ``tokenizers`` post-processor puts before and after every single text.

    Found by encoding probes with and without special tokens; refused if the post-processor does
    anything other than wrap (gigatoken only sees the bare text).
    """
    found = set()
    for probe in ("a b", "東京 x", "hello\nworld"):
        bare = backend.encode(probe, add_special_tokens=False).ids
        full = backend.encode(probe, add_special_tokens=True).ids
        for start in range(len(full) - len(bare) + 1):
            if full[start : start + len(bare)] == bare:
                found.add((tuple(full[:start]), tuple(full[start + len(bare) :])))
                break
        else:
            found.add(None)
    if len(found) != 1 or None in found:
        raise PortingError(
            "the tokenizer's post-processor does more than add special tokens around the text; "
            "only the hf and megatron backends can reproduce it"
        )
    return found.pop()


def _token_content(value) -> str | None:
    """A special token as ``tokenizer_config.json`` spells it (a string or an AddedToken dict)."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def provisional(
    source: TokenizerSource, include_special_tokens: bool, backend_name: str
) -> tuple[BackendSpec, int | None, int] | None:
    """A best guess at (backend spec, EOD id, vocabulary size) from the files alone.

    Building Megatron's tokenizer means importing megatron.core, torch and transformers (seconds);
    workers can start on this guess meanwhile. The guess is only used once it equals what the
    reference says (:func:`data_prep.prep.prepare` compares them and restarts otherwise), so it
    may be wrong but never decides an output byte. None when there is nothing cheap to guess from.
    """
    try:
        if source.kind == "sentencepiece":
            import sentencepiece as spm

            if backend_name not in ("sentencepiece", "gigatoken"):
                return None
            proto = source.path.read_bytes()
            sp = spm.SentencePieceProcessor()
            sp.LoadFromSerializedProto(proto)
            eos = sp.eos_id()
            return (
                BackendSpec(backend_name, "sp-model", proto),
                eos if eos >= 0 else None,
                sp.get_piece_size(),
            )
        if (
            backend_name not in ("hf", "gigatoken")
            or not (source.path / "tokenizer.json").is_file()
        ):
            return None
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(source.path / "tokenizer.json"))
        config_path = source.path / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        eos = _token_content(config.get("eos_token"))
        eod = tok.token_to_id(eos) if eos else None
        payload = tok.to_str()
        if backend_name == "hf":
            spec = BackendSpec("hf", "hf-json", payload, add_special_tokens=include_special_tokens)
        else:
            prefix, suffix = special_wrapping(tok) if include_special_tokens else ((), ())
            spec = BackendSpec("gigatoken", "hf-json", payload, prefix=prefix, suffix=suffix)
        return spec, eod, tok.get_vocab_size(with_added_tokens=True)
    except Exception as err:  # noqa: BLE001
        # Any failure here only means no head start: the reference decides below.
        log.debug("no provisional tokenizer for %s: %s", source.path, err)
        return None


def quiet_third_party() -> None:
    """Silence warnings and sub-ERROR log records in a child process that imports Megatron.

    Spawned children do not inherit the CLI's logging set-up, so Python's last-resort handler
    would print megatron.core's and torch's import-time notices on the user's terminal. torch's
    loggers print through a handler of their own, past the root's level: the known records
    (``porting.quiet``: cpp_extension's "No CUDA runtime is found" on the current stack's CUDA
    build of torch) are dropped at their loggers.
    """
    from porting import quiet

    quiet.install(False)
    warnings.simplefilter("ignore")
    logging.getLogger().setLevel(logging.ERROR)


@contextlib.contextmanager
def third_party_quieted():
    """:func:`quiet_third_party` for the span of a ``with`` block in this process, undone after."""
    root = logging.getLogger()
    level = root.level
    with warnings.catch_warnings():
        quiet_third_party()
        try:
            yield
        finally:
            root.setLevel(level)


@dataclass(frozen=True)
class Facts:
    """What Megatron's tokenizer says about itself and about some texts.

    Computed by :func:`megatron_facts` in a short-lived process, so that the process that runs the
    whole corpus never imports torch, transformers and megatron.core (about 8 s and 550 MB here).
    ``payload`` is what every fast path starts from: the ``tokenizers`` JSON of the tokenizer as
    transformers loaded it for Megatron (None for a slow tokenizer), or the sentencepiece model.
    ``ids[i]`` is Megatron's encoding of ``texts[i]``: the first ``probes`` are
    :func:`probe_texts`, the rest the head of the corpus. ``record``: the tokenizer record the
    facts were read from (:func:`read_record`), None where Megatron's tokenizer was loaded.
    """

    kind: str
    path: str
    include_special_tokens: bool
    use_fast: bool
    vocab_size: int
    eod: int | None
    dtype: str
    index_header: bytes
    payload: str | bytes | None
    texts: tuple[str, ...]
    ids: tuple[tuple[int, ...], ...]
    probes: int
    record: str | None = None


def probe_texts(special: list[str]) -> list[str]:
    """:data:`PROBES` plus every special token's string alone, glued and spaced in text."""
    texts = list(PROBES)
    for s in special:
        texts += [s, f"x{s}y", f"text {s} text"]
    return texts


def megatron_facts(
    kind: str, path: str, include_special_tokens: bool, use_fast: bool, head: list[str]
) -> Facts:
    """Load Megatron's tokenizer and ask it everything a run needs (see :class:`Facts`)."""
    from megatron.core.datasets.indexed_dataset import DType

    from data_prep.writer import index_header

    ref = load_reference(kind, path, include_special_tokens, use_fast)
    dtype = DType.optimal_dtype(ref.vocab_size)
    if kind == "sentencepiece":
        payload = ref.lib.tokenizer.serialized_model_proto()
    else:
        hf = ref.lib.tokenizer
        payload = hf.backend_tokenizer.to_str() if hf.is_fast else None
    probes = probe_texts(ref.special_strings())
    texts = probes + list(head)
    return Facts(
        kind=kind,
        path=str(path),
        include_special_tokens=include_special_tokens,
        use_fast=use_fast,
        vocab_size=ref.vocab_size,
        eod=ref.eod,
        dtype=dtype.__name__,
        index_header=index_header(dtype),
        payload=payload,
        texts=tuple(texts),
        ids=tuple(tuple(ref.encode(t)) for t in texts),
        probes=len(probes),
    )


# Tokenizer records. What Megatron's tokenizer decides (ids, EOD, vocabulary size, dtype, the
# index header, the fast backends' payload, its ids for the probes) depends only on the
# tokenizer's files, the settings that change its ids and the libraries' versions: a run records
# it, keyed by all of those, and a later run with the same key starts from the record, importing
# neither megatron.core nor transformers (seconds per run: a data team's thousand shards run as
# a thousand jobs). The probes are still encoded by the backend and compared with the recorded
# ids; the head of the corpus is compared only in a run that loads Megatron's tokenizer
# (``--recheck-tokenizer`` forces one).
RECORD_FORMAT = 1
RECORD_LIBRARIES = ("megatron-core", "transformers", "tokenizers", "sentencepiece")
# A record holds the tokenizer's payload (an HF tokenizer.json is at most 256 MiB as read
# elsewhere here) and the probes' ids.
MAX_RECORD_BYTES = 512 << 20
_DTYPES = ("uint16", "int32")  # what megatron.core's DType.optimal_dtype picks


def records_dir() -> Path:
    """``tokenizers`` in porting's cache (:func:`porting.cache.cache_dir`)."""
    return cache_dir() / "tokenizers"


def record_key(tok_fp: str) -> dict:
    """What a record is valid for: the tokenizer (:func:`fingerprint`: its files and the
    settings), the installed versions of the libraries that decide or reproduce its ids, and the
    probes (a release that probes more texts records them anew)."""
    from importlib import metadata

    versions: dict[str, str | None] = {}
    for name in RECORD_LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    probes = hashlib.sha256(json.dumps(PROBES).encode()).hexdigest()
    return {"format": RECORD_FORMAT, "tokenizer": tok_fp, "libraries": versions, "probes": probes}


def record_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return records_dir() / f"{digest}.json"


def _encoded(value: str | bytes | None) -> dict | None:
    if isinstance(value, bytes):
        return {"base64": base64.b64encode(value).decode("ascii")}
    return None if value is None else {"text": value}


def write_record(key: dict, facts: Facts) -> None:
    """Record ``facts`` (their probes, not the corpus head) under ``key``, atomically. A cache
    that cannot be written costs the next run Megatron's start-up, nothing else."""
    path = record_path(key)
    data = {
        "key": key,
        "facts": {
            "kind": facts.kind,
            "include_special_tokens": facts.include_special_tokens,
            "use_fast": facts.use_fast,
            "vocab_size": facts.vocab_size,
            "eod": facts.eod,
            "dtype": facts.dtype,
            "index_header": _encoded(facts.index_header),
            "payload": _encoded(facts.payload),
            "texts": list(facts.texts[: facts.probes]),
            "ids": [list(i) for i in facts.ids[: facts.probes]],
        },
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        log.info("tokenizer record not written to %s (%s)", path, err)


def _decoded(value, want_bytes: bool) -> str | bytes | None:
    if value is None:
        return None
    if want_bytes and set(value) == {"base64"}:
        return base64.b64decode(value["base64"], validate=True)
    if not want_bytes and set(value) == {"text"} and isinstance(value["text"], str):
        return value["text"]
    raise ValueError(f"payload {sorted(value)} where {'bytes' if want_bytes else 'text'}")


def _int(value, what: str, low: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{what} {value!r}")
    return value


def _facts_from(data: dict, source: TokenizerSource, key: dict, path: Path) -> Facts:
    if data.get("key") != key:
        raise ValueError("written for another tokenizer, settings or library version")
    f = data["facts"]
    if f["kind"] != source.kind:
        raise ValueError(f"kind {f['kind']!r}")
    for flag in ("include_special_tokens", "use_fast"):
        if not isinstance(f[flag], bool):
            raise ValueError(f"{flag} {f[flag]!r}")
    if f["dtype"] not in _DTYPES:
        raise ValueError(f"dtype {f['dtype']!r}")
    texts, ids = f["texts"], f["ids"]
    if (
        not isinstance(texts, list)
        or not all(isinstance(t, str) for t in texts)
        or not isinstance(ids, list)
        or len(ids) != len(texts)
    ):
        raise ValueError("texts and ids do not pair up")
    vocab = _int(f["vocab_size"], "vocab_size", 1)
    for row in ids:
        if not isinstance(row, list):
            raise ValueError("ids")
        for i in row:
            _int(i, "token id")
            if i >= vocab:
                raise ValueError(f"token id {i} past the vocabulary ({vocab})")
    return Facts(
        kind=source.kind,
        path=str(source.path),
        include_special_tokens=f["include_special_tokens"],
        use_fast=f["use_fast"],
        vocab_size=vocab,
        eod=None if f["eod"] is None else _int(f["eod"], "eod"),
        dtype=f["dtype"],
        index_header=_decoded(f["index_header"], True),
        payload=_decoded(f["payload"], source.kind == "sentencepiece"),
        texts=tuple(texts),
        ids=tuple(tuple(row) for row in ids),
        probes=len(texts),
        record=str(path),
    )


def read_record(key: dict, source: TokenizerSource) -> Facts | None:
    """The facts recorded under ``key`` for ``source``, or None: no record, or one this version
    cannot trust (then it says so, and the run loads Megatron's tokenizer and records anew)."""
    path = record_path(key)
    try:
        size = path.stat().st_size
        if size > MAX_RECORD_BYTES:
            raise ValueError(f"{size} bytes, more than a record holds")
        return _facts_from(json.loads(path.read_bytes()), source, key, path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        log.warning(
            "%s: tokenizer record not used (%s); loading Megatron's tokenizer to record it again",
            path, err,
        )  # fmt: skip
        return None


def backend_spec(facts: Facts, name: str) -> BackendSpec:
    """The picklable recipe of backend ``name`` for the tokenizer the facts describe."""
    if name == "megatron":
        return BackendSpec(
            "megatron",
            "megatron",
            {
                "kind": facts.kind,
                "path": facts.path,
                "include_special_tokens": facts.include_special_tokens,
                "use_fast": facts.use_fast,
            },
        )
    if facts.kind == "sentencepiece":
        if name == "hf":
            raise PortingError(
                f"--tokenizer-backend hf needs an HF tokenizer; {facts.path} is a sentencepiece "
                "model (use sentencepiece or gigatoken)"
            )
        return BackendSpec(name, "sp-model", facts.payload)
    if facts.payload is None:
        raise PortingError(
            f"{facts.path}: transformers loads a slow (Python) tokenizer here, which the {name} "
            "backend cannot reproduce; use --tokenizer-backend megatron"
        )
    if name == "sentencepiece":
        raise PortingError(
            f"--tokenizer-backend sentencepiece needs a .model file; {facts.path} is an HF "
            "tokenizer directory (use hf or gigatoken)"
        )
    if name == "hf":
        return BackendSpec(
            "hf", "hf-json", facts.payload, add_special_tokens=facts.include_special_tokens
        )
    from tokenizers import Tokenizer

    wrap = (
        special_wrapping(Tokenizer.from_str(facts.payload))
        if facts.include_special_tokens
        else ((), ())
    )
    return BackendSpec(name, "hf-json", facts.payload, prefix=wrap[0], suffix=wrap[1])


def check_contract(facts: Facts, contract: Contract, append_eod: bool) -> None:
    """Refuse a tokenizer that cannot produce valid data for the checkpoint's model."""
    where = contract.checkpoint / MANIFEST
    if facts.vocab_size > contract.padded_vocab_size:
        raise PortingError(
            f"{where}: the tokenizer has {facts.vocab_size} entries but the model's vocabulary is "
            f"{contract.padded_vocab_size} (padded); its ids would index past the embedding"
        )
    if not append_eod:
        return
    eod = facts.eod
    if eod is None:
        raise PortingError(f"{facts.path}: the tokenizer has no EOS token to append as EOD")
    if eod >= contract.id_limit:
        raise PortingError(
            f"{where}: EOD id {eod} is outside the model's vocabulary ({contract.id_limit})"
        )
    eos = contract.eos_token_id
    allowed = eos if isinstance(eos, list) else [eos] if eos is not None else None
    if allowed is not None and eod not in allowed:
        raise PortingError(
            f"{where}: the tokenizer's EOD id is {eod} but the model's eos_token_id is {eos}; the "
            "model would not see its end-of-document token"
        )
