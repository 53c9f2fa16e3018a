"""HF <-> NeMo 2.0 conversion: the generic NeMo ``io.ModelConnector`` importer and exporter.

:func:`model_class` loads a family's model class and, the first time, subclasses
:class:`PortingImporter` / :class:`PortingExporter` for it and registers them on that class with
``io.model_importer`` / ``io.model_exporter`` (``llm.import_ckpt`` / ``llm.export_ckpt`` then find
them). The checkpoint itself is written without NeMo (:mod:`porting.convert.hf_import`) for
every family with a NeMo-free config; NeMo's own trainer and save write it here for a family
without one, and for the filled-model reference the streamed checkpoint is tested against.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
from pathlib import Path

import torch
from nemo.lightning import io
from tqdm import tqdm

from porting import cpu
from porting.contract.family import Family
from porting.convert import hf_files, hf_import, ranks, streaming_save
from porting.convert.checkpoint import (
    atomic_dir,
    open_checkpoint,
)
from porting.convert.export import export_into, shapes_of
from porting.convert.hf_files import HFSource, open_hf
from porting.convert.hf_import import TOKENIZER_SUBDIR, resolve_dtype
from porting.convert.manifest import Manifest
from porting.convert.mapping import WeightProducer, import_weights
from porting.convert.megatron import build_config, dtype_name
from porting.convert.safetensors_io import SafetensorsSource, hf_weights
from porting.convert.table_check import check_table

log = logging.getLogger(__name__)


def _nemo_tokenizer(hf_dir: Path, staging: Path):
    """NeMo's HF tokenizer wrapper over a local copy of the checkpoint's tokenizer files."""
    from nemo.collections.common.tokenizers.huggingface.auto_tokenizer import AutoTokenizer

    tok = hf_files.load_tokenizer(hf_dir)
    tok.save_pretrained(str(staging))
    return AutoTokenizer(str(staging))


@contextlib.contextmanager
def _one_local_process():
    """Lightning takes its cluster environment from the shell's variables: inside a Slurm
    allocation (``sbatch`` running ``porting import``) ``SLURM_NTASKS`` makes it a Slurm world of
    that many ranks, or refuses ``--ntasks`` outright (``lightning/fabric/plugins/environments/
    slurm.py``). A conversion is one local process whatever the allocation; hiding the variable
    while the trainer is built is Lightning's own opt-out (``SLURMEnvironment.detect``), without a
    plugin object that NeMo would record in the checkpoint's context."""
    saved = os.environ.pop("SLURM_NTASKS", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["SLURM_NTASKS"] = saved


def _destroy_process_groups() -> None:
    """What ``nemo.lightning.teardown`` does for a one-process conversion, less its walk over
    every object of the process looking for CUDA tensors (which frees nothing: it unbinds its
    loop variable) and its full collection (the caller's follows): 1.65 s of a `porting import`
    of the test Llama (cProfile), more in a process holding more objects."""
    if torch.distributed.is_initialized():
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def _ranks_trainer(options: dict):
    """A NeMo trainer over the launched ranks: data parallel on the CPU, every rank a device."""
    from nemo.lightning import MegatronStrategy, Trainer

    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = Trainer(
        devices=per_node,
        num_nodes=ranks.world_size() // per_node,
        accelerator="cpu",
        strategy=MegatronStrategy(ckpt_save_optimizer=False, always_save_context=True, **options),
    )
    # The context records the trainer a checkpoint is read with, not how it was written: the
    # one-device trainer of a one-process import (the two imports' context/ are then identical).
    trainer.__io__.devices = 1
    del trainer.__io__.num_nodes
    return trainer


class PortingImporter(io.ModelConnector):
    """Generic HF -> NeMo 2.0 importer; a family subclass sets ``FAMILY``.

    Used both by ``llm.import_ckpt(model=FamilyModel(...), source="hf://DIR")`` and by
    ``porting import``. Options beyond NeMo's interface are class attributes a caller may set on the
    instance: ``dtype`` (None = the checkpoint's), ``allow_pickle``, ``vocab_divisor``, and
    ``gate`` (``"streamed"`` / ``"whole"``: the host-memory parity gate that follows, whose memory
    is checked before anything is written).
    """

    FAMILY: Family
    dtype: str | None = None
    allow_pickle: bool = False
    vocab_divisor: int = 128
    show_progress: bool = True
    gate: str | None = None
    # False: fill the whole model, then NeMo's stock save (holds the model; kept as the reference
    # the streamed checkpoint is compared against in tests).
    streaming: bool = True

    def init(self):
        """A fresh family model with the config derived from the HF directory."""
        return model_class(self.FAMILY)(self.config, tokenizer=self.tokenizer)

    @property
    def hf(self) -> HFSource:
        """The HF directory, its ``config.json`` read once per importer."""
        if getattr(self, "_hf", None) is None:
            self._hf = open_hf(str(self), self.FAMILY.name)
        return self._hf

    @property
    def hf_config(self) -> dict:
        """The HF ``config.json`` as a dict (transformers 4.x's spelling)."""
        return self.hf.config

    @property
    def source(self) -> SafetensorsSource:
        """The HF weights' reader (headers and index read once per importer)."""
        if getattr(self, "_source", None) is None:
            self._source = hf_weights(self.hf, allow_pickle=self.allow_pickle)
        return self._source

    @property
    def config(self):
        """The family's Megatron config (padded vocabulary, checkpoint dtype)."""
        dtype = resolve_dtype(self.source, self.dtype, self.FAMILY)
        return build_config(self.FAMILY, self.hf_config, dtype, self.vocab_divisor, nemo=True)[0]

    @property
    def tokenizer(self):
        """NeMo's wrapper of the HF tokenizer (staged once per importer)."""
        if getattr(self, "_tokenizer", None) is None:
            import tempfile
            import weakref

            # Inside the output being written when there is one (convert_into): a killed run's
            # staging then goes with its partial directory instead of staying in the temp dir.
            root = getattr(self, "_staging_root", None)
            staging = Path(tempfile.mkdtemp(prefix=".tokenizer-staging-", dir=root))
            weakref.finalize(self, shutil.rmtree, staging, True)
            # NeMo copies the artifact directory into context/ under its own name; naming it
            # nemo_tokenizer makes that the one copy (and the place the manifest points at).
            self._tokenizer_dir = staging / "nemo_tokenizer"
            self._tokenizer = _nemo_tokenizer(Path(str(self)), self._tokenizer_dir)
        return self._tokenizer

    def apply(self, output_path: Path) -> Path:
        """Convert into ``output_path``; nothing appears under that name unless it completes."""
        with atomic_dir(output_path) as tmp:
            self.convert_into(tmp)
        return Path(output_path)

    def convert_into(self, out: Path) -> Manifest | None:
        """Stream the HF weights through the family table into a NeMo checkpoint at ``out``:
        without NeMo (:func:`porting.convert.hf_import.import_into`) where the family has a
        NeMo-free config and ``streaming`` is on, else through NeMo's trainer and save."""
        if self.streaming and self.FAMILY.core_config_cls is not None:
            return hf_import.import_into(
                str(self),
                out,
                self.FAMILY,
                dtype=self.dtype,
                allow_pickle=self.allow_pickle,
                vocab_divisor=self.vocab_divisor,
                show_progress=self.show_progress,
                gate=self.gate,
            )
        return self._through_nemo(Path(out))

    def _through_nemo(self, out: Path) -> Manifest | None:
        cpu.enable()
        cpu.ensure_rendezvous_env()
        out.mkdir(parents=True, exist_ok=True)
        if getattr(self, "_tokenizer", None) is None:
            self._staging_root = out
        family = self.FAMILY
        prep = hf_import.prepare(
            self.hf,
            family,
            self.source,
            dtype=self.dtype,
            vocab_divisor=self.vocab_divisor,
            gate=self.gate,
        )
        config, ctx = build_config(
            family, prep.hf_config, prep.dtype, self.vocab_divisor, nemo=True
        )
        model = model_class(family)(config, tokenizer=self.tokenizer)
        # NeMo builds the module lazily (perform_initialization=False): its parameters are
        # allocated and never touched, so they cost address space, not memory. Synchronous,
        # single-writer saving lets the streaming strategy below replace the stock one (and the
        # context records the same strategy either way).
        options = {"ckpt_async_save": False, "ckpt_parallel_save": False}
        ranked = ranks.world_size() > 1
        with contextlib.nullcontext() if ranked else _one_local_process():
            trainer = self.nemo_setup(model, _ranks_trainer(options) if ranked else None, **options)
        model.module.to(prep.dtype)  # as hf_import.import_into: every tensor in the import dtype
        target = {
            k: v
            for k, v in model.module.state_dict(keep_vars=True).items()
            if not k.endswith("_extra_state")
        }
        check_table(family, ctx, prep.hf_shapes, shapes_of(target))
        progress = (
            (lambda n: tqdm(total=n, desc="import", unit="tensor", leave=False))
            if self.show_progress
            else None
        )
        if self.streaming:
            producer = WeightProducer(
                prep.reader, target, family.weights, ctx, ctx.num_layers, progress
            )
            del target
            streaming_save.install(trainer, model.module, producer, parallel=ranked)
            self.nemo_save(out, trainer)
            if ranked:  # each rank made its share; together they must have made every one
                everyone: list = [None] * ranks.world_size()
                torch.distributed.all_gather_object(everyone, producer.produced)
                producer.produced = set().union(*everyone)
            report = producer.finish()
        else:
            report = import_weights(
                prep.reader, target, family.weights, ctx, ctx.num_layers, progress
            )
            del target
            self.nemo_save(out, trainer)
        prep.source.close()
        self._source = None  # a pickle checkpoint's tensors go with it
        if not ranked:  # a launched import's process group stays for the layout and the gate
            _destroy_process_groups()
        trainer._teardown()
        del trainer, model
        gc.collect()
        manifest = None
        if ranks.rank() == 0:
            tok_dir = out / TOKENIZER_SUBDIR
            if not tok_dir.is_dir():
                # NeMo copies tokenizer artifacts into context/ on dump; keep a copy where the
                # manifest says if a NeMo version does not.
                shutil.copytree(self._tokenizer_dir, tok_dir, copy_function=shutil.copyfile)
            manifest = hf_import.write_extras(out, prep)
        if self._tokenizer_dir.is_relative_to(out):
            shutil.rmtree(self._tokenizer_dir.parent, ignore_errors=True)
        if ranked:
            torch.distributed.barrier()
        if manifest is not None:
            log.info(
                "imported %s through NeMo (%s, %s): %d HF tensors -> %d Megatron parameters",
                prep.hf_dir,
                family.name,
                dtype_name(prep.dtype),
                report.consumed,
                report.written,
            )
        return manifest


class PortingExporter(io.ModelConnector):
    """Generic NeMo 2.0 -> HF exporter (``llm.export_ckpt(path, target="hf")``); a family subclass
    sets ``FAMILY``."""

    FAMILY: Family

    def apply(self, output_path: Path) -> Path:
        """Export the checkpoint at ``self`` into ``output_path`` atomically."""
        with atomic_dir(output_path) as tmp:
            export_into(open_checkpoint(str(self)), tmp, self.FAMILY)
        return Path(output_path)


_REGISTERED: dict[str, tuple[type, type]] = {}


def register_connectors(family: Family) -> tuple[type, type]:
    """Make and register ``family``'s HF importer and exporter on its model class, once; returns
    them (``HF<Model>Importer``, ``HF<Model>Exporter``), for code that subclasses one.

    Called by :func:`model_class` when a conversion first needs the family's Megatron side: the
    family's module names its classes and never imports NeMo (:mod:`porting.contract.named`).
    """
    model = family.model_class()
    key = f"{family.name}:{model.__module__}.{model.__qualname__}"
    if key not in _REGISTERED:
        doc = f"``llm.{{}}`` for family {family.name} ({model.__name__})."
        importer = type(
            f"HF{model.__name__}Importer",
            (PortingImporter,),
            {"FAMILY": family, "__doc__": doc.format("import_ckpt")},
        )
        exporter = type(
            f"HF{model.__name__}Exporter",
            (PortingExporter,),
            {"FAMILY": family, "__doc__": doc.format("export_ckpt")},
        )
        _REGISTERED[key] = (
            io.model_importer(model, "hf")(importer),
            io.model_exporter(model, "hf")(exporter),
        )
    return _REGISTERED[key]


def model_class(family: Family) -> type:
    """``family``'s NeMo model class, its HF importer and exporter registered on it (what
    ``llm.import_ckpt`` / ``llm.export_ckpt`` and ``model.importer`` look up)."""
    register_connectors(family)
    return family.model_class()
