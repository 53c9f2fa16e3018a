"""The family contract: what a family is made of, and nothing else.

- ``family``: :class:`Family`, :class:`ShapeContext`, :class:`Variant`;
- ``registry``: the installed families, found through the ``porting.families`` entry points;
- ``config_map``: config entries (``Field``, ``Derived``, ``Require``, ``Carry``, ``NoOp``,
  ``Undecided``), the rules every family shares, and ``to_mcore`` / ``to_hf``;
- ``mapping``: weight-table entries (``Rename``, ``Fused``, ``Ignore``) and their expansion;
- ``transforms``: the paired layout transforms a table names (they compute on the tensors handed
  to them and import torch only then);
- ``named``: a family's Megatron classes and functions, named instead of imported;
- ``container``: the vision-language classes a family's language model comes in;
  ``quantization``: the ``quantization_config`` methods porting reads; ``hf_spelling``: the two
  ways transformers spells a ``config.json``; ``rope``: a config's ``rope_scaling`` as
  transformers validates it, for any family's entries.

Imports only the core (``porting.errors``, ``porting.guard``) and the standard library: no torch,
NeMo, Megatron or checkpoint I/O, so that listing the families and refusing a config answer at
once (docs/architecture.md; tests/test_layout.py pins it).
"""
