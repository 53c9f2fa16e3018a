"""The registry's contents are pinned: adding a family is a deliberate, reviewed line."""

from porting import registry


def test_registry_lists_exactly_the_known_families():
    assert registry.FAMILIES == {
        "LlamaForCausalLM": "converters.tsuzumi",
        "FalconForCausalLM": "converters.falcon",
    }


def test_each_registered_family_answers_to_its_architecture():
    for arch in registry.FAMILIES:
        assert registry.family_for_architecture(arch).hf_architecture == arch
