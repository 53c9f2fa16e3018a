"""`porting prep-data`: what it writes, against the tokenizer itself and against Megatron's writer.

Tokenizers are trained here (byte-level BPE, sentencepiece); the byte-identity oracle is
``data_prep.testing.megatron_reference``, which drives megatron-core's tokenizer and
``IndexedDatasetBuilder`` as Megatron-LM's ``tools/preprocess_data.py`` (core_v0.15.3) does.
"""

from __future__ import annotations

import numpy as np
import pytest

from data_prep import testing as T
from data_prep.prep import output_prefix_for, prepare
from porting.errors import PortingError

EDGE = [
    "line one\n\nline two\n",
    "ＧＰＵ１２８ 全角　スペース",
    "emoji 🤖 and a literal <s> in text",
    "  spaces  around  ",
    "x",
]


@pytest.fixture(scope="module")
def texts():
    return T.synthetic_texts(40, seed=7, mean_chars=400) + EDGE


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("tok")
    train = T.synthetic_texts(200, seed=2)
    return {
        "hf": T.train_hf_bpe(train + EDGE, base / "bpe", vocab_size=400),
        "sp": T.train_sentencepiece(
            train, base / "sp.model", vocab_size=2000, character_coverage=0.98
        ),
        "sp_bpe": T.train_sentencepiece(
            train,
            base / "sp_bpe.model",
            vocab_size=2000,
            model_type="bpe",
            byte_fallback=True,
            character_coverage=0.98,
        ),
    }


def _run(inputs, prefix, tokenizer, **kw) -> dict:
    return prepare(T.prep_config(inputs, prefix, tokenizer, **kw))


def _bytes(prefix) -> tuple[bytes, bytes]:
    return (open(f"{prefix}.bin", "rb").read(), open(f"{prefix}.idx", "rb").read())


def _documents(prefix) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(prefix))
    di = ds.document_indices
    return [
        [int(t) for s in range(di[d], di[d + 1]) for t in ds[int(s)]] for d in range(len(di) - 1)
    ]


@pytest.mark.parametrize("append_eod", [True, False])
def test_round_trip_documents_are_the_tokenizers_own_encoding(
    tmp_path, texts, tok_dirs, append_eod
):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from transformers import AutoTokenizer

    corpus = T.write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts])
    _run([corpus], tmp_path / "out", tok_dirs["hf"], append_eod=append_eod, chunk_bytes=4000)
    prefix = output_prefix_for(tmp_path / "out", "text")
    hf = AutoTokenizer.from_pretrained(str(tok_dirs["hf"]))
    ds = IndexedDataset(str(prefix))
    assert len(ds.document_indices) == len(texts) + 1
    for d, text in enumerate(texts):
        a, b = ds.document_indices[d], ds.document_indices[d + 1]
        assert b - a == 1, "one sequence per document"
        want = hf(text).input_ids + ([hf.eos_token_id] if append_eod else [])
        assert ds[int(a)].tolist() == want
        assert want[0] == hf.bos_token_id


@pytest.mark.parametrize(
    "include_special,use_fast,hf_kwargs",
    [
        (False, False, None),  # megatron-core 0.15's script as it ships (its defaults)
        (True, True, T.FAST_WITH_BOS),  # 0.17+ and legacy
    ],
)
def test_byte_identical_to_preprocess_data_hf(
    tmp_path, texts, tok_dirs, include_special, use_fast, hf_kwargs
):
    records = [{"text": t} for t in texts[:20]] + [{"text": ""}] + [{"text": t} for t in texts[20:]]
    corpus = T.write_jsonl(tmp_path / "c.jsonl", records)
    ref = T.megatron_reference(
        corpus, tmp_path / "ref", "HuggingFaceTokenizer", tok_dirs["hf"], hf_kwargs=hf_kwargs
    )["text"]
    _run(
        [corpus],
        tmp_path / "ours",
        tok_dirs["hf"],
        append_eod=True,
        keep_empty=True,
        include_special_tokens=include_special,
        use_fast=use_fast,
        chunk_bytes=3000,
    )
    assert _bytes(output_prefix_for(tmp_path / "ours", "text")) == _bytes(ref)


@pytest.mark.parametrize("model", ["sp", "sp_bpe"])
def test_byte_identical_to_preprocess_data_sentencepiece(tmp_path, texts, tok_dirs, model):
    # "   " encodes to no token at all: an empty document, as is "" with --keep-empty.
    records = [{"text": t} for t in texts] + [{"text": "   "}, {"text": ""}, {"text": "end"}]
    corpus = T.write_jsonl(tmp_path / "c.jsonl", records)
    ref = T.megatron_reference(corpus, tmp_path / "ref", "SentencePieceTokenizer", tok_dirs[model])
    _run([corpus], tmp_path / "ours", tok_dirs[model], append_eod=True, keep_empty=True)
    assert _bytes(output_prefix_for(tmp_path / "ours", "text")) == _bytes(ref["text"])


def test_empty_document_adds_no_sequence_and_repeats_the_document_index(tmp_path, tok_dirs):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    corpus = T.write_jsonl(tmp_path / "c.jsonl", [{"text": "abc"}, {"text": ""}, {"text": "de"}])
    _run(
        [corpus],
        tmp_path / "bare",
        tok_dirs["hf"],
        append_eod=True,
        keep_empty=True,
        include_special_tokens=False,
    )
    ds = IndexedDataset(str(output_prefix_for(tmp_path / "bare", "text")))
    assert ds.document_indices.tolist() == [0, 1, 1, 2]
    assert len(ds) == 2 and all(ds[i][-1] == 1 for i in range(2)), "EOD on non-empty documents only"
    # With the post-processor's BOS an empty text is one token long, so it gets its EOD.
    _run([corpus], tmp_path / "bos", tok_dirs["hf"], append_eod=True, keep_empty=True)
    docs = _documents(output_prefix_for(tmp_path / "bos", "text"))
    assert docs[1] == [0, 1]


def test_multiple_json_keys_each_give_a_complete_readable_pair(tmp_path, texts, tok_dirs):
    records = [{"text": t, "title": t[:30], "n": i} for i, t in enumerate(texts)]
    corpus = T.write_jsonl(tmp_path / "c.jsonl", records)
    report = _run(
        [corpus], tmp_path / "ours", tok_dirs["hf"], json_keys=("text", "title"), append_eod=True
    )
    ref = T.megatron_reference(
        corpus,
        tmp_path / "ref",
        "HuggingFaceTokenizer",
        tok_dirs["hf"],
        json_keys=("text", "title"),
        hf_kwargs=T.FAST_WITH_BOS,
    )
    for key in ("text", "title"):
        prefix = output_prefix_for(tmp_path / "ours", key)
        assert len(_documents(prefix)) == len(texts) == report["outputs"][key]["documents"]
        assert _bytes(prefix) == _bytes(ref[key])


@pytest.mark.parametrize("added,dtype", [((), np.uint16), (("extra",), np.int32)])
def test_token_dtype_is_uint16_below_65500_entries_counting_added_tokens(tmp_path, added, dtype):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tok = T.make_wordlevel_tokenizer(tmp_path / "tok", 65499, added)
    corpus = T.write_jsonl(tmp_path / "c.jsonl", [{"text": "w1 w65496 extra w3"}])
    report = _run([corpus], tmp_path / "ours", tok, append_eod=True)
    assert report["tokenizer"]["vocab_size"] == 65499 + len(added)
    prefix = output_prefix_for(tmp_path / "ours", "text")
    assert IndexedDataset(str(prefix)).index.dtype == dtype
    ref = T.megatron_reference(corpus, tmp_path / "ref", "HuggingFaceTokenizer", tok)
    assert IndexedDataset(str(ref["text"])).index.dtype == dtype


def test_gigatoken_backend_is_byte_identical(tmp_path, texts, tok_dirs):
    corpus = T.write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts])
    ref = T.megatron_reference(
        corpus,
        tmp_path / "ref",
        "HuggingFaceTokenizer",
        tok_dirs["hf"],
        hf_kwargs=T.FAST_WITH_BOS,
    )
    giga = _run([corpus], tmp_path / "gt", tok_dirs["hf"], append_eod=True, backend="gigatoken")
    assert giga["tokenizer"]["backend"] == "gigatoken"
    assert giga["equivalence"]["documents_compared"] > 0
    assert _bytes(output_prefix_for(tmp_path / "gt", "text")) == _bytes(ref["text"])


def test_gigatoken_rebuilt_and_batched_mid_corpus_gives_the_tokenizers_ids(
    texts, tok_dirs, monkeypatch
):
    # Its pretoken cache is bounded by rebuilding it every RESET_CHARS characters, and a worker
    # turns from per-document calls to batches after BATCH_AFTER_CHARS: neither may change an id.
    from tokenizers import Tokenizer

    from data_prep.backends import BackendSpec, GigatokenBackend

    payload = (tok_dirs["hf"] / "tokenizer.json").read_text()
    want = [
        e.ids for e in Tokenizer.from_str(payload).encode_batch(texts, add_special_tokens=False)
    ]
    monkeypatch.setattr(GigatokenBackend, "RESET_CHARS", 500)
    monkeypatch.setattr(GigatokenBackend, "BATCH_AFTER_CHARS", 4000)
    backend = GigatokenBackend(BackendSpec("gigatoken", "hf-json", payload))
    calls = []
    for name in ("_build", "_each", "_batch"):
        method = getattr(backend, name)
        monkeypatch.setattr(backend, name, lambda *a, n=name, m=method: calls.append(n) or m(*a))
    got_ids, got_lens = [], []
    for i in range(0, len(texts), 3):
        ids, lens = backend.encode(texts[i : i + 3])
        got_ids.append(ids)
        got_lens.append(lens)
    assert calls.count("_build") >= 5, "the tokenizer was rebuilt between batches"
    assert 0 < calls.count("_each") < len(got_ids), "documents one by one, then batches"
    assert calls[-1] == "_batch"
    ids, lens = np.concatenate(got_ids), np.concatenate(got_lens)
    assert lens.tolist() == [len(w) for w in want]
    assert ids.tolist() == [t for w in want for t in w]


def test_gigatoken_refused_where_it_differs_from_the_reference(tmp_path, texts, tok_dirs):
    # gigatoken reads a literal "<s>" in text as the control token; sentencepiece does not.
    corpus = T.write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts])
    with pytest.raises(PortingError, match="gigatoken backend does not reproduce Megatron"):
        _run([corpus], tmp_path / "gt", tok_dirs["sp_bpe"], backend="gigatoken")
    assert not list(tmp_path.glob("gt_text_document.*"))


def test_a_backend_differing_on_a_corpus_document_is_caught_with_its_location(
    tmp_path, texts, tok_dirs, monkeypatch
):
    from data_prep import prep
    from data_prep.backends import BackendSpec

    # A gigatoken that slipped past the start-up check: the per-chunk samples must catch it.
    other = T.train_hf_bpe(texts, tmp_path / "other", vocab_size=300)
    payload = (other / "tokenizer.json").read_text()
    monkeypatch.setattr(prep, "check_backend", lambda *a: 0)
    monkeypatch.setattr(
        prep,
        "backend_spec",
        lambda facts, name: BackendSpec("gigatoken", "hf-json", payload, prefix=(0,)),
    )
    corpus = T.write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts])
    with pytest.raises(
        PortingError, match=r"c\.jsonl:1: key 'text': the gigatoken backend does not"
    ):
        _run([corpus], tmp_path / "out", tok_dirs["hf"], backend="gigatoken")


def test_lossiness_is_reported_with_an_example(tmp_path, texts, tok_dirs):
    corpus = T.write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in EDGE + texts])
    sp = _run([corpus], tmp_path / "sp", tok_dirs["sp"])["lossiness"]
    # Default sentencepiece settings fold full-width forms and drop newlines.
    assert sp["differing"] > 0 and sp["share"] > 0
    assert sp["example"]["text"] != sp["example"]["decoded"] and sp["example"]["line"] >= 1
    hf = _run([corpus], tmp_path / "hf", tok_dirs["hf"])["lossiness"]
    # Byte-level BPE loses nothing, except that a literal "<s>" in text becomes the BOS token.
    assert hf["sampled_documents"] == sp["sampled_documents"] > 0 and hf["differing"] == 1
    assert "<s>" in hf["example"]["text"] and "<s>" not in hf["example"]["decoded"]


def test_a_wrong_head_start_guess_is_redone_under_the_reference(
    tmp_path, texts, tok_dirs, monkeypatch
):
    from data_prep import prep
    from data_prep.tokenizer import provisional

    def wrong(source, include_special, backend):
        spec, eod, vocab = provisional(source, include_special, backend)
        return spec, eod + 1, vocab  # as if transformers had remapped the EOS token

    monkeypatch.setattr(prep, "provisional", wrong)
    corpus = T.write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts])
    ref = T.megatron_reference(
        corpus,
        tmp_path / "ref",
        "HuggingFaceTokenizer",
        tok_dirs["hf"],
        hf_kwargs=T.FAST_WITH_BOS,
    )
    # a recheck: a tokenizer record (an earlier case's) would leave no guess to redo
    _run(
        [corpus], tmp_path / "ours", tok_dirs["hf"], append_eod=True, chunk_bytes=2000,
        recheck_tokenizer=True,
    )  # fmt: skip
    assert _bytes(output_prefix_for(tmp_path / "ours", "text")) == _bytes(ref["text"])
