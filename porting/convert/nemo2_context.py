"""NeMo 2's ``context/`` and ``weights/common.pt``, written as data, without NeMo installed.

A NeMo 2 checkpoint's ``context/io.json`` is fiddle's JSON of a ``TrainerContext``: the model's
class called with its config, its optimizer module and its tokenizer, and the one-device trainer
it is read with (``nemo/lightning/io/mixin.py``: ``IOMixin.io_dump``;
``fiddle/_src/experimental/serialization.py``: ``Serialization``). ``context/model.yaml`` is the
model's part as YAML with every default (``nemo_run``'s ``YamlSerializer``), and
``weights/common.pt`` the trainer state Lightning's ``dump_checkpoint`` puts beside the tensors.

Importing NeMo to write these costs a conversion 10-15 s of start-up (Lightning, torchmetrics,
scikit-learn). What NeMo records is a pure function of the config's constructor arguments, so
they are written here: the fiddle graph by fiddle's own algorithm (objects named and numbered as
fiddle names them, each memoizable value with every path that reaches it), the YAML by the same
PyYAML representers. What NeMo adds to our families' configs is :data:`NEMO_GPT_FIELDS`, NeMo
2.7.3's ``GPTConfig`` fields beyond Megatron-Core's ``TransformerConfig``; the rest is the
family's NeMo-free config (:class:`porting.mcore.GPTCore`). ``tests/test_nemo2_context.py``
proves every installed family's files equal NeMo's own, byte for byte, where NeMo is installed.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import json
import re
import types
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

# NeMo 2.7.3's GPTConfig fields that Megatron-Core's TransformerConfig lacks, in its declaration
# order. Every one but those of _NEMO_ONLY (with their defaults; NeMo's functions named, never
# imported) is a field of porting.mcore.GPTCore too, whose default wins in a family's NeMo class
# (XConfig(XCore, GPTConfig) puts XCore first).
NEMO_GPT_FIELDS = (
    "fp16_lm_cross_entropy",
    "parallel_output",
    "share_embeddings_and_output_weights",
    "make_vocab_size_divisible_by",
    "position_embedding_type",
    "rotary_base",
    "rotary_percent",
    "seq_len_interpolation_factor",
    "seq_length",
    "scatter_embedding_sequence_parallel",
    "use_transformer_engine_full_layer_spec",
    "transformer_layer_spec",
    "forward_step_fn",
    "data_step_fn",
    "generation_config",
    "vocab_size",
    "tp_comm_overlap_cfg",
)
# The arguments NeMo's classes take, with their defaults, in signature order: a family's model
# class (config, optim, tokenizer, model_transform), NeMo's optimizer module and HF tokenizer.
_MODEL_ARGS = ("config", "optim", "tokenizer", "model_transform")
_OPTIM = ("nemo.lightning.pytorch.optim.megatron", "MegatronOptimizerModule")
_OPTIM_DEFAULTS = {"lr_scheduler": None, "no_weight_decay_cond": None, "scale_lr_cond": None,
                   "lr_mult": 1.0}  # fmt: skip
_TOKENIZER = ("nemo.collections.common.tokenizers.huggingface.auto_tokenizer", "AutoTokenizer")
_TOKENIZER_DEFAULTS = {
    "vocab_file": None,
    "merges_file": None,
    "mask_token": None,
    "bos_token": None,
    "eos_token": None,
    "pad_token": None,
    "sep_token": None,
    "cls_token": None,
    "unk_token": None,
    "additional_special_tokens": [],
    "use_fast": True,
    "trust_remote_code": False,
    "include_special_tokens": False,
    "chat_template": None,
}
TOKENIZER_DIR = "nemo_tokenizer"  # NeMo copies the tokenizer artifact under its directory's name
# The optimizer NeMo's GPTModel makes when given none (nemo/collections/llm/gpt/model/base.py).
_DEFAULT_OPTIMIZER = {"lr": 1e-4, "use_distributed_optimizer": True}
# MegatronStrategy's parallelism of a conversion (NeMo 2.7.3's ParallelismConfig defaults): the
# strategy sets each on the model's config and on its recorded arguments as it sets the model up
# (nemo/lightning/_strategy_lib.py: set_model_parallel_attributes), those the config has.
_PARALLELISM = {
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_comm_backend": None,
    "pipeline_model_parallel_size": 1,
    "virtual_pipeline_model_parallel_size": None,
    "microbatch_group_size_per_vp_stage": 1,
    "context_parallel_size": 1,
    "sequence_parallel": False,
    "expert_model_parallel_size": 1,
    "moe_extended_tp": False,
    "expert_tensor_parallel_size": None,
    "encoder_tensor_model_parallel_size": 0,
    "encoder_pipeline_model_parallel_size": 0,
    "pipeline_dtype": None,
    "use_te_rng_tracker": False,
    "use_sharp": False,
    "use_gloo_process_groups": True,
    "use_tp_pp_dp_mapping": False,
    "num_layers_in_first_pipeline_stage": None,
    "num_layers_in_last_pipeline_stage": None,
    "account_for_embedding_in_pipeline_split": False,
    "account_for_loss_in_pipeline_split": False,
    "nccl_communicator_config_path": None,
    "num_distributed_optimizer_instances": 1,
    "pipeline_model_parallel_layout": None,
}
# MegatronStrategy's arguments as a conversion builds it, and the trainer a checkpoint is read with.
_STRATEGY = ("nemo.lightning.pytorch.strategies.megatron_strategy", "MegatronStrategy")
_STRATEGY_ARGS = {"ckpt_save_optimizer": False, "ckpt_async_save": False,
                  "ckpt_parallel_save": False, "kwargs": {"always_save_context": True}}  # fmt: skip
_TRAINER = ("nemo.lightning.pytorch.trainer", "Trainer")
_CONTEXT = ("nemo.lightning.io.pl", "TrainerContext")
# MegatronStrategy.sharded_state_dict_metadata of NeMo 2.7.3: the model's sharded state dict is
# made with it and dist_checkpointing records it as the checkpoint's content metadata.
CONTENT_METADATA = {
    "singleton_local_shards": False,
    "chained_optim_avoid_prefix": True,
    "distrib_optim_sharding_type": "dp_reshardable",
}
# The Lightning version NeMo 2.7.3 runs (what common.pt records when Lightning is absent).
LIGHTNING_VERSION = "2.4.0"


@dataclasses.dataclass(frozen=True)
class Symbol:
    """A class or function of NeMo's that the context names, without importing it."""

    module: str
    name: str

    @classmethod
    def named(cls, ref: str) -> Symbol:
        module, _, name = ref.partition(":")
        return cls(module, name)


_GPT_BASE = "nemo.collections.llm.gpt.model.base"
_NEMO_ONLY = {
    "use_transformer_engine_full_layer_spec": False,
    "forward_step_fn": Symbol(_GPT_BASE, "gpt_forward_step"),
    "data_step_fn": Symbol(_GPT_BASE, "gpt_data_step"),
    "generation_config": None,
    "tp_comm_overlap_cfg": None,
}


@dataclasses.dataclass(eq=False)
class Call:
    """A fiddle ``Config``: ``target`` called with ``args`` (in its signature's order)."""

    target: Symbol
    args: list[tuple[str, Any]]


# --- fiddle's JSON ---------------------------------------------------------------------------


def _snake(name: str) -> str:
    return re.sub(r"(?<=[^_A-Z])(?=[A-Z])", "_", name).lower()


def _memoizable(value) -> bool:
    primitive = (bool, int, float, complex, str, bytes, type(None), types.EllipsisType)
    return not isinstance(value, primitive) and not (isinstance(value, tuple) and value == ())


def _pyref_of(value) -> dict | None:
    """fiddle's reference to an importable value: a class, function, enum member, torch dtype or
    :class:`Symbol`; ``None`` for anything else."""
    if isinstance(value, Symbol):
        module, name = value.module, value.name
    elif isinstance(value, torch.dtype):
        module, name = str(value).split(".")
    elif isinstance(value, enum.Enum):
        module, name = type(value).__module__, f"{type(value).__qualname__}.{value.name}"
    elif isinstance(value, type | types.FunctionType | types.BuiltinFunctionType):
        module, name = inspect.getmodule(value).__name__, value.__qualname__
    else:
        return None
    return {"type": "pyref", "module": module, "name": name}


def _children(value) -> list[tuple[str, str, Any]] | None:
    """(repr of the path element, its path text, child) of a traversable value; ``None`` for a
    leaf."""
    if isinstance(value, Call):
        return [(f"Attr(name={k!r})", f".{k}", v) for k, v in value.args]
    if isinstance(value, list | tuple):
        return [(f"Index(index={i})", f"[{i}]", v) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return [(f"Key(key={k!r})", f"[{k!r}]", v) for k, v in value.items()]
    return None


class _Serialization:
    """fiddle's ``Serialization`` of a graph of :class:`Call`, lists, tuples, dicts and leaves."""

    def __init__(self, root: Call) -> None:
        self.objects: dict[str, Any] = {}
        self.refcounts: dict[str, int] = defaultdict(int)
        self.memo: dict[int, str] = {}
        self.paths: dict[int, list[str]] = defaultdict(list)
        self.keep: list[Any] = []  # ids stay unique while the graph is serialized
        self._collect(root, "<root>")
        self.root = self._serialize(root, ["<root>"])

    def _collect(self, value, path: str) -> None:
        if not _memoizable(value):
            return
        seen = id(value) in self.paths
        self.paths[id(value)].append(path)
        children = _children(value)
        if children and not seen:
            for _, step, child in children:
                self._collect(child, path + step)

    def _ref(self, key: str) -> dict:
        self.refcounts[key] += 1
        return {"type": "ref", "key": key}

    def _name(self, hint: str) -> str:
        i = 1
        while f"{hint}_{i}" in self.objects:
            i += 1
        return f"{hint}_{i}"

    def _serialize(self, value, paths: list[str] | None):
        if id(value) in self.memo:
            return self._ref(self.memo[id(value)])
        if paths is not None:
            paths = self.paths.get(id(value), paths)
        children = _children(value)
        if children is None:
            pyref = _pyref_of(value)
            if pyref is not None:
                out = pyref
            elif isinstance(value, bool | int | float | str | type(None)):
                if paths is None:
                    return value
                out = {"type": "leaf", "value": value}
            else:
                raise TypeError(f"cannot write {value!r} ({type(value).__name__}) into io.json")
        else:
            items = [
                [text, self._serialize(child, None if paths is None else [p + step for p in paths])]
                for text, step, child in children
            ]
            out = {"type": None, "items": items, "metadata": self._metadata(value)}
            if isinstance(value, Call):
                out["type"] = {"type": "pyref", "module": "fiddle._src.config", "name": "Config"}
            else:
                out["type"] = _pyref_of(Symbol("builtins", type(value).__name__))
        if paths is not None:
            out["paths"] = list(paths)
        if _memoizable(value) and out["type"] != "pyref":
            hint = value.target.name if isinstance(value, Call) else type(value).__name__
            name = self._name(_snake(hint))
            self.memo[id(value)] = name
            self.objects[name] = out
            self.keep.append(value)
            return self._ref(name)
        return out

    def _metadata(self, value):
        if isinstance(value, Call):
            btm = Call(
                Symbol("fiddle._src.config", "BuildableTraverserMetadata"),
                [
                    ("fn_or_cls", value.target),
                    ("argument_names", tuple(k for k, _ in value.args)),
                    ("argument_tags", {}),
                    ("argument_history", {}),
                ],
            )
            self.keep.append(btm)
            return self._btm(btm)
        if isinstance(value, dict):
            keys = tuple(value)
            self.keep.append(keys)
            return self._serialize(keys, None)
        return None

    def _btm(self, btm: Call) -> dict:
        """fiddle's ``BuildableTraverserMetadata``: a named tuple whose metadata is its type."""
        items = [[f"Attr(name={k!r})", self._serialize(v, None)] for k, v in btm.args]
        out = {"type": _pyref_of(btm.target), "items": items, "metadata": _pyref_of(btm.target)}
        name = self._name("buildable_traverser_metadata")
        self.memo[id(btm)] = name
        self.objects[name] = out
        return self._ref(name)


def io_json(context: Call) -> str:
    """``context/io.json``: fiddle's ``dump_json`` of ``context``."""
    s = _Serialization(context)
    return json.dumps(
        {"root": s.root, "objects": s.objects, "refcounts": s.refcounts, "version": "0.0.1"}
    )


# --- the graph NeMo records -------------------------------------------------------------------


def _field_defaults(core_cls: type) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(core_cls):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def nemo_field_order(core_cls: type) -> list[str]:
    """The init fields of the family's NeMo config (``XConfig(XCore, GPTConfig)``) in its
    dataclass order: Megatron-Core's ``TransformerConfig`` first, NeMo's ``GPTConfig`` fields
    next, then the family's own."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = [f.name for f in dataclasses.fields(TransformerConfig)]
    own = [f.name for f in dataclasses.fields(core_cls) if f.init]
    known = set(base) | set(NEMO_GPT_FIELDS)
    return base + list(NEMO_GPT_FIELDS) + [n for n in own if n not in known]


def model_call(family, kwargs: dict[str, Any]) -> Call:
    """The model NeMo records: the family's model class called with its NeMo config of
    ``kwargs`` (the config's constructor arguments, then the strategy's parallelism), NeMo's
    default optimizer and the HF tokenizer copied under :data:`TOKENIZER_DIR`."""
    from megatron.core.optimizer.optimizer_config import OptimizerConfig

    core_cls = family.config_class(nemo=False)
    order = nemo_field_order(core_cls)
    unknown = sorted(set(kwargs) - set(order))
    if unknown:
        raise TypeError(f"{core_cls.__name__} has no field(s) {', '.join(unknown)}")
    kwargs = kwargs | {k: v for k, v in _PARALLELISM.items() if k in order}
    config = Call(
        Symbol(*_class_ref(family.config_cls)), [(n, kwargs[n]) for n in order if n in kwargs]
    )
    opt = OptimizerConfig(**_DEFAULT_OPTIMIZER)
    opt_args = [(f.name, getattr(opt, f.name)) for f in dataclasses.fields(opt) if f.init]
    optim = Call(Symbol(*_OPTIM), [("config", Call(Symbol.named(_ref(OptimizerConfig)), opt_args))])
    tokenizer = Call(Symbol(*_TOKENIZER), [("pretrained_model_name", TOKENIZER_DIR)])
    return Call(
        Symbol(*_class_ref(family.model_cls)),
        [("config", config), ("optim", optim), ("tokenizer", tokenizer)],
    )


def context_call(model: Call) -> Call:
    """The ``TrainerContext`` of ``model`` with the one-device CPU trainer a conversion records."""
    strategy = Call(Symbol(*_STRATEGY), list(_STRATEGY_ARGS.items()))
    trainer = Call(
        Symbol(*_TRAINER), [("accelerator", "cpu"), ("strategy", strategy), ("devices", 1)]
    )
    return Call(Symbol(*_CONTEXT), [("model", model), ("trainer", trainer), ("extra", {})])


def _ref(obj) -> str:
    return f"{inspect.getmodule(obj).__name__}:{obj.__qualname__}"


def _class_ref(ref) -> tuple[str, str]:
    """(module, qualname) of a family's ``config_cls`` / ``model_cls`` without importing it."""
    if isinstance(ref, str):
        module, _, name = ref.partition(":")
        return module, name
    return inspect.getmodule(ref).__name__, ref.__qualname__


# --- model.yaml -------------------------------------------------------------------------------


def model_yaml(family, model: Call) -> str:
    """``context/model.yaml``: the model's arguments with every default, as NeMo writes it."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def target(obj) -> str:
        return f"{inspect.getmodule(obj).__name__}.{obj.__qualname__}"

    def function(dumper, data):
        return dumper.represent_data({"_target_": target(data), "_call_": False})

    def anything(dumper, data):
        try:
            value = {"_target_": target(data), "_call_": False}
        except AttributeError:
            value = {"_target_": target(type(data)), "_call_": True}
        return dumper.represent_data(value)

    Dumper.add_representer(types.FunctionType, function)
    Dumper.add_representer(type, function)
    Dumper.add_representer(
        torch.dtype, lambda d, v: d.represent_data({"_target_": str(v), "_call_": False})
    )
    Dumper.add_representer(
        Symbol, lambda d, v: d.represent_data({"_target_": f"{v.module}.{v.name}", "_call_": False})
    )
    Dumper.add_multi_representer(object, anything)

    core_cls = family.config_class(nemo=False)
    defaults = {**_NEMO_ONLY, **_field_defaults(core_cls)}
    config, optim, tokenizer = (v for _, v in model.args)
    (opt_config,) = (v for _, v in optim.args)

    def with_defaults(call: Call, default: dict) -> dict:
        return {**default, **dict(call.args)} | {
            "_target_": f"{call.target.module}.{call.target.name}"
        }

    tree = {
        "config": with_defaults(
            config, {n: defaults[n] for n in nemo_field_order(core_cls) if n in defaults}
        ),
        "optim": with_defaults(optim, _OPTIM_DEFAULTS) | {"config": with_defaults(opt_config, {})},
        "tokenizer": with_defaults(tokenizer, _TOKENIZER_DEFAULTS),
        "model_transform": None,
        "_target_": f"{model.target.module}.{model.target.name}",
    }
    return yaml.dump(tree, Dumper=Dumper)


# --- the files --------------------------------------------------------------------------------


def write_context(out: Path, family, kwargs: dict[str, Any]) -> None:
    """``out/context/io.json`` and ``model.yaml`` for the family's config of ``kwargs``; the
    tokenizer goes under ``out/context/`` + :data:`TOKENIZER_DIR` (the caller's)."""
    model = model_call(family, kwargs)
    context = Path(out) / "context"
    context.mkdir(parents=True, exist_ok=True)
    (context / "io.json").write_text(io_json(context_call(model)))
    (context / "model.yaml").write_text(model_yaml(family, model))


def common_state() -> dict[str, Any]:
    """What ``weights/common.pt`` holds beside the tensors of a checkpoint saved before any step:
    Lightning's ``dump_checkpoint`` of a fresh one-device trainer (its loops' counters at zero, its
    default ``ModelCheckpoint``), as NeMo's ``MegatronStrategy.save_checkpoint`` hands it over."""
    progress = {"ready": 0, "completed": 0, "started": 0, "processed": 0}
    two = {"ready": 0, "completed": 0}
    three = {"ready": 0, "completed": 0, "started": 0}

    def batches(last: bool = True):
        out = {"total": dict(progress), "current": dict(progress)}
        return out | ({"is_last_batch": False} if last else {})

    fit = {
        "state_dict": {},
        "epoch_loop.state_dict": {"_batches_that_stepped": 0},
        "epoch_loop.batch_progress": batches(),
        "epoch_loop.scheduler_progress": {"total": dict(two), "current": dict(two)},
        "epoch_loop.automatic_optimization.state_dict": {},
        "epoch_loop.automatic_optimization.optim_progress": {
            "optimizer": {
                "step": {"total": dict(two), "current": dict(two)},
                "zero_grad": {"total": dict(three), "current": dict(three)},
            }
        },
        "epoch_loop.manual_optimization.state_dict": {},
        "epoch_loop.manual_optimization.optim_step_progress": {
            "total": dict(two),
            "current": dict(two),
        },
        "epoch_loop.val_loop.state_dict": {},
        "epoch_loop.val_loop.batch_progress": batches(),
        "epoch_progress": {"total": dict(progress), "current": dict(progress)},
    }
    checkpoint = {
        "monitor": None,
        "best_model_score": None,
        "best_model_path": "",
        "current_score": None,
        "dirpath": None,
        "best_k_models": {},
        "kth_best_model_path": "",
        "kth_value": torch.tensor(float("inf")),
        "last_model_path": "",
    }
    callback = (
        "ModelCheckpoint{'monitor': None, 'mode': 'min', 'every_n_train_steps': 0, "
        "'every_n_epochs': 1, 'train_time_interval': None}"
    )
    return {
        "epoch": 0,
        "global_step": 0,
        "pytorch-lightning_version": _lightning_version(),
        "state_dict": {},
        "loops": {
            "fit_loop": fit,
            "validate_loop": {"state_dict": {}, "batch_progress": batches()},
            "test_loop": {"state_dict": {}, "batch_progress": batches()},
            "predict_loop": {"state_dict": {}, "batch_progress": batches(last=False)},
        },
        "callbacks": {callback: checkpoint},
        "optimizer_states": {},
        "lr_schedulers": [],
    }


@functools.cache
def _lightning_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lightning")
    except PackageNotFoundError:
        return LIGHTNING_VERSION
