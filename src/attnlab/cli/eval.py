"""`attnlab eval`: check the run, the checkpoint and the requested measurements, then evaluate."""

from __future__ import annotations

import json
from pathlib import Path

from ._common import UsageError, float_list, int_list, positive_options


def _check_eval_checkpoint(cfg, checkpoint: str | None) -> None:
    """The checkpoint that eval will load is intact and fits the (possibly overridden) config."""
    from attnlab.models.config import format_changes, model_config_changes
    from attnlab.train.checkpoint import CheckpointError, find_checkpoint, verify_checkpoint
    from attnlab.train.trainer import CKPT_DIR

    where = Path(checkpoint) if checkpoint else Path(cfg.run_dir) / CKPT_DIR
    try:
        path = find_checkpoint(where)
    except FileNotFoundError:
        if checkpoint:
            raise UsageError(f"--checkpoint {checkpoint!r} is neither a checkpoint folder (model.safetensors + "
                             f"state.json) nor a folder of checkpoints holding one") from None
        raise UsageError(f"no checkpoint in {str(where)!r}: train the run first") from None
    try:
        state = verify_checkpoint(path)
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    saved = (state.get("config") or {}).get("model")
    if isinstance(saved, dict):
        changes = model_config_changes(saved, cfg.model, ignore=() if cfg.model.vocab_size else ("vocab_size",))
        if changes:
            raise UsageError(f"checkpoint {str(path)!r} was trained with another model config: {format_changes(changes)}; "
                             f"drop the model.* overrides that change it")


def _eval_plan(ns) -> dict:
    from attnlab.train.config import load_config

    target = Path(ns.target)
    if not target.exists():
        raise UsageError(f"RUN_DIR_OR_CONFIG {ns.target!r} does not exist; give a run folder or the TOML config of a trained run")
    overrides = list(ns.overrides)
    stray = [a for a in overrides if "=" not in a]
    if stray:
        raise UsageError(f"expected section.key=value overrides after RUN_DIR_OR_CONFIG, got {stray[0]!r}")
    if target.is_dir():
        if not (target / "config.toml").is_file():
            raise UsageError(f"{ns.target!r} is not a run folder: it has no config.toml (train it with attnlab train)")
        # the folder as given, wherever it was trained: the run is found where it now lies
        overrides += [f"run.out_dir={json.dumps(str(target.resolve().parent))}", f"run.name={json.dumps(target.resolve().name)}"]
        cfg = load_config(target / "config.toml", overrides)
        source = target
    else:
        cfg = load_config(target, overrides)
        source = Path(cfg.run_dir)
        if not (source / "config.toml").is_file():
            raise UsageError(f"the run folder of {ns.target!r}, {str(source)!r}, holds no trained run; train it first")
        cfg = load_config(source / "config.toml", overrides)
    if ns.checkpoint and not Path(ns.checkpoint).exists():
        raise UsageError(f"--checkpoint {ns.checkpoint!r} does not exist")
    positive_options(ns, "max_tokens", "batch_size", "analysis_len", "analysis_batch")
    seq_lens = int_list(ns.seq_lens, "--seq-lens") if ns.seq_lens else [cfg.data.seq_len]
    if cfg.model.pos_embedding == "learned" and max(seq_lens) > cfg.model.max_seq_len:
        raise UsageError(
            f"--seq-lens: {max(seq_lens)} exceeds model.max_seq_len={cfg.model.max_seq_len} of this run's learned "
            f"position embedding; allowed: lengths <= {cfg.model.max_seq_len}"
        )
    passkey = int_list(ns.passkey, "--passkey") if ns.passkey else None
    windows = int_list(ns.windows, "--windows") if ns.windows else None
    lengths = int_list(ns.lengths, "--lengths") if ns.lengths else None
    budgets = int_list(ns.budgets, "--budgets") if ns.budgets else None
    compress = float_list(ns.compress, "--compress", 0.0, 1e6) if ns.compress else None
    _check_decode_options(cfg, windows, budgets, compress)
    if budgets:  # a cap on the sorted cache that no evaluated context reaches measures the uncapped cache again
        longest = max([*seq_lens, *(lengths or [])])
        useless = [M for M in budgets if M >= longest]
        if useless:
            raise UsageError(f"--budgets {','.join(map(str, useless))}: a cache capped at M keys per head changes "
                             f"nothing when no context is longer than M; the longest length evaluated here is "
                             f"{longest} (--seq-lens / --lengths): give budgets below it")
    if lengths and cfg.model.pos_embedding == "learned" and max(lengths) > cfg.model.max_seq_len:
        raise UsageError(f"--lengths: {max(lengths)} exceeds model.max_seq_len={cfg.model.max_seq_len} of this run's "
                         f"learned position embedding; allowed: lengths <= {cfg.model.max_seq_len}")
    horizons = [a.horizon for a in cfg.model.attention_configs() if a.horizon is not None]
    for option, Ls in (("--seq-lens", seq_lens), ("--passkey", passkey or []), ("--lengths", lengths or [])):
        if horizons and Ls and max(Ls) > min(horizons):
            raise UsageError(
                f"{option}: {max(Ls)} exceeds model.attention.cosformer_max_len={min(horizons)}, the horizon of "
                f"this run's cosformer layers; allowed: lengths <= {min(horizons)}"
            )
    depths = tuple(float_list(ns.passkey_depths, "--passkey-depths", 0.0, 1.0))
    if passkey and cfg.data.source == "mqar":
        raise UsageError("--passkey needs a text model; this run trains on data.source='mqar' (it reports MQAR accuracy)")
    if passkey:
        _check_passkey_lengths(cfg, passkey, depths)
    if ns.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available; allowed here: auto, cpu")
    _check_eval_checkpoint(cfg, ns.checkpoint)  # last: it reads (hashes) the checkpoint files
    return {
        "source": source, "overrides": overrides, "checkpoint": ns.checkpoint, "split": ns.split, "seq_lens": seq_lens,
        "max_tokens": ns.max_tokens, "batch_size": ns.batch_size, "analysis_len": ns.analysis_len,
        "passkey_lengths": passkey, "passkey_depths": depths, "windows": windows, "budgets": budgets,
        "compress": compress, "context_lengths": lengths, "device": None if ns.device == "auto" else ns.device,
    }


DECODE_FLAGS = {"window": "--windows", "budget": "--budgets", "compress": "--compress"}


def _check_decode_options(cfg, windows, budgets, compress) -> None:
    """--windows, --budgets and --compress as the decode options of the windowed losses
    (`DecodeOptions`), checked together and against this run's model, built on the meta device.
    The first value of each list stands for the rest: the parsers checked every value."""
    from attnlab.models.decode import DecodeOptionError, DecodeOptions

    try:
        options = DecodeOptions(window=windows[0] if windows else None, budget=budgets[0] if budgets else None,
                                compress=compress[0] if compress else None)
        if windows:
            import torch

            from attnlab.train.trainer import build_model

            with torch.device("meta"):
                options.check(build_model(cfg, cfg.vocab_size))
    except DecodeOptionError as e:
        raise UsageError(f"{', '.join(DECODE_FLAGS[n] for n in e.names)}: {e}") from None


def _check_passkey_lengths(cfg, lengths: list[int], depths) -> None:
    from attnlab.data.synthetic import passkey
    from attnlab.data.tokenizer import get_tokenizer

    d = cfg.data
    tok = get_tokenizer(d.tokenizer, vocab_size=d.bpe_vocab_size if d.tokenizer == "bpe" else None,
                        corpus=d.source, cache_dir=d.cache_dir or None)
    for L in lengths:
        try:
            passkey(tok, L, depths[0], 1)
        except ValueError as e:
            raise UsageError(f"--passkey: {e}") from None


KEYED = ("checkpoint", "split", "seq_lens", "passkey", "passkey_depths", "windows", "budgets", "compress", "lengths",
         "overrides")


def eval_key(ns) -> str:
    """A file name for the measurement options a call was given, e.g. 'seq-lens=256,1024_windows=16,64'
    ('default' for none), so that evaluations with other options keep their own files."""
    parts = []
    for name in KEYED:
        value = getattr(ns, name, None)
        if value in (None, [], ()) or (name == "split" and value == "val"):
            continue
        if name == "passkey_depths" and not getattr(ns, "passkey", None):
            continue
        value = ",".join(value) if isinstance(value, (list, tuple)) else str(value)
        value = "".join(ch if ch.isalnum() or ch in ",.-+" else "-" for ch in value)
        parts.append(f"{name.replace('_', '-')}={value}")
    key = "_".join(parts) or "default"
    if len(key) <= 120:
        return key
    import hashlib

    return key[:100] + "-" + hashlib.sha1(key.encode()).hexdigest()[:10]


def _keep(run_dir: Path, key: str, *paths: Path) -> Path:
    """Copies of this call's eval.json / eval.md under run_dir/evals/<key>.*: eval.json and eval.md are
    the latest call's, the copies keep every set of options' own results."""
    import shutil

    folder = run_dir / "evals"
    folder.mkdir(exist_ok=True)
    for path in paths:
        if path and Path(path).is_file():
            shutil.copyfile(path, folder / f"{key}{Path(path).suffix}")
    return folder / f"{key}.json"


def cmd_eval(ns) -> int:
    plan = _eval_plan(ns)
    from attnlab.experiments.report import eval_markdown, topk_summary, write_eval_report
    from attnlab.train import evaluate

    key = eval_key(ns)
    source = plan.pop("source")
    result = evaluate(source, analysis_batch=ns.analysis_batch, **plan)
    md = write_eval_report(result, Path(result["run_dir"]))
    kept = _keep(Path(result["run_dir"]), key, Path(result.get("written_to") or ""), md)
    if ns.quiet:
        print(f"wrote {result.get('written_to')} and {md} (kept as {kept.with_suffix('.*')})")
        return 0
    print(eval_markdown(result))
    summary = topk_summary(result.get("layers", []))
    if summary:
        print("mean top-k scalar mass over scalar heads: " + ", ".join(f"k={k}: {v:.4f}" for k, v in summary.items()))
    print(f"\nwrote {result.get('written_to')} and {md} (this call's options kept as {kept.with_suffix('.*')})")
    return 0
