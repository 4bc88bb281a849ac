"""Per-row sorted scalar keys with the slot of each entry: a log-structured index.

Rows are batch x heads flattened (R = B * H); every row is one head's own sort order.
An entry is packed in int32 channels of one tensor ``(C, R, W)``: channel 0 holds the
float32 bits of the key, channel 1 the slot (where the entry's value lives in its
group's value store) and, once density compression is used, channel 2 the float32 bits
of the entry's log-weight (log of the number of tokens it stands for). One tensor per
run means one gather fetches key, slot and weight of a whole window.

Rows may hold different numbers of entries (eviction is per head). Shorter rows are
padded at the end with +inf keys, slot 0 and weight 0: a pad sorts last, never beats a
finite key in a nearest-key contest and gets zero attention weight.

Insertion (why not a flat sorted array): a new key goes to a small unsorted buffer in
O(1). A full buffer is sorted and merged into level 0; a level that outgrows its
capacity ``buffer_size * level_ratio ** (i + 1)`` is merged into the next one. A merge
is linear in the sizes (searchsorted + scatter); an entry is moved O(level_ratio) times
per level and there are log_ratio(n) levels, so insertion costs amortized O(log n).
A query searches every level (O(log n) each) and scans the buffer.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

INF_BITS = int(torch.tensor(float("inf"), dtype=torch.float32).view(torch.int32).item())


def run_keys(data: torch.Tensor) -> torch.Tensor:
    """The float32 keys (R, W) of a packed run (C, R, W) (a view, no copy)."""
    return data[0].view(torch.float32)


def merge_runs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Merge two packed sorted runs (C, R, Wa), (C, R, Wb) into one (C, R, Wa + Wb).

    Each entry of ``b`` lands after the entries of ``a`` with a key <= its own (searchsorted);
    the entries of ``a`` fill the remaining positions in order (masked_scatter). O(Wa + Wb log Wa)."""
    C, R, Wa = a.shape
    Wb = b.shape[2]
    ar = torch.arange(Wb, device=a.device)
    pos = torch.searchsorted(run_keys(a), run_keys(b).contiguous(), right=True) + ar  # (R, Wb)
    taken = torch.zeros(R, Wa + Wb, dtype=torch.bool, device=a.device)
    taken.scatter_(1, pos, True)
    out = torch.empty(C, R, Wa + Wb, dtype=torch.int32, device=a.device)
    out.scatter_(2, pos.unsqueeze(0).expand(C, R, Wb), b)
    out.masked_scatter_(~taken.unsqueeze(0).expand(C, R, Wa + Wb), a)
    return out


def trim_run(data: torch.Tensor) -> torch.Tensor | None:
    """Drop trailing columns that are padding in every row; None when nothing is left."""
    keys = run_keys(data)
    inf = torch.full((keys.shape[0], 1), float("inf"), device=keys.device)
    width = int(torch.searchsorted(keys, inf).max().item()) if keys.shape[1] else 0
    if width == 0:
        return None
    return data if width == data.shape[2] else data[:, :, :width].contiguous()


class SortedKeyIndex:
    """Sorted scalar keys and their slots for R rows (see the module docstring)."""

    def __init__(self, rows: int, *, buffer_size: int = 256, level_ratio: int = 64,
                 weighted: bool = False, device=None):
        self.rows = rows
        self.channels = 3 if weighted else 2
        self.buffer_size = buffer_size
        self.level_ratio = level_ratio
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.levels: list[torch.Tensor | None] = []
        self.buf = self.empty(buffer_size)
        self.buf_len = 0
        self.arange = torch.arange(2 * buffer_size + 2, device=self.device)

    # ---- storage helpers -------------------------------------------------------------
    @property
    def buf(self) -> torch.Tensor:
        """The insertion buffer, packed (C, R, buffer_size); entries [0, buf_len) are in use."""
        return self._buf

    @buf.setter
    def buf(self, data: torch.Tensor) -> None:
        self._buf = data
        self._buf_keys, self._buf_slots = data[0], data[1]  # views kept for the hot path

    @property
    def weighted(self) -> bool:
        """True once entries carry a log-weight channel (density compression)."""
        return self.channels == 3

    def empty(self, width: int) -> torch.Tensor:
        """A packed run of padding: +inf keys, slot 0, weight 0."""
        data = torch.zeros(self.channels, self.rows, width, dtype=torch.int32, device=self.device)
        data[0] = INF_BITS
        return data

    def capacity(self, level: int) -> int:
        """Entries level `level` holds before it is merged into the next."""
        return self.buffer_size * self.level_ratio ** (level + 1)

    def runs(self) -> list[torch.Tensor]:
        """The sorted runs in use, packed (C, R, width) each, level 0 first."""
        return [d for d in self.levels if d is not None]

    def ensure_weighted(self) -> None:
        """Add the log-weight channel (all zeros: every entry stands for one token)."""
        if self.weighted:
            return
        self.channels = 3
        grow = lambda d: torch.cat([d, torch.zeros_like(d[:1])], 0)
        self.levels = [None if d is None else grow(d) for d in self.levels]
        self.buf = grow(self.buf)

    def _arange(self, n: int) -> torch.Tensor:
        if self.arange.numel() < n:
            self.arange = torch.arange(max(n, 2 * self.arange.numel()), device=self.device)
        return self.arange[:n]

    # ---- insertion ---------------------------------------------------------------------
    def insert(self, key_bits: torch.Tensor, slot: int) -> None:
        """Add one entry per row: key_bits (R,) int32 (float32 bits), all with the same slot."""
        if self.buf_len == self.buffer_size:
            self.flush()
        self._buf_keys.select(1, self.buf_len).copy_(key_bits)
        self._buf_slots.select(1, self.buf_len).fill_(slot)
        self.buf_len += 1

    def flush(self) -> None:
        """Sort the buffer and merge it into level 0 (cascading merges as needed)."""
        if self.buf_len == 0:
            return
        buf = self.buf[:, :, : self.buf_len]
        order = run_keys(buf).sort(dim=1).indices  # (R, L)
        run = buf.gather(2, order.unsqueeze(0).expand_as(buf))
        self.buf = self.empty(self.buffer_size)
        self.buf_len = 0
        run = trim_run(run)
        if run is not None:
            self.push(run)

    def push(self, run: torch.Tensor, level: int = 0) -> None:
        """Merge a packed sorted run into ``level``; a level over capacity moves up."""
        while True:
            if level == len(self.levels):
                self.levels.append(None)
            cur = self.levels[level]
            merged = run if cur is None else merge_runs(cur, run)
            if merged.shape[2] <= self.capacity(level):
                self.levels[level] = merged
                return
            self.levels[level] = None
            run, level = merged, level + 1

    def consolidate(self) -> torch.Tensor | None:
        """Merge the buffer and every level into one run; returns it (None when empty)."""
        self.flush()
        runs = self.runs()
        if not runs:
            return None
        merged = runs[0]
        for r in runs[1:]:
            merged = merge_runs(r, merged)
        self.levels = []
        merged = trim_run(merged)
        if merged is not None:
            self.push(merged)
        return merged

    def merged(self, weighted: bool = False) -> torch.Tensor | None:
        """Every entry in one sorted, trimmed run (C, R, W) (None when empty), leaving the index
        as it is; weighted=True adds a zero log-weight channel when the index has none."""
        runs = self.runs()
        if self.buf_len:
            buf = self.buf[:, :, : self.buf_len]
            order = run_keys(buf).sort(dim=1).indices  # (R, L)
            runs.append(buf.gather(2, order.unsqueeze(0).expand_as(buf)))
        if not runs:
            return None
        merged = runs[0]
        for r in runs[1:]:
            merged = merge_runs(merged, r)
        merged = trim_run(merged)
        if merged is not None and weighted and not self.weighted:
            merged = torch.cat([merged, torch.zeros_like(merged[:1])], 0)
        return merged

    # ---- queries -----------------------------------------------------------------------
    def candidates(self, q: torch.Tensor, k: int) -> torch.Tensor:
        """A packed candidate set (C, R, M), M >= k, holding each row's k nearest entries to
        q (R, 1): the 2k entries around q's insertion point in every level, plus the buffer."""
        parts = []
        for data in self.levels:
            if data is None:
                continue
            C, R, W = data.shape
            if W <= 2 * k:
                parts.append(data)
                continue
            p = torch.searchsorted(run_keys(data), q)  # (R, 1)
            idx = (p - k).clamp_(0, W - 2 * k) + self._arange(2 * k)  # (R, 2k)
            parts.append(data.gather(2, idx.unsqueeze(0).expand(C, R, 2 * k)))
        if self.buf_len:
            parts.append(self.buf[:, :, : self.buf_len])
        if not parts:
            return self.empty(0)
        return torch.cat(parts, 2) if len(parts) > 1 else parts[0]

    def count_within(self, q: torch.Tensor, r) -> torch.Tensor:
        """Number of entries per row with |key - q| <= r; q, r broadcast to (R, 1). -> (R,)"""
        lo, hi = (q - r).contiguous(), (q + r).contiguous()
        total = torch.zeros(self.rows, 1, dtype=torch.int64, device=self.device)
        for data in self.runs():
            keys = run_keys(data)
            total += torch.searchsorted(keys, hi, right=True) - torch.searchsorted(keys, lo)
        if self.buf_len:
            d = (run_keys(self.buf[:, :, : self.buf_len]) - q).abs()
            total += (d <= r).sum(1, keepdim=True)
        return total.squeeze(1)

    def all_entries(self) -> torch.Tensor:
        """Every entry of every row, packed (C, R, N) (levels first, then the buffer)."""
        parts = self.runs()
        if self.buf_len:
            parts.append(self.buf[:, :, : self.buf_len])
        if not parts:
            return self.empty(0)
        return torch.cat(parts, 2)

    def n_entries(self) -> torch.Tensor:
        """Finite (live) entries per row, (R,)."""
        return torch.isfinite(run_keys(self.all_entries())).sum(1)

    # ---- bulk edits (eviction, compression, slot reclamation) ---------------------------
    def compact(self, data: torch.Tensor, keep: torch.Tensor) -> torch.Tensor | None:
        """Keep the entries where ``keep`` (R, W) is True, in order; pad shorter rows."""
        C, R, W = data.shape
        width = int(keep.sum(1).max().item()) if W else 0
        if width == 0:
            return None
        dest = torch.where(keep, keep.cumsum(1) - 1, width)  # (R, W); dropped -> spare column
        out = self.empty(width + 1)
        out.scatter_(2, dest.unsqueeze(0).expand(C, R, W), data)
        return out[:, :, :width].contiguous()

    def filter(self, keep_fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Drop every entry whose key fails ``keep_fn(keys) -> bool mask`` (pads are dropped too)."""
        for i, data in enumerate(self.levels):
            if data is not None:
                keys = run_keys(data)
                self.levels[i] = self.compact(data, keep_fn(keys) & torch.isfinite(keys))
        if self.buf_len:
            buf = self.buf[:, :, : self.buf_len]
            drop = ~keep_fn(run_keys(buf))
            buf[0].masked_fill_(drop, INF_BITS)  # holes: +inf keys, merged away at the next flush
            buf[1].masked_fill_(drop, 0)

    def map_slots(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace every slot channel s (R, W) by fn(s) (int32, same shape)."""
        for data in self.runs():
            data[1] = fn(data[1])
        if self.buf_len:
            self.buf[1, :, : self.buf_len] = fn(self.buf[1, :, : self.buf_len].contiguous())

    def replace(self, data: torch.Tensor | None) -> None:
        """Replace all contents by one packed sorted run (or nothing)."""
        self.levels = []
        self.buf = self.empty(self.buffer_size)
        self.buf_len = 0
        if data is not None:
            self.push(data)

    def nbytes(self) -> int:
        """Bytes held by the index (levels + buffer)."""
        return sum(d.numel() * 4 for d in self.runs()) + self.buf.numel() * 4


def radius_from_tolerance(tau, eps: float, kernel: str = "gaussian"):
    """The seed's window radius r = sqrt(-tau * log(eps)): beyond it exp(-d^2 / tau) < eps (the
    Cauchy kernel's: r = sqrt(tau * (1/eps - 1)), beyond which 1 / (1 + d^2 / tau) < eps)."""
    c = -math.log(eps) if kernel == "gaussian" else 1.0 / eps - 1.0
    if isinstance(tau, torch.Tensor):
        return (tau * c).sqrt()
    return math.sqrt(tau * c)
