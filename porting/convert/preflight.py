"""What a config says, checked against what a checkpoint holds, before anything is built or read.

A config is a claim: ``num_hidden_layers: 100000`` or ``vocab_size: 2**40`` over two layers of
weights would have import build (or try to allocate) a model of that size before any check could
see the lie. These checks take only the config, the family's weight table and the checkpoint's
headers (safetensors headers, torch_dist ``.metadata``), and run before any model exists; their
cost does not depend on what the config claims:

- every tensor the table reads is floating point (an ``I32`` of the right byte size would otherwise
  be cast to float silently); a non-float dtype is refused by name;
- the layer and expert indices the checkpoint's names carry are exactly the config's counts;
- the largest tensor the step holds at once fits in the memory this machine has free, and so does
  what the parity gate holds at once (:func:`check_gate_memory`).

Shapes are then checked tensor by tensor once the (bounded) meta models exist
(:func:`porting.convert.table_check.check_checkpoint_shapes`, :func:`check_nemo_layout`).
"""

from __future__ import annotations

import fnmatch
import re
from typing import TYPE_CHECKING, Any

from porting.contract.family import Family
from porting.contract.mapping import EXPERT, LAYER, MTP, Ignore, Rename
from porting.convert.ranks import ranks_on_this_node
from porting.errors import PortingError

if TYPE_CHECKING:
    from porting.convert.checkpoint import Checkpoint

FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
_LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_BYTES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}


def _pattern(name: str) -> re.Pattern:
    # an MTP layer (``@``) sits after the decoder's layers, in the same HF numbering
    rx = re.escape(name.replace(MTP, LAYER)).replace(re.escape(LAYER), r"(?P<layer>\d+)")
    return re.compile(rx.replace(re.escape(EXPERT), r"(?P<expert>\d+)") + r"\Z")


def _read_patterns(family: Family) -> list[re.Pattern]:
    names = []
    for e in family.weights:
        if not isinstance(e, Ignore):
            names.extend((e.hf,) if isinstance(e, Rename) else e.hf)
    # a stacked tensor's slices (``name[#]``) are counted by its shape, not by its name
    return [_pattern(n.removesuffix(f"[{EXPERT}]")) for n in dict.fromkeys(names)]


def _field(hf_config: dict, candidates: tuple[str, ...], value: int, what: str) -> str:
    for key in candidates:
        if hf_config.get(key) == value:
            return f"{key} is {value}"
    return f"it makes {value} {what}"


def _span(found: set[int]) -> str:
    if not found:
        return "none"
    lo, hi = min(found), max(found)
    if found == set(range(lo, hi + 1)):
        return f"{lo}..{hi} ({len(found)})"
    missing = sorted(set(range(lo, hi + 1)) - found)[:3]
    return f"{lo}..{hi} without {', '.join(map(str, missing))}"


def _indices(family: Family, names) -> tuple[set[int], set[int], bool, bool]:
    """The layer and expert indices in tensor ``names`` (read through the table's ``*`` / ``#``
    patterns), and whether the table has layer and expert patterns at all."""
    layers: set[int] = set()
    experts: set[int] = set()
    patterns = [p for p in _read_patterns(family) if p.groupindex]
    for name in names:
        for p in patterns:
            m = p.match(name)
            if m:
                if "layer" in p.groupindex:
                    layers.add(int(m["layer"]))
                if "expert" in p.groupindex:
                    experts.add(int(m["expert"]))
                break
    return (
        layers,
        experts,
        any("layer" in p.groupindex for p in patterns),
        any("expert" in p.groupindex for p in patterns),
    )


def as_stored(family: Family, hf_config: dict, names, shape_of) -> tuple[dict, Any]:
    """``hf_config`` as the checkpoint's tensor ``names`` hold it, and the multi-token-prediction
    count it declared that they do not hold (None: nothing read otherwise). Where the config
    declares such layers (:attr:`Family.mtp_count`) and ``names`` hold exactly the decoder's
    layers, none after them, the count is read as 0: a transformers save, whose classes build no
    MTP layer. ``shape_of(config)``: the family's shape context of a config."""
    count = family.mtp_count
    if not count or not hf_config.get(count):
        return hf_config, None
    bare = {**hf_config, count: 0}
    layers, _, by_layer, _ = _indices(family, names)
    if by_layer and layers == set(range(shape_of(bare).num_layers)):
        return bare, hf_config[count]
    return hf_config, None


def check_hf_counts(family: Family, hf_config: dict, ctx: Any, names, config_path) -> None:
    """The layer and expert indices in the checkpoint's tensor ``names`` (read through the table's
    ``*`` / ``#`` patterns) must be exactly ``range(num_layers)`` / ``range(num_experts)``."""
    layers, experts, by_layer, by_expert = _indices(family, names)
    mtp = getattr(ctx, "mtp_layers", 0)
    if by_layer and layers != set(range(ctx.num_layers + mtp)):
        what = _field(hf_config, _LAYER_FIELDS, ctx.num_layers, "layers")
        if mtp:
            what += (
                f" and {mtp} multi-token-prediction layer(s) follow (as layers {ctx.num_layers}.."
                f"{ctx.num_layers + mtp - 1})"
            )
        raise PortingError(
            f"{config_path}: {what}, but the checkpoint's tensors hold layers {_span(layers)}"
        )
    n_experts = getattr(ctx, "num_experts", 0) or 0
    if by_expert and experts != set(range(n_experts)):
        raise PortingError(
            f"{config_path}: {_field(hf_config, _EXPERT_FIELDS, n_experts, 'experts')}, but the "
            f"checkpoint's tensors hold experts {_span(experts)}"
        )


def check_float_dtypes(family: Family, source) -> None:
    """Every tensor of ``source`` that the family does not ``Ignore`` is stored as a float."""
    ignores = [e.hf for e in family.weights if isinstance(e, Ignore)]
    for key in source.keys():
        dtype, where = source.stored_dtype(key)
        if dtype not in FLOAT_DTYPES and not any(fnmatch.fnmatchcase(key, g) for g in ignores):
            raise PortingError(
                f"{where}: tensor {key!r} is stored as {dtype}; weights must be floating point "
                f"({', '.join(FLOAT_DTYPES)}), and an integer or quantized tensor is not cast"
            )


def size(n: float) -> str:
    """``n`` bytes for a message: ``1.5 GiB``, ``300.0 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def available_bytes() -> int:
    """Memory this process can still take: free RAM plus free swap."""
    import psutil

    return psutil.virtual_memory().available + psutil.swap_memory().free


def check_largest_tensor(step: str, shapes: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """The largest single tensor of ``shapes`` (name -> (shape, safetensors dtype)), held once as
    stored and once in fp32 (the gate's precision), must fit in this machine's free memory."""
    if not shapes:
        return
    name, (shape, dtype) = max(
        shapes.items(), key=lambda kv: _numel(kv[1][0]) * _BYTES.get(kv[1][1], 4)
    )
    need = _numel(shape) * (_BYTES.get(dtype, 4) + 4)
    have = available_bytes()
    if need > have:
        raise PortingError(
            f"{step} needs at least {size(need)} at once for tensor {name!r} "
            f"{tuple(shape)} {dtype}; this machine has {size(have)} free"
        )


_IN_LAYER = re.compile(r"\.(\d+)\.")
_IN_EXPERT = re.compile(r"\.experts\.(\d+)\.")


# fp32 bytes of one slice of a vocabulary table the gate multiplies by (porting.parity.vocab)
VOCAB_SLICE_BYTES = 128 << 20
# A decoder layer whose tensors (not its experts') hold more than this in fp32 is read by the gate
# a module's matrices at a time, the next module's read while one computes
# (porting.parity.modules.pieces_streamed); a smaller one whole, two at a time. A 7B's layer (810
# MB) is read by modules as fast as whole (10.4 s against 10.2 s of gate, 8 layers) in 2.05 GiB
# rather than 2.90.
GATE_LAYER_BYTES = 256 << 20
# the positions of the gate's default prompts, padded to one batch: porting.parity.harness's
# three texts and its random prompt, at the random prompt's 64 tokens (tests/test_moe.py)
GATE_POSITIONS = 4 * 64


def gate_memory(shapes: dict[str, tuple[int, ...]], tied: bool) -> tuple[int, dict[str, int]]:
    """The fp32 bytes the streamed gate holds at once on one side (the sides run in turn), and
    its parts, from the HF model's tensor shapes (name -> shape); :mod:`porting.parity.streamed`.

    The embedding and the output layer, tied or not, are read by vocabulary slices
    (:mod:`porting.parity.vocab`): two slices at a time, in the first layer area where they fit,
    while no layer is loaded; so the gate holds the larger of those and two layers without their
    experts plus two experts (the one computing and the next being read, of each), and the
    logits of its prompts (the side running, padded to one batch, and the other side's). A layer
    over :data:`GATE_LAYER_BYTES` counts its vectors twice and two modules' matrices: its
    matrices are read a module at a time, the next while one computes (Megatron's fused
    gate-and-up, the layer's two largest matrices, and the next: its three largest). A tensor is
    a layer's where its name has a
    numeric part (``model.layers.3.``), an expert's where ``.experts.<e>.`` follows; stacked
    experts (one tensor for all) count with their layer."""
    outside, experts = [], {}
    layers: dict[str, dict[str, int]] = {}  # layer -> module -> matrix bytes ("": its vectors)
    vocab = 0
    for name, shape in shapes.items():
        n = 4 * _numel(shape)
        layer, expert = _IN_LAYER.search(name), _IN_EXPERT.search(name)
        if layer is None:
            outside.append(n)
            if len(shape) == 2:
                vocab = max(vocab, shape[0])
        elif expert is not None and expert.start() >= layer.start():
            key = (layer.group(1), expert.group(1))
            experts[key] = experts.get(key, 0) + n
        else:
            modules = layers.setdefault(layer.group(1), {})
            module = name.rpartition(".")[0] if len(shape) >= 2 else ""
            modules[module] = modules.get(module, 0) + n
    outside.sort(reverse=True)
    tables = outside[:1] if tied else outside[:2]
    if tied and len(outside) > 1 and outside[1] == outside[0]:
        tables = outside[:2]  # the output layer listed under its own name too
    rest = outside[len(tables) :]
    table = max(tables, default=0)
    whole, piece = 0, 0
    for modules in layers.values():
        if sum(modules.values()) > GATE_LAYER_BYTES:
            whole = max(whole, modules.get("", 0))
            # Megatron-Core holds gate and up (q, k and v) as one matrix: the layer's two
            # largest, where HF keeps them apart; and the next module is read meanwhile
            three = sorted((b for m, b in modules.items() if m), reverse=True)[:3]
            piece = max(piece, sum(three))
        else:
            whole = max(whole, sum(modules.values()))
    parts = {
        "two layers without their experts": 2 * whole,
        "two modules' matrices of a layer read by modules": piece,
        "two experts": 2 * max(experts.values(), default=0),
        "two slices of the embedding or output layer": 2 * min(VOCAB_SLICE_BYTES, table),
        "the logits of the prompts": 2 * 4 * GATE_POSITIONS * vocab,
        "the rest outside the layers": sum(rest),
    }
    streamed = 2 * whole + piece + parts["two experts"]
    slices = parts["two slices of the embedding or output layer"]
    need = sum(rest) + parts["the logits of the prompts"] + max(streamed, slices)
    return need, parts


def check_gate_memory(
    step: str, shapes: dict[str, tuple[int, ...]], hf_config: dict, whole_model: bool
) -> None:
    """What the parity gate holds at once (:func:`gate_memory`; ``whole_model``: both models
    whole, in fp32) must fit in this machine's free memory: refused before the gate, and before an
    import writes anything, rather than killed by the kernel part-way."""
    if whole_model:
        parts = {"both models in fp32": 2 * 4 * sum(_numel(s) for s in shapes.values())}
        need = sum(parts.values())
    else:
        # absent, transformers' PretrainedConfig default (tied) is the larger need
        need, parts = gate_memory(shapes, bool(hf_config.get("tie_word_embeddings", True)))
    have = available_bytes()
    # the ranks of a launched conversion on this node each hold a gate of their own at once
    here = ranks_on_this_node()
    if need * here > have:
        detail = ", ".join(f"{part} {size(n)}" for part, n in parts.items() if n)
        each = f" on each of the {here} ranks on this node" if here > 1 else ""
        fewer = ", fewer ranks per node (--nproc-per-node)" if here > 1 else ""
        raise PortingError(
            f"the parity gate of {step} needs about {size(need)} at once{each} (of: {detail}); "
            f"this machine has {size(have)} free. Free memory{fewer}, run the gate on a GPU "
            "(--device cuda), or convert with --no-verify here and run `porting verify` where "
            "the memory is"
        )


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_hf_checkpoint(
    family: Family, hf_config: dict, ctx: Any, source, config_path, step: str
) -> dict[str, tuple[int, ...]]:
    """The HF side's checks after :func:`check_float_dtypes`, cheapest first: layer and expert
    counts (names only), then every tensor's shape against the config's HF model built on the meta
    device, then the memory for the largest tensor. ``ctx`` is the family's shape context of
    ``hf_config`` (``build_config``). Returns that model's shapes (name -> shape)."""
    from porting.convert.table_check import check_checkpoint_shapes, hf_meta_shapes

    check_hf_counts(family, hf_config, ctx, source.keys(), config_path)
    hf_shapes = hf_meta_shapes(family, hf_config)
    check_checkpoint_shapes(source, hf_shapes, config_path)
    check_largest_tensor(
        step, {k: (source.shape(k)[0], source.stored_dtype(k)[0]) for k in source.keys()}
    )
    return hf_shapes


def check_nemo_counts(checkpoint: Checkpoint, config) -> None:
    """The checkpoint's manifest against its torch_dist metadata: the vocabulary sizes agree
    with each other and with the embedding's rows, and every stacked layer tensor holds the
    layer count of ``config`` (the manifest's). Reads ``.metadata`` only."""
    from porting.convert.dist_reader import DistCheckpointReader

    loc, manifest, where = checkpoint.located, checkpoint.manifest, checkpoint.source
    hf_vocab = manifest.hf_config.get("vocab_size")
    if hf_vocab != manifest.vocab_size:
        raise PortingError(
            f"{where}: hf_config.vocab_size is {hf_vocab!r}, but vocab_size is "
            f"{manifest.vocab_size!r}"
        )
    if manifest.padded_vocab_size < manifest.vocab_size:
        raise PortingError(
            f"{where}: padded_vocab_size {manifest.padded_vocab_size} is smaller than "
            f"vocab_size {manifest.vocab_size}"
        )
    reader = DistCheckpointReader(loc.weights)
    layers = loc.prefix + "decoder.layers."
    for key in reader.keys():
        shape = reader.global_shape(key)
        index = key[len(layers) :].partition(".")[0] if key.startswith(layers) else None
        if index is not None and index.isdigit():
            # a model whose layers differ (dense and MoE) is saved one key per layer
            if int(index) >= config.num_layers:
                field = _field(manifest.hf_config, _LAYER_FIELDS, config.num_layers, "layers")
                raise PortingError(
                    f"{where}: hf_config's {field}, but {reader.dir} holds layer {index} ({key!r})"
                )
        elif index is not None and shape[:1] != (config.num_layers,):
            field = _field(manifest.hf_config, _LAYER_FIELDS, config.num_layers, "layers")
            raise PortingError(
                f"{where}: hf_config's {field}, but {reader.dir} holds {shape[0]} layers "
                f"({key!r} is {shape})"
            )
        if key == loc.prefix + "embedding.word_embeddings.weight" and (
            shape[0] != manifest.padded_vocab_size
        ):
            raise PortingError(
                f"{where}: padded_vocab_size is {manifest.padded_vocab_size}, but {reader.dir} "
                f"holds {shape[0]} embedding rows ({key!r} is {shape})"
            )


def check_nemo_layout(sharded: dict, reader, where: str) -> None:
    """Every tensor of a model's data-free ``sharded_state_dict`` has, in the checkpoint, the
    global shape the model expects (one line naming the tensor and both shapes otherwise)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    def visit(item) -> None:
        if isinstance(item, dict):
            for v in item.values():
                visit(v)
        elif isinstance(item, list | tuple):
            for v in item:
                visit(v)
        elif isinstance(item, ShardedTensorFactory):
            visit(item.build())
        elif isinstance(item, ShardedTensor):
            got = reader.global_shape(item.key)
            if tuple(got) != tuple(item.global_shape):
                raise PortingError(
                    f"{reader.dir}: {item.key!r} is {tuple(got)}, but {where} makes it "
                    f"{tuple(item.global_shape)}"
                )

    visit(sharded)
