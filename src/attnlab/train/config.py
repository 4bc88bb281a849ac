"""The run configuration: plain dataclasses loaded from TOML with dotted overrides.

    cfg = load_config("configs/tiny.toml", ["model.attn=hybrid", "train.steps=500"])

A RunConfig has five sections -- model, data, train, regularizers, run -- each a
dataclass whose `__post_init__` checks its values and fills derived fields (the data section,
`DataConfig`, has a module of its own: `attnlab.train.data_config`). Everything is validated
here, at the edge, before any work starts: an unknown key, a wrong type or an impossible
combination raises `ConfigError` naming the dotted key and what is allowed.
Every section checks its fields by their annotations first (`check_fields`): bools are
true/false only, ints are never bools, and no float is NaN or ±inf.
Override values are parsed as TOML literals (`train.lr=3e-4`, `model.attn=["softmax","hybrid"]`)
and fall back to plain strings (`model.attn=hybrid`, `model.attn=[softmax,hybrid]`).
`config_keys()` lists every key with its type, default and help text.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Union

import torch

from attnlab.layers import mechanism_class
from attnlab.layers.mechanisms.scalar import HybridAttention
from attnlab.models.config import ConfigError, ModelConfig, build_dataclass, check_fields, did_you_mean, opt

from attnlab.data.cache import atomic_write_text

from .data_config import DataConfig
from .loggers import LOGGERS
from .overrides import apply_overrides, read_toml
from .toml_io import dumps_toml, to_dict


@dataclass
class TrainConfig:
    """The optimisation: AdamW with linear warmup and cosine decay, clipping, accumulation."""

    steps: int = opt(200, "optimizer steps")
    batch_size: int = opt(8, "sequences per micro-step, summed over all data-parallel ranks")
    grad_accum: int = opt(1, "micro-steps per optimizer step (global batch = batch_size * grad_accum)")
    lr: float = opt(1e-3, "peak learning rate")
    min_lr_ratio: float = opt(0.1, "cosine decay ends at lr * min_lr_ratio")
    warmup_steps: int = opt(20, "linear warmup steps from 0 to lr")
    weight_decay: float = opt(0.1, "AdamW decoupled weight decay on matrices (dim >= 2); none on norms, biases, τ and other vectors")
    betas: tuple[float, float] = opt((0.9, 0.95), "AdamW betas")
    eps: float = opt(1e-8, "AdamW epsilon")
    grad_clip: float = opt(1.0, "clip the global gradient norm to this (0 = off)")
    dtype: Literal["float32", "bfloat16"] = opt("float32", "autocast dtype for the forward pass (weights stay float32)")
    tf32: bool = opt(True, "on CUDA, let float32 matmuls and convolutions use TF32 (about 1e-3 relative error, "
                           "several times faster); false keeps full float32")
    compile: Union[bool, Literal["auto"]] = opt(
        "auto", "run the model under torch.compile (the first steps compile; checkpoints, resume and evaluation are "
                "unchanged); 'auto': on CUDA, where one compiled graph is what trains at a plain GPT's speed, "
                "and not on the CPU, where compiling takes longer than a short run saves")
    checkpoint_activations: bool = opt(False, "recompute each block's activations in the backward pass instead of "
                                              "keeping them (less memory, about one more forward); not on steps that "
                                              "record attention for the regularizers or the logs")
    eval_every: int = opt(50, "evaluate on the validation split every N steps (0 = only at the end)")
    eval_batches: int = opt(8, "validation batches per evaluation")
    log_every: int = opt(10, "write a log row every N steps")
    ckpt_every: int = opt(100, "write a checkpoint every N steps (0 = only at the end)")
    keep_checkpoints: int = opt(2, "checkpoints kept in the run folder (the newest ones)")
    early_stop_patience: int = opt(0, "stop after this many evaluations in a row without improvement of "
                                      "train.early_stop_metric, and end with the best evaluation's weights (0 = off)")
    early_stop_metric: Literal["val_loss", "val_accuracy"] = opt(
        "val_loss", "what early stopping watches: val_loss (lower is better) or val_accuracy (MQAR; higher is better)")
    early_stop_min_delta: float = opt(0.0, "an evaluation improves on the best only by more than this")
    freeze: list[str] = opt([], "parameters set to zero and never trained, by name pattern (fnmatch, e.g. "
                                "'blocks.*.attn.wqs.*': a window's scalar projections frozen at zero make every key "
                                "tie, so it reads its newest keys: a sliding window of the same keys and parameters)")

    tokens_per_step: int = field(init=False, default=0)  # derived in RunConfig: global tokens per optimizer step

    def __post_init__(self):
        check_fields(self, "train.")
        for name in ("steps", "batch_size", "grad_accum", "eval_batches", "log_every", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_every", "ckpt_every", "early_stop_patience"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ConfigError(f"train.lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps > self.steps:
            raise ConfigError(f"train.warmup_steps ({self.warmup_steps}) must be <= train.steps ({self.steps})")
        if self.weight_decay < 0 or self.grad_clip < 0 or not self.eps > 0:
            raise ConfigError("train.weight_decay and train.grad_clip must be >= 0 and train.eps > 0")
        if not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"train.betas must both be in [0, 1), got {self.betas}")
        if not self.early_stop_min_delta >= 0:
            raise ConfigError(f"train.early_stop_min_delta must be >= 0, got {self.early_stop_min_delta}")
        if self.early_stop_patience and not self.eval_every:
            raise ConfigError("train.early_stop_patience needs train.eval_every > 0: early stopping watches the "
                              "periodic evaluations")

    def compiles(self, device) -> bool:
        """Whether the model runs under torch.compile on `device` (train.compile, 'auto' resolved)."""
        return self.compile if isinstance(self.compile, bool) else torch.device(device).type == "cuda"

    def lr_at(self, step: int) -> float:
        """Learning rate for optimizer step `step` (0-based): linear warmup, then cosine to min_lr."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        decay_steps = max(1, self.steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        min_lr = self.lr * self.min_lr_ratio
        return min_lr + 0.5 * (self.lr - min_lr) * (1 + math.cos(math.pi * progress))


@dataclass
class RegularizersConfig:
    """Weights of the scalar-attention regularizers, L_reg = λa L_align + λs L_spread + λt L_tau + λkl L_kl
    (docs/mechanisms.md#regularizers).

    Layer records are gathered (`record=True`) only when some weight is nonzero."""

    align: float = opt(0.0, "λ_align: pull high-weight query/key pairs together in scalar space")
    spread: float = opt(0.0, "λ_spread: push sorted scalar keys toward uniform quantiles")
    tau: float = opt(0.0, "λ_tau: keep the temperature small (sum over heads of log(1 + τ))")
    kl_dense: float = opt(0.0, "λ_kl: KL from each hybrid head's dense q·k attention (detached) to the softmax of its "
                               "scalar kernel alone, on regularizers.kl_queries sampled query rows (how DSA trains its "
                               "indexer: teaches the scalar selection the keys a window never selected)")
    kl_queries: int = opt(64, "query rows per sequence that λ_kl samples (0 = every row; memory O(rows x T) per head)")
    spread_range: Literal["adaptive", "fixed"] = opt("adaptive", "L_spread targets over mean ± 3σ of the keys, or over [spread_low, spread_high]")
    spread_low: float = opt(-3.0, "lower end of the fixed L_spread range")
    spread_high: float = opt(3.0, "upper end of the fixed L_spread range")
    align_start: int = opt(0, "optimizer step at which λ_align switches on (0: from the start)")
    spread_start: int = opt(0, "optimizer step at which λ_spread switches on (e.g. after initial convergence)")
    tau_start: int = opt(0, "optimizer step at which λ_tau switches on")
    kl_dense_start: int = opt(0, "optimizer step at which λ_kl switches on")
    ramp: int = opt(0, "steps over which each weight rises linearly from 0 to its value after its start (0: at once)")

    def __post_init__(self):
        check_fields(self, "regularizers.")
        for name in ("align", "spread", "tau", "kl_dense", "kl_queries", "align_start", "spread_start", "tau_start",
                     "kl_dense_start", "ramp"):
            if getattr(self, name) < 0:
                raise ConfigError(f"regularizers.{name} must be >= 0, got {getattr(self, name)}")
        if not self.spread_low < self.spread_high:
            raise ConfigError(f"regularizers.spread_low ({self.spread_low}) must be < spread_high ({self.spread_high})")

    @property
    def active(self) -> bool:
        return self.align > 0 or self.spread > 0 or self.tau > 0 or self.kl_dense > 0

    def weights_at(self, step: int) -> dict[str, float]:
        """Each weight at optimizer step `step` (0-based): 0 before its start, then linear over `ramp` steps
        (kl_dense only when it is set)."""
        out = {}
        for name in ("align", "spread", "tau") + (("kl_dense",) if self.kl_dense else ()):
            since = step - getattr(self, f"{name}_start")
            frac = 0.0 if since < 0 else 1.0 if self.ramp == 0 else min(1.0, (since + 1) / self.ramp)
            out[name] = getattr(self, name) * frac
        return out


@dataclass
class RunSection:
    """Where the run lives and how it is driven."""

    name: str = opt("", "run name; the folder is out_dir/name ('' derives it from model.attn)")
    out_dir: str = opt("runs", "parent folder of run folders")
    seed: int = opt(0, "seed for model init, data order and every RNG")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "device ('auto': cuda when available, else cpu)")
    resume: bool = opt(False, "continue from the newest checkpoint in the run folder (a fresh start when there is none)")
    overwrite: bool = opt(False, "start afresh in a run folder that already holds logs or checkpoints, deleting them")
    threads: int = opt(0, "torch CPU threads (0 leaves the default)")
    parallel: Literal["ddp", "fsdp"] = opt("ddp", "data parallelism under torchrun: 'ddp' (every rank holds the whole "
                                                  "model) or 'fsdp' (FSDP2: parameters, gradients and optimizer state "
                                                  "sharded over the ranks, each decoder block gathered in turn)")
    nproc: int = opt(1, "processes per run when a sweep launches it as a cluster job (--launcher): N > 1 starts "
                        "torchrun --nproc_per_node=N inside the job (plain `attnlab train` uses torchrun itself)")
    progress: bool = opt(True, "show a progress bar with ETA")
    tensorboard: bool = opt(True, "also log to TensorBoard when torch.utils.tensorboard imports (only while "
                                  "run.logger is unset: a set run.logger is the whole list)")
    logger: Union[str, list[str]] = opt(
        "", f"where log rows go besides log.jsonl and the CSVs: {', '.join(map(repr, LOGGERS))}, several as a list "
            "or comma-separated, or 'none'; each must be installed (pip install 'attnlab[wandb]', ...). "
            "'' (unset) follows run.tensorboard")
    project: str = opt("", "the W&B project / MLflow experiment the run is logged under ('' takes $WANDB_PROJECT / "
                           "$MLFLOW_EXPERIMENT_NAME, else 'attnlab')")

    loggers: list[str] = field(init=False, default_factory=list)  # derived: the backends run.logger names

    def __post_init__(self):
        check_fields(self, "run.")
        if self.nproc < 1:
            raise ConfigError(f"run.nproc must be >= 1, got {self.nproc!r}")
        self.loggers = parse_loggers(self.logger)
        if "tensorboard" in self.loggers and not self.tensorboard:
            raise ConfigError("run.logger names 'tensorboard' but run.tensorboard is false; drop one of them "
                              "(run.logger, once set, decides alone: run.tensorboard=false is not needed)")

    @property
    def tensorboard_if_installed(self) -> bool:
        """run.tensorboard's meaning while run.logger is unset: TensorBoard when it imports, else nothing."""
        return self.tensorboard and isinstance(self.logger, str) and not self.logger.strip()


def parse_loggers(value: str | list[str], key: str = "run.logger") -> list[str]:
    """run.logger as a list of backend names: a name, a comma-separated string or a list; 'none' or []
    is none; '' (unset) is none as well (the caller decides what unset means)."""
    if isinstance(value, str) and not value.strip():
        return []
    names = [n.strip() for n in (value.split(",") if isinstance(value, str) else value)]
    if names in ([], ["none"]):
        return []
    for name in names:
        if name == "none":
            raise ConfigError(f"{key}: 'none' stands alone, got {value!r}")
        if name not in LOGGERS:
            raise ConfigError(f"{key} must name {', '.join(map(repr, LOGGERS))} (one, a list or comma-separated) "
                              f"or 'none', got {value!r}{did_you_mean(name, LOGGERS)}")
    return list(dict.fromkeys(names))


@dataclass
class RunConfig:
    """The whole configuration of one training run: the sections [model], [data], [train],
    [regularizers] and [run] of a config file, each a dataclass whose fields `attnlab train --help`
    lists. Derived: run_dir = run.out_dir / run.name, and model.max_seq_len = data.seq_len when unset.
    Build it with `load_config(path, overrides)`; a value that cannot work raises ConfigError naming
    the dotted key (a cosFormer horizon shorter than data.seq_len, a learned position table too short).
    """

    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "the language model"})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "corpus, tokenizer, packing"})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"help": "optimisation"})
    regularizers: RegularizersConfig = field(default_factory=RegularizersConfig, metadata={"help": "scalar-attention regularizers"})
    run: RunSection = field(default_factory=RunSection, metadata={"help": "run folder, seed, device"})

    run_dir: str = field(init=False, default="")  # derived: out_dir/name

    def __post_init__(self):
        check_fields(self, "")
        if self.model.max_seq_len == 0:
            self.model = dataclasses.replace(self.model, max_seq_len=self.data.seq_len)
        if self.model.pos_embedding == "learned" and self.model.max_seq_len < self.data.seq_len:
            raise ConfigError(
                f"model.max_seq_len ({self.model.max_seq_len}) must be >= data.seq_len ({self.data.seq_len}) "
                f"with model.pos_embedding='learned'"
            )
        for i, a in enumerate(self.model.attention_configs()):
            if a.horizon is not None and a.horizon < self.data.seq_len:
                raise ConfigError(
                    f"model.attention.cosformer_max_len of layer {i} is {a.horizon} (model.max_seq_len when "
                    f"unset), shorter than data.seq_len ({self.data.seq_len}); need a horizon >= data.seq_len"
                )
        if self.regularizers.active and not any(mechanism_class(n).scalar for n in self.model.layer_attn):
            raise ConfigError(
                f"regularizers act on scalar/hybrid heads but model.attn is {self.model.attn!r}: "
                f"set regularizers.align/spread/tau to 0 or use a scalar or hybrid layer"
            )
        if self.regularizers.kl_dense > 0 and not any(issubclass(mechanism_class(n), HybridAttention)
                                                      for n in self.model.layer_attn):
            raise ConfigError(
                f"regularizers.kl_dense teaches scalar keys from a head's own q·k, which only hybrid heads have; "
                f"model.attn is {self.model.attn!r}: set regularizers.kl_dense to 0 or use a hybrid layer"
            )
        if self.data.source == "mqar" and self.model.vocab_size < 2 * self.data.mqar_pairs + 2:
            raise ConfigError(
                f"model.vocab_size must be set to at least {2 * self.data.mqar_pairs + 2} for data.source='mqar' "
                f"(keys and values come from disjoint halves of it), got {self.model.vocab_size}"
            )
        if self.train.early_stop_patience and self.train.early_stop_metric == "val_accuracy" and self.data.source != "mqar":
            raise ConfigError("train.early_stop_metric='val_accuracy' needs data.source='mqar' (the only source "
                              "with an accuracy); use 'val_loss'")
        self.train.tokens_per_step = self.train.batch_size * self.train.grad_accum * self.data.seq_len
        name = self.run.name or "-".join(dict.fromkeys(self.model.layer_attn))
        self.run_dir = str(Path(self.run.out_dir) / name)

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary: model.vocab_size, or the tokenizer's when that is 0."""
        return self.model.vocab_size or self.data.tokenizer_vocab_size


# --------------------------------------------------------------------------- loading


def config_from_dict(raw: dict) -> RunConfig:
    """Validate a raw dict (as from TOML) into a RunConfig."""
    return build_dataclass(RunConfig, raw)


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a TOML file (or start from the defaults when path is None), apply dotted
    overrides, and validate everything. Raises ConfigError naming the offending key."""
    raw = read_toml(path) if path is not None else {}
    return config_from_dict(apply_overrides(raw, list(overrides or [])))


# --------------------------------------------------------------------------- dumping


def save_config(cfg: RunConfig, folder: str | os.PathLike) -> tuple[Path, Path]:
    """Write the resolved config as config.toml (reloadable) and config.json (with derived fields)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    toml_path, json_path = folder / "config.toml", folder / "config.json"
    atomic_write_text(toml_path, dumps_toml(to_dict(cfg)) + "\n")
    atomic_write_text(json_path, json.dumps(to_dict(cfg, derived=True), indent=2) + "\n")
    return toml_path, json_path

