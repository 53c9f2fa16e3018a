"""``porting families``: the families installed, where each comes from and what it converts."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``families`` subcommand."""
    p = sub.add_parser(
        "families",
        help="list the installed model families (entry points of group porting.families)",
        description="List every model family installed in this environment: ours and those of "
        "any package that declares an entry point in the porting.families group "
        "(docs/families.md). For each: the package and module it comes from, the HF "
        "architectures and model types it claims, the vision-language classes whose language "
        "model it converts, and the variants its tests prove. A family "
        "that fails to load is listed with its error and the command exits 2.",
    )
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    p.set_defaults(func=_cmd_families)

    p = sub.add_parser(
        "new-family",
        help="write a family package skeleton from an HF model directory",
        description="Write an installable family package started from HF_DIR's config.json, "
        "the tensor names of the HF model it describes (built on the meta device) and the "
        "checkpoint's tensor names (no tensor is read, no checkpoint code run), starting from the "
        "closest installed family (scored by the HF tensors its table reads and the config fields "
        "it places as they are; the scores are printed): pyproject.toml with the "
        "porting.families entry point, model.py, converter.py importing the base's entries and "
        "table with every config field placed (as the base does, carried, required as seen, or "
        "Undecided), the base's required fields the checkpoint lacks and every HF tensor the "
        "base's table does not read each Undecided, and a test that builds tiny random models of "
        "the config and of a variant and runs the full proof. The family claims HF_DIR's "
        "architecture, or its model_type when another family has the architecture. See "
        "docs/families.md.",
    )
    p.add_argument(
        "name",
        help="family name: lower case letters, digits and underscores, starting with a letter, "
        "not a Python keyword, at most 64 characters",
    )
    p.add_argument("--from", dest="hf_dir", type=Path, required=True, help="HF model directory")
    p.add_argument(
        "--out",
        type=Path,
        help="where to write the package (default: ./porting-family-NAME); it may not be, lie "
        "inside or contain HF_DIR",
    )
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument(
        "--hf-class",
        metavar="CLASS",
        help="the transformers class of the HF reference side, where the checkpoint's "
        "architecture is not one (auto_map checkpoints; their own code is never run)",
    )
    p.add_argument(
        "--base",
        metavar="FAMILY",
        help="the installed family to start from (default: the closest; see porting families)",
    )
    p.set_defaults(func=_cmd_new_family)


def _cmd_families(args) -> int:
    from porting import quiet
    from porting.contract import registry

    # Our families load from the contract alone (no torch, no NeMo): the listing answers at once.
    quiet.offline()
    found = registry.installed()
    if "nemo" in sys.modules:  # an outside family that imports NeMo with its tables
        quiet.quiet_nemo()
    rows = [
        {
            "name": i.name,
            "package": i.package,
            "entry_point": i.value,
            "error": i.error,
            **(
                {
                    "source": i.family.source,
                    "summary": i.family.summary,
                    "architectures": list(i.family.architectures),
                    "model_types": list(i.family.model_types),
                    "containers": [c.architecture for c in i.family.containers],
                    "variants": {v.name: v.summary for v in i.family.variants},
                }
                if i.family
                else {}
            ),
        }
        for i in found
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            print(f"{r['name']}  ({r['package']}, {r['entry_point']})")
            if r["error"]:
                print(f"  failed to load: {r['error']}")
                continue
            if r["summary"]:
                print(f"  {r['summary']}")
            print(f"  source: {r['source']}")
            print(f"  claims: {', '.join(r['architectures'] + r['model_types'])}")
            if r["containers"]:
                print(f"  and the language model of: {', '.join(r['containers'])}")
            for name, what in r["variants"].items():
                print(f"  variant {name}: {what}")
        print(f"{sum(not r['error'] for r in rows)} families installed")
    return 2 if any(r["error"] for r in rows) else 0


def _cmd_new_family(args) -> int:
    from porting import cpu, quiet
    from porting.scaffold import check_name, new_family

    # The name makes the default --out: checked before any path is made from it.
    name = check_name(args.name)
    quiet.offline()
    cpu.hide_gpus()
    quiet.quiet_nemo()
    out = args.out or Path(f"porting-family-{name.replace('_', '-')}")
    done = new_family(
        name, args.hf_dir, out, overwrite=args.overwrite, hf_class=args.hf_class, base=args.base
    )
    print(done.summary())
    return 0
