"""The linear family (cosformer, gla, ssd): recurrent vs chunked forms, states, decode steps,
brute-force references, strong decay and input checks."""

import math

import pytest
import torch
import torch.nn.functional as F

from attnlab.ops.cosformer import CosformerState, cosformer_attention
from attnlab.ops.cosformer import cosformer_step
from attnlab.ops.gla import gla_attention, gla_step, ssd_attention, ssd_step
from attnlab.testing import compare_fwd_bwd, rel_rms

TOL = 1e-4
B, H, DK, DV = 2, 2, 8, 6
# (T, chunk_size): chunk sizes that divide T and that do not; 21 and 48 exercise sub-chunks of 7 and 16
SHAPES = [(1, 16), (63, 21), (63, 16), (257, 64), (257, 48), (256, 64)]
SHAPE_IDS = [f"T{t}-C{c}" for t, c in SHAPES]
DECAY_OPS = {"gla": (gla_attention, gla_step, "vector"), "ssd": (ssd_attention, ssd_step, "scalar")}


def _decay_inputs(T, op, dtype=torch.float32, strong=False):
    """q, k, v, log_decay, initial_state for gla or ssd; all leaves requiring grad.
    strong: log_decay about -20 on a random half of the entries, mild elsewhere."""
    q, k = torch.randn(B, H, T, DK, dtype=dtype), torch.randn(B, H, T, DK, dtype=dtype)
    v = torch.randn(B, H, T, DV, dtype=dtype)
    ld_shape = (B, H, T, DK) if DECAY_OPS[op][2] == "vector" else (B, H, T)
    ld = F.logsigmoid(torch.randn(ld_shape, dtype=dtype) + 2.0)
    if strong:
        ld = torch.where(torch.rand(ld_shape) < 0.5, -20.0 + 0.5 * torch.randn(ld_shape, dtype=dtype), ld)
    s0 = torch.randn(B, H, DK, DV, dtype=dtype)
    return [x.detach().requires_grad_() for x in (q, k, v, ld, s0)]


def _decay_fn(op, impl, chunk_size=64):
    fn = DECAY_OPS[op][0]

    def run(q, k, v, ld, s0):
        o, s = fn(q, k, v, ld, initial_state=s0, impl=impl, chunk_size=chunk_size)
        return torch.cat([o.flatten(), s.flatten()])  # one cotangent covers the output and the final state

    return run


def _cos_inputs(T, reweight=True):
    """q, k, v and an initial state's kv, k_sum; q, k mostly positive so the normaliser stays away from 0."""
    Fd = 2 * DK if reweight else DK
    q, k = torch.randn(B, H, T, DK) + 1.0, torch.randn(B, H, T, DK) + 1.0
    v = torch.randn(B, H, T, DV)
    kv, ks = torch.randn(B, H, Fd, DV), torch.rand(B, H, Fd) * 4
    return [x.requires_grad_() for x in (q, k, v, kv, ks)]


def _cos_fn(impl, C=64, offset=3, **kw):
    def run(q, k, v, kv, ks):
        horizon = offset + q.shape[2] + 4 if kw.get("reweight", True) else None
        st = CosformerState(kv, ks, offset, horizon)
        o, s = cosformer_attention(q, k, v, initial_state=st, impl=impl, chunk_size=C, **kw)
        return torch.cat([o.flatten(), s.kv.flatten(), s.k_sum.flatten()])

    return run


# ---------------------------------------------------------------- recurrent vs chunked


@pytest.mark.parametrize("op", ["gla", "ssd"])
@pytest.mark.parametrize("T,C", SHAPES, ids=SHAPE_IDS)
def test_decay_naive_vs_chunked(op, T, C):
    errs = compare_fwd_bwd(_decay_fn(op, "fast", C), _decay_fn(op, "naive"), _decay_inputs(T, op))
    assert set(errs) == {"out", "grad0", "grad1", "grad2", "grad3", "grad4"}
    assert max(errs.values()) <= TOL, errs


COS_MODES = [
    dict(causal=True, normalize=True, reweight=True),
    dict(causal=True, normalize=False, reweight=True),
    dict(causal=True, normalize=True, reweight=False),
    dict(causal=False, normalize=True, reweight=True),
    dict(causal=False, normalize=False, reweight=False),
]
COS_IDS = ["causal", "causal-unnormalized", "causal-noreweight", "global", "global-plain"]


@pytest.mark.parametrize("mode", COS_MODES, ids=COS_IDS)
@pytest.mark.parametrize("T,C", SHAPES, ids=SHAPE_IDS)
def test_cosformer_naive_vs_chunked(mode, T, C):
    inputs = _cos_inputs(T, mode["reweight"])
    errs = compare_fwd_bwd(_cos_fn("fast", C, **mode), _cos_fn("naive", **mode), inputs)
    assert set(errs) == {"out", "grad0", "grad1", "grad2", "grad3", "grad4"}
    assert max(errs.values()) <= TOL, errs


def test_auto_is_fast():
    q, k, v, ld, s0 = (x.detach() for x in _decay_inputs(40, "gla"))
    a = gla_attention(q, k, v, ld, chunk_size=16)
    b = gla_attention(q, k, v, ld, impl="fast", chunk_size=16)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---------------------------------------------------------------- brute-force references (T = 8, float64)


def _brute_decay(q, k, v, ld, s0, scale):
    """o_t = sum_{s<=t} sum_d q_td k_sd prod_{r=s+1..t} a_rd v_s + sum_d q_td prod_{r<=t} a_rd S0_d."""
    a = torch.exp(ld)  # (B, H, T, Dk)
    T = q.shape[2]
    o = torch.zeros(q.shape[:3] + (v.shape[-1],), dtype=q.dtype)
    for t in range(T):
        carry = torch.prod(a[:, :, : t + 1], dim=2)  # (B, H, Dk)
        o[:, :, t] = torch.einsum("bhd,bhd,bhde->bhe", q[:, :, t], carry, s0)
        for s in range(t + 1):
            w = torch.prod(a[:, :, s + 1 : t + 1], dim=2)  # empty product = 1
            o[:, :, t] += torch.einsum("bhd,bhd,bhd->bh", q[:, :, t], w, k[:, :, s])[..., None] * v[:, :, s]
    return scale * o


@pytest.mark.parametrize("op", ["gla", "ssd"])
@pytest.mark.parametrize("impl", ["naive", "fast"])
def test_decay_brute_force(op, impl):
    q, k, v, ld, s0 = (x.detach().double() for x in _decay_inputs(8, op))
    ld_full = ld if op == "gla" else ld[..., None].expand(B, H, 8, DK)
    ref = _brute_decay(q, k, v, ld_full, s0, 0.7)
    o, s = DECAY_OPS[op][0](q, k, v, ld, scale=0.7, initial_state=s0, impl=impl, chunk_size=3)
    assert rel_rms(o, ref) <= 1e-10
    s_ref = torch.prod(torch.exp(ld_full), 2)[..., None] * s0
    for t in range(8):
        s_ref = s_ref + torch.prod(torch.exp(ld_full[:, :, t + 1 :]), 2)[..., None] * k[:, :, t, :, None] * v[:, :, t, None]
    assert rel_rms(s, s_ref) <= 1e-10


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "global"])
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "nonorm"])
@pytest.mark.parametrize("impl", ["naive", "fast"])
def test_cosformer_brute_force(causal, normalize, impl):
    """Explicit T x T scores relu(q_i).relu(k_j) cos(pi (i - j) / (2M)) at positions offset + i."""
    T, M, off, eps = 8, 20, 5, 1e-6
    q, k, v, kv0, ks0 = (x.detach().double() for x in _cos_inputs(T))
    st = CosformerState(kv0, ks0, off, M)
    o, s = cosformer_attention(q, k, v, causal=causal, normalize=normalize, initial_state=st, impl=impl, chunk_size=3)
    i = torch.arange(T, dtype=torch.float64)
    w = torch.cos(math.pi * (i[:, None] - i[None, :]) / (2 * M))  # (T, T)
    if causal:
        w = w.tril()
    scores = (torch.relu(q) @ torch.relu(k).transpose(-1, -2)) * w  # (B, H, T, T)
    th = math.pi * (off + i) / (2 * M)
    qf = torch.cat([torch.relu(q) * torch.cos(th)[:, None], torch.relu(q) * torch.sin(th)[:, None]], -1)
    num = scores @ v + qf @ kv0
    den = scores.sum(-1) + (qf * ks0[:, :, None]).sum(-1)
    ref = num / (den + eps)[..., None] if normalize else num
    assert rel_rms(o, ref) <= 1e-10
    kf = torch.cat([torch.relu(k) * torch.cos(th)[:, None], torch.relu(k) * torch.sin(th)[:, None]], -1)
    assert rel_rms(s.kv, kv0 + kf.transpose(-1, -2) @ v) <= 1e-10
    assert rel_rms(s.k_sum, ks0 + kf.sum(2)) <= 1e-10
    assert (s.offset, s.max_len) == (off + T, M)


def test_cosformer_default_horizon_is_sequence_length():
    T = 12
    q, k, v = (x.detach() for x in _cos_inputs(T)[:3])
    a, sa = cosformer_attention(q, k, v)
    b, _ = cosformer_attention(q, k, v, max_len=T)
    c, _ = cosformer_attention(q, k, v, max_len=4 * T)
    assert sa.max_len == T and sa.offset == T
    assert torch.equal(a, b) and rel_rms(a, c) > 1e-3


# ---------------------------------------------------------------- state continuation and decode steps


@pytest.mark.parametrize("op", ["gla", "ssd"])
@pytest.mark.parametrize("impl", ["naive", "fast"])
def test_decay_split_equals_whole(op, impl):
    fn = DECAY_OPS[op][0]
    q, k, v, ld, s0 = (x.detach() for x in _decay_inputs(70, op))
    whole, s_whole = fn(q, k, v, ld, initial_state=s0, impl=impl, chunk_size=16)
    o1, s1 = fn(q[:, :, :29], k[:, :, :29], v[:, :, :29], ld[:, :, :29], initial_state=s0, impl=impl, chunk_size=16)
    o2, s2 = fn(q[:, :, 29:], k[:, :, 29:], v[:, :, 29:], ld[:, :, 29:], initial_state=s1, impl=impl, chunk_size=16)
    assert rel_rms(torch.cat([o1, o2], 2), whole) <= TOL
    assert rel_rms(s2, s_whole) <= TOL


@pytest.mark.parametrize("op", ["gla", "ssd"])
def test_decay_step_equals_full(op):
    fn, step, _ = DECAY_OPS[op]
    T = 20
    q, k, v, ld, s0 = (x.detach() for x in _decay_inputs(T, op))
    full, s_full = fn(q, k, v, ld, initial_state=s0, chunk_size=8)
    state, outs = s0, []
    for t in range(T):
        o_t, state = step(q[:, :, t], k[:, :, t], v[:, :, t], ld[:, :, t], state)
        outs.append(o_t)
    assert rel_rms(torch.stack(outs, 2), full) <= TOL
    assert rel_rms(state, s_full) <= TOL
    o0, st0 = step(q[:, :, 0], k[:, :, 0], v[:, :, 0], ld[:, :, 0])  # no state: starts from zeros
    ref, _ = fn(q[:, :, :1], k[:, :, :1], v[:, :, :1], ld[:, :, :1])
    assert rel_rms(o0, ref[:, :, 0]) <= TOL and st0.shape == (B, H, DK, DV)


@pytest.mark.parametrize("reweight", [True, False], ids=["reweight", "plain"])
@pytest.mark.parametrize("impl", ["naive", "fast"])
def test_cosformer_split_equals_whole(reweight, impl):
    q, k, v = (x.detach() for x in _cos_inputs(70)[:3])
    M = 100 if reweight else None
    whole, s_whole = cosformer_attention(q, k, v, max_len=M, reweight=reweight, impl=impl, chunk_size=16)
    o1, s1 = cosformer_attention(q[:, :, :29], k[:, :, :29], v[:, :, :29], max_len=M, reweight=reweight, impl=impl)
    o2, s2 = cosformer_attention(q[:, :, 29:], k[:, :, 29:], v[:, :, 29:], reweight=reweight, initial_state=s1, impl=impl)
    assert rel_rms(torch.cat([o1, o2], 2), whole) <= TOL
    assert rel_rms(s2.kv, s_whole.kv) <= TOL and rel_rms(s2.k_sum, s_whole.k_sum) <= TOL
    assert s2.offset == 70 and s2.max_len == M


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "nonorm"])
def test_cosformer_step_equals_full(normalize):
    T, M = 20, 32
    q, k, v = (x.detach() for x in _cos_inputs(T)[:3])
    full, s_full = cosformer_attention(q, k, v, max_len=M, normalize=normalize, chunk_size=8)
    state, outs = None, []
    for t in range(T):
        o_t, state = cosformer_step(q[:, :, t], k[:, :, t], v[:, :, t], state, max_len=M, normalize=normalize)
        outs.append(o_t)
    assert rel_rms(torch.stack(outs, 2), full) <= TOL
    assert rel_rms(state.kv, s_full.kv) <= TOL and state.offset == T and state.max_len == M


# ---------------------------------------------------------------- numerics


@pytest.mark.parametrize("op", ["gla", "ssd"])
def test_strong_decay_stays_finite(op):
    """log_decay about -20 on half the steps: cumulative log-decays reach about -650 inside a chunk."""
    inputs = _decay_inputs(130, op, strong=True)
    assert inputs[3].min() < -20
    errs = compare_fwd_bwd(_decay_fn(op, "fast", 64), _decay_fn(op, "naive"), inputs)
    assert max(errs.values()) <= TOL, errs
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    _decay_fn(op, "fast", 64)(*leaves).square().sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in leaves)


@pytest.mark.parametrize("op", ["gla", "ssd"])
def test_bf16_inputs(op):
    """16-bit inputs are computed in float32: bf16 output equals the float32 result rounded."""
    q, k, v, ld, s0 = (x.detach() for x in _decay_inputs(50, op))
    lo = [x.bfloat16() for x in (q, k, v, ld)]
    o, s = DECAY_OPS[op][0](*lo, chunk_size=16)
    ref, s_ref = DECAY_OPS[op][0](*(x.float() for x in lo), impl="naive")
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert rel_rms(o, ref) <= 1e-2 and rel_rms(s, s_ref) <= TOL


# ---------------------------------------------------------------- bad input


def _decay_args(op, T=6):
    return [x.detach() for x in _decay_inputs(T, op)]


@pytest.mark.parametrize("op", ["gla", "ssd"])
def test_decay_bad_input(op):
    fn, step, _ = DECAY_OPS[op]
    q, k, v, ld, s0 = _decay_args(op)
    with pytest.raises(ValueError, match="log_decay must be <= 0"):
        fn(q, k, v, ld.abs() + 0.1)
    with pytest.raises(ValueError, match="log_decay must be finite"):
        fn(q, k, v, torch.full_like(ld, float("-inf")))
    with pytest.raises(ValueError, match=r"log_decay must have shape"):
        fn(q, k, v, ld[:, :, :-1])
    with pytest.raises(ValueError, match="causal must be True"):
        fn(q, k, v, ld, causal=False)
    with pytest.raises(ValueError, match="initial_state must have shape"):
        fn(q, k, v, ld, initial_state=s0[..., :-1])
    with pytest.raises(ValueError, match="impl must be one of"):
        fn(q, k, v, ld, impl="cuda")
    with pytest.raises(ValueError, match="chunk_size must be a positive int, got 0"):
        fn(q, k, v, ld, chunk_size=0)
    with pytest.raises(ValueError, match="q and k must agree"):
        fn(q, k[..., :-1], v, ld)
    with pytest.raises(ValueError, match="q and v must agree"):
        fn(q, k, v[:, :, :-1], ld)
    with pytest.raises(ValueError, match="scale must be > 0"):
        fn(q, k, v, ld, scale=-1.0)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        fn(q.numpy(), k, v, ld)
    with pytest.raises(ValueError, match="state must have shape"):
        step(q[:, :, 0], k[:, :, 0], v[:, :, 0], ld[:, :, 0], s0[:, :1])
    with pytest.raises(ValueError, match="log_decay_t must be <= 0"):
        step(q[:, :, 0], k[:, :, 0], v[:, :, 0], -ld[:, :, 0] + 1.0, s0)


def test_cosformer_bad_input():
    q, k, v, kv, ks = (x.detach() for x in _cos_inputs(6))
    with pytest.raises(ValueError, match="max_len=4 is too small"):
        cosformer_attention(q, k, v, max_len=4)
    with pytest.raises(ValueError, match="max_len must be a positive int"):
        cosformer_attention(q, k, v, max_len=0)
    with pytest.raises(ValueError, match="disagrees with the state's horizon"):
        cosformer_attention(q, k, v, initial_state=CosformerState(kv, ks, 0, 50), max_len=60)
    with pytest.raises(ValueError, match=r"initial_state.kv must have shape"):
        cosformer_attention(q, k, v, initial_state=CosformerState(kv, ks, 0, 50), reweight=False)
    with pytest.raises(TypeError, match="initial_state must be a CosformerState"):
        cosformer_attention(q, k, v, initial_state=(kv, ks))
    with pytest.raises(ValueError, match="eps must be > 0"):
        cosformer_attention(q, k, v, eps=0.0)
    with pytest.raises(ValueError, match="impl must be one of"):
        cosformer_attention(q, k, v, impl="chunked")
    with pytest.raises(ValueError, match="q and k must agree"):
        cosformer_attention(q, k[:, :1], v)
    with pytest.raises(ValueError, match="max_len must be given"):
        cosformer_step(q[:, :, 0], k[:, :, 0], v[:, :, 0])
    with pytest.raises(ValueError, match="max_len=10 is too small"):
        cosformer_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], CosformerState(kv, ks, 10, 10))
