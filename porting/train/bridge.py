"""Continued pretraining on Megatron-Bridge's own training loop (``porting train --engine bridge``).

The current stack (Python 3.12, Megatron-Core 0.19, Megatron-Bridge) has no NeMo 2; its training
loop is Bridge's ``pretrain``. :func:`config` builds Bridge's ``ConfigContainer`` from the same
:class:`~porting.train.checks.TrainSpec` the NeMo 2 engine takes, so every flag means the same on
both engines; a user may change any field of it before :func:`run`. Everything is upstream: the
model provider Bridge reads from the checkpoint's ``run_config.yaml`` (``load_model_config``),
Megatron's GPT dataset over the ``.bin/.idx`` prefixes, Megatron's optimizer and cosine schedule,
Bridge's distributed checkpoints, its resume (``checkpoint.load``) and its start from the imported
weights (``checkpoint.pretrained_checkpoint``: the model only, a fresh optimizer).

The run directory: ``OUT/checkpoints`` is a Megatron-Bridge checkpoint root (``iter_NNNNNNN`` and
``latest_checkpointed_iteration.txt``, with our ``porting/`` metadata beside them), so `porting
export OUT/checkpoints` exports its newest iteration and Bridge's own loaders read it;
``OUT/tb`` holds TensorBoard's events and ``OUT/csv/metrics.csv`` the same columns as the NeMo 2
engine's.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import math
import os
import shutil
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from porting import cpu
from porting.guard import Terminated
from porting.train.checks import (
    TrainSpec,
    bridge_iteration,
    parse_blend,
)
from porting.train.preflight import preflight_bridge
from porting.train.settings import (
    configure_model,
    ddp_settings,
    optimizer_settings,
    wants_bf16,
)

log = logging.getLogger(__name__)

# The NeMo 2 engine's columns (Lightning's "step" beside NeMo's "global_step"), so that a tool
# reading one engine's metrics.csv reads the other's.
METRICS = (
    "step",
    "global_step",
    "reduced_train_loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "val_loss",
    "val_ppl",
)


@dataclass
class BridgeRun:
    """Bridge's configuration of a run; change any field of ``config`` before :func:`run`."""

    spec: TrainSpec
    config: object
    warnings: list[str]


def checkpoints_dir(out: Path) -> Path:
    return Path(out) / "checkpoints"


def config(spec: TrainSpec) -> BridgeRun:
    """Bridge's ``ConfigContainer`` for ``spec`` (checked by :func:`preflight_bridge` first)."""
    from porting.owners import shims

    if spec.world_size == 1:
        # One process, no launcher: Megatron reads its rank from the environment (on import too).
        cpu.ensure_rendezvous_env()
        for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            os.environ.setdefault(name, value)
    shims.bridge_training()
    from megatron.bridge.training.config import (
        ConfigContainer,
        DistributedDataParallelConfig,
        DistributedInitConfig,
        OptimizerConfig,
        RNGConfig,
        TrainingConfig,
        ValidationConfig,
    )
    from megatron.bridge.training.tokenizers.config import TokenizerConfig

    pre = preflight_bridge(spec)
    gpu = cpu.cuda_available()
    bf16 = wants_bf16(spec)
    tokenizer_dir = Path(spec.checkpoint) / "porting" / "tokenizer"
    cfg = ConfigContainer(
        model=_model(spec, bf16),
        train=TrainingConfig(
            train_iters=spec.steps,
            global_batch_size=spec.global_batch,
            micro_batch_size=spec.micro_batch,
        ),
        validation=ValidationConfig(
            eval_interval=spec.eval_every or spec.steps, eval_iters=spec.eval_iters
        ),
        optimizer=OptimizerConfig(**optimizer_settings(spec, bf16), fp16=False),
        scheduler=_scheduler(spec),
        ddp=DistributedDataParallelConfig(**ddp_settings(spec)),
        dataset=_dataset(spec, gpu),
        logger=_logger(spec),
        tokenizer=TokenizerConfig(
            tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tokenizer_dir)
        ),
        checkpoint=_checkpoint(spec, gpu),
        rng=RNGConfig(seed=spec.seed),
        dist=DistributedInitConfig(
            distributed_backend="nccl" if gpu else "gloo",
            use_tp_pp_dp_mapping=spec.use_tp_pp_dp_mapping,
        ),
    )
    return BridgeRun(spec, cfg, pre.warnings)


def _model(spec: TrainSpec, bf16: bool):
    """The checkpoint's model provider (its family's own, registered first), configured for the
    run."""
    from megatron.bridge.training.model_load_save import load_model_config

    from porting.owners.bridge import spec_overrides

    source = bridge_iteration(spec.checkpoint)
    overrides = spec_overrides(str(source))  # registers a family's own provider package first
    model, _ = load_model_config(str(source))
    for key, value in overrides.items():
        setattr(model, key, value)
    configure_model(model, spec, bf16)
    return model


def _dataset(spec: TrainSpec, gpu: bool):
    """Megatron's GPT dataset over ``--data`` (and ``--valid-data``)."""
    from megatron.bridge.training.config import GPTDatasetConfig

    if spec.valid_data:
        valid = _blend(spec.valid_data, "--valid-data")
        # Megatron's builder wants a test split too; training never reads it.
        blend, blend_per_split, split = None, [_blend(spec.data, "--data"), valid, valid], None
    else:
        blend, blend_per_split, split = _blend(spec.data, "--data"), None, spec.split
    return GPTDatasetConfig(
        seq_length=spec.seq_length,
        random_seed=spec.seed,
        blend=blend,
        blend_per_split=blend_per_split,
        split=split,
        reset_attention_mask=False,
        reset_position_ids=False,
        eod_mask_loss=False,
        num_dataset_builder_threads=1,
        path_to_cache=str(Path(spec.out) / "index_cache"),
        dataloader_type="single",
        num_workers=spec.num_workers,
        data_sharding=True,
        pin_memory=gpu,
        # Without Transformer Engine Megatron's local attention needs an explicit causal mask.
        skip_getting_attention_mask_from_dataset=gpu,
    )


def _scheduler(spec: TrainSpec):
    """Cosine decay after a linear warmup that starts where NeMo 2's does."""
    from megatron.bridge.training.config import SchedulerConfig

    return SchedulerConfig(
        lr_decay_style="cosine",
        lr_warmup_iters=spec.warmup,
        # Megatron's warmup starts at lr_warmup_init on the first step (0 by default: a step
        # that changes nothing), NeMo 2's at lr / (warmup + 1); starting there, the two
        # engines apply the same rate at every step (measured: within 3e-10)
        lr_warmup_init=spec.lr / (spec.warmup + 1) if spec.warmup else 0.0,
        lr_decay_iters=spec.steps,
        start_weight_decay=spec.weight_decay,
        end_weight_decay=spec.weight_decay,
        weight_decay_incr_style="constant",
    )


def _logger(spec: TrainSpec):
    """A line a step, TensorBoard, the run's config saved; Bridge's narration only with -v."""
    from megatron.bridge.training.config import LoggerConfig

    return LoggerConfig(
        log_interval=1,
        tensorboard_dir=str(Path(spec.out) / "tb"),
        # Bridge's set-up narration (and its own per-step line) only with -v; its filter of
        # WARNING records would also drop ours.
        logging_level=logging.INFO if log.isEnabledFor(logging.DEBUG) else logging.WARNING,
        filter_warnings=False,
        save_config_filepath=str(Path(spec.out) / "bridge_config.yaml"),
    )


def _checkpoint(spec: TrainSpec, gpu: bool):
    """The imported checkpoint to start from, and where the run's own go (torch_dist)."""
    from megatron.bridge.training.config import CheckpointConfig

    ckpts = checkpoints_dir(spec.out)
    return CheckpointConfig(
        pretrained_checkpoint=str(spec.checkpoint),
        save=str(ckpts) if spec.save_every else None,
        load=str(ckpts),
        save_interval=spec.save_every or None,
        ckpt_format="torch_dist",
        save_optim=True,
        save_rng=True,
        async_save=False,
        fully_parallel_save=gpu,
        dist_ckpt_optim_fully_reshardable=spec.optim_fully_reshardable,
    )


def _blend(items: list[str], flag: str) -> list:
    """Megatron's ``[prefixes, weights or None]`` for ``--data``-style items."""
    blend = parse_blend(items, flag)
    if isinstance(blend, tuple):
        return [blend[0], blend[1]]
    return [blend, None]


def run(r: BridgeRun) -> Path:
    """Run Bridge's ``pretrain`` for ``r``; returns the run directory."""
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    spec = r.spec
    out = Path(spec.out)
    for w in r.warnings:
        log.warning(w)
    if os.environ.get("RANK", "0") == "0":
        _place_metadata(Path(spec.checkpoint), checkpoints_dir(out))
    cpu.enable_training()
    metrics = _metrics(spec)
    with contextlib.nullcontext() if log.isEnabledFor(logging.DEBUG) else _narration_to(out):
        pretrain(r.config, forward_step, callbacks=[metrics])
    if os.environ.get("RANK", "0") == "0":
        record = asdict(spec) | {"checkpoint": str(spec.checkpoint), "out": str(out)}
        record |= {"engine": "bridge", "built": metrics.built}
        (out / "run.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    return out


@contextlib.contextmanager
def _narration_to(out: Path):
    """Bridge's and Megatron's narration (printed set-up, per-iteration lines, memory reports,
    their log records and Python warnings) into ``OUT/logs/rank<N>.log``, whole, rather than the
    terminal, which keeps one line per step (ours) and errors. ``-v`` leaves it all on the
    terminal."""
    rank = os.environ.get("RANK", "0")
    path = out / "logs" / f"rank{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    megatron = logging.getLogger("megatron")
    errors = logging.StreamHandler()
    errors.setLevel(logging.ERROR)
    # Bridge logs a stop (SIGTERM, Ctrl-C) as a failure with its traceback; `porting train` says
    # itself what a stop kept.
    errors.addFilter(
        lambda record: (
            not (
                record.exc_info and isinstance(record.exc_info[1], (KeyboardInterrupt, Terminated))
            )
        )
    )
    with open(path, "a", buffering=1) as fh, contextlib.redirect_stdout(fh):
        to_file = logging.StreamHandler(fh)
        to_file.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        handlers, propagate = megatron.handlers[:], megatron.propagate
        megatron.handlers[:] = [to_file, errors]
        megatron.propagate = False
        show = warnings.showwarning
        warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: (
            fh.write(warnings.formatwarning(message, category, filename, lineno, line))
        )
        try:
            yield path
        finally:
            warnings.showwarning = show
            megatron.handlers[:], megatron.propagate = handlers, propagate


def _place_metadata(source: Path, ckpts: Path) -> None:
    """Our ``porting/`` metadata (manifest, tokenizer, HF extras) beside the iterations, so that
    the run's checkpoint root is a checkpoint `porting export` reads."""
    target = ckpts / "porting"
    if target.exists():
        return
    ckpts.mkdir(parents=True, exist_ok=True)
    tmp = ckpts / ".porting.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source / "porting", tmp)
    os.replace(tmp, target)


def _metrics(spec: TrainSpec):
    """A Bridge callback (its class is defined here: ``megatron.bridge`` is imported only after
    :func:`porting.owners.shims.bridge_training`)."""
    from megatron.bridge.training.callbacks import Callback

    class Metrics(_Metrics, Callback):
        pass

    return Metrics(spec)


class _Metrics:
    """One log line and one ``OUT/csv/metrics.csv`` row per step, one per validation, written by
    the last rank: the losses exist on the last pipeline stage only (as Megatron's own log)."""

    def __init__(self, spec: TrainSpec) -> None:
        self.spec = spec
        self.tokens_per_step = spec.global_batch * spec.seq_length
        self.path = Path(spec.out) / "csv" / "metrics.csv"
        self._start = 0.0
        self._lr: float | None = None
        self._last_loss: float | None = None
        self._validated: set[int] = set()
        self.built: dict = {}

    def _writer(self) -> bool:
        if not torch.distributed.is_initialized():
            return True
        return torch.distributed.get_rank() == torch.distributed.get_world_size() - 1

    def _row(self, **values) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists()
        with open(self.path, "a", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=METRICS)
            if new:
                w.writeheader()
            w.writerow({k: ("" if v is None else v) for k, v in values.items()})

    def on_train_start(self, context) -> None:
        """What Megatron built: its process groups' sizes and the optimizer (``run.json``)."""
        from megatron.core import parallel_state as ps
        from megatron.core.utils import get_attr_wrapped_model

        optimizer = context.optimizer
        inner = getattr(optimizer, "chained_optimizers", [optimizer])[0]
        self.built = {
            "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "cp": ps.get_context_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(),
            "ep": ps.get_expert_model_parallel_world_size(),
            "optimizer": type(inner).__name__,
            "inner_optimizer": type(getattr(inner, "optimizer", inner)).__name__,
            "layers_this_rank": sum(
                len(get_attr_wrapped_model(m, "decoder").layers) for m in context.model
            ),
        }

    def on_train_step_start(self, context) -> None:
        self._start = time.perf_counter()
        # the rate this step applies: the scheduler moves it on once the step is done
        self._lr = context.optimizer.param_groups[0]["lr"] if context.optimizer else None

    def on_train_step_end(self, context) -> None:
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        if not self._writer():
            return
        step = context.state.train_state.step  # not yet advanced: this step's 0-based index
        losses = context.loss_dict or {}
        loss = losses.get("lm loss")
        loss = None if loss is None else float(loss)
        self._last_loss = loss
        lr = self._lr
        tokens_per_s = self.tokens_per_step / elapsed
        self._row(
            step=step,
            global_step=step,
            reduced_train_loss=loss,
            lr=lr,
            grad_norm=context.grad_norm,
            tokens_per_s=tokens_per_s,
        )
        log.info(
            "step %d/%d  loss %s  lr %s  %.0f tokens/s",
            step + 1,
            self.spec.steps,
            "-" if loss is None else f"{loss:.4f}",
            "-" if lr is None else f"{lr:.3g}",
            tokens_per_s,
        )

    def on_eval_end(self, context) -> None:
        if not self._writer():
            return
        totals = context.total_loss_dict or {}
        loss = totals.get("lm loss")
        if loss is None:
            return
        loss = float(loss)  # Bridge has divided the summed losses by their count
        ppl = math.exp(min(loss, 80.0))
        step = context.state.train_state.step - 1
        if step in self._validated:
            # Bridge validates once more after the last step (pretrain.py), on the next batches;
            # the step's first validation is its record, as with the NeMo 2 engine.
            return
        self._validated.add(step)
        self._row(step=step, global_step=step, val_loss=loss, val_ppl=ppl)
        log.info(
            "step %d/%d  loss %s  val_loss %.4f  val_ppl %.3f",
            step + 1,
            self.spec.steps,
            "-" if self._last_loss is None else f"{self._last_loss:.4f}",
            loss,
            ppl,
        )
