"""Megatron-Bridge's metadata beside a ``torch_dist`` iteration: ``run_config.yaml`` and the
train state, written from a family's Megatron config and read back as data only.

Megatron-Bridge rebuilds a model from ``iter_NNNNNNN/run_config.yaml``'s ``model:`` section by
instantiating its ``_target_`` (a model provider) and every nested ``_target_``
(``megatron/bridge/training/model_load_save.py``: ``load_model_config``). We write that section
from the family's config; we read one only as bounded YAML data
(:func:`porting.untrusted.read_yaml`) and check every ``_target_`` against an allow-list,
never instantiating anything.

``bridge_fields.json`` lists the fields of ``megatron.bridge.models.gpt_provider.GPTModelProvider``
in megatron-bridge 0.6.2 (a test on the current stack checks it against the class).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from porting.errors import PortingError

PROVIDER = "megatron.bridge.models.gpt_provider.GPTModelProvider"
RUN_CONFIG = "run_config.yaml"  # in each iteration directory
_FIELDS = frozenset(json.loads((Path(__file__).with_name("bridge_fields.json")).read_text()))
# Fields of a NeMo GPT config that describe a training run, not the model: never written.
_RUNTIME = frozenset(
    {
        "forward_step_fn",
        "data_step_fn",
        "generation_config",
        "async_tensor_model_parallel_allreduce",
        "moe_extended_tp",
        "moe_use_legacy_grouped_gemm",
        "init_method",
        "output_layer_init_method",
        "embedding_init_method",
        "attention_backend",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "virtual_pipeline_model_parallel_size",
        "context_parallel_size",
        "sequence_parallel",
        "expert_model_parallel_size",
        "perform_initialization",
        "use_cpu_initialization",
    }
)
_DTYPES = ("params_dtype", "pipeline_dtype", "autocast_dtype")
# Spec functions NeMo's GPT configs and ours name, and Bridge's own function of the same meaning.
_SPECS = {
    "porting.mcore.default_layer_spec": "megatron.bridge.models.gpt_provider.default_layer_spec",
    "nemo.collections.llm.gpt.model.base.default_layer_spec": (
        "megatron.bridge.models.gpt_provider.default_layer_spec"
    ),
    "nemo.collections.llm.gpt.model.base.local_layer_spec": (
        "megatron.bridge.models.gpt_provider.local_layer_spec"
    ),
}
_PLAIN = (int, float, str, bool, type(None))
MAX_RUN_CONFIG_BYTES = 4 << 20


def _qualified(fn) -> str:
    import torch.nn.functional as F

    # torch's builtins say they live in torch._C (F.gelu is torch._C._nn.gelu): named where
    # users and the reader's allow-list know them
    if getattr(F, getattr(fn, "__name__", ""), None) is fn:
        return f"torch.nn.functional.{fn.__name__}"
    return f"{fn.__module__}.{fn.__qualname__}"


def family_provider(family) -> str | None:
    """The provider class a family ships for Bridge (``megatron_bridge_provider``, declared on
    its NeMo-free config class itself, not inherited: a provider is that class over Bridge's
    ``GPTModelProvider``, :class:`porting.mcore.BridgeProvider`), as ``run_config.yaml`` names
    it; ``None``: the family has none."""
    if family is None:
        return None
    return vars(family.config_class(nemo=False)).get("megatron_bridge_provider")


def _beyond_bridge(config) -> tuple[str, str] | None:
    """What keeps Bridge's own ``GPTModelProvider`` from describing ``config``: the family's
    ``megatron_bridge_refusal`` or the first field it lacks set away from its no-op value, as
    ``(what, why)``; ``None`` when it describes it."""
    import dataclasses

    refusal = getattr(type(config), "megatron_bridge_refusal", None)
    if refusal:  # a model-level piece the provider cannot hold, said by the family
        return "", refusal
    for f in dataclasses.fields(config):
        name, value = f.name, getattr(config, f.name)
        if name in _RUNTIME or name in _FIELDS or name.startswith("_"):
            continue
        if f.metadata.get("megatron") is False:  # porting's own bookkeeping, not the model's
            continue
        if value in (None, False, 0, (), []) or (
            name.startswith("rope_scaling") and not getattr(config, "rope_scaling_type", None)
        ):
            continue
        return (
            name,
            f"the family's Megatron config sets {name}={value!r}, a field the provider lacks",
        )
    return None


def run_config_for(config, family) -> dict:
    """The ``run_config.yaml`` content for a checkpoint of ``config`` (the family's Megatron
    config): the ``model:`` section and the checkpoint facts Bridge's loader reads on resume
    (no optimizer, no RNG state saved).

    The section is Bridge's own ``GPTModelProvider`` where that describes the model; otherwise
    the family's own provider (:func:`family_provider`), which has every field of the family's
    config; a family without one is refused, naming what Bridge's provider lacks (Bridge would
    build a different model).
    """
    import dataclasses
    import enum

    import torch

    beyond = _beyond_bridge(config)
    provider = family_provider(family) if beyond else None
    if beyond and not provider:
        raise PortingError(
            f"family {family.name}: Megatron-Bridge's GPTModelProvider cannot describe this "
            f"model ({beyond[1]}) and the family ships no provider of its own "
            "(megatron_bridge_provider, docs/families.md): use --format megatron-lm or nemo2"
        )
    # the fields the provider has: Bridge's, or the family's config's (a NeMo config's own
    # fields are NeMo's, not the provider's)
    has = (
        frozenset(f.name for f in dataclasses.fields(family.config_class(nemo=False)))
        if provider
        else _FIELDS
    )
    model: dict = {"_target_": provider or PROVIDER}
    for f in dataclasses.fields(config):
        name, value = f.name, getattr(config, f.name)
        if name in _RUNTIME or name.startswith("_") or f.metadata.get("megatron") is False:
            continue
        if name not in has:  # a no-op value (_beyond_bridge): left out
            continue
        if name in _DTYPES:
            model[name] = {
                "_target_": f"torch.{str(value).removeprefix('torch.')}",
                "_call_": False,
            }
        elif name == "activation_func":
            model[name] = {"_target_": _qualified(value), "_call_": False}
        elif name == "transformer_layer_spec":
            # a family's spec function may name Bridge's function that builds the same layers
            # (``megatron_bridge_spec``): Bridge's loader instantiates only its allowed prefixes
            target = _qualified(value) if callable(value) else None
            target = _SPECS.get(target) or getattr(value, "megatron_bridge_spec", None) or target
            model[name] = {"_target_": target, "_call_": False}
        elif isinstance(value, _PLAIN):
            model[name] = value
        elif isinstance(value, list | tuple) and all(isinstance(v, _PLAIN) for v in value):
            model[name] = list(value)
        elif isinstance(value, enum.Enum):
            # as Megatron's own YAML representer writes an enum (megatron/training/config/
            # yaml_utils.py: _enum_representer); Megatron-Core 0.19's inference_cuda_graph_scope
            cls = type(value)
            model[name] = {
                "_target_": f"{cls.__module__}.{cls.__qualname__}",
                "_call_": True,
                "_args_": [value.value],
                "_name_": value.name,
            }
        elif isinstance(value, torch.dtype):
            model[name] = {
                "_target_": f"torch.{str(value).removeprefix('torch.')}",
                "_call_": False,
            }
        else:
            raise PortingError(
                f"family {family.name}: config field {name} holds a {type(value).__name__}, which "
                "run_config.yaml cannot carry as data"
            )
    # Our embedding is already padded: Bridge must take vocab_size as it is.
    model["should_pad_vocab"] = False
    # How the checkpoint was saved, which Bridge's loader reads on resume: one unsharded copy
    # (torch_dist reshards to any layout on load).
    model.update(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        context_parallel_size=1,
        expert_model_parallel_size=1,
        sequence_parallel=False,
    )
    return {
        "model": model,
        "checkpoint": {"ckpt_format": "torch_dist", "save_optim": False, "save_rng": False},
    }


def write_bridge_files(root: Path, weights: Path, iteration: int, run_config: dict) -> None:
    """``run_config.yaml`` and ``train_state.pt`` in the iteration, ``latest_train_state.pt``
    beside it (``megatron/bridge/training/checkpointing.py``: ``save_checkpoint``)."""
    import shutil

    import torch
    import yaml

    (weights / RUN_CONFIG).write_text(yaml.safe_dump(run_config, sort_keys=False))
    zero = torch.tensor(0)
    state = {
        "step": torch.tensor(iteration),
        "consumed_train_samples": zero,
        "skipped_train_samples": zero,
        "consumed_valid_samples": zero,
        "floating_point_operations_so_far": torch.tensor(0.0),
        "do_train": torch.tensor(False),
        "do_valid": torch.tensor(False),
        "do_test": torch.tensor(False),
    }
    torch.save(state, weights / "train_state.pt")
    shutil.copyfile(weights / "train_state.pt", root / "latest_train_state.pt")


# Where a _target_ may point: torch's functions and dtypes, Megatron-Core's, Megatron-LM's training
# package's (Bridge's config classes live there) and Bridge's own modules. A checkpoint Bridge's
# training saved names a torch function by its native module where it has one (F.gelu is
# torch._C._nn.gelu).
_ALLOWED_TARGET = re.compile(
    r"(torch\.(nn\.functional|nn\.init|_C\._nn)\.[A-Za-z0-9_]+"
    r"|torch\.(float32|float16|bfloat16|float64|int64|int32)|signal\.Signals"
    r"|megatron\.(core|bridge|training)\.[A-Za-z0-9_.]+)"
)
_PROVIDER = re.compile(r"megatron\.bridge\.models\.[a-z0-9_.]+\.[A-Za-z0-9_]*Provider[A-Za-z0-9_]*")


def _check_targets(data, path: Path, family) -> None:
    """Every ``_target_`` in ``data``, in document order. Each dict or list is checked once: an
    alias repeats the same object, and walking it once per repetition is what made a 1 KB alias
    bomb run for minutes."""
    from porting.convert.context import context_symbol
    from porting.untrusted import shown

    declared = {".".join(context_symbol(o)) for o in family.context_symbols} if family else set()
    declared.add(family_provider(family))
    seen: set[int] = set()
    todo = [(data, "<root>")]
    while todo:
        node, where = todo.pop()
        if not isinstance(node, dict | list) or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, list):
            todo.extend((v, f"{where}[{i}]") for i, v in reversed(list(enumerate(node))))
            continue
        target = node.get("_target_")
        if target is not None and not (
            isinstance(target, str) and (_ALLOWED_TARGET.fullmatch(target) or target in declared)
        ):
            raise PortingError(f"{path}: {where}._target_ {shown(target)} is not allowed")
        todo.extend((v, f"{where}.{k}") for k, v in reversed(node.items()))


def check_run_config(path: str | os.PathLike, root: str | os.PathLike, family=None) -> dict:
    """Read ``run_config.yaml`` (a file of the checkpoint at ``root``) as data and return its
    ``model:`` section.

    Refused: a file that is not plain YAML data within :func:`porting.untrusted.read_yaml`'s
    bounds (size, depth, aliases expanded, numbers), a ``model:`` whose ``_target_`` is not a
    Megatron-Bridge model provider (or ``family``'s own, :func:`family_provider`), and any ``_target_`` anywhere outside torch's functions and
    dtypes, Megatron-Core, Megatron-Bridge and the functions ``family`` declares
    (``Family.context_symbols``).
    """
    from porting.untrusted import read_yaml, shown

    path = Path(path)
    data = read_yaml(path, root, MAX_RUN_CONFIG_BYTES)
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise PortingError(f"{path}: no model: section")
    provider = data["model"].get("_target_")
    if not isinstance(provider, str) or not (
        _PROVIDER.fullmatch(provider) or provider == family_provider(family)
    ):
        raise PortingError(
            f"{path}: model._target_ {shown(provider)} is not a Megatron-Bridge provider"
            + (f" or family {family.name}'s" if family is not None else "")
        )
    _check_targets(data, path, family)
    return data["model"]
