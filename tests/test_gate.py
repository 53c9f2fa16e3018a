"""The parity gate's cost and where it runs: what the fast path computes is what the plain one
did, a clean layer runs once on each side (only a layer that leaves the tolerance runs again on
HF's input), the report gives wall, floor and ratio (the rate measured once per machine and
cached; the ratio only where the floor means something), ``--device`` is checked, a device that
runs out of memory hands the verdict to the CPU, and the mapped torch_dist reader is torch.load's
equal and no more permissive.

The broken-layer negative controls that must fail exactly as before are in
``test_parity_streamed.py`` and each family's tests; they run the same fast path.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from porting.cli import main
from porting.errors import PortingError
from porting.parity import floor, harness
from porting.parity.streamed import LAYER_RTOL


def _prompts_of_several_lengths(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (1, n), generator=g) for n in (3, 17, 9, 30)]


def test_real_rows_only_computes_what_each_prompt_alone_does(tiny_llama, tiny_nemo):
    """The padded batch's linear layers run on the real positions only: the HF logits equal those
    of the HF model run whole on each prompt alone, and the linear layers' FLOPs counted are those
    of the real positions (not of the padded batch)."""
    from transformers import AutoConfig

    from porting.contract.registry import family_by_name
    from porting.convert.checkpoint import read_manifest
    from porting.convert.megatron import init_parallel
    from porting.parity.streamed import streamed_logits

    manifest = read_manifest(tiny_nemo)
    family = family_by_name(manifest.family)
    prompts = _prompts_of_several_lengths(manifest.vocab_size)
    init_parallel()
    hf, mc, layers, cost, _ = streamed_logits(
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
    # and eager attention's two products (scores, weighted values) on the padded batch, which
    # are no linear layer's (porting.parity.streamed._MatmulWork)
    batch, longest = len(prompts), max(p.shape[1] for p in prompts)
    scores = 4 * batch * cfg.num_attention_heads * longest**2 * head_dim
    # LlamaRotaryEmbedding's inv_freq [1, d/2, 1] @ positions [1, 1, s], once: the model
    # makes its position ids [1, s] for the whole batch
    rotary = head_dim * longest
    assert cost.flop == 2 * real * params + cfg.num_hidden_layers * scores + rotary
    assert cost.gflops > 0 and cost.floor_s == pytest.approx(2 * cost.flop / cost.gflops / 1e9)
    report = harness.compare(hf, mc)
    assert report.passed and len(layers) == cfg.num_hidden_layers


def test_verify_reports_the_gate_s_wall_floor_and_ratio(tiny_llama, tiny_nemo, capsys):
    assert main(["verify", str(tiny_llama), str(tiny_nemo), "--json", "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"] == "cpu"
    assert report["wall_s"] > 0 and report["floor_s"] > 0 and report["matmul_gflops"] > 0
    assert report["floor_ratio"] == pytest.approx(report["wall_s"] / report["floor_s"])
    # the machine's one cached rate, whichever command asks (import runs this same verify)
    assert report["matmul_gflops"] == floor.machine_gflops("cpu")
    assert report["floor_s"] == pytest.approx(
        report["matmul_tflop"] * 1e12 / (report["matmul_gflops"] * 1e9)
    )
    assert main(["verify", str(tiny_llama), str(tiny_nemo)]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("  gate ")]
    # a tiny model's floor is far under a second: no ratio, and the line says why
    assert "no ratio under a 1 s floor" in line and not line.endswith("x")
    assert " 0 GFLOP/s" not in line and " 0.00 TFLOP" not in line


@pytest.fixture()
def megatron_layer_runs():
    """The Megatron decoder layers run in this test, counted by their MLP (the run on HF's input
    calls the layer's ``forward`` directly, and its MLP as a module)."""
    from megatron.core.transformer.mlp import MLP

    runs = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, output: runs.append(1) if type(module) is MLP else None
    )
    yield runs
    handle.remove()


def test_a_clean_gate_runs_each_megatron_layer_once(tiny_llama, tiny_nemo, megatron_layer_runs):
    """Each layer's output is within the tolerance on its own input, so none runs again on HF's
    input: the Megatron side is one pass, like HF's, and its matmul work the floor's."""
    from porting.contract.registry import family_by_name
    from porting.convert.checkpoint import read_manifest
    from porting.convert.megatron import init_parallel
    from porting.parity.streamed import streamed_logits

    manifest = read_manifest(tiny_nemo)
    init_parallel()
    prompts = _prompts_of_several_lengths(manifest.vocab_size)
    _, _, layers, _, _ = streamed_logits(
        tiny_llama, tiny_nemo, family_by_name(manifest.family), prompts, manifest.vocab_size
    )
    assert len(megatron_layer_runs) == len(layers) == 2
    assert all(d.max_rel <= LAYER_RTOL and not d.diverges for d in layers)
    assert [d.own_on_hf_input for d in layers] == [True, False]  # layer 0: the same input
    assert [d.own_max_rel for d in layers] == [d.max_rel for d in layers]


def test_only_layers_past_the_tolerance_run_again_and_the_broken_one_is_named(
    tmp_path, megatron_layer_runs
):
    """A broken layer 1 of 3: layers 1 and 2 leave the tolerance on their own input and run again
    on HF's; layer 1 is broken there too, layer 2 is clean there (its error was carried in)."""
    from converters import llama
    from porting.contract.transforms import TransformPair
    from porting.proof import broken_table, import_with_table
    from porting.testing import make_llama

    ones = TransformPair("dropped_norm", lambda w, ctx: torch.ones_like(w), lambda t, ctx: (t,))
    hf = make_llama(tmp_path / "hf", num_layers=3, num_kv_heads=2)
    table = broken_table(llama.WEIGHTS, "input_layernorm.weight", 1, lambda _: ones, 3)
    ckpt = import_with_table(hf, tmp_path / "ck", llama.FAMILY, table)
    megatron_layer_runs.clear()
    report = harness.verify(hf, ckpt)
    assert not report.passed and report.first_divergent_layer == 1
    first, broken, after = report.layers
    assert first["max_rel"] <= LAYER_RTOL and first["own_max_rel"] == first["max_rel"]
    assert broken["max_rel"] > LAYER_RTOL and broken["own_on_hf_input"]
    assert broken["own_max_rel"] > LAYER_RTOL
    assert after["max_rel"] > LAYER_RTOL and after["own_on_hf_input"]
    assert after["own_max_rel"] < 1e-5  # run again on HF's input: nothing of its own
    assert len(megatron_layer_runs) == 3 + 2
    assert "3 streamed, 2 past 0.0001 on their own input" in report.summary()


def test_the_matmul_rate_is_measured_once_and_cached(tmp_path, monkeypatch):
    measured = []

    def measure(device, rows, k, n, **_):
        measured.append((rows, k, n))
        return 123.5

    monkeypatch.setattr(floor, "measure_gflops", measure)
    assert floor.machine_gflops("cpu", tmp_path) == 123.5
    assert floor.machine_gflops("cpu", tmp_path) == 123.5
    assert measured == [floor.RATE_SHAPE]
    data = json.loads((tmp_path / floor.CACHE_NAME).read_text())
    entry = data["rates"][floor.machine_key(torch.device("cpu"))]
    assert entry["gflops"] == 123.5 and entry["shape"] == list(floor.RATE_SHAPE)
    assert [p.name for p in tmp_path.iterdir()] == [floor.CACHE_NAME]  # no temporary left


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        "",
        "[]",
        '{"format": 1, "rates": []}',
        '{"format": 99, "rates": {"KEY": {"gflops": 50.0, "shape": SHAPE}}}',
        '{"format": 1, "rates": {"KEY": {"gflops": 0, "shape": SHAPE}}}',
        '{"format": 1, "rates": {"KEY": {"gflops": -3.0, "shape": SHAPE}}}',
        '{"format": 1, "rates": {"KEY": {"gflops": NaN, "shape": SHAPE}}}',
        '{"format": 1, "rates": {"KEY": {"gflops": 1e300, "shape": SHAPE}}}',
        '{"format": 1, "rates": {"KEY": {"gflops": true, "shape": SHAPE}}}',
        '{"format": 1, "rates": {"KEY": {"gflops": "fast", "shape": SHAPE}}}',
        '{"format": 1, "rates": {"KEY": {"gflops": 50.0, "shape": [1, 2, 3]}}}',
        '{"format": 1, "rates": {"KEY": 50.0}}',
    ],
    ids=lambda t: t[:40],
)
def test_a_rate_cache_not_ours_is_measured_again_and_replaced(tmp_path, monkeypatch, text):
    key = floor.machine_key(torch.device("cpu"))
    path = tmp_path / floor.CACHE_NAME
    path.write_text(
        text.replace('"KEY"', json.dumps(key)).replace("SHAPE", json.dumps(floor.RATE_SHAPE))
    )
    monkeypatch.setattr(floor, "measure_gflops", lambda *args, **_: 77.0)
    assert floor.machine_gflops("cpu", tmp_path) == 77.0
    data = json.loads(path.read_text())
    assert data["format"] == floor.CACHE_FORMAT and data["rates"][key]["gflops"] == 77.0


def test_a_low_cached_rate_is_raised_by_a_gate_whose_floor_matters(tmp_path, monkeypatch):
    """A rate first measured on a loaded machine must not stay: a gate with a floor of a second
    or more takes one more sample and keeps the better rate; a tiny gate trusts the cache."""
    samples = []

    def measure(device, rows, k, n, **kw):
        samples.append(kw.get("samples"))
        return 200.0

    (tmp_path / floor.CACHE_NAME).write_text(
        json.dumps(
            {
                "format": floor.CACHE_FORMAT,
                "rates": {
                    floor.machine_key(torch.device("cpu")): {
                        "gflops": 77.0,
                        "shape": list(floor.RATE_SHAPE),
                    }
                },
            }
        )
    )
    monkeypatch.setattr(floor, "measure_gflops", measure)
    assert floor.machine_gflops("cpu", tmp_path, work_flop=1e9) == 77.0  # 13 ms of floor
    assert samples == []
    assert floor.machine_gflops("cpu", tmp_path, work_flop=77e9 * 2) == 200.0  # 2 s of floor
    assert samples == [1]
    assert floor.machine_gflops("cpu", tmp_path) == 200.0  # kept
    monkeypatch.setattr(floor, "measure_gflops", lambda *a, **k: 150.0)
    assert floor.machine_gflops("cpu", tmp_path, work_flop=1e13) == 200.0  # never lowered


def test_another_machine_s_rate_is_kept_beside_this_one(tmp_path, monkeypatch):
    other = {"gflops": 900.0, "shape": list(floor.RATE_SHAPE), "measured": "then"}
    (tmp_path / floor.CACHE_NAME).write_text(
        json.dumps({"format": floor.CACHE_FORMAT, "rates": {"cuda Other GPU": other}})
    )
    monkeypatch.setattr(floor, "measure_gflops", lambda *args, **_: 77.0)
    assert floor.machine_gflops("cpu", tmp_path) == 77.0
    rates = json.loads((tmp_path / floor.CACHE_NAME).read_text())["rates"]
    assert rates["cuda Other GPU"] == other and len(rates) == 2


def test_a_cache_that_cannot_be_written_costs_a_measurement_not_the_gate(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setattr(floor, "measure_gflops", lambda *args, **_: 77.0)
    assert floor.machine_gflops("cpu", blocked / "cache") == 77.0


def test_the_measured_rate_is_a_rate():
    rate = floor.measure_gflops(torch.device("cpu"), 64, 256, 256, samples=2, sample_s=0.01)
    assert 0 < rate < floor.RATE_MAX


def test_the_kl_of_one_distribution_is_never_below_zero():
    """Logits shifted by a constant are the same distribution: float64 rounding puts their KL a
    few 1e-18 on either side of 0 (below it for about a third of these), and the report must
    not show a negative divergence."""
    for seed in range(12):
        torch.manual_seed(seed)
        hf = (torch.randn(952, 130) * 3).double().reshape(1, 952, 130)
        for shift in (1e-3, 0.1, 0.3):
            report = harness.compare([hf], [hf + shift], atol=1.0)
            assert 0.0 <= report.kl_hf_mcore < 1e-15, (seed, shift, report.kl_hf_mcore)
            assert "KL(HF||Mcore)  -" not in report.summary()


@pytest.mark.parametrize("poison", [None, "nan", "inf"])
def test_the_comparison_by_blocks_of_positions_reports_what_the_whole_does(poison, monkeypatch):
    """Each figure of the report is a maximum, a sum or a count over positions: blocks of a few
    positions (prompts cut across blocks) give the report of one block, NaN and Inf included."""
    from dataclasses import asdict

    g = torch.Generator().manual_seed(5)
    hf = [torch.randn(1, n, 301, generator=g) * 4 for n in (7, 1, 12)]
    mc = [t + torch.randn(t.shape, generator=g) * 1e-3 for t in hf]
    mc[2][0, 3] = mc[2][0, 3].flip(-1)  # a position whose top-1 differs
    if poison:
        mc[2][0, 5, 9] = float(poison)
    whole = asdict(harness.compare(hf, mc))
    assert whole["passed"] is False and 0 < whole["top1_agreement"] < 1
    monkeypatch.setattr(harness, "COMPARE_BYTES", 3 * 8 * 301)  # 3 positions a block
    blocks = asdict(harness.compare(hf, mc))
    for name, value in whole.items():
        if isinstance(value, float) and math.isnan(value):
            assert math.isnan(blocks[name]), name
        elif name in ("mean_abs_diff", "kl_hf_mcore"):  # sums in another order
            assert blocks[name] == pytest.approx(value, rel=1e-12), name
        else:
            assert blocks[name] == value, name
    with pytest.raises(
        ValueError, match=r"logit shapes differ: HF \(20, 301\) vs Megatron \(20, 300\)"
    ):
        harness.compare(hf, [t[..., :300] for t in mc])


def _costed(floor_s: float, gflops: float, wall_s: float) -> harness.ParityReport:
    report = harness.compare([torch.zeros(1, 2, 5)], [torch.zeros(1, 2, 5)])
    report.wall_s, report.floor_s, report.matmul_gflops = wall_s, floor_s, gflops
    report.matmul_tflop = floor_s * gflops / 1e3
    report.floor_ratio = wall_s / floor_s
    return report


@pytest.mark.parametrize(
    "floor_s,gflops,wall_s,want",
    [
        (9.0, 182.0, 12.6, "gate           12.6 s on cpu; floor 9.0 s (1.64 TFLOP of matmul at "
         "182 GFLOP/s): 1.4x"),
        (4e-4, 150.0, 0.8, "gate           0.8 s on cpu; floor 0.4 ms (0.06 GFLOP of matmul "
         "at 150 GFLOP/s); no ratio under a 1 s floor: fixed costs, not matmuls, set the time"),
        (0.2, 0.31, 0.05, "gate           50 ms on cpu; floor 0.2 s (0.062 GFLOP of matmul at "
         "0.31 GFLOP/s); no ratio under a 1 s floor: fixed costs, not matmuls, set the time"),
    ],
    ids=["7b-8", "tiny", "slow"],
)  # fmt: skip
def test_the_cost_line_is_true_at_every_size(floor_s, gflops, wall_s, want):
    (line,) = [x for x in _costed(floor_s, gflops, wall_s).summary().splitlines() if "gate " in x]
    assert line == "  " + want


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
    from converters import llama
    from porting.contract.transforms import TransformPair
    from porting.proof import broken_table, import_with_table
    from porting.testing import make_llama

    ones = TransformPair("dropped_norm", lambda w, ctx: torch.ones_like(w), lambda t, ctx: (t,))
    hf = make_llama(tmp_path / "hf", num_layers=3, num_kv_heads=2)
    table = broken_table(llama.WEIGHTS, "input_layernorm.weight", 1, lambda _: ones, 3)
    ckpt = import_with_table(hf, tmp_path / "ck", llama.FAMILY, table)
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
