"""Continued pretraining of an imported checkpoint with NeMo 2.0 / Megatron-Core.

- ``checks``: the run's spec and every check made before a process is launched (the layout, batch
  and data against the model, the run directory, a resume at another layout, a plan); no NeMo;
- ``recipe``: the NeMo 2.0 objects of a run (model, data, strategy, optimizer, logging, resume,
  the best-validation checkpoint) and the run itself;
- ``launch``: the launchers (torchrun on this node, a Slurm batch script, NeMo-Run);
- ``cli``: ``porting train``.

Reads checkpoints through :mod:`porting.convert`; imports neither ``porting.parity`` nor
``porting.planner``. CPU shims live in :mod:`porting.cpu`, not here.
"""
