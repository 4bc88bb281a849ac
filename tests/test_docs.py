"""The documentation site builds with `mkdocs build --strict`: no broken link or anchor in docs/,
every API page renders from the docstrings, docs/hooks.py turns the committed reports and
benchmark files into the results pages, every table marker of the pages becomes the table
docs/result_tables.py makes from its committed file, and every quoted number's marker the value
docs/quoted_numbers.py generates. Skipped when the [docs] extra is not installed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # every test reads the built site (mkdocs --strict, seconds)
ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("mkdocs", reason="the [docs] extra is not installed")
pytest.importorskip("material", reason="the [docs] extra is not installed (mkdocs-material)")
pytest.importorskip("mkdocstrings_handlers.python", reason="the [docs] extra is not installed (mkdocstrings[python])")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built once for the tests of this module."""
    site = tmp_path_factory.mktemp("docs") / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return site


def test_site_builds_strictly(site):
    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("index.html"))
    assert len(pages) >= 8, pages
    for page in ("guide/ops/index.html", "mechanisms/index.html", "reference/ops/index.html",
                 "results/experiments/index.html", "results/benchmarks/index.html"):
        assert page in pages, f"{page} was not built"
    # one page per committed experiment report, with the plots beside it
    reports = [p for p in (ROOT / "experiments").rglob("report.md") if "runs" not in p.relative_to(ROOT).parts]
    assert reports
    for report in reports:
        folder = site / "results" / report.parent.relative_to(ROOT)
        assert (folder / "report" / "index.html").is_file(), f"no page for {report.relative_to(ROOT)}"
        for png in report.parent.glob("*.png"):
            assert (folder / png.name).is_file(), f"{png.relative_to(ROOT)} is not in the site"
    # the API reference rendered the docstrings, not an empty page
    ops = (site / "reference" / "ops" / "index.html").read_text(encoding="utf-8")
    assert "hybrid_attention" in ops and "scalar_attention_approx" in ops


TABLE_MARKER = "<!-- table:"


def test_table_markers_expanded(site):
    """Every table marker of docs/ became a table: none is left in the built HTML."""
    marked = {p.relative_to(ROOT / "docs").as_posix(): p.read_text(encoding="utf-8").count(TABLE_MARKER)
              for p in (ROOT / "docs").rglob("*.md")}
    assert marked.get("results/measured.md", 0) >= 10, marked
    left = [p.relative_to(site).as_posix() for p in site.rglob("*.html") if TABLE_MARKER in p.read_text(encoding="utf-8")]
    assert not left, f"table markers left unexpanded in {left}"
    measured = (site / "results" / "measured" / "index.html").read_text(encoding="utf-8")
    assert measured.count("<table>") >= marked["results/measured.md"]


def cells(html: str) -> set[str]:
    return {c.strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", html, re.S)}


def test_generated_tables_hold_the_files_numbers(site):
    """Numbers read here from the committed JSON are in the tables of the built page."""
    measured = cells((site / "results" / "measured" / "index.html").read_text(encoding="utf-8"))
    speed = json.loads((ROOT / "benchmarks" / "results" / "train_speed.json").read_text(encoding="utf-8"))
    for row in speed["rows"]:
        assert f"{row['tokens_per_s']:,.0f}" in measured, row["variant"]
    ops = json.loads((ROOT / "benchmarks" / "results" / "ops.json").read_text(encoding="utf-8"))
    scalar = next(r for r in ops["rows"] if r["op"] == "scalar")
    assert f"{scalar['median_ratio_vs_sdpa']:.2f}" in measured
    assert f"{scalar['mem_mb_T2048']:.0f}" in measured


def test_quoted_numbers_filled(site):
    """The quoted numbers' markers (docs/quoted_numbers.py) became their values: none is left in the
    built HTML, and a value the page quotes is in it."""
    left = [p.relative_to(site).as_posix() for p in site.rglob("*.html") if "<!--n " in p.read_text(encoding="utf-8")]
    assert not left, f"number markers left in {left}"
    if str(ROOT / "docs") not in sys.path:
        sys.path.append(str(ROOT / "docs"))
    import quoted_numbers  # docs/quoted_numbers.py

    key = "get decode targets.speedup_k64_cpu .0f"
    assert f"<!--n {key}-->" in (ROOT / "docs" / "results" / "measured.md").read_text(encoding="utf-8")
    measured = (site / "results" / "measured" / "index.html").read_text(encoding="utf-8")
    assert f"{quoted_numbers.value(key)}×" in measured
