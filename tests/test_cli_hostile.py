"""Hostile command lines: every error is one line on stderr (`error: ...`), exit status 2, raised
before any work, with nothing created on disk; and `attnlab search` without the [hf] extra says
which extra to install, while a real import bug inside attnlab.search still surfaces."""

from __future__ import annotations

import builtins
import os
import sys
from pathlib import Path

import pytest

from attnlab.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.toml")
SMALL = ["model.d_model=16", "model.n_heads=2", "model.n_layers=1", "data.seq_len=16", "train.steps=1",
         "train.warmup_steps=0", "run.progress=false", "run.tensorboard=false"]


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def one_line_error(argv, capsys, tmp_path, monkeypatch) -> str:
    """Run `attnlab argv` inside the empty tmp_path; assert exit 2, one stderr line, no files."""
    monkeypatch.chdir(tmp_path)
    before = files_under(tmp_path)
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert files_under(tmp_path) == before, "something was written before the error"
    return lines[0]


# --------------------------------------------------------------------------- train: bad overrides


BAD_TRAIN = [
    (["model.attn=hybrid", "model.attention.tau_max=inf"], ["model.attention.tau_max", "inf", "finite"]),
    (["model.attn=hybrid", "model.attention.scale=inf"], ["model.attention.scale", "inf", "finite"]),
    (["model.attn=principled", "model.attention.alpha_init=nan"], ["model.attention.alpha_init", "nan", "finite"]),
    (["model.attn=hybrid", "model.attention.sink=true", "model.attention.sink_key=nan"],
     ["model.attention.sink_key", "nan", "finite"]),
    (["train.lr=inf"], ["train.lr", "inf", "finite"]),
    (["train.lr=-inf"], ["train.lr", "-inf", "finite"]),
    (["model.attn=hybrid", "regularizers.align=nan"], ["regularizers.align", "nan", "finite"]),
    (["train.betas=[0.9, nan]"], ["train.betas[1]", "nan"]),
    (["model.norm_eps=inf"], ["model.norm_eps", "inf"]),
    (["model.attention.rope=yes"], ["model.attention.rope", "'yes'", "bool"]),
    (["model.attn=hybrid", "model.attention.sink=1"], ["model.attention.sink", "1", "bool"]),
    (["run.progress=on"], ["run.progress", "'on'", "bool"]),
    (["train.steps=true"], ["train.steps", "True", "int"]),
    (["model.attn=cosformer", "model.attention.cosformer_max_len=8"], ["cosformer_max_len", "data.seq_len"]),
]


@pytest.mark.parametrize("overrides, words", BAD_TRAIN, ids=[
    "tau_max-inf", "scale-inf", "alpha_init-nan", "sink_key-nan", "lr-inf", "lr-minus-inf", "align-nan", "betas-nan",
    "norm_eps-inf", "rope-yes", "sink-1", "progress-on", "steps-true", "cosformer-horizon"])
def test_train_bad_override_is_one_line_and_writes_nothing(overrides, words, tmp_path, capsys, monkeypatch):
    line = one_line_error(["train", *SMALL, *overrides], capsys, tmp_path, monkeypatch)
    for word in words:
        assert word in line, f"{word!r} not in {line!r}"


def test_train_with_a_config_file_and_bad_override_writes_nothing(tmp_path, capsys, monkeypatch):
    line = one_line_error(["train", TINY, "--run-dir", str(tmp_path / "r"), "model.attention.tau_max=nan"],
                          capsys, tmp_path, monkeypatch)
    assert "model.attention.tau_max" in line and not (tmp_path / "r").exists()


@pytest.mark.parametrize("content", ["", "\n\n"], ids=["empty", "blank-lines"])
def test_data_source_that_cannot_be_loaded_is_one_line_and_writes_nothing(content, tmp_path, capsys, monkeypatch):
    """The run folder is created only after the data and the model are built."""
    (tmp_path / "docs.txt").write_text(content)
    line = one_line_error(["train", *SMALL, "data.source=docs.txt"], capsys, tmp_path, monkeypatch)
    assert "data.source='docs.txt'" in line and "document" in line


def test_model_that_fails_to_build_is_caught_before_the_run_folder(tmp_path, capsys, monkeypatch):
    """Whatever the model constructor rejects is a usage error raised before any folder exists."""
    import attnlab.train.trainer as trainer

    def refuses(cfg, vocab_size):
        raise ValueError(f"model.d_model: got {cfg.model.d_model}, need something this layer can hold")

    monkeypatch.setattr(trainer, "build_model", refuses)
    line = one_line_error(["train", *SMALL], capsys, tmp_path, monkeypatch)
    assert "model.d_model: got 16" in line


# --------------------------------------------------------------------------- quickstart


@pytest.mark.parametrize(
    "argv, words",
    [
        (["quickstart", "--minutes", "inf"], ["--minutes", "inf", "finite"]),
        (["quickstart", "--minutes", "nan"], ["--minutes", "nan"]),
        (["quickstart", "--steps", "1", "model.attention.tau_max=inf"], ["model.attention.tau_max", "inf"]),
        (["quickstart", "--steps", "1", "train.lr=nan"], ["train.lr", "nan"]),
        (["quickstart", "--steps", "1", "model.attention.rope=yes"], ["model.attention.rope", "'yes'"]),
    ],
    ids=["minutes-inf", "minutes-nan", "tau_max-inf", "lr-nan", "rope-yes"],
)
def test_quickstart_bad_input_is_one_line_and_writes_nothing(argv, words, tmp_path, capsys, monkeypatch):
    line = one_line_error([*argv, "--out", str(tmp_path / "qs")], capsys, tmp_path, monkeypatch)
    for word in words:
        assert word in line, f"{word!r} not in {line!r}"


# --------------------------------------------------------------------------- search


@pytest.mark.parametrize(
    "argv, words",
    [
        (["search", "train", "--tau", "inf"], ["--tau", "inf", "finite"]),
        (["search", "train", "--lr", "nan"], ["--lr", "nan"]),
        (["search", "train", "--alpha=-inf"], ["--alpha", "-inf"]),
        (["search", "train", "--rope-theta", "inf"], ["--rope-theta", "inf"]),
        (["search", "train", "--steps", "0"], ["--steps", "positive"]),
        (["search", "eval", "--methods", "learned", "--model", "x"], ["--checkpoint"]),
        (["search", "eval", "--model", "x", "--methods", "bogus"], ["--methods", "bogus"]),
    ],
    ids=["tau-inf", "lr-nan", "alpha-minus-inf", "rope-theta-inf", "steps-zero", "learned-without-checkpoint",
         "bad-method"],
)
def test_search_bad_options_are_one_line(argv, words, tmp_path, capsys, monkeypatch):
    import attnlab.cli.search_commands  # noqa: F401  (loads the modules below)

    def must_not_run(*args, **kwargs):
        raise AssertionError("the search command started work despite a bad option")

    # no model download, whatever happens
    monkeypatch.setattr(sys.modules["attnlab.search.train"], "train_projections", must_not_run)
    monkeypatch.setattr(sys.modules["attnlab.search.sweep"], "run_eval", must_not_run)
    line = one_line_error(argv, capsys, tmp_path, monkeypatch)
    for word in words:
        assert word in line, f"{word!r} not in {line!r}"


def test_search_index_options_take_their_older_spelling(tmp_path, capsys, monkeypatch):
    """--ef-search, --nlist and --nprobe are --hnsw-ef-search, --ivf-nlist and --ivf-nprobe
    (`attnlab.index.options`): the same config, and a bad value the same one-line error."""
    import argparse

    from attnlab.cli.search_commands import add_search_commands, eval_config, tasks_config

    parser = argparse.ArgumentParser()
    add_search_commands(parser.add_subparsers(dest="command"))
    old = ["--ef-search", "64", "--nlist", "8", "--nprobe", "2"]
    new = ["--hnsw-ef-search", "64", "--ivf-nlist", "8", "--ivf-nprobe", "2"]
    for command, build, head in (("eval", eval_config, ["--checkpoint", "p"]),
                                 ("tasks", tasks_config, ["--model", "m", "--methods", "full"])):
        a, b = (build(parser.parse_args(["search", command, *head, *given])) for given in (old, new))
        assert a == b and (a.hnsw_ef_search, a.ivf_nlist, a.ivf_nprobe) == (64, 8, 2)
    monkeypatch.setattr(sys.modules["attnlab.search.sweep"], "run_eval", lambda *a, **k: pytest.fail("ran"))
    lines = [one_line_error(["search", "eval", "--model", "x", "--methods", "quest", lists, "8", probes, "9"], capsys,
                            tmp_path, monkeypatch) for lists, probes in (("--nlist", "--nprobe"), ("--ivf-nlist", "--ivf-nprobe"))]
    assert lines[0] == lines[1] == "error: attnlab search eval: nprobe (9) must be at most nlist (8)"


def _forget_search_modules(monkeypatch):
    for name in [n for n in sys.modules if n in ("attnlab.search", "attnlab.cli.search_commands")
                 or n.startswith("attnlab.search.")]:
        monkeypatch.delitem(sys.modules, name)


def _import_of_search_cli_raises(monkeypatch, error: ImportError):
    _forget_search_modules(monkeypatch)
    real = builtins.__import__

    def fake(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "attnlab.cli.search_commands" or (name == "attnlab.cli" and "search_commands" in (fromlist or ())):
            raise error
        return real(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", fake)


def test_search_without_transformers_names_the_extra(tmp_path, capsys, monkeypatch):
    import attnlab.cli.search_commands as search_cli

    calls = []
    monkeypatch.setattr(search_cli, "_train", lambda args: calls.append(args) or 0)
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    line = one_line_error(["search", "train", "--steps", "1", "--out", str(tmp_path / "s")], capsys, tmp_path,
                          monkeypatch)
    assert "pip install 'attnlab[hf]'" in line and "transformers" in line
    assert calls == [], "the command ran although its packages are missing"


def test_search_runs_without_the_packages_only_some_methods_need(tmp_path, capsys, monkeypatch):
    """A GPU machine with transformers but no faiss, gguf or datasets trains projections: those three are
    imported only where used (and their absence there is test_search_optional_package_missing_at_run_time)."""
    import attnlab.cli.search_commands as search_cli

    calls = []
    monkeypatch.setattr(search_cli, "_train", lambda args: calls.append(args) or 0)
    for name in ("faiss", "gguf", "datasets"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    monkeypatch.chdir(tmp_path)
    assert main(["search", "train", "--steps", "1", "--out", str(tmp_path / "s")]) == 0 and len(calls) == 1


def test_search_is_registered_when_its_module_cannot_import_an_optional_package(tmp_path, capsys, monkeypatch):
    _import_of_search_cli_raises(monkeypatch, ModuleNotFoundError("No module named 'faiss'", name="faiss"))
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "search" in capsys.readouterr().out
    line = one_line_error(["search", "eval", "--ks", "16"], capsys, tmp_path, monkeypatch)
    assert "pip install 'attnlab[hf]'" in line and "faiss" in line and "invalid choice" not in line


def test_internal_import_bug_in_search_is_not_hidden(monkeypatch):
    bug = ImportError("cannot import name 'METHODS' from 'attnlab.search.retrieval'", name="attnlab.search.retrieval")
    _import_of_search_cli_raises(monkeypatch, bug)
    with pytest.raises(ImportError, match="METHODS"):
        main(["search", "train"])
    with pytest.raises(ImportError, match="METHODS"):
        main(["train", "--help"])


def test_search_optional_package_missing_at_run_time_is_one_line(tmp_path, capsys, monkeypatch):
    import attnlab.cli.search_commands as search_cli

    def needs_gguf(args):
        raise ModuleNotFoundError("No module named 'gguf'", name="gguf")

    monkeypatch.setattr(search_cli, "_train", needs_gguf)
    line = one_line_error(["search", "train"], capsys, tmp_path, monkeypatch)
    assert "gguf" in line and "pip install 'attnlab[hf]'" in line


def test_search_internal_import_error_at_run_time_propagates(tmp_path, monkeypatch):
    import attnlab.cli.search_commands as search_cli

    def broken(args):
        raise ImportError("cannot import name 'x' from 'attnlab.search.lm'", name="attnlab.search.lm")

    monkeypatch.setattr(search_cli, "_train", broken)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ImportError, match="attnlab.search.lm"):
        main(["search", "train"])


@pytest.mark.heavy
def test_subprocess_non_finite_override(tmp_path):
    """The real entry point: exit status 2, one line, no traceback, no run folder."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-m", "attnlab", "train", *SMALL, "model.attn=hybrid",
                           "model.attention.tau_max=inf"], capture_output=True, text=True, env=env, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.attention.tau_max" in lines[0] and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []
