"""mkdocs hook: the results pages come from the committed generated files, never retyped.

At build time this adds to the site, without copying anything into docs/:

- one page per experiment report, `experiments/<path>/report.md` -> `results/experiments/<path>/report.md`,
  with the PNGs beside it and, folded at the end, the spec it was generated from;
- `results/experiments/index.md`: every committed experiment, its claim and a link to its report
  (a spec without a report yet is listed as such);
- one page per generated benchmark table, `benchmarks/results/**/*.md` -> `results/benchmarks/...`,
  with its PNGs, and the benchmark plots and JSON files themselves, so the results pages can link them;
- `results/benchmarks/index.md`: every benchmark file;
- `guide/spec-format.md`: `experiments/README.md`, the spec format, as written.

It also expands the table markers of the pages, `<!-- table: NAME FILE... -->` on a line of their
own: docs/result_tables.py generates table NAME from the committed FILEs, so a results table shows
what its file holds instead of numbers typed from it. An unknown name, a file list that is not the
generator's, or a missing file fails the build. The numbers quoted in the text, each between
`<!--n KEY-->` and `<!--/n-->`, become what docs/quoted_numbers.py generates for KEY (a key that
names nothing fails the build); tests/test_docs_numbers.py checks that the files hold those values.

Run folders (`runs/`) are skipped. Links inside an included file that point at something the site
does not hold (the spec, a run folder) become plain text, so a --strict build fails only on broken
links in the pages of docs/ itself.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from result_tables import TABLES  # docs/result_tables.py: mkdocs puts this folder on the path to load the hook
from quoted_numbers import NumberError, strip as strip_numbers  # docs/quoted_numbers.py

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"
BENCH = ROOT / "benchmarks" / "results"
EXP_SITE = "results/experiments"
BENCH_SITE = "results/benchmarks"
SPEC_PAGE = "guide/spec-format.md"
COPIED = (".png", ".json")

log = logging.getLogger("mkdocs.hooks.results")
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)(\s+\"[^\"]*\")?\)")
TITLE = re.compile(r"^#\s+(.+?)\s*$", re.M)
CLAIM = re.compile(r"^\*\*Claim\.\*\*\s*(.+?)\s*$", re.M)
TABLE_MARKER = re.compile(r"^<!--\s*table:\s*(.*?)\s*-->[ \t]*$", re.M)


def _visible(path: Path, base: Path) -> bool:
    parts = path.relative_to(base).parts
    return not any(p == "runs" or p.startswith(".") for p in parts)


def _reports() -> list[Path]:
    return sorted(p for p in EXPERIMENTS.rglob("report.md") if _visible(p, EXPERIMENTS))


def _specs() -> list[Path]:
    return sorted(p for p in EXPERIMENTS.rglob("spec.toml") if _visible(p, EXPERIMENTS))


def _bench_pages() -> list[Path]:
    return sorted(p for p in BENCH.rglob("*.md") if _visible(p, BENCH))


def _bench_assets() -> list[Path]:
    return sorted(p for p in BENCH.rglob("*") if p.suffix in COPIED and p.is_file() and _visible(p, BENCH))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _title(text: str, fallback: str) -> str:
    m = TITLE.search(text)
    return m.group(1).strip() if m else fallback


def _relink(text: str, folder: Path) -> str:
    """Keep web links, anchors and links to files the site holds beside the page; any other
    link keeps its text and loses its target (an image becomes its alt text in italics)."""

    def sub(m: re.Match) -> str:
        bang, label, target, _ = m.groups()
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            return m.group(0)
        path = (folder / target.split("#", 1)[0]).resolve()
        if path.suffix in COPIED and path.is_file():
            return m.group(0)
        return f"*{label}*" if bang else label

    return LINK.sub(sub, text)


def _pngs_beside(md: Path, text: str) -> str:
    """Markdown for the PNGs in md's folder that the text does not show already."""
    shown = set(re.findall(r"\]\(([^)\s]+\.png)", text))
    extra = [p.name for p in sorted(md.parent.glob("*.png")) if p.name not in shown]
    if not extra:
        return ""
    return "\n\n## Plots\n\n" + "\n\n".join(f"![{name}]({name})" for name in extra) + "\n"


def _report_page(report: Path) -> str:
    text = report.read_text(encoding="utf-8")
    page = _relink(text, report.parent) + _pngs_beside(report, text)
    spec = report.parent / "spec.toml"
    source = f"`{_rel(report)}`"
    page += f"\n\n---\n\n*This page is {source}, the committed report, as generated.*\n"
    if spec.is_file():
        body = "\n".join("    " + line if line else "" for line in spec.read_text(encoding="utf-8").splitlines())
        page += f'\n??? note "The spec: `{_rel(spec)}`"\n\n    ```toml\n{body}\n    ```\n'
    return page


def _bench_page(md: Path) -> str:
    text = md.read_text(encoding="utf-8")
    page = _relink(text, md.parent)
    if not TITLE.search(text):
        page = f"# `{_rel(md)}`\n\n{page}"
    return page + _pngs_beside(md, text) + f"\n\n---\n\n*This page is `{_rel(md)}`, committed as generated.*\n"


def _experiments_index() -> str:
    lines = [
        "# Experiment reports",
        "",
        "Every committed experiment: a spec under `experiments/`, run by `attnlab sweep` or `attnlab search trial`,",
        "and the report that command generated beside it (results table, verdict with its rule, plots). The",
        "pages below are those reports as committed; [Seed experiments](../seed-experiments.md) sums them up.",
        "",
    ]
    reports = {r.parent: r for r in _reports()}
    folders = sorted({s.parent for s in _specs()} | set(reports))
    for folder in folders:
        name = folder.relative_to(EXPERIMENTS).as_posix()
        report = reports.get(folder)
        if report is None:
            if name == "quickstart":
                note = "the spec `make quickstart` runs; its report goes to `runs/quickstart/`, not committed"
            else:
                note = "no report committed yet"
            lines += [f"- **{name}**: `{_rel(folder / 'spec.toml')}`, {note}.", ""]
            continue
        text = report.read_text(encoding="utf-8")
        claim = CLAIM.search(text)
        lines.append(f"- [**{name}**: {_title(text, name)}]({name}/report.md)")
        if claim:
            lines.append(f"  {claim.group(1)}")
        lines.append("")
    return "\n".join(lines) + "\n"


def _bench_index() -> str:
    lines = [
        "# Benchmark files",
        "",
        "What the scripts in `benchmarks/` wrote, as committed under `benchmarks/results/`. The",
        "[measured results](../measured.md) page reads them; the tables generated as markdown are",
        "shown here as they are, with their plots.",
        "",
        "## Generated tables",
        "",
    ]
    for md in _bench_pages():
        rel = md.relative_to(BENCH).as_posix()
        lines.append(f"- [{_title(md.read_text(encoding='utf-8'), rel)}]({rel}) (`{_rel(md)}`)")
    lines += ["", "## Plots and JSON", ""]
    for asset in _bench_assets():
        rel = asset.relative_to(BENCH).as_posix()
        lines.append(f"- [`{rel}`]({rel})")
    return "\n".join(lines) + "\n"


def _spec_format() -> str:
    text = (EXPERIMENTS / "README.md").read_text(encoding="utf-8")
    text = TITLE.sub("# The experiment spec format", text, count=1)
    note = ("*This page is `experiments/README.md`, the format `attnlab sweep` and `attnlab search trial` read "
            "(a test checks that its example spec loads).*\n\n")
    head, sep, rest = text.partition("\n")
    return head + sep + "\n" + note + _relink(rest, EXPERIMENTS)


def _bench_label(md: Path) -> str:
    """search/middle6/results.md -> "search/middle6"; selectors.md -> "selectors"."""
    rel = md.relative_to(BENCH).with_suffix("")
    return (rel.parent if rel.name == "results" and rel.parent.parts else rel).as_posix()


def _page(path: Path, site_dir: str, base: Path) -> str:
    return f"{site_dir}/{path.relative_to(base).as_posix()}"


def _expand_tables(markdown: str, page: str) -> str:
    """Replace every table marker of a page by the table its generator makes from the files named."""

    def sub(m: re.Match) -> str:
        name, *files = m.group(1).split() or [""]
        if name not in TABLES:
            raise PluginError(f"{page}: unknown table {name!r} in {m.group(0)!r}; known: {', '.join(TABLES)}")
        make, sources = TABLES[name]
        if tuple(files) != sources:
            raise PluginError(f"{page}: table {name!r} reads {' '.join(sources)}, the marker names {' '.join(files)}")
        missing = [f for f in files if not (ROOT / f).is_file()]
        if missing:
            raise PluginError(f"{page}: table {name!r}: {', '.join(missing)} does not exist")
        return make(*(json.loads((ROOT / f).read_text(encoding="utf-8")) for f in files))

    return TABLE_MARKER.sub(sub, markdown)


# --------------------------------------------------------------------------- mkdocs events


def on_config(config):
    """Put the generated pages into the nav: under the "Results" section, one entry per report."""
    nav = config.nav or []
    for entry in nav:
        if isinstance(entry, dict) and "Results" in entry:
            section = entry["Results"]
            reports = [{r.parent.relative_to(EXPERIMENTS).as_posix(): _page(r, EXP_SITE, EXPERIMENTS)}
                       for r in _reports()]
            benches = [{_bench_label(p): _page(p, BENCH_SITE, BENCH)} for p in _bench_pages()]
            section.append({"Experiment reports": [f"{EXP_SITE}/index.md", *reports]})
            section.append({"Benchmark files": [f"{BENCH_SITE}/index.md", *benches]})
    return config


def on_files(files: Files, config) -> Files:
    def add(uri: str, *, content: str | None = None, path: Path | None = None) -> None:
        if files.get_file_from_path(uri) is not None:
            log.warning("generated page %s would replace a file of docs/", uri)
            return
        files.append(File.generated(config, uri, content=content,
                                    abs_src_path=str(path) if path is not None else None))

    for report in _reports():
        add(_page(report, EXP_SITE, EXPERIMENTS), content=_report_page(report))
        for png in sorted(report.parent.glob("*.png")):
            add(_page(png, EXP_SITE, EXPERIMENTS), path=png)
    add(f"{EXP_SITE}/index.md", content=_experiments_index())
    for md in _bench_pages():
        add(_page(md, BENCH_SITE, BENCH), content=_bench_page(md))
    for asset in _bench_assets():
        add(_page(asset, BENCH_SITE, BENCH), path=asset)
    add(f"{BENCH_SITE}/index.md", content=_bench_index())
    add(SPEC_PAGE, content=_spec_format())
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Expand the table markers (docs/result_tables.py) and put the generated values in place of the
    quoted numbers' markers (docs/quoted_numbers.py)."""
    try:
        markdown = strip_numbers(markdown)
    except NumberError as e:
        raise PluginError(f"{page.file.src_uri}: {e}") from None
    return _expand_tables(markdown, page.file.src_uri)
