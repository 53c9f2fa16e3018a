"""The parity gate's HF side of a quantized checkpoint: dequantized by the reference code, not ours.

The importer dequantizes with :mod:`porting.convert.quant`; were the gate's HF side to read the same
tensors through the same code, a wrong block index, nibble order or scale paired with the wrong
weight would be on both sides and pass. So the HF side pairs each weight with its scale as
transformers does (one module's ``weight`` and ``weight_scale_inv``; a parameter and its
``_blocks`` / ``_scales``) and takes each format's reference implementation:

- MXFP4: transformers' own, ``convert_moe_packed_tensors`` (what ``Mxfp4Config(dequantize=True)``
  loads gpt-oss with), called one expert at a time (it is row-wise, so the result is the same) to
  keep its int64 index temporaries to one expert's size;
- FP8 blocks: transformers 4.57.6 has no dequantization of them (its ``FineGrainedFP8`` loader needs
  a GPU and Triton, and its ``FP8Linear`` multiplies FP8 operands without ever forming the weight),
  so NVIDIA ModelOpt's ``FP8QTensor.dequantize`` with 128x128 ``block_sizes`` (float32 product, cut
  to the matrix), one block row at a time, rounded once to the compute dtype.
"""

from __future__ import annotations

import torch

from porting.contract.quantization import FP8
from porting.convert.quant import Dequantizer


def _fp8_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    from modelopt.torch.quantization.qtensor.fp8_tensor import FP8QTensor

    bm, bn = block
    rows, cols = weight.shape[-2:]
    w = weight.reshape(-1, rows, cols)
    # bf16 / f16 scales (the FP8 Qwen3 releases) widen to float32 exactly, as DeepSeek's kernel reads them
    s = scale_inv.reshape(-1, *scale_inv.shape[-2:]).to(torch.float32)
    out = torch.empty(w.shape, dtype=dtype)
    for m in range(w.shape[0]):
        for i, r0 in enumerate(range(0, rows, bm)):
            part = w[m, r0 : r0 + bm]
            q = FP8QTensor(part.shape, dtype, part)
            value = q.dequantize(
                dtype=torch.float32, scale=s[m, i : i + 1], block_sizes={-2: bm, -1: bn}
            )
            out[m, r0 : r0 + bm] = value.to(dtype)
    return out.reshape(weight.shape)


def _mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    n, rows, groups, width = blocks.shape
    out = torch.empty(n, groups * width * 2, rows, dtype=dtype)
    for e in range(n):
        out[e : e + 1] = convert_moe_packed_tensors(
            blocks[e : e + 1], scales[e : e + 1], dtype=dtype
        )
    return out


def _parts(kind: str, name: str) -> tuple[str, str]:
    # transformers' pairing: FP8Linear's ``weight`` and ``weight_scale_inv`` are one module's two
    # parameters; an MXFP4 parameter is its name less ``_blocks`` / ``_scales`` (quantizer_mxfp4)
    if kind == FP8:
        return name, name.rsplit(".", 1)[0] + ".weight_scale_inv"
    return name + "_blocks", name + "_scales"


REFERENCE = Dequantizer("transformers (FP8: ModelOpt)", _fp8_block, _mxfp4, _parts)


def import_references() -> None:
    """Import the reference implementations now, from a shallow frame, not on the first read.

    Importing ModelOpt keeps the frames of the code that imported it alive: done by the gate's
    first FP8 read, it kept that read's buffer, a view of a 528 MB area of a layer read by pieces,
    for the rest of the process (DeepSeek-V3's gate)."""
    from modelopt.torch.quantization.qtensor.fp8_tensor import FP8QTensor  # noqa: F401
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: F401


def load_whole(hf_dir, cls, attn_implementation: str) -> torch.nn.Module:
    """The whole fp32 HF model of a quantized directory: loaded as transformers loads it, each
    weight dequantized to the checkpoint's compute dtype, then cast to fp32 as the gate computes.

    MXFP4 through transformers' own loader (``Mxfp4Config(dequantize=True)``); FP8, which that
    loader cannot read without a GPU, from :data:`REFERENCE`'s weights into the model class."""
    import transformers

    from porting.contract.hf_spelling import config_for_reference
    from porting.contract.quantization import MXFP4, read_quantization
    from porting.convert.hf_files import read_hf_config_as_written
    from porting.convert.quant import compute_dtype
    from porting.convert.safetensors_io import SafetensorsSource
    from porting.errors import PortingError

    where = f"{hf_dir}/config.json"
    hf_config, written = read_hf_config_as_written(hf_dir)
    dtype = compute_dtype(hf_config, where)
    # a config spelled by transformers 5: the installed transformers reads its 4.x spelling
    config = config_for_reference(cls, hf_config, written)
    spelled = {} if config is None else {"config": config}
    if read_quantization(hf_config, where).method == MXFP4:
        model = cls.from_pretrained(
            str(hf_dir),
            dtype=dtype,
            attn_implementation=attn_implementation,
            quantization_config=transformers.Mxfp4Config(dequantize=True),
            local_files_only=True,
            **spelled,
        )
        return model.float().eval()
    config = spelled.get("config") or cls.config_class.from_pretrained(
        str(hf_dir), local_files_only=True
    )
    del config.quantization_config  # the weights arrive dequantized
    model = cls._from_config(config, dtype=torch.float32, attn_implementation=attn_implementation)
    source = SafetensorsSource(hf_dir, dequantizer=REFERENCE)
    state = {k: source.get(k).float() for k in source.keys()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise PortingError(
            f"{hf_dir}: weights missing {sorted(set(missing) - tied)[:3]} or unexpected "
            f"{sorted(unexpected)[:3]} for {cls.__name__}"
        )
    model.tie_weights()
    return model.eval()
