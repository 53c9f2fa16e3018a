"""`porting prep-data` against hostile input, a second run on the same output, and stop signals.

Real command-line processes where the behaviour is the process's own (exit status, the closing
line, its process tree, the lock between two processes); the rest in this process. Start-up is
the cost of a real run (Megatron's tokenizer loads in a child, seconds), so the runs that must
reach the tokenizing share one corpus and one uninterrupted reference, and the bad-input runs stop
at the head of the corpus, before that load.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import psutil
import pytest

from data_prep import testing as T
from data_prep.prep import output_prefix_for, prepare, work_path
from data_prep.records import oversize, parse_jsonl
from data_prep.report import report_path
from data_prep.sources import expand_inputs, iter_tasks
from porting.errors import PortingError
from porting.guard import lock_path

CLI = [sys.executable, "-m", "porting.cli", "prep-data"]
CHUNK_MB = "0.002"
CHUNK_BYTES = int(float(CHUNK_MB) * (1 << 20))  # as the command line turns --chunk-mb into bytes
LIMIT = 1000  # --max-record-bytes in the bad-input runs
RUN_TIMEOUT = 300
# what a finished run leaves under its prefix: the pair, its provenance sidecar, the report
COMPLETE = [
    "c.prep-report.json",
    "c_text_document.bin",
    "c_text_document.idx",
    "c_text_document.prov",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return T.train_hf_bpe(T.synthetic_texts(80, seed=3), tmp_path_factory.mktemp("tok"), 300)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """600 short documents, then one of ~2 MB: a run spends most of a second on the last chunk
    alone, which is where "near the end" stops it."""
    texts = T.synthetic_texts(600, seed=5, mean_chars=300)
    big = "\n\n".join(T.synthetic_texts(1200, seed=9, mean_chars=900))
    return T.write_jsonl(
        tmp_path_factory.mktemp("corpus") / "c.jsonl", [{"text": t} for t in [*texts, big]]
    )


@pytest.fixture(scope="module")
def whole(corpus, tok, tmp_path_factory) -> tuple[bytes, bytes]:
    """The bytes of an uninterrupted run over ``corpus`` (in this process: no start-up)."""
    prefix = tmp_path_factory.mktemp("whole") / "c"
    prepare(T.prep_config([corpus], prefix, tok, append_eod=True))
    return _bytes(output_prefix_for(prefix, "text"))


def _bytes(prefix) -> tuple[bytes, bytes]:
    return (Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes())


def _argv(inputs, prefix, tok, *extra) -> list[str]:
    return [*CLI, "--input", *map(str, inputs), "--output-prefix", str(prefix),
            "--tokenizer", str(tok), "--append-eod", "--no-progress", *extra]  # fmt: skip


def _run(argv, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def _under(prefix: Path) -> list[str]:
    """Everything named after the output prefix beside it (outputs, report, work dir, lock)."""
    return sorted(
        p.name
        for p in prefix.parent.iterdir()
        if p.name.startswith(prefix.name) or p.name == lock_path(prefix).name
    )


class _Tree:
    """A ``porting`` process started in its own session, and every process seen in its tree."""

    def __init__(self, argv) -> None:
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        self.seen: dict[int, float] = {}
        self.names: dict[int, str] = {}

    def poll(self) -> None:
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    self.seen.setdefault(child.pid, child.create_time())
                    self.names.setdefault(child.pid, " ".join(child.cmdline())[:200])

    def wait_for(self, ready, what: str, timeout: float = RUN_TIMEOUT) -> None:
        """Poll until ``ready()``; fail if the run ends (or the time runs out) first."""
        deadline = time.monotonic() + timeout
        while not ready():
            self.poll()
            if self.proc.poll() is not None:
                out, err = self.proc.communicate()
                pytest.fail(
                    f"the run ended before {what}: rc {self.proc.returncode}\n{err[-3000:]}"
                )
            assert time.monotonic() < deadline, f"no {what} after {timeout} s"
            time.sleep(0.02)
        self.poll()

    def stop(self, sig: int) -> tuple[int, str]:
        self.proc.send_signal(sig)
        _, err = self.proc.communicate(timeout=60)
        return self.proc.returncode, err

    def alive(self, grace: float = 15.0) -> list[int]:
        """Processes of the tree still running ``grace`` seconds after it ended: those seen (same
        pid and start time), and any other left in its session.

        multiprocessing's resource tracker only learns that its process ended when its pipe
        closes, so it exits just after it; on a loaded machine that takes a moment.
        """
        deadline = time.monotonic() + grace
        while (left := self._running()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left

    def _running(self) -> list[int]:
        left = set()
        for pid, created in self.seen.items():
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    left.add(pid)
        for pid in psutil.pids():
            with contextlib.suppress(OSError, psutil.Error):
                if (
                    os.getsid(pid) == self.proc.pid
                    and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                ):
                    left.add(pid)
        return sorted(left)

    def describe(self) -> list[str]:
        """The command lines of the processes still alive, for a failure message."""
        lines = []
        for pid in self._running():
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                name = self.names.get(pid, " ".join(p.cmdline())[:200])
                lines.append(f"{pid} {p.status()} ppid={p.ppid()} {name}")
        return lines

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture
def trees():
    started: list[_Tree] = []

    def start(argv) -> _Tree:
        started.append(_Tree(argv))
        return started[-1]

    yield start
    for tree in started:  # a failed test leaves nothing running
        if tree.proc.poll() is None:
            tree.kill()


def _holds_lock(prefix, proc) -> bool:
    """Whether ``proc`` holds the output's lock (its pid is written once the lock is taken)."""
    try:
        return lock_path(prefix).read_text().strip() == str(proc.pid)
    except OSError:
        return False


def _state(prefix) -> dict:
    try:
        return json.loads((work_path(prefix) / "state.json").read_text() or "{}")
    except (OSError, ValueError):
        return {}


# ---------------------------------------------------------------------------- one writer per output


def test_second_run_on_the_same_prefix_fails_at_once_and_the_first_completes(
    tmp_path, corpus, tok, whole, trees
):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = tmp_path / "out" / "c"
    argv = _argv([corpus], prefix, tok, "--workers", "2", "--chunk-mb", CHUNK_MB)
    first = trees(argv)
    first.wait_for(lambda: _holds_lock(prefix, first.proc), "it took its lock")
    second = _run(argv)
    assert first.proc.poll() is None, "the second run must fail while the first is running"
    assert second.returncode == 2, second.stderr
    assert f"another porting run (pid {first.proc.pid})" in second.stderr
    assert "Traceback" not in second.stderr
    out, err = first.proc.communicate(timeout=RUN_TIMEOUT)
    assert first.proc.returncode == 0, err[-3000:]
    final = output_prefix_for(prefix, "text")
    assert _bytes(final) == whole
    assert len(IndexedDataset(str(final)).document_indices) == 601 + 1
    assert _under(prefix) == COMPLETE


_HOLD_LOCK = """
import sys
from porting.guard import output_lock
with output_lock(sys.argv[1], "dataset"):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_merge_holds_the_lock_of_its_output_prefix(tmp_path):
    from data_prep.merge import merge

    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(tmp_path / "ab")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(PortingError, match=rf"another porting run \(pid {holder.pid}\)"):
            merge([str(tmp_path / "a")], tmp_path / "ab")
    finally:
        holder.communicate("", timeout=60)
    assert not lock_path(tmp_path / "ab").exists()


# ----------------------------------------------------------------------------------- stop signals


def _last_chunk_start(corpus) -> int:
    return list(iter_tasks(expand_inputs([str(corpus)]), ("text",), CHUNK_BYTES))[-1].start


@pytest.mark.parametrize(
    "sig,when",
    [
        (signal.SIGTERM, "start"),
        (signal.SIGTERM, "work"),
        (signal.SIGTERM, "end"),
        (signal.SIGHUP, "work"),
    ],
    ids=["sigterm-start", "sigterm-work", "sigterm-end", "sighup-work"],
)
def test_stop_signal_kills_the_tree_and_keeps_only_the_resume_state(
    tmp_path, corpus, tok, whole, trees, sig, when
):
    prefix = tmp_path / "out" / "c"
    argv = _argv([corpus], prefix, tok, "--workers", "2", "--chunk-mb", CHUNK_MB)
    # at the start, the process loading Megatron's tokenizer is part of the tree: not a record
    start = ["--recheck-tokenizer"] if when == "start" else []
    run = trees([*argv, *start])
    if when == "start":
        run.wait_for(lambda: _holds_lock(prefix, run.proc), "it took its lock")
    elif when == "work":
        run.wait_for(lambda: _state(prefix).get("chunks", 0) >= 3, "3 chunks were committed")
    else:
        last = _last_chunk_start(corpus)
        run.wait_for(
            lambda: _state(prefix).get("position", {}).get("offset", 0) >= last,
            "every chunk but the last was committed",
        )
    rc, err = run.stop(sig)
    name = signal.Signals(sig).name
    assert rc == 128 + sig, err[-3000:]
    assert "Traceback" not in err
    assert run.alive() == [], f"processes of the tree outlived it: {run.describe()}"
    leftovers = _under(prefix)
    if when == "start":
        assert f"porting prep-data: stopped by {name}; partial outputs removed" in err
        assert leftovers == []
        return
    work = work_path(prefix)
    assert (
        f"porting prep-data: stopped by {name}; resume state kept in {work}; "
        "rerun the same command with --resume"
    ) in err
    assert leftovers == [work.name], "nothing but the resume state beside the output"
    assert not list(work.glob("*.tmp"))
    if when == "work" and sig == signal.SIGTERM:
        resumed = _run([*argv, "--resume"])
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    else:
        prepare(T.prep_config([corpus], prefix, tok, append_eod=True, resume=True))
    assert _bytes(output_prefix_for(prefix, "text")) == whole
    assert json.loads(report_path(prefix).read_text())["time"]["runs"] == 2
    assert _under(prefix) == COMPLETE


def test_a_signal_during_the_final_renames_is_handled_once_they_are_done(
    tmp_path, tok, monkeypatch
):
    from porting.guard import Terminated, signals_as_exceptions

    corpus = T.write_jsonl(tmp_path / "c.jsonl", [{"text": f"document {i}"} for i in range(5)])
    prefix = tmp_path / "out" / "c"
    real_replace = os.replace

    def replace(src, dst):
        if str(dst).endswith("_text_document.bin"):  # the first of the final renames
            os.kill(os.getpid(), signal.SIGTERM)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Terminated) as stop, signals_as_exceptions():
        prepare(T.prep_config([corpus], prefix, tok, append_eod=True))
    assert stop.value.kept.startswith("it came as the run finished: outputs complete")
    assert _under(prefix) == COMPLETE


# ---------------------------------------------------------------------------------- bounded input


def test_fifo_input_is_refused_without_opening_it(tmp_path, tok):
    fifo = tmp_path / "stream.jsonl"
    os.mkfifo(fifo)
    folder = tmp_path / "folder"
    folder.mkdir()
    os.mkfifo(folder / "a.jsonl")
    for given, named in ((fifo, fifo), (folder, folder / "a.jsonl"), (tmp_path / "*.jsonl", fifo)):
        t0 = time.monotonic()
        proc = _run(_argv([given], tmp_path / "out", tok), timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert f"--input {named}: a FIFO (named pipe), not a regular file" in proc.stderr
        assert "Traceback" not in proc.stderr and time.monotonic() - t0 < 60
    assert _under(tmp_path / "out") == []


def test_character_device_input_is_refused(tmp_path, tok):
    proc = _run(_argv(["/dev/zero"], tmp_path / "out", tok), timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "--input /dev/zero: a character device, not a regular file" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert _under(tmp_path / "out") == []


def _records_with(line: bytes, at: int = 2, n: int = 5) -> list:
    return [{"text": f"document {i} has a few words"} for i in range(n)], {at: line}


def test_record_over_max_record_bytes_fails_at_its_line_or_is_skipped(tmp_path, tok):
    records, raw = _records_with(b'{"text": "' + b"x" * 5000 + b'"}')
    corpus = T.write_jsonl(tmp_path / "c.jsonl", records, raw)
    limit = ("--max-record-bytes", str(LIMIT))
    failed = _run(_argv([corpus], tmp_path / "fail", tok, *limit))
    assert failed.returncode == 2, failed.stderr
    assert f"{corpus}:3: record_too_large: 5012 bytes > --max-record-bytes {LIMIT}" in failed.stderr
    assert "Traceback" not in failed.stderr
    assert _under(tmp_path / "fail") == []

    skipped = _run(_argv([corpus], tmp_path / "skip", tok, *limit, "--on-error", "skip"))
    assert skipped.returncode == 0, skipped.stderr
    assert "Traceback" not in skipped.stderr
    report = json.loads(report_path(tmp_path / "skip").read_text())
    assert report["problems"] == {"record_too_large": 1} and report["records"] == 4
    [row] = report["skipped_records"]
    assert (row["file"], row["line"], row["reason"]) == (str(corpus), 3, "record_too_large")


@pytest.mark.parametrize("gz", [False, True], ids=["jsonl", "gzip"])
def test_an_oversize_line_is_measured_not_read(tmp_path, gz):
    # 32 MB on one line, a 1 MiB chunk, a 1000-byte limit: the planner skips it 64 KiB at a time.
    data = b'{"text": "a"}\n{"text": "' + b"y" * (32 << 20) + b'"}\n{"text": "b"}\n'
    path = tmp_path / ("c.jsonl.gz" if gz else "c.jsonl")
    path.write_bytes(gzip.compress(data, compresslevel=1) if gz else data)
    tracemalloc.start()
    try:
        tasks = list(iter_tasks(expand_inputs([str(path)]), ("text",), 1 << 20, max_record=LIMIT))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak} bytes traced: the line was read"
    kinds = [t.payload[0] for t in tasks]
    assert kinds == ["bytes" if gz else "range", "oversize", "bytes" if gz else "range"]
    _, length, span, limit = tasks[1].payload
    assert (length, span, limit) == ((32 << 20) + 12, (32 << 20) + 13, LIMIT)
    parsed = oversize(length, span, ("text",), limit)
    assert parsed.problems == [(0, "record_too_large", f"{length} bytes > --max-record-bytes 1000")]
    assert [t.start for t in tasks[1:]] == [t.end for t in tasks[:-1]] and tasks[-1].end == len(
        data
    )


def test_long_lines_inside_a_chunk_are_problems_too():
    data = b'{"text": "ok"}\n{"text": "' + b"z" * 2000 + b'"}\n{"text": "ok"}\n'
    parsed = parse_jsonl(data, ("text",), False, False, LIMIT)
    assert parsed.problems == [(1, "record_too_large", f"2012 bytes > --max-record-bytes {LIMIT}")]
    assert parsed.texts["text"] == ["ok", "ok"] and parsed.n_lines == 3


# Each malformed record on line 3 of five: (raw line, the problem named). The 10x-limit line is
# longer than --max-record-bytes; everything else is under it.
MALFORMED = {
    "invalid-utf8": (b'{"text": "caf\xe9 au lait"}', "invalid_utf8"),
    "lone-surrogate": (b'{"text": "\\ud800 alone"}', "invalid_utf8"),
    "truncated-json": (b'{"text": "cut off', "malformed_json"),
    "json-array": (b'["text", "an array"]', "not_object"),
    "missing-key": (b'{"body": "no text key"}', "missing_key"),
    "null-text": (b'{"text": null}', "not_string"),
    "number-text": (b'{"text": 12.5}', "not_string"),
    "empty-text": (b'{"text": ""}', "empty_text"),
    "whitespace-line": (b" \t  ", "malformed_json"),
    "nul-bytes": (b'\x00\x00{"text": "x"}', "malformed_json"),
    "nul-in-string": (b'{"text": "a\x00b"}', "malformed_json"),
    "10x-limit": (b'{"text": "' + b"w" * (10 * LIMIT) + b'"}', "record_too_large"),
    # Longer than LIMIT, so run under a higher one: what the stdlib parser raises on.
    "huge-integer": (b'{"text": "ok", "n": 1' + b"0" * 5000 + b"}", "malformed_json"),
    "deep-nesting": (b"[" * 5000 + b"]" * 5000, "malformed_json"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_record_is_located_with_status_2_and_no_traceback(tmp_path, tok, case):
    line, kind = MALFORMED[case]
    limit = LIMIT if kind == "record_too_large" or len(line) <= LIMIT else 1 << 16
    corpus = T.write_jsonl(tmp_path / "c.jsonl", *_records_with(line))
    proc = _run(_argv([corpus], tmp_path / "out", tok, "--max-record-bytes", str(limit)))
    assert proc.returncode == 2, proc.stderr
    assert f"porting prep-data: error: {corpus}:3: {kind}: " in proc.stderr
    assert "Traceback" not in proc.stderr
    assert _under(tmp_path / "out") == []


def test_a_checkpoint_tokenizer_path_outside_the_checkpoint_is_refused(tiny_nemo, tmp_path, capsys):
    from porting.cli import main
    from porting.testing import with_edited_manifest

    ckpt = with_edited_manifest(
        tiny_nemo, tmp_path / "ckpt", lambda d: d["tokenizer"].update(path="../../../../../../etc")
    )
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "hello"}\n')
    out = tmp_path / "out" / "c"
    code = main(
        ["prep-data", "--input", str(corpus), "--output-prefix", str(out), "--tokenizer", str(ckpt)]
    )
    err = capsys.readouterr().err
    assert code == 2 and "porting.json: tokenizer path '../../../../../../etc'" in err, err
    assert not out.parent.exists() or not list(out.parent.glob("c*"))
