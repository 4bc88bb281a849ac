"""The documentation site builds with `mkdocs build --strict`: no broken link or anchor in docs/,
every API page renders from the docstrings, and docs/hooks.py turns the committed reports and
benchmark files into the results pages. Skipped when the [docs] extra is not installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("mkdocs", reason="the [docs] extra is not installed")
pytest.importorskip("material", reason="the [docs] extra is not installed (mkdocs-material)")
pytest.importorskip("mkdocstrings_handlers.python", reason="the [docs] extra is not installed (mkdocstrings[python])")


def test_site_builds_strictly(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
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
