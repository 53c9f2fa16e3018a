"""Our Megatron-LM and Megatron-Bridge checkpoints, loaded by their owners' own code, and theirs
by ours: each on the current stack (.venv: Python 3.12, megatron-core 0.19.2, megatron-bridge
0.6.2; built by scripts/env.sh), through porting/owners/.

Tolerance: the parity gate's (atol = rtol = 1e-4, porting.parity.harness) on every logit of the
HF vocabulary, fp32.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from porting.api import export_hf, import_hf
from porting.convert.foreign import reading
from porting.parity.harness import DEFAULT_ATOL, DEFAULT_RTOL
from porting.testing import run_owners

REPO = Path(__file__).resolve().parents[1]


def _owners(module: str, *args: str) -> str:
    """``python -m porting.owners.MODULE ARGS`` on the current stack (.venv); its output."""
    run = run_owners(["-m", f"porting.owners.{module}", *args])
    return run.stdout + run.stderr


def _tokens(path: Path, vocab: int, lengths: tuple[int, ...] = (13, 5, 32)) -> Path:
    g = torch.Generator().manual_seed(7)
    torch.save([torch.randint(0, vocab, (n,), generator=g) for n in lengths], path)
    return path


@torch.no_grad()
def _hf_logits(hf_dir: Path, tokens: Path) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    return [model(t.view(1, -1)).logits.float() for t in torch.load(tokens)]


def _assert_logits(hf: list[torch.Tensor], owner: Path | list[torch.Tensor]) -> None:
    """``owner``: a loader's logits, or its file (Bridge's: one list per checkpoint loaded)."""
    theirs = torch.load(owner) if isinstance(owner, Path) else owner
    if isinstance(owner, Path) and isinstance(theirs[0], list):
        (theirs,) = theirs
    assert len(theirs) == len(hf)
    for a, b in zip(hf, theirs, strict=True):
        torch.testing.assert_close(b[..., : a.shape[-1]], a, atol=DEFAULT_ATOL, rtol=DEFAULT_RTOL)


@pytest.fixture(scope="module")
def ours(tiny_llama, tmp_path_factory):
    """``tiny_llama`` imported (gated) as Megatron-LM and Megatron-Bridge checkpoints, the token
    ids every test runs and HF's logits of them."""
    root = tmp_path_factory.mktemp("owners")
    out = {}
    for fmt in ("megatron-lm", "megatron-bridge"):
        out[fmt] = root / fmt
        import_hf(tiny_llama, out[fmt], fmt=fmt, show_progress=False)
    out["tokens"] = _tokens(root / "tokens.pt", 130)
    out["hf"] = _hf_logits(tiny_llama, out["tokens"])
    return out


def test_megatron_lm_load_checkpoint_reads_ours(ours, tmp_path):
    """megatron.training.checkpointing.load_checkpoint, the model's shape from our saved args
    (--use-checkpoint-args), logits equal HF's."""
    log = _owners(
        "megatron_lm",
        "load",
        str(ours["megatron-lm"]),
        "--tokens",
        str(ours["tokens"]),
        "--out",
        str(tmp_path / "logits.pt"),
    )
    assert "successfully loaded checkpoint" in log and "at iteration 0" in log
    _assert_logits(ours["hf"], tmp_path / "logits.pt")


def test_megatron_bridge_loader_reads_ours(ours, bridge_run):
    """megatron.bridge.training.model_load_save.load_megatron_model builds the model from our
    run_config.yaml and loads it; logits equal HF's."""
    loaded = f"megatron-bridge loaded {ours['megatron-bridge']}/iter_0000000 as GPTModel"
    assert loaded in bridge_run["log"], bridge_run["log"][-3000:]
    _assert_logits(bridge_run["ours"]["hf"], bridge_run["ours"]["bridge"])


# Families whose Megatron-Bridge checkpoint Bridge's own loader builds: the MoE family from Bridge's
# default spec (no class of ours), OLMo 2 from its own spec function, and those Bridge's
# GPTModelProvider cannot describe (Falcon's block and ALiBi, Gemma's embedding scale and soft-caps,
# Gemma 3's two rotary tables, LongRoPE, llama3/YaRN/linear rotary scaling, DeepSeek's MLA) from
# the family's own provider class (porting.mcore.bridge_provider), once their package's prefix is
# registered with Bridge (porting.owners.bridge), as a user does. All in one loader process (Bridge's start-up is
# most of a load); a case per family.
_ROPE_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
_LONGROPE = {
    "type": "longrope",
    "short_factor": [1.0 + 0.05 * i for i in range(8)],
    "long_factor": [1.0 + 0.9 * i for i in range(8)],
}
_YARN = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 16,
}
_BRIDGE_FAMILIES = {
    "qwen2_moe": ("Qwen2MoeForCausalLM", None, dict(
        intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)),
    "olmo2": ("Olmo2ForCausalLM", None, dict(intermediate_size=96, num_key_value_heads=2)),
    "granite": ("GraniteForCausalLM", "granite", dict(
        intermediate_size=96, num_key_value_heads=2, attention_multiplier=0.05,
        embedding_multiplier=3.0, residual_multiplier=0.5, logits_scaling=2.0)),
    "granitemoe": ("GraniteMoeForCausalLM", "granitemoe", dict(
        intermediate_size=32, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        attention_multiplier=0.05, embedding_multiplier=3.0, residual_multiplier=0.5,
        logits_scaling=2.0)),
    "smollm3": ("SmolLM3ForCausalLM", None, dict(
        intermediate_size=96, num_key_value_heads=2, no_rope_layers=[1, 0],
        use_sliding_window=True, sliding_window=8)),
    "llama4": ("Llama4ForCausalLM", "llama4", dict(
        intermediate_size=32, intermediate_size_mlp=96, num_key_value_heads=2, head_dim=16,
        num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
        no_rope_layers=[1, 0], attention_chunk_size=8, floor_scale=4,
        rope_scaling=_ROPE_LLAMA3)),
    "nemotron": ("NemotronForCausalLM", None, dict(
        intermediate_size=96, num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.5)),
    "olmoe": ("OlmoeForCausalLM", None, dict(
        intermediate_size=32, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)),
    "falcon_40b": ("FalconForCausalLM", "falcon", dict(
        new_decoder_architecture=True, num_kv_heads=2)),
    "falcon_rw_alibi": ("FalconForCausalLM", "falcon", dict(
        alibi=True, parallel_attn=False, multi_query=False, bias=True)),
    "gemma": ("GemmaForCausalLM", "gemma", dict(
        intermediate_size=96, num_key_value_heads=1, head_dim=16)),
    "gemma2": ("Gemma2ForCausalLM", "gemma", dict(
        intermediate_size=96, num_key_value_heads=2, head_dim=16, sliding_window=8)),
    "gemma3": ("Gemma3ForCausalLM", "gemma3", dict(
        intermediate_size=96, num_key_value_heads=2, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"])),
    "phi3_longrope": ("Phi3ForCausalLM", "phi3", dict(
        intermediate_size=96, num_key_value_heads=2, max_position_embeddings=4096,
        original_max_position_embeddings=160, rope_scaling=_LONGROPE)),
    "gpt_oss_yarn": ("GptOssForCausalLM", "gpt_oss", dict(
        intermediate_size=32, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        head_dim=16, sliding_window=8, rope_scaling=_YARN,
        layer_types=["sliding_attention", "full_attention"])),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "deepseek", dict(
        intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=4,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_group=1, topk_group=1)),
    # DeepSeek-V2-Lite's layout, with its YaRN (transformers' V2 softmax scale)
    "deepseek_v2": ("DeepseekV2ForCausalLM", "deepseek-v2", dict(
        intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=4,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1,
        q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        max_position_embeddings=64, rope_scaling={"type": "yarn", "factor": 4.0,
        "original_max_position_embeddings": 16, "mscale": 0.707, "mscale_all_dim": 0.707})),
    "llama_llama3_scaling": ("LlamaForCausalLM", "llama", dict(
        intermediate_size=96, num_key_value_heads=2, rope_scaling=_ROPE_LLAMA3)),
    "mistral_linear_scaling": ("MistralForCausalLM", "mistral", dict(
        intermediate_size=96, num_key_value_heads=2, sliding_window=None,
        rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen2_yarn": ("Qwen2ForCausalLM", "qwen", dict(
        intermediate_size=96, num_key_value_heads=2, rope_scaling=_YARN)),
}  # fmt: skip


# What one owners' interpreter finds in Megatron-Bridge with our shim installed, once it has loaded
# every checkpoint: printed as its last line.
_BRIDGE_FACTS = """
import dataclasses, json, sys
from porting.owners import bridge
bridge.main(sys.argv[1:])
from megatron.bridge.peft import lora_layers
import megatron.core.fp8_utils as fp8
from megatron.core.models.gpt import gpt_layer_specs as specs
facts = {'te_loaded': 'transformer_engine' in sys.modules,
         'have_te': [fp8.HAVE_TE, specs.HAVE_TE],
         'object_is_te_linear': isinstance(object(), lora_layers.te.Linear)}
try:
    lora_layers.te.Linear(1, 1)
except RuntimeError as err:
    facts['te_linear_error'] = str(err)
from megatron.bridge.models.gpt_provider import GPTModelProvider
facts['provider_fields'] = sorted(f.name for f in dataclasses.fields(GPTModelProvider) if f.init)
print(json.dumps(facts))
"""


@pytest.fixture(scope="module")
def bridge_run(ours, tiny_llama, tmp_path_factory) -> dict:
    """Bridge's load_megatron_model over our tiny Llama and each of _BRIDGE_FAMILIES (a tiny HF
    model imported, gated, as megatron-bridge), in one owners' interpreter, which then says what
    it finds in Megatron-Bridge (_BRIDGE_FACTS): Bridge's start-up (about 20 s here) is most of a
    load. Per checkpoint its HF logits, Bridge's and the run_config.yaml targets; the loader's
    log; the facts."""
    import transformers

    from porting.testing import make_tokenizer

    root = tmp_path_factory.mktemp("bridge-families")
    # 200 positions: past LongRoPE's 160 and YaRN's 16 original ones, so the scaled tables count
    tokens = _tokens(root / "tokens.pt", 120, lengths=(13, 200))
    found: dict = {"ours": {"ckpt": ours["megatron-bridge"], "hf": _hf_logits(tiny_llama, tokens)}}
    for variant, (arch, _, extra) in _BRIDGE_FAMILIES.items():
        cls = getattr(transformers, arch)
        hf = root / variant / "hf"
        torch.manual_seed(0)
        config = cls.config_class(
            vocab_size=130, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            pad_token_id=0, **extra,
        )  # fmt: skip
        model = cls(config)
        with torch.no_grad():  # norms and biases off their init, so a dropped one shows
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.1)
        model.save_pretrained(str(hf))
        make_tokenizer(hf, vocab_size=120)
        ckpt = root / variant / "bridge"
        import_hf(hf, ckpt, fmt="megatron-bridge", show_progress=False)
        run_config = (ckpt / "iter_0000000" / "run_config.yaml").read_text()
        targets = {x.split(":", 1)[1].strip() for x in run_config.splitlines() if "_target_:" in x}
        found[variant] = {"ckpt": ckpt, "hf": _hf_logits(hf, tokens), "targets": targets}
    out = root / "logits.pt"
    run = run_owners(["-c", _BRIDGE_FACTS, "load", *(str(v["ckpt"]) for v in found.values()),
                      "--tokens", str(tokens), "--out", str(out)])  # fmt: skip
    log = run.stdout + run.stderr
    assert log.count("megatron-bridge loaded") == len(found), log[-3000:]
    for v, theirs in zip(found.values(), torch.load(out), strict=True):
        v["bridge"] = theirs
    return found | {"log": log, "facts": json.loads(run.stdout.strip().splitlines()[-1])}


@pytest.mark.parametrize("variant", sorted(_BRIDGE_FAMILIES))
def test_megatron_bridge_loader_reads_our_other_families(variant, bridge_run):
    """Imported as megatron-bridge, loaded by Bridge's load_megatron_model from our
    run_config.yaml (Bridge's own provider, or the family's where Bridge's cannot describe the
    model): its logits equal HF's."""
    got = bridge_run[variant]
    family = _BRIDGE_FAMILIES[variant][1]
    provider = [t for t in got["targets"] if t.endswith("Provider")]
    if family is None:  # Bridge's own provider and, for the MoE family, Bridge's own spec
        assert provider == ["megatron.bridge.models.gpt_provider.GPTModelProvider"], provider
        if variant == "qwen2_moe":
            assert all(t.startswith(("megatron.", "torch.")) for t in got["targets"])
    else:
        module = f"models.{family.replace('-', '_')}_bridge."
        assert len(provider) == 1 and provider[0].startswith(module), provider
    _assert_logits(got["hf"], got["bridge"])


def test_bridge_trains_from_ours_and_the_result_exports_through_the_gate(
    ours, tiny_llama, tmp_path
):
    """Three steps of Bridge's own pretrain loop from our weights; its checkpoint (no porting/,
    Bridge's own run_config.yaml and common state) exports, gated, to an HF model whose logits
    are Bridge's."""
    trained = tmp_path / "trained"
    log = _owners(
        "bridge", "train", str(ours["megatron-bridge"]), "--steps", "3", "--save", str(trained)
    )
    assert "successfully loaded checkpoint" in log
    losses = [
        float(x.split("lm loss:")[1].split("|")[0]) for x in log.splitlines() if "lm loss:" in x
    ]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert (trained / "iter_0000003" / "run_config.yaml").is_file()
    _owners(
        "bridge",
        "load",
        str(trained),
        "--tokens",
        str(ours["tokens"]),
        "--out",
        str(tmp_path / "b.pt"),
    )
    with reading(trained, hf_config=tiny_llama):
        export_hf(trained, tmp_path / "hf")  # gated
    hf = _hf_logits(tmp_path / "hf", ours["tokens"])
    _assert_logits(hf, tmp_path / "b.pt")
    # trained: not the weights we started from
    assert not torch.allclose(hf[0], ours["hf"][0], atol=1e-3)


def test_a_megatron_lm_checkpoint_we_did_not_write_exports_through_the_gate(tmp_path):
    """Megatron-LM's own save_checkpoint (common state inside the torch_dist files, as 0.19
    writes it) -> porting export --hf-config -> transformers gives Megatron-LM's logits."""
    tokens = _tokens(tmp_path / "tokens.pt", 128)
    ckpt = tmp_path / "mlm"
    _owners(
        "megatron_lm", "save", str(ckpt), "--tokens", str(tokens), "--out", str(tmp_path / "m.pt")
    )
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert not (ckpt / "iter_0000001" / "common.pt").exists()
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    # The HF facts of the model porting.owners.megatron_lm.SAVE_ARGS describes.
    (cfg / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 96,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "vocab_size": 128,
                "max_position_embeddings": 32,
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "tie_word_embeddings": False,
                "hidden_act": "silu",
                "attention_bias": False,
                "mlp_bias": False,
                "torch_dtype": "float32",
            }
        )
    )
    with reading(ckpt, hf_config=cfg):
        export_hf(ckpt, tmp_path / "hf")  # gated
    _assert_logits(_hf_logits(tmp_path / "hf", tokens), tmp_path / "m.pt")


def test_transformer_engine_stays_absent_for_megatron_core(bridge_run):
    """The shim serves Bridge's one unguarded import and nothing else (porting.owners.shims),
    after Bridge has loaded every checkpoint of bridge_run."""
    bridge_facts = bridge_run["facts"]
    assert bridge_facts["te_loaded"] is False
    assert bridge_facts["have_te"] == [False, False]
    assert bridge_facts["object_is_te_linear"] is False
    assert "Transformer Engine is not installed" in bridge_facts["te_linear_error"]


def test_our_provider_field_list_is_bridges(bridge_run):
    """porting/convert/bridge_fields.json is GPTModelProvider's init fields."""
    bridge_facts = bridge_run["facts"]
    ours = json.loads((REPO / "porting" / "convert" / "bridge_fields.json").read_text())
    assert bridge_facts["provider_fields"] == ours
