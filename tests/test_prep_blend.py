"""`porting prep-data blend`: the weighted blend of prepared corpora from their token counts and the
user's shares, in the form `porting train --data`, Megatron's `--data-path` and its
`--data-args-path` file read; what cannot be a blend is refused by name."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from data_prep import testing as T
from data_prep.blend import blend, corpus_counts
from data_prep.executors.base import output_prefix_for
from data_prep.prep import prepare
from porting.errors import PortingError
from porting.train.checks import parse_blend


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict:
    """Three corpora of one tokenizer (one copied away from its report, as another tool's output
    stands), one of another tokenizer, and one of int32 tokens."""
    d = tmp_path_factory.mktemp("blend")
    tok = T.train_hf_bpe(T.synthetic_texts(80, seed=3), d / "tok", 300)
    other = T.train_hf_bpe(T.synthetic_texts(80, seed=4), d / "tok2", 300)
    out = {}
    for name, n, t in (("a", 30, tok), ("b", 10, tok), ("c", 10, other)):
        texts = T.synthetic_texts(n, seed=len(name) + n, mean_chars=200)
        corpus = T.write_jsonl(d / f"{name}.jsonl", [{"text": x} for x in texts])
        prepare(T.prep_config([corpus], d / name, t, append_eod=True))
        out[name] = str(output_prefix_for(d / name, "text"))
    (d / "bare").mkdir()
    for ext in (".bin", ".idx"):
        shutil.copy(out["b"] + ext, d / "bare" / f"b_text_document{ext}")
    out["bare"] = str(d / "bare" / "b_text_document")
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(d / "wide.bin"), dtype=np.int32)
    builder.add_document(np.arange(5, dtype=np.int32), [5])
    builder.finalize(str(d / "wide.idx"))
    out["wide"] = str(d / "wide")
    return out


def test_shares_given_and_the_rest_by_tokens(corpora):
    a, b, bare = corpora["a"], corpora["b"], corpora["bare"]
    ta, tb = corpus_counts(a).tokens, corpus_counts(b).tokens
    natural = blend([a, b])
    assert [r["share"] for r in natural["corpora"]] == pytest.approx(
        [ta / (ta + tb), tb / (ta + tb)]
    )
    assert natural["tokens"] == ta + tb
    fixed = blend([f"{a}=20%", b, bare], train_tokens=1e6)
    shares = [r["share"] for r in fixed["corpora"]]
    assert shares == pytest.approx([0.2, 0.4, 0.4])  # b and its copy split the rest alike
    assert [r["given"] for r in fixed["corpora"]] == [True, False, False]
    assert fixed["corpora"][0]["epochs"] == pytest.approx(0.2e6 / ta)
    assert all(r["flagged"] for r in fixed["corpora"])  # a million tokens of a few thousand
    assert fixed["tokenizer_unknown"] == [bare]
    assert blend([f"{a}=0.25", f"{b}=0.75"])["data"] == ["0.25", a, "0.75", b]


def test_the_blend_reads_back_in_megatron_and_in_porting_train(corpora, tmp_path, cli):
    from megatron.core.datasets.utils import get_blend_from_list

    a, b = corpora["a"], corpora["b"]
    done = cli(["prep-data", "blend", f"{a}=0.3", b, "--out", str(tmp_path / "blend.txt")])
    assert done.returncode == 0, done.stderr
    data = done.stdout.strip().splitlines()[-2]
    assert data == f"--data 0.3 {a} 0.7 {b}", done.stdout
    prefixes, weights = get_blend_from_list((tmp_path / "blend.txt").read_text().split())
    assert prefixes == [a, b] and weights == pytest.approx([0.3, 0.7])
    assert parse_blend(data.split()[1:]) == ([a, b], [0.3, 0.7])
    again = cli(["prep-data", "blend", a, "--out", str(tmp_path / "blend.txt")])
    assert again.returncode == 2 and "exists; pass --overwrite" in again.stderr
    flagged = cli(["prep-data", "blend", a, b, "--train-tokens", "2M", "--json"])
    assert flagged.returncode == 0
    (said,) = [m for m in flagged.logged if m.startswith(f"{a}: ")]
    assert "epochs of it in 2,000,000 training tokens" in said


@pytest.mark.parametrize(
    "case,why",
    [
        ("over one", "the shares sum to 1.2, more than 1"),
        ("not one", "the shares sum to 0.5; make them sum to 1"),
        ("nothing left", "leaves nothing for"),
        ("twice", "named twice"),
        ("a share of zero", "a share is a fraction in (0, 1]"),
        ("not a number", "the share after '=' is not a number"),
        ("another tokenizer", "were written with different tokenizers"),
        ("int32 tokens", "corpora of different tokenizers cannot be blended"),
        ("missing", "missing (give the prefix"),
        ("whitespace", "a prefix with whitespace cannot be in a blend"),
        ("a cut index", "but its header describes"),
        ("a cut bin", "but its index describes"),
        ("not an index", "not a Megatron index"),
        ("a fifo for an index", "x.idx: not a regular file"),
    ],
)
def test_what_cannot_be_a_blend_is_refused_by_name(case, why, corpora, tmp_path):
    a, b = corpora["a"], corpora["b"]
    if case in ("a cut index", "a cut bin", "not an index"):
        for ext in (".bin", ".idx"):
            shutil.copy(a + ext, tmp_path / f"x{ext}")
        damaged = tmp_path / ("x.bin" if case == "a cut bin" else "x.idx")
        data = damaged.read_bytes()
        damaged.write_bytes(b"MMIDX" + data[5:] if case == "not an index" else data[:-4])
    if case == "a fifo for an index":
        shutil.copy(a + ".bin", tmp_path / "x.bin")
        os.mkfifo(tmp_path / "x.idx")  # opened, it would block the command
    items = {
        "over one": [f"{a}=0.6", f"{b}=0.6"],
        "not one": [f"{a}=0.25", f"{b}=25%"],
        "nothing left": [f"{a}=1", b],
        "twice": [a, a],
        "a share of zero": [f"{a}=0"],
        "not a number": [f"{a}=1e"],
        "another tokenizer": [a, corpora["c"]],
        "int32 tokens": [a, corpora["wide"]],
        "missing": [a, str(tmp_path / "none")],
        "whitespace": [a, "my corpus/x"],
        "a cut index": [str(tmp_path / "x")],
        "a cut bin": [str(tmp_path / "x")],
        "not an index": [str(tmp_path / "x")],
        "a fifo for an index": [str(tmp_path / "x")],
    }[case]
    with pytest.raises(PortingError, match=why.replace("(", r"\(").replace(")", r"\)")):
        blend(items)
