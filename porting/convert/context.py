"""Checking NeMo's ``context/io.json`` before anything reads it.

NeMo stores a checkpoint's model, tokenizer and trainer as a fiddle graph and rebuilds it with
fiddle's default pyref policy, which imports and calls any non-builtin symbol the file names
(``nemo/lightning/io/api.py``: ``load_context``; ``fiddle/_src/experimental/serialization.py``). A
crafted ``io.json`` therefore runs code the moment NeMo loads it. ``porting verify`` and ``porting
export`` never load it (the model is rebuilt from our manifest); ``porting train`` and
``llm.export_ckpt`` do, through NeMo. :func:`check_io_json` reads the file as plain JSON, imports
nothing it names, and refuses every symbol outside an allow-list, naming the entry.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from porting.errors import PortingError
from porting.untrusted import read_json

# Exactly what NeMo 2.7.3 writes for a model, tokenizer, trainer and optimizer, beyond the classes
# of the namespaces below and what the checkpoint's family declares (Family.context_symbols).
_EXACT = {
    "builtins": {"dict", "list", "tuple"},
    "fiddle._src.config": {"Config", "Partial", "BuildableTraverserMetadata"},
    "torch": {"float32", "bfloat16", "float16"},
    "torch.nn.functional": {"silu", "gelu", "relu"},
    # the classes of every imported checkpoint's context, allowed without importing NeMo to see
    # them (verification and export run without it; the namespace rule below imports)
    "nemo.lightning.io.pl": {"TrainerContext"},
    "nemo.lightning.pytorch.trainer": {"Trainer"},
    "nemo.lightning.pytorch.strategies.megatron_strategy": {"MegatronStrategy"},
    "nemo.lightning.pytorch.optim.megatron": {"MegatronOptimizerModule"},
    "nemo.collections.common.tokenizers.huggingface.auto_tokenizer": {"AutoTokenizer"},
    "megatron.core.optimizer.optimizer_config": {"OptimizerConfig"},
    # and what `porting train` adds to the contexts it saves
    "megatron.core.distributed.distributed_data_parallel_config": {"DistributedDataParallelConfig"},
    "nemo.collections.llm.gpt.data.pre_training": {"PreTrainingDataModule"},
    "nemo.lightning.pytorch.optim.lr_scheduler": {"CosineAnnealingScheduler"},
    "porting.train.recipe": {"BuiltLayout", "ThroughputLogger"},
}
# Namespaces whose classes (defined there, not re-exported from elsewhere) may be built: NeMo's and
# Megatron's configs, models, strategies and tokenizers, Lightning's callbacks, our families and
# our training callbacks.
_CLASS_NAMESPACES = ("nemo.", "megatron.core.", "lightning.pytorch.", "models.", "porting.train.")
MAX_IO_JSON_BYTES = 64 * 2**20


def _in_namespaces(module: str) -> bool:
    return module.startswith(_CLASS_NAMESPACES)


def allowed(module: str, name: str, family=None) -> bool:
    """Whether ``module.name`` may appear in an ``io.json``; imports only allowed namespaces.

    ``family`` (the checkpoint's) adds its ``context_symbols``, the classes it names
    (``config_cls``, ``model_cls``: allowed without importing them, so that verification never
    loads NeMo for them) and the classes defined in its config's, model's and core config's
    modules, or moved from there to another of them (:func:`porting.mcore.moved_to`: names that
    checkpoints written before still use), so that an outside package's family needs no entry
    here.
    """
    if name in _EXACT.get(module, ()):
        return True
    if family is not None:
        # what the family names (its classes, known without importing them: a NeMo class's module
        # loads NeMo, which verification does without)
        declared = (*family.context_symbols, family.config_cls, family.model_cls)
        if any(context_symbol(o) == (module, name) for o in declared):
            return True
        if module in family.megatron_modules:
            # the family's own installed module, not the checkpoint's: importing it runs no input
            namespace = vars(importlib.import_module(module))
            # a class it held before moving to another of the family's modules
            moved = getattr(namespace.get("__getattr__"), "moved", {})
            if moved.get(name) in family.megatron_modules:
                return True
            obj = namespace.get(name)
            if isinstance(obj, type) and obj.__module__ == module:
                return True
    if not _in_namespaces(module) or not name.isidentifier():
        return False
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return False
    return isinstance(obj, type) and _in_namespaces(getattr(obj, "__module__", "") + ".")


def _where(obj_key: str, objects: dict, owners: dict[str, str]) -> str:
    """The entry's path in the object graph (``<root>.model.optim``), else its object key.

    fiddle keeps a config's callable in a separate metadata object, so that object is named by
    the path of the config that owns it.
    """
    obj = objects.get(owners.get(obj_key, obj_key))
    paths = obj.get("paths") if isinstance(obj, dict) else None
    if isinstance(paths, list) and paths and isinstance(paths[0], str):
        return paths[0]
    return f"objects.{obj_key}"


_REMOTE_CODE = ("trust_remote_code", "Attr(name='trust_remote_code')")


def _truthy_leaf(value) -> bool:
    leaf = value.get("value") if isinstance(value, dict) and value.get("type") == "leaf" else value
    return leaf not in (None, False)


def _walk(node, where: str, path: Path, family) -> None:
    """Refuse any disallowed pyref and any request for remote code below ``node``."""
    if isinstance(node, dict):
        if node.get("type") == "pyref":
            module, name = node.get("module"), node.get("name")
            ok = isinstance(module, str) and isinstance(name, str)
            if not (ok and allowed(module, name, family)):
                raise PortingError(
                    f"{path}: {where} names {module}.{name}, which is not on the allow-list of "
                    "what a NeMo context may build (NeMo's, Megatron's and our model, config and "
                    "trainer classes, torch dtypes, the family's context_symbols); refusing to "
                    "load this checkpoint"
                )
        pairs = list(node.items())
    elif isinstance(node, list):
        # fiddle writes a config's arguments as [["Attr(name='x')", value], ...]
        pairs = [tuple(v) for v in node if isinstance(v, list) and len(v) == 2]
        for value in node:
            _walk(value, where, path, family)
    else:
        return
    for key, value in pairs:
        if key in _REMOTE_CODE and _truthy_leaf(value):
            raise PortingError(
                f"{path}: {where} asks for trust_remote_code, which runs code shipped with the "
                "checkpoint; refusing to load it"
            )
        if isinstance(node, dict):
            _walk(value, where, path, family)


def check_io_json(ckpt: str | Path, family=None) -> None:
    """Refuse ``CKPT/context/io.json`` unless every symbol it names is allowed (``family``: the
    checkpoint's, whose declared symbols are allowed too; see :func:`allowed`).

    Raises :class:`PortingError` naming the file and the entry (its path in the NeMo object graph,
    e.g. ``<root>.model.optim.config.optimizer``).
    """
    path = Path(ckpt) / "context" / "io.json"
    data = read_json(path, ckpt, MAX_IO_JSON_BYTES)
    if not isinstance(data, dict) or not isinstance(data.get("objects", {}), dict):
        raise PortingError(f"{path}: not a NeMo context (no object table)")
    objects = data.get("objects", {})
    owners = {
        obj["metadata"]["key"]: key
        for key, obj in objects.items()
        if isinstance(obj, dict)
        and isinstance(obj.get("metadata"), dict)
        and isinstance(obj["metadata"].get("key"), str)
    }
    for key, obj in objects.items():
        _walk(obj, _where(key, objects, owners), path, family)
    _walk({k: v for k, v in data.items() if k != "objects"}, "<root>", path, family)


def context_symbol(obj) -> tuple[str, str]:
    """(module, qualname) of a context symbol, given as an object or named ``"module:qualname"``."""
    if isinstance(obj, str):
        module, _, name = obj.partition(":")
        return module, name
    return obj.__module__, obj.__qualname__
