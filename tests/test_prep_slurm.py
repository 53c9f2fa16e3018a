"""`porting prep-data --executor slurm --emit DIR`: the emitted array run by hand, in any order.

The array task and the merge are run as Slurm would run them (``bash`` on the sbatch script with
``SLURM_ARRAY_TASK_ID`` set), in a shuffled order; the bytes must equal the local executor's.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
from pathlib import Path

import pytest

from data_prep import testing as T
from data_prep import units
from data_prep.run import prepare
from porting.errors import PortingError

_bytes = T.dataset_bytes  # .bin, .idx and the provenance sidecar


def _bash(script: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(script)], env={**os.environ, **env}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


def test_emitted_array_run_by_hand_in_shuffled_order_gives_the_local_bytes(tmp_path):
    tok = T.train_hf_bpe(T.synthetic_texts(80, seed=3), tmp_path / "tok", 300)
    texts = T.synthetic_texts(120, seed=12, mean_chars=300)
    a = T.write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts], raw_lines={40: b"["})
    b = T.write_jsonl(tmp_path / "b.jsonl", [{"text": t} for t in texts[:30]])
    common = {"append_eod": True, "chunk_bytes": 3000, "on_error": "skip"}
    want = prepare(T.prep_config([a, b], tmp_path / "local", tok, **common))

    emit = tmp_path / "emit"
    cfg = T.prep_config(
        [a, b], tmp_path / "out", tok, executor="slurm", emit=str(emit), unit_bytes=12_000, no_submit=True,
        **common,
    )  # fmt: skip
    info = prepare(cfg)
    n = info["units"]
    assert n >= 4
    array = (emit / "units.sbatch").read_text()
    assert f"#SBATCH --array=0-{n - 1}" in array
    assert re.search(r"--dependency=afterok:\S+ merge\.sbatch", (emit / "submit.sh").read_text())
    assert not list(tmp_path.glob("out_text_document.*")), "nothing is run at emission"

    order = list(range(n))
    random.Random(4).shuffle(order)
    assert order != sorted(order)
    for k in order[:-1]:
        done = _bash(emit / "units.sbatch", SLURM_ARRAY_TASK_ID=str(k))
        assert done.returncode == 0, done.stderr
    early = _bash(emit / "merge.sbatch")
    assert early.returncode != 0
    assert f"1 unit(s) not done ({order[-1]})" in early.stderr
    for k in (order[-1], order[0]):  # a task run twice is checked and skipped
        done = _bash(emit / "units.sbatch", SLURM_ARRAY_TASK_ID=str(k))
        assert done.returncode == 0, done.stderr
    merged = _bash(emit / "merge.sbatch")
    assert merged.returncode == 0, merged.stderr

    # the sidecar too: the units' lines placed after those of the units before them
    assert _bytes(tmp_path / "local")[2] is not None
    assert _bytes(tmp_path / "out") == _bytes(tmp_path / "local")
    import json

    report = json.loads((tmp_path / "out.prep-report.json").read_text())
    assert report["executor"] == "slurm"
    assert report["skipped_records"] == want["skipped_records"]
    assert len(report["units"]) == n
    assert not units.staging_path(tmp_path / "out").exists()


def test_job_file_round_trips_and_refuses_another_jobs_staging(tmp_path):
    from data_prep import slurm

    tok = T.train_hf_bpe(T.synthetic_texts(40, seed=3), tmp_path / "tok", 300)
    data = T.write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in T.synthetic_texts(30)])
    emit = tmp_path / "emit"
    prepare(
        T.prep_config(
            [data], tmp_path / "out", tok, executor="slurm", emit=str(emit), no_submit=True
        )
    )
    job = slurm.load(emit / "job.json")
    assert units.job_from_json(units.job_to_json(job)) == job
    # Another emission for the same output replaces the staging directory: the first job's
    # tasks must not write into it.
    prepare(
        T.prep_config(
            [data], tmp_path / "out", tok, executor="slurm", emit=str(tmp_path / "emit2"), no_submit=True,
            append_eod=True,
        )
    )  # fmt: skip
    with pytest.raises(PortingError, match="staged by another job"):
        slurm.run_unit(emit / "job.json", 0)
