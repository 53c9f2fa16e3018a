"""A ``plan.json`` written by ``porting plan --emit``, checked against the run before launch:
the plan's model against the checkpoint's, its chosen layout and settings against the flags, every
field it has typed first (a plan is input, read as data). Each mismatch is a
:class:`PortingError` naming the plan's field and the flag."""

from __future__ import annotations

import json
from pathlib import Path

from porting.errors import PortingError
from porting.train.checks import SHAPE, TrainSpec, model_facts, read_json


def check_plan(spec: TrainSpec, manifest, config) -> None:
    """A ``plan.json`` written by ``porting plan --emit`` must describe this model and this run.

    The plan's ``model`` is compared with the checkpoint's model, and the chosen layout and
    settings with the flags, each mismatch an error naming the plan's field.
    """
    path = Path(spec.plan)
    if not path.is_file():
        raise PortingError(f"--plan {path}: no such file")
    plan = read_json(path)
    model = plan.get("model")
    layouts = plan.get("layouts")
    if not isinstance(model, dict) or not isinstance(layouts, list) or not layouts:
        raise PortingError(f"{path}: not a plan written by `porting plan --emit` (model, layouts)")
    _check_plan_types(plan, path)
    _check_plan_model(model, path, spec, manifest, config)
    chosen = layouts[0].get("layout") or {}
    for where, (planned, flag_value, flag) in _planned_and_given(plan, chosen, spec).items():
        if planned is not None and planned != flag_value:
            raise PortingError(
                f"{path}: {where} is {planned!r}, but {flag} gives {flag_value!r}: the flags do "
                "not follow the plan (drop --plan to run another layout)"
            )
    planned_split = (chosen.get("first_layers") or None, chosen.get("last_layers") or None)
    given_split = (spec.first_stage_layers, spec.last_stage_layers)
    if "first_layers" in chosen and planned_split != given_split:
        raise PortingError(
            f"{path}: layouts[0].layout first_layers/last_layers are {planned_split}, but "
            f"--first-stage-layers / --last-stage-layers give {given_split}: the flags do not "
            "follow the plan"
        )
    order = layouts[0].get("rank_order")
    pp_order = "tp-cp-ep-pp-dp"
    if order is not None and spec.pp > 1 and (order == pp_order) != spec.use_tp_pp_dp_mapping:
        raise PortingError(
            f"{path}: layouts[0].rank_order is {order!r}, but --use-tp-pp-dp-mapping is "
            f"{'on' if spec.use_tp_pp_dp_mapping else 'off'}: the flags do not follow the plan"
        )


def _check_plan_model(model: dict, path: Path, spec: TrainSpec, manifest, config) -> None:
    """The plan's ``model`` fields against the checkpoint's model."""
    facts = model_facts(manifest, config)
    source = Path(spec.checkpoint) / "context" / "porting.json"
    for _, key, plan_key in SHAPE:
        key = key or "vocab_size"
        if plan_key in model and model[plan_key] != facts[key]:
            raise PortingError(
                f"{path}: model.{plan_key} is {model[plan_key]!r}, but the model of --checkpoint "
                f"{source} has {key} {facts[key]}: the plan was made for another model "
                f"({model.get('name', '?')})"
            )


def _planned_and_given(plan: dict, chosen: dict, spec: TrainSpec) -> dict:
    """``{plan field: (its value, the flags' value, the flag)}`` of the layout and settings the
    flags must follow (a dense plan's EP and ETP left out)."""
    model = plan["model"]
    settings = plan.get("settings") or {}
    expect = {
        "layouts[0].layout.tp": (chosen.get("tp"), spec.tp, "--tp"),
        "layouts[0].layout.pp": (chosen.get("pp"), spec.pp, "--pp"),
        "layouts[0].layout.vp": (chosen.get("vp"), spec.vp or 1, "--vp"),
        "layouts[0].layout.cp": (chosen.get("cp"), spec.cp, "--cp"),
        "layouts[0].layout.dp": (chosen.get("dp"), spec.data_parallel, "the data-parallel size"),
        "layouts[0].layout.ep": (chosen.get("ep"), spec.ep, "--ep"),
        "layouts[0].layout.etp": (
            chosen.get("etp"),
            spec.etp if spec.etp is not None else spec.tp,
            "--etp",
        ),
        "layouts[0].layout.micro_batch": (
            chosen.get("micro_batch"),
            spec.micro_batch,
            "--micro-batch",
        ),
        "layouts[0].layout.recompute": (chosen.get("recompute"), spec.recompute, "--recompute"),
        "layouts[0].layout.instances": (
            chosen.get("instances"),
            spec.num_distributed_optimizer_instances,
            "--num-distributed-optimizer-instances",
        ),
        "layouts[0].layout.sequence_parallel": (
            chosen.get("sequence_parallel"),
            spec.sequence_parallel,
            "--sequence-parallel",
        ),
        "global_batch": (plan.get("global_batch"), spec.global_batch, "--global-batch"),
        "seq_length": (plan.get("seq_length"), spec.seq_length, "--seq-length"),
        "settings.distributed_optimizer": (
            settings.get("distributed_optimizer"),
            spec.distributed_optimizer,
            "--no-distributed-optimizer",
        ),
        "settings.overlap_grad_reduce": (
            settings.get("overlap_grad_reduce"),
            spec.overlap_grad_reduce,
            "--overlap-grad-reduce",
        ),
        "settings.overlap_param_gather": (
            # only meaningful with the distributed optimizer (emit drops it otherwise)
            settings.get("overlap_param_gather") and settings.get("distributed_optimizer", True),
            spec.overlap_param_gather,
            "--overlap-param-gather",
        ),
        "settings.grad_reduce_in_fp32": (
            settings.get("grad_reduce_in_fp32"),
            spec.grad_reduce_in_fp32,
            "--grad-reduce-in-bf16",
        ),
    }
    if not model.get("experts"):
        # a dense plan's layout carries EP 1 and ETP 1, which mean nothing without experts
        del expect["layouts[0].layout.ep"], expect["layouts[0].layout.etp"]
    return expect


# The fields of a plan.json that train reads, and their kinds: a plan is input, read as data
# and typed before anything is compared (``true`` is not a TP of 1).
_PLAN_KINDS = {
    "model": dict, "layouts": list, "settings": dict, "global_batch": int, "seq_length": int,
    "layouts[0]": dict, "layouts[0].layout": dict, "layouts[0].rank_order": str,
    **{f"model.{key}": int for _, _, key in SHAPE},
    **{f"layouts[0].layout.{key}": int for key in (
        "tp", "pp", "vp", "cp", "dp", "ep", "etp", "micro_batch", "instances", "first_layers",
        "last_layers")},
    "layouts[0].layout.recompute": str, "layouts[0].layout.sequence_parallel": bool,
    **{f"settings.{key}": bool for key in (
        "distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather",
        "grad_reduce_in_fp32")},
}  # fmt: skip


def _check_plan_types(plan: dict, path: Path) -> None:
    """Each field of :data:`_PLAN_KINDS` that the plan has is of its kind (null where absent
    is allowed), else an error naming the field."""
    names = {
        dict: "an object",
        list: "a list",
        int: "an integer",
        str: "a string",
        bool: "true/false",
    }
    for where, kind in _PLAN_KINDS.items():
        value: object = plan
        for part in where.replace("[0]", ".0").split("."):
            if isinstance(value, list) and part == "0":
                value = value[0] if value else None
            elif isinstance(value, dict):
                value = value.get(part)
            else:
                value = None
        if value is None:
            continue
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
            shown = (
                json.dumps(value)[:40]
                if isinstance(value, str | int | float)
                else type(value).__name__
            )
            raise PortingError(
                f"{path}: {where} is {shown}, not {names[kind]}: not a plan written by "
                "`porting plan --emit`"
            )
