"""What the engine knows of a model family: its tables, its config classes and its shape context.

A family is a plugin: a :class:`Family` object in any importable module, named by an entry point
in the ``porting.families`` group of the package that ships it (docs/families.md). The module that
defines it imports only :mod:`porting.contract`: its Megatron classes are named
(``"models.falcon_nemo:FalconConfig"``, :mod:`porting.contract.named`) and loaded by the engine when a
conversion needs them, so that listing the families or refusing a config imports no torch, NeMo or
Megatron.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from porting.contract.config_map import ConfigEntry
from porting.contract.container import Container
from porting.contract.mapping import EXPERT, LAYER, MTP, Entry
from porting.contract.named import is_ref, load, module_of
from porting.errors import PortingError


def _class_or_ref(value: Any) -> bool:
    return isinstance(value, type) or is_ref(value)


def _load_class(family: Family, attr: str) -> type:
    cls = load(getattr(family, attr))
    if not isinstance(cls, type):
        raise PortingError(
            f"family {family.name}: Family.{attr} {getattr(family, attr)!r} names a "
            f"{type(cls).__name__}, not a class"
        )
    return cls


@functools.cache
def _hf_pattern(pattern: str) -> re.Pattern:
    """An HF key pattern of the weight table (``*`` a layer, ``#`` an expert, ``@`` an MTP layer)
    as a regex."""
    wild = (LAYER, EXPERT, MTP)
    parts = re.split("(" + "|".join(map(re.escape, wild)) + ")", pattern)
    return re.compile("".join(r"\d+" if p in wild else re.escape(p) for p in parts))


@dataclass(frozen=True)
class ShapeContext:
    """Shape facts the mapping transforms and ``when`` predicates read.

    Families with more variant switches subclass it (e.g. Falcon's norm count).
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    tied_output: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    mtp_layers: int = 0  # Megatron-Core's multi-token-prediction layers (``mtp_num_layers``)

    @classmethod
    def from_config(cls, config: Any, vocab_size: int, **extra: Any) -> ShapeContext:
        """The shape facts of a Megatron GPT ``config`` (``vocab_size``: the HF, unpadded one),
        plus a subclass's own fields in ``extra``."""
        return cls(
            num_layers=config.num_layers,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_query_groups=config.num_query_groups or config.num_attention_heads,
            head_dim=config.kv_channels,
            vocab_size=vocab_size,
            padded_vocab_size=config.vocab_size,
            tied_output=config.share_embeddings_and_output_weights,
            mtp_layers=getattr(config, "mtp_num_layers", None) or 0,
            **extra,
        )


@dataclass(frozen=True)
class Variant:
    """A layout a family converts, as ``porting families`` lists it (``7b_mqa``: what it is)."""

    name: str
    summary: str


@dataclass(frozen=True)
class Family:
    """One model family: the HF architectures it claims, its Megatron config/model classes and tables.

    Attributes:
        name: short family name used in manifests, messages and ``--family`` (``tsuzumi``).
        architectures: the ``config.json`` ``architectures[0]`` values the family converts.
        config_entries: the HF config mapping and lint (:mod:`porting.contract.config_map`).
        weights: the weight mapping table (:mod:`porting.contract.mapping`).
        config_cls: the family's NeMo/Megatron config dataclass, named ``"module:Class"`` (a
            class is accepted too, at the price of importing it with the family).
        model_cls: the family's NeMo ``GPTModel`` subclass, named likewise.
        core_config_cls: the same config without NeMo (a ``porting.mcore.GPTCore`` subclass in
            a module that imports no NeMo), named likewise: verification and export build their
            Megatron-Core model from it and never load NeMo. ``None``: they use ``config_cls``.
        shape_context: builds the :class:`ShapeContext` from a Megatron config.
        model_types: ``config.json`` ``model_type`` values the family also claims, for checkpoints
            whose architecture name is their own (``auto_map`` code, never run by us).
        hf_model_class: the class the HF reference side loads: a ``transformers`` class name or
            the class itself; ``None`` means the ``transformers`` class named like the
            checkpoint's architecture.
        hf_attn_implementation: the ``transformers`` attention implementation parity runs the HF
            side with; ``"eager"`` unless the family's eager path disagrees with its default one
            (transformers 4.57's eager Falcon adds ALiBi twice; its default, sdpa, once).
        variants: the layouts the family's tests prove, for ``porting families``.
        summary: one line for ``porting families``.
        context_symbols: functions (or other non-class objects; named ``"module:name"`` or given)
            the family's config names, which
            NeMo writes into a checkpoint's ``context/io.json`` (a layer-spec function, an
            activation): the io.json check allows them, and the classes defined in the config's
            and model's modules, for this family's checkpoints.
        fp32_tensors: HF key patterns (the table's ``*`` layer and ``#`` expert wildcards) of
            tensors a checkpoint may keep in float32 whatever its weight dtype (DeepSeek-V3's
            ``e_score_correction_bias``): stored as F32, they take no part in choosing the import
            dtype, are never cast on import (the Megatron parameter must be fp32 too) and are
            written back as F32 on export.
        mtp_count: the ``config.json`` key that counts multi-token-prediction layers stored after
            the decoder's (DeepSeek-V3's ``num_nextn_predict_layers``). A checkpoint that holds
            the decoder's layers and none of those imports its decoder alone, with the key read as
            0 and written back as it came: transformers' classes build no such layer, so every
            transformers save declares it and stores none.
        containers: the checkpoint classes that hold this family's language model beside parts
            porting does not convert (a vision-language class:
            :class:`porting.contract.container.Container`). Such a checkpoint imports its
            language model through this family and carries the rest byte for byte.
        plan_shape: what the planner needs from a config of this family:
            ``plan_shape(config, source, read)`` with the parsed ``config.json`` (transformers
            4.x's spelling), its name for messages and the planner's readers
            (:class:`porting.planner.model.Readers`: a field checked against the planner's
            ceilings, the Llama layout, experts, latent attention), returning the keyword fields
            of :class:`porting.planner.model.ModelShape` (width, heads, layer kinds, experts,
            attention). ``None``: the Llama layout's reading (``read.llama_layout``), experts
            included; a family whose config says more (Falcon's block, DeepSeek's latent
            attention) gives its own.
    """

    name: str
    architectures: tuple[str, ...]
    config_entries: tuple[ConfigEntry, ...]
    weights: tuple[Entry, ...]
    config_cls: str | type
    model_cls: str | type
    shape_context: Callable[[Any], ShapeContext]
    model_types: tuple[str, ...] = ()
    hf_model_class: str | type | None = None
    hf_attn_implementation: str = "eager"
    variants: tuple[Variant, ...] = ()
    summary: str = ""
    context_symbols: tuple[Any, ...] = ()
    fp32_tensors: tuple[str, ...] = ()
    core_config_cls: str | type | None = None
    mtp_count: str | None = None
    plan_shape: Callable[[dict, str, Any], dict] | None = None
    containers: tuple[Container, ...] = ()

    def check(self) -> None:
        """Raise :class:`PortingError` naming the first attribute of the wrong kind.

        A plugin's ``Family`` is built by code we did not write; the registry checks it once, when
        it loads, so that a malformed one is reported as that plugin's error instead of failing
        later inside every command that lists the families.
        """

        def tuple_of(kinds) -> Callable[[Any], bool]:
            return lambda v: isinstance(v, tuple) and all(isinstance(x, kinds) for x in v)

        rules = (
            ("name", lambda v: isinstance(v, str) and v != "", "a non-empty string"),
            ("architectures", tuple_of(str), "a tuple of strings"),
            ("model_types", tuple_of(str), "a tuple of strings"),
            ("config_entries", tuple_of(ConfigEntry), "a tuple of config_map entries"),
            ("weights", tuple_of(Entry), "a tuple of Rename, Fused, Ignore"),
            ("config_cls", _class_or_ref, "a class or a 'module:Class' name"),
            ("model_cls", _class_or_ref, "a class or a 'module:Class' name"),
            ("shape_context", callable, "a function"),
            ("hf_model_class", lambda v: v is None or isinstance(v, str | type), "a class name"),
            ("hf_attn_implementation", lambda v: isinstance(v, str), "a string"),
            ("variants", tuple_of(Variant), "a tuple of Variant"),
            ("summary", lambda v: isinstance(v, str), "a string"),
            ("context_symbols", lambda v: isinstance(v, tuple), "a tuple"),
            ("fp32_tensors", tuple_of(str), "a tuple of strings"),
            (
                "core_config_cls",
                lambda v: v is None or _class_or_ref(v),
                "None, a class or a 'module:Class' name",
            ),
            ("mtp_count", lambda v: v is None or (isinstance(v, str) and v != ""), "None or a key"),
            ("plan_shape", lambda v: v is None or callable(v), "None or a function"),
            ("containers", tuple_of(Container), "a tuple of Container"),
        )
        for attr, ok, what in rules:
            value = getattr(self, attr)
            if not ok(value):
                raise PortingError(
                    f"Family.{attr} must be {what}, not {type(value).__name__} {value!r:.80}"
                )
        if not self.keys:
            raise PortingError("Family claims no architecture and no model type")
        for container in self.containers:
            container.check()
            if container.text_architecture not in self.architectures:
                raise PortingError(
                    f"Family.containers: {container.architecture}'s text_architecture "
                    f"{container.text_architecture!r} is not one of the family's architectures"
                )

    def keeps_fp32(self, key: str) -> bool:
        """Whether HF tensor ``key`` matches one of :attr:`fp32_tensors`."""
        return any(_hf_pattern(p).fullmatch(key) for p in self.fp32_tensors)

    def config_class(self, nemo: bool = True) -> type:
        """The config class, imported now if it was named (this loads the Megatron side):
        NeMo's, or with ``nemo=False`` the NeMo-free one where the family has it."""
        if not nemo and self.core_config_cls is not None:
            return _load_class(self, "core_config_cls")
        return _load_class(self, "config_cls")

    def model_class(self) -> type:
        """The model class, imported now if it was named (this loads the Megatron side)."""
        return _load_class(self, "model_cls")

    @property
    def megatron_modules(self) -> frozenset[str]:
        """The modules that define the config and model classes, known without importing them."""
        classes = (self.config_cls, self.model_cls, self.core_config_cls)
        return frozenset(module_of(c) for c in classes if c is not None)

    @property
    def keys(self) -> tuple[str, ...]:
        """Every registry key the family claims: its architectures, then its model types."""
        return (*self.architectures, *self.model_types)

    def claims(self, hf_config: dict) -> bool:
        """Whether an HF ``config.json`` (parsed) is one of this family's."""
        archs = hf_config.get("architectures") or [None]
        return archs[0] in self.architectures or hf_config.get("model_type") in self.model_types

    def hf_class(self, architecture: str) -> type:
        """The class that loads the HF reference side of a checkpoint of ``architecture``."""
        import transformers

        cls = self.hf_model_class or architecture
        if isinstance(cls, type):
            return cls
        found = getattr(transformers, cls, None)
        if found is None:
            raise PortingError(
                f"family {self.name} ({self.source}): transformers {transformers.__version__} has "
                f"no class {cls!r} for the HF side; set Family.hf_model_class to the class"
            )
        return found

    @property
    def source(self) -> str:
        """The file that defines the family, for messages that point an author at it: the module
        holding it as ``FAMILY`` (where its tables are), else its shape context's module."""
        # a module's own namespace, not getattr: a lazy module (transformers 5's) imports a
        # submodule for any name it is asked for
        module = next(
            (m for m in list(sys.modules.values()) if vars(m).get("FAMILY") is self),
            sys.modules.get(getattr(self.shape_context, "__module__", "")),
        )
        path = getattr(module, "__file__", None)
        return str(Path(path)) if path else f"family {self.name}"
