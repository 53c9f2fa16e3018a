"""The one place where Megatron-Core and NeMo are taught to run without CUDA.

Megatron-Core 0.15.3 and NeMo 2.7.3 assume a GPU in a handful of places that have nothing to do
with the maths of a model. Each shim below names the upstream file it answers. :func:`enable`
installs them once per process and is a no-op when CUDA is available, so the GPU path is always
the stock one. What answers a missing compiled kernel rather than a missing GPU follows the kernel:
:func:`kernel_safe_config` turns fusions off (all of them on the CPU, under CUDA only those whose
kernels are not installed, as on a GPU image without Transformer Engine or apex), and
:func:`enable_training` fixes torch's AdamW, Megatron's Adam without those kernels, on either.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
from typing import Any

import torch

log = logging.getLogger(__name__)

_ENABLED = False

# TransformerConfig flags that select CUDA-only fused kernels (apex / TE / triton); on the CPU the
# unfused torch path computes the same function.
CUDA_ONLY_FUSIONS = (
    "gradient_accumulation_fusion",
    "bias_activation_fusion",
    "masked_softmax_fusion",
    "persist_layer_norm",
    "apply_rope_fusion",
    "bias_dropout_fusion",
    "cross_entropy_loss_fusion",
)


def cuda_available() -> bool:
    """True when a CUDA device can be used; every shim here is skipped then."""
    return torch.cuda.is_available()


# CUDA_VISIBLE_DEVICES as the process found it, before hide_gpus() (None: unset; absent: not hidden)
_FOUND_DEVICES: dict[str, str | None] = {}


def gpu_visible() -> bool:
    """Whether a CUDA device is visible to this process, asked through NVML, without initialising
    CUDA: :func:`hide_gpus` can still hide it afterwards (a CUDA driver once initialised keeps
    the devices it saw). False once :func:`hide_gpus` has run."""
    if _FOUND_DEVICES or not torch.backends.cuda.is_built():
        return False
    previous = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        return torch.cuda.is_available()
    finally:
        if previous is None:
            del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = previous


def environment_with_gpus() -> dict[str, str]:
    """This process's environment with ``CUDA_VISIBLE_DEVICES`` as it was before
    :func:`hide_gpus`: for a child that runs the parity gate on the device."""
    env = dict(os.environ)
    if _FOUND_DEVICES:
        found = _FOUND_DEVICES["CUDA_VISIBLE_DEVICES"]
        if found is None:
            env.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            env["CUDA_VISIBLE_DEVICES"] = found
    return env


def hide_gpus() -> None:
    """Let this process see no GPU: import, export, verify and the demo run on the CPU everywhere.

    Conversion is host-memory work, and the gate's tolerances are those of fp32 on the CPU. On a
    GPU node Megatron would build the buffers it computes itself (rotary frequencies) on the GPU,
    next to weights that the layer-streamed gate reads into host memory. Hiding the devices before
    anything asks CUDA makes a GPU node run the same path as the CPU tests. The parity gate on
    the device (``--device cuda``) runs in a process of its own, started with
    :func:`environment_with_gpus`.
    """
    if torch.cuda.is_initialized():
        raise RuntimeError("hide_gpus() must run before CUDA is initialised")
    _FOUND_DEVICES.setdefault("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def fusions_without_kernels() -> list[str]:
    """The fusions whose compiled kernels this environment lacks, where Megatron looks for them.

    A GPU image with plain PyTorch (no Transformer Engine, no apex) has none of them, and Megatron
    fails where each is used: ``TransformerConfig.__post_init__`` refuses ``apply_rope_fusion``
    without TE's fused rope, ``torch_norm.WrappedTorchNorm`` asserts ``not persist_layer_norm``,
    and ``fusions/fused_softmax.py`` imports ``scaled_masked_softmax_cuda`` at the first bf16
    forward. The other fusions are torch code (``jit_fuser``) and run anywhere CUDA does.
    """
    from importlib.util import find_spec

    from megatron.core.models.common.embeddings import rope_utils

    missing = [] if rope_utils.fused_apply_rotary_pos_emb is not None else ["apply_rope_fusion"]
    for name, module in (
        ("masked_softmax_fusion", "scaled_masked_softmax_cuda"),
        ("persist_layer_norm", "apex"),
        ("gradient_accumulation_fusion", "fused_weight_gradient_mlp_cuda"),
    ):
        if find_spec(module) is None:
            missing.append(name)
    return missing


def kernel_safe_config(config: Any) -> Any:
    """Turn off, in place, the fusions this machine has no kernel for: every CUDA-only one on the
    CPU (plus CPU initialisation); under CUDA those of :func:`fusions_without_kernels`."""
    gpu = cuda_available()
    for name in fusions_without_kernels() if gpu else CUDA_ONLY_FUSIONS:
        if hasattr(config, name):
            setattr(config, name, False)
    if not gpu and hasattr(config, "use_cpu_initialization"):
        config.use_cpu_initialization = True
    return config


class _CpuRNGStatesTracker:
    """Megatron's model-parallel RNG tracker on the CPU generator.

    Answers ``megatron/core/tensor_parallel/random.py``: ``CudaRNGStatesTracker.add`` and ``fork``
    read and write ``torch.cuda`` generator states. The semantics (named states, forked around
    dropout and weight init) are kept; only the generator differs.
    """

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def is_initialized(self) -> bool:
        return True

    def reset(self) -> None:
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


class _NoStream:
    """Stands in for ``torch.cuda.Stream`` where upstream only uses a stream as a context."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> _NoStream:
        # the MoE all-to-all dispatcher records an event on its device-to-host stream and
        # synchronizes on it before reading token counts (transformer/moe/token_dispatcher.py)
        return self


def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    # megatron/core/transformer/utils.py builds this on device="cuda".
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _cpu_sliding_window_causal_mask(sq: int, skv: int, window_size) -> torch.Tensor:
    m = torch.ones(sq, skv, dtype=torch.bool)
    return m.triu(diagonal=window_size[1] + 1) | m.tril(diagonal=-(window_size[0] + 1))


def _patch_nemo() -> None:
    """NeMo's shim, once NeMo is loaded: verification and export run Megatron-Core alone and must
    not load NeMo for it; every path that uses NeMo loads it before calling :func:`enable`."""
    nemo_io_pl = sys.modules.get("nemo.lightning.io.pl")
    if nemo_io_pl is not None:
        # nemo/lightning/io/pl.py (_fix_tensors_device) asserts torch.cuda.is_initialized() to
        # move loaded tensors between GPUs; on the CPU there is nothing to move.
        nemo_io_pl._fix_tensors_device = lambda ckpt: ckpt


def enable() -> None:
    """Install the CPU shims for Megatron-Core once per process, and NeMo's once NeMo is loaded
    (each call looks again: a process that verified first may import later); no-op under CUDA."""
    global _ENABLED
    if cuda_available():
        return
    _patch_nemo()
    if _ENABLED:
        return
    _ENABLED = True

    # Megatron asks torch.cuda.current_device() for the device of the rotary table
    # (models/common/embeddings/rotary_pos_embedding.py), the global memory buffer (utils.py)
    # and tensor-parallel scratch buffers (tensor_parallel/layers.py).
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    # dist_checkpointing/strategies/filesystem_async.py synchronizes before staging tensors.
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]

    # nemo/lightning/megatron_parallel.py (init_model_parallel) builds DDP on a side stream.
    torch.cuda.Stream = _NoStream  # type: ignore[assignment,misc]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.current_stream = lambda *a, **k: _NoStream()  # type: ignore[assignment]

    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer import utils as tf_utils

    tracker = _CpuRNGStatesTracker()
    mp_random._CUDA_RNG_STATE_TRACKER = tracker
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mp_random.initialize_rng_tracker = lambda *a, **k: None
    mp_random.get_cuda_rng_tracker = lambda *a, **k: tracker
    # model_parallel_cuda_manual_seed seeds torch.cuda and re-creates the tracker.
    mp_random.model_parallel_cuda_manual_seed = _cpu_model_parallel_seed
    import megatron.core.tensor_parallel as tp

    tp.get_cuda_rng_tracker = mp_random.get_cuda_rng_tracker
    tp.model_parallel_cuda_manual_seed = _cpu_model_parallel_seed
    # Activation recomputation (random.py: CheckpointFunction, _get_all_rng_states) saves and
    # restores the CUDA generator's state beside the CPU one and the tracker's; on the CPU the
    # CPU generator (which the tracker above also uses) is all there is.
    mp_random._get_cuda_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    mp_random._set_cuda_rng_state = lambda *a, **k: None

    # NeMo seeds the tracker only on its CUDA path (nemo/lightning/_strategy_lib.py), so give it
    # Megatron's default seed here; model_parallel_cuda_manual_seed re-seeds it as upstream.
    _cpu_model_parallel_seed(1234)

    for module in (tf_utils, fused_softmax):
        module.get_default_causal_mask = _cpu_default_causal_mask
        module.get_sliding_window_causal_mask = _cpu_sliding_window_causal_mask

    from megatron.core.transformer.moe import moe_utils

    # moe_utils imports te_general_gemm inside a try and tests it against None where it routes
    # tokens (router_gating_linear); without Transformer Engine the name is never bound.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    from megatron.core.transformer.moe import token_dispatcher

    # The all-to-all dispatcher asks for its split sizes as numpy arrays, which
    # torch.distributed.all_to_all_single accepts; upstream converts only tensors on a GPU, so on
    # the CPU the sizes stay tensors and the call's binding refuses them (expert parallel > 1).
    token_dispatcher.maybe_move_tensor_to_cpu = _cpu_tensor_maybe_numpy
    log.debug("Megatron-Core CPU compatibility shims installed")


def _cpu_tensor_maybe_numpy(tensor, as_numpy: bool = False, record_stream: bool = False):
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, int):
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


# Where Megatron's optimizer asks a parameter for its CUDA type name (see _CpuDeviceMode).
_OPTIMIZER_DIR = os.path.join("megatron", "core", "optimizer", "")


def _called_from_megatron_optimizer() -> bool:
    # frame 0: this function, 1: __torch_function__, 2: the caller of Tensor.type()
    return _OPTIMIZER_DIR in sys._getframe(2).f_code.co_filename


class _CpuDeviceMode(torch.overrides.TorchFunctionMode):
    """Maps ``device="cuda"``, ``.cuda()``, ``.to("cuda")`` and ``pin_memory=True`` to the CPU.

    Megatron's optimizer (``megatron/core/optimizer/``: grad buffers, ``found_inf``, norms) and
    NeMo's ``MegatronStrategy.training_step`` logging create tensors on CUDA unconditionally.

    Also answers ``megatron/core/optimizer/distrib_optimizer.py``
    (``_build_model_and_main_param_groups``) and ``optimizer.py`` (``Float16OptimizerWithFloat16Params``),
    which sort parameters by ``Tensor.type()`` and accept only ``torch.cuda.*Tensor`` names: a
    ``Tensor.type()`` called from ``megatron/core/optimizer/`` reports the CUDA name of the CPU
    tensor's dtype (``torch.FloatTensor`` -> ``torch.cuda.FloatTensor``). Every other caller, and
    ``Tensor.type(dtype)`` conversions, see the stock answer.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            if name.startswith("torch.") and not name.startswith("torch.cuda."):
                if _called_from_megatron_optimizer():
                    return "torch.cuda." + name[len("torch.") :]
            return name
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda_device(a) else a for a in args)
        return func(*args, **kwargs)


def _cpu_clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """CPU version of ``megatron/core/optimizer/clip_grads.py::clip_grad_by_total_norm_fp32``.

    Upstream asserts ``grad.type() == 'torch.cuda.FloatTensor'`` and scales with apex's
    multi-tensor kernel; the arithmetic is the same.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for p in parameters:
            grad = (
                p.decoupled_grad
                if use_decoupled_grad
                else p.main_grad
                if hasattr(p, "main_grad")
                else p.grad
            )
            if grad is not None:
                grad.detach().mul_(clip_coeff)


def _patch_torch_adam_step(distrib_optimizer) -> None:
    """Keep torch AdamW's per-parameter ``step`` out of the distributed optimizer's tensor state.

    Answers ``megatron/core/optimizer/distrib_optimizer.py``. Without Transformer Engine or apex
    (always the case on the CPU) Megatron's Adam is ``torch.optim.AdamW``, whose state holds a 0-d
    ``step`` tensor beside ``exp_avg``/``exp_avg_sq``. ``_get_main_param_and_optimizer_states``
    hands it to the checkpoint formats as if it were a flat shard (``dp_reshardable`` then asserts
    on its shape at the first save), and ``_set_main_param_and_optimizer_states`` copies every state
    key from the loaded tensors, which the ``fully_reshardable`` loader gives without ``step``.
    Upstream already carries the step in the optimizer's param groups (``state_dict`` /
    ``load_state_dict``: "Extract 'step', for non-Apex/TE support"), so it is dropped from the
    tensors on save and kept as it is on load.

    That ``state_dict`` asserts one common ``step`` over the inner optimizer's states, and a
    resume calls it (``sharded_state_dict(is_loading=True)``) before any step made them: the states
    are first given torch's own initial values (``step`` 0, zero moments, as
    ``torch.optim.Adam._init_group`` makes them), which the checkpoint then overwrites. The
    ``dp_reshardable`` loader copies into fp32 main params, which are views of the model's leaf
    parameters, with grad mode on; the copy is made under ``torch.no_grad()``. And
    ``load_state_dict`` gives every parameter's state one shared ``step`` tensor, which torch's Adam
    would advance once per parameter per step: each gets its own copy (measured: without it a
    resumed run's losses leave the uninterrupted run's by 1.7e-2 to 4.4e-2 from the second
    resumed step on).
    """
    if getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True):
        return
    cls = distrib_optimizer.DistributedOptimizer
    if getattr(cls, "_porting_torch_adam_step", False):
        return
    cls._porting_torch_adam_step = True
    get_states = cls._get_main_param_and_optimizer_states
    set_states = cls._set_main_param_and_optimizer_states
    state_dict = cls.state_dict
    load_state_dict = cls.load_state_dict

    def _state_dict(self):
        if isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            for group in self.optimizer.param_groups:
                for param in group["params"]:
                    state = self.optimizer.state[param]
                    if "step" not in state:
                        state["step"] = torch.tensor(0.0, dtype=torch.float32)
                        for key in ("exp_avg", "exp_avg_sq"):
                            if key not in state:
                                state[key] = torch.zeros_like(
                                    param, memory_format=torch.preserve_format
                                )
        return state_dict(self)

    def _load_state_dict(self, state_dict):
        load_state_dict(self, state_dict)
        # Upstream gives every parameter's state the same ``step`` tensor; torch's Adam
        # increments each parameter's step in place, so a shared one would advance once per
        # parameter per step (and bias-correct with that count).
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].detach().clone()

    def _get(self, model_param):
        tensors = get_states(self, model_param)
        tensors.pop("step", None)
        return tensors

    def _set(self, model_param, tensors):
        if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 and "step" not in tensors:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state[main_param].get("step")
            if step is not None:
                tensors = dict(tensors, step=step)  # copied onto itself
        # With fp32 parameters (the CPU's precision) the main param is a view of the model's leaf
        # parameter, and load_parameter_state_from_dp_reshardable copies into it with grad on.
        with torch.no_grad():
            return set_states(self, model_param, tensors)

    cls._get_main_param_and_optimizer_states = _get
    cls._set_main_param_and_optimizer_states = _set
    cls.state_dict = _state_dict
    cls.load_state_dict = _load_state_dict


_RESULTS_QUEUE: Any = None


def _local_results_queue(*args: Any, **kwargs: Any):
    """CPU version of ``filesystem_async._get_write_results_queue``.

    Answers ``megatron/core/dist_checkpointing/strategies/filesystem_async.py``, which gets its
    write results back through a ``multiprocessing`` Manager queue of the spawn context, so that an
    asynchronous save's worker process can hand them on. On the CPU saves are synchronous
    (``ckpt_async_save`` is off; ``async_utils.AsyncRequest.execute_sync``): the results are put
    and read in this process, after its forked writers finish, so a thread queue does. The
    Manager is a spawned server process started at the first save, with a resource tracker that
    ignores SIGTERM; porting's exit cleanup (``porting.guard.stop_new_children``) then waits out
    its 5 s timeout in every training process. (A fork-context ``multiprocessing.Queue`` will not
    do: upstream checks ``empty()`` right after the put, before the queue's feeder thread flushed.)
    """
    global _RESULTS_QUEUE
    if _RESULTS_QUEUE is None:
        import queue

        _RESULTS_QUEUE = queue.Queue()
    return _RESULTS_QUEUE


_TRAINING_MODE: _CpuDeviceMode | None = None


def enable_training() -> None:
    """Install the extra shims NeMo's training loop needs on the CPU (under CUDA, only the one for
    a missing kernel: torch's AdamW standing in for apex's or TE's fused Adam).

    Kept separate from :func:`enable` because the device mode intercepts every torch call of the
    process; conversion does not need it.
    """
    global _TRAINING_MODE
    enable()
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    # Like kernel_safe_config, this follows the missing kernel, not the device: a GPU image
    # without TE or apex (the lent H200, 2026-11-26) trained 30 bf16 steps and then failed its
    # first save on the same 0-d ``step`` assertion as the CPU.
    _patch_torch_adam_step(distrib_optimizer)
    if _TRAINING_MODE is not None or cuda_available():
        return
    for module in (clip_grads, optimizer, distrib_optimizer):
        if hasattr(module, "clip_grad_by_total_norm_fp32"):
            module.clip_grad_by_total_norm_fp32 = _cpu_clip_grad_by_total_norm_fp32
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    # Megatron-Core 0.15 names it _get_write_results_queue, 0.19 get_write_results_queue.
    for name in ("_get_write_results_queue", "get_write_results_queue"):
        if hasattr(filesystem_async, name):
            setattr(filesystem_async, name, _local_results_queue)
    _TRAINING_MODE = _CpuDeviceMode()
    _TRAINING_MODE.__enter__()


def cpu_safe_strategy(strategy: Any) -> Any:
    """Drop NeMo's Megatron timers from a ``MegatronStrategy`` in place (no-op under CUDA).

    Answers ``nemo/lightning/pytorch/strategies/megatron_strategy.py``, which builds
    ``megatron/core/timers.py::Timers`` and hands them to the model config and to NeMo's
    ``ProgressPrinter`` (``nemo/lightning/pytorch/callbacks/progress_printer.py``). The printer
    runs on the first rank only, and its ``Timers.get_all_timers_string`` all-gathers over every
    rank; over gloo that lone collective pairs with the next collective of the other ranks, and a
    multi-process run hangs at its first checkpoint save (measured: TP=2 on 2 gloo processes with
    the progress printer logs 4 of 8 steps and hangs at the save after the 4th with
    ``--save-every 4``; with ``timers = None`` it saves twice and finishes). Megatron checks
    ``config.timers is not None`` before every use.
    """
    if cuda_available():
        return strategy
    strategy.timers = None
    return strategy


def _cpu_model_parallel_seed(seed: int, *args: Any, **kwargs: Any) -> None:
    """CPU version of ``tensor_parallel.random.model_parallel_cuda_manual_seed``.

    Keeps Megatron's seeding scheme (default state from ``seed``; the model-parallel state offset
    by 2718 + 100 x TP rank) so that weight init and dropout differ per TP rank as upstream.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    tp_rank = (
        parallel_state.get_tensor_model_parallel_rank()
        if parallel_state.model_parallel_is_initialized()
        else 0
    )
    torch.manual_seed(seed)
    tracker = mp_random._CUDA_RNG_STATE_TRACKER
    tracker.reset()
    tracker.add(mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + 100 * tp_rank)
    tracker.add(mp_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    if hasattr(mp_random, "_EXPERT_PARALLEL_RNG_TRACKER_NAME"):
        tracker.add(mp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * tp_rank)


def free_port() -> int:
    """An unused TCP port on loopback for a torch.distributed rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_rendezvous_env(world_size: int = 1) -> None:
    """Point a single-process torch.distributed rendezvous at a free loopback port.

    NeMo's MegatronStrategy initialises a process group even for one device and otherwise uses a
    fixed port, which collides when two imports run on one machine. A ``MASTER_PORT`` inherited
    from a parent process (a training job, a test runner) is in use by that parent, so a
    single-process run takes a fresh port; with several processes (``world_size`` > 1, or a
    launcher's ``WORLD_SIZE``) the caller's or the launcher's settings stand. So do torchrun's for a
    single worker (``TORCHELASTIC_RUN_ID``, as NeMo-Run's launcher starts it): torchrun's workers
    join the store its agent serves at ``MASTER_ADDR:MASTER_PORT``
    (``TORCHELASTIC_USE_AGENT_STORE``), and on a fresh port they would wait for it forever.
    """
    if world_size > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
