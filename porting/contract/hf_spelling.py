"""The two ways transformers spells a ``config.json``, read into one and written back as they came.

transformers 5 writes a model's rotary settings as one ``rope_parameters`` object: the base
(``rope_theta``), the kind (``rope_type``) and its scaling keys together, ``partial_rotary_factor``
inside it (Phi-3), and one such object per layer type where the layer types differ (Gemma 3's
``full_attention`` and ``sliding_attention``). transformers 4.x wrote a top-level ``rope_theta``, a
``rope_scaling`` object for a scaled kind, a top-level ``partial_rotary_factor`` and, for Gemma 3,
``rope_local_base_freq``. Qwen3-MoE's expert count moved from ``num_experts`` to
``num_local_experts``, and Qwen2-MoE's unused window is written ``0`` (4.x: null).

Everything in porting reads one form, the 4.x one: the families' config maps and the gate's HF
reference (a 4.x ``transformers`` reads a 5.x config silently wrong: its rope base and scaling
ignored). :func:`internal` translates once, where a config is read; :func:`as_written` puts the
5.x keys back on export, so a 5.x config leaves as it came. A translation that could not be put
back exactly, or a 5.x object the 4.x form cannot express, is refused naming the key.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from porting.errors import PortingError

# The keys of a rope_parameters object that are not its scaling: where 4.x kept them apart.
_BASE = "rope_theta"
_PARTIAL = "partial_rotary_factor"
# What transformers 5.12 also writes beside Gemma 3's per-layer-type objects: the mixin's own
# defaults, which no layer reads.
_STRAY = {"rope_theta": None, "rope_type": "default"}
# model_type -> {5.x name: 4.x name}
RENAMED = {"qwen3_moe": {"num_local_experts": "num_experts"}}


def _renamed(cfg: dict) -> dict[str, str]:
    # any JSON value may stand where model_type should (the config rules refuse it after)
    model_type = cfg.get("model_type")
    return RENAMED.get(model_type, {}) if isinstance(model_type, str) else {}


def is_v5(cfg: dict) -> bool:
    """Whether ``cfg`` uses a 5.x spelling this module translates."""
    if "rope_parameters" in cfg:
        return True
    return any(new in cfg for new in _renamed(cfg))


def internal(cfg: dict, where: str = "config.json") -> dict:
    """``cfg`` in the 4.x spelling (a new dict; a 4.x config comes back equal to itself).

    Raises :class:`PortingError` naming ``where`` and the key for a 5.x config that says the same
    thing twice (``rope_parameters`` beside a top-level ``rope_theta`` or ``rope_scaling``), a
    ``rope_parameters`` that is not an object, or per-layer-type objects the 4.x form cannot hold.
    """
    if not is_v5(cfg):
        return cfg
    out: dict[str, Any] = {}
    renamed = _renamed(cfg)
    for key, value in cfg.items():
        if key == "rope_parameters":
            for name in ("rope_scaling", _BASE, "rope_local_base_freq"):
                if name in cfg:
                    raise PortingError(
                        f"{where}: both rope_parameters (transformers 5) and {name} "
                        "(transformers 4) are set; keep one"
                    )
            out.update(_rope(value, cfg, where))
        elif key == "sliding_window" and value == 0 and cfg.get("use_sliding_window") is False:
            # 5.x writes 0 for Qwen2-MoE's unused window; every config class with the switch sets
            # the window to None once it is off, which 4.x spells null (0 is no window at all)
            out[key] = None
        elif key in renamed:
            old = renamed[key]
            if old in cfg:
                raise PortingError(
                    f"{where}: both {key} (transformers 5) and {old} (transformers 4) are set; "
                    "keep one"
                )
            out[old] = value
        else:
            out[key] = copy.deepcopy(value)
    return out


def _rope(params, cfg: dict, where: str) -> dict:
    """The 4.x keys for one ``rope_parameters`` value."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise PortingError(f"{where}: rope_parameters must be an object, not {params!r:.80}")
    # one object per layer type ("full_attention", "sliding_attention"): no scaling value is an
    # object (short_factor and long_factor are lists)
    nested = {k for k, v in params.items() if isinstance(v, dict)}
    if not nested:
        return _flat(params, where, "rope_parameters", cfg)
    stray = {k: v for k, v in params.items() if k not in nested}
    if any(k not in _STRAY or _STRAY[k] != v for k, v in stray.items()):
        raise PortingError(
            f"{where}: rope_parameters mixes per-layer-type objects ({', '.join(sorted(nested))}) "
            f"with {', '.join(sorted(stray))}"
        )
    objects = {k: params[k] for k in sorted(nested)}
    if len({repr(sorted(v.items())) for v in objects.values()}) == 1:
        return _flat(next(iter(objects.values())), where, f"rope_parameters.{min(objects)}", cfg)
    # Gemma 3 in 4.x: the full-attention layers' base and scaling, and the sliding layers' own
    # base in rope_local_base_freq (those layers unscaled)
    if nested != {"full_attention", "sliding_attention"}:
        raise PortingError(
            f"{where}: rope_parameters differ per layer type ({', '.join(sorted(nested))}); "
            "transformers 4 can hold only full_attention and sliding_attention ones"
        )
    local = objects["sliding_attention"]
    if set(local) - {_BASE, "rope_type"} or local.get("rope_type", "default") != "default":
        raise PortingError(
            f"{where}: rope_parameters.sliding_attention is scaled ({local!r:.120}); "
            "transformers 4 keeps the sliding layers' rotary unscaled"
        )
    out = _flat(objects["full_attention"], where, "rope_parameters.full_attention", cfg)
    if _BASE in local:
        out["rope_local_base_freq"] = local[_BASE]
    return out


def _flat(params: dict, where: str, name: str, cfg: dict) -> dict:
    out: dict[str, Any] = {}
    if params.get(_BASE) is not None:
        out[_BASE] = params[_BASE]
    if _PARTIAL in params:
        out[_PARTIAL] = params[_PARTIAL]
    kind = params.get("rope_type", params.get("type", "default"))
    scaling = {
        k: copy.deepcopy(v)
        for k, v in params.items()
        # 5.x copies a top-level original_max_position_embeddings into the object (Phi-3, whose
        # 4.x config keeps it only at the top), and writes rope_type beside a 4.x "type"
        if k not in (_BASE, _PARTIAL)
        and not (k in cfg and cfg[k] == v)
        and not (k == "rope_type" and params.get("type") == v)
    }
    if kind == "default":
        if set(scaling) - {"rope_type", "type"}:
            raise PortingError(
                f"{where}: {name} has rope_type 'default' with scaling keys "
                f"{', '.join(sorted(set(scaling) - {'rope_type', 'type'}))}"
            )
        # 4.x's spelling of "unscaled" is an explicit null: an absent rope_scaling is the config
        # class's default, which for gpt-oss is YaRN
        out["rope_scaling"] = None
        return out
    out["rope_scaling"] = scaling
    return out


def as_written(hf_config: dict, written: dict | None, where: str = "config.json") -> dict:
    """The config to write for ``hf_config`` (4.x spelling) of a checkpoint whose source config was
    ``written`` (its 5.x spelling as it came; None for a 4.x source): ``written`` itself where
    nothing changed, with any other key's change carried over. A change to a translated key
    (the rope settings, a renamed field) is refused: it could not be written back in 5.x form."""
    if written is None:
        return hf_config
    translated = internal(written, where)
    kept = {k for k in written if k in translated and translated[k] == written[k]}
    out = copy.deepcopy(written)
    for key, value in hf_config.items():
        if key in kept or (key not in translated and key not in written):
            out[key] = copy.deepcopy(value)
        elif translated.get(key, object()) != value:
            raise PortingError(
                f"{where}: {key} is {value!r:.80} now, {translated.get(key)!r:.80} when it was "
                "imported; a changed rotary or renamed field cannot be written back in the "
                "transformers 5 form it came in"
            )
    gone = [k for k in kept if k not in hf_config]
    for key in gone:
        del out[key]
    return out


def transformers_config(cls, hf_config: dict):
    """The installed transformers' config of model class ``cls`` for ``hf_config`` (4.x spelling):
    how the gate's reference reads a config that came in 5.x spelling or that transformers 5
    would read otherwise (:func:`config_for_reference`)."""
    cfg = copy.deepcopy(hf_config)
    if _unscaled_read_as_default(cls.config_class, cfg):
        # transformers 5 spells "unscaled" only inside rope_parameters
        del cfg["rope_scaling"]
        params = {"rope_type": "default"}
        if cfg.get(_BASE) is not None:
            params[_BASE] = cfg.pop(_BASE)
        cfg["rope_parameters"] = params
    return cls.config_class.from_dict(cfg)


def config_for_reference(cls, hf_config: dict, written: dict | None):
    """The config the gate's reference model of class ``cls`` is built from, or None where the
    installed transformers reads the checkpoint's own ``config.json`` as it means: a file spelled
    by transformers 5 (``written``) reaches a 4.x transformers translated, and a 4.x file's
    explicit ``rope_scaling: null`` reaches transformers 5 as "unscaled" where 5.x would read it
    as the class's scaled default (gpt-oss's YaRN; transformers 4 reads it as written)."""
    if written is None and not _unscaled_read_as_default(cls.config_class, hf_config):
        return None
    return transformers_config(cls, hf_config)


def _unscaled_read_as_default(config_class, cfg: dict) -> bool:
    if "rope_scaling" not in cfg or cfg["rope_scaling"] is not None or "rope_parameters" in cfg:
        return False
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        return False
    return _default_is_scaled(config_class)


@functools.cache
def _default_is_scaled(config_class) -> bool:
    try:
        default = config_class()
    except Exception:  # a plugin's class that needs arguments: its null read as written
        return False
    params = getattr(default, "rope_parameters", None)
    kind = params.get("rope_type", "default") if isinstance(params, dict) else "default"
    return kind != "default"
