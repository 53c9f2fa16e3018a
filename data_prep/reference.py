"""Megatron-Core's own tokenizer, built as Megatron-LM's ``preprocess_data.py`` builds it.

It is the reference every faster backend is checked against, and the slow ``megatron`` backend
itself; both :mod:`data_prep.tokenizer` and :mod:`data_prep.backends` use it, so it lives apart
from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from porting.errors import PortingError


@dataclass
class Reference:
    """Megatron-Core's tokenizer for a source, and what data prep needs from it."""

    kind: str
    path: Path
    include_special_tokens: bool
    use_fast: bool
    mt: object = field(repr=False)

    @property
    def lib(self):
        """The library-level tokenizer inside Megatron's wrapper."""
        return self.mt._tokenizer

    @property
    def vocab_size(self) -> int:
        """What Megatron passes to ``DType.optimal_dtype`` (HF: ``len(tokenizer)``, with added)."""
        return int(self.mt.vocab_size)

    @property
    def eod(self) -> int | None:
        """The id Megatron appends with ``--append-eod``."""
        eod = self.mt.eod
        return None if eod is None or eod < 0 else int(eod)

    def encode(self, text: str) -> list[int]:
        """Megatron's ``tokenize``: the ids ``preprocess_data.py`` writes for a text."""
        return list(self.mt.tokenize(text))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of ids, without any clean-up of spaces (sentencepiece always drops controls)."""
        ids = [int(i) for i in ids]
        if self.kind == "sentencepiece":
            return self.lib.tokenizer.decode_ids(ids)
        hf = self.lib.tokenizer
        if hf.is_fast:
            return hf.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return hf.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def special_strings(self) -> list[str]:
        """Contents of the special and added tokens (to probe literal occurrences in text)."""
        if self.kind == "sentencepiece":
            sp = self.lib.tokenizer
            return [
                sp.id_to_piece(i)
                for i in range(sp.get_piece_size())
                if sp.is_control(i) or sp.is_unknown(i)
            ]
        hf = self.lib.tokenizer
        return sorted(set(hf.all_special_tokens) | set(hf.get_added_vocab()))


def load_reference(
    kind: str, path: str | Path, include_special_tokens: bool = True, use_fast: bool = True
) -> Reference:
    """Megatron-Core's tokenizer, built as ``preprocess_data.py``'s ``build_tokenizer`` builds it."""
    from megatron.core.tokenizers import MegatronTokenizer

    path = Path(path)
    try:
        if kind == "hf":
            mt = MegatronTokenizer.from_pretrained(
                tokenizer_path=str(path),
                metadata_path={"library": "huggingface"},
                vocab_file=None,
                merges_file=None,
                use_fast=use_fast,
                include_special_tokens=include_special_tokens,
            )
        else:
            mt = MegatronTokenizer.from_pretrained(
                tokenizer_path=str(path), metadata_path={"library": "sentencepiece"}
            )
    except (ValueError, OSError, RuntimeError) as err:
        raise PortingError(f"{path}: cannot load the tokenizer ({err})") from err
    return Reference(kind, path, include_special_tokens, use_fast, mt)
