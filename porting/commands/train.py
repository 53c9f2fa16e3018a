"""``porting train``: continued pretraining from an imported checkpoint (see :mod:`porting.train.recipe`)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import sys
from pathlib import Path

from porting import guard, quiet
from porting.errors import PortingError
from porting.train import stop
from porting.train.executors import EXECUTORS


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``train`` subcommand."""
    p = sub.add_parser(
        "train",
        help="continue pretraining an imported checkpoint on prepared .bin/.idx data",
        description="Continue pretraining a checkpoint made by `porting import` with NeMo 2.0 / "
        "Megatron-Core (tensor, pipeline, data, sequence parallel; bf16 on GPUs, fp32 on the "
        "CPU). Checkpoints go to OUT/checkpoints (OUT/checkpoints/last links the newest), logs "
        "to OUT/tb (TensorBoard) and OUT/csv/metrics.csv. Re-running the same command resumes "
        "an interrupted run from its last checkpoint. Export a result with "
        "`porting export OUT/checkpoints/last --out DIR`.",
    )
    _run_flags(p)
    _parallel_flags(p)
    _schedule_flags(p)
    _validation_flags(p)
    _layout_flags(p)
    _launch_flags(p)
    p.set_defaults(func=_cmd_train)


def _run_flags(p) -> None:
    """The checkpoint, the data and the run directory."""
    p.add_argument(
        "--checkpoint", type=Path, required=True, help="checkpoint from `porting import`"
    )
    p.add_argument(
        "--data",
        nargs="+",
        required=True,
        help="dataset prefixes (PREFIX for PREFIX.bin/.idx), or a blend W1 PREFIX1 W2 PREFIX2 ...",
    )
    p.add_argument("--out", type=Path, required=True, help="run directory")


def _parallel_flags(p) -> None:
    """How one model is split: tensor, pipeline, context and expert parallel."""
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--vp", type=int, default=None, help="virtual pipeline stages per rank")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size")
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel size (mixture-of-experts models): experts spread over this many ranks",
    )
    p.add_argument(
        "--etp",
        type=int,
        default=None,
        help="expert tensor-parallel size (mixture-of-experts models; default: --tp, as "
        "Megatron): 1 keeps each expert whole, the MoE layers regrouping the ranks as MoE "
        "Parallel Folding does (`porting plan` picks it)",
    )
    p.add_argument("--sequence-parallel", action="store_true")


def _schedule_flags(p) -> None:
    """Sequence and batches, steps, the learning rate's schedule and the checkpoints' interval."""
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--min-lr", type=float, default=None, help="cosine floor (default lr/10)")
    p.add_argument("--warmup", type=int, default=0, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps (0: none)")


def _validation_flags(p) -> None:
    """The held-out data, how often it is read, and the split and seed that order the data."""
    p.add_argument(
        "--valid-data",
        nargs="+",
        default=None,
        help="validation prefixes (or a blend W1 P1 ...); default: the --split share of --data",
    )
    p.add_argument(
        "--eval-every",
        "--val-every",
        dest="eval_every",
        type=int,
        default=None,
        help="validate every N steps (default: once, at the end)",
    )
    p.add_argument(
        "--eval-iters", type=int, default=2, help="global batches per validation (default 2)"
    )
    p.add_argument(
        "--split", default="99,1,0", help="train,valid,test split of --data (without --valid-data)"
    )
    p.add_argument("--seed", type=int, default=1234)


def _layout_flags(p) -> None:
    """Where the processes are, the optimizer's layout, the stages' layers, the overlaps and the
    recomputation."""
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument(
        "--gpus-per-node", type=int, default=1, help="processes per node (GPUs; CPU processes)"
    )
    p.add_argument("--no-distributed-optimizer", action="store_true")
    p.add_argument(
        "--optim-fully-reshardable",
        action="store_true",
        help="save the distributed optimizer's state so that a resume may change TP/PP (it is "
        "gathered per data-parallel group at each save); by default it reshards across DP only",
    )
    p.add_argument(
        "--use-tp-pp-dp-mapping",
        action="store_true",
        help="Megatron's tp-cp-ep-pp-dp rank order (keeps PP inside a site; see `porting plan`)",
    )
    p.add_argument(
        "--first-stage-layers",
        type=int,
        default=None,
        help="decoder layers of the first pipeline stage where --pp does not divide the layers "
        "(Megatron's num_layers_in_first_pipeline_stage; `porting plan` emits it)",
    )
    p.add_argument(
        "--last-stage-layers",
        type=int,
        default=None,
        help="decoder layers of the last pipeline stage (num_layers_in_last_pipeline_stage)",
    )
    p.add_argument("--num-distributed-optimizer-instances", type=int, default=1)
    p.add_argument("--overlap-grad-reduce", action="store_true")
    p.add_argument("--overlap-param-gather", action="store_true")
    p.add_argument(
        "--grad-reduce-in-bf16",
        action="store_true",
        help="reduce gradients in the model's dtype instead of fp32",
    )
    p.add_argument(
        "--recompute",
        choices=["none", "selective", "full"],
        default="none",
        help="activation recomputation (full: uniform, one layer per unit)",
    )


def _launch_flags(p) -> None:
    """The plan a run is checked against, the precision, the training loop and the launcher."""
    p.add_argument(
        "--plan",
        type=Path,
        default=None,
        help="plan.json from `porting plan --emit`: refuse a checkpoint or flags it was not made for",
    )
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto")
    p.add_argument(
        "--engine",
        choices=["nemo2", "bridge"],
        default=None,
        help="the training loop: nemo2 (NeMo 2's LLM collection; a NeMo 2 checkpoint) or "
        "bridge (Megatron-Bridge's pretrain; a Megatron-Bridge checkpoint, from `porting import "
        "--format megatron-bridge`). Default: nemo2 where NeMo is installed, else bridge",
    )
    EXECUTORS.add_to(p)
    g = p.add_argument_group("--executor slurm")
    g.add_argument(
        "--no-submit",
        action="store_true",
        help="write OUT/slurm/train.sbatch without submitting it",
    )
    g.add_argument(
        "--no-wait",
        action="store_true",
        help="return once submitted (the log is OUT/slurm/job-JOBID.out; scancel JOBID stops it)",
    )
    g.add_argument("--partition", metavar="NAME", help="sbatch's --partition")
    g.add_argument("--time", dest="time_limit", metavar="LIMIT", help="sbatch's --time")
    g.add_argument(
        "--cpu-nodes",
        action="store_true",
        help="the nodes have no GPUs: request none (--gpus-per-node is then processes per node, "
        "on gloo)",
    )
    p.add_argument("--dry-run", action="store_true", help="validate and print the plan only")


def _spec(args):
    from porting.train.checks import TrainSpec

    return TrainSpec(
        checkpoint=args.checkpoint,
        data=list(args.data),
        out=args.out,
        tp=args.tp,
        pp=args.pp,
        vp=args.vp,
        cp=args.cp,
        ep=args.ep,
        etp=args.etp,
        sequence_parallel=args.sequence_parallel,
        seq_length=args.seq_length,
        micro_batch=args.micro_batch,
        global_batch=args.global_batch,
        steps=args.steps,
        lr=args.lr,
        min_lr=args.min_lr,
        warmup=args.warmup,
        weight_decay=args.weight_decay,
        save_every=args.save_every,
        valid_data=list(args.valid_data) if args.valid_data else None,
        eval_every=args.eval_every,
        eval_iters=args.eval_iters,
        split=args.split,
        seed=args.seed,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        distributed_optimizer=not args.no_distributed_optimizer,
        optim_fully_reshardable=args.optim_fully_reshardable,
        use_tp_pp_dp_mapping=args.use_tp_pp_dp_mapping,
        first_stage_layers=args.first_stage_layers,
        last_stage_layers=args.last_stage_layers,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        grad_reduce_in_fp32=not args.grad_reduce_in_bf16,
        recompute=args.recompute,
        precision=args.precision,
        plan=args.plan,
    )


def _rank_argv(args) -> list[str]:
    """This command's arguments with the executor switched to local (what each rank runs)."""
    argv = args.typed[args.typed.index("train") + 1 :]
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--executor":
            skip = True
            continue
        if a.startswith("--executor="):
            continue
        out.append(a)
    return out + ["--executor", "local"]


def _engine(chosen: str | None) -> str:
    """The training loop: the one asked for, else NeMo 2's where NeMo is installed (the nemo2
    stack) and Megatron-Bridge's where it is not (the current stack)."""
    if chosen is not None:
        return chosen
    return "nemo2" if quiet.installed("nemo") else "bridge"


def _need_engine(engine: str) -> None:
    """Refuse at once, before any rank starts, where the engine's packages are not installed."""
    if engine == "bridge":
        if not quiet.installed("megatron.bridge"):
            raise PortingError(
                "--engine bridge runs Megatron-Bridge's training loop, and this environment "
                "lacks megatron-bridge: install `porting[current]` (Python 3.12; "
                "docs/environments.md), or train a NeMo 2 checkpoint with --engine nemo2"
            )
        return
    missing = [m for m in ("nemo", "lightning") if not quiet.installed(m)]
    if missing:
        raise PortingError(
            f"--engine nemo2 runs NeMo 2's training loop, and this environment lacks "
            f"{' and '.join(missing)} (the current stack, docs/environments.md): train in the "
            "nemo2 environment (`scripts/env.sh nemo2 -- porting train ...`) or install "
            "`porting[nemo2]` (Python 3.11), or train a Megatron-Bridge checkpoint with "
            "--engine bridge; --dry-run checks a run here without either"
        )


def _cmd_train(args) -> int:
    quiet.offline()
    stop.launcher()  # a stray copy of the launcher's variable is refused before any work
    from porting.train import checks

    spec = _spec(args)
    engine = _engine(args.engine)
    checks.refuse_input_overlap(spec)
    executor = EXECUTORS.get(args.executor)
    if engine not in executor.engines:
        raise PortingError(executor.other_engine)
    if executor.starts_ranks or args.dry_run:
        _checked_before_any_rank(args, spec, engine, executor)
    if args.dry_run:
        print(
            f"ok: TP {spec.tp} x PP {spec.pp} x CP {spec.cp} x DP {spec.data_parallel}"
            + (f" (EP {spec.ep})" if spec.ep > 1 else "")
            + ", "
            f"global batch {spec.global_batch} = micro {spec.micro_batch} x DP x "
            f"{spec.global_batch // (spec.micro_batch * spec.data_parallel)} accumulation steps"
        )
        return 0
    _need_engine(engine)
    if executor.starts_ranks:
        return executor.start(args, spec, _rank_argv(args))
    return _train_here(args, spec, engine)


def _checked_before_any_rank(args, spec, engine: str, executor) -> None:
    """Every check that needs no trainer, in this process, before any rank is started: the
    launch's size, each value a rank's command line (or a script) holds, and the run's
    preflight on the NeMo-free config, so that the launcher is not one more NeMo start-up (~15 s
    of CPU) beside its ranks'."""
    from porting import shell
    from porting.train import preflight

    if executor.starts_ranks:
        executor.check_size(
            spec.nodes, spec.gpus_per_node, nodes_flag="--nodes", ranks_flag="--gpus-per-node"
        )
        for flag, value in (("--partition", args.partition), ("--time", args.time_limit)):
            if value is not None:
                shell.checked(value, flag)
        shell.command(_rank_argv(args))
    pre = (
        preflight.preflight_bridge(spec) if engine == "bridge" else preflight.preflight(spec, False)
    )
    for w in pre.warnings:
        print(f"warning: {w}", file=sys.stderr)
    gc.freeze()  # as at the end of _train_here


def _train_here(args, spec, engine: str) -> int:
    """This process trains: one process, or a rank that torchrun or srun started."""
    from porting.train import checks

    if spec.world_size == 1 and os.environ.get("RANK", "0") not in ("", "0"):
        # one process that took a stray RANK for its own would skip the run's lock and verdict
        raise PortingError(
            f"RANK={os.environ['RANK']} is set in this environment, but this run has one "
            "process (--nodes 1 --gpus-per-node 1): unset RANK"
        )
    if spec.world_size > 1 and "LOCAL_RANK" not in os.environ and "SLURM_PROCID" not in os.environ:
        raise PortingError(
            f"{spec.world_size} processes requested: use --executor torchrun (one node) or "
            "--executor slurm"
        )
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank of torchrun: die with it
        stop.die_with_parent()
        stop.watch_launcher()
    stop.guard_forked_children()
    # A log file on a full disk must not add "--- Logging error ---" reports to the one line
    # that says the disk is full.
    logging.raiseExceptions = False
    if engine == "bridge":
        from porting.train import bridge as recipe

        r = recipe.config(spec)
    else:
        from porting.train import recipe

        quiet.quiet_nemo()
        r = recipe.recipe(spec)
    # The launching process holds the run's lock for its ranks; a run started otherwise (srun,
    # a hand-made torchrun) is locked by its first rank.
    ours = stop.launcher() is not None
    held = ours or os.environ.get("RANK", "0") != "0"
    with contextlib.nullcontext() if held else guard.output_lock(spec.out, "training run"):
        # Ranks under our launcher leave settling the run directory, and saying so, to it.
        quiet_rank = ours and "RANK" in os.environ
        out = stop.run_settled(lambda: recipe.run(r), Path(spec.out), quiet_rank)
    if os.environ.get("RANK", "0") == "0":  # one line for the run, not one per rank
        if spec.save_every and engine == "bridge":
            ckpts = out / "checkpoints"
            done = f"done: checkpoints in {ckpts} (newest: {checks.bridge_iteration(ckpts).name})"
        elif spec.save_every:
            done = (
                f"done: checkpoints in {out / 'checkpoints'} (last: {out / 'checkpoints' / 'last'})"
            )
        else:  # the GPU check's Falcon run said "checkpoints in ..." and had written none
            done = f"done: {spec.steps} steps in {out}, no checkpoint written (--save-every 0)"
        print(done)
        from porting.train.launch import leave_verdict

        leave_verdict(spec.out, done)
    # Exit handlers of libraries NeMo imports (leptonai's Remote._atexit_cleanup) run a full
    # gc.collect() over the whole heap: seconds per process. Nothing left needs collecting.
    gc.freeze()
    return 0
