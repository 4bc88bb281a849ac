"""What the trainer reads: the tokenizer, a resumable training iterator and validation batches.

Text sources go through `attnlab.data`: documents -> tokenizer -> packed stream ->
`PackedBatches` (a pure function of seed and step, sharded by rank). `data.source="mqar"`
trains on freshly generated multi-query associative recall batches instead, each global
batch a pure function of (seed, step) as well, so both resume exactly and shard the same
way: rank r of W takes rows [r*B/W, (r+1)*B/W) of the global batch of B sequences.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from attnlab.data.corpus import load_corpus
from attnlab.data.packing import Batch, PackedBatches, StepBatches, pack_documents, sequential_batches
from attnlab.data.synthetic import mqar
from attnlab.data.tokenizer import get_tokenizer
from attnlab.data.tokenizer_files import (
    TOKENIZER_CONFIG,
    TOKENIZER_JSON,
    PretrainedTokenizer,
    load_tokenizer_file,
    tokenizer_file,
)

from .config import RunConfig
from .data_config import DataConfig
from .ddp import DistEnv


def data_tokenizer(d: DataConfig, train_docs: list[str] | None = None):
    """The tokenizer `d` configures: bytes, or a BPE vocabulary of d.bpe_vocab_size trained on the
    training split (`train_docs` when already read), or loaded from the cache."""
    cache_dir, texts = d.cache_dir or None, None
    if d.tokenizer == "bpe":
        texts = train_docs if train_docs is not None else load_corpus(
            d.source, "train", cache_dir=cache_dir, max_docs=d.max_docs or None)
    return get_tokenizer(d.tokenizer, vocab_size=d.tokenizer_vocab_size, corpus=d.source, cache_dir=cache_dir,
                         texts=texts)


RUN_TOKENIZER = "tokenizer"  # the run folder's copy of a tokenizer file (tokenizer.json, tokenizer_config.json)


def record_tokenizer(cfg: RunConfig, tok) -> RunConfig:
    """A run on a tokenizer file keeps that tokenizer: written into <run_dir>/tokenizer/ (tokenizer.json
    and tokenizer_config.json, naming the file it came from) and named by the returned config's
    data.tokenizer, which the run folder's config.toml then holds; so `attnlab sample`, `attnlab export`,
    evaluation and a resumed run read back this tokenizer, whatever becomes of the original file.
    Byte and BPE tokenizers are rebuilt from the config (BPE from its cache) and need no copy."""
    if not isinstance(tok, PretrainedTokenizer):
        return cfg
    path = Path(cfg.run_dir) / RUN_TOKENIZER / TOKENIZER_JSON
    if not (path.is_file() and Path(tok.source).resolve() == path.resolve()):
        tok.save_pretrained(path.parent)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=str(path)))


def is_recorded_copy(run_dir, saved, configured) -> bool:
    """Whether a run's saved data.tokenizer `saved` is its folder's copy (`record_tokenizer`) of the
    tokenizer file that `configured` names: the same setting, as far as comparing configs goes."""
    copy = Path(run_dir) / RUN_TOKENIZER / TOKENIZER_JSON
    if not isinstance(saved, str) or not isinstance(configured, str) or Path(saved).resolve() != copy.resolve():
        return False
    try:
        source = json.loads((copy.parent / TOKENIZER_CONFIG).read_text(encoding="utf-8")).get("source")
        return source == str(tokenizer_file(configured).resolve())
    except (OSError, ValueError, AttributeError):
        return False


def resumed_tokenizer(cfg: RunConfig, tok):
    """`tok`, checked on resume against the tokenizer the run recorded (`record_tokenizer`): the same
    vocabulary and EOS, or ValueError naming data.tokenizer and the recorded copy."""
    saved = Path(cfg.run_dir) / RUN_TOKENIZER / TOKENIZER_JSON
    if not (cfg.run.resume and isinstance(tok, PretrainedTokenizer) and saved.is_file()):
        return tok  # byte and BPE runs: the model's vocabulary size is checked against the checkpoint's
    recorded = load_tokenizer_file(saved, "data.tokenizer")
    if (tok.to_str(), tok.eos_token) != (recorded.to_str(), recorded.eos_token):
        raise ValueError(f"data.tokenizer {cfg.data.tokenizer!r} is not the tokenizer the run trained with, "
                         f"recorded in {str(saved)!r}; resume with data.tokenizer={str(saved)!r}")
    return recorded


def _seed_for(*parts) -> int:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class MQARBatches(StepBatches):
    """Endless MQAR batches; global batch `step` is a pure function of (seed, step). Fresh
    sequences every step, or with data.mqar_train_size = N (training split only) rows of one
    fixed set of N sequences drawn from the seed, visited in a new shuffled order each epoch."""

    def __init__(self, cfg: RunConfig, vocab_size: int, env: DistEnv, *, split: str = "train"):
        self.cfg, self.vocab_size, self.env, self.split = cfg, vocab_size, env, split
        self.global_batch = cfg.train.batch_size
        self.per_rank = self.global_batch // env.world_size
        self.step = 0
        d = cfg.data
        self.fixed = None
        if split == "train" and d.mqar_train_size:
            self.fixed = self._sample(d.mqar_train_size, _seed_for("mqar-set", cfg.run.seed))  # (N, T) twice
        self._orders: dict[int, torch.Tensor] = {}

    def _sample(self, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.cfg.data
        return mqar(self.vocab_size, d.seq_len, d.mqar_pairs, n, seed=seed, power_a=d.mqar_power_a,
                    num_queries=d.mqar_queries or None, min_gap=d.mqar_min_gap,
                    random_non_queries=d.mqar_filler == "random")

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            g = torch.Generator().manual_seed(_seed_for("mqar-order", self.cfg.run.seed, epoch))
            self._orders = {epoch: torch.randperm(self.fixed[0].shape[0], generator=g)}  # keep one epoch
        return self._orders[epoch]

    def batch(self, step: int) -> Batch:
        if self.fixed is None:
            x, y = self._sample(self.global_batch, _seed_for("mqar", self.split, self.cfg.run.seed, step))
        else:  # rows step*B .. step*B + B - 1 of the epoch-shuffled fixed set
            N = self.fixed[0].shape[0]
            rows = torch.arange(step * self.global_batch, (step + 1) * self.global_batch)
            idx = torch.stack([self._order(int(r) // N)[int(r) % N] for r in rows])
            x, y = self.fixed[0][idx], self.fixed[1][idx]
        # (B, T) each, labels -100 except at query positions
        lo = self.env.rank * self.per_rank
        x, y = x[lo : lo + self.per_rank], y[lo : lo + self.per_rank]
        return Batch(x, y, torch.zeros_like(x), cross_doc=True)

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.cfg.run.seed, "global_batch_size": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        if state.get("global_batch_size", self.global_batch) != self.global_batch:
            raise ValueError(
                f"the checkpoint's global batch is {state['global_batch_size']} sequences but train.batch_size is "
                f"{self.global_batch}; cannot resume exactly"
            )
        self.step = int(state["step"])


@dataclass
class RunData:
    """tokenizer (None for MQAR), vocab_size, the training iterator, and `val(max_batches)`
    which yields this rank's validation batches (the same ones at every evaluation)."""

    tokenizer: object
    vocab_size: int
    train: PackedBatches | MQARBatches
    val: Callable[[int | None], Iterator[Batch]]
    description: str


def build_data(cfg: RunConfig, env: DistEnv) -> RunData:
    """Load, tokenize and pack the configured source (or set up MQAR) for this rank."""
    d = cfg.data
    if cfg.train.batch_size % env.world_size:
        raise ValueError(
            f"train.batch_size ({cfg.train.batch_size}) must be divisible by the number of data-parallel "
            f"ranks ({env.world_size}): each rank reads an equal share of every global batch"
        )
    per_rank = cfg.train.batch_size // env.world_size
    if d.source == "mqar":
        vocab = cfg.model.vocab_size
        train = MQARBatches(cfg, vocab, env)
        val_src = MQARBatches(cfg, vocab, env, split="val")

        def val(max_batches):
            return (val_src.batch(i) for i in range(max_batches or cfg.train.eval_batches))

        desc = (f"MQAR: vocab {vocab}, {d.mqar_pairs} key-value pairs ({d.mqar_queries or d.mqar_pairs} queried), "
                f"seq_len {d.seq_len}, power_a {d.mqar_power_a}, "
                + (f"every query >= {d.mqar_min_gap} tokens after every pair, " if d.mqar_min_gap > 1 else "")
                + ("token 0 between them, " if d.mqar_filler == "zero" else "")
                + (f"a fixed set of {d.mqar_train_size} training sequences" if d.mqar_train_size else "fresh sequences each step"))
        return RunData(None, vocab, train, val, desc)

    cache_dir = d.cache_dir or None
    max_docs = d.max_docs or None
    train_docs = load_corpus(d.source, "train", cache_dir=cache_dir, max_docs=max_docs)
    tok = resumed_tokenizer(cfg, data_tokenizer(d, train_docs))
    train_stream = pack_documents(train_docs, tok)
    val_stream = pack_documents(load_corpus(d.source, "val", cache_dir=cache_dir, max_docs=max_docs), tok)
    train = PackedBatches(
        train_stream, d.seq_len, per_rank, seed=cfg.run.seed, rank=env.rank, world_size=env.world_size,
        cross_doc=d.cross_doc,
    )

    def val(max_batches):
        return sequential_batches(
            val_stream, d.seq_len, per_rank, rank=env.rank, world_size=env.world_size,
            cross_doc=d.cross_doc, max_batches=max_batches,
        )

    desc = (
        f"{d.source}: {train_stream.num_docs} train documents, {len(train_stream):,} train tokens, "
        f"{len(val_stream):,} val tokens ({d.tokenizer}, vocab {tok.vocab_size})"
    )
    return RunData(tok, int(tok.vocab_size), train, val, desc)
