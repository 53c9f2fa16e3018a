"""The shaped-link test bed (``scripts/bench_sites.py``), small: two network namespaces joined by a
token-bucket-shaped veth pair, real gloo collectives across it, compared with the planner.

It needs the privilege to create network namespaces (CI runs as root here). Without it this test
fails, saying so: it is not skipped.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from porting.cli import main

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_sites.py"
RATE_MBIT = 100


def _namespaces() -> set[str]:
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return {line.split()[0] for line in r.stdout.splitlines() if line.strip()}


def test_collectives_over_a_shaped_link_match_the_fitted_model(tmp_path, capsys):
    before = _namespaces()
    out = tmp_path / "bed"
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", "--out", str(out),
         "--rate-mbit", str(RATE_MBIT)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, f"the test bed could not run here:\n{r.stderr[-3000:]}"
    result = json.loads(r.stdout)
    # the namespaces it made are gone, and nothing else was touched
    assert set(result["namespaces"]).isdisjoint(_namespaces())
    assert _namespaces() == before
    rows = {(x["op"], x["ranks"], x["bytes"]): x for x in result["collectives"]}
    big = max(b for _, _, b in rows)
    # the link runs at the shaped rate: 1 MiB one way takes at least 1 MiB / rate
    floor = big * 8 / (RATE_MBIT * 1e6)
    send = rows[("sendrecv", 2, big)]
    assert floor * 0.95 <= send["seconds"] <= floor * 1.5, (send["seconds"], floor)
    # fitted to the 2-rank all-reduce, the model predicts the held-out point-to-point and the
    # 4-rank all-reduce within the band docs/planner.md states for large messages
    for key in (("sendrecv", 2, big), ("all_reduce", 4, big), ("sendrecv", 4, big)):
        assert 0.75 <= rows[key]["ratio_fitted"] <= 1.35, (key, rows[key]["ratio_fitted"])
    # the all-to-all (an MoE layer's dispatch): fitted on its 2-rank log; at 4 ranks it moves at
    # least its remote bytes (2 ranks a site, each 1/2 of its buffer to the other site) at the
    # link's rate
    assert 0.9 <= rows[("alltoall", 2, big)]["ratio_fitted"] <= 1.1
    a2a = rows[("alltoall", 4, big)]
    assert a2a["seconds"] >= 0.95 * 2 * (big / 2) * 8 / (RATE_MBIT * 1e6), a2a
    # its logs are what `porting plan --calibrate` reads, with the cluster file it wrote
    argv = ["plan", "--model", "tiny", "--cluster", str(out / "cluster.yaml")]
    argv += ["--global-batch", "8", "--seq-length", "128", "--calibrate", str(out / "logs")]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "wan_tcp=" in text and "a2a_wan_bw=" in text


def test_without_the_privilege_it_says_so(tmp_path):
    """As an unprivileged user the bed cannot be built: one line, exit 3, nothing left behind."""
    before = _namespaces()
    r = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
         sys.executable, str(SCRIPT), "--quick"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 3, r.stderr[-2000:]
    assert "cannot create network namespace" in r.stderr and "needs root" in r.stderr
    assert _namespaces() == before


def test_sigterm_mid_run_removes_the_namespaces(tmp_path):
    """Stopped while its ranks run, the bed kills them and deletes its namespaces."""
    import os
    import signal
    import time

    before = _namespaces()
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path / "bed")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (_namespaces() - before) and time.monotonic() < deadline:
            time.sleep(0.05)
        made = _namespaces() - before
        assert made, "the bed made no namespace"
        time.sleep(1.0)  # its ranks are up and measuring
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130
    assert "stopped; its processes and namespaces are gone" in err
    assert _namespaces() == before
    left = subprocess.run(["pgrep", "-f", f"{SCRIPT} --worker"], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout
