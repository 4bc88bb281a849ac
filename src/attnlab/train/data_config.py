"""The `[data]` section of a run's configuration (`DataConfig`): what the model reads, the corpus,
its tokenizer and how sequences are packed, checked where it enters like every section
(`attnlab.train.config`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from attnlab.data.corpus import NAMED_SOURCES as CORPORA
from attnlab.data.tokenizer import BYTE_VOCAB_SIZE, MIN_BPE_VOCAB_SIZE, TOKENIZER_KINDS
from attnlab.data.tokenizer_files import load_tokenizer_file
from attnlab.models.config import ConfigError, check_fields, opt

DATA_SOURCES = CORPORA + ("mqar",)  # what data.source may name besides hf:<path> and files


def mqar_min_len(pairs: int, queries: int, min_gap: int = 0) -> int:
    """The shortest MQAR sequence that holds `pairs` pairs and `queries` queries, each query at
    least `min_gap` tokens after every pair token (`attnlab.data.synthetic.mqar`'s layout)."""
    return 2 * pairs + max(0, min_gap - 1) + 2 * queries


@dataclass
class DataConfig:
    """What the model reads: the corpus, its tokenizer and how sequences are packed."""

    source: str = opt(
        "stdlib",
        "'stdlib' (embedded, no download), 'tinystories', 'wikitext103', 'hf:<path>[:<config>]', "
        "a local text file or folder, or 'mqar' (synthetic associative recall)",
    )
    tokenizer: str = opt("byte", "'byte' (UTF-8 bytes), 'bpe' (a BPE vocabulary trained locally and cached), or a "
                                 "model's own tokenizer: the path of a tokenizer.json, a folder holding one, or a "
                                 ".gguf file (its embedded tokenizer); the model's vocabulary follows it")
    bpe_vocab_size: int = opt(4096, "BPE vocabulary size (tokenizer='bpe')")
    cache_dir: str = opt("", "folder for cached tokenizers and datasets; '' uses $ATTNLAB_CACHE or ~/.cache/attnlab")
    seq_len: int = opt(128, "training sequence length T (tokens per sequence)")
    cross_doc: bool = opt(
        True, "attention crosses document boundaries inside a packed sequence; false restarts it at each document "
              "(the same as data.pack='documents')"
    )
    pack: Literal["stream", "documents"] = opt(
        "stream", "'stream': documents packed back to back, attention crossing them; 'documents': each token attends "
                  "within its own document, positions restarting there (in one pass where every layer's op masks "
                  "documents, as every mechanism's exact op does; else, e.g. beside a sink, each document re-padded)")
    max_docs: int = opt(0, "use at most this many documents per split (0 = all)")
    mqar_pairs: int = opt(8, "MQAR key-value pairs per sequence (source='mqar'; vocabulary = model.vocab_size)")
    mqar_power_a: float = opt(0.01, "MQAR power-law parameter of the key-to-query gaps (Zoology's power_a)")
    mqar_queries: int = opt(0, "MQAR pairs queried per sequence (0 = all of them, as in Zoology)")
    mqar_train_size: int = opt(0, "MQAR training sequences: a fixed set of this many, drawn from run.seed and cycled "
                                  "in a shuffled order per epoch (0 = fresh sequences every step)")
    mqar_min_gap: int = opt(0, "MQAR: every query lies at least this many tokens after every key-value pair token, "
                               "so a local window of fewer keys sees no pair (0 = Zoology's layout)")
    mqar_filler: Literal["random", "zero"] = opt(
        "random", "MQAR: the positions that are neither pairs nor queries hold uniform random tokens (Zoology) or token 0")

    def __post_init__(self):
        check_fields(self, "data.")
        if self.pack == "documents" or not self.cross_doc:  # one setting, two spellings
            self.pack, self.cross_doc = "documents", False
        if self.seq_len < 1:
            raise ConfigError(f"data.seq_len must be >= 1, got {self.seq_len}")
        src = self.source
        if not src:
            raise ConfigError(f"data.source must be one of {DATA_SOURCES}, 'hf:<path>' or a file/folder, got ''")
        if src not in DATA_SOURCES and not src.startswith("hf:") and not Path(src).expanduser().exists():
            raise ConfigError(
                f"data.source must be one of {DATA_SOURCES}, 'hf:<path>[:<config>]' or an existing file/folder, got {src!r}"
            )
        if self.tokenizer == "bpe" and self.bpe_vocab_size < MIN_BPE_VOCAB_SIZE:
            raise ConfigError(f"data.bpe_vocab_size must be >= {MIN_BPE_VOCAB_SIZE} (256 bytes, EOS, merges), "
                              f"got {self.bpe_vocab_size}")
        if self.tokenizer not in TOKENIZER_KINDS:  # a tokenizer file: read (cached) so a bad one stops here
            try:
                load_tokenizer_file(self.tokenizer, "data.tokenizer")
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.max_docs < 0:
            raise ConfigError(f"data.max_docs must be >= 0, got {self.max_docs}")
        if self.mqar_pairs < 1 or not 0 < self.mqar_power_a <= 1:
            raise ConfigError("data.mqar_pairs must be >= 1 and data.mqar_power_a in (0, 1]")
        if not 0 <= self.mqar_queries <= self.mqar_pairs:
            raise ConfigError(f"data.mqar_queries must be in [0, data.mqar_pairs={self.mqar_pairs}], got {self.mqar_queries}")
        if self.mqar_train_size < 0:
            raise ConfigError(f"data.mqar_train_size must be >= 0 (0 = fresh sequences), got {self.mqar_train_size}")
        if self.mqar_min_gap < 0:
            raise ConfigError(f"data.mqar_min_gap must be >= 0, got {self.mqar_min_gap}")
        need = mqar_min_len(self.mqar_pairs, self.mqar_queries or self.mqar_pairs, self.mqar_min_gap)
        if src == "mqar" and self.seq_len < need:
            raise ConfigError(
                f"data.seq_len ({self.seq_len}) must be >= 2 * data.mqar_pairs + max(0, data.mqar_min_gap - 1) "
                f"+ 2 * queried pairs ({need}) to hold the pairs and their queries"
            )

    @property
    def tokenizer_vocab_size(self) -> int:
        """The vocabulary of the configured tokenizer: bpe_vocab_size for BPE, BYTE_VOCAB_SIZE for bytes,
        a tokenizer file's own size."""
        if self.tokenizer not in TOKENIZER_KINDS:
            return load_tokenizer_file(self.tokenizer, "data.tokenizer").vocab_size
        return self.bpe_vocab_size if self.tokenizer == "bpe" else BYTE_VOCAB_SIZE
