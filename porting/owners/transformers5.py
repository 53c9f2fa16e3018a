"""Checkpoints as transformers 5 saves them, and its own logits for them, on the current stack (.venv).

``python -m porting.owners.transformers5 save SPEC.json OUT --tokens T.pt --tokenizer DIR`` builds,
for each entry
``name: [config class, {arguments}]`` of SPEC.json, a randomly initialised model of the config's
``architectures[0]`` with transformers 5's own classes, saves it with ``save_pretrained`` (its
default: the weights' original names, or the experts stacked for a name ending ``-packed``;
the config in 5.x spelling) into ``OUT/name`` with the
tokenizer of DIR as transformers 5 saves it (``TokenizersBackend``), and saves the
logits that transformers 5 computes for the token ids in T.pt into ``OUT/name.logits.pt``: a
reference for what we import, computed by the spelling's owner, not by our translation of it.

Nothing from porting is imported: this environment's transformers is the point.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


@torch.no_grad()
def save(spec: Path, out: Path, tokens: Path, tokenizer: Path) -> None:
    import transformers

    ids = torch.load(tokens, weights_only=True)
    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer))
    for name, (config_class, arguments) in json.loads(spec.read_text()).items():
        torch.manual_seed(0)
        config = getattr(transformers, config_class)(**arguments)
        model = getattr(transformers, config.architectures[0])(config).float().eval()
        for p in model.parameters():  # larger than the default init: logits that differ
            p.normal_(0, 0.1)
        # "-packed": the experts as transformers 5 computes with them, stacked per layer
        model.save_pretrained(out / name, save_original_format=not name.endswith("-packed"))
        tok.save_pretrained(out / name)
        logits = [model(t.view(1, -1)).logits.float() for t in ids]
        torch.save(logits, out / f"{name}.logits.pt")
        print(f"saved {name} (transformers {transformers.__version__})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("save", help="save SPEC's models and their logits into OUT")
    s.add_argument("spec", type=Path)
    s.add_argument("out", type=Path)
    s.add_argument("--tokens", type=Path, required=True)
    s.add_argument("--tokenizer", type=Path, required=True, help="a tokenizer directory to re-save")
    args = p.parse_args(argv)
    save(args.spec, args.out, args.tokens, args.tokenizer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
