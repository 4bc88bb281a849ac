"""What resuming a run needs checked before anything is built or loaded: an intact checkpoint, trained
with the model config given now."""

from __future__ import annotations

import os
from pathlib import Path

from attnlab.models.config import format_changes, model_config_changes

from .checkpoint import latest_checkpoint, verify_checkpoint
from .config import RunConfig

CKPT_DIR = "checkpoints"  # a run folder's checkpoints


class ResumeError(ValueError):
    """The run to resume was trained with another model config than the one given now."""


def check_resume(cfg: RunConfig, path: str | os.PathLike | None = None) -> dict | None:
    """Check that `cfg` can resume from checkpoint `path` (default: the newest in its run folder)
    before anything is built or loaded: the checkpoint is intact (`verify_checkpoint`, raising
    CheckpointError naming a damaged file) and was trained with the same model config (raising
    ResumeError naming each dotted key that differs, with its saved and its new value). An unset
    model.vocab_size (0: the tokenizer's) is compared once resolved, in `Trainer._resume`.
    Returns the checkpoint's JSON state, or None when there is no checkpoint to resume from."""
    path = latest_checkpoint(Path(cfg.run_dir) / CKPT_DIR) if path is None else Path(path)
    if path is None:
        return None
    state = verify_checkpoint(path)
    check_same_model(cfg, path, state)
    return state


def check_same_model(cfg: RunConfig, path: Path, state: dict) -> None:
    saved = (state.get("config") or {}).get("model")
    if not isinstance(saved, dict):
        return
    changes = model_config_changes(saved, cfg.model, ignore=() if cfg.model.vocab_size else ("vocab_size",))
    if changes:
        raise ResumeError(
            f"cannot resume from {str(path)!r}: it was trained with another model config: {format_changes(changes)}; "
            f"resume with the run's model settings, or start a new run (--run-dir / run.name, or run.overwrite=true)"
        )
