"""Parity: the same prompts through the HF model and the Megatron model, full logits compared.

``harness`` runs both sides whole and compares (the gate of ``porting import`` and ``porting
export``, and of small models); ``streamed`` runs them a decoder layer at a time (``sides``:
each model with its layers read as they run; ``modules``: a large layer a module at a time;
``vocab``: the embedding and output layer by vocabulary slices; ``mtp``: the
multi-token-prediction layers; ``hf_dequant``: a quantized checkpoint's reference side);
``floor`` is the gate's floor, ``pair`` whether an HF directory and a checkpoint are the same
model, ``plot`` the divergence plot. The command, ``porting verify``, is
:mod:`porting.commands.verify`. The package root imports nothing (``porting --help`` stays free
of torch). Reads checkpoints only through :mod:`porting.convert` (the manifest, the Megatron
loader); imports neither ``porting.train`` nor ``porting.planner``."""
