"""Parity and the round trips: both sides' fp32 logits on the gate's prompts, the full-logit
comparison (``ATOL = RTOL = 1e-5``, 100% top-1), the streamed gate against the whole model, the
export back bit for bit, and the Megatron-LM and Megatron-Bridge layouts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from porting.convert.container import reference_architecture
from porting.testing import assert_streamed_agrees

ATOL = RTOL = 1e-5


def checkpoint_family(ckpt: str | Path):
    """``(family, manifest)`` of one of our checkpoints."""
    from porting.contract.registry import family_by_name
    from porting.convert.checkpoint import read_manifest

    manifest = read_manifest(ckpt)
    return family_by_name(manifest.family), manifest


def prompts_of(ckpt: str | Path) -> list[torch.Tensor]:
    """The gate's prompts, tokenized with the checkpoint's own tokenizer."""
    from transformers import AutoTokenizer

    from porting.parity import harness

    family, m = checkpoint_family(ckpt)
    tok = AutoTokenizer.from_pretrained(str(Path(ckpt) / m.tokenizer["path"]))
    config = harness.reference_config(family, m.hf_config)
    return harness.build_prompts(tok, m.vocab_size, config=config)


def logits(hf_dir: str | Path, ckpt: str | Path, prompts=None):
    """``(hf, megatron)`` fp32 logits per prompt, whole models, cut to the HF vocabulary."""
    from porting.parity import harness

    family, m = checkpoint_family(ckpt)
    prompts = prompts_of(ckpt) if prompts is None else prompts
    mc = harness.megatron_logits_from_checkpoint(ckpt, prompts, m.vocab_size)
    hf_cls = family.hf_class(reference_architecture(m))
    hf = harness.hf_logits(hf_dir, hf_cls, prompts, family.hf_attn_implementation)
    return hf, mc


def megatron_logits_with(ckpt: str | Path, prompts, **changes) -> list[torch.Tensor]:
    """fp32 Megatron logits of ``ckpt`` per prompt, cut to the HF vocabulary, with ``changes``
    set on its config before the model is built: a family's negative controls (one feature
    switched off on the Megatron side alone must break parity)."""
    from porting.convert.megatron import (
        build_mcore_model,
        init_parallel,
        load_weights,
        mcore_logits,
    )
    from porting.testing import checkpoint_config

    _, m = checkpoint_family(ckpt)
    init_parallel()
    config = checkpoint_config(ckpt)
    for key, value in changes.items():
        setattr(config, key, value)
    model = build_mcore_model(config)
    load_weights(model, ckpt)
    return [mcore_logits(model.float(), p)[..., : m.vocab_size] for p in prompts]


def assert_parity(hf, mc, atol: float = ATOL, rtol: float = RTOL) -> None:
    """Every logit of every position of every prompt within tolerance, and the same top-1."""
    assert len(hf) == len(mc) >= 4
    assert len({t.shape[1] for t in hf}) >= 3  # prompts of several lengths
    for a, b in zip(hf, mc, strict=True):
        torch.testing.assert_close(b, a, atol=atol, rtol=rtol)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def prove_parity(
    hf_dir: str | Path, ckpt: str | Path, prompts=None, streamed_atol: float = 1e-6
) -> None:
    """Whole-model fp32 parity at TP=1, and the streamed gate agreeing with it within
    ``streamed_atol`` (the streamed gate runs the prompts as one padded batch, the whole model
    one at a time: a sharp model's own rounding differs between the two)."""
    from porting.parity import harness

    family, _ = checkpoint_family(ckpt)
    prompts = prompts_of(ckpt) if prompts is None else prompts
    hf, mc = logits(hf_dir, ckpt, prompts)
    assert_parity(hf, mc)
    report = harness.compare(hf, mc)
    assert report.passed and report.top1_agreement == 1.0
    assert_streamed_agrees(hf_dir, ckpt, family, prompts, hf, mc, atol=streamed_atol)


def prove_round_trip(hf_dir: str | Path, ckpt: str | Path, out: str | Path) -> None:
    """Export is exact: tensors, ``config.json``, tokenizer; transformers loads it unchanged."""
    from transformers import AutoTokenizer

    from porting.api import export_hf
    from porting.commands.demo import compare_hf_dirs

    hf_dir, out = Path(hf_dir), Path(out)
    export_hf(ckpt, out, verify=False)
    rt = compare_hf_dirs(hf_dir, out)
    assert rt.same_keys and rt.equal_tensors == rt.tensors > 0, rt
    # the original config.json, key for key, value for value and in its order: the diff, if any
    back, original = (json.loads((d / "config.json").read_text()) for d in (out, hf_dir))
    diff = {
        k: (original.get(k, "<absent>"), back.get(k, "<absent>"))
        for k in original.keys() | back.keys()
        if k not in original or k not in back or original[k] != back[k]
    }
    assert diff == {}, f"config.json changed on export (original, exported): {diff}"
    assert list(back) == list(original), "config.json's keys came back in another order"
    text = "東京 hello world"
    tok_a = AutoTokenizer.from_pretrained(str(hf_dir))
    tok_b = AutoTokenizer.from_pretrained(str(out))
    assert tok_a(text)["input_ids"] == tok_b(text)["input_ids"]
    ids = torch.tensor([tok_b(text)["input_ids"]])
    family, m = checkpoint_family(ckpt)
    cls = family.hf_class(reference_architecture(m))  # no remote code: the family's own class
    with torch.no_grad():
        a = cls.from_pretrained(str(hf_dir)).eval()(ids).logits
        b = cls.from_pretrained(str(out)).eval()(ids).logits
    assert torch.equal(a, b)


def prove_formats(
    hf_dir: str | Path, work: str | Path, formats=("megatron-lm", "megatron-bridge")
) -> None:
    """HF -> each Megatron layout in ``formats`` (gated) -> HF is exact
    (:func:`prove_round_trip`), and the layout is the one its owner reads
    (``latest_checkpointed_iteration.txt``, ``iter_0000000/``, Megatron-Bridge's
    ``run_config.yaml``, our files in ``porting/``)."""
    from porting.api import import_hf
    from porting.convert.checkpoint import locate

    work = Path(work)
    for fmt in formats:
        ckpt = work / fmt
        import_hf(hf_dir, ckpt, fmt=fmt, show_progress=False)
        loc = locate(ckpt)
        # The layout is found by its own files (Bridge's run_config.yaml, which the round trip's
        # export then reads back against the family).
        assert (loc.format, loc.weights.name, loc.prefix) == (fmt, "iter_0000000", "")
        assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "0"
        assert (loc.weights / "common.pt").is_file() and loc.manifest_path.is_file()
        assert not (ckpt / "context").exists() and not (ckpt / "weights").exists()
        prove_round_trip(hf_dir, ckpt, work / f"{fmt}-hf")


def prove_bridge_refused(hf_dir: str | Path, work: str | Path, reasons: list[str]) -> None:
    """A family Megatron-Bridge's ``GPTModelProvider`` cannot describe (a config field it lacks,
    or the family's own ``megatron_bridge_refusal``) is refused in the megatron-bridge layout,
    one of ``reasons`` named, before any tensor is read (the same refusal for the directory
    without its weights), and nothing is written."""

    from porting.api import import_hf
    from porting.errors import PortingError

    bare = Path(work) / "bridge-no-weights"
    shutil.copytree(hf_dir, bare, ignore=shutil.ignore_patterns("*.safetensors*", "*.bin"))
    for source in (hf_dir, bare):
        out = Path(work) / "bridge"
        try:
            import_hf(source, out, fmt="megatron-bridge", show_progress=False)
        except PortingError as err:
            assert any(reason in str(err) for reason in reasons), err
            assert "GPTModelProvider" in str(err)
        else:
            raise AssertionError("the megatron-bridge layout was written")
        assert not out.exists() and not list(Path(work).glob(".bridge.partial-*"))


def gate_prompts(hf_dir: str | Path) -> list[torch.Tensor]:
    """The gate's prompts for an HF directory (its tokenizer and config), as ``verify`` builds
    them for a checkpoint imported from it."""
    from transformers import AutoTokenizer

    from porting.convert.hf_files import family_for_hf_dir
    from porting.parity import harness

    family, cfg = family_for_hf_dir(hf_dir)
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    config = harness.reference_config(family, cfg)
    return harness.build_prompts(tok, config.vocab_size, config=config)
