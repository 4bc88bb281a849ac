"""`export_run(run_dir, out_dir)`: a trained attnlab run as a Hugging Face model folder.

    out_dir/  config.json  model.safetensors  generation_config.json
              tokenizer.json  tokenizer_config.json  (special_tokens_map.json, by version)

`import attnlab.hf` then `AutoModelForCausalLM.from_pretrained(out_dir)` and
`AutoTokenizer.from_pretrained(out_dir)` load it (no trust_remote_code). Before anything is
written, the run is checked (a folder with config.toml, a config attnlab accepts, an intact
checkpoint that fits it) and so is out_dir (absent or an empty folder): bad input is one
`ExportError` naming what is wrong. The folder is built in a hidden temporary sibling, checked
(the saved model, loaded back through transformers, gives the run's logits within 1e-6
relative), and renamed into place, so a failure at any point leaves no out_dir behind.

`write_folder` (that atomic, verified write) and `check_reload` (the logit comparison) also
serve attnlab.retrofit's `save`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import torch
from transformers.utils import logging as hf_logging

from attnlab.lock import FolderLock, check_free
from attnlab.testing import rel_rms


class ExportError(ValueError):
    """Bad input to `export_run` (no run, no checkpoint, a non-empty out_dir, ...): one line."""


def check_out_dir(out, name: str = "OUT_DIR", error=None, keep=(), hint: str = "") -> Path:
    """`out` as a Path; `error` (ExportError by default) naming `name` unless it is a new or empty
    folder (entries named in `keep` may be there); `hint` ends the not-empty message."""
    error = error or ExportError
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise error(f"{name} {str(out)!r} is a file; give a new or empty folder")
    if out.is_dir() and any(p.name not in keep for p in out.iterdir()):
        raise error(f"{name} {str(out)!r} is not empty; give a new or empty folder (nothing was written){hint}")
    return out


def _load_checked_run(run_dir: Path, checkpoint: str | None):
    """(cfg, model, tokenizer or None) of run_dir, each problem an ExportError."""
    from attnlab.models.config import ConfigError, format_changes, model_config_changes
    from attnlab.train.checkpoint import CheckpointError, find_checkpoint, load_checkpoint, verify_checkpoint
    from attnlab.train.config import load_config
    from attnlab.train.trainer import CKPT_DIR, build_model

    if not run_dir.is_dir():
        raise ExportError(f"RUN_DIR {str(run_dir)!r} is not a folder; give a run folder written by attnlab train")
    if not (run_dir / "config.toml").is_file():
        raise ExportError(f"RUN_DIR {str(run_dir)!r} has no config.toml: not a run folder (train it with attnlab train)")
    where = [f"run.out_dir={json.dumps(str(run_dir.resolve().parent))}", f"run.name={json.dumps(run_dir.resolve().name)}"]
    try:
        cfg = load_config(run_dir / "config.toml", where)
    except (ConfigError, ValueError) as e:
        raise ExportError(f"{str(run_dir / 'config.toml')!r}: {e}") from None
    try:
        ckpt = find_checkpoint(Path(checkpoint) if checkpoint else run_dir / CKPT_DIR)
        state = verify_checkpoint(ckpt)
    except FileNotFoundError:
        raise ExportError(f"no checkpoint in {str(Path(checkpoint) if checkpoint else run_dir / CKPT_DIR)!r}: "
                          f"train the run first") from None
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    saved = (state.get("config") or {}).get("model")
    if isinstance(saved, dict):
        changes = model_config_changes(saved, cfg.model, ignore=() if cfg.model.vocab_size else ("vocab_size",))
        if changes:
            raise ExportError(f"checkpoint {str(ckpt)!r} was trained with another model config than "
                              f"{str(run_dir / 'config.toml')!r}: {format_changes(changes)}")
    if not cfg.model.vocab_size:
        raise ExportError(f"{str(run_dir / 'config.toml')!r} has no resolved model.vocab_size; export the run folder "
                          f"that attnlab train wrote")
    try:
        model = build_model(cfg, cfg.model.vocab_size)
        load_checkpoint(ckpt, model)
    except (ValueError, RuntimeError, KeyError) as e:
        raise ExportError(f"checkpoint {str(ckpt)!r} does not load into the run's model: {e}") from None
    tokenizer = None
    if cfg.data.source != "mqar":
        from attnlab.train.data import data_tokenizer

        tokenizer = data_tokenizer(cfg.data)
    return cfg, model.eval(), tokenizer


def save_folder(model, folder: Path, tokenizer=None, window: int | None = None) -> None:
    """Write attnlab LM `model` (and its attnlab tokenizer) into `folder` as a transformers folder."""
    from transformers import GenerationConfig

    from .configuration import AttnlabConfig
    from .modeling import AttnlabForCausalLM
    from .tokenizer import hf_tokenizer

    eos = getattr(tokenizer, "eos_id", None)
    tok_ids = {"eos_token_id": eos, "pad_token_id": eos, "bos_token_id": None}
    config = AttnlabConfig.from_model_config(model.cfg, window=window, **tok_ids)
    hf = AttnlabForCausalLM(config)
    hf.model.load_state_dict(model.state_dict())
    hf.generation_config = GenerationConfig(**tok_ids)
    hf.save_pretrained(folder)
    if tokenizer is not None:
        hf_tokenizer(tokenizer, model.cfg.max_seq_len or None).save_pretrained(folder)


def check_folder(model, folder: Path, rtol: float = 1e-6) -> None:
    """The folder, loaded back through transformers, gives `model`'s logits within rtol (relative RMS)."""
    T = min(16, model.cfg.max_seq_len or 16)
    idx = torch.randint(model.cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(idx.to(next(model.parameters()).device))[0]
    check_reload(folder, idx, want, rtol, "the run")


def check_reload(folder: Path, idx: torch.Tensor, want: torch.Tensor, rtol: float, what: str) -> None:
    """Load `folder` back as AttnlabForCausalLM and compare its logits on token ids `idx` with `want`,
    those of the model that was written: RuntimeError naming `what` when their relative RMS error
    (attnlab.testing.rel_rms) exceeds rtol. The reloaded model runs on the device of `want` (the same
    kernels as the model that was written: a CPU reload against CUDA logits would compare two
    implementations), with idx moved there."""
    from .modeling import AttnlabForCausalLM

    loaded = AttnlabForCausalLM.from_pretrained(folder).eval().to(want.device)
    with torch.no_grad():
        got = loaded(idx.to(want.device)).logits
    err = rel_rms(got, want, floor=1e-30)
    if not err <= rtol:
        raise RuntimeError(f"the saved model's logits differ from {what}'s by {err:.2e} relative (> {rtol}); "
                           f"nothing was written")


def write_folder(out: Path, write: Callable[[Path], None], verify: Callable[[Path], None],
                 recheck: Callable[[Path], object] | None = None, keep: Sequence[str] = ()) -> Path:
    """Write the folder `out` atomically and verified; returns `out`.

    Under `FolderLock(out, beside=True)` (FolderBusy before any work when another process holds it)
    `recheck(out)` runs again, `write(tmp)` fills a hidden temporary sibling, `verify(tmp)` checks it
    (e.g. `check_reload`), and tmp is renamed onto `out`, which must be absent or empty apart from
    `keep`: subfolders of `out` (the checkpoints of an interrupted run) that are moved into tmp for
    the rename and deleted once the folder is in place. Any failure removes tmp, puts `keep` back in
    `out` and re-raises, so no half-written `out` is left."""
    check_free(out, beside=True)
    with FolderLock(out, beside=True):  # the lock file sits beside out, which must stay empty
        if recheck is not None:
            recheck(out)  # again, under the lock
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # transformers' per-shard bars say nothing for one small file
        try:
            write(tmp)
            verify(tmp)
            for d in keep:
                if (out / d).is_dir():
                    os.replace(out / d, tmp / d)
            os.replace(tmp, out)  # atomic; replaces an empty out
            for d in keep:
                shutil.rmtree(out / d, ignore_errors=True)
        except BaseException:
            for d in keep:
                if (tmp / d).is_dir() and out.is_dir() and not (out / d).exists():
                    os.replace(tmp / d, out / d)  # keep the checkpoints for a rerun
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            if bars:
                hf_logging.enable_progress_bar()
    return out


def export_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike, *, checkpoint: str | None = None,
               window: int | None = None) -> Path:
    """Write run_dir's newest checkpoint (or `checkpoint`) into out_dir as a Hugging Face folder;
    returns out_dir. window: the default decode window `generate` uses (config.json's `window`).

    The folder holds config.json, model.safetensors, generation_config.json and the tokenizer; it
    is built beside out_dir, loaded back through transformers to compare logits, then renamed into
    place. Raises ExportError (nothing written) when run_dir is not a run folder, its checkpoint is
    missing, damaged or does not match its config, out_dir is a file or not empty, or `window` is
    given for a run without scalar/hybrid layers; FolderBusy when another export writes out_dir;
    RuntimeError when the reloaded model's logits differ by more than 1e-6 relative."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ExportError(f"window must be an int >= 1 or None, got {window!r}")
    check_out_dir(out_dir)
    cfg, model, tokenizer = _load_checked_run(run_dir, checkpoint)
    if window is not None and not any(blk.attn.n_scalar for blk in model.blocks):
        raise ExportError(f"window={window} is for scalar/hybrid layers; this run has none ({cfg.model.layer_attn})")
    return write_folder(out_dir, lambda tmp: save_folder(model, tmp, tokenizer, window),
                        lambda tmp: check_folder(model, tmp), recheck=check_out_dir)

