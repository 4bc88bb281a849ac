"""Property tests of the sorted scalar cache under random insertions (with duplicate keys),
rejected keys, geometric evictions, density compressions and queries.

Each head has its own value group here and a token's value is [its key, one-hot(token id)],
so any entry, plain or merged, tells which tokens it stands for and with what weight:
the checks recover the slot mapping from the values alone."""

import math

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
