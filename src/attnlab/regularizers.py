"""The scalar-space regularizers L_align, L_spread, L_tau, L_kl (docs/mechanisms.md#regularizers).

They shape the scalar keys of scalar and hybrid heads so that the sorted cache needs only a
small window at decode time:

- `align_loss`: attention-weighted squared scalar distance, weights stop-gradiented, so the
  scalar projections learn to predict what the heads attend to;
- `spread_loss`: sorted keys against uniform quantile targets, so keys do not collapse;
- `tau_loss`: log(1 + τ) summed over heads, so the bandwidth stays narrow;
- `dense_kl_loss`: KL from the head's dense dot-product attention (detached) to the softmax of
  its scalar kernel, on a sample of query rows, as DeepSeek's DSA trains its indexer: the scalar
  keys learn to rank first the keys that q·k would attend to, including those a top-k window
  did not select (which the LM loss through the window cannot reach).

Each takes tensors; `regularization(records, weights)` feeds them from the records that
`Attention(..., record=True)` leaves in `layer.last` (any object with the same attributes works).
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

from .checks import check_choice, check_impl, check_positive, check_same, check_tensor
from .ops import hybrid_attention, hybrid_logits, scalar_attention, scalar_logits
from .ops.common.heads import expand_heads
from .ops.common.precision import upcast
from .ops.scalar import scalar_scores

REDUCTIONS = ("pairs", "queries")


def _check_scalars(qs, ks, q, k) -> tuple[int, int, int]:
    check_tensor("qs", qs, 3)
    check_tensor("ks", ks, 3)
    if qs.shape != ks.shape:
        raise ValueError(f"qs and ks must have the same shape (B, H, T), got {tuple(qs.shape)} and {tuple(ks.shape)}")
    B, H, T = qs.shape
    if (q is None) != (k is None):
        raise ValueError("q and k must be given together (hybrid score) or both left out (scalar score)")
    if q is not None:
        check_tensor("q", q, 4)
        check_tensor("k", k, 4)
        check_same("qs", H, "q", q.shape[1], "heads (dim 1)")
        check_same("qs", T, "q", q.shape[2], "sequence length (dim 2)")
        check_same("qs", T, "k", k.shape[2], "sequence length (dim 2)")
    return B, H, T


def align_loss(
    qs: torch.Tensor,
    ks: torch.Tensor,
    tau,
    *,
    q: torch.Tensor | None = None,
    k: torch.Tensor | None = None,
    causal: bool = True,
    n_prefix: int = 0,
    reduction: str = "pairs",
    impl: str = "auto",
) -> torch.Tensor:
    """L_align = mean over visible (query t, key s) pairs of stopgrad(w_ts)·(qs_t − ks_s)².

    w are the head's own attention weights: softmax(−(qs−ks)²/τ) for scalar heads, or with q, k
    given, the hybrid weights softmax(q·k/√d − (qs−ks)²/τ). Gradient reaches qs and ks only (through
    the squared distance), never q, k or τ. qs, ks (B, H, T); τ a float, (H,) or (B, H, T); q (B, H, T, D),
    k (B, G, T, D) with G dividing H. The first `n_prefix` query rows (e.g. a sink's extra leading
    query) are left out; their keys are still attended to. reduction "pairs" divides by the number
    of visible pairs (a 1/n² mean over all pairs, restricted to what is visible); "queries" by the number
    of queries, which makes it the mean per-query E_w[(qs−ks)²] and independent of T.

    Cost on the fast path: no T×T matrix. Per query, Σ_s w_ts(qs_t − ks_s)² = qs_t² − 2·qs_t·E_w[ks]
    + E_w[ks²], and E_w[ks], E_w[ks²] are one extra call of the head's own fast attention op with
    [ks, ks²] as 2-wide values, its score inputs detached (so w carries no gradient) and the values
    not (so ks gets the gradient through the readout): the cost of one attention pass with Dv = 2.
    Keys are centred by their detached mean first, which leaves every distance unchanged and keeps
    qs² − 2·qs·E[ks] + E[ks²] from cancelling when |ks| is large; 16-bit inputs are computed in
    float32. "naive" builds the (B, H, T, T) weights and distances as the formula reads.
    """
    check_impl(impl)
    check_choice("reduction", reduction, REDUCTIONS)
    B, H, T = _check_scalars(qs, ks, q, k)
    if not isinstance(n_prefix, int) or not 0 <= n_prefix < T:
        raise ValueError(f"n_prefix must be an int in [0, T={T}), got {n_prefix!r}")
    check_positive("tau", tau)
    cdt = upcast(qs.dtype)
    if cdt != qs.dtype:  # 16-bit inputs: the loss is computed in float32
        qs, ks = qs.to(cdt), ks.to(cdt)
        q, k = (None, None) if q is None else (q.to(cdt), k.to(cdt))
        tau = tau.to(cdt) if isinstance(tau, torch.Tensor) else tau
    if impl == "naive":
        rows = _align_rows_naive(qs, ks, tau, q, k, causal)  # (B, H, T)
    else:
        rows = _align_rows_fast(qs, ks, tau, q, k, causal)
    rows = rows[..., n_prefix:]
    rows_n = T - n_prefix  # counted query rows; causal row t sees t + 1 keys
    denom = (sum(range(n_prefix + 1, T + 1)) if causal else rows_n * T) if reduction == "pairs" else rows_n
    return rows.sum() / (B * H * denom)  # a Python count: no value read back from the device


def _align_rows_naive(qs, ks, tau, q, k, causal):
    """Σ_s stopgrad(w_ts)(qs_t − ks_s)² per query, from the full (T, T) matrices."""
    with torch.no_grad():  # the head's own logits, masked as it masks them; w carries no gradient
        logits = scalar_logits(qs, ks, tau, causal) if q is None else hybrid_logits(q, k, qs, ks, tau, causal)
        w = torch.softmax(logits, dim=-1)  # (B, H, T, T)
    dist2 = (qs.unsqueeze(-1) - ks.unsqueeze(-2)) ** 2  # (B, H, T, T)
    return (w.to(dist2.dtype) * dist2).sum(-1)  # (B, H, T)


def _align_rows_fast(qs, ks, tau, q, k, causal):
    """The same rows from E_w[ks] and E_w[ks²], read out by the head's own attention op."""
    centre = ks.detach().mean(dim=-1, keepdim=True)  # (B, H, 1)
    qc, kc = qs - centre, ks - centre  # distances unchanged
    vals = torch.stack([kc, kc * kc], dim=-1)  # (B, H, T, 2), carries the gradient into ks
    tau_d = tau.detach() if isinstance(tau, torch.Tensor) else tau
    if q is None:
        m = scalar_attention(qc.detach(), kc.detach(), vals, tau_d, causal=causal, impl="auto")
    else:
        vals = vals.to(q.dtype)
        m = hybrid_attention(q.detach(), k.detach(), vals, qc.detach(), kc.detach(), tau_d, causal=causal, impl="auto")
    m = m.to(qs.dtype)  # (B, H, T, 2): E_w[ks], E_w[ks²] per query
    return qc * qc - 2 * qc * m[..., 0] + m[..., 1]  # (B, H, T)


def spread_loss(ks: torch.Tensor, *, target="adaptive", n_prefix: int = 0) -> torch.Tensor:
    """L_spread = mean over (B, H, position) of (sort(ks)_i − u_i)², u_i uniform quantile targets.

    ks (B, H, T): each head's keys within one sequence are sorted and matched to u = linspace(a, b, T).
    target (a, b) fixes the range (e.g. (-3, 3), the config default); "adaptive" uses mean ± 3·std of that
    head's keys, detached. The sort permutation is a constant of the backward pass: the gradient
    flows through the sorted values back to the keys they came from, never through the order
    (torch.sort's own backward is exactly that scatter). The first `n_prefix` keys (a sink's
    fixed key) are left out. Cost: one sort per head, O(T log T), memory O(T).
    """
    check_tensor("ks", ks, 3)
    if not isinstance(n_prefix, int) or not 0 <= n_prefix < ks.shape[-1]:
        raise ValueError(f"n_prefix must be an int in [0, T={ks.shape[-1]}), got {n_prefix!r}")
    ks = ks[..., n_prefix:]  # (B, H, T)
    T = ks.shape[-1]
    sorted_ks = torch.sort(ks, dim=-1).values  # (B, H, T)
    u = torch.linspace(0.0, 1.0, T, device=ks.device, dtype=ks.dtype)  # (T,)
    if isinstance(target, str):
        check_choice("target", target, ("adaptive",))
        kd = ks.detach()
        mu = kd.mean(-1, keepdim=True)
        sd = kd.std(-1, keepdim=True, unbiased=False)
        lo, hi = mu - 3 * sd, mu + 3 * sd  # (B, H, 1)
    else:
        if not isinstance(target, (tuple, list)) or len(target) != 2 or not float(target[0]) < float(target[1]):
            raise ValueError(f"target must be 'adaptive' or a pair (a, b) with a < b, got {target!r}")
        lo, hi = float(target[0]), float(target[1])
    targets = lo + (hi - lo) * u  # (B, H, T) or (T,)
    return ((sorted_ks - targets) ** 2).mean()


def tau_loss(tau) -> torch.Tensor:
    """L_tau = Σ_heads log(1 + τ_h): log rather than linear, so small τ gets no extreme gradient.

    τ (H,) per head, or (B, H, T) per token (summed over heads, averaged over batch and tokens).
    The alternative, a hard cap, is a parameterisation rather than a loss: set
    `AttentionConfig.tau_max` (a smooth sigmoid cap on τ). Cost: O(H) or O(B·H·T).
    """
    if not isinstance(tau, torch.Tensor):
        raise TypeError(f"tau must be a tensor (H,) or (B, H, T), got {type(tau).__name__}")
    if tau.dim() == 1:
        return torch.log1p(tau).sum()
    if tau.dim() == 3:
        return torch.log1p(tau).sum(1).mean()
    raise ValueError(f"tau must be (H,) or (B, H, T), got shape {tuple(tau.shape)}")


def dense_kl_loss(
    qs: torch.Tensor,
    ks: torch.Tensor,
    tau,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    queries: int | None = None,
    kernel: str = "gaussian",
    n_prefix: int = 0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """L_kl = mean over sampled query rows t (and batch, heads) of KL(p_t ‖ r_t), where over the keys
    s <= t that t sees
        p_t = softmax_s(q_t·k_s / √d), detached: the head's dense dot-product attention, the teacher;
        r_t = softmax_s(kernel(qs_t − ks_s; τ_t)): the scalar kernel alone, −(qs − ks)²/τ (Gaussian) or
              −log(1 + (qs − ks)²/τ) (Cauchy), the distribution whose top-k a window reads.
    As DSA trains its indexer against the main attention: the gradient reaches qs and ks only (τ is
    detached as in L_align, the teacher entirely), and pulls every key q·k favours toward the query
    in scalar space, also the keys that a window trained through the LM loss never selected.

    qs, ks (B, H, T); τ a float, (H,) or (B, H, T); q (B, H, T, D), k (B, G, T, D), G dividing H.
    queries: rows drawn per sequence, uniformly without replacement from the counted rows (None, or
    at least as many rows as there are: every row), with `generator` (or the global RNG of qs's
    device); memory O(B·H·queries·T), never T×T. The first `n_prefix` positions (a sink's extra
    query and key) are left out of both distributions. Computed in float32 for 16-bit inputs.
    """
    B, H, T = _check_scalars(qs, ks, q, k)
    if not isinstance(n_prefix, int) or not 0 <= n_prefix < T:
        raise ValueError(f"n_prefix must be an int in [0, T={T}), got {n_prefix!r}")
    if queries is not None and (isinstance(queries, bool) or not isinstance(queries, int) or queries < 1):
        raise ValueError(f"queries must be None (every row) or an int >= 1, got {queries!r}")
    check_choice("kernel", kernel, ("gaussian", "cauchy"))
    check_positive("tau", tau)
    cdt = upcast(qs.dtype)
    qs, ks = qs[..., n_prefix:].to(cdt), ks[..., n_prefix:].to(cdt)
    q, k = q[:, :, n_prefix:].to(cdt), k[:, :, n_prefix:].to(cdt)
    n = T - n_prefix
    tau = tau.detach().to(cdt) if isinstance(tau, torch.Tensor) else float(tau)
    if isinstance(tau, torch.Tensor) and tau.dim() == 3:
        tau = tau[..., n_prefix:]
    if queries is None or queries >= n:
        rows = torch.arange(n, device=qs.device).expand(B, n)  # (B, R)
    else:
        u = torch.rand(B, n, generator=generator, device=qs.device if generator is None else generator.device)
        rows = u.to(qs.device).topk(queries, dim=1).indices  # (B, R): a uniform sample without replacement
    R = rows.shape[1]
    at = rows[:, None, :].expand(B, H, R)  # (B, H, R)
    if isinstance(tau, torch.Tensor):
        tau_b = tau.gather(-1, at) if tau.dim() == 3 else tau.view(1, -1, 1)
    else:
        tau_b = torch.tensor(tau, dtype=cdt, device=qs.device).view(1, 1, 1)
    hidden = torch.arange(n, device=qs.device).view(1, 1, 1, n) > rows.view(B, 1, R, 1)  # (B, 1, R, T): s > t
    with torch.no_grad():
        q_rows = q.gather(2, at[..., None].expand(B, H, R, q.shape[-1]))  # (B, H, R, D)
        dots = q_rows @ expand_heads(k, H).transpose(-1, -2) / q.shape[-1] ** 0.5  # (B, H, R, T)
        log_p = torch.log_softmax(dots.masked_fill(hidden, float("-inf")), dim=-1)
    student = scalar_scores(qs.gather(-1, at), ks, tau_b, kernel)  # (B, H, R, T), gradient into qs and ks
    log_r = torch.log_softmax(student.masked_fill(hidden, float("-inf")), dim=-1)
    terms = log_p.exp() * (log_p - log_r)
    return terms.masked_fill(hidden, 0.0).sum(-1).mean()


def regularization(records: Iterable, weights: Mapping[str, float], *, spread_target="adaptive", align_reduction="pairs",
                   kl_queries: int | None = None, kernels: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """Σ over layer records of λ_a·L_align + λ_s·L_spread + λ_t·L_tau + λ_kl·L_kl.

    records: the `last` of each `Attention` layer run with record=True (layers without scalar
    heads are skipped, and L_kl skips layers without hybrid scores: it needs q·k). weights:
    {"align": λ_a, "spread": λ_s, "tau": λ_t, "kl_dense": λ_kl}; missing terms count 0 and terms
    with weight 0 are not computed. kl_queries: the query rows L_kl samples per sequence (None:
    all); kernels: each record's scalar kernel, the student of L_kl (None: Gaussian for every
    layer). Returns {"total", "align", "spread", "tau", "kl_dense"} (those computed) with each
    unweighted term summed over layers.
    """
    unknown = set(weights) - {"align", "spread", "tau", "kl_dense"}
    if unknown:
        raise ValueError(f"weights has unknown terms {sorted(unknown)}; allowed: 'align', 'spread', 'tau', 'kl_dense'")
    records = list(records)
    kernels = list(kernels) if kernels is not None else ["gaussian"] * len(records)
    if len(kernels) != len(records):
        raise ValueError(f"kernels must name one kernel per record ({len(records)}), got {len(kernels)}")
    parts: dict[str, torch.Tensor] = {}
    for rec, kernel in zip(records, kernels):
        if rec is None or getattr(rec, "qs", None) is None:
            continue
        n_prefix = getattr(rec, "n_prefix", 0)
        terms = {}
        if weights.get("align", 0.0):
            impl = getattr(rec, "impl", "auto")
            terms["align"] = align_loss(  # a layer's approximate attention has no align counterpart: the fast one
                rec.qs, rec.ks, rec.tau, q=getattr(rec, "q_score", None), k=getattr(rec, "k_score", None),
                causal=rec.causal, n_prefix=n_prefix, reduction=align_reduction, impl="auto" if impl == "approx" else impl,
            )
        if weights.get("spread", 0.0):
            terms["spread"] = spread_loss(rec.ks, target=spread_target, n_prefix=n_prefix)
        if weights.get("tau", 0.0):  # the τ of the sink's extra leading query is left out
            terms["tau"] = tau_loss(rec.tau[..., n_prefix:] if rec.tau.dim() == 3 else rec.tau)
        if weights.get("kl_dense", 0.0) and getattr(rec, "q_score", None) is not None:
            terms["kl_dense"] = dense_kl_loss(rec.qs, rec.ks, rec.tau, rec.q_score, rec.k_score, queries=kl_queries,
                                              kernel=kernel, n_prefix=n_prefix)
        for name, val in terms.items():
            parts[name] = parts[name] + val if name in parts else val
    total = sum((weights[name] * val for name, val in parts.items()), torch.zeros(()))
    return {"total": total, **parts}
