"""Tokenizer records (data_prep.tokenizer): what Megatron's tokenizer decides for a tokenizer,
written by the first `prep-data` run on it and the start of every later run with the same files,
settings and library versions, which then imports neither megatron.core nor transformers.

That the bytes a run makes from a record are Megatron's own: every byte-identity test of data
prep (tests/test_prep.py, tests/test_prep_tools.py, tests/test_prep_inputs.py), whose runs after
a worker's first on each tokenizer start from its record (the suite's cache, tests/conftest.py).
Each case here has a cache of its own.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from data_prep import testing as T
from data_prep.executors.base import output_prefix_for
from data_prep.prep import prepare
from data_prep.tokenizer import (
    fingerprint,
    megatron_facts,
    read_record,
    record_key,
    record_path,
    resolve,
    write_record,
)
from porting.testing import foreign_lines

HEAD = ["a head text of the corpus", "東京 and more"]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A cache of this case's own (the suite's is shared by a worker's cases)."""
    d = tmp_path / "cache"
    monkeypatch.setenv("PORTING_CACHE_DIR", str(d))
    return d


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("tok")
    train = T.synthetic_texts(200, seed=2)
    return {
        "hf": T.train_hf_bpe(train, base / "bpe", vocab_size=300),
        "sentencepiece": T.train_sentencepiece(
            train, base / "sp.model", vocab_size=2000, character_coverage=0.98
        ),
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    texts = T.synthetic_texts(12, seed=9, mean_chars=200)
    return T.write_jsonl(tmp_path_factory.mktemp("c") / "c.jsonl", [{"text": t} for t in texts])


def _key(path: Path):
    source = resolve(str(path))
    return source, record_key(fingerprint(source, True, True))


def _bytes(prefix) -> tuple[bytes, bytes]:
    return (Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes())


@pytest.mark.parametrize("kind", ["hf", "sentencepiece"])
def test_the_record_holds_what_megatron_decides_for_the_probes(kind, tokenizers, cache):
    source, key = _key(tokenizers[kind])
    facts = megatron_facts(kind, str(source.path), True, True, HEAD)
    write_record(key, facts)
    got = read_record(key, source)
    assert got is not None and got.record == str(record_path(key))
    assert record_path(key).parent == cache / "tokenizers"
    for field in ("kind", "path", "include_special_tokens", "use_fast", "vocab_size", "eod"):
        assert getattr(got, field) == getattr(facts, field), field
    for field in ("dtype", "index_header", "payload"):
        assert getattr(got, field) == getattr(facts, field), field
    assert type(got.payload) is (bytes if kind == "sentencepiece" else str)
    # the probes and Megatron's ids for them; the corpus head is this run's, not the record's
    assert got.texts == facts.texts[: facts.probes] and got.ids == facts.ids[: facts.probes]
    assert got.probes == facts.probes == len(facts.texts) - len(HEAD)


_WARM_RUN = """
import json, sys
from data_prep.executors.base import PrepConfig
from data_prep.prep import prepare
from data_prep.tokenizer import resolve
corpus, prefix, tok = sys.argv[1:]
report = prepare(PrepConfig([corpus], prefix, resolve(tok), append_eod=True, in_process=True))
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"megatron", "transformers", "torch"})
print(json.dumps({"equivalence": report["equivalence"], "heavy": heavy}))
"""


@pytest.mark.parametrize("kind", ["hf", "sentencepiece"])
def test_a_second_run_starts_from_the_record_and_imports_no_megatron(
    kind, tokenizers, corpus, cache, tmp_path
):
    """The first run, a command as a user runs it, loads Megatron's tokenizer, records it and
    prints our lines only (on this stack torch's CUDA build logs "No CUDA runtime is found"
    through a handler of its own as Megatron's tokenizer loads); the second, in a fresh
    interpreter that tokenizes in process, starts from the record: neither megatron.core nor
    transformers (nor torch) is imported, and its bytes are the first run's."""
    tok = tokenizers[kind]
    user = subprocess.run(
        [sys.executable, "-m", "porting.cli", "prep-data", "--input", str(corpus),
         "--output-prefix", str(tmp_path / "one"), "--tokenizer", str(tok), "--append-eod"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert user.returncode == 0, user.stderr[-3000:]
    assert foreign_lines(user.stdout + user.stderr) == []
    first = json.loads((tmp_path / "one.prep-report.json").read_text())
    assert first["equivalence"]["tokenizer_record"] is None
    source, key = _key(tok)
    assert record_path(key).is_file()
    done = subprocess.run(
        [sys.executable, "-c", _WARM_RUN, str(corpus), str(tmp_path / "two"), str(tok)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    second = json.loads(done.stdout.strip().splitlines()[-1])
    assert second["heavy"] == []
    assert second["equivalence"]["tokenizer_record"] == str(record_path(key))
    # the probes checked against the record's ids; the head only where Megatron's was loaded
    n_probes = len(read_record(key, source).texts)
    assert second["equivalence"]["texts_checked_at_start"] == n_probes
    assert first["equivalence"]["texts_checked_at_start"] > n_probes
    for key_name in ("text",):
        one, two = (output_prefix_for(tmp_path / d, key_name) for d in ("one", "two"))
        assert _bytes(one) == _bytes(two)


def test_recheck_loads_megatrons_tokenizer_and_records_it_again(
    tokenizers, corpus, cache, tmp_path, cli, prep_in_process, caplog
):
    tok = tokenizers["hf"]
    base = ["prep-data", "--input", str(corpus), "--tokenizer", str(tok), "--append-eod",
            "--no-progress"]  # fmt: skip
    assert cli([*base, "--output-prefix", str(tmp_path / "a")]).returncode == 0
    _, key = _key(tok)
    record_path(key).write_text("{}")  # damaged: a recheck must not read it
    with caplog.at_level(logging.WARNING, logger="data_prep.tokenizer"):
        done = cli([*base, "--output-prefix", str(tmp_path / "b"), "--recheck-tokenizer"])
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "b.prep-report.json").read_text())
    assert report["equivalence"]["tokenizer_record"] is None
    # the damaged record was not even read
    assert not [r for r in caplog.records if "tokenizer record" in r.getMessage()]
    assert json.loads(record_path(key).read_text())["key"] == key  # written again
    assert _bytes(output_prefix_for(tmp_path / "a", "text")) == _bytes(
        output_prefix_for(tmp_path / "b", "text")
    )


DAMAGE = {
    "another library version": lambda d: d["key"]["libraries"].update(transformers="0.0.1"),
    "another tokenizer": lambda d: d["key"].update(tokenizer="0" * 64),
    "other probes": lambda d: d["key"].update(probes="0" * 64),
    "a token id past the vocabulary": lambda d: d["facts"]["ids"].__setitem__(1, [10**6]),
    "a negative token id": lambda d: d["facts"]["ids"].__setitem__(1, [-1]),
    "texts and ids that do not pair": lambda d: d["facts"]["ids"].pop(),
    "a dtype Megatron never picks": lambda d: d["facts"].update(dtype="float64"),
    "an EOD that is not an id": lambda d: d["facts"].update(eod=True),
    "bytes where the payload is text": lambda d: d["facts"].update(payload={"base64": "AA=="}),
    "a header that is not base64": lambda d: d["facts"].update(index_header={"base64": "@@"}),
    "a missing field": lambda d: d["facts"].pop("vocab_size"),
    "a kind of another tokenizer": lambda d: d["facts"].update(kind="sentencepiece"),
    "a flag that is not a flag": lambda d: d["facts"].update(use_fast="yes"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_record_that_cannot_be_trusted_is_named_and_not_used(damage, tokenizers, cache, caplog):
    source, key = _key(tokenizers["hf"])
    write_record(key, megatron_facts("hf", str(source.path), True, True, []))
    path = record_path(key)
    data = json.loads(path.read_text())
    DAMAGE[damage](data)
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="data_prep.tokenizer"):
        assert read_record(key, source) is None
    (said,) = [r.getMessage() for r in caplog.records if "tokenizer record" in r.getMessage()]
    assert said.startswith(f"{path}: tokenizer record not used (") and "loading Megatron" in said


@pytest.mark.parametrize("content", [b"{", b"\xff\xfe", b"[]", b"null"])
def test_a_record_that_is_not_one_is_named_and_replaced_by_the_run(
    content, tokenizers, corpus, cache, tmp_path, caplog
):
    tok = tokenizers["hf"]
    source, key = _key(tok)
    path = record_path(key)
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="data_prep.tokenizer"):
        report = prepare(T.prep_config([corpus], tmp_path / "out", tok, append_eod=True))
    assert report["equivalence"]["tokenizer_record"] is None
    assert any(
        r.getMessage().startswith(f"{path}: tokenizer record not used") for r in caplog.records
    )
    assert read_record(key, source) is not None  # the run recorded it anew


def test_a_record_the_backend_disagrees_with_is_decided_by_megatrons_tokenizer(
    tokenizers, corpus, cache, tmp_path, caplog
):
    """A record that passes every check of its form but holds another id for a probe (a stale or
    damaged cache): the backend's disagreement is not blamed on the backend; Megatron's tokenizer
    decides, the run writes the bytes a clean run writes, and the record is written anew."""
    tok = tokenizers["hf"]
    clean = prepare(T.prep_config([corpus], tmp_path / "clean", tok, append_eod=True))
    source, key = _key(tok)
    path = record_path(key)
    data = json.loads(path.read_text())
    probe = next(i for i, ids in enumerate(data["facts"]["ids"]) if ids)
    data["facts"]["ids"][probe][0] = (data["facts"]["ids"][probe][0] + 1) % 300
    path.write_text(json.dumps(data))
    assert read_record(key, source) is not None  # its form is a record's
    with caplog.at_level(logging.WARNING, logger="data_prep.prep"):
        report = prepare(T.prep_config([corpus], tmp_path / "out", tok, append_eod=True))
    (said,) = [r.getMessage() for r in caplog.records if "tokenizer record" in r.getMessage()]
    assert said == (
        f"{path}: tokenizer record not used (the hf backend disagrees with it on the probes); "
        "loading Megatron's tokenizer"
    )
    assert report["equivalence"]["tokenizer_record"] is None
    assert clean["equivalence"]["tokenizer_record"] is None  # the case's own cache was empty
    one, two = (output_prefix_for(tmp_path / d, "text") for d in ("clean", "out"))
    assert _bytes(one) == _bytes(two)
    assert json.loads(path.read_text())["facts"]["ids"] != data["facts"]["ids"]  # written anew


def test_changed_tokenizer_files_or_settings_are_another_record(tokenizers, tmp_path, cache):
    import shutil

    tok = shutil.copytree(tokenizers["hf"], tmp_path / "tok")
    source, key = _key(tok)
    write_record(key, megatron_facts("hf", str(tok), True, True, []))
    assert read_record(key, source) is not None
    config = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
    assert record_path(_key(tok)[1]) != record_path(key)
    assert read_record(_key(tok)[1], source) is None
    no_bos = record_key(fingerprint(source, False, True))
    assert record_path(no_bos) != record_path(key)


def test_a_cache_that_cannot_be_written_costs_only_the_record(
    tokenizers, corpus, tmp_path, monkeypatch
):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("PORTING_CACHE_DIR", str(blocked))
    report = prepare(T.prep_config([corpus], tmp_path / "out", tokenizers["hf"], append_eod=True))
    assert report["equivalence"]["tokenizer_record"] is None
    assert not list(tmp_path.glob("a-file*/**"))
