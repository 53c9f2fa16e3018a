"""Benchmark: training throughput (tokens/s) and model FLOPs utilisation per family spec.

For each registered family, builds a small random HF model locally, imports it with
`porting import`, then times forward + backward + AdamW steps of the Megatron model built from the
checkpoint (the same module `porting train` trains) on random token batches, on whatever device is
present (fp32 on the CPU, bf16 autocast on a GPU). MFU = achieved model FLOP/s over the device peak:
on the CPU the peak is measured here (a large fp32 matmul), on a GPU it is taken from
``--peak-tflops``.

Model FLOPs per token follow Narayanan et al. (SC'21, eq. 3) generalised to GQA and gated MLPs:
6 x (dense parameters) + 12 x layers x sequence x heads x head_dim (attention scores).

    python scripts/bench_train.py [--hidden 512 --layers 4 --seq 256 --batch 4 --steps 10]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch


def model_flops_per_token(config, vocab: int, seq: int) -> float:
    """Training FLOPs per token of a GPT-style model (forward + backward)."""
    h, layers = config.hidden_size, config.num_layers
    heads = config.num_attention_heads
    groups = config.num_query_groups or heads
    kv = config.kv_channels or h // heads
    mlp_mats = 3 if config.gated_linear_unit else 2
    attn = h * kv * (heads + 2 * groups) + heads * kv * h
    dense = layers * (attn + mlp_mats * config.ffn_hidden_size * h) + vocab * h
    return 6 * dense + 12 * layers * seq * heads * kv


def cpu_peak_flops(n: int = 2048, reps: int = 5) -> float:
    """Measured fp32 matmul FLOP/s of this machine (the CPU 'peak' for MFU)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - t)


def build(family: str, root: Path, args) -> Path:
    """A random HF checkpoint of ``family`` at ``root``; returns its directory."""
    from porting import testing

    common = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        max_position_embeddings=max(args.seq, 256),
    )
    if family == "tsuzumi":
        return testing.make_llama(root / family, intermediate_size=args.ffn, **common)
    if family == "falcon":
        # 40B layout (GQA, two norms, parallel block), GELU MLP of 4h: the same FLOPs per token
        # as the SwiGLU of 2/3 x 4h above.
        return testing.make_falcon(
            root / family,
            ffn_hidden_size=4 * args.hidden,
            new_decoder_architecture=True,
            multi_query=False,
            **common,
        )
    raise SystemExit(f"no benchmark builder for family {family}")


def bench(ckpt: Path, args, device: torch.device, peak: float) -> dict:
    from porting.convert.megatron import init_parallel, shutdown_parallel
    from porting.testing import load_checkpoint_model

    init_parallel()
    model, config = load_checkpoint_model(ckpt, dtype=torch.float32)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(device)
    pos = torch.arange(args.seq, device=device).unsqueeze(0).expand(args.batch, -1)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step():
        with autocast:
            loss = model(ids[:, :-1], pos, None, labels=ids[:, 1:]).float().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(args.steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t
    tokens = args.steps * args.batch * args.seq
    flops = model_flops_per_token(config, args.vocab, args.seq) * tokens
    shutdown_parallel()
    return {
        "tokens_per_s": tokens / elapsed,
        "mfu": flops / elapsed / peak,
        "step_s": elapsed / args.steps,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument(
        "--ffn", type=int, default=1376, help="tsuzumi FFN (SwiGLU: 2/3 of 4h, same FLOPs)"
    )
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument(
        "--peak-tflops", type=float, default=989.0, help="GPU peak (H100 SXM bf16 dense)"
    )
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from porting.api import import_hf

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peak = args.peak_tflops * 1e12 if device.type == "cuda" else cpu_peak_flops()
    # the stock spec and the Falcon spec at equal FLOPs per token: what this benchmark compares
    families = ["tsuzumi", "falcon"]
    root = Path(tempfile.mkdtemp(prefix="porting-bench-train-"))
    rows = []
    try:
        for fam in families:
            hf = build(fam, root, args)
            ckpt = root / f"{fam}-nemo"
            import_hf(hf, ckpt, verify=False, show_progress=False)
            rows.append((fam, bench(ckpt, args, device, peak)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print()
    print(
        f"device: {device.type} ({torch.cuda.get_device_name() if device.type == 'cuda' else f'{os.cpu_count()} cores'}), "
        f"peak {peak / 1e12:.2f} TFLOP/s {'(measured fp32 matmul)' if device.type == 'cpu' else '(given)'}"
    )
    print(
        f"model: hidden {args.hidden}, layers {args.layers}, heads {args.heads}, seq {args.seq}, batch {args.batch}"
    )
    print(f"{'family (spec)':<28}{'tokens/s':>12}{'step s':>10}{'MFU':>8}")
    for fam, r in rows:
        print(f"{fam:<28}{r['tokens_per_s']:>12.0f}{r['step_s']:>10.3f}{100 * r['mfu']:>7.1f}%")


if __name__ == "__main__":
    main()
