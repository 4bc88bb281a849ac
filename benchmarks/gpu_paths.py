"""The attention paths `benchmarks/gpu.py` checks and times on a GPU, each built from one set of inputs.

A path is (name, what it computes, make(B, H, T, D, dtype, device) -> dict of leaf tensors, run(impl, t)
-> output). `run` takes the impl to use ("naive" gives the float64 reference of the same formula),
so every fast path is compared with its own naive op on the same inputs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attnlab.ops import (gla_attention, goat_attention, hybrid_attention, scalar_attention, ssd_attention,
                         windowed_attention)
from attnlab.ops.cosformer import cosformer_attention
from attnlab.ops.principled import principled_attention
from attnlab.ops.goat.flex import flex_goat_attention
from attnlab.ops.scalar.flex import flex_scalar_attention
from attnlab.ops.softmax import softmax_attention
from attnlab.testing import rel_rms

PARAMS = ("tau", "lam", "freqs", "lam_sym", "lam_asym", "u", "alpha", "beta", "gamma")  # float32 whatever the dtype


def _inputs(B, H, T, D, dtype, device, *, scalar=True, dot=True, goat=False, principled=False, decay=None, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    t = {"v": r(B, H, T, D).to(device, dtype)}
    if dot:
        t["q"] = r(B, H, T, D).to(device, dtype)
        t["k"] = r(B, H, T, D).to(device, dtype)
    if scalar:
        t["qs"] = r(B, H, T).to(device, dtype)
        t["ks"] = r(B, H, T).to(device, dtype)
        t["tau"] = (0.5 + torch.rand(H, generator=g)).to(device)
    if dot and scalar:
        t["lam"] = (0.5 + torch.rand(H, generator=g)).to(device)
    if goat:
        R = 8
        t["freqs"] = torch.logspace(-3, 0, R).to(device)  # fixed frequencies, no gradient
        t["lam_sym"] = (0.1 * r(H, R)).to(device)
        t["lam_asym"] = (0.1 * r(H, R)).to(device)
        t["u"] = (0.1 * r(1, H, T)).to(device)
    if principled:  # gate vectors of width 16 and per-head parameters, as the layer's defaults
        t["qg"] = r(B, H, T, 16).to(device, dtype)
        t["kg"] = r(B, H, T, 16).to(device, dtype)
        for name, shift in (("alpha", 0.0), ("beta", 0.0), ("gamma", 0.0)):
            t[name] = (shift + 0.5 * r(H)).to(device)
    if decay is not None:  # log decays <= 0 per key channel ("vector", GLA) or per head and step ("scalar", SSD)
        shape = (B, H, T, D) if decay == "vector" else (B, H, T)
        t["log_decay"] = F.logsigmoid(r(*shape) + 2.0).to(device, dtype)
    return t


def _flash(impl, t):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if impl == "naive":  # the formula, T x T, for the reference
        q, k, v = t["q"], t["k"], t["v"]
        s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        T = q.shape[2]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        return torch.softmax(s, -1) @ v
    # flash in bf16 on CUDA (no float32 flash kernel there: the memory-efficient one), and on the CPU
    cpu = t["q"].device.type == "cpu"
    backends = [SDPBackend.FLASH_ATTENTION] if cpu or t["q"].dtype != torch.float32 else [SDPBackend.EFFICIENT_ATTENTION]
    with sdpa_kernel(backends):
        return F.scaled_dot_product_attention(t["q"], t["k"], t["v"], is_causal=True)


def _scalar(kernel):
    return lambda impl, t: scalar_attention(t["qs"], t["ks"], t["v"], t["tau"], impl=impl, kernel=kernel)


def _hybrid(kernel):
    return lambda impl, t: hybrid_attention(t["q"], t["k"], t["v"], t["qs"], t["ks"], t["tau"], impl=impl,
                                            kernel=kernel, scalar_scale=t["lam"])


def _goat(impl, t):
    return goat_attention(t["q"], t["k"], t["v"], t["freqs"], t["lam_sym"], t["lam_asym"], t["u"], impl=impl)


def _softmax(scale):
    """Softmax attention under one of seed 003's scalings (q.k divided by a key statistic)."""
    return lambda impl, t: softmax_attention(t["q"], t["k"], t["v"], scale=scale, impl=impl)


def _cosformer(impl, t):
    return cosformer_attention(t["q"], t["k"], t["v"], max_len=t["q"].shape[2], impl=impl)[0]  # (output, state)


def _principled(impl, t):
    return principled_attention(t["q"], t["k"], t["qg"], t["kg"], t["v"], alpha=t["alpha"], beta=t["beta"],
                                gamma=t["gamma"], impl=impl)


def _gla(impl, t):
    return gla_attention(t["q"], t["k"], t["v"], t["log_decay"], impl=impl)[0]


def _ssd(impl, t):
    return ssd_attention(t["q"], t["k"], t["v"], t["log_decay"], impl=impl)[0]


def _window(kernel):
    """Training through the window: k = 16 scalar-nearest older keys + the last 32 (configs/windowed.toml)."""
    return lambda impl, t: windowed_attention(t["qs"], t["ks"], t["v"], t["tau"], 16, q=t["q"], k=t["k"], local=32,
                                              impl=impl, kernel=kernel, scalar_scale=t["lam"])


def _flex(kernel, hybrid=True):
    """FlexAttention's generated kernel for the same formula (`ops.scalar.flex`); "naive" is the naive op."""
    def run(impl, t):
        if impl == "naive":
            return (_hybrid(kernel) if hybrid else _scalar(kernel))("naive", t)
        kw = dict(q=t["q"], k=t["k"], scalar_scale=t["lam"]) if hybrid else {}
        return flex_scalar_attention(t["qs"], t["ks"], t["v"], t["tau"], kernel=kernel, **kw)
    return run


def _goat_flex(impl, t):
    if impl == "naive":
        return _goat("naive", t)
    return flex_goat_attention(t["q"], t["k"], t["v"], t["freqs"], t["lam_sym"], t["lam_asym"], t["u"])


def _fix(impl, fn):
    """A path pinned to one impl for its fast run (its reference stays "naive")."""
    return lambda i, t: fn("naive" if i == "naive" else impl, t)


# name -> (run, inputs, largest T timed: slower baselines stop early)
PATHS = {
    "sdpa-flash": (_flash, dict(scalar=False), None),
    "scalar-gaussian/triton": (_fix("triton", _scalar("gaussian")), dict(dot=False), None),
    "scalar-cauchy/triton": (_fix("triton", _scalar("cauchy")), dict(dot=False), None),
    "hybrid-gaussian/triton": (_fix("triton", _hybrid("gaussian")), {}, None),
    "hybrid-cauchy/triton": (_fix("triton", _hybrid("cauchy")), {}, None),
    "scalar-gaussian/flex": (_flex("gaussian", False), dict(dot=False), None),
    "scalar-cauchy/flex": (_flex("cauchy", False), dict(dot=False), None),
    "hybrid-gaussian/flex": (_flex("gaussian"), {}, None),
    "hybrid-cauchy/flex": (_flex("cauchy"), {}, None),
    "scalar-gaussian/sdpa": (_fix("fast", _scalar("gaussian")), dict(dot=False), None),
    "hybrid-gaussian/sdpa": (_fix("fast", _hybrid("gaussian")), {}, None),
    "hybrid-cauchy/chunked": (_fix("fast", _hybrid("cauchy")), {}, 8192),
    "goat/triton": (_fix("triton", _goat), dict(scalar=False, goat=True), None),
    "goat/sdpa": (_fix("fast", _goat), dict(scalar=False, goat=True), None),
    "goat/flex": (_goat_flex, dict(scalar=False, goat=True), None),
    "softmax-ktotal/sdpa": (_fix("fast", _softmax("ktotal")), dict(scalar=False), None),
    "softmax-kmean/sdpa": (_fix("fast", _softmax("kmean")), dict(scalar=False), None),
    "softmax-krms/sdpa": (_fix("fast", _softmax("krms")), dict(scalar=False), None),
    "cosformer/chunked": (_fix("fast", _cosformer), dict(scalar=False), None),
    "principled/triton": (_fix("triton", _principled), dict(scalar=False, principled=True), None),
    "principled/tiled": (_fix("fast", _principled), dict(scalar=False, principled=True), 8192),
    "hybrid-cauchy-window16+32/selected": (_fix("fast", _window("cauchy")), {}, 8192),
    "hybrid-gaussian-window16+32/selected": (_fix("fast", _window("gaussian")), {}, 8192),
    "hybrid-cauchy-window16+32/triton": (_fix("triton", _window("cauchy")), {}, None),
    "hybrid-gaussian-window16+32/triton": (_fix("triton", _window("gaussian")), {}, None),
    "gla/fla": (_fix("fla", _gla), dict(scalar=False, decay="vector"), None),
    "ssd/fla": (_fix("fla", _ssd), dict(scalar=False, decay="scalar"), None),
    "gla/chunked": (_fix("fast", _gla), dict(scalar=False, decay="vector"), 8192),
    "ssd/chunked": (_fix("fast", _ssd), dict(scalar=False, decay="scalar"), 8192),
}
# flash-linear-attention's kernels (no CPU run, not even under TRITON_INTERPRET) and FlexAttention's backward
# (none on the CPU; its forwards are compared on the CPU in tests/test_scalar_flex.py)
NEEDS_CUDA = ("gla/fla", "ssd/fla", "scalar-gaussian/flex", "scalar-cauchy/flex", "hybrid-gaussian/flex",
              "hybrid-cauchy/flex", "goat/flex")


def make(name, B, H, T, D, dtype, device, seed=0):
    """Leaf tensors (requiring grad where the op takes one) for path `name`."""
    run, kw, _ = PATHS[name]
    t = _inputs(B, H, T, D, dtype, device, seed=seed, **kw)
    for n, x in t.items():
        if n != "freqs":
            x.requires_grad_(True)
    return t


def as_reference(t: dict) -> dict:
    """The same inputs in float64 (after their rounding to the run's dtype), as fresh leaves."""
    return {n: x.detach().double().requires_grad_(n != "freqs") for n, x in t.items()}


def fwd_bwd(name, impl, t, dout=None):
    """Output and the gradients of every leaf that takes one, for <out, dout> (dout: a fixed draw)."""
    run = PATHS[name][0]
    out = run(impl, t)
    if dout is None:
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, out.dtype)
    leaves = [x for x in t.values() if x.requires_grad]
    grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
    return out, dict(zip([n for n, x in t.items() if x.requires_grad], grads)), dout


def rel_err(a, b) -> float:
    """Relative RMS error against the reference, its RMS floored at 0.01 (gradients that are exactly zero)."""
    return rel_rms(a, b, floor=1e-2)
