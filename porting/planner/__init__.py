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

from porting.planner.cluster import Cluster, cluster_from_dict, load_cluster
from porting.planner.comm import Efficiency
from porting.planner.model import PRESETS, ModelShape, from_hf_config, load_model
from porting.planner.perf import Evaluator, Infeasible, Layout, Prediction, Settings
from porting.planner.search import Plan, Rejected, plan

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
