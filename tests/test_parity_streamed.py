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


def test_both_models_and_the_vocabulary_slices_share_two_areas():
    from porting.parity.sides import Buffers

    def base(t):
        return t.untyped_storage().data_ptr()

    b = Buffers(torch.device("cpu"))
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
    spare = b.spare()  # a head's two slices, while a layer holds area 1
    assert base(spare("s0", torch.Size([5, 10]))) == area0
    assert base(spare("s1", torch.Size([5, 10]))) == area0
    assert base(spare("s2", torch.Size([5]))) not in (area0, area1)  # past area 0: its own
    assert base(b.spare()("s", torch.Size([200]))) not in (area0, area1)  # larger than area 0
    b.take(2, "fc", torch.Size([10]))  # a layer holds area 0: never handed out under it
    assert base(b.spare()("s", torch.Size([10]))) != area0
    b.free()  # no area is made for slices: they take memory of their own, no layer's size
    assert base(b.spare()("s", torch.Size([10]))) not in (area0, area1) and b._areas == [None, None]
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
    from porting.parity.sides import Buffers

    class Router(torch.nn.Module):  # a weight and a persistent buffer, as a router's bias is
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(4, 8, device="meta"))
            self.register_buffer("bias", torch.empty(4, device="meta"))

    layer, b = Router(), Buffers(torch.device("cpu"))
    b.reserve(64)
    for name, t in list(stored_tensors(layer)):
        set_param(layer, name, b.take(0, name, t.shape))
    area = b._areas[0].untyped_storage().data_ptr()
    assert {t.untyped_storage().data_ptr() for t in (layer.weight, layer.bias)} == {area}
    release(layer)
    assert layer.weight.is_meta and layer.bias.is_meta


def _table(rows: int, width: int, seed: int = 0):
    from porting.parity.vocab import VocabTable

    whole = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))
    asked = []

    def read(start, stop, out):
        asked.append((start, stop))
        out.copy_(whole[start:stop])

    return VocabTable("w", whole.shape, read, torch.device("cpu")), whole, asked


def test_a_vocabulary_table_looks_up_only_the_rows_asked_for():
    import torch.nn.functional as F

    table, whole, asked = _table(10_000, 8)
    ids = torch.tensor([[5, 9000, 5, 70, 71], [9999, 0, 70, 4000, 4001]])
    for got in (F.embedding(ids, table), table[ids], table.lookup(ids)):
        assert torch.equal(got, whole[ids])  # a gather: the same values, not close ones
    # ids up to 64 apart read as one run; the rest of the vocabulary never
    assert asked[:5] == [(0, 6), (70, 72), (4000, 4002), (9000, 9001), (9999, 10_000)]
    assert table.rows_read == 3 * 12
    with pytest.raises(
        IndexError, match=r"^w: id 10000 is out of range for a vocabulary of 10000$"
    ):
        table.lookup(torch.tensor([10_000]))


@pytest.mark.parametrize("rows_per_slice", [1, 7, 128, 10_000])
def test_a_vocabulary_table_multiplies_slice_by_slice_as_the_whole_table(
    rows_per_slice, monkeypatch
):
    import torch.nn.functional as F

    from porting.parity import vocab

    monkeypatch.setattr(vocab, "SLICE_BYTES", rows_per_slice * 4 * 16)
    table, whole, asked = _table(1000, 16)
    assert table.slice_rows == rows_per_slice
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(1000)
    want = F.linear(x, whole, bias)
    got = F.linear(x, table, bias)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # reduction order only
    assert torch.equal(torch.matmul(x, table.t()), F.linear(x, table))  # Megatron's spelling
    # every row read once per product, slice by slice in order
    assert table.rows_read == 3 * 1000
    starts = [a for a, _ in asked[: len(asked) // 3]]
    assert starts == list(range(0, 1000, rows_per_slice))


def test_an_operation_the_slices_do_not_cover_reads_the_table_whole_and_says_so(caplog):
    table, whole, _ = _table(50, 4)
    with caplog.at_level("WARNING", logger="porting.parity.vocab"):
        assert torch.equal(torch.sum(table, dim=0), whole.sum(dim=0))
    assert "w: the gate read this 50 x 4 table whole" in caplog.text


@pytest.mark.parametrize("tied", [False, True])
def test_the_gate_never_holds_a_vocabulary_table_whole(tied, tmp_path, monkeypatch):
    """The streamed gate's embedding and output layer, both sides, tied or not, are read by
    slices: nothing reads a table whole, and slices of a few rows give the report the default
    does (each logit the same dot product)."""
    from porting.api import import_hf
    from porting.contract.registry import family_by_name
    from porting.convert.megatron import init_parallel
    from porting.parity import vocab
    from porting.parity.streamed import streamed_logits

    hf = make_llama(tmp_path / "hf", vocab_size=301, tie_word_embeddings=tied, tokenizer_vocab=290)
    import_hf(hf, tmp_path / "ck", show_progress=False, verify=False)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 301, (1, n), generator=g) for n in (4, 19, 11)]
    init_parallel()

    def gate():
        return streamed_logits(hf, tmp_path / "ck", family_by_name("llama"), prompts, 301)

    monkeypatch.setattr(vocab.VocabTable, "whole", lambda self: pytest.fail(f"{self} read whole"))
    hf_default, mc_default, layers_default, _, _ = gate()
    monkeypatch.setattr(vocab, "SLICE_BYTES", 13 * 4 * 64)  # 13 rows of width 64: 24 slices
    monkeypatch.setattr(vocab, "_RUN_GAP", 0)  # a lookup reads runs of consecutive ids only
    read = []
    monkeypatch.setattr(vocab.VocabTable, "rows", _counting(vocab.VocabTable.rows, read))
    hf_sliced, mc_sliced, layers_sliced, _, _ = gate()
    assert max(stop - start for _, start, stop in read) <= 13 and len(read) > 2 * 24
    for a, b in zip(hf_default + mc_default, hf_sliced + mc_sliced, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert [d.layer for d in layers_sliced] == [d.layer for d in layers_default]


def _counting(rows, read: list):
    def counted(self, start, stop, out=None):
        read.append((self.name, start, stop))
        return rows(self, start, stop, out)

    return counted


def test_a_layer_read_by_pieces_holds_two_modules_at_a_time_and_gives_the_same_report(
    tiny_llama, tiny_nemo, monkeypatch
):
    """At the finest grain (what the proof kit runs for every family) each decoder layer's
    matrices are read while the module before computes and released when their module returns:
    at most one other module of the layers holds matrices when one is read, and each module is
    read once (the next one called is the one read ahead). The report is the default grain's,
    logit for logit."""
    from porting.contract.registry import family_by_name
    from porting.convert.megatron import init_parallel
    from porting.parity import sides, streamed
    from porting.parity.modules import own_matrices

    init_parallel()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 130, (1, n), generator=g) for n in (5, 23, 2)]
    family = family_by_name("llama")

    def gate():
        return streamed.streamed_logits(tiny_llama, tiny_nemo, family, prompts, 130)

    default = gate()
    loaded = []
    load_piece = sides.Side.load_piece

    def watched(self, i, sub, module, take):
        holding = [
            m
            for layer in self.layers
            for m in layer.modules()
            if any(not t.is_meta for _, t in own_matrices(m))
        ]
        assert len(holding) <= 1, f"layer {i} {sub}: {len(holding)} other modules hold matrices"
        assert module not in holding and not any(t.is_meta is False for t in module.parameters())
        loaded.append((type(self.model).__name__, i, sub))
        return load_piece(self, i, sub, module, take)

    monkeypatch.setattr(sides.Side, "load_piece", watched)
    with streamed.finest_grain():
        finest = gate()
    layers = 2  # tiny_llama's
    hf = [x for x in loaded if x[0] == "LlamaForCausalLM"]
    assert len(hf) == layers * 7  # q, k, v, o; gate, up, down
    # Megatron-Core registers linear_proj before linear_qkv and calls it after: a first layer's
    # order is learned, one read dropped; the second layer's reads are all used
    mc = [x for x in loaded if x[0] == "GPTModel"]
    # linear_qkv, linear_proj, linear_fc1, linear_fc2
    assert len(mc) <= layers * 4 + 1, [x[1:] for x in mc]
    assert [x[2] for x in mc if x[1] == 1] == [
        "self_attention.linear_qkv.", "self_attention.linear_proj.", "mlp.linear_fc1.",
        "mlp.linear_fc2.",
    ]  # fmt: skip
    for a, b in zip(default[0] + default[1], finest[0] + finest[1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert [d.max_abs for d in finest[2]] == pytest.approx(
        [d.max_abs for d in default[2]], abs=1e-6
    )


def test_a_large_tensor_a_model_fills_while_it_is_built_is_made_on_meta():
    """transformers 5's Llama 4 fills each layer's expert stack with torch.zeros before it is
    registered (5.4 GB a Scout layer): built for the gate, such a tensor is made on meta at once,
    while what a model keeps real (rotary frequencies, a mask) stays real."""
    from accelerate import init_empty_weights
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import (
        Llama4TextExperts,
        Llama4TextRotaryEmbedding,
    )

    from porting.parity.sides import LargeOnMeta

    with LargeOnMeta():
        assert torch.zeros(16, 1024, 1025).is_meta  # just over 64 MiB
        assert torch.full((4200, 4200), 1.0).is_meta and torch.ones(size=(9000, 2000)).is_meta
        assert not torch.zeros(16, 1024, 1024).is_meta  # 64 MiB
        assert not torch.zeros(4200, 4200, dtype=torch.bool).is_meta  # 17.6 MB of mask
        assert not torch.zeros(16, 1024, 1025, device="cpu").is_meta  # asked for by name
    scout = Llama4TextConfig(
        hidden_size=5120,
        intermediate_size=8192,
        num_local_experts=16,
        head_dim=128,
        num_attention_heads=40,
        rope_theta=500000.0,
    )
    with init_empty_weights(), LargeOnMeta():
        experts = Llama4TextExperts(scout)
        rotary = Llama4TextRotaryEmbedding(scout)
    assert experts.gate_up_proj.is_meta and experts.down_proj.is_meta
    assert not rotary.inv_freq.is_meta and rotary.inv_freq.abs().sum() > 0


def test_at_the_finest_grain_a_table_read_whole_is_an_error():
    """What the default grain does with a warning (test above), the proof kit's grain refuses:
    a family whose model uses its embedding in an operation the slices do not cover fails its
    own parity proof on the tiny model."""
    from porting.parity.streamed import finest_grain

    table, _, _ = _table(50, 4)
    with finest_grain(), pytest.raises(RuntimeError, match=r"^w: the model used this vocabulary"):
        torch.sum(table, dim=0)
    assert torch.equal(table.lookup(torch.tensor([3])), _table(50, 4)[1][3:4])


def test_a_matrix_used_outside_its_modules_call_is_read_for_that_use():
    """Between its module's calls a matrix of a layer read by pieces stands in for itself:
    its shape answers unread, and a use outside the call (transformers 5's DeepSeek-V2
    multiplies by its router's weight without calling the router) reads it for that use."""
    import torch.nn.functional as F

    from porting.parity.modules import StoredMatrix

    w = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    reads = []

    def read():
        reads.append(1)
        return w

    m = StoredMatrix(w.shape, w.dtype, "cpu", read)
    assert (m.shape, m.dtype, m.dim(), m.size(0), m.requires_grad) == ((6, 4), w.dtype, 2, 6, False)
    assert reads == []
    x = torch.randn(3, 4)
    assert torch.equal(F.linear(x.float(), m.type(torch.float32)), F.linear(x, w))
    assert torch.equal(x @ m.t(), x @ w.t()) and torch.equal(m[1], w[1])
    assert torch.equal(F.linear(x, m), F.linear(x, w)) and len(reads) == 4  # one a use


@pytest.mark.parametrize(
    "key,value,match",
    [
        # a head of another vocabulary: named with both shapes before anything runs
        ("lm_head.weight", torch.zeros(131, 64), r"lm_head\.weight.*\(131, 64\)"),
        # a NaN in one row of the head, read in a slice of its own: named, never compared
        ("lm_head.weight", "nan", r"lm_head\.weight' holds 1 NaN/Inf"),
        ("model.embed_tokens.weight", "nan", r"embed_tokens\.weight' holds 1 NaN/Inf"),
    ],
)
def test_a_bad_vocabulary_table_is_named_by_key(tiny_llama, tiny_nemo, tmp_path, key, value, match):
    import shutil

    hf = tmp_path / "hf"
    shutil.copytree(tiny_llama, hf)
    sd = load_file(hf / "model.safetensors")
    if value == "nan":  # row 5: read by the head's slice, and by the lookup's run of ids
        value = sd[key].clone()
        value[5, 3] = float("nan")
    sd[key] = value
    save_file(sd, hf / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PortingError, match=match):
        harness.verify(hf, tiny_nemo)
