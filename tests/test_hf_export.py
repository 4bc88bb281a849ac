"""`attnlab export RUN_DIR OUT_DIR`: a trained run becomes a folder that AutoModelForCausalLM and
AutoTokenizer load and that reproduces the run's logits; hostile input (no run, no checkpoint, a
damaged one, an unknown mechanism, a non-empty or file OUT_DIR) is one line `error: ...`, exit
status 2, and nothing written."""

import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import attnlab.hf  # noqa: E402,F401
from attnlab.cli import main  # noqa: E402
from attnlab.train.evaluate import load_run  # noqa: E402
from attnlab.testing import rel_rms  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.toml")
FAST = ["train.steps=2", "train.eval_every=2", "train.ckpt_every=2", "data.max_docs=20", "run.progress=false",
        "run.tensorboard=false"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny softmax+hybrid run trained through `attnlab train` (2 steps)."""
    run_dir = tmp_path_factory.mktemp("runs") / "tiny"
    assert main(["train", TINY, "--run-dir", str(run_dir), *FAST]) == 0
    return run_dir


def test_export_round_trip(run, tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()  # an empty OUT_DIR is fine
    assert main(["export", str(run), str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    _, lm, _ = load_run(run)
    ids = tok(["def f(x):\n    return x", "import os"], return_tensors="pt", padding=True)
    with torch.no_grad():
        assert rel_rms(hf(ids["input_ids"][1:, -9:]).logits, lm(ids["input_ids"][1:, -9:])[0]) <= 1e-6
        gen = hf.generate(**ids, max_new_tokens=4, do_sample=False)
    assert gen.shape == (2, ids["input_ids"].shape[1] + 4)
    assert hf.generation_config.eos_token_id == hf.generation_config.pad_token_id == 256


def _copy(run, tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(run, dst)
    return dst


def hostile_cases(run: Path, tmp_path: Path):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("hi")
    untrained = tmp_path / "untrained"
    untrained.mkdir()
    shutil.copy(run / "config.toml", untrained / "config.toml")
    unknown = _copy(run, tmp_path, "unknown")
    text = (unknown / "config.toml").read_text()
    (unknown / "config.toml").write_text(text.replace('"hybrid"', '"nope"'))
    damaged = _copy(run, tmp_path, "damaged")
    ckpt = sorted((damaged / "checkpoints").glob("step_*"))[-1] / "model.safetensors"
    ckpt.write_bytes(ckpt.read_bytes()[:100])
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    return {
        "missing run": ([str(tmp_path / "nope"), str(tmp_path / "o1")], "is not a folder"),
        "not a run": ([str(plain), str(tmp_path / "o2")], "no config.toml"),
        "no checkpoint": ([str(untrained), str(tmp_path / "o3")], "no checkpoint"),
        "unknown mechanism": ([str(unknown), str(tmp_path / "o4")], "must be one of"),
        "damaged checkpoint": ([str(damaged), str(tmp_path / "o5")], "damaged"),
        "non-empty out": ([str(run), str(full)], "not empty"),
        "out is a file": ([str(run), str(a_file)], "is a file"),
        "bad window": ([str(run), str(tmp_path / "o6"), "--window", "0"], "--window"),
    }


def test_export_hostile_inputs(run, tmp_path, capsys):
    cases = hostile_cases(run, tmp_path)
    before = {p.name: (p.stat().st_mtime_ns, p.is_dir()) for p in tmp_path.iterdir()}
    for name, (argv, must) in cases.items():
        code = main(["export", *argv])
        err = capsys.readouterr().err
        assert code == 2, name
        assert err.startswith("error: ") and err.count("\n") == 1 and must in err, (name, err)
    after = {p.name: (p.stat().st_mtime_ns, p.is_dir()) for p in tmp_path.iterdir()}
    assert after == before  # no OUT_DIR, no temporary sibling, nothing touched
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine" and (tmp_path / "a_file").read_text() == "x"


def test_push_to_hub_uploads_the_written_folder(run, tmp_path, capsys, monkeypatch):
    """--push-to-hub creates the repository (exist_ok) and uploads the exported folder, through
    huggingface_hub's HfApi (replaced here: no network); a bad repository name is refused before any work."""
    import huggingface_hub

    calls = []

    class FakeApi:
        def create_repo(self, **kw):
            calls.append(("create_repo", kw))

        def upload_folder(self, **kw):
            calls.append(("upload_folder", kw))
            return type("Info", (), {"commit_url": "https://huggingface.co/me/tiny/commit/abc"})()

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    out = tmp_path / "hf"
    assert main(["export", str(run), str(out), "--push-to-hub", "me/tiny", "--private"]) == 0
    assert calls[0] == ("create_repo", {"repo_id": "me/tiny", "repo_type": "model", "private": True, "exist_ok": True})
    name, kw = calls[1]
    assert name == "upload_folder" and kw["repo_id"] == "me/tiny" and kw["folder_path"] == str(out)
    assert "pushed to https://huggingface.co/me/tiny/commit/abc" in capsys.readouterr().out
    assert main(["export", str(run), str(tmp_path / "hf2"), "--push-to-hub", "tiny"]) == 2
    assert "user/name" in capsys.readouterr().err and not (tmp_path / "hf2").exists()
