"""``porting verify``: the parity check of an HF model against a checkpoint, as a command."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from porting import guard, quiet


def add_gate_flags(p: argparse.ArgumentParser) -> None:
    """The gate's mode and tolerances, shared by ``verify`` and the gated ``import``."""
    p.add_argument(
        "--whole-model",
        action="store_true",
        help="load both models whole instead of streaming them layer by layer (small models; "
        "about 8 bytes per parameter of RAM)",
    )
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where the gate's layers compute: fp32 on the CPU, or streamed one at a time to a "
        "CUDA device (fp32, TF32 off; falls back to the CPU, saying so, if it runs out of "
        "memory). auto: cuda when a device is visible",
    )
    p.add_argument(
        "--atol", type=float, default=None, help="parity: absolute logit tolerance (1e-4)"
    )
    p.add_argument(
        "--rtol", type=float, default=None, help="parity: relative logit tolerance (1e-4)"
    )


def resolve_device(flag: str) -> str:
    """``--device`` as ``cpu`` or ``cuda``; call before :func:`porting.cpu.hide_gpus`."""
    from porting import cpu
    from porting.errors import PortingError

    if flag == "cpu":
        return "cpu"
    visible = cpu.gpu_visible()
    if flag == "cuda" and not visible:
        raise PortingError(
            "--device cuda: no CUDA device is visible to this process (a CPU build of torch, "
            "no driver, or CUDA_VISIBLE_DEVICES empty); use --device cpu"
        )
    return "cuda" if visible else "cpu"


def print_report(report, as_json: bool) -> None:
    """Print a parity report once, as text or JSON (nothing for ``None``)."""
    if report is None:
        return
    if as_json:
        print(json.dumps(report.as_dict(), indent=2, allow_nan=False))
    else:
        print(report.summary())


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``verify`` subcommand."""
    p = sub.add_parser(
        "verify",
        help="full-logit parity of an HF model against a NeMo 2, Megatron-LM or Megatron-Bridge "
        "checkpoint",
        description="Run fixed prompts (several lengths, every position) through the HF model and "
        "the Megatron model of the checkpoint and compare full logits: max and mean |dlogit|, "
        "KL(HF || Megatron), top-1 agreement. By default two decoder layers of one side are in "
        "memory at a time (any model size), and the report gives each layer's divergence and "
        "names the first layer that diverges, then the gate's wall time against its floor (both "
        "sides' matmuls at this machine's fp32 rate, measured once and cached in "
        "~/.cache/porting). Exits 1 when the gate fails.",
    )
    p.add_argument("hf_dir", type=Path)
    p.add_argument("ckpt", type=Path, help="checkpoint root (any layout; docs/formats.md)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--min-top1", type=float, default=None, help="minimum top-1 agreement (0.999)")
    p.add_argument(
        "--plot", type=Path, metavar="FILE.png", help="draw the divergence per layer (log scale)"
    )
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="read the HF side's pytorch_model*.bin when no safetensors exist "
        "(torch.load weights_only=True)",
    )
    add_gate_flags(p)
    from porting.convert.executors import add_launch_flags
    from porting.convert.foreign import add_source_flags

    add_source_flags(p)
    add_launch_flags(p)
    p.set_defaults(func=_cmd_verify)


def _cmd_verify(args) -> int:
    from porting.convert.foreign import source_inputs
    from porting.errors import PortingError

    reads = [("HF directory", args.hf_dir), *source_inputs("checkpoint", args.ckpt, args)]
    guard.check_outputs(reads, files=[("--plot", args.plot)])
    if args.plot and args.whole_model:
        raise PortingError("--plot needs the layer-streamed check (drop --whole-model)")
    from porting.convert import executors, ranks
    from porting.convert.checkpoint import open_checkpoint
    from porting.convert.foreign import reading
    from porting.parity.pair import check_pair

    if args.hf_config is None:
        # A wrong pair answers here, before torch, NeMo or Megatron load (or ranks start). One
        # trained elsewhere is adopted through its tokenizer and config (transformers, NeMo):
        # the gate checks its pair once the process is offline with its GPUs hidden.
        with reading(args.ckpt, args.src_format, None, args.tokenizer):
            check_pair(args.hf_dir, open_checkpoint(args.ckpt))
    if executors.executor(args).starts_ranks:
        return _verify_launched(args)
    ranks.refuse_hand_launched("verify")
    quiet.offline()
    guard.return_freed_memory()
    from porting import cpu
    from porting.parity import harness

    guard.keep_loaded_out_of_collections()
    device = resolve_device(args.device)
    if device == "cpu":
        cpu.hide_gpus()
    kwargs = {
        k: v
        for k, v in (("atol", args.atol), ("rtol", args.rtol), ("min_top1", args.min_top1))
        if v is not None
    }
    with reading(args.ckpt, args.src_format, args.hf_config, args.tokenizer):
        report = harness.verify(
            args.hf_dir,
            args.ckpt,
            whole_model=args.whole_model,
            show_progress=sys.stderr.isatty(),
            allow_pickle=args.allow_pickle,
            device=device,
            **kwargs,
        )
    if ranks.staging() is None:
        _say(report, args)
    elif ranks.rank() == 0:  # the launcher prints it, and exits with its verdict
        import contextlib
        import io

        said = io.StringIO()
        with contextlib.redirect_stdout(said):
            _say(report, args)
        ranks.leave_report(said.getvalue(), report.passed)
    if ranks.staging() is not None:
        return 0
    return 0 if report.passed else 1


def _say(report, args) -> None:
    print_report(report, args.json)
    if args.plot:
        from porting.parity.plot import write_plot

        # stdout holds exactly the JSON document under --json
        print(
            f"wrote {write_plot(report, args.plot)}", file=sys.stderr if args.json else sys.stdout
        )


def _verify_launched(args) -> int:
    """``verify --executor torchrun|slurm``: the gate as a pipeline of the ranks' layers; their
    report and verdict come back through a private directory (for Slurm, in this directory,
    which every node must see)."""
    import tempfile

    from porting.convert import executors

    executors.check_launch_flags(args)
    quiet.offline()
    # ranks on other nodes write where every node sees: under this directory
    here = "." if executors.executor(args).spans_nodes else None
    with tempfile.TemporaryDirectory(prefix=".porting-verify-", dir=here) as stage:
        said, passed = executors.launch(args, "verify", Path(stage).absolute())
    sys.stdout.write(said)
    return 0 if passed else 1
