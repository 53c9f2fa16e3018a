"""Conversion: the engine that moves weights and configs between HF and NeMo 2.0 / Megatron-Core.

- ``mapping``, ``transforms``, ``config_map``: a family's declarative tables and the paired layout
  transforms they use (pure, torch only);
- ``safetensors_io``: streaming reads and sharded writes of HF weight files;
- ``checkpoint``: our manifest in a NeMo checkpoint and atomic output directories;
- ``connectors``: the generic NeMo ``io.ModelConnector`` importer/exporter families subclass;
- ``megatron``: process groups and loading a Megatron model from a checkpoint;
- ``api`` and ``cli``: ``porting import`` / ``porting export`` (gated by :mod:`porting.parity`).

Imports neither ``porting.train`` nor ``porting.planner``. The package root imports nothing, so
that the light table modules load without NeMo.
"""
