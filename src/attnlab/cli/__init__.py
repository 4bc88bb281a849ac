"""`attnlab <command>`: train | eval | sample | compare | quickstart | sweep | search | export | retrofit.

Each command parses and validates its arguments, then calls one function below it
(`attnlab.train.train`, `attnlab.train.evaluate`, `attnlab.experiments.quickstart.run`,
`attnlab.experiments.sweep`,
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
import os
import sys
from typing import Sequence

from ._common import EXIT_USAGE, UsageError, command_line, Formatter, Parser
from .eval import cmd_eval
from .export import add_export
from .retrofit import add_retrofit
from .compare import add_compare
from .sample import add_sample
from .search import add_search, run_search
from .sweep import add_sweep
from .train import cmd_quickstart, cmd_train


# --------------------------------------------------------------------------- parser


def _keys_epilog(intro: str) -> str:
    from attnlab.train.config_help import format_config_keys

    return intro + "\n\nconfig keys (section.key  type  default, then meaning):\n" + format_config_keys()


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="attnlab", formatter_class=Formatter,
        description="Attention mechanisms beyond dot-product: train, evaluate and compare language models.",
        epilog="Run `attnlab <command> --help` for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>", parser_class=Parser)

    p = sub.add_parser(
        "train", help="train a language model from a TOML config with key=value overrides", formatter_class=Formatter,
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
        formatter_class=Formatter,
        description="Evaluate the newest checkpoint of a run folder (or of the run a TOML config names).\n\n"
                    "Reports validation loss and perplexity at each --seq-lens; per layer and head the attention\n"
                    "entropy and attention-sink share (mass on the first token); for scalar and hybrid heads the share\n"
                    "of each query's mass inside its k nearest keys in scalar space (k = 8, 16, 32, 64); MQAR accuracy\n"
                    "for MQAR runs and passkey accuracy with --passkey. Writes eval.json and eval.md into the run folder (the latest call's) and keeps a copy per set of options under evals/.\n\n"
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
    p.add_argument("--windows", metavar="K1,K2",
                   help="also the windowed-decode loss: every scalar/hybrid head reads only its k nearest keys in scalar "
                        "space (plus the sink), as decoding through the sorted cache does; at each --seq-lens length")
    p.add_argument("--budgets", metavar="M1,M2",
                   help="with --windows: also the windowed-decode loss with the sorted cache capped at M keys per head "
                        "(after each step it keeps the M keys nearest to its recent queries)")
    p.add_argument("--compress", metavar="S1,S2",
                   help="with --windows: also windowed decoding with density compression (after each step, runs of 4 "
                        "adjacent keys spanning <= S merge into one entry), token by token on one batch at the "
                        "training length: its loss, the exact loss and the share of keys kept")
    p.add_argument("--lengths", metavar="T1,T2",
                   help="also by context length T: exact loss, windowed-decode loss per --windows k, top-k scalar mass "
                        "and entropy on one sequence of length T, and the slope of 1 - mass@k against ln T")
    p.add_argument("--checkpoint", metavar="PATH", help="evaluate this checkpoint instead of the newest")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="device (default: the run's run.device)")
    p.add_argument("-q", "--quiet", action="store_true", help="print only where the results were written")
    p.set_defaults(func=cmd_eval)

    from attnlab.experiments.quickstart import COMPARED, CONFIG_FILE, OWNED_KEYS, base_config
    from attnlab.models.config import ConfigError

    try:
        base = base_config()
        budget = (f"Default budget (configs/quickstart.toml): {base['train']['steps']} steps of "
                  f"{base['train']['batch_size']} x {base['data']['seq_len']} tokens per model,\nd_model "
                  f"{base['model']['d_model']}, {base['model']['n_layers']} layers: about 3 minutes in all on 2 "
                  "idle CPU cores, several times that when other jobs share them.")
        out_help = f"report folder (default: {base['run']['out_dir']})"
    except ConfigError:  # outside a source checkout; using the command then says the file is missing
        budget, out_help = f"The shared configuration is {CONFIG_FILE}, not found here.", "report folder"
    p = sub.add_parser(
        "quickstart", help="train softmax, scalar and hybrid models on the same budget and compare them",
        formatter_class=Formatter,
        description="Train small softmax, scalar and hybrid attention models on the embedded Python-stdlib corpus\n"
                    "(byte tokens, no download) with the same budget -- same steps, tokens, width and seed -- then print\n"
                    "a comparison table (validation loss at the training length and twice it, tokens/s, final τ per layer,\n"
                    "top-k scalar mass, windowed-decode loss) and write OUT/report.md, OUT/results.json and plots.\n"
                    "It runs the sweep spec experiments/quickstart/spec.toml (run folders OUT/runs/<mechanism>/seed<k>);\n"
                    "run again, it keeps the finished models and rebuilds the report.\n\n" + budget,
        epilog=f"Overrides change every model alike, e.g. model.d_model=64 train.batch_size=8; the quickstart owns "
               f"{', '.join(OWNED_KEYS)}.\nWhen other jobs already occupy every CPU it trains with one torch thread, "
               f"which is faster there (run.threads=N chooses).\nSee `attnlab train --help` for every config key.",
    )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides applied to every model")
    p.add_argument("--out", metavar="DIR", help=out_help)
    p.add_argument("--steps", type=int, metavar="N", help="optimizer steps per model (reproducible budget)")
    p.add_argument("--minutes", type=float, metavar="M",
                   help="instead of --steps: measure this machine and pick the steps that train all models in M minutes")
    p.add_argument("--mechanisms", default=",".join(COMPARED), metavar="A,B",
                   help=f"mechanisms to compare (default: {','.join(COMPARED)})")
    p.add_argument("--eval-tokens", type=int, metavar="N",
                   help="validation tokens per length (default: those of the trainer's evaluations, "
                        "train.eval_batches x train.batch_size x data.seq_len)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_quickstart)

    add_sweep(sub)
    add_search(sub)
    add_export(sub)
    add_retrofit(sub)
    add_sample(sub, Formatter)
    add_compare(sub, Formatter)
    return parser



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


def resume_command(ns, argv: Sequence[str]) -> str:
    """The command that continues an interrupted `argv`: the same command, made to resume."""
    words = list(argv)
    if getattr(ns, "command", None) == "train":
        words = [w for w in words if w not in ("run.overwrite=true", "run.resume=false")]
        if "--resume" not in words and "run.resume=true" not in words:
            words.append("--resume")
    elif getattr(ns, "command", None) == "search":
        words = [w for w in words if w != "--no-resume"]
    return command_line(words)


def main(argv: Sequence[str] | None = None) -> int:
    """Run `attnlab` with `argv` (default sys.argv[1:]); returns the exit status.

    Errors are one line on stderr: usage and configuration errors, a folder another process is
    writing (FolderBusy) exit 2; a failed write (WriteError) exits 1; a run stopped by SIGINT or
    SIGTERM after saving its state says where it stopped and how to resume, and exits 130 / 143."""
    from attnlab.data.cache import WriteError
    from attnlab.interrupt import Interrupted, exit_on_next_signal
    from attnlab.lock import FolderBusy
    from attnlab.models.config import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    ns = None
    try:
        ns, extra = parser.parse_known_args(argv)
        _take_overrides(parser, ns, extra)
        if getattr(ns, "func", None) is None:
            parser.print_help()
            return EXIT_USAGE
        ns.command_line = command_line(argv)
        os.environ["ATTNLAB_COMMAND"] = ns.command_line  # a folder lock names its holder by it
        status = run_search(ns) if ns.command == "search" else ns.func(ns)
    except (UsageError, ConfigError, FolderBusy) as e:
        if int(os.environ.get("RANK", 0)) == 0:  # under torchrun every rank refuses alike: say it once
            print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except WriteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Interrupted as e:
        exit_on_next_signal()
        print(f"{e}; resume with: {resume_command(ns, argv)}", file=sys.stderr)
        return e.exit_status
    return 0 if status is None else int(status)


if __name__ == "__main__":
    sys.exit(main())
