"""Falcon-style family: full-logit parity against transformers' FalconForCausalLM for every variant,
exact round trip, NeMo's API, tensor parallelism, the negative control and Falcon's bad inputs.

Tolerance: fp32 throughout, torch.testing.assert_close(atol=1e-5, rtol=1e-5) on every logit of
every position of every prompt (four prompts, 1 to 64 tokens), plus 100% top-1 agreement. The HF
side runs transformers' default attention for Falcon (sdpa): its eager path adds ALiBi twice
(pinned by test_transformers_eager_alibi_adds_the_bias_twice).
"""

from __future__ import annotations

import pytest
import torch

from converters import falcon
from models.falcon import (
    AlibiDotProductAttention,
    FalconBlock,
    FalconParallelLayer,
    alibi_bias,
    alibi_slopes,
    build_falcon_layer_spec,
)
from porting import proof
from porting.api import import_hf
from porting.commands.demo import compare_hf_dirs
from porting.parity import harness as parity
from porting.proof import (
    prove_formats,
    prove_round_trip,
    refused_import,
)
from porting.proof import tp2_logits as tp2_logits_of
from porting.testing import FALCON_VARIANTS, assert_streamed_agrees, make_falcon

ATOL = RTOL = 1e-5
HF_VOCAB = 130

# Tiny stand-ins for the released layouts (their config.json fields, not their sizes).
VARIANTS = FALCON_VARIANTS
TP2_VARIANTS = ["40b_gqa_two_norms", "11b_gqa_one_norm_untied", "rw_alibi_biases"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(variant) -> (hf_dir, nemo_ckpt)``, each built and imported once per module."""
    cache: dict[str, tuple] = {}

    def get(variant: str):
        if variant not in cache:
            root = tmp_path_factory.mktemp(variant)
            hf_dir = make_falcon(root / "hf", seed=len(variant), **VARIANTS[variant])
            import_hf(hf_dir, root / "nemo", verify=False, show_progress=False)
            cache[variant] = (hf_dir, root / "nemo")
        return cache[variant]

    return get


def _prompts(ckpt):
    from transformers import AutoTokenizer

    from porting.convert.checkpoint import read_manifest

    m = read_manifest(ckpt)
    tok = AutoTokenizer.from_pretrained(str(ckpt / m.tokenizer["path"]))
    return parity.build_prompts(tok, m.vocab_size)


def _hf_logits(hf_dir, prompts):
    return parity.hf_logits(hf_dir, "FalconForCausalLM", prompts, "sdpa")


def _assert_parity(hf, mc):
    assert len(hf) == len(mc) >= 4
    assert len({t.shape[1] for t in hf}) >= 3  # prompts of several lengths
    for a, b in zip(hf, mc, strict=True):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=RTOL)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_against_transformers_falcon(variant, converted):
    hf_dir, ckpt = converted(variant)
    prompts = _prompts(ckpt)
    mc = parity.megatron_logits_from_checkpoint(ckpt, prompts, HF_VOCAB)
    hf = _hf_logits(hf_dir, prompts)
    _assert_parity(hf, mc)
    report = parity.compare(hf, mc)
    assert report.passed and report.top1_agreement == 1.0
    assert_streamed_agrees(hf_dir, ckpt, falcon.FAMILY, prompts, hf, mc)


def test_the_variants_build_the_blocks_they_claim(converted):
    """Each variant's Megatron model has the layer class, norms and attention of its layout."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from porting.convert.megatron import init_parallel
    from porting.testing import load_checkpoint_model

    init_parallel()
    expected = {
        "7b_mqa": (FalconParallelLayer, True, False, 1, True),
        "40b_gqa_two_norms": (FalconParallelLayer, False, False, 2, True),
        "11b_gqa_one_norm_untied": (FalconParallelLayer, True, False, 2, False),
        "rw_alibi_biases": (TransformerLayer, False, True, 6, True),
        "alibi_parallel_mqa": (FalconParallelLayer, True, True, 1, True),
    }
    for variant, (cls, shared, alibi, groups, tied) in expected.items():
        model, config = load_checkpoint_model(converted(variant)[1])
        layer = model.decoder.layers[0]
        assert type(layer) is cls, variant
        assert isinstance(layer.pre_mlp_layernorm, IdentityOp) == shared, variant
        core = layer.self_attention.core_attention
        assert isinstance(core, AlibiDotProductAttention) == alibi, variant
        assert model.position_embedding_type == ("none" if alibi else "rope"), variant
        assert config.num_query_groups == groups, variant
        assert model.share_embeddings_and_output_weights == tied, variant


@pytest.mark.nemo2  # NeMo's own API
def test_parallel_layer_keeps_megatron_parameter_names():
    """The custom layer adds no parameters and renames none: its keys are the stock layer's."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from models.falcon import FalconConfig
    from porting.convert.megatron import init_parallel

    init_parallel()
    config = FalconConfig(
        num_layers=1,
        hidden_size=64,
        ffn_hidden_size=96,
        num_attention_heads=4,
        num_query_groups=2,
        new_decoder_architecture=True,
    )
    stock = build_module(get_gpt_layer_local_spec(), config=config, layer_number=1)
    ours = build_module(
        build_falcon_layer_spec(FalconBlock.PARALLEL_TWO_NORMS, alibi=False, use_te=False),
        config=config,
        layer_number=1,
    )
    assert isinstance(ours, FalconParallelLayer)

    def shapes(layer):
        return {k: getattr(v, "shape", None) for k, v in layer.state_dict().items()}

    assert shapes(ours) == shapes(stock)
    assert any(k.startswith("pre_mlp_layernorm.") for k in shapes(ours))


def test_negative_control_parallel_layer_run_sequentially_fails_parity(converted):
    """The 40B checkpoint through the stock sequential layer (same weights, same keys) must fail."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from porting.convert.megatron import (
        build_mcore_model,
        init_parallel,
        load_weights,
        mcore_logits,
    )
    from porting.testing import checkpoint_config

    hf_dir, ckpt = converted("40b_gqa_two_norms")
    init_parallel()
    config = checkpoint_config(ckpt)
    config.transformer_layer_spec = build_falcon_layer_spec(
        FalconBlock.SEQUENTIAL, alibi=False, use_te=False
    )
    model = build_mcore_model(config)
    load_weights(model, ckpt)
    assert all(type(layer) is TransformerLayer for layer in model.decoder.layers)
    prompts = _prompts(ckpt)
    mc = [mcore_logits(model.float(), p)[..., :HF_VOCAB] for p in prompts]
    hf = _hf_logits(hf_dir, prompts)
    with pytest.raises(AssertionError):
        _assert_parity(hf, mc)
    report = parity.compare(hf, mc)
    assert not report.passed and report.max_abs_diff > 1e-2


@pytest.mark.parametrize("num_heads", [1, 4, 6, 12, 71])
def test_alibi_bias_equals_transformers_bitwise(num_heads):
    """Slopes, bf16 rounding and key positions as transformers' build_alibi_tensor, exactly."""
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor

    keys = 300
    ref = build_alibi_tensor(torch.ones(1, keys, dtype=torch.long), num_heads, torch.float32)
    ours = alibi_bias(alibi_slopes(num_heads), keys, torch.device("cpu"))
    assert ours.shape == (num_heads, 1, keys)
    assert torch.equal(ours, ref)


def test_transformers_eager_alibi_adds_the_bias_twice(converted):
    """Why parity runs transformers' sdpa path for Falcon: in transformers 4.57 the eager path adds
    ALiBi to the scores and again through the causal mask (FalconModel._update_causal_mask), so it
    disagrees with sdpa, with the original RW code and with us; twice our bias matches it."""
    import models.falcon_spec as mf
    from porting.convert.megatron import init_parallel, mcore_logits
    from porting.testing import load_checkpoint_model

    hf_dir, ckpt = converted("rw_alibi_biases")
    ids = torch.randint(0, HF_VOCAB, (1, 48), generator=torch.Generator().manual_seed(5))
    (eager,) = parity.hf_logits(hf_dir, "FalconForCausalLM", [ids], "eager")
    (sdpa,) = parity.hf_logits(hf_dir, "FalconForCausalLM", [ids], "sdpa")
    init_parallel()
    model, _ = load_checkpoint_model(ckpt, dtype=torch.float32)
    ours = mcore_logits(model, ids)[..., :HF_VOCAB]
    assert (eager - sdpa).abs().max() > 1e-3
    torch.testing.assert_close(ours, sdpa, atol=ATOL, rtol=RTOL)
    once = mf.alibi_bias
    try:
        mf.alibi_bias = lambda slopes, n, device: 2 * once(slopes, n, device)
        doubled = mcore_logits(model, ids)[..., :HF_VOCAB]
    finally:
        mf.alibi_bias = once
    torch.testing.assert_close(doubled, eager, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_round_trip_is_exact_and_loads_in_transformers(variant, converted, tmp_path):
    """Tensors bit for bit, config.json and tokenizer equal, transformers' Falcon (no remote
    code) loads the export to identical logits (porting.proof.prove_round_trip)."""
    prove_round_trip(*converted(variant), tmp_path / "hf-back")


@pytest.mark.parametrize("variant", ["rw_alibi_biases", "40b_gqa_two_norms"])
def test_every_layout_round_trips_exactly(variant, converted, tmp_path):
    """Through the Megatron-LM and Megatron-Bridge layouts too (porting.proof.prove_formats); the
    Bridge layout names the family's own provider (models.falcon_bridge), which Bridge's loader
    builds: tests/test_owners.py."""
    prove_formats(converted(variant)[0], tmp_path)
    run_config = (tmp_path / "megatron-bridge" / "iter_0000000" / "run_config.yaml").read_text()
    assert "_target_: models.falcon_bridge.FalconModelProvider\n" in run_config
    assert ("alibi: true" in run_config) is (variant == "rw_alibi_biases")


@pytest.mark.nemo2  # NeMo's own API
def test_nemo_api_import_and_export(converted, tmp_path):
    """llm.import_ckpt / llm.export_ckpt find our connectors through FalconModel."""
    from nemo.collections import llm
    from nemo.lightning import io

    from models.falcon_nemo import FalconConfig
    from porting.convert.connectors import model_class

    FalconModel = model_class(falcon.FAMILY)  # its connectors registered, as the engine does
    hf_dir, _ = converted("11b_gqa_one_norm_untied")
    out = tmp_path / "via-llm"
    path = llm.import_ckpt(
        model=FalconModel(FalconConfig()), source=f"hf://{hf_dir}", output_path=out
    )
    assert path == out and (out / "weights").is_dir()
    model = io.load_context(out / "context", subpath="model")
    assert isinstance(model, FalconModel)
    assert model.config.block == FalconBlock.PARALLEL_SHARED_NORM
    assert model.config.num_query_groups == 2 and model.config.rotary_base == 500042.0
    exported = llm.export_ckpt(path=out, target="hf", output_path=tmp_path / "via-llm-hf")
    assert compare_hf_dirs(hf_dir, exported).exact


@pytest.fixture(scope="module")
def tp2_logits(converted, tmp_path_factory):
    """``(ids, {variant: logits at TP=2})`` from two gloo ranks over every TP2 variant."""
    ids = torch.randint(0, HF_VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    ckpts = [str(converted(v)[1]) for v in TP2_VARIANTS]
    logits = tp2_logits_of(ckpts, ids, tmp_path_factory.mktemp("tp2"))
    return ids, {v: logits[c] for v, c in zip(TP2_VARIANTS, ckpts, strict=True)}


@pytest.mark.parametrize("variant", TP2_VARIANTS)
def test_tensor_parallel_2_matches_tp_1(variant, converted, tp2_logits):
    ids, tp2 = tp2_logits
    (tp1,) = parity.megatron_logits_from_checkpoint(converted(variant)[1], [ids], 256)
    assert tp2[variant].shape == (2, 24, 256)
    torch.testing.assert_close(tp2[variant], tp1, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def falcon_hf(tmp_path_factory):
    """A tiny 40B-layout model whose config the bad-input tests damage (on copies)."""
    return make_falcon(tmp_path_factory.mktemp("bad") / "hf", **VARIANTS["40b_gqa_two_norms"])


@pytest.mark.parametrize(
    "changes,needles",
    [
        ({"num_kv_heads": 3}, ["num_kv_heads=3", "does not divide", "num_attention_heads=4"]),
        (
            {
                "new_decoder_architecture": False,
                "multi_query": False,
                "num_kv_heads": 2,
                "num_ln_in_parallel_attn": None,
            },
            ["num_kv_heads=2", "multi_query=False", "one KV head per query head"],
        ),
        ({"parallel_attn": False}, ["parallel_attn=False", "new_decoder_architecture=True"]),
        (
            {"new_decoder_architecture": False, "num_ln_in_parallel_attn": 2},
            ["num_ln_in_parallel_attn=2", "new_decoder_architecture=True"],
        ),
        ({"num_ln_in_parallel_attn": 3}, ["num_ln_in_parallel_attn=3"]),
        ({"activation": "relu"}, ["activation='relu'", "GELU"]),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, ["rope_scaling", "rotary"]),
        ({"hidden_dropout": 0.1}, ["hidden_dropout=0.1"]),
        ({"apply_residual_connection_post_layernorm": True}, ["apply_residual_connection"]),
        ({"hidden_size": 66}, ["hidden_size=66", "num_attention_heads=4"]),
        ({"n_embed": 64}, ["unsupported field", "n_embed"]),
    ],
    ids=[
        "kv_not_dividing",
        "mha_with_fewer_kv_heads",
        "new_arch_sequential",
        "two_norms_classic",
        "three_norms",
        "relu",
        "rope_scaling",
        "dropout",
        "post_layernorm_residual",
        "head_dim_not_integral",
        "unknown_field",
    ],
)
def test_config_lint_names_the_field(falcon_hf, tmp_path, changes, needles):
    err = refused_import(falcon_hf, changes, tmp_path)
    for needle in needles:
        assert needle in err, err


def test_falcon_configs_are_chosen_by_fields_not_names():
    """The table's norm entries follow the block; the same table serves every variant."""
    from porting.contract.mapping import expand

    def ctx(block):
        return falcon.FalconShapeContext(
            num_layers=1,
            hidden_size=64,
            num_heads=4,
            num_query_groups=2,
            head_dim=16,
            vocab_size=130,
            padded_vocab_size=256,
            tied_output=True,
            block=block,
        )

    norms = {}
    for block in FalconBlock:
        entries, _ = expand(falcon.WEIGHTS, ctx(block), 1)
        norms[block] = sorted(c.hf[0] for c in entries if "norm" in c.mcore and ".h." in c.hf[0])
    assert norms[FalconBlock.SEQUENTIAL] == [
        "transformer.h.0.input_layernorm.bias",
        "transformer.h.0.input_layernorm.weight",
        "transformer.h.0.post_attention_layernorm.bias",
        "transformer.h.0.post_attention_layernorm.weight",
    ]
    assert norms[FalconBlock.PARALLEL_SHARED_NORM] == [
        "transformer.h.0.input_layernorm.bias",
        "transformer.h.0.input_layernorm.weight",
    ]
    assert norms[FalconBlock.PARALLEL_TWO_NORMS] == [
        "transformer.h.0.ln_attn.bias",
        "transformer.h.0.ln_attn.weight",
        "transformer.h.0.ln_mlp.bias",
        "transformer.h.0.ln_mlp.weight",
    ]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_mapped_feature_is_seen_or_named(variant, converted):
    """Each mapped feature (rope_theta, a window, ...), perturbed on the HF side alone, moves the
    gate's logits past its tolerance, or the gate's report names it."""
    _, report = proof.prove_features_named(*converted(variant)[:2])
    assert report.passed
