"""The provenance sidecar (data_prep.provenance): every document of a `prep-data` output leads back
to its source record, through resume, merge and the unit executors, and a hostile sidecar is
refused by name.

That the Ray and Slurm executors write the local executor's sidecar byte for byte (their units'
lines placed after those of the units before them): tests/test_prep_ray.py, tests/test_prep_slurm.py
and tests/test_slurm.py compare it with the rest of the output; a killed and resumed run's:
tests/test_prep_inputs.py::test_killed_run_resumes_without_redoing_work_and_ends_byte_identical.
"""

from __future__ import annotations

import gzip
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from data_prep import provenance as P
from data_prep import testing as T
from data_prep.executors.base import output_prefix_for
from data_prep.inspection import document_origin
from data_prep.merge import merge
from data_prep.prep import prepare
from data_prep.reference import load_reference
from porting.errors import PortingError

KEYS = ("text", "title")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return T.train_hf_bpe(T.synthetic_texts(80, seed=3), tmp_path_factory.mktemp("tok"), 300)


@pytest.fixture(scope="module")
def ref(tok):
    return load_reference("hf", tok)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict:
    """A plain JSONL file with bad lines among the good, the same records gzipped, a parquet
    file and a saved dataset with two splits: each record has a text and a title."""
    import datasets

    d = tmp_path_factory.mktemp("sources")
    texts = T.synthetic_texts(30, seed=21, mean_chars=250)
    rows = [{"text": t, "title": f"title {i}: {t[:12]}"} for i, t in enumerate(texts)]
    bad = {3: b"{broken", 9: b'{"text": null, "title": "x"}', 17: b""}
    plain = T.write_jsonl(d / "a.jsonl", rows[:20], bad)
    (d / "b.jsonl.gz").write_bytes(gzip.compress(T.write_jsonl(d / "b", rows[20:]).read_bytes()))
    datasets.Dataset.from_list(rows[5:15]).to_parquet(str(d / "c.parquet"))
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(rows[:4]),
            "test": datasets.Dataset.from_list(rows[4:9]),
        }
    ).save_to_disk(str(d / "ds"))
    return {"dir": d, "plain": plain, "gz": d / "b.jsonl.gz", "parquet": d / "c.parquet",
            "dataset": d / "ds", "bad": bad}  # fmt: skip


def _source_lines(path) -> list[bytes]:
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return data.split(b"\n")


def test_every_document_leads_back_to_its_source_text(sources, tok, ref, tmp_path):
    """Four kinds of input, two keys, bad lines skipped, chunks of 1.5 kB: for every document
    the sidecar names the file and the line (or row) of the record it was made from and its
    byte offset; the text there has the recorded hash, Megatron's ids of it are the document's
    (with its EOD) and the document decodes back to it. Checked against the files themselves,
    not only through the sidecar's own reader."""
    inputs = [sources["plain"], sources["gz"], sources["parquet"], sources["dataset"]]
    report = prepare(
        T.prep_config(inputs, tmp_path / "out", tok, json_keys=KEYS, append_eod=True,
                      on_error="skip", chunk_bytes=1500, split="test")
    )  # fmt: skip
    assert report["skipped"] == len(sources["bad"])
    # the per-core rate: the tokens over every CPU-second of the run
    t = report["time"]
    tokens = sum(o["tokens"] for o in report["outputs"].values())
    assert tokens / t["tokens_per_cpu_s"] == pytest.approx(t["cpu_seconds"], abs=6e-4)  # to 1 ms
    good_lines = [n for n in range(len(_source_lines(sources["plain"])) - 1)
                  if n not in sources["bad"]]  # fmt: skip
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for key in KEYS:
        prefix = output_prefix_for(tmp_path / "out", key)
        assert report["outputs"][key]["provenance"] == f"{prefix}.prov"
        ds = IndexedDataset(str(prefix))
        side = P.read(f"{prefix}.prov", len(ds.document_indices) - 1)
        assert side.key == key and [s["path"] for s in side.sources] == [
            str(p.resolve()) for p in inputs
        ]
        assert side.sources[3]["split"] == "test" and side.sources[2]["unit"] == "row"
        seen = []
        for n in range(side.count):
            ids = ds[n].tolist()  # one sequence per document: no sentence splitting
            origin = document_origin(side, n, ids, ref)
            assert origin["source_now"] == "unchanged", (n, origin)
            assert origin["ids_match_source"] and origin["decodes_to_source"], (n, origin)
            rec = side.record(n)
            path, kind = rec["source"]["path"], rec["source"]["kind"]
            seen.append((path, rec["record"]))
            if kind in ("jsonl", "jsonl.gz"):
                lines = _source_lines(Path(path))
                line = lines[rec["record"] - 1]
                assert json.loads(line)[key] == origin["text"]
                assert rec["offset"] == sum(len(x) + 1 for x in lines[: rec["record"] - 1])
            else:
                assert rec["offset"] == -1
        # every record kept once, in input order; the skipped lines nowhere
        plain = str(sources["plain"].resolve())
        assert [r for p, r in seen if p == plain] == [n + 1 for n in good_lines]
        assert [r for p, r in seen if p.endswith("c.parquet")] == list(range(1, 11))
        assert [r for p, r in seen if p.endswith("ds")] == list(range(1, 6))  # the test split
        assert [p for p, _ in seen] == sorted([p for p, _ in seen], key=lambda p: [
            str(i.resolve()) for i in inputs].index(p))  # fmt: skip


@pytest.fixture(scope="module")
def two(sources, tok, tmp_path_factory) -> dict:
    """Two datasets of the plain file's first and the gzip file's records, the second written
    without a sidecar (as Megatron's own script writes)."""
    d = tmp_path_factory.mktemp("two")
    prepare(T.prep_config([sources["plain"]], d / "a", tok, append_eod=True, on_error="skip"))
    prepare(T.prep_config([sources["gz"]], d / "b", tok, append_eod=True, provenance=False))
    return {k: output_prefix_for(d / k, "text") for k in ("a", "b")}


def test_merge_chains_the_sidecars_and_points_at_a_dataset_that_has_none(two, tmp_path):
    a, b = two["a"], two["b"]
    assert P.sidecar_path(a).exists() and not P.sidecar_path(b).exists()
    out = merge([str(a), str(b), str(a)], tmp_path / "m")
    assert out["provenance_unknown"] == [str(b)]
    n_a = P.read(P.sidecar_path(a)).count
    n_b = json.loads((a.parent / "b.prep-report.json").read_text())["outputs"]["text"]["documents"]
    merged = P.read(P.sidecar_path(tmp_path / "m"), 2 * n_a + n_b)
    # a's source listed once for both of its copies, b as the dataset it is
    assert [s["kind"] for s in merged.sources] == ["jsonl", "dataset"]
    assert merged.sources[1]["path"] == str(b.resolve()) and merged.key == "text"
    records = np.concatenate(list(merged.block_records()))
    mine = np.concatenate(list(P.read(P.sidecar_path(a)).block_records()))
    assert records[:n_a].tobytes() == records[n_a + n_b :].tobytes() == mine.tobytes()
    tail = records[n_a : n_a + n_b]
    assert (tail["source"] == 1).all() and (tail["offset"] == -1).all() and not tail["hash"].any()
    assert tail["record"].tolist() == list(range(1, n_b + 1))

    # none of the inputs has one: neither has the output, and an older one there goes with
    # --overwrite (it would describe other documents)
    P.sidecar_path(tmp_path / "m2").write_bytes(P.sidecar_path(tmp_path / "m").read_bytes())
    with pytest.raises(PortingError, match=r"m2\.prov exists; pass --overwrite"):
        merge([str(b)], tmp_path / "m2")
    assert merge([str(b)], tmp_path / "m2", overwrite=True)["provenance"] is None
    assert not P.sidecar_path(tmp_path / "m2").exists()


def test_without_provenance_no_sidecar_is_left_beside_the_pair(sources, tok, tmp_path):
    prefix = output_prefix_for(tmp_path / "out", "text")
    cfg = dict(append_eod=True, on_error="skip")
    prepare(T.prep_config([sources["plain"]], tmp_path / "out", tok, **cfg))
    assert P.sidecar_path(prefix).exists()
    report = prepare(
        T.prep_config([sources["plain"]], tmp_path / "out", tok, provenance=False, overwrite=True,
                      **cfg)
    )  # fmt: skip
    assert report["outputs"]["text"]["provenance"] is None
    assert not P.sidecar_path(prefix).exists(), "an earlier run's sidecar describes other documents"
    # a sidecar alone is an output too: not replaced without --overwrite
    P.sidecar_path(tmp_path / "x_text_document").write_bytes(b"")
    with pytest.raises(PortingError, match=r"x_text_document\.prov exists; pass --overwrite"):
        prepare(T.prep_config([sources["plain"]], tmp_path / "x", tok, **cfg))


def _sidecar(tmp_path, sources_list=None, records=None, head=None):
    entries = sources_list if sources_list is not None else [
        {"path": str(tmp_path / "s.jsonl"), "kind": "jsonl", "unit": "line", "size": 1,
         "mtime_ns": 1, "split": None}
    ]  # fmt: skip
    body = records if records is not None else P.records(0, [1], [0], np.zeros(1, np.uint64))
    path = tmp_path / "d.prov"
    path.write_bytes((head if head is not None else P.header(entries, "text")) + body.tobytes())
    return path


def _header_of(meta) -> bytes:
    body = json.dumps(meta).encode()
    return struct.pack("<8sIQ", b"PORTPROV", 1, len(body)) + body


GOOD_ENTRY = {"path": "/x.jsonl", "kind": "jsonl", "unit": "line", "size": 1, "mtime_ns": 1,
              "split": None}  # fmt: skip
META = {"format": P.FORMAT, "key": "text", "hash": P.HASH}
HOSTILE = {
    "not a sidecar": (b"PK\x03\x04 a zip", "not a prep-data provenance file"),
    "another version": (struct.pack("<8sIQ", b"PORTPROV", 9, 2) + b"{}", "provenance format 9"),
    "a header past the end": (struct.pack("<8sIQ", b"PORTPROV", 1, 1 << 40), "past the file's end"),
    "a header that is not JSON": (struct.pack("<8sIQ", b"PORTPROV", 1, 3) + b"{{{", "not JSON"),
    "a list for a header": (_header_of([1, 2]), "not a provenance header"),
    "another hash": (_header_of({**META, "hash": "md5", "sources": []}), "another hash"),
    "a source of another shape": (
        _header_of({**META, "sources": [{**GOOD_ENTRY, "extra": 1}]}),
        "source 0 of the header",
    ),
    "a size that is not a number": (
        _header_of({**META, "sources": [{**GOOD_ENTRY, "size": True}]}),
        "source 0 of the header",
    ),
    "a kind of no input": (
        _header_of({**META, "sources": [{**GOOD_ENTRY, "kind": "exe"}]}),
        "source 0 of the header",
    ),
    "part of a record": (_header_of({**META, "sources": []}) + b"\x00" * 27, "not a whole number"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_sidecar_is_refused_naming_it(name, tmp_path):
    data, why = HOSTILE[name]
    path = tmp_path / "d.prov"
    path.write_bytes(data)
    with pytest.raises(PortingError, match=why) as err:
        P.read(path)
    assert str(path) in str(err.value)


def test_records_that_name_no_source_or_another_count_are_refused(tmp_path):
    path = _sidecar(tmp_path, records=P.records(3, [1], [0], np.zeros(1, np.uint64)))
    with pytest.raises(PortingError, match="document 0 names source 3, but the header lists 1"):
        P.read(path).record(0)
    with pytest.raises(PortingError, match="names source 3"):
        list(P.read(path).block_records())
    with pytest.raises(PortingError, match="1 documents' provenance, but its dataset has 2"):
        P.read(_sidecar(tmp_path), documents=2)


@pytest.mark.parametrize(
    "what",
    ["fifo", "directory", "device", "gone", "changed", "past the end", "a parquet file without the column",
     "a dataset without the split", "a corrupt gzip stream"],
)  # fmt: skip
def test_a_source_that_is_not_what_was_read_is_said_and_its_text_not_shown(what, tmp_path):
    """A sidecar's source is read only where it is a regular file (a FIFO would hang the read,
    a device would never end), and its text returned only where it has the recorded hash."""
    src = tmp_path / "s.jsonl"
    src.write_text(json.dumps({"text": "secret words"}) + "\n")
    entry = {**GOOD_ENTRY, "path": str(src)}
    offset = 0
    if what == "fifo":
        src.unlink()
        os.mkfifo(src)
    elif what == "directory":
        src.unlink()
        src.mkdir()
    elif what == "device":
        entry["path"] = "/dev/zero"
    elif what == "gone":
        src.unlink()
    elif what == "past the end":
        offset = 1 << 20
    elif what == "a corrupt gzip stream":
        data = gzip.compress(src.read_bytes())
        (tmp_path / "s.jsonl.gz").write_bytes(data[:12] + b"\xff" * 40)
        entry |= {"path": str(tmp_path / "s.jsonl.gz"), "kind": "jsonl.gz"}
    elif what == "a parquet file without the column":
        import datasets

        datasets.Dataset.from_dict({"other": ["secret words"]}).to_parquet(str(tmp_path / "p"))
        entry |= {"path": str(tmp_path / "p"), "kind": "parquet", "unit": "row"}
    elif what == "a dataset without the split":
        import datasets

        datasets.DatasetDict(
            {"train": datasets.Dataset.from_dict({"text": ["secret words"]})}
        ).save_to_disk(str(tmp_path / "ds"))
        entry |= {
            "path": str(tmp_path / "ds"),
            "kind": "hf-dataset",
            "unit": "row",
            "split": "test",
        }
    hashes = np.array([int(P.text_hash("other words"), 16)], np.uint64)
    if what != "changed":
        hashes[0] = int(P.text_hash("secret words"), 16)
    side = P.read(_sidecar(tmp_path, [entry], P.records(0, [1], [offset], hashes)))
    origin = document_origin(side, 0, [1, 2])
    if what == "changed":
        assert origin["source_now"].startswith("changed") and "text" not in origin
    else:
        assert origin["source_now"].startswith("unreadable: ") and "text" not in origin, origin
        if what in ("fifo", "directory", "device"):
            assert "not a regular file" in origin["source_now"]
        if what.startswith("a parquet") or what.startswith("a dataset"):
            assert "cannot read its 'text' column" in origin["source_now"], origin
        if what == "a corrupt gzip stream":
            assert "cannot read it (" in origin["source_now"], origin


def test_inspect_doc_says_where_a_document_came_from(two, tok, cli):
    a = two["a"]
    side = P.read(P.sidecar_path(a))
    rec = side.record(5)
    done = cli(["prep-data", "inspect", str(a), "--doc", "5"])
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert f"provenance {P.sidecar_path(a)}: 1 source(s)" in out
    assert f"from {rec['source']['path']} line {rec['record']} (byte {rec['offset']})" in out
    assert "source now: unchanged" in out
    assert "Megatron's ids of the source text are this document's; decoded, it is the source" in out
    done = cli(["prep-data", "inspect", str(a), "--doc", str(side.count)])
    assert done.returncode == 2
    assert f"--doc {side.count}: {a} has documents 0 to {side.count - 1}" in done.stderr
    done = cli(["prep-data", "inspect", str(two["b"]), "--doc", "0"])
    assert done.returncode == 2 and "written without provenance" in done.stderr
