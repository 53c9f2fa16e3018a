"""Megatron-LM's layout: ``<root>/latest_checkpointed_iteration.txt`` naming ``<root>/iter_NNNNNNN/``
(keys ``decoder...``, ``megatron/training/checkpointing.py``: ``generate_state_dict`` saves
``model.sharded_state_dict()`` unprefixed), its saved arguments in ``common.pt`` (or, as
Megatron-Core 0.19 writes it, a ``common_state`` record inside the ``torch_dist`` files).

Our own files (``porting.json``, the tokenizer, HF extras) live in ``<root>/porting/``, beside the
iterations, so a run that trains on in the same directory keeps them. Megatron-Bridge's layout is
this one plus its own files (:mod:`porting.convert.layouts.megatron_bridge`).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import pickle
import re
import shutil
import zipfile
from pathlib import Path

from porting.convert.bridge import RUN_CONFIG
from porting.convert.layouts.base import Located
from porting.convert.manifest import MANIFEST, Manifest, write_manifest
from porting.errors import PortingError
from porting.untrusted import checkpoint_dir, read_bytes, read_int

TRACKER = "latest_checkpointed_iteration.txt"
OURS = "porting"  # our directory beside the iterations
_ITER = re.compile(r"iter_(\d{7,})")
# A converted checkpoint has not trained: Megatron-LM's first iteration.
ITERATION = 0
# Megatron-LM's checkpoint_version for torch_dist checkpoints (generate_state_dict).
CHECKPOINT_VERSION = 3.0
# Megatron-LM's saved arguments and counters are a few KB.
MAX_COMMON_BYTES = 64 << 20

# --- reading what a Megatron checkpoint saved ---------------------------------------------------


class SavedEnum:
    """An enum member named in saved arguments, kept as its class name and value (never imported)."""

    def __init__(self, cls: str, value) -> None:
        self.cls, self.value = cls, value

    def __repr__(self) -> str:
        return f"{self.cls}({self.value!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, SavedEnum) and (self.cls, self.value) == (other.cls, other.value)

    def __hash__(self) -> int:
        return hash((self.cls, self.value))


# Enums Megatron-LM and Megatron-Bridge put in their saved arguments (Megatron-Core 0.15-0.19):
# each is read as a SavedEnum, so the module that defines it is never imported.
SAVED_ENUMS = (
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.transformer.enums.InferenceCudaGraphScope",
    "megatron.core.transformer.enums.LayerType",
    "megatron.core.enums.ModelType",
    "megatron.core.enums.Fp8Recipe",
    "megatron.core.enums.Fp4Recipe",
    "signal.Signals",
)


def _enum_standin(qualified: str):
    def make(value):
        return SavedEnum(qualified, value)

    make.__name__ = make.__qualname__ = qualified.rsplit(".", 1)[1]
    make.__module__ = qualified.rsplit(".", 1)[0]
    return make


def load_common(raw: bytes, where: str) -> dict:
    """The common state (``common.pt`` or the ``common_state`` record) of a Megatron checkpoint.

    torch's weights-only unpickler, which refuses every global it does not know, by name, with
    only ``argparse.Namespace`` and the enums in :data:`SAVED_ENUMS` (as :class:`SavedEnum`) added:
    nothing in a checkpoint trained elsewhere can run code here.
    """
    import torch

    try:
        zipped = zipfile.is_zipfile(io.BytesIO(raw))
        members = zipfile.ZipFile(io.BytesIO(raw)).infolist() if zipped else []
    except Exception as err:  # zipfile raises many types for a corrupt archive
        raise PortingError(f"{where}: unreadable ({err})") from err
    for member in members:
        # torch.save stores every member as is; a compressed one could inflate a small file into
        # any size when read
        if member.compress_type != zipfile.ZIP_STORED or member.file_size > len(raw):
            raise PortingError(f"{where}: {member.filename} is compressed; torch.save stores all")
    allowed = [argparse.Namespace] + [(_enum_standin(q), q) for q in SAVED_ENUMS]
    try:
        with torch.serialization.safe_globals(allowed):
            state = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        # torch's message is paragraphs of advice; the reason is the line naming the global.
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        why = next((line for line in lines if "GLOBAL " in line), lines[-1] if lines else "")
        why = why.removeprefix("WeightsUnpickler error: ").split(" was not an allowed")[0]
        raise PortingError(f"{where}: refused ({why.rstrip('.')})") from err
    except Exception as err:  # a corrupt zip or pickle
        raise PortingError(f"{where}: unreadable ({err})") from err
    if isinstance(state, list) and len(state) == 1:  # the common_state record wraps it
        state = state[0]
    if not isinstance(state, dict):
        raise PortingError(f"{where}: holds a {type(state).__name__}, not a dict")
    return state


def read_common(loc: Located) -> dict:
    """The common state of a Megatron-layout checkpoint: ``common.pt`` where there is one, else
    the ``common_state`` record in its ``torch_dist`` files."""
    from porting.convert.dist_reader import read_metadata, read_record

    legacy = loc.weights / "common.pt"
    if os.path.lexists(legacy):
        return load_common(read_bytes(legacy, loc.root, MAX_COMMON_BYTES), str(legacy))
    md = read_metadata(loc.weights)
    for idx, info in md.storage_data.items():
        if idx.fqn.startswith("common_state/"):
            if info.length > MAX_COMMON_BYTES:
                raise PortingError(
                    f"{loc.weights}: the common_state record is {info.length} bytes, more than "
                    f"the {MAX_COMMON_BYTES} it may hold"
                )
            raw = read_record(loc.weights, info)
            return load_common(raw, f"{loc.weights / info.relative_path} (common_state)")
    raise PortingError(f"{loc.weights}: neither common.pt nor a common_state record")


# --- writing the Megatron layouts ----------------------------------------------------------------


def _renamed(fqn: str, old: str, new: str) -> str:
    return new + fqn.removeprefix(old) if fqn.startswith(old) else fqn


def rekey_metadata(weights: Path, old: str, new: str) -> None:
    """Rewrite ``weights/.metadata`` with every key's prefix ``old`` replaced by ``new``.

    The ``.distcp`` files are untouched: a record holds only a tensor, and ``.metadata`` alone says
    which key each record belongs to (``torch/distributed/checkpoint/filesystem.py``). The save
    plans Megatron keeps for its next save of the same structure are dropped: they describe the
    old keys, and loading never reads them.
    """
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from porting.convert.dist_reader import read_metadata, writable

    md = writable(read_metadata(weights))
    changes = {
        "state_dict_metadata": {
            _renamed(k, old, new): v for k, v in md.state_dict_metadata.items()
        },
        "storage_data": {
            MetadataIndex(_renamed(i.fqn, old, new), i.offset, i.index): info
            for i, info in md.storage_data.items()
        },
    }
    if getattr(md, "mcore_data", None):
        changes["mcore_data"] = {_renamed(k, old, new): v for k, v in md.mcore_data.items()}
    out = dataclasses.replace(md, **changes)
    if hasattr(out, "all_local_plans"):
        del out.all_local_plans
    tmp = weights / ".metadata.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(out, f)
    tmp.replace(weights / ".metadata")


def megatron_args(config, padded_vocab_size: int, family_name: str) -> argparse.Namespace:
    """The Megatron-LM arguments that describe ``config`` (a family's Megatron config).

    Exactly the architecture arguments ``load_args_from_checkpoint`` reads back under
    ``--use-checkpoint-args`` (``megatron/training/checkpointing.py``), plus the precision and the
    vocabulary padding, all plain values: a Megatron-LM run can take the model's shape from the
    checkpoint, and our export can check it against the tensors.
    """
    scaling = getattr(config, "rope_scaling_type", None)
    if scaling is not None:
        # Megatron-LM rebuilds the rotary embedding from these arguments (--use-checkpoint-args),
        # and none of them carries a scaling's parameters: it would run the model unscaled.
        raise PortingError(
            f"family {family_name}: rotary scaling {scaling!r} has no Megatron-LM checkpoint "
            "argument, so Megatron-LM would run this model unscaled; the megatron-lm layout cannot "
            "describe it (use --format nemo2)"
        )
    act = getattr(config.activation_func, "__name__", "")
    gated = bool(config.gated_linear_unit)
    experts = getattr(config, "num_moe_experts", None)
    window = getattr(config, "window_size", None)
    args = dict(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.ffn_hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_query_groups or config.num_attention_heads,
        group_query_attention=bool(
            config.num_query_groups and config.num_query_groups != config.num_attention_heads
        ),
        kv_channels=config.kv_channels,
        seq_length=config.seq_length,
        max_position_embeddings=config.seq_length,
        position_embedding_type=config.position_embedding_type,
        add_position_embedding=config.position_embedding_type == "learned_absolute",
        use_rotary_position_embeddings=config.position_embedding_type == "rope",
        rotary_base=getattr(config, "rotary_base", 10000),
        rotary_percent=getattr(config, "rotary_percent", 1.0),
        rotary_interleaved=bool(getattr(config, "rotary_interleaved", False)),
        add_bias_linear=bool(config.add_bias_linear),
        add_qkv_bias=bool(getattr(config, "add_qkv_bias", False)),
        swiglu=gated and act == "silu",
        squared_relu=act == "squared_relu",
        untie_embeddings_and_output_weights=not config.share_embeddings_and_output_weights,
        apply_layernorm_1p=bool(config.layernorm_zero_centered_gamma),
        normalization=config.normalization,
        norm_epsilon=config.layernorm_epsilon,
        qk_layernorm=bool(config.qk_layernorm),
        apply_query_key_layer_scaling=bool(config.apply_query_key_layer_scaling),
        attention_dropout=config.attention_dropout,
        hidden_dropout=config.hidden_dropout,
        window_size=tuple(window) if window else None,
        num_experts=experts,
        moe_router_topk=getattr(config, "moe_router_topk", 2),
        moe_ffn_hidden_size=getattr(config, "moe_ffn_hidden_size", None),
        moe_shared_expert_intermediate_size=getattr(
            config, "moe_shared_expert_intermediate_size", None
        ),
        moe_router_pre_softmax=bool(getattr(config, "moe_router_pre_softmax", False)),
        moe_router_score_function=getattr(config, "moe_router_score_function", "softmax"),
        moe_grouped_gemm=False,
        moe_layer_freq=1,
        padded_vocab_size=padded_vocab_size,
        make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
        tokenizer_type="HuggingFaceTokenizer",
        tokenizer_model=None,
        params_dtype=config.params_dtype,
        bf16=bool(config.bf16),
        fp16=bool(config.fp16),
        ckpt_format="torch_dist",
        use_dist_ckpt=True,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        num_layers_per_virtual_pipeline_stage=None,
        expert_model_parallel_size=1,
        consumed_train_samples=0,
        consumed_valid_samples=0,
        iteration=0,
        porting_family=family_name,
    )
    return argparse.Namespace(**args)


def write_common(weights: Path, args: argparse.Namespace | None, iteration: int = 0) -> None:
    """Replace ``weights/common.pt`` with Megatron-LM's common state for ``args`` (``None``: no
    ``args``, as Megatron-Bridge's own saves have none).

    The keys ``generate_state_dict`` writes for a model-only checkpoint; torch's ``common.pt``
    backend, which Megatron-Core 0.15 through 0.19 load (0.19 calls it legacy and reads it first).
    """
    import torch

    state = {
        **({"args": args} if args is not None else {}),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "num_floating_point_operations_so_far": 0,
        "content_metadata": {"singleton_local_shards": False, "chained_optim_avoid_prefix": True},
    }
    tmp = weights / "common.pt.tmp"
    torch.save(state, tmp)
    tmp.replace(weights / "common.pt")
    (weights / "metadata.json").write_text(
        json.dumps(
            {
                "sharded_backend": "torch_dist",
                "sharded_backend_version": 1,
                "common_backend": "torch",
                "common_backend_version": 1,
            }
        )
    )


def from_nemo2(out: Path, manifest: Manifest, args: argparse.Namespace | None) -> Path:
    """Turn the NeMo 2 checkpoint at ``out`` into iteration :data:`ITERATION` of this layout, in
    place, all but the tracker, with ``args`` in its common state; returns the iteration
    directory.

    The tensors stay where they are; only ``.metadata`` is rewritten and NeMo's context replaced
    by Megatron-LM's common state and our ``porting/`` directory. ``out`` is a private directory
    that becomes the output only once the gate passes (``claimed_output``).
    """
    weights = iteration_dir(out, ITERATION)
    (out / "weights").rename(weights)
    rekey_metadata(weights, "module.", "")
    write_common(weights, args)
    ours = out / OURS
    ours.mkdir()
    ctx = out / "context"
    shutil.move(str(ctx / MANIFEST), ours / MANIFEST)
    tok = Path(manifest.tokenizer["path"]).name if manifest.tokenizer else None
    if tok:
        shutil.move(str(ctx / tok), ours / "tokenizer")
    if (ctx / "hf_extra").is_dir():
        shutil.move(str(ctx / "hf_extra"), ours / "hf_extra")
    shutil.rmtree(ctx)  # NeMo's io.json and model.yaml describe a NeMo run, not this layout
    if tok:
        manifest = dataclasses.replace(
            manifest, tokenizer={"kind": "hf", "path": f"{OURS}/tokenizer"}
        )
    write_manifest(out, manifest, ours)
    return weights


# --- finding the layout --------------------------------------------------------------------------


def iteration_dir(root: Path, iteration: int) -> Path:
    """Where Megatron-LM keeps ``iteration`` of the checkpoint at ``root``."""
    return root / f"iter_{iteration:07d}"


def _is_iteration(path: Path) -> bool:
    """An iteration directory given for its checkpoint, by its name and ``.metadata``."""
    return (path / ".metadata").is_file() and bool(
        _ITER.fullmatch(path.name) or path.name == "release"
    )


def _tracked_iteration(root: Path) -> tuple[int | None, Path]:
    """The iteration directory ``latest_checkpointed_iteration.txt`` names, checked to be one."""
    tracked = read_int(root / TRACKER, root, "an iteration number", ("release",))
    if tracked == "release":
        return None, root / "release"
    return tracked, iteration_dir(root, tracked)


class MegatronLM:
    """``--format megatron-lm``."""

    name = "megatron-lm"
    title = "Megatron-LM"
    prefix = ""
    adoptable = True
    looks = f"a Megatron-LM one {TRACKER} and iter_NNNNNNN/"

    def marks(self, path: Path) -> bool:
        return (path / TRACKER).exists()

    def root_of(self, path: Path) -> Path | None:
        return path.parent if _is_iteration(path) else None

    def owns(self, weights: Path) -> bool:
        """Whether the Megatron iteration ``weights`` is this layout's rather than a refinement's:
        one with Megatron-Bridge's run_config.yaml is Bridge's, even where that file is a link, so
        that it is refused when read rather than skipped."""
        return not os.path.lexists(weights / RUN_CONFIG)

    def find(self, path: Path) -> Located | None:
        iteration: int | None
        if os.path.lexists(path / TRACKER):
            iteration, weights = _tracked_iteration(path)
            root = path
        elif _is_iteration(path):
            m = _ITER.fullmatch(path.name)
            iteration, weights, root = (int(m.group(1)) if m else None), path, path.parent
        else:
            return None
        if not os.path.lexists(weights):
            raise PortingError(f"{weights}: the iteration the checkpoint names is missing")
        checkpoint_dir(weights, root)
        if not self.owns(weights):
            return None
        if os.path.lexists(root / OURS):
            checkpoint_dir(root / OURS, root)
        return Located(self, root, weights, root / OURS, iteration)

    def check_saved(self, loc: Located, family=None) -> None:
        read_common(loc)

    def saved_config(self, loc: Located, family=None) -> tuple[dict, str]:
        args = read_common(loc).get("args")
        if not isinstance(args, argparse.Namespace):
            return {}, str(loc.weights)
        return vars(args), f"{loc.weights}/common state (args)"

    def check_config(self, config, family) -> None:
        """Every family's model: the saved arguments are checked against the HF config on read."""

    def common_args(self, config, manifest: Manifest) -> argparse.Namespace | None:
        """The Megatron-LM arguments the common state holds: what ``--use-checkpoint-args``
        builds the model from (:func:`megatron_args`)."""
        return megatron_args(config, manifest.padded_vocab_size, manifest.family)

    def write(self, out: Path, config, manifest: Manifest, family) -> None:
        from_nemo2(out, manifest, self.common_args(config, manifest))
        (out / TRACKER).write_text(f"{ITERATION}\n")


MEGATRON_LM = MegatronLM()
