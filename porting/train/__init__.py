"""Continued pretraining of an imported checkpoint with NeMo 2.0 / Megatron-Core.

- ``recipe``: the NeMo 2.0 objects of a run (model, data, strategy, optimizer, logging, resume),
  validation of a layout against the model, and the run itself;
- ``launch``: the launchers (torchrun on this node, a Slurm batch script, NeMo-Run);
- ``cli``: ``porting train``.

Reads checkpoints through :mod:`porting.convert`; imports neither ``porting.parity`` nor
``porting.planner``. CPU shims live in :mod:`porting.cpu`, not here.
"""
