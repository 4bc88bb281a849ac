"""`python -m attnlab.train [CONFIG] [section.key=value ...] [--resume]`: train one run.

Also the entry point that `torchrun --nproc_per_node=N -m attnlab.train ...` starts on each rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .config import ConfigError, load_config
from .config_help import format_config_keys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m attnlab.train",
        description="Train a language model whose layers use any attnlab attention mechanism.",
        epilog="Use --keys to list every config key with its type, default and meaning.",
    )
    parser.add_argument("args", nargs="*", metavar="CONFIG | key=value",
                        help="an optional TOML config file, then dotted overrides such as model.attn=hybrid train.steps=500")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint (same as run.resume=true)")
    parser.add_argument("--keys", action="store_true", help="list every config key and exit")
    ns = parser.parse_args(argv)
    if ns.keys:
        print(format_config_keys())
        return 0
    path = ns.args[0] if ns.args and "=" not in ns.args[0] else None
    overrides = ns.args[1:] if path is not None else list(ns.args)
    if ns.resume:
        overrides.append("run.resume=true")
    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from attnlab.data.cache import WriteError
    from attnlab.interrupt import Interrupted, exit_on_next_signal
    from attnlab.lock import FolderBusy

    from .trainer import train

    try:
        summary = train(cfg)
    except FolderBusy as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except WriteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Interrupted as e:
        exit_on_next_signal()
        again = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "run.overwrite=true"]
        again += [] if ns.resume or "run.resume=true" in again else ["--resume"]
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"{e}; resume with: python -m attnlab.train {' '.join(again)}", file=sys.stderr)
        return e.exit_status
    brief = {k: summary[k] for k in ("run_dir", "steps", "val_loss", "val_ppl", "tokens_per_s", "tau") if k in summary}
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps(brief))
    return 0


if __name__ == "__main__":
    sys.exit(main())
