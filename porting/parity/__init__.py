"""Parity: the same prompts through the HF model and the Megatron model, full logits compared.

``harness`` runs both sides and compares (the gate of ``porting import`` and ``porting export``);
``cli`` is ``porting verify``. The package root imports nothing (``porting --help`` stays free
of torch). Reads checkpoints only through :mod:`porting.convert` (the manifest,
the Megatron loader); imports neither ``porting.train`` nor ``porting.planner``.
"""
