"""Early stopping: the run ends after `patience` evaluations without improvement, with the best
evaluation's weights as its final checkpoint; an interrupted and resumed run stops at the same
step with the same weights; the sweep counts an early-stopped run as finished; bad settings are
refused before anything is written."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from attnlab.models.config import ConfigError
from attnlab.train import load_config, train
from attnlab.train.checkpoint import latest_checkpoint
from attnlab.train.early_stop import EarlyStopping
from attnlab.interrupt import Interrupted

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"

MQAR = ["data.source=mqar", "model.vocab_size=16", "model.attn=softmax", "model.n_layers=1", "model.d_model=16",
        "data.seq_len=24", "data.mqar_pairs=3", "train.steps=40", "train.eval_every=4", "train.ckpt_every=8",
        "train.warmup_steps=2", "train.log_every=4", "run.threads=1", "run.name=es"]


def cfg(tmp_path, *extra):
    return load_config(TINY, [f"run.out_dir={tmp_path}", *MQAR, *extra])


def final_weights(run_dir) -> dict:
    return load_file(str(latest_checkpoint(Path(run_dir) / "checkpoints") / "model.safetensors"))


def evals(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (Path(run_dir) / "log.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == "eval"]


def test_watcher_rules():
    w = EarlyStopping(2, "val_loss", 0.1)
    assert w.update({"step": 1, "val_loss": 3.0}) == (True, False)
    assert w.update({"step": 2, "val_loss": 2.95}) == (False, False)  # not better by more than min_delta
    assert w.update({"step": 3, "val_loss": 2.5}) == (True, False) and w.best_step == 3
    assert w.update({"step": 4, "val_loss": 2.6}) == (False, False)
    assert w.update({"step": 5, "val_loss": 2.5}) == (False, True)
    acc = EarlyStopping(1, "val_accuracy")
    assert acc.update({"step": 1, "val_accuracy": 0.2})[0] and acc.update({"step": 2, "val_accuracy": 0.3})[0]
    assert acc.update({"step": 3, "val_accuracy": 0.3}) == (False, True) and acc.best == 0.3
    again = EarlyStopping(1, "val_accuracy")
    again.load_state_dict(acc.state_dict())
    assert again == acc


def test_stops_after_patience_and_ends_with_the_best_weights(tmp_path):
    # min_delta so large that only the first evaluation ever improves
    s = train(cfg(tmp_path, "train.early_stop_patience=2", "train.early_stop_min_delta=100"))
    assert s["best_step"] == 4 and s["stopped_at"] == 12 and s["steps"] == 12
    rows = evals(s["run_dir"])
    assert [r["step"] for r in rows] == [4, 8, 12]
    assert s["val_loss"] == rows[0]["val_loss"] and s["val_accuracy"] == rows[0]["val_accuracy"]
    best = load_file(str(latest_checkpoint(Path(s["run_dir"]) / "checkpoints" / "best") / "model.safetensors"))
    final = final_weights(s["run_dir"])
    assert latest_checkpoint(Path(s["run_dir"]) / "checkpoints").name == "step_000012"
    assert all(torch.equal(best[k], final[k]) for k in best)
    # the same run without early stopping moved on from those weights
    plain = train(cfg(tmp_path, "run.name=plain", "train.steps=12"))
    assert any(not torch.equal(final[k], v) for k, v in final_weights(plain["run_dir"]).items())


def test_a_run_that_never_stops_ends_with_its_best_weights(tmp_path):
    s = train(cfg(tmp_path, "train.early_stop_patience=100", "train.early_stop_metric=val_accuracy"))
    rows = evals(s["run_dir"])
    best = max(rows, key=lambda r: (r["val_accuracy"], -r["step"]))
    assert s["stopped_at"] == 40 and s["best_step"] == best["step"] and s["val_accuracy"] == best["val_accuracy"]
    again = train(cfg(tmp_path, "train.early_stop_patience=100", "train.early_stop_metric=val_accuracy",
                      "run.resume=true"))  # resumed at the end: nothing to train, the same answer
    assert again["best_step"] == s["best_step"] and again["val_accuracy"] == s["val_accuracy"]


@pytest.mark.parametrize("stop_after", [6, 10])  # before and after the best evaluation is written
def test_interrupted_and_resumed_equals_uninterrupted(tmp_path, monkeypatch, stop_after):
    extra = ["train.early_stop_patience=2", "train.early_stop_min_delta=0.05"]
    ref = train(cfg(tmp_path / "ref", *extra))
    import attnlab.train.trainer as trainer_mod

    calls = {"n": 0}

    def stop_once():
        calls["n"] += 1
        return 2 if calls["n"] == stop_after else None

    monkeypatch.setattr(trainer_mod, "requested", stop_once)
    with pytest.raises(Interrupted):
        train(cfg(tmp_path / "cut", *extra))
    monkeypatch.setattr(trainer_mod, "requested", lambda: None)
    got = train(cfg(tmp_path / "cut", *extra, "run.resume=true"))
    assert (got["stopped_at"], got["best_step"], got["val_loss"]) == (ref["stopped_at"], ref["best_step"], ref["val_loss"])
    a, b = final_weights(ref["run_dir"]), final_weights(got["run_dir"])
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_sweep_counts_an_early_stopped_run_as_finished(tmp_path):
    from attnlab.experiments.sweep.runs import summary_of

    s = train(cfg(tmp_path, "train.early_stop_patience=1", "train.early_stop_min_delta=100"))
    assert s["steps"] < 40 and summary_of(Path(s["run_dir"]), 40) is not None


@pytest.mark.parametrize("extra, words", [
    (["train.early_stop_patience=-1"], "train.early_stop_patience must be >= 0"),
    (["train.early_stop_patience=2", "train.eval_every=0"], "needs train.eval_every > 0"),
    (["train.early_stop_min_delta=-0.1"], "train.early_stop_min_delta must be >= 0"),
    (["train.early_stop_metric=accuracy"], "train.early_stop_metric"),
])
def test_bad_settings_name_the_key_before_anything_is_written(tmp_path, extra, words):
    with pytest.raises(ConfigError, match=words):
        cfg(tmp_path, *extra)
    assert not any(tmp_path.iterdir())


def test_accuracy_needs_mqar(tmp_path):
    with pytest.raises(ConfigError, match="needs data.source='mqar'"):
        load_config(TINY, [f"run.out_dir={tmp_path}", "train.early_stop_patience=2",
                           "train.early_stop_metric=val_accuracy"])
