"""``porting demo``: the main job end to end on an embedded tiny model."""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from porting import quiet


@dataclass
class RoundTrip:
    """Result of comparing two HF directories tensor by tensor and field by field."""

    same_keys: bool
    tensors: int
    equal_tensors: int
    config_fields_differing: list[str]

    @property
    def exact(self) -> bool:
        """True when keys, every tensor (``torch.equal``) and every config field match."""
        return (
            self.same_keys
            and self.equal_tensors == self.tensors
            and not self.config_fields_differing
        )


def compare_hf_dirs(a: str | Path, b: str | Path, ignore_fields: tuple[str, ...] = ()) -> RoundTrip:
    """Compare two HF directories: key sets, ``torch.equal`` per tensor, ``config.json`` fields."""
    import torch

    from porting.convert.safetensors_io import SafetensorsSource

    sa, sb = SafetensorsSource(a), SafetensorsSource(b)
    ka, kb = set(sa.keys()), set(sb.keys())
    common = sorted(ka & kb)
    equal = sum(
        1
        for k in common
        if sa.get(k).dtype == sb.get(k).dtype and torch.equal(sa.get(k), sb.get(k))
    )
    ca = json.loads((Path(a) / "config.json").read_text())
    cb = json.loads((Path(b) / "config.json").read_text())
    differing = sorted(
        k for k in set(ca) | set(cb) if k not in ignore_fields and ca.get(k) != cb.get(k)
    )
    return RoundTrip(ka == kb, len(ka | kb), equal, differing)


def run_demo(workdir: Path) -> int:
    """Build, import, verify, export and round-trip a tiny model; print a table; 0 on success."""
    from porting.api import export_hf, import_hf
    from porting.testing import make_falcon, make_llama

    workdir = Path(workdir)
    if workdir.exists():
        shutil.rmtree(workdir)
    rows = []

    def step(name, fn):
        t = time.perf_counter()
        out = fn()
        rows.append((name, time.perf_counter() - t))
        return out

    hf = step(
        "build tiny HF model",
        lambda: make_llama(workdir / "hf", vocab_size=130, num_kv_heads=2, rope_theta=50000.0),
    )
    imp = step(
        "import (+ parity gate)", lambda: import_hf(hf, workdir / "nemo", show_progress=False)
    )
    exp = step(
        "export (+ parity gate)",
        lambda: export_hf(workdir / "nemo", workdir / "hf-back"),
    )
    rt = step("round trip check", lambda: compare_hf_dirs(hf, workdir / "hf-back"))

    fdir = workdir / "falcon"
    f_hf = step(
        "falcon: build tiny model",
        lambda: make_falcon(
            fdir / "hf", new_decoder_architecture=True, num_kv_heads=2, ffn_hidden_size=98
        ),
    )
    f_imp = step(
        "falcon: import (+ gate)", lambda: import_hf(f_hf, fdir / "nemo", show_progress=False)
    )
    f_exp = step("falcon: export (+ gate)", lambda: export_hf(fdir / "nemo", fdir / "hf-back"))
    f_rt = step("falcon: round trip check", lambda: compare_hf_dirs(f_hf, fdir / "hf-back"))

    print()
    print("porting demo: tiny Llama-layout model (llama family, 2 layers, GQA 4/2, vocab 130->256)")
    print(
        "              tiny Falcon-style model (40B layout: parallel attention + MLP, two norms, "
        "GQA 4/2, vocab 130->256)"
    )
    print(f"{'step':<26}{'seconds':>9}")
    for name, sec in rows:
        print(f"{name:<26}{sec:>9.1f}")
    print()
    print(f"{'check':<34}{'result':>24}")
    print(f"{'import parity max|dlogit|':<34}{imp.max_abs_diff:>24.2e}")
    print(f"{'import parity top-1 agreement':<34}{100 * imp.top1_agreement:>23.1f}%")
    print(f"{'export parity max|dlogit|':<34}{exp.max_abs_diff:>24.2e}")
    print(f"{'round trip tensors equal':<34}{f'{rt.equal_tensors}/{rt.tensors}':>24}")
    print(f"{'round trip config fields differ':<34}{len(rt.config_fields_differing):>24}")
    print(f"{'falcon import parity max|dlogit|':<34}{f_imp.max_abs_diff:>24.2e}")
    print(f"{'falcon import parity top-1':<34}{100 * f_imp.top1_agreement:>23.1f}%")
    print(f"{'falcon export parity max|dlogit|':<34}{f_exp.max_abs_diff:>24.2e}")
    print(f"{'falcon round trip tensors equal':<34}{f'{f_rt.equal_tensors}/{f_rt.tensors}':>24}")
    print(f"{'falcon rt config fields differ':<34}{len(f_rt.config_fields_differing):>24}")
    ok = imp.passed and exp.passed and rt.exact and f_imp.passed and f_exp.passed and f_rt.exact
    print(f"\n{'OK' if ok else 'FAILED'}: outputs in {workdir}/")
    return 0 if ok else 1


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``demo`` subcommand."""
    p = sub.add_parser(
        "demo",
        help="end to end on tiny built-in models: build, import, verify, export, round trip",
        description="Build a tiny random Llama-layout and a tiny Falcon-style HF "
        "checkpoint locally, import each, verify parity, export it back and check the round "
        "trip; prints a short table.",
    )
    p.add_argument("--workdir", type=Path, default=Path("demo-out"))
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args) -> int:
    from porting import cpu

    quiet.offline()
    cpu.hide_gpus()
    quiet.quiet_nemo()
    # transformers 5's save_pretrained draws a bar for every tiny model the demo builds
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return run_demo(args.workdir)
