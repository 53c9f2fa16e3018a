"""``porting plan``: choose TP/PP/DP and their placement across sites before booking the GPUs."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from porting.errors import PortingError


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``plan`` subcommand."""
    p = sub.add_parser(
        "plan",
        help="pick TP/PP/DP and placement for a cluster (one or several sites); predict step "
        "time and memory; emit launch files and NCCL settings",
        description="Search every tensor/pipeline/context/data-parallel layout that divides the "
        "model and the cluster, predict step time, memory per GPU and communication per level "
        "(NVLink, site network, inter-site links), rank them, and for the chosen one write "
        "`porting train` flags, a NeMo MegatronStrategy, torchrun/Slurm launchers, nccl.env and "
        "nccl-tests commands. See docs/planner.md for the formulas and their sources.",
    )
    p.add_argument(
        "--model",
        required=True,
        help="imported checkpoint dir, HF config.json (or its dir), or a preset "
        "(llama-7b, llama-13b, llama-70b, llama3-8b, llama3-70b, falcon-7b, falcon-40b, "
        "gpt-1.7b ... gpt-1t, tiny)",
    )
    p.add_argument("--cluster", type=Path, required=True, help="cluster YAML (examples/clusters)")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    p.add_argument("--seq-length", type=int, required=True, help="tokens per sequence")
    p.add_argument("--top", type=int, default=10, help="layouts to show (default 10)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--rejected", action="store_true", help="list rejected layouts and why")
    p.add_argument(
        "--layout",
        help="evaluate and emit this layout instead of the best, e.g. "
        "'tp=8,pp=4,vp=5,cp=1,mb=1,recompute=selective'",
    )
    p.add_argument("--emit", type=Path, metavar="DIR", help="write launch files for the choice")
    p.add_argument("--plot", type=Path, metavar="PNG", help="write a plot of the plan")
    p.add_argument(
        "--calibrate", type=Path, metavar="DIR", help="nccl-tests logs to fit bandwidths to"
    )
    p.add_argument(
        "--measured-step",
        type=float,
        metavar="SECONDS",
        help="measured step time of the chosen layout: fit the compute efficiency to it",
    )
    p.add_argument("--constants", type=Path, help="efficiency constants (YAML) to start from")
    p.add_argument("--save-constants", type=Path, help="write the fitted constants (YAML)")
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
        type=int,
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
        "--no-tune-nccl",
        action="store_true",
        help="predict with the cluster file's NCCL settings, not the ones --emit recommends",
    )
    e = p.add_argument_group("emitted train command")
    e.add_argument("--checkpoint", help="checkpoint for `porting train` (default: --model if it "
                   "is an imported checkpoint, else $CHECKPOINT)")  # fmt: skip
    e.add_argument("--data", help="dataset prefix (default: $DATA)")
    e.add_argument("--out", help="run directory (default: $OUT)")
    p.set_defaults(func=_cmd_plan)


def _settings(args):
    from porting.planner.perf import Settings
    from porting.planner.placement import ORDER_DEFAULT, ORDER_TP_PP_DP

    try:
        mbs = tuple(int(x) for x in args.micro_batches.split(","))
    except ValueError:
        raise PortingError(f"--micro-batches {args.micro_batches!r}: expected e.g. 1,2,4") from None
    if not mbs or min(mbs) <= 0:
        raise PortingError("--micro-batches: sizes must be positive")
    if args.instances is not None and args.instances <= 0:
        raise PortingError("--instances must be positive")
    return Settings(
        distributed_optimizer=not args.no_distributed_optimizer,
        instances=args.instances,
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
    )


def parse_layout(text: str, ev) -> object:
    """``tp=8,pp=4,vp=5,cp=1,mb=1,recompute=selective[,order=default,sites=a>b>c]`` -> Layout.

    DP comes from the cluster, the distributed-optimizer instances as the search sets them, and
    the first/last stage layers from :func:`porting.planner.search.uneven_split` where PP does not
    divide the layers.
    """
    from porting.planner.perf import RECOMPUTE, Layout
    from porting.planner.placement import ORDER_DEFAULT, ORDER_TP_PP_DP
    from porting.planner.search import uneven_split

    fields: dict = {"tp": 1, "pp": 1, "vp": 1, "cp": 1, "mb": 1, "recompute": "selective"}
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
            try:
                fields[key] = int(value)
            except ValueError:
                raise PortingError(f"--layout: {key}={value!r}: expected an integer") from None
            if fields[key] <= 0:
                raise PortingError(f"--layout: {key} must be positive")
    tp, pp, cp = fields["tp"], fields["pp"], fields["cp"]
    world = ev.cluster.world
    if world % (tp * pp * cp):
        raise PortingError(f"--layout: TP x PP x CP = {tp * pp * cp} does not divide {world} GPUs")
    order = ORDER_DEFAULT if fields["order"] == "default" and pp > 1 else ORDER_TP_PP_DP
    sites: tuple[str, ...] = ()
    names = tuple(x.name for x in ev.cluster.sites)
    if order == ORDER_DEFAULT and len(names) > 1:
        sites = tuple(fields["sites"].split(">")) if fields["sites"] else names
        ev.cluster.reordered(sites)  # names each site once, or says which
        if sites not in ev.cluster.site_orders() and sites[::-1] in ev.cluster.site_orders():
            sites = sites[::-1]
    elif fields["sites"]:
        raise PortingError(
            "--layout: sites= only applies with order=default (pipeline across sites)"
        )
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
    )


def _check_layout(layout, ev) -> None:
    """The search's divisibility rules, for a layout given by hand."""
    from porting.planner.search import Rejected, enumerate_layouts

    for item in enumerate_layouts(ev):
        if not isinstance(item, Rejected) and item == layout:
            return
    raise PortingError(
        f"--layout {layout.label()}: not a valid layout for this model, cluster and batch "
        "(run with --rejected to see the rules)"
    )


def _cmd_plan(args) -> int:
    from porting.planner import calibrate as cal
    from porting.planner import report
    from porting.planner.cluster import load_cluster
    from porting.planner.comm import Efficiency
    from porting.planner.model import load_model
    from porting.planner.perf import Evaluator, Infeasible
    from porting.planner.search import plan

    model = load_model(args.model)
    cluster = load_cluster(args.cluster)
    settings = _settings(args)
    eff = cal.load_constants(args.constants) if args.constants else Efficiency()
    out: dict = {}
    lines: list[str] = []
    if args.calibrate:
        tests = cal.load_nccl_tests(args.calibrate)
        eff, fits = cal.fit_levels(cluster, eff, tests)
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
    result = plan(model, cluster, args.seq_length, args.global_batch, settings, eff)
    ev = Evaluator(model, cluster, args.seq_length, args.global_batch, result.settings, eff)
    chosen = result.best
    if args.layout:
        layout = parse_layout(args.layout, ev)
        _check_layout(layout, ev)
        try:
            chosen = ev.predict(layout)
        except Infeasible as err:
            raise PortingError(f"--layout {layout.label()}: {err}") from None
    if args.measured_step is not None:
        if args.measured_step <= 0:
            raise PortingError("--measured-step must be positive")
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
    if args.save_constants:
        import yaml

        from porting.planner.emit import write_atomic

        write_atomic(args.save_constants, yaml.safe_dump(asdict(eff), sort_keys=True))
        lines.append(f"wrote {args.save_constants}")
    if chosen.slowdown is None and len(cluster.sites) > 1:
        one = ev.with_cluster(cluster.one_site())
        try:
            chosen = replace(chosen, slowdown=chosen.step / one.predict(chosen.layout).step)
        except Infeasible:
            pass
    written: list[Path] = []
    if args.emit:
        from porting.planner.emit import default_checkpoint, write_launch

        written = write_launch(
            args.emit,
            result,
            ev,
            chosen,
            checkpoint=args.checkpoint or default_checkpoint(args.model),
            data=args.data or '"$DATA"',
            run_dir=args.out or '"$OUT"',
        )
    if args.plot:
        from porting.planner.plot import write_plot

        written.append(write_plot(args.plot, result, ev, top=min(args.top, 8)))
    if args.json:
        data = report.plan_dict(result, top=args.top, with_rejected=args.rejected)
        data["chosen"] = report.prediction_dict(chosen)
        data.update(out)
        data["written"] = [str(w) for w in written]
        print(json.dumps(data, indent=2, default=str))
        return 0
    print(report.header(result))
    print()
    print(report.table(result, args.top))
    print()
    if report.placements(result):
        print(report.placements(result))
        print()
    where = f", {chosen.layout.placement_label()}" if len(cluster.sites) > 1 else ""
    print(f"chosen: {chosen.layout.label()} (rank order {chosen.order}{where})")
    print(f"  {report.breakdown(chosen)}")
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
    return 0
