"""NeMo 2's context, written without NeMo, is NeMo's own: byte for byte, for every published config.

``porting import`` writes ``context/io.json`` and ``context/model.yaml`` as data
(:mod:`porting.convert.nemo2_context`). Here NeMo itself records the same model: the family's NeMo
model class over its NeMo config of the same arguments, the conversion's strategy parallelism set
on it (NeMo's ``set_model_parallel_attributes``), the one-device CPU trainer, and
``TrainerContext.io_dump``; both files must be equal, byte for byte (NeMo's ``load_context``
reading an imported checkpoint: ``tests/test_llama.py``). The whole-import comparison (the streamed checkpoint
against NeMo's stock save, ``weights/`` and ``context/`` together) is in
``tests/test_streaming_import.py``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from porting.contract.registry import family_for_hf_config
from porting.convert import nemo2_context
from porting.convert.hf_files import load_tokenizer
from porting.convert.megatron import build_config, config_arguments

_spec = importlib.util.spec_from_file_location(
    "published_configs", Path(__file__).with_name("published_configs.py")
)
published = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(published)


def _nemo_context(family, hf_config: dict, dtype, tokenizer_dir: Path, out: Path, monkeypatch):
    """``out/io.json`` and ``out/model.yaml`` as NeMo writes them for an import's model."""
    from nemo import lightning as nl
    from nemo.collections.common.tokenizers.huggingface.auto_tokenizer import AutoTokenizer
    from nemo.lightning import _strategy_lib
    from nemo.lightning.io.pl import TrainerContext

    from porting.convert.connectors import model_class

    config, _ = build_config(family, hf_config, dtype, 128, nemo=True)
    # NeMo records the tokenizer by its directory's name, the one an import stages it under
    staged = out.parent / nemo2_context.TOKENIZER_DIR
    load_tokenizer(tokenizer_dir).save_pretrained(str(staged))
    cls = model_class(family)
    # NeMo wraps a class's __init__ to record its arguments the first time the class is built,
    # and a parent's wrapper, once a parent was built in the process, records over it with the
    # arguments the child hands its parent. A one-command import builds only this class, so the
    # test does as that process would, whatever this one built before.
    for parent in cls.__mro__[1:]:
        init = vars(parent).get("__init__")
        if getattr(getattr(init, "__code__", None), "co_name", "") == "wrapped_init":
            monkeypatch.setattr(parent, "__init__", init.__wrapped__)
    monkeypatch.setattr(cls, "__wrapped_init__", False, raising=False)
    model = cls(config, tokenizer=AutoTokenizer(str(staged)))
    strategy = nl.MegatronStrategy(
        ckpt_save_optimizer=False,
        always_save_context=True,
        ckpt_async_save=False,
        ckpt_parallel_save=False,
    )
    _strategy_lib.set_model_parallel_attributes(model, strategy.parallelism)
    trainer = nl.Trainer(devices=1, accelerator="cpu", strategy=strategy)
    TrainerContext(model=model, trainer=trainer, extra={}).io_dump(out, yaml_attrs=["model"])
    return out


@pytest.mark.parametrize("hub_id", sorted(published.PUBLISHED))
def test_the_context_is_the_one_nemo_writes(hub_id, tmp_path, tiny_llama, monkeypatch):
    cfg = published.PUBLISHED[hub_id]
    family = family_for_hf_config(cfg, f"{hub_id}/config.json")
    dtype = torch.bfloat16
    theirs = _nemo_context(
        family, cfg, dtype, tiny_llama, tmp_path / "nemo" / "context", monkeypatch
    )
    ours = tmp_path / "ours"
    nemo2_context.write_context(ours, family, config_arguments(family, cfg, dtype, 128))
    for name in ("io.json", "model.yaml"):
        assert (ours / "context" / name).read_text() == (theirs / name).read_text(), name


def test_a_value_fiddle_cannot_name_is_refused():
    with pytest.raises(TypeError, match="cannot write"):
        nemo2_context.io_json(nemo2_context.Call(nemo2_context.Symbol("m", "C"), [("x", object())]))
