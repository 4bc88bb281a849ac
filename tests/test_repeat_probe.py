"""The retrieval-in-language probe (attnlab.eval.repeat) and its held-out text ("stdlib-tests"): the
probes hold what they say, a model that copies from the earlier copy scores near zero on it and no
better than chance on the control, a model that cannot see that far scores both alike, and the sweep
collects the metrics by name."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.data.corpus import load_corpus, stdlib_files, stdlib_root, stdlib_tests_corpus
from attnlab.data.packing import TokenStream
from attnlab.eval.repeat import repeat_probes, repeated_span_loss
from attnlab.experiments.sweep.spec import metric_names, _check_metrics

V = 50


def _stream(n: int = 5000, seed: int = 0) -> TokenStream:
    g = torch.Generator().manual_seed(seed)
    return TokenStream(tokens=torch.randint(1, V, (n,), generator=g, dtype=torch.int32),
                       doc_starts=torch.tensor([0, n - 1]), vocab_size=V, eos_id=0)


def test_probes_hold_a_repeated_span_and_a_control():
    T, span = 128, 16
    rep, ctl = repeat_probes(_stream(), T, span, n=8, seed=3)
    assert rep.shape == ctl.shape == (8, T + 1)
    first, last = T // 4, T + 1 - span
    assert torch.equal(rep[:, first:first + span], rep[:, last:])  # the early copy equals the scored one
    assert torch.equal(rep[:, last:], ctl[:, last:])  # the same scored tokens in the control
    assert not torch.equal(ctl[:, first:first + span], ctl[:, last:])  # ... with no earlier copy
    outside = torch.ones(T + 1, dtype=torch.bool)
    outside[first:first + span] = False
    assert torch.equal(rep[:, outside], ctl[:, outside])  # everything else is the same text
    again, _ = repeat_probes(_stream(), T, span, n=8, seed=3)
    assert torch.equal(again, rep)


def _copier(T: int, span: int):
    """Logits that predict, at every position, the token that followed the earlier copy of the current
    token's place in the span (an ideal induction head for this layout), and uniform elsewhere."""
    first, last = T // 4, T + 1 - span

    def logits_of(x):
        out = torch.zeros(*x.shape, V)
        for j in range(last, T):  # predict x[j + 1] from the earlier copy
            out[torch.arange(x.shape[0]), j, x[:, first + (j - last) + 1]] = 30.0
        return out
    return logits_of


def test_a_copier_gains_and_a_blind_model_does_not():
    T, span = 128, 16
    r = repeated_span_loss(_copier(T, span), _stream(), T, span=span, n=8, batch_size=3)
    assert r["repeat"] < 1e-6 and r["control"] > 5 and r["gain"] == pytest.approx(r["control"] - r["repeat"])
    assert r["tokens"] == 8 * (span - 1)
    blind = repeated_span_loss(lambda x: torch.zeros(*x.shape, V), _stream(), T, span=span, n=8)
    assert blind["repeat"] == pytest.approx(math.log(V)) and blind["gain"] == pytest.approx(0.0, abs=1e-9)


def test_probe_arguments_are_checked():
    with pytest.raises(ValueError, match="span"):
        repeat_probes(_stream(), 16, 8, n=2)
    with pytest.raises(ValueError, match="token stream holds"):
        repeat_probes(_stream(100), 256, 16, n=2)


def test_heldout_source_is_the_stdlib_tests_and_not_the_corpus():
    if not (stdlib_root() / "test").is_dir():
        pytest.skip("this Python has no test suite")
    docs = stdlib_tests_corpus("test")
    assert docs and load_corpus("stdlib-tests", "test") == docs
    assert not any(p.startswith("test/") or "/test/" in p for p in stdlib_files("all"))


def test_sweep_metric_names_and_checks():
    m = {"heldout": "stdlib-tests", "heldout_lengths": [256, 1024], "repeat_lengths": [1024], "repeat_span": 32}
    _check_metrics(m)
    assert metric_names(m) == ["heldout/T=256", "heldout/T=1024", "repeat/T=1024", "repeat_control/T=1024",
                               "repeat_gain/T=1024"]
    with pytest.raises(ValueError, match="metrics.heldout is the text"):
        _check_metrics({"heldout": "stdlib-tests"})
    with pytest.raises(ValueError, match="metrics.repeat_span"):
        _check_metrics({"repeat_span": 1, "repeat_lengths": [64]})
