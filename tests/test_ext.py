"""The compiled CPU kernels (ops/csrc/, loaded by ops/_ext.py): fused principled attention and
chunked GLA against their naive references on outputs and every gradient, on awkward shapes and
hostile inputs, each run both on the kernels and on the pure-PyTorch fallback; plus the build,
the fallback warning, grouped heads read in place and results independent of the thread count."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from attnlab.ops import _ext, gla_attention, principled_attention
from attnlab.ops.principled import cpu as principled_cpu
from attnlab.testing import LargestTensor, compare_fwd_bwd, rel_rms

TOL = 1e-4
B, H, D, DG, DV = 2, 4, 8, 4, 6


pytestmark = pytest.mark.usefixtures("one_thread")


def _kernels_or_skip():
    if _ext.library() is None:
        pytest.skip("compiled kernels unavailable on this machine (no C++ compiler or build failed)")


@pytest.fixture
def path(cpu_kernels):
    """Run the test on the compiled kernels and on the pure-PyTorch fast path (conftest.cpu_kernels)."""
    return cpu_kernels


def _rand(g, *shape, dtype=torch.float32, scale=1.0, shift=0.0):
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale + shift).to(dtype).requires_grad_()


def principled_inputs(Tq, Tk=None, form="query", v0="head", groups=(H, H, H), dtype=torch.float32, seed=0,
                      q_scale=1.0, gate_shift=0.0):
    """[q, k, qg, kg, v, alpha, beta, gamma, v0]; groups = heads of (k, kg, v)."""
    g = torch.Generator().manual_seed(seed)
    Tk = Tk or Tq
    Gk, Gg, Gv = groups
    q, k = _rand(g, B, H, Tq, D, dtype=dtype, scale=q_scale), _rand(g, B, Gk, Tk, D, dtype=dtype)
    qg, kg = _rand(g, B, H, Tq, DG, dtype=dtype), _rand(g, B, Gg, Tk, DG, dtype=dtype, scale=0.5, shift=gate_shift)
    v = _rand(g, B, Gv, Tk, DV, dtype=dtype)
    shape = {"float": None, "head": (H,), "query": (B, H, Tq)}[form]
    if shape is None:
        alpha, beta, gamma = 0.3, -0.5, 0.4
    else:
        alpha, beta, gamma = (_rand(g, *shape, dtype=dtype, scale=0.5), _rand(g, *shape, dtype=dtype, scale=0.5),
                              _rand(g, *shape, dtype=dtype, scale=0.3, shift=0.4))
    v0_t = {"none": None, "shared": _rand(g, DV, dtype=dtype), "head": _rand(g, H, DV, dtype=dtype)}[v0]
    return [q, k, qg, kg, v, alpha, beta, gamma, v0_t]


def principled(impl, causal=True, **kw):
    def fn(q, k, qg, kg, v, alpha, beta, gamma, v0):
        o, w0 = principled_attention(q, k, qg, kg, v, alpha=alpha, beta=beta, gamma=gamma, v0=v0, causal=causal,
                                     impl=impl, return_ground=True, **kw)
        return torch.cat([o.flatten(), w0.flatten()])
    return fn


def assert_close(errs, tol=TOL):
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"relative RMS errors above {tol}: {bad}"


PRINCIPLED_CASES = {
    "T1": dict(Tq=1),
    "T63-blocks16": dict(Tq=63, form="head", v0="shared", blocks=(16, 16)),
    "T130": dict(Tq=130),
    "T130-full-float": dict(Tq=130, form="float", v0="none", causal=False),
    "Tq20<Tk53": dict(Tq=20, Tk=53, blocks=(8, 16)),
    "Tq20<Tk53-full": dict(Tq=20, Tk=53, causal=False),
    "decode-Tq1-Tk70": dict(Tq=1, Tk=70),
    "G<H-mixed-groups": dict(Tq=63, groups=(2, 1, 4)),
    "G<H-Tq<Tk": dict(Tq=9, Tk=40, groups=(1, 2, 2), blocks=(4, 8)),
    "odd-blocks": dict(Tq=70, blocks=(7, 13)),
    # logits in the hundreds: the float32 naive path itself is off by ~1e-4 in dalpha, so both
    # are measured against it in float64
    "large-logits": dict(Tq=63, q_scale=20.0, ref64=True),
    "gates-against": dict(Tq=63, gate_shift=-6.0),
}


@pytest.mark.parametrize("case", PRINCIPLED_CASES.values(), ids=PRINCIPLED_CASES.keys())
def test_principled_matches_naive(path, case):
    case = dict(case)
    causal, blocks, ref64 = case.pop("causal", True), case.pop("blocks", (None, None)), case.pop("ref64", False)
    inputs = principled_inputs(**case)
    fast = principled("fast", causal, block_q=blocks[0], block_k=blocks[1])
    errs = compare_fwd_bwd(fast, naive64(causal) if ref64 else principled("naive", causal), inputs)
    n_grads = sum(isinstance(x, torch.Tensor) for x in inputs)
    assert len(errs) == 1 + n_grads  # the output and the gradient of every tensor input
    assert_close(errs, 1e-3 if ref64 else TOL)


@pytest.mark.heavy
def test_principled_float64_and_gradcheck(path):
    inputs = principled_inputs(33, Tk=40, dtype=torch.float64, groups=(2, 4, 1))
    assert_close(compare_fwd_bwd(principled("fast", block_q=8, block_k=16), principled("naive"), inputs), 1e-10)
    small = [x.detach().requires_grad_() if isinstance(x, torch.Tensor) else x
             for x in principled_inputs(5, Tk=7, dtype=torch.float64, groups=(2, 2, 4), seed=3)]
    assert torch.autograd.gradcheck(principled("fast", block_q=2, block_k=3), small, eps=1e-6, atol=1e-6)


def naive64(causal=True):
    """The naive reference in float64 on float32 inputs (gradients come back as float32)."""
    naive = principled("naive", causal)
    return lambda *xs: naive(*(x.double() if isinstance(x, torch.Tensor) else x for x in xs)).float()


@pytest.mark.parametrize("gamma_shift", [-40.0, 8.0], ids=["nothing-grounded", "all-grounded"])
def test_principled_threshold_extremes(path, gamma_shift):
    """With every key far above the threshold the ground weight is exactly 0, and the gradients of
    gamma and v0 vanish (to rounding in the float32 naive path, whose 1 - sum w is not exactly 0),
    so they are checked for size; with every key below it the ground state takes most of the mass."""
    inputs = principled_inputs(45, seed=4)
    inputs[7] = (inputs[7].detach() + gamma_shift).requires_grad_()
    fast = principled("fast", block_q=16, block_k=16)
    errs = compare_fwd_bwd(fast, naive64(), inputs)
    if gamma_shift < 0:
        del errs["grad7"], errs["grad8"]  # relative errors of values that are 0 up to rounding
    assert_close(errs, 1e-3 if gamma_shift < 0 else TOL)  # dalpha = sum ds (s - gamma) cancels at gamma = -40
    q, k, qg, kg, v, alpha, beta, gamma, v0 = (x.detach().requires_grad_() for x in inputs)
    o, w0 = principled_attention(q, k, qg, kg, v, alpha=alpha, beta=beta, gamma=gamma, v0=v0, return_ground=True)
    (o.square().sum() + w0.sum()).backward()
    assert (w0 >= 0).all() and (w0 <= 1).all()
    if gamma_shift < 0:
        assert (w0 == 0).all() and (v0.grad == 0).all() and gamma.grad.abs().max() < 1e-3
    else:
        assert (w0 > 0.5).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_principled_ties_at_the_threshold(path, dtype):
    """q = 0 rows give s = 0 = gamma and saturated gates give softplus(-g) = 0: logits exactly at the
    threshold, whose gradient torch.maximum splits evenly."""
    q, k, qg, kg, v, *_ = principled_inputs(12, dtype=dtype, seed=5)
    with torch.no_grad():
        q[:, :, ::3] = 0.0
        qg.fill_(15.0)
        kg.fill_(15.0)
    gamma = torch.zeros(H, dtype=dtype, requires_grad=True)
    inputs = [q, k, qg, kg, v, 0.5, 0.2, gamma, torch.randn(DV, dtype=dtype)]
    tol = TOL if dtype == torch.float32 else 1e-10
    assert_close(compare_fwd_bwd(principled("fast", block_q=4, block_k=4), principled("naive"), inputs), tol)


def test_principled_bf16(path):
    inputs = principled_inputs(33, groups=(2, 2, 2), seed=6)
    ref = principled("naive")(*inputs)
    low = [x.detach().bfloat16() if isinstance(x, torch.Tensor) else x for x in inputs]
    out = principled("fast")(*low)
    assert out.dtype == torch.bfloat16 and rel_rms(out.float(), ref) < 2e-2


def test_principled_non_contiguous_inputs(path):
    q, k, qg, kg, v, alpha, beta, gamma, v0 = principled_inputs(30, seed=7)
    tq, tk, tqg, tkg, tv = (x.detach().transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, qg, kg, v))
    assert not tq.is_contiguous()
    a = principled_attention(tq, tk, tqg, tkg, tv, alpha=alpha, beta=beta, gamma=gamma, v0=v0)
    b = principled_attention(q, k, qg, kg, v, alpha=alpha, beta=beta, gamma=gamma, v0=v0, impl="naive")
    assert rel_rms(a, b) <= TOL


# ------------------------------------------------------------------------------------------ gla

DK = 8


def gla_inputs(T, dtype=torch.float32, strong=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, H, T, DK, generator=g), torch.randn(B, H, T, DK, generator=g)
    v = torch.randn(B, H, T, DV, generator=g)
    ld = F.logsigmoid(torch.randn(B, H, T, DK, generator=g) + 2.0)
    if strong:  # about -20 on half the entries: cumulative log-decays of hundreds inside a chunk
        ld = torch.where(torch.rand(ld.shape, generator=g) < 0.5, -20.0 + 0.5 * torch.randn(ld.shape, generator=g), ld)
    s0 = torch.randn(B, H, DK, DV, generator=g)
    return [x.to(dtype).requires_grad_() for x in (q, k, v, ld, s0)]


def gla(impl, chunk_size=64):
    def fn(q, k, v, ld, s0):
        o, s = gla_attention(q, k, v, ld, initial_state=s0, impl=impl, chunk_size=chunk_size, scale=0.7)
        return torch.cat([o.flatten(), s.flatten()])  # one cotangent reaches the output and the final state
    return fn


GLA_CASES = [(1, 16), (63, 16), (63, 21), (130, 64), (130, 48), (130, 7), (200, 200)]


@pytest.mark.parametrize("T,C", GLA_CASES, ids=[f"T{t}-C{c}" for t, c in GLA_CASES])
def test_gla_matches_naive(path, T, C):
    errs = compare_fwd_bwd(gla("fast", C), gla("naive"), gla_inputs(T))
    assert set(errs) == {"out", "grad0", "grad1", "grad2", "grad3", "grad4"}  # q, k, v, log_decay, initial state
    assert_close(errs)


def test_gla_strong_decay(path):
    inputs = gla_inputs(130, strong=True, seed=1)
    assert_close(compare_fwd_bwd(gla("fast", 64), gla("naive"), inputs))
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    gla("fast", 64)(*leaves).square().sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in leaves)


def test_gla_float64_and_gradcheck(path):
    assert_close(compare_fwd_bwd(gla("fast", 16), gla("naive"), gla_inputs(70, torch.float64, seed=2)), 1e-10)
    small = [x.detach()[:1, :1].requires_grad_() for x in gla_inputs(9, torch.float64, seed=3)]
    assert torch.autograd.gradcheck(gla("fast", 4), small, eps=1e-6, atol=1e-6)


def test_gla_bf16(path):
    q, k, v, ld, s0 = (x.detach() for x in gla_inputs(50, seed=4))
    low = [x.bfloat16() for x in (q, k, v, ld)]
    o, s = gla_attention(*low, chunk_size=16)
    ref, s_ref = gla_attention(*(x.float() for x in low), impl="naive")
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert rel_rms(o, ref) <= 1e-2 and rel_rms(s, s_ref) <= TOL


# ------------------------------------------------------------------------------------------ the library


def test_kernels_build_here():
    """This machine has a compiler (the test suite's own requirement), so the kernels must load."""
    assert _ext.library() is not None


def test_env_var_and_context_select_the_fallback(monkeypatch):
    _kernels_or_skip()
    monkeypatch.setenv("ATTNLAB_NO_EXT", "1")
    assert _ext.library() is None
    monkeypatch.delenv("ATTNLAB_NO_EXT")
    with _ext.disabled():
        assert _ext.library() is None
    assert _ext.library() is not None


def test_failed_build_warns_once_and_falls_back(monkeypatch):
    def broken(verbose=False):
        raise RuntimeError("compiler exploded")

    monkeypatch.delenv("ATTNLAB_NO_EXT", raising=False)
    monkeypatch.setattr(_ext, "build", broken)
    monkeypatch.setattr(_ext, "_lib", None)
    monkeypatch.setattr(_ext, "_tried", False)
    with pytest.warns(RuntimeWarning, match="compiler exploded"):
        assert _ext.library() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _ext.library() is None  # no second warning
        inputs = principled_inputs(20, seed=8)
        assert_close(compare_fwd_bwd(principled("fast"), principled("naive"), inputs))




def test_grouped_heads_are_read_in_place():
    """With one key group for four heads the forward never holds keys for every head."""
    _kernels_or_skip()
    q, k, qg, kg, v, alpha, beta, gamma, v0 = (x.detach() if isinstance(x, torch.Tensor) else x
                                              for x in principled_inputs(4, Tk=300, groups=(1, 1, 1)))
    with LargestTensor() as seen:
        principled_attention(q, k, qg, kg, v, alpha=alpha, beta=beta, gamma=gamma, v0=v0)
    assert seen.numel < B * H * 300 * D


def test_results_do_not_depend_on_the_thread_count():
    _kernels_or_skip()
    p_inputs, g_inputs = principled_inputs(90, seed=9), gla_inputs(90, seed=9)
    runs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        outs = []
        for fn, inputs in ((principled("fast", block_q=16, block_k=16), p_inputs), (gla("fast", 16), g_inputs)):
            leaves = [x.detach().clone().requires_grad_() if isinstance(x, torch.Tensor) else x for x in inputs]
            out = fn(*leaves)
            out.backward(torch.ones_like(out))
            outs += [out.detach()] + [x.grad for x in leaves if isinstance(x, torch.Tensor)]
        runs.append(outs)
    torch.set_num_threads(1)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_backward_follows_the_forward_route():
    """A graph built on the kernels differentiates on them even if the kernels are switched off
    before backward (as a benchmark or a test toggling them might)."""
    _kernels_or_skip()
    inputs = principled_inputs(20, seed=10)
    q, k, qg, kg, v, alpha, beta, gamma, v0 = inputs
    o = principled_attention(q, k, qg, kg, v, alpha=alpha, beta=beta, gamma=gamma, v0=v0)
    o.sum().backward()
    on_kernels = q.grad.clone()
    q.grad = None
    calls, real = [], principled_cpu._principled_bwd

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    principled_cpu._principled_bwd = counted
    try:
        o = principled_attention(q, k, qg, kg, v, alpha=alpha, beta=beta, gamma=gamma, v0=v0)
        with _ext.disabled():
            o.sum().backward()
    finally:
        principled_cpu._principled_bwd = real
    assert calls == [1]  # the fused backward ran, not the fallback's autograd
    assert torch.equal(q.grad, on_kernels)


def test_a_killed_builds_lock_does_not_hang_the_next_build(tmp_path):
    """torch's build lock left by a killed process (older than a build takes) is removed with a warning
    naming it; a fresh lock (a build under way elsewhere) and a missing one are left alone."""
    import os
    import time

    from attnlab.ops._ext import clear_stale_lock

    assert not clear_stale_lock(tmp_path)
    lock = tmp_path / "lock"
    lock.touch()
    assert not clear_stale_lock(tmp_path) and lock.exists()
    old = time.time() - 3600
    os.utime(lock, (old, old))
    with pytest.warns(RuntimeWarning, match="removed a build lock"):
        assert clear_stale_lock(tmp_path)
    assert not lock.exists()
