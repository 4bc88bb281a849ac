"""Split-K attention for one decode step over a long static cache (FlashDecoding, FlexDecoding).

A decode step has one query per head. Read as one softmax over the whole cache, a fused kernel
runs one program per (batch row, head): at batch 1 that is a few programs for the whole GPU,
each reading all N keys in turn. Split-K cuts the cache into S = N / c chunks of c keys and reads
every chunk in parallel, keeping per chunk s only its partial softmax:

    m_s = max_j x_j,   l_s = sum_j exp(x_j - m_s),   o_s = sum_j exp(x_j - m_s) v_j     (j in chunk s)

and combines them by log-sum-exp: M = max_s m_s, out = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s.
That is the softmax over all keys exactly (up to rounding); a chunk whose keys are all hidden has
m_s = -inf and weighs nothing. An extra key outside the cache (the sink) enters as one more partial
(m = its logit, l = 1, o = its value).

`split_attention` is the split form, `split_attention_naive` the formula it computes (one softmax
over every key, materialised); the static states of softmax and of the scalar family call the split
form for their exact steps when `split_chunk` chooses a chunk (buffers then padded to a multiple of
it; the padding is never visible).

When: on CUDA, for caches of at least SPLIT_MIN keys, in chunks of CHUNK keys. An H100 has 132
SMs; one program per (row, head) uses 4-12 of them at batch 1 (the windowed and GPT-2-small
shapes), so the step's time is one SM streaming N (Dk + Dv) values. Chunks of 512 keys give
B·H·N/512 programs, at least 32 at 4K keys and 4 heads and 768 at 32K and 12 heads, while each
chunk's partial (Dv + 2 floats) stays under 1 % of the 512 (Dk + Dv) values it reads, so the
combine costs nothing that matters. Below 4K keys a head's cache is at most 4096 (Dk + Dv) values
(1 MiB at Dk = Dv = 64 in float32), read in a few microseconds by one SM: less than a step's
launches, so splitting gains nothing there and adds a kernel. On the CPU every core already
shares one step's matmuls (or the step runs on one thread beside other work): "auto" never splits
there, and tests ask for the split by its chunk size.
"""

from __future__ import annotations

import torch

__all__ = ["CHUNK", "SPLIT_MIN", "split_attention", "split_attention_naive", "split_chunk"]

SPLIT_MIN = 4096  # cache length (keys) from which "auto" splits a CUDA step
CHUNK = 512  # keys per chunk under "auto"


def split_chunk(split, max_len: int, device) -> int | None:
    """The chunk size a decoder of `max_len` positions on `device` splits its exact steps into, or None
    (no split). split: "auto" (CHUNK on CUDA from SPLIT_MIN keys, never on the CPU), None (never), or
    an int >= 1 (chunks of that many keys, when max_len is longer than one chunk)."""
    if split == "auto":
        return CHUNK if torch.device(device).type == "cuda" and max_len >= SPLIT_MIN else None
    if split is None:
        return None
    if isinstance(split, bool) or not isinstance(split, int) or split < 1:
        raise ValueError(f"split must be 'auto', None or an int >= 1 (keys per chunk), got {split!r}")
    return split if max_len > split else None


def padded(max_len: int, chunk: int | None) -> int:
    """The buffer length: max_len rounded up to a whole number of chunks."""
    return max_len if chunk is None else -(-max_len // chunk) * chunk


def _check(s: torch.Tensor, v: torch.Tensor, extra) -> None:
    if s.dim() != 5 or v.dim() != 5 or s.shape[:2] != v.shape[:2] or s.shape[3:] != v.shape[2:4]:
        raise ValueError(f"s must be (B, G, r, S, c) and v (B, G, S, c, Dv) with the same B, G, S, c; got s "
                         f"{tuple(s.shape)}, v {tuple(v.shape)}")
    if extra is not None:
        logit, value = extra
        if logit.shape != s.shape[:3] or value.shape != (*s.shape[:3], v.shape[-1]):
            raise ValueError(f"extra must be (logit (B, G, r), value (B, G, r, Dv)) = {tuple(s.shape[:3])}, "
                             f"{(*s.shape[:3], v.shape[-1])}; got {tuple(logit.shape)}, {tuple(value.shape)}")


def split_attention(s: torch.Tensor, v: torch.Tensor, extra=None) -> torch.Tensor:
    """softmax(x) · v over every key, by chunks (module docstring).

    Args:
        s: the logits (B, G, r, S, c) of r queries per value group against S chunks of c keys each,
            -inf where a key is hidden; each query sees at least one key (or the extra one).
        v: the values (B, G, S, c, Dv) in chunks, shared by the group's r queries (GQA without a copy).
        extra: None, or one more key per query outside the chunks: (logit (B, G, r), value (B, G, r, Dv)).

    Returns:
        (B, G, r, Dv) in float32.
    """
    _check(s, v, extra)
    s = s.float()
    m = s.amax(-1)  # (B, G, r, S): each chunk's max; -inf for a chunk with no visible key
    p = torch.exp(s - torch.where(m == float("-inf"), 0.0, m)[..., None])  # hidden keys: exp(-inf) = 0
    l = p.sum(-1)  # (B, G, r, S)
    o = torch.einsum("bgrsc,bgscd->bgrsd", p, v.float())  # (B, G, r, S, Dv): one matmul per chunk
    if extra is not None:
        logit, value = extra
        m = torch.cat([m, logit.float()[..., None]], -1)
        l = torch.cat([l, torch.ones_like(l[..., :1])], -1)
        o = torch.cat([o, value.float()[..., None, :]], -2)
    w = torch.exp(m - m.amax(-1, keepdim=True))  # (B, G, r, S'): the log-sum-exp combine
    return (w[..., None] * o).sum(-2) / (w * l).sum(-1)[..., None]


def split_attention_naive(s: torch.Tensor, v: torch.Tensor, extra=None) -> torch.Tensor:
    """The reference of `split_attention`: one softmax over all S·c keys (and the extra one), then the
    weighted sum of the values, materialised."""
    _check(s, v, extra)
    B, G, r, S, c = s.shape
    x = s.float().reshape(B, G, r, S * c)
    vals = v.float().reshape(B, G, 1, S * c, -1).expand(-1, -1, r, -1, -1)  # (B, G, r, N, Dv)
    if extra is not None:
        x = torch.cat([x, extra[0].float()[..., None]], -1)
        vals = torch.cat([vals, extra[1].float()[..., None, :]], -2)
    w = torch.softmax(x, dim=-1)
    return (w[..., None] * vals).sum(-2)
