"""Continued pretraining of an imported checkpoint on Megatron-Core, through NeMo 2.0 or
Megatron-Bridge.

- ``checks``: the run's spec and the checks made of it before a process is launched (the layout,
  batch and data against the model, the run directory, a resume at another layout); no NeMo;
  ``plan_check``: a plan from ``porting plan --emit`` against the run; ``preflight``: every
  check in order, for either engine;
- ``settings``: what the spec sets in Megatron on both engines (the model config, the optimizer,
  data parallelism, the layout a checkpoint records);
- ``recipe``: the NeMo 2.0 engine's objects of a run (model, data, strategy, optimizer, logging,
  resume, the best-validation checkpoint) and the run itself; ``bridge``: the Megatron-Bridge
  engine's;
- ``executors``: where a run's processes run (this process, torchrun, Slurm, NeMo-Run), one
  object each (:mod:`porting.launch`); ``launch``: what they run (the Slurm batch script, the
  ranks' verdict); ``stop``: a stopped run leaves a run directory to resume from.

The command, ``porting train``, is :mod:`porting.commands.train`. Reads checkpoints through
:mod:`porting.convert`; imports neither ``porting.parity`` nor ``porting.planner``. CPU shims live
in :mod:`porting.cpu`, not here.
"""
