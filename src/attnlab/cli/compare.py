"""`attnlab compare RUN...`: one table and one plot of several trained runs (attnlab.experiments.compare)."""

from __future__ import annotations

from ._common import UsageError


def add_compare(sub, formatter) -> None:
    p = sub.add_parser(
        "compare", help="compare trained runs: one table and their loss curves", formatter_class=formatter,
        description="One table of several finished runs (validation loss and perplexity, tokens/s, parameters, steps,\n"
                    "and the `attnlab eval` losses they share) and one PNG of their loss curves, printed and written as\n"
                    "compare.md, compare.json and compare_loss.png (default: into the runs' common folder).\n\n"
                    "  attnlab compare runs/quickstart/runs/*/seed0",
    )
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="finished run folders (two or more)")
    p.add_argument("--out", metavar="DIR", help="where to write the table and plot (default: the runs' common folder)")
    p.add_argument("--no-plot", action="store_true", help="no PNG")
    p.set_defaults(func=cmd_compare)


def cmd_compare(ns) -> int:
    from attnlab.experiments.compare import CompareError, compare

    try:
        res = compare(ns.runs, ns.out, plot=not ns.no_plot)
    except CompareError as e:
        raise UsageError(str(e)) from None
    print(res["table"])
    print("\nwrote " + ", ".join(res["written"]))
    return 0
