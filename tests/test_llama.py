"""The Llama family: full-logit parity against transformers' Llama, round trip, NeMo loading,
tensor parallelism and the negative control.

Tolerance: fp32 throughout, torch.testing.assert_close(atol=1e-5, rtol=1e-5) on every logit of
every position of every prompt, plus 100% top-1 agreement.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from converters import llama
from porting.api import ParityError, export_hf, import_hf
from porting.commands.demo import compare_hf_dirs
from porting.parity import harness as parity
from porting.testing import assert_streamed_agrees, make_llama

ATOL = RTOL = 1e-5

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # small enough that the tiny head dim's wavelengths straddle both thresholds
    "original_max_position_embeddings": 32,
}

VARIANTS = {
    "mha": dict(num_kv_heads=4),
    "gqa": dict(num_kv_heads=2),
    "mqa": dict(num_kv_heads=1),
    "tied": dict(tie_word_embeddings=True),
    "no_padding_needed": dict(vocab_size=128),
    "rope_theta": dict(rope_theta=500000.0),
    "llama3_scaling": dict(rope_scaling=LLAMA3_SCALING),
    "linear_scaling": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "biases": dict(bias=True),
    "head_dim_32": dict(head_dim=32),
    "bf16": dict(dtype=torch.bfloat16),
}


def _prompts(ckpt):
    from transformers import AutoTokenizer

    from porting.convert.checkpoint import read_manifest

    m = read_manifest(ckpt)
    tok = AutoTokenizer.from_pretrained(str(ckpt / m.tokenizer["path"]))
    return parity.build_prompts(tok, m.vocab_size)


def _logits(hf_dir, ckpt):
    from porting.convert.checkpoint import read_manifest

    m = read_manifest(ckpt)
    prompts = _prompts(ckpt)
    mc = parity.megatron_logits_from_checkpoint(ckpt, prompts, m.vocab_size)
    hf = parity.hf_logits(hf_dir, "LlamaForCausalLM", prompts)
    return hf, mc


def _assert_parity(hf, mc):
    assert len(hf) == len(mc) >= 4
    for a, b in zip(hf, mc, strict=True):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=RTOL)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_against_transformers_llama(variant, tmp_path):
    hf_dir = make_llama(tmp_path / "hf", seed=len(variant), **VARIANTS[variant])
    ckpt = tmp_path / "nemo"
    import_hf(hf_dir, ckpt, verify=False, show_progress=False)
    hf, mc = _logits(hf_dir, ckpt)
    _assert_parity(hf, mc)
    assert parity.compare(hf, mc).passed
    assert_streamed_agrees(hf_dir, ckpt, llama.FAMILY, _prompts(ckpt), hf, mc)


def _qkv_rows(ctx) -> list[int]:
    kv = ctx.num_query_groups * ctx.head_dim
    return [ctx.num_heads * ctx.head_dim, kv, kv]


@pytest.mark.nemo2  # NeMo's own API
def test_negative_control_plain_qkv_concat_fails_parity(tmp_path):
    """The same check with QKV concatenated instead of interleaved per group must fail."""
    from converters import llama
    from porting.contract.mapping import Fused
    from porting.contract.transforms import TransformPair

    concat = TransformPair(
        "plain_concat",
        lambda q, k, v, ctx: torch.cat([q, k, v]),
        lambda t, ctx: tuple(t.split(_qkv_rows(ctx))),
    )
    broken = tuple(
        dataclasses.replace(e, transform=concat)
        if isinstance(e, Fused) and e.mcore.endswith("linear_qkv.weight")
        else e
        for e in llama.WEIGHTS
    )
    assert broken != llama.WEIGHTS

    from porting.convert.connectors import register_connectors

    class BrokenImporter(register_connectors(llama.FAMILY)[0]):
        FAMILY = dataclasses.replace(llama.FAMILY, weights=broken)

    hf_dir = make_llama(tmp_path / "hf", num_kv_heads=2)
    importer = BrokenImporter(str(hf_dir))
    importer.show_progress = False
    importer.convert_into(tmp_path / "nemo")
    hf, mc = _logits(hf_dir, tmp_path / "nemo")
    with pytest.raises(AssertionError):
        _assert_parity(hf, mc)
    report = parity.compare(hf, mc)
    assert not report.passed and report.max_abs_diff > 1e-2


def test_import_gate_refuses_failing_parity_and_leaves_nothing(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setattr(parity, "DEFAULT_ATOL", 0.0)
    monkeypatch.setattr(parity, "DEFAULT_RTOL", 0.0)
    monkeypatch.setattr(parity, "DEFAULT_MIN_TOP1", 1.0)
    out = tmp_path / "ckpt"
    # an impossible gate: zero tolerance while Megatron's fused QKV matmul rounds differently
    with pytest.raises(ParityError, match="parity check failed"):
        import_hf(tiny_llama, out, atol=-1.0, rtol=0.0, show_progress=False)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt")]


def test_round_trip_is_exact_and_loads_in_transformers(tiny_llama, tiny_nemo, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf-back"
    report = export_hf(tiny_nemo, out)
    assert report.passed
    rt = compare_hf_dirs(tiny_llama, out)
    assert rt.same_keys and rt.equal_tensors == rt.tensors == 21
    assert rt.config_fields_differing == []
    a = json.loads((tiny_llama / "config.json").read_text())
    b = json.loads((out / "config.json").read_text())
    for field in (
        "bos_token_id",
        "eos_token_id",
        "max_position_embeddings",
        "rope_theta",
        "vocab_size",
    ):
        assert a[field] == b[field]
    tok_a = AutoTokenizer.from_pretrained(str(tiny_llama))
    tok_b = AutoTokenizer.from_pretrained(str(out))
    text = "東京 hello world"
    assert tok_a(text)["input_ids"] == tok_b(text)["input_ids"]
    ids = torch.tensor([tok_b(text)["input_ids"]])
    m_a = AutoModelForCausalLM.from_pretrained(str(tiny_llama)).eval()
    m_b = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        assert torch.equal(m_a(ids).logits, m_b(ids).logits)


def test_round_trip_keeps_rope_scaling_and_sharding(tmp_path):
    hf_dir = make_llama(
        tmp_path / "hf", rope_scaling=LLAMA3_SCALING, bias=True, max_shard_size="20KB"
    )
    assert (hf_dir / "model.safetensors.index.json").exists()
    import_hf(hf_dir, tmp_path / "nemo", verify=False, show_progress=False)
    export_hf(tmp_path / "nemo", tmp_path / "back", max_shard_bytes=20_000)
    assert (tmp_path / "back" / "model.safetensors.index.json").exists()
    rt = compare_hf_dirs(hf_dir, tmp_path / "back")
    assert rt.exact, rt
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["rope_scaling"] == LLAMA3_SCALING


@pytest.mark.nemo2  # NeMo's own API
def test_llm_import_ckpt_then_nemo_loads_it_back(tiny_llama, tmp_path):
    """The NeMo 2.0 API path: llm.import_ckpt, then NeMo's own load_context + nemo_load."""
    from nemo.collections import llm
    from nemo.lightning import io

    from porting.convert.connectors import model_class

    out = tmp_path / "via-llm"
    llama_model = model_class(llama.FAMILY)  # its connectors registered, as the engine does
    path = llm.import_ckpt(model=llama_model(), source=f"hf://{tiny_llama}", output_path=out)
    assert path == out and (out / "weights").is_dir()
    model = io.load_context(out / "context", subpath="model")
    assert isinstance(model, llama_model)
    assert model.config.num_query_groups == 2 and model.config.vocab_size == 256

    loaded, trainer = io.ModelConnector().nemo_load(out, cpu=True)
    mcore = loaded.module
    while hasattr(mcore, "module"):
        mcore = mcore.module
    from porting.convert.megatron import mcore_logits

    tok = loaded.tokenizer
    ids = torch.tensor([tok.text_to_ids("hello world") or [1, 2, 3]])
    mc = mcore_logits(mcore.float(), ids)[..., :130]
    (hf,) = parity.hf_logits(tiny_llama, "LlamaForCausalLM", [ids])
    torch.testing.assert_close(mc, hf, atol=ATOL, rtol=RTOL)
    from nemo.lightning import teardown

    teardown(trainer, loaded)

    exported = llm.export_ckpt(path=out, target="hf", output_path=tmp_path / "via-llm-hf")
    assert compare_hf_dirs(tiny_llama, exported).exact


def test_tensor_parallel_2_matches_tp_1(tiny_nemo, tmp_path):
    from porting.proof import tp2_logits

    ids = torch.randint(0, 130, (2, 24), generator=torch.Generator().manual_seed(3))
    (tp1,) = parity.megatron_logits_from_checkpoint(tiny_nemo, [ids], 256)
    tp2 = tp2_logits([tiny_nemo], ids, tmp_path)[str(tiny_nemo)]
    assert tp2.shape == (2, 24, 256)
    torch.testing.assert_close(tp2, tp1, atol=1e-5, rtol=1e-5)


def test_a_failed_tp2_request_is_named_and_the_next_one_gets_fresh_ranks(tiny_nemo, tmp_path):
    """The TP=2 ranks a worker keeps (porting.proof.tp2_logits): a request that fails in them
    fails its test with their log, and the next proof is not left with dead ranks."""
    from porting.proof import tp2_logits

    ids = torch.randint(0, 130, (2, 24), generator=torch.Generator().manual_seed(3))
    with pytest.raises(AssertionError, match="the TP=2 ranks failed(.|\n)*no-such-checkpoint"):
        tp2_logits([tmp_path / "no-such-checkpoint"], ids, tmp_path / "bad")
    (tp1,) = parity.megatron_logits_from_checkpoint(tiny_nemo, [ids], 256)
    tp2 = tp2_logits([tiny_nemo], ids, tmp_path / "good")[str(tiny_nemo)]
    torch.testing.assert_close(tp2, tp1, atol=1e-5, rtol=1e-5)


def test_a_tp2_request_whose_port_was_taken_runs_again_on_fresh_ranks(tmp_path, monkeypatch):
    """The ranks' rendezvous port can be taken by another process between choosing and binding
    it (seen once in a full run): that request runs again on fresh ranks; any other failure,
    and a port taken three times, still fails."""
    from porting import proof
    from porting.proof import tp2

    started = []

    class Ranks:
        def __init__(self):
            started.append(self)

        def alive(self):
            return False  # each failure ends its ranks

        def ask(self, request, timeout):
            if len(started) < 3:
                raise tp2._PortTaken("EADDRINUSE")
            torch.save({"ck": torch.ones(1)}, request["out"])

    monkeypatch.setattr(tp2, "_TP2Ranks", Ranks)
    monkeypatch.setattr(tp2, "_TP2", None)
    ids = torch.zeros(1, 2, dtype=torch.long)
    assert torch.equal(proof.tp2_logits(["ck"], ids, tmp_path)["ck"], torch.ones(1))
    assert len(started) == 3
    started.clear()
    monkeypatch.setattr(
        Ranks, "ask", lambda self, r, timeout: (_ for _ in ()).throw(tp2._PortTaken("x"))
    )
    with pytest.raises(tp2._PortTaken):
        proof.tp2_logits(["ck"], ids, tmp_path)
    assert len(started) == 3
