"""Where the attention at MQAR queries goes (`mqar_pair_attention`, `mqar_attention_summary`,
`mqar_attention_report`), the sweep metric `[metrics] mqar_attention` and its report section."""

import pytest
import torch

from attnlab.data import IGNORE, mqar
from attnlab.eval.tasks import mqar_attention_summary, mqar_pair_attention
from attnlab.models.config import ConfigError
from attnlab.train.config import load_config

P = 3


def _task(B=4, T=40, min_gap=12, seed=0):
    return mqar(32, T, P, B, seed=seed, min_gap=min_gap)


def _reference(w, x, y, reach):
    """A loop over every asked position: the heads' mean weight on the pair tokens, on the values,
    on the queried value, and whether some head gives that value at least `reach`."""
    n0 = w.shape[-1] - w.shape[-2]
    out = {"region": [], "values": [], "value": [], "reach": []}
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            if y[b, t] == IGNORE:
                continue
            j = [int(x[b, 2 * i]) for i in range(P)].index(int(x[b, t]))
            row = w[b, :, t, n0:]  # (H, T)
            out["region"].append(float(row[:, : 2 * P].sum(1).mean()))
            out["values"].append(float(row[:, 1 : 2 * P : 2].sum(1).mean()))
            out["value"].append(float(row[:, 2 * j + 1].mean()))
            out["reach"].append(float(row[:, 2 * j + 1].max() >= reach))
    return {k: torch.tensor(v) for k, v in out.items()}


@pytest.mark.parametrize("n_prefix", [0, 1], ids=["plain", "sink"])
def test_per_query_measures_equal_a_loop(n_prefix):
    x, y = _task()
    g = torch.Generator().manual_seed(1)
    T = x.shape[1]
    causal = torch.ones(T, T + n_prefix, dtype=torch.bool).tril(n_prefix)
    scores = torch.randn(4, 2, T, T + n_prefix, generator=g) * 3
    w = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    w2 = w.roll(1, dims=1)  # a second layer
    got = mqar_pair_attention([w, w2], x, y, P, reach=0.05)
    assert len(got) == 2
    for layer, ws in zip(got, (w, w2)):
        ref = _reference(ws, x, y, 0.05)
        assert set(layer) == set(ref)
        for name in ref:
            torch.testing.assert_close(layer[name], ref[name], rtol=1e-6, atol=1e-6)


def test_heads_that_read_the_answer_the_pairs_or_the_recent_keys():
    """One head on the queried value alone: value share 1, reach 1; a head on the last key alone
    (a window of 1 that never reaches a pair): nothing on the pairs; a head spread evenly over the
    pairs: value share 1/P."""
    x, y = _task()
    B, T = x.shape
    rows, cols = (y != IGNORE).nonzero(as_tuple=True)
    answer = torch.zeros(B, 1, T, T)
    recent = torch.eye(T).expand(B, 1, T, T).clone()
    even = torch.zeros(B, 1, T, T)
    even[:, :, :, : 2 * P] = 1 / (2 * P)
    for b, t in zip(rows.tolist(), cols.tolist()):
        j = [int(x[b, 2 * i]) for i in range(P)].index(int(x[b, t]))
        answer[b, 0, t, 2 * j + 1] = 1.0
    s_answer, s_recent, s_even = (mqar_attention_summary([layer]) for layer in
                                  mqar_pair_attention([answer, recent, even], x, y, P))
    assert s_answer == {"region_mass": 1.0, "value_share": 1.0, "value_reach": 1.0}
    assert s_recent == {"region_mass": 0.0, "value_share": None, "value_reach": 0.0}
    assert s_even["region_mass"] == pytest.approx(1.0) and s_even["value_share"] == pytest.approx(1 / P)
    assert s_even["value_reach"] == 1.0  # 1/6 of each head's weight on the value >= 1%
    both = mqar_pair_attention([torch.cat([answer, recent], 1)], x, y, P)[0]  # heads averaged, reach: any head
    assert mqar_attention_summary([both]) == {"region_mass": 0.5, "value_share": 1.0, "value_reach": 1.0}


def test_summary_pools_batches_by_weight():
    parts = [{"region": torch.tensor([1.0]), "values": torch.tensor([1.0]), "value": torch.tensor([1.0]),
              "reach": torch.tensor([1.0])},
             {"region": torch.tensor([0.2, 0.0]), "values": torch.tensor([0.2, 0.0]), "value": torch.tensor([0.0, 0.0]),
              "reach": torch.tensor([0.0, 0.0])}]
    s = mqar_attention_summary(parts)
    assert s["region_mass"] == pytest.approx(0.4) and s["value_reach"] == pytest.approx(1 / 3)
    assert s["value_share"] == pytest.approx(1 / 1.2)  # weight on the answers over weight on all values
    with pytest.raises(ValueError, match="parts is empty"):
        mqar_attention_summary([])


def test_errors_name_the_argument():
    x, y = _task(B=2)
    w = torch.full((2, 1, x.shape[1], x.shape[1]), 1.0 / x.shape[1])
    with pytest.raises(ValueError, match="inputs and labels must have the same shape"):
        mqar_pair_attention([w], x, y[:, :-1], P)
    with pytest.raises(ValueError, match="labels ask nothing"):
        mqar_pair_attention([w], x, torch.full_like(y, IGNORE), P)
    with pytest.raises(ValueError, match=r"weights\[0\] must be \(B=2, H, T=40"):
        mqar_pair_attention([w[:, :, :-1]], x, y, P)
    with pytest.raises(ValueError, match=r"weights\[0\] must have 4 dims"):
        mqar_pair_attention([w[0]], x, y, P)
    with pytest.raises(ValueError, match="reach must be a number in"):
        mqar_pair_attention([w], x, y, P, reach=0)
    with pytest.raises(ValueError, match="num_kv_pairs=30 needs 60 pair tokens"):
        mqar_pair_attention([w], x, y, 30)
    bad = x.clone()
    bad[y != IGNORE] = 31  # a query token no pair holds (keys lie in [1, 16))
    with pytest.raises(ValueError, match="none of its sequence's pair keys"):
        mqar_pair_attention([w], bad, y, P)


MQAR = ["data.source=mqar", "model.vocab_size=32", "data.seq_len=48", "data.mqar_pairs=3", "data.mqar_min_gap=20",
        "model.d_model=32", "model.n_layers=2", "model.n_heads=2"]


def _model(*overrides):
    from attnlab.train.trainer import build_model

    torch.manual_seed(0)
    cfg = load_config(None, [*MQAR, *overrides])
    return cfg, build_model(cfg, cfg.model.vocab_size).eval()


def test_a_sliding_window_reads_no_pair_and_full_attention_does():
    from attnlab.train.evaluate import mqar_attention_report

    cfg, swa = _model("model.attn=softmax", "model.attention.sliding_window=16")
    report = mqar_attention_report(swa, cfg, [], "cpu", num_examples=8)
    assert report == {"exact": [{"region_mass": 0.0, "value_share": None, "value_reach": 0.0}] * 2}
    cfg, full = _model("model.attn=softmax")
    for layer in mqar_attention_report(full, cfg, [], "cpu", num_examples=8)["exact"]:
        assert layer["region_mass"] > 0 and layer["value_reach"] > 0  # an untrained model spreads its weight


def test_windows_of_a_hybrid_and_a_window_holding_every_key():
    from attnlab.train.evaluate import mqar_attention_report

    cfg, model = _model("model.attn=hybrid")
    report = mqar_attention_report(model, cfg, [2, 64], "cpu", num_examples=8, batch_size=3)
    assert set(report) == {"exact", "window=2", "window=64"}
    for a, b in zip(report["window=64"], report["exact"]):  # 64 >= 48 keys: the exact weights
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    # the 2 nearest keys in scalar space: more than half of the queries' weight leaves the pairs
    assert report["window=2"] != report["exact"]


def _spec(tmp_path, metrics: str, source: str = "mqar"):
    from attnlab.experiments.sweep.spec import load_spec

    data = ('{ source = "mqar", seq_len = 48, mqar_pairs = 3, mqar_min_gap = 20 }' if source == "mqar"
            else '{ source = "stdlib", seq_len = 48 }')
    path = tmp_path / "spec.toml"
    path.write_text(f"""seeds = [0]
[base]
model = {{ attn = "hybrid", vocab_size = 32, d_model = 32, n_layers = 2, n_heads = 2 }}
data = {data}
[[variants]]
name = "hybrid"
[metrics]
{metrics}
""")
    return load_spec(path)


def test_sweep_metric_names_values_and_checks(tmp_path):
    from attnlab.experiments.sweep.runs import plan
    from attnlab.experiments.sweep.spec import metric_names, mqar_values

    m = {"mqar_accuracy": True, "mqar_windows": [8], "mqar_attention": [1]}
    names = metric_names(m)
    assert names == ["mqar_accuracy", "mqar_accuracy/window=8", "mqar_region_mass@L1", "mqar_region_mass@L1/window=8",
                     "mqar_value_share@L1", "mqar_value_share@L1/window=8", "mqar_value_reach@L1",
                     "mqar_value_reach@L1/window=8"]
    layer = {"region_mass": 0.5, "value_share": 0.25, "value_reach": 1.0}
    ev = {"mqar": {"1x": {"exact": 0.9}}, "mqar_attention": {"exact": [{}, layer]}}
    assert mqar_values(ev, m) == dict(zip(names, [0.9, None, 0.5, None, 0.25, None, 1.0, None]))
    assert len(plan(_spec(tmp_path, "mqar_accuracy = true\nmqar_attention = [0, 1]"))) == 1
    with pytest.raises(ConfigError, match=r"metrics\.mqar_attention must be a list of integers >= 0"):
        _spec(tmp_path, "mqar_attention = [-1]")
    with pytest.raises(ConfigError, match=r"metrics\.mqar_attention names layer 2; .*model\.n_layers=2"):
        plan(_spec(tmp_path, "mqar_attention = [2]"))
    with pytest.raises(ConfigError, match=r"metrics\.mqar_attention measures .* data\.source is 'stdlib'"):
        plan(_spec(tmp_path, "mqar_attention = [0]", source="stdlib"))


def test_the_report_section_says_which_runs_reach_the_pairs_and_which_recall():
    from attnlab.experiments.sweep.profiles import mqar_attention_section

    def run(variant, seed, acc, region, reach):
        return {"variant": variant, "seed": seed, "metrics": {"mqar_accuracy": acc, "mqar_region_mass@L0": region,
                                                              "mqar_value_reach@L0": reach}}

    runs = [run("swa", 0, 0.2, 0.0, 0.0), run("window", 0, 0.25, 0.6, 0.9), run("window", 1, 0.99, 0.3, 0.5)]
    names = ["mqar_region_mass@L0", "mqar_value_reach@L0"]
    variants = {v: {"mean": {n: 0.1 for n in names}, "sd": {n: None for n in names}, "mqar_pairs": 4}
                for v in ("swa", "window")}
    text = "\n".join(mqar_attention_section({"scalars": ["mqar_accuracy", *names], "runs": runs, "variants": variants}))
    assert "## Where the queries' attention goes" in text and "1/4 for heads blind" in text
    assert "- swa, seed 0: does not reach the pairs (region mass up to 0.00, the queried value read in up to 0% " \
           "of queries); it does not recall (mqar_accuracy 0.200)." in text
    assert "- window, seed 0: reaches the pairs" in text and "- window, seed 1: reaches the pairs" in text
    assert "it recalls (mqar_accuracy 0.990)" in text
    assert "Runs that reach the pairs yet do not recall (window)" in text
    assert "Runs that do not reach the pairs (swa)" in text
    assert mqar_attention_section({"scalars": ["mqar_accuracy"], "runs": runs, "variants": variants}) == []


def test_the_eval_report_shows_the_attention_table():
    from attnlab.experiments.report import eval_markdown

    layer = {"region_mass": 0.5, "value_share": 0.25, "value_reach": 1.0}
    text = eval_markdown({"run_dir": "r", "checkpoint": "c", "step": 1, "attn": ["hybrid"], "mqar_accuracy": 0.5,
                          "mqar_attention": {"exact": [layer], "window=8": [dict(layer, value_share=None)]}})
    assert "| layer | keys     | pair tokens | value share | value reached |" in text
    assert "|     0 | exact    |      0.5000 |      0.2500 |         1.000 |" in text
    assert "|     0 | window=8 |      0.5000 |           — |         1.000 |" in text
    assert "pair tokens" not in eval_markdown({"run_dir": "r", "checkpoint": "c", "step": 1, "attn": ["hybrid"],
                                               "mqar_accuracy": 0.5})


def test_a_stop_requested_during_evaluation_ends_it_between_batches():
    """Inside `interrupt.graceful()` (a sweep's worker), SIGTERM stops an evaluation at its next
    batch rather than after all of it; the sweep evaluates the run again when resumed."""
    import os
    import signal

    from attnlab import interrupt
    from attnlab.eval.tasks import mqar_accuracy
    from attnlab.train.evaluate import mqar_attention_report

    import time

    cfg, model = _model("model.attn=softmax")
    calls = []

    def signal_self():  # the signal is recorded by a watcher thread: wait until it is
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while interrupt.requested() is None and time.monotonic() < deadline:
            time.sleep(0.01)

    def logits(x):
        calls.append(x.shape[0])
        if len(calls) == 2:
            signal_self()
        return model(x)[0]

    task = dict(vocab_size=32, seq_len=48, num_kv_pairs=3, min_gap=20, num_examples=8, batch_size=2)
    with pytest.raises(interrupt.Interrupted, match="evaluation stopped between batches"):
        with interrupt.graceful():
            mqar_accuracy(logits, **task)
    assert calls == [2, 2]  # the batch running when the signal came finished; no other started
    with pytest.raises(interrupt.Interrupted, match="evaluation stopped between batches"):
        with interrupt.graceful():
            signal_self()
            mqar_attention_report(model, cfg, [], "cpu", num_examples=8)
    # the request ended with the block: an evaluation after it runs (a notebook's, after a stopped train())
    assert interrupt.requested() is None
    assert 0 <= mqar_accuracy(logits, **task) <= 1
