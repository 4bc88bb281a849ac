"""Early stopping on the periodic evaluations, keeping the best evaluation's weights.

With train.early_stop_patience = p the trainer watches train.early_stop_metric at every
evaluation; an evaluation improves when it beats the best so far by more than
train.early_stop_min_delta (lower val_loss, higher val_accuracy). The best evaluation's weights
are written as a checkpoint of their own in `checkpoints/best/` (the same atomic format, model
only); after p evaluations in a row without improvement, or at train.steps, the run ends with
those weights restored and saved as its final checkpoint, so `attnlab eval`, the sweep's metrics
and the Hugging Face export all read the best model.

The watcher's state (best value and step, evaluations since, whether the run has ended) travels in
every checkpoint, and the best weights are on disk, so a run interrupted at any step and resumed
stops at the same step and ends with the same weights as one never interrupted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .checkpoint import latest_checkpoint, save_checkpoint
from .ddp import load_into

BEST_DIR = "best"


@dataclass
class EarlyStopping:
    """The watcher: `update(eval_row)` after each evaluation returns whether to stop."""

    patience: int
    metric: str = "val_loss"
    min_delta: float = 0.0
    best: float | None = None
    best_step: int | None = None
    best_eval: dict = field(default_factory=dict)
    since_best: int = 0
    ended: bool = False

    @property
    def active(self) -> bool:
        return self.patience > 0

    def improves(self, value: float) -> bool:
        if self.best is None:
            return True
        if self.metric == "val_accuracy":
            return value > self.best + self.min_delta
        return value < self.best - self.min_delta

    def update(self, row: dict) -> tuple[bool, bool]:
        """Record one evaluation row (it holds "step" and the metric); return (improved, stop)."""
        value = float(row[self.metric])
        improved = self.improves(value)
        if improved:
            self.best, self.best_step, self.best_eval, self.since_best = value, int(row["step"]), dict(row), 0
        else:
            self.since_best += 1
        return improved, self.since_best >= self.patience

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)

    # -------------------------------------------------------------- the best weights on disk

    @staticmethod
    def folder(ckpt_dir: str | Path) -> Path:
        return Path(ckpt_dir) / BEST_DIR

    def save_best(self, ckpt_dir: str | Path, model: torch.nn.Module) -> None:
        """Write the model as the best checkpoint (atomic; the previous best is replaced)."""
        save_checkpoint(self.folder(ckpt_dir), int(self.best_step), model, None,
                        {"early_stop": self.state_dict()}, keep=1)

    def restore_best(self, ckpt_dir: str | Path, model: torch.nn.Module, device, replica=None) -> bool:
        """Load the best weights into `model` (a sharded one through `replica`, its unsharded copy:
        `ddp.load_into`); False (nothing loaded) before any evaluation."""
        path = latest_checkpoint(self.folder(ckpt_dir))
        if path is None:
            if self.best_step is not None:
                raise FileNotFoundError(f"the best checkpoint of step {self.best_step} is missing from "
                                        f"{str(self.folder(ckpt_dir))!r}")
            return False
        load_into(model, None, path, device, replica)
        return True
