"""Shared fixtures: tiny HF checkpoints built locally and their imported NeMo checkpoints.

pytest runs with --import-mode=importlib (NeMo installs a top-level `tests` package), so helpers
live here or in `porting.testing`, never in an importable `tests.` module.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import resource
import sys
import tempfile
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# The gate's matmul rate is cached per machine (porting.parity.floor): the tests keep theirs in a
# directory of this session, never in the user's ~/.cache, and the commands they start inherit
# it. PORTING_CACHE_DIR, not XDG_CACHE_HOME: that would move other libraries' caches too.
_CACHE = tempfile.TemporaryDirectory(prefix="porting-test-cache-")
os.environ["PORTING_CACHE_DIR"] = _CACHE.name


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny GQA (4 heads / 2 KV), untied, padded-vocab Llama-layout HF directory (FFN 98: TP=2)."""
    from porting.testing import make_llama

    return make_llama(
        tmp_path_factory.mktemp("hf") / "gqa", rope_theta=50000.0, intermediate_size=98
    )


@pytest.fixture(scope="session")
def tiny_nemo(tiny_llama, tmp_path_factory):
    """``tiny_llama`` imported with `porting import` (parity-gated)."""
    from porting.api import import_hf

    out = tmp_path_factory.mktemp("nemo") / "ckpt"
    import_hf(tiny_llama, out, show_progress=False)
    return out


@pytest.fixture(scope="session")
def train_corpus(tiny_llama, tmp_path_factory):
    """``porting.testing.TRAIN_TEXT`` x 300 in ``tiny_llama``'s tokens, as Megatron's ``.bin/.idx`` prefix."""
    from transformers import AutoTokenizer

    from porting.testing import TRAIN_TEXT, make_indexed_dataset

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    return make_indexed_dataset(
        tmp_path_factory.mktemp("train-data") / "corpus_text_document", tok, [TRAIN_TEXT] * 300
    )


@pytest.fixture
def cli(capsys):
    """``cli(argv)``: ``porting ARGV`` run by ``porting.cli.main`` in the test's own process, for a
    case about what a command decides, writes and prints, not about a process (its signals, its
    exit, its start-up). Returns a ``CompletedProcess`` whose ``logged`` holds the messages our
    packages logged (a process prints them on stderr; here an earlier ``main`` owns the handler)."""
    import logging
    import subprocess

    from porting.cli import main

    def run(argv: list[str]) -> subprocess.CompletedProcess:
        records: list[logging.LogRecord] = []
        keep = logging.Handler()
        keep.emit = records.append
        ours = [logging.getLogger(name) for name in ("porting", "data_prep")]
        for logger in ours:
            logger.addHandler(keep)
        try:
            code = main(list(argv))
        except SystemExit as stop:
            code = stop.code
        finally:
            for logger in ours:
                logger.removeHandler(keep)
        said = capsys.readouterr()
        done = subprocess.CompletedProcess(argv, code, said.out, said.err)
        done.logged = [r.getMessage() for r in records]
        return done

    return run


@pytest.fixture
def prep_in_process(monkeypatch):
    """``porting prep-data`` run by ``main`` encodes in the test's own process, the check against
    Megatron's tokenizer included: no worker and no checking process starts (each would import
    torch and Megatron-Core). For a case about what the command decides; the worker processes
    are proven in tests/test_prep_tools.py (same bytes as in process) and
    tests/test_prep_hostile.py (their signals and their end)."""
    import functools

    from data_prep.executors.base import PrepConfig
    from porting.commands import prep_data as cli

    monkeypatch.setattr(cli, "PrepConfig", functools.partial(PrepConfig, in_process=True))


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real two-node Slurm cluster on this host (``scripts/slurm_local.sh``), stopped after the
    session with no daemon left. Yields the environment a child submits with (``SLURM_CONF``)."""
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "slurm_local.sh"
    home = tmp_path_factory.mktemp("slurm") / "cluster"
    started = subprocess.run(
        [str(script), "start", str(home)], capture_output=True, text=True, timeout=120
    )
    assert started.returncode == 0, started.stderr
    try:
        yield {**os.environ, "SLURM_CONF": str(home / "slurm.conf")}
    finally:
        stopped = subprocess.run(
            [str(script), "stop", str(home)], capture_output=True, text=True, timeout=120
        )
        assert stopped.returncode == 0, stopped.stderr


# The suite runs on two pytest-xdist workers, a file at a time (scripts/env.sh test). A file's
# cases stay on one worker, so its module fixtures are built once; the files below, measured the
# longest (docs/testing.md), are handed out first, so that no worker is left with one at the end.
LONGEST_FIRST = (
    "test_train_bridge.py",  # the first two of the current stack's files
    "test_train_bridge_families.py",
    "test_slurm.py",
    "test_gpu_check.py",
    "test_train_multiproc.py",
    "test_owners.py",
    "test_output.py",
    "test_convert_ranks.py",
    "test_prep_ray.py",
    "test_train_stop.py",
    "test_train.py",
    "test_prep_hostile.py",
    "test_new_family.py",
    "test_moe_train.py",
    "test_published.py",
    "test_layout_hostile.py",
    "test_deepseek.py",
    "test_deepseek_v2.py",
    "test_prep_inputs.py",
    "test_formats.py",
    "test_gpt_oss.py",
    "test_overlap.py",
)


# `scripts/env.sh test -m quick`, a developer's loop (docs/testing.md): every family's parity at
# TP=1 and its round trips, the config rules, the mapping and the hostile checks made at function
# level. CI and the README's command run everything.
QUICK_FAMILY_FILES = {
    f"test_{family}.py" for family in (
        "llama", "tsuzumi", "falcon", "qwen", "mistral", "gemma", "gemma3", "moe", "gpt_oss",
        "deepseek", "deepseek_v2", "olmo2", "olmoe", "phi3", "nemotron", "granite", "smollm3",
        "granitemoe", "containers", "llama4",
    )
}  # fmt: skip
QUICK_IN_A_FAMILY_FILE = ("parity", "round_trip")
QUICK_FILES = {
    "test_config_rules.py", "test_contract.py", "test_mapping.py", "test_transforms.py",
    "test_rope.py", "test_table_check.py", "test_noop_fields.py", "test_layout_hostile.py",
    "test_plan_hostile.py", "test_bad_input.py", "test_fuzz.py",
}  # fmt: skip


# Which stack runs each file (scripts/env.sh test: the NeMo 2 stack's pass, then the current
# stack's; environments.md). The current stack (.venv: Python 3.12, Megatron-Core 0.19,
# transformers 5, Megatron-Bridge, no NeMo) is where users are, so a file that needs no NeMo runs
# there; the NeMo 2 stack (.venv-nemo2) runs what needs NeMo (training with it, its loader, its
# connectors) and the files not yet moved.
#
# On both stacks: the published catalogue (every family, import with the gate under either
# transformers and export back identical), transformers 5's own saves, the three layouts and their
# hostile metadata, verify's pairing of an HF directory with a checkpoint, the weight tables
# against both models, the no-op field rules, the environments' own checks, data prep's tokenizer
# records (keyed by the libraries' versions: megatron-core 0.19's tokenizer decides here), a
# checkpoint Megatron-Core 0.15 saved (tsuzumi's, read and converted by either), the FP8 and
# MXFP4 weights (which transformers 4 and 5 build differently: quant.fp8_targets), data prep's
# byte-identity with each Megatron-Core's own preprocess_data.py tokenizer arguments, and the
# vision-language containers (each transformers' own multimodal class is the gate's reference).
CURRENT_STACK_FILES = {
    "test_published.py", "test_hf_v5.py", "test_formats.py", "test_verify_pair.py",
    "test_table_check.py", "test_noop_fields.py", "test_environments.py", "test_prep_record.py",
    "test_tsuzumi.py", "test_quant.py", "test_prep.py", "test_containers.py",
}  # fmt: skip
# On the current stack alone: Megatron-Bridge's training loop (its packages), and the files that
# need no NeMo and whose property is no library's (the planner, the mapping, a family's proofs,
# the hostile inputs); a case among them that needs NeMo is marked ``nemo2`` and runs in the NeMo
# 2 stack's pass instead (:func:`_runs_here`).
CURRENT_STACK_ONLY = {
    "test_train_bridge.py", "test_train_bridge_families.py", "test_deepseek.py", "test_gpt_oss.py",
    "test_executors.py",
    "test_rope.py", "test_cli_exit.py", "test_output.py", "test_contract.py", "test_mapping.py", "test_transforms.py",
    "test_plan_domains.py", "test_plan_hostile.py", "test_plan_model.py", "test_plan_placement.py",
    "test_plan_properties.py", "test_plan_published.py", "test_plan_sites.py",
    "test_prep_inputs.py", "test_prep_slurm.py", "test_reused_heap.py",
    "test_streaming_export.py", "test_registry.py", "test_scaffold_hostile.py",
    "test_gate_features.py", "test_llama.py", "test_falcon.py", "test_mistral.py", "test_qwen.py",
    "test_gemma.py", "test_gemma3.py", "test_olmo2.py", "test_phi3.py", "test_config_rules.py",
    "test_fuzz.py", "test_moe.py", "test_olmoe.py", "test_bad_input.py", "test_bench_suite.py",
    "test_convert_ranks.py", "test_gate.py", "test_layout.py", "test_layout_hostile.py",
    "test_new_family.py", "test_parity_streamed.py", "test_plan_cli.py", "test_plan_moe.py", "test_plan_experts.py",
    "test_prep_blend.py", "test_prep_hostile.py", "test_prep_provenance.py", "test_prep_tools.py",
    "test_shell_trust.py", "test_overlap.py", "test_hostile.py", "test_nemotron.py",
    "test_granite.py", "test_smollm3.py", "test_granitemoe.py", "test_prep_ray.py",
    "test_deepseek_v2.py", "test_llama4.py", "test_pages.py",
}  # fmt: skip
# Of those, the files with cases marked ``nemo2``: collected on the NeMo 2 stack too, for those.
WITH_NEMO2_CASES = {
    "test_llama.py",
    "test_falcon.py",
    "test_moe.py",
    "test_hostile.py",
    "test_rope.py",
    "test_output.py",
    "test_llama4.py",
    "test_gpt_oss.py",
}
ON_CURRENT_STACK = importlib.util.find_spec("nemo") is None


def _other_stacks(name: str) -> bool:
    if name in CURRENT_STACK_FILES:
        return False
    if ON_CURRENT_STACK:
        return name not in CURRENT_STACK_ONLY
    return name in CURRENT_STACK_ONLY and name not in WITH_NEMO2_CASES


def _runs_here(item) -> bool:
    """A case of a current-only file runs on the current stack unless marked ``nemo2``, and that
    one on the NeMo 2 stack; the other files' cases run wherever their file does."""
    if item.path.name not in CURRENT_STACK_ONLY:
        return True
    return ON_CURRENT_STACK != (item.get_closest_marker("nemo2") is not None)


def pytest_ignore_collect(collection_path, config):
    """On the current stack, only its files are collected (the others import NeMo); on the NeMo 2
    stack, all but the current stack's own, except those with ``nemo2`` cases (the rest of such a
    file's cases are deselected there: :func:`pytest_collection_modifyitems`)."""
    if collection_path.suffix == ".py":
        name = collection_path.name
        if name.startswith("test_") and _other_stacks(name):
            return True
    return None


class _OtherStacksModule(pytest.Module):
    def collect(self):
        return []


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path, parent):
    """A file named on the command line is collected even where ``pytest_ignore_collect`` would
    skip it: on the other stack it yields no tests rather than failing on its imports
    (`scripts/env.sh test tests/test_slurm.py` runs it on the nemo2 stack only)."""
    if module_path.name.startswith("test_") and _other_stacks(module_path.name):
        return _OtherStacksModule.from_parent(parent, path=module_path)
    return None


def _quick(item) -> bool:
    if item.path.name in QUICK_FILES:
        return True
    return (
        item.path.name in QUICK_FAMILY_FILES
        and any(word in item.name for word in QUICK_IN_A_FAMILY_FILE)
        and "tensor_parallel" not in item.name  # its ranks are processes of their own
    )


def pytest_collection_modifyitems(config, items):
    elsewhere = [item for item in items if not _runs_here(item)]
    if elsewhere:
        # each runs in the other stack's pass of the same command: nothing is skipped
        config.hook.pytest_deselected(items=elsewhere)
        items[:] = [item for item in items if _runs_here(item)]
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    for item in items:
        if _quick(item):
            item.add_marker(pytest.mark.quick)


_CPU_AT_SETUP = pytest.StashKey[tuple[float, float]]()
_STARTED = pytest.StashKey[float]()


def _cpu_s() -> tuple[float, float]:
    me = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    item.stash[_CPU_AT_SETUP] = _cpu_s()
    item.stash[_STARTED] = time.time()
    yield


_modules_at_freeze = 0


def _freeze_new_libraries() -> None:
    """After a case that loaded libraries (NeMo, Megatron-Core, transformers' model classes),
    their objects stay in this process for good: frozen (``gc.freeze``), the collections later
    cases' conversions and gates make to give memory back walk only what those cases made.
    Over the heap of a worker that loaded NeMo each full pass costs ~0.8 s, and a conversion
    makes several: 18% of a published-config case's time (cProfile); tests/test_published.py
    took 217 s before, 91 s after. A frozen object freed by reference counting still goes at
    once; only a cycle among objects alive here would outlive its case."""
    global _modules_at_freeze
    if len(sys.modules) > _modules_at_freeze + 20:
        gc.collect()
        gc.freeze()
        _modules_at_freeze = len(sys.modules)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    """Each case's CPU seconds, its own process's and its children's (those waited for, with
    theirs; not what Slurm's daemons start), as properties of the case in ``--junitxml``
    (scripts/bench_suite.py sums them per file), and the worker it ran on with the wall-clock
    times it started and ended (the same script's per-worker table: who was busy when)."""
    yield
    _freeze_new_libraries()
    start = item.stash.get(_CPU_AT_SETUP, None)
    if start is not None:
        me, children = (round(b - a, 2) for a, b in zip(start, _cpu_s(), strict=True))
        item.user_properties += [("cpu_s", me), ("children_cpu_s", children)]
        item.user_properties += [
            ("worker", os.environ.get("PYTEST_XDIST_WORKER", "main")),
            ("started", round(item.stash[_STARTED], 2)),
            ("ended", round(time.time(), 2)),
        ]
