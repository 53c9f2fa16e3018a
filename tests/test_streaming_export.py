"""The streamed exporter writes what ``safetensors.torch.save_file`` writes, byte for byte.

Shards are planned from names, shapes and dtypes alone and filled tensor by tensor in any order;
each file must equal the one ``save_file`` makes of the same tensors, across mixed dtypes, several
shards and an empty tensor.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import save_file

from porting.convert.safetensors_io import SAFE_INDEX, StreamingShardWriter
from porting.errors import PortingError


def _tensors():
    g = torch.Generator().manual_seed(0)
    out = {}
    for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float16] * 4):
        shape = (3 + i, 5) if i % 4 else (7,)
        out[f"model.layers.{i % 5}.w{i}"] = torch.randn(shape, generator=g).to(dtype)
    out["empty"] = torch.zeros(0, 4)
    return out


@pytest.mark.parametrize("max_shard_bytes", [10**9, 200], ids=["one_shard", "several_shards"])
def test_files_equal_save_file(tmp_path, max_shard_bytes):
    tensors = _tensors()
    specs = [(k, tuple(t.shape), t.dtype) for k, t in tensors.items()]
    writer = StreamingShardWriter(tmp_path, specs, max_shard_bytes)
    order = list(tensors)
    random.Random(1).shuffle(order)
    for k in order:
        writer.write(k, tensors[k])
    paths = writer.close()
    if len(paths) == 1:
        shards = {"model.safetensors": list(tensors)}
    else:
        index = json.loads((tmp_path / SAFE_INDEX).read_text())
        assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
        shards = {}
        for k, name in index["weight_map"].items():
            shards.setdefault(name, []).append(k)
        assert len(shards) == len(paths) > 2
    for name, keys in shards.items():
        ref = tmp_path / f"ref-{name}"
        save_file({k: tensors[k] for k in keys}, str(ref), metadata={"format": "pt"})
        assert (tmp_path / name).read_bytes() == ref.read_bytes(), name
    assert not list(tmp_path.glob(".shard-*"))


def test_a_tensor_never_written_or_of_another_shape_is_refused(tmp_path):
    specs = [("a", (2, 2), torch.float32), ("b", (3,), torch.bfloat16)]
    writer = StreamingShardWriter(tmp_path, specs)
    with pytest.raises(PortingError, match="'a'.*announced"):
        writer.write("a", torch.zeros(2, 3))
    writer.write("a", torch.zeros(2, 2))
    with pytest.raises(PortingError, match="did not produce 1 announced tensor"):
        writer.close()
    with pytest.raises(PortingError, match="twice"):
        StreamingShardWriter(tmp_path / "x", specs + [("a", (1,), torch.float32)])
