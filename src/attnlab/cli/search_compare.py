"""`attnlab search compare SPEC.toml`: a decoding comparison on a pretrained model, in resumable batches.

    attnlab search compare experiments/pretrained-decoding/spec.toml                 # every missing item, both sides
    attnlab search compare SPEC --side attnlab --lengths 2048 --minutes 6 --records "$OUT"   # one batch elsewhere
    attnlab search compare SPEC --merge DIR                                          # fold a batch's records in
    attnlab search compare SPEC --report-only                                        # report.md from the records
"""

from __future__ import annotations

from attnlab.models.config import ConfigError

from ._common import csv_of


def add_compare(sub, formatter) -> None:
    """Register `compare` under the `search` subparsers."""
    c = sub.add_parser(
        "compare", help="attnlab's selectors beside kvpress's presses at equal budgets (resumable batches)",
        formatter_class=formatter, description=__doc__)
    c.add_argument("spec", metavar="SPEC.toml", help="the comparison's spec (attnlab.experiments.pretrained_decoding)")
    c.add_argument("--side", type=csv_of(str), default=None,
                   help="attnlab, presses or both (comma list; default both): which methods score items now")
    c.add_argument("--minutes", type=float, default=None, help="start no item that would end past this many minutes")
    c.add_argument("--records", default=None, help="folder the records go to (default: the spec's records/)")
    c.add_argument("--lengths", type=csv_of(int), default=None, help="only the items of these context lengths")
    c.add_argument("--kinds", type=csv_of(str), default=None, help="only these items: task, ppl, time")
    c.add_argument("--tasks", type=csv_of(str), default=None, help="only these tasks: passkey, needle")
    c.add_argument("--merge", nargs="+", default=None, metavar="DIR",
                   help="fold the records of batches run elsewhere into the spec's records/, then report")
    c.add_argument("--report-only", action="store_true", help="rebuild results.json, report.md and the plots only")
    c.add_argument("--device", default="auto", help="auto | cpu | cuda: where the task and perplexity items run")
    c.add_argument("--threads", type=int, default=None,
                   help="torch threads of each side's process (default: torch's, one per core); 1 on a machine "
                        "busy with other work, where more threads spin waiting for a core")
    c.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    c.set_defaults(func=_compare)


def _compare(args) -> int:
    from attnlab.experiments.pretrained_decoding import SIDES, load_spec, merge, run, write_report
    from attnlab.search.hf_model import resolve_device

    spec = load_spec(args.spec)  # ConfigError naming the key before any work
    sides = args.side or list(SIDES)
    bad = [s for s in sides if s not in SIDES]
    if bad:
        raise ConfigError(f"attnlab search compare: --side must name {' or '.join(SIDES)}, got {bad}")
    try:
        resolve_device(args.device)
    except ValueError as e:
        raise ConfigError(f"attnlab search compare: --{e}") from None
    if args.minutes is not None and not args.minutes > 0:
        raise ConfigError(f"attnlab search compare: --minutes must be > 0, got {args.minutes}")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"attnlab search compare: --threads must be >= 1, got {args.threads}")
    only = {k: getattr(args, k) for k in ("lengths", "kinds", "tasks") if getattr(args, k)}
    if args.merge:
        print(f"merged: {merge(spec, args.merge)}")
    elif not args.report_only:
        ran = run(spec, sides, args.minutes, args.records, only, args.device, args.progress, args.threads)
        print("items recorded now: " + ", ".join(f"{s} {'skipped' if n is None else n}" for s, n in ran.items()))
        if args.records is not None:
            print(f"records in {args.records}; fold them in with: attnlab search compare {args.spec} --merge {args.records}")
            return 0
    results = write_report(spec)
    for v in results["verdicts"]:
        print(f"{v['rule'].get('name') or v['rule']['kind']}: {v['outcome']}")
    print(f"wrote {spec.folder}/report.md, results.json")
    return 0
