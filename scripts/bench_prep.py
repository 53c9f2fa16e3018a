"""Benchmark: `porting prep-data` against Megatron-LM's `tools/preprocess_data.py`.

Generates a mixed Japanese/English JSONL corpus (~100 MB by default) and two 32k-vocabulary
tokenizers trained on its head (byte-level BPE saved as an HF directory; sentencepiece unigram with
default settings), then runs, each in a fresh process and with the same number of workers:

- Megatron's `preprocess_data.py` (from `--megatron-lm PATH`, a checkout of the release matching
  megatron-core; without it, `data_prep.testing.megatron_reference`, which drives megatron-core's
  tokenizer and `IndexedDatasetBuilder` the way the script does, pool and all),
- `porting prep-data` with the HF `tokenizers`, gigatoken and sentencepiece backends,
- the tokenizer alone: batch-encode of the texts already in memory on the same number of threads,
  the ceiling for any pipeline.

For each it prints wall time, MB/s of input bytes (not characters), tokens/s, peak memory of the
whole process tree, and whether the `.bin`/`.idx` equal Megatron's byte for byte. Start-up
(imports, tokenizer loading) is measured on a 20-line corpus and also subtracted, giving a
steady-state rate. Our runs from the tokenizer record ("later runs") and the ceilings are the
median of three runs each. The HF tokenizer is compared twice: Megatron's script as it ships (megatron-core 0.15's
`HuggingFaceTokenizer` defaults: slow transformers tokenizer, no special tokens) against
`porting prep-data --tokenizer-hf-no-include-special-tokens --tokenizer-hf-no-use-fast`, and
megatron-core's tokenizer with `use_fast` and `include_special_tokens` (fast tokenizer, BOS from
the post-processor: megatron-core 0.17+'s defaults) driven as the script drives it
(`data_prep.testing.megatron_reference`, pool and all; 0.15.3's own `--legacy-tokenizer` path is
broken) against `porting prep-data` with its defaults. Each pair must give the same bytes.

    python scripts/bench_prep.py [--workdir /tmp/porting-bench-prep] [--mb 100] [--workers 2]
                                 [--megatron-lm PATH] [--index-memory N] [--executors]
                                 [--start-up]

`--start-up` measures what a run costs before its first document, on the 20-line corpus: each
backend's run with no tokenizer record (a fresh `PORTING_CACHE_DIR`: Megatron's tokenizer loaded
in a process of its own) against the same run starting from the record the first one wrote
(docs/data_prep.md, tokenizer records); wall, CPU (the run and its children) and peak RSS of the
tree, the median of three each.

`--executors` compares the executors instead: the local one and `--executor ray` (a local Ray
instance started by each run) with 1 and 2 workers on the same corpus and BPE tokenizer, each
checked byte for byte against the local executor with 1 worker; the fixed cost of starting Ray
(from the run's report) and the cost of one unit (a 20-line corpus cut into one unit per line).
With `--slurm` as well, `--executor slurm` on the two-node cluster of `scripts/slurm_local.sh`
(one CPU per node, on this host), submitted and followed to the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def _tree_memory(proc: psutil.Process) -> tuple[int, int]:
    """(RSS, PSS) summed over a process and its descendants."""
    rss = pss = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            info = p.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        rss += info.rss
        pss += getattr(info, "pss", info.rss)
    return rss, pss


def measure(cmd: list[str], env: dict | None = None) -> dict:
    """Run ``cmd``; wall time and the peak RSS / PSS of its process tree (sampled every 0.1 s)."""
    t0 = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    ps = psutil.Process(proc.pid)
    peak = [0, 0]
    done = threading.Event()

    def sample():
        while not done.is_set():
            try:
                rss, pss = _tree_memory(ps)
            except psutil.NoSuchProcess:
                return
            peak[0], peak[1] = max(peak[0], rss), max(peak[1], pss)
            done.wait(0.1)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    out, _ = proc.communicate()
    wall = time.perf_counter() - t0
    done.set()
    thread.join()
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{out[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"wall": wall, "cpu": cpu, "rss": peak[0], "pss": peak[1], "log": out}


def idx_counts(prefix: str) -> tuple[int, int]:
    """(documents, tokens) of a .bin/.idx pair, from the header and the .bin size."""
    with open(prefix + ".idx", "rb") as f:
        head = f.read(34)
    itemsize = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 8, 8: 2}[head[17]]
    docs = int.from_bytes(head[26:34], "little") - 1
    return docs, os.path.getsize(prefix + ".bin") // itemsize


def same_bytes(a: str, b: str) -> bool:
    """Whether two prefixes have identical .bin and .idx files."""
    for ext in (".bin", ".idx"):
        if Path(a + ext).read_bytes() != Path(b + ext).read_bytes():
            return False
    return True


def ceiling(kind: str, tokenizer: str, corpus: str, workers: int) -> None:
    """(Child process) batch-encode the corpus texts, already in memory, on ``workers`` threads."""
    import orjson

    texts = [orjson.loads(line)["text"] for line in open(corpus, "rb")]
    nbytes = sum(len(t.encode()) for t in texts)
    batches = [texts[i : i + 512] for i in range(0, len(texts), 512)]
    tokens = 0
    if kind == "hf":
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(tokenizer) / "tokenizer.json"))
        t0 = time.perf_counter()
        for b in batches:
            tokens += sum(len(e.ids) for e in tok.encode_batch_fast(b, add_special_tokens=False))
    elif kind == "gigatoken":
        import gigatoken as gt

        tok = gt.Tokenizer.from_json((Path(tokenizer) / "tokenizer.json").read_text())
        t0 = time.perf_counter()
        for b in batches:
            tokens += int(len(tok.encode_batch(b, parallel=True).layout.content))
    else:
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=tokenizer)
        t0 = time.perf_counter()
        for b in batches:
            tokens += sum(map(len, sp.encode(b, num_threads=workers)))
    seconds = time.perf_counter() - t0
    print(json.dumps({"bytes": nbytes, "tokens": tokens, "seconds": seconds}))


def index_memory(n: int) -> None:
    """(Child processes) peak memory of writing an index of ``n`` documents, both ways."""
    code = {
        "IndexedDatasetBuilder": (
            "import numpy as np, resource, sys\n"
            "from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder\n"
            "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "b = IndexedDatasetBuilder(sys.argv[1] + '.bin', dtype=np.uint16)\n"
            "one = np.ones(1, dtype=np.uint16)\n"
            "for _ in range(int(sys.argv[2])): b.add_document(one, [1])\n"
            "b.finalize(sys.argv[1] + '.idx')\n"
            "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)\n"
        ),
        "streamed (data_prep.writer)": (
            "import numpy as np, resource, sys\n"
            "from data_prep.writer import index_header, write_index_from_doc_lengths\n"
            "n = int(sys.argv[2])\n"
            "np.ones(n, dtype=np.int32).tofile(sys.argv[1] + '.lens')\n"
            "header = index_header(np.uint16)\n"
            "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "write_index_from_doc_lengths(sys.argv[1] + '.idx', header, 2, sys.argv[1] + '.lens')\n"
            "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)\n"
        ),
    }
    tmp = Path("/tmp/porting-index-memory")
    tmp.mkdir(exist_ok=True)
    for name, src in code.items():
        out = subprocess.run(
            [PY, "-c", src, str(tmp / "x"), str(n)], cwd=REPO, capture_output=True, text=True
        )
        grown = int(out.stdout.strip().splitlines()[-1])
        print(f"{name}: {n} documents, peak memory grew {grown / 2**20:.0f} MiB")


def start_up(work: Path, tiny: Path, hf: Path, sp: Path, workers: str) -> int:
    """The ``--start-up`` table (see the module docstring)."""
    rows = (("hf backend, defaults", hf, "hf"), ("gigatoken backend, defaults", hf, "gigatoken"),
            ("sentencepiece backend", sp, "sentencepiece"))  # fmt: skip
    print("| run (20 lines, defaults) | tokenizer record | wall s | CPU s | peak RSS (tree) |")
    print("|---|---|---:|---:|---:|")
    for label, model, backend in rows:
        cold, warm = [], []
        for _ in range(3):
            with tempfile.TemporaryDirectory(dir=work) as cache:
                env = dict(os.environ, PORTING_CACHE_DIR=cache)
                argv = [PY, "-m", "porting.cli", "prep-data", "--input", str(tiny),
                        "--output-prefix", str(work / "startup"), "--tokenizer", str(model),
                        "--workers", workers, "--append-eod", "--tokenizer-backend", backend,
                        "--no-progress", "--overwrite"]  # fmt: skip
                cold.append(measure(argv, env))
                warm.append(measure(argv, env))
        for which, runs in (("none: Megatron's tokenizer loaded", cold), ("read", warm)):
            med = {k: statistics.median(r[k] for r in runs) for k in ("wall", "cpu", "rss")}
            print(f"| {label} | {which} | {med['wall']:.1f} | {med['cpu']:.1f} | "
                  f"{med['rss'] / 2**20:.0f} MiB |")  # fmt: skip
    return 0


def _median_run(run, *args, key: str, n: int = 3) -> dict:
    """Of ``n`` runs of ``run(*args)``, the one of median ``key``: this machine's speed moves
    10-25% between runs minutes apart, and a ratio of two single runs moved with it."""
    runs = sorted((run(*args) for _ in range(n)), key=lambda r: r[key])
    return runs[n // 2]


def _from_record(cmd: list[str], env: dict, prefix: Path) -> dict:
    """One of our runs from the tokenizer record, with its report's per-core rate."""
    r = measure(cmd, env)
    rep = json.loads(Path(f"{prefix}.prep-report.json").read_text())
    return r | {"per_cpu_s": rep["time"]["tokens_per_cpu_s"]}


def _ceiling_of(kind: str, model: Path, corpus: Path, workers: str) -> dict:
    env = dict(os.environ, RAYON_NUM_THREADS=workers, TOKENIZERS_PARALLELISM="true")
    proc = subprocess.run(
        [PY, __file__, "--ceiling", kind, str(model), str(corpus), workers],
        cwd=REPO, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(proc.stdout.strip().splitlines()[-1])


def at_ceiling(work: Path, corpus: Path, tiny: Path, hf: Path, sp: Path, workers: str) -> int:
    """The ``--at-ceiling`` table: each backend end to end from its tokenizer record (a run on
    the 20-line corpus writes it first) against the tokenizer's own batch-encode of the texts
    already in memory, no Megatron run (for corpora where one would take long)."""
    size = corpus.stat().st_size
    print("| backend (defaults) | end to end s | MB/s | Mtok/s | Mtok per CPU-s | peak RSS (tree) "
          "| ceiling s | ceiling MB/s | end to end / ceiling |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory(dir=work) as cache:
        env = dict(os.environ, PORTING_CACHE_DIR=cache)
        for backend, model, kind in (("hf", hf, "hf"), ("gigatoken", hf, "gigatoken"),
                                     ("sentencepiece", sp, "sentencepiece")):  # fmt: skip
            flags = ["--tokenizer", str(model), "--workers", workers, "--append-eod",
                     "--tokenizer-backend", backend, "--no-progress", "--overwrite"]  # fmt: skip
            base = [PY, "-m", "porting.cli", "prep-data", "--input"]
            measure([*base, str(tiny), "--output-prefix", str(work / "ceil_first"), *flags], env)
            r = measure(
                [*base, str(corpus), "--output-prefix", str(work / "ceil_run"), *flags], env
            )
            rep = json.loads((work / "ceil_run.prep-report.json").read_text())
            tokens = sum(o["tokens"] for o in rep["outputs"].values())
            c = _ceiling_of(kind, model, corpus, workers)
            print(f"| {backend} | {r['wall']:.1f} | {size / r['wall'] / 1e6:.1f} | "
                  f"{tokens / r['wall'] / 1e6:.2f} | {rep['time']['tokens_per_cpu_s'] / 1e6:.2f} | "
                  f"{r['rss'] / 2**20:.0f} MiB | {c['seconds']:.1f} | "
                  f"{c['bytes'] / c['seconds'] / 1e6:.1f} | "
                  f"{(size / r['wall']) / (c['bytes'] / c['seconds']):.0%} |", flush=True)  # fmt: skip
    return 0


def provenance_cost(work: Path, corpus: Path, hf: Path, sp: Path, workers: str) -> int:
    """The ``--provenance`` table: the corpus with and without the sidecar, per backend (tokenizer
    records warm, median of three runs each, alternating)."""
    size = corpus.stat().st_size
    print("| backend | sidecar | wall s | MB/s | CPU s | peak RSS (tree) | sidecar bytes "
          "| per document | .bin/.idx equal |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory(dir=work) as cache:
        env = dict(os.environ, PORTING_CACHE_DIR=cache)
        for backend, model in (("hf", hf), ("gigatoken", hf), ("sentencepiece", sp)):
            runs: dict[str, list] = {"on": [], "off": []}
            for i in range(4):  # the first pair warms the record and the page cache
                for which, extra in (("on", []), ("off", ["--no-provenance"])):
                    argv = [PY, "-m", "porting.cli", "prep-data", "--input", str(corpus),
                            "--output-prefix", str(work / f"prov_{which}"), "--tokenizer",
                            str(model), "--workers", workers, "--append-eod",
                            "--tokenizer-backend", backend, "--no-progress", "--overwrite",
                            *extra]  # fmt: skip
                    r = measure(argv, env)
                    if i:
                        runs[which].append(r)
            on, off = (str(work / f"prov_{w}_text_document") for w in ("on", "off"))
            same = same_bytes(on, off)
            docs, _ = idx_counts(on)
            side = os.path.getsize(on + ".prov")
            for which in ("on", "off"):
                med = {
                    k: statistics.median(r[k] for r in runs[which]) for k in ("wall", "cpu", "rss")
                }
                extra = f"{side:,} | {side / docs:.1f} B" if which == "on" else "none | "
                print(f"| {backend} | {which} | {med['wall']:.1f} | {size / med['wall'] / 1e6:.1f} | "
                      f"{med['cpu']:.1f} | {med['rss'] / 2**20:.0f} MiB | {extra} | "
                      f"{'yes' if same else 'NO'} |", flush=True)  # fmt: skip
    return 0


def executors(work: Path, corpus: Path, tiny: Path, hf: Path, unit_mb: float, slurm: bool) -> int:
    """The local executor against ``--executor ray`` and, with ``slurm``, ``--executor slurm`` on
    the local two-node cluster (see the module docstring)."""
    size = corpus.stat().st_size

    def cmd(inp: Path, prefix: Path, workers: int, *extra: str) -> list[str]:
        return [PY, "-m", "porting.cli", "prep-data", "--input", str(inp), "--output-prefix",
                str(prefix), "--tokenizer", str(hf), "--workers", str(workers), "--append-eod",
                "--no-progress", "--overwrite", "--json", *extra]  # fmt: skip

    runs = [
        ("local executor, 1 worker", "ex_local1", 1, ()),
        ("local executor, 2 workers", "ex_local2", 2, ()),
        ("ray executor (local instance), 1 worker", "ex_ray1", 1,
         ("--executor", "ray", "--unit-mb", str(unit_mb))),
        ("ray executor (local instance), 2 workers", "ex_ray2", 2,
         ("--executor", "ray", "--unit-mb", str(unit_mb))),
    ]  # fmt: skip
    env = None
    cluster = work / "slurm-cluster"
    if slurm:
        # scripts/slurm_local.sh: two slurmd of one CPU each on this host, the job followed
        subprocess.run([str(REPO / "scripts" / "slurm_local.sh"), "stop", str(cluster)], check=True)
        subprocess.run([str(REPO / "scripts" / "slurm_local.sh"), "start", str(cluster)],
                       check=True, capture_output=True)  # fmt: skip
        env = {**os.environ, "SLURM_CONF": str(cluster / "slurm.conf")}
        runs.append(("slurm executor (2 one-CPU nodes here)", "ex_slurm", 1,
                     ("--executor", "slurm", "--unit-mb", str(unit_mb))))  # fmt: skip
    rows = []
    for label, name, workers, extra in runs:
        prefix = work / name
        t = time.perf_counter()
        try:
            out = subprocess.run(cmd(corpus, prefix, workers, *extra), cwd=REPO, env=env,
                                 capture_output=True, text=True, check=True)  # fmt: skip
        except BaseException:
            if slurm:
                subprocess.run([str(REPO / "scripts" / "slurm_local.sh"), "stop", str(cluster)])
            raise
        wall = time.perf_counter() - t
        report = json.loads(out.stdout)
        tokens = report["outputs"]["text"]["tokens"]
        same = same_bytes(f"{prefix}_text_document", f"{work / 'ex_local1'}_text_document")
        rows.append((label, wall, size / wall / 1e6, tokens / wall / 1e6, report, same))
        print(f"{label}: {wall:.1f} s", flush=True)
    if slurm:
        subprocess.run([str(REPO / "scripts" / "slurm_local.sh"), "stop", str(cluster)], check=True)
    # One unit per line of a 20-line corpus: what a unit costs beyond its tokens.
    prefix = work / "ex_units"
    out = subprocess.run(cmd(tiny, prefix, 1, "--executor", "ray", "--unit-mb", "1e-6"),
                         cwd=REPO, capture_output=True, text=True, check=True)  # fmt: skip
    tiny_report = json.loads(out.stdout)
    n_units = len(tiny_report["units"])
    per_unit = tiny_report["time"]["processing_seconds"] / n_units
    in_task = sum(u["seconds"] for u in tiny_report["units"]) / n_units

    print(f"\ncorpus {size / 1e6:.1f} MB; --unit-mb {unit_mb:g}; {psutil.cpu_count()} CPU cores "
          "(shared)\n")  # fmt: skip
    print("| run | wall s | MB/s | Mtok/s | units | Ray start s | bytes = local |")
    print("|---|---:|---:|---:|---:|---:|:---:|")
    for label, wall, mbs, mtok, report, same in rows:
        t = report["time"]
        units = len(report.get("units", [])) or "–"
        start = f"{t['ray_start_seconds']:.1f}" if "ray_start_seconds" in t else "–"
        print(f"| {label} | {wall:.1f} | {mbs:.2f} | {mtok:.2f} | {units} | {start} | "
              f"{'yes' if same else 'NO'} |")  # fmt: skip
    print(f"\nper unit ({n_units} one-line units, 1 worker): {per_unit * 1000:.0f} ms from "
          f"hand-out to result, of which {in_task * 1000:.0f} ms inside the task")  # fmt: skip
    return 0


def main() -> int:
    """Entry point."""
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--workdir", default="/tmp/porting-bench-prep")
    ap.add_argument("--mb", type=float, default=100.0, help="corpus size in MB")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--megatron-lm", help="a Megatron-LM checkout (core_v0.15.x)")
    ap.add_argument("--index-memory", type=int, metavar="N", help="only measure index memory")
    ap.add_argument("--ceiling", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--executors", action="store_true", help="local vs ray executor only")
    ap.add_argument("--unit-mb", type=float, default=16.0, help="--unit-mb of the ray runs")
    ap.add_argument(
        "--start-up", action="store_true", help="start-up with and without a tokenizer record"
    )
    ap.add_argument(
        "--provenance", action="store_true", help="the corpus with and without the sidecar"
    )
    ap.add_argument(
        "--at-ceiling",
        action="store_true",
        help="each backend from its tokenizer record against its raw batch-encode, no Megatron",
    )
    ap.add_argument(
        "--slurm",
        action="store_true",
        help="with --executors: also --executor slurm on a local two-node cluster "
        "(scripts/slurm_local.sh; root, Debian's Slurm)",
    )
    args = ap.parse_args()
    if args.ceiling:
        ceiling(args.ceiling[0], args.ceiling[1], args.ceiling[2], int(args.ceiling[3]))
        return 0
    if args.index_memory:
        index_memory(args.index_memory)
        return 0

    sys.path.insert(0, str(REPO))
    from data_prep import testing as T

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "corpus.jsonl"
    target = int(args.mb * 1e6)
    if not corpus.exists() or abs(corpus.stat().st_size - target) > 100_000:
        t = time.perf_counter()
        n, size = T.write_synthetic_corpus(corpus, target, seed=0)
        print(f"corpus: {n} documents, {size / 1e6:.1f} MB ({time.perf_counter() - t:.0f} s)")
    tiny = work / "tiny.jsonl"
    with open(corpus, "rb") as f, open(tiny, "wb") as g:
        for _ in range(20):
            g.write(f.readline())
    hf = work / "bpe32k"
    if not (hf / "tokenizer.json").exists():
        t = time.perf_counter()
        T.train_hf_bpe(T.iter_texts(corpus, limit_bytes=8_000_000), hf, vocab_size=32000)
        print(f"trained byte-level BPE 32k on 8 MB ({time.perf_counter() - t:.0f} s)")
    sp = work / "sp32k.model"
    if not sp.exists():
        t = time.perf_counter()
        texts = list(T.iter_texts(corpus, limit_bytes=6_000_000))
        T.train_sentencepiece(texts, sp, vocab_size=32000, num_threads=args.workers)
        print(f"trained sentencepiece unigram 32k on 6 MB ({time.perf_counter() - t:.0f} s)")
    size = corpus.stat().st_size
    w = str(args.workers)
    if args.executors:
        return executors(work, corpus, tiny, hf, args.unit_mb, args.slurm)
    if args.start_up:
        return start_up(work, tiny, hf, sp, w)
    if args.provenance:
        return provenance_cost(work, corpus, hf, sp, w)
    if args.at_ceiling:
        return at_ceiling(work, corpus, tiny, hf, sp, w)

    def megatron_cmd(inp: Path, prefix: Path, ttype: str, model: Path, fast: bool) -> list[str]:
        # core_v0.15.3's --legacy-tokenizer path is broken (its Encoder.initializer assigns the
        # tokenizer to a local), so fast-with-BOS always goes through megatron_reference.
        if args.megatron_lm and not fast:
            script = str(Path(args.megatron_lm) / "tools" / "preprocess_data.py")
            return [PY, script, "--input", str(inp), "--output-prefix", str(prefix),
                    "--tokenizer-type", ttype, "--tokenizer-model", str(model), "--workers", w,
                    "--append-eod", "--log-interval", "1000000"]  # fmt: skip
        hf_kwargs = {"include_special_tokens": True, "use_fast": True} if fast else None
        code = (
            "import sys\nfrom data_prep.testing import megatron_reference\n"
            "if __name__ == '__main__':\n"
            "    megatron_reference(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4],"
            f" append_eod=True, workers=int(sys.argv[5]), hf_kwargs={hf_kwargs!r})\n"
        )
        return [PY, "-c", code, str(inp), str(prefix), ttype, str(model), w]

    def ours_cmd(inp: Path, prefix: Path, model: Path, backend: str, fast: bool) -> list[str]:
        as_015 = [] if fast else ["--tokenizer-hf-no-include-special-tokens",
                                  "--tokenizer-hf-no-use-fast"]  # fmt: skip
        return [PY, "-m", "porting.cli", "prep-data", "--input", str(inp), "--output-prefix",
                str(prefix), "--tokenizer", str(model), "--workers", w, "--append-eod",
                "--tokenizer-backend", backend, *as_015, "--no-progress",
                "--overwrite"]  # fmt: skip

    # (label, name, Megatron tokenizer type or None for ours, model, our backend, fast HF)
    runs = [
        ("Megatron preprocess_data.py, HF (0.15 defaults: slow, no BOS)", "meg_hf",
         "HuggingFaceTokenizer", hf, None, False),
        ("porting prep-data, hf backend, as 0.15", "ours_hf", None, hf, "hf", False),
        ("porting prep-data, gigatoken backend, as 0.15", "ours_gt", None, hf, "gigatoken", False),
        ("Megatron reference, HF (fast, BOS: 0.17+ defaults)", "meg_hff",
         "HuggingFaceTokenizer", hf, None, True),
        ("porting prep-data, hf backend, defaults", "ours_hff", None, hf, "hf", True),
        ("porting prep-data, gigatoken backend, defaults", "ours_gtf", None, hf, "gigatoken",
         True),
        ("Megatron preprocess_data.py, sentencepiece", "meg_sp", "SentencePieceTokenizer", sp,
         None, False),
        ("porting prep-data, sentencepiece backend", "ours_sp", None, sp, "sentencepiece", False),
    ]  # fmt: skip
    results = {}
    for label, name, ttype, model, backend, fast in runs:
        out = {}
        for which, inp in (("tiny", tiny), ("full", corpus)):
            prefix = work / f"{name}_{which}"
            cmd = (
                megatron_cmd(inp, prefix, ttype, model, fast)
                if backend is None
                else ours_cmd(inp, prefix, model, backend, fast)
            )
            # a first run on a tokenizer loads Megatron's tokenizer and records it; ours run
            # again from the record ("warm"), as every later run on that tokenizer does
            with tempfile.TemporaryDirectory(dir=work) as cache:
                env = dict(os.environ, PORTING_CACHE_DIR=cache)
                out[which] = measure(cmd, env)
                if backend is not None and which == "full":
                    out["warm"] = _median_run(_from_record, cmd, env, prefix, key="wall")
        prefix = str(work / f"{name}_full_text_document")
        docs, tokens = idx_counts(prefix)
        r = out["full"]
        steady = r["wall"] - out["tiny"]["wall"]
        results[name] = {
            "label": label, "wall": r["wall"], "startup": out["tiny"]["wall"], "steady": steady,
            "mb_s": size / r["wall"] / 1e6, "tok_s": tokens / r["wall"],
            "mb_s_steady": size / steady / 1e6, "rss": r["rss"], "pss": r["pss"],
            "prefix": prefix, "documents": docs, "tokens": tokens,
        }  # fmt: skip
        if "warm" in out:
            results[name] |= {"warm": out["warm"]["wall"], "mb_s_warm": size / out["warm"]["wall"] / 1e6,
                              "per_cpu_s": out["warm"]["per_cpu_s"]}  # fmt: skip
        print(f"{label}: {r['wall']:.1f} s", flush=True)
    results["ours_hf"]["same"] = same_bytes(
        results["ours_hf"]["prefix"], results["meg_hf"]["prefix"]
    )
    results["ours_gt"]["same"] = same_bytes(
        results["ours_gt"]["prefix"], results["meg_hf"]["prefix"]
    )
    for ours, megatron in (("ours_hff", "meg_hff"), ("ours_gtf", "meg_hff"), ("ours_sp", "meg_sp")):
        results[ours]["same"] = same_bytes(results[ours]["prefix"], results[megatron]["prefix"])

    ceil = {}
    for kind, model in (("hf", hf), ("gigatoken", hf), ("sentencepiece", sp)):
        c = _median_run(_ceiling_of, kind, model, corpus, w, key="seconds")
        ceil[kind] = c
        results[f"ceil_{kind}"] = {
            "label": f"{kind} batch-encode alone ({w} threads, texts in memory)",
            "wall": c["seconds"], "mb_s": c["bytes"] / c["seconds"] / 1e6,
            "tok_s": c["tokens"] / c["seconds"],
        }  # fmt: skip

    ref = (
        f"Megatron-LM {args.megatron_lm}"
        if args.megatron_lm
        else "no --megatron-lm: Megatron rows are data_prep.testing.megatron_reference (megatron-core's "
        "tokenizer + IndexedDatasetBuilder driven as preprocess_data.py drives them)"
    )
    cpu = psutil.cpu_count()
    print(f"\ncorpus {size / 1e6:.1f} MB, {results['meg_hf']['documents']} documents; {w} workers; "
          f"{cpu} CPU cores (shared); {ref}\n")  # fmt: skip
    print("| run | wall s | MB/s | Mtok/s | start-up s | MB/s after start-up | later runs (record): "
          "wall s | MB/s | Mtok per CPU-s | peak RSS (tree) | peak PSS (tree) | bytes = Megatron |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
    for name in ("meg_hf", "ours_hf", "ours_gt", "meg_hff", "ours_hff", "ours_gtf", "ceil_hf",
                 "ceil_gigatoken", "meg_sp", "ours_sp", "ceil_sentencepiece"):  # fmt: skip
        r = results[name]
        if name.startswith("ceil"):
            print(f"| {r['label']} | {r['wall']:.1f} | {r['mb_s']:.1f} | {r['tok_s'] / 1e6:.2f} "
                  "| – | – | – | – | – | – | – | – |")  # fmt: skip
            continue
        same = {True: "yes", False: "NO"}.get(r.get("same"), "(reference)")
        warm = (f"{r['warm']:.1f} | {r['mb_s_warm']:.1f} | {r['per_cpu_s'] / 1e6:.2f}"
                if "warm" in r else "– | – | –")  # fmt: skip
        print(f"| {r['label']} | {r['wall']:.1f} | {r['mb_s']:.1f} | {r['tok_s'] / 1e6:.2f} | "
              f"{r['startup']:.1f} | {r['mb_s_steady']:.1f} | {warm} | {r['rss'] / 2**20:.0f} MiB | "
              f"{r['pss'] / 2**20:.0f} MiB | {same} |")  # fmt: skip

    def ratio(a: str, b: str, key: str) -> float:
        return results[a][key] / results[b][key]

    print()
    for ours, megatron, gt, what in (("ours_hf", "meg_hf", "ours_gt", "as 0.15"),
                                     ("ours_hff", "meg_hff", "ours_gtf", "fast HF, BOS")):  # fmt: skip
        print(
            f"hf backend / Megatron ({what}): {ratio(ours, megatron, 'mb_s'):.2f}x end to end, "
            f"{ratio(ours, megatron, 'mb_s_steady'):.2f}x after start-up (target 1.3x)"
        )
        print(
            f"hf backend / raw ceiling ({what}): {ratio(ours, 'ceil_hf', 'mb_s'):.0%} end to "
            f"end, {results[ours]['mb_s_steady'] / results['ceil_hf']['mb_s']:.0%} after "
            "start-up (target 85%)"
        )
        print(
            f"gigatoken backend / Megatron ({what}): {ratio(gt, megatron, 'mb_s'):.1f}x end to "
            f"end, {ratio(gt, megatron, 'mb_s_steady'):.1f}x after start-up, "
            f"{results[gt]['mb_s_warm'] / results[megatron]['mb_s']:.1f}x end to end from the "
            "tokenizer record (target 10x)"
        )
        print(
            f"from the record, end to end / raw ceiling ({what}): hf "
            f"{results[ours]['mb_s_warm'] / results['ceil_hf']['mb_s']:.0%}, gigatoken "
            f"{results[gt]['mb_s_warm'] / results['ceil_gigatoken']['mb_s']:.0%} (target 85%)"
        )
    print(
        f"sentencepiece backend / Megatron: {ratio('ours_sp', 'meg_sp', 'mb_s'):.2f}x end to end, "
        f"{ratio('ours_sp', 'meg_sp', 'mb_s_steady'):.2f}x after start-up (target 1.5x); from the "
        f"record, {results['ours_sp']['mb_s_warm'] / results['ceil_sentencepiece']['mb_s']:.0%} "
        "of its raw ceiling end to end (target 85%)"
    )
    peak = max(results[n]["pss"] for n in ("ours_hf", "ours_gt", "ours_hff", "ours_gtf", "ours_sp"))
    print(f"porting prep-data peak PSS {peak / 2**20:.0f} MiB (target < 1 GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
