"""L_kl (`regularizers.dense_kl_loss`, `regularizers.kl_dense`): the KL from a hybrid head's dense q·k
attention to the softmax of its scalar kernel, on sampled query rows, as DSA trains its indexer."""

import math

import pytest
import torch

from attnlab.models.config import ConfigError
from attnlab.regularizers import dense_kl_loss, regularization
from attnlab.train.config import load_config


def _inputs(B=2, H=4, T=24, D=8, G=2, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    qs, ks = torch.randn(B, H, T, generator=g, dtype=dtype), torch.randn(B, H, T, generator=g, dtype=dtype)
    q, k = torch.randn(B, H, T, D, generator=g, dtype=dtype), torch.randn(B, G, T, D, generator=g, dtype=dtype)
    return qs.requires_grad_(), ks.requires_grad_(), q.requires_grad_(), k.requires_grad_()


def _reference(qs, ks, tau, q, k, rows=None, kernel="gaussian", n_prefix=0):
    """The formula row by row: KL(softmax(q·k/√d) ‖ softmax(kernel)) over keys s <= t, mean over rows."""
    qs, ks, q, k = (x.detach() for x in (qs, ks, q, k))
    B, H, T = qs.shape
    k = k.repeat_interleave(H // k.shape[1], dim=1)
    total, count = 0.0, 0
    for b in range(B):
        for h in range(H):
            for t in (rows[b].tolist() if rows is not None else range(n_prefix, T)):
                t_abs = t + n_prefix if rows is not None else t
                keys = range(n_prefix, t_abs + 1)
                tt = tau if not isinstance(tau, torch.Tensor) else (tau[h] if tau.dim() == 1 else tau[b, h, t_abs])
                p = torch.softmax(torch.stack([q[b, h, t_abs] @ k[b, h, s] / math.sqrt(q.shape[-1]) for s in keys]), 0)
                d2 = torch.stack([(qs[b, h, t_abs] - ks[b, h, s]) ** 2 / tt for s in keys])
                r = torch.softmax(-d2 if kernel == "gaussian" else -torch.log1p(d2), 0)
                total += float((p * (p.log() - r.log())).sum())
                count += 1
    return total / count


@pytest.mark.parametrize("kernel", ["gaussian", "cauchy"])
@pytest.mark.parametrize("tau_form", ["float", "head", "token"])
@pytest.mark.parametrize("n_prefix", [0, 1])
def test_every_row_equals_the_formula(kernel, tau_form, n_prefix):
    qs, ks, q, k = _inputs(T=9)
    tau = {"float": 0.7, "head": torch.tensor([0.5, 1.0, 2.0, 0.3], dtype=torch.float64),
           "token": torch.rand(2, 4, 9, dtype=torch.float64) + 0.2}[tau_form]
    got = dense_kl_loss(qs, ks, tau, q, k, kernel=kernel, n_prefix=n_prefix)
    assert got.item() == pytest.approx(_reference(qs, ks, tau, q, k, kernel=kernel, n_prefix=n_prefix), rel=1e-10)


def test_sampled_rows_are_a_uniform_subset_and_match_the_formula():
    qs, ks, q, k = _inputs(T=20)
    got = dense_kl_loss(qs, ks, 0.8, q, k, queries=5, generator=torch.Generator().manual_seed(3))
    rows = torch.rand(2, 20, generator=torch.Generator().manual_seed(3)).topk(5, dim=1).indices
    assert got.item() == pytest.approx(_reference(qs, ks, 0.8, q, k, rows=rows), rel=1e-10)
    # many draws cover every row about equally often (uniform, without replacement)
    counts = torch.zeros(20)
    g = torch.Generator().manual_seed(0)
    for _ in range(2000):
        counts += torch.zeros(20).scatter_(0, torch.rand(1, 20, generator=g).topk(5, dim=1).indices[0], 1.0)
    assert (counts / 2000).sub(0.25).abs().max() < 0.04
    # queries >= rows is every row
    full = dense_kl_loss(qs, ks, 0.8, q, k)
    assert dense_kl_loss(qs, ks, 0.8, q, k, queries=20).item() == pytest.approx(full.item(), rel=1e-12)


def test_gradient_reaches_qs_and_ks_only():
    qs, ks, q, k = _inputs()
    tau = torch.full((4,), 0.6, dtype=torch.float64, requires_grad=True)
    dense_kl_loss(qs, ks, tau, q, k, queries=8).backward()
    assert qs.grad.abs().sum() > 0 and ks.grad.abs().sum() > 0
    assert q.grad is None and k.grad is None and tau.grad is None  # the teacher and τ are detached
    # and the gradient is the formula's: a central difference on one scalar key
    qs2, ks2, q2, k2 = _inputs()
    eps, (b, h, s) = 1e-6, (1, 2, 5)
    f = lambda d: _reference(qs2, ks2 + d, 0.6, q2, k2)
    bump = torch.zeros_like(ks2)
    bump[b, h, s] = eps
    dense_kl_loss(qs2, ks2, 0.6, q2, k2).backward()
    assert float(ks2.grad[b, h, s]) == pytest.approx((f(bump) - f(-bump)) / (2 * eps), rel=1e-5)


def test_zero_with_zero_gradient_when_the_scalar_kernel_equals_dense_attention():
    """q·k/√d = −(qs − ks)²/τ for every pair when q = (√D/τ)(−qs², 2qs, −1) and k = (1, ks, ks²):
    the teacher is the student, so the KL and its gradient vanish."""
    B, H, T, tau = 2, 3, 16, 0.4
    g = torch.Generator().manual_seed(1)
    qs = torch.randn(B, H, T, generator=g, dtype=torch.float64).requires_grad_()
    ks = torch.randn(B, H, T, generator=g, dtype=torch.float64).requires_grad_()
    qd, kd = qs.detach(), ks.detach()
    q = torch.stack([-qd**2, 2 * qd, -torch.ones_like(qd)], -1) * math.sqrt(3) / tau
    k = torch.stack([torch.ones_like(kd), kd, kd**2], -1)
    loss = dense_kl_loss(qs, ks, tau, q, k, queries=6)
    loss.backward()
    assert abs(loss.item()) < 1e-12
    assert qs.grad.abs().max() < 1e-10 and ks.grad.abs().max() < 1e-10
    # moving one key away makes it positive
    assert float(dense_kl_loss(qs.detach(), ks.detach() + 0.3 * torch.arange(T), tau, q, k)) > 1e-3


@pytest.mark.parametrize("case", ["large-keys-small-tau", "huge-dots", "float16", "one-key"])
def test_finite_on_hostile_inputs(case):
    qs, ks, q, k = _inputs(T=32)
    tau = 0.5
    if case == "large-keys-small-tau":
        qs, ks, tau = (qs * 1e4).detach().requires_grad_(), (ks * 1e4).detach().requires_grad_(), 1e-4
    elif case == "huge-dots":
        q = q * 1e6
    elif case == "float16":
        qs, ks, q, k = (x.detach().half().requires_grad_() for x in (qs, ks, q, k))
    elif case == "one-key":
        qs, ks = (x[:, :, :1].detach().requires_grad_() for x in (qs, ks))
        q, k = q[:, :, :1], k[:, :, :1]
    loss = dense_kl_loss(qs, ks, tau, q, k, queries=4)
    loss.backward()
    assert torch.isfinite(loss) and loss.item() >= -1e-6
    assert torch.isfinite(qs.grad).all() and torch.isfinite(ks.grad).all()
    if case == "one-key":  # one visible key: both distributions are that key
        assert loss.item() == 0.0


def test_bad_input_names_the_argument():
    qs, ks, q, k = _inputs()
    with pytest.raises(ValueError, match="queries"):
        dense_kl_loss(qs, ks, 0.5, q, k, queries=0)
    with pytest.raises(ValueError, match="kernel"):
        dense_kl_loss(qs, ks, 0.5, q, k, kernel="laplace")
    with pytest.raises(ValueError, match="n_prefix"):
        dense_kl_loss(qs, ks, 0.5, q, k, n_prefix=24)
    with pytest.raises(ValueError, match="tau"):
        dense_kl_loss(qs, ks, -1.0, q, k)
    with pytest.raises(ValueError, match="qs"):
        dense_kl_loss(qs[:, :2], ks, 0.5, q, k)


def _hybrid_model(*extra):
    from attnlab.train.trainer import build_model

    cfg = load_config(None, ["model.attn=hybrid", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
                             "model.vocab_size=64", "data.seq_len=48", "model.attention.train_window=4",
                             "model.attention.local_window=4", *extra])
    torch.manual_seed(0)
    return cfg, build_model(cfg, 64)


@pytest.mark.parametrize("kernel", ["gaussian", "cauchy"])
def test_from_layer_records_while_the_lm_loss_trains_through_the_window(kernel):
    """The records of a window-trained hybrid hold the full-sequence qs, ks, q, k: L_kl (and L_align)
    are computed on them over every key, and reach the scalar projections, which the windowed LM loss
    alone reaches only through the selected keys."""
    cfg, model = _hybrid_model(f"model.attention.kernel={kernel}", "model.attention.sink=true")
    x = torch.randint(64, (2, 48), generator=torch.Generator().manual_seed(0))
    model(x, record=True)
    layers = model.attention_layers()
    recs = [a.last for a in layers]
    got = regularization(recs, {"kl_dense": 1.0, "align": 1.0}, kl_queries=None, kernels=[kernel] * 2)
    want = sum(float(dense_kl_loss(r.qs, r.ks, r.tau, r.q_score, r.k_score, kernel=kernel, n_prefix=r.n_prefix).detach())
               for r in recs)
    assert float(got["kl_dense"].detach()) == pytest.approx(want, rel=1e-6)
    assert recs[0].n_prefix == 1 and recs[0].qs.shape[-1] == 49  # the sink's position is left out
    model.zero_grad()
    got["kl_dense"].backward(retain_graph=True)
    for a in layers:
        assert a.wqs.weight.grad.abs().sum() > 0 and a.wks.weight.grad.abs().sum() > 0
    # the last layer's teacher (its q·k) is not trained by it (an earlier layer's projections are,
    # through the residual stream into the later layers' scalar keys, as with L_align)
    last = layers[-1]
    assert last.wq.weight.grad is None or last.wq.weight.grad.abs().sum() == 0
    assert last.wk.weight.grad is None or last.wk.weight.grad.abs().sum() == 0
    model.zero_grad()
    got = regularization([a.last for a in layers], {"align": 1.0})
    got["align"].backward()
    assert torch.isfinite(got["align"]) and layers[1].wks.weight.grad.abs().sum() > 0


def test_trainer_adds_it_and_the_config_checks_it(tmp_path):
    from attnlab.train import train

    base = ["data.source=mqar", "model.vocab_size=64", "data.seq_len=48", "data.mqar_pairs=4", "model.d_model=32",
            "model.n_layers=2", "model.n_heads=2", "train.steps=2", "train.warmup_steps=1", "train.batch_size=4",
            "train.eval_every=0", "train.log_every=1", "run.progress=false", "run.tensorboard=false",
            f"run.out_dir={tmp_path}", "model.attn=hybrid", "model.attention.train_window=4"]
    cfg = load_config(None, [*base, "regularizers.kl_dense=0.5", "regularizers.kl_queries=8", "run.name=kl"])
    assert cfg.regularizers.active and cfg.regularizers.weights_at(0)["kl_dense"] == 0.5
    train(cfg)
    import json

    rows = [json.loads(line) for line in (tmp_path / "kl" / "log.jsonl").read_text().splitlines()]
    kl = [r["reg_kl_dense"] for r in rows if r.get("kind") == "train"]
    assert len(kl) == 2 and all(v > 0 and math.isfinite(v) for v in kl)
    late = load_config(None, ["model.attn=hybrid", "regularizers.kl_dense_start=5", "regularizers.kl_dense=1"])
    assert late.regularizers.weights_at(4) == {"align": 0.0, "spread": 0.0, "tau": 0.0, "kl_dense": 0.0}
    assert late.regularizers.weights_at(5)["kl_dense"] == 1.0
    with pytest.raises(ConfigError, match=r"regularizers\.kl_dense .* only hybrid heads have.*'scalar'"):
        load_config(None, ["model.attn=scalar", "regularizers.kl_dense=1"])
    with pytest.raises(ConfigError, match=r"regularizers\.kl_queries must be >= 0"):
        load_config(None, ["regularizers.kl_queries=-1"])
