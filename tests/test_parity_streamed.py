"""The layer-streamed parity check: it agrees with the whole-model check and names a broken layer.

A broken layer is made the way a porting bug makes one: the mapping table of one layer only is
wrong (the QKV interleave, a norm, the MLP), the checkpoint is written through the normal importer,
and the streamed check must name that layer as the first divergence.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from porting.cli import main
from porting.contract.transforms import TransformPair
from porting.errors import PortingError
from porting.parity import harness
from porting.proof import broken_table, import_with_table
from porting.testing import make_falcon, make_llama

LAYERS = 4


def _qkv_split(t, ctx):
    kv = ctx.num_query_groups * ctx.head_dim
    return tuple(t.split([ctx.num_heads * ctx.head_dim, kv, kv]))


# Each broken transform has a working inverse: the table check runs both ways before the import.
CONCAT = TransformPair("concat", lambda q, k, v, ctx: torch.cat([q, k, v]), _qkv_split)
ONES = TransformPair("dropped_norm", lambda w, ctx: torch.ones_like(w), lambda t, ctx: (t,))
SCALED = TransformPair("scaled_mlp", lambda w, ctx: 1.5 * w, lambda t, ctx: (t,))


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("hf") / "l4", num_layers=LAYERS, num_kv_heads=2)


@pytest.mark.parametrize(
    "pattern,transform,layer",
    [("linear_qkv.weight", CONCAT, 2), ("input_layernorm.weight", ONES, 1)],
    ids=["qkv_interleave_of_layer_2", "norm_of_layer_1"],
)
def test_a_broken_tsuzumi_layer_is_named(llama4, tmp_path, pattern, transform, layer):
    from converters import llama

    table = broken_table(llama.WEIGHTS, pattern, layer, lambda _: transform, LAYERS)
    ckpt = import_with_table(llama4, tmp_path / "ck", llama.FAMILY, table)
    report = harness.verify(llama4, ckpt)
    assert not report.passed
    assert report.first_divergent_layer == layer
    assert f"first divergence at layer {layer}:" in report.summary()
    before = report.layers[:layer]
    assert all(d["own_max_rel"] < 1e-5 for d in before)  # the layers before it are exact


def test_a_broken_falcon_mlp_is_named(tmp_path):
    from converters import falcon

    hf = make_falcon(
        tmp_path / "hf", num_layers=LAYERS, new_decoder_architecture=True, num_kv_heads=2
    )
    table = broken_table(falcon.WEIGHTS, "mlp.linear_fc1.weight", 3, lambda _: SCALED, LAYERS)
    ckpt = import_with_table(hf, tmp_path / "ck", falcon.FAMILY, table)
    report = harness.verify(hf, ckpt)
    assert not report.passed and report.first_divergent_layer == 3
    # the carried-in error of the last layer equals its own error: nothing came before it
    assert report.layers[3]["own_max_rel"] > 1e-3


def test_verify_json_has_layers_and_plot_is_written(llama4, tmp_path, capsys):
    from converters import llama

    table = broken_table(llama.WEIGHTS, "linear_qkv.weight", 2, lambda _: CONCAT, LAYERS)
    ckpt = import_with_table(llama4, tmp_path / "ck", llama.FAMILY, table)
    png = tmp_path / "layers.png"
    code = main(["verify", str(llama4), str(ckpt), "--json", "--plot", str(png)])
    out = capsys.readouterr().out
    report = json.loads(out[: out.rindex("}") + 1])
    assert code == 1 and report["first_divergent_layer"] == 2
    assert [d["layer"] for d in report["layers"]] == list(range(LAYERS))
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_a_missing_layer_tensor_is_named_by_layer_and_key(tiny_llama, tiny_nemo, tmp_path):
    import shutil

    hf = tmp_path / "hf"
    shutil.copytree(tiny_llama, hf)
    sd = load_file(hf / "model.safetensors")
    del sd["model.layers.1.mlp.down_proj.weight"]
    save_file(sd, hf / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PortingError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        harness.verify(hf, tiny_nemo)


def test_a_layer_of_the_wrong_width_is_named(tiny_llama, tiny_nemo, tmp_path):
    import shutil

    hf = tmp_path / "hf"
    shutil.copytree(tiny_llama, hf)
    sd = load_file(hf / "model.safetensors")
    sd["model.layers.0.mlp.up_proj.weight"] = torch.zeros(50, 64)
    save_file(sd, hf / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PortingError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*\(50, 64\)"):
        harness.verify(hf, tiny_nemo)


def test_both_models_and_the_heads_share_two_areas():
    from porting.parity.streamed import _Buffers

    def base(t):
        return t.untyped_storage().data_ptr()

    b = _Buffers(torch.device("cpu"))
    b.reserve(100)  # the HF model: layers of up to 100 values
    q, k = b.take(0, "q", torch.Size([4, 5])), b.take(0, "k", torch.Size([10]))
    r = b.take(1, "q", torch.Size([4, 5]))
    area0, area1 = base(q), base(r)
    assert base(k) == area0 != area1
    assert k.data_ptr() == q.data_ptr() + 20 * 4  # carved one after the other
    assert b.take(2, "q", torch.Size([4, 5])).data_ptr() == q.data_ptr()  # layer 2: layer 0's
    assert base(b.take(0, "over", torch.Size([200]))) not in (area0, area1)  # past the area
    b.reserve(80)  # the Megatron model: the same areas, forgotten views
    assert base(b.take(1, "fc", torch.Size([80]))) == area1
    assert base(b.head()("w", torch.Size([10, 10]))) == area0  # a head that fits
    big = b.head()("w", torch.Size([200]))  # one that does not: the areas are freed first
    assert base(big) not in (area0, area1) and b._areas == [None, None]
    b.reserve(120)  # larger than the areas were: made again at that size, when used
    assert b.take(0, "q", torch.Size([120])).untyped_storage().nbytes() == 120 * 4


def test_a_gated_mlp_factory_reads_into_its_rows_as_its_merge_would(tiny_llama, tiny_nemo):
    from accelerate import init_empty_weights
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    from porting.contract.registry import family_by_name
    from porting.convert import dist_reader
    from porting.convert.checkpoint import open_checkpoint
    from porting.convert.megatron import build_mcore_model, checkpoint_config, init_parallel

    init_parallel()
    checkpoint = open_checkpoint(tiny_nemo)
    config = checkpoint_config(checkpoint, family_by_name(checkpoint.family), torch.float32)
    with init_empty_weights():
        model = build_mcore_model(config)
    loc = checkpoint.located
    reader = dist_reader.DistCheckpointReader(loc.weights)
    sharded = model.sharded_state_dict(prefix=loc.prefix)
    factories = {k: v for k, v in sharded.items() if isinstance(v, ShardedTensorFactory)}
    assert factories, "the tiny Llama's MLPs are gated: each fc1 is a factory"
    for key, item in factories.items():
        merged = item.merge_fn([reader.read_sharded(part) for part in item.build()])
        out = torch.full(merged.shape, float("nan"))
        assert dist_reader._concatenates(item, item.build(), out), key
        with pytest.MonkeyPatch.context() as mp:  # read into its rows: never merged
            mp.setattr(torch, "cat", lambda *a, **k: pytest.fail("merged"))
            direct = reader.read_sharded(item, out=out)
        assert torch.equal(direct, merged.float()), key
        wrong = torch.empty(merged.shape[0] + 1, *merged.shape[1:])
        with pytest.raises(PortingError, match="merges to"):
            reader.read_sharded(item, out=wrong)


def test_a_released_layer_keeps_no_view_of_an_area():
    from porting.parity.modules import release, set_param, stored_tensors
    from porting.parity.streamed import _Buffers

    class Router(torch.nn.Module):  # a weight and a persistent buffer, as a router's bias is
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(4, 8, device="meta"))
            self.register_buffer("bias", torch.empty(4, device="meta"))

    layer, b = Router(), _Buffers(torch.device("cpu"))
    b.reserve(64)
    for name, t in list(stored_tensors(layer)):
        set_param(layer, name, b.take(0, name, t.shape))
    area = b._areas[0].untyped_storage().data_ptr()
    assert {t.untyped_storage().data_ptr() for t in (layer.weight, layer.bias)} == {area}
    release(layer)
    assert layer.weight.is_meta and layer.bias.is_meta
