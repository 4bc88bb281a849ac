"""Packed sequences: documents laid end to end in a row, each attending only within itself.

Every op family's public function takes the documents in one of two forms:

- ``cu_seqlens``: flash-linear-attention's (and FlashAttention's varlen) convention, an int32 or
  int64 tensor of N + 1 offsets ``[0, l_0, l_0 + l_1, ..., T]`` into a batch of one packed row
  (B = 1): document i is positions ``cu_seqlens[i] .. cu_seqlens[i + 1] - 1``. Lengths of 0 are
  allowed (an empty document). A Python list of ints is taken too (checked on the host, then
  copied to the inputs' device).
- ``docs``: attnlab's (B, T) integer document ids, a document being a run of equal ids in its row
  (what `attnlab.models.LM` gets as doc_ids): any batch size, no offsets to build.

The result equals running each document alone (outputs and gradients); recurrences start every
document from a zero state. Ops turn either form into a `Packing` of per-position tensors computed on
the device (`packing`): no host sync and no shape that depends on the values, so the fast paths
stay one compiled graph and keep an accelerator busy. The values of a cu_seqlens tensor are checked
as every input value is (`attnlab.checks.value_check_mode`): read and a ValueError eagerly (free on
the CPU; one sync on an accelerator, at entry), a device-side assert inside
`attnlab.checks.async_value_checks` or under torch.compile. docs needs no value check (any ids mean
something). Nothing else reads the offsets on the host, the naive references included (they mask
and reset as the fast paths do, materialising what they must); the one exception is fla's varlen
kernels (`attnlab.ops.gla`), which plan their chunks from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...checks import assert_values, value_check_mode

INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass
class Packing:
    """Where the documents of a packed batch lie, per position (B, T), all int64 or bool, on the device.

    Attributes:
        seg: the run index of each position's document inside its row (0, 1, ...; equal ids further
            apart are different documents).
        starts: True at each document's first position.
        ends: True at each document's last position.
        pos: the position inside its document (0 at its first token).
        length: the length of its document.
        cu: the cu_seqlens given (N + 1,) as int64, or None for docs: the ops then return one final
            state per document of cu instead of one per row.
    """

    seg: torch.Tensor
    starts: torch.Tensor
    ends: torch.Tensor
    pos: torch.Tensor
    length: torch.Tensor
    cu: torch.Tensor | None = None

    def same(self, Tq: int | None = None) -> torch.Tensor:
        """(B, 1, Tq, T) bool: query t (the last Tq positions) and key s lie in one document."""
        T = self.seg.shape[1]
        Tq = T if Tq is None else Tq
        return self.seg[:, None, T - Tq:, None] == self.seg[:, None, None, :]


def check_cu_seqlens(cu_seqlens, T: int, like: torch.Tensor) -> torch.Tensor:
    """cu_seqlens (module docstring) for a packed row of T positions: returns it as an int64 tensor on
    like's device. ValueError naming cu_seqlens (and what is wrong) for a float or bool dtype, another
    rank, fewer than 2 entries, another device, or values that do not start at 0, decrease or do not
    end at T."""
    if isinstance(cu_seqlens, (list, tuple)):
        if any(isinstance(x, bool) or not isinstance(x, int) for x in cu_seqlens):
            raise ValueError(f"cu_seqlens must hold ints (document offsets), got {list(cu_seqlens)!r}")
        _check_offsets(list(cu_seqlens), T)
        return torch.tensor(list(cu_seqlens), dtype=torch.int64, device=like.device)
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens must be an int32 or int64 tensor of document offsets (or a list of ints), "
                         f"got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in INDEX_DTYPES:
        raise ValueError(f"cu_seqlens must be an int32 or int64 tensor (document offsets), got dtype "
                         f"{cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with N + 1 >= 2 offsets (N documents), got shape "
                         f"{tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != like.device:
        raise ValueError(f"cu_seqlens must be on the device of the inputs ({like.device}), got {cu_seqlens.device}")
    cu = cu_seqlens.long()
    mode = value_check_mode(cu)
    if mode == "eager":
        _check_offsets(cu.tolist(), T)
    elif mode == "assert":
        ok = (cu[0] == 0) & (cu[-1] == T) & (cu[1:] >= cu[:-1]).all()
        assert_values(ok, f"cu_seqlens must start at 0, be non-decreasing and end at T = {T} "
                          f"(checked in a compiled graph or on the device)")
    return cu


def _check_offsets(cu: list, T: int) -> None:
    if len(cu) < 2:
        raise ValueError(f"cu_seqlens must hold N + 1 >= 2 offsets (N documents), got {cu!r}")
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {cu[0]}")
    for i in range(1, len(cu)):
        if cu[i] < cu[i - 1]:
            raise ValueError(f"cu_seqlens must be non-decreasing (document lengths >= 0), got {cu[i - 1]} then "
                             f"{cu[i]} at index {i}")
    if cu[-1] != T:
        raise ValueError(f"cu_seqlens must end at T = {T} (the packed row's length), got {cu[-1]}")


def check_docs(docs, B: int, T: int, like: torch.Tensor) -> None:
    """docs: (B, T) integer document ids on like's device (TypeError for a float or bool tensor or
    another type, ValueError for another shape or device)."""
    if not isinstance(docs, torch.Tensor) or docs.dtype.is_floating_point or docs.dtype.is_complex \
            or docs.dtype == torch.bool:
        got = docs.dtype if isinstance(docs, torch.Tensor) else type(docs).__name__
        raise TypeError(f"docs must be an integer tensor of document ids (B, T), got {got}")
    if tuple(docs.shape) != (B, T):
        raise ValueError(f"docs must have shape (B, T) = {(B, T)}, got {tuple(docs.shape)}")
    if docs.device != like.device:
        raise ValueError(f"docs must be on the device of the inputs ({like.device}), got {docs.device}")


def packing(cu_seqlens, docs, B: int, T: int, like: torch.Tensor) -> Packing | None:
    """Check either form (never both) for a batch of B rows of T positions and return its `Packing`,
    or None when neither is given. cu_seqlens needs B = 1."""
    if cu_seqlens is None and docs is None:
        return None
    if cu_seqlens is not None and docs is not None:
        raise ValueError("give packed documents as cu_seqlens or as docs, not both")
    if docs is not None:
        check_docs(docs, B, T, like)
        return _from_ids(docs)
    cu = check_cu_seqlens(cu_seqlens, T, like)
    if B != 1:
        raise ValueError(f"cu_seqlens packs documents into one row (flash-linear-attention's convention): the "
                         f"batch size must be 1, got {B} (flatten the batch into one row, or give docs (B, T))")
    ids = torch.searchsorted(cu[1:], torch.arange(T, device=cu.device), right=True)  # (T,) document of each position
    got = _from_ids(ids[None])
    got.cu = cu
    return got


def _from_ids(ids: torch.Tensor) -> Packing:
    B, T = ids.shape
    ar = torch.arange(T, device=ids.device).expand(B, T)
    starts = torch.ones(B, T, dtype=torch.bool, device=ids.device)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    ends = torch.ones_like(starts)
    ends[:, :-1] = starts[:, 1:]
    first = torch.where(starts, ar, 0).cummax(1).values
    stop = torch.where(ends, ar + 1, T).flip(1).cummin(1).values.flip(1)  # one past each document's last
    return Packing(seg=starts.long().cumsum(1) - 1, starts=starts, ends=ends, pos=ar - first, length=stop - first)


def _like(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A per-position (B, T) tensor viewed as x's shape (B, ..., T)."""
    return y.view(y.shape[0], *([1] * (x.dim() - 2)), y.shape[1]).expand_as(x)


MARGIN = 64.0  # float64 keeps 36.7 nats: an earlier document's terms end up below its last bit


def segment_logcumsumexp(x: torch.Tensor, p: Packing) -> torch.Tensor:
    """log sum_{s <= t, s in t's document} exp(x_s) along the last dim of x (..., T), finite x, in
    float64 (any float dtype in, float64 out), no host sync.

    One logcumsumexp over the row of x + D, minus D: D is a non-decreasing shift (detached) that
    jumps at each document's start by more than any earlier term exceeds the document's smallest,
    plus MARGIN, so every earlier document's terms fall more than MARGIN nats below, under float64's
    resolution. The result's absolute error is about |D| 1e-16 (D <= documents x (range of x + MARGIN))."""
    x = x.double()
    xd = x.detach()
    seg, starts = (_like(y, xd) for y in (p.seg, p.starts))
    doc_min = torch.full_like(xd, float("inf")).scatter_reduce(-1, seg, xd, "amin").gather(-1, seg)
    before = torch.cat([torch.full_like(xd[..., :1], float("-inf")), xd.cummax(-1).values[..., :-1]], dim=-1)
    jump = torch.where(starts & torch.isfinite(before), (before - doc_min + MARGIN).clamp_min(0.0), 0.0)
    shift = jump.cumsum(-1)
    return torch.logcumsumexp(x + shift, dim=-1) - shift


def segment_sum(x: torch.Tensor, p: Packing) -> torch.Tensor:
    """sum over t's whole document of x (..., T), for every position t (non-causal reductions)."""
    seg = _like(p.seg, x)
    return torch.zeros_like(x).scatter_add(-1, seg, x).gather(-1, seg)


def segment_logsumexp(x: torch.Tensor, p: Packing) -> torch.Tensor:
    """log sum over t's whole document of exp(x) (..., T), for every position t, finite x."""
    seg = _like(p.seg, x)
    peak = torch.full_like(x, float("-inf")).scatter_reduce(-1, seg, x.detach(), "amax").gather(-1, seg)
    return segment_sum((x - peak).exp(), p).log() + peak


def document_states(states: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """Every document's state after its last step, (N, ...), from the state after each step of a
    packed row, states (1, H, T, ...) (a naive reference's, which keeps them all); zero for an empty
    document."""
    first, stop = cu[:-1], cu[1:]
    picked = states[0][:, (stop - 1).clamp_min(0)].transpose(0, 1)  # (N, H, ...)
    keep = (stop > first).view(-1, *([1] * (picked.dim() - 1)))
    return picked * keep
