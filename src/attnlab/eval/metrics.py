"""Evaluation metrics as pure functions on tensors, and language-model loss over batches.

Attention weights `w` are (B, H, Tq, Tk): row (b, h, t) is query t's distribution over
keys and should sum to 1. With Tk > Tq (e.g. sink entries placed before the sequence),
query t is aligned with key t + (Tk - Tq). A query counts as valid when `query_mask`
(B, Tq) allows it (default: all) and its row carries mass; the per-head results are
means over valid queries of all batch rows, shape (H,); `reduce=False` gives the
per-query values (B, H, Tq) instead (0 where invalid).
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from .. import interrupt
from ..data.packing import TokenStream, sequential_batches
from ..checks import check_groups, check_int, check_same, check_tensor
from ..models.lm import token_loss
from ..ops.common.heads import expand_heads

# what an evaluation loop's Interrupted says (SIGINT/SIGTERM inside interrupt.graceful(): a sweep's)
EVAL_STOPPED = "evaluation stopped between batches (it starts again when resumed)"

TOPK_KS = (8, 16, 32, 64)


def _check_w(w, query_mask):
    check_tensor("w", w, 4)
    if not w.is_floating_point():
        raise TypeError(f"w must be a floating tensor of attention weights, got dtype {w.dtype}")
    B, H, Tq, Tk = w.shape
    if Tk < Tq:
        raise ValueError(f"w must have at least as many keys as queries (Tk >= Tq), got shape {tuple(w.shape)}")
    valid = w.detach().float().sum(-1) > 0  # (B, H, Tq)
    if query_mask is not None:
        check_tensor("query_mask", query_mask, 2)
        if tuple(query_mask.shape) != (B, Tq):
            raise ValueError(f"query_mask must have shape (B, Tq) = {(B, Tq)}, got {tuple(query_mask.shape)}")
        valid = valid & query_mask.bool()[:, None, :].to(valid.device)
    return valid


def _reduce(per_query: torch.Tensor, valid: torch.Tensor, reduce: bool) -> torch.Tensor:
    per_query = torch.where(valid, per_query, torch.zeros_like(per_query))
    if not reduce:
        return per_query
    n = valid.sum(dim=(0, 2)).clamp_min(1)  # (H,)
    return per_query.sum(dim=(0, 2)) / n


def attention_entropy(w: torch.Tensor, query_mask: torch.Tensor | None = None, *, reduce: bool = True) -> torch.Tensor:
    """Entropy -sum_s w_ts log w_ts of each query's attention (nats, 0 log 0 = 0); mean per
    head over valid queries -> (H,). Uniform causal attention gives log(t + 1) at query t."""
    valid = _check_w(w, query_mask)
    wf = w.detach().float()
    ent = -torch.special.xlogy(wf, wf).sum(-1)  # (B, H, Tq)
    return _reduce(ent, valid, reduce)


def sink_share(
    w: torch.Tensor,
    query_mask: torch.Tensor | None = None,
    *,
    sink: int = 0,
    skip_first_query: bool = True,
    reduce: bool = True,
) -> torch.Tensor:
    """Share of attention mass on key `sink` (the first token by default): sum over valid
    queries of w[..., t, sink] / sum of their total mass, per head -> (H,).

    Query 0 of a causal map can only attend to token 0, so it is left out by default
    (`skip_first_query`); it would add a constant 1 that says nothing about sinks."""
    valid = _check_w(w, query_mask)
    Tk = w.shape[-1]
    if isinstance(sink, bool) or not isinstance(sink, int) or not 0 <= sink < Tk:
        raise ValueError(f"sink must be a key index in [0, {Tk}), got {sink!r}")
    if skip_first_query:
        valid = valid.clone()
        valid[..., 0] = False
    wf = w.detach().float()
    on_sink, total = wf[..., sink], wf.sum(-1)  # (B, H, Tq)
    if not reduce:
        return torch.where(valid, on_sink / total.clamp_min(1e-30), torch.zeros_like(on_sink))
    num = torch.where(valid, on_sink, torch.zeros_like(on_sink)).sum(dim=(0, 2))
    den = torch.where(valid, total, torch.zeros_like(total)).sum(dim=(0, 2))
    return num / den.clamp_min(1e-30)


def topk_scalar_mass(
    w: torch.Tensor,
    qs: torch.Tensor,
    ks: torch.Tensor,
    k: int,
    *,
    causal: bool = True,
    n_prefix: int = 0,
    query_mask: torch.Tensor | None = None,
    reduce: bool = True,
    chunk: int = 256,
) -> torch.Tensor:
    """Fraction of each query's attention mass inside its k nearest keys in scalar space.

    For query t, the candidates are the visible keys (s <= t + Tk - Tq when causal, all
    keys otherwise) after the first `n_prefix` (sink entries, always read); its window is
    `attnlab.ops.window_mask`'s: the k candidates with the smallest |qs_t - ks_s| (all of
    them when fewer are visible; the newest first among tied keys), plus the prefix. The
    metric is sum_{s in window} w_ts: the share a k-entry window of the sorted scalar cache
    (with its sink) would capture. w: (B, H, Tq, Tk); qs: (B, H, Tq); ks: (B, H or G, Tk)
    (G groups shared by H // G heads each). Mean per head over valid queries -> (H,)."""
    from ..ops.scalar import window_mask

    valid = _check_w(w, query_mask)
    B, H, Tq, Tk = w.shape
    check_tensor("qs", qs, 3)
    check_tensor("ks", ks, 3)
    if tuple(qs.shape) != (B, H, Tq):
        raise ValueError(f"qs must have shape (B, H, Tq) = {(B, H, Tq)} to match w, got {tuple(qs.shape)}")
    check_same("ks", ks.shape[0], "w", B, "batch size")
    check_same("ks", ks.shape[2], "w", Tk, "number of keys")
    check_groups(H, ks.shape[1], "ks")
    check_int("k", k)
    check_int("chunk", chunk)
    ks = expand_heads(ks.detach().float(), H)  # (B, H, Tk)
    qs, wf = qs.detach().float(), w.detach().float()
    mass = torch.empty(B, H, Tq, device=w.device)
    for t0 in range(0, Tq, chunk):
        t1 = min(t0 + chunk, Tq)
        keys = ks[..., : t1 + Tk - Tq] if causal else ks  # the keys rows t0..t1 can see
        keep = window_mask(qs[..., t0:t1], keys, k, n_prefix=n_prefix, causal=causal)
        mass[..., t0:t1] = (wf[..., t0:t1, : keys.shape[-1]] * keep).sum(-1)
    return _reduce(mass, valid, reduce)


def alignment_profile(
    w: torch.Tensor,
    qs: torch.Tensor,
    ks: torch.Tensor,
    *,
    bins: int = 10,
    n_prefix: int = 0,
    query_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean scalar distance |qs_t - ks_s| of the (query, key) pairs ranked by attention weight:
    every visible pair of every head and valid query (the first `n_prefix` keys, sinks, left
    out) is sorted by its weight w_ts and cut into `bins` groups of equal size, lowest weight
    first -> (bins,). With scalar projections that align with attention, the last (highest
    weight) bins hold the smallest distances. Shapes as in `topk_scalar_mass` (causal)."""
    valid = _check_w(w, query_mask)
    B, H, Tq, Tk = w.shape
    check_int("bins", bins)
    check_tensor("qs", qs, 3)
    check_tensor("ks", ks, 3)
    if tuple(qs.shape) != (B, H, Tq):
        raise ValueError(f"qs must have shape (B, H, Tq) = {(B, H, Tq)} to match w, got {tuple(qs.shape)}")
    check_same("ks", ks.shape[2], "w", Tk, "number of keys")
    check_groups(H, ks.shape[1], "ks")
    ks = expand_heads(ks.detach().float(), H)
    dist = (qs.detach().float()[..., :, None] - ks[..., None, :]).abs()  # (B, H, Tq, Tk)
    pos_q = torch.arange(Tk - Tq, Tk, device=w.device)[:, None]
    pos_k = torch.arange(Tk, device=w.device)[None, :]
    pair = ((pos_k <= pos_q) & (pos_k >= n_prefix)) & valid[..., None]  # (B, H, Tq, Tk)
    weights, dists = w.detach().float()[pair], dist[pair]
    if weights.numel() < bins:
        raise ValueError(f"alignment_profile needs at least bins={bins} visible pairs, got {weights.numel()}")
    order = weights.argsort(stable=True)
    return torch.stack([d.mean() for d in dists[order].tensor_split(bins)])


def topk_scalar_mass_table(
    w: torch.Tensor, qs: torch.Tensor, ks: torch.Tensor, ks_list: Sequence[int] = TOPK_KS, **kwargs
) -> dict[int, torch.Tensor]:
    """`topk_scalar_mass` for each k in `ks_list` (default 8, 16, 32, 64): {k: (H,)}."""
    return {int(k): topk_scalar_mass(w, qs, ks, int(k), **kwargs) for k in ks_list}


def perplexity(loss: float) -> float:
    """exp(loss), inf when it overflows."""
    return math.exp(loss) if loss < 709.0 else float("inf")


def _xy(batch):
    if hasattr(batch, "x") and hasattr(batch, "y"):
        return batch.x, batch.y
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(f"batches must yield Batch objects or (x, y) pairs, got {type(batch).__name__}")


@torch.no_grad()
def lm_loss(
    model: Callable[[torch.Tensor], torch.Tensor],
    batches: Iterable,
    *,
    max_batches: int | None = None,
    device: torch.device | str | None = None,
    pass_batch: bool = False,
) -> dict[str, float]:
    """Token-weighted mean next-token cross-entropy of `logits = model(x)` (B, T, V) over
    `batches` (Batch objects or (x, y) pairs; targets -100 are skipped). With
    `pass_batch=True` the model is called with the whole Batch (for masks or doc_ids).
    Returns {"loss", "ppl", "tokens", "batches"}."""
    total, count, n = 0.0, 0, 0
    for batch in batches:
        interrupt.check(EVAL_STOPPED)
        if max_batches is not None and n >= max_batches:
            break
        x, y = _xy(batch)
        if device is not None:
            x, y = x.to(device), y.to(device)
            batch = batch.to(device) if pass_batch else batch
        logits = model(batch) if pass_batch else model(x)
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[:2] != y.shape:
            got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise ValueError(f"model must return logits of shape (B, T, V) with (B, T) = {tuple(y.shape)}, got {got}")
        loss = token_loss(logits, y, reduction="sum")
        total += float(loss)
        count += int((y != -100).sum())
        n += 1
    if count == 0:
        raise ValueError("batches held no target tokens to evaluate")
    mean = total / count
    return {"loss": mean, "ppl": perplexity(mean), "tokens": count, "batches": n}


def loss_at_lengths(
    model: Callable[[torch.Tensor], torch.Tensor],
    stream: TokenStream,
    seq_lens: Sequence[int],
    *,
    batch_size: int = 8,
    max_tokens: int | None = None,
    cross_doc: bool = True,
    device: torch.device | str | None = None,
    pass_batch: bool = False,
) -> dict[int, dict[str, float]]:
    """Validation loss and perplexity at each context length: the stream's windows of that
    length in order, at most `max_tokens` target tokens each (so lengths are compared on
    the same text budget). Returns {seq_len: lm_loss(...)}."""
    if not seq_lens:
        raise ValueError("seq_lens must hold at least one context length, got none")
    out = {}
    for T in seq_lens:
        max_batches = None
        if max_tokens is not None:
            max_batches = max(1, math.ceil(max_tokens / (T * batch_size)))
        batches = sequential_batches(stream, T, batch_size, cross_doc=cross_doc, max_batches=max_batches)
        out[int(T)] = lm_loss(model, batches, device=device, pass_batch=pass_batch)
    return out


GATE_LOW = 0.1  # a gate value below this counts as closed (seed 002's sparsity criterion)
GATE_BINS = 10


def gate_profile(g: torch.Tensor, *, low: float = GATE_LOW, bins: int = GATE_BINS) -> tuple[float, list[float]]:
    """Sparsity of sigmoid gate values g (any shape, in [0, 1]): the fraction below `low`, and the
    fraction in each of `bins` equal bins of [0, 1] (the last bin includes 1)."""
    check_tensor("g", g, g.dim())
    if g.numel() == 0:
        raise ValueError("g must hold at least one gate value")
    gf = g.detach().float().flatten()
    if bool(((gf < 0) | (gf > 1) | gf.isnan()).any()):
        raise ValueError("g must hold gate values in [0, 1]")
    idx = (gf * bins).long().clamp_(max=bins - 1)
    hist = torch.bincount(idx, minlength=bins).float() / gf.numel()
    return (gf < low).float().mean().item(), hist.tolist()


def ground_weight(w: torch.Tensor, query_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Principled attention's ground weight w0 = 1 − Σ_j w_ij (the mass a query sends to the ground
    value v0 instead of any key), from its key weights w (B, H, Tq, Tk): mean per head over the
    queries -> (H,)."""
    check_tensor("w", w, 4)
    B, _, Tq, _ = w.shape
    valid = torch.ones(B, w.shape[1], Tq, dtype=torch.bool, device=w.device)
    if query_mask is not None:
        valid = valid & query_mask.bool()[:, None, :].to(w.device)
    return _reduce(1.0 - w.detach().float().sum(-1), valid, True)


def gate_suppression(qg: torch.Tensor, kg: torch.Tensor, beta: torch.Tensor, *, strong: float = 1.0) -> tuple[float, float]:
    """Principled attention's suppress-only gate b_ij = softplus(β_i)·softplus(−qg_i·kg_j) ≥ 0 over the
    causally visible pairs: (its mean in nats, the fraction of pairs it lowers by more than `strong`).
    qg (B, H, T, Dg), kg (B, G, T, Dg) with G dividing H, beta a float, (H,) or (B, H, T)."""
    check_tensor("qg", qg, 4)
    check_tensor("kg", kg, 4)
    check_groups(qg.shape[1], kg.shape[1], "kg")
    B, H, T, _ = qg.shape
    g = qg.detach().float() @ expand_heads(kg.detach().float(), H).transpose(-1, -2)  # (B, H, T, T)
    b = torch.as_tensor(beta, dtype=torch.float32, device=qg.device).detach()
    b = b.view(1, H, 1, 1) if b.dim() == 1 else (b.view(B, H, T, 1) if b.dim() == 3 else b)
    supp = F.softplus(b) * F.softplus(-g)  # (B, H, T, T)
    vis = torch.ones(T, T, dtype=torch.bool, device=qg.device).tril().expand_as(supp)
    vals = supp[vis]
    return vals.mean().item(), (vals > strong).float().mean().item()


def selection_reach(qs: torch.Tensor, ks: torch.Tensor, window: int, *, local: int = 0, n_prefix: int = 0,
                    budget: int | None = None) -> dict[str, list[float]]:
    """Where, by position, the keys a scalar window selects lie: is the selection a retrieval from
    anywhere in the context, or a local window under another name?

    For each query t with more than `budget` keys behind it (sink aside), the `window` keys nearest
    in scalar space among those older than its last `local` (`ops.window_indices`, the keys a model
    trained through the window reads) are measured by their distance t − s. `budget` (default
    window + local) is the key budget of the same model: a sliding window of that many keys reads
    exactly the keys with t − s < budget.

    Args:
        qs: scalar queries (B, H, T), the sink's column first when n_prefix = 1 (as a layer's record holds them).
        ks: scalar keys (B, H, T).
        window: keys selected per query (train_window), an int >= 1.
        local: the local window beside them (local_window), an int >= 0.
        n_prefix: leading sink positions, never counted.
        budget: the sliding window to compare with; default window + local.

    Returns:
        Per head (H,): "in_budget", the share of the selected keys that a sliding window of `budget`
        keys would read too; "uniform", that share if the same number of keys were drawn uniformly
        from the same candidates (the chance level); "median_distance", the median t − s of the
        selected keys, in positions.
    """
    from ..ops.scalar import window_indices

    check_tensor("qs", qs, 3)
    check_tensor("ks", ks, 3)
    check_int("window", window)
    check_int("local", local, 0)
    check_int("n_prefix", n_prefix, 0)
    budget = window + local if budget is None else check_int("budget", budget)
    B, H, T = qs.shape
    idx, ok = window_indices(qs, ks, window, n_prefix=n_prefix, local=local)
    sel, ok = idx[..., n_prefix + local:], ok[..., n_prefix + local:]  # (B, H, T, k): the scalar-selected keys
    t = torch.arange(T, device=qs.device)
    seen = t + 1 - n_prefix  # keys behind each query, itself included, sink aside
    rows = seen > budget  # (T,): a query whose keys a sliding window cannot all read
    dist = t[:, None] - sel  # (B, H, T, k)
    valid = ok & rows[:, None]
    n = valid.sum((0, 2, 3)).clamp_min(1)
    in_budget = ((dist < budget) & valid).sum((0, 2, 3)) / n
    older = (seen - local).clamp_min(1).to(torch.float64)  # candidates: the keys older than the local window
    per_row = ((budget - local) / older).clamp(max=1.0)  # P(a uniform draw from them lies within the budget)
    weights = valid.sum(-1).to(torch.float64)  # (B, H, T): selected keys per row
    uniform = (weights * per_row).sum((0, 2)) / weights.sum((0, 2)).clamp_min(1)
    median = [float(dist[:, h][valid[:, h]].double().median()) if bool(valid[:, h].any()) else float("nan")
              for h in range(H)]
    return {"in_budget": in_budget.tolist(), "uniform": uniform.tolist(), "median_distance": median}


def mean(values) -> float | None:
    """Mean of the values that are not None or NaN; None when there are none."""
    values = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else None


def topk_summary(layers: list[dict]) -> dict[str, float | None]:
    """Mean top-k scalar mass over every scalar head of every layer, per k: {"8": 0.93, ...}."""
    per_k: dict[str, list[float]] = {}
    for layer in layers:
        for k, heads in (layer.get("topk_scalar_mass") or {}).items():
            per_k.setdefault(str(k), []).extend(heads)
    return {k: mean(v) for k, v in sorted(per_k.items(), key=lambda kv: int(kv[0]))}


def layer_inputs(model, x: torch.Tensor, **kwargs) -> dict[int, torch.Tensor]:
    """Each block's attention input (B, T, C) on tokens x, by block index: one forward with hooks;
    `kwargs` go to the model's forward."""
    inputs = {}
    hooks = [
        blk.attn.register_forward_pre_hook(lambda mod, args, i=i: inputs.__setitem__(i, args[0]))
        for i, blk in enumerate(model.blocks)
    ]
    try:
        model(x, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return inputs
