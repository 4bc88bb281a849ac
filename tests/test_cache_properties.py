"""Property tests of the sorted scalar cache under random insertions (with duplicate keys),
rejected keys, geometric evictions, density compressions and queries.

In the first test each head has its own value group and a token's value is [its key,
one-hot(token id)], so any entry, plain or merged, tells which tokens it stands for and with
what weight: the checks recover the slot mapping from the values alone. The second checks that
every rejected call (non-finite or wrongly typed input) leaves the whole state bit-identical."""

import copy
import math

import pytest
import torch
from hypothesis import event, given, settings, strategies as st

from attnlab.cache.sorted import SortedScalarCache
from attnlab.cache.sorted_index import run_keys

B, H, MAX_TOKENS = 2, 2, 40
R = B * H
Dv = 1 + MAX_TOKENS

key = st.one_of(st.sampled_from([-1.0, 0.0, 0.25, 1.0, 2.0]),
                st.floats(-4, 4, allow_nan=False, width=32))
append = st.tuples(st.just("append"), st.lists(key, min_size=R, max_size=R))
attend = st.tuples(st.just("attend"), st.lists(st.floats(-3, 3, width=32), min_size=R, max_size=R),
                   st.sampled_from([None, 1, 3, 8]))
op = st.one_of(
    append, append, append, attend,
    st.tuples(st.just("bad"), st.integers(0, R - 1), st.sampled_from([float("nan"), float("inf"), -float("inf")])),
    st.tuples(st.just("evict"), st.floats(0.01, 2.0)),
    st.tuples(st.just("compress"), st.sampled_from([0.0, 0.3, 1.0, 5.0]), st.sampled_from([2, 3])),
)


# the sink zone (-0.1, 0.1) as the float32 cache stores it: 0.1 in float32 is 0.10000000149...
ZONE_LO, ZONE_HI = (float(torch.tensor(z, dtype=torch.float32)) for z in (-0.1, 0.1))


def entries(cache):
    """Per row: list of (key, slot, logw) of live entries, and check each level's order."""
    idx = cache.index
    for data in idx.runs():
        k = run_keys(data)
        assert bool((k[:, 1:] >= k[:, :-1]).all()), "a level lost its sorted order"
        fin = torch.isfinite(k)
        assert bool((fin[:, 1:] <= fin[:, :-1]).all()), "padding before a live entry"
    assert idx.buf_len <= idx.buffer_size
    for level, data in enumerate(idx.levels):
        assert data is None or data.shape[2] <= idx.capacity(level)
    ent = idx.all_entries()
    keys, slots = run_keys(ent), ent[1]
    logw = ent[2].view(torch.float32) if idx.weighted else torch.zeros_like(keys)
    return [[(keys[r, j].item(), int(slots[r, j]), logw[r, j].item())
             for j in range(keys.shape[1]) if math.isfinite(keys[r, j].item())] for r in range(R)]


def members(cache, r, slot, logw):
    """Token ids (with weights) an entry stands for, read from its value vector."""
    b, h = divmod(r, H)
    val = cache.values[b, h, slot].double()
    w = val[1:] * math.exp(logw)  # each original token carries weight 1
    ids = (val[1:] > 1e-9).nonzero().view(-1).tolist()
    return val[0].item(), ids, w


def check(cache, live, ks_hist):
    """Every live token is in exactly one entry of its head; keys, slots and weights agree."""
    got = entries(cache)
    for r in range(R):
        seen = []
        for k, slot, logw in got[r]:
            assert 0 <= slot < cache.n_slots
            centroid, ids, w = members(cache, r, slot, logw)
            assert ids, "an entry points at an empty slot"
            assert torch.allclose(w[ids], torch.ones(len(ids), dtype=torch.float64), atol=1e-4)
            assert abs(centroid - k) <= 1e-4 * (1 + abs(k))
            if len(ids) == 1 and logw == 0.0:
                assert k == ks_hist[ids[0]][r], "slot maps to another token's value"
            seen += ids
        assert sorted(seen) == sorted(live[r]), f"row {r}: tokens {sorted(seen)} vs {sorted(live[r])}"
    assert int(cache.n_entries().max()) == max(len(g) for g in got)


@pytest.mark.heavy
@settings(max_examples=100, deadline=None)
@given(st.lists(op, min_size=4, max_size=45))
def test_invariants_under_random_operations(ops):
    cache = SortedScalarCache(B, H, H, Dv, buffer_size=4, level_ratio=2, sink_zone=(-0.1, 0.1),
                              query_history=8, sink_key=0.0, sink_value=torch.zeros(Dv))
    live = [[] for _ in range(R)]
    ks_hist, queries = [], []
    for o in ops:
        if o[0] == "append" and len(ks_hist) < MAX_TOKENS:
            ks = torch.tensor(o[1], dtype=torch.float32).view(B, H)
            v = torch.zeros(B, H, Dv)
            v[..., 0] = ks
            v[..., 1 + len(ks_hist)] = 1.0
            cache.append(ks, v)
            for r in range(R):
                live[r].append(len(ks_hist))
            ks_hist.append(ks.view(R).tolist())
        elif o[0] == "bad":
            before = (cache.index.all_entries().clone(), cache.values.clone(), len(cache), cache.n_slots)
            ks = torch.zeros(R)
            ks[o[1]] = o[2]
            try:
                cache.append(ks.view(B, H), torch.zeros(B, H, Dv))
                raise AssertionError("a non-finite key was accepted")
            except ValueError:
                pass
            after = (cache.index.all_entries(), cache.values, len(cache), cache.n_slots)
            assert all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(before, after))
        elif o[0] == "attend":
            qs = torch.tensor(o[1], dtype=torch.float32).view(B, H)
            fast = cache.attend(qs, 0.5, window=o[2])
            naive = cache.attend(qs, 0.5, window=o[2], impl="naive")
            if o[2] is None:  # exact mode: fast and naive must agree (windows may differ on ties)
                assert torch.allclose(fast, naive, atol=1e-5)
            queries = (queries + [o[1]] * 2)[-8:]  # both calls record the query (history of 8)
        elif o[0] == "evict" and queries:
            q = torch.tensor(queries)  # (m, R)
            lo, hi = q.min(0).values - o[1], q.max(0).values + o[1]
            out = {r: set() for r in range(R)}
            for r, row in enumerate(entries(cache)):
                for k, slot, logw in row:
                    if not (lo[r] <= k <= hi[r] or ZONE_LO <= k <= ZONE_HI):
                        out[r].update(members(cache, r, slot, logw)[1])
            event(f"evicted entries: {'some' if cache.evict_geometric(o[1]) else 'none'}")
            live = [[i for i in live[r] if i not in out[r]] for r in range(R)]
        elif o[0] == "compress":
            n_before = [len(row) for row in entries(cache)]
            removed = cache.compress_density(o[1], group=o[2])
            assert removed == sum(n_before) - sum(len(row) for row in entries(cache))
            event(f"compressed entries: {'some' if removed else 'none'}")
        check(cache, live, ks_hist)


# ---- rejected calls leave every bit of state unchanged ------------------------------------
def snapshot(obj):
    """Every attribute of the cache, recursively (its index included), tensors cloned."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map(snapshot, obj))
    if hasattr(obj, "__dict__"):
        return (type(obj), snapshot(vars(obj)))
    return copy.copy(obj)


def same_state(before, obj) -> bool:
    """obj is bit-identical to the snapshot ``before``: tensors equal in dtype, shape and bytes
    (NaN-safe), everything else equal, recursively."""
    if isinstance(obj, torch.Tensor):
        bits = lambda x: x.detach().contiguous().reshape(-1).view(torch.uint8)
        return (isinstance(before, torch.Tensor) and before.dtype == obj.dtype and before.shape == obj.shape
                and torch.equal(bits(before), bits(obj)))
    if isinstance(obj, dict):
        return (isinstance(before, dict) and before.keys() == obj.keys()
                and all(same_state(before[k], obj[k]) for k in obj))
    if isinstance(obj, (list, tuple)):
        return type(before) is type(obj) and len(before) == len(obj) and all(map(same_state, before, obj))
    if hasattr(obj, "__dict__"):
        return isinstance(before, tuple) and before[0] is type(obj) and same_state(before[1], vars(obj))
    return before == obj


Bq, Hq, Gq, Dvq, Dkq = 2, 4, 2, 3, 2  # G < H: two heads read each value group
Rq = Bq * Hq
BAD = [float("nan"), float("inf"), -float("inf")]
q_op = st.one_of(
    st.tuples(st.just("append"), st.lists(key, min_size=Rq, max_size=Rq)),
    st.tuples(st.just("append"), st.lists(key, min_size=Rq, max_size=Rq)),
    st.tuples(st.just("bad_append"), st.sampled_from(["ks", "v", "k"]), st.integers(0, 63), st.sampled_from(BAD)),
    st.tuples(st.just("bad_append"), st.sampled_from(["ks", "v", "k"]), st.integers(0, 63), st.sampled_from(BAD)),
    st.tuples(st.just("bad_dtype"), st.sampled_from(["ks", "v", "k"]), st.sampled_from([torch.float64, torch.int64])),
    st.tuples(st.just("bad_query"), st.sampled_from(["qs", "q", "tau"]), st.integers(0, 63), st.sampled_from(BAD)),
    st.tuples(st.just("attend"), st.sampled_from([None, 1, 3, 8])),
    st.tuples(st.just("evict"), st.floats(0.05, 2.0), st.booleans()),
    st.tuples(st.just("compress"), st.sampled_from([0.0, 0.3, 1.0, 5.0]), st.sampled_from([2, 3]), st.booleans()),
    st.tuples(st.just("reclaim")),
)


def poison(x: torch.Tensor, pos: int, bad: float) -> torch.Tensor:
    x = x.clone()
    x.view(-1)[pos % x.numel()] = bad
    return x


def check_attend(cache, gen, window) -> None:
    """Fast attend equals the naive formula over the live entries (rows whose k-th and (k+1)-th
    nearest keys tie are skipped for a finite window: either choice is a correct window)."""
    if cache.max_entries == 0 and not cache.has_sink:
        return
    qs = torch.randn(Bq, Hq, generator=gen) * 2
    q = torch.randn(Bq, Hq, Dkq, generator=gen) if cache.hybrid else None
    tau = torch.rand(Hq, generator=gen) + 0.2
    fast = cache.attend(qs, tau, q=q, window=window).view(Rq, -1)
    naive = cache.attend(qs, tau, q=q, window=window, impl="naive").view(Rq, -1)
    rows = torch.ones(Rq, dtype=torch.bool)
    if window is not None:
        d = (run_keys(cache.index.all_entries()) - qs.reshape(Rq, 1)).abs().sort(1).values  # (R, N); pads inf
        if d.shape[1] > window:
            rows = ~((d[:, window - 1] == d[:, window]) & torch.isfinite(d[:, window]))
    assert torch.allclose(fast[rows], naive[rows], atol=1e-5, rtol=1e-5)


@pytest.mark.heavy
@settings(max_examples=100, deadline=None)
@given(st.booleans(), st.booleans(), st.integers(0, 2 ** 16), st.lists(q_op, min_size=4, max_size=40))
def test_rejected_calls_leave_state_bit_identical(hybrid, sink, seed, ops):
    gen = torch.Generator().manual_seed(seed)
    extra = {}
    if sink:
        extra = dict(sink_key=float(torch.rand(1, generator=gen)) * 2 - 1, sink_zone=(-0.1, 0.1),
                     sink_value=torch.randn(Gq, Dvq, generator=gen))
        if hybrid:
            extra["sink_vkey"] = torch.randn(Hq, Dkq, generator=gen)
    cache = SortedScalarCache(Bq, Hq, Gq, Dvq, d_k=Dkq if hybrid else None, buffer_size=4, level_ratio=2,
                              query_history=8, capacity=64, **extra)  # 40 tokens + merged entries fit

    def token(keys):
        ks = torch.tensor(keys, dtype=torch.float32).view(Bq, Hq)
        k = torch.randn(Bq, Hq, Dkq, generator=gen) if hybrid else None
        return {"ks": ks, "v": torch.randn(Bq, Gq, Dvq, generator=gen), "k": k}

    for o in ops:
        if o[0] == "append":
            n = len(cache)
            cache.append(**token(o[1]))
            assert len(cache) == n + 1
        elif o[0] in ("bad_append", "bad_dtype"):
            name = o[1] if hybrid or o[1] != "k" else "v"
            args = token(torch.randn(Rq, generator=gen).tolist())
            if o[0] == "bad_append":
                args[name] = poison(args[name], o[2], o[3])
                err, msg = ValueError, f"{name} must be finite, got"
            else:
                args[name] = args[name].to(o[2])
                err, msg = TypeError, f"{name} must have the cache's dtype torch.float32, got {o[2]}"
            before = snapshot(cache)
            with pytest.raises(err, match="^" + msg):
                cache.append(**args)
            assert same_state(before, cache), f"a rejected append ({o}) changed the cache"
            event(f"rejected append into {'an empty' if len(cache) == 0 else 'a filled'} cache")
            check_attend(cache, gen, None)
            check_attend(cache, gen, 3)
        elif o[0] == "bad_query":
            name = o[1] if hybrid or o[1] != "q" else "qs"
            args = {"qs": torch.zeros(Bq, Hq), "tau": torch.ones(Bq, Hq),
                    "q": torch.zeros(Bq, Hq, Dkq) if hybrid else None}
            args[name] = poison(args[name], o[2], o[3])
            before = snapshot(cache)
            with pytest.raises(ValueError, match=f"^{name} must be finite, got"):
                cache.attend(args["qs"], args["tau"], q=args["q"], window=4)
            assert same_state(before, cache), f"a rejected attend ({o}) changed the cache"
        elif o[0] == "attend":
            check_attend(cache, gen, o[1])
        elif o[0] == "evict" and cache.recent_queries().shape[1]:
            event(f"evicted entries: {'some' if cache.evict_geometric(o[1], reclaim=o[2]) else 'none'}")
        elif o[0] == "compress":
            removed = cache.compress_density(o[1], group=o[2], reclaim=o[3])
            event(f"compressed entries: {'some' if removed else 'none'}")
        elif o[0] == "reclaim":
            event(f"reclaimed slots: {'some' if cache.reclaim() else 'none'}")
    check_attend(cache, gen, None)
