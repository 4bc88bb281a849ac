"""Training and evaluation of `attnlab.models.LM` runs.

    from attnlab.train import load_config, train, evaluate
    cfg = load_config("configs/tiny.toml", ["model.attn=hybrid", "train.steps=500"])
    summary = train(cfg)            # writes runs/<name>/: config, logs, checkpoints, summary.json
    report = evaluate(cfg.run_dir)  # loss at lengths, attention statistics, task accuracy

`python -m attnlab.train CONFIG [key=value ...]` runs the same from a shell, and under
`torchrun --nproc_per_node=N -m attnlab.train ...` it trains data-parallel.
"""

from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .config import (
    ConfigError, RegularizersConfig, RunConfig, RunSection, TrainConfig, dumps_toml, load_config, save_config, to_dict,
)
from .data_config import DataConfig
from .config_help import config_keys, format_config_keys
from .evaluate import evaluate, load_run
from .logging import read_log
from .trainer import Trainer, train

__all__ = [
    "ConfigError", "DataConfig", "RegularizersConfig", "RunConfig", "RunSection", "TrainConfig", "Trainer",
    "config_keys", "dumps_toml", "evaluate", "format_config_keys", "latest_checkpoint", "load_checkpoint",
    "load_config", "load_run", "read_log", "save_checkpoint", "save_config", "to_dict", "train",
]
