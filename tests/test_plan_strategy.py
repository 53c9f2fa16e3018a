"""The emitted NeMo 2.0 MegatronStrategy snippet constructs on the CPU (the planner's one NeMo
import: about 30 s, so only here)."""

from __future__ import annotations

from pathlib import Path

from porting.commands.plan import parse_layout
from porting.planner import Evaluator, load_cluster, plan
from porting.planner.emit import strategy_snippet
from porting.planner.model import PRESETS

THREE = Path(__file__).resolve().parents[1] / "examples" / "clusters" / "three-sites.yaml"


def test_emitted_megatron_strategy_constructs_on_cpu():
    cluster = load_cluster(THREE)
    result = plan(PRESETS["llama-70b"], cluster, 4096, 1024)
    ev = Evaluator(PRESETS["llama-70b"], cluster, 4096, 1024, result.settings, result.eff)
    layout = parse_layout("tp=8,pp=4,vp=5,cp=1,mb=1,recompute=selective", ev)
    chosen = ev.predict(layout)
    namespace: dict = {}
    exec(compile(strategy_snippet(chosen, result), "strategy.py", "exec"), namespace)
    strategy = namespace["strategy"]
    assert type(strategy).__name__ == "MegatronStrategy"
    assert strategy.tensor_model_parallel_size == 8
    assert strategy.pipeline_model_parallel_size == 4
    assert strategy.virtual_pipeline_model_parallel_size == 5
    assert strategy.context_parallel_size == 1
    assert strategy.sequence_parallel is True
    assert strategy.use_tp_pp_dp_mapping is True
    assert strategy.num_distributed_optimizer_instances == 4
    assert strategy.ddp_config.num_distributed_optimizer_instances == 4
    assert strategy.ddp_config.use_distributed_optimizer is True
