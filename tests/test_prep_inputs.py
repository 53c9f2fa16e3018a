"""`porting prep-data` inputs: bad records (fail / skip), resume after a kill, gzip, globs, datasets."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from data_prep import testing as T
from data_prep.prep import output_prefix_for, prepare, work_path
from data_prep.report import report_path
from porting.errors import PortingError

BAD_LINES = [
    (b'{"text": "unterminated', "malformed_json"),
    (b"", "malformed_json"),
    (b'{"body": "no text key"}', "missing_key"),
    (b'{"text": null}', "not_string"),
    (b'{"text": 42}', "not_string"),
    (b'{"text": ["a", "list"]}', "not_string"),
    (b'{"text": ""}', "empty_text"),
    (b'{"text": "caf\xe9 latin-1"}', "invalid_utf8"),
    (b'{"text": "\\ud800 lone surrogate"}', "invalid_utf8"),
    (b'["an", "array"]', "not_object"),
]


@pytest.fixture(scope="module")
def texts():
    return T.synthetic_texts(24, seed=11, mean_chars=300)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return T.train_hf_bpe(T.synthetic_texts(80, seed=3), tmp_path_factory.mktemp("tok"), 300)


def _cfg(inputs, prefix, tok, **kw):
    kw.setdefault("append_eod", True)
    return T.prep_config(inputs, prefix, tok, **kw)


def _bytes(prefix) -> tuple[bytes, bytes]:
    return (open(f"{prefix}.bin", "rb").read(), open(f"{prefix}.idx", "rb").read())


def _outputs(prefix) -> list:
    p = output_prefix_for(prefix, "text")
    return [
        x for x in (f"{p}.bin", f"{p}.idx", report_path(prefix)) if __import__("os").path.exists(x)
    ]


@pytest.mark.parametrize(
    "line,kind", BAD_LINES, ids=[k + str(i) for i, (_, k) in enumerate(BAD_LINES)]
)
def test_bad_record_fails_at_its_file_and_line_and_writes_nothing(tmp_path, texts, tok, line, kind):
    records = [{"text": t} for t in texts[:5]]
    corpus = T.write_jsonl(tmp_path / "c.jsonl", records, raw_lines={2: line})
    with pytest.raises(PortingError, match=rf"c\.jsonl:3: {kind}: "):
        prepare(_cfg([corpus], tmp_path / "out", tok))
    assert _outputs(tmp_path / "out") == []


@pytest.mark.parametrize(
    "line,kind", BAD_LINES, ids=[k + str(i) for i, (_, k) in enumerate(BAD_LINES)]
)
def test_bad_record_skipped_is_counted_and_listed(tmp_path, texts, tok, line, kind):
    corpus = T.write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts[:5]], {2: line})
    clean = T.write_jsonl(
        tmp_path / "clean.jsonl", [{"text": t} for i, t in enumerate(texts[:5]) if i != 2]
    )
    report = prepare(_cfg([corpus], tmp_path / "out", tok, on_error="skip"))
    assert report["problems"] == {kind: 1} and report["skipped"] == 1
    [skipped] = report["skipped_records"]
    assert (skipped["file"], skipped["line"], skipped["reason"]) == (str(corpus), 3, kind)
    assert report["records"] == 4 and report["lines"] == 5
    prepare(_cfg([clean], tmp_path / "clean", tok))
    assert _bytes(output_prefix_for(tmp_path / "out", "text")) == _bytes(
        output_prefix_for(tmp_path / "clean", "text")
    )


def test_every_skipped_record_is_listed_across_chunks(tmp_path, texts, tok):
    bad = {i: BAD_LINES[i % len(BAD_LINES)][0] for i in range(1, 24, 3)}
    corpus = T.write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts], bad)
    report = prepare(_cfg([corpus], tmp_path / "out", tok, on_error="skip", chunk_bytes=700))
    assert [r["line"] for r in report["skipped_records"]] == [i + 1 for i in sorted(bad)]
    assert sum(report["problems"].values()) == report["skipped"] == len(bad)
    assert report["records"] == 24 - len(bad)


def test_keep_empty_writes_empty_text_as_megatron_does(tmp_path, texts, tok):
    corpus = T.write_jsonl(tmp_path / "c.jsonl", [{"text": texts[0]}, {"text": ""}])
    report = prepare(_cfg([corpus], tmp_path / "out", tok, keep_empty=True))
    assert report["skipped"] == 0 and report["outputs"]["text"]["documents"] == 2


_CRASHING_RUN = """
import sys
from data_prep.prep import PrepConfig, prepare
from data_prep.tokenizer import resolve
if __name__ == "__main__":
    prepare(PrepConfig([sys.argv[1]], sys.argv[2], resolve(sys.argv[3]), append_eod=True,
                       on_error="skip", chunk_bytes=1500, workers=2, crash_after_chunks=3))
"""


def test_killed_run_resumes_without_redoing_work_and_ends_byte_identical(tmp_path, texts, tok):
    corpus = T.write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts], {4: b"{bad"})
    whole = prepare(_cfg([corpus], tmp_path / "whole", tok, on_error="skip", chunk_bytes=1500))
    prefix = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", _CRASHING_RUN, str(corpus), str(prefix), str(tok)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert _outputs(prefix) == [], "no output under its final name before the run completes"
    state = json.loads((work_path(prefix) / "state.json").read_text())
    assert state["chunks"] == 3
    # The crash left a fourth chunk's tokens in the partial .bin, past the committed size.
    assert (work_path(prefix) / "text.bin").stat().st_size > state["keys"]["text"]["bin_bytes"]
    # and that chunk's provenance records past the sidecar's committed size
    assert (work_path(prefix) / "text.prov").stat().st_size > state["keys"]["text"]["prov_bytes"]

    resumed = prepare(_cfg([corpus], prefix, tok, on_error="skip", resume=True, chunk_bytes=1500))
    assert _bytes(output_prefix_for(prefix, "text")) == _bytes(
        output_prefix_for(tmp_path / "whole", "text")
    )
    # the sidecar cut back to its committed records too: every document's once, in order
    assert T.dataset_bytes(prefix)[2] == T.dataset_bytes(tmp_path / "whole")[2]
    assert resumed["time"]["runs"] == 2
    assert 0 < resumed["time"]["bytes_this_run"] < whole["bytes"]
    assert resumed["skipped_records"] == whole["skipped_records"] and resumed["skipped"] == 1
    assert not work_path(prefix).exists()


def test_cli_run_killed_by_sigkill_resumes_byte_identical(tmp_path, tok):
    # A real kill -9 of the whole process group, wherever it lands after a few committed chunks.
    texts = T.synthetic_texts(1500, seed=5, mean_chars=300)
    corpus = T.write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts])
    prepare(_cfg([corpus], tmp_path / "whole", tok))
    prefix = tmp_path / "run"
    cmd = [sys.executable, "-m", "porting.cli", "prep-data", "--input", str(corpus),
           "--output-prefix", str(prefix), "--tokenizer", str(tok), "--append-eod",
           "--workers", "2", "--chunk-mb", "0.002", "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(cmd, start_new_session=True, stderr=subprocess.PIPE)
    state_file = work_path(prefix) / "state.json"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if state_file.is_file() and json.loads(state_file.read_text() or "{}").get("chunks", 0) > 3:
            break
        time.sleep(0.02)
    assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read()}"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert _outputs(prefix) == []
    done = json.loads(state_file.read_text())["chunks"]
    assert 0 < done < 300
    subprocess.run([*cmd, "--resume"], check=True, capture_output=True, timeout=300)
    assert _bytes(output_prefix_for(prefix, "text")) == _bytes(
        output_prefix_for(tmp_path / "whole", "text")
    )
    report = json.loads(report_path(prefix).read_text())
    assert report["time"]["runs"] == 2 and report["records"] == len(texts)
    assert not work_path(prefix).exists()


def test_resume_refuses_changed_inputs(tmp_path, texts, tok):
    corpus = T.write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts], {20: b"{bad"})
    with pytest.raises(PortingError, match="c.jsonl:21"):
        prepare(_cfg([corpus], tmp_path / "out", tok, chunk_bytes=1500))
    assert work_path(tmp_path / "out").exists(), "a run that failed after some chunks is resumable"
    T.write_jsonl(corpus, [{"text": t} for t in texts[:-1]], {20: b"{bad"})
    with pytest.raises(PortingError, match="other inputs, tokenizer or flags"):
        prepare(_cfg([corpus], tmp_path / "out", tok, on_error="skip", resume=True))


def test_existing_outputs_need_overwrite(tmp_path, texts, tok):
    corpus = T.write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts[:3]])
    prepare(_cfg([corpus], tmp_path / "out", tok))
    with pytest.raises(PortingError, match="exists; pass --overwrite"):
        prepare(_cfg([corpus], tmp_path / "out", tok))
    prepare(_cfg([corpus], tmp_path / "out", tok, overwrite=True))


def test_globs_and_gzip_read_as_one_corpus_in_order(tmp_path, texts, tok):
    T.write_jsonl(tmp_path / "d" / "a.jsonl", [{"text": t} for t in texts[:10]])
    b = T.write_jsonl(tmp_path / "b.jsonl", [{"text": t} for t in texts[10:]])
    (tmp_path / "d" / "b.jsonl.gz").write_bytes(gzip.compress(b.read_bytes()))
    whole = T.write_jsonl(tmp_path / "all.jsonl", [{"text": t} for t in texts])
    report = prepare(
        _cfg([str(tmp_path / "d" / "*.jsonl*")], tmp_path / "glob", tok, chunk_bytes=900)
    )
    assert [i["kind"] for i in report["inputs"]] == ["jsonl", "jsonl.gz"]
    prepare(_cfg([whole], tmp_path / "one", tok))
    assert _bytes(output_prefix_for(tmp_path / "glob", "text")) == _bytes(
        output_prefix_for(tmp_path / "one", "text")
    )


def test_gzip_problem_lines_count_per_file(tmp_path, texts, tok):
    data = b"".join(json.dumps({"text": t}).encode() + b"\n" for t in texts[:4]) + b"{oops\n"
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(data))
    with pytest.raises(PortingError, match=r"c\.jsonl\.gz:5: malformed_json"):
        prepare(_cfg([tmp_path / "c.jsonl.gz"], tmp_path / "out", tok))


def test_saved_hf_dataset_and_parquet_equal_the_jsonl_run(tmp_path, texts, tok):
    import datasets

    datasets.Dataset.from_dict({"text": texts, "id": list(range(len(texts)))}).save_to_disk(
        str(tmp_path / "ds")
    )
    datasets.Dataset.from_dict({"text": texts}).to_parquet(str(tmp_path / "c.parquet"))
    jsonl = T.write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts])
    prepare(_cfg([jsonl], tmp_path / "j", tok))
    for name, inp in (("d", tmp_path / "ds"), ("p", tmp_path / "c.parquet")):
        report = prepare(_cfg([inp], tmp_path / name, tok, chunk_bytes=2000))
        assert report["records"] == len(texts)
        assert _bytes(output_prefix_for(tmp_path / name, "text")) == _bytes(
            output_prefix_for(tmp_path / "j", "text")
        )


def test_dataset_rows_with_null_are_reported_by_row(tmp_path, texts, tok):
    import datasets

    datasets.Dataset.from_dict({"text": [texts[0], None, texts[1]]}).save_to_disk(
        str(tmp_path / "ds")
    )
    with pytest.raises(PortingError, match=r"ds:2: not_string: key 'text': value is null"):
        prepare(_cfg([tmp_path / "ds"], tmp_path / "out", tok))
    report = prepare(_cfg([tmp_path / "ds"], tmp_path / "out", tok, on_error="skip"))
    assert report["skipped_records"][0]["row"] == 2
    with pytest.raises(PortingError, match="no column 'body'"):
        prepare(_cfg([tmp_path / "ds"], tmp_path / "x", tok, json_keys=("body",)))
