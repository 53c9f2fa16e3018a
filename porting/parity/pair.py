"""Whether an HF directory and one of our checkpoints describe the same model, from their
configs alone.

The gate would find a pair of different shapes too, but only once the HF side has run (a
7B-shaped stack: half a minute). These checks need no torch, NeMo or Megatron, so ``porting
verify`` of such a pair answers at once.
"""

from __future__ import annotations

from pathlib import Path

from porting.contract.config_map import differences
from porting.contract.registry import family_by_name
from porting.convert.checkpoint import Checkpoint
from porting.convert.hf_files import HFSource, hf_config_of
from porting.errors import PortingError

# The Megatron fields that set the model's sizes. Two configs that differ in one describe models
# whose tensors could not even be exchanged: another model, not a conversion to judge. Every
# other field (a rotary base, a cap, a window, a bias) is the gate's to judge from the logits: a
# conversion that dropped one must fail there, by how much it moves them, and the proof kit's
# negative controls verify exactly such pairs.
SHAPE_FIELDS = frozenset(
    {
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "kv_channels",
        "num_moe_experts",
        "moe_ffn_hidden_size",
        "moe_shared_expert_intermediate_size",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_head_dim",
        "qk_pos_emb_head_dim",
        "v_head_dim",
    }
)


def settled(kwargs: dict) -> dict:
    """``kwargs`` with the shapes Megatron's ``TransformerConfig`` derives when they are left
    out (``__post_init__``)."""
    out = dict(kwargs)
    heads = out.get("num_attention_heads")
    if out.get("num_query_groups") is None:
        out["num_query_groups"] = heads
    if out.get("kv_channels") is None and isinstance(heads, int) and heads > 0:
        out["kv_channels"] = out.get("hidden_size", 0) // heads
    if out.get("ffn_hidden_size") is None and out.get("hidden_size") is not None:
        out["ffn_hidden_size"] = 4 * out["hidden_size"]
    if out.get("num_moe_experts") and out.get("moe_ffn_hidden_size") is None:
        out["moe_ffn_hidden_size"] = out["ffn_hidden_size"]
    return out


def check_pair(hf_dir: HFSource | str | Path, checkpoint: Checkpoint) -> dict:
    """Refuse an HF directory whose config describes another model than the one ``checkpoint``
    was made from (its manifest records that model's config); return the HF config.

    Compared: the architecture, the vocabulary and the fields that set tensor shapes
    (:data:`SHAPE_FIELDS`, read through the family's config map).
    """
    manifest = checkpoint.manifest
    family = family_by_name(manifest.family)
    hf_dir, hf_config, _ = hf_config_of(hf_dir)
    config_path = hf_dir / "config.json"
    # Not "made from another model": a manifest edited after the import says the same thing,
    # and which of the two is wrong is not known here.
    apart = (
        f"{checkpoint.path}: its manifest ({checkpoint.source}) and {config_path} describe "
        "different models (the manifest's value first)"
    )
    theirs = hf_config.get("architectures")
    arch = theirs[0] if isinstance(theirs, list) and theirs else theirs

    def runs(architecture):  # the HF class the reference side loads (tsuzumi: Llama's for both)
        return family.hf_model_class or architecture

    # Not family.claims: a checkpoint written when its family claimed another architecture
    # (tsuzumi, from LlamaForCausalLM) still pairs with the directory it came from.
    if runs(arch) != runs(manifest.hf_architecture):
        raise PortingError(
            f"{apart}: architecture {manifest.hf_architecture!r} against {arch!r} "
            f"({family.name} family)"
        )
    if hf_config.get("vocab_size") != manifest.vocab_size:
        raise PortingError(
            f"{apart}: vocab_size {manifest.vocab_size} against {hf_config.get('vocab_size')!r}"
        )
    where = f"{checkpoint.source}: hf_config"
    differ = differences(
        manifest.hf_config,
        hf_config,
        family.config_entries,
        where,
        str(config_path),
        SHAPE_FIELDS,
        settled,
    )
    if differ:
        raise PortingError(f"{apart}: " + "; ".join(differ))
    return hf_config
