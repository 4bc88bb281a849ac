"""The training loop: `train(cfg) -> summary`.

AdamW with linear warmup and cosine decay, gradient clipping, optional bf16 autocast,
gradient accumulation, periodic evaluation, the scalar-attention regularizers weighted
from the config, logs (JSONL, CSV and run.logger's TensorBoard / W&B / MLflow; each row with loss,
lr, grad norm, tokens/s, MFU and peak memory), a progress bar, atomic
checkpoints and exact resume, and data parallelism when launched by torchrun.

Exact resume: a run's losses are a function of (config, seed) alone. Every batch is a
pure function of (seed, step); the checkpoint holds the model, the AdamW moments, the
data position and every RNG state; the learning rate is a function of the step. So a run
killed at any moment and resumed from its last checkpoint logs, step for step, the same
losses as a run that was never interrupted (bit for bit on the same machine and thread count).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from attnlab.data.cache import atomic_write_text
from attnlab.interrupt import Interrupted, graceful, requested
from attnlab.lock import FolderLock
from attnlab.models.config import ConfigError
from attnlab.checks import async_value_checks
from attnlab.regularizers import regularization

from . import ddp
from .checkpoint import capture_rng, checkpoint_name, latest_checkpoint, read_state, restore_rng, save_checkpoint
from .config import RunConfig, load_config, save_config, to_dict
from .resume import CKPT_DIR, check_same_model
from .data import RunData, build_data, record_tokenizer
from .early_stop import EarlyStopping
from .loggers import check_loggers
from .logging import RunLogger, ordered, read_log
from .run_folder import check_run_dir, prepare_run_dir
from .stats import attention_stats
from .throughput import Throughput
from .validation import validation_metrics
from .setup import (DataError, allow_tf32, autocast, build_model, compile_model,  # noqa: F401
                    has_unused_parameters, make_optimizer, resolve_device, seed_everything, to_device)


class Trainer:
    """One run: build everything from the config, then `fit()`. Construction checks the run folder
    (FileExistsError when it holds a run and neither run.resume nor run.overwrite is set), loads the
    data (DataError), builds model and optimizer, takes the folder's lock (FolderBusy) and, with
    run.resume, restores the newest checkpoint exactly; `close()` releases the folder."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.env = ddp.init_distributed(resolve_device(cfg.run.device))
        self.device = ddp.rank_device(resolve_device(cfg.run.device), self.env)
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_dir = self.run_dir / CKPT_DIR
        check_run_dir(self.run_dir, cfg.run.resume, cfg.run.overwrite)
        check_loggers(cfg.run.loggers)  # a backend that is not installed: named, before any folder exists
        seed_everything(cfg.run.seed)
        try:
            self.data: RunData = build_data(cfg, self.env)
        except (ValueError, OSError) as e:  # a source that cannot be read: named, before any folder exists
            raise DataError(f"data.source={cfg.data.source!r} could not be loaded: {e}") from e
        self.model = build_model(cfg, self.data.vocab_size).to(self.device)
        if cfg.train.compiles(self.device) and cfg.data.pack == "documents" and not self.model.takes_documents(self.device):
            raise ConfigError(f"train.compile with data.pack='documents': {self.model.not_taking(self.device)} "
                              f"re-pads packed documents into single ones, which needs their lengths on the host and "
                              f"cannot be compiled; set train.compile=false or data.pack='stream'")
        allow_tf32(self.device, cfg.train.tf32)
        # only now, so a run that cannot start leaves nothing on disk; one writer per run folder
        self._lock = FolderLock(self.run_dir).acquire() if self.env.is_main else None
        try:
            # again, under the lock: another run may have finished here meanwhile
            check_run_dir(self.run_dir, cfg.run.resume, cfg.run.overwrite)
            prepare_run_dir(self.run_dir, cfg.run.resume, self.env)
        except BaseException:
            self.close()
            raise
        self.cfg = cfg = dataclasses.replace(cfg, model=self.model.cfg)  # vocab_size resolved
        if self.env.is_main:  # a tokenizer file: copied into the run folder, which data.tokenizer then names
            self.cfg = cfg = record_tokenizer(cfg, self.data.tokenizer)
        self.throughput = Throughput(self.model, cfg.data.seq_len, self.device, self.env.world_size)
        unused = self.env.distributed and cfg.run.parallel == "ddp" and has_unused_parameters(self.model, self.device)
        self.ddp_model = ddp.wrap_model(self.model, self.env, find_unused_parameters=unused, parallel=cfg.run.parallel)
        self.sharded = ddp.is_sharded(self.model)  # FSDP: self.model is sharded in place, self.ddp_model is it
        self._replica = None  # sharded runs: an unsharded CPU copy that checkpoints pass through
        self.optimizer = make_optimizer(self.model, cfg.train, self.device)  # after sharding: FSDP's parameters
        if cfg.train.compiles(self.device):  # checkpoints, evaluation and resume keep using the plain module
            self.ddp_model = compile_model(self.ddp_model, self.device)
        self.logger = RunLogger(self.run_dir, enabled=self.env.is_main, tensorboard=cfg.run.tensorboard_if_installed,
                                loggers=cfg.run.loggers, meta={"title": str(self.run_dir), "project": cfg.run.project,
                                                               "config": to_dict(cfg)})
        self.step = 0  # optimizer steps completed
        t = cfg.train
        self.early = EarlyStopping(t.early_stop_patience, t.early_stop_metric, t.early_stop_min_delta)
        if cfg.run.resume:
            self._resume()
        if self.env.is_main:
            save_config(cfg, self.run_dir)

    # ------------------------------------------------------------------ setup

    def close(self) -> None:
        """Release the run folder (locked since construction); backends still open (it raised) mark their run failed."""
        if getattr(self, "logger", None) is not None:
            self.logger.close("failed")
        if getattr(self, "_lock", None) is not None:
            self._lock.release()

    def release(self) -> None:
        """Drop the DDP wrapper (its reducer) while the process group still exists: see
        `ddp.shutdown` for why it must go first."""
        if getattr(self, "ddp_model", None) is not None and self.ddp_model is not self.model:
            self.ddp_model = self.model
            gc.collect()

    def _resume(self) -> None:
        path = latest_checkpoint(self.ckpt_dir)
        if path is None:
            return  # nothing to resume: a fresh start
        check_same_model(self.cfg, path, read_state(path))  # before a tensor is read into this model
        state = ddp.load_into(self.model, self.optimizer, path, self.device, self.replica() if self.sharded else None)
        self.data.train.load_state_dict(state["data"])
        self.step = int(state["step"])
        if self.early.active and "early_stop" in state:
            self.early.load_state_dict(state["early_stop"])
        restore_rng(state["rng"])
        self.logger.truncate_after(self.step)
        self._resumed_from = str(path)

    def replica(self) -> torch.nn.Module:
        """A sharded run's unsharded CPU copy of the model (built once; the global RNG is untouched, so
        the run draws what an unsharded run draws)."""
        if self._replica is None:
            with torch.random.fork_rng(devices=[]):
                self._replica = build_model(self.cfg, self.data.vocab_size)
        return self._replica

    # ------------------------------------------------------------------ one step

    def _is_log_row(self, step: int) -> bool:
        done = step + 1
        return done % self.cfg.train.log_every == 0 or done == self.cfg.train.steps

    def _needs_record(self, step: int) -> bool:
        return self.cfg.regularizers.active or self._is_log_row(step)

    def train_step(self) -> dict:
        """One optimizer step over grad_accum micro-batches; returns this rank's scalars as device tensors
        (lr a float): nothing in the step waits for the device; the loop reads them at its log rows."""
        cfg, model = self.cfg, self.ddp_model
        lr = cfg.train.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        record = self._needs_record(self.step)
        reg_w = cfg.regularizers.weights_at(self.step)  # delayed starts and ramps
        spread_target = "adaptive" if cfg.regularizers.spread_range == "adaptive" else (
            cfg.regularizers.spread_low, cfg.regularizers.spread_high)
        accum = cfg.train.grad_accum
        lm_loss, reg_parts = torch.zeros((), device=self.device), {}  # summed on device: one sync per step
        model.train()
        for micro in range(accum):
            batch = next(self.data.train)
            x, y = to_device(batch.x, self.device), to_device(batch.y, self.device)
            doc_ids = None if batch.cross_doc else to_device(batch.doc_ids, self.device)
            with ddp.no_sync(model, micro < accum - 1):
                with autocast(self.device, cfg.train.dtype):
                    _, loss = model(x, y, record=record, doc_ids=doc_ids)
                total = loss
                if cfg.regularizers.active:
                    layers = self.model.attention_layers()
                    with async_value_checks():  # on an accelerator its input checks are device-side asserts: no sync
                        reg = regularization([a.last for a in layers], reg_w, spread_target=spread_target,
                                             kl_queries=cfg.regularizers.kl_queries or None,
                                             kernels=[getattr(a.config, "kernel", "gaussian") for a in layers])
                    total = total + reg["total"]
                    for k, v in reg.items():
                        reg_parts[k] = reg_parts.get(k, 0.0) + v.detach().float() / accum
                (total / accum).backward()
            lm_loss += loss.detach().float() / accum
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
        grad_norm = ddp.local(torch.nn.utils.clip_grad_norm_(params, max_norm).detach())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        out = {"loss": lm_loss, "grad_norm": grad_norm, "lr": lr}
        out.update({f"reg_{k}": v for k, v in reg_parts.items()})
        if record and self._is_log_row(self.step - 1):  # per-layer τ / gate statistics read values: log rows only
            out["layers"] = attention_stats(self.model.attention_layers())
        return out

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, max_batches: int | None = None) -> dict:
        """Mean token loss over the validation batches (all ranks), its perplexity, and for
        MQAR the accuracy at the query positions (`validation_metrics`)."""
        return validation_metrics(self.model, self.data.val(max_batches or self.cfg.train.eval_batches), self.device,
                                  self.cfg.train.dtype, self.env, accuracy=self.cfg.data.source == "mqar")

    # ------------------------------------------------------------------ checkpoints

    def save(self) -> None:
        """Write a checkpoint of the current step atomically (model, optimizer, data position,
        schedule, RNG states); on the main process only, keeping the newest train.keep_checkpoints.
        A sharded run gathers the full weights and optimizer state first (every rank takes part)."""
        model, optimizer = ddp.gather_state(self.model, self.optimizer, self.replica() if self.sharded else None)
        if not self.env.is_main:
            return
        state = {
            "data": self.data.train.state_dict(),
            "scheduler": {"kind": "warmup_cosine", "step": self.step, "lr": self.cfg.train.lr_at(self.step)},
            "rng": capture_rng(),
            "config": to_dict(self.cfg),
            "world_size": self.env.world_size,
        }
        if self.early.active:
            state["early_stop"] = self.early.state_dict()
        save_checkpoint(self.ckpt_dir, self.step, model, optimizer, state, keep=self.cfg.train.keep_checkpoints)

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict:
        """Train to train.steps (from the resumed step), evaluating every train.eval_every steps and
        checkpointing every train.ckpt_every; returns the summary `train` returns and writes it to
        run_dir/summary.json. On SIGINT/SIGTERM the current step finishes, a checkpoint is written
        and `attnlab.interrupt.Interrupted` is raised with the command that resumes."""
        cfg, t_cfg = self.cfg, self.cfg.train
        main = self.env.is_main
        if main and cfg.run.progress:
            tqdm.write(f"{self.run_dir}: {self.model.num_params():,} parameters; {self.data.description}")
        bar = tqdm(total=t_cfg.steps, initial=self.step, disable=not (main and cfg.run.progress),
                   desc=self.run_dir.name, dynamic_ncols=True, unit="step")
        self.logger.open()
        with graceful():
            last_eval = self._loop(bar)
        bar.close()
        if last_eval is None:  # resumed at the end: nothing left to train
            last_eval = dict(self.early.best_eval) if self.early.ended else {"step": self.step, **self.evaluate()}
        summary = self._summary(last_eval, self.throughput.tokens, self.throughput.seconds)
        if main:
            atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")
        self.logger.close()
        return summary

    def _stop_requested(self) -> int | None:
        """The signal that asked this run to stop, agreed by every rank (the highest number any saw)."""
        signum = requested() or 0
        if self.env.distributed:
            signum = int(ddp.max_over_ranks(signum, self.env))
        return signum or None

    def _loop(self, bar) -> dict | None:
        """Train to train.steps; on SIGINT/SIGTERM finish the step, checkpoint and raise Interrupted."""
        cfg, t_cfg, main = self.cfg, self.cfg.train, self.env.is_main
        last_eval = None
        while self.step < t_cfg.steps and not self.early.ended:
            t0 = time.perf_counter()
            row = self.train_step()
            log = self.step % t_cfg.log_every == 0 or self.step == t_cfg.steps
            if log:  # read the step's scalars (the one wait on the device per log window) before the clock
                row.update({k: float(v) for k, v in row.items() if isinstance(v, torch.Tensor)})
            dt = time.perf_counter() - t0
            self.throughput.add(dt, t_cfg.tokens_per_step)
            bar.update(1)
            if log:
                loss, *regs = ddp.mean_over_ranks([row["loss"]] + [row[k] for k in sorted(row) if k.startswith("reg_")], self.env)
                row.update({"loss": loss, **dict(zip(sorted(k for k in row if k.startswith("reg_")), regs))})
                row.update(step=self.step, ppl=math.exp(min(loss, 50.0)), tokens=self.step * t_cfg.tokens_per_step,
                           **self.throughput.row())  # tokens/s, MFU and peak memory since the last row
                self.logger.log("train", ordered(row))
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
            if (t_cfg.eval_every and self.step % t_cfg.eval_every == 0) or self.step == t_cfg.steps:
                last_eval = {"step": self.step, **self.evaluate()}
                self.logger.log("eval", last_eval)
                if main and cfg.run.progress:
                    tqdm.write(f"step {self.step}: val loss {last_eval['val_loss']:.4f}, ppl {last_eval['val_ppl']:.2f}")
                if self.early.active:
                    last_eval = self._watch(last_eval)
            if self.early.ended:
                break
            if (t_cfg.ckpt_every and self.step % t_cfg.ckpt_every == 0) or self.step == t_cfg.steps:
                self.save()
            # Ranks agree on a stop request through a collective (a host sync): on log rows only.
            signum = self._stop_requested() if log or not self.env.distributed else None
            if signum is not None and self.step < t_cfg.steps:
                self.save()
                bar.close()
                self.logger.close("killed")
                raise Interrupted(signum, f"{self.run_dir} stopped after step {self.step} of {t_cfg.steps}; "
                                          f"checkpoint {self.ckpt_dir / checkpoint_name(self.step)} saved")
        return last_eval

    def _watch(self, row: dict) -> dict:
        """Early stopping after an evaluation: keep the best weights; at the end (patience spent or
        the last step) restore them and save them as the final checkpoint. Returns the evaluation
        the run reports: this one, or at the end the best one."""
        improved, stop = self.early.update(row)
        if improved:
            model, _ = ddp.gather_state(self.model, None, self.replica() if self.sharded else None)
            if self.env.is_main:
                self.early.save_best(self.ckpt_dir, model)
        if not (stop or self.step >= self.cfg.train.steps):
            return row
        ddp.barrier(self.env)  # the best checkpoint is on disk before any rank reads it
        self.early.restore_best(self.ckpt_dir, self.model, self.device, self.replica() if self.sharded else None)
        self.early.ended = True
        self.save()
        if self.env.is_main and self.cfg.run.progress:
            tqdm.write(f"early stopping at step {self.step}: the best {self.early.metric} "
                       f"{self.early.best:.4f} was at step {self.early.best_step}; its weights are the run's")
        return dict(self.early.best_eval)

    def _summary(self, last_eval: dict, tokens: int, seconds: float) -> dict:
        history = read_log(self.run_dir) if self.env.is_main else []
        train_rows = [r for r in history if r.get("kind") == "train"]
        layers = self._final_layer_stats()
        return {
            "run_dir": str(self.run_dir),
            "attn": self.cfg.model.layer_attn,
            "params": self.model.num_params(),
            "steps": self.step,
            "val_loss": last_eval["val_loss"],
            "val_ppl": last_eval["val_ppl"],
            **({"val_accuracy": last_eval["val_accuracy"]} if "val_accuracy" in last_eval else {}),
            "train_loss": train_rows[-1]["loss"] if train_rows else None,
            "tokens_per_s": tokens / seconds if seconds > 0 else None,
            "train_seconds": seconds,
            "tau": [layer.get("tau_mean") for layer in layers],
            "layers": layers,
            "resumed_from": getattr(self, "_resumed_from", None),
            **({"stopped_at": self.step, "best_step": self.early.best_step,
                "early_stop": {"metric": self.early.metric, "best": self.early.best}} if self.early.active else {}),
            "history": {
                "train": train_rows,
                "eval": [r for r in history if r.get("kind") == "eval"],
            },
        }

    @torch.no_grad()
    def _final_layer_stats(self) -> list[dict]:
        """τ and gate statistics of every layer on one validation batch."""
        batch = next(iter(self.data.val(1)))
        self.model.eval()
        self.model(batch.x.to(self.device), record=True)
        self.model.train()
        return attention_stats(self.model.attention_layers())


def train(cfg: RunConfig | str | os.PathLike, overrides: list[str] | None = None) -> dict:
    """Train one run and return its summary (also written to run_dir/summary.json).

    `cfg` is a RunConfig, or a TOML path loaded with the dotted `overrides`. The summary holds
    run_dir, attn, params, steps, val_loss, val_ppl, train_loss, tokens_per_s, train_seconds, τ per
    layer and resumed_from. Raises ConfigError for a bad config (naming the key), ValueError when
    overrides come with a RunConfig, FileExistsError when the run folder already holds a run and
    neither run.resume nor run.overwrite is set, FolderBusy when another process writes it.
    SIGINT/SIGTERM stop it after the current step with a checkpoint (`attnlab.interrupt`)."""
    if not isinstance(cfg, RunConfig):
        cfg = load_config(cfg, overrides)
    elif overrides:
        raise ValueError("overrides are only applied to a config path; pass a RunConfig already resolved, or a path")
    try:
        trainer = Trainer(cfg)
    except BaseException:  # e.g. a busy run folder: every rank refuses alike; leave the group it joined
        ddp.shutdown(ddp.env_from_environment(), synchronize=False)
        raise
    together = False  # every rank reached the end, or the same agreed stop: they can meet at a barrier
    try:
        summary = trainer.fit()
        together = True
        return summary
    except Interrupted:
        together = True
        raise
    finally:
        trainer.close()
        trainer.release()
        ddp.shutdown(trainer.env, synchronize=together)
