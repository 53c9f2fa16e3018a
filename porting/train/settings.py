"""What a run's spec sets in Megatron, the same on both engines (NeMo 2's recipe and
Megatron-Bridge's loop): the model config's layout, dtypes and recompute, the optimizer's and
data parallelism's settings, and what a checkpoint records of the layout it was saved at."""

from __future__ import annotations

from typing import TYPE_CHECKING

from porting.errors import PortingError

if TYPE_CHECKING:
    from porting.train.checks import TrainSpec


def wants_bf16(spec: TrainSpec) -> bool:
    """Whether the run computes in bf16: ``--precision``, or bf16 on GPUs and fp32 on the CPU."""
    from porting import cpu

    gpu = cpu.cuda_available()
    precision = spec.precision if spec.precision != "auto" else ("bf16" if gpu else "fp32")
    if precision == "bf16" and not gpu:
        raise PortingError("--precision bf16 needs GPUs; on the CPU training runs in fp32")
    return precision == "bf16"


def configure_model(cfg, spec: TrainSpec, bf16: bool) -> None:
    """Set, in place, what ``spec`` asks of the model's Megatron config (NeMo 2's model config or
    Megatron-Bridge's provider, one engine each): the layout, the dtypes, recompute, and the
    fusions this machine has kernels for."""
    import torch

    from porting import cpu

    cfg.seq_length = spec.seq_length
    cfg.tensor_model_parallel_size = spec.tp
    cfg.pipeline_model_parallel_size = spec.pp
    cfg.virtual_pipeline_model_parallel_size = spec.vp
    cfg.context_parallel_size = spec.cp
    cfg.expert_model_parallel_size = spec.ep
    cfg.expert_tensor_parallel_size = spec.etp if spec.etp is not None else spec.tp
    cfg.sequence_parallel = spec.sequence_parallel
    cfg.num_layers_in_first_pipeline_stage = spec.first_stage_layers
    cfg.num_layers_in_last_pipeline_stage = spec.last_stage_layers
    # Weights are stored in the checkpoint's dtype; training keeps fp32 master weights and casts
    # (bf16 on GPUs).
    cfg.params_dtype = torch.float32
    cfg.bf16, cfg.fp16 = bf16, False
    cfg.pipeline_dtype = torch.bfloat16 if bf16 else torch.float32
    cfg.autocast_dtype = cfg.pipeline_dtype
    # The restored checkpoint overwrites the initial values, but initialization must run:
    # megatron/core/tensor_parallel/layers.py marks a weight as tensor-parallel
    # (``tensor_model_parallel``, ``partition_dim``) only inside its init functions. Without the
    # marks every TP-sharded weight counts as a replica on TP ranks > 0, and the gradient norm
    # behind clipping (optimizer.py: get_main_grads_for_grad_norm) leaves those shards out
    # (measured at TP=2: first-step norm 2.032 instead of 2.204, losses apart from step 3 on).
    cfg.perform_initialization = True
    if spec.recompute == "selective":
        cfg.recompute_granularity = "selective"
    elif spec.recompute == "full":
        cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers = (
            "full",
            "uniform",
            1,
        )
    cpu.kernel_safe_config(cfg)


def optimizer_settings(spec: TrainSpec, bf16: bool) -> dict:
    """Megatron's ``OptimizerConfig`` fields for ``spec``, on both engines: Adam (0.9, 0.95),
    decaying to ``--min-lr`` (lr / 10 unless given), clipping, fp32 master weights."""
    import torch

    return dict(
        optimizer="adam",
        lr=spec.lr,
        min_lr=spec.min_lr if spec.min_lr is not None else spec.lr / 10,
        weight_decay=spec.weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.95,
        clip_grad=spec.clip_grad,
        bf16=bf16,
        params_dtype=torch.float32,
        use_distributed_optimizer=spec.distributed_optimizer,
    )


def ddp_settings(spec: TrainSpec) -> dict:
    """Megatron's ``DistributedDataParallelConfig`` fields for ``spec``, on both engines."""
    return dict(
        use_distributed_optimizer=spec.distributed_optimizer,
        grad_reduce_in_fp32=spec.grad_reduce_in_fp32,
        overlap_grad_reduce=spec.overlap_grad_reduce,
        overlap_param_gather=spec.overlap_param_gather,
        check_for_nan_in_grad=True,
        num_distributed_optimizer_instances=spec.num_distributed_optimizer_instances,
    )


def saved_layout(spec: TrainSpec) -> dict:
    """What a checkpoint records about the layout it was saved at (``context/train_layout.json``)."""
    return {
        "tp": spec.tp,
        "pp": spec.pp,
        "vp": spec.vp,
        "cp": spec.cp,
        "dp": spec.data_parallel,
        "distributed_optimizer": spec.distributed_optimizer,
        "optimizer_format": (
            None
            if not spec.distributed_optimizer
            else "fully_reshardable"
            if spec.optim_fully_reshardable
            else "dp_reshardable"
        ),
        "global_batch": spec.global_batch,
        "seq_length": spec.seq_length,
    }
