"""`porting prep-data --executor ray`: the bytes of the local executor, on a local Ray instance.

One Ray instance (3 CPUs) serves the module: starting one costs seconds. Every comparison is of
the ``.bin`` and ``.idx`` bytes against a local-executor run over the same inputs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import ray

from data_prep import testing as T
from data_prep import units
from data_prep.run import prepare
from data_prep.sources import expand_inputs
from data_prep.tokenizer import fingerprint
from porting.errors import PortingError
from porting.testing import still_running

UNIT = 16_000  # bytes per unit: about ten units over the corpus
CHUNK = 3_000
# what a finished run leaves under its prefix: the pair, its provenance sidecar, the report
COMPLETE = [
    "c.prep-report.json",
    "c_text_document.bin",
    "c_text_document.idx",
    "c_text_document.prov",
]


@pytest.fixture(scope="module")
def cluster():
    tmp = tempfile.mkdtemp(prefix="ray-t-", dir="/tmp")
    ray.init(
        num_cpus=3,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.ERROR,
        _temp_dir=tmp,
    )
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return T.train_hf_bpe(T.synthetic_texts(80, seed=3), tmp_path_factory.mktemp("tok"), 300)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    texts = T.synthetic_texts(400, seed=11, mean_chars=300)
    return T.write_jsonl(tmp_path_factory.mktemp("c") / "c.jsonl", [{"text": t} for t in texts])


_bytes = T.dataset_bytes  # .bin, .idx and the provenance sidecar


def _local(inputs, prefix, tok, **kw) -> dict:
    return prepare(T.prep_config(inputs, prefix, tok, append_eod=True, chunk_bytes=CHUNK, **kw))


def _ray(inputs, prefix, tok, **kw) -> dict:
    kw.setdefault("workers", 2)
    kw.setdefault("chunk_bytes", CHUNK)
    cfg = T.prep_config(inputs, prefix, tok, append_eod=True, executor="ray", unit_bytes=UNIT, **kw)
    return prepare(cfg)


@pytest.fixture(scope="module")
def local(corpus, tok, tmp_path_factory):
    prefix = tmp_path_factory.mktemp("local") / "c"
    report = _local([corpus], prefix, tok)
    written = _bytes(prefix)
    assert written[2] is not None  # provenance by default: every executor's must equal it
    return written, report


def _under(prefix: Path) -> list[str]:
    return sorted(p.name for p in prefix.parent.iterdir() if p.name.startswith(prefix.name))


@pytest.mark.parametrize("workers,seed", [(1, None), (1, 5), (2, 7), (3, 3)])
def test_byte_identical_to_local_for_any_workers_and_order(
    cluster, corpus, tok, local, tmp_path, workers, seed
):
    prefix = tmp_path / "c"
    report = _ray([corpus], prefix, tok, workers=workers, unit_order_seed=seed)
    assert _bytes(prefix) == local[0]
    assert report["records"] == local[1]["records"]
    assert report["outputs"]["text"]["tokens"] == local[1]["outputs"]["text"]["tokens"]
    assert len(report["units"]) >= 8
    order = [u["finished"] for u in report["units"]]
    assert sorted(order) == list(range(len(order)))
    if seed is not None:
        assert order != sorted(order), "the units completed out of input order"
    assert all(u["seconds"] > 0 for u in report["units"])
    t = report["time"]
    assert t["unit_cpu_seconds_total"] > 0
    tokens = report["outputs"]["text"]["tokens"]
    # each unit's CPU to 0.1 ms, their sum to 1 ms
    assert tokens / t["tokens_per_cpu_s"] == pytest.approx(t["unit_cpu_seconds_total"], abs=2e-3)
    assert report["time"]["workers"] == workers
    # Outputs and report only: the staging directory and the lock are gone.
    assert _under(prefix) == COMPLETE


def test_skipped_records_are_placed_as_the_local_executor_places_them(cluster, tok, tmp_path):
    texts = T.synthetic_texts(200, seed=4, mean_chars=300)
    bad = {17: b'{"text": 3}', 90: b"not json", 150: b'{"other": "x"}', 199: b"{"}
    a = T.write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts], raw_lines=bad)
    b = T.write_jsonl(tmp_path / "b.jsonl", [{"text": t} for t in texts[:50]], raw_lines={3: b"["})
    want = _local([a, b], tmp_path / "local", tok, on_error="skip")
    got = _ray([a, b], tmp_path / "ray", tok, on_error="skip", unit_order_seed=1)
    assert _bytes(tmp_path / "ray") == _bytes(tmp_path / "local")
    assert got["skipped_records"] == want["skipped_records"]
    assert [(r["file"], r["line"]) for r in got["skipped_records"]] == [
        (str(a), 18), (str(a), 91), (str(a), 151), (str(a), 200), (str(b), 4)
    ]  # fmt: skip
    assert got["problems"] == want["problems"]


def test_bad_record_stops_the_job_at_its_line_and_leaves_nothing(cluster, tok, tmp_path):
    texts = T.synthetic_texts(400, seed=6, mean_chars=300)
    corpus = T.write_jsonl(
        tmp_path / "c.jsonl", [{"text": t} for t in texts], raw_lines={250: b"{broken"}
    )
    with pytest.raises(PortingError) as local_err:
        _local([corpus], tmp_path / "local", tok)
    t0 = time.perf_counter()
    with pytest.raises(PortingError) as ray_err:
        _ray([corpus], tmp_path / "ray", tok, workers=3)
    assert time.perf_counter() - t0 < 60
    assert f"{corpus}:251:" in str(ray_err.value)
    assert str(ray_err.value) == str(local_err.value)
    assert _under(tmp_path / "ray") == []


def test_killed_worker_is_retried_and_the_output_is_unchanged(
    cluster, corpus, tok, local, tmp_path
):
    prefix = tmp_path / "c"
    staging = units.staging_path(prefix)
    killed: list[int] = []
    stop = threading.Event()

    def kill_one_mid_unit():
        # A unit is mid-way once its attempt's .bin exists and its summary does not.
        while not stop.is_set() and not killed:
            busy = [p for p in staging.glob("u*.text.bin.tmp-*") if p.stat().st_size > 0]
            for p in busy:
                pid = int(p.name.split(".tmp-")[1].split("-")[0])
                if not Path(str(p).split(".text.bin")[0] + ".json").exists():
                    with_title = " ".join(psutil.Process(pid).cmdline())
                    assert "_unit_task" in with_title
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                    return
            time.sleep(0.002)

    killer = threading.Thread(target=kill_one_mid_unit)
    killer.start()
    try:
        report = _ray([corpus], prefix, tok, workers=2, chunk_bytes=400)
    finally:
        stop.set()
        killer.join()
    assert killed, "no worker was caught mid-unit"
    assert killed[0] not in {u["pid"] for u in report["units"]}
    assert _bytes(prefix) == local[0]
    assert report["records"] == local[1]["records"]


def test_interrupted_job_resumes_and_refuses_a_changed_input_or_tokenizer(
    cluster, corpus, tok, local, tmp_path
):
    data = tmp_path / "c.jsonl"
    shutil.copy(corpus, data)
    st = data.stat()
    prefix = tmp_path / "c"
    with pytest.raises(KeyboardInterrupt) as stopped:
        _ray([data], prefix, tok, workers=1, stop_after_units=3)
    assert "--resume" in stopped.value.kept
    staging = units.staging_path(prefix)
    assert len(list(staging.glob("u*.json"))) == 3

    other = T.train_hf_bpe(T.synthetic_texts(80, seed=4), tmp_path / "tok2", 300)
    with pytest.raises(PortingError, match=r"cannot resume: the tokenizer \(.*tok2"):
        _ray([data], prefix, other, resume=True)
    with open(data, "ab") as f:
        f.write(b'{"text": "one more"}\n')
    with pytest.raises(PortingError, match=f"cannot resume: input {data} changed"):
        _ray([data], prefix, tok, resume=True)
    shutil.copy(corpus, data)
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))

    report = _ray([data], prefix, tok, resume=True, unit_order_seed=2)
    assert report["time"]["units_resumed"] == 3
    got = _bytes(prefix)
    # the same documents from a copy of the corpus: the sidecar's header names the copy
    assert got[:2] == local[0][:2]
    assert T.provenance_records(got[2]) == T.provenance_records(local[0][2])
    assert not staging.exists()


def test_a_run_that_keeps_no_record_fails_unless_asked(cluster, tok, tmp_path, capsys):
    """Every record skipped and none kept: refused in one line, nothing written, unless
    --allow-empty (tests/test_reliability.py has the local executor's case)."""
    from porting.cli import main

    src = tmp_path / "bad.jsonl"
    src.write_text("not json\n" * 50)
    out = tmp_path / "out" / "ds"
    argv = [
        "prep-data", "--input", str(src), "--output-prefix", str(out), "--tokenizer", str(tok),
        "--on-error", "skip", "--no-progress", "--executor", "ray",
    ]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "no record kept (50 skipped: 50 malformed_json); nothing written" in err, err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []
    assert main([*argv, "--allow-empty"]) == 0
    assert json.loads(Path(f"{out}.prep-report.json").read_text())["records"] == 0


def test_killed_driver_resumes_through_the_cli(cluster, corpus, tok, local, tmp_path):
    prefix = tmp_path / "c"
    argv = [sys.executable, "-m", "porting.cli", "prep-data", "--input", str(corpus),
            "--output-prefix", str(prefix), "--tokenizer", str(tok), "--append-eod",
            "--no-progress", "--executor", "ray", "--ray-address", cluster, "--workers", "1",
            "--unit-mb", str(UNIT / (1 << 20)), "--chunk-mb", "0.0004"]  # fmt: skip
    staging = units.staging_path(prefix)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while len(list(staging.glob("u*.json"))) < 2 and proc.poll() is None:
            assert time.time() < deadline
            time.sleep(0.01)
        proc.kill()
    finally:
        proc.wait(30)
    done = len(list(staging.glob("u*.json")))
    assert 2 <= done < 10
    out = subprocess.run([*argv, "--resume", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["time"]["units_resumed"] >= done
    assert _bytes(prefix) == local[0]
    ours = re.compile(r"(resuming|wrote|replacing|unit \d+)\b")  # data_prep's own lines
    noise = [line for line in out.stderr.splitlines() if not ours.match(line)]
    assert noise == [], "Ray (and Megatron) stay quiet on the console"


def test_sigterm_cancels_the_units_stops_its_own_ray_and_keeps_what_finished(
    cluster, corpus, tok, local, tmp_path
):
    """Without --ray-address the command starts Ray itself; SIGTERM (what Slurm and Kubernetes
    send) must still reach our handler, not Ray's native one that kills the process on the spot.
    The resume joins this module's Ray: where a resumed job runs is not what is proven here."""
    prefix = tmp_path / "c"
    argv = [sys.executable, "-m", "porting.cli", "prep-data", "--input", str(corpus),
            "--output-prefix", str(prefix), "--tokenizer", str(tok), "--append-eod",
            "--no-progress", "--executor", "ray", "--workers", "1",
            "--unit-mb", str(UNIT / (1 << 20)), "--chunk-mb", "0.0004"]  # fmt: skip
    staging = units.staging_path(prefix)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tree: set[int] = set()
    deadline = time.time() + 180
    while len(list(staging.glob("u*.json"))) < 2 and proc.poll() is None:
        assert time.time() < deadline, "no unit finished"
        with contextlib.suppress(psutil.Error):
            tree |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped by SIGTERM; finished units kept in" in err and "--resume" in err, err
    assert "Traceback" not in err and "SIGTERM received" not in err, err
    left = still_running(tree, grace=30)  # Ray's processes see their driver go within seconds
    assert not left, f"processes of the stopped job outlive it: {left}"
    assert _under(prefix) == [staging.name]
    resume = [*argv, "--resume", "--ray-address", cluster]
    out = subprocess.run(resume, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert _bytes(prefix) == local[0]


def test_unreachable_address_fails_within_seconds_naming_it(corpus, tok, tmp_path):
    t0 = time.perf_counter()
    with pytest.raises(PortingError, match="--ray-address 127.0.0.1:9: no Ray cluster answers"):
        _ray([corpus], tmp_path / "c", tok, ray_address="127.0.0.1:9")
    assert time.perf_counter() - t0 < 10
    assert _under(tmp_path / "c") == []


def test_input_changing_size_after_planning_is_an_error_naming_it(corpus, tok, tmp_path):
    data = tmp_path / "c.jsonl"
    shutil.copy(corpus, data)
    cfg = T.prep_config([data], tmp_path / "c", tok, append_eod=True, unit_bytes=UNIT)
    sources = expand_inputs(cfg.inputs)
    job = units.plan_job(cfg, sources, fingerprint(cfg.tokenizer, True, True))
    units.open_staging(job, resume=False)
    units.run_unit(job, 0)
    with open(data, "ab") as f:
        f.write(b'{"text": "late"}\n')
    with pytest.raises(PortingError, match=f"{data}: changed size between planning"):
        units.run_unit(job, 1)
    assert not list(Path(job.staging).glob("u000001*"))


def test_local_executor_does_not_import_ray(corpus, tok, tmp_path):
    code = (
        "import sys\n"
        "from data_prep import testing as T\n"
        "from data_prep.run import prepare\n"
        f"prepare(T.prep_config([{str(corpus)!r}], {str(tmp_path / 'c')!r}, {str(tok)!r}))\n"
        "assert 'ray' not in sys.modules, 'the local executor imported ray'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
