"""The parity gate's cost and where it runs: what the fast path computes is what the plain one
did, the report gives wall, floor and ratio, ``--device`` is checked, a device that runs out of
memory hands the verdict to the CPU, and the mapped torch_dist reader is torch.load's equal and
no more permissive.

The broken-layer negative controls that must fail exactly as before are in
``test_parity_streamed.py`` and each family's tests; they run the same fast path.
"""

from __future__ import annotations

import io
import json
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from porting.cli import main
from porting.errors import PortingError
from porting.parity import harness


def _prompts_of_several_lengths(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (1, n), generator=g) for n in (3, 17, 9, 30)]


def test_real_rows_only_computes_what_each_prompt_alone_does(tiny_llama, tiny_nemo):
    """The padded batch's linear layers run on the real positions only: the HF logits equal those
    of the HF model run whole on each prompt alone, and the FLOPs counted are those of the real
    positions (not of the padded batch)."""
    from transformers import AutoConfig

    from porting.convert.checkpoint import read_manifest
    from porting.convert.megatron import init_parallel
    from porting.parity.streamed import streamed_logits
    from porting.registry import family_by_name

    manifest = read_manifest(tiny_nemo)
    family = family_by_name(manifest.family)
    prompts = _prompts_of_several_lengths(manifest.vocab_size)
    init_parallel()
    hf, mc, layers, cost = streamed_logits(
        tiny_llama, tiny_nemo, family, prompts, manifest.vocab_size
    )
    alone = harness.hf_logits(tiny_llama, "LlamaForCausalLM", prompts)
    for got, want in zip(hf, alone, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    cfg = AutoConfig.from_pretrained(tiny_llama)
    h, f, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads
    head_dim = h // cfg.num_attention_heads
    per_layer = h * h * 2 + 2 * h * kv * head_dim + 3 * h * f  # q, o, k, v, gate, up, down
    params = cfg.num_hidden_layers * per_layer + cfg.vocab_size * h
    real = sum(p.shape[1] for p in prompts)
    assert cost.flop == 2 * real * params
    assert cost.gflops > 0 and cost.floor_s == pytest.approx(2 * cost.flop / cost.gflops / 1e9)
    report = harness.compare(hf, mc)
    assert report.passed and len(layers) == cfg.num_hidden_layers


def test_verify_reports_the_gate_s_wall_floor_and_ratio(tiny_llama, tiny_nemo, capsys):
    assert main(["verify", str(tiny_llama), str(tiny_nemo), "--json", "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"] == "cpu"
    assert report["wall_s"] > 0 and report["floor_s"] > 0 and report["matmul_gflops"] > 0
    assert report["floor_ratio"] == pytest.approx(report["wall_s"] / report["floor_s"])
    assert main(["verify", str(tiny_llama), str(tiny_nemo)]) == 0
    assert "gate " in capsys.readouterr().out  # the text summary's line


def test_device_cuda_without_a_device_is_refused(tiny_llama, tiny_nemo, capsys):
    if torch.backends.cuda.is_built() and torch.cuda.is_available():
        pytest.fail("this test is for a machine without CUDA (the CI's)")
    assert main(["verify", str(tiny_llama), str(tiny_nemo), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda: no CUDA device is visible" in err and err.count("\n") == 1


@pytest.fixture()
def device_runs_out_of_memory(monkeypatch):
    """Call it to make this process believe it has a device whose gate runs out of memory; it
    returns the devices the gate was started on."""
    from porting import cpu
    from porting.parity import streamed

    calls = []

    def oom(*args, **kwargs):
        calls.append(kwargs.get("device", args[8] if len(args) > 8 else None))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.17 GiB")

    def arm() -> list:
        from porting.convert.megatron import init_parallel

        init_parallel()  # on the CPU (gloo), as the device run would have found it
        monkeypatch.setattr(cpu, "cuda_available", lambda: True)
        monkeypatch.setattr(streamed, "streamed_logits", oom)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        return calls

    return arm


def test_a_device_out_of_memory_falls_back_to_the_cpu(
    tiny_llama, tiny_nemo, device_runs_out_of_memory, capfd
):
    calls = device_runs_out_of_memory()
    report = harness.verify(tiny_llama, tiny_nemo, device="cuda")
    err = capfd.readouterr().err
    assert calls == ["cuda"]
    lines = [line for line in err.splitlines() if line.startswith("parity:")]
    assert lines == [
        "parity: the cuda device ran out of memory (CUDA out of memory. Tried to allocate "
        "3.17 GiB); running the gate on the CPU instead"
    ]
    assert report.passed and report.device == "cpu" and report.mode == "layer-streamed"
    assert len(report.layers) == 2


def test_after_the_fallback_a_broken_layer_still_fails_and_is_named(
    tmp_path, device_runs_out_of_memory
):
    from converters import tsuzumi
    from porting.convert.transforms import TransformPair
    from porting.proof import broken_table, import_with_table
    from porting.testing import make_llama

    ones = TransformPair("dropped_norm", lambda w, ctx: torch.ones_like(w), lambda t, ctx: (t,))
    hf = make_llama(tmp_path / "hf", num_layers=3, num_kv_heads=2)
    table = broken_table(tsuzumi.WEIGHTS, "input_layernorm.weight", 1, lambda _: ones, 3)
    ckpt = import_with_table(hf, tmp_path / "ck", tsuzumi.FAMILY, table)
    device_runs_out_of_memory()
    report = harness.verify(hf, ckpt, device="cuda")
    assert not report.passed and report.first_divergent_layer == 1
    assert report.device == "cpu"


def _records(weights: Path):
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(weights)).read_metadata()
    return md, md.storage_data


def _largest_tensor_record(md, storage):
    return max(
        ((i, v) for i, v in storage.items() if hasattr(md.state_dict_metadata[i.fqn], "chunks")),
        key=lambda kv: kv[1].length,
    )


def test_the_mapped_reader_reads_what_torch_load_reads(tiny_nemo):
    from porting.convert.dist_reader import _mapped_record

    weights = Path(tiny_nemo) / "weights"
    md, storage = _records(weights)
    tensors = {i: v for i, v in storage.items() if hasattr(md.state_dict_metadata[i.fqn], "chunks")}
    assert tensors
    for index, info in tensors.items():
        data = (weights / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        want = torch.load(io.BytesIO(data), weights_only=True)
        got = _mapped_record(weights / info.relative_path, info.offset, info.length, weights)
        assert got.dtype == want.dtype and got.shape == want.shape, index.fqn
        assert got.stride() == want.stride() and torch.equal(got, want), index.fqn


def _planted(path: Path, offset: int, length: int, payload: bytes) -> None:
    """Replace the record at ``[offset, offset + length)`` by a torch.save-like zip whose pickle is
    ``payload``, padded to the same length with a member of filler."""

    def record(pad: int) -> bytes:
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
            zf.writestr("archive/data.pkl", payload)
            zf.writestr("archive/byteorder", "little")
            zf.writestr("archive/pad", b"\0" * pad)
        return buf.getvalue()

    planted = record(length - len(record(0)))
    assert len(planted) == length
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(planted)


class _Runs:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def _copied_record(tiny_nemo, tmp_path):
    """A copy of the tiny checkpoint's weights, its metadata, and its largest tensor's record."""
    weights = tmp_path / "ck" / "weights"
    shutil.copytree(tiny_nemo, weights.parent)
    md, storage = _records(weights)
    index, info = _largest_tensor_record(md, storage)
    return weights, md, index, info


def test_a_torch_dist_record_whose_pickle_names_a_global_is_refused(tiny_nemo, tmp_path):
    from porting.convert.dist_reader import DistCheckpointReader

    weights, md, index, info = _copied_record(tiny_nemo, tmp_path)
    marker = tmp_path / "ran"
    _planted(
        weights / info.relative_path,
        info.offset,
        info.length,
        pickle.dumps(_Runs(marker), protocol=2),
    )
    reader = DistCheckpointReader(weights)
    shape = tuple(md.state_dict_metadata[index.fqn].size)
    with pytest.raises(PortingError, match=r"record of .* is unreadable .*system"):
        reader.read(index.fqn, tuple(index.offset), shape)
    assert not marker.exists()


def test_a_torch_dist_record_overwritten_is_refused(tiny_nemo, tmp_path):
    from porting.convert.dist_reader import DistCheckpointReader

    weights, md, index, info = _copied_record(tiny_nemo, tmp_path)
    path = weights / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset : info.offset + info.length] = b"\0" * info.length
    path.write_bytes(bytes(data))
    shape = tuple(md.state_dict_metadata[index.fqn].size)
    with pytest.raises(PortingError, match=r"record of .* is unreadable"):
        DistCheckpointReader(weights).read(index.fqn, tuple(index.offset), shape)
