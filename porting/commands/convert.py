"""``porting import`` and ``porting export``: thin wrappers over :mod:`porting.api`."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from porting import guard, quiet
from porting.commands.verify import add_gate_flags, print_report
from porting.convert import executors
from porting.convert.executors import add_launch_flags
from porting.convert.foreign import add_source_flags, source_inputs
from porting.convert.layouts.registry import NAMES
from porting.errors import PortingError


def register(sub: argparse._SubParsersAction) -> None:
    """Add the conversion subcommands."""
    _register_import(sub)
    _register_export(sub)
    _register_convert(sub)


def _register_import(sub) -> None:
    """``import``: HF -> a checkpoint in one of the three layouts, gated."""
    p = sub.add_parser(
        "import",
        help="convert a Hugging Face model directory into a NeMo 2.0 checkpoint",
        description="Convert an HF model directory (config.json, *.safetensors, tokenizer) into a "
        "NeMo 2.0 checkpoint. The family is found from config.json's architectures[0] (or its "
        "model_type) among the installed families (`porting families`). The result "
        "is checked for full-logit parity against the HF model before it appears under --out; a "
        "failed check exits non-zero and leaves nothing there.",
    )
    p.add_argument("hf_dir", type=Path, help="Hugging Face model directory")
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory to create")
    p.add_argument(
        "--format",
        dest="fmt",
        choices=NAMES,
        default="nemo2",
        help="layout to write (docs/formats.md): nemo2 (context/ + weights/, for NeMo 2.0), "
        "megatron-lm (iter_0000000/ with the model's arguments in common.pt, for Megatron-LM's "
        "--load), megatron-bridge (the same plus run_config.yaml, for Megatron-Bridge). "
        "Default: nemo2",
    )
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--no-verify", action="store_true", help="skip the parity gate")
    p.add_argument(
        "--family",
        metavar="NAME",
        help="the installed family to convert with (default: the one claiming config.json's "
        "architecture); it must claim the checkpoint's architecture or model type",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="weight dtype of the checkpoint (default: the HF checkpoint's own)",
    )
    p.add_argument(
        "--vocab-divisible-by",
        type=int,
        default=128,
        help="pad the vocabulary to a multiple of this (Megatron's make_vocab_size_divisible_by)",
    )
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="read pytorch_model*.bin when no safetensors exist (torch.load weights_only=True)",
    )
    p.add_argument("--json", action="store_true", help="print the parity report as JSON")
    add_gate_flags(p)
    add_launch_flags(p)
    p.set_defaults(func=_cmd_import)


def _register_export(sub) -> None:
    """``export``: a checkpoint of any layout -> HF, gated."""
    p = sub.add_parser(
        "export",
        help="convert a NeMo 2, Megatron-LM or Megatron-Bridge checkpoint to a Hugging Face "
        "directory",
        description="Write an HF directory (config.json, safetensors shards, tokenizer) from a "
        "checkpoint in any of the three layouts (docs/formats.md), found from the directory. "
        "Everything needed is in a checkpoint made by `porting import` (or trained from one); "
        "for a Megatron-LM or Megatron-Bridge checkpoint trained elsewhere, give the HF config "
        "of its architecture with --hf-config. The result is parity-checked against the "
        "checkpoint before it appears.",
    )
    p.add_argument("ckpt", type=Path, help="checkpoint root (or one iter_NNNNNNN directory)")
    p.add_argument("--out", type=Path, required=True, help="HF directory to create")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--no-verify", action="store_true", help="skip the parity gate")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size")
    p.add_argument(
        "--quantize",
        choices=["fp8-block"],
        help="write the Linear weights as FP8 (e4m3) with a float32 weight_scale_inv per 128x128 "
        "block and config.json's quantization_config, as DeepSeek-V3 and the FP8 Qwen3 releases "
        "ship them (the parity gate runs on the unquantized weights first). Default: the "
        "checkpoint's dtype, without a quantization_config",
    )
    p.add_argument(
        "--hf-layout",
        choices=["as-imported", "published", "stacked"],
        default="as-imported",
        help="a mixture of experts' tensors: one per expert under the names the model was "
        "published with (published), or each layer's experts in one gate_up_proj and one "
        "down_proj as transformers 5 saves them with save_original_format=False (stacked; "
        "Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2 and V3). Default: the form the import read",
    )
    add_source_flags(p)
    p.add_argument("--json", action="store_true", help="print the parity report as JSON")
    add_gate_flags(p)
    add_launch_flags(p)
    p.set_defaults(func=_cmd_export)


def _register_convert(sub) -> None:
    """``convert``: between the layouts (or from HF), each step gated."""
    p = sub.add_parser(
        "convert",
        help="convert between NeMo 2, Megatron-LM and Megatron-Bridge checkpoints (or from HF)",
        description="Write SRC (an HF model directory, or a checkpoint in any of the three "
        "layouts, found from the directory) as a checkpoint in the layout --to. Between "
        "checkpoints, SRC is exported to an HF directory beside --out and that is imported: both "
        "steps streamed (memory of one tensor and one layer) and parity-gated, the round trip "
        "exact. Model weights, tokenizer and our manifest are carried; optimizer and train state "
        "are not (docs/formats.md). Nothing appears under --out unless every step passes.",
    )
    p.add_argument("src", type=Path, help="HF directory or checkpoint root")
    p.add_argument("--to", required=True, choices=NAMES, help="layout to write")
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory to create")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--no-verify", action="store_true", help="skip the parity gates")
    p.add_argument("--json", action="store_true", help="print the parity reports as one JSON list")
    add_gate_flags(p)
    add_source_flags(p)
    p.set_defaults(func=_cmd_convert)


def _launched(args, command: str, what: str, reads, refuse_early=None, before_ranks=None) -> int:
    """The launcher's side of ``--executor torchrun|slurm``: the same refusals as one process,
    the output claimed here, the ranks run into its staging directory (porting.convert.ranks).
    ``before_ranks``: checks that take seconds, made once the output is claimed (a second run on
    it is refused at once) and before any rank starts."""
    from porting.convert.checkpoint import claimed_output

    executors.check_launch_flags(args)
    quiet.offline()
    guard.check_outputs(reads, writes=[("--out", args.out)])
    if refuse_early is not None:
        refuse_early()
    with claimed_output(args.out, args.overwrite, what) as tmp:
        if before_ranks is not None:
            before_ranks()
        said, _ = executors.launch(args, command, tmp)
    sys.stdout.write(said)
    if not args.json:
        print(f"wrote {args.out} ({executors.described(args)})")
    return 0


@contextlib.contextmanager
def _converting(args, reads, what: str, refuse_early=None) -> Iterator[str]:
    """The prologue the three conversions share, ordered so that a refusal needing no model
    answers at once (no torch, NeMo or Megatron imported before it). Yields the gate's device.

    Offline; freed memory given back to the OS; the outputs checked against the inputs;
    ``refuse_early`` (the HF directory and its config: a missing directory, an unknown
    architecture, a bad value), then an output that exists without ``--overwrite``; the output
    locked before Megatron's import (seconds), so that a second run on it fails at once; this
    process's GPUs hidden (conversion is host work; a device gate runs in a child that sees them);
    NeMo's own narration quieted where a family without a NeMo-free config loaded it.
    """
    from porting.convert import ranks
    from porting.convert.checkpoint import prepare_output

    ranks.refuse_hand_launched(args.command)
    quiet.offline()
    guard.return_freed_memory()
    guard.check_outputs(reads, writes=[("--out", args.out)])
    if refuse_early is not None:
        refuse_early()
    prepare_output(args.out, args.overwrite)
    with guard.output_lock(args.out, what):
        from porting import cpu
        from porting.commands.verify import resolve_device

        device = resolve_device(args.device)
        cpu.hide_gpus()
        import porting.api  # noqa: F401

        quiet.quiet_nemo(load=False)
        guard.keep_loaded_out_of_collections()
        yield device


def _cmd_import(args) -> int:
    from porting.convert import ranks
    from porting.convert.hf_files import open_hf

    reads = [("HF directory", args.hf_dir)]
    opened = {}  # the HF directory, read once by the early refusal and handed to the import

    def early() -> None:
        opened["hf"] = open_hf(args.hf_dir, args.family)

    if executors.executor(args).starts_ranks:
        return _launched(
            args, "import", "checkpoint", reads, early, lambda: _weights_readable(args)
        )
    if ranks.staging() is not None:
        return _import_rank(args)
    with _converting(args, reads, "checkpoint", early) as device:
        from porting.api import import_hf

        report = import_hf(
            opened.get("hf", args.hf_dir),
            args.out,
            **_import_options(args),
            whole_model=args.whole_model,
            show_progress=sys.stderr.isatty(),
            device=device,
        )
    print_report(report, args.json)
    if not args.json:
        print(f"wrote {args.out}")
    return 0


def _weights_readable(args) -> None:
    """A launched import's weight files (the index, every shard it names, every header), read
    by the launcher: a checkpoint the ranks would refuse is refused before they pay their
    start-up (Megatron-Core's, each). Pickle weights are left to the ranks: reading them means loading
    them whole."""
    if not args.allow_pickle:
        from porting.convert.safetensors_io import SafetensorsSource

        SafetensorsSource(args.hf_dir).close()


def _import_options(args) -> dict:
    """What ``porting import``'s flags ask of :func:`porting.api.import_hf`, in one process or
    in each rank of a launched import."""
    return dict(
        overwrite=args.overwrite,
        dtype=args.dtype,
        allow_pickle=args.allow_pickle,
        vocab_divisor=args.vocab_divisible_by,
        verify=not args.no_verify,
        atol=args.atol,
        rtol=args.rtol,
        family=args.family,
        fmt=args.fmt,
    )


def _import_rank(args) -> int:
    """One rank of a launched import: the launcher holds the output and its lock."""
    return _in_rank(
        args,
        lambda api: api.import_hf(
            args.hf_dir, args.out, **_import_options(args), show_progress=False
        ),
    )


def _export_options(args) -> dict:
    """What ``porting export``'s flags ask of :func:`porting.api.export_hf` (one process or a
    rank)."""
    return dict(
        overwrite=args.overwrite,
        verify=not args.no_verify,
        max_shard_bytes=int(args.max_shard_gb * 2**30),
        atol=args.atol,
        rtol=args.rtol,
        quantize=args.quantize,
        hf_layout=args.hf_layout,
    )


def _export_rank(args) -> int:
    """One rank of a launched export: the launcher holds the output and its lock."""
    from porting.convert.foreign import reading

    def run(api):
        with reading(args.ckpt, args.src_format, args.hf_config, args.tokenizer):
            return api.export_hf(args.ckpt, args.out, **_export_options(args), show_progress=False)

    return _in_rank(args, run)


def _in_rank(args, run) -> int:
    """A rank's prologue (offline, no GPU: the ranks gate on the CPU), ``run(porting.api)``,
    and rank 0's report left for the launcher."""
    from porting import cpu

    quiet.offline()
    cpu.hide_gpus()
    import porting.api as api

    _leave_report(run(api), args)
    return 0


def _leave_report(report, args) -> None:
    """Rank 0 of a launched conversion leaves its report for the launcher to print."""
    import io

    from porting.convert import ranks

    if ranks.rank() == 0:
        said = io.StringIO()
        if report is not None:
            with contextlib.redirect_stdout(said):
                print_report(report, args.json)
        ranks.leave_report(said.getvalue())


def _open_early(args, ckpt) -> None:
    """Refuse, before NeMo loads, a checkpoint that is not one or whose manifest does not read. One
    trained elsewhere (``--hf-config``) is adopted by the conversion itself: that reads its
    tokenizer through transformers."""
    from porting.convert.checkpoint import open_checkpoint
    from porting.convert.foreign import reading

    if args.hf_config is None:
        with reading(ckpt, args.src_format, None, args.tokenizer):
            open_checkpoint(ckpt)


def _refuse_source_early(args) -> None:
    from porting.convert.hf_files import family_for_hf_dir
    from porting.convert.layouts.registry import is_hf_dir

    if not is_hf_dir(args.src):
        _open_early(args, args.src)
        return
    if args.hf_config or args.tokenizer or args.src_format:
        raise PortingError(
            f"{args.src}: an HF directory; --format, --hf-config and --tokenizer are for checkpoints"
        )
    family_for_hf_dir(args.src)


def _cmd_export(args) -> int:
    from porting.convert import ranks

    reads = source_inputs("checkpoint", args.ckpt, args)
    early = lambda: _open_early(args, args.ckpt)  # noqa: E731
    if executors.executor(args).starts_ranks:
        return _launched(args, "export", "HF directory", reads, early)
    if ranks.staging() is not None:
        return _export_rank(args)
    with _converting(args, reads, "HF directory", early) as device:
        from porting.api import export_hf
        from porting.convert.foreign import reading

        with reading(args.ckpt, args.src_format, args.hf_config, args.tokenizer):
            report = export_hf(
                args.ckpt,
                args.out,
                **_export_options(args),
                whole_model=args.whole_model,
                show_progress=sys.stderr.isatty(),
                device=device,
            )
    print_report(report, args.json)
    if not args.json:
        print(f"wrote {args.out}")
    return 0


def _cmd_convert(args) -> int:
    reads = source_inputs("source", args.src, args)
    with _converting(args, reads, "checkpoint", lambda: _refuse_source_early(args)) as device:
        from porting.api import convert
        from porting.convert.foreign import reading
        from porting.convert.layouts.registry import is_hf_dir

        if is_hf_dir(args.src):
            context = contextlib.nullcontext()
        else:
            context = reading(args.src, args.src_format, args.hf_config, args.tokenizer)
        with context:
            reports = convert(
                args.src,
                args.out,
                args.to,
                overwrite=args.overwrite,
                verify=not args.no_verify,
                show_progress=sys.stderr.isatty(),
                device=device,
                atol=args.atol,
                rtol=args.rtol,
            )
    if args.json:  # one document: the export's report, then the import's
        print(json.dumps([r.as_dict() for r in reports], indent=2, allow_nan=False))
        return 0
    steps = [f"import ({args.src} -> {args.to})"]
    if len(reports) == 2:
        steps = [f"export ({args.src} -> HF)", f"import (HF -> {args.to})"]
    for step, report in zip(steps, reports, strict=False):
        print(f"{step}:")
        print_report(report, False)
    print(f"wrote {args.out}")
    return 0
