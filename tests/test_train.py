"""The trainer: a tiny run end to end, its run folder and logs, accumulation, regularizers,
bf16, MQAR, document restarts, BPE, and evaluation of the trained run (task accuracy checked
with oracle models whose score is known)."""

import csv
import importlib
import json
import math
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attnlab.data import ByteTokenizer, mqar, passkey
from attnlab.data.corpus import load_corpus
from attnlab.data.splits import split_of
from attnlab.data.packing import doc_causal_mask
from attnlab.data.synthetic import PASSKEY_QUESTION
from attnlab.eval.tasks import label_hits
from attnlab.train import evaluate, load_config, load_run, read_log, train
from attnlab.models.config import ConfigError
from attnlab.train.trainer import Trainer, autocast

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


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory) -> str:
    """A folder of one-line documents (stdlib source lines cut to 20 characters, at most 22
    tokens with the separator), so that every 32-token window crosses a document boundary;
    file names are picked by the split rule to give 300 train and 12 val documents."""
    source = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text(encoding="utf-8")
    lines = [line.strip()[:20] for line in source.splitlines() if len(line.strip()) > 12]
    folder = tmp_path_factory.mktemp("short_docs")
    want, i = {"train": 300, "val": 12}, 0
    while want["train"] or want["val"]:
        name = f"doc{i:04d}.txt"
        if want.get(split_of(name)):
            want[split_of(name)] -= 1
            (folder / name).write_text(lines[i % len(lines)] + "\n", encoding="utf-8")
        i += 1
    return str(folder)


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
    assert report["passkey"] == {"256@0.5": 0.0}  # 12 steps cannot copy a random 5-digit key (oracles: below)
    assert (run / "eval.json").exists()


def _evaluate_with(monkeypatch, wrap, *args, **kwargs):
    """`evaluate` with the checkpoint's model replaced by wrap(model)."""
    module = importlib.import_module("attnlab.train.evaluate")
    real = module.load_run

    def load_run_wrapped(*a, **k):
        cfg, model, state = real(*a, **k)
        return cfg, wrap(model), state

    monkeypatch.setattr(module, "load_run", load_run_wrapped)
    try:
        return evaluate(*args, write=False, **{"mqar_attention": False, **kwargs})  # oracles have no attention
    finally:
        monkeypatch.setattr(module, "load_run", real)


class PasskeyOracle(torch.nn.Module):
    """A byte-level LM that, on a passkey prompt, spells the key of the first needle it finds from
    fraction `search_from` of the prompt on (" 00000" when none, or with `odd_fails` when the key
    is odd); elsewhere, and for the loss and the attention analysis (its `blocks`), it is the
    wrapped LM."""

    def __init__(self, lm, search_from=0.0, odd_fails=False):
        super().__init__()
        self.lm, self.blocks, self.search_from, self.odd_fails = lm, lm.blocks, search_from, odd_fails

    def forward(self, x, *args, **kwargs):
        logits, loss = self.lm(x, *args, **kwargs)
        logits = logits.clone()
        for b in range(x.shape[0]):
            text = ByteTokenizer().decode(x[b].tolist())  # one character per token: indices agree
            q = text.rfind(PASSKEY_QUESTION)
            if q < 0:
                continue
            found = text.find("The pass key is ", int(self.search_from * q))
            key = text[found + 16 : found + 21] if 0 <= found < q else "00000"
            key = "00000" if self.odd_fails and int(key) % 2 else key
            for i, ch in enumerate(" " + key):
                t = q + len(PASSKEY_QUESTION) - 1 + i
                if t < x.shape[1]:
                    logits[b, t] = F.one_hot(torch.tensor(ord(ch)), logits.shape[-1]).to(logits.dtype)
        return logits, loss


@pytest.mark.heavy
def test_evaluate_scores_passkey_oracles(tmp_path, corpus, monkeypatch):
    """evaluate()'s passkey accuracy per length and depth is the share of examples whose whole key is
    spelled: 1 for an oracle; for one that looks only at the second half of the prompt, 0 with the
    needle at depth 0 (it spells " 00000": the space alone is right) and 1 at depth 1; for one that
    fails on odd keys, the share of even keys among the 8 examples of seed 12345."""
    train(cfg_for(tmp_path, corpus, "train.steps=2", "train.eval_every=0", "run.name=pk"))
    kw = dict(seq_lens=[32], max_tokens=128, analysis_len=16, analysis_batch=1, passkey_lengths=[400, 500],
              passkey_depths=(0.0, 1.0))
    seeing = _evaluate_with(monkeypatch, PasskeyOracle, tmp_path / "pk", **kw)
    assert seeing["passkey"] == {"400@0.0": 1.0, "400@1.0": 1.0, "500@0.0": 1.0, "500@1.0": 1.0}
    half_blind = _evaluate_with(monkeypatch, lambda lm: PasskeyOracle(lm, 0.5), tmp_path / "pk", **kw)
    assert half_blind["passkey"] == {"400@0.0": 0.0, "400@1.0": 1.0, "500@0.0": 0.0, "500@1.0": 1.0}
    even = _evaluate_with(monkeypatch, lambda lm: PasskeyOracle(lm, odd_fails=True), tmp_path / "pk", **kw)
    for L, depth in [(400, 0.0), (400, 1.0), (500, 0.0), (500, 1.0)]:
        _, y = passkey(ByteTokenizer(), L, depth, 8, seed=12345)
        keys = [int(ByteTokenizer().decode(row[row != -100].tolist())) for row in y]
        assert even["passkey"][f"{L}@{depth}"] == pytest.approx(sum(k % 2 == 0 for k in keys) / 8)
    assert 0 < even["passkey"]["500@0.0"] < 1
    # the rest of the report is the wrapped LM's
    plain = evaluate(tmp_path / "pk", write=False, **{k: v for k, v in kw.items() if k != "passkey_lengths"})
    assert seeing["loss"] == plain["loss"] and seeing["layers"] == plain["layers"] and "passkey" not in plain


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


def test_regularizer_starts_late_and_ramps(tmp_path, corpus):
    cfg = cfg_for(tmp_path, corpus, "train.steps=4", "train.log_every=1", "model.attn=hybrid", "regularizers.align=0.1",
                  "regularizers.spread=0.01", "regularizers.spread_start=2", "regularizers.ramp=2", "run.name=late")
    rows = train(cfg)["history"]["train"]
    assert [("reg_spread" in r) for r in rows] == [False, False, True, True]  # not computed before its start
    assert all("reg_align" in r for r in rows)
    assert rows[0]["reg_total"] == pytest.approx(0.05 * rows[0]["reg_align"], rel=1e-5)  # align ramps: 1/2 at step 0
    last = rows[-1]
    assert last["reg_total"] == pytest.approx(0.1 * last["reg_align"] + 0.01 * last["reg_spread"], rel=1e-5)


def test_records_only_when_needed(tmp_path, corpus):
    """No regularizer weight: layers record only on logging steps."""
    trainer = Trainer(cfg_for(tmp_path, corpus, "train.log_every=5", "run.name=rec"))
    layers = trainer.model.attention_layers()
    trainer.train_step()  # step 1 of 12: not a log step
    assert all(a.last is None for a in layers)
    for _ in range(4):
        trainer.train_step()  # step 5: a log step
    assert layers[1].last is not None and layers[1].last.tau is not None


def test_bf16_autocast_and_document_restarts(tmp_path, short_docs):
    """bf16 autocast with data.cross_doc=false, against the same run with cross_doc=true (same
    seed, same batches): training and evaluation restart attention at every document boundary,
    the step runs under bf16, and a few steps take the loss well below uniform over bytes."""
    def trainer(cross_doc):
        return Trainer(load_config(TINY, [
            f"run.out_dir={tmp_path}", "run.threads=1", f"data.source={short_docs}", f"data.cross_doc={cross_doc}",
            "train.dtype=bfloat16", "train.steps=6", "train.lr=1e-2", "train.eval_every=0", f"run.name=bf16-{cross_doc}"]))

    restart, cross = trainer("false"), trainer("true")
    batch, batch_cross = restart.data.train.batch(0), cross.data.train.batch(0)
    assert torch.equal(batch.x, batch_cross.x) and torch.equal(batch.y, batch_cross.y)
    assert (batch.doc_ids.diff(dim=1) != 0).any(dim=1).all()  # a boundary in every row
    assert batch_cross.cross_doc and batch_cross.mask is None
    causal = torch.ones(32, 32, dtype=torch.bool).tril()
    assert torch.equal(batch.mask, doc_causal_mask(batch.doc_ids))
    assert (causal & ~batch.mask[:, 0]).any(dim=(1, 2)).all()  # every row blocks some earlier key

    # step 1's loss is the initial model's (the same in both runs) on batch 0: with restarts and in bf16
    model = restart.model
    with torch.no_grad():
        with autocast(restart.device, "bfloat16"):
            want_restart = model(batch.x, batch.y, doc_ids=batch.doc_ids)[1].item()
            want_cross = model(batch.x, batch.y)[1].item()
        want_fp32 = model(batch.x, batch.y, doc_ids=batch.doc_ids)[1].item()
    assert abs(want_restart - want_cross) > 1e-3  # measured 4e-3: the restarts change the loss
    assert 1e-6 < abs(want_restart - want_fp32) < 0.05  # measured 1.3e-4: bf16 rounding, no more

    untrained, untrained_cross = restart.evaluate()["val_loss"], cross.evaluate()["val_loss"]
    assert abs(untrained - untrained_cross) > 1e-3  # measured 1.5e-2: validation restarts too
    assert untrained == pytest.approx(math.log(257), abs=0.1)
    summary, summary_cross = restart.fit(), cross.fit()
    assert summary["history"]["train"][0]["loss"] == pytest.approx(want_restart, rel=1e-6)
    assert summary_cross["history"]["train"][0]["loss"] == pytest.approx(want_cross, rel=1e-6)
    assert math.isfinite(summary["val_loss"]) and summary["val_loss"] < 6.0
    # measured 4.34 (cross_doc=true: 4.42) after 6 steps, from 5.56 untrained; ln 257 = 5.55
    assert summary["val_loss"] < min(untrained, math.log(257)) - 0.5
    assert abs(summary["val_loss"] - summary_cross["val_loss"]) > 1e-3


class MQAROracle(torch.nn.Module):
    """An LM-shaped MQAR solver (forward -> (logits, None)): at each position after the opening
    key-value pairs that holds one of their keys it predicts that key's value; keys in `wrong`
    get token 0 instead, which is never a value."""

    def __init__(self, pairs: int, vocab_size: int, wrong=()):
        super().__init__()
        self.pairs, self.vocab_size = pairs, vocab_size
        self.wrong = torch.tensor(sorted(wrong), dtype=torch.long)

    def forward(self, x, targets=None, record=False, doc_ids=None):
        n = 2 * self.pairs
        keys, values = x[:, 0:n:2], x[:, 1:n:2]  # (B, P)
        hit = x[:, :, None] == keys[:, None, :]  # (B, T, P): keys are distinct, at most one hit
        hit[:, :n] = False
        answer = (hit * values[:, None, :]).sum(-1).masked_fill(torch.isin(x, self.wrong), 0)  # (B, T)
        return F.one_hot(answer, self.vocab_size).float(), None


def _accuracy(model, data, batch_size=64):
    """Share of asked positions (labels != -100) whose argmax is the label, over `data`, a list of
    (x, y), each cut into batches as the evaluation under test cuts them."""
    hit = asked = 0
    for x, y in data:
        for i in range(0, x.shape[0], batch_size):
            h, a = label_hits(model(x[i : i + batch_size])[0], y[i : i + batch_size])
            hit, asked = hit + int(h.sum()), asked + int(a.sum())
    return hit / asked


def _even_key_share(data):
    """The accuracy of MQAROracle(wrong=odd keys) on `data`, a list of (x, y): the share of asked
    positions holding an even key."""
    even = sum(int(((y != -100) & (x % 2 == 0)).sum()) for x, y in data)
    return even / sum(int((y != -100).sum()) for x, y in data)


def test_mqar_source(tmp_path, monkeypatch):
    overrides = [f"run.out_dir={tmp_path}", "run.threads=1", "data.source=mqar", "model.vocab_size=64",
                 "data.mqar_pairs=4", "train.steps=3"]
    summary = train(load_config(TINY, [*overrides, "run.name=mqar"]))
    assert 0 <= summary["val_accuracy"] <= 1
    _, model, _ = load_run(tmp_path / "mqar")
    odd_keys = range(1, 32, 2)  # keys are drawn from [1, 64 // 2)

    # the trainer's accuracy: the final model's, over the run's validation batches ...
    probe = Trainer(load_config(TINY, [*overrides, "run.name=mqar-probe"]))  # the same data, another folder
    val = [(b.x, b.y) for b in probe.data.val(None)]
    assert sum(int((y != -100).sum()) for _, y in val) == 2 * 4 * 4  # eval_batches x batch_size x pairs
    assert not torch.equal(val[0][0], probe.data.train.batch(0).x)  # validation draws its own examples
    assert summary["val_accuracy"] == pytest.approx(_accuracy(model, val), abs=1e-12)
    # ... and exactly the known score of an oracle: 1, or the share of even keys when odd ones fail
    probe.model = MQAROracle(4, 64)
    assert probe.evaluate()["val_accuracy"] == 1.0
    probe.model = MQAROracle(4, 64, wrong=odd_keys)
    partial = _even_key_share(val)
    assert 0 < partial < 1 and probe.evaluate()["val_accuracy"] == pytest.approx(partial)

    # evaluate(): 256 fresh examples from seed 12345 (not the training seed)
    report = evaluate(tmp_path / "mqar")
    assert 0 <= report["mqar_accuracy"] <= 1
    fresh = [mqar(64, 32, 4, 256, seed=12345, power_a=0.01)]
    assert report["mqar_accuracy"] == pytest.approx(_accuracy(model, fresh), abs=1e-12)
    oracle = _evaluate_with(monkeypatch, lambda m: MQAROracle(4, 64), tmp_path / "mqar")
    assert oracle["mqar_accuracy"] == 1.0
    partial = _even_key_share(fresh)
    assert 0 < partial < 1
    oracle = _evaluate_with(monkeypatch, lambda m: MQAROracle(4, 64, wrong=odd_keys), tmp_path / "mqar")
    assert oracle["mqar_accuracy"] == pytest.approx(partial)


def test_log_rows_are_readable(tmp_path, corpus):
    train(cfg_for(tmp_path, corpus, "train.steps=2", "train.eval_every=0", "run.name=log"))
    rows = read_log(tmp_path / "log")
    assert [r["kind"] for r in rows] == ["train", "train", "eval"]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows if r["kind"] == "train")


def test_bpe_tokenizer_sets_the_vocabulary(tmp_path, corpus):
    """data.tokenizer=bpe: the model's vocabulary is the tokenizer's, the packed data is its
    (round-tripping) encoding with merged tokens, and a few steps learn below uniform over it."""
    cfg = cfg_for(tmp_path, corpus, "data.tokenizer=bpe", "data.bpe_vocab_size=300", f"data.cache_dir={tmp_path / 'cache'}",
                  "train.steps=8", "train.lr=1e-2", "train.eval_every=0", "run.name=bpe")
    trainer = Trainer(cfg)
    tok, model = trainer.data.tokenizer, trainer.model
    assert tok.vocab_size == model.cfg.vocab_size == model.tok_emb.num_embeddings == model.head.out_features == 300
    train_text, val_text = load_corpus(corpus, "train")[0], load_corpus(corpus, "val")[0]
    ids = tok.encode(val_text)
    assert tok.decode(ids) == val_text and max(ids) < 300
    assert len(ids) < 0.85 * len(val_text.encode())  # merges are used (measured 0.73 tokens per byte)
    stream = trainer.data.train.stream
    assert stream.vocab_size == 300 and stream.eos_id == tok.eos_id != ByteTokenizer.eos_id
    assert stream.tokens[1:-1].tolist() == tok.encode(train_text)  # EOS text EOS: the BPE encoding
    assert (stream.tokens >= 257).any()  # ids past EOS + 256 bytes are merges
    untrained = trainer.evaluate()["val_loss"]
    summary = trainer.fit()
    assert math.isfinite(summary["val_loss"])
    # measured 4.59 after 8 steps, from 5.74 untrained; ln 300 = 5.70
    assert summary["val_loss"] < min(untrained, math.log(300)) - 0.5
    assert load_config(tmp_path / "bpe" / "config.toml").model.vocab_size == 300  # resolved and saved
    assert list((tmp_path / "cache" / "bpe").glob("*.json"))  # the trained vocabulary is cached


def test_mqar_queried_pairs_and_fixed_training_set(tmp_path):
    """data.mqar_queries asks that many of the pairs; data.mqar_train_size = N trains on one fixed
    set of N sequences, the same for the same seed, every row of every batch one of them, each
    epoch a permutation of the set; validation still draws fresh sequences."""
    over = [f"run.out_dir={tmp_path}", "run.threads=1", "data.source=mqar", "model.vocab_size=16", "data.seq_len=64",
            "data.mqar_pairs=4", "data.mqar_queries=2", "data.mqar_train_size=10", "train.batch_size=4"]
    a, b = Trainer(load_config(TINY, [*over, "run.name=a"])), Trainer(load_config(TINY, [*over, "run.name=b"]))
    other = Trainer(load_config(TINY, [*over, "run.name=c", "run.seed=1"]))
    fixed = {tuple(r) for r in a.data.train.fixed[0].tolist()}
    assert len(fixed) == 10 and torch.equal(a.data.train.fixed[0], b.data.train.fixed[0])
    assert not torch.equal(a.data.train.fixed[0], other.data.train.fixed[0])
    rows = [tuple(r) for s in range(5) for r in a.data.train.batch(s).x.tolist()]  # 20 rows = 2 epochs
    assert set(rows) <= fixed and set(rows[:10]) == fixed and set(rows[10:]) == fixed
    assert rows[:10] != rows[10:]  # a new order each epoch
    for s in range(3):
        y = a.data.train.batch(s).y
        assert bool(((y != -100).sum(1) == 2).all())  # 2 of the 4 pairs queried
    val = next(iter(a.data.val(1)))
    assert not {tuple(r) for r in val.x.tolist()} & fixed and bool(((val.y != -100).sum(1) == 2).all())
    for bad, word in (("data.mqar_queries=5", "data.mqar_queries"), ("data.mqar_train_size=-1", "data.mqar_train_size"),
                      ("data.seq_len=11", "data.seq_len")):
        with pytest.raises(ConfigError, match=word):
            load_config(TINY, [*over, bad])
