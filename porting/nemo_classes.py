"""The one factory of a family's NeMo 2.0 classes.

A family's NeMo 2.0 config is its NeMo-free core config (``models.<family>.<Name>Core``, the
fields and maths of the family) mixed into a base NeMo config (``GPTConfig``, or the NeMo config
of the family it derives from), and its model is NeMo's ``GPTModel`` defaulting to that config.
Nothing else differs between families, so one function makes both. They are bound as globals of
the family's own ``<family>_nemo`` module, whose path is what a checkpoint's ``context/io.json``
names and NeMo imports (so the module must keep making them under those names)::

    MistralConfig, MistralModel = nemo_classes(MistralCore, LlamaConfig, __name__)

Imports NeMo when called: only a NeMo-bound module calls it.
"""

from __future__ import annotations

from dataclasses import dataclass


def nemo_classes(core: type, base_config: type, module: str) -> tuple[type, type]:
    """``(<Name>Config, <Name>Model)`` for the core config ``<Name>Core``, in ``module``."""
    from nemo.collections.llm.gpt.model.base import GPTModel

    name = core.__name__.removesuffix("Core")

    def made(cls_name: str, bases: tuple[type, ...], doc: str, **members) -> type:
        ns = {"__module__": module, "__qualname__": cls_name, "__doc__": doc, **members}
        return type(cls_name, bases, ns)

    config_cls = dataclass(
        made(
            f"{name}Config",
            (core, base_config),
            f"NeMo's GPT config with the fields and maths of :class:`{core.__module__}."
            f"{core.__qualname__}`.",
        )
    )

    def __init__(self, config=None, optim=None, tokenizer=None, model_transform=None):
        GPTModel.__init__(
            self,
            config or config_cls(),
            optim=optim,
            tokenizer=tokenizer,
            model_transform=model_transform,
        )

    model_cls = made(
        f"{name}Model",
        (GPTModel,),
        f"NeMo 2.0 model of the {name} family (a ``GPTModel`` with :class:`{name}Config`).",
        __init__=__init__,
    )
    return config_cls, model_cls
