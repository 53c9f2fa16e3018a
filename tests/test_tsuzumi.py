"""The tsuzumi family, a derived product on the Llama base: its own architecture name converts
with the full proof, and a checkpoint written before the Llama base was split out (an earlier
porting, ``family: tsuzumi`` from a ``LlamaForCausalLM`` directory; shipped in
tests/data/tsuzumi-0.1 with its HF source) keeps verifying and exporting exactly.

Tolerance: porting.proof's, fp32 full logits at atol=rtol=1e-5 and 100% top-1.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from porting import proof
from porting.api import import_hf
from porting.contract import registry
from porting.testing import make_llama

WRITTEN_BEFORE = Path(__file__).parent / "data" / "tsuzumi-0.1"


@pytest.fixture(scope="module")
def old(tmp_path_factory):
    """The shipped checkpoint, copied so that no test can write into the repository."""
    root = tmp_path_factory.mktemp("tsuzumi-0.1")
    shutil.copytree(WRITTEN_BEFORE, root, dirs_exist_ok=True)
    return root / "hf", root / "nemo"


def test_a_checkpoint_written_before_the_llama_base_names_the_tsuzumi_family(old):
    manifest = json.loads((old[1] / "context" / "porting.json").read_text())
    assert manifest["family"] == "tsuzumi"
    assert manifest["hf_architecture"] == "LlamaForCausalLM"
    assert b"models.tsuzumi" in (old[1] / "context" / "io.json").read_bytes()


def test_a_checkpoint_written_before_the_llama_base_keeps_its_parity(old):
    proof.prove_parity(*old)


def test_a_checkpoint_written_before_the_llama_base_exports_exactly(old, tmp_path):
    proof.prove_round_trip(*old, tmp_path / "hf-back")


def test_a_checkpoint_megatron_core_0_15_saved_converts_to_megatron_lm_for_any_loader(
    old, tmp_path
):
    """Its ``.metadata`` names Megatron-Core 0.15's ``MCoreMetadata``, which later versions
    keep only as an empty placeholder: read on either stack, converted with the gate, and the
    Megatron-LM copy's metadata is a torch ``Metadata`` that the installed Megatron-Core unpickles
    (its own subclass on 0.15, torch's class from 0.16 on)."""
    import pickle

    import megatron.core.dist_checkpointing.strategies.torch  # noqa: F401  (the class, as loaders do)
    from torch.distributed.checkpoint.metadata import Metadata

    from porting.api import convert

    assert b"MCoreMetadata" in (old[1] / "weights" / ".metadata").read_bytes()
    convert(old[1], tmp_path / "mlm", "megatron-lm", show_progress=False)
    (written,) = (tmp_path / "mlm").glob("iter_*/.metadata")
    with open(written, "rb") as f:
        md = pickle.load(f)
    assert isinstance(md, Metadata) and type(md).__module__.split(".")[0] in ("torch", "megatron")
    proof.prove_round_trip(old[0], tmp_path / "mlm", tmp_path / "hf-back")


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """A checkpoint under tsuzumi's own architecture name: the Llama layout, its own names."""
    root = tmp_path_factory.mktemp("tsuzumi")
    hf = make_llama(root / "hf", num_kv_heads=2)
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(architectures=["TsuzumiForCausalLM"], model_type="tsuzumi")
    (hf / "config.json").write_text(json.dumps(cfg, indent=2))
    import_hf(hf, root / "nemo", verify=False, show_progress=False)
    return hf, root / "nemo"


def test_tsuzumi_s_own_architecture_is_claimed_by_the_tsuzumi_family(own):
    manifest = json.loads((own[1] / "context" / "porting.json").read_text())
    assert manifest["family"] == "tsuzumi"
    assert registry.family_for_config(manifest["hf_config"]).name == "tsuzumi"
    assert registry.family_for_config({"architectures": ["LlamaForCausalLM"]}).name == "llama"


def test_tsuzumi_s_own_architecture_has_parity(own):
    proof.prove_parity(*own)


def test_tsuzumi_s_own_architecture_round_trips_exactly(own, tmp_path):
    proof.prove_round_trip(*own, tmp_path / "hf-back")
