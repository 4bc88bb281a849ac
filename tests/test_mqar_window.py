"""MQAR beyond a window: `mqar(..., min_gap=g)` puts every query at least g tokens after every
key-value pair token, `data.mqar_min_gap` trains on it, and the MQAR metrics at longer lengths
(`mqar_scales`) and through a decode window (`mqar_windows`) measure it."""

import hashlib

import pytest
import torch

from attnlab.data import IGNORE, mqar
from attnlab.models.config import ConfigError
from attnlab.train.config import load_config, mqar_min_len


def _digest(x, y) -> str:
    return hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()[:16]


# sequences of the generator before min_gap existed (sha256 of inputs and labels)
BEFORE = [
    ((16, 64, 4, 32), dict(seed=0, num_queries=2), "eedf15ebfae9259e"),
    ((128, 512, 8, 16), dict(seed=7), "c193a2332ef52bcf"),
    ((64, 256, 8, 8), dict(seed=3, power_a=1.0, random_non_queries=False), "c98603b947444972"),
]


@pytest.mark.parametrize("args,kw,digest", BEFORE, ids=["mve", "512-8", "flat-zero-fill"])
@pytest.mark.parametrize("min_gap", [0, 1])
def test_min_gap_0_and_1_keep_the_sequences_bit_for_bit(args, kw, digest, min_gap):
    x, y = mqar(*args, **kw, min_gap=min_gap)
    assert _digest(x, y) == digest


@pytest.mark.parametrize("P,Q,min_gap,T", [(8, 8, 48, 512), (4, 2, 33, 64), (32, 32, 48, 2048), (1, 1, 2, 5)],
                         ids=["512", "mve-33", "4x", "tightest"])
def test_every_query_lies_min_gap_after_every_pair_token(P, Q, min_gap, T):
    x, y = mqar(128, T, P, 200, seed=5, num_queries=Q, min_gap=min_gap, power_a=0.3)
    pos = (y != IGNORE).nonzero()  # (N * Q, 2): example, query position
    assert pos.shape[0] == 200 * Q
    last_pair_token = 2 * P - 1  # the last value
    gaps = pos[:, 1] - last_pair_token
    assert int(gaps.min()) >= min_gap
    assert int(gaps.min()) == min_gap  # the nearest slot is used (power_a favours it), so the rule is tight
    for b, p in pos[:50].tolist():  # every answer is still the value of the asked key
        table = dict(zip(x[b, 0 : 2 * P : 2].tolist(), x[b, 1 : 2 * P : 2].tolist()))
        assert y[b, p].item() == table[x[b, p].item()]


def test_min_gap_shifts_only_the_query_region():
    """The gaps follow the same power law over the slots left after the shift: min_gap = 2m + 1
    gives the positions of min_gap = 0 moved by 2m, from the same random draws."""
    a = mqar(64, 200, 4, 20, seed=9)
    b = mqar(64, 220, 4, 20, seed=9, min_gap=21)  # 20 more positions hold the shift: same slot count
    qa = (a[1] != IGNORE).nonzero()[:, 1]
    qb = (b[1] != IGNORE).nonzero()[:, 1]
    assert torch.equal(qb, qa + 20)
    assert torch.equal(a[0][:, :8], b[0][:, :8])  # the same pairs


def test_min_gap_is_deterministic():
    a, b = mqar(64, 256, 8, 4, seed=1, min_gap=40), mqar(64, 256, 8, 4, seed=1, min_gap=40)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], mqar(64, 256, 8, 4, seed=2, min_gap=40)[0])


def test_min_gap_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"seq_len must be >= .*min_gap.* = 78.*min_gap=47"):
        mqar(64, 77, 8, 1, min_gap=47)  # 16 pair tokens + 46 + 8 queries at 2 positions each = 78
    with pytest.raises(ValueError, match=r"= 70 .*num_queries=4"):
        mqar(64, 69, 8, 1, min_gap=47, num_queries=4)
    mqar(64, 70, 8, 1, min_gap=47, num_queries=4)  # just fits
    with pytest.raises(ValueError, match="min_gap"):
        mqar(64, 512, 8, 1, min_gap=-1)
    with pytest.raises(TypeError, match="min_gap"):
        mqar(64, 512, 8, 1, min_gap=2.5)


def test_config_key_and_its_checks():
    assert mqar_min_len(8, 8, 48) == 16 + 47 + 16
    cfg = load_config(None, ["data.source=mqar", "model.vocab_size=64", "data.seq_len=512", "data.mqar_min_gap=48"])
    assert cfg.data.mqar_min_gap == 48
    assert load_config(None, []).data.mqar_min_gap == 0
    with pytest.raises(ConfigError, match=r"data\.seq_len \(78\).*data\.mqar_min_gap.*\(79\)"):
        load_config(None, ["data.source=mqar", "model.vocab_size=64", "data.seq_len=78", "data.mqar_min_gap=48"])
    with pytest.raises(ConfigError, match=r"data\.mqar_min_gap must be >= 0"):
        load_config(None, ["data.mqar_min_gap=-3"])


def test_training_batches_keep_the_distance_rule(tmp_path):
    from attnlab.train.data import build_data
    from attnlab.train.ddp import DistEnv

    cfg = load_config(None, ["data.source=mqar", "model.vocab_size=64", "data.seq_len=256", "data.mqar_pairs=6",
                             "data.mqar_min_gap=100", "train.batch_size=8", f"run.out_dir={tmp_path}"])
    data = build_data(cfg, DistEnv())
    for batch in [data.train.batch(0), data.train.batch(3), next(data.val(1))]:
        q = (batch.y != IGNORE).nonzero()[:, 1]
        assert q.numel() == 8 * 6 and int(q.min()) - 11 >= 100
    assert "100 tokens after every pair" in data.description
