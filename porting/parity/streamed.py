"""Layer-streamed parity: both models run with one decoder layer in memory at a time.

The whole-model check holds the HF model and the Megatron model in fp32 (4 bytes a parameter
each), which no ordinary node has for a 70B. Here each side is built with its parameters on the
``meta`` device (``accelerate.init_empty_weights``: buffers and plain attributes such as rotary
frequencies and ALiBi slopes stay real), the embeddings, final norm and output layer are loaded,
and each decoder layer is loaded just before it runs and released just after, by forward hooks
around the model's own forward (a side: :class:`porting.parity.sides.Side`). So each side runs its
own code (masks, rotary, ALiBi) and nothing family-specific lives here:

- HF side: layer ``i``'s tensors are cast from the mapped safetensors shards;
- Megatron side: layer ``i``'s slice of the stacked layer keys is read from the written checkpoint
  through the layout ``megatron.core.dist_checkpointing`` gives (what users get is what is checked).

All prompts run as one right-padded batch (causal attention: no valid position sees a pad), so
each layer is read once per side. A Megatron layer whose output leaves :data:`LAYER_RTOL` of the
HF layer's on its own (propagated) input runs again on the HF layer's input, which tells a broken
layer from error carried in from earlier ones; a layer within it on its own input computes HF's
layer to fp32's precision there, and has nothing to tell apart. Peak memory: embeddings and
output layer of both sides, two layers of each (the one computing, the next being read), and the
per-layer hidden states.

What makes it fast, none of it changing what is computed (docs/conversion.md, "What the gate
costs"):

- the linear layers of both sides (``nn.Linear``; Megatron's column and row parallel linears) run
  on the prompts' real positions only: the padded batch's rows are gathered into one matrix, and
  the output scattered back with zeros on the pads, which no real position attends to;
- each layer's tensors are cast once, from views of the mapped files (the safetensors shards; the
  torch_dist records, whose pickles torch's weights-only unpickler reads) straight into one of two
  reused buffer sets (no fresh pages per layer), on a reader thread while the previous layer
  computes;
- a clean Megatron layer runs once: the run on the HF layer's input happens only where the
  layer's output on its own input leaves the tolerance (and not where the two inputs are equal
  bit for bit, as at the first layer: it would compute the same thing again). A clean gate's
  matmul work is its floor's.

A checkpoint with multi-token-prediction layers (Megatron-Core's MTP block) has them checked
after the main pass, one layer per side in memory, on the final hidden states both passes made
(:mod:`porting.parity.mtp`); the main logits are the main head's (the block runs only towards a
loss in Megatron-Core 0.15.3).

On a device (``device="cuda"``) the layers stream host -> device one at a time and every tensor
that the model computes with lives there; the comparison and its tolerances are those of fp32 with
TF32 off, as on the CPU.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from porting.errors import PortingError, check_finite
from porting.guard import ReusedHeap
from porting.parity import sides
from porting.parity.floor import machine_gflops
from porting.parity.modules import (
    set_param,
    stored_tensors,
    stream_expert_stacks,
)
from porting.parity.sides import (
    Buffers,
    LargeOnMeta,
    Side,
    Stage,
    Take,
    cast_into,
    check_shape,
    layer_list,
    layer_numel,
    output_of,
    to_device,
)
from porting.parity.vocab import VocabTable, install_tables

log = logging.getLogger(__name__)


# A layer whose own error (Megatron's layer on the HF layer's input, against the HF layer's
# output) exceeds this relative to the output's magnitude is broken: fp32 reduction order alone
# gives ~1e-6 for a decoder layer (measured on every tiny variant in tests).
LAYER_RTOL = 1e-4


@dataclass
class LayerDivergence:
    """How far one decoder layer's output differs between the two sides.

    ``max_abs`` / ``mean_abs`` / ``max_rel``: each side's layer on its own propagated input (what
    the logits see). ``own_max_abs`` / ``own_max_rel``: this layer's own error. Where
    ``own_on_hf_input``, the Megatron layer on the HF layer's input (nothing carried in): run
    again there because ``max_rel`` left :data:`LAYER_RTOL`, or the same run where the two inputs
    are equal bit for bit. Otherwise ``max_rel`` is within :data:`LAYER_RTOL` and these are its
    figures: the layer computes HF's layer to fp32's precision on its own input, so no error,
    its own or carried in, is there to tell apart.
    """

    layer: int
    max_abs: float
    mean_abs: float
    max_rel: float
    own_max_abs: float
    own_max_rel: float
    own_on_hf_input: bool = True

    @property
    def diverges(self) -> bool:
        """True when the layer's own error exceeds what fp32 reduction order explains."""
        return not self.own_max_rel <= LAYER_RTOL  # NaN counts as divergence


@dataclass
class GateCost:
    """The matmul work of one side and this machine's rate for it: the gate's floor.

    ``flop``: the HF side's linear layers and output head over the real positions, and its other
    matrix products (experts computed as ``x @ w``, attention's scores: :class:`_MatmulWork`);
    the Megatron side does the same work. ``gflops``: this device's fp32 ``F.linear`` rate,
    measured once per machine and cached (:func:`porting.parity.floor.machine_gflops`).
    ``floor_s``: both sides at that rate. ``ranks``: each process's share of the gate, in rank
    order (one for a gate in one process): ``{"rank", "layers": [first, last] (empty for a rank
    past the layers), "cpu_s", "wall_s"}``, from reading its side's inputs to its last pass
    (``cpu_s``: the process's CPU time, its reader and matmul threads included).
    """

    flop: float
    gflops: float
    ranks: list[dict] = field(default_factory=list)

    @property
    def floor_s(self) -> float:
        """Seconds both sides' matmuls take at the measured rate."""
        return 2 * self.flop / (self.gflops * 1e9)


def pad_batch(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts ``[1, s_i]`` right-padded into ``[B, max s]`` ids and the mask of real positions."""
    longest = max(p.shape[1] for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    valid = torch.zeros(len(prompts), longest, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, : p.shape[1]] = p[0]
        valid[i, : p.shape[1]] = True
    return ids, valid


def unpad(logits: torch.Tensor, prompts: list[torch.Tensor], vocab: int) -> list[torch.Tensor]:
    """Per-prompt ``[1, s_i, vocab]`` fp32 logits on the CPU from the padded batch's, each a copy
    of its own: the padded batch (every prompt at the longest one's length, and Megatron's padded
    vocabulary) is released once its side has run, not held through the other side's pass."""
    return [
        logits[i : i + 1, : p.shape[1], :vocab]
        .float()
        .cpu()
        .clone(memory_format=torch.contiguous_format)
        for i, p in enumerate(prompts)
    ]


@contextmanager
def finest_grain(rows: int = 16) -> Iterator[None]:
    """Within, the gate reads every decoder layer a module at a time
    (:data:`porting.parity.sides.LAYER_BYTES` 0) and
    every vocabulary table ``rows`` rows at a time: the same computation, in the smallest pieces
    it takes. The proof kit runs every family's streamed gate so (``porting.testing.
    assert_streamed_agrees``), so that a family whose model uses a module's tensors outside its
    call, or a table in an operation the slices do not cover (an error here, where the default
    grain reads the table whole with a warning), is found on a tiny model; the default grain is
    the one every import's gate runs."""
    from porting.parity import vocab

    was = sides.LAYER_BYTES, vocab.SLICE_ROWS, vocab.WHOLE_ALLOWED
    sides.LAYER_BYTES, vocab.SLICE_ROWS, vocab.WHOLE_ALLOWED = 0, rows, False
    try:
        yield
    finally:
        sides.LAYER_BYTES, vocab.SLICE_ROWS, vocab.WHOLE_ALLOWED = was


def _megatron_linear_types() -> tuple[type, ...]:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return (ColumnParallelLinear, RowParallelLinear)


@contextmanager
def _real_rows_only(
    model: torch.nn.Module, real: torch.Tensor, linear_types: tuple[type, ...], flop: list[float]
) -> Iterator[None]:
    """Run ``model``'s linear layers on the real (unpadded) positions only; count their FLOPs.

    ``real``: the mask of real positions in the model's hidden-state layout (``[b, s]`` for HF,
    ``[s, b]`` for Megatron). A linear layer is position-wise, so its output at a real position
    depends on that position's input alone: gathering those rows into one matrix computes the
    same values for them with none of the padding's rows. The pads get zeros, which stay finite
    through norms and attention and are never attended to by a real position (causal mask,
    right padding). An input of another layout (a mixture's routed tokens) runs as it is.
    """
    patched = []
    rows = int(real.sum())
    gather = not bool(real.all())
    for module in model.modules():
        if not isinstance(module, linear_types):
            continue

        def forward(x, *args, _orig=module.forward, **kwargs):
            if x.dim() != 3 or tuple(x.shape[:2]) != tuple(real.shape):
                out = _orig(x, *args, **kwargs)
                first = out[0] if isinstance(out, tuple) else out
                flop[0] += 2.0 * (x.numel() // x.shape[-1]) * x.shape[-1] * first.shape[-1]
                return out
            if not gather:
                out = _orig(x, *args, **kwargs)
                first = out[0] if isinstance(out, tuple) else out
            else:
                out = _orig(x[real].unsqueeze(1), *args, **kwargs)  # [rows, 1, h]: valid layout
                first = out[0] if isinstance(out, tuple) else out
                full = first.new_zeros(*real.shape, first.shape[-1])
                full[real] = first.squeeze(1)
                out = (full, *out[1:]) if isinstance(out, tuple) else full
            flop[0] += 2.0 * rows * x.shape[-1] * first.shape[-1]
            return out

        module.forward = forward
        patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward


class _MatmulWork(TorchFunctionMode):
    """Adds to ``flop`` the work of the matrix products that no linear layer makes: an expert
    computed as ``x @ w`` (transformers' GptOssExperts on the CPU), attention's scores. The
    linear layers are counted by :func:`_real_rows_only` (``F.linear`` is not one of these)."""

    _PRODUCTS = frozenset(
        {
            torch.matmul,
            torch.bmm,
            torch.mm,
            torch.Tensor.matmul,
            torch.Tensor.__matmul__,
            torch.Tensor.bmm,
            torch.Tensor.mm,
        }
    )

    def __init__(self, flop: list[float]) -> None:
        super().__init__()
        self.flop = flop

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = args[0] if args else None
        if (
            func in self._PRODUCTS
            and isinstance(first, torch.Tensor)
            and isinstance(out, torch.Tensor)
        ):
            # [..., m, k] @ [..., k, n]: each of the output's values is k multiply-adds
            self.flop[0] += 2.0 * out.numel() * first.shape[-1]
        return out


def _hf_side(hf_dir: Path, family, allow_pickle: bool, device: torch.device, read=None):
    """The reference model with streamed layers, and its text config. ``read``: ``(config dict,
    SafetensorsSource, config as written)`` of ``hf_dir`` where the caller has them (verify
    reads them before the gate starts); read here otherwise."""
    hf_config, source, written, held = _reference_weights(hf_dir, allow_pickle, read)
    model, text = _reference_model(hf_dir, family, hf_config, written, held)
    to_device(model, device)
    language = held.container.own_names[0][0].rstrip(".") if held is not None else ""
    prefix, layers = layer_list(model, text.num_hidden_layers, language)
    buffers = Buffers(device)
    reader = _ReferenceReader(hf_dir, source, text.model_type, prefix, device, buffers)
    # transformers 5 holds a mixture's experts in two stacks per layer, as Llama 4 does in
    # either: its eager loop (or Llama 4's bmm) reads them expert by expert, so no layer holds all
    # of its experts (a 480B-class layer's are 30 GB in fp32, a Maverick layer's 64 GB)
    stacks = sum(
        stream_expert_stacks(
            layer, lambda name, e, shape, i=i: reader.read_expert(f"{prefix}.{i}.{name}", e, shape)
        )
        for i, layer in enumerate(layers)
    )
    if stacks and hasattr(model, "set_experts_implementation"):  # transformers 5's interface
        model.set_experts_implementation("eager")
    buffers.reserve(layer_numel(layers))
    _install_reference_tables(model, text, held, reader)
    # a container's parts that text does not run (vision tower, projector) stay on meta
    own = tuple(p for p, _ in held.container.own_names) if held is not None else ("",)
    in_layers = tuple(f"{prefix}.{i}." for i in range(len(layers)))
    for name, p in model.named_parameters():
        if name.startswith(own) and not name.startswith(in_layers):
            set_param(model, name, reader.read(name, p.shape))
    # The reader (and the mapped files behind it) outlives the pass only for layers past the
    # decoder's (MTP layers, porting.parity.mtp): otherwise its pages would stay resident
    # through the Megatron pass.
    beyond = any(k.startswith(f"{prefix}.{text.num_hidden_layers}.") for k in reader.available)
    side = Side(
        model,
        layers,
        reader.load,
        reader.read if beyond else None,
        buffers,
        Buffers(device),
        reader.read_expert if beyond else None,
        reader.table if beyond else None,
    )
    return side, text


def _reference_weights(hf_dir: Path, allow_pickle: bool, read):
    """The HF directory's config (as read, and as written), its weights as the reference reads
    them (a quantized checkpoint dequantized by the reference's own code, not the importer's),
    and the container it is held in (None: a text model's own checkpoint)."""
    from porting.convert.hf_files import read_hf_config_as_written
    from porting.convert.safetensors_io import RenamedSource, weights_at

    if read:
        hf_config, source, written = read
    else:
        (hf_config, written), source = read_hf_config_as_written(hf_dir), None
    if source is None:
        from porting.parity.hf_dequant import REFERENCE

        source = weights_at(hf_dir, allow_pickle=allow_pickle, dequantizer=REFERENCE, names="own")
        held = getattr(source, "held", None)
    elif isinstance(source, RenamedSource):  # the text names the import read, as the class's
        held = source.held
        source = source.renamed_as("own")
    else:
        held = None
    if source.dequantized() is not None:
        from porting.parity.hf_dequant import import_references

        import_references()
    return hf_config, source, written, held


def _reference_model(hf_dir: Path, family, hf_config: dict, written, held):
    """The family's transformers class built on meta in fp32 (its large tensors never
    allocated), and the config of its language model."""
    from accelerate import init_empty_weights

    from porting.contract.hf_spelling import config_for_reference
    from porting.convert.container import reference_config

    if held is not None:
        # the container class itself, run on text: its language model, its head
        cls = family.hf_class(held.container.architecture)
        config = reference_config(cls, held, hf_config)
        text = config.get_text_config()
    else:
        # The family's class reads the config: AutoConfig would want the checkpoint's own code
        # for a model_type transformers does not know (an auto_map checkpoint). A config
        # spelled by transformers 5 reaches it in the 4.x spelling, a 4.x one as transformers 4
        # meant it (porting.contract.hf_spelling.config_for_reference).
        cls = family.hf_class(hf_config["architectures"][0])
        config = config_for_reference(cls, hf_config, written) or cls.config_class.from_pretrained(
            str(hf_dir), local_files_only=True
        )
        text = config
    with init_empty_weights(), LargeOnMeta():
        model = cls._from_config(
            config, dtype=torch.float32, attn_implementation=family.hf_attn_implementation
        )
    model.eval()
    return model, text


def _install_reference_tables(model, text, held, reader: _ReferenceReader) -> None:
    """The embedding and the output layer read by vocabulary slices (porting.parity.vocab),
    tied or not: neither is ever in memory whole."""
    tied = bool(getattr(text, "tie_word_embeddings", False))
    if held is not None and not tied:
        # a container's head may be tied to its embedding by the container's own flag (as
        # transformers 5 builds it) where the language model's config says it is not
        output = model.get_output_embeddings()
        if output.weight is model.get_input_embeddings().weight:
            output.weight = torch.nn.Parameter(torch.empty_like(output.weight, device="meta"))
    if tied:  # one table in both places (transformers 5 builds them apart on meta)
        model.tie_weights()
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    install_tables(model, [inputs, outputs], text.vocab_size, reader.table)


class _ReferenceReader:
    """The reference's tensors by name from the HF directory's weights, each in fp32 on the
    gate's device: whole, an expert of a stack, a vocabulary table's rows, a layer's."""

    def __init__(self, hf_dir: Path, source, model_type: str, prefix: str, device, buffers):
        self.hf_dir, self.source, self.model_type = hf_dir, source, model_type
        self.prefix, self.device, self.buffers = prefix, device, buffers
        self.available = set(source.keys())

    def _missing(self, key: str) -> PortingError:
        return PortingError(f"{self.hf_dir}: tensor {key!r} is missing")

    def read(self, key: str, want: torch.Size | None, buf: torch.Tensor | None = None):
        """Tensor ``key`` (of shape ``want``; None: as stored) into ``buf`` (a new tensor where
        None); one transformers 5 stacks, made of the per-expert tensors a checkpoint stores."""
        from porting.convert.packed_experts import published_parts

        if key not in self.available:
            parts = want is not None and published_parts(self.model_type, key, tuple(want))
            if not parts or any(name not in self.available for name, _ in parts):
                raise self._missing(key)
            if buf is None:
                buf = torch.empty(want, dtype=torch.float32, device=self.device)
            for name, part in parts:
                into = buf if part is None else buf[part.expert]
                if part is not None and part.rows is not None:
                    into = into[part.rows[0] : part.rows[1]]
                into.copy_(self.read(name, into.shape))
            return buf
        stored = torch.Size(self.source.shape(key)[0])
        want = stored if want is None else want
        check_shape(str(self.hf_dir), key, stored, want)
        if buf is None:
            buf = torch.empty(want, dtype=torch.float32, device=self.device)
        with self.source.mapped(key) as stored:
            cast_into(buf, stored)
        check_finite(buf, str(self.hf_dir), key)
        return buf

    def read_expert(self, key: str, e: int, shape: torch.Size) -> torch.Tensor:
        """Expert ``e`` (of ``shape``) of the stack ``key``: its slice of a stored stack, or the
        published per-expert tensors it is made of."""
        from porting.convert.packed_experts import published_parts

        buf = torch.empty(shape, dtype=torch.float32, device=self.device)
        if key in self.available:
            stored = torch.Size(self.source.shape(key)[0])
            check_shape(str(self.hf_dir), key, stored[1:], shape)
            if not 0 <= e < stored[0]:
                raise PortingError(f"{self.hf_dir}: tensor {key!r} has no expert {e}")
            with self.source.mapped(key, e) as one:
                cast_into(buf, one)
            check_finite(buf, str(self.hf_dir), key)
            return buf
        parts = published_parts(self.model_type, key, (e + 1, *shape)) or []
        mine = [(name, part) for name, part in parts if part is not None and part.expert == e]
        if not mine or any(name not in self.available for name, _ in mine):
            raise self._missing(key)
        for name, part in mine:
            into = buf if part.rows is None else buf[part.rows[0] : part.rows[1]]
            into.copy_(self.read(name, into.shape))
        return buf

    def table(self, key: str, shape: torch.Size | None = None) -> VocabTable:
        """The stored tensor ``key`` as a vocabulary table, read by rows when used."""
        if key not in self.available:
            raise self._missing(key)
        stored = torch.Size(self.source.shape(key)[0])
        check_shape(str(self.hf_dir), key, stored, stored if shape is None else shape)
        source, where = self.source, str(self.hf_dir)

        def rows(start: int, stop: int, out: torch.Tensor) -> None:
            with source.mapped(key) as whole:
                cast_into(out, whole[start:stop])
            check_finite(out, where, key)

        return VocabTable(key, stored, rows, self.device, self.buffers.spare)

    def load(self, i: int, sub: str, module, take: Take, skip, matrices=None):
        """The stored tensors of ``module`` at ``sub`` in layer ``i`` (:attr:`Side.load`)."""
        return {
            name: self.read(f"{self.prefix}.{i}.{sub}{name}", p.shape, take(name, p.shape))
            for name, p in stored_tensors(module, skip, matrices)
        }


def _megatron_side(ckpt, family, device: torch.device, buffers: Buffers):
    """``buffers``: the HF side's (the areas its layers were read into), for this model's."""
    from accelerate import init_empty_weights
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    from porting.convert.checkpoint import open_checkpoint
    from porting.convert.dist_reader import DistCheckpointReader
    from porting.convert.megatron import build_mcore_model, checkpoint_config
    from porting.convert.preflight import check_nemo_layout

    checkpoint = open_checkpoint(ckpt)
    config = checkpoint_config(checkpoint, family, torch.float32)  # the layers run in fp32
    with init_empty_weights():
        model = build_mcore_model(config)
    to_device(model, device)
    loc = checkpoint.located
    weights = loc.weights
    reader = DistCheckpointReader(weights)
    # Every key, offset and factory of the checkpoint's layout, without data.
    sharded = model.sharded_state_dict(prefix=loc.prefix)
    check_nemo_layout(sharded, reader, str(loc.manifest_path))
    buffers.reserve(layer_numel(model.decoder.layers))

    def params_of(
        module_prefix: str,
        module: torch.nn.Module,
        take: Take | None = None,
        skip=(),
        matrices: bool | None = None,
    ) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in stored_tensors(module, skip, matrices):
            key = module_prefix + name
            item = sharded.get(loc.prefix + key)
            if item is None or isinstance(item, ShardedObject):
                raise PortingError(f"{weights}: the model's layout has no tensor for {key!r}")
            if isinstance(item, ShardedTensor):
                check_shape(str(weights), key, torch.Size(item.local_shape), p.shape)
            if take is None:
                buf = torch.empty(p.shape, dtype=torch.float32, device=device)
            else:
                buf = take(name, p.shape)
            if device.type == "cpu":  # a factory (a GLU's two halves) too
                reader.read_sharded(item, out=buf)
            else:
                value = reader.read_sharded(item)
                check_shape(str(weights), key, value.shape, p.shape)
                cast_into(buf, value)
            out[name] = buf
        return out

    # the embedding and the output layer read by vocabulary slices, as the HF side's
    words = getattr(getattr(model, "embedding", None), "word_embeddings", None)
    head = getattr(model, "output_layer", None)
    vocab = next(
        (m.weight.shape[0] for m in (words, head) if getattr(m, "weight", None) is not None), 0
    )
    install_tables(
        model,
        [words, head],
        vocab,
        lambda key, shape: _stored_table(
            reader, sharded.get(loc.prefix + key), key, shape, device, buffers.spare
        ),
    )
    layers = model.decoder.layers
    for name, module in model.named_children():
        # the gate runs the main head (main_head_only); the MTP check reads its own
        if name not in ("decoder", "mtp"):
            for pname, value in params_of(f"{name}.", module).items():
                set_param(module, pname, value)
    for name, module in model.decoder.named_children():
        if name != "layers":
            for pname, value in params_of(f"decoder.{name}.", module).items():
                set_param(module, pname, value)

    def load(i: int, sub: str, module, take: Take, skip, matrices=None) -> dict[str, torch.Tensor]:
        return params_of(f"decoder.layers.{i}.{sub}", module, take, skip, matrices)

    def module_params(name: str, skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
        return params_of(f"{name}.", model.get_submodule(name), None, skip)

    side = Side(model, layers, load, module_params, buffers, Buffers(device))
    return side, config


def _stored_table(reader, item, key: str, shape: torch.Size, device, spare) -> VocabTable:
    """A vocabulary table whose rows ``reader`` reads from the checkpoint's stored chunks
    (``item``: its ``ShardedTensor`` in the model's layout)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if not isinstance(item, ShardedTensor) or item.prepend_axis_num or item.flattened_range:
        raise PortingError(f"{reader.dir}: the model's layout has no plain tensor for {key!r}")
    check_shape(str(reader.dir), key, torch.Size(item.local_shape), shape)
    offset = tuple(item.global_offset)

    def rows(start: int, stop: int, out: torch.Tensor) -> None:
        at, size = (offset[0] + start, *offset[1:]), (stop - start, *shape[1:])
        if device.type == "cpu":
            reader.read(item.key, at, size, out)
        else:
            cast_into(out, reader.read(item.key, at, size))

    return VocabTable(key, shape, rows, device, spare)


def _relative(diff_max: float, ref: torch.Tensor) -> float:
    scale = ref.abs().max().item()
    return diff_max / scale if scale > 0 else diff_max


def streamed_logits(
    hf_dir: str | Path,
    ckpt: str | Path,
    family,
    prompts: list[torch.Tensor],
    vocab_size: int,
    show_progress: bool = False,
    allow_pickle: bool = False,
    scratch_dir: str | Path | None = None,
    device: str | torch.device = "cpu",
    hf_probe=None,
    hf_read=None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[LayerDivergence], GateCost, list]:
    """HF and Megatron logits (cut to the HF vocabulary, on the CPU), the per-layer divergence,
    the matmul work with this device's rate for it (the gate's floor), and for each
    multi-token-prediction layer of the checkpoint the pair (HF, Megatron) of its logits
    (:mod:`porting.parity.mtp`; none for a model without).

    The parallel state must be initialised (:func:`porting.convert.megatron.init_parallel`).
    ``allow_pickle``: the HF side may be ``pytorch_model*.bin`` (read with ``weights_only=True``).
    ``scratch_dir``: where the hidden states wait (default: the temp directory); an import or
    export gives its partial output, so that a killed run leaves them with it. ``device``: where
    the layers compute (``cuda``: fp32 with TF32 off; a device that runs out of memory raises
    ``torch.OutOfMemoryError``, and the caller decides). ``hf_probe``: a context entered around
    the HF side's forward only (:class:`porting.parity.harness.SiteProbe`). ``ckpt``: a path or
    the :class:`~porting.convert.checkpoint.Checkpoint` the caller opened; ``hf_read``: the HF
    side's ``(config dict, SafetensorsSource)`` where the caller has read them.
    """
    # the same activations in every layer: freed blocks serve the next layer's
    # 32 MiB: every activation of the default prompts at these widths (a 7B's largest is 11 MB)
    # is reused from the heap, but not a frontier mixture's experts (DeepSeek-V3's are 59 MB in
    # fp32), which took the heap to 1.8 GB with 0.9 GB of it free and resident under the MTP check
    with ReusedHeap(threshold=32 << 20) as heap:
        return _streamed_logits(
            hf_dir,
            ckpt,
            family,
            prompts,
            vocab_size,
            show_progress,
            allow_pickle,
            scratch_dir,
            torch.device(device),
            hf_probe,
            hf_read,
            heap,
        )


def _streamed_logits(
    hf_dir,
    ckpt,
    family,
    prompts,
    vocab_size,
    show_progress,
    allow_pickle,
    scratch_dir,
    device,
    hf_probe,
    hf_read,
    heap: ReusedHeap,
):
    from tqdm import tqdm

    started = time.process_time(), time.perf_counter()
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    ids, valid = pad_batch(prompts)
    hf, hf_config = _hf_side(Path(hf_dir), family, allow_pickle, device, hf_read)
    n = len(hf.layers)
    stage = Stage.of_this_process(n)
    steps = 2 * (n if stage is None else len(stage.owned))
    bar = tqdm(total=steps, desc="parity", unit="layer", leave=False, disable=not show_progress)
    # Each HF layer's input and output go to disk, not memory: the Megatron pass needs them one
    # layer at a time, and kept in RAM they would grow with the depth.
    with tempfile.TemporaryDirectory(prefix=".porting-parity-", dir=scratch_dir) as scratch:
        run = _Pass(
            ids.to(device), valid.to(device), prompts, vocab_size, Path(scratch), stage, heap, bar
        )
        reference = _reference_pass(hf, run, hf_probe)
        hf = None  # the HF model is released before the Megatron side is built
        mc_logits, report, got, ctx = _megatron_pass(ckpt, family, hf_dir, run, reference)
        mtp = _mtp_pairs(family, ctx, hf_config, run, reference, got) if got else []
    bar.close()
    # this process's share ends with its passes: the rate's first measurement below is not the gate's
    owned = range(n) if stage is None else stage.owned
    share = {
        "rank": 0 if stage is None else stage.rank,
        "layers": [owned[0], owned[-1]] if owned else [],
        "cpu_s": round(time.process_time() - started[0], 3),
        "wall_s": round(time.perf_counter() - started[1], 3),
    }
    # Measured (where not cached) after the run: timed alone, not beside the reader.
    rate = machine_gflops(device, work_flop=2 * run.flop[0])  # both sides, as GateCost counts it
    result = [
        reference.logits if run.head else None,
        mc_logits if run.head else None,
        report,
        GateCost(flop=run.flop[0], gflops=rate, ranks=[share]),
        mtp,
    ]
    if stage is not None:
        result = _gathered(stage, result)
    return tuple(result)


@dataclass
class _Pass:
    """What the two sides' passes share: the padded batch, where the reference's layer inputs
    and outputs are kept, this process's pipeline stage (None: every layer), the matmul work
    counted on the reference side."""

    ids: torch.Tensor
    valid: torch.Tensor
    prompts: list[torch.Tensor]
    vocab_size: int
    kept: Path
    stage: Stage | None
    heap: ReusedHeap
    bar: object
    flop: list[float] = field(default_factory=lambda: [0.0])

    @property
    def head(self) -> bool:
        """This process computes the logits (the last stage, or the whole model)."""
        return self.stage is None or self.stage.last

    def step(self) -> None:
        self.heap.step()
        self.bar.update()


@dataclass
class _Reference:
    """What the Megatron pass and the MTP check need of the reference's, once its model is gone:
    its logits (per prompt, on the last stage), the last decoder layer's arguments and the final
    norm's output (``last``), its layer list's name, its last layer, its readers and its layer
    areas (for the Megatron side's)."""

    logits: list[torch.Tensor] | torch.Tensor | None
    last: dict
    prefix: str
    last_layer: torch.nn.Module
    read: Callable | None
    read_expert: Callable | None
    table: Callable | None
    buffers: Buffers
    layers: int


def _reference_pass(hf: Side, run: _Pass, hf_probe) -> _Reference:
    """The reference model over the batch, each layer's input and output saved for the Megatron
    pass's comparison."""
    n = len(hf.layers)
    last: dict = {}

    def on_hf_layer(i, layer, args, kwargs, output):
        hidden = args[0] if args else kwargs["hidden_states"]
        torch.save(
            {"in": hidden.detach().cpu(), "out": output.detach().cpu()}, run.kept / f"{i}.pt"
        )
        if i == n - 1:
            last["kwargs"] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        run.step()

    grab = hf.model.get_output_embeddings().register_forward_pre_hook(
        lambda m, a: last.update(normed=a[0])
    )
    with (
        _real_rows_only(hf.model, run.valid, (torch.nn.Linear,), run.flop),
        _MatmulWork(run.flop),
        hf_probe or nullcontext(),
    ):
        logits = hf.run(
            lambda: hf.model(input_ids=run.ids, use_cache=False).logits, on_hf_layer, run.stage
        )
    grab.remove()
    if run.head:
        logits = unpad(logits, run.prompts, run.vocab_size)
    prefix = next(name for name, m in hf.model.named_modules() if m is hf.layers)
    return _Reference(
        logits, last, prefix, hf.layers[-1], hf.read, hf.read_expert, hf.table, hf.buffers, n
    )


def _megatron_pass(ckpt, family, hf_dir, run: _Pass, reference: _Reference):
    """The Megatron model over the batch, each layer compared with the reference's as it
    returns; its logits, the layers' report, its MTP heads' logits (where it has them) and the
    shape context. The model is released on return, before the reference's MTP layers are read."""
    from porting.convert.checkpoint import open_checkpoint
    from porting.convert.megatron import main_head_only

    device = run.ids.device
    checkpoint = open_checkpoint(ckpt)
    mc, mc_config = _megatron_side(checkpoint, family, device, reference.buffers)
    n = reference.layers
    if len(mc.layers) != n:
        raise PortingError(
            f"{checkpoint.path}: {len(mc.layers)} Megatron layers against {n} in {hf_dir}/config.json"
        )
    report: list[LayerDivergence] = []
    mask = run.valid.transpose(0, 1)  # Megatron's hidden states are [s, b, h]
    positions = torch.arange(run.ids.shape[1], device=device).unsqueeze(0).expand_as(run.ids)
    decoder: dict = {}
    watch = mc.model.decoder.register_forward_hook(
        lambda m, a, k, o: decoder.update(out=output_of(o), kwargs=k), with_kwargs=True
    )
    on_layer = _layer_comparison(run, mask, report)
    with _real_rows_only(mc.model, mask, _megatron_linear_types(), [0.0]):
        with main_head_only(mc.model):
            logits = mc.run(lambda: mc.model(run.ids, positions, None), on_layer, run.stage)
        if run.head:
            logits = unpad(logits, run.prompts, run.vocab_size)
        watch.remove()
        reference.buffers.free()
        ctx = family.shape_context(mc_config, run.vocab_size)
        got = []
        if ctx.mtp_layers and run.head:
            from porting.parity import mtp as mtp_check

            if reference.read is None:
                raise PortingError(
                    f"{checkpoint.path} has {ctx.mtp_layers} multi-token-prediction "
                    f"layer(s); {hf_dir} has no tensors past its decoder's "
                    f"{reference.prefix}.{n - 1}"
                )
            got = mtp_check.megatron_mtp_logits(
                mc.model, mc.read, run.ids, positions, decoder["out"], decoder["kwargs"]
            )
            got = [unpad(g, run.prompts, run.vocab_size) for g in got]
    return logits, report, got, ctx


def _layer_comparison(run: _Pass, mask: torch.Tensor, report: list[LayerDivergence]):
    """``on_layer`` of the Megatron pass: layer ``i``'s output against the reference's, and where
    it differs beyond the tolerance, the same layer again on the reference's input (its own
    error, apart from what it was handed), into ``report``."""
    device = run.ids.device

    def on_mc_layer(i, layer, args, kwargs, output):
        saved = torch.load(run.kept / f"{i}.pt", weights_only=True)
        ref = saved["out"].to(device).transpose(0, 1)[mask]
        got = output[mask]
        diff = (got - ref).abs()
        max_abs = diff.max().item()
        max_rel = _relative(max_abs, ref)
        hf_in = saved["in"].to(device).transpose(0, 1).contiguous()
        given = kwargs.get("hidden_states", args[0] if args else None)
        same_input = given is not None and torch.equal(given, hf_in)
        if same_input or max_rel <= LAYER_RTOL:  # NaN is not within: it runs again
            # the same computation on the same input, or a layer within the tolerance on its
            # own input: nothing carried in to tell from its own error
            own_abs, own_rel = max_abs, max_rel
        else:
            own_kwargs = dict(kwargs, hidden_states=hf_in)
            own = output_of(layer.forward(*args, **own_kwargs))[mask]
            own_abs = (own - ref).abs().max().item()
            own_rel = _relative(own_abs, ref)
        report.append(
            LayerDivergence(
                layer=i,
                max_abs=max_abs,
                mean_abs=diff.mean().item(),
                max_rel=max_rel,
                own_max_abs=own_abs,
                own_max_rel=own_rel,
                own_on_hf_input=same_input or not max_rel <= LAYER_RTOL,
            )
        )
        run.step()

    return on_mc_layer


def _mtp_pairs(family, ctx, hf_config, run: _Pass, reference: _Reference, got: list) -> list:
    """Each MTP head's logits, the reference's (its MTP layers read now) beside Megatron's."""
    from porting.parity import mtp as mtp_check

    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # position-wise, as the model's own linear layers run in the pass (_real_rows_only)
        rows = F.linear(x[run.valid], weight)
        run.flop[0] += 2.0 * rows.shape[0] * x.shape[-1] * rows.shape[-1]
        full = rows.new_zeros(*run.valid.shape, rows.shape[-1])
        full[run.valid] = rows
        return full

    @contextmanager
    def computing(layer: torch.nn.Module) -> Iterator[None]:
        with _real_rows_only(layer, run.valid, (torch.nn.Linear,), run.flop), _MatmulWork(run.flop):
            yield

    want = mtp_check.hf_mtp_logits(
        mtp_check.mtp_names(family, ctx, reference.prefix),
        reference.read,
        reference.last_layer,
        hf_config,
        run.ids,
        reference.last["normed"],
        reference.last["kwargs"],
        reference.table,
        reference.read_expert,
        linear,
        computing,
    )
    return [(unpad(w, run.prompts, run.vocab_size), g) for w, g in zip(want, got, strict=True)]


def _gathered(stage: Stage, mine: list) -> list:
    """What every rank of a split gate returns: the last stage's logits and MTP pairs, every
    stage's layer reports in layer order, the matmul work of all of them (at the slowest rank's
    measured rate: the gate's floor is its slowest stage's)."""
    dist = torch.distributed
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (mine[2], mine[3].flop, mine[3].gflops, mine[3].ranks))
    head = [mine[0], mine[1], mine[4]] if stage.last else [None, None, None]
    dist.broadcast_object_list(head, src=stage.stages - 1)
    layers = sorted((d for p in parts for d in p[0]), key=lambda d: d.layer)
    cost = GateCost(
        flop=sum(p[1] for p in parts),
        gflops=min(p[2] for p in parts),
        ranks=[share for p in parts for share in p[3]],
    )
    return [head[0], head[1], layers, cost, head[2]]
