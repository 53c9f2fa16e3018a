"""Checkpoints saved by transformers 5 (its default ``save_pretrained``, on the current stack:
transformers 5.12): each architecture we claim imports through the gate, the imported model's
logits are the ones transformers 5 itself computed for the same tokens, and export writes the same
files back (``config.json`` in 5.x spelling, experts stacked where they came stacked). Runs on
both stacks: the gate's reference is transformers 4.57 on nemo2 (given the config in 4.x
spelling: porting.contract.hf_spelling) and transformers 5 itself on the current one.

Tolerance: the gate's (atol = rtol = 1e-4) on every logit of the vocabulary, fp32.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from porting.parity.harness import DEFAULT_ATOL, DEFAULT_RTOL

VOCAB = 128
_SMALL = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
    intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=256, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 64}  # fmt: skip
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
# name: (transformers 5 config class, its arguments beyond _SMALL, _SMALL's it does not take)
CASES = {
    "LlamaForCausalLM": ("LlamaConfig", {}, ()),
    "LlamaForCausalLM-llama3": ("LlamaConfig", dict(rope_scaling=_LLAMA3, rope_theta=500000.0), ()),
    "MistralForCausalLM": ("MistralConfig", dict(sliding_window=None), ()),
    "Qwen2ForCausalLM-yarn": ("Qwen2Config", dict(rope_scaling=_YARN), ()),
    "Qwen3ForCausalLM": ("Qwen3Config", dict(head_dim=16), ()),
    "MixtralForCausalLM": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2), ()),
    "Qwen2MoeForCausalLM": (
        "Qwen2MoeConfig", dict(num_experts=4, shared_expert_intermediate_size=48, **_MOE), (),
    ),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", dict(num_experts=4, head_dim=16, **_MOE), ()),
    "GemmaForCausalLM": ("GemmaConfig", dict(head_dim=16), ()),
    "Gemma2ForCausalLM": ("Gemma2Config", dict(head_dim=16, sliding_window=32), ()),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", dict(
        head_dim=16, sliding_window=32, sliding_window_pattern=2,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    ), ()),
    "Phi3ForCausalLM": ("Phi3Config", {}, ()),
    "Olmo2ForCausalLM": ("Olmo2Config", {}, ()),
    "NemotronForCausalLM": ("NemotronConfig", dict(head_dim=32, partial_rotary_factor=0.5), ()),
    "SmolLM3ForCausalLM": ("SmolLM3Config", dict(no_rope_layers=[1, 0]), ()),
    # Scout's kind of layers: a dense one, then a mixture (top-1 of 4) without rotary
    "Llama4ForCausalLM": ("Llama4TextConfig", dict(
        intermediate_size=32, intermediate_size_mlp=96, head_dim=16, num_local_experts=4,
        num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layers=[1, 0],
        attention_chunk_size=8, floor_scale=4, rope_scaling=_LLAMA3,
    ), ()),
    "GraniteMoeForCausalLM": ("GraniteMoeConfig", dict(
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        attention_multiplier=0.05, embedding_multiplier=3.0, residual_multiplier=0.5,
    ), ()),
    "GraniteForCausalLM": ("GraniteConfig", dict(
        attention_multiplier=0.05, embedding_multiplier=3.0, residual_multiplier=0.5,
        logits_scaling=2.0,
    ), ()),
    "OlmoeForCausalLM": ("OlmoeConfig", dict(num_experts=4, num_experts_per_tok=2), ()),
    "FalconForCausalLM": ("FalconConfig", dict(
        num_kv_heads=1, new_decoder_architecture=False, multi_query=True, parallel_attn=True,
        bias=False,
    ), ("num_key_value_heads", "intermediate_size")),
    "GptOssForCausalLM": ("GptOssConfig", dict(
        num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=32,
    ), ()),
    # declaring one multi-token-prediction layer and holding none, as every transformers 5.2x
    # save of DeepSeek-V3 does (its config's num_mtp_layers defaults to 1, its model has none)
    "DeepseekV3ForCausalLM": ("DeepseekV3Config", dict(
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        first_k_dense_replace=1, n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_nextn_predict_layers=1,
    ), ()),
    # DeepSeek-V2-Lite's layout: no query latent, greedy softmax routing, YaRN
    "DeepseekV2ForCausalLM": ("DeepseekV2Config", dict(
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2,
        moe_intermediate_size=32, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, topk_method="greedy",
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                      "mscale": 0.707, "mscale_all_dim": 0.707},
    ), ()),
}  # fmt: skip
# the MoE families' experts saved stacked (save_original_format=False), read as published
PACKED = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM",
          "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")  # fmt: skip
CASES |= {f"{name}-packed": CASES[name] for name in PACKED}


def _arguments(name: str, extra: dict, dropped: tuple[str, ...]) -> dict:
    args = {**_SMALL, **extra, "architectures": [name.split("-")[0]]}
    return {k: v for k, v in args.items() if k not in dropped}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """Every case saved by transformers 5, our test tokenizer re-saved by it too
    (``TokenizersBackend``), with the logits it computes beside each."""
    from porting.testing import make_tokenizer, run_owners

    root = tmp_path_factory.mktemp("v5")
    spec = root / "spec.json"
    spec.write_text(json.dumps({n: [c, _arguments(n, *rest)] for n, (c, *rest) in CASES.items()}))
    g = torch.Generator().manual_seed(7)
    tokens = root / "tokens.pt"
    torch.save([torch.randint(0, VOCAB, (n,), generator=g) for n in (13, 40)], tokens)
    make_tokenizer(root / "tokenizer", vocab_size=120)
    run_owners(["-m", "porting.owners.transformers5", "save", str(spec), str(root / "models"),
                "--tokens", str(tokens), "--tokenizer", str(root / "tokenizer")])  # fmt: skip
    return root


def _stored(hf_dir: Path) -> set[str]:
    """The tensor names an HF directory's safetensors files store (not as read)."""
    from safetensors import safe_open

    names = set()
    for shard in Path(hf_dir).glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            names |= set(f.keys())
    return names


@pytest.mark.parametrize("name", list(CASES))
def test_a_transformers_5_save_imports_gives_its_logits_and_exports_as_it_came(
    name, saved, tmp_path
):
    from porting.api import export_hf, import_hf
    from porting.commands.demo import compare_hf_dirs
    from porting.parity.harness import megatron_logits_from_checkpoint

    hf = saved / "models" / name
    written = json.loads((hf / "config.json").read_text())
    assert "rope_parameters" in written or "num_local_experts" in written, written
    tokenizer = json.loads((hf / "tokenizer_config.json").read_text())
    assert tokenizer["tokenizer_class"] == "TokenizersBackend"
    ours = tmp_path / "nemo"
    report = import_hf(hf, ours, show_progress=False)
    assert report.passed
    manifest = json.loads((ours / "context" / "porting.json").read_text())
    assert manifest["hf_config_as_written"] == written
    assert "rope_parameters" not in manifest["hf_config"]

    theirs = torch.load(saved / "models" / f"{name}.logits.pt", weights_only=True)
    tokens = torch.load(saved / "tokens.pt", weights_only=True)
    got = megatron_logits_from_checkpoint(ours, [t.view(1, -1) for t in tokens], VOCAB)
    for a, b in zip(got, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=DEFAULT_ATOL, rtol=DEFAULT_RTOL)

    export_hf(ours, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == written
    # the same tensors under the same stored names as saved: stacked experts stacked again
    back = compare_hf_dirs(hf, tmp_path / "hf")
    assert back.exact, back
    assert _stored(tmp_path / "hf") == _stored(hf)
    if name.endswith("-packed"):
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in _stored(hf))
        # asked for the published form: each expert under its own name, its rows of the stack
        from porting.convert.safetensors_io import SafetensorsSource
        from porting.errors import PortingError

        with pytest.raises(PortingError, match=r"FP8 releases do; add --hf-layout published"):
            export_hf(ours, tmp_path / "fp8", quantize="fp8-block")
        assert not (tmp_path / "fp8").exists()
        export_hf(ours, tmp_path / "published", hf_layout="published", verify=False)
        stacked, back = SafetensorsSource(hf), SafetensorsSource(tmp_path / "published")
        assert _stored(tmp_path / "published") == set(stacked.keys())
        assert all(torch.equal(stacked.get(k), back.get(k)) for k in back.keys())
    # the tokenizer leaves as the installed transformers spells it (4.57: PreTrainedTokenizerFast,
    # which 5.x reads too), and encodes as it came
    from transformers import PreTrainedTokenizerFast

    text = "The quick brown fox. 東京は日本の首都です。"
    ids = [
        PreTrainedTokenizerFast.from_pretrained(str(d))(text).input_ids
        for d in (hf, tmp_path / "hf")
    ]
    assert ids[0] == ids[1]


# The translation itself, one function down: every form transformers 5.12 writes (the configs
# above, as saved), what it refuses, and the way back.

_V4_LLAMA = {"model_type": "llama", "rope_theta": 10000.0, "rope_scaling": None}


def test_an_import_with_its_gate_reads_the_config_once(saved, tmp_path, monkeypatch):
    """The HF directory is opened once (porting.convert.hf_files.HFSource) and handed down:
    the weights reader, the family's checks, the manifest (which keeps transformers 5's spelling
    as written), the tokenizer load and the gate read no config.json of their own."""
    from porting.api import import_hf
    from porting.convert import hf_files, safetensors_io

    read = hf_files.read_json
    opened = []

    def counting(path, model_dir):
        if Path(path).name == "config.json":
            opened.append(Path(path))
        return read(path, model_dir)

    monkeypatch.setattr(hf_files, "read_json", counting)
    monkeypatch.setattr(safetensors_io, "read_json", counting)
    hf = saved / "models" / "Qwen3ForCausalLM"
    assert import_hf(hf, tmp_path / "ckpt", show_progress=False).passed
    assert opened == [hf / "config.json"]
    manifest = json.loads((tmp_path / "ckpt" / "context" / "porting.json").read_text())
    assert manifest["hf_config_as_written"] == json.loads((hf / "config.json").read_text())


def test_a_4x_config_is_read_as_it_is():
    from porting.contract import hf_spelling

    assert not hf_spelling.is_v5(_V4_LLAMA)
    # a model_type of any JSON kind is left for the config rules to refuse
    for odd in ([1], {"a": 1}, None, 3):
        assert hf_spelling.internal(_V4_LLAMA | {"model_type": odd}) == _V4_LLAMA | {
            "model_type": odd
        }
    assert hf_spelling.internal(_V4_LLAMA) == _V4_LLAMA
    assert hf_spelling.as_written(_V4_LLAMA, None) == _V4_LLAMA


@pytest.mark.parametrize(
    "written,internal",
    [
        (  # flat, unscaled: 4.x's explicit null (an absent one is the class's default, which
            # for gpt-oss is YaRN)
            {"rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}},
            {"rope_theta": 1e4, "rope_scaling": None},
        ),
        (  # flat, scaled
            {"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}},
            {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
        ),
        (  # Phi-3: the factor inside; "type" kept, its rope_type twin and the top-level
            # original_max_position_embeddings copy dropped
            {
                "original_max_position_embeddings": 64,
                "rope_parameters": {
                    "partial_rotary_factor": 1.0, "rope_theta": 1e4, "rope_type": "longrope",
                    "type": "longrope", "original_max_position_embeddings": 64,
                    "short_factor": [1.0], "long_factor": [2.0],
                },
            },
            {
                "original_max_position_embeddings": 64, "partial_rotary_factor": 1.0,
                "rope_theta": 1e4,
                "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]},
            },
        ),
        (  # Gemma 3: one object per layer type, with the mixin's two stray defaults beside them
            {
                "layer_types": ["sliding_attention", "full_attention"],
                "rope_parameters": {
                    "full_attention": {"factor": 8.0, "rope_theta": 1e6, "rope_type": "linear"},
                    "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"},
                    "rope_theta": None, "rope_type": "default",
                },
            },
            {
                "layer_types": ["sliding_attention", "full_attention"], "rope_theta": 1e6,
                "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                "rope_local_base_freq": 1e4,
            },
        ),
        (  # the same object for every layer type: one flat setting
            {"rope_parameters": {"full_attention": {"rope_theta": 1e4, "rope_type": "default"},
                                 "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}},
            {"rope_theta": 1e4, "rope_scaling": None},
        ),
        (  # Qwen2-MoE's unused window: 0 in 5.x, null in 4.x (a 0 window stays refused)
            {"rope_parameters": {"rope_theta": 1e4}, "sliding_window": 0,
             "use_sliding_window": False},
            {"rope_theta": 1e4, "rope_scaling": None, "sliding_window": None,
             "use_sliding_window": False},
        ),
        (  # Qwen3-MoE's expert count under its 5.x name
            {"model_type": "qwen3_moe", "num_local_experts": 4},
            {"model_type": "qwen3_moe", "num_experts": 4},
        ),
    ],
)  # fmt: skip
def test_each_5x_form_reads_as_its_4x_twin_and_writes_back_as_it_came(written, internal):
    from porting.contract import hf_spelling

    assert hf_spelling.is_v5(written)
    assert hf_spelling.internal(written) == internal
    assert hf_spelling.as_written(internal, written) == written
    # a change to a key that is not translated is carried into the 5.x form
    assert hf_spelling.as_written({**internal, "vocab_size": 7}, written) == {
        **written,
        "vocab_size": 7,
    }


@pytest.mark.parametrize(
    "written,needle",
    [
        ({"rope_parameters": {"rope_theta": 1e4}, "rope_theta": 1e4},
         "both rope_parameters (transformers 5) and rope_theta (transformers 4) are set"),
        ({"rope_parameters": {"rope_type": "linear"}, "rope_scaling": None},
         "both rope_parameters (transformers 5) and rope_scaling"),
        ({"rope_parameters": [1.0]}, "rope_parameters must be an object"),
        ({"rope_parameters": {"rope_type": "default", "factor": 2.0}},
         "rope_parameters has rope_type 'default' with scaling keys factor"),
        ({"rope_parameters": {"full_attention": {"rope_theta": 1e6},
                              "sliding_attention": {"rope_theta": 1e4, "rope_type": "linear",
                                                    "factor": 2.0}}},
         "rope_parameters.sliding_attention is scaled"),
        ({"rope_parameters": {"full_attention": {"rope_theta": 1e6},
                              "chunked_attention": {"rope_theta": 1e4}}},
         "rope_parameters differ per layer type (chunked_attention, full_attention)"),
        ({"rope_parameters": {"full_attention": {"rope_theta": 1e6}, "rope_theta": 5.0}},
         "rope_parameters mixes per-layer-type objects (full_attention) with rope_theta"),
        ({"model_type": "qwen3_moe", "num_local_experts": 4, "num_experts": 4},
         "both num_local_experts (transformers 5) and num_experts (transformers 4) are set"),
    ],
)  # fmt: skip
def test_a_5x_config_the_4x_form_cannot_hold_is_refused_naming_the_key(written, needle):
    from porting.contract import hf_spelling
    from porting.errors import PortingError

    with pytest.raises(PortingError, match=r"^cfg\.json: ") as err:
        hf_spelling.internal(written, "cfg.json")
    assert needle in str(err.value)


def test_a_changed_rotary_setting_cannot_be_written_back_in_5x_form():
    from porting.contract import hf_spelling
    from porting.errors import PortingError

    written = {"rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}}
    with pytest.raises(PortingError, match="rope_theta is 20000.0 now, 10000.0 when it was"):
        hf_spelling.as_written({"rope_theta": 2e4}, written, "cfg.json")


def test_the_planner_reads_a_5x_config_as_import_does(saved):
    """`porting plan --model DIR` of a transformers 5 save: Qwen3-MoE's experts under their 5.x
    name counted, the same shape as from the config in 4.x spelling."""
    from porting.contract import hf_spelling
    from porting.planner.model import from_hf_config, load_model

    hf = saved / "models" / "Qwen3MoeForCausalLM"
    shape = load_model(hf)
    assert shape.experts == 4 and shape.top_k == 2
    internal = hf_spelling.internal(json.loads((hf / "config.json").read_text()))
    assert shape == from_hf_config(internal, "config.json", hf.name)


def test_a_tokenizers_backend_tokenizer_loads_as_the_fast_tokenizer_it_is_and_says_nothing(saved):
    """transformers 5's ``TokenizersBackend`` (a tokenizer that is its tokenizer.json alone) is
    4.x's ``PreTrainedTokenizerFast``: under 4.x loaded as that (under 5.x as itself), encoding as
    the tokenizer it was saved from, with no warning that the class differs."""
    import logging

    import transformers
    from transformers import AutoTokenizer

    from porting.convert.hf_files import load_tokenizer

    records: list[logging.LogRecord] = []
    keep = logging.Handler(logging.WARNING)
    keep.emit = records.append
    logging.getLogger("transformers").addHandler(keep)
    try:
        tok = load_tokenizer(saved / "models" / "LlamaForCausalLM")
    finally:
        logging.getLogger("transformers").removeHandler(keep)
    assert [r.getMessage() for r in records] == []
    native = hasattr(transformers, "TokenizersBackend")
    assert type(tok).__name__ == ("TokenizersBackend" if native else "PreTrainedTokenizerFast")
    text = "The quick brown fox. 東京は日本の首都です。 0123"
    assert tok(text).input_ids == AutoTokenizer.from_pretrained(saved / "tokenizer")(text).input_ids


def test_stacked_experts_are_planned_per_published_name_and_a_broken_stack_is_refused():
    from porting.convert import packed_experts
    from porting.convert.packed_experts import Slice
    from porting.errors import PortingError

    layer = "model.layers.3."
    shapes = {
        f"{layer}mlp.experts.gate_up_proj": (2, 8, 16),
        f"{layer}mlp.experts.down_proj": (2, 16, 4),
        f"{layer}mlp.gate.weight": (2, 16),
    }
    plan = packed_experts.plan("mixtral", shapes, "ckpt")
    assert plan[f"{layer}block_sparse_moe.experts.1.w3.weight"] == Slice(
        f"{layer}mlp.experts.gate_up_proj", 1, (4, 8)
    )
    assert plan[f"{layer}block_sparse_moe.experts.0.w2.weight"] == Slice(
        f"{layer}mlp.experts.down_proj", 0
    )
    assert plan[f"{layer}block_sparse_moe.gate.weight"] == f"{layer}mlp.gate.weight"
    assert len(plan) == 2 * 3 + 1
    assert packed_experts.plan("gpt_oss", shapes, "ckpt") == {}  # its published form
    assert packed_experts.plan(["mixtral"], shapes, "ckpt") == {}  # the config rules refuse it
    with pytest.raises(
        PortingError, match=r"^ckpt: model.layers.3.mlp.experts.down_proj is missing"
    ):
        packed_experts.plan("qwen3_moe", {f"{layer}mlp.experts.gate_up_proj": (2, 8, 16)}, "ckpt")
    with pytest.raises(PortingError, match=r"are not one layer's experts"):
        packed_experts.plan("olmoe", shapes | {f"{layer}mlp.experts.down_proj": (2, 16, 5)}, "ckpt")
    # a hostile header: a billion empty experts, or a stack of the wrong rank
    empty = {f"{layer}mlp.experts.gate_up_proj": (10**9, 0, 16),
             f"{layer}mlp.experts.down_proj": (10**9, 16, 0)}  # fmt: skip
    with pytest.raises(PortingError, match=r"a stack of 1 to 65536 experts of non-empty"):
        packed_experts.plan("qwen3_moe", empty, "ckpt")
    flat = {
        f"{layer}mlp.experts.gate_up_proj": (8, 16),
        f"{layer}mlp.experts.down_proj": (2, 16, 4),
    }
    with pytest.raises(PortingError, match=r"must each have three dimensions"):
        packed_experts.plan("qwen3_moe", flat, "ckpt")


def test_published_experts_written_stacked_read_back_bit_for_bit(tmp_path):
    """Export's stacked form (--hf-layout stacked): each expert's tensors written at their rows
    of the layer's stacks, which read back (as published names) equal to what was written; the
    files are safetensors' own (loaded by safetensors itself)."""
    from safetensors.torch import load_file

    from porting.convert.packed_experts import stacked_plan
    from porting.convert.safetensors_io import SafetensorsSource, StreamingShardWriter
    from porting.errors import PortingError

    torch.manual_seed(0)
    experts, ffn, hidden, layer = 3, 4, 6, "model.layers.1."
    tensors = {"model.embed_tokens.weight": torch.randn(10, hidden, dtype=torch.bfloat16)}
    for e in range(experts):
        for w, shape in (("w1", (ffn, hidden)), ("w3", (ffn, hidden)), ("w2", (hidden, ffn))):
            name = f"{layer}block_sparse_moe.experts.{e}.{w}.weight"
            tensors[name] = torch.randn(shape, dtype=torch.bfloat16)
    tensors[f"{layer}block_sparse_moe.gate.weight"] = torch.randn(experts, hidden).bfloat16()
    specs = [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    stored, parts = stacked_plan("mixtral", specs, "ckpt")
    assert [k for k, *_ in stored] == [
        "model.embed_tokens.weight",
        f"{layer}mlp.experts.gate_up_proj",
        f"{layer}mlp.experts.down_proj",
        f"{layer}mlp.gate.weight",
    ]
    assert dict((k, s) for k, s, _ in stored)[f"{layer}mlp.experts.gate_up_proj"] == (3, 8, 6)
    assert parts[f"{layer}block_sparse_moe.experts.2.w3.weight"] == (
        f"{layer}mlp.experts.gate_up_proj",
        2 * 8 * 6 + 4 * 6,
    )
    shapes = {k: s for k, s, _ in specs}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    writer = StreamingShardWriter(
        tmp_path, stored, parts={k: (*v, shapes[k]) for k, v in parts.items()}
    )
    for key, tensor in reversed(tensors.items()):  # any order
        writer.write(key, tensor)
    writer.close()
    raw = load_file(tmp_path / "model.safetensors")
    assert torch.equal(raw[f"{layer}mlp.experts.down_proj"][1],
                       tensors[f"{layer}block_sparse_moe.experts.1.w2.weight"])  # fmt: skip
    back = SafetensorsSource(tmp_path)
    assert set(back.keys()) == set(tensors)
    assert all(torch.equal(back.get(k), t) for k, t in tensors.items())

    with pytest.raises(PortingError, match=r"not every one of 3 experts has its gate, up and"):
        stacked_plan("mixtral", [s for s in specs if ".experts.1.w3." not in s[0]], "ckpt")
    with pytest.raises(PortingError, match=r"model_type 'llama' has no stacked expert form"):
        stacked_plan("llama", specs, "ckpt")
    odd = [(k, (ffn + 1, hidden) if ".experts.0.w1." in k else s, d) for k, s, d in specs]
    with pytest.raises(PortingError, match=r"differ in shape or dtype"):
        stacked_plan("mixtral", odd, "ckpt")
