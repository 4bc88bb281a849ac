"""Tokenizers: byte-level by default, optional byte-level BPE trained locally and cached.

Every tokenizer has `encode(str) -> list[int]`, `decode(ids) -> str`, `vocab_size` and
`eos_id`, and `encode_batch(texts) -> list[np.ndarray]` for bulk work.

ByteTokenizer: ids 0-255 are the UTF-8 bytes, id 256 is EOS, the document separator
(`vocab_size` 257). EOS never comes out of `encode`; `decode` drops it and replaces
invalid UTF-8 with U+FFFD.

BPETokenizer: a `tokenizers` BPE model over GPT-2-style byte-level pre-tokenization, so
any text encodes without unknown tokens. Id 0 is the special token "<|endoftext|>" (EOS).
`get_tokenizer("bpe", vocab_size=V, corpus=...)` trains it on the corpus's train split
once and caches it as `<cache_dir>/bpe/<corpus>-<sha256 of the texts, 16 hex>-v<V>.json`,
written atomically.

PretrainedTokenizer (`attnlab.data.tokenizer_files`): a model's own tokenizer, from a local
`tokenizer.json` or the tokenizer embedded in a GGUF file: `get_tokenizer("path/to/model.gguf")`.

BPETokenizer and PretrainedTokenizer share `TokenizersTokenizer`: a `tokenizers.Tokenizer` with a
named EOS token; encode adds no special tokens (no BOS), decode drops the special ones.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Iterable, Protocol, Sequence, runtime_checkable

import numpy as np

from ..checks import check_int
from .cache import atomic_write_text, resolve_cache_dir
from .tokenizer_base import TokenizersTokenizer, _check_text, _id_list

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_KINDS = ("byte", "bpe")


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


BYTE_VOCAB_SIZE = 257  # the 256 byte values and EOS
MIN_BPE_VOCAB_SIZE = BYTE_VOCAB_SIZE + 1  # EOS, the 256 byte symbols and at least one merge


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, EOS = 256."""

    name = "byte"
    vocab_size = BYTE_VOCAB_SIZE
    eos_id = BYTE_VOCAB_SIZE - 1

    def encode(self, text: str) -> list[int]:
        return list(_check_text(text).encode("utf-8"))

    def encode_batch(self, texts: Iterable[str]) -> list[np.ndarray]:
        return [np.frombuffer(_check_text(t).encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        ids = _id_list(ids, self.vocab_size)
        return bytes(i for i in ids if i != self.eos_id).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id})"


class BPETokenizer(TokenizersTokenizer):
    """A trained byte-level BPE vocabulary (wraps `tokenizers.Tokenizer`)."""

    def __init__(self, tok):
        if tok.token_to_id(EOS_TOKEN) is None:
            raise ValueError(f"a BPE tokenizer for attnlab needs the special token {EOS_TOKEN!r}")
        super().__init__(tok, EOS_TOKEN, "")
        self.name = f"bpe-{self.vocab_size}"

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "BPETokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_file(str(path)))

    def save(self, path: str | os.PathLike) -> Path:
        """Write the vocabulary as tokenizers JSON, atomically."""
        return atomic_write_text(path, self._tok.to_str())


def train_bpe(texts: Iterable[str], vocab_size: int) -> BPETokenizer:
    """Train a byte-level BPE vocabulary of `vocab_size` ids (EOS + 256 byte symbols + merges)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    check_int("vocab_size", vocab_size, MIN_BPE_VOCAB_SIZE)
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return BPETokenizer(tok)


def texts_fingerprint(texts: Iterable[str]) -> str:
    """sha256 over the texts (length-prefixed, so boundaries count), 16 hex digits."""
    h = hashlib.sha256()
    for t in texts:
        b = t.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()[:16]


def bpe_cache_path(corpus: str, texts: Sequence[str], vocab_size: int, cache_dir=None) -> Path:
    """Where the BPE vocabulary of size `vocab_size` trained on `texts` is cached."""
    label = re.sub(r"[^A-Za-z0-9._-]+", "_", corpus).strip("_")[-48:] or "corpus"
    return resolve_cache_dir(cache_dir) / "bpe" / f"{label}-{texts_fingerprint(texts)}-v{vocab_size}.json"


def get_tokenizer(
    kind: str = "byte",
    *,
    vocab_size: int | None = None,
    corpus: str = "stdlib",
    cache_dir: str | os.PathLike | None = None,
    texts: Sequence[str] | None = None,
) -> TokenizersTokenizer | ByteTokenizer:
    """The tokenizer `kind`: "byte", "bpe", or the path of a model's tokenizer (a tokenizer.json,
    a folder holding one, or a .gguf file: `attnlab.data.tokenizer_files`).

    For "bpe": trained on `texts` if given, else on `load_corpus(corpus, "train")`;
    loaded from the cache when a vocabulary for the same texts and size exists.
    For a path: its own vocabulary; `vocab_size`, when given, must equal it."""
    if not isinstance(kind, str):
        raise TypeError(f"kind must be a str ('byte', 'bpe' or a tokenizer file), got {type(kind).__name__}")
    if kind not in TOKENIZER_KINDS:
        from .tokenizer_files import load_tokenizer_file

        tok = load_tokenizer_file(kind, name="kind")
        if vocab_size not in (None, tok.vocab_size):
            raise ValueError(f"vocab_size for the tokenizer {kind!r} is its own, {tok.vocab_size}; got {vocab_size!r}")
        return tok
    if kind == "byte":
        if vocab_size not in (None, ByteTokenizer.vocab_size):
            raise ValueError(f"vocab_size for the byte tokenizer is fixed at {BYTE_VOCAB_SIZE}, got {vocab_size!r}")
        return ByteTokenizer()
    if vocab_size is None:
        raise ValueError(f"vocab_size is required for kind='bpe' (an int >= {MIN_BPE_VOCAB_SIZE}, e.g. 4096)")
    check_int("vocab_size", vocab_size, MIN_BPE_VOCAB_SIZE)
    if texts is None:
        from .corpus import load_corpus

        texts = load_corpus(corpus, "train")
    if not texts:
        raise ValueError(f"texts to train BPE on must be non-empty, got none from corpus {corpus!r}")
    path = bpe_cache_path(corpus, texts, vocab_size, cache_dir)
    if path.exists():
        return BPETokenizer.from_file(path)
    tok = train_bpe(texts, vocab_size)
    tok.save(path)
    return tok
