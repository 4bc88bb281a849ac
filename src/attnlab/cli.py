"""`attnlab <command>`: train | eval | quickstart | search.

Each command parses and validates its arguments, then calls one function below it
(`attnlab.train.train`, `attnlab.train.evaluate`, `attnlab.experiments.quickstart.run`,
`attnlab.search`). Every usage or configuration error is one line on stderr naming the key
or option, what it got and what it allows, with exit status 2, before any work starts and
before anything is written: the config is validated, the model is built on the meta device
(no memory, no RNG) to check its shapes, and a checkpoint to resume or evaluate is checked
(intact, same model config) before a run folder is created or touched.

`search` is always registered; it needs the optional `[hf]` extra, and without it says so
(`pip install 'attnlab[hf]'`) as such an error.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
from pathlib import Path
from typing import Sequence

EXIT_USAGE = 2
HF_EXTRA = "pip install 'attnlab[hf]'"
HF_PACKAGES = ("transformers", "datasets", "faiss", "gguf", "accelerate")  # the [hf] extra, as imported


class UsageError(ValueError):
    """Bad command-line input, reported as one line with exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but its errors are one line (no usage dump) and go through UsageError."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog):
        super().__init__(prog, max_help_position=30, width=110)


# --------------------------------------------------------------------------- helpers


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise UsageError(f"{name} must be comma-separated positive integers such as 128,256, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise UsageError(f"{name} must be comma-separated positive integers such as 128,256, got {text!r}")
    return values


def _float_list(text: str, name: str, lo: float, hi: float) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        values = []
    if not values or any(not lo <= v <= hi for v in values):
        raise UsageError(f"{name} must be comma-separated numbers in [{lo}, {hi}] such as 0,0.5,1, got {text!r}")
    return values


def _split_config_args(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """[CONFIG] key=value ... -> (config path or None, overrides)."""
    args = list(args)
    path = args[0] if args and "=" not in args[0] else None
    overrides = args[1:] if path is not None else args
    stray = [a for a in overrides if "=" not in a]
    if stray:
        raise UsageError(f"expected section.key=value overrides after the config file, got {stray[0]!r}")
    return path, overrides


def _command_line(argv: Sequence[str]) -> str:
    safe = set("-_=./,:@+")
    return " ".join(["attnlab"] + [a if a and all(c.isalnum() or c in safe for c in a) else json.dumps(a) for a in argv])


def _print_table(rows: dict) -> None:
    width = max(len(k) for k in rows)
    for k, v in rows.items():
        print(f"  {k:<{width}}  {v}")


# --------------------------------------------------------------------------- train


def _check_model_builds(cfg, what: str = "") -> None:
    """Build the model of `cfg` on the meta device (no memory, no RNG draws), so a shape error
    surfaces now, as a usage error, rather than after the run folder exists."""
    import torch

    from attnlab.train.trainer import build_model

    d = cfg.data
    vocab = cfg.model.vocab_size or (d.bpe_vocab_size if d.tokenizer == "bpe" else 257)
    try:
        with torch.device("meta"):
            build_model(cfg, vocab)
    except (ValueError, TypeError) as e:
        raise UsageError(f"{what}{e}") from None


def _train_cfg(ns):
    from attnlab.train.checkpoint import CheckpointError, latest_checkpoint
    from attnlab.train.config import load_config
    from attnlab.train.trainer import CKPT_DIR, ResumeError, check_resume

    path, overrides = _split_config_args(ns.args)
    if ns.run_dir:
        run_dir = Path(ns.run_dir)
        if not run_dir.name:
            raise UsageError(f"--run-dir must name a folder, got {ns.run_dir!r}")
        overrides += [f"run.out_dir={json.dumps(str(run_dir.parent))}", f"run.name={json.dumps(run_dir.name)}"]
    if ns.resume:
        overrides.append("run.resume=true")
    cfg = load_config(path, overrides)
    run_dir = Path(cfg.run_dir)
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
        need = cfg.data.bpe_vocab_size if cfg.data.tokenizer == "bpe" else 257
        if cfg.model.vocab_size < need:
            raise UsageError(
                f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the {cfg.data.tokenizer} tokenizer's "
                f"vocabulary ({need}); allowed: 0 (take the tokenizer's) or >= {need}"
            )
    _check_model_builds(cfg)
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
    except DataError as e:  # raised before the run folder is created
        raise UsageError(str(e)) from None
    if int(os.environ.get("RANK", 0)) == 0:
        taus = [f"{t:.4g}" for t in summary["tau"] if t is not None]
        print(f"trained {summary['run_dir']}")
        _print_table({
            "steps": summary["steps"],
            "val loss": f"{summary['val_loss']:.4f}",
            "val ppl": f"{summary['val_ppl']:.2f}",
            **({"val accuracy": f"{summary['val_accuracy']:.4f}"} if "val_accuracy" in summary else {}),
            "tokens/s": f"{summary['tokens_per_s']:,.0f}" if summary.get("tokens_per_s") else "—",
            "τ per layer": " / ".join(taus) if taus else "—",
        })
        print(f"next: attnlab eval {summary['run_dir']}")
    return 0


# --------------------------------------------------------------------------- eval


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
    for name in ("max_tokens", "batch_size", "analysis_len", "analysis_batch"):
        value = getattr(ns, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    seq_lens = _int_list(ns.seq_lens, "--seq-lens") if ns.seq_lens else [cfg.data.seq_len]
    if cfg.model.pos_embedding == "learned" and max(seq_lens) > cfg.model.max_seq_len:
        raise UsageError(
            f"--seq-lens: {max(seq_lens)} exceeds model.max_seq_len={cfg.model.max_seq_len} of this run's learned "
            f"position embedding; allowed: lengths <= {cfg.model.max_seq_len}"
        )
    passkey = _int_list(ns.passkey, "--passkey") if ns.passkey else None
    horizons = [a.cosformer_max_len for a in cfg.model.attention_configs()
                if a.mechanism == "cosformer" and a.cosformer_max_len is not None]
    for option, lengths in (("--seq-lens", seq_lens), ("--passkey", passkey or [])):
        if horizons and lengths and max(lengths) > min(horizons):
            raise UsageError(
                f"{option}: {max(lengths)} exceeds model.attention.cosformer_max_len={min(horizons)}, the horizon of "
                f"this run's cosformer layers; allowed: lengths <= {min(horizons)}"
            )
    depths = tuple(_float_list(ns.passkey_depths, "--passkey-depths", 0.0, 1.0))
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
        "passkey_lengths": passkey, "passkey_depths": depths, "device": None if ns.device == "auto" else ns.device,
    }


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


def cmd_eval(ns) -> int:
    plan = _eval_plan(ns)
    from attnlab.experiments.report import eval_markdown, topk_summary, write_eval_report
    from attnlab.train import evaluate

    source = plan.pop("source")
    result = evaluate(source, analysis_batch=ns.analysis_batch, **plan)
    md = write_eval_report(result, Path(result["run_dir"]))
    if ns.quiet:
        print(f"wrote {result.get('written_to')} and {md}")
        return 0
    print(eval_markdown(result))
    summary = topk_summary(result.get("layers", []))
    if summary:
        print("mean top-k scalar mass over scalar heads: " + ", ".join(f"k={k}: {v:.4f}" for k, v in summary.items()))
    print(f"\nwrote {result.get('written_to')} and {md}")
    return 0


# --------------------------------------------------------------------------- quickstart


def cmd_quickstart(ns) -> int:
    from attnlab.experiments.quickstart import quickstart_configs, run

    if ns.steps is not None and ns.minutes is not None:
        raise UsageError("attnlab quickstart: give --steps or --minutes, not both")
    if ns.steps is not None and ns.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {ns.steps}")
    if ns.minutes is not None and not (math.isfinite(ns.minutes) and ns.minutes > 0):
        raise UsageError(f"--minutes must be a finite number > 0, got {ns.minutes}")
    if ns.eval_tokens is not None and ns.eval_tokens < 1:
        raise UsageError(f"--eval-tokens must be >= 1, got {ns.eval_tokens}")
    mechanisms = [m.strip() for m in ns.mechanisms.split(",") if m.strip()]
    stray = [a for a in ns.overrides if "=" not in a]
    if stray:
        raise UsageError(f"expected section.key=value overrides, got {stray[0]!r}")
    for cfg in quickstart_configs(ns.out, steps=ns.steps, mechanisms=mechanisms, overrides=ns.overrides):  # validate first
        _check_model_builds(cfg, f"{cfg.model.attn}: ")
    run(ns.out, steps=ns.steps, minutes=ns.minutes, mechanisms=mechanisms, overrides=ns.overrides,
        eval_tokens=ns.eval_tokens, progress=not ns.no_progress, command=ns.command_line)
    return 0


# --------------------------------------------------------------------------- parser


def _keys_epilog(intro: str) -> str:
    from attnlab.train.config import format_config_keys

    return intro + "\n\nconfig keys (section.key  type  default, then meaning):\n" + format_config_keys()


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="attnlab", formatter_class=_Formatter,
        description="Attention mechanisms beyond dot-product: train, evaluate and compare language models.",
        epilog="Run `attnlab <command> --help` for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>", parser_class=_Parser)

    p = sub.add_parser(
        "train", help="train a language model from a TOML config with key=value overrides", formatter_class=_Formatter,
        description="Train a language model whose layers use any attnlab attention mechanism.\n\n"
                    "  attnlab train configs/tiny.toml model.attn=hybrid train.steps=500\n"
                    "  attnlab train configs/tiny.toml --resume\n\n"
                    "The run folder (run.out_dir/run.name) receives the resolved config, logs (log.jsonl, train.csv,\n"
                    "eval.csv), checkpoints and summary.json. Under torchrun it trains data-parallel:\n"
                    "  torchrun --nproc_per_node=2 -m attnlab train configs/tiny.toml",
        epilog=_keys_epilog("Override values are TOML literals (train.lr=3e-4, model.attn=[\"softmax\",\"hybrid\"]) or bare "
                            "words (model.attn=hybrid, model.attn=[softmax,hybrid])."),
    )
    p.add_argument("args", nargs="*", metavar="CONFIG | key=value",
                   help="a TOML config file (optional; defaults otherwise), then dotted section.key=value overrides")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the run folder")
    p.add_argument("--run-dir", metavar="DIR", help="the run folder (sets run.out_dir and run.name)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "eval", help="evaluate a trained run: loss by context length, attention statistics, task accuracy",
        formatter_class=_Formatter,
        description="Evaluate the newest checkpoint of a run folder (or of the run a TOML config names).\n\n"
                    "Reports validation loss and perplexity at each --seq-lens; per layer and head the attention\n"
                    "entropy and attention-sink share (mass on the first token); for scalar and hybrid heads the share\n"
                    "of each query's mass inside its k nearest keys in scalar space (k = 8, 16, 32, 64); MQAR accuracy\n"
                    "for MQAR runs and passkey accuracy with --passkey. Writes eval.json and eval.md into the run folder.\n\n"
                    "  attnlab eval runs/hybrid --seq-lens 128,256,512",
        epilog=_keys_epilog("Overrides after RUN_DIR_OR_CONFIG change the loaded run config (e.g. data.max_docs=50)."),
    )
    p.add_argument("target", metavar="RUN_DIR_OR_CONFIG", help="a run folder, or the TOML config of a trained run")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides of the run's config")
    p.add_argument("--seq-lens", metavar="L1,L2", help="context lengths for loss and perplexity (default: data.seq_len)")
    p.add_argument("--split", choices=("val", "test"), default="val", help="which split to evaluate (default: val)")
    p.add_argument("--max-tokens", type=int, default=65536, metavar="N",
                   help="target tokens per context length, the same text budget at every length (default: 65536)")
    p.add_argument("--batch-size", type=int, metavar="N", help="sequences per batch (default: train.batch_size)")
    p.add_argument("--analysis-len", type=int, metavar="T",
                   help="sequence length of the attention analysis, which builds T x T weights (default: min(seq_len, 256))")
    p.add_argument("--analysis-batch", type=int, default=4, metavar="N", help="sequences in the attention analysis (default: 4)")
    p.add_argument("--passkey", metavar="L1,L2", help="also measure passkey retrieval at these lengths (tokens)")
    p.add_argument("--passkey-depths", default="0,0.5,1", metavar="D1,D2",
                   help="needle depths in [0, 1] for --passkey (default: 0,0.5,1)")
    p.add_argument("--checkpoint", metavar="PATH", help="evaluate this checkpoint instead of the newest")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="device (default: the run's run.device)")
    p.add_argument("-q", "--quiet", action="store_true", help="print only where the results were written")
    p.set_defaults(func=cmd_eval)

    from attnlab.experiments.quickstart import BASE_CONFIG, DEFAULT_OUT, MECHANISMS, OWNED_KEYS

    base = BASE_CONFIG
    p = sub.add_parser(
        "quickstart", help="train softmax, scalar and hybrid models on the same budget and compare them",
        formatter_class=_Formatter,
        description="Train small softmax, scalar and hybrid attention models on the embedded Python-stdlib corpus\n"
                    "(byte tokens, no download) with the same budget -- same steps, tokens, width and seed -- then print\n"
                    "a comparison table (validation loss and perplexity, tokens/s, final τ per layer, top-k scalar mass)\n"
                    "and write OUT/report.md, OUT/results.json, OUT/loss_curves.png and OUT/tau.png.\n\n"
                    f"Default budget: {base['train']['steps']} steps of {base['train']['batch_size']} x "
                    f"{base['data']['seq_len']} tokens per model, d_model {base['model']['d_model']}, "
                    f"{base['model']['n_layers']} layers: about 7 minutes in all on a 2-core CPU\n"
                    "shared with other jobs (1 torch thread), less when the CPU is idle.",
        epilog=f"Overrides change every model alike, e.g. model.d_model=64 train.batch_size=8; the quickstart owns "
               f"{', '.join(OWNED_KEYS)}.\nWhen other jobs already occupy every CPU it trains with one torch thread, "
               f"which is faster there (run.threads=N chooses).\nSee `attnlab train --help` for every config key.",
    )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides applied to every model")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"report folder (default: {DEFAULT_OUT})")
    p.add_argument("--steps", type=int, metavar="N", help="optimizer steps per model (reproducible budget)")
    p.add_argument("--minutes", type=float, metavar="M",
                   help="instead of --steps: measure this machine and pick the steps that train all models in M minutes")
    p.add_argument("--mechanisms", default=",".join(MECHANISMS), metavar="A,B",
                   help=f"mechanisms to compare (default: {','.join(MECHANISMS)})")
    p.add_argument("--eval-tokens", type=int, metavar="N",
                   help="validation tokens per length (default: those of the trainer's evaluations, "
                        "train.eval_batches x train.batch_size x data.seq_len)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_quickstart)

    _add_search(sub)
    return parser


def _missing_extra(e: ImportError) -> str | None:
    """The [hf] package whose absence raised `e`, or None for any other import failure."""
    root = (e.name or "").split(".")[0]
    return root if root in HF_PACKAGES else None


def _extra_error(missing: list[str]) -> UsageError:
    return UsageError(f"attnlab search needs the optional package{'s' if len(missing) > 1 else ''} "
                      f"{', '.join(missing)}, not installed here; install the [hf] extra: {HF_EXTRA}")


def _add_search(sub) -> None:
    """Register `search` always. Without the [hf] extra it is a stub whose use is a one-line
    error naming the extra; an ImportError of anything else (a bug inside attnlab.search) propagates."""
    try:
        from attnlab.search.cli import add_search_commands
    except ImportError as e:
        missing = _missing_extra(e)
        if missing is None:
            raise
        p = sub.add_parser("search", help=f"learned search projections on a frozen pretrained LM (needs {HF_EXTRA})",
                           formatter_class=_Formatter)
        p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

        def unavailable(ns):
            raise _extra_error([missing])

        p.set_defaults(func=unavailable)
        return
    add_search_commands(sub)


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None  # None also when sys.modules[name] is None
    except (ImportError, ValueError):
        return sys.modules.get(name) is not None


def _run_search(ns) -> int:
    """Run a `search` command once its optional packages are known to be there; an ImportError
    of one of them later on is the same one-line error, any other ImportError propagates."""
    missing = [name for name in HF_PACKAGES if not _installed(name)]
    if missing:
        raise _extra_error(missing)
    try:
        return ns.func(ns)
    except ImportError as e:
        missing_now = _missing_extra(e)
        if missing_now is None:
            raise
        raise _extra_error([missing_now]) from None


# --------------------------------------------------------------------------- entry point


def _take_overrides(parser, ns, extra: list[str]) -> None:
    """key=value words that argparse left over because they came after an option
    (`attnlab train CONFIG --resume train.steps=9`) join the command's overrides."""
    target = "args" if getattr(ns, "func", None) is cmd_train else "overrides"
    unknown = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(ns, target)]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        setattr(ns, target, list(getattr(ns, target)) + extra)


def main(argv: Sequence[str] | None = None) -> int:
    """Run `attnlab` with `argv` (default sys.argv[1:]); returns the exit status."""
    from attnlab.models.config import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        ns, extra = parser.parse_known_args(argv)
        _take_overrides(parser, ns, extra)
        if getattr(ns, "func", None) is None:
            parser.print_help()
            return EXIT_USAGE
        ns.command_line = _command_line(argv)
        status = _run_search(ns) if ns.command == "search" else ns.func(ns)
    except (UsageError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return 0 if status is None else int(status)


if __name__ == "__main__":
    sys.exit(main())
