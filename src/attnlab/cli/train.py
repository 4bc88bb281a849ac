"""`attnlab train` and `attnlab quickstart`: validate everything, then call the trainer."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from ._common import UsageError, check_model_builds, positive_options, print_table, split_config_args


def _train_cfg(ns):
    from attnlab.lock import check_free
    from attnlab.train.checkpoint import CheckpointError, latest_checkpoint
    from attnlab.train.config import load_config
    from attnlab.train.resume import CKPT_DIR, ResumeError, check_resume

    path, overrides = split_config_args(ns.args)
    if ns.run_dir:
        run_dir = Path(ns.run_dir)
        if not run_dir.name:
            raise UsageError(f"--run-dir must name a folder, got {ns.run_dir!r}")
        overrides += [f"run.out_dir={json.dumps(str(run_dir.parent))}", f"run.name={json.dumps(run_dir.name)}"]
    if ns.resume:
        overrides.append("run.resume=true")
    cfg = load_config(path, overrides)
    run_dir = Path(cfg.run_dir)
    check_free(run_dir)  # another process writing this run folder: FolderBusy, exit 2, before anything
    has_state = (run_dir / "log.jsonl").exists() or latest_checkpoint(run_dir / CKPT_DIR) is not None
    if has_state and not (cfg.run.resume or cfg.run.overwrite):
        raise UsageError(
            f"run folder {str(run_dir)!r} already holds a run: add --resume to continue it, run.overwrite=true to "
            f"start afresh there, or --run-dir / run.name to choose another folder"
        )
    if cfg.run.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("run.device is 'cuda' but no CUDA device is available; allowed here: 'auto', 'cpu'")
    if cfg.model.vocab_size and cfg.data.source != "mqar":
        need = cfg.data.tokenizer_vocab_size
        if cfg.model.vocab_size < need:
            raise UsageError(
                f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the {cfg.data.tokenizer} tokenizer's "
                f"vocabulary ({need}); allowed: 0 (take the tokenizer's) or >= {need}"
            )
    check_model_builds(cfg)
    if cfg.run.resume:
        try:
            check_resume(cfg)
        except (CheckpointError, ResumeError) as e:
            raise UsageError(str(e)) from None
    return cfg


def cmd_train(ns) -> int:
    cfg = _train_cfg(ns)
    from attnlab.train import train
    from attnlab.train.trainer import DataError

    try:
        summary = train(cfg)
    except (DataError, FileExistsError) as e:  # raised before the run folder is created or changed
        raise UsageError(str(e)) from None
    if int(os.environ.get("RANK", 0)) == 0:
        taus = [f"{t:.4g}" for t in summary["tau"] if t is not None]
        print(f"trained {summary['run_dir']}")
        print_table({
            "steps": summary["steps"],
            "val loss": f"{summary['val_loss']:.4f}",
            "val ppl": f"{summary['val_ppl']:.2f}",
            **({"val accuracy": f"{summary['val_accuracy']:.4f}"} if "val_accuracy" in summary else {}),
            "tokens/s": f"{summary['tokens_per_s']:,.0f}" if summary.get("tokens_per_s") else "—",
            "τ per layer": " / ".join(taus) if taus else "—",
        })
        print(f"next: attnlab eval {summary['run_dir']}")
    return 0



def cmd_quickstart(ns) -> int:
    from attnlab.experiments.quickstart import quickstart_configs, run

    if ns.steps is not None and ns.minutes is not None:
        raise UsageError("attnlab quickstart: give --steps or --minutes, not both")
    positive_options(ns, "steps", "eval_tokens")
    if ns.minutes is not None and not (math.isfinite(ns.minutes) and ns.minutes > 0):
        raise UsageError(f"--minutes must be a finite number > 0, got {ns.minutes}")
    mechanisms = [m.strip() for m in ns.mechanisms.split(",") if m.strip()]
    stray = [a for a in ns.overrides if "=" not in a]
    if stray:
        raise UsageError(f"expected section.key=value overrides, got {stray[0]!r}")
    for cfg in quickstart_configs(ns.out, steps=ns.steps, mechanisms=mechanisms, overrides=ns.overrides):  # validate first
        check_model_builds(cfg, f"{cfg.model.attn}: ")
    run(ns.out, steps=ns.steps, minutes=ns.minutes, mechanisms=mechanisms, overrides=ns.overrides,
        eval_tokens=ns.eval_tokens, progress=not ns.no_progress, command=ns.command_line)
    return 0
