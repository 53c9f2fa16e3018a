"""No command's output touches its inputs, and `convert` leaves no staging behind.

Every command that writes is tried with its output on each path it reads: the same path, inside
it, containing it, an existing file in it, and through symlinks. Each must exit 2 with one line
naming the output's flag and the input, having written nothing (the whole tree is hashed before
and after). File outputs (``--plot``, ``--save-constants``) are checked before the work they end.
``convert`` is stopped by SIGTERM at each stage and by SIGKILL, and a rerun removes what that left.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from porting import guard
from porting.cli import main
from porting.errors import PortingError

CLUSTER = Path(__file__).resolve().parents[1] / "examples" / "clusters" / "h100-one-gpu.yaml"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _tree(root: Path) -> dict:
    """Every entry under ``root``: file bytes hashed, symlink targets, directories."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[rel] = ("link", os.readlink(p))
        elif p.is_dir():
            out[rel] = ("dir",)
        else:
            out[rel] = ("file", hashlib.sha256(p.read_bytes()).hexdigest())
    return out


@pytest.fixture(scope="module")
def world(tiny_llama, tiny_nemo, train_corpus, tmp_path_factory):
    """Every kind of input, each alone in a directory of its own (so that "contains" names it
    alone), with a user's file in each input directory."""
    root = tmp_path_factory.mktemp("world")
    w = {"root": root}

    def home(name: str) -> Path:
        (root / name).mkdir()
        return root / name

    w["hf"] = home("hf") / "H"
    shutil.copytree(tiny_llama, w["hf"])
    w["ckpt"] = home("ckpt") / "CK"
    assert (
        main(["import", str(tiny_llama), "--out", str(w["ckpt"]), "--format", "megatron-lm"]) == 0
    )
    w["nemo"] = home("nemo") / "N"
    shutil.copytree(tiny_nemo, w["nemo"])
    w["cfg"] = home("cfg") / "C"
    w["tok"] = home("tok") / "T"
    for d in (w["cfg"], w["tok"]):
        d.mkdir()
        for name in TOKENIZER_FILES:
            if (tiny_llama / name).exists():
                shutil.copyfile(tiny_llama / name, d / name)
    shutil.copyfile(tiny_llama / "config.json", w["cfg"] / "config.json")
    for key, name in (("data", "D"), ("valid", "V")):
        w[key] = home(key) / name
        w[key].mkdir()
        for ext in (".bin", ".idx"):
            shutil.copyfile(f"{train_corpus}{ext}", w[key] / f"d{ext}")
    w["prefix"] = w["data"] / "d"
    w["corpus"] = home("corpus") / "J"
    w["corpus"].mkdir()
    (w["corpus"] / "a.jsonl").write_text('{"text": "hello world"}\n')
    w["plan"] = home("plan") / "P"
    w["plan"].mkdir()
    (w["plan"] / "plan.json").write_text("{}\n")
    w["cluster"] = home("cluster") / "K"
    w["cluster"].mkdir()
    shutil.copyfile(CLUSTER, w["cluster"] / "cluster.yaml")
    w["const"] = home("const") / "Q"
    w["const"].mkdir()
    (w["const"] / "c.yaml").write_text("compute: 0.5\n")
    w["calib"] = home("calib") / "L"
    w["calib"].mkdir()
    (w["calib"] / "allreduce.log").write_text("# nccl-tests\n")
    for key in ("hf", "ckpt", "nemo", "cfg", "tok", "plan", "cluster", "const", "calib", "valid"):
        (w[key] / "mine.txt").write_text("a user's file\n")
    (root / "links").mkdir()
    (root / "outs").mkdir()
    return w


# Each reader: (id, the input as the message names it, the input's directory in the world, the
# output's flag, what it writes (a directory, one file, or files named from a prefix), and argv
# from (world, output)).
def _export(w, extra, out):
    return ["export", w["ckpt"], *extra, "--out", out, "--overwrite"]


def _convert(w, extra, out, src=None):
    return ["convert", src or w["ckpt"], "--to", "nemo2", *extra, "--out", out, "--overwrite"]


def _verify(w, extra, plot, hf=None, ckpt=None):
    return ["verify", hf or w["hf"], ckpt or w["ckpt"], *extra, "--plot", plot]


def _train(w, extra, out):
    base = ["train", "--checkpoint", w["nemo"], "--data", w["prefix"], "--steps", "1"]
    return [*base, *extra, "--out", out, "--dry-run"]


def _prep(w, out, inputs=None, tok=None):
    return ["prep-data", "--input", inputs or w["corpus"], "--tokenizer", tok or w["tok"],
            "--output-prefix", out, "--overwrite", "--no-progress"]  # fmt: skip


def _plan(w, extra, emit):
    base = ["plan", "--model", "tiny", "--cluster", w["cluster"] / "cluster.yaml"]
    return [*base, "--global-batch", "8", "--seq-length", "128", *extra, "--emit", emit]


READERS = [
    ("import", "HF directory", "hf", "--out", "dir",
     lambda w, o: ["import", w["hf"], "--out", o, "--overwrite"]),
    ("export", "checkpoint", "ckpt", "--out", "dir", lambda w, o: _export(w, [], o)),
    ("export-iteration", "checkpoint", "ckpt", "--out", "dir",
     lambda w, o: ["export", w["ckpt"] / "iter_0000000", "--out", o, "--overwrite"]),
    ("export-hf-config", "--hf-config", "cfg", "--out", "dir",
     lambda w, o: _export(w, ["--hf-config", w["cfg"]], o)),
    ("export-hf-config-file", "--hf-config", "cfg", "--out", "dir",
     lambda w, o: _export(w, ["--hf-config", w["cfg"] / "config.json"], o)),
    ("export-tokenizer", "--tokenizer", "tok", "--out", "dir",
     lambda w, o: _export(w, ["--hf-config", w["cfg"], "--tokenizer", w["tok"]], o)),
    ("convert", "source", "ckpt", "--out", "dir", lambda w, o: _convert(w, [], o)),
    ("convert-hf", "source", "hf", "--out", "dir", lambda w, o: _convert(w, [], o, w["hf"])),
    ("convert-hf-config", "--hf-config", "cfg", "--out", "dir",
     lambda w, o: _convert(w, ["--hf-config", w["cfg"]], o)),
    ("convert-tokenizer", "--tokenizer", "tok", "--out", "dir",
     lambda w, o: _convert(w, ["--hf-config", w["cfg"], "--tokenizer", w["tok"]], o)),
    ("verify-hf", "HF directory", "hf", "--plot", "file", lambda w, o: _verify(w, [], o)),
    ("verify-ckpt", "checkpoint", "ckpt", "--plot", "file", lambda w, o: _verify(w, [], o)),
    ("verify-iteration", "checkpoint", "ckpt", "--plot", "file",
     lambda w, o: _verify(w, [], o, ckpt=w["ckpt"] / "iter_0000000")),
    ("verify-hf-config", "--hf-config", "cfg", "--plot", "file",
     lambda w, o: _verify(w, ["--hf-config", w["cfg"]], o)),
    ("verify-tokenizer", "--tokenizer", "tok", "--plot", "file",
     lambda w, o: _verify(w, ["--hf-config", w["cfg"], "--tokenizer", w["tok"]], o)),
    ("train-checkpoint", "--checkpoint", "nemo", "--out", "dir", lambda w, o: _train(w, [], o)),
    ("train-plan", "--plan", "plan/plan.json", "--out", "dir",
     lambda w, o: _train(w, ["--plan", w["plan"] / "plan.json"], o)),
    ("train-valid-data", "--valid-data file", "valid/d.bin", "--out", "dir",
     lambda w, o: _train(w, ["--valid-data", w["valid"] / "d"], o)),
    ("prep-input", "input", "corpus", "--output-prefix", "prefix", lambda w, o: _prep(w, o)),
    ("prep-tokenizer", "tokenizer", "tok", "--output-prefix", "prefix",
     lambda w, o: _prep(w, o)),
    ("prep-tokenizer-checkpoint", "tokenizer", "nemo", "--output-prefix", "prefix",
     lambda w, o: _prep(w, o, tok=w["nemo"])),
    ("prep-emit", "input", "corpus", "--emit", "dir",
     lambda w, o: [*_prep(w, w["root"] / "outs" / "p"), "--executor", "slurm", "--no-submit", "--emit", o]),
    ("plan-model", "--model", "hf", "--emit", "dir",
     lambda w, o: [*_plan(w, [], o), "--model", w["hf"]]),
    ("plan-cluster", "--cluster", "cluster/cluster.yaml", "--emit", "dir",
     lambda w, o: _plan(w, [], o)),
    ("plan-calibrate", "--calibrate", "calib", "--emit", "dir",
     lambda w, o: _plan(w, ["--calibrate", w["calib"]], o)),
    ("plan-constants", "--constants", "const/c.yaml", "--emit", "dir",
     lambda w, o: _plan(w, ["--constants", w["const"] / "c.yaml"], o)),
    ("plan-plot", "--constants", "const/c.yaml", "--plot", "file",
     lambda w, o: [*_plan(w, ["--constants", w["const"] / "c.yaml"], w["root"] / "outs" / "e"),
                   "--plot", o]),
    ("plan-save-constants", "--constants", "const/c.yaml", "--save-constants", "file",
     lambda w, o: [*_plan(w, ["--constants", w["const"] / "c.yaml"], w["root"] / "outs" / "e"),
                   "--save-constants", o]),
]  # fmt: skip

# How the output is placed against an input directory I (a symlink made under links/ first).
DIR_RELATIONS = {
    "is": lambda i, links: i,
    "inside": lambda i, links: i / "new",
    "a file inside": lambda i, links: i / "mine.txt",
    "deep inside": lambda i, links: i / "a" / "b",
    "containing": lambda i, links: i.parent,
    "a symlink to it": lambda i, links: _link(links / "to", i),
    "a symlink into it": lambda i, links: _link(links / "into", i / "mine.txt"),
    "inside a symlink to it": lambda i, links: _link(links / "via", i) / "new",
    "a dangling symlink into it": lambda i, links: _link(links / "dangling", i / "gone"),
}
# A prefix's files lie beside it: only a prefix inside the input puts them there.
PREFIX_RELATIONS = {
    k: DIR_RELATIONS[k]
    for k in ("inside", "a file inside", "deep inside", "inside a symlink to it")
}
# ... and against an input file F.
FILE_RELATIONS = {
    "is": lambda f, links: f,
    "containing": lambda f, links: f.parent,
    "a symlink to it": lambda f, links: _link(links / "to", f),
    "inside a symlink to its directory": lambda f, links: _link(links / "via", f.parent) / f.name,
    "a hard link to it": lambda f, links: _hard_link(links / "hard", f),
}


def _link(link: Path, target: Path) -> Path:
    link.unlink(missing_ok=True)
    link.symlink_to(target)
    return link


def _hard_link(link: Path, target: Path) -> Path:
    link.unlink(missing_ok=True)
    os.link(target, link)
    return link


def _refused(argv, capsys, *needles) -> str:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, (argv, err)
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"porting {argv[0]}: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.mark.parametrize("reader", READERS, ids=[r[0] for r in READERS])
def test_no_output_lands_on_an_input(world, reader, capsys):
    _, what, key, flag, kind, argv = reader
    root, links = world["root"], world["root"] / "links"
    name, _, file = key.partition("/")
    given = world[name] / file if file else world[name]
    if file:
        relations = FILE_RELATIONS
    else:
        relations = PREFIX_RELATIONS if kind == "prefix" else DIR_RELATIONS
    for relation, place in relations.items():
        out = place(given, links)
        before = _tree(root)
        line = _refused(argv(world, out), capsys, flag, f"the {what} ")
        assert str(given) in line, (relation, line)
        assert _tree(root) == before, relation


def test_merge_and_a_config_file_as_outputs(world, capsys):
    """A merge onto its own input prefix (or the same through a symlinked directory) or into the
    directory it merges, and an export onto the ``config.json`` it was given."""
    root, links = world["root"], world["root"] / "links"
    bin_file = Path(f"{world['prefix']}.bin")
    merge = ["prep-data", "merge", world["prefix"], "--overwrite", "--output-prefix"]
    for out in (world["prefix"], _link(links / "D", bin_file.parent) / "d"):
        before = _tree(root)
        _refused([*merge, out], capsys, "--output-prefix", "the dataset")
        assert _tree(root) == before
    # --input DIR: an output among the directory's pairs would be merged into the next merge of it
    merge_dir = ["prep-data", "merge", "--input", str(bin_file.parent), "--output-prefix"]
    before = _tree(root)
    _refused([*merge_dir, bin_file.parent / "merged"], capsys, "--output-prefix", "--input")
    assert _tree(root) == before
    config = world["cfg"] / "config.json"
    before = _tree(root)
    _refused(_export(world, ["--hf-config", config], config), capsys, "--out", "--hf-config")
    assert _tree(root) == before


def test_file_outputs_are_checked_before_the_work(world, monkeypatch, capsys):
    """`verify --plot` and `plan --plot/--save-constants` into a missing directory, onto a
    directory, or with a mode that cannot draw: refused before the gate (or the search) runs."""
    from porting.parity import harness
    from porting.planner import search

    def never(*a, **k):
        raise AssertionError("ran before the output was checked")

    monkeypatch.setattr(harness, "verify", never)
    monkeypatch.setattr(search, "plan", never)
    root = world["root"]
    missing = root / "outs" / "missing" / "p.png"
    before = _tree(root)
    _refused(_verify(world, [], missing), capsys, "--plot", "no directory", str(missing.parent))
    _refused(_verify(world, [], root / "outs"), capsys, "--plot", "a directory")
    _refused(
        [*_verify(world, [], root / "outs" / "p.png"), "--whole-model"],
        capsys,
        "--plot needs the layer-streamed check",
    )
    emit = root / "outs" / "e"
    for flag in ("--plot", "--save-constants"):
        _refused([*_plan(world, [], emit), flag, missing], capsys, flag, "no directory")
    assert _tree(root) == before


def test_check_outputs_reads_no_missing_path_as_an_input(tmp_path):
    """A path of None (a flag not given) is skipped; unrelated siblings pass; an input inside
    the output's directory does not make the output overlap it."""
    (tmp_path / "in").mkdir()
    guard.check_outputs(
        [("--a", tmp_path / "in"), ("--b", None)],
        writes=[("--out", tmp_path / "out"), ("--emit", None)],
        files=[("--plot", tmp_path / "p.png"), ("--json", None)],
    )
    with pytest.raises(PortingError, match="--out .* contains the --a"):
        guard.check_outputs([("--a", tmp_path / "in")], writes=[("--out", tmp_path)])


def test_an_output_where_a_hub_snapshot_s_links_lead_is_refused(
    tiny_llama, tiny_nemo, tmp_path, capsys
):
    """An HF hub cache: `snapshots/REV/*` are links into `blobs/`, where the bytes are. An output
    that is `blobs/` (or one blob) would destroy the model as surely as the snapshot itself."""
    repo = tmp_path / "hub" / "models--org--m"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in sorted(Path(tiny_llama).iterdir()):
        if f.is_file():
            shutil.copyfile(f, blobs / f"b-{f.name}")
            (snap / f.name).symlink_to(Path("..", "..", "blobs", f"b-{f.name}"))
    before = _tree(tmp_path / "hub")
    _refused(["import", snap, "--out", blobs, "--overwrite"], capsys, "--out", "(a link)")
    blob = blobs / "b-config.json"
    _refused(["verify", snap, tiny_nemo, "--plot", blob], capsys, "--plot", "config.json (a link)")
    assert _tree(tmp_path / "hub") == before


def test_two_outputs_of_one_run_may_not_meet(tmp_path, capsys):
    """`plan --emit D --plot D`, `--emit D --save-constants D/x.yaml`, `--plot F --save-constants
    F`: the later write would replace or land inside the earlier; refused before the search."""
    cluster = Path(__file__).resolve().parents[1] / "examples" / "clusters" / "two-sites.yaml"
    plan = ["plan", "--model", "tiny", "--cluster", str(cluster), "--global-batch", "64"]
    plan += ["--seq-length", "1024"]
    emit, same = tmp_path / "em", tmp_path / "same.yaml"
    for outs in (
        ["--emit", emit, "--plot", emit],
        ["--emit", emit, "--save-constants", emit],
        ["--plot", same, "--save-constants", same],
    ):
        _refused([*plan, *outs], capsys, str(outs[1]), "the output of")
        assert sorted(tmp_path.iterdir()) == []
    guard.check_outputs([], writes=[("--emit", emit)], files=[("--plot", tmp_path / "p.png")])


# -- convert: staging cleaned up as one ------------------------------------------------------


def _convert_proc(src: Path, out: Path) -> subprocess.Popen:
    from porting.testing import child_env

    argv = [sys.executable, "-m", "porting.cli", "convert", str(src), "--to", "megatron-lm"]
    return subprocess.Popen(
        [*argv, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=child_env(),
    )


def _stop_when(proc: subprocess.Popen, where: Path, pattern: str, sig: int) -> tuple[str, str]:
    deadline = time.time() + 300
    try:
        while time.time() < deadline and proc.poll() is None and not any(where.glob(pattern)):
            time.sleep(0.02)
        assert proc.poll() is None, f"the conversion ended before {pattern} appeared"
        os.killpg(proc.pid, sig)
        return proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


@pytest.mark.parametrize(
    "stage",
    [
        ".out.hf-*",  # the staging directory made, the export about to start
        ".out.hf-*/.hf.partial-*",  # the export writing
        ".out.partial-*",  # the import writing, the HF copy still there
    ],
)
def test_sigterm_at_each_stage_of_convert_leaves_nothing(tiny_nemo, tmp_path, stage):
    out, err = _stop_when(
        _convert_proc(tiny_nemo, tmp_path / "out"), tmp_path, stage, signal.SIGTERM
    )
    assert "Traceback" not in err, err[-3000:]
    assert "stopped by SIGTERM" in err, err[-3000:]
    assert "wrote" not in out
    assert list(tmp_path.iterdir()) == []


def test_a_rerun_removes_every_kind_of_leftover_of_a_killed_convert(tiny_nemo, tmp_path, capsys):
    """SIGKILL during the import step leaves the HF copy and the partial checkpoint; with the
    other kinds a kill can leave (the replaced output) they all go on the next run, and what
    belongs to other outputs stays."""
    out = tmp_path / "out"
    _stop_when(_convert_proc(tiny_nemo, out), tmp_path, ".out.partial-*", signal.SIGKILL)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert any(n.startswith(".out.hf-") for n in left), left
    assert any(n.startswith(".out.partial-") for n in left), left
    (tmp_path / ".out.old-5f3e9a1c0b2d4e6f").mkdir()
    (tmp_path / ".out.old-5f3e9a1c0b2d4e6f" / "weights").write_text("an older output")
    neighbours = [".out.hf-1.partial-abc", ".other.partial-abc", "out.hf-1"]
    for name in neighbours:
        (tmp_path / name).mkdir()
    assert main(["convert", str(tiny_nemo), "--to", "megatron-lm", "--out", str(out)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*neighbours, "out"])


def test_a_stop_that_library_code_swallows_or_wraps_still_stops(
    tiny_nemo, tiny_llama, tmp_path, monkeypatch
):
    """A SIGTERM whose exception is dropped (a finalizer running when it arrives) or wrapped
    (torch's CheckpointException) still ends the command with 143 and nothing written."""
    from torch.distributed.checkpoint.api import CheckpointException

    from porting import api

    def sigterm_here():
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):
            time.sleep(0.01)

    export_hf = api.export_hf

    def swallowing(*a, **k):
        report = export_hf(*a, **k)
        try:
            sigterm_here()
        except BaseException:
            pass
        return report

    out = tmp_path / "out"
    monkeypatch.setattr(api, "export_hf", swallowing)
    assert main(["convert", str(tiny_nemo), "--to", "megatron-lm", "--out", str(out)]) == 143
    assert list(tmp_path.iterdir()) == []

    def wrapping(*a, **k):
        try:
            sigterm_here()
        except BaseException as err:
            raise CheckpointException("write", {0: (err, [])}) from None

    monkeypatch.setattr(api, "import_hf", wrapping)
    # a real HF directory: an empty one is refused before the conversion starts
    assert main(["import", str(tiny_llama), "--out", str(out)]) == 143
    assert list(tmp_path.iterdir()) == []


def test_a_stop_inside_a_finalizer_prints_no_traceback_and_still_stops(capfd):
    """SIGTERM handled while a finalizer runs (seen: importlib's weakref callback, mid-convert):
    Python would print the handler's exception with a traceback and drop it; the command still
    stops, and its one closing line is all it says."""
    import os
    import signal

    from porting.guard import Terminated, raise_if_stopped, signals_as_exceptions

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100_000):  # the handler runs here, inside the finalizer
                pass

    with pytest.raises(Terminated), signals_as_exceptions():
        Finalized()
        raise_if_stopped()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception ignored" not in err, err
