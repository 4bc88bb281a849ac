"""Every public op through hostile inputs, table-driven, each case asserting the input policy
(docs/guide/input-policy.md):

- a NaN or inf in any argument raises ValueError naming the argument, before any work;
- under causal masking no row depends on later positions: with outliers up to +-1e4 at the
  later positions, the earlier rows and their gradients equal a run on the truncated sequence;
- T = 0 gives an empty output (and zero gradients), T = 1 the naive result;
- sequence tensors of mixed dtypes raise TypeError naming the odd one; mixing parameters
  (tau, alpha, beta, gamma) take any floating dtype; integer tensors raise TypeError;
- non-contiguous and expanded tensors give the contiguous result; float32 agrees with float64.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

from attnlab.ops import (
    cosformer_attention, cosformer_step, gla_attention, gla_step, goat_attention, hybrid_attention, principled_attention,
    scalar_attention, softmax_attention, ssd_attention, ssd_step,
)
from attnlab.ops.softmax import SCALES
from attnlab.testing import rel_rms

B, H, G, T, D = 2, 4, 2, 12, 8


@dataclass
class Op:
    """One public op: `make(T, dtype, gen)` builds its keyword inputs; `run(impl, **inputs)` returns
    the output tensor. `time` maps each input with a time axis to that axis; `params` are the
    mixing parameters (any floating dtype); `positive`: inputs that must stay > 0, `nonpositive`:
    inputs that must stay <= 0 (for the outliers)."""

    name: str
    make: Callable
    run: Callable
    time: dict
    params: tuple = ()
    positive: tuple = ()
    nonpositive: tuple = ()
    floats: dict = field(default_factory=dict)  # python-float arguments to try with nan / inf


def _r(gen, dtype, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def _qkv(gen, dtype, t, groups=H):
    return dict(q=_r(gen, dtype, B, H, t, D), k=_r(gen, dtype, B, groups, t, D), v=_r(gen, dtype, B, groups, t, D))


def _softmax(scale):
    return Op(
        f"softmax-{scale}",
        lambda t, dt, g: _qkv(g, dt, t, G),
        lambda impl, **a: softmax_attention(a["q"], a["k"], a["v"], scale=scale, impl=impl),
        dict(q=2, k=2, v=2),
    )


def _scalar_inputs(t, dt, g):
    return dict(qs=_r(g, dt, B, H, t), ks=_r(g, dt, B, H, t), v=_r(g, dt, B, G, t, D),
                tau=0.2 + torch.rand(B, H, t, generator=g, dtype=torch.float64).to(dt))


def _hybrid_inputs(t, dt, g):
    return {**_qkv(g, dt, t, G), **{k: v for k, v in _scalar_inputs(t, dt, g).items() if k != "v"}}


def _principled_inputs(t, dt, g):
    a = _qkv(g, dt, t, G)
    a.update(qg=_r(g, dt, B, H, t, 4), kg=_r(g, dt, B, G, t, 4), alpha=_r(g, dt, B, H, t), beta=_r(g, dt, B, H, t),
             gamma=_r(g, dt, B, H, t), v0=_r(g, dt, H, D))
    return a


def _linear_inputs(vector):
    def make(t, dt, g):
        a = _qkv(g, dt, t)
        shape = (B, H, t, D) if vector else (B, H, t)
        a["log_decay"] = -torch.rand(*shape, generator=g, dtype=torch.float64).to(dt)
        return a
    return make


OPS = [_softmax(s) for s in (*SCALES, 0.3)] + [
    Op("scalar", _scalar_inputs,
       lambda impl, **a: scalar_attention(a["qs"], a["ks"], a["v"], a["tau"], impl=impl),
       dict(qs=2, ks=2, v=2, tau=2), params=("tau",), positive=("tau",)),
    Op("hybrid", _hybrid_inputs,
       lambda impl, **a: hybrid_attention(a["q"], a["k"], a["v"], a["qs"], a["ks"], a["tau"], impl=impl),
       dict(q=2, k=2, v=2, qs=2, ks=2, tau=2), params=("tau",), positive=("tau",)),
    Op("principled", _principled_inputs,
       lambda impl, **a: principled_attention(a["q"], a["k"], a["qg"], a["kg"], a["v"], alpha=a["alpha"],
                                              beta=a["beta"], gamma=a["gamma"], v0=a["v0"], impl=impl),
       dict(q=2, k=2, v=2, qg=2, kg=2, alpha=2, beta=2, gamma=2), params=("alpha", "beta", "gamma")),
    Op("goat", lambda t, dt, g: {**_hybrid_inputs(t, dt, g), "lam_sym": _r(g, dt, G, 3), "lam_asym": _r(g, dt, G, 3),
                                 "u": _r(g, dt, B, G, t)},
       lambda impl, **a: goat_attention(a["q"], a["k"], a["v"], torch.tensor([1.0, 0.1, 0.01], dtype=a["q"].dtype),
                                        a["lam_sym"], a["lam_asym"], a["u"], qs=a["qs"], ks=a["ks"], tau=a["tau"], impl=impl),
       dict(q=2, k=2, v=2, qs=2, ks=2, tau=2, u=2), params=("tau", "lam_sym", "lam_asym", "u"), positive=("tau",)),
    Op("cosformer", lambda t, dt, g: _qkv(g, dt, t),
       lambda impl, **a: cosformer_attention(a["q"], a["k"], a["v"], max_len=64, impl=impl)[0],
       dict(q=2, k=2, v=2), floats=dict(eps=1e-6)),
    Op("gla", _linear_inputs(True),
       lambda impl, **a: gla_attention(a["q"], a["k"], a["v"], a["log_decay"], impl=impl, chunk_size=8)[0],
       dict(q=2, k=2, v=2, log_decay=2), nonpositive=("log_decay",), floats=dict(scale=0.5)),
    Op("ssd", _linear_inputs(False),
       lambda impl, **a: ssd_attention(a["q"], a["k"], a["v"], a["log_decay"], impl=impl, chunk_size=8)[0],
       dict(q=2, k=2, v=2, log_decay=2), nonpositive=("log_decay",), floats=dict(scale=0.5)),
]
OP_IDS = [op.name for op in OPS]


def _inputs(op, t=T, dtype=torch.float32, seed=0):
    return op.make(t, dtype, torch.Generator().manual_seed(seed))


def _names_arg(err, name):
    return re.search(rf"(^|\W){re.escape(name)}(\W|$)", str(err)) is not None


def _poison(x, value, at):
    x = x.clone()
    x.view(-1)[at % x.numel()] = value
    return x


# --------------------------------------------------------------------------- non-finite values

NONFINITE = [float("nan"), float("inf"), float("-inf")]
CASES = [(op, name, bad) for op in OPS for name in _inputs(op) for bad in NONFINITE]


@pytest.mark.parametrize("impl", ["naive", "fast"])
@pytest.mark.parametrize(
    "op,name,bad", CASES, ids=[f"{op.name}-{name}-{bad}" for op, name, bad in CASES]
)
def test_nonfinite_tensor_raises_naming_it(op, name, bad, impl):
    a = _inputs(op)
    a[name] = _poison(a[name], bad, at=7)
    with pytest.raises(ValueError, match="finite") as e:
        op.run(impl, **a)
    assert _names_arg(e.value, name), str(e.value)


FLOAT_CASES = [(op, name, bad) for op in OPS for name in op.floats for bad in NONFINITE] + [
    (op, "tau", bad) for op in OPS if op.name in ("scalar", "hybrid") for bad in NONFINITE
] + [(op, p, bad) for op in OPS if op.name == "principled" for p in op.params for bad in NONFINITE]


@pytest.mark.parametrize("op,name,bad", FLOAT_CASES, ids=[f"{o.name}-{n}-{b}" for o, n, b in FLOAT_CASES])
def test_nonfinite_python_float_raises_naming_it(op, name, bad):
    a = _inputs(op)
    if name in a:  # a tensor parameter given as a plain float instead
        a[name] = bad
        with pytest.raises(ValueError, match="finite") as e:
            op.run("fast", **a)
    else:  # a keyword float of the op itself (scale, eps)
        fn = {"cosformer": cosformer_attention, "gla": gla_attention, "ssd": ssd_attention}[op.name]
        extra = (a["log_decay"],) if "log_decay" in a else ()
        kw = dict(max_len=64) if op.name == "cosformer" else {}
        with pytest.raises(ValueError) as e:
            fn(a["q"], a["k"], a["v"], *extra, **kw, **{name: bad})
    assert _names_arg(e.value, name), str(e.value)


def test_softmax_nan_query_row_is_an_error_not_zeros():
    a = _inputs(OPS[0])
    a["q"][0, 1, 3] = float("nan")
    for impl in ("naive", "fast"):
        with pytest.raises(ValueError, match=r"\bq\b.*finite"):
            softmax_attention(a["q"], a["k"], a["v"], impl=impl)


# --------------------------------------------------------------------------- causal isolation


def _truncate(op, a, t0):
    out = {}
    for name, x in a.items():
        axis = op.time.get(name)
        out[name] = x.narrow(axis, 0, t0) if axis is not None and isinstance(x, torch.Tensor) else x
    return out


def _with_future_outliers(op, a, t0, magnitude):
    """Every input with a time axis gets +-magnitude at positions >= t0 (signs that keep the
    input legal: tau stays > 0, log_decay <= 0)."""
    out = dict(a)
    g = torch.Generator().manual_seed(1)
    for name, axis in op.time.items():
        x = a[name].clone()
        fut = x.narrow(axis, t0, x.shape[axis] - t0)
        sign = torch.where(torch.rand(fut.shape, generator=g) < 0.5, -1.0, 1.0).to(x.dtype)
        if name in op.positive:
            sign = sign.abs()
        if name in op.nonpositive:
            sign = -sign.abs()
        fut.copy_(sign * magnitude)
        out[name] = x
    return out


def _grads(op, a, impl, rows):
    """Output rows [:rows] and the gradients of a fixed cotangent on them w.r.t. every tensor input."""
    leaves = {n: x.detach().clone().requires_grad_(True) for n, x in a.items()}
    o = op.run(impl, **leaves)
    cot = torch.randn(o[:, :, :rows].shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (o[:, :, :rows] * cot.to(o.dtype)).sum().backward()
    return o[:, :, :rows].detach(), {n: x.grad for n, x in leaves.items()}


@pytest.mark.parametrize("magnitude", [1e3, 1e4])
@pytest.mark.parametrize("op", OPS, ids=OP_IDS)
def test_earlier_rows_and_gradients_never_see_later_positions(op, magnitude):
    t0 = T // 2
    clean = _inputs(op)
    hostile = _with_future_outliers(op, clean, t0, magnitude)
    ref_o, ref_g = _grads(op, {n: x.double() for n, x in _truncate(op, clean, t0).items()}, "naive", t0)
    for impl in ("fast", "naive"):
        o, grads = _grads(op, hostile, impl, t0)
        assert torch.isfinite(o).all()
        assert rel_rms(o, ref_o) <= 2e-6, (impl, rel_rms(o, ref_o))
        for name, gr in grads.items():
            assert torch.isfinite(gr).all(), name
            axis = op.time.get(name)
            if axis is None:  # v0: seen by every row
                assert rel_rms(gr, ref_g[name]) <= 2e-5, (impl, name)
                continue
            assert rel_rms(gr.narrow(axis, 0, t0), ref_g[name]) <= 2e-5, (impl, name, rel_rms(gr.narrow(axis, 0, t0), ref_g[name]))
            assert (gr.narrow(axis, t0, T - t0) == 0).all(), (impl, name)


@pytest.mark.parametrize("magnitude,nan", [(1e3, False), (1e4, False), (0.0, True)])
def test_scalar_fast_path_reported_case(magnitude, nan):
    """B=1, H=2, T=16, tau=0.5: the last 8 keys at 1e3 / 1e4 changed the first 8 rows by 1.1e-2 /
    0.69 (the shift was the mean of all keys); a NaN in the last key made earlier rows NaN."""
    g = torch.Generator().manual_seed(0)
    qs, ks, v = torch.randn(1, 2, 16, generator=g), torch.randn(1, 2, 16, generator=g), torch.randn(1, 2, 16, 4, generator=g)
    ref = scalar_attention(qs[..., :8].double(), ks[..., :8].double(), v[:, :, :8].double(), 0.5, impl="naive")
    ks_far = ks.clone()
    if nan:
        ks_far[..., -1] = float("nan")
        with pytest.raises(ValueError, match=r"\bks\b"):
            scalar_attention(qs, ks_far, v, 0.5)
        return
    ks_far[..., 8:] = magnitude
    out = scalar_attention(qs, ks_far, v, 0.5)
    assert rel_rms(out[:, :, :8], ref) <= 1e-6


# --------------------------------------------------------------------------- lengths 0 and 1


@pytest.mark.parametrize("impl", ["naive", "fast"])
@pytest.mark.parametrize("op", OPS, ids=OP_IDS)
def test_empty_sequence_gives_empty_output_and_zero_gradients(op, impl):
    a = {n: x.requires_grad_(True) for n, x in _inputs(op, t=0).items()}
    o = op.run(impl, **a)
    assert o.shape == (B, H, 0, D) and o.dtype == torch.float32
    o.sum().backward()
    for name, x in a.items():
        assert x.grad is None or (x.grad == 0).all(), name


@pytest.mark.parametrize("op", OPS, ids=OP_IDS)
def test_single_position_matches_naive(op):
    a = _inputs(op, t=1, dtype=torch.float64)
    assert rel_rms(op.run("fast", **a), op.run("naive", **a)) <= 1e-10


def test_linear_ops_with_empty_sequence_return_the_initial_state():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, 0, D, generator=g) for _ in range(3))
    s0 = torch.randn(B, H, D, D, generator=g)
    o, s = gla_attention(q, k, v, torch.zeros(B, H, 0, D), initial_state=s0)
    assert o.shape == (B, H, 0, D) and torch.equal(s, s0)
    o, s = ssd_attention(q, k, v, torch.zeros(B, H, 0), initial_state=s0)
    assert torch.equal(s, s0)
    o, st = cosformer_attention(q, k, v, max_len=8)
    assert st.offset == 0 and st.max_len == 8 and (st.kv == 0).all()
    with pytest.raises(ValueError, match="max_len"):  # no horizon to default to
        cosformer_attention(q, k, v)


# --------------------------------------------------------------------------- dtypes and layouts

MIX = [(op, name) for op in OPS for name in _inputs(op) if name not in op.params]


@pytest.mark.parametrize("op,name", MIX, ids=[f"{op.name}-{name}" for op, name in MIX])
def test_sequence_tensor_of_another_dtype_raises_naming_it(op, name):
    a = _inputs(op)
    a[name] = a[name].double()
    with pytest.raises(TypeError, match="dtype") as e:
        op.run("fast", **a)
    assert _names_arg(e.value, name), str(e.value)


@pytest.mark.parametrize("op", [op for op in OPS if op.params], ids=lambda op: op.name)
def test_mixing_parameters_take_any_float_dtype(op):
    a = _inputs(op)
    ref = op.run("fast", **a)
    for p in op.params:
        mixed = dict(a, **{p: a[p].double()})
        assert rel_rms(op.run("fast", **mixed), ref) <= 1e-6, p


@pytest.mark.parametrize("op", OPS, ids=OP_IDS)
def test_integer_tensor_raises_type_error(op):
    a = _inputs(op)
    first = next(iter(a))
    a[first] = a[first].round().long()
    with pytest.raises(TypeError) as e:
        op.run("fast", **a)
    assert _names_arg(e.value, first)


@pytest.mark.parametrize("op", OPS, ids=OP_IDS)
def test_noncontiguous_and_expanded_inputs_give_the_contiguous_result(op):
    a = _inputs(op)
    ref = op.run("fast", **a)

    def strided(x):  # same values, transposed storage
        return x.transpose(-1, -2).contiguous().transpose(-1, -2) if x.dim() >= 2 else x

    out = op.run("fast", **{n: strided(x) for n, x in a.items()})
    assert not all(x.is_contiguous() for x in (strided(x) for x in a.values()) if x.dim() >= 2)
    assert rel_rms(out, ref) <= 1e-6
    # batch entries expanded from one (stride 0 along B)
    one = {n: (x[:1].expand_as(x) if x.dim() >= 3 and x.shape[0] == B else x) for n, x in a.items()}
    out = op.run("fast", **one)
    ref_one = op.run("fast", **{n: x.contiguous() for n, x in one.items()})
    assert rel_rms(out, ref_one) <= 1e-6
    assert rel_rms(out[0], out[1]) <= 1e-6


@pytest.mark.parametrize("op", OPS, ids=OP_IDS)
def test_float32_agrees_with_float64(op):
    a = _inputs(op, dtype=torch.float64)
    ref = op.run("naive", **a)
    out = op.run("fast", **{n: x.float() for n, x in a.items()})
    assert out.dtype == torch.float32
    assert rel_rms(out, ref) <= 1e-5


# --------------------------------------------------------------------------- decode steps


def _step_inputs(vector):
    g = torch.Generator().manual_seed(0)
    a = dict(q_t=torch.randn(B, H, D, generator=g), k_t=torch.randn(B, H, D, generator=g), v_t=torch.randn(B, H, D, generator=g))
    if vector is not None:
        a["log_decay_t"] = -torch.rand(*((B, H, D) if vector else (B, H)), generator=g)
    a["state"] = torch.randn(B, H, D, D, generator=g)
    return a


STEPS = [("gla_step", gla_step, True), ("ssd_step", ssd_step, False)]
STEP_CASES = [(n, fn, vec, arg) for n, fn, vec in STEPS for arg in _step_inputs(vec)]


@pytest.mark.parametrize("bad", NONFINITE)
@pytest.mark.parametrize("name,fn,vector,arg", STEP_CASES, ids=[f"{c[0]}-{c[3]}" for c in STEP_CASES])
def test_decode_steps_reject_nonfinite_and_mixed_dtypes(name, fn, vector, arg, bad):
    a = _step_inputs(vector)
    a[arg] = _poison(a[arg], bad, at=3)
    with pytest.raises(ValueError, match="finite") as e:
        fn(**a)
    assert _names_arg(e.value, arg)
    a = _step_inputs(vector)
    a[arg] = a[arg].double()
    with pytest.raises(TypeError, match="dtype") as e:
        fn(**a)
    assert _names_arg(e.value, arg)


@pytest.mark.parametrize("arg", ["q_t", "k_t", "v_t", "state.kv", "state.k_sum"])
def test_cosformer_step_rejects_nonfinite_and_mixed_dtypes(arg):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, 3, D, generator=g) for _ in range(3))
    _, state = cosformer_attention(q, k, v, max_len=8)
    a = dict(q_t=q[:, :, 0], k_t=k[:, :, 0], v_t=v[:, :, 0])
    for bad, err in ((float("nan"), ValueError), ("double", TypeError)):
        kw, st = dict(a), state
        if arg.startswith("state."):
            field_name = arg.split(".")[1]
            x = getattr(state, field_name)
            st = state._replace(**{field_name: x.double() if bad == "double" else _poison(x, bad, 2)})
        else:
            kw[arg] = kw[arg].double() if bad == "double" else _poison(kw[arg], bad, 2)
        with pytest.raises(err) as e:
            cosformer_step(**kw, state=st)
        assert _names_arg(e.value, arg), str(e.value)
