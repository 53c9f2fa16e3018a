"""Tiny random-init Hugging Face checkpoints and tokenizers built locally (no hub).

Used by the test suite, ``porting demo`` and the benchmarks. Random init leaves every norm weight at
1.0 and every bias at 0, so a dropped norm or bias would pass parity unnoticed; :func:`perturb`
moves them away from their init.
"""

from __future__ import annotations

import contextlib
import copy
import signal
from pathlib import Path

import torch

CORPUS = (
    "The quick brown fox jumps over the lazy dog. "
    "Megatron trains large language models with tensor and pipeline parallelism. "
    "東京は日本の首都です。京都には古い寺がたくさんあります。 "
    "Hello world, hello NeMo, hello Hugging Face. 0123456789 "
)


def save_as_published(model, out: str | Path, **kwargs) -> None:
    """``model.save_pretrained(out, safe_serialization=True, **kwargs)`` with ``config.json`` in
    transformers 4's spelling, as the published checkpoints these tiny models stand in for are
    written: transformers 5 would write its own (``rope_parameters``, renamed fields), which
    every family reads too (:mod:`porting.contract.hf_spelling`) and ``tests/test_hf_v5.py``
    proves for every architecture from its own saves, but which the tests' config edits, spelled
    as published configs are, would contradict. Under transformers 4 nothing changes. No
    progress bar: transformers 5 draws one per save."""
    import json

    from transformers.utils import logging as hf_logging

    from porting.contract import hf_spelling

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(out), safe_serialization=True, **kwargs)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    path = Path(out) / "config.json"
    cfg = json.loads(path.read_text())
    if hf_spelling.is_v5(cfg):
        path.write_text(json.dumps(hf_spelling.internal(cfg, str(path)), indent=2) + "\n")


def make_tokenizer(out_dir: str | Path, vocab_size: int = 120):
    """Train a tiny byte-level BPE on :data:`CORPUS` and save it as an HF fast tokenizer.

    BOS is added by the post-processor, as in Llama-style tokenizers.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<pad>"],
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(str(out_dir))
    return fast


@torch.no_grad()
def perturb(model: torch.nn.Module, seed: int = 0) -> None:
    """Move every norm weight and bias away from its init (1.0 / 0.0) deterministically."""
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if "norm" in name or name.endswith(".bias"):
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype))


def make_llama(
    out_dir: str | Path,
    *,
    vocab_size: int = 130,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 97,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    bias: bool = False,
    head_dim: int | None = None,
    max_position_embeddings: int = 256,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    max_shard_size: str | None = None,
    tokenizer_vocab: int = 120,
) -> Path:
    """Save a tiny random ``LlamaForCausalLM`` plus tokenizer at ``out_dir``; return the path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(out, vocab_size=tokenizer_vocab)
    kwargs = {"head_dim": head_dim} if head_dim else {}
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta,
        # transformers 5 adds rope_theta to the object it is given: the caller's constant stays
        rope_scaling=copy.deepcopy(rope_scaling),
        tie_word_embeddings=tie_word_embeddings,
        attention_bias=bias,
        mlp_bias=bias,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **kwargs,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    perturb(model, seed)
    model = model.to(dtype)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    save_as_published(model, out, **save_kwargs)
    return out


# The Falcon layouts the tests and scripts/gpu/check.py build (make_falcon's switches); the
# first four are released models' layouts.
FALCON_VARIANTS = {
    # falcon-7b: MQA, parallel block with one shared norm, tied output; odd FFN
    "7b_mqa": dict(),
    # falcon-40b / 180B: new decoder architecture, GQA, parallel block with two norms
    "40b_gqa_two_norms": dict(new_decoder_architecture=True, num_kv_heads=2, ffn_hidden_size=98),
    # falcon-11B: new decoder architecture with one norm, untied output, large rope_theta
    "11b_gqa_one_norm_untied": dict(
        new_decoder_architecture=True,
        num_kv_heads=2,
        num_ln_in_parallel_attn=1,
        tie_word_embeddings=False,
        rope_theta=500042.0,
        ffn_hidden_size=98,
    ),
    # falcon-rw: sequential block, MHA with ALiBi, biases everywhere; 6 heads so that ALiBi's
    # slopes for a head count that is not a power of two are exercised (and split under TP=2)
    "rw_alibi_biases": dict(
        alibi=True,
        parallel_attn=False,
        multi_query=False,
        bias=True,
        hidden_size=96,
        num_heads=6,
        ffn_hidden_size=98,
    ),
    # not a released layout, but transformers runs it: ALiBi in the 7B parallel MQA block
    "alibi_parallel_mqa": dict(alibi=True),
}
RELEASED_FALCON_LAYOUTS = (
    "7b_mqa",
    "40b_gqa_two_norms",
    "11b_gqa_one_norm_untied",
    "rw_alibi_biases",
)


def quantize_hf_dir(
    path: str | Path, scale_dtype: str = "float32", max_shard_bytes: int = 4 * 2**30
) -> Path:
    """Rewrite an HF directory's weights as a quantized release ships them, by its
    ``config.json``'s ``quantization_config`` (:mod:`porting.convert.quant`), one tensor at a
    time (the benchmarks' real-width checkpoints pass through here too).

    ``fp8``: every weight transformers' FP8 loader converts (each ``nn.Linear`` but ``lm_head`` and
    ``modules_to_not_convert``) as ``float8_e4m3fn`` with a ``weight_scale_inv`` per block, in
    ``scale_dtype`` (DeepSeek-V3: float32; the FP8 Qwen3 releases: bfloat16). ``mxfp4``: the
    gpt-oss experts' ``mlp.experts.gate_up_proj`` / ``down_proj`` (``[E, in, out]``) as
    ``*_blocks`` (two E2M1 codes a byte, low nibble first) and ``*_scales`` (the block's exponent
    + 127), grouped along ``in`` as ``convert_moe_packed_tensors`` reads them.
    """
    import json
    import math
    import shutil

    import transformers

    from porting.contract.quantization import FP8, UE8M0, read_quantization
    from porting.convert import quant
    from porting.convert.safetensors_io import SAFE_INDEX, SafetensorsSource, StreamingShardWriter

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    method = read_quantization(config, str(path / "config.json"))
    if method is None:
        raise ValueError(f"{path}/config.json has no quantization_config")
    source = SafetensorsSource(path)  # nothing quantized yet: every tensor is itself
    targets: set[str] = set()
    experts = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    if method.method == FP8:
        cls = getattr(transformers, config["architectures"][0])
        targets = quant.fp8_targets(cls, config, source.keys())
    else:
        targets = {k for k in source.keys() if k.endswith(experts)}
    scale = getattr(torch, scale_dtype)
    specs = []
    for key in source.keys():
        (shape, _), (stored, _) = source.shape(key), source.stored_dtype(key)
        dtype = getattr(torch, quant.FLOAT_NAMES[stored])
        if key not in targets:
            specs.append((key, shape, dtype))
        elif method.method == FP8:
            blocks = tuple(math.ceil(d / b) for d, b in zip(shape, method.block, strict=True))
            specs += [(key, shape, torch.float8_e4m3fn), (key + quant.SCALE_SUFFIX, blocks, scale)]
        else:
            n, k, rows = shape
            groups = k // quant.MXFP4_BLOCK
            specs += [
                (key + quant.BLOCKS, (n, rows, groups, quant.MXFP4_BLOCK // 2), torch.uint8),
                (key + quant.SCALES, (n, rows, groups), torch.uint8),
            ]
    staging = path / ".quantized"
    staging.mkdir()
    writer = StreamingShardWriter(staging, specs, max_shard_bytes)
    for key in source.keys():
        t = source.get(key)
        if key not in targets:
            writer.write(key, t)
        elif method.method == FP8:
            q, s = quant.quantize_fp8_block(t, method.block, method.scale_fmt == UE8M0)
            writer.write(key, q)
            writer.write(key + quant.SCALE_SUFFIX, s.to(scale))
        else:
            b, s = _mxfp4_pack(t)
            writer.write(key + quant.BLOCKS, b)
            writer.write(key + quant.SCALES, s)
        del t
    written = writer.close()
    for old in [*path.glob("*.safetensors"), path / SAFE_INDEX]:
        old.unlink(missing_ok=True)
    for new in [*written, staging / SAFE_INDEX]:
        if new.exists():
            new.rename(path / new.name)
    shutil.rmtree(staging)
    return path


def _mxfp4_pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[E, K, R]`` as MXFP4 blocks ``[E, R, K / 32, 16]`` and scales
    ``[E, R, K / 32]``: each block of 32 along ``K`` scaled by the power of two that brings its
    largest magnitude to at most 6, every value rounded to the nearest E2M1 code. One expert at a
    time: the nearest-code search holds eight float32 copies of what it packs."""
    from porting.convert.quant import MXFP4_BIAS, MXFP4_BLOCK

    n, k, rows = weight.shape
    if k % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 groups {MXFP4_BLOCK} values; {k} is not a multiple")
    magnitudes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    blocks = torch.empty(n, rows, k // MXFP4_BLOCK, MXFP4_BLOCK // 2, dtype=torch.uint8)
    scales = torch.empty(n, rows, k // MXFP4_BLOCK, dtype=torch.uint8)
    for e in range(n):
        w = weight[e].to(torch.float32).T.reshape(rows, k // MXFP4_BLOCK, MXFP4_BLOCK)
        amax = w.abs().amax(dim=-1)
        exp = torch.ceil(torch.log2(torch.clamp(amax, min=2.0**-120) / 6.0)).clamp(-127, 127)
        scaled = w / torch.exp2(exp).unsqueeze(-1)
        code = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)
        code = (code | torch.where(scaled < 0, 8, 0)).to(torch.uint8)
        blocks[e] = code[..., 0::2] | (code[..., 1::2] << 4)
        scales[e] = (exp + MXFP4_BIAS).to(torch.uint8)
    return blocks, scales


def make_falcon(
    out_dir: str | Path,
    *,
    vocab_size: int = 130,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    ffn_hidden_size: int = 97,
    multi_query: bool = True,
    new_decoder_architecture: bool = False,
    parallel_attn: bool = True,
    num_ln_in_parallel_attn: int | None = None,
    alibi: bool = False,
    bias: bool = False,
    tie_word_embeddings: bool = True,
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 256,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    tokenizer_vocab: int = 120,
) -> Path:
    """Save a tiny random ``FalconForCausalLM`` plus tokenizer at ``out_dir``; return the path.

    The defaults are the 7B layout (MQA, parallel block with one shared norm, tied output); the
    switches are ``transformers``' ``FalconConfig`` fields of the same names.
    """
    from transformers import FalconConfig, FalconForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(out, vocab_size=tokenizer_vocab)
    config = FalconConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_kv_heads=num_kv_heads,
        ffn_hidden_size=ffn_hidden_size,
        multi_query=multi_query,
        new_decoder_architecture=new_decoder_architecture,
        parallel_attn=parallel_attn,
        num_ln_in_parallel_attn=num_ln_in_parallel_attn,
        alibi=alibi,
        bias=bias,
        tie_word_embeddings=tie_word_embeddings,
        rope_theta=rope_theta,
        max_position_embeddings=max_position_embeddings,
        layer_norm_epsilon=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = FalconForCausalLM(config)
    perturb(model, seed)
    # perturb() finds norm weights by name; Falcon's ln_attn, ln_mlp and ln_f need a hand
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.LayerNorm) and "norm" not in name:
                module.weight.add_(0.2 * torch.randn(module.weight.shape, generator=g))
    model = model.to(dtype)
    save_as_published(model, out)
    return out


def with_edited_manifest(src: str | Path, dst: str | Path, edit) -> Path:
    """A copy of our nemo2 checkpoint ``src`` at ``dst`` whose ``porting.json`` (parsed) went
    through ``edit`` (a function that changes the dict in place): a crafted or lying manifest."""
    import json
    import shutil

    shutil.copytree(src, dst)
    manifest = Path(dst) / "context" / "porting.json"
    data = json.loads(manifest.read_text())
    edit(data)
    manifest.write_text(json.dumps(data))
    return Path(dst)


def checkpoint_config(ckpt: str | Path):
    """The Megatron config of one of our checkpoints (its family looked up from the manifest)."""
    from porting.contract.registry import family_by_name
    from porting.convert.checkpoint import open_checkpoint
    from porting.convert.megatron import checkpoint_config as config_of

    checkpoint = open_checkpoint(ckpt)
    return config_of(checkpoint, family_by_name(checkpoint.family))


def load_checkpoint_model(ckpt: str | Path, dtype: torch.dtype | None = None):
    """``(mcore_model, config)`` of one of our checkpoints; the parallel state must exist."""
    from porting.contract.registry import family_by_name
    from porting.convert.checkpoint import open_checkpoint
    from porting.convert.megatron import load_mcore_from_checkpoint

    checkpoint = open_checkpoint(ckpt)
    return load_mcore_from_checkpoint(checkpoint, family_by_name(checkpoint.family), dtype)


def assert_streamed_agrees(hf_dir, ckpt, family, prompts, hf, mc, atol: float = 1e-6) -> None:
    """The layer-streamed check gives the whole-model logits ``hf``/``mc`` within ``atol``,
    the same verdict, and no diverging layer, at its finest grain (each layer read a module at a
    time, each vocabulary table a few rows at a time: ``porting.parity.streamed.finest_grain``);
    the default grain is what the imports' gates run."""
    from porting.parity.harness import compare
    from porting.parity.streamed import finest_grain, streamed_logits

    vocab = hf[0].shape[-1]
    with finest_grain():
        hf_s, mc_s, layers, _cost, _mtp = streamed_logits(hf_dir, ckpt, family, prompts, vocab)
    for streamed, whole in zip(hf_s + mc_s, hf + mc, strict=True):
        torch.testing.assert_close(streamed, whole, atol=atol, rtol=0)
    assert compare(hf_s, mc_s).passed == compare(hf, mc).passed
    assert [d.layer for d in layers if d.diverges] == []


def make_indexed_dataset(
    prefix: str | Path, tokenizer, texts: list[str], append_eod: bool = True
) -> Path:
    """Write ``texts`` tokenized by ``tokenizer`` as a Megatron ``.bin/.idx`` pair at ``prefix``."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    for text in texts:
        ids = tokenizer(text)["input_ids"] + ([tokenizer.eos_token_id] if append_eod else [])
        builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
    builder.finalize(str(prefix) + ".idx")
    return prefix


# Every line our commands print, as patterns: log lines of our packages, the parity report, the
# demo's table, prep-data's summary, train's closing line. A line matching none of them came from a
# library, and the quiet-output tests fail on it.
OWN_OUTPUT_PATTERNS = (
    r"(INFO|WARNING|ERROR) (porting|data_prep|converters|models)[.:]",  # with -v
    # our log records, as porting.cli prints them (no logger prefix): training, prep-data, outputs
    r"(warning|error): ",
    r"step \d+/\d+  loss ",
    r"saved checkpoint \S",
    r"tokenizer \S+ \(\w+, backend \w+, vocab \d+, eod \S+, dtype \w+\); \d+ input\(s\)$",
    r"(resuming|replacing) ",
    r"unit \d+ of \S+ is incomplete",
    r"removing \S+, left by an earlier run",
    r"porting [a-z-]+: error: ",
    r"parity (PASS|FAIL): \d+ prompts",
    r"  (max \|dlogit\||mean \|dlogit\||KL\(HF\|\|Mcore\)|top-1 agree|layers|first divergence|gate|ranks) ",
    r"wrote \S",
    # the import's own lines (porting.convert.connectors): a config note, and its summary
    r"\S*config\.json: ",
    r"imported .+ \(\S+, \w+(; \d+ \w+ weights dequantized)?\): \d+ HF tensors -> \d+ Megatron "
    r"parameters, \d+ ignored$",
    r"(export|import) \(\S+ -> \S+\):$",
    r"done: checkpoints in ",
    r"submitted Slurm job \d+ \(\d+ nodes\); log \S",
    r"submitted Slurm job \d+ \(\d+ nodes?, \d+ ranks? each\); log \S+$",
    r"submitted Slurm jobs (\d+|\(no unit left\)) \(units\) and \d+ \(merge\); logs in \S",
    r"Slurm requeued job \d+ \(restart \d+\): ",
    r"porting demo: |              tiny |step +seconds$|check +result$|(OK|FAILED): outputs in ",
    r"[a-z][\w :+()|%-]*? {2,}[-+\d.e%/]+$",
    r"\S+\.bin/\.idx(/\.prov)?  \w+: \d+ documents",
    r"records \d+, skipped \d+",
    r"checkpoint \S+: every id < \d+",
    r"tokenizer \S+ \(\w+, \w+\); decode\(encode\(text\)\)",
    r"  e\.g\. ",
    r"[\d.]+ s, [\d.]+ MB/s, [\d.]+ Mtok/s( \([\d.]+ per core\))?; report ",
)


def foreign_lines(output: str) -> list[str]:
    """The non-empty lines of ``output`` that match none of :data:`OWN_OUTPUT_PATTERNS`."""
    import re

    own = re.compile("|".join(f"(?:{p})" for p in OWN_OUTPUT_PATTERNS))
    return [line for line in output.splitlines() if line.strip() and not own.match(line)]


#: The training tests' corpus: one sentence repeated, which a tiny model learns within 24 steps.
TRAIN_TEXT = "The quick brown fox jumps over the lazy dog. Hello world, hello NeMo."


def child_env(**extra: str) -> dict:
    """The environment for a `porting` child of a test: the test process's own rendezvous port
    (``MASTER_ADDR``/``MASTER_PORT``) left out, so the child picks a fresh one."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    return env | {"PYTHONUNBUFFERED": "1"} | extra


def run_owners(argv: list[str], timeout: float = 600):
    """``python ARGV`` on the current stack, where the owners' loaders live (``.venv``: Python
    3.12, Megatron-Core 0.19, Megatron-Bridge, transformers 5; built by ``scripts/env.sh``), with
    this checkout first on its path and no GPU; the completed process, which must have
    succeeded. From a test on the NeMo 2 stack this is the other environment."""
    import os
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    python = repo / ".venv" / "bin" / "python"
    if not python.exists():
        raise AssertionError(f"{python} missing: `scripts/env.sh test` builds the current stack")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env |= {"PYTHONPATH": str(repo), "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(
        [str(python), *argv], capture_output=True, text=True, timeout=timeout, env=env, cwd=repo
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    return run


#: The tiny training runs' shape, shared by the tests of ``porting train``.
TINY_TRAIN = ("--seq-length", "32", "--micro-batch", "2", "--global-batch", "4", "--lr", "1e-2")


def porting_train(ckpt, data, out, *extra: str, timeout: float = 600):
    """``porting train`` of ``ckpt`` on ``data`` into ``out`` with ``extra`` and
    :data:`TINY_TRAIN`, run to its end in a session of its own (:func:`run_in_session`)."""
    import sys

    argv = [
        sys.executable, "-m", "porting.cli", "train", "--checkpoint", str(ckpt),
        "--data", str(data), "--out", str(out), *extra, *TINY_TRAIN,
    ]  # fmt: skip
    return run_in_session(argv, timeout)


def run_in_session(argv: list[str], timeout: float, env: dict | None = None):
    """Run ``argv`` to its end in a session of its own; past ``timeout`` the whole group is
    killed and an ``AssertionError`` says so (a hang fails a test and leaves no process)."""
    import os
    import signal
    import subprocess

    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env or child_env(),
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"ran past {timeout} s: {argv}\n{(stdout + stderr)[-3000:]}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def checkpoint_complete(out: Path) -> bool:
    """Whether the `porting train` run directory ``out`` holds a complete checkpoint: a ``*-last``
    one (NeMo 2), or an iteration that Megatron-Bridge's tracker file names (written after a save)."""
    if (Path(out) / "checkpoints" / "latest_checkpointed_iteration.txt").exists():
        return True
    return any(
        (p / "context" / "train_layout.json").exists()
        and not p.with_name(p.name + "-unfinished").exists()
        for p in (Path(out) / "checkpoints").glob("step=*-last")
    )


def signal_at_first_checkpoint(
    argv: list[str], out: Path, sig: int, timeout: float, env: dict | None = None
):
    """Start the `porting train` command ``argv`` (run directory ``out``) in a session of its
    own, send ``sig`` to the whole group once a checkpoint is complete (SIGKILL: what a node
    failure does; SIGTERM: a scheduler; SIGINT: Ctrl-C) and wait for it to end. Returns the
    ``CompletedProcess`` (output captured); fails if the run ended first or outlived ``timeout``.
    ``env`` defaults to :func:`child_env`."""
    import os
    import signal
    import subprocess
    import time

    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=env or child_env(),
        # as started from a terminal: a suite run as a background job inherits SIGINT ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + timeout
    try:
        while time.time() < deadline and proc.poll() is None and not checkpoint_complete(out):
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be stopped"
        os.killpg(proc.pid, sig)
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def kill_at_first_checkpoint(
    argv: list[str], out: Path, timeout: float, env: dict | None = None
) -> None:
    """SIGKILL the `porting train` run ``argv`` as soon as a checkpoint is complete (``env``:
    as :func:`signal_at_first_checkpoint`)."""
    import signal

    r = signal_at_first_checkpoint(argv, out, signal.SIGKILL, timeout, env)
    assert r.returncode == -signal.SIGKILL, "the run ended before it could be killed"


def processes_mentioning(text: str, grace: float = 0.0) -> list[str]:
    """Command lines of live processes (not this one, not zombies) that mention ``text``, after
    waiting up to ``grace`` seconds for them to end (a child learns of its parent's end late)."""
    import os
    import time

    deadline = time.monotonic() + grace
    while True:
        found = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if text in cmd and state != "Z":
                found.append(f"{pid}: {cmd[:200]}")
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)


def cpu_cluster(path: Path, name: str, gpus_per_site: dict[str, int]) -> Path:
    """A ``porting plan --cluster`` file whose devices are this machine's CPU processes: one node
    per site with that many devices, the sites (where more than one) joined by a 1 Gbit/s,
    1 ms link. Written to ``path``; returns it."""
    import yaml

    spec = {
        "name": name,
        "gpu": {"name": "cpu", "peak_bf16_tflops": 1, "memory_gib": 16, "hbm_tbytes_s": 0.05},
        "node": {"bandwidth_gbytes_s": 10, "latency_us": 5},
        "site": {"bandwidth_gbit_s": 10, "latency_us": 10},
        "sites": [{"name": s, "nodes": 1, "gpus_per_node": n} for s, n in gpus_per_site.items()],
    }
    if len(gpus_per_site) > 1:
        spec["links"] = [{"sites": list(gpus_per_site)[:2], "bandwidth_gbit_s": 1, "rtt_ms": 1}]
    path.write_text(yaml.safe_dump(spec))
    return path


def h100_cluster(directory: Path, nodes: int) -> Path:
    """A ``porting plan --cluster`` file of one site of ``nodes`` DGX H100s (NVIDIA's Eos as MoE
    Parallel Folding describes it: 989.5 TFLOP/s, 80 GiB, NVLink 450 GB/s a direction, a 400
    Gb/s InfiniBand NIC per GPU), the machine of the published runs the planner is checked
    against. Written into ``directory``; returns its path."""
    path = Path(directory) / f"eos-{nodes}.yaml"
    path.write_text(
        f"name: eos-{nodes}\n"
        "gpu: {name: H100, peak_bf16_tflops: 989.5, memory_gib: 80, hbm_tbytes_s: 3.35}\n"
        "node: {bandwidth_gbytes_s: 450, latency_us: 3}\n"
        "site: {bandwidth_gbit_s: 400, latency_us: 5}\n"
        f"sites:\n  - {{name: eos, nodes: {nodes}, gpus_per_node: 8}}\n"
    )
    return path


def train_losses(out: Path) -> dict[int, float]:
    """step -> ``reduced_train_loss`` from every metrics.csv of a `porting train` run directory
    (each restart writes its own)."""
    import csv

    losses = {}
    for f in sorted(Path(out).rglob("metrics.csv")):
        with open(f) as fh:
            for row in csv.DictReader(fh):
                if row.get("reduced_train_loss") and row.get("global_step"):
                    losses[int(float(row["global_step"]))] = float(row["reduced_train_loss"])
    return losses


def still_running(pids, grace: float) -> list[int]:
    """The processes of ``pids`` still running (zombies aside) after waiting up to ``grace``
    seconds: a child learns that its parent ended only when a pipe closes, a moment later."""
    import contextlib
    import time

    import psutil

    deadline = time.monotonic() + grace
    while True:
        alive = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)


class Hang(Exception):
    """A test's command gave no answer within its time."""


@contextlib.contextmanager
def no_hang(seconds: int = 120):
    """Fail instead of blocking forever (an ``open()`` of a FIFO waits for a writer; a hostile
    file that costs exponential time): main thread only, through SIGALRM."""

    def alarm(signum, frame):
        raise Hang(f"no answer within {seconds} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def checkpoint_tensors(ckpt: Path) -> dict:
    """Every tensor of a NeMo checkpoint's torch_dist weights, whole, by key."""
    from porting.convert.dist_reader import DistCheckpointReader

    reader = DistCheckpointReader(ckpt / "weights")
    out = {}
    for key in reader.keys():
        shape = reader.global_shape(key)
        if shape is not None:
            out[key] = reader.read(key, (0,) * len(shape), tuple(shape))
    return out


def assert_same_checkpoint(one: Path, two: Path) -> None:
    """``two`` (written by several ranks) holds ``one``'s tensors bit for bit, its context and
    metadata byte for byte, one ``.metadata``, and files written by ranks 0 and 1."""
    import torch

    a, b = checkpoint_tensors(one), checkpoint_tensors(two)
    assert a.keys() == b.keys() and a
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    for sub in ("context", "weights/metadata.json"):
        left, right = one / sub, two / sub
        files = sorted(p.relative_to(left) for p in left.rglob("*")) if left.is_dir() else [""]
        for f in files:
            if (left / f).is_file():
                assert (left / f).read_bytes() == (right / f).read_bytes(), f"{sub}/{f}"
    weights = sorted(p.name for p in (two / "weights").iterdir())
    assert weights.count(".metadata") == 1
    # both ranks wrote: Megatron names a rank's files __RANK_N.distcp
    for rank in (0, 1):
        mine = [w for w in weights if w.startswith(f"__{rank}_")]
        assert mine and all((two / "weights" / w).stat().st_size > 0 for w in mine), weights


def on_a_small_disk(size: str, argv: list[str], out: Path) -> tuple[int, str, list[str]]:
    """Run ``argv`` with ``out``'s parent a tmpfs of ``size`` (a mount namespace of its own:
    ``unshare``, as root or, elsewhere, through a user namespace); returns the exit status, the
    stderr and what the command left on the small disk."""
    import os
    import shutil
    import subprocess

    disk = out.parent
    disk.mkdir(parents=True, exist_ok=True)
    unshare = shutil.which("unshare")
    assert unshare, "unshare (util-linux) is needed to give a command a small disk"
    script = (
        'mount -t tmpfs -o size="$0" tmpfs "$1" || exit 99; shift; "$@"; rc=$?; '
        'echo "LEFT: $(ls -A "$DISK" | tr "\\n" " ")" >&2; exit $rc'
    )
    wrap = [unshare, "--mount", "--propagation", "private"]
    if os.geteuid() != 0:
        wrap.insert(1, "--map-root-user")
    r = subprocess.run(
        [*wrap, "sh", "-c", script, size, str(disk), *argv],
        capture_output=True,
        text=True,
        env=child_env(DISK=str(disk)),
        timeout=600,
    )
    assert r.returncode != 99, f"cannot mount a tmpfs here: {r.stderr[-2000:]}"
    left = r.stderr.rsplit("LEFT:", 1)[1].split()
    return r.returncode, r.stderr.rsplit("LEFT:", 1)[0], left
