"""`attnlab sweep --launcher`: runs as submitit jobs, through submitit's local executor (real subprocesses,
no cluster). A job SIGKILLed mid-run is resubmitted by the sweep, a job preempted (submitit's USR2) is
requeued through its checkpoint() hook; both resume from their checkpoints, and the results equal those
of `--jobs 1` bit for bit. Bad launcher options are one-line errors before anything is submitted or
written; the SLURM script carries the options."""

from __future__ import annotations

import json
import os
import signal
import sys
import sysconfig
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("submitit")

from attnlab.cli import main  # noqa: E402
from attnlab.experiments.launch import Launcher, make_executor, torchrun_command  # noqa: E402
from attnlab.lock import holder  # noqa: E402
from attnlab.train import read_log  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = (ROOT / "configs" / "tiny.toml").as_posix()
CORPUS = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").as_posix()
STEPS = 150
SHARED = ["model.d_model=16", "model.n_heads=2", "data.seq_len=16", f"data.source={CORPUS}", f"train.steps={STEPS}",
          "train.warmup_steps=0", "train.ckpt_every=5", "train.eval_every=0", "train.log_every=1",
          "train.eval_batches=1", "run.tensorboard=false", "run.threads=1"]


def write_spec(folder: Path, extra: list[str] = ()) -> Path:
    lines = ['title = "launch"', 'claim = "none"', 'below_budget = "a test"', f'base = "{TINY}"', "seeds = [0, 1]",
             f"overrides = {json.dumps(SHARED + list(extra))}",
             "[[variants]]", 'name = "hybrid"', 'overrides = ["model.attn=hybrid"]']
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spec.toml").write_text("\n".join(lines) + "\n")
    return folder / "spec.toml"


def per_run(results: dict) -> dict:
    keep = ("params", "steps", "tokens", "val_loss", "val_ppl", "train_loss", "tau", "metrics", "curves")
    return {(r["variant"], r["seed"]): {k: r[k] for k in keep} for r in results["runs"]}


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def wait_for(predicate, thread: threading.Thread, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while True:
        found = predicate()
        if found:
            return found
        assert thread.is_alive(), "the sweep ended early"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def training_pid(run_dir: Path, past_step: int):
    """The pid of the job process training `run_dir` once it has logged `past_step` steps (its lock names it)."""
    try:
        steps = [r["step"] for r in read_log(run_dir, "train")]
    except (OSError, ValueError):
        return None
    held = holder(run_dir)
    return held["pid"] if held and steps and past_step <= steps[-1] < STEPS - 20 else None


def start_sweep(spec: Path, status: dict) -> threading.Thread:
    sweep = threading.Thread(target=lambda: status.update(rc=main(["sweep", str(spec), "--no-progress",
                                                                     "--launcher", "local"])))
    sweep.start()
    return sweep


@pytest.mark.heavy
def test_a_killed_job_is_resubmitted_and_resumes_onto_the_jobs_1_results(tmp_path, capsys):
    seeds = "seeds = [0]\n"
    ref = write_spec(tmp_path / "ref")
    ref.write_text(ref.read_text().replace("seeds = [0, 1]\n", seeds))
    assert main(["sweep", str(ref), "--no-progress", "--jobs", "1"]) == 0
    expected = json.loads((tmp_path / "ref" / "results.json").read_text())

    spec = write_spec(tmp_path / "jobs")
    spec.write_text(spec.read_text().replace("seeds = [0, 1]\n", seeds))
    status = {}
    sweep = start_sweep(spec, status)
    run_dir = tmp_path / "jobs" / "runs" / "hybrid" / "seed0"
    try:  # a job that dies without a result (SIGKILL, OOM killer, a lost node): the sweep resubmits it
        os.kill(wait_for(lambda: training_pid(run_dir, 8), sweep), signal.SIGKILL)
    finally:
        sweep.join(timeout=180)
    err = capsys.readouterr().err
    assert status.get("rc") == 0, err[-3000:]
    assert "ended without a result" in err and "resubmitted" in err
    res = json.loads((tmp_path / "jobs" / "results.json").read_text())
    assert per_run(res) == per_run(expected)  # bit for bit: losses, curves, metrics
    assert res["runs"][0]["resumed"]  # from its checkpoint, not from scratch
    assert [r["step"] for r in read_log(run_dir, "train")] == list(range(1, STEPS + 1))
    assert set(json.loads((tmp_path / "jobs" / "submitit" / "jobs.json").read_text())) == {"hybrid/seed0"}


@pytest.mark.slow
def test_killed_and_preempted_jobs_resume_onto_the_jobs_1_results(tmp_path, capsys):
    """Two jobs at once: one SIGKILLed (resubmitted by the sweep), one preempted with submitit's USR2
    (its checkpoint() hands back the job, which submitit requeues)."""
    ref = write_spec(tmp_path / "ref")
    assert main(["sweep", str(ref), "--no-progress"]) == 0
    expected = json.loads((tmp_path / "ref" / "results.json").read_text())

    spec = write_spec(tmp_path / "jobs")
    status = {}
    sweep = start_sweep(spec, status)
    runs = tmp_path / "jobs" / "runs" / "hybrid"
    try:
        os.kill(wait_for(lambda: training_pid(runs / "seed0", 8), sweep), signal.SIGKILL)
        os.kill(wait_for(lambda: training_pid(runs / "seed1", 8), sweep), signal.SIGUSR2)
    finally:
        sweep.join(timeout=180)
    assert status.get("rc") == 0, capsys.readouterr().err[-3000:]
    res = json.loads((tmp_path / "jobs" / "results.json").read_text())
    assert per_run(res) == per_run(expected)
    assert all(r["resumed"] for r in res["runs"])
    for seed in (0, 1):
        assert [r["step"] for r in read_log(runs / f"seed{seed}", "train")] == list(range(1, STEPS + 1))
    logs = [p.read_text() for p in (tmp_path / "jobs" / "submitit").glob("*_log.*")]
    assert any("Requeued job" in text for text in logs)  # submitit's own requeue path, through checkpoint()


@pytest.mark.parametrize("args, word", [
    (["--launcher", "pbs"], "--launcher"),
    (["--slurm-partition", "gpu"], "--slurm-partition needs --launcher slurm"),
    (["--launcher", "local", "--slurm-time", "10"], "--slurm-time needs --launcher slurm"),
    (["--launcher", "slurm", "--slurm-time", "0:00:30"], "--slurm-time"),
    (["--launcher", "slurm", "--slurm-time", "soon"], "--slurm-time"),
    (["--launcher", "slurm", "--slurm-gpus-per-job", "-1"], "--slurm-gpus-per-job"),
    (["--launcher", "slurm", "--slurm-partition", "a b"], "--slurm-partition"),
    (["--launcher", "slurm"], "sbatch is not on PATH"),
    (["--launcher", "local", "--report-only"], "--report-only"),
    (["--launcher", "local", "--jobs", "0"], "--jobs"),
    (["run.nproc=2"], "needs --launcher"),
    (["--launcher", "local", "run.nproc=0"], "run.nproc"),
], ids=["kind", "partition-alone", "time-local", "time-short", "time-word", "gpus", "partition-space", "no-sbatch",
        "report-only", "jobs-0", "nproc-no-launcher", "nproc-0"])
def test_bad_launcher_options_are_one_line_errors_before_anything_is_submitted(args, word, tmp_path, capsys,
                                                                              monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))  # no sbatch here
    overrides = [a for a in args if "=" in a]
    spec = write_spec(tmp_path / "exp", [o for o in overrides])
    options = [a for a in args if "=" not in a]
    before = files_under(tmp_path)
    assert main(["sweep", str(spec), "--no-progress", *options]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and word in err[0], err
    assert files_under(tmp_path) == before


def test_slurm_script_carries_the_options(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sbatch", "srun"):  # stand-ins: submitit checks that it is on a SLURM host
        (bin_dir / tool).write_text("#!/bin/sh\necho 'Submitted batch job 4242'\n")
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    ex = make_executor(Launcher("slurm", partition="gpu", gpus_per_job=2, time=90), tmp_path / "submitit")
    script = ex._make_submission_file_text("CMD", "uid")
    for line in ("--partition=gpu", "--gpus-per-node=2", "--time=90", "--signal=USR2@90", "--nodes=1"):
        assert f"#SBATCH {line}" in script, script


def test_nproc_starts_torchrun_inside_the_job(tmp_path):
    cmd = torchrun_command({"run": {"nproc": 4}}, tmp_path / "config.toml")
    assert cmd[:2] == [sys.executable, "-m"] and "torch.distributed.run" in cmd
    assert "--standalone" in cmd and "--nproc_per_node=4" in cmd
    assert cmd[-3:] == ["-m", "attnlab.train", str(tmp_path / "config.toml")]
