"""A ``porting train`` run's spec and the checks made of it before anything is launched: the
layout, batch and data against the model (:func:`validate`), the run directory's checkpoints
(:func:`check_run_dir`), a resume at another layout (:func:`check_layout_change`). Each failure
is a :class:`PortingError` naming the file and field (or the flag). A plan's check is
:mod:`porting.train.plan_check`; the checks in order, for either engine,
:mod:`porting.train.preflight`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from porting.errors import PortingError
from porting.guard import check_outputs

RECOMPUTE = ("none", "selective", "full")
# Written by SelfDescribingCheckpoint into every checkpoint's context/: the layout it was saved at.
LAYOUT_FILE = "train_layout.json"
# Validation history and the best checkpoint, kept beside the checkpoints (NeMoLogger moves files
# it finds in the run directory itself into run_N/ when a run restarts).
BEST_FILE = "best.json"


@dataclass
class TrainSpec:
    """What a continued-pretraining run needs; the CLI flags map one to one onto these fields.

    ``data`` and ``valid_data`` hold dataset prefixes (``out/corpus_text_document``), optionally
    with blend weights as ``[w1, prefix1, w2, prefix2, ...]`` in Megatron's style. Without
    ``valid_data``, validation reads the ``split`` share of ``data``.
    """

    checkpoint: Path
    data: list[str]
    out: Path
    tp: int = 1
    pp: int = 1
    vp: int | None = None
    cp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor-parallel size; None: Megatron's default, TP
    sequence_parallel: bool = False
    seq_length: int = 2048
    micro_batch: int = 1
    global_batch: int = 8
    steps: int = 100
    lr: float = 3e-5
    min_lr: float | None = None
    warmup: int = 0
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    save_every: int = 50  # 0: no checkpoints (quick experiments)
    valid_data: list[str] | None = None
    eval_every: int | None = None  # None: validate once, at the end
    eval_iters: int = 2  # global batches per validation
    split: str = "99,1,0"
    seed: int = 1234
    nodes: int = 1
    gpus_per_node: int = 1
    distributed_optimizer: bool = True
    optim_fully_reshardable: bool = False
    use_tp_pp_dp_mapping: bool = False
    first_stage_layers: int | None = None  # Megatron's num_layers_in_first_pipeline_stage
    last_stage_layers: int | None = None  # num_layers_in_last_pipeline_stage
    num_distributed_optimizer_instances: int = 1
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    grad_reduce_in_fp32: bool = True
    recompute: str = "none"
    precision: str = "auto"
    plan: Path | None = None
    num_workers: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        """Total number of processes (one per device)."""
        return self.nodes * self.gpus_per_node

    @property
    def data_parallel(self) -> int:
        """Data-parallel size implied by the world size and the model-parallel sizes."""
        return self.world_size // (self.tp * self.pp * self.cp)


def parse_blend(
    items: list[str], flag: str = "--data"
) -> list[str] | tuple[list[str], list[float]]:
    """``["0.3", "a", "0.7", "b"]`` -> (["a", "b"], [0.3, 0.7]); plain prefixes pass through."""

    def is_number(s: str) -> bool:
        try:
            float(s)
            return True
        except ValueError:
            return False

    if items and is_number(items[0]):
        if len(items) % 2 or not all(is_number(w) for w in items[::2]):
            raise PortingError(f"{flag}: blend must alternate WEIGHT PREFIX WEIGHT PREFIX ...")
        return [p for p in items[1::2]], [float(w) for w in items[::2]]
    return list(items)


def _prefixes(items: list[str], flag: str = "--data") -> list[str]:
    blend = parse_blend(items, flag)
    return blend[0] if isinstance(blend, tuple) else blend


def refuse_input_overlap(spec: TrainSpec) -> None:
    """``--out`` must not be, lie inside or contain ``--checkpoint``, ``--plan`` or any data
    file: a run directory is written into and may be replaced, and its inputs must survive it."""
    inputs = [("--checkpoint", spec.checkpoint), ("--plan", spec.plan)]
    for flag, items in (("--data", spec.data), ("--valid-data", spec.valid_data or [])):
        for prefix in _prefixes(items, flag):
            inputs += [(f"{flag} file", f"{prefix}{ext}") for ext in (".bin", ".idx")]
    check_outputs(inputs, writes=[("--out", spec.out)])


def megatron_paths(items: list[str], flag: str) -> list:
    """Megatron's blend list (``[w1, p1, w2, p2]`` or ``[p1, p2]``) for ``--data``-style items."""
    blend = parse_blend(items, flag)
    if isinstance(blend, list):
        return blend
    return [x for pair in zip(blend[1], blend[0], strict=True) for x in pair]


def validate(spec: TrainSpec, model_config, vocab_size: int) -> list[str]:
    """Check the layout, batch and data against the model before anything is launched.

    Raises :class:`PortingError` naming the offending flag (and, for model limits, the file the
    model's field comes from); returns warnings (as strings) for settings that run but deserve a
    look (a sequence longer than the rotary settings were trained for). ``vocab_size`` is the
    checkpoint's real (HF) vocabulary, the bound on the data's token ids.
    """
    manifest = Path(spec.checkpoint) / "context" / "porting.json"
    _check_tensor_parallel(spec, model_config, manifest)
    _check_layout_and_batch(spec, model_config, manifest)
    _check_experts(spec, model_config)
    if spec.sequence_parallel and spec.tp == 1:
        raise PortingError("--sequence-parallel needs --tp > 1")
    if spec.steps < 1 or spec.warmup >= spec.steps:
        raise PortingError(f"--warmup {spec.warmup} must be below --steps {spec.steps}")
    if spec.save_every < 0:
        raise PortingError(f"--save-every {spec.save_every} must be 0 (no checkpoints) or more")
    if spec.eval_every is not None and spec.eval_every < 1:
        raise PortingError(f"--eval-every {spec.eval_every} must be at least 1")
    if spec.eval_iters < 1:
        raise PortingError(f"--eval-iters {spec.eval_iters} must be at least 1")
    if spec.recompute not in RECOMPUTE:
        raise PortingError(f"--recompute {spec.recompute!r}: one of {', '.join(RECOMPUTE)}")
    _check_optimizer(spec)
    if model_config.vocab_size % spec.tp:
        raise PortingError(
            f"padded vocabulary {model_config.vocab_size} is not divisible by --tp {spec.tp}"
        )
    check_data(spec.data, vocab_size, "--data", model_config.vocab_size)
    if spec.valid_data:
        check_data(spec.valid_data, vocab_size, "--valid-data", model_config.vocab_size)
    else:
        check_split(spec.data, spec.split, "--data")
    return _warnings(spec, model_config)


def _check_tensor_parallel(spec: TrainSpec, model_config, manifest: Path) -> None:
    """TP against the attention heads and the KV groups."""
    heads = model_config.num_attention_heads
    groups = model_config.num_query_groups or heads
    if spec.tp < 1 or spec.pp < 1 or spec.cp < 1:
        raise PortingError("--tp, --pp and --cp must be at least 1")
    if heads % spec.tp:
        raise PortingError(
            f"--tp {spec.tp} does not divide the {heads} attention heads "
            f"(num_attention_heads of the model in {manifest})"
        )
    if groups % spec.tp and spec.tp % groups:
        raise PortingError(
            f"--tp {spec.tp} and the {groups} KV groups: one must divide the other "
            "(Megatron replicates KV heads only when TP is a multiple of the group count; "
            f"num_key_value_heads of the model in {manifest})"
        )
    if groups % spec.tp:
        raise PortingError(
            f"--tp {spec.tp} exceeds the {groups} KV groups; Megatron-Core 0.15 requires "
            "num_query_groups to be divisible by the tensor-parallel size "
            f"(num_key_value_heads of the model in {manifest})"
        )


def _check_layout_and_batch(spec: TrainSpec, model_config, manifest: Path) -> None:
    """The pipeline's stages and virtual stages, the devices against TP x PP x CP, and the
    global batch against micro-batch x DP."""
    layers = model_config.num_layers
    check_stage_layers(spec, layers, manifest)
    if spec.vp is not None and spec.pp == 1:
        raise PortingError("--vp needs --pp > 1 (virtual stages interleave pipeline stages)")
    if spec.world_size % (spec.tp * spec.pp * spec.cp):
        raise PortingError(
            f"{spec.world_size} devices are not a multiple of TP x PP x CP = "
            f"{spec.tp * spec.pp * spec.cp}"
        )
    dp = spec.data_parallel
    if spec.global_batch % (spec.micro_batch * dp):
        raise PortingError(
            f"--global-batch {spec.global_batch} is not divisible by --micro-batch "
            f"{spec.micro_batch} x data-parallel size {dp}"
        )


def _check_experts(spec: TrainSpec, model_config) -> None:
    """EP and ETP against the model's experts and the ranks they tile, and Megatron's rule for
    the tp-pp-dp rank order."""
    dp = spec.data_parallel
    experts = getattr(model_config, "num_moe_experts", None)
    if spec.ep < 1:
        raise PortingError(f"--ep {spec.ep} must be at least 1")
    etp = spec.etp if spec.etp is not None else spec.tp
    if spec.etp is not None and spec.etp < 1:
        raise PortingError(f"--etp {spec.etp} must be at least 1")
    if spec.etp is not None and not experts:
        raise PortingError(f"--etp {spec.etp}: the model has no experts to shard")
    if spec.ep > 1 or etp != spec.tp:
        if not experts:
            raise PortingError(f"--ep {spec.ep}: the model has no experts to spread")
        if experts % spec.ep:
            raise PortingError(f"--ep {spec.ep} does not divide the model's {experts} experts")
        # Megatron's expert groups (ETP x EP x EDP) tile tensor x context x data parallel ranks
        if (spec.tp * spec.cp * dp) % (spec.ep * etp):
            raise PortingError(
                f"--ep {spec.ep} x --etp {etp} does not divide tensor x context x data parallel "
                f"({spec.tp} x {spec.cp} x {dp})"
            )
    if spec.use_tp_pp_dp_mapping and spec.pp > 1 and spec.ep * etp != spec.tp * spec.cp:
        # megatron.core.parallel_state.initialize_model_parallel asserts it (its expert grid
        # exists for a dense model too: EP 1, ETP = TP), deep inside the launch
        raise PortingError(
            f"--use-tp-pp-dp-mapping with --pp {spec.pp} needs --ep x --etp = --tp x --cp "
            f"({spec.ep} x {etp} against {spec.tp} x {spec.cp}): Megatron requires the MoE and "
            "attention layers' data-parallel sizes to be the same under that order (drop "
            "--use-tp-pp-dp-mapping, or use CP 1 for a dense model)"
        )


def _check_optimizer(spec: TrainSpec) -> None:
    """The distributed optimizer's instances and what needs the distributed optimizer."""
    dp = spec.data_parallel
    instances = spec.num_distributed_optimizer_instances
    if instances < 1 or dp % instances:
        raise PortingError(
            f"--num-distributed-optimizer-instances {instances} does not divide the "
            f"data-parallel size {dp}"
        )
    if instances > 1 and not spec.distributed_optimizer:
        raise PortingError(
            "--num-distributed-optimizer-instances > 1 needs the distributed optimizer"
        )
    if spec.overlap_param_gather and not spec.distributed_optimizer:
        raise PortingError("--overlap-param-gather needs the distributed optimizer")


def _warnings(spec: TrainSpec, model_config) -> list[str]:
    """Settings that run but deserve a look."""
    warnings = []
    trained = _trained_context(model_config)
    if trained and spec.seq_length > trained:
        warnings.append(
            f"--seq-length {spec.seq_length} exceeds the {trained} positions the model's rotary "
            "settings were trained for; quality may drop without rope scaling"
        )
    if spec.eval_every and spec.save_every and spec.save_every % spec.eval_every:
        warnings.append(
            f"--save-every {spec.save_every} is not a multiple of --eval-every {spec.eval_every}: "
            "only checkpoints saved at a validation step can be marked best"
        )
    return warnings


def check_data(items: list[str], vocab_size: int, flag: str, padded: int | None = None) -> None:
    """Every prefix of ``items`` exists and holds no token id at or beyond ``vocab_size``, the
    checkpoint's real (HF) vocabulary.

    A token id at or past it means the data was tokenized with another tokenizer than the
    checkpoint's (the contract ``porting prep-data --tokenizer CHECKPOINT`` enforces). The padded
    vocabulary (``padded``) is not the bound: its extra rows exist only to divide evenly across
    tensor-parallel ranks, and export drops them, so tokens trained onto them are lost.
    """
    for prefix in _prefixes(items, flag):
        for ext in (".bin", ".idx"):
            if not Path(prefix + ext).exists():
                raise PortingError(f"{flag}: {prefix}{ext} does not exist")
        max_id = max_token_id(prefix)
        if max_id is not None and max_id >= vocab_size:
            pad = f" (padded to {padded} for the layout)" if padded and padded != vocab_size else ""
            raise PortingError(
                f"{flag}: {prefix}.bin holds token id {max_id}, beyond the checkpoint's "
                f"vocabulary of {vocab_size}{pad}; it was tokenized with another tokenizer"
            )


_SPLITS = ("training", "validation", "test")


def check_split(items: list[str], split: str, flag: str) -> None:
    """The training share of ``split``, and every other share with a non-zero ratio, holds at
    least one document of every prefix.

    Megatron's dataset builder cuts each prefix's documents at ``round(bound * documents)``
    (``blended_megatron_dataset_builder._build_megatron_dataset_splits``); a share left with no
    document has no tokens, and its sample index then loops forever (``gpt_dataset``
    ``_get_num_epochs``) instead of failing.
    """
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    bounds = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    for prefix in _prefixes(items, flag):
        docs = IndexedDataset(prefix).document_indices.shape[0] - 1
        for name, bound in zip(_SPLITS, bounds, strict=True):
            if bound is None and name != "training":  # a share of ratio 0 is not built
                continue
            share = (
                0 if bound is None else int(round(bound[1] * docs)) - int(round(bound[0] * docs))
            )
            if share < 1:
                raise PortingError(
                    f"{flag}: {prefix} holds {docs} document(s); --split {split} leaves the "
                    f"{name} share none of them. Add documents, change --split, or pass "
                    "--valid-data"
                )


def _trained_context(config) -> int | None:
    if getattr(config, "position_embedding_type", "rope") != "rope":
        return None
    if getattr(config, "rope_scaling_type", None) == "llama3":
        return int(
            config.rope_scaling_original_max_position_embeddings * config.rope_scaling_factor
        )
    factor = getattr(config, "seq_len_interpolation_factor", None) or 1.0
    return int(config.seq_length * factor)


def max_token_id(prefix: str) -> int | None:
    """The largest token id in a Megatron indexed dataset (streamed in chunks; None if empty)."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    tokens = np.memmap(prefix + ".bin", dtype=ds.index.dtype, mode="r")
    if tokens.size == 0:
        return None
    step = 1 << 24
    return int(max(tokens[i : i + step].max() for i in range(0, tokens.size, step)))


# Shape fields of the model that a checkpoint of the same model must share: (field of the HF config
# in porting.json, field of the Megatron config in model.yaml, field of a plan's model).
SHAPE = (
    ("hidden_size", "hidden_size", "hidden"),
    ("num_hidden_layers", "num_layers", "layers"),
    ("num_attention_heads", "num_attention_heads", "heads"),
    ("num_key_value_heads", "num_query_groups", "kv_heads"),
    ("intermediate_size", "ffn_hidden_size", "ffn"),
    ("vocab_size", None, "vocab"),
)


def read_json(path: Path, inside: Path | None = None) -> dict:
    """A JSON object from ``path``, read within the bounds every checkpoint file is read with
    (``porting.untrusted``); ``inside`` is the checkpoint it belongs to, if any, else the
    file given by the user is taken where its links lead. Anything else is an error naming it."""
    from porting import untrusted

    if inside is None:
        path = Path(os.path.realpath(path))
        inside = path.parent
    data = untrusted.read_json(path, inside)
    if not isinstance(data, dict):
        raise PortingError(f"{path}: expected a JSON object")
    return data


def model_facts(manifest, config) -> dict:
    """Our model's values of the fields a resume checkpoint and a plan are checked against."""
    return {
        "hidden_size": config.hidden_size,
        "num_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_query_groups": config.num_query_groups or config.num_attention_heads,
        "ffn_hidden_size": config.ffn_hidden_size,
        "vocab_size": manifest.vocab_size,
    }


def check_same_model(ours: Path, inside: Path, spec: TrainSpec, manifest, source: Path) -> None:
    """Refuse the manifest ``ours`` of a run directory's checkpoint where it is of another family
    or model shape than ``--checkpoint``'s (``source``)."""
    theirs = read_json(ours, inside)
    for key in ("family", "hf_architecture"):
        if theirs.get(key) != getattr(manifest, key):
            raise PortingError(
                f"{ours}: {key} is {theirs.get(key)!r}, but --checkpoint {source} has "
                f"{getattr(manifest, key)!r}: {spec.out} holds a run of another model; "
                "use another --out"
            )
    hf = theirs.get("hf_config") or {}
    mine = manifest.hf_config
    for hf_key, _, _ in SHAPE:
        if hf_key in mine and hf.get(hf_key, mine[hf_key]) != mine[hf_key]:
            raise PortingError(
                f"{ours}: hf_config.{hf_key} is {hf.get(hf_key)!r}, but --checkpoint "
                f"{source} has {mine[hf_key]!r}: {spec.out} holds a run of another model; "
                "use another --out"
            )


def check_run_dir(spec: TrainSpec, manifest, config) -> None:
    """Refuse a run directory whose checkpoints belong to another model or family.

    NeMo would resume from them and fail deep inside loading (or, for a model of the same shape,
    silently continue another model). Each checkpoint's ``context/porting.json`` (copied in by
    :class:`SelfDescribingCheckpoint`) and ``context/model.yaml`` (NeMo's) are compared with
    ``--checkpoint``'s manifest and model.
    """
    from porting import untrusted

    source = Path(spec.checkpoint) / "context" / "porting.json"
    facts = model_facts(manifest, config)
    for ctx in sorted((Path(spec.out) / "checkpoints").glob("*/context")):
        if ctx.parent.is_symlink():
            continue
        ours = ctx / "porting.json"
        if ours.is_file():
            check_same_model(ours, ctx.parent, spec, manifest, source)
        model_yaml = ctx / "model.yaml"
        if model_yaml.is_file():
            cfg = untrusted.read_yaml(model_yaml, ctx.parent) or {}
            cfg = (cfg.get("config") if isinstance(cfg, dict) else None) or {}
            for _, key, _ in SHAPE:
                if key is None or key not in cfg:
                    continue
                theirs = cfg[key]
                if key == "num_query_groups" and theirs is None:  # MHA: one group per head
                    theirs = cfg.get("num_attention_heads")
                if theirs != facts[key]:
                    raise PortingError(
                        f"{model_yaml}: config.{key} is {theirs!r}, but the model of --checkpoint "
                        f"{source} has {facts[key]!r}: {spec.out} holds a run of another model; "
                        "use another --out"
                    )


def resume_checkpoint(out: Path) -> Path | None:
    """The checkpoint NeMo's ``AutoResume`` will resume from: the newest finished ``*-last``."""
    ckpts = Path(out) / "checkpoints"
    if not ckpts.is_dir():
        return None
    lasts = [
        d
        for d in ckpts.glob("*last")
        if d.is_dir()
        and not d.is_symlink()
        and not any(d.parent.glob(f"{d.name}*-unfinished"))
        and (d / "weights").is_dir()
    ]
    return max(lasts, key=lambda p: p.stat().st_mtime) if lasts else None


def check_layout_change(spec: TrainSpec) -> str | None:
    """Check a resume at another layout before launch; return a note on what changes, or None.

    Megatron's distributed checkpoints store every weight and the plain optimizer's state per
    parameter (global shapes), so they reshard to any TP/PP/DP on load. The distributed
    optimizer's default format (``dp_reshardable``, ``megatron/core/optimizer/distrib_optimizer.py``)
    stores its flat buffers as they lie in each TP x PP rank's memory: it reshards across DP only.
    A resume that changes TP or PP from such a checkpoint is refused here, naming the file.
    """
    ckpt = resume_checkpoint(spec.out)
    if ckpt is None:
        return None
    path = ckpt / "context" / LAYOUT_FILE
    if not path.is_file():
        return None
    saved = read_json(path, ckpt)
    now = {"tp": spec.tp, "pp": spec.pp, "vp": spec.vp, "cp": spec.cp, "dp": spec.data_parallel}
    changed = [k for k in now if saved.get(k, now[k]) != now[k]]
    if not changed:
        return None
    change = ", ".join(f"{k.upper()} {saved.get(k)} -> {now[k]}" for k in changed)
    model_parallel = [k for k in changed if k in ("tp", "pp", "vp", "cp")]
    if (
        model_parallel
        and saved.get("distributed_optimizer")
        and saved.get("optimizer_format") == "dp_reshardable"
        and spec.distributed_optimizer
    ):
        raise PortingError(
            f"{path}: optimizer_format is 'dp_reshardable' (saved at "
            f"{', '.join(f'{k.upper()}={saved.get(k)}' for k in model_parallel)}): the distributed "
            f"optimizer's state in {ckpt.name} reshards across data-parallel ranks only, and this "
            f"resume changes {change}. Resume once at the saved layout with "
            "--optim-fully-reshardable and let it save a checkpoint, then change the layout"
        )
    return f"resuming {ckpt.name} with a new layout ({change}); Megatron reshards on load"


def stage_layers(spec: TrainSpec, layers: int) -> list[int]:
    """Decoder layers of each pipeline stage, as Megatron-Core splits them for these flags."""
    first, last = spec.first_stage_layers, spec.last_stage_layers
    stages, rest = spec.pp, layers
    if first is not None:
        stages, rest = stages - 1, rest - first
    if last is not None:
        stages, rest = stages - 1, rest - last
    middle = rest // stages if stages > 0 else 0
    out = [middle] * spec.pp
    if first is not None:
        out[0] = first
    if last is not None:
        out[-1] = last
    return out


def check_stage_layers(spec: TrainSpec, layers: int, manifest: object) -> None:
    """The rules Megatron-Core's TransformerConfig applies to a pipeline's layer split, checked
    before anything is built, naming the flag."""
    first, last = spec.first_stage_layers, spec.last_stage_layers
    if (first is not None or last is not None) and spec.pp < 2:
        raise PortingError("--first-stage-layers / --last-stage-layers need --pp > 1")
    for flag, value in (("--first-stage-layers", first), ("--last-stage-layers", last)):
        if value is not None and not 0 < value < layers:
            raise PortingError(f"{flag} {value}: must be between 1 and {layers - 1}")
        if value is not None and spec.vp is not None and value % spec.vp:
            raise PortingError(f"{flag} {value} is not divisible by --vp {spec.vp}")
    stages, rest = spec.pp, layers
    for value in (first, last):
        if value is not None:
            stages, rest = stages - 1, rest - value
    if first is None and last is None and layers % spec.pp:
        raise PortingError(
            f"--pp {spec.pp} does not divide the {layers} layers (of the model in {manifest}); "
            "give --first-stage-layers / --last-stage-layers for an uneven split"
        )
    if stages == 0 and rest != 0:
        raise PortingError(
            f"--first-stage-layers and --last-stage-layers add up to {layers - rest}, not the "
            f"model's {layers} layers"
        )
    if stages > 0 and (rest <= 0 or rest % stages):
        raise PortingError(
            f"the {rest} layers left for the {stages} other pipeline stages do not divide "
            "evenly (Megatron-Core's rule for --first-stage-layers / --last-stage-layers)"
        )
    if spec.vp is not None and stages > 0 and (rest // stages) % spec.vp:
        raise PortingError(f"--vp {spec.vp} does not divide the {rest // stages} layers per stage")


def bridge_iteration(root: Path) -> Path | None:
    """The newest complete iteration of a Megatron-Bridge checkpoint root (what its tracker file,
    written once a save has finished, names), or None where there is none."""
    tracker = Path(root) / "latest_checkpointed_iteration.txt"
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise PortingError(f"{tracker}: {text[:40]!r} is not an iteration number")
    return Path(root) / f"iter_{int(text):07d}"


def check_bridge_layout_change(spec: TrainSpec) -> str | None:
    """:func:`check_layout_change` for a Megatron-Bridge run: the layout a resume starts from is
    the newest iteration's ``run_config.yaml`` (read as data), the optimizer format its
    ``checkpoint.dist_ckpt_optim_fully_reshardable``."""
    from porting import untrusted

    it = bridge_iteration(Path(spec.out) / "checkpoints")
    if it is None or not (it / "run_config.yaml").is_file():
        return None
    path = it / "run_config.yaml"
    run = untrusted.read_yaml(path, it) or {}
    model = run.get("model") or {}
    ddp = run.get("ddp") or {}
    saved = {
        "tp": model.get("tensor_model_parallel_size", spec.tp),
        "pp": model.get("pipeline_model_parallel_size", spec.pp),
        "vp": model.get("virtual_pipeline_model_parallel_size", spec.vp),
        "cp": model.get("context_parallel_size", spec.cp),
    }
    now = {"tp": spec.tp, "pp": spec.pp, "vp": spec.vp, "cp": spec.cp}
    changed = [k for k in now if saved[k] != now[k]]
    if not changed:
        return None
    change = ", ".join(f"{k.upper()} {saved[k]} -> {now[k]}" for k in changed)
    reshardable = (run.get("checkpoint") or {}).get("dist_ckpt_optim_fully_reshardable")
    if ddp.get("use_distributed_optimizer") and not reshardable and spec.distributed_optimizer:
        raise PortingError(
            f"{path}: checkpoint.dist_ckpt_optim_fully_reshardable is false (saved at "
            f"{', '.join(f'{k.upper()}={saved[k]}' for k in changed)}): the distributed "
            f"optimizer's state in {it.name} reshards across data-parallel ranks only, and this "
            f"resume changes {change}. Resume once at the saved layout with "
            "--optim-fully-reshardable and let it save a checkpoint, then change the layout"
        )
    return f"resuming {it.name} with a new layout ({change}); Megatron reshards on load"
