"""Local corpora, tokenizers, checkpoint layouts and a Megatron reference writer (no hub).

Used by ``tests/test_prep*.py`` and ``scripts/bench_prep.py``. Everything is generated from a seed,
so two calls with the same arguments give the same bytes.

:func:`megatron_reference` drives ``megatron.core``'s tokenizer and ``IndexedDatasetBuilder`` the
way Megatron-LM's ``tools/preprocess_data.py`` (tag ``core_v0.15.3``, which is in no wheel) does:
``Encoder.encode`` per JSON line, ``builder.add_document(ids, sentence_lens)`` per record, the token
dtype from ``DType.optimal_dtype(tokenizer.vocab_size)``. It is the byte-identity oracle when no
Megatron-LM checkout is at hand.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

# Word stock for the synthetic corpus: Zipf-distributed English words (common ones plus words built
# from syllables) and Japanese built from a few thousand kanji, katakana words and hiragana, so that
# byte-level BPE meets both space-separated and unsegmented text and its word cache does not see
# the same few pretokens over and over.
_EN_COMMON = (
    "the of and to in is was for on that with as by at from his her it an were are which this be "
    "or has had not but also its their have one first new after two they more been who other time "
    "city year during world team school state university season national government war model "
    "data training language large parallel tensor pipeline checkpoint token corpus network"
).split()
_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
_HIRAGANA = [chr(c) for c in range(0x3041, 0x3094)]
_KATAKANA = [chr(c) for c in range(0x30A1, 0x30F5)]
_KANJI = [chr(0x4E00 + 7 * i) for i in range(2500)]
_PARTICLES = "は が を に で と の も へ から まで より".split()
_ENDINGS = ("です。", "ます。", "した。", "である。", "ください。", "、")


def _zipf(items: list[str]) -> tuple[list[str], list[float]]:
    cum, total = [], 0.0
    for rank in range(len(items)):
        total += 1.0 / (rank + 1)
        cum.append(total)
    return items, cum


def _word_stock(seed: int = 1234):
    rng = random.Random(seed)
    made = {"".join(rng.choices(_SYLLABLES, k=rng.randint(1, 4))) for _ in range(6000)}
    en = _zipf(_EN_COMMON + sorted(made))
    kanji_words = {"".join(rng.choices(_KANJI, k=rng.choice((1, 2, 2, 2, 3)))) for _ in range(8000)}
    ja = _zipf(sorted(kanji_words))
    kata = _zipf(
        sorted({"".join(rng.choices(_KATAKANA, k=rng.randint(2, 6))) for _ in range(2000)})
    )
    return en, ja, kata


_EN, _JA, _KATA = _word_stock()


def _en_sentence(rng: random.Random) -> str:
    words = rng.choices(_EN[0], cum_weights=_EN[1], k=rng.randint(6, 22))
    words[0] = words[0].capitalize()
    if rng.random() < 0.1:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
    return " ".join(words) + rng.choice((".", ".", ".", "?", "!", ","))


def _ja_sentence(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(3, 9)):
        if rng.random() < 0.75:
            parts.append(rng.choices(_JA[0], cum_weights=_JA[1])[0])
            if rng.random() < 0.3:
                parts.append("".join(rng.choices(_HIRAGANA, k=rng.randint(1, 3))))
        else:
            parts.append(rng.choices(_KATA[0], cum_weights=_KATA[1])[0])
        parts.append(rng.choice(_PARTICLES))
    if rng.random() < 0.1:
        # Full-width Latin and digits: what an NFKC-normalizing sentencepiece model folds.
        parts.append("ＧＰＵ１２８")
    return "".join(parts) + rng.choice(_ENDINGS)


def synthetic_document(rng: random.Random, mean_chars: int = 900) -> str:
    """One mixed Japanese/English document of a few paragraphs."""
    target = max(20, int(rng.expovariate(1.0 / mean_chars)))
    lang = rng.random()
    paragraphs, size = [], 0
    while size < target:
        sentences = []
        for _ in range(rng.randint(1, 6)):
            ja = lang < 0.5 or (lang >= 0.9 and rng.random() < 0.5)
            sentences.append(_ja_sentence(rng) if ja else _en_sentence(rng))
        paragraph = ("" if lang < 0.5 else " ").join(sentences)
        paragraphs.append(paragraph)
        size += len(paragraph)
    return "\n\n".join(paragraphs)


def synthetic_texts(n: int, seed: int = 0, mean_chars: int = 900) -> list[str]:
    """``n`` deterministic documents."""
    rng = random.Random(seed)
    return [synthetic_document(rng, mean_chars) for _ in range(n)]


def dataset_bytes(output_prefix: str | Path, key: str = "text") -> tuple:
    """The ``.bin``, ``.idx`` and ``.prov`` bytes of one key of a ``prep-data`` output (the
    last None where there is no sidecar): what two executors or runs must write alike."""
    from data_prep.executors.base import output_prefix_for

    prefix = output_prefix_for(output_prefix, key)
    prov = Path(f"{prefix}.prov")
    return (
        Path(f"{prefix}.bin").read_bytes(),
        Path(f"{prefix}.idx").read_bytes(),
        prov.read_bytes() if prov.exists() else None,
    )


def provenance_records(sidecar: bytes) -> bytes:
    """A sidecar's records without its header: equal for two runs over the same documents read
    from inputs at other paths (a copy of the corpus)."""
    import struct

    (length,) = struct.unpack_from("<Q", sidecar, 12)
    return sidecar[20 + length :]


def write_jsonl(path: str | Path, records: list, raw_lines: dict[int, bytes] | None = None) -> Path:
    """Write records (dicts) as JSON lines; ``raw_lines`` replaces line i (0-based) with raw bytes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw_lines = raw_lines or {}
    with open(path, "wb") as f:
        for i, rec in enumerate(records):
            if i in raw_lines:
                f.write(raw_lines[i] + b"\n")
            else:
                f.write(json.dumps(rec, ensure_ascii=False).encode("utf-8") + b"\n")
    return path


def write_synthetic_corpus(path: str | Path, target_bytes: int, seed: int = 0) -> tuple[int, int]:
    """Write a JSONL corpus of about ``target_bytes``; return (documents, bytes)."""
    rng = random.Random(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = size = 0
    with open(path, "wb") as f:
        while size < target_bytes:
            line = (
                json.dumps({"id": n, "text": synthetic_document(rng)}, ensure_ascii=False).encode()
                + b"\n"
            )
            f.write(line)
            n += 1
            size += len(line)
    return n, size


def iter_texts(
    path: str | Path, key: str = "text", limit_bytes: int | None = None
) -> Iterator[str]:
    """Texts of a JSONL file (for training tokenizers on a prefix of a corpus)."""
    seen = 0
    with open(path, "rb") as f:
        for line in f:
            seen += len(line)
            yield json.loads(line)[key]
            if limit_bytes is not None and seen >= limit_bytes:
                return


def train_hf_bpe(
    texts, out_dir: str | Path, vocab_size: int = 400, bos: bool = True, extra_specials=()
) -> Path:
    """Train a byte-level BPE with ``tokenizers`` and save it as an HF tokenizer directory.

    Special tokens ``<s>`` (BOS, added by the post-processor when ``bos``), ``</s>`` (EOS, the
    EOD Megatron appends), ``<pad>``; the directory loads with ``AutoTokenizer.from_pretrained``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<pad>", *extra_specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "model_max_length": 1_000_000_000,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}, indent=2)
    )
    return out_dir


def make_wordlevel_tokenizer(
    out_dir: str | Path, n_vocab: int, added: tuple[str, ...] = ()
) -> Path:
    """An HF tokenizer directory with ``n_vocab`` whitespace-split words (``</s>`` last, the EOS)
    plus ``added`` tokens: for the vocabulary-size boundary of the token dtype."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = {f"w{i}": i for i in range(n_vocab - 2)}
    vocab["<unk>"] = n_vocab - 2
    vocab["</s>"] = n_vocab - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken("</s>", special=True)])
    if added:
        tok.add_tokens([AddedToken(t, special=False) for t in added])
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "</s>",
        "unk_token": "<unk>",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return out_dir


def train_sentencepiece(
    texts,
    model_path: str | Path,
    vocab_size: int = 400,
    model_type: str = "unigram",
    byte_fallback: bool = False,
    normalization: str = "nmt_nfkc",
    character_coverage: float = 0.9995,
    num_threads: int = 1,
) -> Path:
    """Train a sentencepiece model (default settings: NFKC, whitespace folding) and write it."""
    import io

    import sentencepiece as spm

    model_path = Path(model_path)
    model_path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type=model_type,
        byte_fallback=byte_fallback,
        normalization_rule_name=normalization,
        character_coverage=character_coverage,
        max_sentence_length=1_000_000,
        train_extremely_large_corpus=False,
        minloglevel=2,
        num_threads=num_threads,
    )
    model_path.write_bytes(buf.getvalue())
    return model_path


def make_checkpoint_layout(
    ckpt_dir: str | Path,
    tokenizer: str | Path,
    kind: str,
    padded_vocab_size: int,
    eos_token_id: int | None,
) -> Path:
    """A directory shaped like a ``porting import`` checkpoint: ``context/porting.json`` naming the
    tokenizer (copied under ``context/``), an empty ``weights/``. Only what data prep reads."""
    ckpt_dir = Path(ckpt_dir)
    (ckpt_dir / "weights").mkdir(parents=True, exist_ok=True)
    ctx = ckpt_dir / "context"
    ctx.mkdir(parents=True, exist_ok=True)
    tokenizer = Path(tokenizer)
    if kind == "hf":
        rel = "context/nemo_tokenizer"
        shutil.copytree(tokenizer, ckpt_dir / rel, dirs_exist_ok=True)
    else:
        rel = "context/tokenizer.model"
        shutil.copy(tokenizer, ckpt_dir / rel)
    hf_config = {"architectures": ["LlamaForCausalLM"], "vocab_size": padded_vocab_size}
    if eos_token_id is not None:
        hf_config["eos_token_id"] = eos_token_id
    manifest = {
        "family": "tsuzumi",
        "hf_architecture": "LlamaForCausalLM",
        "hf_config": hf_config,
        "vocab_size": padded_vocab_size,
        "padded_vocab_size": padded_vocab_size,
        "dtype": "float32",
        "tokenizer": {"kind": kind, "path": rel},
        "format": "porting-nemo2",
        "version": 1,
    }
    (ctx / "porting.json").write_text(json.dumps(manifest, indent=2))
    return ckpt_dir


def _reference_tokenizer_args(tokenizer_type: str, tokenizer_model: str):
    import argparse

    return argparse.Namespace(
        tokenizer_type=tokenizer_type,
        tokenizer_model=tokenizer_model,
        vocab_file=None,
        merge_file=None,
        tokenizer_metadata=None,
        tiktoken_pattern=None,
        vocab_size=None,
        tiktoken_num_special_tokens=1000,
        tiktoken_special_tokens=None,
    )


_REF_STATE: dict = {}


def _reference_init(tokenizer_type: str, tokenizer_model: str, hf_kwargs: dict) -> None:
    try:
        from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    except ImportError:  # Megatron-Core 0.15
        _reference_init_015(tokenizer_type, tokenizer_model, hf_kwargs)
        return
    import argparse

    from megatron.training.arguments import _add_tokenizer_args

    # Megatron-Core 0.19's tools/preprocess_data.py: its own tokenizer arguments (fast, with
    # special tokens, unless told not to) and the dummy values it sets after parsing
    argv = ["--tokenizer-type", tokenizer_type, "--tokenizer-model", tokenizer_model]
    if tokenizer_type == "HuggingFaceTokenizer":
        if not hf_kwargs.get("use_fast", False):
            argv.append("--tokenizer-hf-no-use-fast")
        if not hf_kwargs.get("include_special_tokens", False):
            argv.append("--tokenizer-hf-no-include-special-tokens")
    args = _add_tokenizer_args(argparse.ArgumentParser()).parse_args(argv)
    args.rank, args.make_vocab_size_divisible_by = 1, 128
    args.tensor_model_parallel_size, args.vocab_extra_ids = 1, 0
    _REF_STATE["tok"] = build_tokenizer(args)


def _reference_init_015(tokenizer_type: str, tokenizer_model: str, hf_kwargs: dict) -> None:
    from megatron.core.tokenizers import MegatronTokenizer
    from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer

    if hf_kwargs and tokenizer_type == "HuggingFaceTokenizer":
        # Megatron >= 0.17's build_tokenizer passes these two; 0.15's defaults are both False.
        _REF_STATE["tok"] = MegatronTokenizer.from_pretrained(
            tokenizer_path=tokenizer_model, metadata_path={"library": "huggingface"}, **hf_kwargs
        )
    else:
        _REF_STATE["tok"] = build_tokenizer(
            _reference_tokenizer_args(tokenizer_type, tokenizer_model)
        )


def _reference_encode(line: str, json_keys: tuple[str, ...], append_eod: bool):
    # tools/preprocess_data.py, Encoder.encode (core_v0.15.3), without sentence splitting.
    tok = _REF_STATE["tok"]
    data = json.loads(line)
    ids, lens = {}, {}
    for key in json_keys:
        text = data[key]
        sentences = text if isinstance(text, list) else [text]
        doc_ids, sentence_lens = [], []
        for sentence in sentences:
            sentence_ids = tok.tokenize(sentence)
            if len(sentence_ids) > 0:
                doc_ids.extend(sentence_ids)
                sentence_lens.append(len(sentence_ids))
        if len(doc_ids) > 0 and append_eod:
            doc_ids.append(tok.eod)
            sentence_lens[-1] += 1
        ids[key] = doc_ids
        lens[key] = sentence_lens
    return ids, lens, len(line)


#: Megatron's HuggingFaceTokenizer as megatron-core 0.17+ (and the legacy tokenizer) build it.
FAST_WITH_BOS = {"include_special_tokens": True, "use_fast": True}


def prep_config(inputs, output_prefix, tokenizer, **kw):
    """A :class:`data_prep.executors.base.PrepConfig` over local paths that encodes in this
    process (no worker start-up) unless ``in_process=False`` is passed."""
    from data_prep.executors.base import PrepConfig
    from data_prep.tokenizer import resolve

    kw.setdefault("in_process", True)
    return PrepConfig([str(i) for i in inputs], str(output_prefix), resolve(str(tokenizer)), **kw)


def megatron_reference(
    input_path: str | Path,
    output_prefix: str | Path,
    tokenizer_type: str,
    tokenizer_model: str | Path,
    json_keys: tuple[str, ...] = ("text",),
    append_eod: bool = True,
    workers: int = 0,
    hf_kwargs: dict | None = None,
) -> dict[str, Path]:
    """Write ``{prefix}_{key}_document.bin/.idx`` as Megatron's ``preprocess_data.py`` would.

    ``workers=0`` encodes in this process; otherwise a ``multiprocessing.Pool(workers)`` with
    ``imap(..., 32)`` as the script does (used for timing). Unlike the script (which finalizes only
    the last key's ``.idx``), every key's index is written. Returns the prefixes per key.
    """
    import functools
    import multiprocessing

    from megatron.core.datasets import indexed_dataset

    hf_kwargs = dict(hf_kwargs or {})
    _reference_init(tokenizer_type, str(tokenizer_model), hf_kwargs)
    tokenizer = _REF_STATE["tok"]
    prefixes, builders = {}, {}
    for key in json_keys:
        prefixes[key] = Path(f"{output_prefix}_{key}_document")
        builders[key] = indexed_dataset.IndexedDatasetBuilder(
            str(prefixes[key]) + ".bin",
            dtype=indexed_dataset.DType.optimal_dtype(tokenizer.vocab_size),
        )
    encode = functools.partial(_reference_encode, json_keys=tuple(json_keys), append_eod=append_eod)
    with open(input_path, encoding="utf-8") as fin:
        if workers:
            pool = multiprocessing.get_context("fork").Pool(
                workers,
                initializer=_reference_init,
                initargs=(tokenizer_type, str(tokenizer_model), hf_kwargs),
            )
            docs = pool.imap(encode, fin, 32)
        else:
            pool, docs = None, map(encode, fin)
        for doc, sentence_lens, _ in docs:
            for key in doc.keys():
                builders[key].add_document(doc[key], sentence_lens[key])
        if pool is not None:
            pool.close()
            pool.join()
    for key in json_keys:
        builders[key].finalize(str(prefixes[key]) + ".idx")
    return prefixes
