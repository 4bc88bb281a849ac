"""Attention metrics against hand-computed values and loops; loss and task accuracy helpers."""

import math

import pytest
import torch

from attnlab.data import ByteTokenizer, pack_documents, passkey, sequential_batches
from attnlab.data.synthetic import PASSKEY_QUESTION
from attnlab.eval.metrics import (
    attention_entropy,
    lm_loss,
    loss_at_lengths,
    perplexity,
    sink_share,
    topk_scalar_mass,
    topk_scalar_mass_table,
)
from attnlab.eval.tasks import mqar_accuracy, passkey_accuracy, recall_accuracy
from attnlab.testing import rel_rms


def uniform_causal(B, H, T):
    w = torch.ones(T, T).tril()
    return (w / w.sum(-1, keepdim=True)).expand(B, H, T, T).clone()


def test_entropy_of_uniform_causal_is_log_t_plus_one():
    T = 9
    w = uniform_causal(2, 3, T)
    per_q = attention_entropy(w, reduce=False)
    assert per_q.shape == (2, 3, T)
    want = torch.log(torch.arange(1, T + 1, dtype=torch.float32))
    assert torch.allclose(per_q, want.expand(2, 3, T), atol=1e-6)
    assert torch.allclose(attention_entropy(w), torch.full((3,), want.mean().item()), atol=1e-6)


def test_entropy_one_hot_mask_and_padding():
    T = 5
    w = uniform_causal(1, 2, T)
    w[:, 1] = torch.eye(T)  # head 1 attends to itself only
    assert attention_entropy(w)[1].item() == pytest.approx(0.0, abs=1e-7)
    qm = torch.tensor([[False, False, True, False, True]])
    assert attention_entropy(w, qm)[0].item() == pytest.approx((math.log(3) + math.log(5)) / 2, rel=1e-6)
    w[..., 4, :] = 0  # a padded query: no mass, not counted
    assert attention_entropy(w)[0].item() == pytest.approx(sum(math.log(t) for t in range(1, 5)) / 4, rel=1e-6)


def test_sink_share_hand_values():
    T = 6
    w = uniform_causal(1, 1, T)
    want = sum(1 / (t + 1) for t in range(1, T)) / (T - 1)
    assert sink_share(w).item() == pytest.approx(want, rel=1e-6)
    assert sink_share(w, skip_first_query=False).item() == pytest.approx(sum(1 / (t + 1) for t in range(T)) / T, rel=1e-6)
    w2 = torch.tensor([[[[1.0, 0, 0], [0.9, 0.1, 0], [0.2, 0.3, 0.5]]]])
    assert sink_share(w2).item() == pytest.approx((0.9 + 0.2) / 2, rel=1e-6)
    assert sink_share(w2, sink=1).item() == pytest.approx((0.1 + 0.3) / 2, rel=1e-6)
    assert torch.allclose(sink_share(w2, reduce=False), torch.tensor([[[0.0, 0.9, 0.2]]]))
    with pytest.raises(ValueError, match="sink"):
        sink_share(w2, sink=3)


def test_topk_scalar_mass_hand_example():
    # one head, 4 tokens; query 3 sees keys 0..3 at distances |0.0-ks| = 3, 0.1, 2, 0.5
    w = torch.tensor([[[[1.0, 0, 0, 0], [0.5, 0.5, 0, 0], [0.2, 0.3, 0.5, 0], [0.1, 0.2, 0.3, 0.4]]]])
    qs = torch.tensor([[[5.0, 0.0, 9.0, 0.0]]])
    ks = torch.tensor([[[3.0, 0.1, 2.0, 0.5]]])
    per_q = topk_scalar_mass(w, qs, ks, 2, reduce=False)
    # q0: only key 0 visible -> 1.0; q1: both visible -> 1.0;
    # q2 (qs=9): nearest of {3, 0.1, 2} are 3 (d=6) and 2 (d=7) -> 0.2 + 0.5;
    # q3 (qs=0): nearest of {3, 0.1, 2, 0.5} are 0.1 and 0.5 -> 0.2 + 0.4
    assert torch.allclose(per_q, torch.tensor([[[1.0, 1.0, 0.7, 0.6]]]))
    assert topk_scalar_mass(w, qs, ks, 2).item() == pytest.approx((1 + 1 + 0.7 + 0.6) / 4)
    assert topk_scalar_mass(w, qs, ks, 1, reduce=False)[0, 0].tolist() == pytest.approx([1.0, 0.5, 0.2, 0.2])
    assert torch.allclose(topk_scalar_mass(w, qs, ks, 8), torch.ones(1))


def loop_topk_mass(w, qs, ks, k, causal=True):
    B, H, Tq, Tk = w.shape
    ks = ks.repeat_interleave(H // ks.shape[1], dim=1)
    out = torch.zeros(B, H, Tq, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for t in range(Tq):
                vis = list(range(t + Tk - Tq + 1)) if causal else list(range(Tk))
                vis.sort(key=lambda s: abs(qs[b, h, t].item() - ks[b, h, s].item()))
                out[b, h, t] = sum(w[b, h, t, s].item() for s in vis[:k])
    return out


@pytest.mark.parametrize("Tq,Tk,G,causal", [(37, 37, 4, True), (20, 23, 2, True), (1, 1, 4, True), (15, 15, 1, False)],
                         ids=["T37-H4", "sinks3-G2", "T1", "noncausal-G1"])
def test_topk_scalar_mass_matches_loop(Tq, Tk, G, causal):
    B, H = 2, 4
    logits = torch.randn(B, H, Tq, Tk)
    if causal:
        vis = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq)
        logits = logits.masked_fill(~vis, float("-inf"))
    w = logits.softmax(-1)
    qs, ks = torch.randn(B, H, Tq), torch.randn(B, G, Tk)
    for k in (1, 3, 8):
        got = topk_scalar_mass(w, qs, ks, k, causal=causal, reduce=False, chunk=6)
        assert rel_rms(got, loop_topk_mass(w, qs, ks, k, causal)) < 1e-6
    table = topk_scalar_mass_table(w, qs, ks, causal=causal)
    assert list(table) == [8, 16, 32, 64] and all(v.shape == (H,) for v in table.values())
    assert all((table[a] <= table[b] + 1e-6).all() for a, b in [(8, 16), (16, 32), (32, 64)])


def test_metric_errors_name_the_argument():
    w = uniform_causal(1, 2, 4)
    with pytest.raises(ValueError, match="w must have 4 dims"):
        attention_entropy(w[0])
    with pytest.raises(ValueError, match="query_mask"):
        attention_entropy(w, torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="qs"):
        topk_scalar_mass(w, torch.zeros(1, 2, 3), torch.zeros(1, 2, 4), 2)
    with pytest.raises(ValueError, match="ks"):
        topk_scalar_mass(w, torch.zeros(1, 2, 4), torch.zeros(1, 3, 4), 2)
    with pytest.raises(ValueError, match="k must"):
        topk_scalar_mass(w, torch.zeros(1, 2, 4), torch.zeros(1, 2, 4), 0)
    with pytest.raises(TypeError, match="floating"):
        attention_entropy(torch.ones(1, 1, 2, 2, dtype=torch.long))


# ----------------------------------------------------------------------------- loss


class Bigram(torch.nn.Module):
    def __init__(self, V):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(V, V))

    def forward(self, x):
        return self.table[x]  # (B, T, V)


def test_lm_loss_matches_manual_cross_entropy():
    tok = ByteTokenizer()
    stream = pack_documents(["hello world", "def f(x):\n    return x\n", "attention"], tok)
    model = Bigram(tok.vocab_size)
    batches = list(sequential_batches(stream, 8, 2))
    res = lm_loss(model, batches)
    x, y = torch.cat([b.x for b in batches]), torch.cat([b.y for b in batches])
    logp = model(x).log_softmax(-1).gather(-1, y[..., None])
    assert res["loss"] == pytest.approx(-logp.mean().item(), rel=1e-5)
    assert res["ppl"] == pytest.approx(math.exp(res["loss"]), rel=1e-9)
    assert res["tokens"] == y.numel() and res["batches"] == len(batches)
    assert lm_loss(model, [(b.x, b.y) for b in batches], max_batches=1)["tokens"] == batches[0].y.numel()
    y_masked = y.clone()
    y_masked[:, :4] = -100
    assert lm_loss(model, [(x, y_masked)])["tokens"] == y.numel() - 4 * y.shape[0]
    with pytest.raises(ValueError, match="logits"):
        lm_loss(lambda x: x.float(), batches)


def test_loss_at_lengths_uniform_model_is_log_vocab():
    tok = ByteTokenizer()
    stream = pack_documents(["abcdefghij" * 20] * 3, tok)
    uniform = lambda x: torch.zeros(*x.shape, tok.vocab_size)
    res = loss_at_lengths(uniform, stream, [16, 64], batch_size=2, max_tokens=256)
    assert set(res) == {16, 64}
    for T, r in res.items():
        assert r["loss"] == pytest.approx(math.log(257), rel=1e-6)
        assert r["ppl"] == pytest.approx(257, rel=1e-5)
        assert 256 <= r["tokens"] < 256 + 2 * T
    assert perplexity(1000.0) == float("inf")


# ----------------------------------------------------------------------------- tasks


def mqar_oracle(P, V, wrong_keys=()):
    """Reads the key-value pairs at the start and answers each key with its value."""

    def model(x):
        B, T = x.shape
        logits = torch.zeros(B, T, V)
        for b in range(B):
            table = dict(zip(x[b, 0 : 2 * P : 2].tolist(), x[b, 1 : 2 * P : 2].tolist()))
            for t in range(2 * P, T):
                key = x[b, t].item()
                if key in table and key not in wrong_keys:
                    logits[b, t, table[key]] = 1.0
        return logits

    return model


def test_mqar_accuracy_oracle_and_partial():
    kw = dict(vocab_size=16, seq_len=64, num_kv_pairs=4, num_examples=40, batch_size=16)
    assert mqar_accuracy(mqar_oracle(4, 16), **kw) == 1.0
    from attnlab.data import mqar

    x, y = mqar(16, 64, 4, 40, seed=12345)
    asked = y != -100
    want = (asked & (x % 2 == 0)).sum().item() / asked.sum().item()  # the oracle fails on odd keys
    got = mqar_accuracy(mqar_oracle(4, 16, wrong_keys=(1, 3, 5, 7)), **kw)
    assert got == pytest.approx(want)
    acc = recall_accuracy(mqar_oracle(4, 16, wrong_keys=(1, 3, 5, 7)), x, y, batch_size=7)
    assert acc["token_acc"] == pytest.approx(want) and acc["asked"] == asked.sum().item()
    all_right = ((x % 2 == 0) | ~asked).all(1).float().mean().item()
    assert acc["seq_acc"] == pytest.approx(all_right)


def passkey_oracle(tok, search_from=0.0, last_digit_wrong_if_odd=False):
    """Finds the needle in the later part of the text (from fraction `search_from`) and spells it;
    with `last_digit_wrong_if_odd`, odd keys get their last digit wrong (5 of 6 answer tokens right)."""

    def model(x):
        B, T = x.shape
        logits = torch.zeros(B, T, tok.vocab_size)
        for b in range(B):
            text = tok.decode(x[b].tolist())
            q_end = text.rfind(PASSKEY_QUESTION) + len(PASSKEY_QUESTION)
            found = text.find("The pass key is ", int(search_from * q_end))
            key = text[found + 16 : found + 21] if 0 <= found < q_end - 40 else "00000"
            if last_digit_wrong_if_odd and int(key) % 2:
                key = key[:-1] + str((int(key[-1]) + 1) % 10)
            for i, ch in enumerate(" " + key):
                if q_end - 1 + i < T:
                    logits[b, q_end - 1 + i, ord(ch)] = 1.0
        return logits

    return model


def test_passkey_accuracy_oracle_per_depth():
    tok = ByteTokenizer()
    res = passkey_accuracy(passkey_oracle(tok), tok, lengths=[300, 500], depths=[0.0, 1.0], num_examples=3)
    assert res == {(300, 0.0): 1.0, (300, 1.0): 1.0, (500, 0.0): 1.0, (500, 1.0): 1.0}
    blind_start = passkey_accuracy(passkey_oracle(tok, 0.5), tok, lengths=[500], depths=[0.0, 1.0], num_examples=3)
    assert blind_start == {(500, 0.0): 0.0, (500, 1.0): 1.0}
    # exact match per example: a key with one digit wrong scores 0, so the score is the share of even keys
    lengths, depths = [300, 500], [0.0, 0.5]
    res = passkey_accuracy(passkey_oracle(tok, last_digit_wrong_if_odd=True), tok, lengths=lengths, depths=depths,
                           num_examples=6)
    for L in lengths:
        for d in depths:
            _, y = passkey(tok, L, d, 6, seed=12345)
            keys = [int(tok.decode(row[row != -100].tolist())) for row in y]
            assert res[(L, d)] == pytest.approx(sum(k % 2 == 0 for k in keys) / 6)
    assert 0 < min(res.values()) and max(res.values()) < 1


def test_gate_profile_against_a_loop():
    from attnlab.eval.metrics import gate_profile

    g = torch.tensor([0.0, 0.05, 0.0999, 0.1, 0.25, 0.5, 0.95, 1.0]).view(2, 4)
    low, hist = gate_profile(g)
    assert low == pytest.approx(3 / 8)
    want = [0.0] * 10
    for x in g.flatten().tolist():
        want[min(int(x * 10), 9)] += 1 / 8
    assert hist == pytest.approx(want) and sum(hist) == pytest.approx(1.0)
    for bad in (torch.tensor([1.5]), torch.tensor([float("nan")]), torch.empty(0)):
        with pytest.raises(ValueError, match="g must"):
            gate_profile(bad)


@pytest.mark.parametrize("attn", ["gla", "cosformer", "softmax"])
def test_attention_report_gate_and_linear_first_token_share(attn):
    from attnlab.models import LM, ModelConfig
    from attnlab.train.evaluate import attention_report

    torch.manual_seed(0)
    model = LM(ModelConfig(d_model=32, n_layers=2, n_heads=2, vocab_size=256, attn=attn, max_seq_len=24,
                           attention={"output_gate": "elementwise"})).eval()
    for blk in model.blocks:  # a gate that is not the constant 0.5 of its zero initialisation
        torch.nn.init.normal_(blk.attn.gate.proj.weight, std=2.0)
    x = torch.randint(0, 256, (2, 24))
    inputs = {}
    hooks = [blk.attn.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0]))
             for i, blk in enumerate(model.blocks)]
    with torch.no_grad():
        model(x)
        rep = attention_report(model, x)
    for h in hooks:
        h.remove()
    for i, (entry, blk) in enumerate(zip(rep, model.blocks)):
        with torch.no_grad():
            g = blk.attn.gate(inputs[i])
            A = blk.attn.attention_weights(inputs[i]).abs()  # (B, H, T, T)
        assert entry["gate_low"] == pytest.approx((g < 0.1).float().mean().item())
        assert sum(entry["gate_hist"]) == pytest.approx(1.0)
        # the first-token share by a loop over queries 1..T-1: sum of |A[t, 0]| over sum of |A[t, :]|, per head
        for h in range(A.shape[1]):
            num = sum(A[b, h, t, 0].item() for b in range(2) for t in range(1, 24))
            den = sum(A[b, h, t].sum().item() for b in range(2) for t in range(1, 24))
            assert entry["first_token_share"][h] == pytest.approx(num / den, rel=1e-4)


def test_ground_weight_and_gate_suppression_against_the_naive_op():
    from attnlab.eval.metrics import gate_suppression, ground_weight
    from attnlab.ops import principled_attention

    g = torch.Generator().manual_seed(0)
    B, H, T, D = 2, 2, 7, 4
    q, k, qg, kg, v = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(5))
    beta = torch.tensor([0.3, -1.0], dtype=torch.float64)
    eye = torch.eye(T, dtype=torch.float64).expand(B, H, T, T)
    w = principled_attention(q, k, qg, kg, eye, alpha=0.2, beta=beta, gamma=0.5, impl="naive")
    _, w0 = principled_attention(q, k, qg, kg, v, alpha=0.2, beta=beta, gamma=0.5, impl="naive", return_ground=True)
    assert ground_weight(w).tolist() == pytest.approx(w0.mean(dim=(0, 2)).tolist(), rel=1e-6)
    vals = [math.log1p(math.exp(beta[h].item())) * math.log1p(math.exp(-(qg[b, h, i] @ kg[b, h, j]).item()))
            for b in range(B) for h in range(H) for i in range(T) for j in range(i + 1)]
    mean, strong = gate_suppression(qg, kg, beta)
    assert mean == pytest.approx(sum(vals) / len(vals), rel=1e-5)
    assert strong == pytest.approx(sum(x > 1 for x in vals) / len(vals))


def test_attention_report_gives_the_ground_state_of_layers_with_one():
    """A layer whose mechanism has a ground value (principled's v0) reports its ground weight and gate
    suppression, from its own weights and gate vectors; a layer without one reports neither."""
    from attnlab.eval.metrics import gate_suppression, ground_weight, layer_inputs
    from attnlab.models import LM, ModelConfig
    from attnlab.train.evaluate import attention_report

    torch.manual_seed(0)
    model = LM(ModelConfig(d_model=32, n_layers=2, n_heads=2, vocab_size=256, attn=["principled", "softmax"],
                           max_seq_len=16, layer_attention=[{"alpha_init": 0.5, "beta_init": 0.5, "gamma_init": 0.0},
                                                            {}])).eval()
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        rep = attention_report(model, x, alignment=False)
        inputs = layer_inputs(model, x, record=True)
        layer = model.blocks[0].attn
        w = layer.attention_weights(inputs[0]).float()
        layer(inputs[0], record=True)
        p = layer.last.heads
    assert rep[0]["ground_weight"] == ground_weight(w).tolist() and min(rep[0]["ground_weight"]) > 0
    assert (rep[0]["gate_suppression"], rep[0]["gate_suppression_strong"]) == gate_suppression(p.qg, p.kg, p.beta)
    assert not {"ground_weight", "gate_suppression", "gate_suppression_strong"} & set(rep[1])


def test_by_length_analyses_attention_only_up_to_its_cap(monkeypatch):
    """Past ANALYSIS_MAX_LEN the loss is still measured but the T x T attention analysis is skipped
    (at 16K tokens it would need gigabytes per layer); the slope uses the lengths analysed."""
    import importlib
    import types

    from attnlab.models import LM, ModelConfig
    ev = importlib.import_module("attnlab.train.evaluate")

    torch.manual_seed(0)
    model = LM(ModelConfig(vocab_size=257, d_model=16, n_layers=1, n_heads=2, attn="hybrid", max_seq_len=64)).eval()
    stream = pack_documents(["def f(x):\n    return x * 2\n" * 40], ByteTokenizer())
    monkeypatch.setattr(ev, "ANALYSIS_MAX_LEN", 32)
    seen = []
    real = ev.attention_report
    monkeypatch.setattr(ev, "attention_report", lambda m, x, *a, **k: seen.append(x.shape[1]) or real(m, x, *a, **k))
    with torch.no_grad():
        out = ev.by_length(model, lambda x: model(x)[0], stream, [16, 32, 64], [], (4,), max_tokens=256, batch_size=2,
                           data=types.SimpleNamespace(cross_doc=True), device="cpu")
    rows = out["lengths"]
    assert seen == [16, 32] and all(math.isfinite(rows[T]["loss"]) for T in ("16", "32", "64"))
    assert rows["64"]["topk_mass"] == {} and rows["64"]["entropy"] is None and "4" in rows["32"]["topk_mass"]
    assert set(out["miss_slope"]) == {"4"}
