"""Parity of every installed family's architectures on tiny random-init models, as a table.

For each architecture a family claims, a tiny random model is built locally
(porting.proof.make_hf of porting.proof.tiny_fields: 3 layers, hidden 64, norms and biases perturbed),
imported with the parity gate off, then compared whole-model in fp32 against ``transformers``:
max and mean |dlogit| over every logit of the gate's prompts, KL, top-1, and the import's wall time.

    python scripts/bench_families.py [--workdir DIR]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--workdir", type=Path, help="where the models go (default: a temp dir)")
    args = p.parse_args()
    from porting import proof
    from porting.api import import_hf
    from porting.contract import registry
    from porting.parity.harness import compare

    work = args.workdir or Path(tempfile.mkdtemp(prefix="porting-bench-families-"))
    rows = []
    for family in registry.families():
        for arch in family.architectures:
            root = work / arch
            shutil.rmtree(root, ignore_errors=True)
            hf = proof.make_hf(root / "hf", arch, seed=1, **proof.tiny_fields(arch))
            t = time.perf_counter()
            import_hf(hf, root / "nemo", verify=False, show_progress=False)
            wall = time.perf_counter() - t
            report = compare(*proof.logits(hf, root / "nemo"))
            rows.append((family.name, arch, report, wall))
            print(f"{arch}: {report.max_abs_diff:.2e}", file=sys.stderr, flush=True)
    print(f"{'family':<9}{'architecture':<22}{'max|dlogit|':>12}{'mean|dlogit|':>14}{'KL':>11}"
          f"{'top-1':>8}{'import s':>10}  gate")  # fmt: skip
    for name, arch, r, wall in rows:
        print(
            f"{name:<9}{arch:<22}{r.max_abs_diff:>12.2e}{r.mean_abs_diff:>14.2e}{r.kl_hf_mcore:>11.1e}"
            f"{100 * r.top1_agreement:>7.1f}%{wall:>10.1f}  {'PASS' if r.passed else 'FAIL'}"
        )
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r.passed for _, _, r, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
