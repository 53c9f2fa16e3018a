"""The family contract's own pieces: named Megatron objects, loaded only when a conversion needs
them, and a family whose classes are named rather than imported."""

from __future__ import annotations

import dataclasses

import pytest

from converters import gemma, llama
from porting.contract import named
from porting.errors import PortingError


def test_a_named_object_loads_what_it_names():
    ref = named.Named("porting.contract.config_map:with_common")
    from porting.contract.config_map import with_common

    assert ref.load() is with_common
    assert named.resolve({"a": ref, "b": 1}) == {"a": with_common, "b": 1}


@pytest.mark.parametrize("ref", ["no_colon", "a:b:c", ":x", "mod:", "1mod:x", "mod:x y"])
def test_a_malformed_reference_is_refused_by_name(ref):
    with pytest.raises(PortingError, match="not a 'module:qualname' reference"):
        named.Named(ref)


def test_a_reference_to_a_missing_name_says_which_module_lacks_it():
    with pytest.raises(PortingError, match="module porting.contract.config_map has no 'Nope'"):
        named.load("porting.contract.config_map:Nope")


def test_our_families_name_their_megatron_side_instead_of_importing_it():
    for family in (llama.FAMILY, gemma.FAMILY):
        assert isinstance(family.config_cls, str) and isinstance(family.model_cls, str)
        named = (family.config_cls, family.model_cls, family.core_config_cls)
        assert family.megatron_modules == {ref.split(":")[0] for ref in named}
        assert len(family.megatron_modules) == 2  # models.x_nemo and the NeMo-free models.x
    assert all(isinstance(s, str) for s in gemma.FAMILY.context_symbols)


def test_a_named_class_that_is_not_a_class_is_refused_naming_the_family():
    broken = dataclasses.replace(llama.FAMILY, config_cls="porting.contract.named:load")
    with pytest.raises(PortingError, match="family llama: Family.config_cls .* names a function"):
        broken.config_class()
