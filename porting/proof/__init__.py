"""The proof every family owes, as functions a family's tests call (ours and an outside package's).

Each check builds on a tiny random-init HF model made locally (:func:`make_hf`, no hub) and one of
our checkpoints imported from it, and asserts what its name says:

- :func:`prove_parity`: fp32 full-logit parity against ``transformers`` on prompts of several
  lengths, every logit within ``atol=rtol=1e-5``, 100% top-1 agreement; the layer-streamed gate
  gives the same logits and names no diverging layer;
- :func:`prove_tp2`: two gloo ranks at tensor parallel 2 give the TP=1 logits (1e-5);
- :func:`prove_round_trip`: export gives back every tensor bit for bit, the same ``config.json``
  and tokenizer, and ``transformers``' own class loads it to the same logits;
- :func:`prove_formats`: the same, through the Megatron-LM and Megatron-Bridge layouts (each
  import parity-gated);
- :func:`prove_routing` (mixture-of-experts families): every layer sends every token to the same
  experts on both sides, with no near-tie that rounding could flip;
- :func:`prove_experts_streamed` (mixture-of-experts families): the streamed gate holds a layer's
  experts one at a time on each side (two with the one being read), never the whole mixture;
- :func:`prove_fault_named`: the negative control. One layer's entry of the table is broken, the
  checkpoint written through the normal importer; parity must fail by 100x the tolerance and
  more, and the streamed gate must name that layer first;
- :func:`prove_features_observed` / :func:`prove_features_named`: each mapped feature of the
  config (:data:`FEATURES`: a window, a soft-cap, a GELU variant, rope settings) is perturbed on
  the HF side alone; one whose perturbation moves no logit past the tolerance on the gate's
  prompts is invisible to the gate, and the gate's report must name it (``unobserved``).

The kit is a package a plugin's tests import (``from porting import proof``; the scaffold's
generated test does): each name below is one of its submodules', listed here as its public
surface (docs/families.md, "The proof kit"):

- :mod:`porting.proof.models`: the tiny models (``make_hf``, ``tiny_fields``, ``imported_variants``);
- :mod:`porting.proof.parity`: parity, the round trip, the layouts;
- :mod:`porting.proof.experts`: routing and streamed experts;
- :mod:`porting.proof.tp2`: tensor parallel 2;
- :mod:`porting.proof.faults`: a table wrong in one layer;
- :mod:`porting.proof.features`: what the gate sees of each config feature.
"""

from __future__ import annotations

from porting.proof.experts import (
    prove_experts_streamed,
    prove_routing,
    routing,
    swapped_experts_table,
)
from porting.proof.faults import (
    broken_table,
    import_with_table,
    prove_fault_named,
    prove_table_fault_named,
    scaled,
)
from porting.proof.features import FEATURES, Sighted, prove_features_named, prove_features_observed
from porting.proof.models import (
    imported_variants,
    make_container,
    make_container_as_shipped,
    make_hf,
    reach_caps,
    refused_import,
    sharpened,
    tiny_fields,
)
from porting.proof.parity import (
    ATOL,
    RTOL,
    assert_parity,
    checkpoint_family,
    gate_prompts,
    logits,
    megatron_logits_with,
    prompts_of,
    prove_bridge_refused,
    prove_formats,
    prove_parity,
    prove_round_trip,
)
from porting.proof.tp2 import prove_tp2, tp2_logits

__all__ = [
    "tiny_fields",
    "make_hf",
    "make_container",
    "make_container_as_shipped",
    "imported_variants",
    "refused_import",
    "sharpened",
    "reach_caps",
    "ATOL",
    "RTOL",
    "checkpoint_family",
    "prompts_of",
    "logits",
    "megatron_logits_with",
    "assert_parity",
    "prove_parity",
    "prove_round_trip",
    "prove_formats",
    "prove_bridge_refused",
    "gate_prompts",
    "routing",
    "prove_routing",
    "prove_experts_streamed",
    "swapped_experts_table",
    "tp2_logits",
    "prove_tp2",
    "broken_table",
    "import_with_table",
    "scaled",
    "prove_fault_named",
    "prove_table_fault_named",
    "FEATURES",
    "Sighted",
    "prove_features_observed",
    "prove_features_named",
]
