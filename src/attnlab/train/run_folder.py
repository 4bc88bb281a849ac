"""A run's folder before training starts: whether it already holds a run, the refusal to train over
one unless run.resume or run.overwrite says so, and the clearing of an overwritten one."""

from __future__ import annotations

import shutil
from pathlib import Path

from . import ddp
from .checkpoint import latest_checkpoint
from .logging import LOG_PATHS
from .resume import CKPT_DIR


def holds_run(run_dir: Path) -> bool:
    """Whether `run_dir` holds a run: its log or a checkpoint."""
    return (run_dir / "log.jsonl").exists() or latest_checkpoint(run_dir / CKPT_DIR) is not None


def check_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """FileExistsError when `run_dir` holds a run and neither `resume` nor `overwrite` (run.resume,
    run.overwrite) is set."""
    if holds_run(run_dir) and not resume and not overwrite:
        raise FileExistsError(
            f"run folder {str(run_dir)!r} already holds a run; set run.resume=true to continue it, "
            f"run.overwrite=true to start afresh there, or choose another run.name"
        )


def prepare_run_dir(run_dir: Path, resume: bool, env: ddp.DistEnv) -> None:
    """Clear an overwritten run's logs, summary and checkpoints (the main process, between barriers
    every rank meets), then create the folder."""
    if holds_run(run_dir) and not resume:
        ddp.barrier(env)
        if env.is_main:
            for name in LOG_PATHS + ("summary.json", CKPT_DIR):
                path = run_dir / name
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        ddp.barrier(env)
    run_dir.mkdir(parents=True, exist_ok=True)
