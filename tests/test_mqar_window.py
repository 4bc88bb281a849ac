"""MQAR beyond a window: `mqar(..., min_gap=g)` puts every query at least g tokens after every
key-value pair token, `data.mqar_min_gap` trains on it, and the MQAR metrics at longer lengths
(`mqar_scales`) and through a decode window (`mqar_windows`) measure it."""

import hashlib

import pytest
import torch

from attnlab.data import IGNORE, mqar
from attnlab.models.config import ConfigError
from attnlab.train.config import load_config
from attnlab.train.data_config import mqar_min_len


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


# --------------------------------------------------------------------------- the metrics


class ReachOracle(torch.nn.Module):
    """An LM-shaped MQAR solver that reads only the last `reach` tokens (None: all of them): at a
    position holding one of the opening keys it predicts that key's value when the value lies
    within reach, else token 0, which is never a value."""

    def __init__(self, pairs_per_len: float, vocab_size: int, reach: int | None = None):
        super().__init__()
        self.rate, self.vocab_size, self.reach = pairs_per_len, vocab_size, reach

    def forward(self, x, targets=None, record=False, doc_ids=None):
        T = x.shape[1]
        n = 2 * round(self.rate * T)  # pairs scale with the length
        keys, values = x[:, 0:n:2], x[:, 1:n:2]  # (B, P)
        hit = x[:, :, None] == keys[:, None, :]  # (B, T, P)
        hit[:, :n] = False
        if self.reach is not None:  # value of pair j at 2j + 1: within reach of position t?
            t = torch.arange(T)[:, None]
            hit &= (t - (2 * torch.arange(n // 2) + 1)[None, :] < self.reach)[None]
        answer = (hit * values[:, None, :]).sum(-1)  # (B, T)
        return torch.nn.functional.one_hot(answer, self.vocab_size).float(), None


MQAR_RUN = ["data.source=mqar", "model.vocab_size=64", "data.seq_len=96", "data.mqar_pairs=4", "data.mqar_min_gap=40",
            "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "train.steps=2", "train.warmup_steps=1",
            "train.batch_size=4", "train.eval_every=0", "run.progress=false", "run.tensorboard=false", "run.threads=1"]


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory):
    from attnlab.train import train

    out = tmp_path_factory.mktemp("mqar-window")
    cfg = load_config(None, [*MQAR_RUN, "model.attn=hybrid", f"run.out_dir={out}", "run.name=hybrid"])
    train(cfg)
    return out / "hybrid"


def _evaluate_with(monkeypatch, wrap, *args, **kwargs):
    import importlib

    module = importlib.import_module("attnlab.train.evaluate")
    real = module.load_run

    def wrapped(*a, **k):
        cfg, model, state = real(*a, **k)
        return cfg, wrap(model), state

    monkeypatch.setattr(module, "load_run", wrapped)
    return module.evaluate(*args, write=False, **{"mqar_attention": False, **kwargs})  # oracles have no attention


def test_scaled_accuracy_keeps_the_distance_rule(hybrid_run, monkeypatch):
    """At 1x and 4x every pair lies >= 40 tokens before every query: an oracle reading the last 40
    tokens answers nothing, one reading everything answers everything (4 pairs in 96 tokens, 16 in 384)."""
    full = _evaluate_with(monkeypatch, lambda m: ReachOracle(4 / 96, 64), hybrid_run, mqar_scales=[4])
    assert full["mqar"] == {"1x": {"exact": 1.0}, "4x": {"exact": 1.0}} and full["mqar_accuracy"] == 1.0
    near = _evaluate_with(monkeypatch, lambda m: ReachOracle(4 / 96, 64, reach=40), hybrid_run, mqar_scales=[4])
    assert near["mqar"] == {"1x": {"exact": 0.0}, "4x": {"exact": 0.0}}
    far = _evaluate_with(monkeypatch, lambda m: ReachOracle(4 / 96, 64, reach=41), hybrid_run, mqar_scales=[4])
    # one more token of reach: the last pair's value at gap exactly 40 (the slot power_a favours)
    assert far["mqar"]["1x"]["exact"] > 0 and far["mqar"]["4x"]["exact"] > 0


@pytest.mark.heavy
def test_scaled_and_windowed_accuracy_of_a_model_equal_a_direct_count(hybrid_run):
    from attnlab.eval.tasks import mqar_accuracy
    from attnlab.eval.window import decode_window
    from attnlab.train.evaluate import evaluate, load_run

    ev = evaluate(hybrid_run, mqar_scales=[2], mqar_windows=[8, 400], write=False)
    _, model, _ = load_run(hybrid_run)

    def acc(T, P, window=None):
        with decode_window(model, window):
            return mqar_accuracy(lambda x: model(x)[0], vocab_size=64, seq_len=T, num_kv_pairs=P, min_gap=40)

    assert ev["mqar_accuracy"] == ev["mqar"]["1x"]["exact"] == acc(96, 4)
    assert ev["mqar"]["2x"]["exact"] == acc(192, 8)
    assert ev["mqar"]["1x"]["window=8"] == acc(96, 4, 8)
    assert ev["mqar"]["2x"]["window=8"] == acc(192, 8, 8)
    assert ev["mqar"]["2x"]["window=400"] == ev["mqar"]["2x"]["exact"]  # a window holding every key is exact
    assert set(ev["mqar"]["1x"]) == {"exact", "window=8", "window=400"}
    # where the queries' attention goes, through the same windows; a window holding every key is exact
    assert set(ev["mqar_attention"]) == {"exact", "window=8", "window=400"}
    for a, b in zip(ev["mqar_attention"]["window=400"], ev["mqar_attention"]["exact"]):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    assert len(ev["mqar_attention"]["exact"]) == 2 and set(ev["mqar_attention"]["exact"][0]) == {
        "region_mass", "value_share", "value_reach"}
    assert "mqar_attention" not in evaluate(hybrid_run, mqar_attention=False, write=False)


def test_mqar_metric_errors_before_any_work(hybrid_run, tmp_path):
    from attnlab.train.evaluate import check_mqar_scales, evaluate

    cfg = load_config(hybrid_run / "config.toml")
    assert check_mqar_scales(cfg, [2, 7]) == [2, 7]  # 7 x 4 = 28 keys fit [1, 32)
    with pytest.raises(ValueError, match=r"mqar_scales: 8x needs .* = 32 distinct keys .*model\.vocab_size=64 holds 31.*>= 66"):
        evaluate(hybrid_run, mqar_scales=[8], write=False)
    with pytest.raises(ValueError, match="mqar_scales must be a list of ints >= 1"):
        check_mqar_scales(cfg, [0])
    text = load_config(None, ["data.source=stdlib"])
    with pytest.raises(ValueError, match="data.source is 'stdlib'"):
        check_mqar_scales(text, [4])


def test_sweep_metric_names_values_and_checks(tmp_path):
    from attnlab.experiments.sweep.runs import plan
    from attnlab.experiments.sweep.spec import load_spec, metric_names, mqar_values

    m = {"mqar_accuracy": True, "mqar_scales": [4], "mqar_windows": [32]}
    names = ["mqar_accuracy", "mqar_accuracy/window=32", "mqar_accuracy@4x", "mqar_accuracy@4x/window=32"]
    assert metric_names(m) == names
    assert metric_names({"mqar_scales": [4]}) == ["mqar_accuracy@4x"]
    ev = {"mqar": {"1x": {"exact": 0.9, "window=32": 0.5}, "4x": {"exact": 0.7}}}
    assert mqar_values(ev, m) == dict(zip(names, [0.9, 0.5, 0.7, None]))

    def spec(metrics: str, vocab: int = 64):
        path = tmp_path / "spec.toml"
        path.write_text(f"""seeds = [0]
[base]
model = {{ attn = "hybrid", vocab_size = {vocab}, d_model = 32, n_layers = 1, n_heads = 2 }}
data = {{ source = "mqar", seq_len = 96, mqar_pairs = 4, mqar_min_gap = 40 }}
[[variants]]
name = "hybrid"
[metrics]
{metrics}
""")
        return load_spec(path)

    from attnlab.models.config import ConfigError

    with pytest.raises(ConfigError, match=r"metrics\.mqar_scales must be a list of integers >= 2 .*1x"):
        spec("mqar_accuracy = true\nmqar_scales = [1, 4]")
    with pytest.raises(ConfigError, match=r"metrics\.mqar_windows .* set metrics\.mqar_accuracy"):
        spec("mqar_windows = [32]")
    with pytest.raises(ConfigError, match=r"variant 'hybrid': metrics\.mqar_scales: 8x needs"):
        plan(spec("mqar_accuracy = true\nmqar_scales = [8]"))
    assert len(plan(spec("mqar_accuracy = true\nmqar_scales = [8]", vocab=66))) == 1


def test_zero_filler_reaches_training_batches_and_the_metrics(tmp_path, monkeypatch):
    from attnlab.train.data import build_data
    from attnlab.train.ddp import DistEnv

    zero = ["data.source=mqar", "model.vocab_size=64", "data.seq_len=128", "data.mqar_pairs=4", "data.mqar_min_gap=50",
            "data.mqar_filler=zero", "train.batch_size=4", f"run.out_dir={tmp_path}"]
    data = build_data(load_config(None, zero), DistEnv())
    batch = data.train.batch(1)
    asked = batch.y != IGNORE
    rest = ~asked
    rest[:, :8] = False
    assert (batch.x[rest] == 0).all() and (batch.x[asked] > 0).all()
    want = mqar(64, 128, 4, 4, seed=0, min_gap=50, random_non_queries=False)[1]
    assert ((want != IGNORE).sum(1) == asked.sum(1)).all()
    with pytest.raises(ConfigError, match=r"data\.mqar_filler"):
        load_config(None, ["data.mqar_filler=noise"])
    # the metrics read the same kind of sequence: an oracle that answers only where token 0 fills
    # the sequence scores 1 with the zero filler
    from attnlab.train import train

    cfg = load_config(None, [*zero, "model.attn=softmax", "model.d_model=16", "model.n_layers=1", "model.n_heads=1",
                             "train.steps=1", "train.warmup_steps=1", "train.eval_every=0", "run.progress=false",
                             "run.tensorboard=false", "run.name=zero"])
    train(cfg)

    class ZeroOracle(ReachOracle):
        def forward(self, x, targets=None, record=False, doc_ids=None):
            logits, _ = super().forward(x)
            n = 2 * round(self.rate * x.shape[1])
            other = (x[:, n:] != 0) & (logits[:, n:].argmax(-1) == 0)  # a nonzero token that is not a query
            return logits * (1 - float(other.any())), None

    ev = _evaluate_with(monkeypatch, lambda m: ZeroOracle(4 / 128, 64), tmp_path / "zero", mqar_scales=[2])
    assert ev["mqar"] == {"1x": {"exact": 1.0}, "2x": {"exact": 1.0}}


@pytest.mark.heavy
def test_scales_that_keep_the_pairs(hybrid_run, tmp_path):
    """mqar_scale_pairs = false: s x the length with the training's pairs, which a vocabulary too small
    for s x the pairs still holds."""
    from attnlab.eval.tasks import mqar_accuracy
    from attnlab.experiments.sweep.spec import load_spec, metric_names
    from attnlab.models.config import ConfigError
    from attnlab.train.evaluate import evaluate, load_run

    ev = evaluate(hybrid_run, mqar_scales=[8], mqar_scale_pairs=False, write=False)
    _, model, _ = load_run(hybrid_run)
    want = mqar_accuracy(lambda x: model(x)[0], vocab_size=64, seq_len=768, num_kv_pairs=4, min_gap=40, batch_size=8)
    assert ev["mqar"]["8x"]["exact"] == want
    path = tmp_path / "spec.toml"
    path.write_text('seeds = [0]\n[base]\nmodel = { attn = "hybrid", vocab_size = 64 }\n'
                    'data = { source = "mqar", seq_len = 96, mqar_pairs = 4 }\n[[variants]]\nname = "h"\n'
                    '[metrics]\nmqar_scale_pairs = false\n')
    with pytest.raises(ConfigError, match=r"metrics\.mqar_scale_pairs .* give metrics\.mqar_scales"):
        load_spec(path)
    path.write_text(path.read_text() + "mqar_scales = [8]\n")
    assert metric_names(load_spec(path).metrics) == ["mqar_accuracy@8x"]
