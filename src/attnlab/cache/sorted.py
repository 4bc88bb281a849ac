"""Sorted scalar KV cache: O(log n + k) decode for scalar and hybrid attention.

A decode step binary-searches its scalar query among the sorted cached keys and attends over the
k nearest only: softmax_j(-(qs - ks_j)^2 / tau + log c_j) for scalar heads, with q . k_j / sqrt(d_k)
added for hybrid heads; c_j is the number of tokens entry j stands for (1 unless density compression
merged it). Layout, search and window: docs/mechanisms.md#sorted-scalar-cache. Each head keeps its own
sorted index of (key, slot) entries; values are stored once per value group, hybrid heads' vector
keys once per head and slot; all state is batched over batch x heads, with no Python loop over heads
on the hot path. Inference only: appended tensors are detached; gradients flow to the query
arguments (qs, q, tau) of ``attend``, which is what the naive/fast comparison checks. Input checks:
the class docstring (a rejected call leaves the cache as it was).
"""

from __future__ import annotations

import math

import torch

from .. import checks
from ..checks import check_groups, check_impl, check_int, check_positive
from ..ops.scalar import check_kernel
from . import eviction, sorted_read
from .sink import SinkRows, parse_zone, sink_rows
from .sorted_index import SortedKeyIndex
from .sorted_naive import attend_naive
from .sorted_read import DecodeQuery, check_finite_cache as _check_finite, check_float32_range

__all__ = ["DecodeQuery", "QUERY_HISTORY", "SortedScalarCache", "bytes_per_token"]


QUERY_HISTORY = 256  # recent queries kept per head (geometric and budget eviction read them)


def bytes_per_token(n_heads: int, n_groups: int, d_v: int, d_k: int | None = None,
                    dtype: torch.dtype = torch.float32, weighted: bool = False) -> dict[str, int]:
    """Bytes one cached token costs in one layer, by part, as a dict of ints, for n_heads heads, n_groups
    value groups of size d_v, vector keys of size d_k (hybrid; None for scalar heads), values in `dtype`,
    and `weighted` entries (density compression on). No argument is checked.

    key_index: per head a float32 key + an int32 slot (+ a float32 log-weight when weighted): 8 (12)
    bytes per head (key_index_per_head). values: one d_v vector per value group. vector_keys: hybrid
    heads only, one d_k vector per head. total: their sum. full_attention_kv: an ordinary per-head K
    and V cache of the same head sizes, for comparison."""
    item = torch.empty((), dtype=dtype).element_size()
    per_head = 12 if weighted else 8
    parts = {
        "key_index_per_head": per_head,
        "key_index": n_heads * per_head,
        "values": n_groups * d_v * item,
        "vector_keys": n_heads * d_k * item if d_k else 0,
    }
    parts["total"] = parts["key_index"] + parts["values"] + parts["vector_keys"]
    parts["full_attention_kv"] = n_heads * ((d_k or d_v) + d_v) * item
    return parts


class SortedScalarCache:
    """Decode-time cache for one layer of scalar (or hybrid, when ``d_k`` is given) heads.

    Args:
        batch: B (every size is an int >= 1).
        n_heads: H.
        n_groups: G value groups, dividing H (head h reads group h // (H / G)).
        d_v: the value size Dv.
        d_k: the vector key size Dk of hybrid heads; None for pure scalar heads.
        capacity: value slots (tokens + merged entries); None grows by doubling. When full, dead
            slots are reclaimed, then RuntimeError.
        dtype: the floating dtype of the stored values and vector keys (scalar keys are float32).
        device: where the cache lives; None for the CPU.
        sink_key: the scalar sink's key (float, 0-d or (H,)), always a candidate; None: no sink.
        sink_value: the sink's value, (d_v,), (G, d_v) or (H, d_v).
        sink_vkey: the sink's vector key, (d_k,) or (H, d_k) (hybrid); None for zeros.
        sink_zone: (lo, hi); keys in this range are never evicted or compressed.
        sink_logw: the log of the sink's weight w in the normaliser, w·e^score (float, 0-d or
            (H,), finite or -inf); None for 0, weight 1.
        query_history: recent queries kept per head (eviction reads them).
        buffer_size: the sorted index's insertion buffer.
        level_ratio: the sorted index's level growth factor, an int >= 2.
        kernel: the scalar term's kernel, "gaussian" or "cauchy" (`attnlab.ops.scalar`).

    Raises:
        TypeError: dtype not floating; a size not an int (NotAnIntError, also a ValueError). Later calls:
            an appended tensor not of the cache's dtype, a query tensor not floating.
        ValueError: a size out of range, G not dividing H, a bad sink. Later calls: a bad shape, NaN or
            inf in any argument (checked before anything changes), attend on an empty cache without sink.
    """

    def __init__(self, batch: int, n_heads: int, n_groups: int, d_v: int, d_k: int | None = None,
                 capacity: int | None = None, dtype: torch.dtype = torch.float32, device=None,
                 sink_key=None, sink_value=None, sink_vkey=None, sink_zone=None, sink_logw=None,
                 query_history: int = QUERY_HISTORY, buffer_size: int = 256, level_ratio: int = 64,
                 kernel: str = "gaussian"):
        check_kernel(kernel)
        self.kernel = kernel
        self.batch, self.n_heads = check_int("batch", batch), check_int("n_heads", n_heads)
        self.n_groups, self.d_v = check_int("n_groups", n_groups), check_int("d_v", d_v)
        check_groups(n_heads, n_groups, "n_groups")
        self.d_k = None if d_k is None else check_int("d_k", d_k)
        self.capacity = None if capacity is None else check_int("capacity", capacity)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.dtype, self.device = dtype, torch.device("cpu") if device is None else torch.device(device)
        check_int("query_history", query_history)
        check_int("buffer_size", buffer_size)
        check_int("level_ratio", level_ratio, 2)
        B, H, G = self.batch, self.n_heads, self.n_groups
        self.rows = R = B * H
        self.index = SortedKeyIndex(R, buffer_size=buffer_size, level_ratio=level_ratio, device=self.device)
        self.n_tokens = 0  # tokens appended
        self.n_slots = 0  # value slots in use (uniform over batch x groups)
        self._n_max = 0  # most live entries any head holds (public: max_entries)
        heads = torch.arange(H, device=self.device)
        bidx = torch.arange(B, device=self.device).repeat_interleave(H)
        self._row_group = (bidx * G + heads.repeat(B) // (H // G)).view(R, 1)  # (R, 1) value row b*G+g
        self._row_head = torch.arange(R, device=self.device).view(R, 1)  # (R, 1) vector-key row b*H+h
        self._qhist = torch.zeros(R, query_history, device=self.device)
        self._qpos = self._qcount = 0
        self._sink = sink_rows(self, sink_key, sink_value, sink_vkey, sink_logw)
        self.has_sink = self._sink is not None
        self.sink_zone = parse_zone(sink_zone)
        self._alloc(self.capacity or 1024)

    # ---- construction helpers -----------------------------------------------------------
    def _alloc(self, slots: int) -> None:
        """(Re)allocate the value (and vector-key) store with room for ``slots`` slots."""
        B, H, G, n = self.batch, self.n_heads, self.n_groups, self.n_slots
        values = torch.zeros(B, G, slots, self.d_v, dtype=self.dtype, device=self.device)
        if n:
            values[:, :, :n] = self.values[:, :, :n]
        self.values = values
        if self.d_k is not None:
            vkeys = torch.zeros(B, H, slots, self.d_k, dtype=self.dtype, device=self.device)
            if n:
                vkeys[:, :, :n] = self.vkeys[:, :, :n]
            self.vkeys = vkeys
        self._val_off = self._row_group * slots  # (R, 1) row offsets into values.view(-1, Dv)
        self._key_off = self._row_head * slots

    def reserve_slots(self, extra: int) -> None:
        """Make room for `extra` more value slots: grow the store, or with a fixed capacity reclaim
        dead slots; RuntimeError when a full fixed capacity has no room."""
        need = self.n_slots + extra
        cap = self.values.shape[2]
        if need <= cap:
            return
        if self.capacity is not None:
            eviction.reclaim_slots(self)
            if self.n_slots + extra > self.capacity:
                raise RuntimeError(f"the cache is full: capacity={self.capacity} value slots, "
                                   f"{self.n_slots} live; evict, compress, or use a larger capacity")
            return
        self._alloc(max(2 * cap, need))

    @classmethod
    def from_tensors(cls, ks: torch.Tensor, v: torch.Tensor, k: torch.Tensor | None = None,
                     **kwargs) -> "SortedScalarCache":
        """Bulk-load a cache from a whole context: ks (B, H, N), v (B, G, N, Dv), k (B, H, N, Dk) for hybrid
        heads. Sorts each head's keys once (O(N log N)); other keyword arguments go to the constructor
        (dtype defaults to v's, device to ks'). ks, v and k must have the cache's dtype and be finite, as in
        ``append``. Without a capacity the store holds N and doubles when full: give a capacity of N + the
        tokens still to come to avoid that copy during decode."""
        for name, x, dims in (("ks", ks, "(B, H, N)"), ("v", v, "(B, G, N, Dv)"), ("k", k, "(B, H, N, Dk)")):
            if x is None and name == "k":
                continue
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a {dims} torch.Tensor, got {type(x).__name__}")
            if x.dim() != len(dims.split(",")):
                raise ValueError(f"{name} must be a {dims} tensor, got shape {tuple(x.shape)}")
        B, H, N = ks.shape
        if v.shape[0] != B or v.shape[2] != N:
            raise ValueError(f"v must be (B, G, N, Dv) with B={B}, N={N} as in ks, got {tuple(v.shape)}")
        if k is not None and tuple(k.shape[:3]) != (B, H, N):
            raise ValueError(f"k must be (B, H, N, Dk) = ({B}, {H}, {N}, Dk), got {tuple(k.shape)}")
        kwargs.setdefault("device", ks.device)
        if v.is_floating_point():
            kwargs.setdefault("dtype", v.dtype)
        cache = cls(B, H, v.shape[1], v.shape[3], d_k=None if k is None else k.shape[3], **kwargs)
        if cache.capacity is not None and N > cache.capacity:
            raise ValueError(f"capacity={cache.capacity} is smaller than the N={N} tokens given")
        for name, x in (("ks", ks), ("v", v), ("k", k)):
            if x is not None:
                cache._check_dtype(name, x)
        for name, x in (("ks", ks), ("v", v), ("k", k)):
            if x is not None:
                checks.check_finite(name, x)
        check_float32_range("ks", ks)
        if cache.values.shape[2] < N:
            cache._alloc(N)
        cache.values[:, :, :N] = v.detach()
        if k is not None:
            cache.vkeys[:, :, :N] = k.detach()
        keys, order = ks.detach().reshape(B * H, N).to(cache.device, torch.float32).sort(dim=1)
        data = cache.index.empty(N)
        data[0] = keys.view(torch.int32)
        data[1] = order.to(torch.int32)
        if N:
            cache.index.push(data)
        cache.n_tokens = cache.n_slots = cache._n_max = N
        return cache

    # ---- properties ---------------------------------------------------------------------
    @property
    def hybrid(self) -> bool:
        """True when the heads are hybrid (the cache was built with d_k)."""
        return self.d_k is not None

    @property
    def row_group(self) -> torch.Tensor:
        """(R, 1) the value-store row b * G + g that index row b * H + h reads (read-only)."""
        return self._row_group

    @property
    def max_entries(self) -> int:
        """The most live entries any head holds (a window is never wider)."""
        return self._n_max

    @property
    def sink(self) -> SinkRows | None:
        """The sink entry per index row (key (R, 1) float32, value (R, Dv), vector key (R, Dk) or
        None), or None without a sink."""
        return self._sink

    def recount_entries(self) -> None:
        """Refresh max_entries after the index lost entries (eviction, compression)."""
        self._n_max = int(self.index.n_entries().max().item()) if self.rows else 0

    def __len__(self) -> int:
        return self.n_tokens

    def n_entries(self) -> torch.Tensor:
        """Live entries per head (B, H): tokens minus evicted ones, merged ones counting once."""
        return self.index.n_entries().view(self.batch, self.n_heads)

    def bytes_per_token(self) -> dict[str, int]:
        """Per-token, per-layer memory of this configuration (see module-level bytes_per_token)."""
        return bytes_per_token(self.n_heads, self.n_groups, self.d_v, self.d_k, self.dtype, self.index.weighted)

    def memory_bytes(self) -> int:
        """Bytes actually allocated now: index (with padding and buffer) + value/key stores."""
        total = self.index.nbytes() + self.values.numel() * self.values.element_size()
        if self.hybrid:
            total += self.vkeys.numel() * self.vkeys.element_size()
        return total

    # ---- argument checks ----------------------------------------------------------------
    def _check_shape(self, name: str, x, shape: tuple) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} to match the cache "
                             f"(batch={self.batch}, n_heads={self.n_heads}), got {tuple(x.shape)}")
        return x

    def _check_dtype(self, name: str, x: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Appended tensors: the cache's dtype (no silent rounding); query tensors: floating (``dtype``: the one they share)."""
        if dtype is None and x.dtype != self.dtype:
            raise TypeError(f"{name} must have the cache's dtype {self.dtype}, got {x.dtype}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
        if dtype is not None and x.dtype != dtype:
            raise TypeError(f"{name} must have the dtype of qs ({dtype}), got {x.dtype}")

    def per_row(self, name: str, value):
        """Parameter `value` (tau, radius), a finite float > 0 or such a 0-d, (H,) or (B, H) floating
        tensor, as a float or an (R, 1) float32 tensor; TypeError or ValueError naming it (`name`)."""
        B, H = self.batch, self.n_heads
        if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
            raise TypeError(f"{name} must be a float or a tensor, got {type(value).__name__}")
        if not isinstance(value, torch.Tensor):
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value}; the cache is unchanged")
            check_positive(name, value)
            return float(value)
        if not value.is_floating_point():
            raise TypeError(f"{name} must be a float or a floating-point tensor, got {value.dtype}")
        _check_finite(name, value)
        check_float32_range(name, value)
        check_positive(name, value)
        t = value.to(self.device, torch.float32)
        if t.dim() == 0 or tuple(t.shape) == (H,):
            t = t.expand(B, H)
        elif tuple(t.shape) != (B, H):
            raise ValueError(f"{name} must be a float, 0-d, ({H},) or ({B}, {H}), got shape {tuple(t.shape)}")
        return t.reshape(self.rows, 1)

    def _plain(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x detached, on the cache's device, in dtype (no op when it already is)."""
        if x.requires_grad:
            x = x.detach()
        return x if x.dtype == dtype and x.device == self.device else x.to(self.device, dtype)

    # ---- decode step --------------------------------------------------------------------
    def append(self, ks: torch.Tensor, v: torch.Tensor, k: torch.Tensor | None = None, *, check_values: bool = True) -> None:
        """Insert one token: ks (B, H) scalar keys, v (B, G, Dv) values, k (B, H, Dk) vector keys
        (hybrid only), all in the cache's dtype. Every argument is checked (shape, dtype, finite)
        before anything changes: a rejected append leaves the cache exactly as it was.
        check_values=False skips the finiteness and float32-range checks, for a caller that has
        checked these tensors already (a decoding layer checks its projections once per step)."""
        B, H = self.batch, self.n_heads
        args = [("ks", ks, (B, H)), ("v", v, (B, self.n_groups, self.d_v))]
        if self.hybrid:
            if k is None:
                raise ValueError(f"k (B, H, Dk) = ({B}, {H}, {self.d_k}) is required: this cache has hybrid heads")
            args.append(("k", k, (B, H, self.d_k)))
        elif k is not None:
            raise ValueError("k must be None: this cache has pure scalar heads (build it with d_k for hybrid)")
        for name, x, shape in args:
            self._check_shape(name, x, shape)
            self._check_dtype(name, x)
        if check_values:
            for name, x, _ in args:
                _check_finite(name, x)
            check_float32_range("ks", ks)
        if self.n_slots == self.values.shape[2]:
            self.reserve_slots(1)  # a full fixed capacity raises before anything changes
        s = self.n_slots
        self.values.select(2, s).copy_(self._plain(v, self.dtype))
        if self.hybrid:
            self.vkeys.select(2, s).copy_(self._plain(k, self.dtype))
        self.index.insert(self._plain(ks, torch.float32).reshape(self.rows).view(torch.int32), s)
        self.n_slots += 1
        self.n_tokens += 1
        self._n_max += 1

    def attend(self, qs: torch.Tensor, tau, q: torch.Tensor | None = None, window: int | None = 64,
               radius=None, eps: float | None = None, impl: str = "auto", extra=None, *,
               check_values: bool = True, scalar_scale=None) -> torch.Tensor:
        """One decode step: qs (B, H) scalar queries, q (B, H, Dk) vector queries (hybrid) -> (B, H, Dv).

        tau: float, 0-d, (H,) or (B, H). window: k nearest entries (None: all, i.e. exact); clamped to what
        a head holds (among equal distances the newest entries first). radius (float/(H,)/(B, H)) or eps
        (r = sqrt(-tau log eps), Cauchy: sqrt(tau (1/eps - 1)); eps in (0, 1)): keep only entries within r (at most ``window``). impl:
        "fast" searches the sorted index, "naive" scores every cached entry by the formula and masks
        outside the window. extra (fast only): (logits (B, H, m), values (B, H, m, Dv)) of m keys held
        outside the cache (a local ring of recent tokens), in the same softmax. check_values=False skips
        the finiteness and float32-range checks of qs, q and extra (shapes are always checked), for a
        caller that has checked them already. scalar_scale (hybrid): lam in q·k/√d − lam (qs − ks)²/τ,
        a float >= 0 or an (H,) tensor. Raises as the class says."""
        check_impl(impl)
        query = sorted_read.make_query(self, qs, tau, q, window, radius, eps, check_values=check_values,
                                       scalar_scale=scalar_scale)
        if extra is not None:
            extra = sorted_read.check_extra(self, extra, check_values)
            if impl == "naive":
                raise ValueError("extra columns are read by impl='fast' / 'auto' only")
        if self._n_max == 0 and not self.has_sink and extra is None:
            raise ValueError("the cache is empty and has no sink: append a token before attend")
        hist = self._qhist.shape[1]
        self._qhist.select(1, self._qpos).copy_(self._plain(query.qs, torch.float32).view(self.rows))
        self._qpos, self._qcount = (self._qpos + 1) % hist, self._qcount + 1
        if impl == "naive":
            return attend_naive(self, query)
        cand, _ = self.select(query)
        return sorted_read.output(self, cand, query, extra)

    def query(self, qs: torch.Tensor, tau, q: torch.Tensor | None = None, window: int | None = 64,
              radius=None, eps: float | None = None) -> DecodeQuery:
        """Check the arguments of `attend` (same meaning and errors) and lay them out per row as a
        `DecodeQuery` (R = B * H rows); records nothing."""
        return sorted_read.make_query(self, qs, tau, q, window, radius, eps)

    def select(self, query: DecodeQuery) -> tuple[torch.Tensor, torch.Tensor]:
        """The window of a `query()`: packed candidates (C, R, k), each head's k nearest entries
        (within the radius, if any), and their distances |qs - ks| (R, k); pads at inf."""
        return sorted_read.select(self, query)

    def scores(self, entries: torch.Tensor, query: DecodeQuery, *, radius: bool = True,
               sink: bool = False) -> torch.Tensor:
        """Logits (R, n) of packed entries (C, R, n) for a `query()`, -inf beyond its radius if
        `radius`; `sink` appends the sink's logit as column n (`sorted_read.scores`)."""
        return sorted_read.scores(self, entries, query, radius=radius, sink=sink)

    # ---- eviction and compression (see cache/eviction.py) ---------------------------------
    def recent_queries(self) -> torch.Tensor:
        """The recent scalar queries recorded by attend, (R, m) with m <= query_history."""
        return self._qhist[:, : min(self._qcount, self._qhist.shape[1])]

    def evict_geometric(self, radius=None, *, tau=None, eps: float | None = None, reclaim: bool = True) -> int:
        """Evict keys outside [min recent qs - r, max recent qs + r] per head (sink zone kept), r the
        `radius` (float, (H,) or (B, H)) or sqrt(-tau log eps) from `tau` and `eps` in (0, 1); `reclaim`:
        free dead value slots. Returns the entries evicted; ValueError before any attend or for bad r."""
        return eviction.evict_geometric(self, radius, tau=tau, eps=eps, reclaim=reclaim)

    def evict_to_budget(self, budget: int) -> int:
        """Keep each head's ``budget`` entries nearest to its recent queries' range (newest on ties)."""
        return eviction.evict_to_budget(self, budget)

    def compress_density(self, max_span: float, group: int = 4, reclaim: bool = True) -> int:
        """Merge aligned runs of ``group`` (>= 2) adjacent keys spanning <= max_span (>= 0) into one
        weighted entry; `reclaim`: free dead value slots. Returns the entries removed (ValueError for
        bad arguments; RuntimeError, the cache unchanged, when a fixed capacity has no room)."""
        return eviction.compress_density(self, max_span, group=group, reclaim=reclaim)

    def reclaim(self) -> int:
        """Free value slots no head references any more; returns the number freed."""
        return eviction.reclaim_slots(self)
