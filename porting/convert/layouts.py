"""The three checkpoint layouts we write and read: NeMo 2, Megatron-LM and Megatron-Bridge.

All three keep the model in the same ``torch_dist`` format (``.metadata`` + ``*.distcp``); they
differ in where that directory lies, the prefix of its keys and the metadata beside it:

- ``nemo2``: ``<root>/weights/`` (keys ``module.decoder...``, NeMo's ``MegatronParallel``
  wrapper), ``<root>/context/`` (NeMo's ``io.json``, our ``porting.json`` and the tokenizer);
- ``megatron-lm``: ``<root>/latest_checkpointed_iteration.txt`` naming ``<root>/iter_NNNNNNN/``
  (keys ``decoder...``, ``megatron/training/checkpointing.py``: ``generate_state_dict`` saves
  ``model.sharded_state_dict()`` unprefixed), its saved arguments in ``common.pt`` (or, as
  Megatron-Core 0.19 writes it, a ``common_state`` record inside the ``torch_dist`` files);
- ``megatron-bridge``: the Megatron-LM layout (Bridge writes the same tracker) plus
  ``iter_NNNNNNN/run_config.yaml`` (the model provider's fields) and ``train_state.pt``, with
  ``latest_train_state.pt`` beside the iterations (``megatron/bridge/training/checkpointing.py``).

In the two Megatron layouts our own files (``porting.json``, the tokenizer, HF extras) live in
``<root>/porting/``, beside the iterations, so a run that trains on in the same directory keeps
them. A checkpoint without them (trained elsewhere) is read with the HF config given by the user
(:func:`adopt`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import pickle
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from porting.errors import PortingError

FORMATS = ("nemo2", "megatron-lm", "megatron-bridge")
TRACKER = "latest_checkpointed_iteration.txt"
RUN_CONFIG = "run_config.yaml"
OURS = "porting"  # our directory in the Megatron layouts
_ITER = re.compile(r"iter_(\d{7,})")
_PREFIX = {"nemo2": "module.", "megatron-lm": "", "megatron-bridge": ""}
# Megatron-LM's checkpoint_version for torch_dist checkpoints (generate_state_dict).
CHECKPOINT_VERSION = 3.0


@dataclass(frozen=True)
class Located:
    """Where one checkpoint's parts are."""

    format: str
    root: Path
    weights: Path  # the torch_dist directory
    prefix: str  # of every model tensor key in it
    meta: Path  # our porting.json, tokenizer/ and hf_extra/ (context/ for NeMo 2)
    iteration: int | None = None

    @property
    def manifest_path(self) -> Path:
        """Where ``porting.json`` is (or would be)."""
        return self.meta / "porting.json"


def _tracked_iteration(root: Path) -> tuple[int | None, Path]:
    """The iteration directory ``latest_checkpointed_iteration.txt`` names, checked to be one."""
    tracker = root / TRACKER
    if tracker.is_symlink() or not tracker.is_file():
        raise PortingError(f"{tracker}: not a regular file")
    text = tracker.read_text(errors="replace").strip()
    if text == "release":
        return None, root / "release"
    if not text.isdigit():
        raise PortingError(f"{tracker}: holds {text[:40]!r}, not an iteration number or 'release'")
    return int(text), root / f"iter_{int(text):07d}"


def locate(ckpt: str | os.PathLike, fmt: str | None = None) -> Located:
    """Find the layout of the checkpoint at ``ckpt`` (its root, or one iteration directory).

    ``fmt`` (one of :data:`FORMATS`) is checked against what the directory holds; a mismatch is
    an error that names both, never a guess.
    """
    path = Path(ckpt)
    if fmt is not None and fmt not in FORMATS:
        raise PortingError(f"unknown checkpoint format {fmt!r}; one of {', '.join(FORMATS)}")
    if not path.is_dir():
        raise PortingError(f"{path}: not a directory")
    iteration: int | None
    if (path / "weights").is_dir() and (path / "context").is_dir():
        found = Located("nemo2", path, path / "weights", "module.", path / "context")
    else:
        if (path / TRACKER).exists():
            iteration, weights = _tracked_iteration(path)
            root = path
        elif (path / ".metadata").is_file() and (
            _ITER.fullmatch(path.name) or path.name == "release"
        ):
            m = _ITER.fullmatch(path.name)
            iteration, weights, root = (int(m.group(1)) if m else None), path, path.parent
        else:
            raise PortingError(
                f"{path}: not a checkpoint we know: a NeMo 2 checkpoint has context/ and weights/, "
                f"a Megatron-LM one {TRACKER} and iter_NNNNNNN/, a Megatron-Bridge one also "
                f"{RUN_CONFIG} in its iteration"
            )
        if weights.is_symlink() or not weights.is_dir():
            raise PortingError(f"{weights}: the iteration the checkpoint names is missing")
        if not weights.resolve().is_relative_to(root.resolve()):
            raise PortingError(f"{weights}: lies outside {root}")
        kind = "megatron-bridge" if (weights / RUN_CONFIG).exists() else "megatron-lm"
        found = Located(kind, root, weights, _PREFIX[kind], root / OURS, iteration)
    if fmt is not None and fmt != found.format:
        raise PortingError(f"{path}: a {found.format} checkpoint, not {fmt}")
    return found


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
    from porting.convert.checkpoint import regular_file
    from porting.convert.dist_reader import read_metadata

    legacy = loc.weights / "common.pt"
    if legacy.exists():
        return load_common(regular_file(legacy, inside=loc.root).read_bytes(), str(legacy))
    md = read_metadata(loc.weights)
    for idx, info in md.storage_data.items():
        if idx.fqn.startswith("common_state/"):
            if Path(info.relative_path).name != info.relative_path:
                raise PortingError(f"{loc.weights}: common_state points at {info.relative_path!r}")
            path = regular_file(loc.weights / info.relative_path, inside=loc.weights)
            with open(path, "rb") as f:
                f.seek(info.offset)
                raw = f.read(info.length)
            if len(raw) != info.length:
                raise PortingError(f"{path}: truncated; common_state needs bytes past its end")
            return load_common(raw, f"{path} (common_state)")
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

    from porting.convert.dist_reader import read_metadata

    md = read_metadata(weights)
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


def write_common(weights: Path, args: argparse.Namespace, iteration: int = 0) -> None:
    """Replace ``weights/common.pt`` with Megatron-LM's common state for ``args``.

    The keys ``generate_state_dict`` writes for a model-only checkpoint; torch's ``common.pt``
    backend, which Megatron-Core 0.15 through 0.19 load (0.19 calls it legacy and reads it first).
    """
    import torch

    state = {
        "args": args,
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


def nemo_to_megatron(tmp: Path, fmt: str, config, manifest, run_config: dict | None) -> None:
    """Turn the finished NeMo 2 checkpoint at ``tmp`` into the ``fmt`` layout, in place.

    The tensors stay where they are; only ``.metadata`` is rewritten and NeMo's context replaced
    by the target's own metadata and our ``porting/`` directory. ``tmp`` is a private directory
    that becomes the output only once the gate passes (``claimed_output``).
    """
    from porting.convert.checkpoint import write_manifest

    iteration = 0
    weights = tmp / f"iter_{iteration:07d}"
    (tmp / "weights").rename(weights)
    rekey_metadata(weights, "module.", "")
    write_common(weights, megatron_args(config, manifest.padded_vocab_size, manifest.family))
    ours = tmp / OURS
    ours.mkdir()
    ctx = tmp / "context"
    shutil.move(str(ctx / "porting.json"), ours / "porting.json")
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
    write_manifest(tmp, manifest, ours)
    if fmt == "megatron-bridge":
        from porting.convert.bridge import write_bridge_files

        write_bridge_files(tmp, weights, iteration, run_config)
    (tmp / TRACKER).write_text(f"{iteration}\n")


def check_saved_metadata(ckpt: str | os.PathLike, family=None) -> None:
    """Refuse a checkpoint whose own metadata would run code when its owner loads it: NeMo 2's
    ``io.json`` (:func:`porting.convert.context.check_io_json`), Megatron-LM's common state
    (:func:`read_common`), Megatron-Bridge's ``run_config.yaml``
    (:func:`porting.convert.bridge.check_run_config`); and, in the Megatron layouts, one whose
    saved architecture disagrees with the manifest we read it by (its owner would build another
    model from it)."""
    loc = locate(ckpt)
    if loc.format == "nemo2":
        from porting.convert.context import check_io_json

        check_io_json(loc.root, family)
        return
    read_common(loc)
    if loc.format == "megatron-bridge":
        from porting.convert.bridge import check_run_config

        check_run_config(loc.weights / RUN_CONFIG, family)
    if family is not None:
        from porting.convert.checkpoint import adopted, read_manifest
        from porting.convert.megatron import DTYPES, build_config

        manifest = read_manifest(ckpt)
        config, _ = build_config(
            family,
            manifest.hf_config,
            DTYPES[manifest.dtype],
            1,
            padded_vocab_size=manifest.padded_vocab_size,
        )
        stand_in = adopted(ckpt)
        check_saved_shape(loc, config, stand_in.source if stand_in else str(loc.manifest_path))


def check_saved_shape(loc: Located, config, where: str) -> None:
    """What the checkpoint saved about its architecture (:func:`saved_shape`) against ``config``
    (from ``where``): the first disagreement is one line naming both files, the field and both
    values."""
    saved, source = saved_shape(loc)
    for name, attr in _SAVED_SHAPE:
        ours, theirs = getattr(config, attr, None), saved.get(name)
        if name == "num_query_groups" and theirs is None:
            theirs = saved.get("num_attention_heads")
        if attr == "num_query_groups" and ours is None:
            ours = config.num_attention_heads
        if theirs is not None and ours is not None and theirs != ours:
            raise PortingError(f"{source}: {name} is {theirs!r}, but {where} makes it {ours!r}")


def to_megatron_layout(tmp: Path, fmt: str, family, manifest, vocab_divisor: int) -> None:
    """Turn the NeMo 2 checkpoint just written at ``tmp`` (with ``manifest``) into ``fmt``."""
    from porting.convert.megatron import DTYPES, build_config

    config, _ = build_config(
        family,
        manifest.hf_config,
        DTYPES[manifest.dtype],
        vocab_divisor,
        padded_vocab_size=manifest.padded_vocab_size,
    )
    run_config = None
    if fmt == "megatron-bridge":
        from porting.convert.bridge import run_config_for

        run_config = run_config_for(config, family)
    nemo_to_megatron(tmp, fmt, config, manifest, run_config)


# --- checkpoints trained elsewhere ---------------------------------------------------------------

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


def saved_shape(loc: Located) -> tuple[dict, str]:
    """The architecture a Megatron checkpoint says it has (its saved arguments, or Bridge's
    ``run_config.yaml`` model section), and the file that says it."""
    if loc.format == "megatron-bridge":
        from porting.convert.bridge import check_run_config

        model = check_run_config(loc.weights / RUN_CONFIG)
        return model, f"{loc.weights / RUN_CONFIG} (model)"
    args = read_common(loc).get("args")
    if not isinstance(args, argparse.Namespace):
        return {}, str(loc.weights)
    return vars(args), f"{loc.weights}/common state (args)"


def foreign_manifest(loc: Located, hf_config: Path, tokenizer: Path | None):
    """A manifest for a Megatron checkpoint we did not write, from the HF ``config.json`` of its
    architecture (``hf_config``: the file or the directory holding it).

    The family is the one claiming that config; its Megatron config is checked against what the
    checkpoint saved (layers, widths, heads, norm) and against its tensors before anything is
    built. The padded vocabulary is the embedding's rows, the dtype the embedding's.
    """
    from porting.convert.checkpoint import Adopted, Manifest
    from porting.convert.dist_reader import DistCheckpointReader
    from porting.convert.megatron import build_config, dtype_name
    from porting.registry import family_for_hf_dir

    hf_config = Path(hf_config)
    if hf_config.is_file():
        if hf_config.name != "config.json":
            raise PortingError(f"{hf_config}: give an HF config.json (or the directory holding it)")
        hf_config = hf_config.parent
    family, cfg = family_for_hf_dir(hf_config)
    where = hf_config / "config.json"
    reader = DistCheckpointReader(loc.weights)
    emb = loc.prefix + "embedding.word_embeddings.weight"
    if emb not in reader.keys():
        raise PortingError(f"{loc.weights}: no {emb!r}; not a GPT checkpoint")
    padded = reader.global_shape(emb)[0]
    dtype = reader.dtype(emb)
    config, _ = build_config(family, cfg, dtype, 1, padded_vocab_size=padded)
    check_saved_shape(loc, config, f"{where} ({family.name})")
    vocab = cfg.get("vocab_size")
    if not isinstance(vocab, int) or vocab > padded:
        raise PortingError(
            f"{where}: vocab_size {vocab!r} does not fit the checkpoint's {padded} embedding rows"
        )
    manifest = Manifest(
        family=family.name,
        hf_architecture=cfg["architectures"][0],
        hf_config=cfg,
        vocab_size=vocab,
        padded_vocab_size=padded,
        dtype=dtype_name(dtype),
    )
    if tokenizer is None and any(hf_config.glob("tokenizer*")):
        tokenizer = hf_config  # the HF directory the config came from carries its tokenizer
    return Adopted(
        manifest, Path(tokenizer) if tokenizer else None, f"{where} (--hf-config)", hf_config
    )


def add_source_flags(p) -> None:
    """``--format``, ``--hf-config`` and ``--tokenizer``: how a command reads its checkpoint."""
    p.add_argument(
        "--format",
        dest="src_format",
        choices=FORMATS,
        help="the checkpoint's layout (default: found from the directory; docs/formats.md)",
    )
    p.add_argument(
        "--hf-config",
        type=Path,
        metavar="PATH",
        help="for a Megatron-LM or Megatron-Bridge checkpoint not written by porting: the HF "
        "config.json of its architecture (or the directory holding it); checked against the "
        "checkpoint's saved arguments and tensors. Nothing is fetched",
    )
    p.add_argument(
        "--tokenizer",
        type=Path,
        metavar="DIR",
        help="with --hf-config: the HF tokenizer directory to carry (default: the --hf-config "
        "directory's tokenizer files, if any)",
    )


@contextlib.contextmanager
def reading(ckpt, fmt: str | None = None, hf_config=None, tokenizer=None):
    """Read the checkpoint ``ckpt`` for the block: its layout checked against ``fmt``, and a
    checkpoint trained elsewhere adopted with ``hf_config`` (:func:`foreign_manifest`)."""
    from porting.convert.checkpoint import adopt

    loc = locate(ckpt, fmt)
    if hf_config is None:
        if tokenizer is not None:
            raise PortingError("--tokenizer goes with --hf-config (a checkpoint trained elsewhere)")
        yield loc
        return
    if loc.manifest_path.exists():
        raise PortingError(
            f"{ckpt}: carries its own {loc.manifest_path.name}; --hf-config is for checkpoints "
            "trained elsewhere"
        )
    if loc.format == "nemo2":
        raise PortingError(f"{ckpt}: a NeMo 2 checkpoint is read from its manifest only")
    stand_in = foreign_manifest(loc, hf_config, tokenizer)
    with tempfile.TemporaryDirectory(prefix="porting-tokenizer-") as staging:
        if stand_in.tokenizer_dir is not None:
            stand_in = dataclasses.replace(
                stand_in, tokenizer_dir=_tokenizer_files_of(stand_in.tokenizer_dir, Path(staging))
            )
        with adopt(ckpt, stand_in):
            yield loc


def _tokenizer_files_of(src: Path, staging: Path) -> Path:
    """The tokenizer of the HF directory ``src``, as ``transformers`` saves it into ``staging``:
    only its own files (never the weights or the config beside them)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
    except (OSError, ValueError) as err:
        raise PortingError(f"{src}: no usable tokenizer ({err})") from err
    tok.save_pretrained(str(staging))
    return staging
