"""gla_attention and ssd_attention through flash-linear-attention (impl="fla"; "auto" on CUDA).

fla's Triton kernels need a GPU (they do not run under TRITON_INTERPRET either), so on the CPU the
conversion is proven with fla's own pure-PyTorch references: the public op runs its fla route with
fla's naive recurrence (or naive chunked form) standing in for the chunked kernel, called with the
same arguments in the same layout, and must agree with attnlab's naive op on the output, the final
state and every gradient. The tests marked cuda run the real kernels at a GPU-sized shape."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from attnlab.ops.gla import fla as fla_mod
from attnlab.ops.gla import gla_attention, ssd_attention
from attnlab.testing import compare_fwd_bwd, rel_rms

OPS = {"gla": (gla_attention, True), "ssd": (ssd_attention, False)}  # name -> (op, per-channel decay)
NAMES = ("q", "k", "v", "log_decay", "initial_state")


def _inputs(op, B, H, T, Dk, Dv, dtype=torch.float32, device="cpu", seed=0) -> list[torch.Tensor]:
    """q, k, v, log_decay (logsigmoid, so <= 0) in `dtype` and an initial state in the compute dtype."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    ld_shape = (B, H, T, Dk) if OPS[op][1] else (B, H, T)
    xs = [r(B, H, T, Dk), r(B, H, T, Dk), r(B, H, T, Dv), F.logsigmoid(r(*ld_shape) + 1.0)]
    xs = [x.to(device, dtype) for x in xs]
    state_dtype = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    xs.append(r(B, H, Dk, Dv).to(device, state_dtype))
    return [x.requires_grad_() for x in xs]


def _call(op, impl, scale=None):
    fn = OPS[op][0]
    return lambda q, k, v, ld, s0: fn(q, k, v, ld, initial_state=s0, scale=scale, impl=impl)


def _naive_kernels(ssd_ref="recurrent", seen=None):
    """fla's references with its kernels' calling convention, kernel(q, k, v, g, scale=,
    initial_state=, output_final_state=), in fla's (B, T, H, D) layout. `seen` collects each call's
    arguments."""
    from fla.ops.gla.naive import naive_recurrent_gla
    from fla.ops.simple_gla.naive import naive_chunk_simple_gla, naive_recurrent_simple_gla

    def gla(q, k, v, g, *, scale, initial_state, output_final_state):
        if seen is not None:
            seen.append(dict(q=q, k=k, v=v, g=g, scale=scale, initial_state=initial_state))
        # fla's GLA reference fixes its scale at 1/sqrt(K): the rest is folded into q, in float32
        q = q.float() * (scale * q.shape[-1] ** 0.5)
        return naive_recurrent_gla(q, k, v, g, initial_state=initial_state, output_final_state=output_final_state)

    ssd_fn = naive_recurrent_simple_gla if ssd_ref == "recurrent" else naive_chunk_simple_gla

    def ssd(q, k, v, g, *, scale, initial_state, output_final_state):
        if seen is not None:
            seen.append(dict(q=q, k=k, v=v, g=g, scale=scale, initial_state=initial_state))
        return ssd_fn(q, k, v, g, scale=scale, initial_state=initial_state, output_final_state=output_final_state)

    return {True: gla, False: ssd}


@pytest.fixture
def fla_on_cpu(monkeypatch):
    """The fla route on the CPU with fla's references in place of its kernels: returns a function
    that installs them (and a list collecting the calls)."""
    pytest.importorskip("fla")

    def install(ssd_ref="recurrent"):
        seen: list = []
        monkeypatch.setattr(fla_mod, "fla_missing", lambda *a, **kw: None)
        monkeypatch.setattr(fla_mod, "fla_kernels", lambda: _naive_kernels(ssd_ref, seen))
        return seen

    return install


# ---------------------------------------------------------------- the conversion, on the CPU


CASES = [("gla", "recurrent"), ("ssd", "recurrent"), ("ssd", "chunk")]


@pytest.mark.parametrize("T", [1, 63, 100], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("scale", [None, 0.7], ids=["scale-default", "scale0.7"])
@pytest.mark.parametrize("op,ref", CASES, ids=[f"{o}-fla-{r}" for o, r in CASES])
def test_conversion_matches_naive_op(fla_on_cpu, op, ref, scale, T):
    """Output, final state and the gradients of q, k, v, log_decay and initial_state."""
    fla_on_cpu(ref)
    errs = compare_fwd_bwd(_call(op, "fla", scale), _call(op, "naive", scale), _inputs(op, 2, 3, T, 16, 24))
    assert set(errs) == {"out", "out1", *(f"grad{i}" for i in range(5))}, errs
    assert max(errs.values()) < 1e-5, errs


@pytest.mark.parametrize("op", ["gla", "ssd"])
def test_conversion_without_initial_state(fla_on_cpu, op):
    seen = fla_on_cpu()
    q, k, v, ld, _ = (x.detach() for x in _inputs(op, 1, 2, 37, 16, 16))
    o, s = OPS[op][0](q, k, v, ld, impl="fla")
    ro, rs = OPS[op][0](q, k, v, ld, impl="naive")
    assert seen[0]["initial_state"] is None
    assert rel_rms(o, ro) < 1e-5 and rel_rms(s, rs) < 1e-5
    assert s.dtype == torch.float32 and s.shape == (1, 2, 16, 16)


@pytest.mark.parametrize("op", ["gla", "ssd"])
def test_sixteen_bit_policy(fla_on_cpu, op):
    """bf16 inputs: q, k, v reach fla in bf16 and (B, T, H, D) layout, the gate in float32, the scale
    as an argument (q is not pre-scaled), the state in float32; the output comes back in bf16 and
    (B, H, T, Dv), the state in float32, matching the naive op (float32 inside) to bf16 rounding."""
    seen = fla_on_cpu()
    xs = [x.detach() for x in _inputs(op, 2, 3, 50, 16, 32, dtype=torch.bfloat16)]
    o, s = OPS[op][0](*xs[:4], initial_state=xs[4], impl="fla", scale=0.3)
    ro, rs = OPS[op][0](*xs[:4], initial_state=xs[4], impl="naive", scale=0.3)
    call = seen[0]
    assert call["q"].dtype == call["k"].dtype == call["v"].dtype == torch.bfloat16
    assert call["g"].dtype == torch.float32 and call["initial_state"].dtype == torch.float32
    assert call["q"].shape == (2, 50, 3, 16) and call["v"].shape == (2, 50, 3, 32)
    assert call["g"].shape == ((2, 50, 3, 16) if op == "gla" else (2, 50, 3))
    assert call["scale"] == 0.3 and torch.equal(call["q"], xs[0].transpose(1, 2))
    assert o.dtype == torch.bfloat16 and o.shape == (2, 3, 50, 32)
    assert s.dtype == torch.float32 and s.shape == (2, 3, 16, 32)
    assert rel_rms(o, ro) < 1e-2 and rel_rms(s, rs) < 1e-5


def test_real_fla_functions_take_what_the_route_passes():
    """The installed fla exports the functions the route calls, with fla's (q, k, v, g) order and the
    keywords it passes."""
    pytest.importorskip("fla")
    from fla.ops.gla import chunk_gla
    from fla.ops.simple_gla import chunk_simple_gla

    kernels = fla_mod.fla_kernels()
    assert not isinstance(kernels, str), kernels
    assert kernels[True] is chunk_gla and kernels[False] is chunk_simple_gla
    for fn in (chunk_gla, chunk_simple_gla):
        sig = inspect.signature(fn)
        assert list(sig.parameters)[:4] == ["q", "k", "v", "g"], sig
        sig.bind("q", "k", "v", "g", scale=0.5, initial_state=None, output_final_state=True)


# ---------------------------------------------------------------- choosing the route


@pytest.mark.parametrize("op", ["gla", "ssd"])
def test_fla_on_the_cpu_raises(op):
    q, k, v, ld, s0 = (x.detach() for x in _inputs(op, 1, 2, 5, 16, 16))
    with pytest.raises(ValueError, match=r"impl='fla' cannot run: fla's Triton kernels run on CUDA tensors, got "
                                         r"device cpu"):
        OPS[op][0](q, k, v, ld, initial_state=s0, impl="fla")
    with pytest.raises(ValueError, match="impl='fla' cannot run"):
        OPS[op][0](q[:, :, :0], k[:, :, :0], v[:, :, :0], ld[:, :, :0], impl="fla")
    with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'naive', 'fast', 'fla'\), got 'triton'"):
        OPS[op][0](q, k, v, ld, impl="triton")


@pytest.mark.parametrize("op", ["gla", "ssd"])
def test_auto_on_the_cpu_never_touches_fla(monkeypatch, op):
    def boom(*a, **kw):
        raise AssertionError("fla consulted on the CPU")

    monkeypatch.setattr(fla_mod, "fla_kernels", boom)
    monkeypatch.setattr(fla_mod, "fla_missing", boom)
    monkeypatch.setattr(fla_mod, "fla_attention", boom)
    xs = _inputs(op, 2, 2, 40, 16, 8)
    a = OPS[op][0](*xs[:4], initial_state=xs[4], impl="auto")
    b = OPS[op][0](*xs[:4], initial_state=xs[4], impl="fast")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_reasons_fla_cannot_run(monkeypatch):
    """`fla_missing` on a CUDA device (nothing here touches the GPU): each reason names its cause."""
    cuda = torch.device("cuda")
    miss = fla_mod.fla_missing
    assert "CUDA tensors" in miss(torch.device("cpu"), torch.float32, 64, 64, True, False)
    assert "got torch.float64" in miss(cuda, torch.float64, 64, 64, True, False)
    assert "Dk=8, Dv=64" in miss(cuda, torch.bfloat16, 8, 64, True, False)
    monkeypatch.setattr(fla_mod, "fla_kernels", lambda: "flash-linear-attention is not installed (x)")
    assert miss(cuda, torch.bfloat16, 64, 64, True, False) == "flash-linear-attention is not installed (x)"
    monkeypatch.setattr(fla_mod, "fla_kernels", lambda: {True: None, False: None})
    monkeypatch.setitem(fla_mod.FLA, "ssd_grad_refused", False)
    assert miss(cuda, torch.bfloat16, 64, 64, True, True) is None
    assert miss(cuda, torch.bfloat16, 64, 64, False, True) is None
    assert "even Dk and Dv" in miss(cuda, torch.bfloat16, 64, 33, False, True)
    assert miss(cuda, torch.float32, 64, 33, False, True) is None
    assert miss(cuda, torch.bfloat16, 64, 33, False, False) is None  # the forward alone is fine
    monkeypatch.setitem(fla_mod.FLA, "ssd_grad_refused", True)
    assert "Hopper" in miss(cuda, torch.bfloat16, 64, 64, False, True)
    assert miss(cuda, torch.bfloat16, 64, 64, False, False) is None
    assert miss(cuda, torch.bfloat16, 64, 64, True, True) is None  # gla's backward is its own kernel


def test_fla_reason_when_not_installed(monkeypatch):
    """Without fla, fla_kernels says so (and the import is retried only once)."""
    monkeypatch.setitem(sys.modules, "fla", None)
    monkeypatch.setattr(fla_mod, "FLA", {})
    reason = fla_mod.fla_kernels()
    assert isinstance(reason, str) and reason.startswith("flash-linear-attention is not installed"), reason
    assert fla_mod.fla_kernels() is reason


@pytest.mark.heavy
def test_import_attnlab_never_needs_fla():
    code = (
        "import sys; sys.modules['fla'] = None\n"
        "import torch, attnlab\n"
        "from attnlab.ops import gla_attention, ssd_attention\n"
        "q = torch.randn(1, 2, 9, 16); ld = -torch.rand(1, 2, 9, 16)\n"
        "gla_attention(q, q, q, ld); ssd_attention(q, q, q, ld[..., 0])\n"
        "try:\n"
        "    gla_attention(q, q, q, ld, impl='fla')\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "impl='fla' cannot run" in p.stdout


# ---------------------------------------------------------------- fla's kernels on a GPU

GPU_SHAPE = dict(B=2, H=4, T=1000, Dk=64, Dv=64)
TOL = {torch.float32: (1e-2, 1e-2), torch.bfloat16: (2e-2, 5e-2)}  # (outputs, gradients): TF32 / bf16 products


def _fwd_bwd(op, impl, xs, cot):
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    o, s = OPS[op][0](*leaves[:4], initial_state=leaves[4], impl=impl)
    grads = torch.autograd.grad([o, s], leaves, [cot[0].to(o.dtype), cot[1].to(s.dtype)])
    return o, s, grads


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("op", ["gla", "ssd"])
def test_fla_kernels_match_naive_on_cuda(op, dtype):
    """fla's kernels against the naive op in float64 on the same (rounded) inputs: outputs, final
    state and the gradients of q, k, v, log_decay and initial_state, by relative RMS."""
    pytest.importorskip("fla")
    sh = GPU_SHAPE
    reason = fla_mod.fla_missing(torch.device("cuda"), dtype, sh["Dk"], sh["Dv"], OPS[op][1], True)
    if reason is not None:
        pytest.skip(reason)
    xs = _inputs(op, *sh.values(), dtype=dtype, device="cuda")
    g = torch.Generator().manual_seed(1)
    cot = [torch.randn(sh["B"], sh["H"], sh["T"], sh["Dv"], generator=g, dtype=torch.float64).cuda(),
           torch.randn(sh["B"], sh["H"], sh["Dk"], sh["Dv"], generator=g, dtype=torch.float64).cuda()]
    o, s, grads = _fwd_bwd(op, "fla", xs, cot)
    ro, rs, rgrads = _fwd_bwd(op, "naive", [x.detach().double() for x in xs], cot)
    assert o.dtype == dtype and s.dtype == torch.float32
    tol_out, tol_grad = TOL[dtype]
    errs = {"out": rel_rms(o, ro, floor=1e-2), "state": rel_rms(s, rs, floor=1e-2)}
    errs.update({f"d{n}": rel_rms(a, b, floor=1e-2) for n, a, b in zip(NAMES, grads, rgrads)})
    assert errs["out"] < tol_out and errs["state"] < tol_out, errs
    assert max(v for n, v in errs.items() if n.startswith("d")) < tol_grad, errs


@pytest.mark.cuda
@pytest.mark.parametrize("op", ["gla", "ssd"])
def test_fla_forward_on_cuda(op):
    """The forward alone in bf16 (where fla refuses a backward, the forward still runs)."""
    pytest.importorskip("fla")
    xs = [x.detach() for x in _inputs(op, *GPU_SHAPE.values(), dtype=torch.bfloat16, device="cuda")]
    o, s = OPS[op][0](*xs[:4], initial_state=xs[4], impl="fla")
    ro, rs = OPS[op][0](*(x.double() for x in xs[:4]), initial_state=xs[4].double(), impl="naive")
    assert rel_rms(o, ro, floor=1e-2) < 2e-2 and rel_rms(s, rs, floor=1e-2) < 2e-2


@pytest.mark.cuda
@pytest.mark.parametrize("op", ["gla", "ssd"])
def test_auto_on_cuda_takes_fla(monkeypatch, op):
    pytest.importorskip("fla")
    calls = []
    real = fla_mod.fla_attention
    monkeypatch.setattr(fla_mod, "fla_attention", lambda *a: calls.append(1) or real(*a))
    xs = [x.detach() for x in _inputs(op, 1, 2, 64, 64, 64, dtype=torch.bfloat16, device="cuda")]
    with torch.no_grad():
        OPS[op][0](*xs[:4], initial_state=xs[4], impl="auto")
        OPS[op][0](*xs[:4], initial_state=xs[4], impl="fast")
    assert calls == [1]
