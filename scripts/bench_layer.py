"""Benchmark: forward + backward of Falcon's custom Megatron layers vs the stock sequential GPT layer.

Every layer is built at the same sizes from the same config (LayerNorm, ungated GELU MLP, GQA,
fp32), so all do the same matmuls; the parallel layers apply one extra LayerNorm (the shared-norm
one re-normalises the input for the MLP) and ALiBi adds one bias tensor to the scores. Time per
FLOP relative to the stock layer is therefore the cost of the custom code. Measurements of the
layers are interleaved round by round so that load from other processes hits all of them alike;
the median and the minimum are reported (the CPU machines here are shared; the minimum is the
least disturbed run).

    python scripts/bench_layer.py [--hidden 1024] [--seq 512] [--batch 2] [--rounds 7]
    python scripts/bench_layer.py --device cuda --dtype bf16   # a GPU (local spec; Megatron-Core
                                                               # alone, no NeMo or TE needed)
"""

from __future__ import annotations

import argparse
import statistics
import time


def layer_flops(hidden: int, ffn: int, heads: int, groups: int, seq: int, batch: int) -> float:
    """Matmul FLOPs of one layer's forward + backward (backward = 2 x forward)."""
    head_dim = hidden // heads
    qkv = hidden * (heads + 2 * groups) * head_dim
    params = qkv + hidden * hidden + 2 * hidden * ffn
    tokens = seq * batch
    # causal or not, the dense kernels compute the full s x s score and context products
    attention = 2 * 2 * batch * seq * seq * hidden
    return 3 * (2 * tokens * params + attention)


def layer_config(args, dtype, cpu_init: bool):
    """One layer's ``TransformerConfig`` with Falcon's settings (as ``models.falcon.FalconConfig``
    sets them) and the sizes in ``args`` (hidden, heads, groups, ffn).

    A plain Megatron-Core config, so that these scripts need no NeMo. Fusions that need
    Transformer Engine or Apex kernels are off where TE is absent; every layer gets this config.
    """
    import dataclasses

    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    from models.falcon_spec import HAVE_TE
    from porting.cpu import CUDA_ONLY_FUSIONS

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    unfused = {} if HAVE_TE else {n: False for n in CUDA_ONLY_FUSIONS if n in fields}
    settings = dict(
        num_layers=1,
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn,
        num_attention_heads=args.heads,
        num_query_groups=args.groups,
        normalization="LayerNorm",
        activation_func=F.gelu,
        gated_linear_unit=False,
        add_bias_linear=True,
        bias_activation_fusion=False,  # Falcon's GELU is the exact erf one
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=cpu_init,
    )
    return TransformerConfig(**{**settings, **unfused})


def layer_cases() -> dict:
    """The stock GPT layer and each Falcon block: name -> (local layer spec, takes rotary)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from models.falcon_block import FalconBlock
    from models.falcon_spec import build_falcon_layer_spec

    def falcon(block: FalconBlock, alibi: bool):
        return build_falcon_layer_spec(block, alibi=alibi, use_te=False)

    return {
        "stock GPT layer (sequential, rotary)": (get_gpt_layer_local_spec(), True),
        "Falcon parallel, shared norm (7B/11B)": (
            falcon(FalconBlock.PARALLEL_SHARED_NORM, False),
            True,
        ),
        "Falcon parallel, two norms (40B/180B)": (
            falcon(FalconBlock.PARALLEL_TWO_NORMS, False),
            True,
        ),
        "Falcon sequential + ALiBi (RW)": (falcon(FalconBlock.SEQUENTIAL, True), False),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--groups", type=int, default=4, help="KV heads (query groups)")
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument(
        "--threads", type=int, default=1, help="CPU threads (1: least sensitive to other load)"
    )
    args = p.parse_args()

    import torch
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.spec_utils import build_module

    from porting.convert.megatron import init_parallel, shutdown_parallel

    init_parallel()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    # On the CPU the clock is this process's CPU time: other processes on a shared machine then
    # cost nothing but cache and memory bandwidth. On a GPU it is wall time between synchronisations.
    clock = time.perf_counter if args.device == "cuda" else time.process_time
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]

    cfg = layer_config(args, dtype, cpu_init=args.device == "cpu")
    cases = layer_cases()
    layers = {}
    for name, (spec, rotary) in cases.items():
        # Whole-module cast, as Megatron's Float16Module does for bf16 training (its local
        # LayerNorm is created in fp32 whatever params_dtype says).
        layer = build_module(spec, config=cfg, layer_number=1).to(device=device, dtype=dtype)
        rope = None
        if rotary:
            rope = RotaryEmbedding(cfg.kv_channels, rotary_percent=1.0)(args.seq).to(device)
        layers[name] = (layer, rope)

    x = torch.randn(args.seq, args.batch, args.hidden, device=device, dtype=dtype)

    def step(layer, rope) -> float:
        inp = x.detach().requires_grad_()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = clock()
        out, _ = layer(hidden_states=inp, attention_mask=None, rotary_pos_emb=rope)
        out.sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return clock() - t

    for layer, rope in layers.values():  # warm-up: allocator, kernels, caches
        step(layer, rope)
    times: dict[str, list[float]] = {name: [] for name in layers}
    names = list(layers)
    for r in range(args.rounds):
        # rotate the order each round so that no layer always runs first (or after the same one)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(step(*layers[name]))

    flops = layer_flops(args.hidden, args.ffn, args.heads, args.groups, args.seq, args.batch)
    base = statistics.median(times["stock GPT layer (sequential, rotary)"])
    print(
        f"device {args.device} ({'wall' if args.device == 'cuda' else 'process CPU'} time), "
        f"torch threads {torch.get_num_threads()}, {args.dtype}; hidden {args.hidden}, "
        f"heads {args.heads}/{args.groups} KV, ffn {args.ffn}, seq {args.seq}, batch "
        f"{args.batch}; {flops / 1e9:.1f} GFLOP per forward+backward; median of {args.rounds}"
    )
    base_min = min(times["stock GPT layer (sequential, rotary)"])
    print(
        f"{'layer':<40}{'median ms':>10}{'GFLOP/s':>9}{'vs stock':>9}{'min ms':>9}{'vs stock':>9}"
    )
    for name, ts in times.items():
        med, best = statistics.median(ts), min(ts)
        print(
            f"{name:<40}{1e3 * med:>10.1f}{flops / med / 1e9:>9.1f}{med / base:>8.3f}x"
            f"{1e3 * best:>9.1f}{best / base_min:>8.3f}x"
        )

    shutdown_parallel()


if __name__ == "__main__":
    main()
