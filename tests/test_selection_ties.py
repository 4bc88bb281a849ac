"""Decoders agree on which keys they read when keys tie: a token's scalar query and key are the same
bits whether it was projected in a prompt of T rows or in a decode step of one (ScalarProjection sums
in float64 and rounds once; a float32 matmul's order depends on the row count and the CPU's vector
width), so two mathematically equal keys (a repeated token in the first layer) are equal in the
static decoder and in the sorted cache alike, and both break the tie by the same rule (newest first).
`make test-isa` runs this file and the other selection-equality tests under ATEN_CPU_CAPABILITY=default
and avx2 as well as the machine's own."""

from __future__ import annotations

import pytest
import torch

from attnlab.layers.mechanisms.scalar import ScalarProjection
from attnlab.models.config import ModelConfig
from attnlab.models.lm import LM
from attnlab.models.static_decode import StaticDecoder

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("C", [16, 64, 128, 384])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_a_rows_projection_does_not_depend_on_the_rows_beside_it(C, bias):
    """Bit for bit, at every row count a prompt or a chunk may have (a plain float32 nn.Linear fails
    this on every CPU capability: the 1-row and the T-row products round differently)."""
    torch.manual_seed(C)
    p = ScalarProjection(C, 4, bias=bias)
    with torch.no_grad():  # weights of a trained scale (nn.Linear's init happens to round alike here)
        p.weight.copy_(torch.randn(4, C) / C**0.5)
    x = torch.randn(2, 300, C)
    # with the parameters as they are, and detached (another BLAS path: matmul folds the batch into
    # the rows only for a weight that needs no gradient, and which path rounds alike varies by CPU)
    detached = {name: t.detach() for name, t in p.named_parameters()}
    for proj in (p, lambda x: torch.func.functional_call(p, detached, (x,))):
        one = torch.cat([proj(x[:, t : t + 1]) for t in range(x.shape[1])], 1)
        for T in (2, 9, 17, 64, 300):
            assert torch.equal(proj(x[:, :T]), one[:, :T]), T


def test_a_float32_product_would_not_do():
    """Why the projection sums in float64: here, as on the machines where decoders disagreed, the
    float32 product of a row rounds differently beside other rows (if this CPU's BLAS ever rounds every
    row alike, the test above still holds; this one then says so)."""
    torch.manual_seed(0)
    w, x = torch.randn(4, 64) / 8, torch.randn(2, 300, 64)
    one = torch.cat([torch.nn.functional.linear(x[:, t : t + 1], w) for t in range(300)], 1)
    if all(torch.equal(torch.nn.functional.linear(x[:, :T], w), one[:, :T]) for T in (2, 9, 17, 64, 300)):
        pytest.skip("this CPU's float32 products round every row alike at these shapes")


def test_the_projection_is_the_float64_sum_rounded_once_with_the_linear_gradients():
    """Values: the explicit sum of exact products in float64, rounded to float32 (an independent
    reference). Gradients: those of the float32 nn.Linear with the same weights, to float32's
    precision over a 64-term sum (rtol 1e-5 = ~ 64 * 2^-24 with margin)."""
    torch.manual_seed(0)
    p = ScalarProjection(64, 4)
    ref = torch.nn.Linear(64, 4)
    ref.load_state_dict(p.state_dict())
    x = torch.randn(3, 11, 64, requires_grad=True)
    want = ((x.double()[..., None, :] * p.weight.double()).sum(-1) + p.bias.double()).float()
    y = p(x)
    assert y.dtype == torch.float32 and torch.equal(y, want)
    g = torch.randn_like(y)
    y.backward(g)
    got = (x.grad.clone(), p.weight.grad.clone(), p.bias.grad.clone())
    x.grad = None
    ref(x).backward(g)
    for a, b in zip(got, (x.grad, ref.weight.grad, ref.bias.grad)):
        assert a.dtype == torch.float32 and torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_under_autocast_the_projection_returns_what_linear_would():
    p, x = ScalarProjection(32, 2), torch.randn(1, 5, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert p(x).dtype == torch.nn.Linear(32, 2)(x).dtype == torch.bfloat16


CASES = {
    "hybrid": ("hybrid", {}, 4, 6),
    "trained-window-ring": ("hybrid", dict(train_window=3, local_window=2), 3, 5),
    "scalar-weighted-sink": ("scalar", dict(sink=True, sink_weight=0.5, kernel="cauchy", n_value_groups=2), 4, 5),
}


def repeated(B: int, T: int, alphabet: int, seed: int) -> torch.Tensor:
    """Tokens from a small alphabet: every token repeats, in the prompt and after it."""
    return torch.randint(0, alphabet, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(CASES))
def test_the_prompts_keys_are_the_keys_a_step_computes(case):
    """The static decoder's prompt keys of the first layer (a token's embedding, nothing else) are
    bit for bit what projecting each token alone gives, so equal tokens have equal keys."""
    attn, attention, k, budget = CASES[case]
    torch.manual_seed(0)
    m = LM(ModelConfig(vocab_size=50, d_model=64, n_layers=2, n_heads=4, attn=attn, max_seq_len=128,
                       attention=attention)).eval()
    idx = repeated(2, 24, 3, 1)
    with torch.no_grad():
        dec = StaticDecoder(m, 2, 48, window=k, budget=budget)
        dec.prefill(idx)
        a, h = m.blocks[0].attn, m.blocks[0].norm1(m.tok_emb(idx))
        alone = torch.cat([a.project(h[:, t : t + 1], t).ks for t in range(idx.shape[1])], -1)
        ks = dec.states["0"].ks
        assert torch.equal(ks[:, :, : idx.shape[1]], alone.float())
        same = idx[0, :, None] == idx[0, None, :]  # every pair of equal tokens in row 0
        ks = ks[0, 0, : idx.shape[1]]
        assert torch.equal(ks[:, None] == ks[None, :], same)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("alphabet", [2, 3, 5])
def test_a_budgeted_window_over_repeated_tokens_reads_what_the_sorted_cache_reads(case, alphabet):
    """Repeated tokens in the prompt and after it tie exactly in the first layer's keys: every step's
    logits of the static decoder (its prompt in one pass) equal stepping the sorted cache with
    evict_to_budget token by token, and so without a budget. One layer: the ties of the first layer
    are exact (a token's embedding, projected alike); a later layer's keys of two such tokens are
    equal only up to rounding, which two implementations summing in different orders cannot agree
    on (docs/guide/decoding.md)."""
    attn, attention, k, budget = CASES[case]
    torch.manual_seed(alphabet)
    m = LM(ModelConfig(vocab_size=50, d_model=64, n_layers=1, n_heads=4, attn=attn, max_seq_len=128,
                       attention=attention)).eval()
    idx = repeated(2, 40, alphabet, alphabet)
    with torch.no_grad():
        caches = m.make_caches(2, window=k, budget=budget)
        want = torch.stack([m.step(idx[:, t : t + 1], caches, t).reshape(2, -1) for t in range(40)], 1)
        dec = StaticDecoder(m, 2, 48, window=k, budget=budget)
        assert torch.allclose(dec.prefill(idx[:, :9]), want[:, 8], atol=1e-5)
        for t in range(9, 40):
            assert torch.allclose(dec.step(idx[:, t : t + 1]), want[:, t], atol=1e-5), t
        # and through the window without a budget (sorted codes, not every slot scored)
        caches = m.make_caches(2, window=k)
        want = torch.stack([m.step(idx[:, t : t + 1], caches, t).reshape(2, -1) for t in range(40)], 1)
        dec = StaticDecoder(m, 2, 48, window=k)
        assert torch.allclose(dec.prefill(idx[:, :9]), want[:, 8], atol=1e-5)
        for t in range(9, 40):
            assert torch.allclose(dec.step(idx[:, t : t + 1]), want[:, t], atol=1e-5), t
