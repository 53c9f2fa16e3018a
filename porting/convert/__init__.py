"""Conversion: the engine that moves weights and configs between HF and NeMo 2.0 / Megatron-Core.

- ``hf_files``: an HF model directory read as untrusted input (files checked, config bounded);
- ``mapping``: a family's weight table (:mod:`porting.contract.mapping`) applied, every key
  accounted for both ways;
- ``safetensors_io``: streaming reads and sharded writes of HF weight files;
- ``layouts``: the checkpoint layouts (NeMo 2, Megatron-LM, Megatron-Bridge), one module and one
  registration each; ``manifest``: our ``porting.json`` in any of them;
- ``checkpoint``: a checkpoint opened once per command (layout, manifest) and atomic output
  directories;
- ``hf_import``: HF -> NeMo 2 checkpoint, streamed, without NeMo; ``nemo2_context``: what NeMo
  records beside the tensors (``context/io.json``, ``model.yaml``, ``common.pt``), as data;
- ``connectors``: the generic NeMo ``io.ModelConnector`` importer/exporter (``llm.import_ckpt``),
  registered on a family's model class when it is first loaded through it;
- ``megatron``: process groups and loading a Megatron model from a checkpoint;
- ``export``: one of our checkpoints to an HF directory, streamed; ``quant`` / ``quant_export``:
  quantized checkpoints read and written; ``foreign``: a Megatron checkpoint porting did not write;
- ``ranks`` / ``executors``: one conversion over several processes (torchrun, Slurm), the ranks'
  side and the launcher's.

The commands (``porting import`` / ``export`` / ``convert``) are :mod:`porting.commands.convert`,
over :mod:`porting.api` (which adds the parity gate). Imports the contract and the core below it,
never ``porting.parity``, ``porting.train``, ``porting.planner`` or a command. The package root
imports nothing.
"""
