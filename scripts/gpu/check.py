#!/usr/bin/env python3
"""The GPU check: parity in fp32 and bf16, `porting train` in bf16, resume, export, planner.

Run on a GPU machine through ``scripts/gpu/check.sh OUTDIR`` (which installs the wheelhouse first);
``--tiny`` runs the same steps at test size on whatever device there is (the CPU here, which is how
``tests/test_gpu_check.py`` keeps this script working between GPU loans). Steps, in order:

1. ``models``: random-init HF checkpoints saved in bf16: a ~1.1B Llama-layout (llama family,
   TinyLlama's shape), a Falcon of the 40B layout at equal FLOPs per token for the throughput
   comparison, and the four released Falcon layouts (7B, 40B, 11B, RW) at small width.
2. ``import``: ``porting import`` of each, without its gate (the parity step runs the same
   comparison on the CPU, and on the device besides).
3. ``data``: a corpus of the tokenizer's own words through ``porting prep-data`` (the imported
   1.1B's tokenizer).
4. ``parity``: whole-model logits on the device, fp32 and bf16, HF and Megatron, against the same
   fp32 run on the CPU in a process that sees no GPU (the two processes run side by side).
5. ``gate``: ``porting verify`` of a 7B-shaped 8-layer bf16 stack, layers streamed to the device
   and on the host, each timed against its floor; then with the device's memory capped, which
   must hand the verdict to the CPU with one line.
6. ``train stock`` and ``train falcon``: ``porting train`` of the 1.1B (bf16 on a GPU, distributed
   optimizer, sequence 2048), then the Falcon at equal FLOPs per token, back to back.
7. ``plan``: ``porting plan`` for the same model, batch and sequence on one H100, next to the
   measured step time and memory; more than 15% apart, ``--measured-step`` fits the constants.
8. ``export``: the trained checkpoint back to HF through ``porting export`` (gate on the CPU).
9. ``train resume``: the stock run again, SIGKILLed at its first checkpoint and resumed.

``OUTDIR/report.json`` is rewritten after every step (a run cut short still reports what it did),
``OUTDIR/report.md`` holds the tables, ``OUTDIR/check.log`` every command's output. The exit status
is 0 only when every check passed.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "examples" / "clusters" / "h100-one-gpu.yaml"
# The issue's bar for GPU fp32 against the CPU, and for Falcon's throughput against the stock spec.
FP32_CPU_ATOL = 1e-5
FALCON_THROUGHPUT_TARGET = 0.95
PLAN_TOLERANCE = 0.15
LOG_TAIL_BYTES = 8 << 20


@dataclass(frozen=True)
class Sizes:
    """Everything that differs between the GPU run and the ``--tiny`` rehearsal."""

    llama: dict
    falcon_train: dict
    falcon_width: dict
    seq_length: int
    micro_batch: int
    global_batch: int
    steps: int
    documents: int
    words_per_document: int
    # bf16 training on a GPU reorders reductions between runs (atomics); fp32 on the CPU does not
    resume_atol: float


# TinyLlama-1.1B's shape: 22 layers, 2048 wide, 32 heads in 4 KV groups, SwiGLU 5632, 32000 vocab.
FULL = Sizes(
    llama=dict(
        vocab_size=32000,
        hidden_size=2048,
        num_layers=22,
        num_heads=32,
        num_kv_heads=4,
        intermediate_size=5632,
        max_position_embeddings=4096,
    ),
    # Falcon's MLP has two matrices to SwiGLU's three: 1.5x the width is the same FLOPs per token.
    falcon_train=dict(
        vocab_size=32000,
        hidden_size=2048,
        num_layers=22,
        num_heads=32,
        num_kv_heads=4,
        ffn_hidden_size=8448,
        new_decoder_architecture=True,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    ),
    falcon_width=dict(vocab_size=32000, num_layers=4, max_position_embeddings=4096, scale=8),
    seq_length=2048,
    micro_batch=2,
    global_batch=8,
    steps=30,
    documents=6000,
    words_per_document=120,
    resume_atol=2e-2,
)

TINY = Sizes(
    llama=dict(vocab_size=130, hidden_size=64, num_layers=2, intermediate_size=96),
    falcon_train=dict(
        vocab_size=130,
        hidden_size=64,
        num_layers=2,
        num_kv_heads=2,
        ffn_hidden_size=144,
        new_decoder_architecture=True,
        tie_word_embeddings=False,
    ),
    falcon_width=dict(vocab_size=130, num_layers=2, max_position_embeddings=256, scale=1),
    seq_length=32,
    micro_batch=2,
    global_batch=4,
    steps=6,
    documents=300,
    words_per_document=12,
    resume_atol=1e-5,
)


# how long a stopped command gets to print its stacks (SIGABRT, faulthandler) before SIGKILL
STACK_DUMP_S = 5


@dataclass
class Check:
    """One run of the check: where it writes, what it found so far."""

    out: Path
    work: Path
    sizes: Sizes
    tiny: bool
    budget_s: float
    families: list[str] | None = None
    skip: frozenset[str] = frozenset()
    # a command started as the budget runs out still gets this long: a step begun is worth ending
    min_run_s: float = 30
    started: float = field(default_factory=time.time)
    report: dict = field(default_factory=lambda: {"steps": {}, "checks": {}})

    @property
    def log(self) -> Path:
        return self.work / "check.log"

    def left_s(self) -> float:
        return self.budget_s - (time.time() - self.started)

    def save(self) -> None:
        """Rewrite report.json in the work directory and OUTDIR, atomically (a run cut short keeps
        what it measured, and ``--continue`` goes on from the work directory's copy)."""
        self.report["elapsed_s"] = round(
            self.report.get("earlier_s", 0) + time.time() - self.started, 1
        )
        text = json.dumps(self.report, indent=2, default=str)
        for folder in (self.work, self.out):
            tmp = folder / ".report.json.tmp"
            tmp.write_text(text)
            tmp.replace(folder / "report.json")
        if self.log.exists():
            # the device returns files of up to 16 MiB: the log's end is what explains a failure
            with open(self.log, "rb") as src:
                src.seek(max(0, self.log.stat().st_size - LOG_TAIL_BYTES))
                (self.out / "check.log").write_bytes(src.read())

    def step(self, name: str, fn) -> dict | None:
        """Run one step unless the budget is spent; record its result, time or error."""
        earlier = self.report["steps"].get(name)
        if earlier and earlier["status"] == "done":
            return earlier["result"]
        entry: dict = {"status": "skipped"}
        self.report["steps"][name] = entry
        if name in self.skip:
            entry["why"] = "--skip"
            self.save()
            return None
        if self.left_s() <= 0:
            entry["why"] = "time budget spent"
            self.save()
            return None
        t = time.time()
        print(f"[check] {name} ...", flush=True)
        try:
            entry["result"] = fn()
            entry["status"] = "done"
        except Exception as err:  # the report must say what broke and go on with the rest
            entry["status"] = "failed"
            entry["error"] = f"{type(err).__name__}: {err}"[-4000:]
            entry["traceback"] = traceback.format_exc()[-4000:]
        entry["seconds"] = round(time.time() - t, 1)
        print(f"[check] {name}: {entry['status']} in {entry['seconds']} s", flush=True)
        self.save()
        return entry.get("result")

    def passed(self, name: str, ok: bool, detail: str) -> None:
        """Record one of the issue's "done when" checks."""
        self.report["checks"][name] = {"passed": bool(ok), "detail": detail}

    def env(self, **extra: str) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
        # faulthandler prints every thread's stack on SIGABRT: what a command stopped past the
        # budget was doing reaches check.log (the 2026-11-30 export ran 270 s without a line)
        return env | {"PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"} | extra

    def run(self, argv: list[str], what: str, env: dict | None = None) -> str:
        """Run a command to its end within the budget; its output goes to check.log."""
        return self.run_together([(argv, what, env)])[0]

    def run_together(self, jobs: list[tuple[list[str], str, dict | None]]) -> list[str]:
        """Run commands side by side, each ``(argv, what, env)``, to their end within the budget;
        their outputs go to check.log. The first to fail, or the budget, stops the others."""
        budget = max(self.left_s(), self.min_run_s)
        deadline = time.time() + budget
        procs = []
        for i, (argv, what, env) in enumerate(jobs):
            # files, not pipes: a command nobody reads from would block once its pipe is full
            fh = open(self.work / f".output-{i}.txt", "w+")
            proc = subprocess.Popen(
                argv, stdout=fh, stderr=subprocess.STDOUT, text=True, env=env or self.env(),
                start_new_session=True,
            )  # fmt: skip
            procs.append((proc, fh, argv, what))
        late: list[str] = []
        while True:
            codes = [proc.poll() for proc, *_ in procs]  # every one: any() would stop at the first
            if None not in codes or any(code not in (None, 0) for code in codes):
                break
            if time.time() > deadline:
                late = [what for proc, _, _, what in procs if proc.poll() is None]
                break
            time.sleep(0.5)
        outputs, failed, stopped = [], None, set()
        running = [proc for proc, *_ in procs if proc.poll() is None]
        for proc in running:
            os.killpg(proc.pid, signal.SIGABRT)
        for proc in running:
            try:
                proc.wait(timeout=STACK_DUMP_S)
            except subprocess.TimeoutExpired:
                pass
        for proc, fh, argv, what in procs:
            if proc in running:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
                stopped.add(what)
            fh.seek(0)
            output = fh.read()
            fh.close()
            Path(fh.name).unlink()
            self._log(what, argv, output)
            outputs.append(output)
            if failed is None and what not in stopped and proc.returncode != 0:
                failed = f"{what}: exit {proc.returncode}: {output[-1500:]}"
        if late:
            raise RuntimeError(f"{', '.join(late)}: ran past the time budget ({budget:.0f} s)")
        if failed:
            raise RuntimeError(failed)
        return outputs

    def _log(self, what: str, argv: list[str], output: str) -> None:
        with open(self.log, "a") as fh:
            fh.write(f"\n===== {what}: {' '.join(argv)}\n{output}")

    def porting(self, *args: str, what: str, env: dict | None = None) -> str:
        return self.run([sys.executable, "-m", "porting.cli", *args], what, env)


def _gpu() -> dict:
    import torch

    info = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    for dist in ("nemo_toolkit", "megatron_core", "transformers", "tokenizers", "lightning"):
        try:
            from importlib.metadata import version

            info[dist] = version(dist)
        except Exception:
            info[dist] = None
    try:
        import transformer_engine  # noqa: F401

        info["transformer_engine"] = True
    except ImportError:
        info["transformer_engine"] = False
    return info


def _falcon_small(name: str, width: dict) -> dict:
    """A released Falcon layout at small width (``width['scale']`` times the tests' widths)."""
    from porting.testing import FALCON_VARIANTS

    kwargs = dict(FALCON_VARIANTS[name])
    scale = width["scale"]
    kwargs["hidden_size"] = kwargs.get("hidden_size", 64) * scale
    kwargs["ffn_hidden_size"] = kwargs.get("ffn_hidden_size", 97) * scale
    kwargs.update(
        vocab_size=width["vocab_size"],
        num_layers=width["num_layers"],
        max_position_embeddings=width["max_position_embeddings"],
    )
    return kwargs


def build_models(c: Check) -> dict:
    """The HF checkpoints, saved in bf16 as released checkpoints are; in fp32 for ``--tiny``.

    An export keeps the import's dtype, and a GPU trains bf16 weights, so its export is exact; the
    CPU trains in fp32, and the export of fp32 training into a bf16 checkpoint would round.
    """
    import torch

    from porting import proof
    from porting.contract import registry
    from porting.testing import RELEASED_FALCON_LAYOUTS, make_falcon, make_llama

    dtype = torch.float32 if c.tiny else torch.bfloat16
    hf = c.work / "hf"
    made = {}
    t = time.time()
    make_llama(hf / "llama-1b", dtype=dtype, **c.sizes.llama)
    made["llama-1b"] = round(time.time() - t, 1)
    t = time.time()
    make_falcon(hf / "falcon-1b", dtype=dtype, **c.sizes.falcon_train)
    made["falcon-1b"] = round(time.time() - t, 1)
    for name in RELEASED_FALCON_LAYOUTS:
        make_falcon(hf / f"falcon-{name}", dtype=dtype, **_falcon_small(name, c.sizes.falcon_width))
    # Every other installed family's architectures, at the Falcon layouts' small width: the
    # parity step compares each one's bf16 against transformers' own bf16 on the device.
    width = c.sizes.falcon_width
    for family in registry.families():
        if family.name in ("llama", "tsuzumi", "falcon"):  # built above; tsuzumi is llama's tables
            continue
        if c.families is not None and family.name not in c.families:
            continue
        for arch in family.architectures:
            fields = proof.tiny_fields(
                arch,
                scale=width["scale"],
                vocab_size=width["vocab_size"],
                num_hidden_layers=width["num_layers"],
                max_position_embeddings=width["max_position_embeddings"],
            )
            proof.make_hf(hf / f"{family.name}-{arch}", arch, dtype=dtype, **fields)
    return {"built_s": made, "models": sorted(p.name for p in hf.iterdir())}


def import_models(c: Check) -> dict:
    """``porting import`` of every model (host work), the models shared out round-robin over a
    core-scaled number of worker processes, each running the command for its models one after
    another. Without the gate: the parity step runs the same whole-model comparison on the CPU,
    and on the device besides."""
    names = sorted(p.name for p in (c.work / "hf").iterdir())
    # An import is ~35 s of mostly single-threaded NeMo start-up on the H200 host and a few
    # seconds of conversion for the 1.1B (2026-11-26): a process per model paid the start-up
    # fourteen times (two at a time took 252 s of the 480 s budget). A worker pays it once for
    # its share; half the cores' count of workers, two threads each.
    cores = os.cpu_count() or 2
    at_once = min(len(names), max(2, cores // 2))
    threads = max(1, cores // at_once)
    env = c.env(OMP_NUM_THREADS=str(threads))
    workers = []
    for i in range(at_once):
        share = names[i::at_once]
        log = c.work / f"import-worker-{i}.log"
        argv = [sys.executable, __file__, "--import-worker", str(c.work), *share]
        with open(log, "w") as fh:
            proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, text=True)
        workers.append((proc, log, share))
    while any(proc.poll() is None for proc, _, _ in workers):
        # out of budget, or a worker failed: the others' imports would be of no use
        if c.left_s() < 0 or any(proc.poll() for proc, _, _ in workers):
            for proc, _, _ in workers:
                proc.kill()
        time.sleep(0.5)
    seconds = {}
    for proc, log, share in workers:
        text = log.read_text()
        c._log(f"import {', '.join(share)}", proc.args, text)
        for line in text.splitlines():
            if line.startswith(IMPORTED):
                name, took = line[len(IMPORTED) :].rsplit(" ", 1)
                seconds[name] = float(took)
        if proc.returncode != 0:
            raise RuntimeError(f"import of {', '.join(share)}: exit {proc.returncode}: "
                               f"{text[-1500:]}")  # fmt: skip
    return {"seconds": seconds}


IMPORTED = "[import-worker] imported "


def import_worker(work: Path, models: list[str]) -> int:
    """In a process of its own: ``porting import`` of each model, one after another."""
    from porting.cli import main

    for name in models:
        t0 = time.time()
        argv = [
            "import",
            str(work / "hf" / name),
            "--out",
            str(work / "nemo" / name),
            "--no-verify",
        ]
        code = main(argv)
        if code != 0:
            print(f"[import-worker] porting import {name}: exit {code}", flush=True)
            return code
        print(f"{IMPORTED}{name} {time.time() - t0:.1f}", flush=True)
    return 0


def _words() -> list[str]:
    from porting.testing import CORPUS

    return CORPUS.split()


def make_data(c: Check) -> dict:
    """A JSONL of sentences drawn from the tokenizer's own words, through ``porting prep-data``."""
    rng = random.Random(0)
    words = _words()
    src = c.work / "corpus.jsonl"
    with open(src, "w") as fh:
        for _ in range(c.sizes.documents):
            text = " ".join(rng.choice(words) for _ in range(c.sizes.words_per_document))
            fh.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    prefix = c.work / "data" / "corpus"
    c.porting(
        "prep-data", "--input", str(src), "--output-prefix", str(prefix),
        "--tokenizer", str(c.work / "nemo" / "llama-1b"), "--append-eod", "--workers", "2",
        "--no-progress", what="prep-data",
    )  # fmt: skip
    return {"prefix": str(prefix) + "_text_document", "bytes": src.stat().st_size}


def parity_worker(models: list[str], work: Path, device: str, bf16: bool, role: str) -> None:
    """In a process of its own: each model's logits, fp32 (and bf16), saved for the comparison."""
    import torch
    from transformers import AutoTokenizer

    from porting.contract.registry import family_by_name
    from porting.convert.checkpoint import read_manifest
    from porting.parity import harness

    # Full fp32 matmuls: TF32 would be a precision change, not a porting error.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    for name in models:
        ckpt, hf_dir = work / "nemo" / name, work / "hf" / name
        manifest = read_manifest(ckpt)
        family = family_by_name(manifest.family)
        tok = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
        prompts = harness.build_prompts(tok, manifest.vocab_size)
        out = {}
        dtypes = {"fp32": torch.float32} | ({"bf16": torch.bfloat16} if bf16 else {})
        for label, dtype in dtypes.items():
            out[f"mc_{label}"] = harness.megatron_logits_from_checkpoint(
                ckpt, prompts, manifest.vocab_size, dtype=dtype
            )
            out[f"hf_{label}"] = harness.hf_logits(
                hf_dir,
                family.hf_class(manifest.hf_architecture),
                prompts,
                family.hf_attn_implementation,
                device=device,
                dtype=dtype,
            )
            if device == "cuda":
                torch.cuda.empty_cache()
        torch.save(out, work / "logits" / f"{name}-{role}.pt")


def _max_abs(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def parity(c: Check) -> dict:
    """Device fp32 against CPU fp32; the gate on the device; bf16 against HF's own bf16."""
    import torch

    from porting.parity.harness import compare
    from porting.testing import RELEASED_FALCON_LAYOUTS

    names = ["llama-1b", *(f"falcon-{n}" for n in RELEASED_FALCON_LAYOUTS)]
    (c.work / "logits").mkdir(exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    worker = [sys.executable, __file__, "--parity-worker", str(c.work), *names]
    # Side by side: the device run waits mostly on the GPU and the disk, the reference on the
    # host's cores (measured at full size on a 2-core host: the reference alone 54 s). Both keep
    # torch's default thread count, so on a CPU-only machine the two fp32 runs agree bit for bit.
    c.run_together(
        [
            (
                [*worker, "--device", device, "--bf16", "--role", "device"],
                f"parity on {device}",
                None,
            ),
            # The reference: the path every CPU test runs, in a process that sees no GPU.
            (
                [*worker, "--device", "cpu", "--role", "reference"],
                "parity on the CPU",
                c.env(CUDA_VISIBLE_DEVICES=""),
            ),
        ]
    )
    rows = {}
    for name in names:
        dev = torch.load(c.work / "logits" / f"{name}-device.pt", weights_only=True)
        ref = torch.load(c.work / "logits" / f"{name}-reference.pt", weights_only=True)
        gate = compare(dev["hf_fp32"], dev["mc_fp32"])
        cpu_gate = compare(ref["hf_fp32"], ref["mc_fp32"])
        ours = compare(dev["hf_fp32"], dev["mc_bf16"], min_top1=0.0)
        theirs = compare(dev["hf_fp32"], dev["hf_bf16"], min_top1=0.0)
        rows[name] = {
            "fp32_gate_on_device": {"passed": gate.passed, "max_abs_diff": gate.max_abs_diff},
            "fp32_gate_on_cpu": {"passed": cpu_gate.passed, "max_abs_diff": cpu_gate.max_abs_diff},
            "fp32_device_vs_cpu": {
                "megatron_max_abs": _max_abs(dev["mc_fp32"], ref["mc_fp32"]),
                "hf_max_abs": _max_abs(dev["hf_fp32"], ref["hf_fp32"]),
            },
            "bf16_vs_hf_fp32": {
                "megatron": {
                    "max_abs": ours.max_abs_diff,
                    "kl": ours.kl_hf_mcore,
                    "top1": ours.top1_agreement,
                },
                "hf": {
                    "max_abs": theirs.max_abs_diff,
                    "kl": theirs.kl_hf_mcore,
                    "top1": theirs.top1_agreement,
                },
            },
        }
    worst = max(max(r["fp32_device_vs_cpu"].values()) for r in rows.values())  # the issue's 1e-5
    c.passed(
        f"fp32 on {device} equals the CPU within {FP32_CPU_ATOL:g}",
        worst <= FP32_CPU_ATOL,
        f"largest |dlogit| {worst:.2e} over {len(rows)} models",
    )
    for where in (device, "cpu"):
        c.passed(
            f"fp32 parity gate on {where}",
            all(
                r[f"fp32_gate_on_{'cpu' if where == 'cpu' else 'device'}"]["passed"]
                for r in rows.values()
            ),
            f"{len(rows)} models",
        )
    return {"device": device, "models": rows}


GATE_FALLBACK = """
import sys, torch
torch.cuda.set_per_process_memory_fraction(0.002)  # ~150 MB of an H100: the first layer fails
from porting.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _json_block(output: str) -> dict:
    """The report that ``--json`` printed (an indented block from a line ``{`` to a line ``}``),
    among the other lines of a command's output."""
    lines = output.splitlines()
    start = lines.index("{")
    end = len(lines) - 1 - lines[::-1].index("}")
    return json.loads("\n".join(lines[start : end + 1]))


def gate(c: Check) -> dict:
    """The layer-streamed gate of a 7B-shaped stack (4096 wide, 8 layers, bf16) on the device and
    on the host, each against its floor (its report's ``floor_ratio``); then the same gate with the
    device's memory capped so that it runs out: one line, and the CPU's verdict."""
    import torch

    sys.path.insert(0, str(REPO / "scripts"))
    from bench_scale import SIZES, write_checkpoint

    hf, ckpt = c.work / "gate-hf", c.work / "gate-nemo"
    shape = dict(SIZES["7b-8"])
    if c.tiny:
        shape.update(hidden=256, ffn=704, heads=8, kv=8, vocab=1000, layers=2)
    write_checkpoint(hf, **shape)
    c.porting("import", str(hf), "--out", str(ckpt), "--no-verify", what="gate: import")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = {}
    for where in dict.fromkeys([device, "cpu"]):
        out = c.porting(
            "verify", str(hf), str(ckpt), "--json", "--device", where, what=f"gate on {where}"
        )
        report = _json_block(out)
        rows[where] = {
            k: report[k] for k in ("passed", "wall_s", "floor_s", "floor_ratio", "matmul_gflops")
        }
        c.passed(f"7B-shaped gate on {where} passes", report["passed"], json.dumps(rows[where]))
    if device == "cuda":
        argv = [sys.executable, "-c", GATE_FALLBACK, "verify", str(hf), str(ckpt), "--json"]
        proc = subprocess.run(argv + ["--device", "cuda"], capture_output=True, text=True)
        c._log("gate: device out of memory", argv, proc.stdout + proc.stderr)
        fell_back = "ran out of memory" in proc.stderr and "on the CPU instead" in proc.stderr
        report = _json_block(proc.stdout) if "{" in proc.stdout else {}
        rows["out of memory"] = {"fell back": fell_back, "device": report.get("device")}
        c.passed(
            "a device out of memory falls back to the CPU's verdict",
            proc.returncode == 0 and fell_back and report.get("device") == "cpu",
            f"exit {proc.returncode}",
        )
    shutil.rmtree(hf, ignore_errors=True)
    shutil.rmtree(ckpt, ignore_errors=True)
    return {"device": device, "gate": rows}


def _train_argv(c: Check, ckpt: Path, out: Path, save_every: int) -> list[str]:
    import torch

    s = c.sizes
    return [
        sys.executable, "-m", "porting.cli", "train", "--checkpoint", str(ckpt),
        "--data", c.report["steps"]["data"]["result"]["prefix"], "--out", str(out),
        "--seq-length", str(s.seq_length), "--micro-batch", str(s.micro_batch),
        "--global-batch", str(s.global_batch), "--steps", str(s.steps),
        "--save-every", str(save_every), "--lr", "3e-4", "--min-lr", "3e-5", "--warmup", "3",
        "--eval-iters", "1", "--precision", "bf16" if torch.cuda.is_available() else "fp32",
    ]  # fmt: skip


def _metrics(out: Path) -> dict:
    """Per-step loss, tokens/s and peak GPU memory from every metrics.csv of a run."""
    steps: dict[int, dict] = {}
    for f in sorted(out.rglob("metrics.csv")):
        with open(f) as fh:
            for row in csv.DictReader(fh):
                if row.get("global_step") and row.get("reduced_train_loss"):
                    step = steps.setdefault(int(float(row["global_step"])), {})
                    step["loss"] = float(row["reduced_train_loss"])
                    for key in ("tokens_per_s", "gpu_mem_gib"):
                        if row.get(key):
                            step[key] = float(row[key])
    return steps


def _summary(c: Check, name: str, out: Path, seconds: float) -> dict:
    from porting.planner.model import load_model

    steps = _metrics(out)
    if not steps:
        raise RuntimeError(f"{name}: no metrics in {out}")
    first, last = min(steps), max(steps)
    # The first steps pay for allocation and compilation; the median of the rest is the rate.
    warm = [v["tokens_per_s"] for k, v in steps.items() if k >= 3 and "tokens_per_s" in v]
    tokens_s = statistics.median(warm) if warm else None
    flops = load_model(str(c.work / "nemo" / name)).model_flops_per_token(c.sizes.seq_length)
    mem = [v["gpu_mem_gib"] for v in steps.values() if "gpu_mem_gib" in v]
    return {
        "seconds": round(seconds, 1),
        "steps": last + 1,
        "loss_first": steps[first]["loss"],
        "loss_last": steps[last]["loss"],
        "losses": {k: v["loss"] for k, v in sorted(steps.items())},
        "tokens_per_s": tokens_s,
        "step_s": c.sizes.global_batch * c.sizes.seq_length / tokens_s if tokens_s else None,
        "model_flops_per_token": flops,
        "mfu_h100": tokens_s * flops / 989e12 if tokens_s else None,
        "peak_gpu_mem_gib": max(mem) if mem else None,
        "per_step_gpu_mem_gib": {k: v.get("gpu_mem_gib") for k, v in sorted(steps.items())},
    }


def train_stock(c: Check) -> dict:
    """The 1.1B Llama-layout model, uninterrupted: loss, tokens/s, MFU, memory."""
    out = c.work / "runs" / "llama"
    t = time.time()
    c.run(_train_argv(c, c.work / "nemo" / "llama-1b", out, c.sizes.steps), "train llama")
    result = _summary(c, "llama-1b", out, time.time() - t)
    c.passed(
        "train: loss falls",
        result["loss_last"] < result["loss_first"],
        f"{result['loss_first']:.3f} -> {result['loss_last']:.3f} in {result['steps']} steps",
    )
    last = out / "checkpoints" / "last"
    c.passed("train: checkpoint written", (last / "weights" / "metadata.json").exists(), str(last))
    return result


def train_resume(c: Check) -> dict:
    """The same run SIGKILLed once its first checkpoint is complete, then the same command again."""
    from porting.testing import kill_at_first_checkpoint, train_losses

    out = c.work / "runs" / "llama-resumed"
    argv = _train_argv(c, c.work / "nemo" / "llama-1b", out, c.sizes.steps // 2)
    kill_at_first_checkpoint(argv, out, timeout=max(c.left_s(), 30))
    before = train_losses(out)
    c.run(argv, "train llama, resumed")
    after = train_losses(out)
    ref = c.report["steps"]["train stock"]["result"]["losses"]
    resumed = [s for s in after if s not in before or after[s] != before[s]]
    start = min(resumed) if resumed else None
    diffs = {s: abs(after[s] - ref[s]) for s in range(start or 0, c.sizes.steps) if s in after}
    worst = max(diffs.values()) if diffs else math.inf
    c.passed(
        "train: resumed from the checkpoint with equal losses",
        bool(start) and worst <= c.sizes.resume_atol and len(diffs) == c.sizes.steps - start,
        f"resumed at step {start}; largest |dloss| {worst:.2e} over {len(diffs)} steps "
        f"(tolerance {c.sizes.resume_atol:g})",
    )
    return {"resumed_at": start, "max_abs_dloss": worst, "steps_compared": len(diffs)}


def train_falcon(c: Check) -> dict:
    """The Falcon spec at the stock model's FLOPs per token, same flags."""
    out = c.work / "runs" / "falcon"
    t = time.time()
    c.run(_train_argv(c, c.work / "nemo" / "falcon-1b", out, 0), "train falcon")
    result = _summary(c, "falcon-1b", out, time.time() - t)
    stock = c.report["steps"]["train stock"].get("result") or {}
    if stock.get("tokens_per_s") and result["tokens_per_s"]:
        # Compared in FLOPs, not tokens: the two models' FLOPs per token differ by the vocabulary
        # and rounding only, and the ratio must not hide that.
        ratio = (result["tokens_per_s"] * result["model_flops_per_token"]) / (
            stock["tokens_per_s"] * stock["model_flops_per_token"]
        )
        result["throughput_vs_stock"] = ratio
    if "throughput_vs_stock" in result and not c.tiny:  # test-size models measure overheads
        c.passed(
            f"falcon spec >= {FALCON_THROUGHPUT_TARGET}x the stock spec's model FLOP/s",
            result["throughput_vs_stock"] >= FALCON_THROUGHPUT_TARGET,
            f"{result['throughput_vs_stock']:.3f}x ({result['tokens_per_s']:.0f} vs {stock['tokens_per_s']:.0f} tokens/s)",
        )
    return result


def export_trained(c: Check) -> dict:
    """``porting export`` of the trained checkpoint; its gate runs on the CPU."""
    ckpt = c.work / "runs" / "llama" / "checkpoints" / "last"
    text = c.porting(
        "export", str(ckpt), "--out", str(c.work / "exported"), "--json", what="export trained"
    )
    report = json.loads(text[text.index("{") : text.rindex("}") + 1])
    c.passed(
        "export of the trained checkpoint passes the gate",
        report["passed"],
        f"max |dlogit| {report['max_abs_diff']:.2e}, top-1 {100 * report['top1_agreement']:.2f}%",
    )
    # A 1.1B checkpoint with its optimizer state is ~15 GB, the device's disk 64 GB: the resumed
    # run needs the room.
    shutil.rmtree(ckpt.parent)
    return {"passed": report["passed"], "max_abs_diff": report["max_abs_diff"]}


def plan(c: Check) -> dict:
    """The planner's prediction on one H100 beside the measured step time and memory."""
    import torch

    stock = c.report["steps"]["train stock"].get("result")
    if not stock or not stock.get("step_s"):
        raise RuntimeError("no measured step time (the stock training step did not finish)")
    s = c.sizes
    args = [
        "plan", "--model", str(c.work / "nemo" / "llama-1b"), "--cluster", str(CLUSTER),
        "--global-batch", str(s.global_batch), "--seq-length", str(s.seq_length),
        "--layout", f"tp=1,pp=1,mb={s.micro_batch},recompute=none", "--json",
    ]  # fmt: skip
    if not _gpu()["transformer_engine"]:
        # Without Transformer Engine the local spec's attention materialises the score matrix.
        args.append("--no-flash-attention")
    chosen = json.loads(c.porting(*args, what="plan"))["chosen"]
    result = {
        "predicted_step_s": chosen["step_s"],
        "measured_step_s": stock["step_s"],
        "step_ratio": stock["step_s"] / chosen["step_s"],
        "predicted_memory_gib": chosen["memory_gib"]["total"],
        "measured_peak_gpu_mem_gib": stock["peak_gpu_mem_gib"],
        "memory_ratio": (
            stock["peak_gpu_mem_gib"] / chosen["memory_gib"]["total"]
            if stock["peak_gpu_mem_gib"]
            else None
        ),
        "comparable": torch.cuda.is_available() and not c.tiny,
    }
    if result["comparable"] and abs(result["step_ratio"] - 1) > PLAN_TOLERANCE:
        constants = c.out / "h100-one-gpu-constants.yaml"
        fit = json.loads(
            c.porting(
                *args,
                "--measured-step",
                str(stock["step_s"]),
                "--save-constants",
                str(constants),
                what="plan --measured-step",
            )  # fmt: skip
        )
        result["fit"] = fit.get("step_fit")
        result["constants"] = str(constants)
    return result


# in the order main runs them
STEPS = (
    "models", "import", "data", "parity", "gate", "train stock", "train falcon", "plan", "export",
    "train resume",
)  # fmt: skip


def markdown(report: dict) -> str:
    """The short tables of report.md."""
    env = report.get("env", {})
    lines = [
        f"# GPU check: {env.get('gpu') or 'no GPU (rehearsal)'}",
        "",
        f"torch {env.get('torch')} (CUDA {env.get('cuda')}), NeMo {env.get('nemo_toolkit')}, "
        f"Megatron-Core {env.get('megatron_core')}, transformers {env.get('transformers')}, "
        f"Transformer Engine: {'yes' if env.get('transformer_engine') else 'no (local spec)'}; "
        f"{report.get('elapsed_s')} s in all.",
        "",
        "| check | result | detail |",
        "|---|---|---|",
    ]
    for name, v in report["checks"].items():
        lines.append(f"| {name} | {'PASS' if v['passed'] else 'FAIL'} | {v['detail']} |")
    for name, v in report["steps"].items():
        if v["status"] != "done":
            lines.append(
                f"| step {name} | {v['status'].upper()} | {v.get('error') or v.get('why')} |"
            )
    par = (report["steps"].get("parity") or {}).get("result")
    if par:
        lines += [
            "",
            f"Parity on {par['device']} (max |dlogit|; bf16 against the fp32 HF model):",
            "",
            "| model | fp32 gate | fp32 vs CPU (Megatron / HF) | Megatron bf16: max, KL, top-1 "
            "| HF bf16: max, KL, top-1 |",
            "|---|---|---|---|---|",
        ]
        for name, r in par["models"].items():
            g, d, b = r["fp32_gate_on_device"], r["fp32_device_vs_cpu"], r["bf16_vs_hf_fp32"]
            m, h = b["megatron"], b["hf"]
            lines.append(
                f"| {name} | {g['max_abs_diff']:.1e} {'pass' if g['passed'] else 'FAIL'} "
                f"| {d['megatron_max_abs']:.1e} / {d['hf_max_abs']:.1e} "
                f"| {m['max_abs']:.3f}, {m['kl']:.1e}, {100 * m['top1']:.1f}% "
                f"| {h['max_abs']:.3f}, {h['kl']:.1e}, {100 * h['top1']:.1f}% |"
            )
    runs = [
        (n, (report["steps"].get(n) or {}).get("result")) for n in ("train stock", "train falcon")
    ]
    if any(r for _, r in runs):
        lines += [
            "",
            "| run | steps | loss first -> last | tokens/s | step s | MFU | peak GPU GiB |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, r in runs:
            if r and r.get("tokens_per_s"):
                mem = r["peak_gpu_mem_gib"]
                lines.append(
                    f"| {name} | {r['steps']} | {r['loss_first']:.3f} -> {r['loss_last']:.3f} "
                    f"| {r['tokens_per_s']:.0f} | {r['step_s']:.3f} | {100 * r['mfu_h100']:.1f}% "
                    f"| {f'{mem:.1f}' if mem else '-'} |"
                )
    p = (report["steps"].get("plan") or {}).get("result")
    if p:
        mem, ratio = p["measured_peak_gpu_mem_gib"], p["memory_ratio"]
        lines += [
            "",
            "| planner (one H100) | predicted | measured | ratio |",
            "|---|---|---|---|",
            f"| step time s | {p['predicted_step_s']:.3f} | {p['measured_step_s']:.3f} "
            f"| {p['step_ratio']:.2f} |",
            f"| memory GiB | {p['predicted_memory_gib']:.1f} | {f'{mem:.1f}' if mem else '-'} "
            f"| {f'{ratio:.2f}' if ratio else '-'} |",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run every step (or the parity worker); 0 when every check passed."""
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        description="The GPU check: parity fp32/bf16, `porting train` bf16 with resume and "
        "export, Falcon vs stock throughput, planner vs measured. Writes OUTDIR/report.json, "
        "report.md and check.log. Normally started by scripts/gpu/check.sh on a GPU machine.",
    )
    p.add_argument("outdir", type=Path, nargs="?", help="where the report goes")
    p.add_argument("--work", type=Path, default=Path("/tmp/porting-gpu-check"), help="scratch")
    p.add_argument("--tiny", action="store_true", help="test-size models (a rehearsal on the CPU)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=480,
        help="stop starting steps after this many seconds (default 480: the device's 10-minute "
        "command limit, less the install)",
    )
    p.add_argument(
        "--continue",
        dest="continue_",
        action="store_true",
        help="go on from the steps an earlier call left done in --work (a second device call "
        "while the machine is still warm); starts afresh when --work holds no report",
    )
    p.add_argument(
        "--families",
        type=lambda v: [n for n in v.split(",") if n],
        metavar="NAMES",
        help="comma-separated: build and import only these of the other installed families "
        "(default: every one); Llama and Falcon always run, every step needs them",
    )
    p.add_argument(
        "--skip",
        type=lambda v: frozenset(n for n in v.split(",") if n),
        default=frozenset(),
        metavar="STEPS",
        help="comma-separated steps not to run (the report marks them skipped): with 15 minutes "
        f"of device time a loan spends it on what earlier loans left unmeasured; steps: "
        f"{', '.join(STEPS)}",
    )
    p.add_argument("--parity-worker", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--import-worker", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    p.add_argument("--bf16", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--role", default="device", help=argparse.SUPPRESS)
    p.add_argument("models", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if unknown := sorted(args.skip - set(STEPS)):
        p.error(f"--skip: no step named {', '.join(unknown)} (steps: {', '.join(STEPS)})")
    if args.import_worker:
        return import_worker(
            args.import_worker, ([str(args.outdir)] if args.outdir else []) + args.models
        )
    if args.parity_worker:
        names = ([str(args.outdir)] if args.outdir else []) + args.models
        parity_worker(names, args.parity_worker, args.device, args.bf16, args.role)
        return 0
    if args.outdir is None:
        p.error("OUTDIR is required")
    args.outdir.mkdir(parents=True, exist_ok=True)
    from importlib.metadata import entry_points

    from porting.contract.registry import GROUP

    if not entry_points(group=GROUP):
        # The families are entry points, found through porting.egg-info (git-ignored, so a device
        # call leaves it behind unless `carry` names it): without them every step fails (seen on
        # the first H200 run, 2026-11-26).
        p.error(
            "no porting family is installed: carry porting.egg-info with the device call "
            '(carry: [".whl", "porting.egg-info"]), or `pip install -e .` first'
        )
    earlier = args.work / "report.json"
    env = None if args.continue_ and earlier.exists() else _gpu()
    # the budget counts from here: what it guards is the steps
    if args.families is not None:
        from porting.contract import registry

        unknown = sorted(set(args.families) - {f.name for f in registry.families()})
        if unknown:
            p.error(f"--families: no installed family named {', '.join(unknown)}")
    c = Check(
        args.outdir, args.work, TINY if args.tiny else FULL, args.tiny, args.budget_s,
        args.families, args.skip,
    )  # fmt: skip
    if args.continue_ and earlier.exists():
        c.report = json.loads(earlier.read_text())
        if c.report.get("tiny") != args.tiny:
            p.error(f"{args.work} holds a {'tiny' if c.report.get('tiny') else 'full'} run")
        c.report["earlier_s"] = c.report.get("elapsed_s", 0)
        c.report["continued"] = c.report.get("continued", 0) + 1
        # JSON made the step numbers strings; the comparisons want them back
        for name in ("train stock", "train falcon"):
            result = (c.report["steps"].get(name) or {}).get("result")
            if result:
                result["losses"] = {int(k): v for k, v in result["losses"].items()}
    else:
        if args.work.exists():
            shutil.rmtree(args.work)
        args.work.mkdir(parents=True)
        c.report["env"] = env
        c.report["tiny"] = args.tiny
    c.save()
    c.step("models", lambda: build_models(c))
    c.step("import", lambda: import_models(c))
    c.step("data", lambda: make_data(c))
    c.step("parity", lambda: parity(c))
    c.step("gate", lambda: gate(c))
    # The two measured runs back to back, on an idle host; then the planner, which needs only the
    # stock run; the costliest pass/fail steps last (the resume writes two 14 GiB checkpoints).
    c.step("train stock", lambda: train_stock(c))
    c.step("train falcon", lambda: train_falcon(c))
    c.step("plan", lambda: plan(c))
    c.step("export", lambda: export_trained(c))
    c.step("train resume", lambda: train_resume(c))
    (c.out / "report.md").write_text(markdown(c.report))
    failed = [
        n for n, v in c.report["steps"].items() if v["status"] != "done" and n not in args.skip
    ]
    failed += [n for n, v in c.report["checks"].items() if not v["passed"]]
    print((c.out / "report.md").read_text())
    print("FAILED: " + "; ".join(failed) if failed else "every check passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
