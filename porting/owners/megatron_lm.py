"""Megatron-LM's own save and load paths, run on the current stack (.venv, scripts/env.sh).

``python -m porting.owners.megatron_lm load CKPT --tokens T.pt --out L.pt [--spec MOD FN]``
loads CKPT with ``megatron.training.checkpointing.load_checkpoint`` into a ``GPTModel`` whose
shape comes from the checkpoint's own saved arguments (``--use-checkpoint-args``, as a Megatron-LM
user would start from it), runs the token ids in T.pt and saves the logits to L.pt.

``python -m porting.owners.megatron_lm save OUT --tokens T.pt --out L.pt`` builds a small random
GPT with Megatron-LM's arguments and saves it with ``megatron.training.checkpointing
.save_checkpoint``: a checkpoint we did not write, for export to read; L.pt gets its logits.

Only ``porting.cpu`` is imported from porting: NeMo is not in this environment.
"""

from __future__ import annotations

import argparse
import importlib
import sys

import torch

# The model a `save` makes: Llama-shaped, the fields of the HF config the test exports it with.
SAVE_ARGS = (
    "--num-layers 2 --hidden-size 64 --ffn-hidden-size 96 --num-attention-heads 4 "
    "--group-query-attention --num-query-groups 2 --seq-length 32 --max-position-embeddings 32 "
    "--vocab-size 128 --make-vocab-size-divisible-by 128 --normalization RMSNorm "
    "--norm-epsilon 1e-5 --swiglu --disable-bias-linear --position-embedding-type rope "
    "--rotary-base 10000 --untie-embeddings-and-output-weights"
).split()

# What a CPU run needs: no fused kernels, no Transformer Engine, CPU initialisation.
CPU_ARGS = (
    "--transformer-impl local --use-cpu-initialization --no-gradient-accumulation-fusion "
    "--no-masked-softmax-fusion --no-bias-swiglu-fusion --no-rope-fusion --no-persist-layer-norm "
    "--micro-batch-size 1 --global-batch-size 1 --train-iters 1 "
    "--lr 1e-4 --ckpt-format torch_dist --tokenizer-type NullTokenizer --save-interval 1"
).split()


def _init(argv: list[str]):
    """Megatron-LM's own argument parsing and validation, on one gloo process."""
    from porting.owners import shims

    shims.one_cpu_process()
    from megatron.core import parallel_state
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables

    sys.argv = [sys.argv[0], *argv]
    args = parse_args()
    if args.use_checkpoint_args:
        from megatron.training.checkpointing import load_args_from_checkpoint

        args, _ = load_args_from_checkpoint(args)
    validate_args(args)
    set_global_variables(args, build_tokenizer=False)
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    return args


def _model(args, spec: list[str] | None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training.arguments import core_transformer_config_from_args

    config = core_transformer_config_from_args(args)
    if spec:
        # A family's own layer spec, as Megatron-LM's --spec names one (pretrain_gpt.py).
        layer_spec = getattr(importlib.import_module(spec[0]), spec[1])(config)
    else:
        layer_spec = get_gpt_layer_local_spec(
            qk_layernorm=args.qk_layernorm, normalization=args.normalization
        )
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
    )


@torch.no_grad()
def _logits(model, tokens: list[torch.Tensor]) -> list[torch.Tensor]:
    model.eval()
    out = []
    for ids in tokens:
        ids = ids.view(1, -1)
        pos = torch.arange(ids.shape[1]).view(1, -1)
        out.append(model(ids, pos, attention_mask=None).float())
    return out


def main(argv: list[str] | None = None) -> int:
    """``load`` or ``save`` (see the module docstring)."""
    p = argparse.ArgumentParser(
        allow_abbrev=False, prog="porting.owners.megatron_lm", description=__doc__
    )
    p.add_argument("action", choices=["load", "save"])
    p.add_argument("ckpt", help="checkpoint root (latest_checkpointed_iteration.txt beside iter_*)")
    p.add_argument("--tokens", required=True, help="torch file: a list of 1-D token id tensors")
    p.add_argument("--out", required=True, help="torch file to write the logits to")
    p.add_argument("--spec", nargs=2, metavar=("MODULE", "FUNCTION"), help="layer spec to build")
    a = p.parse_args(argv)
    tokens = torch.load(a.tokens, weights_only=True)
    if a.action == "load":
        args = _init(
            [
                "--load",
                a.ckpt,
                "--use-checkpoint-args",
                "--no-load-optim",
                "--no-load-rng",
                "--exit-on-missing-checkpoint",
                *CPU_ARGS,
            ]
        )
        from megatron.training.checkpointing import load_checkpoint

        model = _model(args, a.spec)
        iteration, _ = load_checkpoint([model], None, None, strict=True)
        print(f"megatron-lm loaded {a.ckpt} at iteration {iteration}")
    else:
        torch.manual_seed(0)
        args = _init([*SAVE_ARGS, *CPU_ARGS, "--save", a.ckpt, "--no-save-rng", "--no-save-optim"])
        # Megatron-LM pads the vocabulary when it builds the tokenizer, which this run does not.
        step = args.make_vocab_size_divisible_by
        args.padded_vocab_size = -(-args.vocab_size // step) * step
        from megatron.training.checkpointing import save_checkpoint

        model = _model(args, a.spec)
        for param in model.parameters():  # a model whose every tensor matters to its logits
            param.data.normal_(0, 0.2)
        save_checkpoint(1, [model], None, None, 0)
        print(f"megatron-lm saved {a.ckpt}")
    torch.save(_logits(model, tokens), a.out)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
