"""What the gate sees of each mapped config feature (:data:`FEATURES`): each perturbed on the
HF side alone must move the logits past the tolerance, or be named in the gate's report."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch

from porting.proof.parity import ATOL, RTOL, gate_prompts


def _nulled(name: str):
    def perturb_config(config) -> dict | None:
        return None if getattr(config, name, None) is None else {name: None}

    return perturb_config


def _doubled(name: str):
    def perturb_config(config) -> dict | None:
        value = getattr(config, name, None)
        if not isinstance(value, int | float) or isinstance(value, bool):
            return None
        return {name: 2 * value}

    return perturb_config


def _rotary(perturb):
    """``perturb`` only where the config's attention is rotary: Falcon's ALiBi layout maps
    ``rope_theta`` and never uses it."""

    def perturb_config(config) -> dict | None:
        return None if getattr(config, "alibi", False) is True else perturb(config)

    return perturb_config


def _window_removed(config) -> dict | None:
    from porting.parity import harness

    if harness.sliding_window_of(config) is None:
        return None
    types = getattr(config, "layer_types", None)
    if isinstance(types, list | tuple):  # Gemma 2 builds its sliding mask whatever the layers
        return {"layer_types": ["full_attention"] * len(types)}
    return {"sliding_window": None}


def _layers_swapped(config) -> dict | None:
    from porting.parity import harness

    types = getattr(config, "layer_types", None)
    if harness.sliding_window_of(config) is None or not isinstance(types, list | tuple):
        return None
    swap = {"full_attention": "sliding_attention", "sliding_attention": "full_attention"}
    return {"layer_types": [swap.get(t, t) for t in types]}


def _other_gelu(name: str):
    from porting.parity.harness import GELU_VARIANTS

    def perturb_config(config) -> dict | None:
        value = getattr(config, name, None)
        if value not in GELU_VARIANTS:
            return None
        other = GELU_VARIANTS[1 - GELU_VARIANTS.index(value)]
        # both spellings where a config has both and they agree (where they disagree, the one
        # the reference class reads is the feature: converters/gemma.py)
        return {
            f: other
            for f in ("hidden_act", "hidden_activation")
            if getattr(config, f, None) == value
        }

    return perturb_config


# HF config field -> perturb(transformers config) -> the changed fields, or None where the config
# does not use the feature. A family's tests may pass more (``features=FEATURES | {...}``).
FEATURES = {
    "sliding_window": _window_removed,
    "layer_types": _layers_swapped,
    "attn_logit_softcapping": _nulled("attn_logit_softcapping"),
    "final_logit_softcapping": _nulled("final_logit_softcapping"),
    "hidden_activation": _other_gelu("hidden_activation"),
    "hidden_act": _other_gelu("hidden_act"),
    "rope_scaling": _rotary(_nulled("rope_scaling")),
    "query_pre_attn_scalar": _doubled("query_pre_attn_scalar"),
    # Granite's scalars on the embeddings, the attention scores, each residual branch, the logits
    "attention_multiplier": _doubled("attention_multiplier"),
    "embedding_multiplier": _doubled("embedding_multiplier"),
    "residual_multiplier": _doubled("residual_multiplier"),
    "logits_scaling": _doubled("logits_scaling"),
    "rope_theta": _rotary(_doubled("rope_theta")),
}


@dataclasses.dataclass
class Sighted:
    """Per mapped feature present in the config: max |d logit| when it is perturbed, split by
    whether that fails the gate's tolerance (observed) or passes it (unobserved)."""

    observed: dict[str, float]
    unobserved: dict[str, float]


@torch.no_grad()
def prove_features_observed(
    hf_dir: str | Path, prompts=None, atol: float = ATOL, rtol: float = RTOL, features=None
) -> Sighted:
    """Which of the family's mapped features (:data:`FEATURES`, or ``features``) the gate's
    ``prompts`` (default :func:`gate_prompts`) see: the HF model built with the same weights from
    its own config and from the config with that feature perturbed
    (``from_pretrained(hf_dir, config=perturbed)``), each perturbation compared with
    :func:`porting.parity.harness.compare` at ``atol`` / ``rtol``. A feature whose perturbation
    passes that comparison would pass the gate if a conversion dropped it."""
    from porting.contract.hf_spelling import transformers_config
    from porting.convert.hf_files import family_for_hf_dir
    from porting.parity import harness

    family, cfg = family_for_hf_dir(hf_dir)
    prompts = gate_prompts(hf_dir) if prompts is None else prompts
    cls = family.hf_class(cfg["architectures"][0])
    config = transformers_config(cls, cfg)
    mapped = harness.mapped_fields(family)

    def run(conf) -> list[torch.Tensor]:
        model = cls.from_pretrained(
            str(hf_dir),
            config=conf,
            dtype=torch.float32,
            attn_implementation=family.hf_attn_implementation,
            local_files_only=True,
        ).eval()
        return [model(p).logits.float() for p in prompts]

    # transformers 5's config objects fold rope_theta, rope_scaling and partial_rotary_factor into
    # rope_parameters, so a perturbation set on the object would reach no layer. The perturbers
    # read and change those fields as transformers 4 spells them (the config file in that
    # spelling: ``cfg``), and each perturbed config is built from that spelling, which
    # transformers 4 and 5 both read.
    view = copy.deepcopy(config)
    for key, value in cfg.items():
        if not hasattr(view, key):
            setattr(view, key, copy.deepcopy(value))
    if hasattr(view, "rope_parameters"):
        # and its rope_scaling reads back rope_parameters, where transformers 4's meant "none"
        view.rope_scaling = copy.deepcopy(cfg.get("rope_scaling"))
    base = run(config)
    seen = Sighted({}, {})
    for name, perturb_config in (FEATURES if features is None else features).items():
        changes = perturb_config(view) if name in mapped else None
        if not changes:
            continue
        perturbed = transformers_config(cls, {**cfg, **copy.deepcopy(changes)})
        moved = harness.compare(base, run(perturbed), atol=atol, rtol=rtol)
        (seen.unobserved if moved.passed else seen.observed)[name] = moved.max_abs_diff
    return seen


def prove_features_named(hf_dir: str | Path, ckpt_or_report, features=None):
    """Every mapped feature that the gate's prompts cannot see (:func:`prove_features_observed`,
    at the report's tolerances) is named in the gate's ``unobserved`` list. ``ckpt_or_report``:
    a :class:`~porting.parity.harness.ParityReport`, or a checkpoint imported from ``hf_dir``
    (verified here at this kit's tolerance). Returns ``(sighted, report)``."""
    from porting.parity import harness

    report = ckpt_or_report
    if not isinstance(report, harness.ParityReport):
        report = harness.verify(hf_dir, ckpt_or_report, atol=ATOL, rtol=RTOL)
    seen = prove_features_observed(hf_dir, atol=report.atol, rtol=report.rtol, features=features)
    named = {u["field"] for u in report.unobserved}
    unnamed = sorted(set(seen.unobserved) - named)
    assert not unnamed, (
        f"the gate cannot see {unnamed} (max |d logit| when perturbed: "
        f"{[f'{seen.unobserved[n]:.1e}' for n in unnamed]}) and its report does not say so:\n"
        + report.summary()
    )
    return seen, report
