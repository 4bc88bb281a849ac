"""Corpora, tokenizers, packing and synthetic tasks.

    docs = load_corpus("stdlib", "train")          # embedded default, no download
    tok = get_tokenizer("byte")                    # or get_tokenizer("bpe", vocab_size=4096), or a model's own:
                                                   # get_tokenizer("tokenizer.json" | "model.gguf")
    stream = pack_documents(docs, tok)             # EOS d0 EOS d1 ... EOS
    batches = PackedBatches(stream, seq_len=256, batch_size=16, seed=0)
    batch = next(batches)                          # batch.x, batch.y: (B, T); batch.doc_ids
"""

from .cache import atomic_write_bytes, atomic_write_text, default_cache_dir
from .corpus import (
    count_tokens,
    describe_stdlib,
    load_corpus,
    local_corpus,
    stdlib_corpus,
    stdlib_files,
    stdlib_stats,
)
from .hf import hf_corpus, tinystories, wikitext103, wikitext_articles
from .packing import (
    Batch,
    PackedBatches,
    TokenStream,
    doc_causal_mask,
    pack_documents,
    positions_in_doc,
    sequential_batches,
)
from .splits import SPLITS, split_of
from .synthetic import IGNORE, mqar, passkey
from .tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, get_tokenizer, train_bpe
from .tokenizer_files import PretrainedTokenizer, load_tokenizer_file

__all__ = [
    "SPLITS",
    "IGNORE",
    "Batch",
    "BPETokenizer",
    "ByteTokenizer",
    "PackedBatches",
    "PretrainedTokenizer",
    "TokenStream",
    "Tokenizer",
    "atomic_write_bytes",
    "atomic_write_text",
    "count_tokens",
    "default_cache_dir",
    "describe_stdlib",
    "doc_causal_mask",
    "get_tokenizer",
    "hf_corpus",
    "load_corpus",
    "load_tokenizer_file",
    "local_corpus",
    "mqar",
    "pack_documents",
    "passkey",
    "positions_in_doc",
    "sequential_batches",
    "split_of",
    "stdlib_corpus",
    "stdlib_files",
    "stdlib_stats",
    "tinystories",
    "train_bpe",
    "wikitext103",
    "wikitext_articles",
]
