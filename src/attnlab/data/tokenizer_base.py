"""What attnlab's tokenizers share: argument checks, and `TokenizersTokenizer`, a `tokenizers.Tokenizer`
with the token that separates documents (the base of BPETokenizer and PretrainedTokenizer)."""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np


def _check_text(text) -> str:
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return text


def _id_list(ids, vocab_size: int) -> list[int]:
    """ids (a sequence, array or tensor) as ints, each in [0, vocab_size) or ValueError."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"ids must lie in [0, {vocab_size}), got {bad[0]}")
    return ids


class TokenizersTokenizer:
    """A `tokenizers.Tokenizer` and the token that separates documents (EOS)."""

    def __init__(self, tok, eos_token: str, name: str):
        self._tok = tok
        eos = tok.token_to_id(eos_token)
        if eos is None:
            raise ValueError(f"the tokenizer has no token {eos_token!r} to use as EOS")
        self.eos_token = eos_token
        self.eos_id = int(eos)
        # one past the largest id: the vocabulary and the added tokens may leave gaps
        self.vocab_size = 1 + max(tok.get_vocab(with_added_tokens=True).values())
        self.name = name

    def to_str(self) -> str:
        """The tokenizer as `tokenizers` JSON (what a tokenizer.json holds)."""
        return self._tok.to_str()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(_check_text(text), add_special_tokens=False).ids

    def encode_batch(self, texts: Iterable[str]) -> list[np.ndarray]:
        texts = [_check_text(t) for t in texts]
        encs = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encs]

    def decode(self, ids: Sequence[int]) -> str:
        ids = _id_list(ids, self.vocab_size)
        return self._tok.decode(ids, skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eos_id={self.eos_id})"
