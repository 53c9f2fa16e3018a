"""The local executor: JSONL / local datasets to Megatron's ``.bin``/``.idx``, resumably.

Also the check every executor starts with (:func:`tokenizer_setup`: Megatron's tokenizer loaded
as the reference, the backend compared with it) and the report they all write.

The main process plans chunks, hands them to ``spawn``-ed workers (parse with orjson, batch-encode,
flat arrays back), and consumes results strictly in input order: it places problems at their
file and line, checks sampled documents against Megatron's own tokenizer, appends tokens and
document lengths to the partial outputs and commits the run's state after every chunk. At the
end it writes each ``.idx`` and the report in the work directory, then renames them to
``{prefix}_{key}_document.{bin,idx}`` and ``{prefix}.prep-report.json``. Output bytes equal
Megatron-LM's ``tools/preprocess_data.py`` (no sentence splitting) for the same tokenizer, input
and flags.

One run per output prefix (:func:`porting.guard.output_lock`, held for the whole run). However a
run ends early (a bad record, SIGINT, SIGTERM, SIGHUP: :class:`porting.guard.Terminated`), the
workers are killed before it returns, and the work directory is either removed (nothing was
committed) or kept as the resume state; a stopping signal carries which in its ``kept``. The final
renames are not interrupted: a signal arriving then is handled once the outputs are complete.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import multiprocessing
import os
import pickle
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from data_prep import provenance, worker, worker_start
from data_prep.backends import LightReference, build_backend, describe_diff
from data_prep.executors.base import (
    PrepConfig,
    checked_inputs,
    output_prefix_for,
    refuse_existing,
    work_path,
)
from data_prep.records import (
    PROBLEM_KINDS,
    Parsed,
    listed,
    oversize,
    parse_jsonl,
    parse_rows,
    refuse_empty,
)
from data_prep.report import Progress, cpu_seconds, rate, report_path, write_json_atomic
from data_prep.sources import Source, iter_tasks, read_range
from data_prep.tokenizer import (
    Facts,
    backend_spec,
    check_contract,
    megatron_facts,
    provisional,
    quiet_third_party,
    read_record,
    record_key,
    write_record,
)
from data_prep.writer import WorkDir, total_tokens, write_index_from_doc_lengths
from porting.errors import PortingError
from porting.guard import Terminated, output_lock, signals_deferred

log = logging.getLogger(__name__)

#: Texts of the corpus head that Megatron's tokenizer and the backend are compared on at start,
#: at most this many characters together: each is encoded three more times there.
HEAD_CHARS = 1 << 20
REPORT = "report.json"


def _run_fingerprint(cfg: PrepConfig, sources: list[Source], tok_fp: str) -> str:
    data = {
        "inputs": [[str(s.path.resolve()), s.kind, s.size, s.mtime_ns] for s in sources],
        "keys": list(cfg.json_keys),
        "append_eod": cfg.append_eod,
        "keep_empty": cfg.keep_empty,
        "split": cfg.split,
        "tokenizer": tok_fp,
        # Which records are skipped (or stop the run) depends on it.
        "max_record_bytes": cfg.max_record_bytes,
        "provenance": cfg.provenance,
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _fresh_state(fp: str, keys: tuple[str, ...]) -> dict:
    return {
        "fingerprint": fp,
        "position": {"source": 0, "offset": 0, "line": 0},
        "keys": {k: {"bin_bytes": 0, "documents": 0, "tokens": 0, "empty": 0} for k in keys},
        "lines": 0,
        "records": 0,
        "skipped": 0,
        "problems_bytes": 0,
        "problem_counts": dict.fromkeys(PROBLEM_KINDS, 0),
        "bytes": 0,
        "chunks": 0,
        "compared": 0,
        "lossy": {"sampled": 0, "differing": 0, "example": None},
        "elapsed": 0.0,
        "runs": 0,
    }


def _default_backend(kind: str) -> str:
    return "hf" if kind == "hf" else "sentencepiece"


def check_backend(facts: Facts, backend_name: str, spec) -> int:
    """Refuse a backend (or a light reference) that differs from Megatron's tokenizer on the
    probes and the head of the corpus; return how many texts were compared."""
    if backend_name == "megatron":
        return 0
    try:
        backend = build_backend(spec)
    except ImportError as err:
        raise PortingError(
            f"the {backend_name} backend needs a package that is not installed ({err.name}); "
            f"pip install {err.name}"
        ) from err
    except (ValueError, RuntimeError, OSError) as err:
        raise PortingError(f"the {backend_name} backend cannot load {facts.path}: {err}") from err
    # The light reference checks gigatoken's sampled documents in the workers; the other
    # backends are the reference's own library, checked here already.
    light = None
    if backend_name == "gigatoken":
        light = LightReference(facts.kind, facts.payload, facts.include_special_tokens)
    got = [backend.encode([t])[0].tolist() for t in facts.texts]
    for text, want, ids in zip(facts.texts, facts.ids, got, strict=True):
        diff = describe_diff(ids, list(want), text)
        if diff is not None:
            raise PortingError(
                f"the {backend_name} backend does not reproduce Megatron's tokenizer "
                f"({facts.path}) on {diff}; use --tokenizer-backend "
                f"{_default_backend(facts.kind)} (or megatron)"
            )
        if light is None:
            continue
        diff = describe_diff(light.encode(text), list(want), text)
        if diff is not None:
            raise PortingError(
                f"{facts.path}: the tokenizers library alone does not reproduce Megatron's "
                f"tokenizer on {diff}; use --tokenizer-backend megatron"
            )
    return len(facts.texts)


def backend_name_for(cfg: PrepConfig) -> str:
    """The backend ``--tokenizer-backend`` names (``auto``: the tokenizer kind's own library)."""
    return _default_backend(cfg.tokenizer.kind) if cfg.backend == "auto" else cfg.backend


def recorded_facts(cfg: PrepConfig, tok_fp: str) -> Facts | None:
    """The facts of this run's tokenizer from its record (data_prep.tokenizer), if there is one
    and ``--recheck-tokenizer`` is not given."""
    if cfg.recheck_tokenizer:
        return None
    return read_record(record_key(tok_fp), cfg.tokenizer)


def tokenizer_setup(
    cfg: PrepConfig, head: list[str], backend_name: str, tok_fp: str, facts: Facts | None = None
) -> tuple[Facts, worker.WorkerConfig, int]:
    """Check the model's contract and the backend against Megatron's tokenizer: on the probes,
    from ``facts`` (:func:`recorded_facts`) where given, else on the probes and ``head`` with
    Megatron's tokenizer loaded (its facts then recorded). Return the facts, the workers'
    configuration and how many texts were compared."""
    src = cfg.tokenizer
    if facts is None:
        facts = _megatron_facts(cfg, head)
        write_record(record_key(tok_fp), facts)
    if src.contract is not None:
        check_contract(facts, src.contract, cfg.append_eod)
    if cfg.append_eod and facts.eod is None:
        raise PortingError(f"{src.path}: the tokenizer has no EOS token to append as EOD")
    spec = backend_spec(facts, backend_name)
    try:
        n_probes = check_backend(facts, backend_name, spec)
    except PortingError:
        if facts.record is None:
            raise
        # A record is a cache: one that the backend disagrees with may be the stale or damaged
        # side, so Megatron's own tokenizer decides (and is recorded again).
        log.warning(
            "%s: tokenizer record not used (the %s backend disagrees with it on the probes); "
            "loading Megatron's tokenizer",
            facts.record, backend_name,
        )  # fmt: skip
        return tokenizer_setup(cfg, head, backend_name, tok_fp, None)
    wcfg = _worker_config(
        cfg, spec, facts.eod, facts.vocab_size, facts.dtype, src.contract, facts.payload
    )
    return facts, wcfg, n_probes


def located(source: Source, line: int, kind: str, detail: str) -> PortingError:
    """The error for a bad record at ``line`` of ``source`` under ``--on-error fail``."""
    return _located(source, line, kind, detail)


def bad_id_error(where: str, key: str, bad: int, id_limit: int, checkpoint) -> PortingError:
    """A token id at or past the vocabulary (or, with a ``checkpoint``, the model's HF
    vocabulary, not the padded one) at ``where``."""
    what = (
        f"the model's vocabulary ({id_limit}, HF vocab_size of {checkpoint})"
        if checkpoint
        else f"the tokenizer's vocabulary ({id_limit})"
    )
    return PortingError(f"{where}: key {key!r}: token id {bad} is outside {what}")


def diff_error(where: str, key: str, backend_name: str, diff: str, kind: str) -> PortingError:
    """A sampled document the backend encodes differently from Megatron's tokenizer."""
    return PortingError(
        f"{where}: key {key!r}: the {backend_name} backend does not reproduce Megatron's "
        f"tokenizer on {diff}; use --tokenizer-backend {_default_backend(kind)} (or megatron)"
    )


def _located(source: Source, line: int, kind: str, detail: str) -> PortingError:
    return PortingError(
        f"{source.path}:{line}: {kind}: {detail} (--on-error skip skips and lists such records)"
    )


def _head(sources: list[Source], keys, pos: dict, cfg: PrepConfig) -> list[str]:
    """The first usable texts of every key where this run starts (32 each, ``HEAD_CHARS`` in
    all), for the setup check.

    With ``--on-error fail`` a bad record among them stops the run here, before Megatron's
    tokenizer is loaded (seconds), with the error the run would have stopped with.
    """
    task = next(
        iter_tasks(
            sources, keys, min(cfg.chunk_bytes, 1 << 20), pos["source"], pos["offset"], cfg.split,
            cfg.max_record_bytes,
        ),
        None,
    )  # fmt: skip
    if task is None:
        return []
    kind, *rest = task.payload
    checks = (keys, cfg.keep_empty, cfg.on_error == "fail", cfg.max_record_bytes)
    parsed: Parsed
    if kind == "rows":
        parsed = parse_rows(rest[0], *checks)
    elif kind == "oversize":
        parsed = oversize(rest[0], rest[1], keys, rest[2])
    else:
        parsed = parse_jsonl(read_range(*rest) if kind == "range" else rest[0], *checks)
    if parsed.problems and cfg.on_error == "fail":
        rel, problem, detail = parsed.problems[0]
        line0 = pos["line"] if task.source_index == pos["source"] else 0
        raise _located(sources[task.source_index], line0 + rel + 1, problem, detail)
    texts, budget = [], HEAD_CHARS
    for k in keys:
        for t in parsed.texts[k][:32]:
            if len(t) <= budget:
                texts.append(t)
                budget -= len(t)
    return texts


def _megatron_facts(cfg: PrepConfig, head: list[str]) -> Facts:
    """:func:`megatron_facts` in a short-lived process (in this one for ``in_process``)."""
    src = cfg.tokenizer
    args = (src.kind, str(src.path), cfg.include_special_tokens, cfg.use_fast, head)
    if cfg.in_process:
        return megatron_facts(*args)
    pool = None
    try:
        with signals_deferred():  # see _Runner.start
            pool = ProcessPoolExecutor(
                1, mp_context=multiprocessing.get_context("spawn"),
                initializer=worker.ignore_parent_signals,
            )  # fmt: skip
            future = pool.submit(_facts_quietly, *args)
        facts = future.result()
        pool.shutdown(wait=True)
    except BrokenProcessPool as err:
        _stop_pool(pool)
        raise PortingError(
            f"{src.path}: the process loading Megatron's tokenizer died (out of memory?)"
        ) from err
    except BaseException:
        # On SIGTERM or Ctrl-C, not wait for its seconds of imports to finish.
        if pool is not None:
            _stop_pool(pool)
        raise
    return facts


def _facts_quietly(*args) -> Facts:
    """:func:`megatron_facts` in the child, without the import-time chatter of torch and
    megatron.core (deprecation warnings and log lines about CUDA, Apex, end-of-life functions)."""
    quiet_third_party()
    return megatron_facts(*args)


def _stop_pool(pool: ProcessPoolExecutor) -> None:
    """Kill a pool's processes and return once they are gone (results in flight are dropped).

    Workers ignore SIGINT/SIGTERM/SIGHUP (:func:`worker.ignore_parent_signals`) and hold nothing
    but the chunks in memory, so SIGKILL is safe and immediate; ``shutdown(wait=True)`` would wait
    for every running chunk. This is what Python 3.14's ``ProcessPoolExecutor.kill_workers``
    does, through the same private attributes.
    """
    procs = list((getattr(pool, "_processes", None) or {}).values())
    manager = getattr(pool, "_executor_manager_thread", None)
    for p in procs:
        with contextlib.suppress(Exception):
            p.kill()
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        with contextlib.suppress(Exception):
            p.join(5)
    if manager is not None:
        # It notices the dead workers, fails what was pending and closes the queues.
        manager.join(5)


def _bytes_done(sources: list[Source], position: dict) -> int:
    """On-disk bytes already behind the resume point (for the progress bar)."""
    done = sum(s.size for s in sources[: position["source"]])
    if position["source"] < len(sources):
        src = sources[position["source"]]
        if src.kind == "jsonl":
            done += min(position["offset"], src.size)
    return done


class _Done:
    """A result computed in this process, shaped like a Future."""

    def __init__(self, value) -> None:
        self._value = value

    def result(self):
        """The value."""
        return self._value


class _Runner:
    """Hands tasks to the workers through a bounded window; yields results in task order.

    :meth:`fill` can run ahead (a head start while the main process is still loading Megatron);
    :meth:`restart` reruns everything in flight under another worker configuration.
    """

    def __init__(self, cfg: PrepConfig, tasks, head_first: bool) -> None:
        self._cfg = cfg
        self._tasks = iter(tasks)
        self._window: collections.deque = collections.deque()
        self._pool = None
        self._head = head_first
        self.config: worker.WorkerConfig | None = None

    def start(self, wcfg: worker.WorkerConfig) -> None:
        """Start the workers with this configuration.

        Building the pool and handing it a task (which starts a worker process) is not cut by a
        signal: one handled half-way would leave a process or the pool's queues that
        :meth:`stop` cannot reach, their semaphores then released only at interpreter exit.
        """
        self.config = wcfg
        if self._cfg.in_process:
            worker.init(wcfg)
        else:
            with signals_deferred():
                self._pool = ProcessPoolExecutor(
                    max_workers=self._cfg.workers,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=worker_start.init,
                    initargs=(pickle.dumps(wcfg),),
                )

    def _submit(self, task, head: bool):
        if self._pool is None:
            return _Done(worker.run(task.payload, head))
        with signals_deferred():
            return self._pool.submit(worker.run, task.payload, head)

    def fill(self, n: int) -> None:
        """Keep ``n`` chunks handed out (fewer at the end of the input)."""
        while len(self._window) < n:
            task = next(self._tasks, None)
            if task is None:
                return
            self._window.append((task, self._head, self._submit(task, self._head)))
            self._head = False

    def restart(self, wcfg: worker.WorkerConfig) -> None:
        """New workers with ``wcfg``; what was in flight is computed again by them."""
        self.close()
        self.start(wcfg)
        pending = list(self._window)
        self._window = collections.deque(
            (task, head, self._submit(task, head)) for task, head, _ in pending
        )

    def results(self):
        """(task, ChunkResult) pairs in task order, two chunks per worker in flight.

        A worker that died (the kernel's OOM killer, an allocation failure aborting the
        tokenizer) or ran out of memory raises :class:`WorkerLost` naming the first task in
        flight.
        """
        limit = 2 * self._cfg.workers
        while True:
            try:
                self.fill(limit)  # a broken pool refuses new tasks too
                if not self._window:
                    return
                res = self._window[0][2].result()
            except (BrokenProcessPool, MemoryError) as err:
                raise WorkerLost(self._window[0][0] if self._window else None, err) from err
            task, _, _ = self._window.popleft()
            yield task, res

    def close(self) -> None:
        """Stop the workers once idle, cancelling what has not started."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def stop(self) -> None:
        """Kill the workers now: the run is ending early and their results are not wanted."""
        pool, self._pool = self._pool, None
        if pool is not None:
            _stop_pool(pool)


class WorkerLost(Exception):
    """A worker process died, or ran out of memory, with ``task`` the first chunk in flight
    (None: none was)."""

    def __init__(self, task, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.task = task
        self.oom = isinstance(cause, MemoryError)


def _worker_config(
    cfg: PrepConfig, spec, eod: int | None, vocab_size: int, dtype: str, contract, payload
) -> worker.WorkerConfig:
    """What the workers run with; ``payload`` builds the reference gigatoken is checked against."""
    reference = None
    if spec.name == "gigatoken":
        reference = (cfg.tokenizer.kind, payload, cfg.include_special_tokens)
    return worker.WorkerConfig(
        keys=tuple(cfg.json_keys),
        backend=spec,
        eod=eod if cfg.append_eod else None,
        keep_empty=cfg.keep_empty,
        stop_at_first=cfg.on_error == "fail",
        dtype=dtype,
        id_limit=contract.id_limit if contract else vocab_size,
        reference=reference,
        max_record=cfg.max_record_bytes,
        provenance=cfg.provenance,
    )


def _guess_dtype(vocab_size: int) -> str:
    # DType.optimal_dtype's rule, for the head start only; the real one is compared after import.
    return "uint16" if vocab_size < 65500 else "int32"


class _Run:
    """The state of one run while it consumes results: placing, checking, writing, counting."""

    def __init__(self, cfg, sources, work: WorkDir, facts: Facts, backend_name: str, id_limit):
        self.cfg, self.sources, self.work, self.facts = cfg, sources, work, facts
        self.backend_name, self.id_limit = backend_name, id_limit
        self.state = work.state
        self.run_bytes = self.run_tokens = self.run_docs = 0

    def first_line(self, task) -> int:
        """The 0-based line (or row) of its file that ``task`` starts at: chunks come in order,
        so the state's position is where the next one starts."""
        pos = self.state["position"]
        return pos["line"] if task.source_index == pos["source"] else 0

    def lost(self, err: WorkerLost) -> PortingError:
        """The located error for a worker that died on ``err.task`` or a chunk after it."""
        pos = self.state["position"]
        index = err.task.source_index if err.task is not None else pos["source"]
        source = self.sources[min(index, len(self.sources) - 1)]
        line = self.first_line(err.task) if err.task is not None else pos["line"]
        what = "ran out of memory" if err.oom else "died (killed, or out of memory)"
        return PortingError(
            f"{source.path}:{line + 1}: a tokenizing worker {what} on the chunk from this "
            f"{source.unit} on, or one after it ({err}); lower --max-record-bytes (one long "
            "record is encoded in one piece) or --workers, and rerun with --resume"
        )

    def add(self, task, res: worker.ChunkResult) -> tuple[int, int]:
        """Account for one chunk (in input order); return (documents, tokens) added."""
        cfg, state, src = self.cfg, self.state, self.cfg.tokenizer
        source = self.sources[task.source_index]
        line0 = self.first_line(task)
        if res.problems and cfg.on_error == "fail":
            rel, kind, detail = res.problems[0]
            raise _located(source, line0 + rel + 1, kind, detail)
        if res.bad_id is not None:
            rel, key, bad = res.bad_id
            where = f"{source.path}:{line0 + rel + 1}"
            checkpoint = src.contract.checkpoint if src.contract else None
            raise bad_id_error(where, key, bad, self.id_limit, checkpoint)
        for rel, key, diff, text, decoded in res.samples:
            self._check_sample(source, line0 + rel + 1, key, diff, text, decoded)
        keys = tuple(cfg.json_keys)
        n_docs = len(res.doc_lens[keys[0]])
        n_tokens = 0
        for key in keys:
            lens, tokens = res.doc_lens[key], res.tokens[key]
            prov = None
            if cfg.provenance:
                offsets = None if res.offsets is None else task.start + res.offsets
                prov = provenance.records(
                    task.source_index, line0 + res.lines + 1, offsets, res.hashes[key]
                )
            self.work.append(key, tokens, lens, prov)
            entry = state["keys"][key]
            entry["tokens"] += int(tokens.size)
            entry["empty"] += int(np.count_nonzero(lens == 0))
            n_tokens += int(tokens.size)
        rows = [
            {
                "file": str(source.path),
                source.unit: line0 + rel + 1,
                "reason": kind,
                "detail": detail,
            }
            for rel, kind, detail in res.problems
            if listed(state["problem_counts"], kind)
        ]
        self.work.add_problems(rows)
        state["skipped"] += len(res.problems)
        state["records"] += n_docs
        state["lines"] += res.n_lines
        state["bytes"] += res.nbytes
        state["chunks"] += 1
        state["position"] = {
            "source": task.source_index,
            "offset": task.end,
            "line": line0 + res.n_lines,
        }
        self.run_bytes += res.nbytes
        self.run_docs += n_docs
        self.run_tokens += n_tokens
        if cfg.crash_after_chunks is not None and state["chunks"] > cfg.crash_after_chunks:
            self.work.flush()
            os._exit(3)
        self.work.commit()
        return n_docs, n_tokens

    def _check_sample(self, source: Source, line: int, key: str, diff, text, decoded) -> None:
        """The equivalence check against the reference, and the lossiness estimate."""
        state = self.state
        if diff is not None:
            raise diff_error(f"{source.path}:{line}", key, self.backend_name, diff, self.facts.kind)
        if self.backend_name == "gigatoken":
            state["compared"] += 1
        lossy = state["lossy"]
        lossy["sampled"] += 1
        if text is not None:
            lossy["differing"] += 1
            if lossy["example"] is None:
                lossy["example"] = {
                    "file": str(source.path),
                    source.unit: line,
                    "key": key,
                    "text": text,
                    "decoded": decoded,
                }


def _open_work(cfg: PrepConfig, work: WorkDir, keys, run_fp: str, resuming: bool) -> None:
    if resuming:
        work.resume(run_fp)
        log.info("resuming %s after %d chunks", work.path, work.state["chunks"])
    else:
        if work.path.exists():
            log.info("replacing the partial run in %s (pass --resume to continue it)", work.path)
        work.start(_fresh_state(run_fp, keys))
    work.state["runs"] += 1


def _wind_down(work: WorkDir, opened: bool) -> str:
    """After a run ended early: keep the work directory where it holds committed chunks (the
    resume state), remove it where it holds nothing worth resuming; say which. A work directory
    this run did not open (a refused --resume, a stop before the start) is left as it was."""
    if opened and work.state.get("chunks", 0) > 0:
        work.close()
        return f"resume state kept in {work.path}; rerun the same command with --resume"
    if opened:
        work.remove()
    return "partial outputs removed"


def prepare(cfg: PrepConfig) -> dict:
    """Run one ``prep-data`` on this machine (the local executor, whatever ``cfg.executor``
    says); return the report (also written next to the outputs). :func:`data_prep.run.prepare`
    runs the executor ``cfg.executor`` names."""
    t_start, cpu_start = time.perf_counter(), cpu_seconds()
    sources, tok_fp = checked_inputs(cfg)
    run_fp = _run_fingerprint(cfg, sources, tok_fp)
    if cfg.workers is None:
        cfg.workers = 1
    # Everything above only reads; from here on this run alone writes under the prefix.
    with output_lock(cfg.output_prefix, "dataset"):
        return _prepare(cfg, sources, tok_fp, run_fp, (t_start, cpu_start))


def _prepare(cfg: PrepConfig, sources: list[Source], tok_fp: str, run_fp: str, start) -> dict:
    t_start, cpu_start = start
    keys = tuple(cfg.json_keys)
    src = cfg.tokenizer
    backend_name = backend_name_for(cfg)
    refuse_existing(cfg)
    prov_heads = None
    if cfg.provenance:
        entries = [provenance.source_entry(s, cfg.split) for s in sources]
        prov_heads = {k: provenance.header(entries, k) for k in keys}
    work = WorkDir(work_path(cfg.output_prefix), keys, prov_heads)
    opened = False
    runner = progress = None
    t_work = time.perf_counter()
    try:
        # Replacing or reopening the work directory is not cut short by a signal: it is either
        # untouched or opened (and then removed or kept like any other).
        with signals_deferred():
            _open_work(cfg, work, keys, run_fp, cfg.resume and work.exists())
            opened = True
        state = work.state
        pos = state["position"]
        tasks = iter_tasks(
            sources, keys, cfg.chunk_bytes, pos["source"], pos["offset"], cfg.split,
            cfg.max_record_bytes,
        )  # fmt: skip
        runner = _Runner(cfg, tasks, head_first=state["chunks"] == 0)
        head = _head(sources, keys, pos, cfg)
        recorded = recorded_facts(cfg, tok_fp)
        guessed = _early_worker_config(cfg, backend_name, recorded)
        if guessed is not None:
            runner.start(guessed)
            runner.fill(min(32, 8 * cfg.workers))

        facts, wcfg, n_probes = tokenizer_setup(cfg, head, backend_name, tok_fp, recorded)
        dtype = np.dtype(facts.dtype)
        if runner.config is None:
            runner.start(wcfg)
        elif runner.config != wcfg:
            log.info("the tokenizer as Megatron loads it differs from its files; restarting")
            runner.restart(wcfg)
        log.info(
            "tokenizer %s (%s, backend %s, vocab %d, eod %s, dtype %s); %d input(s)",
            src.path, src.kind, backend_name, facts.vocab_size, wcfg.eod, dtype.name, len(sources),
        )  # fmt: skip
        run = _Run(cfg, sources, work, facts, backend_name, wcfg.id_limit)
        progress = Progress(
            sum(s.size for s in sources), _bytes_done(sources, pos), cfg.show_progress
        )
        try:
            for task, res in runner.results():
                docs, tokens = run.add(task, res)
                progress.update(task.disk_bytes, docs, tokens, res.nbytes)
        except WorkerLost as err:
            raise run.lost(err) from None
        runner.close()
        progress.close()
        work.close()
        t_work = time.perf_counter() - t_work

        _write_indexes(work, facts, dtype, state, prov_heads is not None)
        elapsed = time.perf_counter() - t_start
        # the workers are joined by now (runner.close), so their CPU is counted
        cpu = cpu_seconds() - cpu_start
        state["elapsed"] += elapsed
        report = _report(
            cfg, sources, src, facts, backend_name, dtype, state, work.problems(), tok_fp, n_probes
        )
        report["time"] = _timing(run, state, elapsed, t_work, cpu)
        # Written beside the partial outputs, so that finishing is renames only.
        write_json_atomic(work.path / REPORT, report)
    except BaseException as err:
        kept = "partial outputs removed"
        try:
            # A second signal must not cut the clean-up short; it is raised once it is done.
            with signals_deferred():
                if runner is not None:
                    runner.stop()
                if progress is not None:
                    progress.close()
                kept = _wind_down(work, opened)
        except (KeyboardInterrupt, Terminated) as stop:
            stop.kept = kept
            raise
        if isinstance(err, (KeyboardInterrupt, Terminated)):
            err.kept = kept
        raise
    try:
        refuse_empty(state["records"], state["skipped"], state["problem_counts"], cfg.allow_empty)
    except PortingError:
        work.remove()
        raise
    rpath = _publish(cfg, work, prov_heads is not None)
    log.info("wrote %s (%d records, %d skipped)", rpath, state["records"], state["skipped"])
    return report


def _early_worker_config(cfg: PrepConfig, backend_name: str, recorded):
    """The workers' configuration before the backend is checked, where it is known: from the
    tokenizer's record (the workers start meanwhile, and a failed check stops them before
    anything is written), or guessed from the tokenizer's files while Megatron's tokenizer
    loads, where spare cores can absorb the loading (and its memory is not on top of theirs on a
    small machine); else None."""
    src = cfg.tokenizer
    if recorded is not None:
        spec = backend_spec(recorded, backend_name)
        return _worker_config(
            cfg, spec, recorded.eod, recorded.vocab_size, recorded.dtype, src.contract,
            recorded.payload,
        )  # fmt: skip
    if cfg.in_process or (os.cpu_count() or 1) > cfg.workers + 1:
        guess = provisional(src, cfg.include_special_tokens, backend_name)
        if guess is not None:
            spec, eod, vocab = guess
            return _worker_config(
                cfg, spec, eod, vocab, _guess_dtype(vocab), src.contract, spec.payload
            )
    return None


def _write_indexes(work: WorkDir, facts: Facts, dtype, state: dict, provenance_on: bool) -> None:
    """Each key's ``.idx`` from its document lengths, once its ``.bin`` is the size they say (and
    its provenance sidecar holds every document)."""
    for key in work.keys:
        lengths = work.lens_path(key)
        if work.bin_path(key).stat().st_size != total_tokens(lengths) * dtype.itemsize:
            raise PortingError(f"{work.bin_path(key)}: size does not match its document lengths")
        if provenance_on:
            provenance.read(work.prov_path(key), state["keys"][key]["documents"])
        write_index_from_doc_lengths(
            work.path / f"{key}.idx", facts.index_header, dtype.itemsize, lengths
        )


def _timing(run, state: dict, elapsed: float, t_work: float, cpu: float) -> dict:
    """The report's ``time``: this run's and every run's seconds, its rates and per-core rate."""
    return {
        "seconds": round(elapsed, 3),
        # From the first chunk handed out to the last one written: the steady-state part.
        "processing_seconds": round(t_work, 3),
        "seconds_all_runs": round(state["elapsed"], 3),
        "runs": state["runs"],
        "bytes_this_run": run.run_bytes,
        "bytes_per_s": round(rate(run.run_bytes, elapsed), 1),
        "tokens_per_s": round(rate(run.run_tokens, elapsed), 1),
        "documents_per_s": round(rate(run.run_docs, elapsed), 1),
        # the run's per-core rate: every process of it, start-up and the index included
        "cpu_seconds": round(cpu, 3),
        "tokens_per_cpu_s": round(rate(run.run_tokens, cpu), 1),
    }


def _publish(cfg: PrepConfig, work: WorkDir, provenance_on: bool):
    """The finished outputs renamed into place, the report last; its path."""
    rpath = report_path(cfg.output_prefix)
    try:
        # A signal now would leave some outputs renamed and the resume state without them.
        with signals_deferred():
            for key in work.keys:
                final = output_prefix_for(cfg.output_prefix, key)
                os.replace(work.bin_path(key), f"{final}.bin")
                os.replace(work.path / f"{key}.idx", f"{final}.idx")
                provenance.place(work.prov_path(key) if provenance_on else None, final)
            os.replace(work.path / REPORT, rpath)
            work.remove()
    except (KeyboardInterrupt, Terminated) as err:
        err.kept = f"it came as the run finished: outputs complete, report {rpath}"
        raise
    return rpath


def _report(
    cfg, sources, src, facts, backend_name, dtype, state, skipped, tok_fp, n_probes
) -> dict:
    static = report_static(cfg, sources, src, facts, backend_name, dtype, tok_fp, n_probes)
    return assemble_report(static, report_counts(cfg, state, skipped))


def assemble_report(static: dict, counts: dict) -> dict:
    """:func:`report_static` and :func:`report_counts` as one report."""
    report = {**static, **counts}
    report["equivalence"] = {**static["equivalence"], **counts["equivalence"]}
    return report


def report_static(cfg, sources, src, facts, backend_name, dtype, tok_fp, n_probes) -> dict:
    """The parts of the report known before any document is read."""
    tokenizer = {
        "kind": src.kind,
        # Absolute, so that `prep-data inspect` finds it from any directory.
        "path": str(src.path.resolve()),
        "fingerprint": tok_fp,
        "backend": backend_name,
        "vocab_size": facts.vocab_size,
        "dtype": dtype.name,
        "eod": facts.eod if cfg.append_eod else None,
        "include_special_tokens": cfg.include_special_tokens if src.kind == "hf" else None,
        "use_fast": cfg.use_fast if src.kind == "hf" else None,
    }
    if src.contract is not None:
        tokenizer["checkpoint"] = {
            "path": str(src.contract.checkpoint.resolve()),
            "vocab_size": src.contract.id_limit,
            "padded_vocab_size": src.contract.padded_vocab_size,
            "eos_token_id": src.contract.eos_token_id,
        }
    return {
        "inputs": [{"path": str(s.path), "kind": s.kind, "bytes": s.size} for s in sources],
        "json_keys": list(cfg.json_keys),
        "append_eod": cfg.append_eod,
        "keep_empty": cfg.keep_empty,
        "on_error": cfg.on_error,
        "tokenizer": tokenizer,
        "equivalence": {
            "reference": "megatron.core.tokenizers (as tools/preprocess_data.py builds it)",
            # Probe texts and the head of the corpus, compared with Megatron's own ids at start
            # (the probes only where a tokenizer record stood in for Megatron's tokenizer).
            "texts_checked_at_start": n_probes,
            "tokenizer_record": facts.record,
        },
    }


def report_counts(cfg, state: dict, skipped: list[dict]) -> dict:
    """The parts of the report counted from the documents (``state`` as :func:`_fresh_state`
    lays it out)."""
    lossy = state["lossy"]
    outputs = {}
    for key in cfg.json_keys:
        entry = state["keys"][key]
        prefix = output_prefix_for(cfg.output_prefix, key)
        outputs[key] = {
            "prefix": str(prefix),
            "provenance": str(provenance.sidecar_path(prefix)) if cfg.provenance else None,
            "documents": entry["documents"],
            "sequences": entry["documents"] - entry["empty"],
            "empty_documents": entry["empty"],
            "tokens": entry["tokens"],
        }
    return {
        "outputs": outputs,
        "lines": state["lines"],
        "records": state["records"],
        "bytes": state["bytes"],
        "skipped": state["skipped"],
        "problems": {k: v for k, v in state["problem_counts"].items() if v},
        "skipped_records": skipped,
        # Beyond the first PROBLEMS_LISTED of each kind, skipped records are counted, not listed.
        "skipped_not_listed": state["skipped"] - len(skipped),
        "equivalence": {
            # gigatoken only: sampled documents re-encoded by the tokenizers/sentencepiece object
            # Megatron's tokenizer wraps (the other backends are that object).
            "documents_compared": state["compared"],
            "differences": 0,
        },
        "lossiness": {
            "sampled_documents": lossy["sampled"],
            "differing": lossy["differing"],
            "share": round(rate(lossy["differing"], lossy["sampled"]), 4),
            "example": lossy["example"],
        },
    }
