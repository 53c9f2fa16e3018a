"""Check: Falcon's custom Megatron layers compute the same function on an accelerator as on the CPU.

Builds the stock GPT layer and each Falcon block (:mod:`models.falcon_spec`, local spec) on the
CPU in fp32 (in a child process that sees no GPU), loads the very weights on the device, and runs
forward + backward of the same input there in fp32 and in bf16 (weights and activations). Prints, per layer, the largest
difference of the output and of the input gradient from the CPU fp32 result, relative to the
largest CPU value. On the device the CPU compatibility layer is a no-op, so this exercises the
code path GPU runs take. Needs Megatron-Core and torch only (no NeMo, no Transformer Engine).

    python scripts/check_layer_device.py [--device cuda] [--hidden 1024] [--seq 512]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--reference", metavar="PATH", help=argparse.SUPPRESS)
    args = p.parse_args()

    import torch
    from bench_layer import layer_cases, layer_config  # this script's directory
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.spec_utils import build_module

    from models.falcon_spec import HAVE_TE
    from porting.convert.megatron import init_parallel, shutdown_parallel

    if not args.reference:
        # The CPU side first, in a child that sees no GPU (Megatron's local attention takes its
        # buffers from the current CUDA device whenever there is one) and picks its own port.
        with tempfile.TemporaryDirectory() as tmp:
            ref_path = os.path.join(tmp, "reference.pt")
            subprocess.run(
                [sys.executable, __file__, "--reference", ref_path, *sys.argv[1:]],
                env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
                check=True,
            )
            saved = torch.load(ref_path, weights_only=True)

    init_parallel()
    torch.manual_seed(0)
    cases = layer_cases()

    def config(dtype):
        return layer_config(args, dtype, cpu_init=True)

    def run(layer, x, rope, device, dtype):
        inp = x.to(device=device, dtype=dtype).clone().requires_grad_()
        out, _ = layer(hidden_states=inp, attention_mask=None, rotary_pos_emb=rope)
        out.float().square().mean().backward()
        return out.detach().float().cpu(), inp.grad.float().cpu()

    if args.reference:
        x = torch.randn(args.seq, args.batch, args.hidden)
        rope = RotaryEmbedding(args.hidden // args.heads, rotary_percent=1.0)(args.seq)
        saved = {"x": x, "rope": rope}
        for name, (spec, rotary) in cases.items():
            layer = build_module(spec, config=config(torch.float32), layer_number=1)
            out, grad = run(layer, x, rope if rotary else None, "cpu", torch.float32)
            saved[name] = {"state": layer.state_dict(), "out": out, "grad": grad}
        torch.save(saved, args.reference)
        shutdown_parallel()
        return

    print(
        f"device {args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else ''}), "
        f"torch {torch.__version__}, TE {'yes' if HAVE_TE else 'no'}; hidden {args.hidden}, heads "
        f"{args.heads}/{args.groups} KV, ffn {args.ffn}, seq {args.seq}, batch {args.batch}; "
        "against the same layers, weights and input in fp32 on the CPU"
    )
    print(f"{'layer':<38}{'dtype':>6}{'max|dout|/max|out|':>20}{'max|dgrad|/max|grad|':>22}")
    for name, (spec, rotary) in cases.items():
        ref = saved[name]
        for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            layer = build_module(spec, config=config(dtype), layer_number=1)
            layer.load_state_dict(ref["state"])
            layer.to(device=args.device, dtype=dtype)  # as Float16Module casts for bf16
            rope = saved["rope"].to(args.device) if rotary else None
            out, grad = run(layer, saved["x"], rope, args.device, dtype)
            d_out = (out - ref["out"]).abs().max() / ref["out"].abs().max()
            d_grad = (grad - ref["grad"]).abs().max() / ref["grad"].abs().max()
            print(f"{name:<38}{label:>6}{d_out:>20.2e}{d_grad:>22.2e}")

    shutdown_parallel()


if __name__ == "__main__":
    main()
