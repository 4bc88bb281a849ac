"""The trainer: a tiny run end to end, its run folder and logs, accumulation, regularizers,
bf16, MQAR, document restarts, and evaluation of the trained run."""

import csv
import json
import math
import sysconfig
from pathlib import Path

import pytest
import torch

from attnlab.train import evaluate, load_config, read_log, train
from attnlab.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """One local text file (~160 KB of stdlib source): its 96/2/2 % cut gives train/val/test."""
    root = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((root / name).read_text(encoding="utf-8") for name in ("argparse.py", "dataclasses.py"))
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    return str(path)


def cfg_for(tmp_path, corpus, *overrides):
    return load_config(TINY, [f"run.out_dir={tmp_path}", f"data.source={corpus}", "run.threads=1", *overrides])


def test_tiny_run_end_to_end(tmp_path, corpus):
    summary = train(cfg_for(tmp_path, corpus, "train.steps=12", "run.name=e2e"))
    run = tmp_path / "e2e"
    for name in ("config.toml", "config.json", "log.jsonl", "train.csv", "eval.csv", "summary.json", "checkpoints/latest"):
        assert (run / name).exists(), name
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_000008", "step_000012"]
    assert summary["steps"] == 12 and summary["attn"] == ["softmax", "hybrid"]
    assert summary["val_loss"] < math.log(257)  # learned something beyond uniform over bytes
    assert summary["val_ppl"] == pytest.approx(math.exp(summary["val_loss"]))
    assert summary["tokens_per_s"] > 0
    assert summary["tau"][0] is None and summary["tau"][1] > 0  # softmax has no τ, hybrid does
    train_rows = summary["history"]["train"]
    assert [r["step"] for r in train_rows] == list(range(1, 13))
    assert [r["step"] for r in summary["history"]["eval"]] == [6, 12]
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]
    assert len(train_rows[0]["layers"][1]["tau_heads"]) == 4
    with open(run / "train.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 12 and float(rows[-1]["loss"]) == pytest.approx(train_rows[-1]["loss"])
    assert "layers.1.tau_mean" in rows[0] and "tokens_per_s" in rows[0]
    assert json.loads((run / "summary.json").read_text())["val_loss"] == pytest.approx(summary["val_loss"])

    # a second run into the same folder must say what to do
    with pytest.raises(FileExistsError, match="run.resume"):
        Trainer(cfg_for(tmp_path, corpus, "train.steps=12", "run.name=e2e"))

    # evaluation of the trained run, from its folder
    report = evaluate(run, seq_lens=[16, 32], max_tokens=512, analysis_len=24, analysis_batch=2,
                      passkey_lengths=[256], passkey_depths=(0.5,))
    assert set(report["loss"]) == {"16", "32"} and report["step"] == 12
    soft, hyb = report["layers"]
    assert len(soft["entropy"]) == 4 and "topk_scalar_mass" not in soft
    assert set(hyb["topk_scalar_mass"]) == {"8", "16", "32", "64"}
    masses = [hyb["topk_scalar_mass"][k] for k in ("8", "16", "32", "64")]
    assert all(0 <= m <= 1 + 1e-6 for row in masses for m in row)
    assert all(a <= b + 1e-6 for lo, hi in zip(masses, masses[1:]) for a, b in zip(lo, hi))  # more keys, more mass
    assert masses[-1] == pytest.approx([1.0] * 4, abs=1e-5)  # 64 >= 24 keys: everything
    assert all(0 <= s <= 1 for s in soft["first_token_share"])
    assert 0 <= report["passkey"]["256@0.5"] <= 1
    assert (run / "eval.json").exists()


def test_grad_accumulation_matches_one_big_batch(tmp_path, corpus):
    """Two micro-batches of 2 read the same windows as one batch of 4 and average to the same gradient."""
    common = ["train.steps=4", "train.eval_every=0", "train.ckpt_every=0", "model.attn=hybrid"]
    big = train(cfg_for(tmp_path, corpus, *common, "train.batch_size=4", "run.name=big"))
    acc = train(cfg_for(tmp_path, corpus, *common, "train.batch_size=2", "train.grad_accum=2", "run.name=acc"))
    a = [r["loss"] for r in big["history"]["train"]]
    b = [r["loss"] for r in acc["history"]["train"]]
    assert a == pytest.approx(b, rel=1e-5)
    ev = [evaluate(tmp_path / name, batch_size=4, max_tokens=256, analysis_len=8, write=False) for name in ("big", "acc")]
    assert ev[0]["loss"]["32"]["loss"] == pytest.approx(ev[1]["loss"]["32"]["loss"], rel=1e-5)


def test_regularizers_are_weighted_and_logged(tmp_path, corpus):
    cfg = cfg_for(tmp_path, corpus, "train.steps=3", "model.attn=[scalar,hybrid]", "regularizers.align=0.1",
                  "regularizers.spread=0.01", "regularizers.tau=0.01", "regularizers.spread_range=fixed", "run.name=reg")
    summary = train(cfg)
    row = summary["history"]["train"][-1]
    for term in ("reg_align", "reg_spread", "reg_tau", "reg_total"):
        assert math.isfinite(row[term])
    assert row["reg_total"] == pytest.approx(0.1 * row["reg_align"] + 0.01 * row["reg_spread"] + 0.01 * row["reg_tau"], rel=1e-5)


def test_records_only_when_needed(tmp_path, corpus):
    """No regularizer weight: layers record only on logging steps."""
    trainer = Trainer(cfg_for(tmp_path, corpus, "train.log_every=5", "run.name=rec"))
    layers = trainer.model.attention_layers()
    trainer.train_step()  # step 1 of 12: not a log step
    assert all(a.last is None for a in layers)
    for _ in range(4):
        trainer.train_step()  # step 5: a log step
    assert layers[1].last is not None and layers[1].last.tau is not None


def test_bf16_autocast_and_document_restarts(tmp_path):
    cfg = load_config(TINY, [f"run.out_dir={tmp_path}", "run.threads=1", "data.max_docs=20", "data.cross_doc=false",
                             "train.dtype=bfloat16", "train.steps=3", "train.eval_every=0", "run.name=bf16"])
    summary = train(cfg)
    assert math.isfinite(summary["val_loss"]) and summary["val_loss"] < 6.0


def test_mqar_source(tmp_path):
    cfg = load_config(TINY, [f"run.out_dir={tmp_path}", "run.threads=1", "data.source=mqar", "model.vocab_size=64",
                             "data.mqar_pairs=4", "train.steps=3", "run.name=mqar"])
    summary = train(cfg)
    assert 0 <= summary["val_accuracy"] <= 1
    report = evaluate(tmp_path / "mqar")
    assert 0 <= report["mqar_accuracy"] <= 1


def test_log_rows_are_readable(tmp_path, corpus):
    train(cfg_for(tmp_path, corpus, "train.steps=2", "train.eval_every=0", "run.name=log"))
    rows = read_log(tmp_path / "log")
    assert [r["kind"] for r in rows] == ["train", "train", "eval"]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows if r["kind"] == "train")


def test_bpe_tokenizer_sets_the_vocabulary(tmp_path, corpus):
    cfg = cfg_for(tmp_path, corpus, "data.tokenizer=bpe", "data.bpe_vocab_size=300", f"data.cache_dir={tmp_path / 'cache'}",
                  "train.steps=2", "train.eval_every=0", "run.name=bpe")
    summary = train(cfg)
    assert math.isfinite(summary["val_loss"])
    assert load_config(tmp_path / "bpe" / "config.toml").model.vocab_size == 300  # resolved and saved
    assert list((tmp_path / "cache" / "bpe").glob("*.json"))  # the trained vocabulary is cached
