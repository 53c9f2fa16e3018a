"""Continued pretraining of an imported checkpoint with NeMo 2.0 / Megatron-Core.

:func:`recipe` returns the NeMo objects (model, data, trainer, optimizer, logger, resume) in the
NeMo 2.0 recipe style, so a user can change any field before :func:`run` calls ``llm.train``.
Everything is upstream machinery: ``MegatronStrategy`` (TP, PP, virtual PP, SP, CP, the
distributed optimizer), ``MegatronMixedPrecision`` (bf16 on GPUs), Megatron's GPT dataset over
``.bin/.idx`` prefixes through ``PreTrainingDataModule``, ``MegatronOptimizerModule`` with a cosine
schedule, ``NeMoLogger`` checkpoints and ``AutoResume``. The imported weights are restored (not a
fresh init) with a fresh optimizer; an interrupted run resumes from its last checkpoint.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback
from nemo.lightning.ckpt_utils import ckpt_to_dir
from nemo.lightning.pytorch.callbacks import ModelCheckpoint

from porting import cpu
from porting.errors import PortingError

log = logging.getLogger(__name__)


@dataclass
class TrainSpec:
    """What a continued-pretraining run needs; the CLI flags map one to one onto these fields.

    ``data`` holds dataset prefixes (``out/corpus_text_document``), optionally with blend weights
    as ``[w1, prefix1, w2, prefix2, ...]`` in Megatron's style.
    """

    checkpoint: Path
    data: list[str]
    out: Path
    tp: int = 1
    pp: int = 1
    vp: int | None = None
    cp: int = 1
    sequence_parallel: bool = False
    seq_length: int = 2048
    micro_batch: int = 1
    global_batch: int = 8
    steps: int = 100
    lr: float = 3e-5
    min_lr: float | None = None
    warmup: int = 0
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    save_every: int = 50  # 0: no checkpoints (quick experiments)
    val_every: int | None = None
    val_batches: int = 2
    split: str = "99,1,0"
    seed: int = 1234
    nodes: int = 1
    gpus_per_node: int = 1
    distributed_optimizer: bool = True
    use_tp_pp_dp_mapping: bool = False
    num_distributed_optimizer_instances: int = 1
    precision: str = "auto"
    num_workers: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        """Total number of processes (one per device)."""
        return self.nodes * self.gpus_per_node

    @property
    def data_parallel(self) -> int:
        """Data-parallel size implied by the world size and the model-parallel sizes."""
        return self.world_size // (self.tp * self.pp * self.cp)


def parse_blend(items: list[str]) -> list[str] | tuple[list[str], list[float]]:
    """``["0.3", "a", "0.7", "b"]`` -> (["a", "b"], [0.3, 0.7]); plain prefixes pass through."""

    def is_number(s: str) -> bool:
        try:
            float(s)
            return True
        except ValueError:
            return False

    if items and is_number(items[0]):
        if len(items) % 2 or not all(is_number(w) for w in items[::2]):
            raise PortingError("--data: blend must alternate WEIGHT PREFIX WEIGHT PREFIX ...")
        return [p for p in items[1::2]], [float(w) for w in items[::2]]
    return list(items)


def _prefixes(spec: TrainSpec) -> list[str]:
    blend = parse_blend(spec.data)
    return blend[0] if isinstance(blend, tuple) else blend


def validate(spec: TrainSpec, model_config, vocab_size: int) -> list[str]:
    """Check the layout, batch and data against the model before anything is launched.

    Raises :class:`PortingError` naming the offending flag; returns warnings (as strings) for
    settings that run but deserve a look (a sequence longer than the rotary settings were trained
    for).
    """
    heads = model_config.num_attention_heads
    groups = model_config.num_query_groups or heads
    if spec.tp < 1 or spec.pp < 1 or spec.cp < 1:
        raise PortingError("--tp, --pp and --cp must be at least 1")
    if heads % spec.tp:
        raise PortingError(f"--tp {spec.tp} does not divide the {heads} attention heads")
    if groups % spec.tp and spec.tp % groups:
        raise PortingError(
            f"--tp {spec.tp} and the {groups} KV groups: one must divide the other "
            "(Megatron replicates KV heads only when TP is a multiple of the group count)"
        )
    if groups % spec.tp:
        raise PortingError(
            f"--tp {spec.tp} exceeds the {groups} KV groups; Megatron-Core 0.15 requires "
            "num_query_groups to be divisible by the tensor-parallel size"
        )
    layers = model_config.num_layers
    if layers % spec.pp:
        raise PortingError(f"--pp {spec.pp} does not divide the {layers} layers")
    if spec.vp is not None and (layers // spec.pp) % spec.vp:
        raise PortingError(
            f"--vp {spec.vp} does not divide the {layers // spec.pp} layers per stage"
        )
    if spec.world_size % (spec.tp * spec.pp * spec.cp):
        raise PortingError(
            f"{spec.world_size} devices are not a multiple of TP x PP x CP = "
            f"{spec.tp * spec.pp * spec.cp}"
        )
    dp = spec.data_parallel
    if spec.global_batch % (spec.micro_batch * dp):
        raise PortingError(
            f"--global-batch {spec.global_batch} is not divisible by --micro-batch "
            f"{spec.micro_batch} x data-parallel size {dp}"
        )
    if spec.sequence_parallel and spec.tp == 1:
        raise PortingError("--sequence-parallel needs --tp > 1")
    if spec.steps < 1 or spec.warmup >= spec.steps:
        raise PortingError(f"--warmup {spec.warmup} must be below --steps {spec.steps}")
    if model_config.vocab_size % spec.tp:
        raise PortingError(
            f"padded vocabulary {model_config.vocab_size} is not divisible by --tp {spec.tp}"
        )
    for prefix in _prefixes(spec):
        for ext in (".bin", ".idx"):
            if not Path(prefix + ext).exists():
                raise PortingError(f"--data: {prefix}{ext} does not exist")
        max_id = max_token_id(prefix)
        if max_id is not None and max_id >= vocab_size:
            raise PortingError(
                f"--data: {prefix} holds token id {max_id}, beyond the model's vocabulary "
                f"of {vocab_size}; it was tokenized with another tokenizer"
            )
    warnings = []
    trained = _trained_context(model_config)
    if trained and spec.seq_length > trained:
        warnings.append(
            f"--seq-length {spec.seq_length} exceeds the {trained} positions the model's rotary "
            "settings were trained for; quality may drop without rope scaling"
        )
    return warnings


def _trained_context(config) -> int | None:
    if getattr(config, "position_embedding_type", "rope") != "rope":
        return None
    if getattr(config, "rope_scaling_type", None) == "llama3":
        return int(
            config.rope_scaling_original_max_position_embeddings * config.rope_scaling_factor
        )
    factor = getattr(config, "seq_len_interpolation_factor", None) or 1.0
    return int(config.seq_length * factor)


def max_token_id(prefix: str) -> int | None:
    """The largest token id in a Megatron indexed dataset (streamed in chunks; None if empty)."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    tokens = np.memmap(prefix + ".bin", dtype=ds.index.dtype, mode="r")
    if tokens.size == 0:
        return None
    step = 1 << 24
    return int(max(tokens[i : i + step].max() for i in range(0, tokens.size, step)))


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
    """Build the NeMo 2.0 objects for ``spec`` (validated first)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from nemo import lightning as nl
    from nemo.collections import llm
    from nemo.collections.common.tokenizers.huggingface.auto_tokenizer import AutoTokenizer
    from nemo.lightning.pytorch.optim import CosineAnnealingScheduler, MegatronOptimizerModule

    from porting.convert.checkpoint import read_manifest, tokenizer_files
    from porting.convert.context import check_io_json
    from porting.convert.megatron import checkpoint_config
    from porting.registry import family_by_name

    manifest = read_manifest(spec.checkpoint)
    family = family_by_name(manifest.family)
    # NeMo reads io.json of the restored checkpoint and of every checkpoint it may resume from
    # (artifacts, the tokenizer); each is checked before NeMo sees it. The model itself is built
    # from our manifest.
    check_io_json(spec.checkpoint)
    for resumable in sorted((Path(spec.out) / "checkpoints").glob("*/context")):
        check_io_json(resumable.parent)
    tok_files = tokenizer_files(spec.checkpoint, manifest)
    if not tok_files:
        raise PortingError(f"{spec.checkpoint}: the manifest names no tokenizer; cannot train")
    model = family.model_cls(
        checkpoint_config(spec.checkpoint, family),
        tokenizer=AutoTokenizer(str(tok_files[0].parent)),
    )
    warnings = validate(spec, model.config, manifest.padded_vocab_size)

    gpu = cpu.cuda_available()
    precision = spec.precision if spec.precision != "auto" else ("bf16" if gpu else "fp32")
    if precision == "bf16" and not gpu:
        raise PortingError("--precision bf16 needs GPUs; on the CPU training runs in fp32")
    bf16 = precision == "bf16"
    cfg = model.config
    cfg.seq_length = spec.seq_length
    cfg.tensor_model_parallel_size = spec.tp
    cfg.pipeline_model_parallel_size = spec.pp
    cfg.virtual_pipeline_model_parallel_size = spec.vp
    cfg.context_parallel_size = spec.cp
    cfg.sequence_parallel = spec.sequence_parallel
    # Weights are stored in the checkpoint's dtype; training keeps fp32 master weights and lets the
    # mixed-precision plugin cast (bf16 on GPUs).
    cfg.params_dtype = torch.float32
    cfg.bf16, cfg.fp16 = bf16, False
    cfg.pipeline_dtype = torch.bfloat16 if bf16 else torch.float32
    cfg.autocast_dtype = cfg.pipeline_dtype
    cfg.perform_initialization = False
    cpu.cpu_safe_config(cfg)

    dist_opt = spec.distributed_optimizer
    if dist_opt and not gpu:
        # megatron/core/optimizer/distrib_optimizer.py accepts only torch.cuda.*Tensor parameters.
        warnings.append(
            "the distributed optimizer needs CUDA tensors; using the plain one on the CPU"
        )
        dist_opt = False

    blend = parse_blend(spec.data)
    paths = (
        blend
        if isinstance(blend, list)
        else [x for pair in zip(blend[1], blend[0], strict=True) for x in pair]
    )
    data = llm.PreTrainingDataModule(
        paths=paths,
        seq_length=spec.seq_length,
        tokenizer=model.tokenizer,
        micro_batch_size=spec.micro_batch,
        global_batch_size=spec.global_batch,
        num_workers=spec.num_workers,
        pin_memory=gpu,
        # Without Transformer Engine, NeMo's gpt_forward_step needs an explicit mask.
        create_attention_mask=not gpu,
        seed=spec.seed,
        split=spec.split,
        index_mapping_dir=str(Path(spec.out) / "index_cache"),
    )
    ddp = DistributedDataParallelConfig(
        use_distributed_optimizer=dist_opt,
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        check_for_nan_in_grad=True,
        num_distributed_optimizer_instances=spec.num_distributed_optimizer_instances,
    )
    strategy = nl.MegatronStrategy(
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
        virtual_pipeline_model_parallel_size=spec.vp,
        context_parallel_size=spec.cp,
        sequence_parallel=spec.sequence_parallel,
        pipeline_dtype=cfg.pipeline_dtype,
        use_tp_pp_dp_mapping=spec.use_tp_pp_dp_mapping,
        ddp=ddp,
        ckpt_async_save=gpu,
        ckpt_load_optimizer=True,
        ckpt_save_optimizer=True,
    )
    plugins = [nl.MegatronMixedPrecision(precision="bf16-mixed")] if bf16 else []
    val_every = spec.val_every or spec.steps
    trainer = nl.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=spec.gpus_per_node,
        num_nodes=spec.nodes,
        max_steps=spec.steps,
        strategy=strategy,
        plugins=plugins,
        log_every_n_steps=1,
        val_check_interval=val_every,
        limit_val_batches=spec.val_batches,
        num_sanity_val_steps=0,
        # our ThroughputLogger prints one line per step instead of Lightning's bar and summary
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        enable_checkpointing=spec.save_every > 0,
        callbacks=[ThroughputLogger(spec.global_batch * spec.seq_length)],
    )
    opt = OptimizerConfig(
        optimizer="adam",
        lr=spec.lr,
        min_lr=spec.min_lr if spec.min_lr is not None else spec.lr / 10,
        weight_decay=spec.weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.95,
        clip_grad=spec.clip_grad,
        bf16=bf16,
        params_dtype=torch.float32,
        use_distributed_optimizer=dist_opt,
    )
    sched = CosineAnnealingScheduler(
        warmup_steps=spec.warmup,
        constant_steps=0,
        max_steps=spec.steps,
        min_lr=opt.min_lr,
    )
    optim = MegatronOptimizerModule(config=opt, lr_scheduler=sched)
    ckpt_cb = (
        None
        if spec.save_every == 0
        else SelfDescribingCheckpoint(
            source=Path(spec.checkpoint),
            every_n_train_steps=spec.save_every,
            save_last=True,
            save_top_k=-1,
            monitor="step",
            mode="max",
            save_optim_on_train_end=True,
            filename="{step}",
        )
    )
    logger = nl.NeMoLogger(
        explicit_log_dir=str(spec.out),
        update_logger_directory=False,
        ckpt=ckpt_cb,
        tensorboard=_tensorboard_logger(spec.out),
        extra_loggers=[_csv_logger(spec.out)],
    )
    resume = nl.AutoResume(
        restore_config=nl.RestoreConfig(path=str(spec.checkpoint), load_optim_state=False),
        resume_if_exists=True,
        resume_ignore_no_checkpoint=True,
    )
    return Recipe(spec, model, data, trainer, optim, logger, resume, warnings)


class ThroughputLogger(Callback):
    """Logs ``tokens_per_s`` (global batch x sequence / step time) and, on GPUs, ``gpu_mem_gib``,
    and prints one line per step (loss, learning rate, tokens/s) in place of Lightning's bar.

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
                f"{float(loss):.4f}" if loss is not None else "-",
                f"{float(lr):.3g}" if lr is not None else "-",
                tokens_per_s,
            )

    def on_validation_end(self, trainer, pl_module) -> None:
        loss = trainer.callback_metrics.get("val_loss")
        if trainer.global_rank == 0 and loss is not None and not trainer.sanity_checking:
            log.info("validation at step %d  loss %.4f", trainer.global_step, float(loss))


class SelfDescribingCheckpoint(ModelCheckpoint):
    """NeMo's ModelCheckpoint that also copies our manifest into every checkpoint's context.

    A training checkpoint then exports on its own, like an imported one.
    """

    def __init__(self, *args, source: Path, **kwargs):
        super().__init__(*args, **kwargs)
        self._source = Path(source)

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        if trainer.global_rank == 0:
            copy_manifest(self._source, ckpt_to_dir(filepath))
            log.info("saved checkpoint %s", ckpt_to_dir(filepath))


def copy_manifest(source_ckpt: Path, ckpt: Path) -> None:
    """Copy ``porting.json`` and the carried HF files from ``source_ckpt`` into ``ckpt``'s context."""
    import shutil

    src, dst = Path(source_ckpt) / "context", Path(ckpt) / "context"
    if not dst.is_dir():
        return
    shutil.copy2(src / "porting.json", dst / "porting.json")
    if (src / "hf_extra").is_dir():
        shutil.copytree(src / "hf_extra", dst / "hf_extra", dirs_exist_ok=True)


def link_last(out: Path) -> Path | None:
    """Point ``checkpoints/last`` at the newest ``*-last`` checkpoint; return the link."""
    ckpts = Path(out) / "checkpoints"
    lasts = sorted(ckpts.glob("*-last"), key=lambda p: p.stat().st_mtime)
    if not lasts:
        return None
    link = ckpts / "last"
    tmp = ckpts / ".last.tmp"
    if tmp.is_symlink():
        tmp.unlink()
    tmp.symlink_to(lasts[-1].name)
    tmp.replace(link)
    return link


def _tensorboard_logger(out: Path):
    from lightning.pytorch.loggers import TensorBoardLogger

    return TensorBoardLogger(save_dir=str(out), name="tb", version="")


def _csv_logger(out: Path):
    from lightning.pytorch.loggers import CSVLogger

    return CSVLogger(save_dir=str(out), name="csv", version="")


def run(r: Recipe) -> Path:
    """Train with ``llm.train``; returns the run directory. Writes ``run.json`` with the spec."""
    from nemo.collections import llm

    from porting.convert.megatron import shutdown_parallel

    cpu.enable()
    if not cpu.cuda_available():
        cpu.enable_training()
    cpu.ensure_rendezvous_env()
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
        # Written after the run: NeMoLogger moves files it finds in the log dir into run_N/.
        spec = asdict(r.spec) | {"checkpoint": str(r.spec.checkpoint), "out": str(out)}
        (out / "run.json").write_text(json.dumps(spec, indent=2, default=str) + "\n")
    return out
