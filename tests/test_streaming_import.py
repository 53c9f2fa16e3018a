"""The streamed import, written without NeMo, is the checkpoint NeMo's own import writes.

For every tiny variant of both families, the streamed checkpoint (parameters produced one at a
time as the writer reaches them, the context and trainer state written as data:
:mod:`porting.convert.hf_import`) and the classic one (the model filled in NeMo's trainer, then
NeMo's stock save and context dump) hold the same keys, the same chunks and ``torch.equal``
tensors, the same ``common.pt`` and ``metadata.json``, and the same ``context/`` files, byte for
byte (every published config's context: ``tests/test_nemo2_context.py``). That both load in Megatron (TP=1 and TP=2), in NeMo's training and in
``porting export`` is shown by the rest of the suite, which imports through the streamed path.
"""

from __future__ import annotations

import pytest
import torch

from porting.convert.dist_reader import DistCheckpointReader
from porting.testing import FALCON_VARIANTS, RELEASED_FALCON_LAYOUTS, make_falcon, make_llama

LLAMA = {
    "mha": dict(num_kv_heads=4),
    "gqa": dict(num_kv_heads=2),
    "mqa": dict(num_kv_heads=1),
    "tied": dict(tie_word_embeddings=True),
    "no_padding_needed": dict(vocab_size=128),
    "biases": dict(bias=True),
    "head_dim_32": dict(head_dim=32),
    "bf16": dict(dtype=torch.bfloat16),
    "llama3_scaling": dict(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    ),
}
FALCON = {name: FALCON_VARIANTS[name] for name in RELEASED_FALCON_LAYOUTS}


def _import(hf_dir, out, streaming: bool):
    from porting.convert.connectors import model_class
    from porting.convert.hf_files import family_for_hf_dir

    family, _ = family_for_hf_dir(hf_dir)
    importer = model_class(family).importer(f"hf://{hf_dir}")
    importer.show_progress, importer.streaming = False, streaming
    importer.convert_into(out)
    return out


def _assert_same_checkpoint(one, two):
    for name in ("io.json", "model.yaml", "porting.json"):
        assert (one / "context" / name).read_bytes() == (two / "context" / name).read_bytes()
    tokenizers = [sorted((c / "context" / "nemo_tokenizer").iterdir()) for c in (one, two)]
    assert [p.name for p in tokenizers[0]] == [p.name for p in tokenizers[1]]
    assert all(p.read_bytes() == q.read_bytes() for p, q in zip(*tokenizers, strict=True))
    a, b = one / "weights", two / "weights"
    ra, rb = DistCheckpointReader(a), DistCheckpointReader(b)
    assert sorted(ra._tensors) == sorted(rb._tensors)
    for key, md in ra._tensors.items():
        chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
        assert chunks == [(tuple(c.offsets), tuple(c.sizes)) for c in rb._tensors[key].chunks]
        shape = ra.global_shape(key)
        ta, tb = ra.read(key, (0,) * len(shape), shape), rb.read(key, (0,) * len(shape), shape)
        assert ta.dtype == tb.dtype and torch.equal(ta, tb), key
    assert (a / "common.pt").read_bytes() == (b / "common.pt").read_bytes()
    assert (a / "metadata.json").read_bytes() == (b / "metadata.json").read_bytes()
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())


@pytest.mark.parametrize(
    "family,variant",
    [("llama", v) for v in LLAMA] + [("falcon", v) for v in FALCON],
)
def test_streamed_checkpoint_equals_the_stock_save(tmp_path, family, variant):
    make = make_llama if family == "llama" else make_falcon
    kw = (LLAMA if family == "llama" else FALCON)[variant]
    hf_dir = make(tmp_path / "hf", **kw)
    streamed = _import(hf_dir, tmp_path / "streamed", streaming=True)
    classic = _import(hf_dir, tmp_path / "classic", streaming=False)
    _assert_same_checkpoint(streamed, classic)


def test_a_shard_changed_during_the_import_is_a_located_error(tiny_llama, tmp_path):
    import shutil

    from porting.convert.safetensors_io import SafetensorsSource
    from porting.errors import PortingError

    hf = tmp_path / "hf"
    shutil.copytree(tiny_llama, hf)
    source = SafetensorsSource(hf)
    source.get("model.norm.weight")
    with open(hf / "model.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) - 100)
    with pytest.raises(PortingError, match=r"model\.safetensors: changed while being read"):
        source.get("model.layers.1.mlp.down_proj.weight")


def test_a_partial_output_left_by_a_killed_run_is_removed_and_said(tiny_llama, tmp_path, caplog):
    from porting.cli import main

    stale = tmp_path / ".ck.partial-abc123"
    (stale / "weights").mkdir(parents=True)
    (stale / "weights" / "__0_0.distcp").write_bytes(b"half")
    code = main(["import", str(tiny_llama), "--out", str(tmp_path / "ck"), "--no-verify"])
    assert code == 0 and not stale.exists()
    assert f"removing {stale}, left by an earlier run" in caplog.text
    assert (tmp_path / "ck" / "context" / "porting.json").exists()
