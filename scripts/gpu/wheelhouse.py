"""Build `.whl/`: the wheels a lent GPU machine lacks for running `porting`, within 64 MiB.

The GPU machine has no package index. Whatever `porting import/verify/export/prep-data/train/plan`
import and its image does not provide (or provides at a version our pins exclude) travels as wheels
in `.whl/` at the repository root and is installed there with

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site

Subcommands:

    trace     (here) run every command for real on tiny local models under import profiling
              (PYTHONPROFILEIMPORTTIME=1, which worker processes inherit), map every module any
              process imported to the distribution that installed it, and write
              scripts/gpu/needed.txt (distribution, version here, commands that import it).
    build     (here) read needed.txt and scripts/gpu/image-packages.txt; rely on the image's copy
              where its version meets every pin on it (pyproject.toml and the Requires-Dist of
              the distributions we need, markers evaluated for the target Python); pin the rest
              to this environment's versions and `pip download` their wheels for the target
              Python (manylinux x86-64) into a temp dir, renamed to the output at the end. The
              tables in this file (LEFT_BEHIND, STUBBED, USE_IMAGE_ANYWAY, CARRY_ANYWAY) record
              what the rehearsal showed the rules alone get wrong. The device tool's 64 MiB
              counts the work tree too: build fails, naming the largest wheels, past it.
    rehearse  (here, or on the GPU machine after the install line) run the same commands with a
              given interpreter and report where each needed distribution was found.

scripts/gpu/rehearse-here.sh rehearses the whole path on this machine with Python 3.11.

This is GPU-machine tooling, not part of the `porting` package: run it with the project's
interpreter, e.g. `.venv/bin/python scripts/gpu/wheelhouse.py trace`.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata as md
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
NEEDED = HERE / "needed.txt"
IMAGE = HERE / "image-packages.txt"
STUBS = HERE / "stubs"
LIMIT_BYTES = 64 * 1024 * 1024

# The repository itself travels as the work tree (PYTHONPATH), never as a wheel.
OWN_DISTRIBUTION = "porting"

# Never carried: ours is the CPU build on this machine's disk, the image's is built for its CUDA.
# The image's must still meet the pins of what uses it (megatron-core and nemo-toolkit want
# torch>=2.6); pyproject.toml's torch range names the CPU builds and is not read for it.
MACHINE_BUILDS = frozenset({"torch"})

# What the rehearsal (a venv with the image's packages at their newest, the wheelhouse on
# PYTHONPATH) showed, each entry with its evidence. Keys are needed.txt names.

# Imported through a guard (try/except ImportError, or a find_spec check) and not used by the
# traced commands; the image has none of them. Not carried: the importer takes its "not
# installed" branch, as it does on any machine without them.
LEFT_BEHIND = {
    "wandb": "megatron/core/timers.py `try: import wandb` (a metrics writer porting never picks)",
    "boto3": "accelerate/commands/config/sagemaker.py imports it only if is_boto3_available()",
    "botocore": "boto3's",
    "s3transfer": "boto3's",
    "jmespath": "botocore's",
    "zarr": "megatron/core/dist_checkpointing/strategies/zarr.py `try: import zarr` (the zarr "
    "checkpoint format; porting writes torch_dist)",
    "numcodecs": "zarr's",
    "asciitree": "zarr's",
    "multi-storage-client": "nemo/utils/msc_utils.py `try: import multistorageclient`; "
    "porting.convert.streaming_save imports it only for msc:// checkpoint paths",
    "nvtx": "megatron/core/utils.py `try: import nvtx` (profiling ranges, off by default)",
}

# Imported at module level, never used by the traced commands, too big to carry: a stand-in from
# scripts/gpu/stubs/<name> (built into a wheel by `build`, never part of the product) takes the
# import. Using one raises an error that says so.
STUBBED = {
    "onnx": "nemo/utils/export_utils.py imports it for ONNX export only; the image's onnx "
    "(protos from protoc 6.31) refuses the carried protobuf 5.29",
    "pulp": "modelopt/torch/opt/searcher.py imports it for architecture search only (15.6 MiB)",
}

# Taken from the image although a pin excludes its version.
USE_IMAGE_ANYWAY = {
    "numpy": "megatron-core 0.15.3 and nemo-toolkit[llm] say numpy<2, but the image's pandas and "
    "pyarrow refuse numpy 1.x ('pyarrow requires NumPy 2.0 or newer'), and numpy 1.26.4 with "
    "pandas 3.0.6 and pyarrow 21 would be 68 MiB alone; every traced command ran on numpy 2.4.6 "
    "with byte-identical prep-data output and the same training losses",
    "pyarrow": "pyproject.toml's ==21.* fixes the CPU set's resolution and no dependency caps "
    "it (datasets wants >=21); ours is 41 MiB and the rehearsal ran on pyarrow 26.0.1",
    "tensorstore": "nemo-toolkit[llm] caps it <0.1.72, but only Megatron's zarr checkpoint "
    "strategy uses it (dist_checkpointing/strategies/tensorstore.py, a guarded import) and "
    "porting reads and writes torch_dist; ours is 17 MiB and the rehearsal imported 0.1.86",
}

# Carried although the image's would meet every pin.
CARRY_ANYWAY = {
    "tensorboard": "the image's protos (tensorboard 2.21: protoc 6.31) refuse the carried "
    "protobuf 5.29 at import ('Runtime version cannot be older than the linked gencode "
    "version'); torch.utils.tensorboard is imported by megatron.core and writes train's logs",
}

# Where pip looks first: the manylinux tags the device tool's README names. pip matches a
# manylinux_2_N tag exactly, so when a distribution has none of these the other N up to 39 (the
# newest that README allows: the image's glibc) are tried.
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
NEWER_PLATFORMS = tuple(
    f"manylinux_2_{n}_x86_64"
    for n in range(39, 4, -1)
    if f"manylinux_2_{n}_x86_64" not in PLATFORMS
)

# ---------------------------------------------------------------------------------------------
# trace
# ---------------------------------------------------------------------------------------------

# Builds the tiny models the traced commands run on (porting.testing, as tests/conftest.py and
# `porting demo` do): a GQA Llama-layout and a 40B-layout Falcon, each with its tokenizer, a
# JSONL corpus, and the tokenizers prep-data's other backends need (gigatoken wants every byte in
# the vocabulary, as data_prep.testing.train_hf_bpe makes it). No network.
_FIXTURES = """
from porting.testing import make_falcon, make_llama
from data_prep import testing as T
make_llama("hf", rope_theta=50000.0, intermediate_size=98)
make_falcon("fhf", new_decoder_architecture=True, num_kv_heads=2, ffn_hidden_size=98)
texts = T.synthetic_texts(200, seed=2)
T.write_jsonl("corpus.jsonl", [{"text": t} for t in texts])
T.train_hf_bpe(texts, "bpe", vocab_size=400)
T.train_sentencepiece(texts, "sp.model", vocab_size=2000, character_coverage=0.98)
"""

_ONE_SITE = shlex.quote(str(ROOT / "examples" / "clusters" / "dgx-h100-one-site.yaml"))
_THREE_SITES = shlex.quote(str(ROOT / "examples" / "clusters" / "three-sites.yaml"))
_PREP = "prep-data --input corpus.jsonl --json-keys text"


@dataclass(frozen=True)
class Step:
    """One traced process: ``label`` names the command, ``args`` follow ``python``."""

    label: str
    args: tuple[str, ...]


def _porting(label: str, command_line: str) -> Step:
    return Step(label, ("-m", "porting.cli", *shlex.split(command_line)))


# Each command as a user runs it, and the variants that reach other code (layer-streamed and whole
# model gates, plots, JSON, prep-data's gigatoken and sentencepiece backends, two workers, the
# inspect action, plan's emitted files). The train run is one process with the local executor,
# as on a one-GPU machine; the distributed optimizer (its default) and a validation run included.
STEPS = (
    Step("tiny-models", ("-c", _FIXTURES)),
    _porting("import", "import hf --out ckpt"),
    _porting("import", "import fhf --out fckpt --whole-model --json"),
    _porting("verify", "verify hf ckpt --plot verify.png"),
    _porting("verify", "verify fhf fckpt --whole-model --json"),
    _porting("export", "export ckpt --out hf-back"),
    _porting("export", "export fckpt --out fhf-back --whole-model"),
    _porting("prep-data", f"{_PREP} --tokenizer ckpt --output-prefix data/c --append-eod"),
    # Its own label: the backend's libraries are 6.7 MiB (`build --without prep-data/gigatoken`).
    _porting(
        "prep-data/gigatoken",
        f"{_PREP} --tokenizer bpe --output-prefix data/g --tokenizer-backend gigatoken --workers 2",
    ),
    _porting("prep-data", f"{_PREP} --tokenizer sp.model --output-prefix data/s"),
    _porting("prep-data", "prep-data inspect data/c_text_document"),
    _porting(
        "train",
        "train --checkpoint ckpt --data data/c_text_document --out run --seq-length 32 "
        "--global-batch 2 --steps 3 --save-every 2 --eval-every 3",
    ),
    _porting(
        "plan",
        f"plan --model ckpt --cluster {_ONE_SITE} --global-batch 8 --seq-length 32 "
        "--emit launch --plot plan.png",
    ),
    _porting(
        "plan",
        f"plan --model llama-70b --cluster {_THREE_SITES} --global-batch 1024 --seq-length 4096 "
        "--json",
    ),
)

_IMPORT_LINE = re.compile(r"import time:\s+\d+ \|\s+\d+ \| *(\S+)$")


def imported_modules(stderr: str) -> set[str]:
    """Every module name in ``-X importtime`` output (failed imports are listed too).

    >>> sorted(imported_modules("import time:  12 |  40 |   yaml.error\\nother line\\n"))
    ['yaml.error']
    """
    return {m.group(1) for line in stderr.splitlines() if (m := _IMPORT_LINE.match(line))}


def run_step(step: Step, cwd: Path, python: str, timeout: float = 900):
    """Run one step with import profiling on; ``(modules imported, completed process)``."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    # Inherited by every Python child (prep-data's spawned workers), unlike `-X importtime`.
    env |= {"PYTHONPROFILEIMPORTTIME": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT)) if p)
    proc = subprocess.run(
        [python, *step.args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    return imported_modules(proc.stderr), proc


def _describe(step: Step) -> str:
    return " ".join(step.args[2:]) if step.args[0] == "-m" else "(tiny models and corpora)"


def _failure(step: Step, proc: subprocess.CompletedProcess) -> str:
    rest = "\n".join(ln for ln in proc.stderr.splitlines() if not _IMPORT_LINE.match(ln))
    return (
        f"{step.label} failed (exit {proc.returncode}): {_describe(step)[:200]}\n"
        f"{proc.stdout[-2000:]}\n{rest[-6000:]}"
    )


def run_steps(python: str, workdir: Path, keep_going: bool) -> tuple[dict[str, set[str]], int]:
    """Run :data:`STEPS` in ``workdir``; ``(module -> labels importing it, failures)``."""
    seen: dict[str, set[str]] = defaultdict(set)
    failures = 0
    for step in STEPS:
        t0 = time.monotonic()
        mods, proc = run_step(step, workdir, python)
        ok = "ok  " if proc.returncode == 0 else "FAIL"
        print(f"{ok} {time.monotonic() - t0:6.1f} s {len(mods):>5} modules  {_describe(step)[:80]}")
        if proc.returncode != 0:
            failures += 1
            print(_failure(step, proc), file=sys.stderr)
            if not keep_going:
                break
        for m in mods:
            seen[m].add(step.label)
    return seen, failures


def _module_of_file(path: str) -> str | None:
    """The module a distribution file provides (``google/protobuf/message.py`` ->
    ``google.protobuf.message``); None for metadata, scripts and data files."""
    parts = path.split("/")
    if parts[0] == ".." or parts[0].endswith((".dist-info", ".egg-info", ".data")):
        return None
    name = parts[-1]
    if name.endswith(".py"):
        stem = name[:-3]
    elif name.endswith((".so", ".pyd")):
        stem = name.split(".", 1)[0]  # _message.cpython-311-x86_64-linux-gnu.so
    else:
        return None
    parts = parts[:-1] if stem == "__init__" else [*parts[:-1], stem]
    return ".".join(parts) if parts and all(p.isidentifier() for p in parts) else None


def module_owners() -> dict[str, str]:
    """Module name -> the installed distribution whose RECORD lists its file.

    Finer than ``packages_distributions()``, which maps only top-level names and so cannot tell
    ``google.protobuf`` (protobuf) from ``google.api_core`` in a shared namespace package.
    """
    owners: dict[str, str] = {}
    for dist in md.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        for f in dist.files or ():
            mod = _module_of_file(str(f))
            if mod:
                owners.setdefault(mod, name)
    return owners


def owner_of(module: str, owners: dict[str, str], top: dict[str, list[str]]) -> str | None:
    """The distribution that provides ``module``: its own file or its nearest package's, else
    ``packages_distributions()``'s unique answer for its top-level name (editable installs)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if (dist := owners.get(".".join(parts[:n]))) is not None:
            return dist
    dists = {canonicalize_name(d) for d in top.get(parts[0], ())}
    return dists.pop() if len(dists) == 1 else None


def _is_ignorable(module: str) -> bool:
    top = module.split(".")[0]
    return (
        top in sys.stdlib_module_names
        or top.startswith(("__editable__", "_sysconfigdata_"))
        or top in ("sitecustomize", "usercustomize")
    )


def trace(workdir: Path | None) -> dict[str, set[str]]:
    """Run :data:`STEPS` with this interpreter, write :data:`NEEDED` and return distribution ->
    labels of the steps that import it. Modules no installed distribution provides are listed
    there as absent (each importer goes on without them)."""
    tmp = Path(workdir or tempfile.mkdtemp(prefix="wheelhouse-trace-"))
    tmp.mkdir(parents=True, exist_ok=True)
    seen, failures = run_steps(sys.executable, tmp, keep_going=False)
    if failures:
        raise SystemExit("trace: a step failed; needed.txt left as it was")
    owners, top = module_owners(), md.packages_distributions()
    needed: dict[str, set[str]] = defaultdict(set)
    absent: dict[str, set[str]] = defaultdict(set)
    for mod, labels in seen.items():
        if _is_ignorable(mod):
            continue
        dist = owner_of(mod, owners, top)
        if dist is not None:
            if dist != OWN_DISTRIBUTION:
                needed[dist] |= labels
        elif "." not in mod and importlib.util.find_spec(mod) is None:
            absent[mod] |= labels
    write_needed(needed, absent, NEEDED)
    if workdir is None:
        shutil.rmtree(tmp, ignore_errors=True)
    return needed


# Printed by the interpreter under rehearsal: each needed distribution's version as that
# interpreter finds it, and the folder its metadata came from (the wheelhouse or the image).
_WHERE = """
import importlib.metadata as md, json, sys
out = {}
for name in sys.argv[1:]:
    try:
        d = md.distribution(name)
        out[name] = [d.version, str(d.locate_file(""))]
    except md.PackageNotFoundError:
        out[name] = None
print(json.dumps(out))
"""


def rehearse(python: str, workdir: Path | None) -> int:
    """Run :data:`STEPS` with ``python`` (an interpreter with the wheelhouse on its path, as on
    the GPU machine) and print where each needed distribution comes from; 1 if a step failed."""
    needed = read_needed()
    proc = subprocess.run(
        [python, "-c", _WHERE, *needed], capture_output=True, text=True, check=True
    )
    where = json.loads(proc.stdout)
    missing = sorted(n for n, v in where.items() if v is None)
    for name, v in sorted(where.items()):
        if v is not None:
            print(f"{name:<44}{v[0]:<16}{v[1]}")
    if missing:
        print(f"MISSING ({len(missing)}): {', '.join(missing)}")
    tmp = Path(workdir or tempfile.mkdtemp(prefix="wheelhouse-rehearse-"))
    tmp.mkdir(parents=True, exist_ok=True)
    _, failures = run_steps(python, tmp, keep_going=True)
    if workdir is None:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{len(STEPS) - failures} passed, {failures} failed")
    return 1 if failures else 0


def write_needed(needed: dict[str, set[str]], absent: dict[str, set[str]], path: Path) -> None:
    """Write ``needed.txt``: one ``name version commands`` line per distribution."""
    image = read_image(IMAGE) if IMAGE.exists() else {}
    lines = [
        "# Distributions that `porting` commands import, found by scripts/gpu/wheelhouse.py trace",
        f"# on {datetime.date.today()} with Python {sys.version.split()[0]} ({sys.executable}).",
        "# Columns: distribution, its version in that environment, the traced commands that",
        "# import it. Regenerate with `.venv/bin/python scripts/gpu/wheelhouse.py trace`.",
    ]
    for name in sorted(needed):
        lines.append(f"{name} {md.version(name)} {','.join(sorted(needed[name]))}")
    lines += [
        "#",
        "# Imports tried and not installed in that environment (optional in the code that tries",
        "# them); 'image' marks the ones the GPU image has, which run there and not here:",
    ]
    for mod in sorted(absent, key=str.lower):
        mark = " image" if canonicalize_name(mod) in image else ""
        lines.append(f"#   {mod}{mark}  ({','.join(sorted(absent[mod]))})")
    path.write_text("\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------------------
# reading the lists
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Needed:
    """One line of needed.txt."""

    name: str
    version: str
    commands: tuple[str, ...]


def read_needed(path: Path = NEEDED) -> dict[str, Needed]:
    """Parse needed.txt (comments and blank lines skipped); names are canonical."""
    out = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) != 3:
            raise ValueError(f"{path}:{n}: expected 'name version commands', got {line!r}")
        name = canonicalize_name(fields[0])
        Version(fields[1])  # raises on a malformed version
        out[name] = Needed(name, fields[1], tuple(fields[2].split(",")))
    return out


def as_installed(needed: dict[str, Needed]) -> tuple[dict[str, Needed], list[str]]:
    """``needed`` at this environment's versions, and a ``name recorded -> here`` line for each
    that moved since the trace.

    The pins come from this environment's metadata, so the versions carried must be its own too:
    the package index moves daily (a fresh install a day after a trace found nine distributions
    newer, pydantic 2.14.4 among them, which pins pydantic-core==2.50.5 where needed.txt recorded
    2.50.4). A distribution needed.txt names and this environment lacks is an error: only a new
    trace can say what the commands import now.
    """
    here, moved, absent = {}, [], []
    for name, item in needed.items():
        try:
            version = md.version(name)
        except md.PackageNotFoundError:
            absent.append(name)
            continue
        if version != item.version:
            moved.append(f"{name} {item.version} -> {version}")
        here[name] = Needed(name, version, item.commands)
    if absent:
        raise SystemExit(
            f"build: needed.txt names {', '.join(sorted(absent))}, which this environment "
            "lacks: re-run `wheelhouse.py trace` with the project's interpreter"
        )
    return here, moved


def read_image(path: Path = IMAGE) -> dict[str, str | None]:
    """Parse an image package list: ``name`` or ``name==version`` a line, ``#`` comments.

    ``pip list --format=freeze`` output of the real image reads the same way, so a list taken on
    the GPU machine can replace the committed one (``build --image FILE``).
    """
    out: dict[str, str | None] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name.strip()):
            raise ValueError(f"{path}:{n}: not a distribution name: {raw!r}")
        if sep:
            version = version.strip().split("+")[0] if version.strip() else ""
            Version(version)  # a local tag such as +cu130 compares as its public version
        out[canonicalize_name(name.strip())] = version.strip() if sep else None
    return out


# ---------------------------------------------------------------------------------------------
# pins and the decision
# ---------------------------------------------------------------------------------------------


@dataclass
class Pins:
    """Every specifier some requirement puts on a distribution, with who asked; pyproject.toml's
    own are kept apart as well (a deliberate pin of ours, unlike a dependency's cap)."""

    specs: dict[str, SpecifierSet] = field(default_factory=dict)
    project: dict[str, SpecifierSet] = field(default_factory=dict)
    sources: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))

    def add(self, name: str, spec: SpecifierSet, source: str) -> None:
        name = canonicalize_name(name)
        self.specs[name] = self.specs.get(name, SpecifierSet()) & spec
        if source == "pyproject.toml":
            self.project[name] = self.project.get(name, SpecifierSet()) & spec
        if str(spec):
            self.sources[name].append(f"{source}: {spec}")

    def of(self, name: str) -> SpecifierSet:
        return self.specs.get(canonicalize_name(name), SpecifierSet())

    def of_project(self, name: str) -> SpecifierSet:
        return self.project.get(canonicalize_name(name), SpecifierSet())


def _marker_env(python_version: str) -> dict[str, str]:
    return {
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "extra": "",
    }


def _applies(req: Requirement, env: dict[str, str], extras: set[str]) -> bool:
    if req.marker is None:
        return True
    marker = Marker(str(req.marker))
    return any(marker.evaluate(env | {"extra": e}) for e in extras | {""})


# The kit runs the NeMo 2 stack's commands (training goes through NeMo 2): porting's requirements
# and its nemo2 extra, which holds transformers below 5 and Megatron-Core below 0.16.
KIT_EXTRAS = ("nemo2",)


def project_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[Requirement]:
    """pyproject.toml's requirements for the kit's stack (``KIT_EXTRAS``)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    texts = list(project["dependencies"])
    for extra in KIT_EXTRAS:
        texts += project["optional-dependencies"][extra]
    return [Requirement(t) for t in texts]


def collect_pins(
    needed: set[str], python_version: str, pyproject: Path = ROOT / "pyproject.toml"
) -> Pins:
    """Pins on the ``needed`` distributions from pyproject.toml and from the Requires-Dist of
    each needed distribution as installed here, with the extras someone asks of it (nemo-toolkit's
    ``llm`` brings ``numpy<2``). Distributions that will not be on the GPU machine (left behind,
    stubbed) pin nothing."""
    pins = Pins()
    env = _marker_env(python_version)
    extras: dict[str, set[str]] = defaultdict(set)
    for req in project_requirements(pyproject):
        name = canonicalize_name(req.name)
        extras[name] |= req.extras
        if name in needed and name not in MACHINE_BUILDS and _applies(req, env, set()):
            pins.add(name, req.specifier, "pyproject.toml")
    present = needed - set(LEFT_BEHIND) - set(STUBBED)
    reqs_of = {n: [Requirement(r) for r in md.distribution(n).requires or ()] for n in present}
    # An extra can ask for extras of another distribution: iterate to a fixed point first.
    changed = True
    while changed:
        changed = False
        for n in present:
            for req in reqs_of[n]:
                dep = canonicalize_name(req.name)
                if _applies(req, env, extras[n]) and not req.extras <= extras[dep]:
                    extras[dep] |= req.extras
                    changed = True
    for n in sorted(present):
        for req in reqs_of[n]:
            if canonicalize_name(req.name) in needed and _applies(req, env, extras[n]):
                pins.add(req.name, req.specifier, f"{n} {md.version(n)}")
    return pins


@dataclass(frozen=True)
class Decision:
    """Whether a needed distribution is carried, and why (the MANIFEST's last column)."""

    carry: bool
    reason: str


# Specifiers that fix a version or a narrow range: an unknown image version is not trusted
# against them.
_TIGHT = ("==", "===", "~=", "<=")


def _next_minor(version: str) -> Version:
    """The first release after ``version``'s minor series: 1.26.20 -> 1.27."""
    major, minor = (*Version(version).release, 0)[:2]
    return Version(f"{major}.{minor + 1}")


def decide(
    ours: str, image: str | None, in_image: bool, spec: SpecifierSet, project: SpecifierSet
) -> Decision:
    """Carry our version, or rely on the image's? ``spec``: every pin on the distribution;
    ``project``: pyproject.toml's alone.

    - not in the image: carry ours;
    - in the image at a known version every pin allows: the image's;
    - at a known version some pin excludes: carry ours (which the pins allow);
    - at an unknown version: carry ours when a pin fixes it (``==``, ``~=``, ``<=``), caps it
      below our next minor release (``urllib3<1.27`` with ours at 1.26.20: the image's, a fresh
      install, is past it), or pyproject.toml caps it (``packaging<25``: ours is deliberately
      old); else the image's (a cap such as ``<3`` on ours at 2.21 is what a fresh image meets),
      which `rehearse` on the GPU machine then checks.

    >>> decide("1.26.4", "2.5.2", True, SpecifierSet("<2"), SpecifierSet())
    Decision(carry=True, reason='image has 2.5.2, pins want <2')
    >>> decide("2.21.0", None, True, SpecifierSet("<3,>=2.13"), SpecifierSet()).carry
    False
    """
    if not in_image:
        return Decision(True, "not in the image")
    if image is not None:
        if spec.contains(image, prereleases=True):
            return Decision(False, f"image {image} satisfies {spec or 'no pin'}")
        return Decision(True, f"image has {image}, pins want {spec}")
    tight = [s for s in spec if s.operator in _TIGHT]
    below_next = not spec.contains(_next_minor(ours), prereleases=True)
    capped = [s for s in project if s.operator in ("<", *_TIGHT)]
    if tight or below_next or capped:
        return Decision(True, f"image version unknown, pins want {spec}")
    return Decision(False, f"image version unknown, pins only {spec or 'none'} (unverified)")


def select(
    needed: dict[str, Needed], image: dict[str, str | None], pins: Pins
) -> dict[str, Decision]:
    """:func:`decide` for every needed distribution, then the tables above; fails when ours
    breaks our own pins or a table contradicts the image list."""
    out = {}
    for name, item in sorted(needed.items()):
        spec = pins.of(name)
        if not spec.contains(item.version, prereleases=True):
            raise SystemExit(f"build: our {name} {item.version} breaks the pins {spec}")
        dec = decide(item.version, image.get(name), name in image, spec, pins.of_project(name))
        if name in MACHINE_BUILDS:
            if dec.carry:
                raise SystemExit(f"build: the image's {name} will not do ({dec.reason})")
            dec = Decision(False, f"the image's own build; {dec.reason}")
        elif name in LEFT_BEHIND:
            if name in image:
                raise SystemExit(f"build: {name} is left behind, but the image has one")
            dec = Decision(False, f"left behind: {LEFT_BEHIND[name]}")
        elif name in STUBBED:
            dec = Decision(True, f"stub: {STUBBED[name]}")
        elif name in USE_IMAGE_ANYWAY and dec.carry:
            if name not in image:
                raise SystemExit(f"build: {name} is taken from the image, which has none")
            dec = Decision(False, f"the image's despite {spec}: {USE_IMAGE_ANYWAY[name]}")
        elif name in CARRY_ANYWAY and not dec.carry:
            dec = Decision(True, f"{dec.reason}, but {CARRY_ANYWAY[name]}")
        out[name] = dec
    return out


# ---------------------------------------------------------------------------------------------
# build
# ---------------------------------------------------------------------------------------------


def _pip(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pip", *args], capture_output=True, text=True, cwd=cwd
    )


def _download(name: str, version: str, python_version: str, dest: Path) -> Path:
    """One wheel of ``name==version`` for the target interpreter, into ``dest``.

    Binary-only for the target platform; newer manylinux tags only when the usual ones have none;
    a pure-Python sdist (some small dependencies publish no wheel) is built into a wheel here.
    """
    base = [
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        "-d",
        str(dest),
    ]
    before = set(dest.iterdir())
    err = ""
    for platforms in (PLATFORMS, PLATFORMS + NEWER_PLATFORMS):
        flags = [x for p in platforms for x in ("--platform", p)]
        proc = _pip(*base, *flags, f"{name}=={version}")
        if proc.returncode == 0:
            break
        err = proc.stderr
    else:
        return _build_pure_wheel(name, version, dest, err)
    (new,) = set(dest.iterdir()) - before
    return new


def _build_pure_wheel(name: str, version: str, dest: Path, err: str) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        proc = _pip("wheel", "--no-deps", "--no-binary", name, "-w", tmp, f"{name}=={version}")
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            raise SystemExit(f"build: no wheel of {name}=={version}:\n{err}\n{proc.stderr}")
        tags = parse_wheel_filename(wheels[0].name)[3]
        if any(t.abi != "none" or t.platform != "any" for t in tags):
            raise SystemExit(f"build: {name}=={version} has no wheel and its sdist is not pure")
        return Path(shutil.move(str(wheels[0]), dest))


def _build_stub(name: str, dest: Path) -> Path:
    """The wheel of scripts/gpu/stubs/<name>, built from a copy (setuptools leaves build/ and
    egg-info folders beside the sources)."""
    with tempfile.TemporaryDirectory() as tmp:
        proj = Path(shutil.copytree(STUBS / name, Path(tmp) / name))
        proc = _pip("wheel", "--no-deps", "--no-build-isolation", "-w", tmp, str(proj))
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            raise SystemExit(f"build: stub {name} did not build:\n{proc.stderr}")
        return Path(shutil.move(str(wheels[0]), dest))


def recompress(wheel: Path) -> None:
    """Rewrite ``wheel`` with LZMA members where that is smaller (about 14% over the whole set).

    A wheel is a zip; pip extracts it with ``zipfile``, which reads LZMA members where Python has
    its ``lzma`` module (Ubuntu's Python 3.12 does). Member contents, names and modes are
    unchanged, so RECORD's hashes still hold.
    """
    tmp = wheel.with_suffix(".lzma-tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w") as dst:
        for info in src.infolist():
            dst.writestr(info, src.read(info), compress_type=zipfile.ZIP_LZMA)
    if tmp.stat().st_size < wheel.stat().st_size:
        tmp.replace(wheel)
    else:
        tmp.unlink()


@dataclass(frozen=True)
class Carried:
    """One wheel of the wheelhouse."""

    name: str
    version: str
    size: int
    reason: str
    file: str


def build(
    out: Path,
    python_version: str,
    image_list: Path,
    without: set[str],
    limit: int,
    lzma: bool = False,
) -> list[Carried]:
    """Download the selected wheels into a temp dir beside ``out``; rename it to ``out``."""
    needed = read_needed()
    missing = sorted(n for n in STUBBED if not (STUBS / n / "pyproject.toml").exists())
    if missing:
        raise SystemExit(f"build: no stub project under {STUBS} for {', '.join(missing)}")
    needed = {n: item for n, item in needed.items() if not set(item.commands) <= without}
    needed, moved = as_installed(needed)
    if moved:
        print(
            f"build: {len(moved)} distributions moved since the trace; carrying this "
            f"environment's versions ({'; '.join(moved)}). A new version can import what the "
            "trace never saw: `rehearse` shows it.",
            file=sys.stderr,
        )
    pins = collect_pins(set(needed), python_version)
    decisions = select(needed, read_image(image_list), pins)
    tree = work_tree_bytes()  # before the temp dir, which git would count as untracked
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-partial-", dir=out.parent))
    try:
        carried = []
        for name, dec in decisions.items():
            if not dec.carry:
                continue
            if name in STUBBED:
                wheel = _build_stub(name, tmp)
            else:
                wheel = _download(name, needed[name].version, python_version, tmp)
            if lzma:
                recompress(wheel)
            version = str(parse_wheel_filename(wheel.name)[1])
            carried.append(Carried(name, version, wheel.stat().st_size, dec.reason, wheel.name))
            print(f"  {wheel.name}  {wheel.stat().st_size / 2**20:.2f} MiB", flush=True)
        _check(carried, tmp, tree, limit)
        _write_manifest(carried, decisions, pins, tmp, python_version, image_list, lzma)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _print_table(carried, decisions, tree)
    return carried


def work_tree_bytes(root: Path = ROOT) -> int:
    """Bytes of what travels besides carried paths: tracked and untracked-not-ignored files."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout
    paths = (root / p for p in out.decode().split("\0") if p)
    return sum(p.stat().st_size for p in paths if p.is_file())


def _check(carried: list[Carried], folder: Path, tree: int, limit: int) -> None:
    # pip refuses a --no-index install with two versions of one distribution.
    names = [parse_wheel_filename(p.name)[0] for p in folder.glob("*.whl")]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SystemExit(f"build: more than one wheel of {', '.join(twice)}")
    # The device tool's 64 MiB counts the work tree and every carried path together.
    total = sum(c.size for c in carried)
    if total + tree > limit:
        big = sorted(carried, key=lambda c: -c.size)[:5]
        raise SystemExit(
            f"build: {total / 2**20:.1f} MiB of wheels + {tree / 2**20:.1f} MiB of work tree "
            f"exceed the {limit / 2**20:.0f} MiB that may travel; largest: "
            + ", ".join(f"{c.name} {c.size / 2**20:.1f} MiB" for c in big)
        )


def _write_manifest(carried, decisions, pins, folder, python_version, image_list, lzma) -> None:
    lines = [
        f"# .whl for CPython {python_version} manylinux x86-64, made by scripts/gpu/wheelhouse.py",
        f"# build on {datetime.date.today()} against {image_list.name}; total "
        f"{sum(c.size for c in carried)} bytes"
        + (" (members recompressed with LZMA)" if lzma else "")
        + ". Install with:",
        "#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade"
        " --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site",
        "# name version bytes why",
    ]
    lines += [f"{c.name} {c.version} {c.size} {c.reason}" for c in carried]
    lines.append("# not carried (the image's, left behind):")
    lines += [f"#   {n}: {d.reason}" for n, d in decisions.items() if not d.carry]
    lines.append("# pins read (pyproject.toml and the Requires-Dist of the needed distributions):")
    lines += [f"#   {n}: {'; '.join(s)}" for n, s in sorted(pins.sources.items())]
    (folder / "MANIFEST.txt").write_text("\n".join(lines) + "\n")


def _print_table(carried: list[Carried], decisions: dict[str, Decision], tree: int) -> None:
    print(f"\n{'carried':<34}{'version':<14}{'MiB':>7}  why")
    for c in sorted(carried, key=lambda c: -c.size):
        print(f"{c.name:<34}{c.version:<14}{c.size / 2**20:>7.2f}  {c.reason[:90]}")
    total = sum(c.size for c in carried)
    print(f"{'total':<48}{total / 2**20:>7.2f}  ({len(carried)} wheels)")
    print(f"{'+ work tree':<48}{tree / 2**20:>7.2f}  = {(total + tree) / 2**20:.2f} MiB to travel")
    kept = [n for n, d in decisions.items() if not d.carry and "satisfies" in d.reason]
    unverified = [n for n, d in decisions.items() if not d.carry and "unverified" in d.reason]
    print(f"\nfrom the image, version known to meet the pins: {', '.join(kept)}")
    print(f"from the image, version unknown (rehearse checks): {', '.join(unverified)}")
    for name, dec in decisions.items():
        if not dec.carry and name not in kept and name not in unverified:
            print(f"not carried: {name}: {dec.reason[:120]}")


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="wheelhouse.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Typical use: `.venv/bin/python scripts/gpu/wheelhouse.py trace` after a "
        "dependency change (commit needed.txt), then `... build` before a GPU session "
        "(writes .whl/, git-ignored, carried to the GPU machine with the work tree), and there, "
        "after the install line, `python3 scripts/gpu/wheelhouse.py rehearse`.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser(
        "trace",
        help="run every command on tiny models and write scripts/gpu/needed.txt",
        description="Run porting import/verify/export/prep-data/train/plan on tiny local models "
        "under PYTHONPROFILEIMPORTTIME=1 and write the distributions they import to "
        "scripts/gpu/needed.txt. Takes a few minutes on two cores; needs no network.",
    )
    t.add_argument("--workdir", type=Path, help="keep the tiny models and outputs here")
    b = sub.add_parser(
        "build",
        help="download the wheels the GPU image lacks into .whl/ (64 MiB at most)",
        description="Decide for each distribution in needed.txt whether the image's copy will do "
        "(its version satisfies every pin), download our version's wheel for the target Python "
        "otherwise, check the total, and write OUT/MANIFEST.txt. OUT appears only when "
        "everything succeeded.",
    )
    b.add_argument("--out", type=Path, default=ROOT / ".whl", help="output folder (.whl)")
    b.add_argument("--python-version", default="3.12", help="target CPython (default 3.12)")
    b.add_argument(
        "--image",
        type=Path,
        default=IMAGE,
        help="image package list (default scripts/gpu/image-packages.txt; `pip list "
        "--format=freeze` from the GPU machine reads the same way)",
    )
    b.add_argument(
        "--without",
        action="append",
        default=[],
        metavar="COMMAND",
        help="leave out what only this traced command (a needed.txt label) imports",
    )
    b.add_argument(
        "--lzma",
        action="store_true",
        help="recompress every wheel's members with LZMA (about 14%% smaller; pip on the GPU "
        "machine must have Python's lzma module, which Ubuntu's Python 3.12 has)",
    )
    b.add_argument(
        "--limit-mib",
        type=float,
        default=LIMIT_BYTES / 2**20,
        help="what may travel: the work tree's files plus the wheels (default 64)",
    )
    r = sub.add_parser(
        "rehearse",
        help="run the traced commands with another interpreter (the wheelhouse installed)",
        description="Run the same steps as trace with PYTHON, e.g. a venv that mimics the GPU "
        "image with the wheelhouse on PYTHONPATH, or the GPU machine's python3 after the "
        "install line. Prints which version of each needed distribution PYTHON finds and "
        "where, then pass/fail per step (all steps run); exits 1 on a failure.",
    )
    r.add_argument("--python", default=sys.executable, help="interpreter (default: this one)")
    r.add_argument("--workdir", type=Path, help="keep the tiny models and outputs here")
    for child in sub.choices.values():
        child.allow_abbrev = False
    args = parser.parse_args(argv)
    if args.command == "trace":
        needed = trace(args.workdir)
        print(f"wrote {NEEDED.relative_to(ROOT)}: {len(needed)} distributions")
        return 0
    if args.command == "rehearse":
        return rehearse(args.python, args.workdir)
    carried = build(
        args.out.resolve(),
        args.python_version,
        args.image,
        set(args.without),
        int(args.limit_mib * 2**20),
        args.lzma,
    )
    print(json.dumps({"out": str(args.out), "wheels": len(carried)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
