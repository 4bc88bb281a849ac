"""The numbers README.md and the results pages quote, filled in from the repository and the committed
JSON, never typed.

A quoted number sits between two markers that name where it comes from, and the page shows only what
lies between them:

    it decodes at <!--n exp seed000/train-through-window-cauchy swa48 loss/T=1024 pm3-->2.261 ± 0.068<!--/n--> nats

`python docs/quoted_numbers.py` checks that every marked value in FILES is what its key gives now
(exit status 1 and one line per difference otherwise); `--write` puts the generated values in.
tests/test_docs_numbers.py runs the check, and docs/hooks.py puts the generated values in the built
site. A marker never starts a line (GitHub would show that line as raw HTML) and closes on its line.

A key is split like a shell line (quote an argument with spaces):

- `exp PATH VARIANT METRIC FMT`: a variant's metric in experiments/PATH/results.json; FMT `pm3` is
  mean ± sd at 3 decimals, `m3` the mean, `sd3` the sd, `seeds3` each seed's value in seed order;
  `+m3`, `+pm3` sign the mean; `pct1m`, `pct0pm` scale a fraction to a percentage;
- `verdict PATH NAME`: the outcome of the verdict rule NAME (an unnamed rule: its index, "0");
  `answer PATH`: the outcome of the experiment's answer;
- `get FILE PATH FMT`: one value of a committed JSON (FILE: a path from the repository root, or NAME
  for benchmarks/results/NAME.json); `get-len FILE PATH`: how many items that value holds;
  `ratio FILE PATH_A PATH_B FMT`: the first over the second (`ratio FILE_A PATH_A FILE_B PATH_B FMT`
  across two files); `span FILE PATH FMT`: the range of the values PATH selects, "lo–hi";
  `spread FILE PATH`: how far their largest lies above their smallest, in %;
- `log FILE REGEX FMT`: the number REGEX's first group matches in a committed text file (a log);
- `NAME ARG...`: a figure of docs/quote_experiments.py (`EXPERIMENTS`) or docs/quote_benchmarks.py
  (`BENCHMARKS`: also the versions and extras of pyproject.toml and the Makefile);
- `code KEY...`: what KEY gives, as inline code.

PATH is dotted keys and selectors: `rows[model=windowed,batch=8]` the rows whose model is "windowed"
and batch 8 (compared as text), `rows[path~window]` those whose path contains "window", `rows[*]`
every row, `rows[2]` the third, `rows[-1]` the last; on a mapping `variants[hybrid,hybrid-align*]`
the values of the keys matching those patterns. FMT is a Python format spec (`.2f`, `,.0f`, `d`, `s`)
or: `x2` a ratio ("1.06×"); `/x1` one over a time ratio, how many times faster (0.22 -> "4.6×");
`+2` signed ("+0.17", "−0.007"); `pct1` a fraction in % (0.172 -> "17.2"), `+pct3` signed, `1-pct0`
the rest (0.79 -> "21"); `met` a target's boolean ("meets" / "misses"); `K0`, `M1` in thousands or
millions ("211K", "0.8M"); `sig2` two significant figures; `sci` ("8.7e-8"); `e` ("1e-4"); `tokens`
("64K"); `int` ("16,369").
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # the modules beside this one, when imported from elsewhere
    sys.path.append(str(Path(__file__).resolve().parent))
from quote_benchmarks import BENCHMARKS  # noqa: E402  (docs/quote_benchmarks.py)
from quote_experiments import EXPERIMENTS  # noqa: E402  (docs/quote_experiments.py)
from quote_lookup import ROOT, NumberError, experiment, exp_value, fmt, load, one, select, span, verdict  # noqa: E402

FILES = ("README.md", "docs/results/index.md", "docs/results/headline.md", "docs/results/measured.md",
         "docs/results/seed-experiments.md", "docs/guide/training.md", "docs/guide/experiments.md")
MARKER = re.compile(r"<!--n (?P<key>[^\n]*?)-->(?P<value>[^\n]*?)<!--/n-->")
OPEN = re.compile(r"<!--n[ -]")
NAMED = {**EXPERIMENTS, **BENCHMARKS}

__all__ = ["FILES", "MARKER", "NAMED", "NumberError", "differences", "render", "strip", "value"]


def value(key: str) -> str:
    """The text a key gives (see the module's docstring); NumberError for a key that names nothing."""
    try:
        parts = shlex.split(key)
    except ValueError as e:
        raise NumberError(f"key {key!r}: {e}") from None
    kind, args = parts[0], parts[1:]
    try:
        if kind == "exp" and len(args) == 4:
            return exp_value(*args)
        if kind == "verdict" and len(args) == 2:
            return verdict(*args)["outcome"]
        if kind == "answer" and len(args) == 1:
            return experiment(args[0])["answer"]["outcome"]
        if kind == "get" and len(args) == 3:
            return fmt(one(load(args[0]), args[1]), args[2])
        if kind == "ratio" and len(args) == 4:
            data = load(args[0])
            return fmt(one(data, args[1]) / one(data, args[2]), args[3])
        if kind == "ratio" and len(args) == 5:  # across two files
            return fmt(one(load(args[0]), args[1]) / one(load(args[2]), args[3]), args[4])
        if kind == "get-len" and len(args) == 2:
            return str(len(one(load(args[0]), args[1])))
        if kind == "span" and len(args) == 3:
            return span(select(load(args[0]), args[1]), args[2])
        if kind == "spread" and len(args) == 2:
            values = select(load(args[0]), args[1])
            return fmt(100 * (max(values) / min(values) - 1), ".0f")
        if kind == "log" and len(args) == 3:
            text = (ROOT / args[0]).read_text(encoding="utf-8")
            m = re.search(args[1], text)
            if m is None:
                raise NumberError(f"{args[0]} has no match for {args[1]!r}")
            return fmt(float(m[1]), args[2])
        if kind == "code" and args:
            return f"`{value(shlex.join(args))}`"
        if kind in NAMED:
            return NAMED[kind](*args)
    except NumberError as e:
        raise NumberError(f"key {key!r}: {e}") from None
    except (KeyError, IndexError, TypeError, ZeroDivisionError) as e:
        raise NumberError(f"key {key!r}: {type(e).__name__}: {e}") from None
    raise NumberError(f"key {key!r}: not a key (exp, verdict, answer, get, ratio, span or a name of NAMED)")


def render(text: str, where: str = "") -> str:
    """text with every marked value replaced by what its key gives now. NumberError for a key that
    names nothing, a marker not closed on its line, or one that starts a line (GitHub would show
    that line as raw HTML)."""
    for i, line in enumerate(text.splitlines(), 1):
        opened = len(OPEN.findall(line))
        if opened != len(MARKER.findall(line)) or line.count("<!--/n-->") != opened:
            raise NumberError(f"{where}:{i}: a number marker is not closed on its line")
        if line.lstrip().startswith("<!--n "):
            raise NumberError(f"{where}:{i}: a number marker starts the line; put text before it")
    return MARKER.sub(lambda m: f"<!--n {m['key']}-->{value(m['key'])}<!--/n-->", text)


def strip(text: str) -> str:
    """text as a reader sees it: the generated values, without the markers (docs/hooks.py)."""
    return MARKER.sub(lambda m: value(m["key"]), text)


def differences(files=FILES) -> list[str]:
    """One line per marked value that differs from what its key gives: 'file:line: key: has X, gives Y'."""
    out = []
    for name in files:
        text = (ROOT / name).read_text(encoding="utf-8")
        for i, line in enumerate(text.splitlines(), 1):
            for m in MARKER.finditer(line):
                try:
                    want = value(m["key"])
                except NumberError as e:
                    out.append(f"{name}:{i}: {e}")
                    continue
                if want != m["value"]:
                    out.append(f"{name}:{i}: {m['key']}: has {m['value']!r}, gives {want!r}")
        try:
            render(text, name)
        except NumberError as e:
            out.append(str(e))
    return out


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Check (or, with --write, fill in) the numbers README.md and "
                                            "docs/results/*.md quote, from the committed files")
    p.add_argument("--write", action="store_true", help="put the generated values into the files")
    p.add_argument("files", nargs="*", default=list(FILES), help="files relative to the repository root")
    args = p.parse_args(argv)
    if args.write:
        for name in args.files:
            path = ROOT / name
            text = path.read_text(encoding="utf-8")
            new = render(text, name)
            if new != text:
                path.write_text(new, encoding="utf-8")
                print(f"{name}: updated")
    diffs = differences(args.files)
    for line in diffs:
        print(line)
    n = sum(len(MARKER.findall((ROOT / f).read_text(encoding="utf-8"))) for f in args.files)
    print(f"{n} quoted numbers, {len(diffs)} differ from what their keys give" if diffs else
          f"{n} quoted numbers, every one as its key gives it")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
