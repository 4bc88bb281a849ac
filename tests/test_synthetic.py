"""MQAR (Zoology definition) and passkey retrieval."""

import re

import pytest
import torch

from attnlab.data import ByteTokenizer, IGNORE, mqar, passkey
from attnlab.data.synthetic import PASSKEY_INTRO, PASSKEY_QUESTION
from attnlab.data.tokenizer import train_bpe


@pytest.mark.parametrize("V,T,P", [(16, 64, 4), (64, 32, 8), (8192, 256, 16)], ids=["mve-16-64-4", "64-32-8", "8k-256-16"])
def test_mqar_layout(V, T, P):
    x, y = mqar(V, T, P, 50, seed=3)
    assert x.shape == y.shape == (50, T) and x.dtype == y.dtype == torch.long
    ctx = 2 * P
    for b in range(50):
        keys, values = x[b, 0:ctx:2], x[b, 1:ctx:2]
        assert ((keys >= 1) & (keys < V // 2)).all() and len(set(keys.tolist())) == P
        assert ((values >= V // 2) & (values < V)).all() and len(set(values.tolist())) == P
        pos = (y[b] != IGNORE).nonzero().flatten()
        assert len(pos) == P and (pos >= ctx).all() and ((pos - ctx) % 2 == 0).all()
        table = dict(zip(keys.tolist(), values.tolist()))
        assert sorted(x[b, pos].tolist()) == sorted(table)  # every pair is queried once
        for p in pos.tolist():
            assert y[b, p].item() == table[x[b, p].item()]
        assert ((x[b] >= 0) & (x[b] < V)).all()


def test_mqar_is_deterministic_and_seeded():
    a, b = mqar(32, 64, 4, 8, seed=11), mqar(32, 64, 4, 8, seed=11)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    c = mqar(32, 64, 4, 8, seed=12)
    assert not torch.equal(a[0], c[0])


def test_mqar_gaps_follow_the_power_law():
    S, power_a, N = 8, 0.3, 40000
    x, y = mqar(64, 2 + 2 * S, 1, N, seed=0, power_a=power_a)
    g = ((y != IGNORE).nonzero()[:, 1] - 2) // 2  # (N,) slot index of the single query
    freq = torch.bincount(g, minlength=S).double() / N
    p = power_a * torch.arange(1, S + 1, dtype=torch.float64) ** (power_a - 1)
    assert torch.allclose(freq, p / p.sum(), atol=0.01)


def test_mqar_small_power_a_favours_short_gaps():
    _, y_small = mqar(256, 256, 8, 200, seed=0, power_a=0.01)
    _, y_flat = mqar(256, 256, 8, 200, seed=0, power_a=1.0)
    mean_pos = lambda y: (y != IGNORE).nonzero()[:, 1].double().mean()
    assert mean_pos(y_small) < mean_pos(y_flat) - 30


def test_mqar_num_queries_and_zero_fill():
    x, y = mqar(16, 64, 4, 30, seed=1, num_queries=2, random_non_queries=False)
    assert ((y != IGNORE).sum(1) == 2).all()
    asked = set()
    for b in range(30):
        pos = (y[b] != IGNORE).nonzero().flatten()
        pairs = dict(zip(x[b, 0:8:2].tolist(), x[b, 1:8:2].tolist()))
        assert all(y[b, p].item() == pairs[x[b, p].item()] for p in pos.tolist())
        asked |= {x[b, 0:8:2].tolist().index(x[b, p].item()) for p in pos.tolist()}
        rest = torch.ones(64, dtype=torch.bool)
        rest[:8] = False
        rest[pos] = False
        assert (x[b, rest] == 0).all()
    assert asked == {0, 1, 2, 3}  # the queried pairs are not always the first ones


def test_mqar_errors():
    with pytest.raises(ValueError, match="num_kv_pairs"):
        mqar(16, 64, 8, 1)
    with pytest.raises(ValueError, match="seq_len"):
        mqar(64, 15, 4, 1)
    with pytest.raises(ValueError, match="power_a"):
        mqar(64, 64, 4, 1, power_a=0.0)
    with pytest.raises(ValueError, match="num_queries"):
        mqar(64, 64, 4, 1, num_queries=5)
    with pytest.raises(ValueError, match="vocab_size"):
        mqar(16.0, 64, 4, 1)


def _decode_rows(tok, x):
    return [tok.decode(row.tolist()) for row in x]


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_passkey_byte_level(depth):
    tok = ByteTokenizer()
    x, y = passkey(tok, 400, depth, 3, seed=5)
    assert x.shape == y.shape == (3, 400)
    for b, text in enumerate(_decode_rows(tok, x)):
        key = re.search(r"The pass key is (\d{5})\. Remember it\. \1 is the pass key\.", text).group(1)
        asked = y[b] != IGNORE
        assert tok.decode(y[b, asked].tolist()) == f" {key}"
        assert asked.nonzero().flatten().tolist() == list(range(400 - 6, 400))
        # the labels are the next input tokens where both exist
        assert torch.equal(y[b, 394:399], x[b, 395:400])
        assert text.startswith(PASSKEY_INTRO)
        before = text.index("\nThe pass key") - len(PASSKEY_INTRO)
        after = text.index(PASSKEY_QUESTION) - (text.index(" is the pass key.\n") + len(" is the pass key.\n"))
        assert before / max(1, before + after) == pytest.approx(depth, abs=0.01)
    keys = {re.search(r"key is (\d+)", t).group(1) for t in _decode_rows(tok, x)}
    assert len(keys) == 3
    x2, y2 = passkey(tok, 400, depth, 3, seed=5)
    assert torch.equal(x, x2) and torch.equal(y, y2)


def test_passkey_with_bpe_and_corpus_filler():
    filler = "".join(f"def helper_{i}(a, b):\n    return a * {i} + b\n\n" for i in range(60))
    tok = train_bpe([filler, PASSKEY_INTRO, PASSKEY_QUESTION, "The pass key is 12345. Remember it."], 300)
    x, y = passkey(tok, 256, 0.25, 2, seed=0, filler=filler, digits=3)
    assert x.shape == (2, 256)
    for b in range(2):
        text = tok.decode(x[b].tolist())
        key = re.search(r"The pass key is (\d{3})\.", text).group(1)
        answer = tok.decode(y[b, y[b] != IGNORE].tolist())
        assert answer == f" {key}" and "def helper_" in text and "grass" not in text


def test_passkey_errors():
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match="length"):
        passkey(tok, 100, 0.5)
    with pytest.raises(ValueError, match="depth"):
        passkey(tok, 400, 1.5)
    with pytest.raises(TypeError, match="tokenizer"):
        passkey(object(), 400, 0.5)
    with pytest.raises(ValueError, match="filler"):
        passkey(tok, 400, 0.5, filler="  ")
