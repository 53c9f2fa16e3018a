"""The proof every family owes, as functions a family's tests call (ours and an outside package's).

Each check builds on a tiny random-init HF model made locally (:func:`make_hf`, no hub) and one of
our checkpoints imported from it, and asserts what its name says:

- :func:`prove_parity`: fp32 full-logit parity against ``transformers`` on prompts of several
  lengths, every logit within ``atol=rtol=1e-5``, 100% top-1 agreement; the layer-streamed gate
  gives the same logits and names no diverging layer;
- :func:`prove_tp2`: two gloo ranks at tensor parallel 2 give the TP=1 logits (1e-5);
- :func:`prove_round_trip`: export gives back every tensor bit for bit, the same ``config.json``
  and tokenizer, and ``transformers``' own class loads it to the same logits;
- :func:`prove_formats`: the same, through the Megatron-LM and Megatron-Bridge layouts (each
  import parity-gated);
- :func:`prove_routing` (mixture-of-experts families): every layer sends every token to the same
  experts on both sides, with no near-tie that rounding could flip;
- :func:`prove_experts_streamed` (mixture-of-experts families): the streamed gate holds a layer's
  experts one at a time on each side (two with the one being read), never the whole mixture;
- :func:`prove_fault_named`: the negative control. One layer's entry of the table is broken, the
  checkpoint written through the normal importer; parity must fail by 100x the tolerance and
  more, and the streamed gate must name that layer first;
- :func:`prove_features_observed` / :func:`prove_features_named`: each mapped feature of the
  config (:data:`FEATURES`: a window, a soft-cap, a GELU variant, rope settings) is perturbed on
  the HF side alone; one whose perturbation moves no logit past the tolerance on the gate's
  prompts is invisible to the gate, and the gate's report must name it (``unobserved``).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from porting.contract import registry
from porting.contract.container import renamed, reversed_pairs
from porting.convert.container import reference_architecture
from porting.testing import assert_streamed_agrees, make_tokenizer, perturb, save_as_published

ATOL = RTOL = 1e-5

_TINY = dict(
    vocab_size=130,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
# What each architecture needs beyond _TINY to be a meaningful tiny model of its kind (its windows
# shorter than the prompts, its soft-caps low enough to bend, its experts routed top-2 of 4).
_TINY_EXTRA = {
    "FalconForCausalLM": dict(new_decoder_architecture=True, num_kv_heads=2, ffn_hidden_size=96),
    "Qwen3ForCausalLM": dict(head_dim=32),
    "MistralForCausalLM": dict(sliding_window=8),
    "GemmaForCausalLM": dict(head_dim=32),
    "Gemma2ForCausalLM": dict(
        head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
        attn_logit_softcapping=0.05, final_logit_softcapping=0.2,
    ),
    "Gemma3ForCausalLM": dict(
        head_dim=32, sliding_window=8, query_pre_attn_scalar=24, sliding_window_pattern=2,
        rope_theta=1e6, rope_local_base_freq=100.0,
    ),
    "Phi3ForCausalLM": dict(sliding_window=8),
    "NemotronForCausalLM": dict(head_dim=32, partial_rotary_factor=0.5),
    "SmolLM3ForCausalLM": dict(no_rope_layer_interval=3),
    "GraniteMoeForCausalLM": dict(
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        attention_multiplier=0.05, embedding_multiplier=3.0, residual_multiplier=0.5,
    ),
    "GraniteForCausalLM": dict(
        attention_multiplier=0.0078125, embedding_multiplier=12.0, residual_multiplier=0.22,
        logits_scaling=16.0,
    ),
    "MixtralForCausalLM": dict(num_local_experts=4, num_experts_per_tok=2),
    "Qwen2MoeForCausalLM": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        shared_expert_intermediate_size=80,
    ),
    "Qwen3MoeForCausalLM": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
        head_dim=32,
    ),
    "OlmoeForCausalLM": dict(num_experts=4, num_experts_per_tok=2),
    "DeepseekV3ForCausalLM": dict(
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
        topk_group=1, n_shared_experts=1, moe_intermediate_size=48, first_k_dense_replace=1,
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    ),
    # Llama 4 in three layers: dense, mixture (top-1 of 4), dense; the last rotary-free with its
    # attention temperature at a floor the prompts pass; the rotary ones chunked by 8
    "Llama4ForCausalLM": dict(
        intermediate_size=48, intermediate_size_mlp=96, head_dim=16, num_local_experts=4,
        num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layer_interval=3,
        attention_chunk_size=8, floor_scale=4, attn_scale=0.5,
    ),
    # DeepSeek-V2-Lite's layout: no query latent, greedy top-2 of 4, 2 shared experts
    "DeepseekV2ForCausalLM": dict(
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2,
        moe_intermediate_size=48, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, topk_method="greedy",
    ),
}  # fmt: skip
_FALCON_NAMES = ("intermediate_size", "num_key_value_heads")


def tiny_fields(architecture: str, scale: int = 1, **overrides) -> dict:
    """Config fields of a tiny model of ``architecture`` for :func:`make_hf` (widths times
    ``scale``), as the benchmarks and the GPU check build them."""
    fields = _TINY | _TINY_EXTRA.get(architecture, {})
    if architecture == "FalconForCausalLM":
        fields = {k: v for k, v in fields.items() if k not in _FALCON_NAMES}
    for key in ("hidden_size", "intermediate_size", "ffn_hidden_size", "moe_intermediate_size",
                "shared_expert_intermediate_size", "intermediate_size_mlp", "head_dim"):  # fmt: skip
        if key in fields:
            fields[key] *= scale
    return fields | overrides


def make_hf(
    out_dir: str | Path,
    architecture: str,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tokenizer_vocab: int = 120,
    edit=None,
    **fields,
) -> Path:
    """Save a tiny random ``transformers`` ``architecture`` model plus tokenizer at ``out_dir``.

    ``fields`` are the config's (``hidden_size=64, num_hidden_layers=2, ...``); the token ids come
    from the tokenizer. Norm weights and biases are moved off their init (:func:`perturb`), so a
    dropped one fails parity; ``edit(model)`` may change the weights further before saving.
    """
    import transformers

    from porting.contract import hf_spelling

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out, vocab_size=tokenizer_vocab)
    cls = getattr(transformers, architecture)
    # fields in transformers 4's spelling, read by the installed transformers as 4.x meant them
    # (rope_scaling=None is unscaled, even where transformers 5's default is YaRN)
    config = hf_spelling.transformers_config(
        cls,
        dict(
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            **fields,
        ),
    )
    torch.manual_seed(seed)
    model = cls(config)
    perturb(model, seed)
    if edit is not None:
        with torch.no_grad():
            edit(model)
    save_as_published(model.to(dtype), out)
    return out


# A vision tower of each container class, as small as its config allows: it is carried, never run
# by the gate, so its size is only what the round trip copies.
_TINY_VISION = {
    "Gemma3ForConditionalGeneration": (
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             image_size=28, patch_size=14),
        dict(mm_tokens_per_image=4, image_token_index=127, boi_token_index=125,
             eoi_token_index=126),
    ),
    "Mistral3ForConditionalGeneration": (
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             image_size=28, patch_size=14, head_dim=16),
        dict(image_token_index=10),
    ),
    "Llama4ForConditionalGeneration": (
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
             projector_output_dim=32),
        dict(image_token_index=10, boi_token_index=11, eoi_token_index=12),
    ),
}  # fmt: skip


def make_container(
    out_dir: str | Path,
    architecture: str,
    text_architecture: str,
    *,
    seed: int = 0,
    vision: dict | None = None,
    **fields,
) -> Path:
    """Save a tiny random vision-language ``architecture`` model (its language model a
    ``text_architecture`` of ``fields``, as :func:`make_hf` builds one; its vision tower from
    ``vision`` or the class's tiny default) plus tokenizer at ``out_dir``."""
    import transformers

    out = Path(out_dir)
    text = make_hf(out / ".text", text_architecture, seed=seed, **fields)
    text_cfg = json.loads((text / "config.json").read_text())
    for key in ("architectures", "torch_dtype", "dtype", "transformers_version"):
        text_cfg.pop(key, None)
    vision_cfg, top = _TINY_VISION[architecture] if vision is None else (vision, {})
    cls = getattr(transformers, architecture)
    tie = text_cfg.get("tie_word_embeddings", False)
    config = cls.config_class(
        text_config=text_cfg, vision_config=vision_cfg, tie_word_embeddings=tie, **top
    )
    torch.manual_seed(seed)
    model = cls(config)
    perturb(model, seed)
    # the language model's weights are the text model's own (perturbed as make_hf leaves them)
    shown = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        weights = getattr(transformers, text_architecture).from_pretrained(str(text)).state_dict()
    finally:
        if shown:
            transformers.utils.logging.enable_progress_bar()
    # the text class's names as the container class's own (Container.own_names)
    _, container = registry.container_for({"architectures": [architecture]})
    back = reversed_pairs(container.own_names)
    own = {renamed(k, back): v for k, v in weights.items()}
    missing = model.load_state_dict(own, strict=False)
    assert not missing.unexpected_keys, missing.unexpected_keys
    save_as_published(model, out)
    for f in text.iterdir():
        if f.name != "config.json" and not f.name.startswith(("model", "generation")):
            shutil.copyfile(f, out / f.name)
    shutil.rmtree(text)
    return out


def _text_tied(config) -> bool:
    """Whether a container config's language model ties its head to its embedding."""
    return bool(getattr(config.get_text_config(), "tie_word_embeddings", False))


def make_container_as_shipped(out_dir: str | Path, config: dict, *, seed: int = 0) -> Path:
    """Save a random model of the container class a published ``config.json`` (shrunk in size
    only) describes, with that file as it is (a sparse ``text_config`` stays sparse: the model is
    built from it as transformers reads it), in the dtype the file names, and a tokenizer, at
    ``out_dir``."""
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer(out, vocab_size=120)
    cls = getattr(transformers, config["architectures"][0])
    torch.manual_seed(seed)
    model = cls(cls.config_class.from_dict(copy.deepcopy(config)))
    with torch.no_grad():
        perturb(model, seed)
        for p in model.parameters():  # logits that move: the default init leaves them near 0
            p.mul_(4.0)
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        if head.weight is embedding.weight and not _text_tied(model.config):
            # transformers 5 ties a container's head by the container's own flag (true by
            # default in Mistral3Config) where its language model's config unties it; the
            # releases store their own head, which the gate reads as the language model says
            head.weight = torch.nn.Parameter(embedding.weight.clone())
    # the card's dtype for every tensor (transformers may build a part in another)
    dtype = config.get("torch_dtype") or config.get("dtype")
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        for p in model.parameters():  # not model.to(): Llama 4's rotary table is complex
            p.data = p.data.to(getattr(torch, dtype))
    save_as_published(model, out)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def imported_variants(tmp_path_factory, make):
    """For a module-scoped fixture: ``get(variant) -> (hf_dir, ckpt)``, each variant's HF model
    built by ``make(directory, variant) -> hf_dir`` and imported (gate off) once per module."""
    from porting.api import import_hf

    cache: dict[str, tuple[Path, Path]] = {}

    def get(variant: str) -> tuple[Path, Path]:
        if variant not in cache:
            root = tmp_path_factory.mktemp(variant)
            hf = Path(make(root / "hf", variant))
            import_hf(hf, root / "nemo", verify=False, show_progress=False)
            cache[variant] = (hf, root / "nemo")
        return cache[variant]

    return get


def refused_import(hf_dir: str | Path, changes: dict, work: str | Path) -> str:
    """``porting import`` of a copy of ``hf_dir`` whose ``config.json`` has ``changes``: asserts
    exit 2 with nothing written; returns what it printed on stderr (the located message)."""
    import contextlib
    import io
    import shutil

    from porting.cli import main
    from porting.contract import hf_spelling

    hf, out = Path(work) / "hf", Path(work) / "out"
    shutil.copytree(hf_dir, hf)
    cfg = json.loads((hf / "config.json").read_text())
    if "rope_parameters" not in changes:
        # ``changes`` in transformers 4's spelling, as tests write them, on a config transformers
        # 5 saved: the config goes to that spelling first (which both read), else the two would
        # be refused for saying the rotary settings twice, not for the change
        cfg = hf_spelling.internal(cfg)
    cfg.update(changes)
    (hf / "config.json").write_text(json.dumps(cfg))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["import", str(hf), "--out", str(out), "--no-verify"])
    assert code == 2, err.getvalue()
    assert not out.exists()
    assert not [p for p in Path(work).iterdir() if p.name.startswith(".out")]
    return err.getvalue()


def checkpoint_family(ckpt: str | Path):
    """``(family, manifest)`` of one of our checkpoints."""
    from porting.contract.registry import family_by_name
    from porting.convert.checkpoint import read_manifest

    manifest = read_manifest(ckpt)
    return family_by_name(manifest.family), manifest


def prompts_of(ckpt: str | Path) -> list[torch.Tensor]:
    """The gate's prompts, tokenized with the checkpoint's own tokenizer."""
    from transformers import AutoTokenizer

    from porting.parity import harness

    family, m = checkpoint_family(ckpt)
    tok = AutoTokenizer.from_pretrained(str(Path(ckpt) / m.tokenizer["path"]))
    config = harness.reference_config(family, m.hf_config)
    return harness.build_prompts(tok, m.vocab_size, config=config)


def logits(hf_dir: str | Path, ckpt: str | Path, prompts=None):
    """``(hf, megatron)`` fp32 logits per prompt, whole models, cut to the HF vocabulary."""
    from porting.parity import harness

    family, m = checkpoint_family(ckpt)
    prompts = prompts_of(ckpt) if prompts is None else prompts
    mc = harness.megatron_logits_from_checkpoint(ckpt, prompts, m.vocab_size)
    hf_cls = family.hf_class(reference_architecture(m))
    hf = harness.hf_logits(hf_dir, hf_cls, prompts, family.hf_attn_implementation)
    return hf, mc


def megatron_logits_with(ckpt: str | Path, prompts, **changes) -> list[torch.Tensor]:
    """fp32 Megatron logits of ``ckpt`` per prompt, cut to the HF vocabulary, with ``changes``
    set on its config before the model is built: a family's negative controls (one feature
    switched off on the Megatron side alone must break parity)."""
    from porting.convert.megatron import (
        build_mcore_model,
        init_parallel,
        load_weights,
        mcore_logits,
    )
    from porting.testing import checkpoint_config

    _, m = checkpoint_family(ckpt)
    init_parallel()
    config = checkpoint_config(ckpt)
    for key, value in changes.items():
        setattr(config, key, value)
    model = build_mcore_model(config)
    load_weights(model, ckpt)
    return [mcore_logits(model.float(), p)[..., : m.vocab_size] for p in prompts]


def assert_parity(hf, mc, atol: float = ATOL, rtol: float = RTOL) -> None:
    """Every logit of every position of every prompt within tolerance, and the same top-1."""
    assert len(hf) == len(mc) >= 4
    assert len({t.shape[1] for t in hf}) >= 3  # prompts of several lengths
    for a, b in zip(hf, mc, strict=True):
        torch.testing.assert_close(b, a, atol=atol, rtol=rtol)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def prove_parity(
    hf_dir: str | Path, ckpt: str | Path, prompts=None, streamed_atol: float = 1e-6
) -> None:
    """Whole-model fp32 parity at TP=1, and the streamed gate agreeing with it within
    ``streamed_atol`` (the streamed gate runs the prompts as one padded batch, the whole model
    one at a time: a sharp model's own rounding differs between the two)."""
    from porting.parity import harness

    family, _ = checkpoint_family(ckpt)
    prompts = prompts_of(ckpt) if prompts is None else prompts
    hf, mc = logits(hf_dir, ckpt, prompts)
    assert_parity(hf, mc)
    report = harness.compare(hf, mc)
    assert report.passed and report.top1_agreement == 1.0
    assert_streamed_agrees(hf_dir, ckpt, family, prompts, hf, mc, atol=streamed_atol)


@torch.no_grad()
def routing(
    hf_dir: str | Path, ckpt: str | Path, router_suffix: str, prompts=None, router_logits=None
):
    """``(hf, megatron)``: per layer, per prompt, the sorted top-k expert ids of every token, and
    HF's smallest gap between the k-th and (k+1)-th router logit.

    ``router_suffix`` names the HF router modules (``block_sparse_moe.gate``, ``mlp.gate``); the
    Megatron side is every ``TopKRouter``'s routing map. ``router_logits(module, inputs, output)``
    gives the logits of a router whose output is not them (gpt-oss's returns its top-k scores
    and indices), or None for a module of that name that routes nothing (a dense layer's MLP
    where the hook is on the MLP); by default the output is, or its first element (transformers
    5's routers return their logits, scores and indices).
    """
    from megatron.core.transformer.moe.router import TopKRouter

    from porting.convert import packed_experts
    from porting.convert.hf_files import read_hf_config
    from porting.convert.megatron import init_parallel, mcore_logits
    from porting.parity.harness import reference_config
    from porting.testing import load_checkpoint_model

    family, m = checkpoint_family(ckpt)
    prompts = prompts_of(ckpt) if prompts is None else prompts
    hf_model = family.hf_class(reference_architecture(m)).from_pretrained(
        str(hf_dir),
        config=reference_config(family, read_hf_config(hf_dir)),
        dtype=torch.float32,
        attn_implementation=family.hf_attn_implementation,
    )
    k = hf_model.config.num_experts_per_tok
    renamed = packed_experts.renamed_in_5x(hf_model.config.model_type)
    # transformers 5 may keep the router under another module name than the published one
    suffix = renamed.get(f"{router_suffix}.weight", router_suffix).removesuffix(".weight")
    routers = [
        mod
        for name, mod in hf_model.named_modules()
        if name.endswith(router_suffix) or name.endswith(suffix)
    ]
    assert routers, f"no module of the HF model is named *{router_suffix}"

    hf_logits = [[] for _ in routers]
    read = router_logits or (lambda mod, a, out: out[0] if isinstance(out, tuple) else out)

    def keep(i: int, mod, a, out) -> None:
        got = read(mod, a, out)
        if got is not None:
            hf_logits[i].append(got.reshape(-1, got.shape[-1]))

    hooks = [
        r.register_forward_hook(lambda mod, a, out, i=i: keep(i, mod, a, out))
        for i, r in enumerate(routers)
    ]
    for p in prompts:
        hf_model.eval()(p)
    for h in hooks:
        h.remove()
    hf_logits = [layer for layer in hf_logits if layer]
    hf_top = [[t.topk(k, -1).indices.sort(-1).values for t in layer] for layer in hf_logits]
    gaps = [
        (s[:, k - 1] - s[:, k]).min().item()
        for layer in hf_logits
        for s in (t.sort(-1, descending=True).values for t in layer)
    ]
    init_parallel()
    model, _ = load_checkpoint_model(ckpt, dtype=torch.float32)
    mc_maps = {}
    mc_routers = [mod for mod in model.modules() if isinstance(mod, TopKRouter)]
    hooks = [
        r.register_forward_hook(lambda mod, a, out, i=i: mc_maps.setdefault(i, []).append(out[1]))
        for i, r in enumerate(mc_routers)
    ]
    for p in prompts:
        mcore_logits(model, p)
    for h in hooks:
        h.remove()
    mc_top = [
        [rm.nonzero()[:, 1].reshape(rm.shape[0], k).sort(-1).values for rm in mc_maps[i]]
        for i in range(len(mc_routers))
    ]
    return hf_top, mc_top, min(gaps)


def prove_routing(
    hf_dir: str | Path, ckpt: str | Path, router_suffix: str, router_logits=None
) -> None:
    """Both sides pick the same experts for every token of every prompt in every layer, and no
    HF top-k decision is within 1e-4 of a tie (a hundred times the fp32 rounding of router logits
    of order one, so rounding cannot decide it)."""
    hf_top, mc_top, gap = routing(hf_dir, ckpt, router_suffix, router_logits=router_logits)
    assert gap > 1e-4, f"a routing near-tie ({gap:.2e}) in the test model; widen the router"
    assert len(hf_top) == len(mc_top) > 0
    for layer, (a, b) in enumerate(zip(hf_top, mc_top, strict=True)):
        for prompt, (x, y) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(x, y), f"layer {layer}, prompt {prompt}: experts differ"
    # the routing really varies: several experts are used
    assert len(torch.cat([t.flatten() for t in hf_top[0]]).unique()) > 1


def prove_experts_streamed(hf_dir: str | Path, ckpt: str | Path, prompts=None) -> dict[str, int]:
    """The streamed gate's memory bound below a layer, observed on both sides (and in a
    multi-token-prediction check): each time an expert returns, it is the only expert of its
    layer holding tensors, so neither the layer's read nor the prefetch of the next expert has
    bound more; under transformers 5, whose experts are two stacks per layer, each time one
    expert's slice of a stack is read no other slice read before is still held. The gate's
    verdict is the whole model's (:func:`prove_parity`). Returns how many experts ran in each
    kind of module streaming them (the class of the layer or block; ``ExpertStack`` for the
    stacks' reads)."""
    import weakref
    from contextlib import contextmanager

    from porting.parity import modules, mtp, streamed

    seen: dict[str, list[int]] = {}
    real = modules.experts_streamed
    real_item = modules.ExpertStack.__getitem__
    handed: list[weakref.ref] = []

    def item(stack, expert):
        t = real_item(stack, expert)
        handed[:] = [r for r in handed if r() is not None]
        seen.setdefault(modules.ExpertStack.__name__, []).append(1 + len(handed))
        handed.append(weakref.ref(t))
        return t

    @contextmanager
    def observed(layers, load):
        layers = list(layers)
        every = [x for _, layer in layers for _, xs in modules.expert_lists(layer) for x in xs]

        def returned(module, args, output):
            live = sum(any(p.device.type != "meta" for p in x.parameters()) for x in every)
            seen.setdefault(type(layers[0][1]).__name__, []).append(live)

        # registered first, so they run before the stream releases the expert
        handles = [x.register_forward_hook(returned) for x in every]
        try:
            with real(layers, load):
                yield
        finally:
            for h in handles:
                h.remove()

    streamed.experts_streamed = mtp.experts_streamed = observed
    modules.ExpertStack.__getitem__ = item
    try:
        prove_parity(hf_dir, ckpt, prompts)
    finally:
        streamed.experts_streamed = mtp.experts_streamed = real
        modules.ExpertStack.__getitem__ = real_item
    assert len(seen) >= 2, f"experts seen running in {sorted(seen)} only"
    for kind, live in seen.items():
        assert set(live) == {1}, f"{kind}: experts holding tensors when one returned: {live}"
    return {kind: len(live) for kind, live in seen.items()}


def swapped_experts_table(table, layer: int, a: int, b: int, num_layers: int, num_experts: int):
    """``table`` with experts ``a`` and ``b`` of one layer swapped (each written from the other's
    HF tensors): the negative control of a mixture-of-experts mapping."""
    from porting.contract.mapping import EXPERT, LAYER, Fused, Rename

    out = []
    for e in table:
        names = (
            (e.mcore, *((e.hf,) if isinstance(e, Rename) else e.hf))
            if isinstance(e, Rename | Fused)
            else ()
        )
        if not any(EXPERT in n for n in names):
            out.append(e)
            continue
        hf = (e.hf,) if isinstance(e, Rename) else e.hf
        transform = e.transform if isinstance(e, Fused) else None
        for i in range(num_layers):

            def when(c, i=i, e=e) -> bool:  # an entry for some layers only stays for those
                return (e.when is None or e.when(c)) and (e.layers is None or e.layers(c, i))

            for x in range(num_experts):
                src = {a: b, b: a}.get(x, x) if i == layer else x
                keys = tuple(k.replace(LAYER, str(i)).replace(EXPERT, str(src)) for k in hf)
                mcore = e.mcore.replace(LAYER, str(i)).replace(EXPERT, str(x))
                if transform is None:
                    out.append(Rename(keys[0], mcore, when=when))
                else:
                    out.append(Fused(keys, mcore, transform, when=when))
    return tuple(out)


def prove_round_trip(hf_dir: str | Path, ckpt: str | Path, out: str | Path) -> None:
    """Export is exact: tensors, ``config.json``, tokenizer; transformers loads it unchanged."""
    from transformers import AutoTokenizer

    from porting.api import export_hf
    from porting.commands.demo import compare_hf_dirs

    hf_dir, out = Path(hf_dir), Path(out)
    export_hf(ckpt, out, verify=False)
    rt = compare_hf_dirs(hf_dir, out)
    assert rt.same_keys and rt.equal_tensors == rt.tensors > 0, rt
    # the original config.json, key for key, value for value and in its order: the diff, if any
    back, original = (json.loads((d / "config.json").read_text()) for d in (out, hf_dir))
    diff = {
        k: (original.get(k, "<absent>"), back.get(k, "<absent>"))
        for k in original.keys() | back.keys()
        if k not in original or k not in back or original[k] != back[k]
    }
    assert diff == {}, f"config.json changed on export (original, exported): {diff}"
    assert list(back) == list(original), "config.json's keys came back in another order"
    text = "東京 hello world"
    tok_a = AutoTokenizer.from_pretrained(str(hf_dir))
    tok_b = AutoTokenizer.from_pretrained(str(out))
    assert tok_a(text)["input_ids"] == tok_b(text)["input_ids"]
    ids = torch.tensor([tok_b(text)["input_ids"]])
    family, m = checkpoint_family(ckpt)
    cls = family.hf_class(reference_architecture(m))  # no remote code: the family's own class
    with torch.no_grad():
        a = cls.from_pretrained(str(hf_dir)).eval()(ids).logits
        b = cls.from_pretrained(str(out)).eval()(ids).logits
    assert torch.equal(a, b)


def prove_formats(
    hf_dir: str | Path, work: str | Path, formats=("megatron-lm", "megatron-bridge")
) -> None:
    """HF -> each Megatron layout in ``formats`` (gated) -> HF is exact
    (:func:`prove_round_trip`), and the layout is the one its owner reads
    (``latest_checkpointed_iteration.txt``, ``iter_0000000/``, Megatron-Bridge's
    ``run_config.yaml``, our files in ``porting/``)."""
    from porting.api import import_hf
    from porting.convert.checkpoint import locate

    work = Path(work)
    for fmt in formats:
        ckpt = work / fmt
        import_hf(hf_dir, ckpt, fmt=fmt, show_progress=False)
        loc = locate(ckpt)
        # The layout is found by its own files (Bridge's run_config.yaml, which the round trip's
        # export then reads back against the family).
        assert (loc.format, loc.weights.name, loc.prefix) == (fmt, "iter_0000000", "")
        assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "0"
        assert (loc.weights / "common.pt").is_file() and loc.manifest_path.is_file()
        assert not (ckpt / "context").exists() and not (ckpt / "weights").exists()
        prove_round_trip(hf_dir, ckpt, work / f"{fmt}-hf")


def prove_bridge_refused(hf_dir: str | Path, work: str | Path, reasons: list[str]) -> None:
    """A family Megatron-Bridge's ``GPTModelProvider`` cannot describe (a config field it lacks,
    or the family's own ``megatron_bridge_refusal``) is refused in the megatron-bridge layout,
    one of ``reasons`` named, before any tensor is read (the same refusal for the directory
    without its weights), and nothing is written."""
    import shutil

    from porting.api import import_hf
    from porting.errors import PortingError

    bare = Path(work) / "bridge-no-weights"
    shutil.copytree(hf_dir, bare, ignore=shutil.ignore_patterns("*.safetensors*", "*.bin"))
    for source in (hf_dir, bare):
        out = Path(work) / "bridge"
        try:
            import_hf(source, out, fmt="megatron-bridge", show_progress=False)
        except PortingError as err:
            assert any(reason in str(err) for reason in reasons), err
            assert "GPTModelProvider" in str(err)
        else:
            raise AssertionError("the megatron-bridge layout was written")
        assert not out.exists() and not list(Path(work).glob(".bridge.partial-*"))


# Two ranks kept for the life of the process that asked: every TP=2 proof of a test session (each
# family's, and a scaffolded family's) shares one launch, where starting NeMo twice per proof cost
# more than the rest of a family's proof. Each rank reads a request (a JSON line) from its stdin,
# joins a gloo group at TP=2 on the port the request names, builds each checkpoint, and leaves the
# group again: waiting idle inside one, Megatron's ~20 gloo groups poll ~4% of a core per rank.
# Rank 0 saves the gathered logits. A `python -c` child needs no importable test module.
_TP2_SERVER = """
import importlib, json, os, sys, torch
from porting.convert.megatron import init_parallel, mcore_logits, shutdown_parallel
from porting.testing import load_checkpoint_model
rank = int(sys.argv[1])

def resolve(ref):
    module, _, path = ref.partition(":")
    owner, _, attr = path.rpartition(".")
    obj = importlib.import_module(module)
    for part in filter(None, owner.split(".")):
        obj = getattr(obj, part)
    return obj, attr

for line in sys.stdin:
    req = json.loads(line)
    os.environ["MASTER_PORT"] = str(req["port"])
    init_parallel(tp=2, rank=rank, world_size=2)
    saved = []
    for target, source in req["patches"]:
        (obj, attr), (src, src_attr) = resolve(target), resolve(source)
        saved.append((obj, attr, vars(obj).get(attr, saved)))
        setattr(obj, attr, getattr(src, src_attr))
    try:
        ids, logits = torch.load(req["ids"]), {}
        for ckpt in req["ckpts"]:
            model, _ = load_checkpoint_model(ckpt, dtype=torch.float32)
            logits[ckpt] = mcore_logits(model, ids)
            del model
    finally:
        for obj, attr, old in reversed(saved):
            delattr(obj, attr) if old is saved else setattr(obj, attr, old)
    shutdown_parallel()
    if rank == 0:
        torch.save(logits, req["out"])
        print(req["token"], flush=True)
"""


class _PortTaken(AssertionError):
    """The ranks' rendezvous port was taken between choosing it and binding it (another
    process of the suite, on the same machine): the harness's race, not the property."""


class _TP2Ranks:
    """The two ranks of :data:`_TP2_SERVER`, started at the first request, ended at exit."""

    def __init__(self) -> None:
        import atexit
        import tempfile

        self.logs = Path(tempfile.mkdtemp(prefix="porting-tp2-"))
        env = dict(os.environ, MASTER_ADDR="127.0.0.1")
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-c", _TP2_SERVER, str(rank)],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                stderr=open(self.logs / f"rank{rank}.log", "w"),
                text=True,
            )
            for rank in range(2)
        ]
        self.served = 0
        atexit.register(self.close)

    def ask(self, request: dict, timeout: float) -> None:
        """Send ``request``, wait for rank 0 to say it saved the logits; a rank that dies or a
        request past ``timeout`` ends both ranks and fails with their logs."""
        import selectors
        import time

        self.served += 1
        token = f"tp2-done-{os.getpid()}-{self.served}"
        from porting.cpu import free_port

        line = json.dumps(request | {"token": token, "port": free_port()}) + "\n"
        for proc in self.procs:
            proc.stdin.write(line)
            proc.stdin.flush()
        rank0 = self.procs[0]
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(rank0.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if sel.select(timeout=1.0):
                    line = rank0.stdout.readline()
                    if line.strip() == token:
                        return
                    if line:
                        continue  # what a library printed; the answer is its own line
                if any(p.poll() is not None for p in self.procs):
                    break
        for p in self.procs:  # their logs are complete once they are gone
            p.kill()
            p.wait()
        logs = [(self.logs / f"rank{r}.log").read_text()[-3000:] for r in range(2)]
        self.close(kill=True)
        failed = _PortTaken if any("EADDRINUSE" in log for log in logs) else AssertionError
        raise failed(f"the TP=2 ranks failed:\n{logs[0]}\n{logs[1]}")

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def close(self, kill: bool = False) -> None:
        if not kill and self.alive():
            for proc in self.procs:
                try:
                    proc.stdin.close()  # end of input: the rank leaves its loop
                except OSError:
                    pass
            for p in self.procs:
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    pass
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        # the ranks' logs, read above where they failed: nothing of them is left in the temp dir
        shutil.rmtree(self.logs, ignore_errors=True)


_TP2: _TP2Ranks | None = None


def tp2_logits(
    ckpts: list[str | Path],
    ids: torch.Tensor,
    work: str | Path,
    patches: list[tuple[str, str]] = (),
) -> dict[str, torch.Tensor]:
    """Megatron logits (padded vocabulary) of each checkpoint at tensor parallel 2 over gloo.

    ``patches``: ``("module:Class.attr", "module:Other.attr")`` pairs set in both ranks for this
    request only (a negative control that takes a reduction out); restored after it.
    """
    global _TP2

    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    torch.save(ids, work / "ids.pt")
    request = {
        "ids": str(work / "ids.pt"),
        "out": str(work / "tp2.pt"),
        "ckpts": [str(c) for c in ckpts],
        "patches": [list(p) for p in patches],
    }
    for attempt in range(3):  # fresh ranks on a new port where the chosen one was taken
        if _TP2 is None or not _TP2.alive():
            _TP2 = _TP2Ranks()
        try:
            _TP2.ask(request, timeout=600)
            break
        except _PortTaken:
            if attempt == 2:
                raise
    return torch.load(work / "tp2.pt", weights_only=True)


def prove_tp2(ckpts: list[str | Path], work: str | Path, vocab: int = 130) -> None:
    """Each checkpoint's logits at TP=2 equal its TP=1 logits (atol=rtol=1e-5)."""
    from porting.parity import harness

    ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(3))
    tp2 = tp2_logits(ckpts, ids, work)
    for ckpt in ckpts:
        (tp1,) = harness.megatron_logits_from_checkpoint(ckpt, [ids], tp2[str(ckpt)].shape[-1])
        torch.testing.assert_close(tp2[str(ckpt)], tp1, atol=1e-5, rtol=1e-5)


def broken_table(table, pattern: str, layer: int, breaker, num_layers: int):
    """``table`` with the entry whose Megatron name ends in ``pattern`` broken for one layer only.

    ``breaker(transform) -> TransformPair`` turns the entry's own transform into the broken one
    (see :func:`scaled`); the other layers keep theirs. An entry for some layers only (its
    ``layers``) stays for those.
    """
    from porting.contract.mapping import Fused, Rename
    from porting.contract.transforms import IDENTITY

    out = []
    for e in table:
        if isinstance(e, Rename | Fused) and e.mcore.endswith(pattern) and "*" in e.mcore:
            fixed = e.transform if isinstance(e, Fused) else IDENTITY
            for i in range(num_layers):
                hf = (e.hf,) if isinstance(e, Rename) else e.hf
                hf = tuple(k.replace("*", str(i)) for k in hf)
                chosen = breaker(fixed) if i == layer else fixed

                def when(c, i=i, e=e) -> bool:
                    return (e.when is None or e.when(c)) and (e.layers is None or e.layers(c, i))

                out.append(Fused(hf, e.mcore.replace("*", str(i)), chosen, when=when))
        else:
            out.append(e)
    assert tuple(out) != tuple(table), f"no layered entry ends in {pattern!r}"
    return tuple(out)


def import_with_table(hf_dir: str | Path, out: str | Path, family, table) -> Path:
    """Import as ``porting import`` does, with ``table`` in place of the family's weight table."""
    from porting.api import nemo2_import

    broken = dataclasses.replace(family, weights=table)
    nemo2_import(Path(hf_dir).resolve(), Path(out), broken, show_progress=False)
    return Path(out)


def scaled(factor: float = 1.5):
    """A breaker for :func:`broken_table`: the entry's own transform, its output times ``factor``."""
    from porting.contract.transforms import TransformPair

    def breaker(fixed):
        return TransformPair(
            f"{fixed.name}_times_{factor}",
            lambda *args: factor * fixed.forward(*args),
            lambda t, ctx: fixed.inverse(t / factor, ctx),
        )

    return breaker


def prove_fault_named(
    hf_dir: str | Path,
    out: str | Path,
    family,
    layer: int,
    num_layers: int,
    pattern: str = "self_attention.linear_proj.weight",
) -> None:
    """The negative control: one layer's ``pattern`` tensor scaled by 1.5 through the importer
    (see :func:`prove_table_fault_named`)."""
    table = broken_table(family.weights, pattern, layer, scaled(), num_layers)
    prove_table_fault_named(hf_dir, out, family, table, layer)


def prove_table_fault_named(hf_dir: str | Path, out: str | Path, family, table, layer: int) -> None:
    """A checkpoint written through ``table`` (wrong in ``layer`` only) must fail full-logit
    parity by more than 100x the tolerance, and the streamed gate must name ``layer`` first with
    the layers before it exact."""
    from porting.parity import harness

    ckpt = import_with_table(hf_dir, out, family, table)
    hf, mc = logits(hf_dir, ckpt)
    whole = harness.compare(hf, mc)
    assert not whole.passed and whole.max_abs_diff > 100 * ATOL
    report = harness.verify(hf_dir, ckpt)
    assert not report.passed
    assert report.first_divergent_layer == layer, report.summary()
    assert all(d["own_max_rel"] < 1e-5 for d in report.layers[:layer])


# --- what the gate's prompts can see -------------------------------------------------------------


def _nulled(name: str):
    def perturb_config(config) -> dict | None:
        return None if getattr(config, name, None) is None else {name: None}

    return perturb_config


def _doubled(name: str):
    def perturb_config(config) -> dict | None:
        value = getattr(config, name, None)
        if not isinstance(value, int | float) or isinstance(value, bool):
            return None
        return {name: 2 * value}

    return perturb_config


def _rotary(perturb):
    """``perturb`` only where the config's attention is rotary: Falcon's ALiBi layout maps
    ``rope_theta`` and never uses it."""

    def perturb_config(config) -> dict | None:
        return None if getattr(config, "alibi", False) is True else perturb(config)

    return perturb_config


def _window_removed(config) -> dict | None:
    from porting.parity import harness

    if harness.sliding_window_of(config) is None:
        return None
    types = getattr(config, "layer_types", None)
    if isinstance(types, list | tuple):  # Gemma 2 builds its sliding mask whatever the layers
        return {"layer_types": ["full_attention"] * len(types)}
    return {"sliding_window": None}


def _layers_swapped(config) -> dict | None:
    from porting.parity import harness

    types = getattr(config, "layer_types", None)
    if harness.sliding_window_of(config) is None or not isinstance(types, list | tuple):
        return None
    swap = {"full_attention": "sliding_attention", "sliding_attention": "full_attention"}
    return {"layer_types": [swap.get(t, t) for t in types]}


def _other_gelu(name: str):
    from porting.parity.harness import GELU_VARIANTS

    def perturb_config(config) -> dict | None:
        value = getattr(config, name, None)
        if value not in GELU_VARIANTS:
            return None
        other = GELU_VARIANTS[1 - GELU_VARIANTS.index(value)]
        # both spellings where a config has both and they agree (where they disagree, the one
        # the reference class reads is the feature: converters/gemma.py)
        return {
            f: other
            for f in ("hidden_act", "hidden_activation")
            if getattr(config, f, None) == value
        }

    return perturb_config


# HF config field -> perturb(transformers config) -> the changed fields, or None where the config
# does not use the feature. A family's tests may pass more (``features=FEATURES | {...}``).
FEATURES = {
    "sliding_window": _window_removed,
    "layer_types": _layers_swapped,
    "attn_logit_softcapping": _nulled("attn_logit_softcapping"),
    "final_logit_softcapping": _nulled("final_logit_softcapping"),
    "hidden_activation": _other_gelu("hidden_activation"),
    "hidden_act": _other_gelu("hidden_act"),
    "rope_scaling": _rotary(_nulled("rope_scaling")),
    "query_pre_attn_scalar": _doubled("query_pre_attn_scalar"),
    # Granite's scalars on the embeddings, the attention scores, each residual branch, the logits
    "attention_multiplier": _doubled("attention_multiplier"),
    "embedding_multiplier": _doubled("embedding_multiplier"),
    "residual_multiplier": _doubled("residual_multiplier"),
    "logits_scaling": _doubled("logits_scaling"),
    "rope_theta": _rotary(_doubled("rope_theta")),
}


@dataclasses.dataclass
class Sighted:
    """Per mapped feature present in the config: max |d logit| when it is perturbed, split by
    whether that fails the gate's tolerance (observed) or passes it (unobserved)."""

    observed: dict[str, float]
    unobserved: dict[str, float]


def gate_prompts(hf_dir: str | Path) -> list[torch.Tensor]:
    """The gate's prompts for an HF directory (its tokenizer and config), as ``verify`` builds
    them for a checkpoint imported from it."""
    from transformers import AutoTokenizer

    from porting.convert.hf_files import family_for_hf_dir
    from porting.parity import harness

    family, cfg = family_for_hf_dir(hf_dir)
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    config = harness.reference_config(family, cfg)
    return harness.build_prompts(tok, config.vocab_size, config=config)


@torch.no_grad()
def prove_features_observed(
    hf_dir: str | Path, prompts=None, atol: float = ATOL, rtol: float = RTOL, features=None
) -> Sighted:
    """Which of the family's mapped features (:data:`FEATURES`, or ``features``) the gate's
    ``prompts`` (default :func:`gate_prompts`) see: the HF model built with the same weights from
    its own config and from the config with that feature perturbed
    (``from_pretrained(hf_dir, config=perturbed)``), each perturbation compared with
    :func:`porting.parity.harness.compare` at ``atol`` / ``rtol``. A feature whose perturbation
    passes that comparison would pass the gate if a conversion dropped it."""
    from porting.contract.hf_spelling import transformers_config
    from porting.convert.hf_files import family_for_hf_dir
    from porting.parity import harness

    family, cfg = family_for_hf_dir(hf_dir)
    prompts = gate_prompts(hf_dir) if prompts is None else prompts
    cls = family.hf_class(cfg["architectures"][0])
    config = transformers_config(cls, cfg)
    mapped = harness.mapped_fields(family)

    def run(conf) -> list[torch.Tensor]:
        model = cls.from_pretrained(
            str(hf_dir),
            config=conf,
            dtype=torch.float32,
            attn_implementation=family.hf_attn_implementation,
            local_files_only=True,
        ).eval()
        return [model(p).logits.float() for p in prompts]

    # transformers 5's config objects fold rope_theta, rope_scaling and partial_rotary_factor into
    # rope_parameters, so a perturbation set on the object would reach no layer. The perturbers
    # read and change those fields as transformers 4 spells them (the config file in that
    # spelling: ``cfg``), and each perturbed config is built from that spelling, which
    # transformers 4 and 5 both read.
    view = copy.deepcopy(config)
    for key, value in cfg.items():
        if not hasattr(view, key):
            setattr(view, key, copy.deepcopy(value))
    if hasattr(view, "rope_parameters"):
        # and its rope_scaling reads back rope_parameters, where transformers 4's meant "none"
        view.rope_scaling = copy.deepcopy(cfg.get("rope_scaling"))
    base = run(config)
    seen = Sighted({}, {})
    for name, perturb_config in (FEATURES if features is None else features).items():
        changes = perturb_config(view) if name in mapped else None
        if not changes:
            continue
        perturbed = transformers_config(cls, {**cfg, **copy.deepcopy(changes)})
        moved = harness.compare(base, run(perturbed), atol=atol, rtol=rtol)
        (seen.unobserved if moved.passed else seen.observed)[name] = moved.max_abs_diff
    return seen


def prove_features_named(hf_dir: str | Path, ckpt_or_report, features=None):
    """Every mapped feature that the gate's prompts cannot see (:func:`prove_features_observed`,
    at the report's tolerances) is named in the gate's ``unobserved`` list. ``ckpt_or_report``:
    a :class:`~porting.parity.harness.ParityReport`, or a checkpoint imported from ``hf_dir``
    (verified here at this kit's tolerance). Returns ``(sighted, report)``."""
    from porting.parity import harness

    report = ckpt_or_report
    if not isinstance(report, harness.ParityReport):
        report = harness.verify(hf_dir, ckpt_or_report, atol=ATOL, rtol=RTOL)
    seen = prove_features_observed(hf_dir, atol=report.atol, rtol=report.rtol, features=features)
    named = {u["field"] for u in report.unobserved}
    unnamed = sorted(set(seen.unobserved) - named)
    assert not unnamed, (
        f"the gate cannot see {unnamed} (max |d logit| when perturbed: "
        f"{[f'{seen.unobserved[n]:.1e}' for n in unnamed]}) and its report does not say so:\n"
        + report.summary()
    )
    return seen, report


def sharpened(scores: float = 16.0, routers: float = 1.0):
    """An ``edit`` for :func:`make_hf` for a config that scales its attention scores by an
    ``attention_multiplier`` (Granite's 1/128 or 1/64): with a random init's small ``q.k`` that
    leaves a tiny model's attention uniform, where the scale and the rotary base move the logits
    by under 1e-6 and no gate could see them. q and k are scaled until ``multiplier * q.k`` is
    ``scores`` times the usual ``q.k / sqrt(head_dim)`` (largest scores about 4 at the default),
    and a mixture's router weights (``router.layer``) times ``routers``, so that no top-k choice
    is within rounding of a tie."""

    def edit(model) -> None:
        c = model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        gain = scores / (c.attention_multiplier * math.sqrt(head_dim))
        for name, p in model.named_parameters():
            if name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
                p.mul_(gain**0.5)
            elif name.endswith("router.layer.weight"):
                p.mul_(routers)

    return edit


def reach_caps(score: float = 4.0, logit: float = 5.0):
    """An ``edit`` for :func:`make_hf` that makes a tiny model reach published soft-caps (Gemma
    2's 50 and 30), which its random init barely bends (scores up to ~0.2, logits up to ~0.6):
    the q and k projections are scaled so that the largest attention score before the cap is
    about ``score``, then the final norm's scale so that the largest logit before the cap is about
    ``logit`` (the residual stream, and so every layer, unchanged), each measured on 64 random ids.
    For Llama-named attention (``q_proj``, ``k_proj``), transformers' eager attention (where the
    scores meet the cap) and a final ``model.norm``, scaled as ``w`` or, for Gemma's ``(1 + w)``,
    as ``1 + w``.

    At the defaults a tiny Gemma 2 with the published caps moves its logits by ~3e-2 when the
    attention cap is dropped and ~7e-2 for the final cap (3000x and 7000x the kit's 1e-5), and its
    parity stays within 5e-6; scores of ~8 bring parity within 1.5x of the tolerance (larger
    scores amplify fp32 rounding)."""
    from porting.parity.harness import SiteProbe

    def edit(model) -> None:
        config = model.config
        ids = torch.randint(
            0, config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0)
        )
        attn_cap = getattr(config, "attn_logit_softcapping", None)
        if attn_cap:
            probe = SiteProbe()
            built_with = config._attn_implementation
            model.set_attn_implementation("eager")  # where the scores meet the cap
            with probe:
                model(ids)
            model.set_attn_implementation(built_with)
            assert probe.attention_tanh, "no capped attention scores seen"
            gain = score / (attn_cap * probe.attention_tanh)
            for name, p in model.named_parameters():
                if name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
                    p.mul_(gain**0.5)
        top = model(ids).logits.abs().max().item()
        final_cap = getattr(config, "final_logit_softcapping", None)
        if final_cap:
            top = final_cap * math.atanh(top / final_cap)
        norm = model.model.norm
        kept = norm.weight.clone()
        norm.weight.zero_()
        offset = bool(norm(torch.ones(1, kept.shape[0])).abs().max() > 0)  # Gemma's 1 + w
        gain = logit / top
        norm.weight.copy_((1 + kept) * gain - 1 if offset else kept * gain)

    return edit
