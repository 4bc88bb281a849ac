"""What the Triton kernels of the op families share about where their rows lie: a program's element
offsets into its head's queries, keys and grouped values (`bases`), loading a tile of rows (`load_rows`),
the end of the keys a causal query tile sees (`seen_end`), and packed documents: each position's
document id (`doc_ids`), a tile's key range narrowed to its documents (`doc_span`) and, on the host,
the per-position spans those read (`document_spans`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def bases(bh, H, GK, GV, Tq, Tk):
    """Element offsets of program (batch x head) bh's rows: its queries (and per-row scalars), its
    scalar keys, and the rows of its key and value groups (GQA: head h reads group h // (H / G))."""
    b = bh // H
    h = bh % H
    row = bh.to(tl.int64) * Tq
    krow = bh.to(tl.int64) * Tk
    kbase = (b * GK + h // (H // GK)).to(tl.int64) * Tk
    vbase = (b * GV + h // (H // GV)).to(tl.int64) * Tk
    return row, krow, kbase, vbase


@triton.jit
def load_rows(X, base, offs, n_ok, offs_d, D: tl.constexpr, LOAD: tl.constexpr, BLOCK_D: tl.constexpr,
              dtype: tl.constexpr):
    """(len(offs), BLOCK_D) rows base + offs of a row-major (.., D) tensor, zeros where absent."""
    if LOAD:
        return tl.load(X + (base + offs[:, None]) * D + offs_d[None, :], mask=n_ok[:, None] & (offs_d[None, :] < D),
                       other=0.0)
    return tl.zeros((offs.shape[0], BLOCK_D), dtype=dtype)


@triton.jit
def seen_end(m0, Tk, off, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """One past the last key the query tile from m0 sees (its rows past Tq see no more)."""
    hi = Tk
    if CAUSAL:
        hi = m0 + BLOCK_M + off
        if hi > Tk:
            hi = Tk
    return hi


@triton.jit
def doc_ids(DOCS, drow, offs, ok, DOC: tl.constexpr):
    """Document (segment) ids of positions offs of batch row drow (-1 past the end), or 0 without documents."""
    ids = 0
    if DOC:
        ids = tl.load(DOCS + drow + offs, mask=ok, other=-1)
    return ids


@triton.jit
def doc_span(START, END, drow, first, last, lo, hi, BLOCK: tl.constexpr, DOC: tl.constexpr):
    """[lo, hi) narrowed to the documents of positions first..last (START / END: each position's
    document's first position and one past its last), lo rounded down to a tile of BLOCK."""
    if DOC:
        lo = tl.maximum(lo, tl.load(START + drow + first) // BLOCK * BLOCK)
        hi = tl.minimum(hi, tl.load(END + drow + last))
    return lo, hi


def document_spans(docs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position of docs (B, T) (any ids; a document is a run of equal ids): its segment index, its
    document's first position and one past its last, each (B, T) int32 and computed on the device
    (no host sync: what the kernels need to mask other documents and skip their tiles)."""
    B, T = docs.shape
    pos = torch.arange(T, device=docs.device).expand(B, T)
    new = torch.ones_like(docs, dtype=torch.bool)
    new[:, 1:] = docs[:, 1:] != docs[:, :-1]
    last = torch.ones_like(new)
    last[:, :-1] = new[:, 1:]
    start = torch.where(new, pos, 0).cummax(1).values
    end = torch.where(last, pos + 1, T).flip(1).cummin(1).values.flip(1)
    return (new.cumsum(1) - 1).int().contiguous(), start.int().contiguous(), end.int().contiguous()
