"""The negative control: a weight table wrong in one layer only, imported as ``porting import``
does; parity must fail by far more than the tolerance and the streamed gate must name that
layer first."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from porting.proof.parity import ATOL, logits


def broken_table(table, pattern: str, layer: int, breaker, num_layers: int):
    """``table`` with the entry whose Megatron name ends in ``pattern`` broken for one layer only.

    ``breaker(transform) -> TransformPair`` turns the entry's own transform into the broken one
    (see :func:`scaled`); the other layers keep theirs. An entry for some layers only (its
    ``layers``) stays for those.
    """
    from porting.contract.mapping import Fused, Rename
    from porting.contract.transforms import IDENTITY

    out = []
    for e in table:
        if isinstance(e, Rename | Fused) and e.mcore.endswith(pattern) and "*" in e.mcore:
            fixed = e.transform if isinstance(e, Fused) else IDENTITY
            for i in range(num_layers):
                hf = (e.hf,) if isinstance(e, Rename) else e.hf
                hf = tuple(k.replace("*", str(i)) for k in hf)
                chosen = breaker(fixed) if i == layer else fixed

                def when(c, i=i, e=e) -> bool:
                    return (e.when is None or e.when(c)) and (e.layers is None or e.layers(c, i))

                out.append(Fused(hf, e.mcore.replace("*", str(i)), chosen, when=when))
        else:
            out.append(e)
    assert tuple(out) != tuple(table), f"no layered entry ends in {pattern!r}"
    return tuple(out)


def import_with_table(hf_dir: str | Path, out: str | Path, family, table) -> Path:
    """Import as ``porting import`` does, with ``table`` in place of the family's weight table."""
    from porting.api import nemo2_import

    broken = dataclasses.replace(family, weights=table)
    nemo2_import(Path(hf_dir).resolve(), Path(out), broken, show_progress=False)
    return Path(out)


def scaled(factor: float = 1.5):
    """A breaker for :func:`broken_table`: the entry's own transform, its output times ``factor``."""
    from porting.contract.transforms import TransformPair

    def breaker(fixed):
        return TransformPair(
            f"{fixed.name}_times_{factor}",
            lambda *args: factor * fixed.forward(*args),
            lambda t, ctx: fixed.inverse(t / factor, ctx),
        )

    return breaker


def prove_fault_named(
    hf_dir: str | Path,
    out: str | Path,
    family,
    layer: int,
    num_layers: int,
    pattern: str = "self_attention.linear_proj.weight",
) -> None:
    """The negative control: one layer's ``pattern`` tensor scaled by 1.5 through the importer
    (see :func:`prove_table_fault_named`)."""
    table = broken_table(family.weights, pattern, layer, scaled(), num_layers)
    prove_table_fault_named(hf_dir, out, family, table, layer)


def prove_table_fault_named(hf_dir: str | Path, out: str | Path, family, table, layer: int) -> None:
    """A checkpoint written through ``table`` (wrong in ``layer`` only) must fail full-logit
    parity by more than 100x the tolerance, and the streamed gate must name ``layer`` first with
    the layers before it exact."""
    from porting.parity import harness

    ckpt = import_with_table(hf_dir, out, family, table)
    hf, mc = logits(hf_dir, ckpt)
    whole = harness.compare(hf, mc)
    assert not whole.passed and whole.max_abs_diff > 100 * ATOL
    report = harness.verify(hf_dir, ckpt)
    assert not report.passed
    assert report.first_divergent_layer == layer, report.summary()
    assert all(d["own_max_rel"] < 1e-5 for d in report.layers[:layer])
