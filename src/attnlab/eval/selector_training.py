"""Search projections for the "learned" key selector of `attnlab.eval.selectors`, distilled from an
attnlab model's own attention: each scalar/hybrid layer's input is captured with its heads' exact
attention over the real keys (the teacher), then `SearchProjections` (one search space per head)
are trained by InfoNCE + KL (`attnlab.search.search_losses`)."""

from __future__ import annotations

import math
from typing import Iterable

import torch

from ..checks import check_int, check_positive
from ..index.projections import SearchProjections, search_losses_from, search_targets
from ..models.decode import key_rule_of
from ..models.lm import selectable_layers

@torch.no_grad()
def _capture(model, layers, x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: its input h (B, T, C) on tokens x and the exact attention of its scalar heads over
    the real keys (B, H_s, T, T): the sink column dropped and each row renormalised."""
    inputs = {}
    hooks = [layer.register_forward_pre_hook(lambda mod, args, i=i: inputs.__setitem__(i, args[0].detach()))
             for i, layer in layers]
    try:
        model(x)
    finally:
        for h in hooks:
            h.remove()
    out = []
    for i, layer in layers:
        w = layer.attention_weights(inputs[i])[:, : layer.n_scalar].float()  # (B, H_s, T, T + n_prefix)
        w = w[..., w.shape[-1] - w.shape[-2]:]
        out.append((inputs[i].float(), w / w.sum(-1, keepdim=True).clamp_min(1e-30)))
    return out


def _causal(teacher: torch.Tensor) -> torch.Tensor:
    """(B * H, T, T) bool, a view: the causal keys of teacher (B, H, T, T)."""
    B, H, T, _ = teacher.shape
    return torch.ones(T, T, dtype=torch.bool, device=teacher.device).tril().expand(B * H, T, T)


def train_selector_projections(model, batches: Iterable[torch.Tensor], steps: int, *, d_search: int = 32,
                               tau: float = 0.05, rope: bool = True, k_pos: int = 16, alpha: float = 1.0,
                               beta: float = 1.0, lr: float = 2e-3, warmup: int = 20, seed: int = 0):
    """Search projections for the "learned" selector, distilled from `model`'s own attention.

    batches: token tensors (B, T); each is run through the frozen model once, keeping every
    scalar/hybrid layer's input and the exact attention of its heads over the real keys (the
    sink column dropped, rows renormalised), the teacher. Then `steps` Adam steps cycle over the
    batches in order, each minimising alpha * L_NCE + beta * L_KL (`attnlab.search.search_losses`,
    top-k_pos teacher keys as positives) averaged over layers, with one search space of d_search
    dims per head. The learning rate warms up over `warmup` steps and decays to lr / 10 by a
    cosine. Deterministic for a seed (the initialisation; the global RNG is left as it was).
    Returns the SearchProjections; meta["losses"] holds the loss of every step."""

    check_int("steps", steps, 0)
    check_int("d_search", d_search)
    check_int("k_pos", k_pos)
    check_int("warmup", warmup, 0)
    check_int("seed", seed, 0)
    for name, value in (("tau", tau), ("lr", lr)):
        check_positive(name, value)
    for name, value in (("alpha", alpha), ("beta", beta)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise ValueError(f"{name} must be a finite float >= 0, got {value!r}")
    layers = selectable_layers(model)
    if not layers:
        raise ValueError("model has no scalar or hybrid layer to train search projections for")
    heads = {layer.n_scalar for _, layer in layers}
    if len(heads) > 1:
        raise ValueError(f"model: its scalar/hybrid layers have different head counts {sorted(heads)}; "
                         f"one SearchProjections takes one count of search spaces")
    for i, layer in layers:
        if key_rule_of(layer) is not None:
            raise ValueError(f"model: layer {i} has a key rule set; train on exact attention, outside decode_window/select_keys")
    batches = list(batches)
    if not batches:
        raise ValueError("batches must hold at least one token tensor (B, T)")
    for j, x in enumerate(batches):
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.long:
            got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"batches[{j}] must be a (B, T) int64 token tensor, got {got}")
    was_training = model.training
    model.eval()
    try:  # per batch and layer: the input and the teacher's targets (the teacher is fixed: computed once)
        data = []
        for x in batches:
            data.append([(h, search_targets(teacher.flatten(0, 1), _causal(teacher), k_pos))
                         for h, teacher in _capture(model, layers, x)])
    finally:
        model.train(was_training)

    ids = [i for i, _ in layers]
    d_model = layers[0][1].config.d_model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        proj = SearchProjections(ids, d_model, d_search, tau, rope=rope, groups=heads.pop(),
                                 meta={"seed": seed, "steps": steps, "k_pos": k_pos})
    opt = torch.optim.Adam(proj.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        warm = min(1.0, (step + 1) / warmup) if warmup else 1.0
        for g in opt.param_groups:
            g["lr"] = lr * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))
        total = 0.0
        for i, (h, targets) in zip(ids, data[step % len(data)]):
            sq, sk = proj(i, h)  # (B, H, T, d)
            nce, kl = search_losses_from(sq.flatten(0, 1), sk.flatten(0, 1), targets, proj.tau)
            total = total + alpha * nce + beta * kl
        loss = total / len(ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    proj.meta["losses"] = losses
    return proj.eval()
