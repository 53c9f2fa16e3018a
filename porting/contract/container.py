"""A checkpoint class that holds a family's language model beside parts porting does not convert.

The most downloaded Gemma 3, Mistral Small 3.x and Llama 4 checkpoints are vision-language
classes (``Gemma3ForConditionalGeneration``, ``Mistral3ForConditionalGeneration``): a language
model, whose config is the container's ``text_config``, beside a vision tower and a projector. A
family names the containers of its language model (:attr:`porting.contract.family.Family.containers`);
the engine imports the language model through the family's own table and carries everything
else byte for byte (:mod:`porting.convert.container`). Nothing here reads a file.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from porting.contract import hf_spelling
from porting.errors import PortingError


@dataclass(frozen=True)
class Container:
    """One container class of a family's language model.

    Attributes:
        architecture: the container's ``architectures[0]`` (``Gemma3ForConditionalGeneration``).
        text_architecture: the family's class whose tensor names its table reads
            (``Gemma3ForCausalLM``): the language model's tensors are read under those names.
        spellings: how a checkpoint of the container names the language model's tensors, each
            a tuple of ``(stored prefix, the text class's prefix)``. The first is the
            container class's own parameter names (what the gate's reference model holds);
            the others are how checkpoints store them (transformers' checkpoint conversion
            mapping: ``language_model.model.`` as published). A checkpoint's spelling is the
            first whose first prefix starts one of its tensors' names; a tensor no prefix of
            it starts is carried.
        text_config: the container config's key holding the language model's config.
        unapplied: keys of the text config the container class does not apply, though the text
            class does (``Gemma3ForConditionalGeneration`` never soft-caps its logits, whatever
            ``final_logit_softcapping`` says): read as null, so that the language model is
            converted as the container runs it, and written back as they came.
    """

    architecture: str
    text_architecture: str
    spellings: tuple[tuple[tuple[str, str], ...], ...]
    text_config: str = "text_config"
    unapplied: tuple[str, ...] = ()

    def check(self) -> None:
        """Raise :class:`PortingError` naming what is malformed (a plugin's container)."""
        names = (self.architecture, self.text_architecture, self.text_config, *self.unapplied)
        if not isinstance(self.unapplied, tuple) or not all(
            isinstance(n, str) and n for n in names
        ):
            raise PortingError(
                "Container.architecture, text_architecture and text_config must be non-empty "
                "strings, unapplied a tuple of them"
            )
        ok = isinstance(self.spellings, tuple) and self.spellings
        for spelling in self.spellings if ok else ():
            ok = ok and isinstance(spelling, tuple) and bool(spelling)
            for pair in spelling if ok else ():
                ok = ok and (
                    isinstance(pair, tuple)
                    and len(pair) == 2
                    and all(isinstance(p, str) and p.endswith(".") for p in pair)
                )
        if not ok:
            raise PortingError(
                f"Container {self.architecture!r}: spellings must be a non-empty tuple of "
                "non-empty tuples of (stored prefix, text prefix) pairs, each ending in '.'"
            )

    def text_view(self, config: dict, where: str) -> dict:
        """The language model's config in a container's ``config``, as import, the gate and the
        planner read a checkpoint's own: in transformers 4.x's spelling, with ``architectures``
        naming :attr:`text_architecture` and :attr:`unapplied` keys null. The file as it came
        stays the container's, which export writes back."""
        text = config.get(self.text_config)
        if not isinstance(text, dict):
            raise PortingError(
                f"{where}: a {self.architecture} config needs its language model's config as an "
                f"object under {self.text_config!r}"
            )
        view = {**copy.deepcopy(text), "architectures": [self.text_architecture]}
        if hf_spelling.is_v5(view):
            view = hf_spelling.internal(view, f"{where}: {self.text_config}")
        return {**view, **dict.fromkeys(k for k in self.unapplied if k in view)}

    @property
    def own_names(self) -> tuple[tuple[str, str], ...]:
        """The container class's own spelling (its parameters' names)."""
        return self.spellings[0]

    def spelling_of(self, keys: list[str]) -> tuple[tuple[str, str], ...] | None:
        """The spelling of a checkpoint whose tensors are ``keys``; None where none fits."""
        for spelling in self.spellings:
            first = spelling[0][0]
            if any(k.startswith(first) for k in keys):
                return spelling
        return None


def renamed(key: str, pairs: tuple[tuple[str, str], ...]) -> str | None:
    """``key`` with the first of ``pairs``' prefixes that starts it replaced by its partner;
    None where none does."""
    for old, new in pairs:
        if key.startswith(old):
            return new + key[len(old) :]
    return None


def reversed_pairs(pairs: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """The same renaming backwards (text names to stored ones)."""
    return tuple((new, old) for old, new in pairs)


# transformers' vision-language classes since 4.52 (Gemma 3, Mistral 3, LLaVA): the language model
# at model.language_model, its head at lm_head; checkpoints store it as published before that
# (language_model.model., language_model.lm_head.), which transformers 4.57 and 5 still write
VISION_LANGUAGE = (
    (("model.language_model.", "model."), ("lm_head.", "lm_head.")),
    (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")),
)


@dataclass(frozen=True)
class ContainerSource:
    """A container checkpoint as a command reads it: the family whose language model it holds,
    that family's :class:`Container` and its ``config.json`` as the file holds it."""

    family: Any
    container: Container
    config: dict


def language_pairs(
    held: ContainerSource, keys: list[str], where: str, names: str = "text"
) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    """``(renaming, spelling)`` of a container checkpoint whose tensors are ``keys``: how it
    spells its language model, and the renaming (stored prefix -> shown prefix) that shows the
    language model's tensors under its family's text class's names (``names="text"``: import,
    its checks) or under the container class's own (``"own"``: the gate's reference model)."""
    container = held.container
    spelling = container.spelling_of(keys)
    if spelling is None:
        prefixes = ", ".join(s[0][0] for s in container.spellings)
        raise PortingError(
            f"{where}: a {container.architecture} checkpoint with no language-model tensor "
            f"(none starts with {prefixes})"
        )
    if names == "text":
        return spelling, spelling
    own = {text: name for name, text in container.own_names}
    return tuple((stored, own[text]) for stored, text in spelling if text in own), spelling
