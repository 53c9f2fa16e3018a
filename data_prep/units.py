"""Units: ``prep-data`` cut into pieces that any machine can tokenize, then merged in input order.

The ray and slurm executors share this. A unit (:func:`data_prep.executors.base.plan_units`) is
a whole input, or a byte range of a plain JSONL file that starts and ends at line ends
(:func:`data_prep.sources.line_ranges`), so the same inputs and ``--unit-mb`` always give the
same units. Each unit is tokenized on its own (by the same
:func:`data_prep.worker.run` the local executor's workers run, a chunk at a time) into
``u{index}.{key}.bin/.idx`` in a staging directory beside the output,
``{output_prefix}.prep-data.units/``, and a ``u{index}.json`` summary written last. The merge
(:func:`data_prep.merge.merge`) then chains the units' pairs in unit order: the documents come out
in input order, each encoded independently, so the bytes equal the local executor's whatever
ran where and in which order.

The staging directory is the job's resume state. Its ``job.json`` holds the fingerprint of the
inputs, the tokenizer, the flags that change bytes and the unit plan; a unit is done when its
summary carries that fingerprint and its own index agrees with the summary (sizes and counts),
never because a file is there. Files of an attempt are written under names of their own and
renamed, so a task killed half-way and run again (Ray retries it) leaves nothing behind that counts.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import socket
import struct
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_prep import provenance, worker
from data_prep.backends import BackendSpec
from data_prep.executors.base import Unit, output_prefix_for, plan_units, staging_path
from data_prep.prep import (
    _head,
    assemble_report,
    backend_name_for,
    bad_id_error,
    diff_error,
    located,
    recorded_facts,
    report_counts,
    report_static,
    tokenizer_setup,
)
from data_prep.records import PROBLEM_KINDS, PROBLEMS_LISTED, listed, refuse_empty
from data_prep.report import cpu_seconds, rate, report_path, write_json_atomic
from data_prep.sources import Source, _source, lines_before, range_tasks
from data_prep.writer import write_index_from_doc_lengths
from porting.errors import PortingError
from porting.guard import Terminated, signals_deferred

log = logging.getLogger(__name__)

JOB = "job.json"
REPORT = "report.json"


@dataclass(frozen=True)
class Job:
    """What every unit task needs, the same for all of them (sent once, or read from a file)."""

    staging: str
    fingerprint: str
    parts: dict
    output_prefix: str
    json_keys: tuple[str, ...]
    sources: tuple[Source, ...]
    units: tuple[Unit, ...]
    wcfg: worker.WorkerConfig
    header: bytes
    chunk_bytes: int
    split: str | None
    backend_name: str
    tokenizer_kind: str
    checkpoint: str | None
    overwrite: bool
    report: dict
    allow_empty: bool = False
    # Each unit writes a provenance sidecar per key, merged with the pairs.
    provenance: bool = False


def plan_job(cfg, sources: list[Source], tok_fp: str) -> Job:
    """Check the tokenizer as the local executor does (head of the corpus, Megatron's ids, the
    backend) and cut the inputs into units."""
    keys = tuple(cfg.json_keys)
    backend_name = backend_name_for(cfg)
    head = _head(sources, keys, {"source": 0, "offset": 0, "line": 0}, cfg)
    facts, wcfg, n_probes = tokenizer_setup(
        cfg, head, backend_name, tok_fp, recorded_facts(cfg, tok_fp)
    )
    units = plan_units(sources, cfg.unit_bytes)
    parts = {
        "inputs": [[str(s.path.resolve()), s.kind, s.size, s.mtime_ns] for s in sources],
        "tokenizer": [str(cfg.tokenizer.path.resolve()), tok_fp],
        "flags": {
            "json-keys": list(keys),
            "append-eod": cfg.append_eod,
            "keep-empty": cfg.keep_empty,
            "hf-split": cfg.split,
            "max-record-bytes": cfg.max_record_bytes,
            "on-error": cfg.on_error,
            "unit-mb": cfg.unit_bytes / (1 << 20),
            "provenance": cfg.provenance,
        },
        "units": [[u.source, u.start, u.end] for u in units],
    }
    fp = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    static = report_static(
        cfg, sources, cfg.tokenizer, facts, backend_name, np.dtype(facts.dtype), tok_fp, n_probes
    )
    contract = cfg.tokenizer.contract
    return Job(
        staging=str(staging_path(cfg.output_prefix).absolute()),
        fingerprint=fp,
        parts=parts,
        output_prefix=str(cfg.output_prefix),
        json_keys=keys,
        sources=tuple(dataclasses.replace(s, path=s.path.absolute()) for s in sources),
        units=tuple(units),
        wcfg=wcfg,
        header=facts.index_header,
        chunk_bytes=cfg.chunk_bytes,
        split=cfg.split,
        backend_name=backend_name,
        tokenizer_kind=facts.kind,
        checkpoint=str(contract.checkpoint) if contract else None,
        overwrite=cfg.overwrite,
        report=static,
        allow_empty=cfg.allow_empty,
        provenance=cfg.provenance,
    )


def _changes(old: dict, new: dict) -> str:
    """What differs between two jobs' fingerprint parts, in words."""
    out = []
    before = {row[0]: row[1:] for row in old.get("inputs", [])}
    now = {row[0]: row[1:] for row in new["inputs"]}
    for path, facts in now.items():
        if path not in before:
            out.append(f"input {path} was not in the job")
        elif before[path] != facts:
            out.append(
                f"input {path} changed ({before[path][1]} -> {facts[1]} bytes, or modified since)"
            )
    out += [f"input {p} is no longer given" for p in before if p not in now]
    if not out and list(before) != list(now):
        out.append("the order of the inputs")
    if old.get("tokenizer") != new["tokenizer"]:
        out.append(f"the tokenizer ({new['tokenizer'][0]}: other files or settings)")
    for flag, value in new["flags"].items():
        if old.get("flags", {}).get(flag) != value:
            out.append(f"--{flag} ({old.get('flags', {}).get(flag)!r} -> {value!r})")
    if not out and old.get("units") != new["units"]:
        out.append("the unit plan")
    return "; ".join(out) or "the job"


def open_staging(job: Job, resume: bool) -> bool:
    """Create the staging directory, or with ``resume`` reopen this job's; return whether an
    earlier run's units are there. Another job's staging directory is never reused: resuming it
    is an error that names what changed, and without ``resume`` it is replaced."""
    path = Path(job.staging)
    if path.exists() and resume:
        try:
            old = json.loads((path / JOB).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise PortingError(
                f"{path}: not a prep-data staging directory ({err}); rerun without --resume"
            ) from err
        if old.get("fingerprint") != job.fingerprint:
            raise PortingError(
                f"{path}: cannot resume: {_changes(old.get('parts', {}), job.parts)} since its "
                "units were made; rerun without --resume to start over"
            )
        for stray in path.glob("*.tmp-*"):
            stray.unlink(missing_ok=True)
        return True
    if path.exists():
        log.info("replacing the staged units in %s (pass --resume to continue them)", path)
        shutil.rmtree(path)
    path.mkdir(parents=True)
    write_json_atomic(path / JOB, {"fingerprint": job.fingerprint, "parts": job.parts})
    return False


def _stem(job: Job, index: int) -> Path:
    return Path(job.staging) / f"u{index:06d}"


def _check_size(src: Source) -> None:
    try:
        size = _source(src.path).size
    except PortingError as err:
        raise PortingError(f"{src.path}: gone since the job was planned ({err})") from err
    if size != src.size:
        raise PortingError(
            f"{src.path}: changed size between planning ({src.size} bytes) and reading "
            f"({size} bytes); rerun once the file is complete"
        )


def _init_worker(wcfg: worker.WorkerConfig) -> None:
    """Build the backend once per process and configuration (a Ray worker serves many units)."""
    if worker._STATE.get("config") == wcfg:
        return
    if wcfg.backend.name == "megatron":
        path = wcfg.backend.payload["path"]
        if not os.path.exists(path):
            raise PortingError(
                f"{path}: the tokenizer files are not on {socket.gethostname()}; the megatron "
                "backend loads them by path (use --tokenizer-backend hf or sentencepiece, "
                "which ship the tokenizer with the job)"
            )
    worker.init(wcfg)


def run_unit(job: Job, index: int, report=None) -> dict:
    """Tokenize unit ``index`` into the staging directory; return its summary (also written).

    ``report(index, documents, tokens, bytes, disk_bytes)``, if given, is called after every chunk
    with the unit's running totals. A bad record under ``--on-error fail``, a token id outside the
    vocabulary, a backend that differs from Megatron's tokenizer or an input that changed size
    raises :class:`PortingError` naming its file and line; nothing of the unit is kept.
    """
    t0, cpu0 = time.perf_counter(), cpu_seconds(children=False)
    unit = job.units[index]
    src = job.sources[unit.source]
    wcfg = job.wcfg
    _check_size(src)
    _init_worker(wcfg)
    stem = _stem(job, index)
    tmp, bins, provs = _open_unit_files(job, stem, src)
    lens: dict[str, list] = {k: [] for k in job.json_keys}
    stats = {k: {"documents": 0, "tokens": 0, "empty": 0} for k in job.json_keys}
    problems: list[list] = []
    problem_counts: dict[str, int] = {}
    lossy = {"sampled": 0, "differing": 0, "example": None}
    lines = nbytes = disk = compared = docs = tokens = 0

    def line_of(rel: int) -> int:
        # Counted only for an error: a range does not know how many lines precede it.
        base = lines_before(src.path, unit.start) if unit.end is not None else 0
        return base + lines + rel + 1

    def where(rel: int) -> str:
        return f"{src.path}:{line_of(rel)}"

    try:
        tasks = range_tasks(
            src, unit.start, unit.end, job.json_keys, job.chunk_bytes, job.split, wcfg.max_record
        )
        for n, task in enumerate(tasks):
            res = worker.run(task.payload, index == 0 and n == 0)
            if res.problems and wcfg.stop_at_first:
                rel, kind, detail = res.problems[0]
                raise located(src, line_of(rel), kind, detail)
            if res.bad_id is not None:
                rel, key, bad = res.bad_id
                raise bad_id_error(where(rel), key, bad, wcfg.id_limit, job.checkpoint)
            for rel, key, diff, text, decoded in res.samples:
                if diff is not None:
                    raise diff_error(where(rel), key, job.backend_name, diff, job.tokenizer_kind)
                compared += job.backend_name == "gigatoken"
                lossy["sampled"] += 1
                if text is not None:
                    lossy["differing"] += 1
                    if lossy["example"] is None:
                        lossy["example"] = [lines + rel, key, text, decoded]
            tokens += _write_chunk(job, res, task.start, lines, bins, provs, lens, stats)
            problems += [
                [lines + rel, kind, detail]
                for rel, kind, detail in res.problems
                if listed(problem_counts, kind)
            ]
            docs += len(res.doc_lens[job.json_keys[0]])
            lines += res.n_lines
            nbytes += res.nbytes
            disk += task.disk_bytes
            if report is not None:
                report(index, docs, tokens, nbytes, disk)
        _check_size(src)
        _place_unit_files(job, stem, tmp, bins, provs, lens)
    finally:
        for key in job.json_keys:
            bins[key].close()
            if key in provs:
                provs[key].close()
            for p in tmp[key]:
                p.unlink(missing_ok=True)
    summary = {
        "fingerprint": job.fingerprint,
        "unit": [unit.index, unit.source, unit.start, unit.end],
        "keys": stats,
        "lines": lines,
        "bytes": nbytes,
        "disk_bytes": disk,
        "problems": problems,
        "problem_counts": problem_counts,
        "lossy": lossy,
        "compared": compared,
        "seconds": round(time.perf_counter() - t0, 4),
        "cpu_seconds": round(cpu_seconds(children=False) - cpu0, 4),
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }
    # Written last: the unit counts as done only once its pair is in place.
    write_json_atomic(Path(f"{stem}.json"), summary)
    return summary


def _write_chunk(job: Job, res, start: int, lines: int, bins, provs, lens, stats) -> int:
    """One chunk's tokens, document lengths and provenance records per key, written after the
    unit's ``lines`` so far (its byte offsets from the chunk's ``start``); its token count."""
    tokens = 0
    for key in job.json_keys:
        toks, dl = res.tokens[key], res.doc_lens[key]
        bins[key].write(toks.tobytes(order="C"))
        lens[key].append(dl)
        if job.provenance:
            offsets = None if res.offsets is None else start + res.offsets
            prov = provenance.records(0, lines + res.lines + 1, offsets, res.hashes[key])
            provs[key].write(prov.tobytes(order="C"))
        stats[key]["documents"] += len(dl)
        stats[key]["tokens"] += int(toks.size)
        stats[key]["empty"] += int(np.count_nonzero(dl == 0))
        tokens += int(toks.size)
    return tokens


def _open_unit_files(job: Job, stem: Path, src):
    """The unit's temporary ``.bin``, ``.idx`` and ``.prov`` paths per key (under a tag of this
    process), its ``.bin`` files open, and its provenance sidecars open with their header."""
    tag = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = {
        k: (
            Path(f"{stem}.{k}.bin{tag}"),
            Path(f"{stem}.{k}.idx{tag}"),
            Path(f"{stem}.{k}.prov{tag}"),
        )
        for k in job.json_keys
    }
    bins = {k: open(tmp[k][0], "wb") for k in job.json_keys}
    provs = {}
    if job.provenance:
        # Its own source only (a job of a thousand files has a thousand units: every source in
        # every unit's header would grow with their product); the merge lists the job's sources
        # and places the unit's lines after those of the units before it.
        entries = [provenance.source_entry(src, job.split)]
        for k in job.json_keys:
            provs[k] = open(tmp[k][2], "wb")
            provs[k].write(provenance.header(entries, k))
    return tmp, bins, provs


def _place_unit_files(job: Job, stem: Path, tmp: dict, bins: dict, provs: dict, lens: dict) -> None:
    """Each key's ``.bin`` (and sidecar) synced, its ``.idx`` written from the document lengths,
    and all renamed into place."""
    itemsize = np.dtype(job.wcfg.dtype).itemsize
    for key in job.json_keys:
        bins[key].flush()
        os.fsync(bins[key].fileno())
        bins[key].close()
        doc_lens = np.concatenate(lens[key]) if lens[key] else np.empty(0, np.int32)
        write_index_from_doc_lengths(tmp[key][1], job.header, itemsize, doc_lens)
        if job.provenance:
            provs[key].flush()
            os.fsync(provs[key].fileno())
            provs[key].close()
    for key in job.json_keys:
        os.replace(tmp[key][0], f"{stem}.{key}.bin")
        os.replace(tmp[key][1], f"{stem}.{key}.idx")
        if job.provenance:
            os.replace(tmp[key][2], f"{stem}.{key}.prov")


def _index_counts(path: Path, header: bytes) -> tuple[int, int, int] | None:
    """(sequences, document entries, tokens) of an ``.idx`` whose header and size are as
    ``_IndexWriter`` lays them out; None otherwise."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(header) + 16)
            if len(head) < len(header) + 16 or head[: len(header)] != header:
                return None
            n_seq, n_docs = struct.unpack("<QQ", head[len(header) :])
            if path.stat().st_size != len(header) + 16 + 12 * n_seq + 8 * n_docs:
                return None
            lengths = np.fromfile(f, dtype=np.int32, count=n_seq)
    except OSError:
        return None
    return n_seq, n_docs, int(lengths.sum(dtype=np.int64))


def _whole_sidecar(path: Path, documents: int) -> bool:
    try:
        provenance.read(path, documents)
    except PortingError:
        return False
    return True


def verified(job: Job, index: int) -> dict | None:
    """The summary of unit ``index`` if it is complete and this job's: its fingerprint, and every
    key's index and ``.bin`` agreeing with the summary's counts. None: (re)do the unit."""
    stem = _stem(job, index)
    unit = job.units[index]
    try:
        summary = json.loads(Path(f"{stem}.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if summary.get("fingerprint") != job.fingerprint or summary.get("unit") != [
        unit.index, unit.source, unit.start, unit.end
    ]:  # fmt: skip
        return None
    itemsize = np.dtype(job.wcfg.dtype).itemsize
    for key in job.json_keys:
        want = summary["keys"][key]
        counts = _index_counts(Path(f"{stem}.{key}.idx"), job.header)
        if counts is None:
            return None
        n_seq, n_docs, n_tokens = counts
        bin_path = Path(f"{stem}.{key}.bin")
        if (
            n_docs != want["documents"] + 1
            or n_seq != want["documents"] - want["empty"]
            or n_tokens != want["tokens"]
            or not bin_path.is_file()
            or bin_path.stat().st_size != n_tokens * itemsize
            or (job.provenance and not _whole_sidecar(Path(f"{stem}.{key}.prov"), n_docs - 1))
        ):
            log.info("unit %d of %s is incomplete; tokenizing it again", index, job.staging)
            return None
    return summary


def _state(job: Job, summaries: list[dict]) -> tuple[dict, list[dict]]:
    """The counts the local executor keeps (``_fresh_state``'s layout), and the skipped records
    placed at their file and line: a unit's lines follow those of the units before it."""
    state = {
        "keys": {k: {"documents": 0, "tokens": 0, "empty": 0} for k in job.json_keys},
        "lines": 0,
        "records": 0,
        "bytes": 0,
        "skipped": 0,
        "problem_counts": dict.fromkeys(PROBLEM_KINDS, 0),
        "compared": 0,
        "lossy": {"sampled": 0, "differing": 0, "example": None},
    }
    skipped: list[dict] = []
    line_base: dict[int, int] = {}
    for unit, s in zip(job.units, summaries, strict=True):
        src = job.sources[unit.source]
        base = line_base.get(unit.source, 0)
        line_base[unit.source] = base + s["lines"]
        for key in job.json_keys:
            for field in ("documents", "tokens", "empty"):
                state["keys"][key][field] += s["keys"][key][field]
        state["records"] += s["keys"][job.json_keys[0]]["documents"]
        state["lines"] += s["lines"]
        state["bytes"] += s["bytes"]
        state["compared"] += s["compared"]
        # Each unit lists its first PROBLEMS_LISTED of a kind; the job lists the first of all.
        for rel, kind, detail in s["problems"]:
            if sum(r["reason"] == kind for r in skipped) < PROBLEMS_LISTED:
                skipped.append(
                    {
                        "file": str(src.path),
                        src.unit: base + rel + 1,
                        "reason": kind,
                        "detail": detail,
                    }
                )
        for kind, n in s["problem_counts"].items():
            state["problem_counts"][kind] = state["problem_counts"].get(kind, 0) + n
            state["skipped"] += n
        lossy = state["lossy"]
        lossy["sampled"] += s["lossy"]["sampled"]
        lossy["differing"] += s["lossy"]["differing"]
        if lossy["example"] is None and s["lossy"]["example"] is not None:
            rel, key, text, decoded = s["lossy"]["example"]
            lossy["example"] = {
                "file": str(src.path), src.unit: base + rel + 1, "key": key, "text": text,
                "decoded": decoded,
            }  # fmt: skip
    return state, skipped


def _merge_key(job: Job, key: str, summaries: list[dict], out: Path) -> None:
    """The units' pairs of ``key`` chained in unit order into ``out``.bin/.idx."""
    from data_prep.merge import merge

    prefixes, bases = [], []
    line_base: dict[int, int] = {}
    for u, s in zip(job.units, summaries, strict=True):
        base = line_base.get(u.source, 0)
        line_base[u.source] = base + s["lines"]
        if s["keys"][key]["documents"]:
            prefixes.append(f"{_stem(job, u.index)}.{key}")
            bases.append(base)
    if prefixes:
        entries = [provenance.source_entry(s, job.split) for s in job.sources]
        merge(prefixes, out, overwrite=True, record_bases=bases, sources=entries)
        return
    # No document anywhere: what the local executor writes for an input without any.
    Path(f"{out}.bin").write_bytes(b"")
    itemsize = np.dtype(job.wcfg.dtype).itemsize
    write_index_from_doc_lengths(f"{out}.idx", job.header, itemsize, np.empty(0, np.int32))
    if job.provenance:
        entries = [provenance.source_entry(s, job.split) for s in job.sources]
        provenance.write(provenance.sidecar_path(out), provenance.header(entries, key), ())


def finish(job: Job, summaries: list[dict], executor: str, timing: dict) -> dict:
    """Merge every unit, write the report, and give the outputs their names (the staging directory
    is then removed). ``summaries`` in unit order, each :func:`verified`."""
    staging = Path(job.staging)
    state, skipped = _state(job, summaries)
    try:
        refuse_empty(state["records"], state["skipped"], state["problem_counts"], job.allow_empty)
    except PortingError:
        shutil.rmtree(staging, ignore_errors=True)  # a finished job of nothing: no resume state
        raise
    t0 = time.perf_counter()
    from data_prep.tokenizer import third_party_quieted

    # The merge reads the units' indexes with megatron.core, whose import-time notices say
    # nothing about the data.
    with third_party_quieted():
        for key in job.json_keys:
            _merge_key(job, key, summaries, staging / f"merged.{key}")
    report = assemble_report(job.report, report_counts(job, state, skipped))
    report["executor"] = executor
    report["units"] = [
        {
            "unit": u.index,
            "file": str(job.sources[u.source].path),
            "start": u.start,
            "end": u.end,
            "documents": s["keys"][job.json_keys[0]]["documents"],
            "tokens": sum(s["keys"][k]["tokens"] for k in job.json_keys),
            "bytes": s["bytes"],
            "seconds": s["seconds"],
            "host": s["host"],
            "pid": s["pid"],
            **({"finished": s["finished"]} if "finished" in s else {}),
        }
        for u, s in zip(job.units, summaries, strict=True)
    ]
    timing = dict(timing)
    timing["merge_seconds"] = round(time.perf_counter() - t0, 3)
    seconds = timing.get("seconds", 0.0)
    unit_seconds = [s["seconds"] for s in summaries]
    unit_cpu = sum(s.get("cpu_seconds", 0.0) for s in summaries)
    tokens = sum(e["tokens"] for e in state["keys"].values())
    timing.update(
        {
            "unit_seconds_total": round(sum(unit_seconds), 3),
            "unit_seconds_max": round(max(unit_seconds, default=0.0), 3),
            # the units' per-core rate (each unit's process CPU while it ran; the merge aside)
            "unit_cpu_seconds_total": round(unit_cpu, 3),
            "tokens_per_cpu_s": round(rate(tokens, unit_cpu), 1),
            "bytes_per_s": round(rate(state["bytes"], seconds), 1),
            "tokens_per_s": round(rate(tokens, seconds), 1),
            "documents_per_s": round(rate(state["records"], seconds), 1),
        }
    )
    report["time"] = timing
    write_json_atomic(staging / REPORT, report)
    rpath = report_path(job.output_prefix)
    try:
        # A signal now would leave some outputs renamed and the staged units without them.
        with signals_deferred():
            for key in job.json_keys:
                final = output_prefix_for(job.output_prefix, key)
                os.replace(staging / f"merged.{key}.bin", f"{final}.bin")
                os.replace(staging / f"merged.{key}.idx", f"{final}.idx")
                made = provenance.sidecar_path(staging / f"merged.{key}")
                provenance.place(made if job.provenance else None, final)
            os.replace(staging / REPORT, rpath)
            shutil.rmtree(staging, ignore_errors=True)
    except (KeyboardInterrupt, Terminated) as err:
        err.kept = f"it came as the job finished: outputs complete, report {rpath}"
        raise
    log.info("wrote %s (%d records, %d skipped)", rpath, state["records"], state["skipped"])
    return report


def wind_down(job: Job, opened: bool, err: BaseException) -> str:
    """After a job ended early: a stop (a signal, a lost cluster) keeps the staged units to resume
    from; a failure of the data itself (a bad record, a changed input) removes them, so that
    nothing is left under the output name."""
    staging = Path(job.staging)
    if not opened:
        return "nothing staged"
    with signals_deferred():
        if not isinstance(err, PortingError) and any(staging.glob("u*.json")):
            for stray in staging.glob("*.tmp-*"):
                stray.unlink(missing_ok=True)
            return f"finished units kept in {staging}; rerun the same command with --resume"
        shutil.rmtree(staging, ignore_errors=True)
    return "staged units removed"


def job_to_json(job: Job) -> dict:
    """``job`` as JSON (bytes in base64), for tasks started from a file (slurm)."""

    def enc(v):
        if isinstance(v, bytes):
            return {"__bytes__": base64.b64encode(v).decode()}
        if isinstance(v, (list, tuple)):
            return [enc(x) for x in v]
        if isinstance(v, dict):
            return {k: enc(x) for k, x in v.items()}
        if isinstance(v, Path):
            return str(v)
        return v

    d = {f.name: getattr(job, f.name) for f in dataclasses.fields(job)}
    d["sources"] = [dataclasses.asdict(s) for s in job.sources]
    d["units"] = [dataclasses.asdict(u) for u in job.units]
    d["wcfg"] = dataclasses.asdict(job.wcfg)
    return enc(d)


def job_from_json(data: dict) -> Job:
    """The inverse of :func:`job_to_json`."""

    def dec(v):
        if isinstance(v, dict):
            if set(v) == {"__bytes__"}:
                return base64.b64decode(v["__bytes__"])
            return {k: dec(x) for k, x in v.items()}
        if isinstance(v, list):
            return [dec(x) for x in v]
        return v

    d = dec(data)
    w = d["wcfg"]
    b = w["backend"]
    backend = BackendSpec(
        **{**b, "prefix": tuple(b["prefix"]), "suffix": tuple(b["suffix"])},
    )
    ref = w["reference"]
    wcfg = worker.WorkerConfig(
        **{
            **w,
            "keys": tuple(w["keys"]),
            "backend": backend,
            "reference": tuple(ref) if ref is not None else None,
        }
    )
    return Job(
        **{
            **d,
            "json_keys": tuple(d["json_keys"]),
            "sources": tuple(Source(**{**s, "path": Path(s["path"])}) for s in d["sources"]),
            "units": tuple(Unit(**u) for u in d["units"]),
            "wcfg": wcfg,
        }
    )
