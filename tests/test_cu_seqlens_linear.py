"""cu_seqlens on the linear family (gla, ssd, cosformer): documents packed in one row, each equal to
running it alone, outputs, every gradient and the final states, on the chunked fast path and the
naive recurrence, at awkward lengths (documents of length 0, 1 and 63, one document, many); the
(B, T) docs form; the argument's checks; one graph under torch.compile (no host read, no shape that
depends on the offsets)."""

from __future__ import annotations

import pytest
import torch

from attnlab.ops import cosformer_attention, gla_attention, ssd_attention
from attnlab.testing import PACKED_LENGTHS, cu_offsets, rel_rms

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS, offsets = PACKED_LENGTHS, cu_offsets


def make(T, vector, H=2, Dk=8, Dv=6, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, H, T, Dk, generator=g), torch.randn(1, H, T, Dk, generator=g)
    v = torch.randn(1, H, T, Dv, generator=g)
    ld = -torch.rand(1, H, T, *((Dk,) if vector else ()), generator=g) * 0.5
    return [x.to(dtype) for x in (q, k, v, ld)]


def per_document(fn, inputs, cu, **kw):
    """The reference: the naive op on each document alone (float64), outputs concatenated, final
    states stacked (a zero state for an empty document)."""
    outs, finals = [], []
    for a, b in zip(cu[:-1], cu[1:]):
        o, s = fn(*(x[:, :, a:b] for x in inputs), impl="naive", **kw)
        outs.append(o)
        finals.append(s)
    return torch.cat(outs, 2), torch.cat(finals, 0)


def check_against_documents(fn, inputs, cu, impl, tol=(1e-5, 1e-4), **kw):
    leaves = [x.detach().requires_grad_() for x in inputs]
    ref_leaves = [x.detach().double().requires_grad_() for x in inputs]
    o, s = fn(*leaves, impl=impl, cu_seqlens=torch.tensor(cu), **kw)
    ro, rs = per_document(fn, ref_leaves, cu, **kw)
    assert s.shape == rs.shape == (len(cu) - 1, *rs.shape[1:])
    assert rel_rms(o, ro) < tol[0] and rel_rms(s, rs) < tol[0], (rel_rms(o, ro), rel_rms(s, rs))
    g = torch.Generator().manual_seed(9)
    go, gs = torch.randn(o.shape, generator=g), torch.randn(s.shape, generator=g)
    got = torch.autograd.grad((o * go).sum() + (s * gs).sum(), leaves)
    want = torch.autograd.grad((ro * go.double()).sum() + (rs * gs.double()).sum(), ref_leaves)
    for name, a, b in zip("q k v log_decay".split(), got, want):
        assert rel_rms(a, b, floor=1e-3) < tol[1], (name, rel_rms(a, b, floor=1e-3))


@pytest.mark.parametrize("impl", ["fast", "naive"])
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize("op", ["gla", "ssd"])
def test_gla_ssd_documents_alone(op, lengths, impl):
    """The state restarts at every document's first step: outputs, final states (N, H, Dk, Dv) and
    every gradient equal each document run alone."""
    fn, vector = (gla_attention, True) if op == "gla" else (ssd_attention, False)
    cu = offsets(lengths)
    check_against_documents(fn, make(cu[-1], vector), cu, impl)


@pytest.mark.parametrize("chunk_size", [1, 7, 16])
@pytest.mark.parametrize("op", ["gla", "ssd"])
def test_gla_ssd_any_chunk(op, chunk_size):
    """Documents that start and end anywhere inside and across chunks (sub-chunks of 16 for gla)."""
    fn, vector = (gla_attention, True) if op == "gla" else (ssd_attention, False)
    cu = offsets(LENGTHS["many"])
    check_against_documents(fn, make(cu[-1], vector), cu, "fast", chunk_size=chunk_size)


def test_gla_bfloat16_within_its_precision():
    cu = offsets(LENGTHS["awkward"])
    q, k, v, ld = make(cu[-1], True, dtype=torch.bfloat16)
    o, s = gla_attention(q, k, v, ld, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    ro, rs = per_document(gla_attention, [x.double() for x in (q, k, v, ld)], cu)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert rel_rms(o, ro) < 2e-2 and rel_rms(s, rs) < 1e-5


def test_docs_rows_equal_their_documents():
    """docs (B, T): every row packed its own way; the state returned is each row's last document's."""
    rows = [[5, 1, 20, 4], [30]]
    docs = torch.tensor([[i for i, n in enumerate(r) for _ in range(n)] for r in rows])
    for fn, vector in ((gla_attention, True), (ssd_attention, False)):
        parts = [make(30, vector, seed=s) for s in (1, 2)]
        inputs = [torch.cat(xs, 0) for xs in zip(*parts)]
        o, s = fn(*inputs, docs=docs, chunk_size=16)
        for b, r in enumerate(rows):
            cu = offsets(r)
            ro, rs = per_document(fn, [x[b:b + 1].double() for x in inputs], cu)
            assert rel_rms(o[b:b + 1], ro) < 1e-5 and rel_rms(s[b], rs[-1]) < 1e-5


COSFORMER = {
    "causal": dict(causal=True),
    "causal-M": dict(causal=True, max_len=80),
    "causal-plain": dict(causal=True, reweight=False, normalize=False),
    "bidirectional": dict(causal=False),
    "bidirectional-M": dict(causal=False, max_len=80),
}


def cos_per_document(inputs, cu, **kw):
    """As `per_document`; an empty document (which alone would need a max_len) has zero sums."""
    outs, kvs, sums = [], [], []
    q, _, v = inputs
    F = q.shape[-1] * (2 if kw.get("reweight", True) else 1)
    for a, b in zip(cu[:-1], cu[1:]):
        if a == b:
            kvs.append(q.new_zeros(1, q.shape[1], F, v.shape[-1]))
            sums.append(q.new_zeros(1, q.shape[1], F))
            continue
        o, st = cosformer_attention(*(x[:, :, a:b] for x in inputs), impl="naive", **kw)
        outs.append(o)
        kvs.append(st.kv)
        sums.append(st.k_sum)
    return torch.cat(outs, 2), torch.cat(kvs, 0), torch.cat(sums, 0)


@pytest.mark.parametrize("impl", ["fast", "naive"])
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize("kw", COSFORMER.values(), ids=COSFORMER.keys())
def test_cosformer_documents_alone(kw, lengths, impl):
    """Positions, sums and the horizon (max_len, or each document's own length) restart per document;
    bidirectionally each document reads all of itself and nothing else."""
    cu = offsets(lengths)
    if "max_len" in kw and kw["max_len"] < max(lengths):
        pytest.skip("a horizon below the longest document is refused (test_cosformer_horizon_covers_documents)")
    q, k, v, _ = make(cu[-1], False)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    o, st = cosformer_attention(*leaves, impl=impl, cu_seqlens=torch.tensor(cu), chunk_size=16, **kw)
    ro, rkv, rsum = cos_per_document(ref_leaves, cu, **kw)
    assert torch.equal(st.offset, torch.tensor(lengths)) and st.max_len == kw.get("max_len")
    assert rel_rms(o, ro) < 1e-5 and rel_rms(st.kv, rkv) < 1e-5 and rel_rms(st.k_sum, rsum) < 1e-5
    g = torch.Generator().manual_seed(4)
    go, gkv = torch.randn(o.shape, generator=g), torch.randn(st.kv.shape, generator=g)
    got = torch.autograd.grad((o * go).sum() + (st.kv * gkv).sum(), leaves)
    want = torch.autograd.grad((ro * go.double()).sum() + (rkv * gkv.double()).sum(), ref_leaves)
    for name, a, b in zip("qkv", got, want):
        assert rel_rms(a, b, floor=1e-3) < 1e-4, name


def test_cosformer_horizon_covers_documents():
    q, k, v, _ = make(20, False)
    with pytest.raises(ValueError, match="max_len=8 is too small: a packed document has 12 positions"):
        cosformer_attention(q, k, v, max_len=8, cu_seqlens=[0, 8, 20])
    cosformer_attention(q, k, v, max_len=12, cu_seqlens=[0, 8, 20])  # each document fits


BAD = {
    "float": (torch.tensor([0.0, 4.0, 10.0]), "cu_seqlens must be an int32 or int64 tensor"),
    "bool-list": ([0, True, 10], "cu_seqlens must hold ints"),
    "2-D": (torch.tensor([[0, 4, 10]]), "cu_seqlens must be 1-D"),
    "one-offset": (torch.tensor([0]), "cu_seqlens must be 1-D with N . 1 >= 2 offsets"),
    "start": (torch.tensor([1, 4, 10]), "cu_seqlens must start at 0, got 1"),
    "decreasing": (torch.tensor([0, 6, 4, 10]), "cu_seqlens must be non-decreasing .* got 6 then 4 at index 2"),
    "end": (torch.tensor([0, 4, 9]), "cu_seqlens must end at T = 10"),
    "end-list": ([0, 4, 11], "cu_seqlens must end at T = 10"),
    "not-offsets": ("0,4,10", "cu_seqlens must be an int32 or int64 tensor of document offsets"),
}


@pytest.mark.parametrize("cu, match", BAD.values(), ids=BAD.keys())
def test_bad_cu_seqlens_named_before_any_work(cu, match):
    q, k, v, ld = make(10, True)
    for call in (lambda: gla_attention(q, k, v, ld, cu_seqlens=cu),
                 lambda: ssd_attention(q, k, v, ld[..., 0], cu_seqlens=cu, impl="naive"),
                 lambda: cosformer_attention(q, k, v, cu_seqlens=cu)):
        with pytest.raises(ValueError, match=match):
            call()


def test_packing_needs_one_row_no_state_and_one_form():
    q, k, v, ld = make(10, True)
    q2, k2, v2, ld2 = (torch.cat([x, x]) for x in (q, k, v, ld))
    with pytest.raises(ValueError, match="cu_seqlens packs documents into one row .* batch size must be 1, got 2"):
        gla_attention(q2, k2, v2, ld2, cu_seqlens=[0, 4, 10])
    with pytest.raises(ValueError, match="initial_state must be None with packed documents"):
        ssd_attention(q, k, v, ld[..., 0], initial_state=torch.zeros(1, 2, 8, 6), cu_seqlens=[0, 10])
    with pytest.raises(ValueError, match="initial_state must be None with packed documents"):
        _, st = cosformer_attention(q, k, v)
        cosformer_attention(q, k, v, initial_state=st, docs=torch.zeros(1, 10, dtype=torch.long))
    with pytest.raises(ValueError, match="as cu_seqlens or as docs, not both"):
        gla_attention(q, k, v, ld, cu_seqlens=[0, 10], docs=torch.zeros(1, 10, dtype=torch.long))
    with pytest.raises(ValueError, match="docs must have shape"):
        gla_attention(q, k, v, ld, docs=torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(TypeError, match="docs must be an integer tensor"):
        gla_attention(q, k, v, ld, docs=torch.zeros(1, 10))
    with pytest.raises(ValueError, match="impl='fla' takes packed documents as cu_seqlens"):
        gla_attention(q, k, v, ld, impl="fla", docs=torch.zeros(1, 10, dtype=torch.long))


def test_empty_row():
    """T = 0: every document is empty; the final states are zero, one per document."""
    q, k, v, ld = make(0, True)
    o, s = gla_attention(q, k, v, ld, cu_seqlens=[0, 0, 0])
    assert o.shape == (1, 2, 0, 6) and s.shape == (2, 2, 8, 6) and not s.any()
    o, st = cosformer_attention(q, k, v, cu_seqlens=[0, 0])
    assert o.shape == (1, 2, 0, 6) and st.kv.shape == (1, 2, 16, 6) and not st.kv.any()


@pytest.mark.heavy
@pytest.mark.parametrize("op", ["gla", "ssd", "cosformer", "cosformer-bidirectional"])
def test_one_graph_under_compile(op):
    """The fast path reads nothing of cu_seqlens on the host and no shape depends on it: it traces as
    one graph, forward and backward (the offsets' check becomes an assert in the graph)."""
    cu = offsets(LENGTHS["awkward"])
    q, k, v, ld = make(cu[-1], op == "gla")
    if op == "gla":
        fn, args = gla_attention, (q, k, v, ld)
    elif op == "ssd":
        fn, args = ssd_attention, (q, k, v, ld)
    else:
        def fn(q, k, v, cu_seqlens, chunk_size):
            return cosformer_attention(q, k, v, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                                       causal=op == "cosformer")[0], None
        args = (q, k, v)
    leaves = [x.requires_grad_() for x in args]
    torch._dynamo.reset()
    compiled = torch.compile(lambda *xs, cu_seqlens: fn(*xs, cu_seqlens=cu_seqlens, chunk_size=16)[0],
                             fullgraph=True, backend="aot_eager")
    out = compiled(*leaves, cu_seqlens=torch.tensor(cu))
    ref = fn(*leaves, cu_seqlens=torch.tensor(cu), chunk_size=16)[0]
    assert rel_rms(out, ref) < 1e-6
    got = torch.autograd.grad(out.square().sum(), leaves)
    want = torch.autograd.grad(ref.square().sum(), leaves)
    for a, b in zip(got, want):
        assert rel_rms(a, b) < 1e-5
    with pytest.raises(RuntimeError, match="cu_seqlens must start at 0"):  # the check, as an assert in the graph
        compiled(*leaves, cu_seqlens=torch.tensor([0, 3, cu[-1] - 1]))


@pytest.mark.cuda
@pytest.mark.parametrize("op", ["gla", "ssd"])
def test_cuda_chunked_documents_alone(op):
    """On CUDA ("fast": the chunked form; "auto" would take fla's varlen kernel where fla is installed)."""
    fn, vector = (gla_attention, True) if op == "gla" else (ssd_attention, False)
    cu = offsets([300, 1, 211, 0, 512])
    inputs = [x.cuda() for x in make(cu[-1], vector, H=4, Dk=64, Dv=64)]
    o, s = fn(*inputs, impl="fast", cu_seqlens=torch.tensor(cu, device="cuda"))
    ro, rs = per_document(fn, [x.double() for x in inputs], cu)
    assert rel_rms(o, ro) < 1e-3 and rel_rms(s, rs) < 1e-3


@pytest.mark.cuda
@pytest.mark.parametrize("op", ["gla", "ssd"])
def test_cuda_fla_varlen_documents_alone(op):
    """fla's varlen kernels take cu_seqlens as they are (fla's convention is ours)."""
    pytest.importorskip("fla")
    fn, vector = (gla_attention, True) if op == "gla" else (ssd_attention, False)
    cu = offsets([300, 1, 211, 512])
    inputs = [x.cuda() for x in make(cu[-1], vector, H=4, Dk=64, Dv=64)]
    with torch.no_grad():
        o, s = fn(*inputs, impl="fla", cu_seqlens=torch.tensor(cu, device="cuda"))
    ro, rs = per_document(fn, [x.double() for x in inputs], cu)
    assert rel_rms(o, ro) < 2e-3 and rel_rms(s, rs) < 2e-3
