"""Interrupted and concurrent work loses nothing, with real subprocesses: SIGINT / SIGTERM at a
random step save a checkpoint, print where the run stopped and the command that resumes it, and
exit 130 / 143; the resumed run equals an uninterrupted one bit for bit. One writer per folder:
a second training of a run, or a manual run of a sweep's run, is a one-line error (exit 2)
naming the holder; a SIGKILLed holder blocks nobody. Failed writes name the file and keep the
previous checkpoint."""

from __future__ import annotations

import errno
import json
import os
import random
import resource
import shlex
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from attnlab.cli import main
from attnlab.data.cache import WriteError
from attnlab.lock import FolderBusy, FolderLock, check_free, holder
from attnlab.train import checkpoint as ckpt
from attnlab.train import read_log

ROOT = Path(__file__).resolve().parents[1]
TINY = (ROOT / "configs" / "tiny.toml").as_posix()
CORPUS = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").as_posix()
STEPS = 36
COMMON = [f"data.source={CORPUS}", "run.threads=1", "run.tensorboard=false", f"train.steps={STEPS}",
          "train.ckpt_every=15", "train.eval_every=12", "train.log_every=1"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def attnlab(*args, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "attnlab", *map(str, args)], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def train_args(run_dir, *extra):
    return ["train", TINY, "--run-dir", str(run_dir), *COMMON, *extra]


def wait_for(predicate, proc: subprocess.Popen | None = None, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process ended early ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.02)


def logged_steps(run_dir) -> list[int]:
    return [r["step"] for r in read_log(run_dir, "train")]


def weights(run_dir, step=STEPS) -> dict:
    return load_file(str(Path(run_dir) / "checkpoints" / ckpt.checkpoint_name(step) / "model.safetensors"))


def printed_command(stderr: str) -> list[str]:
    """The arguments of the command the interrupted process printed (`... resume with: attnlab ARGS`)."""
    line = stderr.strip().splitlines()[-1]
    words = shlex.split(line.split("resume with: ", 1)[1])
    assert words[0] == "attnlab"
    return words[1:]


# --------------------------------------------------------------------------- SIGINT / SIGTERM then resume


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("ref") / "ref"
    assert main(train_args(run_dir)) == 0
    return run_dir


@pytest.mark.heavy
def test_sigint_sigterm_sigkill_at_random_steps_then_resume_equal_an_uninterrupted_run(tmp_path, reference, capsys):
    """Three victims at once: SIGINT and SIGTERM save the step they are in and print the command that
    resumes; SIGKILL loses the steps since the last checkpoint, which the resume trains again. While
    they run, a second training of one of their run folders is refused before it writes anything."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)
    rng = random.Random()  # its own, from the OS: the training in this process seeds the global one
    at = {sig: rng.randint(2, STEPS - 12) for sig in sigs}
    at[signal.SIGKILL] = rng.randint(16, 20)  # past the first checkpoint (step 15)
    dirs = {sig: tmp_path / sig.name for sig in sigs}
    victims = {sig: attnlab(*train_args(dirs[sig])) for sig in sigs}
    try:
        pending = set(sigs)
        deadline = time.monotonic() + 180
        while pending and time.monotonic() < deadline:
            for sig in list(pending):
                assert victims[sig].poll() is None, victims[sig].stderr.read()[-2000:]
                if len(logged_steps(dirs[sig])) >= at[sig]:
                    if sig == signal.SIGKILL:
                        _second_training_is_refused(dirs[sig], victims[sig].pid, capsys)
                    victims[sig].send_signal(sig)
                    pending.discard(sig)
            time.sleep(0.02)
        errs = {sig: victims[sig].communicate(timeout=120)[1] for sig in sigs}
    finally:
        for v in victims.values():
            v.kill()
    resumes = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        err, run_dir = errs[sig], dirs[sig]
        assert victims[sig].returncode == 128 + sig, (at, err[-2000:])
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in err, err
        stopped = logged_steps(run_dir)[-1]
        assert stopped < STEPS and f"stopped after step {stopped} of {STEPS}" in lines[0], (at, lines)
        assert f"interrupted by {sig.name}" in lines[0] and "--resume" in lines[0]
        assert ckpt.latest_checkpoint(run_dir / "checkpoints").name == ckpt.checkpoint_name(stopped)  # nothing lost
        resumes[sig] = printed_command(err)
    assert victims[signal.SIGKILL].returncode == -signal.SIGKILL
    assert ckpt.latest_checkpoint(dirs[signal.SIGKILL] / "checkpoints").name in ("step_000015", "step_000030")
    resumes[signal.SIGKILL] = train_args(dirs[signal.SIGKILL], "--resume")
    for sig in sigs:
        assert main(resumes[sig]) == 0, sig.name  # in this process: the same code, one interpreter less
        run_dir = dirs[sig]
        assert logged_steps(run_dir) == list(range(1, STEPS + 1))  # rows past the checkpoint written once
        assert _losses(run_dir) == _losses(reference), f"{sig.name} at step {at[sig]}"
        assert read_log(run_dir, "eval") == read_log(reference, "eval")
        a, b = weights(reference), weights(run_dir)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"{sig.name} at step {at[sig]}"


def _second_training_is_refused(busy: Path, pid: int, capsys) -> None:
    config = (busy / "config.toml").stat().st_mtime_ns
    assert holder(busy)["pid"] == pid
    assert main(train_args(busy, "--resume")) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(busy) in err and f"process {pid}" in err and "attnlab train" in err
    assert (busy / "config.toml").stat().st_mtime_ns == config  # nothing written


def _losses(run_dir) -> list:
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in read_log(run_dir, "train")]  # not timings


@pytest.mark.heavy
def test_a_second_signal_exits_at_once_leaving_the_previous_checkpoint(tmp_path):
    run_dir = tmp_path / "run"  # steps of about a second, so the second signal comes mid-step
    victim = attnlab(*train_args(run_dir, "train.steps=2000", "train.ckpt_every=1", "train.eval_every=0",
                                 "train.batch_size=64", "data.seq_len=512"))
    wait_for(lambda: ckpt.latest_checkpoint(run_dir / "checkpoints") is not None, victim)
    first = ckpt.latest_checkpoint(run_dir / "checkpoints")
    time.sleep(0.05)  # inside the next step
    victim.send_signal(signal.SIGINT)
    time.sleep(0.05)
    victim.send_signal(signal.SIGINT)
    _, err = victim.communicate(timeout=60)
    assert victim.returncode == 130 and "again: stopped at once" in err and "Traceback" not in err, err[-2000:]
    latest = ckpt.latest_checkpoint(run_dir / "checkpoints")
    assert latest.name <= ckpt.checkpoint_name(int(first.name[5:]) + 1)  # no step finished after the first signal
    ckpt.verify_checkpoint(latest)  # intact, and the one a resume would take


# --------------------------------------------------------------------------- one writer per folder


def _hold(folder: Path) -> subprocess.Popen:
    """A bare process holding `folder`'s lock until killed (imports no torch: starts fast)."""
    code = ("import sys, time; from attnlab.lock import FolderLock; FolderLock(sys.argv[1]).acquire(); "
            "print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder)], env=dict(ENV, ATTNLAB_COMMAND="holder-cmd"),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_lock_held_by_a_sigkilled_process_blocks_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    proc = _hold(run_dir)
    with pytest.raises(FolderBusy, match=f"process {proc.pid} \\(holder-cmd\\)"):
        check_free(run_dir)
    assert main(train_args(run_dir, "train.steps=2")) == 2
    assert "holder-cmd" in capsys.readouterr().err
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    check_free(run_dir)  # the kernel released it
    assert main(train_args(run_dir, "train.steps=2", "run.overwrite=true")) == 0
    with FolderLock(run_dir), FolderLock(run_dir):  # re-entrant in one process
        assert holder(run_dir) is None


def sweep_spec(folder: Path, steps: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    shared = ["model.d_model=16", "model.n_heads=2", "data.seq_len=16", f"data.source={CORPUS}",
              f"train.steps={steps}", "train.ckpt_every=50", "train.eval_every=0", "train.log_every=1",
              "train.eval_batches=1", "run.tensorboard=false", "run.threads=1"]
    lines = ['title = "interrupt"', 'claim = "none"', 'below_budget = "a test"', f'base = "{TINY}"', "seeds = [0]",
             f"overrides = {json.dumps(shared)}"]
    for name in ("softmax", "hybrid"):
        lines += ["[[variants]]", f'name = "{name}"', f'overrides = ["model.attn={name}"]']
    (folder / "spec.toml").write_text("\n".join(lines) + "\n")
    return folder / "spec.toml"


@pytest.mark.heavy
def test_sweep_with_workers_stops_them_on_sigterm_refuses_a_manual_run_and_resumes(tmp_path, capsys):
    spec = sweep_spec(tmp_path / "exp", steps=200)
    runs = [tmp_path / "exp" / "runs" / v / "seed0" for v in ("softmax", "hybrid")]
    sw = attnlab("sweep", spec, "--jobs", "2", "--no-progress")
    try:
        wait_for(lambda: all(len(logged_steps(r)) >= 3 for r in runs), sw, timeout=180)
        assert main(["train", TINY, "--run-dir", str(runs[0]), "--resume"]) == 2  # a manual run of one of its runs
        err = capsys.readouterr().err
        assert "attnlab sweep" in err and str(runs[0]) in err
        assert main(["sweep", str(spec), "--no-progress"]) == 2  # a second sweep of the same spec
        assert "being written" in capsys.readouterr().err
        sw.send_signal(signal.SIGTERM)
        _, err = sw.communicate(timeout=120)
    finally:
        sw.kill()
    assert sw.returncode == 143, err[-3000:]
    assert "sweep stopped" in err.strip().splitlines()[-1] and "resume with: attnlab sweep" in err, err[-2000:]
    stopped = {r: logged_steps(r)[-1] for r in runs}  # a worker finished its step and saved it (a fast one
    assert any(s < 200 for s in stopped.values()), stopped  # may have finished its run before the signal)
    for r, step in stopped.items():
        assert ckpt.latest_checkpoint(r / "checkpoints").name == ckpt.checkpoint_name(step)
    assert main(printed_command(err)) == 0
    for r in runs:
        assert logged_steps(r) == list(range(1, 201))
    assert json.loads((tmp_path / "exp" / "results.json").read_text())["runs"]


# --------------------------------------------------------------------------- failed writes


def test_a_checkpoint_write_that_fails_part_way_names_the_file(tmp_path, monkeypatch):
    from test_checkpoint_resume import small_model_and_optimizer

    model, opt = small_model_and_optimizer()
    ckpt.save_checkpoint(tmp_path, 1, model, opt, {})

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ckpt, "save_file", disk_full)  # the optimizer tensors
    with pytest.raises(WriteError, match=r"optimizer.safetensors'.*No space left.*step_000001 is still the latest"):
        ckpt.save_checkpoint(tmp_path, 2, model, opt, {})
    monkeypatch.undo()
    monkeypatch.setattr(ckpt, "atomic_write_text", lambda *a: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    with pytest.raises(WriteError, match=r"latest'.*Permission denied"):
        ckpt.save_checkpoint(tmp_path, 3, model, opt, {})
    monkeypatch.undo()
    assert ckpt.latest_checkpoint(tmp_path).name == "step_000001" and not list(tmp_path.glob(".tmp-*"))
    assert ckpt.load_checkpoint(tmp_path, model)["step"] == 1


def test_a_real_failed_write_is_one_line_and_eval_uses_the_previous_checkpoint(tmp_path, capsys):
    """A real EFBIG (a file-size limit on the resumed process) while writing the next checkpoint."""
    run_dir = tmp_path / "run"
    assert main(train_args(run_dir, "train.steps=20", "train.ckpt_every=20")) == 0
    size = (run_dir / "checkpoints" / "step_000020" / "model.safetensors").stat().st_size
    limit = size // 2  # smaller than any checkpoint file, larger than the logs' growth
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    capsys.readouterr()
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))  # writes past it fail with EFBIG (SIGXFSZ ignored)
    try:
        status = main(train_args(run_dir, "train.steps=40", "train.ckpt_every=20", "--resume"))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
    err = capsys.readouterr().err.strip()
    assert status == 1 and err.count("\n") == 0, err[-2000:]
    assert "model.safetensors" in err and "step_000020 is still the latest" in err
    assert ckpt.latest_checkpoint(run_dir / "checkpoints").name == "step_000020"
    assert main(["eval", str(run_dir), "-q", "--max-tokens", "256", "--analysis-len", "16"]) == 0
    assert json.loads((run_dir / "eval.json").read_text())["step"] == 20
