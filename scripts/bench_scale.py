"""Import (with the parity gate), verify and export at real sizes: wall time and peak memory.

Writes a Llama-layout bf16 checkpoint of a given shape straight to safetensors shards (random
weights, no model built in memory), then runs each command in a fresh process under
``/usr/bin/time -v`` and reports wall time, peak RSS and peak / weights on disk. Sizes:

    7b        hidden 4096, 32 layers, FFN 11008, 32 heads (MHA), vocab 32000 (6.7B, 13.5 GB)
    7b-8      the same width, 8 layers (the parity gate's benchmark stack)       (1.9B, 3.6 GB)
    7b-deep   the same width, 64 layers                                         (13.0B, 26 GB)
    moe       Mixtral layout: hidden 2048, 4 layers, 8 experts of FFN 5632 (top-2), GQA 16/8,
              vocab 32000                                                        (1.3B, 2.6 GB)
    moe-deep  the same with 16 layers                                            (4.8B, 9.6 GB)
    deepseek-v3    DeepSeek-V3's published config (MLA, hidden 7168, vocab 129280) with 1 dense
                   + 2 MoE layers of 16 of its 256 experts and its multi-token-prediction layer,
                   in FP8 with 128x128 block scales
    gpt-oss-20b-4  gpt-oss-20b's published config (hidden 2880, 32 experts, vocab 201088) with 4
                   of its 24 layers, experts in MXFP4
    kimi-k2        Kimi K2's published config (MLA, hidden 7168, vocab 163840) with 1 dense + 1
                   MoE layer of 16 of its 384 experts, in FP8 with 128x128 block scales
    gpt-oss-120b-2 gpt-oss-120b's published config (hidden 2880, vocab 201088) with 2 of its 36
                   layers (sliding and full) of 32 of its 128 experts, experts in MXFP4
    qwen3-coder-480b-1  one Qwen3-Coder-480B-A35B layer: 160 experts of 6144 x 2560 (top-8), 96
                   heads, vocab 32000                                  (7.6B, 15.1 GB in bf16)
    nemotron-mini-4b  Nemotron-Mini-4B-Instruct's published config, all 32 layers  (4.2B, 8.4 GB)
    deepseek-v2-lite-4  DeepSeek-V2-Lite's published config with 4 of its 27 layers: 1 dense and
                   3 MoE layers of all 64 experts, YaRN as published             (2.3B, 4.6 GB)
    deepseek-v3-1  one DeepSeek-V3 MoE layer with all 256 experts, no MTP layer, vocab 32000, in
                   FP8                                      (11.3B, 22.5 GB in bf16, 11 GB FP8)
    llama4-scout-1 one Llama 4 Scout MoE layer (16 stacked experts of 5120 x 8192, shared
                   expert) with its vocab of 202048                        (4.3B, 8.6 GB in bf16)

The frontier sizes are written from the HF class (every tensor it has) and quantized as released.

``--nemo`` also runs NeMo 2.7.3's own ``HFLlamaImporter`` (``llm.import_ckpt``) on the same
checkpoint. Outputs are deleted as soon as the next step no longer needs them (disk).

    python scripts/bench_scale.py --sizes 7b 7b-deep --workdir /tmp/bench-scale

The gate's columns (import, verify, export) come from the command's ``--json`` report: the
gate's own wall (start-up excluded), its floor (both sides' matmuls at this machine's fp32 rate,
measured in the same run) and their ratio.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path

SIZES = {
    "7b": dict(hidden=4096, layers=32, ffn=11008, heads=32, kv=32, vocab=32000),
    "7b-8": dict(hidden=4096, layers=8, ffn=11008, heads=32, kv=32, vocab=32000),
    "7b-deep": dict(hidden=4096, layers=64, ffn=11008, heads=32, kv=32, vocab=32000),
    "1b": dict(hidden=2048, layers=16, ffn=5632, heads=16, kv=16, vocab=32000),
    "1b-deep": dict(hidden=2048, layers=32, ffn=5632, heads=16, kv=16, vocab=32000),
    "moe": dict(hidden=2048, layers=4, ffn=5632, heads=16, kv=8, vocab=32000, experts=8),
    "moe-deep": dict(hidden=2048, layers=16, ffn=5632, heads=16, kv=8, vocab=32000, experts=8),
}
# Frontier shapes at their real widths: the published config.json (tests/published_configs.py,
# as on the model card) with fewer layers, built from the HF class itself (names and shapes from
# the model on the meta device) and written as it ships: DeepSeek-V3 in FP8 with 128x128 block
# scales, gpt-oss's experts in MXFP4. A DeepSeek-V3 MoE layer holds 256 experts (11.3B
# parameters, 22.5 GB in bf16), more than this machine's memory bound allows per layer (the issue
# on giant layers): that size keeps every width and cuts the expert count, which the table says.
ARCH_SIZES = {
    "deepseek-v3": (
        "deepseek-ai/DeepSeek-V3",
        dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=16),
        "DeepSeek-V3 (MLA, hidden 7168; 1 dense + 2 MoE layers of 16 of its 256 experts, and its "
        "MTP layer), FP8",
    ),
    "gpt-oss-20b-4": (
        "openai/gpt-oss-20b",
        dict(num_hidden_layers=4),
        "gpt-oss-20b (hidden 2880, 32 experts, vocab 201088), 4 of its 24 layers, MXFP4 experts",
    ),
    # The frontier vocabularies at their real widths (issue 59's sizes): Kimi K2's 163,840 x
    # 7168 (4.7 GB in fp32 a table) with its dense first layer (FFN 18432) and one MoE layer;
    # gpt-oss-120b's 201,088 x 2880 with two layers of 32 of its 128 experts (one random fp32
    # stack of 128 is 8.5 GB where the bench writes it; the gate streams experts one at a time).
    "kimi-k2": (
        "moonshotai/Kimi-K2-Instruct",
        dict(num_hidden_layers=2, n_routed_experts=16),
        "Kimi K2 (MLA, hidden 7168, vocab 163840; 1 dense + 1 MoE layer of 16 of its 384 "
        "experts), FP8",
    ),
    "gpt-oss-120b-2": (
        "openai/gpt-oss-120b",
        dict(num_hidden_layers=2, num_local_experts=32),
        "gpt-oss-120b (hidden 2880, vocab 201088), 2 of its 36 layers of 32 of its 128 experts, "
        "MXFP4 experts",
    ),
    # One Qwen3-Coder-480B-A35B layer (its config.json's widths on Qwen3-30B-A3B's catalogued
    # config: 160 experts of 6144 x 2560, 96 heads of 128, 8 KV groups), 7.6B parameters and
    # 15.1 GB in bf16, with a 32,000-token vocabulary so that the layer, not the embedding, is
    # what the memory bound is about.
    "qwen3-coder-480b-1": (
        "Qwen/Qwen3-30B-A3B",
        dict(
            num_hidden_layers=1,
            hidden_size=6144,
            num_attention_heads=96,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=8192,
            moe_intermediate_size=2560,
            num_experts=160,
            num_experts_per_tok=8,
            max_position_embeddings=262144,
            max_window_layers=62,
            rope_theta=10000000.0,
            vocab_size=32000,
            bos_token_id=0,
            eos_token_id=1,
        ),
        "one Qwen3-Coder-480B-A35B layer (hidden 6144, 160 experts of 2560, top-8; 15.1 GB), "
        "vocab 32000",
    ),
    # A whole dense model of a family on a custom spec (LayerNorm1P, squared ReLU, partial
    # rotary): Nemotron-Mini-4B as published, 4.2B parameters, 8.4 GB in bf16.
    "nemotron-mini-4b": (
        "nvidia/Nemotron-Mini-4B-Instruct",
        {},
        "Nemotron-Mini-4B (hidden 3072, 32 layers, vocab 256000; LayerNorm1P, squared ReLU), bf16",
    ),
    # DeepSeek-V2-Lite as published, its first 4 layers: the dense one and 3 MoE layers with all
    # 64 experts and 2 shared ones (2.3B parameters, 4.6 GB in bf16)
    "deepseek-v2-lite-4": (
        "deepseek-ai/DeepSeek-V2-Lite",
        dict(num_hidden_layers=4),
        "DeepSeek-V2-Lite (MLA without a query latent, hidden 2048, vocab 102400; 1 dense + 3 "
        "MoE layers of all 64 experts), bf16",
    ),
    # One DeepSeek-V3 MoE layer with all 256 experts (11.3B parameters, 22.5 GB in bf16, 11 GB
    # in FP8 as shipped), no MTP layer, a 32,000-token vocabulary as above.
    "deepseek-v3-1": (
        "deepseek-ai/DeepSeek-V3",
        dict(
            num_hidden_layers=1,
            first_k_dense_replace=0,
            num_nextn_predict_layers=0,
            vocab_size=32000,
            bos_token_id=0,
            eos_token_id=1,
        ),
        "one DeepSeek-V3 MoE layer (MLA, hidden 7168, 256 experts of 2048, top-8), FP8, "
        "vocab 32000",
    ),
    # One Llama 4 Scout MoE layer at its real widths (16 experts of 5120 x 8192 stacked as HF
    # stores them, a shared expert, 40 heads of 128, 8 KV groups) and its whole 202,048-token
    # vocabulary: Scout's text_config as published (attn_temperature_tuning true, which either
    # transformers reads) with its first layer only. 4.3B parameters, 8.6 GB in bf16.
    "llama4-scout-1": (
        None,
        dict(
            architectures=["Llama4ForCausalLM"],
            model_type="llama4_text",
            attention_bias=False,
            attention_chunk_size=8192,
            attention_dropout=0.0,
            attn_scale=0.1,
            attn_temperature_tuning=True,
            bos_token_id=200000,
            eos_token_id=[200001, 200007, 200008],
            floor_scale=8192,
            for_llm_compressor=False,
            head_dim=128,
            hidden_act="silu",
            hidden_size=5120,
            initializer_range=0.02,
            interleave_moe_layer_step=1,
            intermediate_size=8192,
            intermediate_size_mlp=16384,
            max_position_embeddings=262144,
            moe_layers=[0],
            no_rope_layers=[1],
            num_attention_heads=40,
            num_experts_per_tok=1,
            num_hidden_layers=1,
            num_key_value_heads=8,
            num_local_experts=16,
            output_router_logits=False,
            pad_token_id=200018,
            rms_norm_eps=1e-05,
            rope_scaling={
                "factor": 8.0,
                "high_freq_factor": 4.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            rope_theta=500000.0,
            router_aux_loss_coef=0.001,
            router_jitter_noise=0.0,
            torch_dtype="bfloat16",
            use_cache=True,
            use_qk_norm=True,
            vocab_size=202048,
        ),
        "one Llama 4 Scout MoE layer (hidden 5120, 16 experts of 8192 stacked, shared expert, "
        "top-1 sigmoid), vocab 202048, bf16",
    ),
}
SHARD_BYTES = 4 * 2**30
LAYOUT_STEPS = (
    "import-megatron-lm",
    "import-megatron-bridge",
    "export-megatron-lm",
    "convert-megatron-bridge",
)


def write_checkpoint(out: Path, hidden, layers, ffn, heads, kv, vocab, experts=0) -> int:
    """A random Llama-layout bf16 checkpoint at ``out``, shard by shard; returns bytes on disk.

    With ``experts``, every MLP is a Mixtral mixture of that many experts (top-2).
    """
    import torch
    from safetensors.torch import save_file

    from porting.testing import make_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer(out)
    head_dim = hidden // heads
    g = torch.Generator().manual_seed(0)

    def rand(*shape, scale=0.02):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    def tensors():
        yield "model.embed_tokens.weight", rand(vocab, hidden)
        for i in range(layers):
            p = f"model.layers.{i}."
            yield p + "input_layernorm.weight", (1 + rand(hidden, scale=0.1).float()).bfloat16()
            yield p + "self_attn.q_proj.weight", rand(heads * head_dim, hidden)
            yield p + "self_attn.k_proj.weight", rand(kv * head_dim, hidden)
            yield p + "self_attn.v_proj.weight", rand(kv * head_dim, hidden)
            yield p + "self_attn.o_proj.weight", rand(hidden, heads * head_dim)
            yield (
                p + "post_attention_layernorm.weight",
                (1 + rand(hidden, scale=0.1).float()).bfloat16(),
            )
            if experts:
                m = p + "block_sparse_moe."
                yield m + "gate.weight", rand(experts, hidden)
                for e in range(experts):
                    yield m + f"experts.{e}.w1.weight", rand(ffn, hidden)
                    yield m + f"experts.{e}.w3.weight", rand(ffn, hidden)
                    yield m + f"experts.{e}.w2.weight", rand(hidden, ffn)
                continue
            yield p + "mlp.gate_proj.weight", rand(ffn, hidden)
            yield p + "mlp.up_proj.weight", rand(ffn, hidden)
            yield p + "mlp.down_proj.weight", rand(hidden, ffn)
        yield "model.norm.weight", (1 + rand(hidden, scale=0.1).float()).bfloat16()
        yield "lm_head.weight", rand(vocab, hidden)

    shards, buf, size, total = [], {}, 0, 0
    weight_map = {}

    def flush():
        nonlocal buf, size
        name = f"shard-{len(shards):05d}.safetensors"
        save_file(buf, str(out / name), metadata={"format": "pt"})
        shards.append(name)
        weight_map.update({k: name for k in buf})
        buf, size = {}, 0

    for key, t in tensors():
        if buf and size + t.nbytes > SHARD_BYTES:
            flush()
        buf[key] = t
        size += t.nbytes
        total += t.nbytes
    flush()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    if experts:
        for key in ("attention_bias", "mlp_bias"):
            del config[key]
        config.update(
            architectures=["MixtralForCausalLM"],
            model_type="mixtral",
            num_local_experts=experts,
            num_experts_per_tok=2,
        )
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return sum(f.stat().st_size for f in out.glob("*.safetensors"))


def published_config(hub_id: str) -> dict:
    """A published ``config.json`` as the suite's catalogue holds it."""
    import copy
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "tests" / "published_configs.py"
    spec = importlib.util.spec_from_file_location("published_configs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return copy.deepcopy(module.PUBLISHED[hub_id])


def write_arch_checkpoint(out: Path, size: str) -> int:
    """A random checkpoint of an ``ARCH_SIZES`` shape at ``out``: every tensor the HF class has
    (read from the model built on the meta device, so nothing of its size is allocated), written
    shard by shard in bf16, then quantized as the shape's ``quantization_config`` says, the way
    the published checkpoint ships. Returns bytes on disk."""
    import copy

    import torch
    import transformers
    from safetensors.torch import save_file

    from porting.convert.packed_experts import published_shapes
    from porting.testing import make_tokenizer, quantize_hf_dir

    hub_id, changes, _ = ARCH_SIZES[size]
    # a shape with no catalogue entry (a container's language model) gives its whole config
    fields = (published_config(hub_id) if hub_id else {}) | changes
    if "layer_types" in fields:
        fields["layer_types"] = fields["layer_types"][: fields["num_hidden_layers"]]
    arch = fields["architectures"][0]
    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer(out)
    cls = getattr(transformers, arch)
    skip = ("architectures", "auto_map", "quantization_config")
    # a copy: transformers 5's config classes rewrite a rope_scaling dict in place (rope_theta
    # moved into it), which config.json must not take
    config = cls.config_class(**copy.deepcopy({k: v for k, v in fields.items() if k not in skip}))
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in cls(config).state_dict().items()}
    # under transformers 5 a layer's experts are two stacks: the published names are per expert
    # (and one random stack of a 480B-class layer would be 20 GB in fp32)
    shapes = published_shapes(config.model_type, shapes, f"transformers' {arch}")
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    extra = mtp_shapes(shapes, fields) if fields.get("num_nextn_predict_layers") else {}
    copies = {k: v for k, v in extra.items() if isinstance(v, str)}
    shapes |= {k: shapes[v] if isinstance(v, str) else v for k, v in extra.items()}
    shards, buf, size_now, total, weight_map = [], {}, 0, 0, {}

    def flush():
        nonlocal buf, size_now
        name = f"shard-{len(shards):05d}.safetensors"
        save_file(buf, str(out / name), metadata={"format": "pt"})
        shards.append(name)
        weight_map.update(dict.fromkeys(buf, name))
        buf, size_now = {}, 0

    for key, shape in shapes.items():
        # a tensor's values from its name (a copy's from its original's): the MTP layer's
        # embedding and head equal the model's, bit for bit
        g = torch.Generator().manual_seed(zlib.crc32(copies.get(key, key).encode()))
        if key.endswith("norm.weight") or key.endswith("layernorm.weight"):
            t = 1 + torch.randn(shape, generator=g) * 0.1
        elif key.endswith("e_score_correction_bias"):
            # non-negative, as the tests' (tests/test_deepseek.py): a chosen expert whose biased
            # score falls below 0 is routed otherwise by transformers' router (0 for the
            # unchosen groups) than by DeepSeek's own code and Megatron-Core's (-inf)
            t = 0.5 * torch.rand(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) * 0.02
        # DeepSeek-V3 ships its routers' expert bias in float32 beside bf16 weights
        t = t.to(torch.float32 if key.endswith("e_score_correction_bias") else torch.bfloat16)
        if buf and size_now + t.nbytes > SHARD_BYTES:
            flush()
        buf[key] = t
        size_now += t.nbytes
        total += t.nbytes
    flush()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    (out / "config.json").write_text(json.dumps(fields, indent=1))
    if "quantization_config" in fields:
        quantize_hf_dir(out)
    return sum(f.stat().st_size for f in out.glob("*.safetensors"))


def mtp_shapes(shapes: dict, fields: dict) -> dict:
    """DeepSeek-V3's multi-token-prediction layer, which the HF class does not build: the last
    decoder layer's tensors at index ``num_hidden_layers`` (an MoE layer), its own norms and
    ``eh_proj``, and copies of the embedding and head (name -> shape, or -> the copied name)."""
    n, h = fields["num_hidden_layers"], fields["hidden_size"]
    last, mtp = f"model.layers.{n - 1}.", f"model.layers.{n}."
    out: dict = {mtp + k[len(last) :]: shapes[k] for k in shapes if k.startswith(last)}
    out |= {mtp + f"{k}.weight": (h,) for k in ("enorm", "hnorm", "shared_head.norm")}
    out[mtp + "eh_proj.weight"] = (h, 2 * h)
    out[mtp + "embed_tokens.weight"] = "model.embed_tokens.weight"
    out[mtp + "shared_head.head.weight"] = "lm_head.weight"
    return out


def disk_rate(where: Path) -> tuple[float, float]:
    """Bytes per second written and read by ``dd`` with O_DIRECT (the page cache bypassed),
    2 GiB in 16 MiB blocks: the rate a conversion's streaming reads and writes can reach."""
    where.mkdir(parents=True, exist_ok=True)
    probe = where / "disk-probe"
    rates = []
    for argv in (
        ["dd", "if=/dev/zero", f"of={probe}", "bs=16M", "count=128", "oflag=direct"],
        ["dd", f"if={probe}", "of=/dev/null", "bs=16M", "iflag=direct"],
    ):
        t = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        rates.append(2**31 / (time.perf_counter() - t))
    probe.unlink()
    return rates[0], rates[1]


RANK_STEPS = ("import-2", "import-2-no-gate", "verify-2", "export-2")
TWO_RANKS = ["--executor", "torchrun", "--nproc-per-node", "2"]


def write_sized(out: Path, size: str) -> int:
    if size in ARCH_SIZES:
        return write_arch_checkpoint(out, size)
    return write_checkpoint(out, **SIZES[size])


def timed(cmd: list[str], log: Path) -> dict:
    """Run ``cmd`` under /usr/bin/time -v; wall seconds, peak RSS bytes, exit code, and the
    parity gate's wall, floor and ratio when the command printed its report as JSON."""
    t = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(
            ["/usr/bin/time", "-v", *cmd], stdout=subprocess.PIPE, stderr=f, text=True
        )
    wall = time.perf_counter() - t
    text = log.read_text()
    gate = {}
    if "{" in proc.stdout:
        try:
            report, _ = json.JSONDecoder().raw_decode(proc.stdout[proc.stdout.index("{") :])
            gate = {k: report.get(k) for k in ("wall_s", "floor_s", "floor_ratio", "ranks")}
        except ValueError:
            pass
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    # blocks of 512 bytes that reached the disk (page-cache hits are not counted)
    io = [re.search(rf"File system {w}: (\d+)", text) for w in ("inputs", "outputs")]
    row = {
        "wall_s": wall,
        "peak_rss": int(m.group(1)) * 1024 if m else None,
        "disk_read": int(io[0].group(1)) * 512 if io[0] else None,
        "disk_written": int(io[1].group(1)) * 512 if io[1] else None,
        "rc": proc.returncode,
        "oom": "Killed" in text or proc.returncode in (-9, 137),
        "gate_s": gate.get("wall_s"),
        "gate_floor_s": gate.get("floor_s"),
        "gate_ratio": gate.get("floor_ratio"),
        # each process's CPU seconds in the gate (one, or one a rank)
        "gate_cpu_s": [r["cpu_s"] for r in gate.get("ranks") or []],
    }
    if proc.returncode != 0:
        # The exception's own line (the last one naming an error), for the table.
        errors = [m.group(0) for m in re.finditer(r"\b\w*(Error|Exception): [^\n]*", text)]
        row["error"] = errors[-1][:120] if errors else None
    return row


NEMO_IMPORT = """
import sys
from nemo.collections import llm
from nemo.collections.llm.gpt.model.base import GPTConfig
from nemo.collections.llm.gpt.model.llama import LlamaConfig
from porting import cpu

cpu.enable()
cpu.ensure_rendezvous_env()


def post_init(self):  # NeMo's LlamaConfig turns CUDA-only fusions on; off so it builds on the CPU
    cpu.kernel_safe_config(self)
    GPTConfig.__post_init__(self)


LlamaConfig.__post_init__ = post_init
# The importer builds its config from the HF directory; this one only selects the class.
placeholder = LlamaConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
llm.import_ckpt(model=llm.LlamaModel(placeholder), source="hf://" + sys.argv[1], output_path=sys.argv[2])
"""


def main() -> int:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--sizes", nargs="+", default=["7b", "7b-deep"], choices=[*SIZES, *ARCH_SIZES])
    p.add_argument("--workdir", type=Path, default=Path("bench-out/scale"))
    p.add_argument("--nemo", action="store_true", help="also run NeMo's own HFLlamaImporter")
    p.add_argument(
        "--steps",
        nargs="*",
        default=["import", "verify", "export"],
        choices=["import", "import-no-gate", "verify", "export", *LAYOUT_STEPS, *RANK_STEPS],
        help="our commands to run (none: only --nemo); import-no-gate: import --no-verify, to "
        "see what the gate adds; import-megatron-lm / import-megatron-bridge: import --format; "
        "export-megatron-lm: export of the Megatron-LM checkpoint (after import-megatron-lm); "
        "convert-megatron-bridge: convert of the NeMo checkpoint (after import); import-2, "
        "verify-2, export-2: the same over two torchrun ranks (--executor torchrun; the peak "
        "is the largest one process's, a rank's)",
    )
    p.add_argument("--json", type=Path, help="also write the rows as JSON")
    p.add_argument(
        "--disk", action="store_true", help="first measure the work directory's disk (dd, 2 GiB)"
    )
    args = p.parse_args()
    porting = [sys.executable, "-m", "porting.cli"]
    rows = []
    rate = disk_rate(args.workdir) if args.disk else None
    for size in args.sizes:
        work = args.workdir / size
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        t = time.perf_counter()
        weights = write_sized(work / "hf", size)
        print(
            f"{size}: wrote {weights / 1e9:.2f} GB in {time.perf_counter() - t:.0f} s", flush=True
        )
        steps = {
            "import": porting + ["import", str(work / "hf"), "--out", str(work / "nemo"), "--json"],
            "import-no-gate": porting
            + ["import", str(work / "hf"), "--out", str(work / "nemo-no-gate"), "--no-verify"],
            "verify": porting + ["verify", str(work / "hf"), str(work / "nemo"), "--json"],
            "export": porting
            + ["export", str(work / "nemo"), "--out", str(work / "hf-out"), "--json"],
            "import-2": porting
            + ["import", str(work / "hf"), "--out", str(work / "nemo-2"), "--json", *TWO_RANKS],
            "import-2-no-gate": porting
            + [
                "import",
                str(work / "hf"),
                "--out",
                str(work / "nemo-2"),
                "--no-verify",
                *TWO_RANKS,
            ],
            "verify-2": porting
            + ["verify", str(work / "hf"), str(work / "nemo"), "--json", *TWO_RANKS],
            "export-2": porting
            + ["export", str(work / "nemo"), "--out", str(work / "hf-out"), "--json", *TWO_RANKS],
            "import-megatron-lm": porting
            + [
                "import",
                str(work / "hf"),
                "--format",
                "megatron-lm",
                "--out",
                str(work / "mlm"),
                "--json",
            ],
            "import-megatron-bridge": porting
            + [
                "import",
                str(work / "hf"),
                "--format",
                "megatron-bridge",
                "--out",
                str(work / "bridge"),
                "--json",
            ],
            "export-megatron-lm": porting
            + ["export", str(work / "mlm"), "--out", str(work / "hf-out"), "--json"],
            "convert-megatron-bridge": porting
            + [
                "convert",
                str(work / "nemo"),
                "--to",
                "megatron-bridge",
                "--out",
                str(work / "converted"),
                "--json",
            ],
        }
        for n, step in enumerate(args.steps):
            later = args.steps[n + 1 :]
            if step == "export" and not any(s.startswith(("import", "verify")) for s in later):
                shutil.rmtree(work / "hf", ignore_errors=True)  # disk: export needs only nemo/
            r = timed(steps[step], work / f"{step}.log")
            # disk: what no later step reads
            for done in ("nemo-no-gate", "nemo-2", "bridge", "converted", "hf-out"):
                shutil.rmtree(work / done, ignore_errors=True)
            if step == "export-megatron-lm":
                shutil.rmtree(work / "mlm", ignore_errors=True)
            r.update(size=size, step=step, weights=weights)
            rows.append(r)
            print(json.dumps(r), flush=True)
            if r["rc"] != 0:
                break
        shutil.rmtree(work / "hf-out", ignore_errors=True)
        if args.nemo and size in SIZES:  # NeMo's importer here is its Llama one
            shutil.rmtree(work / "nemo", ignore_errors=True)
            if not (work / "hf").exists():
                write_sized(work / "hf", size)
            code = NEMO_IMPORT
            r = timed(
                [
                    sys.executable,
                    "-c",
                    code,
                    str(work / "hf"),
                    str(work / "nemo-ref"),
                    str(SIZES[size]["layers"]),
                ],
                work / "nemo.log",
            )
            r.update(size=size, step="nemo HFLlamaImporter", weights=weights)
            rows.append(r)
            print(json.dumps(r), flush=True)
        for log in work.glob("*.log"):  # kept beside the work directory, which goes
            shutil.copy(log, args.workdir / f"{size}-{log.name}")
        shutil.rmtree(work, ignore_errors=True)
    print()
    if rate:
        print(f"disk: {rate[0] / 1e6:.0f} MB/s written, {rate[1] / 1e6:.0f} MB/s read (O_DIRECT)")
    # the size column as wide as its longest name (qwen3-coder-480b-1, nemotron-mini-4b) and a gap
    sw = max([len("size"), *(len(r["size"]) for r in rows)]) + 2
    print(
        f"{'size':<{sw}}{'step':<22}{'wall s':>8}{'peak RSS GiB':>14}{'peak/weights':>14}"
        f"{'gate s':>8}{'floor s':>9}{'gate/floor':>12}{'gate CPU-s':>14}{'disk GB r/w':>14}"
        f"{'MB/s':>7}  result"
    )
    for r in rows:
        peak = r["peak_rss"] or 0
        result = "ok" if r["rc"] == 0 else ("out of memory" if r["oom"] else f"exit {r['rc']}")
        if r.get("error"):
            result += f": {r['error']}"
        gate = "".join(
            f"{v:>{w}.1f}" if v is not None else f"{'-':>{w}}"
            for v, w in (
                (r.get("gate_s"), 8),
                (r.get("gate_floor_s"), 9),
                (r.get("gate_ratio"), 12),
            )
        )
        # a rank's each, "/" between them
        cpu = "/".join(f"{c:.1f}" for c in r.get("gate_cpu_s") or []) or "-"
        gate += f"{cpu:>14}"
        moved = (r.get("disk_read") or 0) + (r.get("disk_written") or 0)
        disk = f"{(r.get('disk_read') or 0) / 1e9:.1f}/{(r.get('disk_written') or 0) / 1e9:.1f}"
        print(
            f"{r['size']:<{sw}}{r['step']:<22}{r['wall_s']:>8.0f}{peak / 2**30:>14.2f}"
            f"{peak / r['weights']:>14.2f}{gate}{disk:>14}{moved / r['wall_s'] / 1e6:>7.0f}"
            f"  {result}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
