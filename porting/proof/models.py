"""The tiny models a family's proof is made on, built locally (no hub): a config's meaningful
tiny fields, a random HF model (or a vision-language container) with its tokenizer, the
variants a test module imports once, the edits that sharpen a tiny model's attention and
routers, and an import refused for a changed config."""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import torch

from porting.contract import registry
from porting.contract.container import renamed, reversed_pairs
from porting.testing import make_tokenizer, perturb, save_as_published

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
