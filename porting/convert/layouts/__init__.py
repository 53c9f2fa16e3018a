"""The checkpoint layouts we write and read, and checking a checkpoint in any of them against the
family it is read by (:func:`check_saved_metadata`).

All keep the model in the same ``torch_dist`` format (``.metadata`` + ``*.distcp``); they differ in
where that directory lies, the prefix of its keys and the metadata beside it:
:mod:`~porting.convert.layouts.nemo2`, :mod:`~porting.convert.layouts.megatron_lm`,
:mod:`~porting.convert.layouts.megatron_bridge`, each a
:class:`~porting.convert.layouts.base.Layout` listed in :mod:`porting.convert.layouts.registry`.
A Megatron checkpoint without our files (trained elsewhere) is read with the HF config given by
the user (:mod:`porting.convert.foreign`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from porting.convert.layouts.base import Located
from porting.convert.layouts.megatron_lm import SavedEnum, load_common, read_common
from porting.errors import PortingError
from porting.untrusted import shown

if TYPE_CHECKING:
    from porting.convert.checkpoint import Checkpoint

__all__ = [
    "SavedEnum",
    "check_recorded_shapes",
    "check_saved_metadata",
    "check_saved_shape",
    "load_common",
    "read_common",
]


def check_saved_metadata(ckpt: Checkpoint | str | os.PathLike, family) -> None:
    """Refuse a checkpoint (a path is opened here: the gate still hands one) whose own metadata
    would run code when its owner loads it (its layout's
    :meth:`~porting.convert.layouts.base.Layout.check_saved`), whose saved architecture or
    recorded tensor shapes (:func:`check_recorded_shapes`) disagree with the manifest we read it
    by, before any model or buffer is sized by either, and one whose tokenizer or HF extra files
    do not parse: every command that reads the checkpoint refuses what any of them would."""
    from porting.convert.checkpoint import extra_file, open_checkpoint, tokenizer_files
    from porting.convert.megatron import DTYPES, build_config
    from porting.convert.preflight import check_nemo_counts

    checkpoint = open_checkpoint(ckpt)
    loc, manifest = checkpoint.located, checkpoint.manifest
    loc.layout.check_saved(loc, family)
    tokenizer_files(checkpoint)
    for name in manifest.extra_files:
        extra_file(checkpoint, name)
    config, _ = build_config(
        family,
        manifest.hf_config,
        DTYPES[manifest.dtype],
        1,
        padded_vocab_size=manifest.padded_vocab_size,
    )
    check_saved_shape(loc, config, checkpoint.source, family)
    # The layer count and vocabulary first: named by the manifest's field, and a manifest claiming
    # 10**5 layers is refused before even a meta model of that size is built.
    check_nemo_counts(checkpoint, config)
    check_recorded_shapes(loc, config, checkpoint.source)


def check_recorded_shapes(loc: Located, config, where: str) -> None:
    """Every tensor of the model ``config`` (from ``where``) describes against the global shape
    the checkpoint's ``.metadata`` records for it: one line naming the tensor and both shapes.

    The model is built on the meta device, so a config claiming 2**40 rows costs nothing, and
    ``.metadata`` has been checked against the bytes stored for each tensor
    (:func:`porting.convert.dist_reader.read_metadata`), so either side that lies is caught here,
    before a model is built for real or a tensor is read.
    """
    import torch

    from porting.convert.dist_reader import DistCheckpointReader
    from porting.convert.megatron import build_mcore_model, init_parallel
    from porting.convert.preflight import check_nemo_layout

    reader = DistCheckpointReader(loc.weights)
    init_parallel()
    # Megatron passes no device to torch.empty under CPU initialisation (on a GPU it names one).
    config.use_cpu_initialization = True
    with torch.device("meta"):
        model = build_mcore_model(config)
    check_nemo_layout(model.sharded_state_dict(prefix=loc.prefix), reader, where)


# Saved architecture facts checked against the HF config's: (Megatron-LM argument or
# Megatron-Bridge provider field, the family config's attribute).
_SAVED_SHAPE = (
    ("num_layers", "num_layers"),
    ("hidden_size", "hidden_size"),
    ("ffn_hidden_size", "ffn_hidden_size"),
    ("num_attention_heads", "num_attention_heads"),
    ("num_query_groups", "num_query_groups"),
    ("kv_channels", "kv_channels"),
    ("normalization", "normalization"),
)


def check_saved_shape(loc: Located, config, where: str, family=None) -> None:
    """What the checkpoint saved about its architecture (its layout's
    :meth:`~porting.convert.layouts.base.Layout.saved_config`) against ``config`` (from
    ``where``; ``family``: ``config``'s): the first disagreement is one line naming both files, the
    field and both values."""
    saved, source = loc.layout.saved_config(loc, family)
    for name, attr in _SAVED_SHAPE:
        ours, theirs = getattr(config, attr, None), saved.get(name)
        if name == "num_query_groups" and theirs is None:
            theirs = saved.get("num_attention_heads")
        if attr == "num_query_groups" and ours is None:
            ours = config.num_attention_heads
        if theirs is not None and ours is not None and theirs != ours:
            raise PortingError(
                f"{source}: {name} is {shown(theirs)}, but {where} makes it {ours!r}"
            )
