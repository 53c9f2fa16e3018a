"""Benchmark: `porting import` vs NeMo's own HFLlamaImporter on a ~1B-parameter checkpoint.

Builds a random tsuzumi-style (Llama layout) HF checkpoint of about 1B parameters on disk (fp32:
NeMo 2.7.3's importer fails outright on bf16 without Transformer Engine), then imports it twice,
each in a fresh process: with `porting import --no-verify` and with
`llm.import_ckpt(model=llm.LlamaModel(...))`. Prints wall time and peak RSS of each and the ratios.

NeMo's output is not a correct model on this stack: without Transformer Engine its importer leaves
every per-layer norm weight at 1.0 (a warning is all it prints), which our importer's completeness
accounting would refuse. The comparison is of cost only.

    python scripts/bench_import.py [--workdir /tmp/porting-bench] [--layers 18]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path


def build_checkpoint(
    out: Path, layers: int, hidden: int, ffn: int, heads: int, kv: int, vocab: int
) -> int:
    """Write random fp32 weights shard by shard (never a whole model in memory); return #params."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from porting.testing import make_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out, vocab_size=120)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        torch_dtype="float32",
    )
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    shard, shard_bytes, shards, weight_map = {}, 0, [], {}

    def flush():
        nonlocal shard, shard_bytes
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        shards.append(name)
        weight_map.update({k: name for k in shard})
        shard, shard_bytes = {}, 0

    total = 0
    for key, shape in shapes.items():
        t = torch.empty(shape)
        if "norm" in key:
            t.normal_(1.0, 0.1, generator=g)
        else:
            t.normal_(0.0, 0.02, generator=g)
        shard[key] = t
        shard_bytes += t.numel() * 4
        total += t.numel()
        if shard_bytes > 2 * 2**30:
            flush()
    if shard:
        flush()
    n = len(shards)
    renamed = {}
    for i, name in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        (out / name).rename(out / final)
        renamed[name] = final
    index = {
        "metadata": {"total_size": total * 4},
        "weight_map": {k: renamed[v] for k, v in weight_map.items()},
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(str(out))
    return total


def child(which: str, hf: Path, out: Path) -> None:
    """Run one import in this process and print wall seconds and peak RSS (self + children) as JSON."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    t0 = time.perf_counter()
    if which == "porting":
        from porting.cli import main

        code = main(["import", str(hf), "--out", str(out), "--no-verify"])
        if code:
            sys.exit(code)
    elif which == "porting-verified":
        from porting.cli import main

        code = main(["import", str(hf), "--out", str(out)])
        if code:
            sys.exit(code)
    else:
        from nemo.collections import llm
        from nemo.collections.llm.gpt.model.base import GPTConfig
        from nemo.collections.llm.gpt.model.llama import LlamaConfig

        from porting import cpu

        cpu.enable()
        cpu.ensure_rendezvous_env()

        # NeMo's LlamaConfig turns CUDA-only fusions on; off here so that it constructs on the CPU.
        def post_init(self):
            cpu.kernel_safe_config(self)
            GPTConfig.__post_init__(self)

        LlamaConfig.__post_init__ = post_init
        # The importer builds its config from the HF directory; this one only selects the class.
        placeholder = LlamaConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
        llm.import_ckpt(model=llm.LlamaModel(placeholder), source=f"hf://{hf}", output_path=out)
    wall = time.perf_counter() - t0
    rss = max(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
    )
    print("BENCH " + json.dumps({"wall_s": wall, "peak_rss_gib": rss / 2**20}))


def run_child(which: str, hf: Path, out: Path) -> dict:
    if out.exists():
        shutil.rmtree(out)
    proc = subprocess.run(
        [sys.executable, __file__, "--child", which, "--hf", str(hf), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH "):
            return json.loads(line[6:])
    sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
    raise SystemExit(f"{which} import failed (exit {proc.returncode})")


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workdir", type=Path, default=Path("/tmp/porting-bench"))
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument(
        "--with-verify", action="store_true", help="also time `porting import` with its parity gate"
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--hf", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.hf, args.out)
        return

    hf = args.workdir / "hf"
    if hf.exists():
        shutil.rmtree(hf)
    t = time.perf_counter()
    n = build_checkpoint(
        hf, args.layers, args.hidden, args.ffn, args.heads, args.kv_heads, args.vocab
    )
    print(
        f"built {n / 1e9:.2f}B-parameter fp32 checkpoint in {time.perf_counter() - t:.0f} s: {hf}"
    )
    results = {}
    for which in ["porting", "nemo"] + (["porting-verified"] if args.with_verify else []):
        results[which] = run_child(which, hf, args.workdir / f"out-{which}")
        print(f"  {which}: {results[which]}", flush=True)
        shutil.rmtree(args.workdir / f"out-{which}", ignore_errors=True)
    ours, theirs = results["porting"], results["nemo"]
    print()
    print(f"{'importer':<34}{'wall s':>9}{'peak RSS GiB':>14}")
    print(f"{'porting import --no-verify':<34}{ours['wall_s']:>9.1f}{ours['peak_rss_gib']:>14.2f}")
    print(f"{'NeMo HFLlamaImporter':<34}{theirs['wall_s']:>9.1f}{theirs['peak_rss_gib']:>14.2f}")
    if "porting-verified" in results:
        v = results["porting-verified"]
        print(
            f"{'porting import (with parity gate)':<34}{v['wall_s']:>9.1f}{v['peak_rss_gib']:>14.2f}"
        )
    print(
        f"{'ratio porting / NeMo':<34}{ours['wall_s'] / theirs['wall_s']:>9.2f}"
        f"{ours['peak_rss_gib'] / theirs['peak_rss_gib']:>14.2f}"
    )
    print("targets: wall <= 0.70, peak RSS <= 0.60 (NeMo's output has every layer norm at 1.0)")


if __name__ == "__main__":
    main()
