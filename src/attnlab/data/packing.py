"""Packing documents into fixed-length training sequences, and a deterministic, resumable,
rank-sharded batch iterator.

Stream layout: `EOS d0 EOS d1 ... EOS d_{n-1} EOS` (EOS = tokenizer.eos_id). The separator
before a document belongs to it: as an input it opens the document (it is what predicts
the first token), as a target it ends the document before. So no target is predicted from
another document's tokens unless attention lets it look there.

Windows: the stream is cut into non-overlapping windows of T+1 tokens that share their
boundary token, window i = tokens[i*T : i*T + T + 1]; x = window[:-1], y = window[1:], so
every token after the first is a target exactly once per epoch.

Document boundaries: by default (`cross_doc=True`) attention inside a packed sequence
crosses document boundaries, as in GPT-2-style packed training; the separator tells the
model where a document starts. With `cross_doc=False` a batch carries the causal
block-diagonal mask `doc_causal_mask(doc_ids)` (True = may attend) so each token sees only
earlier tokens of its own document; mechanisms without a mask argument can reset their
state where `doc_ids` changes.

Contexts (`pack_contexts`, `pack_corpus`): the layout that evaluation and fine-tuning of a pretrained
model read, `d0 EOS d1 EOS ...` (documents shuffled by a seed, each followed by EOS, tokenized only
until enough tokens exist) cut into N contexts of T tokens; each token also carries its document
number within the context (`segments`) and its position within its document (`position_ids`).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from ..checks import check_int, check_tensor

_ENCODE_CHUNK = 512


@dataclass(frozen=True)
class TokenStream:
    """A packed corpus: `tokens` (N,) int32 and `doc_starts` (D + 1,) int64, the offset of
    each document's leading separator (the last entry is the closing separator)."""

    tokens: torch.Tensor
    doc_starts: torch.Tensor
    vocab_size: int
    eos_id: int

    def __len__(self) -> int:
        return int(self.tokens.numel())

    @property
    def num_docs(self) -> int:
        return int(self.doc_starts.numel()) - 1

    def doc_ids_at(self, positions: torch.Tensor) -> torch.Tensor:
        """The document index of each stream position (the closing separator gets D)."""
        return torch.searchsorted(self.doc_starts, positions, right=True) - 1

    def num_windows(self, seq_len: int) -> int:
        """How many (seq_len + 1)-token windows the stream holds."""
        return max(0, (len(self) - 1) // seq_len)


def pack_documents(docs: Sequence[str], tokenizer, *, progress: bool | None = None) -> TokenStream:
    """Tokenize `docs` and lay them out as `EOS d0 EOS d1 ... EOS`. A progress bar shows
    when `progress` is True, or by default for more than 20,000 documents."""
    if isinstance(docs, str) or not isinstance(docs, Sequence):
        raise TypeError(f"docs must be a sequence of strings, got {type(docs).__name__}")
    if not docs:
        raise ValueError("docs must hold at least one document, got an empty sequence")
    eos = int(tokenizer.eos_id)
    sep = np.array([eos], dtype=np.int32)
    encode_batch = getattr(tokenizer, "encode_batch", None)
    parts: list[np.ndarray] = []
    lengths: list[int] = []
    show = len(docs) > 20_000 if progress is None else bool(progress)
    bar = tqdm(total=len(docs), desc="tokenizing", unit="doc", disable=not show)
    for i in range(0, len(docs), _ENCODE_CHUNK):
        chunk = docs[i : i + _ENCODE_CHUNK]
        encs = encode_batch(chunk) if encode_batch else [np.asarray(tokenizer.encode(d)) for d in chunk]
        for ids in encs:
            parts.append(sep)
            parts.append(ids.astype(np.int32, copy=False))
            lengths.append(1 + len(ids))
        bar.update(len(chunk))
    bar.close()
    parts.append(sep)
    tokens = torch.from_numpy(np.concatenate(parts))
    starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    return TokenStream(tokens, torch.from_numpy(starts), int(tokenizer.vocab_size), eos)


def doc_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Causal block-diagonal (block-causal) mask (B, 1, T, T), True where query i may attend to key j:
    j <= i and both tokens lie in the same document. Broadcasts over heads."""
    check_tensor("doc_ids", doc_ids, 2)
    T = doc_ids.shape[1]
    same = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return (same & causal).unsqueeze(1)  # (B, 1, T, T)


def positions_in_doc(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) position of each token counted from the start of its document inside the
    window (0 at the window start or at a document's separator)."""
    check_tensor("doc_ids", doc_ids, 2)
    B, T = doc_ids.shape
    ar = torch.arange(T, device=doc_ids.device).expand(B, T)
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(start, ar, torch.zeros_like(ar)).cummax(dim=1).values
    return ar - first


@dataclass
class Batch:
    """x, y: (B, T) int64 inputs and next-token targets; doc_ids: (B, T) int64 document of
    each input token; mask: None when attention crosses documents, else (B, 1, T, T) bool."""

    x: torch.Tensor
    y: torch.Tensor
    doc_ids: torch.Tensor
    cross_doc: bool = True
    _mask: torch.Tensor | None = field(default=None, repr=False)

    @property
    def mask(self) -> torch.Tensor | None:
        if self.cross_doc:
            return None
        if self._mask is None:
            self._mask = doc_causal_mask(self.doc_ids)
        return self._mask

    def to(self, device) -> "Batch":
        return Batch(self.x.to(device), self.y.to(device), self.doc_ids.to(device), self.cross_doc)


def _windows(stream: TokenStream, idx: torch.Tensor, seq_len: int, cross_doc: bool) -> Batch:
    pos = idx[:, None] * seq_len + torch.arange(seq_len + 1)  # (B, T+1)
    w = stream.tokens[pos].long()
    return Batch(w[:, :-1], w[:, 1:], stream.doc_ids_at(pos[:, :-1].contiguous()), cross_doc)


def _check_stream(stream, seq_len: int) -> int:
    if not isinstance(stream, TokenStream):
        raise TypeError(f"stream must be a TokenStream (from pack_documents), got {type(stream).__name__}")
    check_int("seq_len", seq_len)
    n = stream.num_windows(seq_len)
    if n < 1:
        raise ValueError(f"stream of {len(stream)} tokens is too short for seq_len={seq_len}: needs at least {seq_len + 1}")
    return n


class StepBatches:
    """An endless iterator whose batches are a pure function of the step, `batch(step)`; `next()`
    returns the batch at `self.step` and advances it, so resuming only needs the step."""

    step: int

    def batch(self, step: int) -> Batch:
        raise TypeError(f"{type(self).__name__} must define batch(step)")

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        b = self.batch(self.step)
        self.step += 1
        return b


class PackedBatches(StepBatches):
    """Endless shuffled batches of packed windows, a pure function of (seed, step).

    Sample j (counting from 0 over the whole run) is window perm_e[j mod n] of epoch
    e = j // n, perm_e a seeded permutation of the n windows. Global batch `step` is samples
    [step*B*W, (step+1)*B*W); rank r takes its r-th slice of B. So W ranks with batch_size B
    see together exactly the batches of one process with batch_size B*W, and
    `state_dict()` / `load_state_dict()` (just the step) resume exactly."""

    def __init__(
        self,
        stream: TokenStream,
        seq_len: int,
        batch_size: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        cross_doc: bool = True,
        shuffle: bool = True,
        step: int = 0,
    ):
        self.num_windows = _check_stream(stream, seq_len)
        check_int("batch_size", batch_size)
        check_int("world_size", world_size)
        check_int("rank", rank, 0)
        if rank >= world_size:
            raise ValueError(f"rank must be < world_size={world_size}, got {rank}")
        check_int("seed", seed, 0)
        check_int("step", step, 0)
        self.stream, self.seq_len, self.batch_size = stream, seq_len, batch_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.cross_doc, self.shuffle, self.step = bool(cross_doc), bool(shuffle), step
        self._perms: dict[int, torch.Tensor] = {}

    @property
    def tokens_per_step(self) -> int:
        """Target tokens in one global batch (all ranks)."""
        return self.batch_size * self.world_size * self.seq_len

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            digest = hashlib.sha256(f"attnlab-packing:{self.seed}:{epoch}".encode()).digest()
            g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = torch.randperm(self.num_windows, generator=g)
        return self._perms[epoch]

    def window_indices(self, step: int) -> torch.Tensor:
        """(B,) the window indices this rank reads at global step `step`."""
        check_int("step", step, 0)
        n = self.num_windows
        j = step * self.batch_size * self.world_size + self.rank * self.batch_size + torch.arange(self.batch_size)
        if not self.shuffle:
            return j % n
        epochs, within = j // n, j % n
        out = torch.empty_like(j)
        for e in epochs.unique().tolist():
            sel = epochs == e
            out[sel] = self._perm(int(e))[within[sel]]
        return out

    def batch(self, step: int) -> Batch:
        """This rank's batch at global step `step` (does not move the iterator)."""
        return _windows(self.stream, self.window_indices(step), self.seq_len, self.cross_doc)

    def epoch(self, step: int | None = None) -> float:
        """Epochs completed after `step` (default: the current step) global batches."""
        s = self.step if step is None else step
        return s * self.batch_size * self.world_size / self.num_windows

    def state_dict(self) -> dict:
        """The step of the next batch, plus what must match to resume exactly."""
        return {
            "step": self.step,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch_size": self.batch_size * self.world_size,
            "num_windows": self.num_windows,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("seed", "seq_len", "global_batch_size", "num_windows", "shuffle"):
            if key in state and state[key] != mine[key]:
                raise ValueError(f"state[{key!r}] is {state[key]!r} but this iterator has {mine[key]!r}; cannot resume exactly")
        self.step = check_int("state['step']", state.get("step"), 0)


def sequential_batches(
    stream: TokenStream,
    seq_len: int,
    batch_size: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    cross_doc: bool = True,
    max_batches: int | None = None,
) -> Iterator[Batch]:
    """Every window once, in stream order (for evaluation). The last batch may be smaller;
    with world_size > 1, rank r takes its slice of each global batch of B*W windows."""
    n = _check_stream(stream, seq_len)
    check_int("batch_size", batch_size)
    check_int("world_size", world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    if max_batches is not None:
        check_int("max_batches", max_batches)
    G = batch_size * world_size
    for step, start in enumerate(range(0, n, G)):
        if max_batches is not None and step >= max_batches:
            return
        lo = start + rank * batch_size
        idx = torch.arange(lo, min(lo + batch_size, n))
        if idx.numel():
            yield _windows(stream, idx, seq_len, cross_doc)


@dataclass
class Packed:
    """Contexts of documents packed back to back (`pack_contexts`): input_ids (N, T); segments (N, T),
    the document number within each context (0 at its first token); position_ids (N, T), each token's
    position counted from its document's first token in the context (`positions_in_doc`)."""

    input_ids: torch.Tensor  # (N, T)
    position_ids: torch.Tensor  # (N, T)
    segments: torch.Tensor  # (N, T)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def batch(self, i: int, n: int = 1) -> "Packed":
        """Contexts i .. i + n - 1 as a Packed of their own (rows of every field)."""
        return Packed(self.input_ids[i:i + n], self.position_ids[i:i + n], self.segments[i:i + n])


def pack_contexts(
    texts: Sequence[str], encode: Callable[[str], list[int]], eos_id: int, context: int, n_contexts: int,
    seed: int | None = 0,
) -> Packed:
    """Tokenize documents (shuffled by `seed`, None keeps order) only until n_contexts * context
    tokens exist, append EOS to each, and cut the stream into contexts. ValueError when the
    documents hold too few tokens."""
    check_int("context", context, 2)
    check_int("n_contexts", n_contexts)
    need = context * n_contexts
    order = list(range(len(texts)))
    if seed is not None:
        random.Random(seed).shuffle(order)
    ids, segs = [], []
    for doc_no, i in enumerate(order):
        toks = list(encode(texts[i])) + [eos_id]
        ids.extend(toks)
        segs.extend([doc_no] * len(toks))
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise ValueError(
            f"corpus too short for the context: {len(texts)} documents give {len(ids)} tokens, "
            f"need context * n_contexts = {context} * {n_contexts} = {need}"
        )
    input_ids = torch.tensor(ids[:need]).view(n_contexts, context)
    seg = torch.tensor(segs[:need]).view(n_contexts, context)
    seg = seg - seg[:, :1]  # (N, T), 0 at each context start
    return Packed(input_ids, positions_in_doc(seg), seg)


def pack_corpus(corpus: str, split: str, encode: Callable[[str], list[int]], eos_id: int, context: int,
                n_contexts: int, seed: int | None = 0) -> Packed:
    """`pack_contexts` over the documents of a corpus split (`attnlab.data.corpus.load_corpus`: 'stdlib',
    a Hugging Face source, a local file or folder). ValueError for an unknown corpus or too few tokens."""
    from .corpus import load_corpus

    return pack_contexts(load_corpus(corpus, split), encode, eos_id, context, n_contexts, seed)
