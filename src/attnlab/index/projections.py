"""Search projections W_Qs, W_Ks per selected layer and the dual distillation loss.

    q^s = normalize(h W_Qs),  k^s = normalize(h W_Ks),  z_tj = q^s_t . k^s_j / tau
    L_NCE(t) = -log( sum_{j in P_t} exp z_tj / sum_{j in C_t} exp z_tj )   P_t: teacher top-K_pos keys
    L_KL(t)  = sum_{j in C_t} A^T_tj log(A^T_tj / A^S_tj),  A^S = softmax over C_t of z
C_t is the admissible (block-causal) key set of query t. Losses average over query tokens.

Optional search RoPE (rope=True): after normalisation, q^s_t and k^s_j are rotated by their
sequence positions as in rotary embeddings, so q^s_t . k^s_j depends on t - j as well as on content
and the search space can express the recency and sink preferences of the teacher. Rotation keeps
unit norm, and a key's rotation is fixed when it is added, so the vectors stay ANN-indexable.

Candidate groups (groups=G): each layer maps to G independent d_search-dim search spaces, one per
run of H / G consecutive query heads (G = the KV-head count: one candidate set per KV head). Group g
is trained against the average attention of its own heads only. G = 1 (default) is one set per
token shared by all heads.

A distance score (score="distance", the scalar selection of seed 000 when d_search = 1): the maps are
not normalised and keys are ranked by -|q^s - k^s|^2 / tau, the Gaussian kernel's exponent. Since
-|q - k|^2 = 2 q.k - |k|^2 - |q|^2 and |q|^2 is the same for every key of a query, the inner product
of the augmented vectors [2 q, -1] . [k, |k|^2] ranks keys and gives the same softmax over them, so
the losses, the exact index and its top-K take the augmented vectors unchanged (`forward`), while a
sorted array reads the raw ones (`raw`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from attnlab.checks import check_impl, check_int, check_positive, check_tensor
from attnlab.ops.gla.chunked import exp_floor

SCORES = ("dot", "distance")


class SearchProjections(nn.Module):
    """Two bias-free d_model -> d_search maps per selected layer; the base model stays frozen.

    layers: the layer indices it holds maps for; d_model: the model's width; d_search: the search
    width (even with rope); tau: the temperature of the training losses; rope / rope_theta: rotate
    search vectors by position; groups: candidate sets per token, each with its own d_search-wide
    map (the maps are groups · d_search wide); score: "dot" (unit vectors, inner product) or
    "distance" (raw vectors, -|q - k|^2; no rope). `forward(layer, hidden, start)` gives the search
    queries and keys whose inner products rank keys (B, G, T, d_search), for "distance" the augmented
    (B, G, T, d_search + 1) ones; `raw` gives the projections themselves. `save(path)` /
    `SearchProjections.load(path)` keep them in one safetensors file with their metadata. Raises
    ValueError for an empty `layers`, a non-positive width, tau or theta, an odd d_search with rope,
    an unknown score or rope with the distance score.
    """

    def __init__(self, layers: list[int], d_model: int, d_search: int = 128, tau: float = 0.05, meta=None,
                 rope: bool = False, rope_theta: float = 10000.0, groups: int = 1, score: str = "dot"):
        super().__init__()
        if score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {score!r}")
        if score == "distance" and rope:
            raise ValueError("score='distance' takes no rope: a rotation would change the distances it ranks by")
        if not layers:
            raise ValueError("layers must be a non-empty list of layer indices")
        check_positive("d_search", d_search)
        check_positive("tau", tau)
        check_positive("rope_theta", rope_theta)
        check_int("groups", groups)  # candidate sets per token
        if rope and d_search % 2:
            raise ValueError(f"d_search must be even with rope=True, got {d_search}")
        self.layers = [int(i) for i in layers]
        self.d_model, self.d_search, self.tau = d_model, d_search, float(tau)
        self.rope, self.rope_theta, self.groups, self.score = bool(rope), float(rope_theta), groups, score
        self.meta = dict(meta or {})
        width = groups * d_search
        self.wq = nn.ModuleDict({str(i): nn.Linear(d_model, width, bias=False) for i in self.layers})
        self.wk = nn.ModuleDict({str(i): nn.Linear(d_model, width, bias=False) for i in self.layers})

    def raw(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (B, T, C) -> the projections h W_Qs, h W_Ks as they are (B, G, T, d_search): no
        normalisation, no rotation."""
        if str(layer) not in self.wq:
            raise ValueError(f"no search projection for layer {layer}; trained layers are {self.layers}")
        w = self.wq[str(layer)].weight
        h = hidden.to(w.dtype)
        B, T, _ = h.shape

        def split(x):  # (B, T, G * d) -> (B, G, T, d)
            return x.view(B, T, self.groups, self.d_search).transpose(1, 2)

        return split(self.wq[str(layer)](h)), split(self.wk[str(layer)](h))

    def forward(self, layer: int, hidden: torch.Tensor, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (B, T, C) of positions start..start+T-1 -> search queries and keys whose inner
        products rank keys: unit vectors (B, G, T, d_search), rotated with rope (score "dot"), or the
        augmented [2 q, -1], [k, |k|^2] (B, G, T, d_search + 1) (score "distance"). G = self.groups."""
        qs, ks = self.raw(layer, hidden)
        if self.score == "distance":
            one = torch.ones_like(qs[..., :1])
            return torch.cat([2 * qs, -one], -1), torch.cat([ks, ks.square().sum(-1, keepdim=True)], -1)
        qs, ks = F.normalize(qs, dim=-1), F.normalize(ks, dim=-1)
        if self.rope:
            qs, ks = self._rotate(qs, start), self._rotate(ks, start)
        return qs, ks

    def _rotate(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Rotate channel pairs (i, i + d/2) by angle pos * theta^(-2i/d) (norm preserving)."""
        half = self.d_search // 2
        inv = self.rope_theta ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
        pos = (torch.arange(x.shape[-2], device=x.device) + start).float()  # start: an int or a 0-dim tensor
        ang = pos[:, None] * inv[None, :]  # (T, d/2)
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    def save(self, path: str | Path, extra_tensors: dict | None = None, extra_meta: dict | None = None) -> None:
        """Atomic safetensors write: weights (+ optional extra tensors) and JSON metadata; WriteError
        naming the file when it fails (the previous file stays)."""
        from attnlab.data.cache import atomic_save_tensors

        tensors = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        tensors.update(extra_tensors or {})
        meta = {"layers": self.layers, "d_model": self.d_model, "d_search": self.d_search, "tau": self.tau,
                "rope": self.rope, "rope_theta": self.rope_theta, "groups": self.groups, "score": self.score,
                "meta": self.meta,
                **(extra_meta or {})}
        atomic_save_tensors(path, tensors, {"attnlab_search": json.dumps(meta)})

    @classmethod
    def load(cls, path: str | Path) -> tuple["SearchProjections", dict, dict]:
        """(projections, all metadata, the extra tensors saved beside the weights) of a file written by
        `save`. Raises ValueError when the file does not exist or is not a search-projection checkpoint."""
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"checkpoint {str(path)!r} does not exist")
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get("attnlab_search")
            if raw is None:
                raise ValueError(f"{path} is not a search-projection checkpoint (no 'attnlab_search' metadata)")
            meta = json.loads(raw)
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        proj = cls(meta["layers"], meta["d_model"], meta["d_search"], meta["tau"], meta.get("meta"),
                   meta.get("rope", False), meta.get("rope_theta", 10000.0), meta.get("groups", 1),
                   meta.get("score", "dot"))
        own = {k: tensors.pop(k) for k in list(tensors) if k.startswith(("wq.", "wk."))}
        proj.load_state_dict(own)
        return proj, meta, tensors


def _check_loss_args(qs, ks, teacher, allowed, k_pos):
    check_tensor("qs", qs, 3)
    check_tensor("ks", ks, 3)
    check_tensor("teacher", teacher, 3)
    check_tensor("allowed", allowed, 3)
    B, T, _ = qs.shape
    if tuple(teacher.shape) != (B, T, ks.shape[1]):
        raise ValueError(f"teacher must be (B, Tq, Tk) = {(B, T, ks.shape[1])}, got {tuple(teacher.shape)}")
    if tuple(allowed.shape) != tuple(teacher.shape):
        raise ValueError(f"allowed must have the teacher's shape {tuple(teacher.shape)}, got {tuple(allowed.shape)}")
    check_int("k_pos", k_pos)


def search_losses_naive(qs, ks, teacher, allowed, tau: float, k_pos: int):
    """Query by query, exactly as the formulas read."""
    nce, kl, n = qs.new_zeros(()), qs.new_zeros(()), 0
    for b in range(qs.shape[0]):
        for t in range(qs.shape[1]):
            c = allowed[b, t].nonzero().squeeze(-1)
            n += 1
            if c.numel() == 0:
                continue
            z = (ks[b, c] @ qs[b, t]) / tau
            a = teacher[b, t, c]
            pos = a.topk(min(k_pos, c.numel())).indices
            nce = nce - (torch.logsumexp(z[pos], 0) - torch.logsumexp(z, 0))
            logp = z - torch.logsumexp(z, 0)
            nz = a > 0
            kl = kl + (a[nz] * (a[nz].log() - logp[nz])).sum()
    return nce / n, kl / n


class SearchTargets:
    """What the losses read of a fixed teacher and admissible mask, computed once (`search_targets`)
    and reused by every step that trains against them (`search_losses_from`): the positives (each
    query's top-k_pos admissible teacher keys) as indices, the teacher restricted to the admissible
    keys, and per query its mass, its sum of A log A and whether it has an admissible key."""

    def __init__(self, allowed, pos, pos_ok, a, mass, ent, has):
        self.allowed, self.pos, self.pos_ok, self.a, self.mass, self.ent, self.has = (
            allowed, pos, pos_ok, a, mass, ent, has)


@torch.no_grad()
def search_targets(teacher: torch.Tensor, allowed: torch.Tensor, k_pos: int) -> SearchTargets:
    """The SearchTargets of teacher (B, Tq, Tk) and the admissible mask (B, Tq, Tk) (see `search_losses`)."""
    kk = min(k_pos, teacher.shape[-1])
    pos = teacher.masked_fill(~allowed, -1.0).topk(kk, dim=-1).indices  # (B, Tq, kk)
    a = torch.where(allowed & (teacher > 0), teacher, torch.zeros((), dtype=teacher.dtype, device=teacher.device))
    ent = torch.where(a > 0, a * a.clamp_min(1e-30).log(), torch.zeros_like(a)).sum(-1)  # (B, Tq)
    return SearchTargets(allowed, pos, allowed.gather(-1, pos), a, a.sum(-1), ent, allowed.any(-1))


def _masked_logsumexp(z: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """log sum over the kept entries of exp(z), along the last dim, with every exponent z - max held
    at or above `exp_floor`: eager `torch.exp` (and `torch.logsumexp`) on a CPU takes a scalar path
    for exponents whose result underflows, 10-40x slower per element, and scores at tau 0.05 put
    most of a row there. Each held term, and each entry not kept, adds at most exp(floor) (~3e-38
    in float32) to a sum of at least 1, far below the float's precision, and gets no gradient
    (where a held term's true one is below that). A row with no kept entry gives a finite, very
    negative value and zero gradient (callers leave such rows out)."""
    info, hidden, floor = torch.finfo(z.dtype), ~keep, exp_floor(z.dtype)
    peak = z.detach().masked_fill(hidden, float("-inf")).amax(-1, keepdim=True).clamp_min(info.min)
    held = (z - peak).masked_fill(hidden, floor).clamp_min(floor)  # hidden entries add exp(floor)
    return peak.squeeze(-1) + held.exp().sum(-1).log()


def search_losses_from(qs: torch.Tensor, ks: torch.Tensor, targets: SearchTargets, tau: float):
    """(L_NCE, L_KL) of `search_losses` against precomputed targets, with one dense (B, Tq, Tk) score
    matrix: L_NCE from the log-sum-exp over the admissible keys and over the k_pos positives
    (gathered); L_KL = sum A log A - sum A z + mass * lse, its sum A z = q . (A k) / tau a matmul."""
    z = (qs @ ks.transpose(1, 2)) / tau  # (B, Tq, Tk)
    lse_all = _masked_logsumexp(z, targets.allowed)  # (B, Tq)
    lse_pos = _masked_logsumexp(z.gather(-1, targets.pos), targets.pos_ok)
    nce = torch.where(targets.has, lse_all - lse_pos, torch.zeros_like(lse_all)).mean()
    a = targets.a.to(z.dtype)
    az = (qs * (a @ ks)).sum(-1) / tau  # sum_j A_tj z_tj, A zero outside the admissible keys
    kl = targets.ent.to(z.dtype) - az + torch.where(targets.mass > 0, lse_all * targets.mass.to(z.dtype),
                                                    torch.zeros_like(lse_all))
    return nce, kl.mean()


def search_losses_fast(qs, ks, teacher, allowed, tau: float, k_pos: int):
    """All queries at once (`search_losses_from` on the teacher's targets)."""
    return search_losses_from(qs, ks, search_targets(teacher, allowed, k_pos), tau)


def search_losses(qs, ks, teacher, allowed, tau: float, k_pos: int = 16, impl: str = "auto"):
    """(L_NCE, L_KL) for search queries qs (B, Tq, d), keys ks (B, Tk, d), teacher A^T (B, Tq, Tk)
    and the admissible mask (B, Tq, Tk); both averaged over the B * Tq queries."""
    check_impl(impl)
    _check_loss_args(qs, ks, teacher, allowed, k_pos)
    check_positive("tau", tau)
    if impl == "naive":
        return search_losses_naive(qs, ks, teacher, allowed, tau, k_pos)
    return search_losses_fast(qs, ks, teacher, allowed, tau, k_pos)


def check_projections(projections, layers) -> None:
    """TypeError / ValueError unless `projections` fit `layers` ((block index, layer) pairs of a model
    whose scalar/hybrid layers decode through the sorted cache): one search space per scalar head."""
    if not isinstance(projections, SearchProjections):
        raise TypeError(f"projections must be a SearchProjections (see train_selector_projections), "
                        f"got {type(projections).__name__}")
    for i, layer in layers:
        if str(i) not in projections.wq:
            raise ValueError(f"projections hold layers {projections.layers}; the model's scalar/hybrid layer {i} has none")
        if projections.groups != layer.n_scalar:
            raise ValueError(f"projections have groups={projections.groups} search spaces per token; layer {i} "
                             f"needs one per scalar/hybrid head ({layer.n_scalar})")
        if projections.d_model != layer.config.d_model:
            raise ValueError(f"projections map d_model={projections.d_model}; layer {i} has d_model={layer.config.d_model}")
