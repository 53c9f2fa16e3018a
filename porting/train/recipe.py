"""Continued pretraining of an imported checkpoint with NeMo 2.0 / Megatron-Core.

:func:`recipe` returns the NeMo objects (model, data, trainer, optimizer, logger, resume) in the
NeMo 2.0 recipe style, so a user can change any field before :func:`run` calls ``llm.train``.
Everything is upstream machinery: ``MegatronStrategy`` (TP, PP, virtual PP, SP, CP, the
distributed optimizer), ``MegatronMixedPrecision`` (bf16 on GPUs), Megatron's GPT dataset over
``.bin/.idx`` prefixes through ``PreTrainingDataModule``, ``MegatronOptimizerModule`` with a cosine
schedule, ``NeMoLogger`` checkpoints and ``AutoResume``. The imported weights are restored (not a
fresh init) with a fresh optimizer; an interrupted run resumes from its last checkpoint, at the same
or another layout (Megatron's distributed checkpoints reshard on load).

The checks made before anything is launched live in :mod:`porting.train.checks` (no NeMo import);
:func:`recipe` runs them again in each rank.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback
from nemo.lightning.ckpt_utils import ckpt_to_dir
from nemo.lightning.pytorch.callbacks import ModelCheckpoint

from porting import cpu
from porting.errors import PortingError
from porting.train.checks import (
    BEST_FILE,
    LAYOUT_FILE,
    TrainSpec,
    megatron_paths,
    read_json,
)
from porting.train.checks import max_token_id as max_token_id
from porting.train.checks import parse_blend as parse_blend
from porting.train.checks import validate as validate
from porting.train.preflight import preflight
from porting.train.settings import (
    configure_model,
    ddp_settings,
    optimizer_settings,
    saved_layout,
    wants_bf16,
)

log = logging.getLogger(__name__)


@dataclass
class Recipe:
    """The NeMo objects of a run; change any of them before :func:`run`."""

    spec: TrainSpec
    model: object
    data: object
    trainer: object
    optim: object
    log: object
    resume: object
    warnings: list[str]


def recipe(spec: TrainSpec) -> Recipe:
    """Build the NeMo 2.0 objects for ``spec`` (checked by :func:`preflight` first)."""
    from nemo.collections.common.tokenizers.huggingface.auto_tokenizer import AutoTokenizer

    from porting.convert.checkpoint import tokenizer_files
    from porting.convert.connectors import model_class

    pre = preflight(spec)
    tok_files = tokenizer_files(spec.checkpoint, pre.manifest)
    if not tok_files:
        raise PortingError(f"{spec.checkpoint}: the manifest names no tokenizer; cannot train")
    model = model_class(pre.family)(pre.config, tokenizer=AutoTokenizer(str(tok_files[0].parent)))
    gpu = cpu.cuda_available()
    bf16 = wants_bf16(spec)
    configure_model(model.config, spec, bf16)
    return Recipe(
        spec,
        model,
        _data_module(spec, model.tokenizer, gpu),
        _trainer(spec, model.config, gpu, bf16),
        _optimizer(spec, bf16),
        _logger(spec),
        _resume(spec),
        pre.warnings,
    )


def _data_module(spec: TrainSpec, tokenizer, gpu: bool):
    """NeMo's pretraining data module over ``--data`` (and ``--valid-data``)."""
    from nemo.collections import llm

    paths: list | dict[str, list] = megatron_paths(spec.data, "--data")
    if spec.valid_data:
        valid = megatron_paths(spec.valid_data, "--valid-data")
        # NeMo's data module needs a test split too; training never reads it.
        paths = {"train": paths, "validation": valid, "test": valid}
    return llm.PreTrainingDataModule(
        paths=paths,
        seq_length=spec.seq_length,
        tokenizer=tokenizer,
        micro_batch_size=spec.micro_batch,
        global_batch_size=spec.global_batch,
        num_workers=spec.num_workers,
        pin_memory=gpu,
        # Without Transformer Engine, NeMo's gpt_forward_step needs an explicit mask.
        create_attention_mask=not gpu,
        seed=spec.seed,
        split=None if spec.valid_data else spec.split,
        index_mapping_dir=str(Path(spec.out) / "index_cache"),
    )


def _trainer(spec: TrainSpec, cfg, gpu: bool, bf16: bool):
    """Lightning's trainer on NeMo's Megatron strategy: the layout, DDP, precision, schedule of
    validation and checkpoints, our per-step lines."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from nemo import lightning as nl

    ddp = DistributedDataParallelConfig(**ddp_settings(spec))
    strategy = nl.MegatronStrategy(
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
        virtual_pipeline_model_parallel_size=spec.vp,
        # NeMo's strategy copies its own values of these into the model config (None unset).
        num_layers_in_first_pipeline_stage=spec.first_stage_layers,
        num_layers_in_last_pipeline_stage=spec.last_stage_layers,
        context_parallel_size=spec.cp,
        expert_model_parallel_size=spec.ep,
        expert_tensor_parallel_size=spec.etp,
        sequence_parallel=spec.sequence_parallel,
        pipeline_dtype=cfg.pipeline_dtype,
        use_tp_pp_dp_mapping=spec.use_tp_pp_dp_mapping,
        # The strategy copies its own value into the DDP config (megatron_strategy.py), so the
        # instances are given to both.
        num_distributed_optimizer_instances=spec.num_distributed_optimizer_instances,
        ddp=ddp,
        ckpt_async_save=gpu,
        ckpt_load_optimizer=True,
        ckpt_save_optimizer=True,
        ckpt_optim_fully_reshardable=spec.optim_fully_reshardable,
    )
    plugins = [nl.MegatronMixedPrecision(precision="bf16-mixed")] if bf16 else []
    return nl.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=spec.gpus_per_node,
        num_nodes=spec.nodes,
        max_steps=spec.steps,
        strategy=strategy,
        plugins=plugins,
        log_every_n_steps=1,
        val_check_interval=spec.eval_every or spec.steps,
        limit_val_batches=spec.eval_iters,
        num_sanity_val_steps=0,
        # our ThroughputLogger prints one line per step instead of Lightning's bar and summary
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        enable_checkpointing=spec.save_every > 0,
        callbacks=[ThroughputLogger(spec.global_batch * spec.seq_length), BuiltLayout()],
    )


def _optimizer(spec: TrainSpec, bf16: bool):
    """Megatron's optimizer under a cosine schedule with linear warmup."""
    from megatron.core.optimizer import OptimizerConfig
    from nemo.lightning.pytorch.optim import CosineAnnealingScheduler, MegatronOptimizerModule

    opt = OptimizerConfig(**optimizer_settings(spec, bf16))
    sched = CosineAnnealingScheduler(
        warmup_steps=spec.warmup,
        constant_steps=0,
        max_steps=spec.steps,
        min_lr=opt.min_lr,
    )
    return MegatronOptimizerModule(config=opt, lr_scheduler=sched)


def _logger(spec: TrainSpec):
    """NeMo's logger: the run directory, its self-describing checkpoints, TensorBoard and CSV."""
    from nemo import lightning as nl

    ckpt_cb = (
        None
        if spec.save_every == 0
        else SelfDescribingCheckpoint(
            source=Path(spec.checkpoint),
            layout=saved_layout(spec),
            every_n_train_steps=spec.save_every,
            save_last=True,
            save_top_k=-1,
            monitor="step",
            mode="max",
            save_optim_on_train_end=True,
            filename="{step}",
        )
    )
    return nl.NeMoLogger(
        explicit_log_dir=str(spec.out),
        update_logger_directory=False,
        ckpt=ckpt_cb,
        tensorboard=_tensorboard_logger(spec.out),
        extra_loggers=[_csv_logger(spec.out)],
    )


def _resume(spec: TrainSpec):
    """The run's last checkpoint where there is one, else the imported checkpoint's weights."""
    from nemo import lightning as nl

    return nl.AutoResume(
        restore_config=nl.RestoreConfig(path=str(spec.checkpoint), load_optim_state=False),
        resume_if_exists=True,
        resume_ignore_no_checkpoint=True,
    )


def _fmt(value) -> str:
    return f"{float(value):.4f}" if value is not None else "-"


class ThroughputLogger(Callback):
    """Logs ``tokens_per_s`` (global batch x sequence / step time), ``val_ppl`` (exp of the
    validation loss) and, on GPUs, ``gpu_mem_gib``; prints one line per step (loss, learning
    rate, tokens/s) and one per validation (training and validation loss, perplexity) in place of
    Lightning's bar.

    A Lightning batch under MegatronStrategy is one global step (all micro-batches), so one
    timing per batch is one optimizer step. Only the first rank prints.
    """

    def __init__(self, tokens_per_step: int) -> None:
        self.tokens_per_step = tokens_per_step
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        tokens_per_s = self.tokens_per_step / elapsed
        pl_module.log("tokens_per_s", tokens_per_s, batch_size=1)
        if torch.cuda.is_available():
            pl_module.log("gpu_mem_gib", torch.cuda.max_memory_allocated() / 2**30, batch_size=1)
        if trainer.global_rank == 0:
            m = trainer.callback_metrics
            loss, lr = m.get("reduced_train_loss"), m.get("lr")
            log.info(
                "step %d/%d  loss %s  lr %s  %.0f tokens/s",
                trainer.global_step,
                trainer.max_steps,
                _fmt(loss),
                f"{float(lr):.3g}" if lr is not None else "-",
                tokens_per_s,
            )

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        """``val_ppl`` = exp(``val_loss``), logged at the same step.

        Lightning has reduced NeMo's ``val_loss`` (megatron_strategy.py: validation_step, summed
        over pipeline stages) by the time this hook runs, on every rank alike.
        """
        loss = trainer.callback_metrics.get("val_loss")
        if trainer.sanity_checking or loss is None:
            return
        pl_module.log("val_ppl", math.exp(min(float(loss), 80.0)), on_epoch=True, batch_size=1)

    def on_validation_end(self, trainer, pl_module) -> None:
        m = trainer.callback_metrics
        loss = m.get("val_loss")
        if trainer.global_rank == 0 and loss is not None and not trainer.sanity_checking:
            log.info(
                "step %d/%d  loss %s  val_loss %s  val_ppl %s",
                trainer.global_step,
                trainer.max_steps,
                _fmt(m.get("reduced_train_loss")),
                _fmt(loss),
                f"{float(m['val_ppl']):.3f}" if m.get("val_ppl") is not None else "-",
            )


class BuiltLayout(Callback):
    """Records what the trainer actually built, as the run starts: the process-group sizes Megatron
    set up, the strategy's and DDP's settings, the model's recompute settings, the batch sizes and
    the optimizer's class. :func:`run` writes it into ``run.json`` (key ``built``)."""

    def __init__(self) -> None:
        self.built: dict = {}

    def on_train_start(self, trainer, pl_module) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.transformer_layer import TransformerLayer

        strategy = trainer.strategy
        ddp = strategy.ddp_config
        config = pl_module.config
        data = trainer.datamodule
        optimizers = [getattr(o, "mcore_optimizer", o) for o in trainer.optimizers]
        chained = [getattr(o, "chained_optimizers", [o]) for o in optimizers]
        self.built = {
            "world_size": trainer.world_size,
            "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "vp": ps.get_virtual_pipeline_model_parallel_world_size(),
            "cp": ps.get_context_parallel_world_size(),
            "ep": ps.get_expert_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(),
            "sequence_parallel": bool(config.sequence_parallel),
            "use_tp_pp_dp_mapping": bool(strategy.use_tp_pp_dp_mapping),
            "num_layers_in_first_pipeline_stage": config.num_layers_in_first_pipeline_stage,
            "num_layers_in_last_pipeline_stage": config.num_layers_in_last_pipeline_stage,
            # on this rank: the first stage's share where rank 0 reports
            "layers_built": sum(isinstance(m, TransformerLayer) for m in pl_module.modules()),
            "use_distributed_optimizer": bool(ddp.use_distributed_optimizer),
            "num_distributed_optimizer_instances": ddp.num_distributed_optimizer_instances,
            "overlap_grad_reduce": bool(ddp.overlap_grad_reduce),
            "overlap_param_gather": bool(ddp.overlap_param_gather),
            "grad_reduce_in_fp32": bool(ddp.grad_reduce_in_fp32),
            "recompute_granularity": config.recompute_granularity,
            "recompute_method": config.recompute_method,
            "micro_batch": data.micro_batch_size if data is not None else None,
            "global_batch": data.global_batch_size if data is not None else None,
            "seq_length": config.seq_length,
            "optimizer": sorted({type(o).__name__ for group in chained for o in group}),
            "megatron_timers": strategy.timers is not None,
        }


class SelfDescribingCheckpoint(ModelCheckpoint):
    """NeMo's ModelCheckpoint that also copies our manifest into every checkpoint's context, records
    the layout it was saved at, and marks the best-validation checkpoint.

    A training checkpoint then exports on its own, like an imported one. ``checkpoints/best``
    links the checkpoint with the lowest validation loss among those validated at their own step
    (validation runs right after the save of the same step); ``checkpoints/best.json`` keeps the
    validation history across restarts. Only the first rank writes files.
    """

    def __init__(self, *args, source: Path, layout: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._source = Path(source)
        self._layout = layout or {}
        self._history: dict[int, dict] | None = None
        self._saved: dict[int, str] = {}

    def _get_finalize_save_checkpoint_callback(self, trainer, filepath: str, global_step: int):
        # NeMo's finalization removes the checkpoint's "-unfinished" marker. Our files go in
        # before it, so that a checkpoint without its manifest never looks complete; "last"
        # moves after it, so that it never points at an incomplete one (a run killed at any
        # moment leaves "last" on a checkpoint it can resume from).
        finalize = super()._get_finalize_save_checkpoint_callback(trainer, filepath, global_step)

        def cb() -> None:
            ckpt = Path(ckpt_to_dir(filepath))
            if trainer.global_rank == 0:
                copy_manifest(self._source, ckpt)
                write_layout(ckpt, self._layout | {"global_step": global_step})
            finalize()
            if trainer.global_rank == 0 and ckpt.name.endswith("-last"):
                relink(ckpt.parent / "last", ckpt.name)

        return cb

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        if trainer.global_rank == 0:
            ckpt = ckpt_to_dir(filepath)
            name = Path(ckpt).name
            # A step saves "step=N" and "step=N-last"; the -last one is removed at the next save.
            if trainer.global_step not in self._saved or not name.endswith("-last"):
                self._saved[trainer.global_step] = name
            self._mark_best(trainer)
            log.info("saved checkpoint %s", ckpt)

    def on_validation_end(self, trainer, pl_module) -> None:
        super().on_validation_end(trainer, pl_module)
        loss = trainer.callback_metrics.get("val_loss")
        if trainer.global_rank != 0 or trainer.sanity_checking or loss is None:
            return
        ppl = trainer.callback_metrics.get("val_ppl")
        history = self._load_history()
        history[trainer.global_step] = {
            "global_step": trainer.global_step,
            "val_loss": float(loss),
            "val_ppl": float(ppl) if ppl is not None else None,
            "checkpoint": self._saved.get(trainer.global_step),
        }
        self._mark_best(trainer)

    def _load_history(self) -> dict[int, dict]:
        if self._history is None:
            path = Path(self.dirpath) / BEST_FILE
            self._history = {}
            if path.is_file():
                for entry in read_json(path).get("validations", []):
                    self._history[int(entry["global_step"])] = entry
        return self._history

    def _mark_best(self, trainer) -> None:
        history = self._load_history()
        step = trainer.global_step
        if step in history and step in self._saved:
            history[step]["checkpoint"] = self._saved[step]
        ckpts = Path(self.dirpath)
        candidates = [
            e
            for e in history.values()
            if e.get("checkpoint") and (ckpts / e["checkpoint"]).is_dir()
        ]
        best = min(candidates, key=lambda e: (e["val_loss"], e["global_step"]), default=None)
        if best is not None:
            relink(ckpts / "best", best["checkpoint"])
        if history:
            state = {
                "best": best,
                "validations": [history[k] for k in sorted(history)],
            }
            tmp = ckpts / f".{BEST_FILE}.tmp"
            tmp.write_text(json.dumps(state, indent=2) + "\n")
            tmp.replace(ckpts / BEST_FILE)


def copy_manifest(source_ckpt: Path, ckpt: Path) -> None:
    """Copy ``porting.json`` and the carried HF files from ``source_ckpt`` into ``ckpt``'s context."""
    import shutil

    src, dst = Path(source_ckpt) / "context", Path(ckpt) / "context"
    if not dst.is_dir():
        return
    shutil.copyfile(src / "porting.json", dst / "porting.json")
    if (src / "hf_extra").is_dir():
        shutil.copytree(
            src / "hf_extra", dst / "hf_extra", dirs_exist_ok=True, copy_function=shutil.copyfile
        )


def write_layout(ckpt: Path, layout: dict) -> None:
    """Write ``context/train_layout.json``: the layout and optimizer format of a checkpoint."""
    ctx = Path(ckpt) / "context"
    if not ctx.is_dir():
        return
    tmp = ctx / f".{LAYOUT_FILE}.tmp"
    tmp.write_text(json.dumps(layout, indent=2, sort_keys=True) + "\n")
    tmp.replace(ctx / LAYOUT_FILE)


def relink(link: Path, target_name: str) -> Path:
    """Point ``link`` at the sibling ``target_name`` (atomically: a new link renamed over it)."""
    tmp = link.with_name(f".{link.name}.tmp")
    if tmp.is_symlink():
        tmp.unlink()
    tmp.symlink_to(target_name)
    tmp.replace(link)
    return link


def link_last(out: Path) -> Path | None:
    """Point ``checkpoints/last`` at the newest ``*-last`` checkpoint; return the link."""
    ckpts = Path(out) / "checkpoints"
    lasts = sorted(
        (p for p in ckpts.glob("*-last") if not p.is_symlink()), key=lambda p: p.stat().st_mtime
    )
    if not lasts:
        return None
    return relink(ckpts / "last", lasts[-1].name)


def _tensorboard_logger(out: Path):
    from lightning.pytorch.loggers import TensorBoardLogger

    return TensorBoardLogger(save_dir=str(out), name="tb", version="")


def drop_partial_row(path: Path) -> None:
    """Cut ``path`` (a metrics CSV) back to its last complete line.

    A run stopped while it appended a row leaves that row without its newline; the resumed run's
    first row would be appended onto it, one line with too many fields, which Lightning's CSV
    logger then fails on (``dict contains fields not in fieldnames: None``) the next time it
    rewrites the header. The cut row is of a step after the last checkpoint, which the resumed
    run trains and logs again. Written beside and renamed, so a second stop loses nothing more."""
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data[: data.rfind(b"\n") + 1])
    tmp.replace(path)


def _csv_logger(out: Path):
    """``csv/metrics.csv``, continued by a resumed run (Lightning's logger deletes it on start;
    rows of steps a resumed run repeats appear again, the later ones being the kept history)."""
    import csv

    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.loggers.csv_logs import ExperimentWriter
    from lightning.pytorch.loggers.logger import rank_zero_experiment

    class HistoryWriter(ExperimentWriter):
        def _check_log_dir_exists(self) -> None:
            if os.path.isfile(self.metrics_file_path):
                drop_partial_row(Path(self.metrics_file_path))
                with open(self.metrics_file_path, newline="") as f:
                    self.metrics_keys = list(next(csv.reader(f), []))

    class HistoryLogger(CSVLogger):
        @property
        @rank_zero_experiment
        def experiment(self):
            if self._experiment is None:
                os.makedirs(self.root_dir, exist_ok=True)
                self._experiment = HistoryWriter(log_dir=self.log_dir)
            return self._experiment

    return HistoryLogger(save_dir=str(out), name="csv", version="")


def run(r: Recipe) -> Path:
    """Train with ``llm.train``; returns the run directory.

    Writes ``run.json``: the spec and, under ``built``, what the trainer built (:class:`BuiltLayout`).
    """
    from nemo.collections import llm

    from porting.convert.megatron import shutdown_parallel

    cpu.enable_training()
    cpu.ensure_rendezvous_env()
    cpu.cpu_safe_strategy(r.trainer.strategy)
    out = Path(r.spec.out)
    out.mkdir(parents=True, exist_ok=True)
    for w in r.warnings:
        log.warning("%s", w)
    shutdown_parallel()  # NeMo's strategy sets up its own process groups
    llm.train(
        model=r.model,
        data=r.data,
        trainer=r.trainer,
        log=r.log,
        resume=r.resume,
        optim=r.optim,
        tokenizer="model",
    )
    if r.trainer.global_rank == 0:
        link_last(out)
        built = next((c.built for c in r.trainer.callbacks if isinstance(c, BuiltLayout)), {})
        # Written after the run: NeMoLogger moves files it finds in the log dir into run_N/.
        spec = asdict(r.spec) | {"checkpoint": str(r.spec.checkpoint), "out": str(out)}
        (out / "run.json").write_text(
            json.dumps(spec | {"built": built}, indent=2, default=str) + "\n"
        )
    return out
