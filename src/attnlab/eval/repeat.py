"""Retrieval inside language: the loss on a span of real text whose earlier copy lies beyond a window.

Each probe is a context of T tokens cut from a token stream (held-out text). A span of `span` tokens,
cut from another place in the stream, is written twice into it: once early (its first token at
position T // 4) and once at the very end. The probe scores the model's loss on the second copy's
tokens after its first (the first token of a span cannot be guessed from the copy: what finds the copy
is the span's start). The control is the same context with the early copy replaced by a different span
of the same length, so the scored tokens are the same and nothing earlier repeats them.

The gap between the copies is about 3T/4 tokens (160 at T = 256, 736 at T = 1024): beyond a sliding
window of 48 or 96 keys, so a model that reads only recent keys can lower the repeated-span loss only
by what the span's own first tokens tell it, as in the control. What the induction-head literature
measures with repeated random tokens, here on natural text: attention that reaches the first copy
copies it, and the loss falls towards zero.

`repeated_span_loss(logits_of, stream, T, ...)` returns {"repeat", "control", "gain" = control -
repeat, "probes", "tokens"}: mean loss in nats per scored token.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..checks import check_int
from ..data.packing import TokenStream


def repeat_probes(stream: TokenStream, T: int, span: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The n probes of length T + 1 (inputs and targets), (n, T + 1) int64 each: the repeated one and
    its control. Offsets are drawn with a generator seeded by `seed`, so every model is scored on the
    same probes."""
    check_int("T", T)
    check_int("span", span, 2)
    check_int("n", n)
    first = T // 4
    if first + span > T + 1 - span:
        raise ValueError(f"span={span} is too long for T={T}: the two copies would overlap (need 2 x span + "
                         f"T // 4 <= T + 1)")
    need = T + 1 + 2 * span
    N = len(stream)
    if N < need:
        raise ValueError(f"the token stream holds {N} tokens; a probe of T={T} needs at least {need}")
    g = torch.Generator().manual_seed(seed)
    tokens = stream.tokens.long()
    ctx_at = torch.randint(0, N - T, (n,), generator=g)
    span_at = torch.randint(0, N - span + 1, (n,), generator=g)
    other_at = torch.randint(0, N - span + 1, (n,), generator=g)
    rep, ctl = [], []
    for c, s, o in zip(ctx_at.tolist(), span_at.tolist(), other_at.tolist()):
        base = tokens[c:c + T + 1].clone()
        sp, other = tokens[s:s + span], tokens[o:o + span]
        base[T + 1 - span:] = sp  # the scored copy, at the end
        r, k = base.clone(), base.clone()
        r[first:first + span] = sp  # its earlier copy
        k[first:first + span] = other  # the control: another span of the same length there
        rep.append(r)
        ctl.append(k)
    return torch.stack(rep), torch.stack(ctl)


@torch.no_grad()
def repeated_span_loss(logits_of: Callable[[torch.Tensor], torch.Tensor], stream: TokenStream, T: int, *,
                       span: int = 32, n: int = 64, batch_size: int = 8, seed: int = 0,
                       device: torch.device | str | None = None) -> dict:
    """Mean loss (nats per token) on the second copy of a repeated span and on the same tokens in the
    control (`repeat_probes`), by `logits_of(x) -> (B, T, V)`. Returns {"repeat", "control", "gain",
    "probes", "tokens"}."""
    check_int("batch_size", batch_size)
    rep, ctl = repeat_probes(stream, T, span, n, seed)
    scored = slice(T + 1 - span, T)  # input positions whose targets are the second copy's tokens 2 .. span
    sums = {}
    for name, probes in (("repeat", rep), ("control", ctl)):
        total = torch.zeros((), dtype=torch.float64)
        for i in range(0, n, batch_size):
            seq = probes[i:i + batch_size].to(device)
            x, y = seq[:, :-1], seq[:, 1:]
            logits = logits_of(x)[:, scored].float()  # (B, span - 1, V)
            total += F.cross_entropy(logits.flatten(0, 1), y[:, scored].flatten(), reduction="sum").double().cpu()
        sums[name] = float(total) / (n * (span - 1))
    return {"repeat": sums["repeat"], "control": sums["control"], "gain": sums["control"] - sums["repeat"],
            "probes": n, "tokens": n * (span - 1)}
