"""The decode step's choice of a trained window's keys as one Triton kernel (cache/static/window_kernel.py),
under Triton's interpreter: the same keys as `cache.static.window_keys` (its PyTorch ops) where valid, and
the same validity, on exact ties, both zeros, every merge point and tail, searches of one to three rounds
and positions before the first old key; a decoder through it generates what LM.generate does, compiled too."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from attnlab.models.config import ModelConfig  # noqa: E402
from attnlab.models.lm import LM  # noqa: E402
from attnlab.models.static_decode import StaticDecoder  # noqa: E402
from attnlab.cache.static import merge_codes, window_keys  # noqa: E402
from attnlab.cache.static.window_kernel import search_rounds  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def both(qs, ks, merged: int, last_old: int, k: int, tail: int):
    codes = merge_codes(ks, merged)
    args = (qs.contiguous(), ks, codes, torch.tensor(merged), torch.tensor(last_old), k, tail)
    return window_keys(*args, impl="torch"), window_keys(*args, impl="triton")


def same(a, b) -> bool:
    (ia, oka), (ib, okb) = a, b
    return torch.equal(oka, okb) and torch.equal(ia[oka], ib[okb]) and bool((ib[~okb] == 0).all())


def test_the_kernel_chooses_the_keys_the_ops_choose_on_ties():
    g = torch.Generator().manual_seed(6)
    B, H, N, k = 2, 3, 40, 4
    ks = torch.randint(-3, 4, (B, H, N), generator=g).float() / 2 + 0.0  # many exact ties, +0.0 only
    qs = torch.randint(-3, 4, (B, H, N), generator=g).float() / 2
    qs[0, 0, 5] = -0.0
    for t, merged in ((0, 0), (3, 3), (17, 8), (39, 0), (39, 39)):  # a tail only, codes only, both
        assert same(*both(qs[..., t], ks, merged, t, k, max(t + 1 - merged, 1))), (t, merged)


@pytest.mark.parametrize("N", [100, 300, pytest.param(20000, marks=pytest.mark.heavy)])  # 1, 2, 3 search rounds
def test_the_kernel_chooses_the_keys_the_ops_choose_on_long_caches(N):
    g = torch.Generator().manual_seed(N)
    B, H, k, tail = 1, 2, 16, 37  # neither a power of two
    ks = torch.randn(B, H, N, generator=g) + 0.0
    ks[:, :, ::7] = ks[:, :, 3:4]  # repeats of one key
    for t, merged in ((N - 1, N - 30), (N // 2, N // 2 - 36), (20, 0), (-4, 0)):
        qs = torch.randn(B, H, generator=g)
        qs[0, 1] = ks[0, 1, 3]  # a query on the repeated key
        tail_ = max(tail, t + 1 - merged) if merged == 0 and t < 64 else tail
        assert same(*both(qs, ks, merged, t, k, tail_)), (N, t, merged)


def test_the_kernel_spells_out_the_codes_constants():
    from attnlab.cache.static import window

    assert (window.POS_MAX, window.LAST) == (2**31 - 1, 2**63 - 1)


def test_search_rounds():
    assert [search_rounds(n) for n in (0, 1, 128, 129, 128 * 129, 128 * 129 + 1, 2**17)] == [1, 1, 1, 2, 2, 3, 3]


def test_impl_is_checked():
    ks = torch.zeros(1, 1, 4)
    with pytest.raises(ValueError, match="impl must be"):
        window_keys(torch.zeros(1, 1), ks, merge_codes(ks, 0), torch.tensor(0), torch.tensor(0), 1, 1, impl="cuda")


def _windowed(**attention):
    torch.manual_seed(0)
    return LM(ModelConfig(vocab_size=50, d_model=64, n_layers=2, n_heads=4, attn="hybrid", max_seq_len=128,
                          attention=dict(train_window=3, **attention))).eval()


@pytest.mark.heavy  # interpreted: the kernel takes a fraction of a second per step
@pytest.mark.parametrize("attention", [dict(local_window=2), dict(local_window=5, kernel="cauchy", n_kv_heads=2)])
def test_a_decoder_through_the_kernel_generates_what_generate_does(attention):
    """The step through the kernel (window_impl="triton") with codes merged every step and never past the
    prompt: the tokens of LM.generate (the sorted cache and ring), on a prompt of 3 distinct
    tokens (tied scalar keys), and no searchsorted or top-k left in the step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    m = _windowed(**attention)
    idx = torch.randint(0, 3, (1, 9), generator=torch.Generator().manual_seed(1))
    ref = m.generate(idx, 14)
    for tail in (1, 64):
        dec = StaticDecoder(m, 1, 30, tail=tail, window_impl="triton")
        assert torch.equal(dec.generate(idx, 14), ref), tail
    with torch.no_grad(), Ops() as ops:
        dec.step(ref[:, -1:])
    assert "window_keys" in ops.seen and not ops.seen & {"searchsorted", "topk", "sort"}, ops.seen


@pytest.mark.heavy  # torch.compile of a decode step: seconds
def test_a_compiled_step_through_the_kernel_equals_eager():
    """Compiled (fullgraph), the kernel is one opaque custom op: every step's logits equal the eager step's."""
    m = _windowed(local_window=2)
    idx = torch.randint(0, 50, (1, 20), generator=torch.Generator().manual_seed(2))
    eager = StaticDecoder(m, 1, 40, tail=4, window_impl="triton")
    fast = StaticDecoder(m, 1, 40, tail=4, compile=True, window_impl="triton")
    assert torch.allclose(fast.prefill(idx[:, :6]), eager.prefill(idx[:, :6]), atol=1e-5)
    for t in range(6, 20):
        assert torch.allclose(fast.step(idx[:, t : t + 1]), eager.step(idx[:, t : t + 1]), atol=1e-5), t


@pytest.mark.cuda
def test_cuda_kernel_chooses_the_keys_the_ops_choose_at_128k():
    g = torch.Generator().manual_seed(3)
    B, H, N, k, tail = 2, 4, 2**17, 16, 256
    ks = (torch.randn(B, H, N, generator=g).round(decimals=2) + 0.0).cuda()  # ties
    qs = torch.randn(B, H, generator=g).cuda()
    for t, merged in ((N - 1, N - 200), (N - 1, N - 32), (1000, 900), (-1, 0)):
        codes = merge_codes(ks, merged)
        args = (qs, ks, codes, torch.tensor(merged, device="cuda"), torch.tensor(t, device="cuda"), k, tail)
        assert same(window_keys(*args, impl="torch"), window_keys(*args, impl="auto")), (t, merged)
