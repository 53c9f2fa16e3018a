"""Which of the three Falcon decoder blocks a config's switches build (:mod:`models.falcon_spec`
has their equations).

Pure Python: the Falcon family's config map reads it to refuse a combination, and a family's
tables load without torch or Megatron (:mod:`porting.contract.named`).
"""

from __future__ import annotations

import enum


class FalconBlock(enum.StrEnum):
    """The three Falcon decoder blocks (see the module docstring for their equations)."""

    SEQUENTIAL = "sequential"
    PARALLEL_SHARED_NORM = "parallel_shared_norm"
    PARALLEL_TWO_NORMS = "parallel_two_norms"


def falcon_block(
    *, new_decoder_architecture: bool, parallel_attn: bool, num_ln_in_parallel_attn: int | None
) -> FalconBlock:
    """The block ``transformers``' ``FalconDecoderLayer`` builds for these config switches.

    Raises ``ValueError`` naming the field for combinations ``transformers`` cannot run: its layer
    creates one set of norms in ``__init__`` and reads another in ``forward`` for them.
    """
    if num_ln_in_parallel_attn not in (None, 1, 2):
        raise ValueError(f"num_ln_in_parallel_attn={num_ln_in_parallel_attn!r} must be 1 or 2")
    if new_decoder_architecture:
        if not parallel_attn:
            raise ValueError(
                "parallel_attn=False with new_decoder_architecture=True: the new decoder "
                "architecture is always a parallel block in transformers' Falcon"
            )
        # transformers' FalconDecoderLayer turns None into 2 for the new architecture.
        if num_ln_in_parallel_attn in (None, 2):
            return FalconBlock.PARALLEL_TWO_NORMS
        return FalconBlock.PARALLEL_SHARED_NORM
    if not parallel_attn:
        return FalconBlock.SEQUENTIAL
    if num_ln_in_parallel_attn == 2:
        raise ValueError(
            "num_ln_in_parallel_attn=2 needs new_decoder_architecture=True: the classic parallel "
            "block has one shared input_layernorm"
        )
    return FalconBlock.PARALLEL_SHARED_NORM
