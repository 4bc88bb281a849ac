"""Packed block-causal contexts, capture of native post-RoPE Q/K and attention inputs, the teacher.

The frozen model runs with its normal SDPA attention; the selected layers record their q, k and
the hidden state entering self-attention. The teacher distribution A^T is rebuilt afterwards from
the captured q and k, so the forward never needs the eager path. Packed contexts live on the CPU;
each batch goes to the model's device (`on_device`) as it is read, so what is captured sits there too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from attnlab.checks import check_groups
from attnlab.data.packing import Packed, doc_causal_mask, pack_contexts  # noqa: F401  (search's names)

from .hf_model import model_device
from .hooks import Installed


def load_texts(corpus: str, split: str) -> list[str]:
    """Documents of a corpus split through attnlab.data: 'stdlib' (embedded default), a Hugging Face
    source ('tinystories', 'wikitext103', 'hf:<path>'), or a local text file or folder."""
    from attnlab.data.corpus import load_corpus

    return load_corpus(corpus, split)


def on_device(batch: Packed, device) -> Packed:
    """The batch with its input_ids, position_ids and segments on `device` (no copy where they are)."""
    return Packed(batch.input_ids.to(device), batch.position_ids.to(device), batch.segments.to(device))


def forward_packed(model, batch: Packed):
    """The model's logits on packed contexts with the block-causal mask and restarted positions; the
    batch goes to the model's device first, and the logits are there."""
    batch = on_device(batch, model_device(model))
    allowed = doc_causal_mask(batch.segments)
    # additive float mask: read the same way by SDPA, eager and the search attention function
    mask = torch.zeros(allowed.shape, dtype=model.dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(model.dtype).min)
    return model(input_ids=batch.input_ids, attention_mask=mask, position_ids=batch.position_ids,
                 use_cache=False).logits


@dataclass
class Captured:
    """One layer's activations on one batch: hidden (B, T, C), q (B, H, T, D), k (B, Hkv, T, D)."""

    hidden: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    scaling: float


@torch.no_grad()
def capture(model, batch: Packed, layers: Sequence[int]) -> dict[int, Captured]:
    """Run the frozen model once and return each selected layer's captured activations (on the
    model's device, in its dtype)."""
    out: dict[int, Captured] = {}

    def make(i):
        def handler(module, hidden, q, k, v, allowed, scaling):
            out[i] = Captured(hidden.detach().clone(), q.detach().clone(), k.detach().clone(), float(scaling))
            return None  # keep the model's own SDPA result

        return handler

    with Installed(model, {i: make(i) for i in layers}):
        forward_packed(model, batch)
    return out


def _head_probs(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, scaling: float, s: int, chunk: int):
    """Per-head softmax (B, H, c, Tk) of queries s..s+chunk; head h reads KV head h // (H / Hkv) (GQA)."""
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    qc = q[:, :, s:s + chunk].float().view(B, Hkv, H // Hkv, -1, D)  # (B, Hkv, rep, c, D)
    sc = (qc @ k.float()[:, :, None].transpose(-1, -2)).view(B, H, -1, k.shape[2]) * scaling  # (B, H, c, Tk)
    sc = sc.masked_fill(~allowed[:, :, s:s + chunk], float("-inf"))
    return torch.softmax(sc, dim=-1).nan_to_num(0.0)


def teacher_attention(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, scaling: float,
                      chunk: int = 512, groups: int | None = None) -> torch.Tensor:
    """Head-averaged attention A^T of q (B, H, Tq, D) over k (B, Hkv, Tk, D).

    Each query head h reads KV head h // (H / Hkv) (GQA); `allowed` (B or 1, 1, Tq, Tk) is the mask.
    groups=None averages all heads: (B, Tq, Tk). groups=G averages each run of H / G consecutive heads
    (the heads that share one candidate set): (B, G, Tq, Tk).
    Computed in query chunks so the (H, Tq, Tk) scores never exist at once for long contexts.
    """
    B, H = q.shape[:2]
    G = check_groups(H, 1 if groups is None else groups, "groups")
    allowed = allowed.to(q.device)  # the mask follows the captured q, k
    outs = []
    for s in range(0, q.shape[2], chunk):
        p = _head_probs(q, k, allowed, scaling, s, chunk)
        outs.append(p.view(B, G, H // G, *p.shape[2:]).mean(2))  # (B, G, c, Tk)
    out = torch.cat(outs, dim=2)
    return out[:, 0] if groups is None else out
