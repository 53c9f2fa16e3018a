"""Megatron-Bridge's own loader and training loop, run on the current stack (.venv, scripts/env.sh).

``python -m porting.owners.bridge load CKPT [CKPT ...] --tokens T.pt --out L.pt`` loads each
CKPT's newest iteration with ``megatron.bridge.training.model_load_save.load_megatron_model`` (the
model built from its ``run_config.yaml`` by Bridge) and saves the logits of the token ids in T.pt
to L.pt: one list per checkpoint, in order (one process for many checkpoints: Bridge's start-up
is most of a load).

``python -m porting.owners.bridge train CKPT --steps N --save DIR`` runs N steps of Bridge's
``pretrain`` loop on its mock dataset, starting from CKPT's weights (``pretrained_checkpoint``),
with the model provider read from CKPT by Bridge's ``load_model_config``, and saves to DIR.

Without Transformer Engine (on the CPU), a ``run_config.yaml`` that names Bridge's
``default_layer_spec`` (Transformer Engine layers) is built with Bridge's ``local_layer_spec``,
through the loader's own ``mp_overrides``: the same parameters under the same checkpoint keys.
A family's own spec (Gemma's, OLMo 2's, gpt-oss's) picks the local layers itself, and is left as
named; so is a family's own provider (Falcon's, ``models.falcon_bridge``): its package's prefix
is registered with Bridge's ``register_allowed_target_prefix``, as a user who loads such a
checkpoint in Bridge does (docs/formats.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def _setup() -> None:
    from porting.owners import shims

    shims.one_cpu_process()
    torch.distributed.init_process_group("gloo")


def _iteration(ckpt: str) -> str:
    root = Path(ckpt)
    text = (root / "latest_checkpointed_iteration.txt").read_text().strip()
    return str(root / f"iter_{int(text):07d}")


_BRIDGE_SPEC = "megatron.bridge.models.gpt_provider.default_layer_spec"


def spec_overrides(iteration: str) -> dict:
    """Bridge's local spec where Transformer Engine's cannot be built and the checkpoint names
    Bridge's own spec; a family's own spec's package registered (see the docstring)."""
    import importlib.util

    import yaml
    from megatron.bridge.utils.instantiate_utils import register_allowed_target_prefix

    model = yaml.safe_load((Path(iteration) / "run_config.yaml").read_text())["model"]
    target = (model.get("transformer_layer_spec") or {}).get("_target_", "")
    named = [model["_target_"]]  # the provider: Bridge's, or a family's own (Falcon's)
    named += [v["_target_"] for v in model.values() if isinstance(v, dict) and "_target_" in v]
    for name in named:
        if not name.startswith(("megatron.", "torch.")):
            register_allowed_target_prefix(name.split(".")[0] + ".")
    if target != _BRIDGE_SPEC or importlib.util.find_spec("transformer_engine") is not None:
        return {}
    from megatron.bridge.models.gpt_provider import local_layer_spec

    return {"transformer_layer_spec": local_layer_spec}


def load(ckpt: str, tokens: list[torch.Tensor]) -> list[torch.Tensor]:
    """Logits of the model Bridge loads from ``ckpt`` (its root), one per token-id tensor."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    from megatron.bridge.training.model_load_save import load_megatron_model

    path = _iteration(ckpt)
    model = load_megatron_model(
        path, use_cpu_init=True, skip_temp_dist_context=True, mp_overrides=spec_overrides(path)
    )
    model = model[0] if isinstance(model, list) else model
    model.eval()
    print(f"megatron-bridge loaded {path} as {type(model).__name__}")
    out = []
    with torch.no_grad():
        for ids in tokens:
            ids = ids.view(1, -1)
            out.append(model(ids, torch.arange(ids.shape[1]).view(1, -1), None).float())
    return out


def train(ckpt: str, steps: int, save: str) -> None:
    """``steps`` steps of Bridge's ``pretrain`` from ``ckpt``'s weights; saves into ``save``."""
    from porting.owners import shims

    shims.bridge_training()
    from megatron.bridge.training.config import (
        CheckpointConfig,
        ConfigContainer,
        DistributedDataParallelConfig,
        DistributedInitConfig,
        LoggerConfig,
        MockGPTDatasetConfig,
        OptimizerConfig,
        RNGConfig,
        SchedulerConfig,
        TrainingConfig,
        ValidationConfig,
    )
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.model_load_save import load_model_config
    from megatron.bridge.training.pretrain import pretrain
    from megatron.bridge.training.tokenizers.config import TokenizerConfig

    from porting import cpu

    overrides = spec_overrides(_iteration(ckpt))
    model, _ = load_model_config(_iteration(ckpt))
    for key, value in overrides.items():
        setattr(model, key, value)
    # Fused kernels off where they do not exist (on the CPU, all): Bridge warms each up first.
    cpu.kernel_safe_config(model)
    seq = 16
    model.seq_length = seq
    cfg = ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=steps, global_batch_size=2, micro_batch_size=1),
        validation=ValidationConfig(eval_interval=1000, eval_iters=0),
        optimizer=OptimizerConfig(
            optimizer="adam",
            lr=1e-3,
            min_lr=1e-4,
            use_distributed_optimizer=False,
            bf16=False,
            fp16=False,
            clip_grad=1.0,
        ),
        scheduler=SchedulerConfig(
            lr_decay_style="constant",
            lr_warmup_iters=0,
            start_weight_decay=0.01,
            end_weight_decay=0.01,
            weight_decay_incr_style="constant",
        ),
        ddp=DistributedDataParallelConfig(
            use_distributed_optimizer=False, overlap_grad_reduce=False, overlap_param_gather=False
        ),
        dataset=MockGPTDatasetConfig(
            seq_length=seq,
            random_seed=1234,
            reset_attention_mask=False,
            reset_position_ids=False,
            eod_mask_loss=False,
            num_dataset_builder_threads=1,
            split="9999,8,2",
            dataloader_type="single",
            num_workers=0,
            skip_getting_attention_mask_from_dataset=True,
        ),
        logger=LoggerConfig(log_interval=1),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=model.vocab_size),
        checkpoint=CheckpointConfig(
            pretrained_checkpoint=ckpt,
            save=save,
            save_interval=steps,
            ckpt_format="torch_dist",
            save_optim=False,
            save_rng=False,
            async_save=False,
            fully_parallel_save=False,
        ),
        rng=RNGConfig(seed=1234),
        dist=DistributedInitConfig(distributed_backend="gloo"),
    )
    pretrain(cfg, forward_step)
    print(f"megatron-bridge trained {steps} steps from {ckpt} into {save}")


def main(argv: list[str] | None = None) -> int:
    """``load`` or ``train`` (see the module docstring)."""
    p = argparse.ArgumentParser(
        allow_abbrev=False, prog="porting.owners.bridge", description=__doc__
    )
    p.add_argument("action", choices=["load", "train"])
    p.add_argument(
        "ckpt", nargs="+", help="checkpoint root (latest_checkpointed_iteration.txt beside iter_*)"
    )
    p.add_argument("--tokens", help="load: torch file with a list of 1-D token id tensors")
    p.add_argument("--out", help="load: torch file to write the logits to")
    p.add_argument("--steps", type=int, default=3, help="train: how many steps")
    p.add_argument("--save", help="train: directory to save into")
    a = p.parse_args(argv)
    if a.action == "train" and len(a.ckpt) != 1:
        p.error("train starts from one checkpoint")
    _setup()
    if a.action == "load":
        tokens = torch.load(a.tokens, weights_only=True)
        torch.save([load(ckpt, tokens) for ckpt in a.ckpt], a.out)
    else:
        train(a.ckpt[0], a.steps, a.save)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
