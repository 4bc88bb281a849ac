"""Checkpoints: exact round trip, atomic writes, damaged checkpoints and resume checks."""

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from attnlab.models import LM, ModelConfig
from attnlab.train import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"


def small_model_and_optimizer(seed=0):
    torch.manual_seed(seed)
    model = LM(ModelConfig(vocab_size=40, d_model=16, n_layers=1, n_heads=2, attn="hybrid", max_seq_len=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(40, (2, 8))
    for _ in range(2):
        model(idx, idx)[1].backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_round_trip_is_exact(tmp_path):
    model, opt = small_model_and_optimizer()
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    state = {"data": {"step": 7}, "rng": ckpt.capture_rng()}
    expect = (random.random(), np.random.rand(), torch.rand(3))
    path = ckpt.save_checkpoint(tmp_path, 2, model, opt, state)
    assert path.name == "step_000002" and (tmp_path / "latest").read_text().strip() == "step_000002"

    other, other_opt = small_model_and_optimizer(seed=1)
    loaded = ckpt.load_checkpoint(tmp_path, other, other_opt)
    assert loaded["step"] == 2 and loaded["data"] == {"step": 7}
    for (n, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), n
    sa, sb = opt.state_dict(), other_opt.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i in sa["state"]:
        for key in sa["state"][i]:
            assert torch.equal(sa["state"][i][key], sb["state"][i][key]), (i, key)
    ckpt.restore_rng(loaded["rng"])
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expect[0] and got[1] == expect[1] and torch.equal(got[2], expect[2])


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model, opt = small_model_and_optimizer()
    ckpt.save_checkpoint(tmp_path, 1, model, opt, {})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    def dies(*args, **kwargs):
        raise KeyboardInterrupt("killed while writing the optimizer tensors")

    monkeypatch.setattr(ckpt, "save_file", dies)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(tmp_path, 2, model, opt, {})
    assert ckpt.latest_checkpoint(tmp_path).name == "step_000001"
    assert not list(tmp_path.glob(".tmp-*")) and not (tmp_path / "step_000002").exists()
    fresh, _ = small_model_and_optimizer(seed=5)
    assert ckpt.load_checkpoint(tmp_path, fresh)["step"] == 1
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())


def test_leftovers_of_a_kill_are_ignored_then_cleaned(tmp_path):
    model, opt = small_model_and_optimizer()
    ckpt.save_checkpoint(tmp_path, 10, model, opt, {})
    # what a SIGKILL can leave: a half-written temp folder, and a renamed folder whose pointer never moved
    stale = tmp_path / ".tmp-step_000020-abc"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\x00" * 10)
    assert ckpt.latest_checkpoint(tmp_path).name == "step_000010"
    ckpt.save_checkpoint(tmp_path, 30, model, opt, {}, keep=2)
    assert not stale.exists()
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000010", "step_000030"]
    ckpt.save_checkpoint(tmp_path, 40, model, opt, {}, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000030", "step_000040"]
    (tmp_path / "latest").unlink()  # pointer lost: fall back to the newest complete folder
    assert ckpt.latest_checkpoint(tmp_path).name == "step_000040"
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        ckpt.load_checkpoint(tmp_path / "nothing", model)


# The real kill (SIGKILL, SIGINT, SIGTERM of a training subprocess, then resume): tests/test_interrupts.py


# --------------------------------------------------------------------------- damaged checkpoints: raise, never fall back


def two_checkpoints(folder):
    model, opt = small_model_and_optimizer()
    ckpt.save_checkpoint(folder, 1, model, opt, {"data": {"step": 1}})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    ckpt.save_checkpoint(folder, 2, model, opt, {"data": {"step": 2}})
    return folder / "step_000002"


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def overwrite(path: Path, at: int, count: int = 8) -> None:
    """Flip `count` bytes at offset `at` (negative: from the end) in place; the size is unchanged."""
    data = bytearray(path.read_bytes())
    start = at % len(data)
    for i in range(start, start + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "file, damage, words",
    [
        ("model.safetensors", lambda p: truncate(p), ["bytes", "were written"]),
        ("model.safetensors", lambda p: overwrite(p, -16), ["SHA-256"]),  # tensor data: safetensors alone cannot tell
        ("model.safetensors", lambda p: overwrite(p, 12), ["SHA-256"]),  # the header
        ("optimizer.safetensors", lambda p: overwrite(p, -16), ["SHA-256"]),
        ("optimizer.safetensors", lambda p: p.write_bytes(b""), ["0 bytes"]),
        ("state.json", lambda p: truncate(p), ["not readable JSON"]),
    ],
    ids=["model-truncated", "model-bytes-overwritten", "model-header-overwritten", "optimizer-bytes-overwritten",
         "optimizer-emptied", "state-truncated"],
)
def test_damaged_checkpoint_raises_naming_the_file(tmp_path, file, damage, words):
    newest = two_checkpoints(tmp_path)
    damage(newest / file)
    model, opt = small_model_and_optimizer(seed=7)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.load_checkpoint(tmp_path, model, opt)
    msg = str(info.value)
    assert str(newest / file) in msg and "step_000001" in msg, msg  # names the file and the intact previous one
    for word in words:
        assert word in msg, msg
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "tensors loaded before the check"
    assert ckpt.latest_checkpoint(tmp_path) == newest  # no silent fallback: the damaged one is still the latest


def test_damaged_checkpoint_written_before_digests_were_recorded(tmp_path):
    newest = two_checkpoints(tmp_path)
    state = json.loads((newest / "state.json").read_text())
    del state["files"]
    (newest / "state.json").write_text(json.dumps(state))
    model, opt = small_model_and_optimizer(seed=7)
    assert ckpt.load_checkpoint(tmp_path, model, opt)["step"] == 2  # an intact old-style checkpoint still loads
    truncate(newest / "model.safetensors", 0.9)
    with pytest.raises(ckpt.CheckpointError, match=r"model\.safetensors.*not a readable safetensors file"):
        ckpt.load_checkpoint(tmp_path, model, opt)


def test_only_checkpoint_damaged_suggests_a_fresh_start(tmp_path):
    model, opt = small_model_and_optimizer()
    path = ckpt.save_checkpoint(tmp_path, 3, model, opt, {})
    truncate(path / "model.safetensors")
    with pytest.raises(ckpt.CheckpointError, match="run.overwrite=true"):
        ckpt.verify_checkpoint(path)


# --------------------------------------------------------------------------- the same through `attnlab train --resume`


CLI_RUN = ["train.steps=4", "train.ckpt_every=2", "train.eval_every=4", "train.eval_batches=1", "data.max_docs=20",
           "run.progress=false", "run.tensorboard=false"]


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """A real 4-step run (checkpoints at steps 2 and 4) written by `attnlab train`."""
    from attnlab.cli import main

    run_dir = tmp_path_factory.mktemp("cli") / "run"
    assert main(["train", str(TINY), "--run-dir", str(run_dir), *CLI_RUN]) == 0
    return run_dir


@pytest.fixture
def run_copy(cli_run, tmp_path):
    import shutil

    return Path(shutil.copytree(cli_run, tmp_path / "run"))


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def cli_error(argv, capsys, folder: Path) -> str:
    """`attnlab argv` must fail with one line on stderr and exit 2, leaving `folder` untouched."""
    from attnlab.cli import main

    before = snapshot(folder)
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert snapshot(folder) == before, "the run folder changed"
    return lines[0]


def resume_argv(run_dir, *extra):
    return ["train", str(TINY), "--run-dir", str(run_dir), *CLI_RUN, "train.steps=6", "--resume", *extra]


@pytest.mark.heavy
@pytest.mark.parametrize(
    "file, damage, words",
    [
        ("model.safetensors", lambda p: truncate(p), ["bytes"]),
        ("model.safetensors", lambda p: overwrite(p, -64, 32), ["SHA-256"]),
        ("optimizer.safetensors", lambda p: overwrite(p, 100, 4), ["SHA-256"]),
        ("state.json", lambda p: p.write_text('{"step": 4, "da'), ["JSON"]),
    ],
    ids=["model-truncated", "model-overwritten", "optimizer-overwritten", "state-truncated"],
)
def test_resume_from_damaged_checkpoint_is_a_one_line_error(run_copy, file, damage, words, capsys):
    damaged = run_copy / "checkpoints" / "step_000004" / file
    damage(damaged)
    line = cli_error(resume_argv(run_copy), capsys, run_copy)
    assert str(damaged) in line and "step_000002" in line, line
    for word in words:
        assert word in line, line


def test_eval_of_damaged_checkpoint_is_a_one_line_error(run_copy, capsys):
    damaged = run_copy / "checkpoints" / "step_000004" / "model.safetensors"
    overwrite(damaged, -64, 32)
    line = cli_error(["eval", str(run_copy)], capsys, run_copy)
    assert str(damaged) in line and "SHA-256" in line
    line = cli_error(["eval", str(run_copy), "--checkpoint", str(run_copy / "checkpoints" / "nothing")], capsys, run_copy)
    assert "--checkpoint" in line


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["model.d_model=64"], ["model.d_model was 32, now 64"]),
        (["model.attn=hybrid"], ["model.attn was ['softmax', 'hybrid'], now 'hybrid'"]),
        (["model.n_layers=3", "model.attn=[softmax,hybrid,hybrid]"], ["model.n_layers was 2, now 3"]),
        (["model.attention.tau=global"], ["model.attention.tau was 'head', now 'global'"]),
        (["model.layer_attention=[{},{sink=true}]"], ["model.layer_attention[1].sink was False, now True"]),
    ],
    ids=["d_model", "mechanism", "n_layers", "attention-field", "per-layer-field"],
)
def test_resume_with_another_model_config_names_the_key(run_copy, overrides, words, capsys):
    line = cli_error(resume_argv(run_copy, *overrides), capsys, run_copy)
    assert "cannot resume" in line and str(run_copy / "checkpoints" / "step_000004") in line, line
    for word in words:
        assert word in line, line


def test_eval_with_overrides_that_change_the_model_names_the_key(run_copy, capsys):
    line = cli_error(["eval", str(run_copy), "model.d_model=64"], capsys, run_copy)
    assert "model.d_model was 32, now 64" in line


@pytest.mark.heavy
def test_resume_accepts_a_default_written_out(run_copy, capsys):
    """The comparison is of the model each config builds: rope=true is the default here, so no change."""
    from attnlab.cli import main

    assert main(resume_argv(run_copy, "model.attention.rope=true")) == 0
    summary = json.loads((run_copy / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["resumed_from"].endswith("step_000004")


def test_trainer_resume_checks_the_model_config_before_loading(run_copy):
    """Library use (no CLI): the same named error, not a tensor shape mismatch from safetensors."""
    from attnlab.train import train
    from attnlab.train.config import load_config
    from attnlab.train.resume import ResumeError

    cfg = load_config(TINY, [f"run.out_dir={run_copy.parent}", f"run.name={run_copy.name}", *CLI_RUN,
                             "train.steps=6", "run.resume=true", "model.d_model=64"])
    with pytest.raises(ResumeError, match=r"model\.d_model was 32, now 64"):
        train(cfg)
