"""``porting plan``: choose TP/PP/DP and their placement across sites before booking the GPUs."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, replace
from pathlib import Path

from porting import guard, shell
from porting.errors import PortingError
from porting.planner.limits import (
    GLOBAL_BATCH,
    MAX_GPUS,
    MAX_MICRO_BATCH_SIZES,
    MICRO_BATCH,
    SEQ_LENGTH,
    STEP_SECONDS,
    positive_int,
    show,
)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``plan`` subcommand."""
    p = sub.add_parser(
        "plan",
        help="pick TP/PP/DP and placement for a cluster (one or several sites); predict step "
        "time and memory; emit launch files and NCCL settings",
        description="Search every tensor/pipeline/context/data-parallel (and, for MoE models, "
        "expert-parallel) layout that divides the model and the cluster, predict step time, "
        "memory per GPU and communication per level (NVLink, the racks and zones of a site, "
        "inter-site links), rank them, and for the chosen one write "
        "`porting train` flags, a NeMo MegatronStrategy, torchrun/Slurm launchers, nccl.env and "
        "nccl-tests commands. See docs/planner.md for the formulas and their sources.",
    )
    _problem_flags(p)
    _output_flags(p)
    _calibration_flags(p)
    _training_settings(p)
    _emitted_command_flags(p)
    p.set_defaults(func=_cmd_plan)


def _problem_flags(p) -> None:
    """The model, the cluster, the batch and the sequence."""
    p.add_argument(
        "--model",
        required=True,
        help="imported checkpoint dir, HF config.json (or its dir), or a preset "
        "(llama-7b, llama-13b, llama-70b, llama3-8b, llama3-70b, falcon-7b, falcon-40b, "
        "gpt-1.7b ... gpt-1t, tiny; MoE: mixtral-8x7b, mixtral-8x22b, qwen2-57b-a14b, "
        "qwen3-235b-a22b, deepseek-v2-lite, deepseek-v3)",
    )
    p.add_argument("--cluster", type=Path, required=True, help="cluster YAML (examples/clusters)")
    # numbers are read as text and checked by _cmd_plan: one error line naming the flag
    p.add_argument("--global-batch", required=True, help="sequences per step")
    p.add_argument("--seq-length", required=True, help="tokens per sequence")


def _output_flags(p) -> None:
    """What is shown and written: the table, JSON, the rejected, one layout, launch files, a plot."""
    p.add_argument("--top", default="10", help="layouts to show (default 10)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--rejected", action="store_true", help="list rejected layouts and why")
    p.add_argument(
        "--layout",
        help="evaluate and emit this layout instead of the best, e.g. "
        "'tp=8,pp=4,vp=5,cp=1,mb=1,recompute=selective' (MoE models: add ep=8,etp=1)",
    )
    p.add_argument("--emit", type=Path, metavar="DIR", help="write launch files for the choice")
    p.add_argument("--plot", type=Path, metavar="PNG", help="write a plot of the plan")


def _calibration_flags(p) -> None:
    """Measurements to fit the model's constants to, and the constants read and written."""
    p.add_argument(
        "--calibrate",
        type=Path,
        metavar="DIR",
        help="nccl-tests logs to fit bandwidths to, and grouped-GEMM logs "
        "(grouped_gemm*.csv, as --emit's gemm_bench.py writes them) to fit the expert GEMMs to",
    )
    p.add_argument(
        "--measured-step",
        metavar="SECONDS",
        help="measured step time of the chosen layout: fit the compute efficiency to it",
    )
    p.add_argument("--constants", type=Path, help="efficiency constants (YAML) to start from")
    p.add_argument("--save-constants", type=Path, help="write the fitted constants (YAML)")


def _training_settings(p) -> None:
    """The training settings a prediction assumes (defaults follow ``porting train``)."""
    g = p.add_argument_group("training settings (defaults follow `porting train`)")
    g.add_argument(
        "--order",
        choices=["search", "tp-pp-dp", "default"],
        default="search",
        help="rank order where PP > 1: search both (default) and show the best of each "
        "placement; tp-pp-dp: Megatron's tp-cp-ep-pp-dp only (model replicas inside a site, "
        "data parallel across sites); default: Megatron's default tp-cp-ep-dp-pp only (pipeline "
        "stages across sites, every order of the sites the links allow)",
    )
    g.add_argument(
        "--no-uneven-pipeline",
        action="store_true",
        help="only PP sizes that divide the layers (by default others are tried with Megatron's "
        "num_layers_in_first/last_pipeline_stage)",
    )
    g.add_argument("--no-distributed-optimizer", action="store_true")
    g.add_argument(
        "--instances",
        help="distributed-optimizer instances (default: one per site where the sites allow)",
    )
    g.add_argument(
        "--overlap",
        action="store_true",
        help="model overlap_grad_reduce and overlap_param_gather (porting train has them off)",
    )
    g.add_argument("--tp-comm-overlap", action="store_true")
    g.add_argument("--bf16-grad-reduce", action="store_true", help="grad_reduce_in_fp32=False")
    g.add_argument("--no-flash-attention", action="store_true")
    g.add_argument("--micro-batches", default="1,2,4,8", help="micro-batch sizes to try")
    g.add_argument(
        "--ep",
        metavar="SIZES",
        help="MoE models: expert-parallel sizes to try, e.g. 8,16,32 (default: every divisor "
        "of the experts that tiles a pipeline stage)",
    )
    g.add_argument(
        "--dispatcher",
        choices=["alltoall", "flex"],
        default="alltoall",
        help="MoE token dispatcher the all-to-all is predicted for: alltoall (Megatron's "
        "default, a copy per routed expert; what porting train runs) or flex (DeepEP: a copy "
        "per node, forwarded over NVLink)",
    )
    g.add_argument(
        "--no-grouped-gemm",
        action="store_true",
        help="MoE models: predict the local experts' GEMMs one launch each (Megatron's "
        "SequentialMLP) instead of grouped (--moe-grouped-gemm, TEGroupedMLP)",
    )
    g.add_argument(
        "--no-tune-nccl",
        action="store_true",
        help="predict with the cluster file's NCCL settings, not the ones --emit recommends",
    )


def _emitted_command_flags(p) -> None:
    """What the emitted ``porting train`` command names."""
    e = p.add_argument_group("emitted train command")
    e.add_argument("--checkpoint", help="checkpoint for `porting train` (default: --model if it "
                   "is an imported checkpoint, else $CHECKPOINT)")  # fmt: skip
    e.add_argument("--data", help="dataset prefix (default: $DATA)")
    e.add_argument("--out", help="run directory (default: $OUT)")


def _integer(text: str, where: str) -> int:
    """A flag's integer: ASCII digits only (no 1e3, no Unicode digits, no 5000-digit numbers)."""
    text = str(text).strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 4000:
        raise PortingError(f"{where}: expected a positive integer, got {show(text)}")
    return int(text)


def _seconds(text: str, where: str) -> float:
    """A flag's number of seconds, finite and in range."""
    try:
        value = float(text) if len(text) <= 40 else math.nan
    except ValueError:
        raise PortingError(f"{where}: expected a number of seconds, got {show(text)}") from None
    return float(STEP_SECONDS.check(value, where))


def _settings(args):
    from porting.planner.perf import Settings
    from porting.planner.placement import ORDER_DEFAULT, ORDER_TP_PP_DP

    items = str(args.micro_batches).split(",")
    if len(items) > MAX_MICRO_BATCH_SIZES:
        raise PortingError(
            f"--micro-batches: {len(items)} sizes, more than the planner's limit of "
            f"{MAX_MICRO_BATCH_SIZES}"
        )
    mbs = tuple(MICRO_BATCH.check(_integer(x, "--micro-batches"), "--micro-batches") for x in items)
    eps: tuple[int, ...] = ()
    if args.ep is not None:
        items = str(args.ep).split(",")
        if len(items) > MAX_MICRO_BATCH_SIZES:
            raise PortingError(
                f"--ep: {len(items)} sizes, more than the planner's limit of "
                f"{MAX_MICRO_BATCH_SIZES}"
            )
        checked = (int(positive_int(MAX_GPUS).check(_integer(x, "--ep"), "--ep")) for x in items)
        eps = tuple(dict.fromkeys(checked))
    instances = None
    if args.instances is not None:
        instances = int(
            positive_int(MAX_GPUS).check(_integer(args.instances, "--instances"), "--instances")
        )
    return Settings(
        distributed_optimizer=not args.no_distributed_optimizer,
        instances=instances,
        overlap_grad_reduce=args.overlap,
        overlap_param_gather=args.overlap,
        tp_comm_overlap=args.tp_comm_overlap,
        grad_reduce_in_fp32=not args.bf16_grad_reduce,
        flash_attention=not args.no_flash_attention,
        micro_batches=mbs,
        tune_nccl=not args.no_tune_nccl,
        orders={
            "search": (ORDER_TP_PP_DP, ORDER_DEFAULT),
            "tp-pp-dp": (ORDER_TP_PP_DP,),
            "default": (ORDER_DEFAULT,),
        }[args.order],
        uneven_pipeline=not args.no_uneven_pipeline,
        expert_parallel=eps,
        dispatcher=args.dispatcher,
        grouped_gemm=not args.no_grouped_gemm,
    )


def parse_layout(text: str, ev) -> object:
    """``tp=8,pp=4,vp=5,cp=1,mb=1,recompute=selective[,order=default,sites=a>b>c][,ep=8,etp=1]``
    -> Layout (``ep``/``etp``: the MoE layers' expert-parallel and expert tensor-parallel sizes,
    default 1).

    DP comes from the cluster, the distributed-optimizer instances as the search sets them, and
    the first/last stage layers from :func:`porting.planner.search.uneven_split` where PP does not
    divide the layers.
    """
    from porting.planner.perf import Layout
    from porting.planner.placement import ORDER_DEFAULT, ORDER_TP_PP_DP
    from porting.planner.search import megatron_order_rule, uneven_split

    fields = _layout_fields(text)
    tp, pp, cp = fields["tp"], fields["pp"], fields["cp"]
    world = ev.cluster.world
    if world % (tp * pp * cp):
        raise PortingError(f"--layout: TP x PP x CP = {tp * pp * cp} does not divide {world} GPUs")
    bad = [x for x in ev.cluster.sites if x.gpus_per_node % tp]
    if bad:
        raise PortingError(
            f"--layout: TP {tp} does not divide site {bad[0].name}'s {bad[0].gpus_per_node} GPUs "
            "per node (TP stays inside a node)"
        )
    order = ORDER_DEFAULT if fields["order"] == "default" and pp > 1 else ORDER_TP_PP_DP
    sites = _layout_sites(fields["sites"], order == ORDER_DEFAULT, ev.cluster)
    ep, etp = fields["ep"], fields["etp"]
    if ep * etp > 1:
        _check_layout_experts(ep, etp, tp, world // pp, ev)
    why = megatron_order_rule(order, tp, cp, pp, ep, etp, ev.model.moe)
    if why:
        raise PortingError(f"--layout: {why} (give order=default)")
    first = middle = last = 0
    if ev.model.layers % pp:
        split = uneven_split(ev.model.layers, pp)
        if split is None:
            raise PortingError(f"--layout: PP {pp} cannot split {ev.model.layers} layers")
        first, middle, last = split
    return Layout(
        tp=tp,
        cp=cp,
        pp=pp,
        vp=fields["vp"],
        dp=world // (tp * pp * cp),
        micro_batch=fields["mb"],
        recompute=fields["recompute"],
        instances=ev.instances_for(tp, cp, pp, order, sites),
        sequence_parallel=ev.settings.sequence_parallel and tp > 1,
        order=order,
        sites=sites,
        first_layers=first,
        middle_layers=middle,
        last_layers=last,
        ep=ep,
        etp=etp,
    )


def _layout_fields(text: str) -> dict:
    """``--layout``'s ``key=value`` items, each key known and each value of its kind."""
    from porting.planner.perf import RECOMPUTE

    fields: dict = {"tp": 1, "pp": 1, "vp": 1, "cp": 1, "mb": 1, "recompute": "selective"}
    fields.update(ep=1, etp=1)
    fields.update(order="tp-pp-dp", sites="")
    for item in text.replace(" ", ",").split(","):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise PortingError(
                f"--layout: {item!r}: expected one of {', '.join(fields)} as key=value"
            )
        if key == "recompute":
            if value not in RECOMPUTE:
                raise PortingError(f"--layout: recompute must be one of {', '.join(RECOMPUTE)}")
            fields[key] = value
        elif key == "order":
            if value not in ("tp-pp-dp", "default"):
                raise PortingError("--layout: order must be tp-pp-dp or default")
            fields[key] = value
        elif key == "sites":
            fields[key] = value
        else:
            fields[key] = positive_int(MAX_GPUS).check(
                _integer(value, f"--layout: {key}"), f"--layout: {key}"
            )
    return fields


def _layout_sites(given: str, across_sites: bool, cluster) -> tuple[str, ...]:
    """The order of the sites the pipeline crosses (Megatron's default rank order with several
    sites): ``sites=a>b>c`` or the file's, each site once and each neighbour linked; () else."""
    names = tuple(x.name for x in cluster.sites)
    if across_sites and len(names) > 1:
        sites = tuple(given.split(">")) if given else names
        try:
            cluster.reordered(sites).ring_links()  # each site once, each neighbour linked
        except PortingError as err:
            raise PortingError(f"--layout: sites: {err}") from None
        if names.index(sites[0]) > names.index(sites[-1]):
            sites = sites[::-1]  # the search lists one of each pair that reverses the other
        return sites
    if given:
        raise PortingError(
            "--layout: sites= only applies with order=default (pipeline across sites)"
        )
    return ()


def _check_layout_experts(ep: int, etp: int, tp: int, stage: int, ev) -> None:
    """``ep``/``etp`` against the model's experts, TP, a pipeline stage's GPUs and ``--ep``."""
    m = ev.model
    if not m.moe:
        raise PortingError(f"--layout: ep/etp: model {m.name} has no experts")
    if m.experts % ep:
        raise PortingError(f"--layout: EP {ep} does not divide the {m.experts} experts")
    if etp not in (1, tp):
        raise PortingError(f"--layout: ETP {etp} must be 1 or TP {tp}")
    if stage % (ep * etp):
        raise PortingError(
            f"--layout: EP {ep} x ETP {etp} does not divide the {stage} GPUs of a pipeline stage"
        )
    if ev.settings.expert_parallel and ep not in ev.settings.expert_parallel:
        raise PortingError(f"--layout: EP {ep} is not among --ep")


def _check_layout(layout, ev) -> None:
    """The search's divisibility rules, for a layout given by hand (in any order of the sites
    the links allow, not only those the search tried)."""
    from porting.planner.search import Rejected, enumerate_layouts

    for item in enumerate_layouts(ev, [layout.sites] if layout.sites else []):
        if not isinstance(item, Rejected) and item == layout:
            return
    raise PortingError(
        f"--layout {layout.label()}: not a valid layout for this model, cluster and batch "
        "(run with --rejected to see the rules)"
    )


def _calibrated(directory: Path, cluster, eff, lines: list[str], out: dict):
    """``eff`` refitted to the nccl-tests and grouped-GEMM logs in ``directory``; what was fitted
    added to ``lines`` (the table) and ``out`` (the JSON)."""
    from porting.planner import calibrate as cal

    tests = cal.load_nccl_tests(directory)
    eff, fits = cal.fit_levels(cluster, eff, tests)
    if fits:
        lines.append("calibration from nccl-tests (busbw GB/s and small-message latency us):")
        lines.append(
            f"  {'log':<40} {'level':<5} {'pred bw':>8} {'meas bw':>8} "
            f"{'pred lat':>9} {'meas lat':>9}  constant"
        )
    for f in fits:
        lines.append(
            f"  {Path(f.path).name:<40} {f.level:<5} {f.predicted_busbw / 1e9:>8.1f} "
            f"{f.measured_busbw / 1e9:>8.1f} {f.predicted_latency * 1e6:>9.1f} "
            f"{f.measured_latency * 1e6:>9.1f}  {f.constant}={f.value:.3f}"
        )
    out["calibration"] = [asdict(f) for f in fits]
    gemms = cal.load_gemm_logs(directory)
    if gemms:
        gpu = cluster.slowest_gpu()
        eff, before, after = cal.fit_experts(gemms, gpu.peak_flops, gpu.hbm_bytes_s, eff)
        lines.append(
            f"calibration from {len(gemms)} grouped-GEMM shapes: expert_compute="
            f"{eff.expert_compute:.3f}, expert_hbm={eff.expert_hbm:.3f}, expert_launch="
            f"{eff.expert_launch * 1e6:.1f} us; worst error {before:.0%} before, "
            f"{after:.0%} after"
        )
        out["expert_calibration"] = {
            "shapes": len(gemms),
            "expert_compute": eff.expert_compute,
            "expert_hbm": eff.expert_hbm,
            "expert_launch": eff.expert_launch,
            "worst_error_before": before,
            "worst_error_after": after,
        }
    return eff


def _cmd_plan(args) -> int:
    from porting.planner import calibrate as cal
    from porting.planner.cluster import load_cluster
    from porting.planner.comm import Efficiency
    from porting.planner.model import load_model
    from porting.planner.perf import Evaluator
    from porting.planner.search import plan

    refs = _checked_flags(args)
    settings = _settings(args)
    model = load_model(args.model)
    cluster = load_cluster(args.cluster)
    _check_expert_parallel(settings.expert_parallel, model, cluster)
    eff = cal.load_constants(args.constants) if args.constants else Efficiency()
    out: dict = {}
    lines: list[str] = []
    if args.calibrate:
        eff = _calibrated(args.calibrate, cluster, eff, lines, out)
    result = plan(model, cluster, args.seq_length, args.global_batch, settings, eff)
    ev = Evaluator(model, cluster, args.seq_length, args.global_batch, result.settings, eff)
    chosen = _chosen_layout(args.layout, ev, result.best)
    if args.measured_step is not None:
        result, ev, chosen, eff = _fitted_to_step(args, settings, ev, chosen, lines, out)
    if args.save_constants:
        import yaml

        from porting.planner.emit import write_atomic

        write_atomic(args.save_constants, yaml.safe_dump(asdict(eff), sort_keys=True))
        lines.append(f"wrote {args.save_constants}")
    chosen = _with_slowdown(chosen, ev)
    written = _written(args, refs, result, ev, chosen)
    if args.json:
        _print_json(args, result, ev, chosen, out, written)
    else:
        _print_tables(args, result, ev, chosen, lines, written)
    return 0


def _checked_flags(args) -> dict:
    """Every path and number of the command line checked before any work (the paths a script
    will hold for a shell among them); the numbers put in ``args`` as numbers. Returns the
    emitted train command's ``--checkpoint``, ``--data`` and ``--out``: each a path, or a
    ``"$NAME"`` the scripts expand."""
    from porting.planner.model import PRESETS

    guard.check_outputs(
        [
            ("--model", None if args.model in PRESETS else args.model),
            ("--cluster", args.cluster),
            ("--calibrate", args.calibrate),
            ("--constants", args.constants),
        ],
        writes=[("--emit", args.emit)],
        files=[("--plot", args.plot), ("--save-constants", args.save_constants)],
    )
    refs = {
        flag: None if value is None else shell.reference_or_value(value, flag)
        for flag, value in (("--checkpoint", args.checkpoint), ("--data", args.data),
                            ("--out", args.out))
    }  # fmt: skip
    if args.emit is not None:  # as given and where its links lead: plan.json's path is resolved
        shell.checked(str(Path(args.emit).absolute()), "--emit")
        shell.checked(str(Path(args.emit).resolve()), "--emit")
        if args.checkpoint is None and args.model not in PRESETS:  # the default --checkpoint
            shell.checked(str(Path(args.model).resolve()), "--model")
    args.seq_length = int(
        SEQ_LENGTH.check(_integer(args.seq_length, "--seq-length"), "--seq-length")
    )
    args.global_batch = int(
        GLOBAL_BATCH.check(_integer(args.global_batch, "--global-batch"), "--global-batch")
    )
    args.top = int(positive_int(1 << 20).check(_integer(args.top, "--top"), "--top"))
    if args.measured_step is not None:
        args.measured_step = _seconds(args.measured_step, "--measured-step")
    return refs


def _check_expert_parallel(sizes, model, cluster) -> None:
    """``--ep``'s sizes against the model's experts and the cluster's GPUs."""
    for ep in sizes:
        if not model.moe:
            raise PortingError(f"--ep: model {model.name} has no experts")
        if model.experts % ep:
            raise PortingError(
                f"--ep {ep} does not divide the {model.experts} experts of model {model.name}"
            )
        if ep > cluster.world:
            raise PortingError(f"--ep {ep} is more than the {cluster.world} GPUs of {cluster.name}")


def _chosen_layout(layout_flag: str | None, ev, best):
    """The search's best, or the prediction of ``--layout``."""
    from porting.planner.perf import Infeasible

    if not layout_flag:
        return best
    layout = parse_layout(layout_flag, ev)
    _check_layout(layout, ev)
    try:
        return ev.predict(layout)
    except Infeasible as err:
        raise PortingError(f"--layout {layout.label()}: {err}") from None


def _fitted_to_step(args, settings, ev, chosen, lines: list[str], out: dict):
    """``--measured-step``: the compute efficiency fitted to the chosen layout's measured step,
    the search run again with it; ``(result, evaluator, chosen, constants)``, what was fitted
    said in ``lines`` and ``out``."""
    from porting.planner import calibrate as cal
    from porting.planner.perf import Evaluator
    from porting.planner.search import plan

    model, cluster = ev.model, ev.cluster
    before = chosen.step
    eff = cal.fit_step(ev, chosen.layout, args.measured_step)
    result = plan(model, cluster, args.seq_length, args.global_batch, settings, eff)
    ev = Evaluator(model, cluster, args.seq_length, args.global_batch, result.settings, eff)
    chosen = ev.predict(chosen.layout)
    lines.append(
        f"step time of {chosen.layout.label()}: measured {args.measured_step:.3f} s, "
        f"predicted {before:.3f} s before the fit and {chosen.step:.3f} s after "
        f"(compute efficiency {eff.compute:.3f})"
    )
    out["step_fit"] = {
        "layout": chosen.layout.label(),
        "measured_s": args.measured_step,
        "predicted_before_s": before,
        "predicted_after_s": chosen.step,
        "compute": eff.compute,
    }
    return result, ev, chosen, eff


def _with_slowdown(chosen, ev):
    """The choice with its step time against the same GPUs in one site, where there are
    several and the search did not say."""
    from porting.planner.perf import Infeasible

    if chosen.slowdown is not None or len(ev.cluster.sites) <= 1:
        return chosen
    one = ev.with_cluster(ev.cluster.one_site())
    try:
        return replace(chosen, slowdown=chosen.step / one.predict(chosen.layout).step)
    except Infeasible:
        return chosen


def _written(args, refs: dict, result, ev, chosen) -> list[Path]:
    """``--emit``'s launch files and ``--plot``'s plot, as written."""
    written: list[Path] = []
    if args.emit:
        from porting.planner.emit import DATA, OUT, default_checkpoint, write_launch

        written = write_launch(
            args.emit,
            result,
            ev,
            chosen,
            checkpoint=refs["--checkpoint"] or default_checkpoint(args.model),
            data=refs["--data"] or DATA,
            run_dir=refs["--out"] or OUT,
        )
    if args.plot:
        from porting.planner.plot import write_plot

        written.append(write_plot(args.plot, result, ev, top=min(args.top, 8)))
    return written


def _print_json(args, result, ev, chosen, out: dict, written: list[Path]) -> None:
    from porting.planner import report

    data = report.plan_dict(result, top=args.top, with_rejected=args.rejected)
    data["chosen"] = report.prediction_dict(chosen)
    data["chosen"]["groups"] = report.groups(ev, chosen)
    data.update(out)
    data["written"] = [str(w) for w in written]
    print(json.dumps(data, indent=2, default=str))


def _print_tables(args, result, ev, chosen, lines: list[str], written: list[Path]) -> None:
    from porting.planner import report

    print(report.header(result))
    print()
    print(report.table(result, args.top))
    print()
    if report.placements(result):
        print(report.placements(result))
        print()
    where = f", {chosen.layout.placement_label()}" if len(ev.cluster.sites) > 1 else ""
    print(f"chosen: {chosen.layout.label()} (rank order {chosen.order}{where})")
    print(f"  {report.breakdown(chosen)}")
    print(f"  groups: {report.groups(ev, chosen)}")
    if chosen.slowdown is not None:
        print(f"  {chosen.slowdown:.2f}x the step time of the same GPUs in one site")
    for note in result.notes:
        print(f"  note: {note}")
    for line in lines:
        print(line)
    if args.rejected:
        print(f"rejected ({len(result.rejected)}):")
        print(report.rejected(result))
    for w in written:
        print(f"wrote {w}")
    sys.stdout.flush()
