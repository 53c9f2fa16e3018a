"""``porting import``, ``verify``, ``export`` and ``demo``: thin wrappers over library functions."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path


def _offline() -> None:
    # Nothing we run may reach a hub: every model and tokenizer is a local directory.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _quiet_nemo(args) -> None:
    """Keep NeMo's own INFO narration (one line per setup step) out of conversion output."""
    if not args.verbose:
        from nemo.utils import logging as nemo_logging

        nemo_logging.setLevel(logging.WARNING)


def _add_gate_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--atol", type=float, default=None, help="parity: absolute logit tolerance (1e-4)"
    )
    p.add_argument(
        "--rtol", type=float, default=None, help="parity: relative logit tolerance (1e-4)"
    )


def register(sub: argparse._SubParsersAction) -> None:
    """Add the conversion subcommands."""
    p = sub.add_parser(
        "import",
        help="convert a Hugging Face model directory into a NeMo 2.0 checkpoint",
        description="Convert an HF model directory (config.json, *.safetensors, tokenizer) into a "
        "NeMo 2.0 checkpoint. The family is found from config.json's architectures[0]. The result "
        "is checked for full-logit parity against the HF model before it appears under --out; a "
        "failed check exits non-zero and leaves nothing there.",
    )
    p.add_argument("hf_dir", type=Path, help="Hugging Face model directory")
    p.add_argument("--out", type=Path, required=True, help="NeMo checkpoint directory to create")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--no-verify", action="store_true", help="skip the parity gate")
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
    _add_gate_flags(p)
    p.set_defaults(func=_cmd_import)

    p = sub.add_parser(
        "verify",
        help="full-logit parity of an HF model against a NeMo checkpoint",
        description="Run fixed prompts (several lengths, every position) through the HF model and "
        "the Megatron model of the checkpoint and compare full logits: max and mean |dlogit|, "
        "KL(HF || Megatron), top-1 agreement. Exits 1 when the gate fails.",
    )
    p.add_argument("hf_dir", type=Path)
    p.add_argument("ckpt", type=Path)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--min-top1", type=float, default=None, help="minimum top-1 agreement (0.999)")
    _add_gate_flags(p)
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser(
        "export",
        help="convert a checkpoint made by `porting import` back to a Hugging Face directory",
        description="Write an HF directory (config.json, safetensors shards, tokenizer) from a "
        "NeMo checkpoint made by `porting import` (or trained from one). Everything needed is in "
        "the checkpoint. The result is parity-checked against the checkpoint before it appears.",
    )
    p.add_argument("ckpt", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--no-verify", action="store_true", help="skip the parity gate")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser(
        "demo",
        help="end to end on a tiny built-in model: build, import, verify, export, round trip",
        description="Build a tiny random tsuzumi-style (Llama layout) HF checkpoint locally, import "
        "it, verify parity, export it back and check the round trip; prints a short table.",
    )
    p.add_argument("--workdir", type=Path, default=Path("demo-out"))
    p.set_defaults(func=_cmd_demo)


def _print_report(report, as_json: bool) -> None:
    if report is None:
        return
    if as_json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(report.summary())


def _cmd_import(args) -> int:
    _offline()
    from porting.convert import import_hf

    _quiet_nemo(args)

    report = import_hf(
        args.hf_dir,
        args.out,
        overwrite=args.overwrite,
        dtype=args.dtype,
        allow_pickle=args.allow_pickle,
        vocab_divisor=args.vocab_divisible_by,
        verify=not args.no_verify,
        atol=args.atol,
        rtol=args.rtol,
        show_progress=sys.stderr.isatty(),
    )
    _print_report(report, args.json)
    if not args.json:
        print(f"wrote {args.out}")
    return 0


def _cmd_verify(args) -> int:
    _offline()
    from porting import parity

    _quiet_nemo(args)

    kwargs = {
        k: v
        for k, v in (("atol", args.atol), ("rtol", args.rtol), ("min_top1", args.min_top1))
        if v is not None
    }
    report = parity.verify(args.hf_dir, args.ckpt, **kwargs)
    _print_report(report, args.json)
    return 0 if report.passed else 1


def _cmd_export(args) -> int:
    _offline()
    from porting.convert import export_hf

    _quiet_nemo(args)

    report = export_hf(
        args.ckpt,
        args.out,
        overwrite=args.overwrite,
        verify=not args.no_verify,
        max_shard_bytes=int(args.max_shard_gb * 2**30),
    )
    _print_report(report, args.json)
    if not args.json:
        print(f"wrote {args.out}")
    return 0


def _cmd_demo(args) -> int:
    _offline()
    from porting.demo import run_demo

    _quiet_nemo(args)

    return run_demo(args.workdir)
