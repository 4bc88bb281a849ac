"""Query chunks and the keys each reads: a causal sliding window's band (`band_spans`), or each
chunk's causal prefix (`chunk_spans`), so that no path of a windowed or packed op builds Tq x Tk."""

from __future__ import annotations

import torch

BAND_CHUNK = 256  # query rows per chunk


def band_spans(Tq: int, Tk: int, window: int, chunk: int = BAND_CHUNK, n_prefix: int = 0):
    """The (a, b, lo, hi) spans that compute a causal sliding window of `window` keys by query
    chunks: query rows a..b-1 (the last Tq of Tk positions) see no key outside n_prefix's leading
    keys and lo..hi-1, so each chunk reads (b - a) x (n_prefix + hi - lo) scores, never Tq x Tk."""
    off = Tk - Tq
    for a in range(0, Tq, chunk):
        b = min(Tq, a + chunk)
        yield a, b, min(max(n_prefix, a + off - window + 1), b + off), b + off


def chunk_spans(Tq: int, Tk: int, causal: bool, window: int | None, chunk: int = BAND_CHUNK, n_prefix: int = 0):
    """`band_spans` under a causal window; else (a, b, 0, hi) for every chunk of `chunk` query rows,
    hi the end of the keys its last row sees (all Tk without causal masking)."""
    if causal and window is not None:
        return band_spans(Tq, Tk, window, chunk, n_prefix)
    off = Tk - Tq
    return ((a, min(Tq, a + chunk), 0, min(Tq, a + chunk) + off if causal else Tk) for a in range(0, Tq, chunk))


def band_keys(x: torch.Tensor, lo: int, hi: int, n_prefix: int, dim: int = 2) -> torch.Tensor:
    """The keys a span of `band_spans` reads along `dim`: the prefix, then lo..hi-1."""
    part = x.narrow(dim, lo, hi - lo)
    return part if not n_prefix else torch.cat([x.narrow(dim, 0, n_prefix), part], dim=dim)


def band_mask(a: int, b: int, lo: int, hi: int, off: int, window: int, n_prefix: int, device) -> torch.Tensor:
    """(b - a, n_prefix + hi - lo) bool: which keys of `band_keys` query rows a..b-1 see."""
    rows = torch.arange(a + off, b + off, device=device)[:, None]  # query positions
    cols = torch.cat([torch.arange(n_prefix, device=device), torch.arange(lo, hi, device=device)])[None, :]
    return (cols <= rows) & ((cols > rows - window) | (cols < n_prefix))


def document_mask(seg: torch.Tensor, a: int, b: int, lo: int, hi: int, off: int, causal: bool,
                  window: int | None) -> torch.Tensor:
    """(B, 1, b - a, hi - lo) bool: which keys lo..hi-1 query rows a..b-1 (at positions a + off ..) see
    with packed documents, seg (B, Tk) each key's document: those of their own document, up to
    themselves under `causal`, their last `window` with a sliding window."""
    rows = torch.arange(a + off, b + off, device=seg.device)[:, None]  # query positions
    cols = torch.arange(lo, hi, device=seg.device)[None, :]
    mask = seg[:, None, a + off:b + off, None] == seg[:, None, None, lo:hi]
    if causal:
        mask = mask & (cols <= rows)
    if window is not None:
        mask = mask & (cols > rows - window)
    return mask
