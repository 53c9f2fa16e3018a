"""What reaches the terminal: our lines, and third-party output only when it is an error.

NeMo, Megatron-Core, Lightning and transformers narrate their set-up (banners, deprecation notices,
"module could not be imported", telemetry warnings) on every run. None of it is actionable for a
user of ``porting``, and it buries our report. :func:`install` silences exactly that chatter at its
source, by logger name and message, before the libraries are imported:

- Python warnings by message (and category), also for child processes (``PYTHONWARNINGS``);
- log records of named third-party loggers whose message starts with a known prefix;
- loggers that only narrate (Lightning's rank-zero INFO lines, NVIDIA's telemetry) at WARNING/ERROR.

Nothing else is touched: an exception or an ERROR record from a library still reaches the user,
and ``-v`` shows everything.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys
import warnings

# Python warnings silenced by default: (message prefix, category). Each is emitted by a library on
# import or set-up, whatever the user does.
_WARNINGS = (
    # torch/cuda/__init__.py imports pynvml on a CPU machine too
    ("The pynvml package is deprecated", FutureWarning),
    # lightning/pytorch/trainer/trainer.py: NeMo's own importer builds the model this way
    ("`trainer.init_module` cannot fully support", UserWarning),
    # megatron/core/dist_checkpointing: noted once per save on the CPU
    ("`torch.distributed._sharded_tensor` will be deprecated", FutureWarning),
    # lightning's logger_connector, for metrics NeMo's strategy logs itself
    ("It is recommended to use `self.log(", UserWarning),
    # megatron/core imports: megatron_fsdp/utils.py and inference/unified_memory.py, on a machine
    # without Transformer Engine, Apex or CUDA (the launcher of `porting train --executor torchrun`)
    ("Transformer Engine and Apex are not installed", UserWarning),
    ("Failed to create unified memory mempool", UserWarning),
    # megatron/core/models/backends.py and gpt_layer_specs.py build the local spec's norms on
    # torch when Apex is missing (the CPU), said on import whatever the command
    ("Apex is not installed. Falling back to Torch Norm", UserWarning),
    # lightning/fabric/plugins/environments/slurm.py, on any host with `srun` on the PATH (a Slurm
    # login node): a training's or NeMo's own importer's Lightning trainer is one local process
    # there; `porting train --executor slurm` launches with srun itself.
    ("The `srun` command is available on your system but is not used", UserWarning),
    # modelopt/torch/__init__.py, on import, for any transformers outside the range its HF
    # plugins were tested with; the gate's FP8 reference uses only its FP8 tensor
    # (porting/parity/hf_dequant.py), none of its HF plugins
    ("transformers version ", UserWarning),
    # lightning/pytorch/loops/training_epoch_loop.py, at every resume mid-epoch: Megatron's
    # sampler resumes from the consumed samples the checkpoint holds, not the dataloader's state
    # (a resumed run's losses equal the uninterrupted run's: tests/test_train_stop.py)
    ("You're resuming from a checkpoint that ended before the epoch ended", UserWarning),
    # megatron/core/transformer/transformer_config.py (0.19), for every config: its own default
    # cuda_graph_scope, which nothing here sets (and no CPU run captures)
    ("full scope is deprecated", UserWarning),
    # Megatron-Bridge's training loop (`porting train --engine bridge`) on import, without
    # Transformer Engine: the local expert layers it then uses, torch's note on the jit-scripted
    # fusions it imports, and its own notes that pretrain and the multimodal configs it imports
    # are new
    ("Only transformer-engine>=1.7.0 supports MoE experts", UserWarning),
    ("`torch.jit.script` is deprecated", FutureWarning),
    ("MimoModelConfig is experimental", UserWarning),
    ("Function 'pretrain' is experimental", UserWarning),
    # megatron/core/_rank_utils.py (0.19), imported in a process that is no rank: the launcher of
    # `porting train --executor torchrun`, which checks a run before starting its ranks
    ("Could not determine rank from torch.distributed", UserWarning),
    ("Could not determine world size from torch.distributed", UserWarning),
)

# Log records silenced by default: (logger name, message prefix); an empty prefix means the logger
# only narrates, so it is set to ERROR instead.
_RECORDS = (
    ("megatron.core.utils", "fused_indices_to_multihot has reached end of life"),
    # torch/utils/cpp_extension.py, on import, where the torch build is a CUDA one and the machine
    # has no GPU (the current stack's torch on the CPU)
    ("torch.utils.cpp_extension", "No CUDA runtime is found"),
    ("nemo.collections.llm.gpt.model.megatron.hyena.hyena_mixer", "WARNING: transformer_engine"),
    ("nemo_logger", "The deploy module could not be imported"),
    ("nemo_logger", "The evaluate module could not be imported"),
    ("nemo_logger", "Could not copy Trainer's 'max_steps'"),
    ("nemo_logger", "`trainer.init_module` cannot fully support"),
    # nemo/lightning/nemo_logger.py narrates the logger and checkpoint set-up `porting train` chose
    ("nemo_logger", "nemo logger received explicit_log_dir"),
    ("nemo_logger", "NeMoLogger is logging to"),
    ("nemo_logger", "The Trainer already contains a ModelCheckpoint callback"),
    # nemo/lightning/resume.py: our `last` link and the `step=N-last` it names both match
    ("nemo_logger", "Multiple checkpoints "),
    # megatron/core/dist_checkpointing/serialization.py, about NeMo's own call
    ("nemo_logger", "DEPRECATED: Passing 'checkpoint_dir' as a Path object"),
    ("megatron.core.dist_checkpointing.serialization", "DEPRECATED: Passing 'checkpoint_dir'"),
    ("megatron.core.rerun_state_machine", "Implicit initialization of Rerun State Machine"),
    ("megatron.core.rerun_state_machine", "RerunStateMachine initialized in mode"),
    ("nv_one_logger", ""),
    # megatron/bridge/utils/import_utils.py: every optional import it tries, with its traceback
    # (FP8GlobalStateManager without Transformer Engine); it sets its logger's level itself
    ("megatron.bridge.utils.import_utils", "Import of "),
    # Megatron-Core 0.19, on every model built from a GPT spec: GPTModel is kept for fixes only
    # (HybridModel is its successor) and a partial as the MLP submodule is rewrapped. Both are
    # Megatron's advice to its own spec writers; the checkpoint and its maths are unchanged.
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"),
    ("megatron.core.transformer.transformer_layer", "Rewrapping ModuleSpec with module"),
    # a checkpoint write that failed: `porting train` names the failure (a full disk) itself
    ("megatron.core.dist_checkpointing.strategies.filesystem_async", "Local process"),
    # NeMo's telemetry spans, cut short when a run is stopped
    ("nv_one_logger.recorder.default_recorder", "The parent of span"),
    # transformers 5.12 validating a rotary config as it reads one: Gemma 3's own per-layer-type
    # form (which 5.12 writes) is "unrecognized" to it, and a published YaRN factor that is not
    # max_position_embeddings / original_max_position_embeddings (DeepSeek-V2-Lite's) is
    # "explicitly set". Neither changes what the class computes, which is what the gate checks.
    ("transformers.modeling_rope_utils", "Unrecognized keys in `rope_parameters`"),
    ("transformers.modeling_rope_utils", "The explicitly set RoPE scaling factor"),
    # "Received SIGTERM": `porting train` says itself what a stop kept
    ("lightning.pytorch.trainer.connectors.signal_connector", "[rank: "),
    ("lightning.pytorch.trainer.connectors.signal_connector", "Received SIG"),
)

# Loggers whose INFO lines are set-up narration (GPU/TPU/HPU availability, the process-group
# banner); their warnings and errors still show. Lightning resets its package loggers to INFO on
# import, so the rank-zero modules' own loggers are the ones set.
_NARRATORS = tuple(
    f"{pkg}.utilities.rank_zero"
    for pkg in ("lightning.pytorch", "pytorch_lightning", "lightning.fabric")
)


class _DropPrefixes(logging.Filter):
    """Drops records whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes: list[str]) -> None:
        super().__init__()
        self.prefixes = tuple(prefixes)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is not ours to judge; let it through
            return True
        return not message.lstrip().startswith(self.prefixes)


_INSTALLED = False


def offline() -> None:
    """Nothing we run may reach a hub: every model and tokenizer is a local directory."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def install(verbose: bool) -> None:
    """Silence known third-party chatter in this process and the processes it starts.

    With ``verbose`` nothing is silenced. Safe to call more than once.
    """
    global _INSTALLED
    if verbose or _INSTALLED:
        return
    _INSTALLED = True
    specs = []
    for message, category in _WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
        # -W syntax: action:message:category; the message is matched as a literal prefix.
        specs.append(f"ignore:{message.replace(':', '')}:{category.__name__}")
    inherited = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = ",".join(([inherited] if inherited else []) + specs)
    by_logger: dict[str, list[str]] = {}
    for name, prefix in _RECORDS:
        if prefix:
            by_logger.setdefault(name, []).append(prefix)
        else:
            logging.getLogger(name).setLevel(logging.ERROR)
    for name, prefixes in by_logger.items():
        logging.getLogger(name).addFilter(_DropPrefixes(prefixes))
    for name in _NARRATORS:
        logging.getLogger(name).setLevel(logging.WARNING)


def installed(package: str) -> bool:
    """Whether ``package`` is installed, not merely a directory of that name on the path: ``python
    -m porting.cli`` puts the working directory first, and a checkpoint directory named ``nemo``
    there is a namespace package to ``find_spec`` (no origin), which imports nothing of NeMo."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin is not None


def quiet_nemo(load: bool = True) -> None:
    """Keep NeMo's own INFO narration out of our output (its logger resets itself on import).

    ``load=False``: only where NeMo is already loaded (a command that may run without it). Where
    NeMo is not installed (the current stack) there is nothing to quiet."""
    if "nemo.utils" not in sys.modules and (not load or not installed("nemo")):
        return
    from nemo.utils import logging as nemo_logging

    nemo_logging.setLevel(logging.WARNING)
