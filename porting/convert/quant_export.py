"""``porting export --quantize fp8-block``: the exported bf16 shards rewritten as FP8 blocks with
their scales (:mod:`porting.convert.quant`), after the parity gate passed on the unquantized
weights."""

from __future__ import annotations

import math

from porting.contract.quantization import UE8M0
from porting.convert.quant import (
    FLOAT_NAMES,
    SCALE_SUFFIX,
    fp8_config,
    fp8_targets,
    quantize_fp8_block,
)


def quantize_export(
    out_dir, hf_class, max_shard_bytes: int, block=(128, 128), released: dict | None = None
) -> int:
    """Rewrite the bf16 HF export in ``out_dir`` as an FP8-block checkpoint: each weight
    transformers' FP8 loader expects in FP8 (:func:`fp8_targets`) as ``float8_e4m3fn`` with its
    regenerated ``weight_scale_inv``, the rest as exported, and ``config.json`` given the
    ``quantization_config`` transformers reads. One tensor at a time, into new shards that replace
    the old ones once all are written. Returns the number of weights quantized.

    ``released``: the ``config.json`` of the FP8 release the checkpoint was imported from (as it
    came): it is written back as it was, its ``quantization_config`` key for key in its place,
    and its ``scale_fmt`` kept (``ue8m0``: scales that are powers of two, so that an unchanged
    weight comes back with the release's own bits)."""
    import json
    import shutil
    from pathlib import Path

    import torch

    from porting.convert.safetensors_io import SAFE_INDEX, SafetensorsSource, StreamingShardWriter

    out_dir = Path(out_dir)
    config_path = out_dir / "config.json"
    hf_config = json.loads(config_path.read_text())
    qc = (released or {}).get("quantization_config")
    power_of_two = isinstance(qc, dict) and qc.get("scale_fmt") == UE8M0
    source = SafetensorsSource(out_dir)
    targets = fp8_targets(hf_class, hf_config, source.keys())
    specs = []
    for key in source.keys():
        (shape, _), (st, _) = source.shape(key), source.stored_dtype(key)
        if key in targets:
            scale = tuple(math.ceil(d / b) for d, b in zip(shape, block, strict=True))
            specs += [(key, shape, torch.float8_e4m3fn), (key + SCALE_SUFFIX, scale, torch.float32)]
        else:
            specs.append((key, shape, getattr(torch, FLOAT_NAMES[st])))
    staging = out_dir / ".quantized"
    staging.mkdir()
    writer = StreamingShardWriter(staging, specs, max_shard_bytes)
    for key in source.keys():
        tensor = source.get(key)
        if key in targets:
            q, scale = quantize_fp8_block(tensor, block, power_of_two)
            writer.write(key, q)
            writer.write(key + SCALE_SUFFIX, scale)
        else:
            writer.write(key, tensor)
        del tensor
    written = writer.close()
    for old in [*out_dir.glob("model*.safetensors"), out_dir / SAFE_INDEX]:
        old.unlink(missing_ok=True)
    for new in [*written, staging / SAFE_INDEX]:
        if new.exists():
            new.rename(out_dir / new.name)
    shutil.rmtree(staging)
    if released is not None:
        hf_config = released
    else:
        hf_config["quantization_config"] = fp8_config(block)
    config_path.write_text(json.dumps(hf_config, indent=2) + "\n")
    return len(targets)
