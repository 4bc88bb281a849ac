"""`attnlab search`: always registered; without the optional [hf] extra, using it is a one-line
error naming the extra, while an import bug inside attnlab.search still propagates."""

from __future__ import annotations

import argparse
import importlib.util
import sys

from ._common import HF_EXTRA, UsageError, Formatter

HF_PACKAGES = ("transformers", "datasets", "faiss", "gguf", "accelerate")  # the [hf] extra, as imported
HF_REQUIRED = ("transformers",)  # what every search command imports; the rest only where used (faiss: the
#                                  hnsw/ivf methods, gguf: a GGUF model, datasets: a Hub corpus), each missing
#                                  one the same one-line error when it is reached


def _missing_extra(e: ImportError) -> str | None:
    """The [hf] package whose absence raised `e`, or None for any other import failure."""
    root = (e.name or "").split(".")[0]
    return root if root in HF_PACKAGES else None


def _extra_error(missing: list[str]) -> UsageError:
    return UsageError(f"attnlab search needs the optional package{'s' if len(missing) > 1 else ''} "
                      f"{', '.join(missing)}, not installed here; install the [hf] extra: {HF_EXTRA}")


def add_search(sub) -> None:
    """Register `search` always. Without the [hf] extra it is a stub whose use is a one-line
    error naming the extra; an ImportError of anything else (a bug inside attnlab.search) propagates."""
    try:
        from attnlab.cli.search_commands import add_search_commands
    except ImportError as e:
        missing = _missing_extra(e)
        if missing is None:
            raise
        p = sub.add_parser("search", help=f"learned search projections on a frozen pretrained LM (needs {HF_EXTRA})",
                           formatter_class=Formatter)
        p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

        def unavailable(ns):
            raise _extra_error([missing])

        p.set_defaults(func=unavailable)
        return
    from attnlab.experiments.launch import add_launcher_options

    add_search_commands(sub, trial_options=add_launcher_options)


def _trial_launch(ns) -> None:
    """`search trial --launcher ...`: check the options before anything (ConfigError names the option),
    then hand run_trial a function that runs its jobs through attnlab.experiments.launch."""
    from functools import partial

    from attnlab.experiments.launch import launch, launcher_from_options

    launcher = launcher_from_options(ns)
    if launcher is not None:
        ns.launch = lambda work, folder: partial(launch, launcher=launcher, folder=folder)(work)


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None  # None also when sys.modules[name] is None
    except (ImportError, ValueError):
        return sys.modules.get(name) is not None


def run_search(ns) -> int:
    """Run a `search` command once its optional packages are known to be there; an ImportError
    of one of them later on is the same one-line error, any other ImportError propagates."""
    missing = [name for name in HF_REQUIRED if not _installed(name)]
    if missing:
        raise _extra_error(missing)
    from attnlab.experiments.launch import JobFailed

    try:
        if getattr(ns, "search_command", None) == "trial":
            _trial_launch(ns)
        return ns.func(ns)
    except JobFailed as e:  # a cluster job raised: one line naming its log, exit 1
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ImportError as e:
        missing_now = _missing_extra(e)
        if missing_now is None:
            raise
        raise _extra_error([missing_now]) from None
