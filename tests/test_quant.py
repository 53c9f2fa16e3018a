"""Quantized checkpoints in and out (porting.convert.quant): FP8 128x128 blocks and MXFP4 read as
the weights they stand for, bit for bit as the reference dequantizers give them, gated against
those references; refused by name where they are not what we read; FP8 written on export.

The references: transformers' own ``convert_moe_packed_tensors`` for MXFP4 (what
``Mxfp4Config(dequantize=True)`` loads gpt-oss with). transformers 4.57.6 has no FP8-block
dequantization (its FP8 loader wants a GPU and Triton and never forms the weight), so for FP8 the
references are NVIDIA ModelOpt's ``FP8QTensor.dequantize`` (the gate's HF side) and, in (a), a third
implementation on numpy and ml_dtypes' float8, torch not involved.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from porting import proof
from porting.api import ParityError, export_hf, import_hf
from porting.cli import main
from porting.convert import quant
from porting.convert.safetensors_io import SafetensorsSource, read_safetensors_header
from porting.parity.hf_dequant import REFERENCE, load_whole
from porting.testing import quantize_hf_dir

FP8_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}  # Qwen/Qwen3-8B-FP8's, key for key (DeepSeek-V3's has the same keys)
# hidden 160 and MLP 288: every projection has clipped edge blocks besides full ones
QWEN3 = proof.tiny_fields(
    "Qwen3ForCausalLM", hidden_size=160, intermediate_size=288, num_hidden_layers=2
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b))  # NaN payloads are no value: positions must agree
    assert torch.equal(_bits(a)[~nan], _bits(b)[~nan])


def _numpy_fp8_block(w: torch.Tensor, s: torch.Tensor, dtype) -> np.ndarray:
    """FP8 blocks dequantized without torch: ml_dtypes' e4m3 decode, numpy's float32 product."""
    rows, cols = w.shape
    values = w.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    scales = np.repeat(np.repeat(s.numpy(), 128, axis=0), 128, axis=1)[:rows, :cols]
    with np.errstate(over="ignore"):  # float16's range ends at 65504: inf, as torch gives
        return (values * scales).astype(dtype)


def _fp8_cases():
    g = torch.Generator().manual_seed(0)
    every_code = torch.arange(256, dtype=torch.uint8).repeat(300 * 260 // 256 + 1)[: 300 * 260]
    for rows, cols in [(300, 260), (128, 128), (1, 7), (129, 385), (256, 130)]:
        w = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=g)
        if rows * cols >= 256:
            w.view(-1)[:256] = every_code[:256]  # NaN codes, +-0, subnormals, +-448
        br, bc = -(-rows // 128), -(-cols // 128)
        s = torch.exp2(torch.randint(-140, 120, (br, bc), generator=g).float())
        s *= 1 + torch.rand(br, bc, generator=g)
        s.view(-1)[0] = 0.0  # an all-zero block's scale from some quantizers
        yield w.view(torch.float8_e4m3fn), s


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_block_dequantization_is_bit_identical_to_the_references(dtype):
    np_dtype = {torch.bfloat16: ml_dtypes.bfloat16, torch.float16: np.float16}.get(
        dtype, np.float32
    )
    for w, s32 in _fp8_cases():
        # float32 scales as DeepSeek-V3 ships them, bf16 as the FP8 Qwen3 releases do
        for s in (s32, s32.to(torch.bfloat16)):
            ours = quant.dequantize_fp8_block(w, s, (128, 128), dtype)
            _same_bits(ours, REFERENCE.fp8_block(w, s, (128, 128), dtype))
            ref = _numpy_fp8_block(w, s.to(torch.float32), np_dtype).view(np.uint8).copy()
            _same_bits(ours, torch.from_numpy(ref).view(dtype).reshape(w.shape))
    # stacked: leading dims go block matrix by block matrix
    w, s = next(_fp8_cases())
    ours = quant.dequantize_fp8_block(
        torch.stack([w, w]), torch.stack([s, s * 2]), (128, 128), dtype
    )
    _same_bits(ours[1], quant.dequantize_fp8_block(w, s * 2, (128, 128), dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_mxfp4_dequantization_is_bit_identical_to_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (3, 40, 5, 16), dtype=torch.uint8, generator=g)
    blocks.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)  # every pair of E2M1 codes
    scales = torch.randint(0, 255, (3, 40, 5), dtype=torch.uint8, generator=g)
    scales.view(-1)[:255] = torch.arange(255, dtype=torch.uint8)  # every finite exponent
    ours = quant.dequantize_mxfp4(blocks, scales, dtype)
    assert ours.shape == (3, 5 * 32, 40)
    _same_bits(ours, convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype))
    _same_bits(ours, REFERENCE.mxfp4(blocks, scales, dtype))


def test_fp8_quantization_round_trips_within_fp8_precision():
    w = torch.randn(300, 260, dtype=torch.bfloat16)
    w[:128, :128] = 0  # an all-zero block
    q, s = quant.quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 3) and s[0, 0] == 1
    back = quant.dequantize_fp8_block(q, s, (128, 128), torch.float32)
    # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of the value, one block's scale apart
    assert torch.all((back - w.float()).abs() <= w.float().abs() / 16 + s.max() * 2**-9)


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """A tiny bf16 Qwen3 shipped as FP8 (quantize_hf_dir), imported with the gate."""
    root = tmp_path_factory.mktemp("fp8")
    hf = proof.make_hf(root / "hf", "Qwen3ForCausalLM", dtype=torch.bfloat16, **QWEN3)
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(cfg | {"quantization_config": FP8_CONFIG}))
    quantize_hf_dir(hf)
    report = import_hf(hf, root / "ckpt", show_progress=False)
    return hf, root / "ckpt", report


def test_bf16_scales_as_the_fp8_qwen3_releases_ship_them_import_with_the_gate(tmp_path):
    hf = proof.make_hf(tmp_path / "hf", "Qwen3ForCausalLM", dtype=torch.bfloat16, **QWEN3)
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(cfg | {"quantization_config": FP8_CONFIG}))
    quantize_hf_dir(hf, scale_dtype="bfloat16")
    header = read_safetensors_header(hf / "model.safetensors")
    assert {v.dtype for k, v in header.items() if k.endswith("_scale_inv")} == {"BF16"}
    report = import_hf(hf, tmp_path / "ckpt", show_progress=False)
    assert report.passed and report.first_divergent_layer is None, report.summary()


def test_an_fp8_checkpoint_imports_with_the_gate_and_equals_the_reference_exactly(fp8, tmp_path):
    hf, ckpt, report = fp8
    assert report.passed and report.first_divergent_layer is None, report.summary()
    stored = load_file(hf / "model.safetensors")
    q = "model.layers.1.mlp.down_proj.weight"  # [160, 288]: 2 x 3 blocks, both axes clipped
    assert stored[q].dtype == torch.float8_e4m3fn and stored[q + "_scale_inv"].shape == (2, 3)
    assert stored["lm_head.weight"].dtype == torch.bfloat16  # transformers' FP8 skips lm_head
    assert "model.layers.0.input_layernorm.weight_scale_inv" not in stored
    # the import, read back exactly (bf16 export), against the reference's dequantized weights
    export_hf(ckpt, tmp_path / "back", verify=False)
    back, ref = SafetensorsSource(tmp_path / "back"), SafetensorsSource(hf, dequantizer=REFERENCE)
    assert sorted(back.keys()) == sorted(ref.keys())
    assert q + "_scale_inv" not in ref.keys() and ref.shape(q)[0] == (160, 288)
    for key in ref.keys():
        assert back.get(key).dtype == torch.bfloat16
        assert torch.equal(_bits(back.get(key)), _bits(ref.get(key))), key


def test_scales_paired_with_the_wrong_layer_fail_the_gate_naming_it(fp8, tmp_path, monkeypatch):
    hf, _, _ = fp8
    swap = {"model.layers.0.self_attn.q_proj.weight": "model.layers.1.self_attn.q_proj.weight"}
    swap |= {v: k for k, v in swap.items()}

    def swapped(kind, name):  # the importer pairs layer 0's weight with layer 1's scale
        return name, quant.parts_of(kind, swap.get(name, name))[1]

    monkeypatch.setattr(quant, "OURS", dataclasses.replace(quant.OURS, parts=swapped))
    with pytest.raises(ParityError) as err:
        import_hf(hf, tmp_path / "out", show_progress=False)
    assert err.value.report.first_divergent_layer == 0
    assert "layer 0" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_export_writes_bf16_without_quantization_config_and_fp8_on_request(fp8, tmp_path, caplog):
    import transformers
    from transformers.quantizers.auto import AutoQuantizationConfig

    hf, ckpt, _ = fp8
    with caplog.at_level("INFO", logger="porting.api"):
        export_hf(ckpt, tmp_path / "bf16", show_progress=False)
    assert "quantization_config (fp8) is not written" in caplog.text
    bf16_cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "quantization_config" not in bf16_cfg
    assert {t.dtype for t in load_file(tmp_path / "bf16" / "model.safetensors").values()} == {
        torch.bfloat16
    }
    assert (
        main(["export", str(ckpt), "--out", str(tmp_path / "fp8"), "--quantize", "fp8-block"]) == 0
    )
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert cfg == bf16_cfg | {"quantization_config": FP8_CONFIG}
    fp8_config = transformers.AutoConfig.from_pretrained(tmp_path / "fp8").quantization_config
    parsed = AutoQuantizationConfig.from_dict(fp8_config)
    assert type(parsed).__name__ == "FineGrainedFP8Config" and parsed.weight_block_size == [
        128,
        128,
    ]
    # the same tensors as the release it came from: names, dtypes, scale shapes
    shipped, written = (
        load_file(hf / "model.safetensors"),
        load_file(tmp_path / "fp8" / "model.safetensors"),
    )
    assert {k: (v.dtype, v.shape) for k, v in written.items()} == {
        k: (v.dtype, v.shape) for k, v in shipped.items()
    }
    # loaded back with the reference dequantization, logits within FP8's error of the bf16 export
    cls = transformers.Qwen3ForCausalLM
    ids = torch.randint(0, 120, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = cls.from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()(ids).logits
        b = load_whole(tmp_path / "fp8", cls, "eager")(ids).logits
    assert (a - b).abs().max() <= 0.05 * a.abs().max()  # FP8_TOLERANCE, stated: 5% of the range
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


def _damaged(fp8, tmp_path, edit_tensors=None, edit_config=None):
    hf = tmp_path / "hf"
    shutil.copytree(fp8[0], hf)
    if edit_tensors:
        tensors = load_file(hf / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, hf / "model.safetensors", {"format": "pt"})
    if edit_config:
        cfg = json.loads((hf / "config.json").read_text())
        edit_config(cfg)
        (hf / "config.json").write_text(json.dumps(cfg))
    return hf


SCALE = "model.layers.1.self_attn.o_proj.weight_scale_inv"


def _nan_scale(t):
    t[SCALE] = t[SCALE].clone()
    t[SCALE][0, 0] = float("nan")


def test_the_import_says_what_it_dequantized_and_prints_nothing_else(fp8, tmp_path):
    import subprocess
    import sys

    from porting.testing import child_env, foreign_lines

    proc = subprocess.run(
        [sys.executable, "-m", "porting.cli", "import", str(fp8[0]), "--out", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=600, env=child_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (summary,) = [x for x in proc.stderr.splitlines() if "HF tensors ->" in x]
    assert "(qwen, bfloat16; 14 fp8 weights dequantized)" in summary, summary  # 7 per layer
    assert foreign_lines(proc.stdout + proc.stderr) == []


@pytest.mark.parametrize(
    "damage, needles",
    [
        (dict(edit_tensors=lambda t: t.pop(SCALE)), ["has no scale", repr(SCALE)]),
        (
            dict(edit_tensors=lambda t: t.update({SCALE: t[SCALE].repeat(1, 2)})),
            [repr(SCALE), "F32 (2, 2)", "needs (2, 1) in F32/BF16/F16"],
        ),
        (dict(edit_tensors=_nan_scale), [repr(SCALE), "1 non-finite value"]),
        (
            dict(edit_config=lambda c: c.pop("quantization_config")),
            ["F8_E4M3", "no quantization_config"],
        ),
        *(
            (
                dict(edit_config=lambda c, m=m: c.update(quantization_config={"quant_method": m})),
                [f"quantization_config.quant_method={m!r} is not read"],
            )
            for m in ("gptq", "awq", "bitsandbytes", "compressed-tensors")
        ),
        (
            dict(edit_config=lambda c: c["quantization_config"].update(weight_block_size=[64])),
            ["quantization_config.weight_block_size=[64]"],
        ),
        (
            dict(edit_config=lambda c: c["quantization_config"].update(scale_fmt="e5m3")),
            ["quantization_config.scale_fmt='e5m3' is not read (only 'ue8m0'"],
        ),
    ],
)
def test_bad_quantized_input_is_refused_by_name(fp8, tmp_path, capsys, damage, needles):
    hf = _damaged(fp8, tmp_path, **damage)
    out = tmp_path / "out"
    code = main(["import", str(hf), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and all(n in lines[0] for n in needles), err
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_a_ue8m0_release_comes_back_bit_for_bit_with_its_config_as_it_came(tmp_path):
    """DeepSeek-V3.1's FP8 releases tag their scales ``scale_fmt: ue8m0`` (powers of two, stored
    as float32): such a release imports with the gate, and `--quantize fp8-block` gives back its
    own codes and scales, bit for bit, and its config.json key for key (the yarn rope_scaling and
    the quantization_config with its scale_fmt, in their places)."""
    cfg = proof.tiny_fields("DeepseekV3ForCausalLM")
    hf = proof.make_hf(tmp_path / "hf", "DeepseekV3ForCausalLM", dtype=torch.bfloat16, **cfg)
    release = json.loads((hf / "config.json").read_text())
    release["rope_scaling"] = {
        "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 64, "type": "yarn",
    }  # fmt: skip
    release["quantization_config"] = FP8_CONFIG | {"scale_fmt": "ue8m0"}
    (hf / "config.json").write_text(json.dumps(release, indent=2))
    quantize_hf_dir(hf)
    shipped = load_file(hf / "model.safetensors")
    scales = [v for k, v in shipped.items() if k.endswith("_scale_inv")]
    assert scales and all(torch.equal(s, torch.exp2(torch.log2(s).round())) for s in scales)
    assert import_hf(hf, tmp_path / "ckpt", show_progress=False).passed
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back"),
                 "--quantize", "fp8-block"]) == 0  # fmt: skip
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(shipped)
    for key, t in shipped.items():
        assert back[key].dtype == t.dtype and torch.equal(_bits(back[key]), _bits(t)), key
    came_back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert came_back == release and list(came_back) == list(release)


GPT_OSS_MXFP4 = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}  # openai/gpt-oss-20b's
GPT_OSS = dict(
    vocab_size=130, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
    num_experts_per_tok=2, sliding_window=8, max_position_embeddings=256,
)  # fmt: skip


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """A tiny bf16 gpt-oss shipped as MXFP4 (quantize_hf_dir)."""
    hf = proof.make_hf(
        tmp_path_factory.mktemp("mxfp4") / "hf",
        "GptOssForCausalLM",
        dtype=torch.bfloat16,
        **GPT_OSS,
    )
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(cfg | {"quantization_config": GPT_OSS_MXFP4}))
    return quantize_hf_dir(hf)


def test_an_mxfp4_checkpoint_reads_as_transformers_loads_it(mxfp4):
    import transformers

    stored = load_file(mxfp4 / "model.safetensors")
    experts = "model.layers.1.mlp.experts."
    assert stored[experts + "gate_up_proj_blocks"].shape == (4, 192, 2, 16)  # [E, 2I, H/32, 16]
    assert stored[experts + "down_proj_scales"].dtype == torch.uint8
    ours = SafetensorsSource(mxfp4)
    model = transformers.GptOssForCausalLM.from_pretrained(
        mxfp4, dtype=torch.bfloat16, quantization_config=transformers.Mxfp4Config(dequantize=True)
    )
    theirs = model.state_dict()
    assert sorted(ours.keys()) == sorted(theirs)
    assert ours.shape(experts + "gate_up_proj")[0] == (4, 64, 192)  # gate/up interleaved last
    for key in ours.keys():
        assert torch.equal(_bits(ours.get(key)), _bits(theirs[key])), key
    # the gate's reference reads a stack one expert at a time: each dequantized alone is the
    # whole's slice, by either dequantizer
    for source in (ours, SafetensorsSource(mxfp4, dequantizer=REFERENCE)):
        for name in ("gate_up_proj", "down_proj"):
            whole = theirs[experts + name]
            for e in range(whole.shape[0]):
                with source.mapped(experts + name, e) as one:
                    assert torch.equal(_bits(one), _bits(whole[e])), (source, name, e)


def test_an_mxfp4_gpt_oss_imports_with_the_gate(mxfp4, tmp_path):
    report = import_hf(mxfp4, tmp_path / "ckpt", show_progress=False)
    assert report.passed and report.first_divergent_layer is None, report.summary()
    # and with the whole model loaded by transformers' own MXFP4 loader (dequantize=True)
    from porting.parity.harness import verify

    assert verify(mxfp4, tmp_path / "ckpt", whole_model=True).passed


_PEAK = """
import resource, sys
from porting.convert.safetensors_io import SafetensorsSource, read_safetensors_header
source = SafetensorsSource(sys.argv[1])
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
weight = source.get("w.weight")
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024 / weight.nbytes)
"""


def test_a_large_fp8_weight_dequantizes_within_one_output_and_its_mapped_input(tmp_path):
    """DeepSeek-V3's MLP width (7168 x 18432, 56 x 144 blocks): the peak memory grows by the
    bf16 output, the mapped FP8 input (half of it) and one block row, nothing full-size more."""
    import subprocess
    import sys

    codes = torch.randint(0, 256, (7168, 18432), dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes: the read is refused on those
    save_file(
        {"w.weight": codes.view(torch.float8_e4m3fn), "w.weight_scale_inv": torch.rand(56, 144)},
        tmp_path / "model.safetensors",
    )
    del codes
    config = {"torch_dtype": "bfloat16", "quantization_config": FP8_CONFIG}
    (tmp_path / "config.json").write_text(json.dumps(config))
    run = subprocess.run(
        [sys.executable, "-c", _PEAK, str(tmp_path)], capture_output=True, text=True, check=True
    )
    assert float(run.stdout) < 2.0, run.stdout  # measured 1.58


def test_the_whole_model_gate_reads_fp8_through_the_reference(fp8):
    from porting.parity.harness import verify

    hf, ckpt, _ = fp8
    assert verify(hf, ckpt, whole_model=True).passed


# What transformers 4.57's FP8 loader quantizes in each tiny model (every nn.Linear but lm_head),
# written there by fp8_targets (tests/data; `proof.tiny_fields(arch)` configs): transformers 5
# stacks the experts and moves some routers out of nn.Linear, and the releases did not change.
FP8_TARGETS_4_57 = Path(__file__).parent / "data" / "fp8_targets_transformers_4_57.json"


@pytest.mark.parametrize("arch", sorted(json.loads(FP8_TARGETS_4_57.read_text())))
def test_fp8_targets_are_transformers_4_57_s_under_either_transformers(arch):
    import transformers

    cfg = proof.tiny_fields(arch) | {"architectures": [arch]}
    targets = quant.fp8_targets(getattr(transformers, arch), cfg)
    assert sorted(targets) == json.loads(FP8_TARGETS_4_57.read_text())[arch]


def test_fp8_targets_reach_a_layer_past_the_decoder_as_its_last_layer_is():
    """DeepSeek-V3's multi-token-prediction layer (model.layers.{num_hidden_layers}) is built by
    no transformers class: its decoder-layer weights are FP8 where the last layer's are, and its
    own eh_proj and its embedding and head copies stay as they are (vLLM's DeepSeek MTP reads
    them unquantized)."""
    import transformers

    cfg = proof.tiny_fields("DeepseekV3ForCausalLM") | {
        "architectures": ["DeepseekV3ForCausalLM"],
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    }
    n = cfg["num_hidden_layers"]
    extra = [
        f"model.layers.{n}.self_attn.kv_b_proj.weight",
        f"model.layers.{n}.mlp.experts.0.down_proj.weight",
        f"model.layers.{n}.eh_proj.weight",
        f"model.layers.{n}.shared_head.head.weight",
        f"model.layers.{n}.embed_tokens.weight",
        f"model.layers.{n}.enorm.weight",
    ]
    targets = quant.fp8_targets(transformers.DeepseekV3ForCausalLM, cfg, extra)
    assert set(extra) & targets == set(extra[:2])
    assert f"model.layers.{n - 1}.self_attn.kv_b_proj.weight" in targets
    assert "lm_head.weight" not in targets
