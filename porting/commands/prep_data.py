"""``porting prep-data`` (and its ``merge`` and ``inspect`` actions): the command-line layer.

Flags that Megatron-LM's ``tools/preprocess_data.py`` or NeMo's ``preprocess_data_for_megatron.py``
also have keep their names and meaning, so their scripts port by changing the command name.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from pathlib import Path

from data_prep.blend import EPOCHS_FLAGGED
from data_prep.executors import EXECUTORS, executor_flags
from data_prep.executors.base import PrepConfig
from data_prep.sources import MAX_RECORD_BYTES
from porting.errors import PortingError
from porting.guard import Terminated

log = logging.getLogger(__name__)


def register(subparsers) -> None:
    """Add ``prep-data`` with its ``merge``, ``blend``, ``inspect`` and Slurm actions."""
    p = subparsers.add_parser(
        "prep-data",
        help="tokenize JSONL / local datasets into Megatron .bin/.idx (also: merge, blend, inspect)",
        description="Tokenize JSONL files (globs, .jsonl.gz) or local Hugging Face datasets into "
        "Megatron's indexed dataset, byte-identical to Megatron-LM's tools/preprocess_data.py. "
        "Writes {output_prefix}_{key}_document.bin/.idx per --json-keys entry and "
        "{output_prefix}.prep-report.json.",
        epilog="examples:\n"
        "  porting prep-data --input 'corpus/*.jsonl' --output-prefix out/corpus \\\n"
        "      --tokenizer ./my-nemo-ckpt --append-eod --workers 2\n"
        "  porting prep-data ... --resume            # continue a killed run\n"
        "  porting prep-data ... --executor slurm    # a job array on Slurm, followed to the end\n"
        "  porting prep-data status --job out/corpus.prep-data.slurm/job.json\n"
        "  porting prep-data inspect out/corpus_text_document\n"
        "  porting prep-data merge out/a_text_document out/b_text_document --output-prefix out/ab\n"
        "details: docs/data_prep.md",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _input_flags(p)
    _tokenizer_flags(p)
    _output_flags(p)
    _runtime_flags(p)
    p.set_defaults(func=run_prep)
    actions = p.add_subparsers(dest="prep_action", metavar="ACTION")
    _merge_actions(actions)
    _status_action(actions)
    _blend_action(actions)
    _inspect_action(actions)


def _input_flags(p) -> None:
    """What is read: files, globs, folders, saved datasets, and the keys."""
    g = p.add_argument_group("input data")
    g.add_argument(
        "--input",
        nargs="+",
        metavar="PATH",
        help="JSONL files, globs, .jsonl.gz, "
        "folders of JSONL, saved HF datasets (save_to_disk) or .parquet files",
    )
    g.add_argument(
        "--json-keys", nargs="+", default=["text"], help="keys to tokenize (default text)"
    )
    g.add_argument("--hf-split", default=None, help="split of a saved DatasetDict")
    g.add_argument(
        "--preproc-folder",
        action="store_true",
        help="NeMo's flag; a folder given to --input is always read as JSONL files",
    )
    g.add_argument("--split-sentences", action="store_true", help=argparse.SUPPRESS)


def _tokenizer_flags(p) -> None:
    """Which tokenizer decides the ids, which library encodes, and Megatron's and NeMo's names."""
    g = p.add_argument_group("tokenizer")
    g.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="an imported checkpoint (its tokenizer, checked against the model's "
        "vocabulary), an HF tokenizer directory or a sentencepiece .model",
    )
    g.add_argument(
        "--tokenizer-type",
        help="Megatron's: HuggingFaceTokenizer, "
        "SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer (with NeMo's "
        "--tokenizer-library huggingface: the tokenizer directory)",
    )
    g.add_argument("--tokenizer-model", help="Megatron's: tokenizer directory or .model file")
    g.add_argument("--tokenizer-library", choices=["huggingface", "sentencepiece"], help="NeMo's")
    g.add_argument(
        "--tokenizer-backend",
        default="auto",
        choices=["auto", "hf", "sentencepiece", "gigatoken", "megatron"],
        help="what encodes: auto = hf (tokenizers) or sentencepiece; gigatoken is "
        "faster and checked against Megatron's tokenizer; megatron is the reference "
        "itself, one document at a time",
    )
    g.add_argument(
        "--tokenizer-hf-no-include-special-tokens",
        action="store_true",
        help="no BOS/EOS from the HF post-processor (megatron-core 0.15/0.16's default)",
    )
    g.add_argument(
        "--tokenizer-hf-no-use-fast",
        action="store_true",
        help="load the slow transformers tokenizer (megatron-core 0.15/0.16's default)",
    )
    g.add_argument(
        "--recheck-tokenizer",
        action="store_true",
        help="load Megatron's tokenizer in this run and check the backend on the head of this "
        "corpus too, not only on the probes; by default a run starts from the record an "
        "earlier run made of the same tokenizer files, settings and library versions (in "
        "$PORTING_CACHE_DIR/tokenizers, default ~/.cache/porting/tokenizers), importing neither "
        "megatron.core nor transformers",
    )


def _output_flags(p) -> None:
    """Where the .bin/.idx pairs go and what each document ends with."""
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", help="output path without suffix")
    g.add_argument(
        "--append-eod",
        action="store_true",
        help="append EOD (the tokenizer's EOS) to every non-empty document",
    )
    g.add_argument("--dataset-impl", choices=["mmap"], default="mmap", help="NeMo's; only mmap")
    g.add_argument("--overwrite", action="store_true", help="replace existing outputs")


def _runtime_flags(p) -> None:
    """Where and how the tokenizing runs (the executors' own flags included), and what a bad
    record does."""
    g = p.add_argument_group("runtime")
    g.add_argument(
        "--workers",
        type=int,
        default=None,
        help="tokenizing processes (default 1; with --executor ray: units at once, default the "
        "cluster's CPUs)",
    )
    g.add_argument(
        "--executor",
        choices=list(EXECUTORS),
        default="local",
        help="; ".join(f"{e.name}: {e.help}" for e in EXECUTORS.values()),
    )
    for flag in executor_flags():
        flag.add_to(g)
    g.add_argument(
        "--on-error",
        choices=["fail", "skip"],
        default="fail",
        help="a bad record stops the run at its file:line (fail) or is skipped and "
        "listed in the report (skip)",
    )
    g.add_argument(
        "--keep-empty",
        action="store_true",
        help='keep "text": "" as an empty '
        "document, as preprocess_data.py does, instead of treating it as an error",
    )
    g.add_argument(
        "--allow-empty",
        action="store_true",
        help="write an empty dataset when no record is kept (by default that run fails: every "
        "record skipped, or inputs with none, is a wrong input)",
    )
    g.add_argument(
        "--no-provenance",
        action="store_true",
        help="write no PREFIX.prov sidecar (by default one beside each .bin/.idx maps every "
        "document to its file, line or row, byte offset and text hash; `inspect --doc N` reads it)",
    )
    g.add_argument("--resume", action="store_true", help="continue an interrupted run")
    g.add_argument("--chunk-mb", type=float, default=4.0, help="input per work unit (MiB)")
    g.add_argument(
        "--max-record-bytes",
        type=int,
        default=MAX_RECORD_BYTES,
        metavar="N",
        help="a longer JSONL line (or dataset row) is a record_too_large problem, handled by "
        f"--on-error; measured without reading it (default {MAX_RECORD_BYTES}, 64 MiB)",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--json", action="store_true", help="print the report as JSON")


def _merge_actions(actions) -> None:
    """``merge``, and the two steps an emitted Slurm job runs (``run-unit``, ``finish``)."""
    m = actions.add_parser("merge", help="merge .bin/.idx pairs (as merge_datasets.py)")
    m.add_argument("prefixes", nargs="*", help="prefixes to merge, in this order")
    m.add_argument(
        "--input",
        dest="merge_dir",
        help="a directory: merge every pair in it, sorted (merge_datasets.py's --input)",
    )
    m.add_argument("--output-prefix", dest="merge_out", required=True)
    m.add_argument("--overwrite", dest="merge_overwrite", action="store_true")
    m.set_defaults(func=run_merge)
    u = actions.add_parser("run-unit", help="one unit of an emitted slurm job")
    u.add_argument("--job", dest="job_file", required=True, help="the emitted job.json")
    u.add_argument("--unit", dest="unit_index", type=int, required=True)
    u.set_defaults(func=run_unit)
    f = actions.add_parser("finish", help="merge the units of an emitted slurm job")
    f.add_argument("--job", dest="job_file", required=True, help="the emitted job.json")
    f.add_argument("--json", dest="finish_json", action="store_true")
    f.set_defaults(func=run_finish)


def _status_action(actions) -> None:
    """``status``: where a submitted Slurm job stands."""
    st = actions.add_parser(
        "status",
        help="where a submitted slurm job stands (exit 0 done, 3 still going, 2 failed)",
        description="Where the job that `prep-data --executor slurm` submitted from DIR stands: "
        "units done, the tasks' states, and for a failed task its log. Exit 0 when the dataset "
        "is written, 3 while the job is queued or running, 2 when it failed (named, with its log).",
    )
    st.add_argument("--job", dest="job_file", required=True, help="DIR/job.json")
    st.add_argument(
        "--wait", dest="status_wait", action="store_true", help="follow it to the end, with a bar"
    )
    st.set_defaults(func=run_status)


def _blend_action(actions) -> None:
    """``blend``: the weighted ``--data`` blend of prepared corpora."""
    b = actions.add_parser(
        "blend",
        help="the weighted --data blend of prepared corpora from their token counts and shares",
        description="The weighted blend of prepared corpora for `porting train --data` (and "
        "Megatron's --data-path): each corpus's weight is its share of the training tokens. "
        "PREFIX=0.3 or PREFIX=30%% fixes a share; corpora given without one split the rest in "
        "proportion to their token counts (all without: each as much as it has). Corpora "
        "written with different tokenizers are refused.",
    )
    b.add_argument("corpora", nargs="+", metavar="PREFIX[=SHARE]")
    b.add_argument(
        "--train-tokens",
        type=_token_count,
        metavar="N",
        help="tokens the run will train on (1e9, 300M, 2B): each corpus's epochs, flagged past "
        f"{EPOCHS_FLAGGED:g}",
    )
    b.add_argument(
        "--out",
        dest="blend_out",
        type=Path,
        help="also write the blend to this file, as Megatron's --data-args-path reads it",
    )
    b.add_argument("--overwrite", dest="blend_overwrite", action="store_true")
    b.add_argument("--json", dest="blend_json", action="store_true")
    b.set_defaults(func=run_blend)


def _inspect_action(actions) -> None:
    """``inspect``: counts, the first documents, one document and its source."""
    i = actions.add_parser("inspect", help="counts and the first documents decoded")
    i.add_argument("prefix", help="e.g. out/corpus_text_document")
    i.add_argument(
        "--tokenizer",
        dest="inspect_tokenizer",
        help="default: the one in the prep-data report beside the prefix",
    )
    i.add_argument("--docs", type=int, default=3, help="how many first documents to show")
    i.add_argument(
        "--doc",
        type=int,
        metavar="N",
        help="document N (0-based): its ids decoded, and where it came from (the .prov sidecar), "
        "checked against that source as it is now",
    )
    i.add_argument("--max-tokens", type=int, default=64)
    i.add_argument("--json", dest="inspect_json", action="store_true")
    i.set_defaults(func=run_inspect)


def _quieted(args):
    """merge and inspect import megatron.core in this process; its import-time notices (CUDA,
    Apex, deprecations) say nothing about the user's data, so only ``-v`` shows them."""
    from data_prep.tokenizer import third_party_quieted

    return contextlib.nullcontext() if getattr(args, "verbose", False) else third_party_quieted()


def run_prep(args) -> int:
    """``porting prep-data``."""
    from data_prep.run import prepare
    from data_prep.tokenizer import resolve

    if args.split_sentences:
        raise PortingError("--split-sentences (NLTK sentence splitting) is not supported")
    if not args.input or not args.output_prefix:
        raise PortingError("--input and --output-prefix are required")
    source = resolve(
        args.tokenizer, args.tokenizer_type, args.tokenizer_model, args.tokenizer_library
    )
    cfg = PrepConfig(
        inputs=args.input,
        output_prefix=args.output_prefix,
        tokenizer=source,
        json_keys=tuple(args.json_keys),
        append_eod=args.append_eod,
        workers=args.workers,
        include_special_tokens=not args.tokenizer_hf_no_include_special_tokens,
        use_fast=not args.tokenizer_hf_no_use_fast,
        backend=args.tokenizer_backend,
        recheck_tokenizer=args.recheck_tokenizer,
        on_error=args.on_error,
        keep_empty=args.keep_empty,
        provenance=not args.no_provenance,
        allow_empty=args.allow_empty,
        resume=args.resume,
        overwrite=args.overwrite,
        chunk_bytes=max(1, int(args.chunk_mb * (1 << 20))),
        split=args.hf_split,
        show_progress=not args.no_progress,
        max_record_bytes=args.max_record_bytes,
        executor=args.executor,
        **{flag.field: flag.value(args) for flag in executor_flags()},
    )
    report = prepare(cfg)
    summary = EXECUTORS[args.executor].summary(report)
    if summary is not None:
        print(summary)
        return 0
    try:
        _print_report(args, report)
    except (KeyboardInterrupt, Terminated) as stop:
        stop.kept = f"outputs complete, report {args.output_prefix}.prep-report.json"
        raise
    return 0


def _pair(out: dict) -> str:
    """An output's files as the closing lines name them: its pair, and its sidecar if written."""
    return f"{out['prefix']}.{'bin/.idx/.prov' if out.get('provenance') else 'bin/.idx'}"


def _print_report(args, report: dict) -> None:
    if args.json:
        print(json.dumps(report, indent=2, ensure_ascii=False))
        return
    t = report["time"]
    for key, out in report["outputs"].items():
        print(
            f"{_pair(out)}  {key}: {out['documents']} documents, {out['tokens']} tokens "
            f"({out['empty_documents']} empty)"
        )
    print(
        f"records {report['records']}, skipped {report['skipped']}"
        + (f" {report['problems']}" if report["problems"] else "")
        + (
            f" ({report['skipped_not_listed']} beyond the first 100 of a kind counted, not listed)"
            if report.get("skipped_not_listed")
            else ""
        )
    )
    ckpt = report["tokenizer"].get("checkpoint")
    if ckpt:
        print(
            f"checkpoint {ckpt['path']}: every id < {ckpt['vocab_size']} (HF vocab_size; padded "
            f"to {ckpt['padded_vocab_size']}), "
            f"EOD {report['tokenizer']['eod']} (model eos_token_id {ckpt['eos_token_id']})"
        )
    lossy = report["lossiness"]
    print(
        f"tokenizer {report['tokenizer']['path']} ({report['tokenizer']['backend']}, "
        f"{report['tokenizer']['dtype']}); decode(encode(text)) != text on "
        f"{lossy['differing']}/{lossy['sampled_documents']} sampled documents"
    )
    if lossy["example"]:
        ex = lossy["example"]
        print(f"  e.g. {ex['text'][:60]!r} -> {ex['decoded'][:60]!r}")
    per_core = f" ({t['tokens_per_cpu_s'] / 1e6:.2f} per core)" if t.get("tokens_per_cpu_s") else ""
    print(
        f"{t['seconds']:.1f} s, {t['bytes_per_s'] / 1e6:.1f} MB/s, "
        f"{t['tokens_per_s'] / 1e6:.2f} Mtok/s{per_core}; report "
        f"{args.output_prefix}.prep-report.json"
    )


def run_unit(args) -> int:
    """``porting prep-data run-unit``."""
    from data_prep import slurm

    s = slurm.run_unit(args.job_file, args.unit_index)
    print(f"unit {args.unit_index}: {s['lines']} lines, {s['seconds']:.1f} s")
    return 0


def run_finish(args) -> int:
    """``porting prep-data finish``."""
    from data_prep import slurm

    with _quieted(args):
        report = slurm.finish(args.job_file)
    if args.finish_json:
        print(json.dumps(report, indent=2, ensure_ascii=False))
    else:
        for key, out in report["outputs"].items():
            print(f"{_pair(out)}  {key}: {out['documents']} documents")
    return 0


def run_status(args) -> int:
    """``porting prep-data status``."""
    from data_prep import slurm

    directory = Path(args.job_file).parent
    if args.status_wait:
        report = slurm.follow(directory, show_progress=sys.stderr.isatty())
        for key, out in report["outputs"].items():
            print(f"{_pair(out)}  {key}: {out['documents']} documents")
        return 0
    now = slurm.progress(directory)
    if now.failed:
        raise PortingError(now.failed)
    print(f"{now.done}/{now.total} units done; {now.line}")
    return 0 if now.finished else 3


def run_merge(args) -> int:
    """``porting prep-data merge``."""
    from data_prep.merge import merge, prefixes_in

    if bool(args.merge_dir) == bool(args.prefixes):
        raise PortingError("give either prefixes or --input DIR")
    prefixes = prefixes_in(args.merge_dir) if args.merge_dir else args.prefixes
    with _quieted(args):
        out = merge(
            prefixes, args.merge_out, overwrite=args.merge_overwrite, input_dir=args.merge_dir
        )
    print(
        f"{out['output_prefix']}.bin/.idx: {out['documents']} documents, {out['sequences']} "
        f"sequences ({out['dtype']}) from {len(prefixes)} inputs"
    )
    if out["provenance"]:
        unknown = out["provenance_unknown"]
        print(
            f"provenance {out['provenance']}"
            + (
                f"; without a sidecar, known by their number: {', '.join(unknown)}"
                if unknown
                else ""
            )
        )
    return 0


def _token_count(text: str) -> float:
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
    t = text.strip().upper()
    try:
        n = float(t[:-1]) * scale[t[-1]] if t and t[-1] in scale else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a token count (1e9, 300M, 2B)") from None
    if not n > 0 or n != n or n == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: a positive token count")
    return n


def run_blend(args) -> int:
    """``porting prep-data blend``."""
    from data_prep.blend import blend
    from data_prep.report import write_text_atomic

    out = blend(args.corpora, args.train_tokens)
    line = " ".join(out["data"])
    if args.blend_out is not None:
        if args.blend_out.exists() and not args.blend_overwrite:
            raise PortingError(f"{args.blend_out} exists; pass --overwrite to replace it")
        write_text_atomic(args.blend_out, line + "\n")
    if args.blend_json:
        print(json.dumps(out, indent=2, ensure_ascii=False))
    else:
        drawn = out["train_tokens"] is not None
        print(
            "| corpus | documents | tokens | share |"
            + (" tokens drawn | epochs |" if drawn else "")
        )
        print("|---|---:|---:|---:|" + ("---:|---:|" if drawn else ""))
        for r in out["corpora"]:
            cells = [r["prefix"], f"{r['documents']:,}", f"{r['tokens']:,}",
                     f"{100 * r['share']:.2f}%{'' if r['given'] else ' (by tokens)'}"]  # fmt: skip
            if drawn:
                cells += [f"{r['train_tokens']:,.0f}", f"{r['epochs']:.2f}"]
            print("| " + " | ".join(cells) + " |")
        print(f"--data {line}")
    for r in out["corpora"]:
        if r.get("flagged"):
            log.warning(
                "%s: %.1f epochs of it in %s training tokens (repeats lose value past about %g)",
                r["prefix"], r["epochs"], f"{out['train_tokens']:,.0f}", EPOCHS_FLAGGED,
            )  # fmt: skip
    for prefix in out["tokenizer_unknown"]:
        if out["tokenizer"] is not None:
            log.warning(
                "%s: no prep-data report beside it, so its tokenizer is not checked", prefix
            )
    if args.blend_out is not None:
        print(f"wrote {args.blend_out} (Megatron's --data-args-path)")
    return 0


def run_inspect(args) -> int:
    """``porting prep-data inspect``."""
    from data_prep.inspection import inspect_dataset
    from data_prep.tokenizer import resolve

    tok = resolve(args.inspect_tokenizer) if args.inspect_tokenizer else None
    with _quieted(args):
        info = inspect_dataset(
            args.prefix, tok, n_docs=args.docs, max_tokens=args.max_tokens, doc=args.doc
        )
    if args.inspect_json:
        print(json.dumps(info, indent=2, ensure_ascii=False))
        return 0
    print(
        f"{info['prefix']}: {info['documents']} documents ({info['empty_documents']} empty), "
        f"{info['sequences']} sequences, {info['tokens']} tokens, {info['dtype']}, "
        f"{info['bin_bytes']} bytes"
    )
    dt = info["document_tokens"]
    print(f"tokens per document: min {dt['min']}, mean {dt['mean']}, max {dt['max']}")
    if "eod" in info:
        print(f"EOD {info['eod']}: ends {info['documents_ending_in_eod']} non-empty documents")
    prov = info["provenance"]
    if prov:
        print(f"provenance {prov['path']}: {prov['sources']} source(s)")
    for doc in info["first_documents"]:
        print(f"--- document {doc['document']} ({doc['tokens']} tokens) ids {doc['ids'][:16]}")
        if "text" in doc:
            sys.stdout.write(doc["text"] + "\n")
        origin = doc.get("origin")
        if origin:
            unit = "row" if "row" in origin else "line" if "line" in origin else "document"
            at = f" (byte {origin['offset']})" if origin["offset"] is not None else ""
            print(f"from {origin['file']} {unit} {origin[unit]}{at}, text hash {origin['hash']}")
            print(f"source now: {origin['source_now']}")
            if "ids_match_source" in origin:
                print(
                    f"Megatron's ids of the source text {'are' if origin['ids_match_source'] else 'are NOT'} "
                    f"this document's; decoded, it {'is' if origin['decodes_to_source'] else 'is not'} "
                    "the source text"
                )
    return 0
