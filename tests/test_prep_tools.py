"""`porting prep-data merge` / `inspect`, the checkpoint contract, and the command line itself."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from data_prep import testing as T
from data_prep.prep import output_prefix_for, prepare
from porting.cli import main
from porting.errors import PortingError


@pytest.fixture(scope="module")
def texts():
    return T.synthetic_texts(30, seed=5, mean_chars=300)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return T.train_hf_bpe(T.synthetic_texts(80, seed=3), tmp_path_factory.mktemp("tok"), 300)


def _prep(inputs, prefix, tokenizer, **kw) -> dict:
    kw.setdefault("append_eod", True)
    return prepare(T.prep_config(inputs, prefix, tokenizer, **kw))


def _bytes(prefix) -> tuple[bytes, bytes]:
    return (open(f"{prefix}.bin", "rb").read(), open(f"{prefix}.idx", "rb").read())


@pytest.fixture(scope="module")
def parts(tmp_path_factory, texts, tok):
    """Three prepared prefixes (one with an empty document) in one directory."""
    d = tmp_path_factory.mktemp("parts")
    out = []
    for i, chunk in enumerate((texts[:10], texts[10:11] + [""], texts[11:])):
        c = T.write_jsonl(d / f"src{i}.jsonl", [{"text": t} for t in chunk])
        _prep([c], d / f"p{i}", tok, keep_empty=True, include_special_tokens=False)
        out.append(str(output_prefix_for(d / f"p{i}", "text")))
    return d, out


def test_merge_is_byte_identical_to_megatrons_builder(tmp_path, parts):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    d, prefixes = parts
    # tools/merge_datasets.py: the first input's dtype, add_index per prefix in sorted order.
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    builder = IndexedDatasetBuilder(
        str(tmp_path / "ref.bin"), dtype=IndexedDataset(prefixes[0]).index.dtype
    )
    for p in sorted(prefixes):
        builder.add_index(p)
    builder.finalize(str(tmp_path / "ref.idx"))
    assert main(["prep-data", "merge", *prefixes, "--output-prefix", str(tmp_path / "m")]) == 0
    assert _bytes(tmp_path / "m") == _bytes(tmp_path / "ref")
    # merge_datasets.py's spelling: every pair in a directory, sorted.
    merged_dir = tmp_path / "dir"
    merged_dir.mkdir()
    for p in prefixes:
        for ext in (".bin", ".idx"):
            (merged_dir / (p.rsplit("/", 1)[1] + ext)).write_bytes(open(p + ext, "rb").read())
    assert (
        main(
            [
                "prep-data",
                "merge",
                "--input",
                str(merged_dir),
                "--output-prefix",
                str(tmp_path / "m2"),
            ]
        )
        == 0
    )
    assert _bytes(tmp_path / "m2") == _bytes(tmp_path / "ref")
    merged = IndexedDataset(str(tmp_path / "m2"))  # its arrays die with it (mmap closed)
    assert merged.document_indices.tolist()[10:13] == [10, 11, 11]


def test_merge_refuses_mixed_token_dtypes_and_truncated_data(tmp_path, parts, capsys):
    d, prefixes = parts
    wide = T.make_wordlevel_tokenizer(tmp_path / "wide", 70000)
    c = T.write_jsonl(tmp_path / "w.jsonl", [{"text": "w1 w2"}])
    _prep([c], tmp_path / "w", wide)
    wide_prefix = str(output_prefix_for(tmp_path / "w", "text"))
    merge = ["prep-data", "merge", "--output-prefix", str(tmp_path / "m")]
    assert main([*merge, prefixes[0], wide_prefix]) == 2
    assert "token dtype int32 differs" in capsys.readouterr().err
    cut = tmp_path / "cut"
    (tmp_path / "cut.idx").write_bytes(open(prefixes[0] + ".idx", "rb").read())
    (tmp_path / "cut.bin").write_bytes(open(prefixes[0] + ".bin", "rb").read()[:-2])
    assert main([*merge, str(cut), prefixes[1]]) == 2
    assert re.search(r"cut\.bin: \d+ bytes, but its index describes", capsys.readouterr().err)
    assert not (tmp_path / "m.bin").exists() and not (tmp_path / "m.idx").exists()


def test_inspect_counts_and_decodes_the_first_documents(tmp_path, texts, tok, capsys):
    from data_prep.inspection import inspect_dataset

    c = T.write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts[:5]] + [{"text": ""}])
    report = _prep([c], tmp_path / "out", tok, keep_empty=True)
    prefix = output_prefix_for(tmp_path / "out", "text")
    info = inspect_dataset(prefix, n_docs=2, max_tokens=10_000)
    assert info["tokenizer_from"] == "report"
    assert (info["documents"], info["empty_documents"], info["tokens"]) == (
        6,
        0,
        report["outputs"]["text"]["tokens"],
    ), "with BOS, an empty text is a (two-token) document"
    assert info["documents_ending_in_eod"] == "6/6"
    assert [d["text"] for d in info["first_documents"]] == [f"<s>{t}</s>" for t in texts[:2]]
    assert main(["prep-data", "inspect", str(prefix), "--docs", "1"]) == 0
    out = capsys.readouterr().out
    assert "6 documents" in out and texts[0][:20] in out


def test_checkpoint_tokenizer_meets_the_models_contract(tmp_path, texts, tok):
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(str(tok)).eos_token_id
    ckpt = T.make_checkpoint_layout(
        tmp_path / "ckpt", tok, "hf", padded_vocab_size=384, eos_token_id=eos
    )
    c = T.write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts])
    report = _prep([c], tmp_path / "ok", ckpt)
    assert report["tokenizer"]["checkpoint"]["padded_vocab_size"] == 384
    assert report["tokenizer"]["eod"] == eos
    _prep([c], tmp_path / "plain", tok)
    assert _bytes(output_prefix_for(tmp_path / "ok", "text")) == _bytes(
        output_prefix_for(tmp_path / "plain", "text")
    )

    small = T.make_checkpoint_layout(
        tmp_path / "small", tok, "hf", padded_vocab_size=256, eos_token_id=eos
    )
    with pytest.raises(
        PortingError, match="tokenizer has 300 entries but the model's vocabulary is 256"
    ):
        _prep([c], tmp_path / "x", small)
    other_eos = T.make_checkpoint_layout(
        tmp_path / "eos", tok, "hf", padded_vocab_size=384, eos_token_id=7
    )
    with pytest.raises(PortingError, match=f"EOD id is {eos} but the model's eos_token_id is 7"):
        _prep([c], tmp_path / "x", other_eos)
    broken = tmp_path / "ckpt" / "context" / "porting.json"
    broken.write_text('{"padded_vocab_size": 384,')
    with pytest.raises(PortingError, match="porting.json:1: not valid JSON"):
        _prep([c], tmp_path / "x", ckpt)


def test_sentencepiece_checkpoint(tmp_path, texts):
    sp = T.train_sentencepiece(
        T.synthetic_texts(200, seed=2), tmp_path / "sp.model", 2000, character_coverage=0.98
    )
    ckpt = T.make_checkpoint_layout(
        tmp_path / "ckpt", sp, "sentencepiece", padded_vocab_size=2048, eos_token_id=2
    )
    c = T.write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts])
    report = _prep([c], tmp_path / "out", ckpt)
    assert report["tokenizer"]["kind"] == "sentencepiece" and report["tokenizer"]["eod"] == 2


def test_tokenizer_of_a_checkpoint_porting_imported(tmp_path, texts, tiny_nemo, tiny_llama):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_llama))
    manifest = json.loads((tiny_nemo / "context" / "porting.json").read_text())
    c = T.write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts[:8]])
    report = _prep([c], tmp_path / "out", tiny_nemo, chunk_bytes=1000)
    assert report["tokenizer"]["checkpoint"]["padded_vocab_size"] == manifest["padded_vocab_size"]
    assert report["tokenizer"]["checkpoint"]["vocab_size"] == manifest["hf_config"]["vocab_size"]
    assert report["tokenizer"]["eod"] == hf.eos_token_id == manifest["hf_config"]["eos_token_id"]
    ds = IndexedDataset(str(output_prefix_for(tmp_path / "out", "text")))
    for d, text in enumerate(texts[:8]):
        ids = ds[int(ds.document_indices[d])].tolist()
        assert ids == hf(text).input_ids + [hf.eos_token_id]
        assert max(ids) < manifest["hf_config"]["vocab_size"]


def test_worker_flags_ids_outside_the_vocabulary(tok):
    from data_prep import worker
    from data_prep.tokenizer import backend_spec, megatron_facts

    facts = megatron_facts("hf", str(tok), True, True, [])
    spec = backend_spec(facts, "hf")
    worker.init(worker.WorkerConfig(("text",), spec, 1, False, True, "uint16", id_limit=100))
    res = worker.run(("bytes", b'{"text": "a"}\n{"text": "zzzz zzzz"}\n'))
    assert res.bad_id is not None and res.bad_id[0] in (0, 1) and res.bad_id[2] >= 100


def test_cli_with_worker_processes_matches_in_process_run(tmp_path, texts, tok, capsys):
    c = T.write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts], {3: b"null"})
    argv = [
        "prep-data", "--input", str(c), "--output-prefix", str(tmp_path / "cli"),
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tok),
        "--json-keys", "text", "--append-eod", "--workers", "2", "--on-error", "skip",
        "--chunk-mb", "0.002", "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    assert "skipped 1" in capsys.readouterr().out
    _prep([c], tmp_path / "lib", tok, on_error="skip")
    assert _bytes(output_prefix_for(tmp_path / "cli", "text")) == _bytes(
        output_prefix_for(tmp_path / "lib", "text")
    )
    report = json.loads((tmp_path / "cli.prep-report.json").read_text())
    assert report["skipped_records"][0]["reason"] == "not_object"
    assert main(argv[:5] + ["--tokenizer", str(tok), "--split-sentences"]) == 2
    assert "not supported" in capsys.readouterr().err


def test_cli_reports_bad_input_with_location_and_status_2(tmp_path, tok, capsys):
    c = T.write_jsonl(tmp_path / "c.jsonl", [{"text": "ok"}], {0: b'{"text": 1}'})
    argv = [
        "prep-data",
        "--input",
        str(c),
        "--output-prefix",
        str(tmp_path / "o"),
        "--tokenizer",
        str(tok),
    ]
    assert main(argv + ["--no-progress"]) == 2
    assert f"{c}:1: not_string" in capsys.readouterr().err
    assert (
        main(
            [
                "prep-data",
                "--input",
                str(c),
                "--output-prefix",
                "x",
                "--tokenizer-type",
                "GPT2BPETokenizer",
            ]
        )
        == 2
    )
    assert "not supported" in capsys.readouterr().err


def test_doc_lengths_index_writer_matches_megatron_builder(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from data_prep.writer import index_header, write_index_from_doc_lengths

    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 5, size=3000).astype(np.int32)  # many empty documents
    builder = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=np.uint16)
    for n in lengths:
        builder.add_document(np.arange(n), [int(n)] if n else [])
    builder.finalize(str(tmp_path / "ref.idx"))
    write_index_from_doc_lengths(tmp_path / "ours.idx", index_header(np.uint16), 2, lengths)
    assert (tmp_path / "ours.idx").read_bytes() == (tmp_path / "ref.idx").read_bytes()


def test_inspect_refuses_a_missing_or_broken_pair(tmp_path, capsys):
    assert main(["prep-data", "inspect", str(tmp_path / "absent")]) == 2
    assert re.search(r"absent\.(idx|bin): missing", capsys.readouterr().err)
    (tmp_path / "x.idx").write_bytes(b"garbage")
    (tmp_path / "x.bin").write_bytes(b"")
    assert main(["prep-data", "inspect", str(tmp_path / "x")]) == 2
    assert "x.idx: not a Megatron index" in capsys.readouterr().err
