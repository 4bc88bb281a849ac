"""The `attnlab` command line: help text, validation at the edge (exit 2, one line, before
any work), and train -> eval through `main([...])` on a tiny run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnlab.cli import main
from attnlab.experiments.report import eval_markdown, fmt, markdown_table, topk_summary

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.toml")
FAST = ["train.steps=4", "train.eval_every=2", "train.ckpt_every=2", "data.max_docs=20", "run.progress=false",
        "run.tensorboard=false"]


def run_main(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


# --------------------------------------------------------------------------- help


@pytest.mark.parametrize(
    "command, expected",
    [
        (["--help"], ["train", "eval", "quickstart"]),
        (["train", "--help"], ["--resume", "--run-dir", "model.attn", "train.steps", "int", "optimizer steps",
                               "model.attention.n_value_groups"]),
        (["eval", "--help"], ["--seq-lens", "--passkey", "entropy", "model.attn"]),
        (["quickstart", "--help"], ["--out", "--minutes", "--steps", "--mechanisms", "softmax,scalar,hybrid"]),
    ],
    ids=["top", "train", "eval", "quickstart"],
)
def test_help_explains_options(command, expected, capsys):
    with pytest.raises(SystemExit) as exc:
        main(command)
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for word in expected:
        assert word in text, f"{word!r} missing from `attnlab {' '.join(command)}`"


def test_no_command_prints_help_and_fails(capsys):
    code, out, _ = run_main([], capsys)
    assert code == 2 and "quickstart" in out


# --------------------------------------------------------------------------- validation at the edge


@pytest.mark.parametrize(
    "args, must_contain",
    [
        (["model.foo=1"], ["model.foo", "allowed keys", "d_model"]),
        (["train.steps=abc"], ["train.steps", "int", "'abc'"]),
        (["model.d_model=48", "model.n_heads=6", "model.attn=scalar", "model.attention.n_value_groups=4"],
         ["n_value_groups", "divisor", "6 scalar heads"]),
        (["model.attn=bogus"], ["model.attn", "softmax", "hybrid", "'bogus'"]),
        (["model.attn=[softmax,hybrid,scalar]"], ["model.attn", "n_layers"]),
        (["data.tokenizer=word"], ["data.tokenizer", "'byte'", "'bpe'"]),
        (["model.vocab_size=100"], ["model.vocab_size", "257"]),
        (["train.warmup_steps=50"], ["train.warmup_steps", "train.steps"]),
        (["steps=3"], ["unknown key steps", "train"]),
    ],
    ids=["unknown-key", "wrong-type", "heads-in-groups", "bad-mechanism", "attn-list-length", "bad-choice",
         "vocab-too-small", "warmup-gt-steps", "no-section"],
)
def test_train_rejects_bad_config(args, must_contain, tmp_path, capsys):
    code, out, err = run_main(["train", TINY, f"run.out_dir={tmp_path}", *args], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for word in must_contain:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    assert list(tmp_path.iterdir()) == [], "work started before validation"


@pytest.mark.parametrize(
    "argv, must_contain",
    [
        (["train", "/nonexistent/x.toml"], ["/nonexistent/x.toml", "does not exist"]),
        (["train", TINY, "--bogus"], ["--bogus"]),
        (["train", TINY, "stray"], ["stray", "key=value"]),
        (["eval", "/nonexistent/run"], ["/nonexistent/run", "does not exist"]),
        (["quickstart", "--steps", "3", "--minutes", "1"], ["--steps", "--minutes"]),
        (["quickstart", "--steps", "0"], ["--steps", ">= 1"]),
        (["quickstart", "model.attn=hybrid"], ["model.attn", "--mechanisms"]),
        (["quickstart", "--mechanisms", "softmax,dot"], ["'dot'", "scalar", "cosformer"]),
        (["quickstart", "model.n_heads=6", "model.d_model=48", "model.attention.n_value_groups=4"],
         ["n_value_groups"]),
    ],
    ids=["missing-config", "unknown-option", "stray-arg", "eval-missing", "qs-steps-and-minutes", "qs-zero-steps",
         "qs-owned-key", "qs-bad-mechanism", "qs-bad-combination"],
)
def test_usage_errors_are_one_line(argv, must_contain, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(argv, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for word in must_contain:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.heavy
def test_subprocess_exit_code_and_message(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, "-m", "attnlab", "train", TINY, f"run.out_dir={tmp_path}", "model.attention.tau=sometimes"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.attention.tau" in lines[0] and "'head'" in lines[0], proc.stderr
    assert proc.stdout == ""


# --------------------------------------------------------------------------- train -> eval


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny softmax+hybrid run trained through `attnlab train` (4 steps)."""
    run_dir = tmp_path_factory.mktemp("runs") / "tiny-cli"
    assert main(["train", TINY, "--run-dir", str(run_dir), *FAST]) == 0
    return run_dir


@pytest.mark.heavy
def test_train_writes_run_folder(trained):
    for name in ("config.toml", "config.json", "log.jsonl", "train.csv", "eval.csv", "summary.json"):
        assert (trained / name).is_file(), name
    summary = json.loads((trained / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["attn"] == ["softmax", "hybrid"]
    assert math.isclose(summary["val_ppl"], math.exp(summary["val_loss"]), rel_tol=1e-9)


def test_train_refuses_existing_run_then_resumes(trained, capsys):
    code, _, err = run_main(["train", TINY, "--run-dir", str(trained), *FAST], capsys)
    assert code == 2 and "--resume" in err and str(trained) in err
    code, out, _ = run_main(["train", TINY, "--run-dir", str(trained), *FAST, "train.steps=6", "--resume"], capsys)
    assert code == 0 and "attnlab eval" in out
    summary = json.loads((trained / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["resumed_from"].endswith("step_000004")


def test_eval_writes_json_and_markdown(trained, capsys):
    code, out, _ = run_main(["eval", str(trained), "--seq-lens", "16,32", "--max-tokens", "256", "--analysis-len", "24"],
                            capsys)
    assert code == 0
    result = json.loads((trained / "eval.json").read_text())
    md = (trained / "eval.md").read_text()
    assert set(result["loss"]) == {"16", "32"}
    for T, r in result["loss"].items():
        assert math.isclose(r["ppl"], math.exp(r["loss"]), rel_tol=1e-9)
        assert f"| {T:>7} | {fmt(r['loss']):>17} | {fmt(r['ppl']):>10} |" in md
    softmax_layer, hybrid_layer = result["layers"]
    assert "topk_scalar_mass" not in softmax_layer
    assert sorted(hybrid_layer["topk_scalar_mass"], key=int) == ["8", "16", "32", "64"]
    for heads in hybrid_layer["topk_scalar_mass"].values():
        assert all(0.0 <= v <= 1.0 + 1e-6 for v in heads)
    mass = [sum(hybrid_layer["topk_scalar_mass"][k]) for k in ("8", "16", "32", "64")]
    assert mass == sorted(mass), "top-k mass must grow with k"
    assert hybrid_layer["topk_scalar_mass"]["32"] == pytest.approx([1.0] * 4, abs=1e-5)  # 24 keys <= 32: all mass
    for layer in result["layers"]:
        assert all(0 <= e <= math.log(24) + 1e-4 for e in layer["entropy"])
        assert all(0 <= s <= 1 + 1e-6 for s in layer["first_token_share"])
    assert "top-8" in md and "hybrid" in md and md in out + "\n"


@pytest.mark.heavy
def test_eval_windowed_and_by_length(trained, capsys):
    kept = trained / "evals" / "seq-lens=16,32.json"
    if not kept.is_file():  # an earlier eval of other options, whose file this one must keep
        assert run_main(["eval", str(trained), "--seq-lens", "16,32", "--max-tokens", "256", "--analysis-len", "24"],
                        capsys)[0] == 0
    code, out, _ = run_main(["eval", str(trained), "--seq-lens", "16", "--max-tokens", "256", "--analysis-len", "16",
                             "--windows", "2,64", "--budgets", "4", "--lengths", "16,48", "--compress", "0"], capsys)
    assert code == 0
    result = json.loads((trained / "eval.json").read_text())
    exact = result["loss"]["16"]["loss"]
    assert result["windowed_loss"]["16"]["64"]["loss"] == pytest.approx(exact, abs=1e-5)  # 16 keys < 64: exact
    assert result["windowed_loss"]["16"]["2"]["loss"] != pytest.approx(exact, abs=1e-5)
    assert result["windowed_loss"]["16"]["64/M=4"]["loss"] != pytest.approx(exact, abs=1e-5)
    by = result["by_length"]
    assert set(by["lengths"]["48"]["windowed_loss"]) == {"2", "2/M=4", "64", "64/M=4"}
    assert set(by["lengths"]) == {"16", "48"} and set(by["miss_slope"]) == {"8", "16", "32", "64"}
    assert by["lengths"]["16"]["loss"] == pytest.approx(exact, rel=1e-6)
    assert by["lengths"]["48"]["windowed_loss"]["64"] == pytest.approx(by["lengths"]["48"]["loss"], abs=1e-5)
    assert by["miss_slope"]["64"] == pytest.approx(0.0, abs=1e-5)  # 64 keys hold everything at both lengths
    comp = result["compressed"]
    assert set(comp) == {"2/span=0", "64/span=0"} and comp["64/span=0"]["kept"] == pytest.approx(1.0)
    assert comp["64/span=0"]["loss"] == pytest.approx(comp["64/span=0"]["exact"], abs=1e-5)  # nothing merged, all keys
    md = (trained / "eval.md").read_text()
    assert "## Windowed-decode loss" in md and "## By context length" in md and "Slope of" in md
    assert "## Windowed decoding with density compression" in md and "A negative gap means" in md
    # an earlier call with other options keeps its own files (test_eval_writes_json_and_markdown's)
    assert kept.is_file() and set(json.loads(kept.read_text())["loss"]) == {"16", "32"}
    mine = trained / "evals" / "seq-lens=16_windows=2,64_budgets=4_compress=0_lengths=16,48.json"
    assert json.loads(mine.read_text()) == result and mine.with_suffix(".md").read_text() == md


@pytest.mark.parametrize(
    "extra, must_contain",
    [
        (["--seq-lens", "16,x"], ["--seq-lens", "128,256"]),
        (["--windows", "0"], ["--windows"]),
        (["--budgets", "8"], ["--budgets", "--windows"]),
        (["--windows", "4", "--budgets", "512", "--lengths", "16,48"], ["--budgets 512", "changes nothing", "48"]),
        (["--compress", "0.1"], ["--compress", "--windows"]),
        (["--windows", "4", "--compress", "-1"], ["--compress"]),
        (["--lengths", "a"], ["--lengths"]),
        (["--seq-lens", "0"], ["--seq-lens"]),
        (["--passkey", "40"], ["--passkey", "length must be >="]),
        (["--passkey", "300", "--passkey-depths", "2"], ["--passkey-depths", "[0.0, 1.0]"]),
        (["--max-tokens", "0"], ["--max-tokens", ">= 1"]),
        (["--split", "train"], ["--split", "'val'", "'test'"]),
        (["data.seq_len=-1"], ["data.seq_len"]),
    ],
    ids=["seq-lens-text", "windows-zero", "budget-alone", "budget-beyond-every-length", "compress-alone", "compress-negative", "lengths-text", "seq-lens-zero", "passkey-short", "passkey-depth", "max-tokens", "split", "bad-override"],
)
def test_eval_rejects_bad_options(trained, extra, must_contain, capsys):
    before = sorted(p.name for p in trained.iterdir())
    code, _, err = run_main(["eval", str(trained), *extra], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for word in must_contain:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    assert sorted(p.name for p in trained.iterdir()) == before


def test_eval_needs_a_trained_run(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, _, err = run_main(["eval", str(tmp_path / "empty")], capsys)
    assert code == 2 and "config.toml" in err
    code, _, err = run_main(["eval", TINY, f"run.out_dir={tmp_path}"], capsys)
    assert code == 2 and "train it first" in err


@pytest.mark.heavy
def test_eval_reports_mqar_accuracy_for_a_moved_mqar_run(tmp_path, capsys):
    run_dir = tmp_path / "mqar"
    argv = ["train", TINY, "--run-dir", str(run_dir), *FAST, "data.source=mqar", "data.seq_len=32",
            "data.mqar_pairs=4", "model.vocab_size=64", "train.steps=2"]
    assert main(argv) == 0
    run_dir = run_dir.rename(tmp_path / "moved")  # a run folder can be evaluated wherever it now lies
    code, out, _ = run_main(["eval", str(run_dir), "--passkey", "300"], capsys)
    assert code == 2 and "mqar" in out + _
    code, out, _ = run_main(["eval", str(run_dir), "-q"], capsys)
    assert code == 0 and "eval.md" in out
    result = json.loads((run_dir / "eval.json").read_text())
    assert 0.0 <= result["mqar_accuracy"] <= 1.0 and "loss" not in result
    # the reported accuracy is the moved checkpoint's own, recounted here on the same 256 examples
    import torch

    from attnlab.data.synthetic import mqar
    from attnlab.train import load_run

    _, model, _ = load_run(run_dir, checkpoint=str(run_dir / "checkpoints"))
    x, y = mqar(64, 32, 4, 256, seed=12345, power_a=0.01)
    with torch.no_grad():
        pred = model(x)[0].argmax(-1)
    asked = y != -100
    assert asked.sum() == 256 * 4
    assert result["mqar_accuracy"] == pytest.approx((pred[asked] == y[asked]).double().mean().item(), abs=1e-12)
    assert f"Accuracy at the query positions: {fmt(result['mqar_accuracy'])}" in (run_dir / "eval.md").read_text()


# --------------------------------------------------------------------------- report pieces


def test_markdown_table_aligns_and_formats():
    table = markdown_table(["model", "loss", "τ"], [["softmax", 1.23456, None], ["scalar", 12345.6, 0.05]])
    lines = table.splitlines()
    assert lines[1] == "|:--------|-------:|-------:|"
    assert lines[2] == "| softmax |  1.235 |      — |"
    assert lines[3] == "| scalar  | 12,346 | 0.0500 |"
    assert len({len(line) for line in lines}) == 1


def test_eval_markdown_covers_tasks():
    result = {
        "run_dir": "r", "checkpoint": "c", "step": 3, "attn": ["scalar"], "mqar_accuracy": 0.625,
        "passkey": {"300@0.5": 0.25},
        "analysis_len": 8,
        "layers": [{"layer": 0, "mechanism": "scalar", "entropy": [1.0, 2.0], "first_token_share": [0.5, 0.25],
                    "learned_sink_share": [0.1, 0.2], "topk_scalar_mass": {"8": [0.9, 0.8], "16": [1.0, 0.95]}},
                   {"layer": 1, "mechanism": "gla"}],
    }
    md = eval_markdown(result)
    assert "0.6250" in md and "|    300 | 0.5000 |   0.2500 |" in md
    assert "|     0 | scalar    |    1 |   2.000 |     0.2500 |       0.2000 | 0.8000 | 0.9500 |" in md
    assert "|     1 | gla       |    — |       — |" in md and "Linear-family" in md
    assert topk_summary(result["layers"]) == pytest.approx({"8": 0.85, "16": 0.975})


def test_search_commands_registered_when_available(capsys):
    try:
        import attnlab.cli.search_commands  # noqa: F401
    except ImportError:
        pytest.skip("attnlab.cli.search_commands is not importable here")
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "search" in capsys.readouterr().out


@pytest.mark.parametrize("command", [["search"], ["search", "train"], ["search", "eval"], ["search", "tasks"],
                                     ["search", "trial"]], ids=lambda c: " ".join(c))
def test_search_help_is_full(command, capsys):
    """`attnlab search [sub] --help`: what it does, an example, and every option described."""
    pytest.importorskip("transformers")
    import argparse

    from attnlab.cli import build_parser

    parser = build_parser()
    for word in command:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    assert parser.description and "  attnlab search " in parser.description  # what it does, with an example
    undescribed = [a.option_strings or a.dest for a in parser._actions
                   if not isinstance(a, argparse._SubParsersAction) and not a.help]
    assert not undescribed, f"{' '.join(command)}: options without help: {undescribed}"
    with pytest.raises(SystemExit) as e:
        main([*command, "--help"])
    assert e.value.code == 0 and parser.description.splitlines()[0] in capsys.readouterr().out
