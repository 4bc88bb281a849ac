"""The README and the results pages are true by construction, and so is every committed report.

- Every number README.md and docs/results/*.md quote between `<!--n KEY-->` and `<!--/n-->` is what
  docs/quoted_numbers.py generates for KEY from the repository and the committed JSON; a stale value
  fails here (`python docs/quoted_numbers.py --write` updates the files). A measured figure typed
  outside a marker (a number after ±, a time in ms, tokens/s, three decimals) fails too.
- Every committed experiment report (experiments/**/report.md) is the text its report code makes from
  the results.json beside it, and that results.json names the command that trained the runs, which
  `--report-only` keeps: a report that the code or its own results no longer give fails here. The
  text is rebuilt without drawing the plots (the plot functions stop at their first pyplot call and
  say whether they would have drawn). The slow test rebuilds every report the way `--report-only`
  does on a fresh clone (results.json too), from a copy of the specs and results alone.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "docs") not in sys.path:
    sys.path.append(str(ROOT / "docs"))

import quoted_numbers as qn  # noqa: E402  (docs/quoted_numbers.py)

# --------------------------------------------------------------------------- the quoted numbers

TEXTS = {name: (ROOT / name).read_text(encoding="utf-8") for name in qn.FILES}


def test_quoted_numbers_are_generated():
    diffs = qn.differences()
    assert not diffs, ("quoted numbers differ from what docs/quoted_numbers.py generates (run `python "
                       "docs/quoted_numbers.py --write` if the committed files changed):\n" + "\n".join(diffs))


@pytest.mark.parametrize("name,least", [("README.md", 100), ("docs/results/index.md", 30),
                                        ("docs/results/headline.md", 200), ("docs/results/measured.md", 300),
                                        ("docs/results/seed-experiments.md", 400)])
def test_markers_found(name, least):
    assert len(qn.MARKER.findall(TEXTS[name])) >= least, f"{name}: the quoted numbers' markers were not found"


# numbers quoted from the seed documents (the proposals), not measured here
DOCUMENT_QUOTES = ("+1.746 %", "−0.062 %")
TYPED = re.compile(r"±\s+\d|\d\s?ms\b|\d\s?tokens/s|(?<![\w.])\d+\.\d{3}")


@pytest.mark.parametrize("name", qn.FILES)
def test_no_measured_figure_typed_by_hand(name):
    """Outside the markers, code and links: no number after ±, no time in ms, no tokens/s, no figure
    with three decimals (a measured figure typed from a file instead of generated from it)."""
    text = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), TEXTS[name], flags=re.S | re.M)
    typed = []
    for i, line in enumerate(text.splitlines(), 1):
        line = qn.MARKER.sub(" ", line)
        line = re.sub(r"`[^`]*`|\]\([^)]*\)", " ", line)
        for quote in DOCUMENT_QUOTES:
            line = line.replace(quote, " ")
        typed += [f"{name}:{i}: {line[max(0, m.start() - 30):m.end() + 10]!r}" for m in TYPED.finditer(line)]
    assert not typed, "measured figures typed by hand (put them between number markers):\n" + "\n".join(typed)


def test_render_and_strip():
    torch = qn.value("torch")
    text = "asks for <!--n torch-->torch>=0.1<!--/n--> and <!--n code torch-->x<!--/n-->.\n"
    assert qn.render(text) == f"asks for <!--n torch-->{torch}<!--/n--> and <!--n code torch-->`{torch}`<!--/n-->.\n"
    assert qn.strip(text) == f"asks for {torch} and `{torch}`.\n"


@pytest.mark.parametrize("text,error", [
    ("<!--n torch-->x<!--/n--> first on its line\n", "starts the line"),
    ("a <!--n torch-->x\n", "not closed"),
    ("a <!--n no-such-key-->x<!--/n-->\n", "not a key"),
    ("a <!--n get decode_speed rows[model=nothing].step_ms .2f-->x<!--/n-->\n", "matches nothing"),
    ("a <!--n exp windowed nothing val_loss pm3-->x<!--/n-->\n", "no variant 'nothing'"),
    ("a <!--n verdict windowed nothing-->x<!--/n-->\n", "0 verdicts named 'nothing'"),
])
def test_bad_markers_are_refused(text, error):
    with pytest.raises(qn.NumberError, match=re.escape(error)):
        qn.render(text, "page.md")


def test_write_mode(tmp_path, capsys):
    page = tmp_path / "page.md"
    page.write_text("torch: <!--n torch-->torch>=0.1<!--/n-->\n", encoding="utf-8")
    assert qn.main([str(page)]) == 1
    assert "has 'torch>=0.1'" in capsys.readouterr().out
    assert qn.main(["--write", str(page)]) == 0
    assert page.read_text(encoding="utf-8") == f"torch: <!--n torch-->{qn.value('torch')}<!--/n-->\n"
    assert qn.main([str(page)]) == 0


# --------------------------------------------------------------------------- the committed reports

REPORTS = sorted(p for p in (ROOT / "experiments").rglob("report.md")
                 if "runs" not in p.relative_to(ROOT).parts)


def kind(report: Path) -> str:
    """Which command made a report, from its opening lines."""
    head = report.read_text(encoding="utf-8")[:400]
    for command, name in (("attnlab sweep", "sweep"), ("attnlab search trial", "search"),
                          ("attnlab retrofit trial", "retrofit"), ("attnlab.experiments.scalings", "scalings")):
        if command in head:
            return name
    raise AssertionError(f"{report.relative_to(ROOT)}: no known command made it")


class _NoPlot(Exception):
    """Raised at a plot function's first pyplot call: it would have drawn."""


def _no_pyplot():
    raise _NoPlot


def _dry(plot):
    """The plot function, stopped before it draws: True where it would have drawn, else its return."""
    def dry(*args, **kwargs):
        try:
            return plot(*args, **kwargs)
        except _NoPlot:
            return True
    return dry


@pytest.fixture
def no_plots(monkeypatch):
    """The report code with its plots stopped before drawing, and a retrofit trial's spec read without
    its model's config (the layer plan checks it against the model; the report does not need it)."""
    import attnlab.experiments.report as report
    import attnlab.experiments.search_trial as search_trial
    import attnlab.experiments.sweep.profiles as profiles
    import attnlab.experiments.sweep.results as results
    import attnlab.experiments.scalings as scalings
    import attnlab.retrofit.finetune  # noqa: F401
    import attnlab.retrofit.io  # noqa: F401

    monkeypatch.setattr(report, "pyplot", _no_pyplot)
    monkeypatch.setattr(profiles, "pyplot", _no_pyplot)
    for module, name in ((profiles, "plot_lengths"), (profiles, "plot_indexed"), (results, "plot_curves"),
                         (results, "plot_metrics"), (results, "plot_steps")):
        monkeypatch.setattr(module, name, _dry(getattr(module, name)))
    monkeypatch.setattr(search_trial, "plot_coverage", lambda *a, **k: None)
    monkeypatch.setattr(scalings, "plot", lambda *a, **k: None)
    monkeypatch.setattr(sys.modules["attnlab.retrofit.io"], "plan_source", lambda *a, **k: (None, None))
    monkeypatch.setattr(sys.modules["attnlab.retrofit.finetune"], "check_trainable", lambda *a, **k: None)


def rebuilt_text(report: Path) -> str:
    """The report's text as its report code makes it from the committed results.json."""
    folder, res = report.parent, json.loads((report.parent / "results.json").read_text(encoding="utf-8"))
    spec_path = folder / "spec.toml"
    match kind(report):
        case "sweep":
            from attnlab.experiments.sweep import load_spec
            from attnlab.experiments.sweep.report import report_markdown
            from attnlab.experiments.sweep.results import _trained_by, plot_metrics

            spec = load_spec(spec_path)
            trained_by = _trained_by(spec, folder)[0]
            assert res["command"] == trained_by, (
                f"{folder.relative_to(ROOT)}/results.json names {res['command']!r}; a --report-only rebuild names "
                f"{trained_by!r} (the command that trains the runs)")
            drawn = plot_metrics(spec, res, folder / "metrics.png")
            return report_markdown(spec, res, folder, drawn is not None) + "\n"
        case "search":
            from attnlab.experiments.search_trial import load_trial, report_markdown

            trial = load_trial(spec_path)
            return report_markdown(trial, _with_unrun(trial, res["variants"]), res["verdicts"])
        case "retrofit":
            from attnlab.experiments.retrofit_report import report_markdown
            from attnlab.experiments.retrofit_trial import load_trial

            trial = load_trial(spec_path)
            return report_markdown(trial, _with_unrun(trial, res["variants"]), res["per_layer"], res["verdicts"])
        case "scalings":
            from attnlab.experiments.scalings import report as scalings_report

            return scalings_report(res, folder) + "\n"


def _with_unrun(trial, stats: dict) -> dict:
    """A trial's recorded statistics, with what a rebuild finds for a variant the spec names but
    results.json does not hold (no finished seed), as the trial's own `collect` gives it."""
    from attnlab.experiments.trial import seed_stats

    return {**stats, **{v: seed_stats({}) for v in trial.variants if v not in stats}}


def test_reports_found():
    kinds = {kind(r) for r in REPORTS}
    assert kinds == {"sweep", "search", "retrofit", "scalings"} and len(REPORTS) >= 30, kinds


@pytest.mark.parametrize("report", REPORTS, ids=[r.parent.relative_to(ROOT / "experiments").as_posix() for r in REPORTS])
def test_report_is_its_results_rebuilt(report, no_plots, monkeypatch):
    monkeypatch.chdir(ROOT)  # the rebuild command a report shows is relative to the working folder
    rebuilt = rebuilt_text(report)
    committed = report.read_text(encoding="utf-8")
    if rebuilt != committed:
        old, new = committed.splitlines(), rebuilt.splitlines()
        at = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
        pytest.fail(f"{report.relative_to(ROOT)} is not what its results.json rebuilds (line {at + 1}):\n"
                    f"  committed: {old[at] if at < len(old) else '(end)'}\n"
                    f"  rebuilt:   {new[at] if at < len(new) else '(end)'}\n"
                    f"rebuild it with the command on its third line")


@pytest.mark.slow
def test_report_only_rebuild_changes_nothing(tmp_path, no_plots, monkeypatch):
    """What `--report-only` writes on a fresh clone (no run folders: the committed results stand for
    the runs) is the committed results.json and report.md, for every report."""
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    for f in (ROOT / "experiments").rglob("*"):
        rel = f.relative_to(ROOT)
        # a spec's carried corpus (experiments/seed000/window-language-at-scale/corpus) is read at its path
        if f.is_file() and (f.suffix in (".toml", ".json") or "corpus" in rel.parts) and "runs" not in rel.parts:
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, tmp_path / rel)
    monkeypatch.chdir(tmp_path)
    from attnlab.experiments import retrofit_report, retrofit_trial, scalings, search_trial
    from attnlab.experiments.sweep import load_spec, write_results

    changed = []
    for report in REPORTS:
        rel = report.parent.relative_to(ROOT)
        match kind(report):
            case "sweep":
                write_results(load_spec(rel / "spec.toml"), rel, report_only=True)
            case "search":
                search_trial.write_report(search_trial.load_trial(rel / "spec.toml"))
            case "retrofit":
                retrofit_report.write_report(retrofit_trial.load_trial(rel / "spec.toml"))
            case "scalings":
                scalings.run(rel, report_only=True)
        for name in ("report.md", "results.json"):
            new, old = (tmp_path / rel / name).read_text(encoding="utf-8"), (ROOT / rel / name).read_text(encoding="utf-8")
            if (json.loads(new) != json.loads(old)) if name.endswith(".json") else new != old:
                changed.append(f"{rel}/{name}")
    assert not changed, f"a --report-only rebuild changes {changed}"


def test_report_only_restores_a_report_edited_by_hand(tmp_path, monkeypatch):
    """`attnlab sweep SPEC --report-only` writes report.md from results.json every time, so a committed
    report edited by hand (a verdict typed over) does not survive a rebuild; its plots, the results being
    those on disk, are left as they are."""
    exp = Path("experiments") / "seed004" / "claims"
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    shutil.copytree(ROOT / exp, tmp_path / exp, ignore=shutil.ignore_patterns("runs"))
    monkeypatch.chdir(tmp_path)
    report, committed = exp / "report.md", (ROOT / exp / "report.md").read_text(encoding="utf-8")
    pngs = {p.name: p.read_bytes() for p in (tmp_path / exp).glob("*.png")}
    edited = committed.replace("**supported**", "**not supported**").replace("inconclusive", "supported")
    assert edited != committed
    report.write_text(edited, encoding="utf-8")
    from attnlab.cli import main

    assert main(["sweep", str(exp / "spec.toml"), "--report-only", "--no-progress"]) == 0
    assert report.read_text(encoding="utf-8") == committed
    assert {p.name: p.read_bytes() for p in (tmp_path / exp).glob("*.png")} == pngs
