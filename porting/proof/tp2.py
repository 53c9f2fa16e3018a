"""Tensor parallel 2: two gloo ranks kept for the life of the process that asked, serving each
TP=2 proof of a test session, and the proof that their logits are the TP=1 logits."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

# Two ranks kept for the life of the process that asked: every TP=2 proof of a test session (each
# family's, and a scaffolded family's) shares one launch, where starting NeMo twice per proof cost
# more than the rest of a family's proof. Each rank reads a request (a JSON line) from its stdin,
# joins a gloo group at TP=2 on the port the request names, builds each checkpoint, and leaves the
# group again: waiting idle inside one, Megatron's ~20 gloo groups poll ~4% of a core per rank.
# Rank 0 saves the gathered logits. A `python -c` child needs no importable test module.
_TP2_SERVER = """
import importlib, json, os, sys, torch
from porting.convert.megatron import init_parallel, mcore_logits, shutdown_parallel
from porting.testing import load_checkpoint_model
rank = int(sys.argv[1])

def resolve(ref):
    module, _, path = ref.partition(":")
    owner, _, attr = path.rpartition(".")
    obj = importlib.import_module(module)
    for part in filter(None, owner.split(".")):
        obj = getattr(obj, part)
    return obj, attr

for line in sys.stdin:
    req = json.loads(line)
    os.environ["MASTER_PORT"] = str(req["port"])
    init_parallel(tp=2, rank=rank, world_size=2)
    saved = []
    for target, source in req["patches"]:
        (obj, attr), (src, src_attr) = resolve(target), resolve(source)
        saved.append((obj, attr, vars(obj).get(attr, saved)))
        setattr(obj, attr, getattr(src, src_attr))
    try:
        ids, logits = torch.load(req["ids"]), {}
        for ckpt in req["ckpts"]:
            model, _ = load_checkpoint_model(ckpt, dtype=torch.float32)
            logits[ckpt] = mcore_logits(model, ids)
            del model
    finally:
        for obj, attr, old in reversed(saved):
            delattr(obj, attr) if old is saved else setattr(obj, attr, old)
    shutdown_parallel()
    if rank == 0:
        torch.save(logits, req["out"])
        print(req["token"], flush=True)
"""


class _PortTaken(AssertionError):
    """The ranks' rendezvous port was taken between choosing it and binding it (another
    process of the suite, on the same machine): the harness's race, not the property."""


class _TP2Ranks:
    """The two ranks of :data:`_TP2_SERVER`, started at the first request, ended at exit."""

    def __init__(self) -> None:
        import atexit
        import tempfile

        self.logs = Path(tempfile.mkdtemp(prefix="porting-tp2-"))
        env = dict(os.environ, MASTER_ADDR="127.0.0.1")
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-c", _TP2_SERVER, str(rank)],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                stderr=open(self.logs / f"rank{rank}.log", "w"),
                text=True,
            )
            for rank in range(2)
        ]
        self.served = 0
        atexit.register(self.close)

    def ask(self, request: dict, timeout: float) -> None:
        """Send ``request``, wait for rank 0 to say it saved the logits; a rank that dies or a
        request past ``timeout`` ends both ranks and fails with their logs."""
        import selectors
        import time

        self.served += 1
        token = f"tp2-done-{os.getpid()}-{self.served}"
        from porting.cpu import free_port

        line = json.dumps(request | {"token": token, "port": free_port()}) + "\n"
        for proc in self.procs:
            proc.stdin.write(line)
            proc.stdin.flush()
        rank0 = self.procs[0]
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(rank0.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if sel.select(timeout=1.0):
                    line = rank0.stdout.readline()
                    if line.strip() == token:
                        return
                    if line:
                        continue  # what a library printed; the answer is its own line
                if any(p.poll() is not None for p in self.procs):
                    break
        for p in self.procs:  # their logs are complete once they are gone
            p.kill()
            p.wait()
        logs = [(self.logs / f"rank{r}.log").read_text()[-3000:] for r in range(2)]
        self.close(kill=True)
        failed = _PortTaken if any("EADDRINUSE" in log for log in logs) else AssertionError
        raise failed(f"the TP=2 ranks failed:\n{logs[0]}\n{logs[1]}")

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def close(self, kill: bool = False) -> None:
        if not kill and self.alive():
            for proc in self.procs:
                try:
                    proc.stdin.close()  # end of input: the rank leaves its loop
                except OSError:
                    pass
            for p in self.procs:
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    pass
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        # the ranks' logs, read above where they failed: nothing of them is left in the temp dir
        shutil.rmtree(self.logs, ignore_errors=True)


_TP2: _TP2Ranks | None = None


def tp2_logits(
    ckpts: list[str | Path],
    ids: torch.Tensor,
    work: str | Path,
    patches: list[tuple[str, str]] = (),
) -> dict[str, torch.Tensor]:
    """Megatron logits (padded vocabulary) of each checkpoint at tensor parallel 2 over gloo.

    ``patches``: ``("module:Class.attr", "module:Other.attr")`` pairs set in both ranks for this
    request only (a negative control that takes a reduction out); restored after it.
    """
    global _TP2

    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    torch.save(ids, work / "ids.pt")
    request = {
        "ids": str(work / "ids.pt"),
        "out": str(work / "tp2.pt"),
        "ckpts": [str(c) for c in ckpts],
        "patches": [list(p) for p in patches],
    }
    for attempt in range(3):  # fresh ranks on a new port where the chosen one was taken
        if _TP2 is None or not _TP2.alive():
            _TP2 = _TP2Ranks()
        try:
            _TP2.ask(request, timeout=600)
            break
        except _PortTaken:
            if attempt == 2:
                raise
    return torch.load(work / "tp2.pt", weights_only=True)


def prove_tp2(ckpts: list[str | Path], work: str | Path, vocab: int = 130) -> None:
    """Each checkpoint's logits at TP=2 equal its TP=1 logits (atol=rtol=1e-5)."""
    from porting.parity import harness

    ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(3))
    tp2 = tp2_logits(ckpts, ids, work)
    for ckpt in ckpts:
        (tp1,) = harness.megatron_logits_from_checkpoint(ckpt, [ids], tp2[str(ckpt)].shape[-1])
        torch.testing.assert_close(tp2[str(ckpt)], tp1, atol=1e-5, rtol=1e-5)
