"""Declarative mapping of HF ``config.json`` fields onto a family's Megatron config, with a lint.

A family lists every HF field it knows, in one of four kinds:

- :class:`Field`   - one HF field is one Megatron field (optionally converted both ways);
- :class:`Derived` - several HF fields together set Megatron fields (biases, rope scaling);
- :class:`Require` - a field whose value must satisfy a check, else the maths would change in a way
  we cannot represent; the error names the field and the value;
- :class:`Carry`   - a field that does not change the maths (ids, bookkeeping); it is stored in the
  checkpoint and written back unchanged on export;
- :class:`NoOp`    - a field that changes nothing at one value (``use_mrope: false``, ``rope_scaling:
  null``) and would change the maths at any other: carried at that value, refused naming it else;
- :class:`Undecided` - a field a new family has not decided yet (``porting new-family`` writes one
  per field it cannot place); a family with any is refused, all of them listed at once.

Any HF field the family does not list is an error: an unknown field might change the maths, and we
never drop one silently. :data:`COMMON` lists, once for every family, the fields of transformers'
``PretrainedConfig`` itself (``_name_or_path``, generation defaults, ``auto_map``, ...) that a
published ``config.json`` may hold; a family's own entry for such a field takes precedence.

Export writes the original ``config.json`` back key for key and value for value (:func:`to_hf`).

Values are checked before any conversion runs, so a size of ``0``, ``-1``, ``true`` or ``1.0``, a
``rope_theta`` of ``Infinity`` or a top-k above the expert count is refused naming the field and the
value instead of failing later inside Megatron, transformers or a layout transform:

- :data:`FIELD_RULES` gives each HF field name one rule (:data:`POSITIVE_INT`, :data:`WINDOW`,
  :data:`BOOL`, ...), applied in every family that lists the field, ours and plugins alike;
- :data:`RELATIONS` states once what fields need of each other (``num_experts_per_tok`` at most
  the expert count, heads dividing ``hidden_size``);
- ``Field``, ``Derived`` and ``Carry`` take an optional ``check`` that narrows the shared rule for
  one family (Gemma's ``head_dim`` may not be null).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from porting.errors import PortingError

_MISSING = object()


def _same(v: Any) -> Any:
    return v


@dataclass(frozen=True)
class Check:
    """A constraint on one HF field's value: ``ok(value)`` must hold; ``what`` the value must be.

    ``null_ok`` lets JSON ``null`` through (for fields where transformers reads null as "derive it",
    e.g. ``head_dim`` or ``num_key_value_heads``); use :meth:`or_null` to get such a check.
    """

    ok: Callable[[Any], bool]
    what: str
    null_ok: bool = False

    def or_null(self) -> Check:
        """The same check, also accepting ``null``."""
        return replace(self, null_ok=True, what=f"{self.what} or null")

    def __call__(self, name: str, value: Any, where: str) -> None:
        if value is None and self.null_ok:
            return
        if not self.ok(value):
            raise PortingError(f"{where}: {name}={value!r} is invalid: it must be {self.what}")


def _is_int(v: Any) -> bool:
    # bool is a subclass of int in Python; JSON true/false are never sizes
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    # json.loads accepts the non-standard literals NaN, Infinity and -Infinity; an int is always
    # finite (and math.isfinite would overflow on a huge one)
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))


POSITIVE_INT = Check(lambda v: _is_int(v) and v > 0, "a positive integer")
NON_NEGATIVE_INT = Check(lambda v: _is_int(v) and v >= 0, "an integer >= 0")
POSITIVE_FLOAT = Check(lambda v: _is_real(v) and v > 0, "a finite number > 0")
NON_NEGATIVE_FLOAT = Check(lambda v: _is_real(v) and v >= 0, "a finite number >= 0")
PROBABILITY = Check(lambda v: _is_real(v) and 0 <= v < 1, "a finite number in [0, 1)")
BOOL = Check(lambda v: isinstance(v, bool), "true or false")
# transformers masks keys at or beyond W positions back (masking_utils.sliding_window_overlay:
# kv_idx > q_idx - W), so W=0 admits no key at all and is no "off" value: null is. The attention
# kernels (flash-attn, Transformer Engine) take the window as a C int.
WINDOW = Check(lambda v: _is_int(v) and 0 < v < 2**31, "a positive integer below 2**31")
# Rotary embeddings turn channel pairs: transformers' and Megatron's inv_freq have dim/2 entries,
# so an odd head width fails inside the first attention (every family with a head_dim is rotary).
EVEN_WIDTH = Check(lambda v: _is_int(v) and v > 0 and v % 2 == 0, "a positive even integer")
LAYER_INDICES = Check(
    lambda v: isinstance(v, list) and all(_is_int(i) and i >= 0 for i in v),
    "a list of layer indices (integers >= 0)",
)
# transformers reads a string dtype as getattr(torch, name); "auto" takes the weights' own
DTYPE_NAME = Check(
    lambda v: v in ("float32", "float16", "bfloat16", "float64", "float", "half", "double", "auto"),
    "a floating dtype name (float32, float16, bfloat16, float64) or auto",
)
LAYER_TYPES = Check(
    lambda v: isinstance(v, list) and all(isinstance(t, str) for t in v),
    "a list of attention kinds, one string per layer",
)

# One rule per HF field name, applied by :func:`lint` in every family that lists the field, next to
# the entry's own ``check`` (which may only narrow it): transformers gives a field one meaning
# across its config classes, so a value that is wrong for one family is wrong for all of them, and
# no family may read ``sliding_window: 0`` otherwise than another.
FIELD_RULES: dict[str, Check] = {
    # sizes; null where transformers derives the value (head_dim: hidden/heads, KV heads: heads)
    "num_hidden_layers": POSITIVE_INT,
    "hidden_size": POSITIVE_INT,
    "intermediate_size": POSITIVE_INT,
    "ffn_hidden_size": POSITIVE_INT.or_null(),
    "num_attention_heads": POSITIVE_INT,
    "num_key_value_heads": POSITIVE_INT.or_null(),
    "num_kv_heads": POSITIVE_INT.or_null(),
    "head_dim": EVEN_WIDTH.or_null(),
    "vocab_size": POSITIVE_INT,
    "max_position_embeddings": POSITIVE_INT,
    "num_ln_in_parallel_attn": POSITIVE_INT.or_null(),
    # numbers
    "rms_norm_eps": POSITIVE_FLOAT,
    "layer_norm_epsilon": POSITIVE_FLOAT,
    "norm_eps": POSITIVE_FLOAT,
    "rope_theta": POSITIVE_FLOAT,
    "initializer_range": POSITIVE_FLOAT,
    "attention_dropout": PROBABILITY,
    "query_pre_attn_scalar": POSITIVE_FLOAT,
    "attn_logit_softcapping": POSITIVE_FLOAT.or_null(),
    "final_logit_softcapping": POSITIVE_FLOAT.or_null(),
    "torch_dtype": DTYPE_NAME.or_null(),
    "dtype": DTYPE_NAME.or_null(),
    # switches
    "tie_word_embeddings": BOOL,
    "attention_bias": BOOL,
    "mlp_bias": BOOL,
    "qkv_bias": BOOL,
    "bias": BOOL,
    "alibi": BOOL,
    "new_decoder_architecture": BOOL,
    "multi_query": BOOL,
    "parallel_attn": BOOL,
    # windows
    "sliding_window": WINDOW.or_null(),
    "sliding_window_size": WINDOW.or_null(),
    "use_sliding_window": BOOL,
    "max_window_layers": NON_NEGATIVE_INT,
    "layer_types": LAYER_TYPES.or_null(),
    "sliding_window_pattern": POSITIVE_INT,  # Gemma 3: every n-th layer global
    "rope_local_base_freq": POSITIVE_FLOAT,
    "use_bidirectional_attention": BOOL.or_null(),  # null: transformers 5's Gemma 1/2 (causal)
    "original_max_position_embeddings": POSITIVE_INT,  # LongRoPE's pretraining length (Phi-3)
    "resid_pdrop": PROBABILITY,
    "embd_pdrop": PROBABILITY,
    # experts
    "num_local_experts": POSITIVE_INT,
    "num_experts": POSITIVE_INT,
    "n_routed_experts": POSITIVE_INT,
    "num_experts_per_tok": POSITIVE_INT,
    "moe_intermediate_size": POSITIVE_INT,
    "shared_expert_intermediate_size": NON_NEGATIVE_INT.or_null(),  # 0 or null: none
    "decoder_sparse_step": POSITIVE_INT,  # transformers takes layer_idx + 1 modulo it
    "mlp_only_layers": LAYER_INDICES.or_null(),
    "norm_topk_prob": BOOL,
    "router_aux_loss_coef": NON_NEGATIVE_FLOAT,
    "router_jitter_noise": PROBABILITY,
    "output_router_logits": BOOL,
    # OLMo / OLMoE: q, k and v clamped to [-clip_qkv, clip_qkv]; null: no clamp
    "clip_qkv": POSITIVE_FLOAT.or_null(),
}


@dataclass(frozen=True)
class Relation:
    """Fields ``a`` and ``b`` of one config must satisfy ``ok(a, b)`` when both are present and
    not null (and ``unless`` is absent or null). ``says`` is the message, ``{a}`` and ``{b}``
    standing for ``name=value`` and ``{vb}`` for ``b``'s value alone
    (``num_experts_per_tok=9 must be at most num_local_experts=8``). Checked after each field's
    own rule, so ``ok`` sees values of the right type."""

    a: str
    b: str
    ok: Callable[[Any, Any], bool]
    says: str
    unless: str | None = None

    def __call__(self, hf_config: dict, where: str) -> None:
        va, vb = hf_config.get(self.a), hf_config.get(self.b)
        if va is None or vb is None or (self.unless and hf_config.get(self.unless) is not None):
            return
        if not self.ok(va, vb):
            said = self.says.format(a=f"{self.a}={va!r}", b=f"{self.b}={vb!r}", vb=vb)
            raise PortingError(f"{where}: {said}")


# The relations transformers or Megatron need between fields, each stated once for every family.
RELATIONS = (
    Relation(
        "num_key_value_heads",
        "num_attention_heads",
        lambda kv, h: h % kv == 0,
        "{a} must divide {b}",
    ),
    # an explicit head_dim makes the attention width heads x head_dim, apart from hidden_size;
    # without one, Megatron-LM (arguments.py) asserts the division and transformers' Falcon and
    # Qwen2-MoE raise
    Relation(
        "hidden_size",
        "num_attention_heads",
        lambda d, h: d % h == 0,
        "{a} must be a multiple of {b}",
        unless="head_dim",
    ),
    # the same for a head width that no head_dim gives (stricter than transformers only for
    # Falcon's ALiBi layout, which has no rotary embedding but no checkpoint of odd width either)
    Relation(
        "hidden_size",
        "num_attention_heads",
        lambda d, h: d // h % 2 == 0,
        "{a} over {b} must make an even head width (rotary embeddings turn channel pairs)",
        unless="head_dim",
    ),
    # torch.topk of k above the expert count fails inside the router
    Relation(
        "num_experts_per_tok", "num_local_experts", lambda k, n: k <= n, "{a} must be at most {b}"
    ),
    Relation("num_experts_per_tok", "num_experts", lambda k, n: k <= n, "{a} must be at most {b}"),
    Relation(
        "num_experts_per_tok", "n_routed_experts", lambda k, n: k <= n, "{a} must be at most {b}"
    ),
    # transformers' layer_type_validation raises on any other length
    Relation(
        "layer_types",
        "num_hidden_layers",
        lambda t, n: len(t) == n,
        "{a} must name one kind for each of the {vb} layers ({b})",
    ),
)


@dataclass(frozen=True)
class Field:
    """HF field ``hf`` <-> Megatron field ``mcore``; ``default`` applies when ``hf`` is absent.

    ``check`` constrains the HF value when it is present.
    """

    hf: str
    mcore: str
    to_mcore: Callable[[Any], Any] = _same
    to_hf: Callable[[Any], Any] = _same
    default: Any = _MISSING
    check: Check | None = None


@dataclass(frozen=True)
class Derived:
    """HF fields ``hf`` jointly set Megatron fields.

    ``to_mcore(hf_config) -> dict`` of Megatron fields (raise PortingError for unsupported values);
    ``to_hf(mcore_config) -> dict`` of HF fields for export. ``check`` applies to each of the
    ``hf`` fields that is present.
    """

    hf: tuple[str, ...]
    to_mcore: Callable[[dict], dict]
    to_hf: Callable[[Any], dict]
    check: Check | None = None
    # one line the import prints about these fields (note(hf_config); None for nothing)
    note: Callable[[dict], str | None] | None = None


@dataclass(frozen=True)
class Require:
    """HF field ``hf`` must satisfy ``ok(value)`` when present; ``why`` explains the constraint."""

    hf: str
    ok: Callable[[Any], bool]
    why: str


@dataclass(frozen=True)
class Carry:
    """HF field ``hf`` does not change the maths; it is carried through export unchanged.

    ``check`` constrains it where the engine reads it all the same (``vocab_size``).
    """

    hf: str
    check: Check | None = None


@dataclass(frozen=True)
class NoOp:
    """HF field ``hf`` changes nothing at the values ``values`` (compared with their JSON type:
    ``false`` is not ``0``), or, with ``same_as``, when it repeats that field's value (a legacy
    duplicate). Carried unchanged at such a value; any other is refused naming the no-op value,
    with ``why`` saying what it would change. ``note``, if given, is one line the import prints
    (``note(hf_config)``; ``None`` for nothing)."""

    hf: str
    values: tuple = ()
    why: str = ""
    same_as: str | None = None
    note: Callable[[dict], str | None] | None = None

    def is_noop(self, hf_config: dict) -> bool:
        """Whether the config's value of the field is one that changes nothing."""
        v = hf_config[self.hf]
        if any(_same_json(v, x) for x in self.values):
            return True
        return self.same_as is not None and _same_json(v, hf_config.get(self.same_as, _MISSING))

    def refusal(self, hf_config: dict, where: str) -> PortingError:
        """The one-line error for a value that is not a no-op."""
        ok = [_json_text(x) for x in self.values]
        if self.same_as is not None:
            ok.append(f"the value of {self.same_as}")
        return PortingError(
            f"{where}: {self.hf}={_json_text(hf_config[self.hf])} is not supported: {self.why} "
            f"(only {' or '.join(ok)} changes nothing and is carried)"
        )


def _same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values of the same kind: ``false`` is not ``0``, ``1`` is ``1.0``."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_json(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _json_text(v: Any) -> str:
    import json

    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 200 else text[:200] + "..."


@dataclass(frozen=True)
class Undecided:
    """HF field ``hf`` is still to decide (its value in the config the family was started from
    was ``seen``): map it, carry it or require a value. Refused until then."""

    hf: str
    seen: Any = None


ConfigEntry = Field | Derived | Require | Carry | NoOp | Undecided


def native_architecture(architecture: Any) -> bool:
    """Whether ``transformers`` itself defines the class ``architecture`` (no remote code)."""
    import transformers

    return isinstance(architecture, str) and isinstance(
        getattr(transformers, architecture, None), type
    )


def _auto_map_to_mcore(hf: dict) -> dict:
    if "auto_map" not in hf:
        return {}
    amap = hf["auto_map"]
    if not isinstance(amap, dict) or not all(isinstance(k, str) for k in amap):
        raise PortingError(f"config.json: auto_map={_json_text(amap)} must be an object")
    arch = (hf.get("architectures") or [None])[0]
    if not native_architecture(arch):
        raise PortingError(
            f"config.json: auto_map names remote code and {arch!r} is no transformers class, so that "
            "code is the model's only definition, which porting never runs; bring the architecture "
            "as a family: `porting new-family NAME --from HF_DIR` (docs/families.md)"
        )
    return {}


def _auto_map_note(hf: dict) -> str:
    arch = hf["architectures"][0]
    return (
        f"config.json: auto_map ({', '.join(sorted(hf['auto_map']))}) points trust_remote_code users "
        f"to the repository's own code; porting never runs or copies it: the reference is "
        f"transformers' native {arch}, and auto_map is carried unchanged"
    )


# Fields of transformers' PretrainedConfig itself (configuration_utils.py), which any published
# config.json may hold whatever its architecture: bookkeeping, generation defaults (generate()
# reads them, a forward pass never does) and encoder-decoder switches at their decoder-only value.
# A family's own entry for one of these names takes precedence.
_BOOKKEEPING = (
    "_name_or_path", "_commit_hash", "_attn_implementation_autoset", "transformers_version",
    "architectures", "torchscript", "use_bfloat16", "return_dict", "output_hidden_states",
    "output_attentions", "id2label", "label2id", "problem_type", "finetuning_task",
    "tokenizer_class", "prefix", "task_specific_params", "bos_token_id", "eos_token_id",
    "pad_token_id", "sep_token_id", "decoder_start_token_id", "torch_dtype", "dtype",
    # generation defaults: read by generate(), never by a forward pass
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens", "tf_legacy_loss",
    # how the forward is chunked or cached, not what it computes
    "chunk_size_feed_forward",
    # transformers.js's settings for the model's web (ONNX) export, such as its kv-cache dtypes:
    # read by the JavaScript port only, never by a forward pass here
    "transformers.js_config",
)  # fmt: skip
_DECODER_ONLY = "a decoder-only causal LM has no encoder or cross-attention"


class _Quantization(Check):
    """How the weights are stored, not what they compute: the engine reads FP8 blocks and MXFP4
    (:mod:`porting.convert.quant`), and refuses any other method by name before a tensor is read."""

    def __call__(self, name: str, value: Any, where: str) -> None:
        from porting.contract.quantization import read_quantization

        read_quantization({name: value}, where)


QUANTIZATION = _Quantization(lambda v: True, "a quantization_config porting reads")
COMMON: tuple[ConfigEntry, ...] = (
    *(Carry(name) for name in _BOOKKEEPING),
    Carry("quantization_config", check=QUANTIZATION),
    # every causal LM's; padded on the Megatron side by the engine, restored exactly on export
    Carry("vocab_size"),
    Carry("use_cache", check=BOOL),
    Carry("is_decoder", check=BOOL),  # the CausalLM classes read it nowhere
    NoOp("is_encoder_decoder", (False,), _DECODER_ONLY),
    NoOp("add_cross_attention", (False,), _DECODER_ONLY),
    NoOp("tie_encoder_decoder", (False,), _DECODER_ONLY),
    NoOp("cross_attention_hidden_size", (None,), _DECODER_ONLY),
    NoOp("pruned_heads", ({},), "pruned heads change the attention's shapes"),
    Derived(("auto_map",), _auto_map_to_mcore, lambda c: {}, note=_auto_map_note),
)


def with_common(entries: Iterable[ConfigEntry]) -> list[ConfigEntry]:
    """A family's entries plus each :data:`COMMON` entry for a field the family does not list."""
    entries = list(entries)
    own = known_fields(entries)
    return entries + [e for e in COMMON if not set(_names(e)) & own]


def undecided(entries: Iterable[ConfigEntry]) -> list[Undecided]:
    """The entries still to decide."""
    return [e for e in entries if isinstance(e, Undecided)]


def _names(entry: ConfigEntry) -> tuple[str, ...]:
    return entry.hf if isinstance(entry, Derived) else (entry.hf,)


def known_fields(entries: Iterable[ConfigEntry]) -> set[str]:
    """Every HF field name the family accounts for."""
    return {n for e in entries for n in _names(e)}


def lint(hf_config: dict, entries: Iterable[ConfigEntry], where: str = "config.json") -> None:
    """Raise :class:`PortingError` for an unknown field or a value the family cannot represent."""
    entries = with_common(entries)
    unknown = sorted(set(hf_config) - known_fields(entries))
    if unknown:
        raise PortingError(
            f"{where}: unsupported field(s) {', '.join(unknown)}; they may change the model's "
            "maths and cannot be dropped silently"
        )
    for e in entries:
        if isinstance(e, Field) and e.default is _MISSING and e.hf not in hf_config:
            raise PortingError(f"{where}: required field {e.hf!r} is missing")
    for name, value in hf_config.items():
        if name in FIELD_RULES:
            FIELD_RULES[name](name, value, where)
    for e in entries:
        if isinstance(e, Field | Derived | Carry) and e.check is not None:
            for name in _names(e):
                if name in hf_config:
                    e.check(name, hf_config[name], where)
    for relation in RELATIONS:
        relation(hf_config, where)
    for e in entries:
        if isinstance(e, Require) and e.hf in hf_config and not e.ok(hf_config[e.hf]):
            raise PortingError(f"{where}: {e.hf}={hf_config[e.hf]!r} is not supported: {e.why}")
        if isinstance(e, NoOp) and e.hf in hf_config and not e.is_noop(hf_config):
            raise e.refusal(hf_config, where)


def notes(hf_config: dict, entries: Iterable[ConfigEntry], where: str = "config.json") -> list[str]:
    """The lines an import prints about fields it accepted on a rule worth saying (``auto_map``
    carried, never run; which of two activation fields the reference reads), for a config that
    passed :func:`lint`."""
    out = []
    for e in with_common(entries):
        if getattr(e, "note", None) is not None and set(_names(e)) & set(hf_config):
            line = e.note(hf_config)
            if line:
                out.append(line.replace("config.json: ", f"{where}: ", 1))
    return out


def to_mcore(hf_config: dict, entries: Iterable[ConfigEntry], where: str = "config.json") -> dict:
    """Lint ``hf_config`` and return the Megatron config keyword arguments it determines."""
    entries = with_common(entries)
    lint(hf_config, entries, where)
    out: dict[str, Any] = {}
    for e in entries:
        # A conversion that trips over a value no check described (a rope_scaling object without
        # its factor, say) is still bad input: name the field(s) rather than show a traceback.
        try:
            out.update(_entry_values(e, hf_config))
        except PortingError as err:
            # a family's function is given no path and names the file as plain config.json
            said = str(err)
            if where == "config.json" or not said.startswith("config.json: "):
                raise
            raise PortingError(f"{where}: {said.removeprefix('config.json: ')}") from err
        except (KeyError, TypeError, ValueError, ArithmeticError) as err:
            fields = ", ".join(f"{n}={hf_config.get(n)!r}" for n in _names(e))
            raise PortingError(
                f"{where}: cannot convert {fields} ({type(err).__name__}: {err})"
            ) from err
    return out


def _entry_values(e: ConfigEntry, hf_config: dict) -> dict:
    """The Megatron keyword arguments one entry gives for a config that passed :func:`lint`."""
    if isinstance(e, Field):
        # lint has refused a missing field without a default
        return {e.mcore: e.to_mcore(hf_config[e.hf]) if e.hf in hf_config else e.default}
    if isinstance(e, Derived):
        return dict(e.to_mcore(hf_config))
    return {}


def differences(
    a: dict,
    b: dict,
    entries: Iterable[ConfigEntry],
    where_a: str,
    where_b: str,
    only: Iterable[str],
    settle: Callable[[dict], dict] | None = None,
) -> list[str]:
    """Where two HF configs of one family give different values to the Megatron fields ``only``:
    one line per field that differs, naming the HF fields that set it and their values in each
    (``[]``: the same). The family's config map reads both, so aliases and derived values compare
    as what they set; ``settle`` fills in what Megatron derives from a field left out (a head
    width from the width and heads), so a config that spells a default out still compares equal.
    """
    entries = with_common(entries)
    ka, kb = to_mcore(a, entries, where_a), to_mcore(b, entries, where_b)
    if settle is not None:
        ka, kb = settle(ka), settle(kb)
    out = []
    for key in sorted(set(only) & (ka.keys() | kb.keys())):
        if ka.get(key) == kb.get(key):
            continue
        setters = [e for e in entries if key in _entry_values(e, a) | _entry_values(e, b)]
        names = dict.fromkeys(n for e in setters for n in _names(e))
        said = [
            f"{n} {_shown(a, n)} against {_shown(b, n)}"
            for n in names
            if (n in a) != (n in b) or not _same_json(a.get(n), b.get(n))
        ]
        settled = f"{key} {ka.get(key)!r} against {kb.get(key)!r}"
        if said and any(n not in a or n not in b for n in names):
            said[-1] += f" (Megatron's {settled})"  # what a field left out comes to
        out.append("; ".join(said) or settled)
    return out


def _shown(config: dict, name: str) -> str:
    return _json_text(config[name]) if name in config else "absent"


def to_hf(mcore_config: Any, original: dict, entries: Iterable[ConfigEntry]) -> dict:
    """The HF config export writes: the original, key for key and value for value.

    Nothing is added (a ``head_dim`` or ``attention_bias`` the original left to its default stays
    out) and nothing is rewritten. Every mapped field the original holds is re-derived from the
    Megatron config all the same and must agree with it (a ``null`` the original left for
    transformers to derive is not compared): a family whose mapping does not invert is refused
    here rather than writing a config that no longer describes its weights.
    """
    for e in with_common(entries):
        if isinstance(e, Field):
            derived = {e.hf: e.to_hf(getattr(mcore_config, e.mcore))}
        elif isinstance(e, Derived):
            derived = e.to_hf(mcore_config)
        else:
            continue
        for k, v in derived.items():
            if original.get(k) is not None and not _same_json(v, original[k]):
                raise PortingError(
                    f"config.json: {k}={_json_text(original[k])} comes back from the Megatron "
                    f"config as {_json_text(v)}: the family's mapping of {k} does not invert"
                )
    return copy.deepcopy(original)
