"""Layer-streamed parity: both models run with one decoder layer in memory at a time.

The whole-model check holds the HF model and the Megatron model in fp32 (4 bytes a parameter
each), which no ordinary node has for a 70B. Here each side is built with its parameters on the
``meta`` device (``accelerate.init_empty_weights``: buffers and plain attributes such as rotary
frequencies and ALiBi slopes stay real), the embeddings, final norm and output layer are loaded,
and each decoder layer is loaded just before it runs and released just after, by forward hooks
around the model's own forward. So each side runs its own code (masks, rotary, ALiBi) and nothing
family-specific lives here:

- HF side: layer ``i``'s tensors are read from the safetensors shards one at a time;
- Megatron side: layer ``i``'s slice of the stacked layer keys is read from the written checkpoint
  with ``megatron.core.dist_checkpointing.load`` (what users get is what is checked).

All prompts run as one right-padded batch (causal attention: no valid position sees a pad), so
each layer is read once per side. Each Megatron layer also runs on the HF layer's input, which
tells a broken layer from error carried in from earlier ones. Peak memory: embeddings and output
layer of both sides, one layer of each, and the per-layer hidden states.
"""

from __future__ import annotations

import gc
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from porting.errors import PortingError

log = logging.getLogger(__name__)

# A layer whose own error (Megatron's layer on the HF layer's input, against the HF layer's
# output) exceeds this relative to the output's magnitude is broken: fp32 reduction order alone
# gives ~1e-6 for a decoder layer (measured on every tiny variant in tests).
LAYER_RTOL = 1e-4


@dataclass
class LayerDivergence:
    """How far one decoder layer's output differs between the two sides.

    ``max_abs`` / ``mean_abs`` / ``max_rel``: each side's layer on its own propagated input (what
    the logits see). ``own_max_abs`` / ``own_max_rel``: the Megatron layer on the HF layer's input
    (this layer's own error, nothing carried in).
    """

    layer: int
    max_abs: float
    mean_abs: float
    max_rel: float
    own_max_abs: float
    own_max_rel: float

    @property
    def diverges(self) -> bool:
        """True when the layer's own error exceeds what fp32 reduction order explains."""
        return not self.own_max_rel <= LAYER_RTOL  # NaN counts as divergence


def _set_param(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    parent, _, leaf = name.rpartition(".")
    owner = module.get_submodule(parent) if parent else module
    owner._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)


def _release(module: torch.nn.Module) -> None:
    """Put ``module``'s parameters back on the meta device (frees their memory)."""
    for name, p in list(module.named_parameters()):
        _set_param(module, name, torch.empty(p.shape, dtype=p.dtype, device="meta"))


def _check_shape(where: str, key: str, got: torch.Size, want: torch.Size) -> None:
    if tuple(got) != tuple(want):
        raise PortingError(
            f"{where}: tensor {key!r} has shape {tuple(got)}, the config implies {tuple(want)}"
        )


def _layer_list(model: torch.nn.Module, num_layers: int) -> tuple[str, torch.nn.ModuleList]:
    """The model's one ``ModuleList`` of ``num_layers`` decoder layers, and its name."""
    found = [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers
    ]
    if len(found) != 1:
        raise PortingError(
            f"cannot tell the decoder layers of {type(model).__name__} "
            f"({len(found)} module lists of {num_layers} layers)"
        )
    return found[0]


def pad_batch(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts ``[1, s_i]`` right-padded into ``[B, max s]`` ids and the mask of real positions."""
    longest = max(p.shape[1] for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    valid = torch.zeros(len(prompts), longest, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, : p.shape[1]] = p[0]
        valid[i, : p.shape[1]] = True
    return ids, valid


def unpad(logits: torch.Tensor, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-prompt ``[1, s_i, vocab]`` logits from the padded batch."""
    return [logits[i : i + 1, : p.shape[1]] for i, p in enumerate(prompts)]


def _output(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


@dataclass
class _Side:
    """One model with streamed layers: hooks load layer ``i`` before it runs, release it after."""

    model: torch.nn.Module
    layers: torch.nn.ModuleList
    load_layer: Callable[[int], dict[str, torch.Tensor]]

    @torch.no_grad()
    def run(self, call: Callable[[], torch.Tensor], on_layer) -> torch.Tensor:
        """``call()`` with every layer streamed; ``on_layer(i, layer, kwargs, output)`` after each."""
        handles = []
        for i, layer in enumerate(self.layers):

            def pre(mod, args, kwargs, i=i):
                for name, value in self.load_layer(i).items():
                    _set_param(mod, name, value)

            def post(mod, args, kwargs, output, i=i):
                on_layer(i, mod, args, kwargs, _output(output))
                _release(mod)
                gc.collect()

            handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(layer.register_forward_hook(post, with_kwargs=True))
        try:
            return call()
        finally:
            for h in handles:
                h.remove()


def _hf_side(hf_dir: Path, family, allow_pickle: bool):
    from accelerate import init_empty_weights

    from porting.convert.config_map import read_hf_config
    from porting.convert.safetensors_io import SafetensorsSource

    # The family's class reads the config: AutoConfig would want the checkpoint's own code for a
    # model_type transformers does not know (an auto_map checkpoint).
    cls = family.hf_class(read_hf_config(hf_dir)["architectures"][0])
    config = cls.config_class.from_pretrained(str(hf_dir), local_files_only=True)
    with init_empty_weights():
        model = cls._from_config(
            config, dtype=torch.float32, attn_implementation=family.hf_attn_implementation
        )
    model.eval()
    prefix, layers = _layer_list(model, config.num_hidden_layers)
    source = SafetensorsSource(hf_dir, allow_pickle=allow_pickle)
    available = set(source.keys())

    def read(key: str, want: torch.Size) -> torch.Tensor:
        if key not in available:
            raise PortingError(f"{hf_dir}: tensor {key!r} is missing")
        t = source.get(key)
        _check_shape(str(hf_dir), key, t.shape, want)
        return t.to(torch.float32)

    layer_params = {f"{prefix}.{i}.": layer for i, layer in enumerate(layers)}
    for name, p in model.named_parameters():
        if not any(name.startswith(lp) for lp in layer_params):
            if name in available or not getattr(config, "tie_word_embeddings", False):
                _set_param(model, name, read(name, p.shape))
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()

    def load_layer(i: int) -> dict[str, torch.Tensor]:
        return {
            name: read(f"{prefix}.{i}.{name}", p.shape) for name, p in layers[i].named_parameters()
        }

    return _Side(model, layers, load_layer), config


def _megatron_side(ckpt: Path, family):
    from accelerate import init_empty_weights
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from porting.convert.dist_reader import DistCheckpointReader
    from porting.convert.megatron import build_mcore_model, checkpoint_config
    from porting.convert.preflight import check_nemo_layout

    config = checkpoint_config(ckpt, family, torch.float32)  # the layers run in fp32
    with init_empty_weights():
        model = build_mcore_model(config)
    weights = Path(ckpt) / "weights"
    reader = DistCheckpointReader(weights)
    # Every key, offset and factory of the checkpoint's layout, without data.
    sharded = model.sharded_state_dict(prefix="module.")
    check_nemo_layout(sharded, reader, f"{ckpt}/context/porting.json")

    def params_of(module_prefix: str, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in module.named_parameters():
            key = module_prefix + name
            item = sharded.get("module." + key)
            if item is None or isinstance(item, ShardedObject):
                raise PortingError(f"{weights}: the model's layout has no tensor for {key!r}")
            value = reader.read_sharded(item)
            _check_shape(str(weights), key, value.shape, p.shape)
            out[name] = value.to(torch.float32)
        return out

    layers = model.decoder.layers
    for name, module in model.named_children():
        if name != "decoder":
            for pname, value in params_of(f"{name}.", module).items():
                _set_param(module, pname, value)
    for name, module in model.decoder.named_children():
        if name != "layers":
            for pname, value in params_of(f"decoder.{name}.", module).items():
                _set_param(module, pname, value)

    def load_layer(i: int) -> dict[str, torch.Tensor]:
        return params_of(f"decoder.layers.{i}.", layers[i])

    return _Side(model, layers, load_layer), config


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
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[LayerDivergence]]:
    """HF and Megatron logits (cut to the HF vocabulary) and the per-layer divergence.

    The parallel state must be initialised (:func:`porting.convert.megatron.init_parallel`).
    ``allow_pickle``: the HF side may be ``pytorch_model*.bin`` (read with ``weights_only=True``).
    ``scratch_dir``: where the hidden states wait (default: the temp directory); an import or
    export gives its partial output, so that a killed run leaves them with it.
    """
    from tqdm import tqdm

    ids, valid = pad_batch(prompts)
    hf, _ = _hf_side(Path(hf_dir), family, allow_pickle)
    n = len(hf.layers)
    bar = tqdm(total=2 * n, desc="parity", unit="layer", leave=False, disable=not show_progress)
    # Each HF layer's input and output go to disk, not memory: the Megatron pass needs them one
    # layer at a time, and kept in RAM they would grow with the depth.
    scratch = tempfile.TemporaryDirectory(prefix=".porting-parity-", dir=scratch_dir)
    kept = Path(scratch.name)

    def on_hf_layer(i, layer, args, kwargs, output):
        hidden = args[0] if args else kwargs["hidden_states"]
        torch.save({"in": hidden.detach(), "out": output.detach()}, kept / f"{i}.pt")
        bar.update()

    with scratch:
        hf_logits = hf.run(lambda: hf.model(input_ids=ids, use_cache=False).logits, on_hf_layer)
        hf_logits = hf_logits[..., :vocab_size].float()
        hf = None  # the HF model is released before the Megatron side is built
        gc.collect()

        mc, _ = _megatron_side(Path(ckpt), family)
        if len(mc.layers) != n:
            raise PortingError(
                f"{ckpt}: {len(mc.layers)} Megatron layers against {n} in {hf_dir}/config.json"
            )
        report: list[LayerDivergence] = []
        mask = valid.transpose(0, 1)  # Megatron's hidden states are [s, b, h]

        def on_mc_layer(i, layer, args, kwargs, output):
            saved = torch.load(kept / f"{i}.pt", weights_only=True)
            ref = saved["out"].transpose(0, 1)[mask]
            got = output[mask]
            diff = (got - ref).abs()
            own_kwargs = dict(kwargs, hidden_states=saved["in"].transpose(0, 1).contiguous())
            own = _output(layer.forward(*args, **own_kwargs))[mask]
            own_diff = (own - ref).abs().max().item()
            report.append(
                LayerDivergence(
                    layer=i,
                    max_abs=diff.max().item(),
                    mean_abs=diff.mean().item(),
                    max_rel=_relative(diff.max().item(), ref),
                    own_max_abs=own_diff,
                    own_max_rel=_relative(own_diff, ref),
                )
            )
            bar.update()

        positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
        mc_logits = mc.run(lambda: mc.model(ids, positions, None), on_mc_layer)
    bar.close()
    mc_logits = mc_logits[..., :vocab_size].float()
    return unpad(hf_logits, prompts), unpad(mc_logits, prompts), report
