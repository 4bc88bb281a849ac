"""cu_seqlens on the windowed scalar and hybrid op (`windowed_attention`): each query's window, and its
local keys, come from its own document only, so documents packed in one row equal each document run
alone through the naive op in float64, outputs and every gradient, on every path (naive, the
selected-keys path, and the Triton kernel under TRITON_INTERPRET=1), at awkward lengths, with ties,
GQA, both kernels; the (B, T) docs form; the refusals."""

from __future__ import annotations

import pytest
import torch

from attnlab.ops import windowed_attention
from attnlab.testing import PACKED_LENGTHS, cu_offsets, rel_rms

pytestmark = pytest.mark.usefixtures("one_thread")


def inputs(T, *, hybrid, ties=False, seed=0):
    """Scalar (and hybrid) inputs of one packed row: 4 query heads on 2 value/key groups."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    qs, ks = r(1, 4, T), r(1, 4, T)
    if ties:  # equal distances everywhere: the newest of the tied keys fill a window's last places
        qs, ks = qs.round(), ks.round()
    t = {"qs": qs, "ks": ks, "v": r(1, 2, T, 6), "tau": 0.3 + torch.rand(1, 4, T, generator=g, dtype=torch.float64)}
    if hybrid:
        t.update(q=r(1, 4, T, 8), k=r(1, 2, T, 8))
    return t


def call(t, impl, dtype, **kw):
    cast = {n: x.to(dtype) if n != "tau" or dtype == torch.float64 else x.float() for n, x in t.items()}
    return windowed_attention(cast["qs"], cast["ks"], cast["v"], cast["tau"], q=cast.get("q"), k=cast.get("k"),
                              impl=impl, **kw)


def compare(t, cu, impl, dtype=torch.float32, tol=1e-5, **kw):
    """The packed call (cu_seqlens) against each document alone (naive, float64, the inputs rounded to
    dtype: rounding can change which keys are nearest), outputs and every gradient."""
    leaves = {n: x.to(dtype if n != "tau" else torch.float32).requires_grad_() for n, x in t.items()}
    refs = {n: x.to(dtype if n != "tau" else torch.float32).double().requires_grad_() for n, x in t.items()}
    got = windowed_attention(leaves["qs"], leaves["ks"], leaves["v"], leaves["tau"], q=leaves.get("q"),
                             k=leaves.get("k"), impl=impl, cu_seqlens=torch.tensor(cu), **kw)
    parts = [windowed_attention(*(refs[n][..., a:b] if refs[n].dim() == 3 else refs[n][:, :, a:b]
                                  for n in ("qs", "ks", "v", "tau")),
                                q=refs["q"][:, :, a:b] if "q" in refs else None,
                                k=refs["k"][:, :, a:b] if "k" in refs else None, impl="naive", **kw)
             for a, b in zip(cu[:-1], cu[1:]) if b > a]
    want = torch.cat(parts, 2)
    assert got.dtype == dtype
    assert rel_rms(got.double(), want) < tol, rel_rms(got.double(), want)
    cot = torch.randn(got.shape, generator=torch.Generator().manual_seed(5))
    g_got = torch.autograd.grad((got * cot.to(dtype)).sum(), list(leaves.values()))
    g_want = torch.autograd.grad((want * cot.to(dtype).double()).sum(), list(refs.values()))
    for n, a, b in zip(leaves, g_got, g_want):
        assert rel_rms(a.double(), b, floor=1e-2) < 10 * tol, (n, rel_rms(a.double(), b, floor=1e-2))


CASES = {  # (window, local, kernel, ties)
    "k3": (3, 0, "gaussian", False),
    "k4-local2-ties": (4, 2, "gaussian", True),
    "k2-local3-cauchy": (2, 3, "cauchy", False),
    "k64-local8": (64, 8, "gaussian", False),  # k + w past every document: each reads all its keys
}


@pytest.mark.parametrize("impl", ["naive", "fast"])
@pytest.mark.parametrize("hybrid", [False, True], ids=["scalar", "hybrid"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("lengths", ["awkward", "many"])
def test_window_documents_alone(lengths, case, hybrid, impl):
    window, local, kernel, ties = case
    cu = cu_offsets(PACKED_LENGTHS[lengths])
    compare(inputs(cu[-1], hybrid=hybrid, ties=ties), cu, impl, window=window, local=local, kernel=kernel)


@pytest.mark.parametrize("lengths", ["len1", "len63", "one"])
def test_window_documents_at_awkward_lengths(lengths):
    cu = cu_offsets(PACKED_LENGTHS[lengths])
    compare(inputs(cu[-1], hybrid=True), cu, "fast", window=5, local=2)


@pytest.mark.heavy
@pytest.mark.parametrize("hybrid", [False, True], ids=["scalar", "hybrid"])
def test_window_documents_through_the_triton_kernel(hybrid):
    """The Triton kernel reads the selected keys (idx, ok), which carry the documents: interpreter on
    the CPU."""
    pytest.importorskip("triton")
    cu = cu_offsets(PACKED_LENGTHS["awkward"])
    compare(inputs(cu[-1], hybrid=hybrid, seed=1), cu, "triton", window=4, local=2)


def test_docs_ids_equal_cu_seqlens_and_batch_rows():
    """The (B, T) docs form: two rows, each its own packing, equal to the cu_seqlens call per row."""
    rows = [PACKED_LENGTHS["awkward"], [20, 58]]
    T = 78
    t = {n: torch.cat([x, inputs(T, hybrid=True, seed=3)[n]]) for n, x in inputs(T, hybrid=True).items()}
    ids = torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in rows])
    both = call(t, "fast", torch.float64, window=3, local=1, docs=ids)
    for b, row in enumerate(rows):
        one = {n: x[b:b + 1] for n, x in t.items()}
        want = call(one, "fast", torch.float64, window=3, local=1, cu_seqlens=cu_offsets(row))
        torch.testing.assert_close(both[b:b + 1], want)


def test_documents_refuse_position_rules_and_bad_offsets():
    t = inputs(10, hybrid=False)
    with pytest.raises(ValueError, match="n_prefix=1"):
        call(t, "fast", torch.float64, window=3, n_prefix=1, cu_seqlens=[0, 4, 10])
    with pytest.raises(ValueError, match="budget=4"):
        call(t, "naive", torch.float64, window=3, budget=4, cu_seqlens=[0, 4, 10])
    with pytest.raises(ValueError, match="must end at T = 10"):
        call(t, "fast", torch.float64, window=3, cu_seqlens=[0, 4, 9])
    with pytest.raises(ValueError, match="not both"):
        call(t, "fast", torch.float64, window=3, cu_seqlens=[0, 10], docs=torch.zeros(1, 10, dtype=torch.long))
