"""Training-layout planner: which TP/PP/CP/DP, where the ranks go, how long a step takes.

``porting plan`` (``porting/commands/plan.py``) is the command; the pieces are plain functions and
dataclasses that tests call directly:

- :mod:`~porting.planner.model`: model shapes (HF config, imported checkpoint, presets)
- :mod:`~porting.planner.cluster`: sites, levels and inter-site links from a YAML file
- :mod:`~porting.planner.placement`: which node/site each parallel group's ranks sit on
- :mod:`~porting.planner.comm`: alpha-beta collective costs, link sharing, the NCCL window
- :mod:`~porting.planner.perf`: step time and memory of one layout
- :mod:`~porting.planner.search`: every valid layout, ranked, with rejection reasons
- :mod:`~porting.planner.emit`, :mod:`~porting.planner.calibrate`, :mod:`~porting.planner.plot`

Nothing here imports NeMo, Megatron or torch: planning a 512-GPU cluster takes well under 2 s.
"""

import importlib

# Each name is imported from its module when first asked for: the command line imports
# porting.planner.limits to declare `porting plan`'s flags, and every other command (a
# prep-data run starts its workers only once its parser is built) would otherwise pay for
# numpy and the registry here (0.19 s measured).
_WHERE = {
    "Cluster": "cluster",
    "cluster_from_dict": "cluster",
    "load_cluster": "cluster",
    "Efficiency": "comm",
    "PRESETS": "model",
    "ModelShape": "model",
    "from_hf_config": "model",
    "load_model": "model",
    "Evaluator": "perf",
    "Infeasible": "perf",
    "Layout": "perf",
    "Prediction": "perf",
    "Settings": "perf",
    "Plan": "search",
    "Rejected": "search",
    "plan": "search",
}


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{where}"), name)
    globals()[name] = value
    return value


__all__ = [
    "PRESETS",
    "Cluster",
    "Efficiency",
    "Evaluator",
    "Infeasible",
    "Layout",
    "ModelShape",
    "Plan",
    "Prediction",
    "Rejected",
    "Settings",
    "cluster_from_dict",
    "from_hf_config",
    "load_cluster",
    "load_model",
    "plan",
]
