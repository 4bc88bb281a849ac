"""Sweeps beyond one machine: each unfinished run becomes one submitit job.

    attnlab sweep SPEC.toml --launcher slurm --slurm-partition gpu --slurm-gpus-per-job 1 --slurm-time 4:00:00
    attnlab sweep SPEC.toml --launcher local           # the same path, as local subprocesses

The command still plans, validates and locks its output folder here; only the work of a run
(train, or resume, then measure) moves into a job. Submitit's own files (the pickled job, its
stdout/stderr) go under OUT/submitit/, with OUT/submitit/jobs.json naming the newest job of each run.

How a job ends, and what happens then:
- finished: its result comes back; results, report and plots are written as without a launcher.
- time limit or preemption (submitit's USR2 signal, sent before the limit): `RunJob.checkpoint`
  hands submitit the same job again, which requeues it; the rerun finds the run folder's newest
  checkpoint and resumes from it exactly (the trainer's resume), losing at most train.ckpt_every steps.
  (On SIGTERM the trainer finishes its step and checkpoints first.)
- died without a result (killed, node failure): resubmitted by this command, up to `retries` times,
  and resumed the same way.
- raised an error: not resubmitted; once the other jobs have ended the command names the run and its log.

Every (re)start of a job looks at its run folder afresh (done, evaluate, resume, restart, new), so a
resubmission is always a plain rerun. SIGINT/SIGTERM to the waiting command: with `local` the jobs are
told to stop (each finishes its step and checkpoints) and the command exits 130/143; with `slurm` the
jobs keep running on the cluster, and the same command run again collects them (it waits for the
jobs named in jobs.json that are still queued or running instead of submitting new ones).

A run with run.nproc = N > 1 trains through `torchrun --standalone --nproc_per_node=N -m attnlab.train`
inside its job (one node; several nodes per run is not supported here).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from attnlab import interrupt
from attnlab.data.cache import atomic_write_text
from attnlab.models.config import ConfigError

LAUNCHERS = ("local", "slurm")
CLUSTER_EXTRA = "pip install 'attnlab[cluster]'"
SUBMITIT_DIR = "submitit"
LOCAL_NO_LIMIT_MIN = 7 * 24 * 60  # submitit's local executor kills a job at its time limit: none by default


class JobFailed(RuntimeError):
    """A job raised an error (not resubmitted), or died more often than allowed."""


# --------------------------------------------------------------------------- options


@dataclass
class Launcher:
    """Where and how the jobs run. `time` in minutes (None: slurm's partition default; no limit locally)."""

    kind: str = "local"
    partition: str | None = None
    gpus_per_job: int = 0
    cpus_per_job: int | None = None
    time: int | None = None
    parallel: int | None = None  # jobs queued or running at once (None: all)
    retries: int = 3  # resubmissions of a run whose job died without a result
    requeues: int = 20  # time-limit requeues of one job (submitit's max_num_timeout)
    poll_s: float | None = None  # how often the jobs are checked (default 0.2 s locally, 30 s on slurm)
    signal_delay_s: int | None = None  # the USR2 notice before the time limit (default: 90 s slurm, 30 s local)

    def __post_init__(self):
        if self.kind not in LAUNCHERS:
            raise ConfigError(f"--launcher must be one of {', '.join(LAUNCHERS)}, got {self.kind!r}")


def _minutes(text: str) -> int:
    """'90' (minutes), 'H:MM:SS', 'MM:SS' or 'D-HH:MM:SS' as SLURM writes them -> whole minutes >= 1."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not m:
        raise ValueError(text)
    days, a, b, c = (int(g) if g is not None else None for g in m.groups())
    if b is None:  # minutes, or D-HH
        seconds = a * 3600 if days is not None else a * 60
    elif c is None:  # MM:SS, or D-HH:MM
        seconds = a * 3600 + b * 60 if days is not None else a * 60 + b
    else:
        seconds = a * 3600 + b * 60 + c
    seconds += (days or 0) * 86400
    if seconds < 60:
        raise ValueError(text)
    return -(-seconds // 60)


def add_launcher_options(p) -> None:
    """--launcher and the --slurm-* options of a command (today `attnlab sweep`)."""
    p.add_argument("--launcher", choices=LAUNCHERS, metavar="local|slurm",
                   help="run each unfinished run as a submitit job: on SLURM, or as local subprocesses; jobs that "
                        f"die or time out are resubmitted and resume from their checkpoints (needs {CLUSTER_EXTRA})")
    p.add_argument("--slurm-partition", metavar="NAME", help="SLURM partition of the jobs (--launcher slurm)")
    p.add_argument("--slurm-gpus-per-job", type=int, metavar="N", help="GPUs per job (--launcher slurm; default 0)")
    p.add_argument("--slurm-cpus-per-job", type=int, metavar="N", help="CPUs per job (--launcher slurm)")
    p.add_argument("--slurm-time", metavar="TIME", help="time limit per job: minutes, or [D-]H:MM:SS (--launcher "
                   "slurm); a job that reaches it is checkpointed and requeued")


def launcher_from_options(ns) -> Launcher | None:
    """The Launcher the options ask for (None without --launcher), checked before anything is submitted:
    each problem raises ConfigError naming the option."""
    kind = getattr(ns, "launcher", None)
    slurm = {name: getattr(ns, name, None) for name in
             ("slurm_partition", "slurm_gpus_per_job", "slurm_cpus_per_job", "slurm_time")}
    given = [n for n, v in slurm.items() if v is not None]
    if kind != "slurm" and given:
        raise ConfigError(f"--{given[0].replace('_', '-')} needs --launcher slurm")
    if kind is None:
        return None
    if getattr(ns, "report_only", False):
        raise ConfigError("--launcher with --report-only: a report trains nothing; drop --launcher")
    partition = slurm["slurm_partition"]
    if partition is not None and (not partition.strip() or re.search(r"\s", partition)):
        raise ConfigError(f"--slurm-partition must be a partition name, got {partition!r}")
    gpus, cpus = slurm["slurm_gpus_per_job"], slurm["slurm_cpus_per_job"]
    if gpus is not None and gpus < 0:
        raise ConfigError(f"--slurm-gpus-per-job must be >= 0, got {gpus}")
    if cpus is not None and cpus < 1:
        raise ConfigError(f"--slurm-cpus-per-job must be >= 1, got {cpus}")
    minutes = None
    if slurm["slurm_time"] is not None:
        try:
            minutes = _minutes(slurm["slurm_time"])
        except ValueError:
            raise ConfigError(f"--slurm-time must be minutes or [D-]H:MM:SS, at least one minute, "
                              f"got {slurm['slurm_time']!r}") from None
    try:
        import submitit  # noqa: F401
    except ImportError:
        raise ConfigError(f"--launcher needs the optional package submitit, not installed here; install the "
                          f"[cluster] extra: {CLUSTER_EXTRA}") from None
    missing = [tool for tool in ("sbatch", "srun") if kind == "slurm" and shutil.which(tool) is None]
    if missing:
        raise ConfigError(f"--launcher slurm: {missing[0]} is not on PATH; run the command where SLURM jobs are "
                          f"submitted (a login node), or use --launcher local")
    return Launcher(kind, partition=partition, gpus_per_job=gpus or 0, cpus_per_job=cpus, time=minutes,
                    parallel=getattr(ns, "jobs", None))


def make_executor(launcher: Launcher, folder: Path):
    """The submitit executor of `launcher`, writing its files into `folder`."""
    import submitit

    folder = Path(folder)
    if launcher.kind == "local":
        ex = submitit.LocalExecutor(folder, max_num_timeout=launcher.requeues)
        ex.update_parameters(timeout_min=launcher.time or LOCAL_NO_LIMIT_MIN,
                             signal_delay_s=30 if launcher.signal_delay_s is None else launcher.signal_delay_s)
        return ex
    ex = submitit.SlurmExecutor(folder, max_num_timeout=launcher.requeues)
    params = {"nodes": 1, "ntasks_per_node": 1, "job_name": "attnlab",
              "signal_delay_s": 90 if launcher.signal_delay_s is None else launcher.signal_delay_s}
    if launcher.partition:
        params["partition"] = launcher.partition
    if launcher.gpus_per_job:
        params["gpus_per_node"] = launcher.gpus_per_job
    if launcher.cpus_per_job:
        params["cpus_per_task"] = launcher.cpus_per_job
    if launcher.time:
        params["time"] = launcher.time
    ex.update_parameters(**params)
    return ex


# --------------------------------------------------------------------------- the jobs


def torchrun_command(raw: dict, config_path: Path) -> list[str]:
    """The command that trains the run of `raw` on run.nproc processes of this node."""
    nproc = int((raw.get("run") or {}).get("nproc", 1))
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "attnlab.train", str(config_path)]


class SweepJob:
    """One (variant, seed) of a sweep, as a job: look at the run folder, then train (or resume) and measure
    it through `runs.execute`. Checkpointable in submitit's sense (what submitit looks for is the
    `checkpoint` method; subclassing submitit.helpers.Checkpointable would make `import attnlab` need it):
    `checkpoint()`, called on a time limit or preemption, returns the same job, whose rerun resumes from
    the trainer's newest checkpoint."""

    def __init__(self, job: dict):
        self.job = job
        self._child: subprocess.Popen | None = None

    def __call__(self) -> dict:
        from .sweep.runs import _run_state, execute
        from attnlab.train.config import config_from_dict

        with interrupt.graceful():
            job = copy.deepcopy(self.job)
            cfg = config_from_dict(job["raw"])
            state = _run_state(Path(cfg.run_dir), cfg, job["metrics"])  # as the folder is now, not at submission
            run = job["raw"]["run"]
            run.update(resume=state in ("resume", "evaluate", "done"), overwrite=state == "restart")
            if state == "done":
                state = "evaluate"  # finished before an earlier job could report: only the record is rebuilt
            job["state"] = state
            if state != "evaluate" and cfg.run.nproc > 1:
                self._torchrun(job["raw"], Path(cfg.run_dir))
                job["state"] = "evaluate"
            return execute(job)

    def _torchrun(self, raw: dict, run_dir: Path) -> None:
        """Train on run.nproc processes; the ranks' trainer takes the run folder's lock itself."""
        from attnlab.train.config import config_from_dict, save_config

        folder = run_dir.parent / f".{run_dir.name}.torchrun"  # the job's own copy of the config
        path, _ = save_config(config_from_dict(raw), folder)
        self._child = subprocess.Popen(torchrun_command(raw, path))
        try:
            while self._child.poll() is None:
                try:
                    self._child.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    if interrupt.requested() is not None:
                        self._child.send_signal(signal.SIGTERM)  # the ranks checkpoint and stop
                        self._child.wait()
            code = self._child.returncode
        finally:
            self._child = None
        interrupt.check(f"{run_dir} stopped")
        if code != 0:
            raise RuntimeError(f"torchrun for {run_dir} exited with status {code}")

    def checkpoint(self, *args, **kwargs):
        """submitit's hook on a time limit or preemption: stop a torchrun child (it checkpoints on
        SIGTERM) and return this same job for requeueing; its rerun resumes from the checkpoint."""
        import submitit

        child = self._child
        if child is not None and child.poll() is None:  # let torchrun's ranks finish their step and checkpoint
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=120)
            except subprocess.TimeoutExpired:
                child.kill()
        return submitit.helpers.DelayedSubmission(SweepJob(self.job))


# --------------------------------------------------------------------------- submit and wait


def _registry(folder: Path) -> dict:
    try:
        data = json.loads((folder / "jobs.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _attach(launcher: Launcher, folder: Path, job_id: str):
    """A SLURM job of an earlier run of this command, when it is still queued or running."""
    if launcher.kind != "slurm":
        return None
    import submitit

    job = submitit.SlurmJob(folder=folder, job_id=job_id)
    try:
        return None if job.done(force_check=True) else job
    except Exception:  # sacct unavailable or the job unknown: submit anew
        return None


def launch(work: list[tuple[str, object]], launcher: Launcher, folder: str | os.PathLike, *,
           bar=None, stopped: Callable[[], str] | None = None, quiet: bool = False) -> dict[str, object]:
    """Run every (name, job) of `work` as a submitit job and wait for them; returns {name: result}.
    Jobs that die without a result are resubmitted (up to launcher.retries times each). Raises
    JobFailed naming the runs whose job raised, once the others have ended; Interrupted on
    SIGINT/SIGTERM (local jobs are stopped, slurm jobs are left running; see the module doc)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    executor = make_executor(launcher, folder)
    poll = launcher.poll_s if launcher.poll_s is not None else (0.2 if launcher.kind == "local" else 30.0)
    registry = _registry(folder)
    jobs = dict(work)
    pending = list(jobs)
    running: dict[str, object] = {}
    tries = {name: 0 for name in jobs}
    results: dict[str, object] = {}
    failed: list[str] = []
    stopping = False

    def note(text: str) -> None:
        if not quiet:
            (bar.write if bar is not None and hasattr(bar, "write") else print)(text, file=sys.stderr)

    def submit(name: str) -> None:
        job = executor.submit(jobs[name])
        running[name] = job
        registry[name] = str(job.job_id)
        atomic_write_text(folder / "jobs.json", json.dumps(registry, indent=1) + "\n")

    for name in list(pending):  # slurm: jobs an earlier (interrupted) run of the command left on the cluster
        old = registry.get(name)
        job = _attach(launcher, folder, old) if old else None
        if job is not None:
            running[name] = job
            pending.remove(name)
            note(f"{name}: collecting job {old}, still on the cluster")

    with interrupt.graceful():
        while pending or running:
            if interrupt.requested() is not None and not stopping:
                stopping = True
                pending.clear()
                if launcher.kind != "local":
                    break
                for job in running.values():  # the controller passes it on to the job: step, checkpoint, stop
                    proc = getattr(job, "_process", None)
                    if proc is not None and proc.poll() is None:
                        proc.send_signal(signal.SIGTERM)
            while pending and (launcher.parallel is None or len(running) < launcher.parallel):
                submit(pending.pop(0))
            for name, job in list(running.items()):
                if not job.done():
                    continue
                del running[name]
                if job.paths.result_pickle.exists():
                    try:
                        results[name] = job.result()
                    except Exception:  # the job's function raised: its log holds the traceback
                        failed.append(f"{name} (log: {job.paths.stderr})")
                        continue
                    if bar is not None:
                        bar.set_postfix_str(name)
                        bar.update(1)
                elif stopping:
                    continue
                elif tries[name] < launcher.retries:
                    tries[name] += 1
                    note(f"{name}: job {job.job_id} ended without a result (killed?); resubmitted "
                         f"({tries[name]} of {launcher.retries}), it resumes from its checkpoint")
                    submit(name)
                else:
                    failed.append(f"{name} (died {tries[name] + 1} times; last log: {job.paths.stderr})")
            if pending or running:
                time.sleep(poll)
    if failed:
        raise JobFailed(f"{len(failed)} job(s) failed: {'; '.join(failed)}; the same command retries them")
    signum = interrupt.requested()
    if stopping and signum is not None:
        where = stopped() if stopped is not None else "stopped"
        if running:  # slurm: left on the cluster
            ids = ", ".join(str(j.job_id) for j in running.values())
            where += f"; {len(running)} job(s) still on the cluster ({ids}): run the same command again to collect them"
        raise interrupt.Interrupted(signum, where)
    return results
