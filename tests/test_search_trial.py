"""`attnlab search trial`: spec checks before any work, seeds x variants trained and evaluated once,
mean ± sd and verdicts from the runs' own results, resuming without new work."""

import json
import shutil
import statistics

import pytest

import attnlab.experiments.search_trial as trial_mod
from attnlab.cli import main
from attnlab.models.config import ConfigError
from attnlab.search.lm import tiny_lm
from attnlab.experiments.search_trial import load_trial, run_trial


@pytest.fixture(scope="module")
def corpus(code_corpus):
    return code_corpus


def spec(tmp_path, corpus, extra=""):
    text = f'''title = "rows"
claim = "subsampled rows train as well"
seeds = [0, 1]
[train]
model = "tiny"
layers = "2,5"
d_search = 8
context = 32
n_contexts = 2
corpus = "{corpus}"
split = "all"
steps = 3
log_every = 1
eval_k = 4
warmup = 1
[eval]
layer_sets = ["2,5"]
ks = [4, 8]
methods = ["learned", "oracle"]
context = 40
n_contexts = 1
corpus = "{corpus}"
split = "all"
[[variants]]
name = "some"
train = {{ query_rows = 8 }}
[[verdict]]
metric = "learned/mass@4"
better = "higher"
variant = "some"
threshold = 0.0
{extra}'''
    path = tmp_path / "spec.toml"
    path.write_text(text)
    return path


@pytest.mark.heavy
def test_trial_trains_evaluates_and_reports(tmp_path, corpus, monkeypatch):
    lm = tiny_lm("llama")
    trial = load_trial(spec(tmp_path, corpus))
    assert [(r.variant, r.seed) for r in trial.runs] == [("some", 0), ("some", 1)]
    assert trial.runs[1].train.query_rows == 8 and trial.runs[1].train.seed == 1 and trial.runs[1].eval.seed == 0
    evals = []
    real = trial_mod.run_eval
    monkeypatch.setattr(trial_mod, "run_eval", lambda cfg, **kw: evals.append(cfg.methods) or real(cfg, **kw))
    res = run_trial(trial, lm=lm, progress=False)
    assert evals == [["learned", "oracle"], ["learned"]]  # oracle once per variant
    assert len(list((tmp_path / "runs" / "full").glob("full-*.json"))) == 1  # full attention once per trial
    for v in ("some",):
        st = res["variants"][v]
        assert st["seeds"] == [0, 1]
        xs = [st["runs"][s]["learned/mass@4"] for s in ("0", "1")]
        assert st["mean"]["learned/mass@4"] == pytest.approx(statistics.fmean(xs))
        assert st["sd"]["learned/mass@4"] == pytest.approx(statistics.stdev(xs))
        assert st["runs"]["0"]["oracle/mass@4"] == st["runs"]["1"]["oracle/mass@4"] and st["sd"]["oracle/mass@4"] == 0
        own = json.loads((tmp_path / "runs" / v / "seed1" / "eval" / "results.json").read_text())
        (row,) = [r for r in own["rows"] if r["method"] == "learned" and r["K"] == 8]
        assert st["runs"]["1"]["learned/gap@8"] == pytest.approx(100 * row["rel_gap"])
    assert res["verdicts"][0]["outcome"] == "supported"  # some mass is kept, beyond 2 sd of 0
    report = (tmp_path / "report.md").read_text()
    assert "| variant" in report and "How a rule is judged" in report and "query rows 8" in report
    evals.clear()
    again = run_trial(load_trial(tmp_path / "spec.toml"), lm=lm, progress=False)  # finished: no new work
    assert evals == [] and again["variants"] == json.loads(json.dumps(res["variants"]))
    # a fresh clone has spec.toml and results.json, not runs/: --report-only keeps every recorded result
    shutil.rmtree(tmp_path / "runs")
    rebuilt = run_trial(load_trial(tmp_path / "spec.toml"), lm=lm, progress=False, report_only=True)
    assert evals == [] and rebuilt["variants"] == again["variants"] and rebuilt["verdicts"] == again["verdicts"]


@pytest.mark.parametrize("extra, words", [
    ("[other]\nx = 1\n", ["unknown key", "other"]),
    ('[[variants]]\nname = "some"\n', ["variants[1].name", "unique"]),
    ('[[variants]]\nname = "bad"\ntrain = { steps = 0 }\n', ["variant 'bad'", "steps"]),
    ('[[variants]]\nname = "own"\ntrain = { seed = 3 }\n', ["train.seed", "owned"]),
    ('[[variants]]\nname = "ks"\neval = { ks = [0] }\n', ["variant 'ks'", "K must be"]),
])
def test_bad_specs_fail_before_any_work(tmp_path, corpus, extra, words):
    with pytest.raises(ConfigError) as e:
        load_trial(spec(tmp_path, corpus, extra))
    assert all(w in str(e.value) for w in words), str(e.value)
    assert not (tmp_path / "runs").exists()


def test_bad_verdict_metric_and_cli_error(tmp_path, corpus, capsys):
    path = spec(tmp_path, corpus)
    path.write_text(path.read_text().replace('metric = "learned/mass@4"', 'metric = "learned/mass@99"'))
    with pytest.raises(ConfigError, match="verdict"):
        load_trial(path)
    assert main(["search", "trial", str(path)]) == 2
    assert "mass@99" in capsys.readouterr().err and not (tmp_path / "runs").exists()


def test_index_options_take_their_older_spelling(tmp_path, corpus):
    """nlist, nprobe and ef_search in [eval] (shared or a variant's) are ivf_nlist, ivf_nprobe and
    hnsw_ef_search, checked as those; an option in both spellings, or an old name a section does not
    spell the new way, is refused naming the keys."""
    old = '[[variants]]\nname = "old"\neval = { nlist = 8, nprobe = 2, ef_search = 64 }\n'
    new = '[[variants]]\nname = "old"\neval = { ivf_nlist = 8, ivf_nprobe = 2, hnsw_ef_search = 64 }\n'
    runs = {t: [r.eval for r in load_trial(spec(tmp_path, corpus, t)).runs if r.variant == "old"] for t in (old, new)}
    assert runs[old] == runs[new] and [(e.ivf_nlist, e.ivf_nprobe, e.hnsw_ef_search) for e in runs[old]] == [(8, 2, 64)] * 2
    path = spec(tmp_path, corpus)
    path.write_text(path.read_text().replace("[eval]\n", "[eval]\nnprobe = 4\n"))
    assert {r.eval.ivf_nprobe for r in load_trial(path).runs} == {4}
    errors = {}
    for name, extra in (("old", "eval = { nlist = 8, nprobe = 9 }"), ("new", "eval = { ivf_nlist = 8, ivf_nprobe = 9 }"),
                        ("both", "eval = { nprobe = 2, ivf_nprobe = 2 }"), ("train", "train = { nprobe = 2 }")):
        with pytest.raises(ConfigError) as e:
            load_trial(spec(tmp_path, corpus, f'[[variants]]\nname = "bad"\n{extra}\n'))
        errors[name] = str(e.value)
    assert errors["old"] == errors["new"] == "variant 'bad', seed 0: eval: nprobe (9) must be at most nlist (8)"
    assert errors["both"] == ("variant 'bad', seed 0: eval.nprobe and eval.ivf_nprobe are one option (nprobe is its "
                              "older spelling); give eval.ivf_nprobe only")
    assert errors["train"].startswith("variant 'bad', seed 0: unknown or owned key train.nprobe; allowed:")
    assert not (tmp_path / "runs").exists()


COVERAGE = '''[[variants]]
name = "frontier"
train = { query_rows = 8 }
eval = { layer_sets = ["5", "2,5"], wide_layers = "2", wide_factor = 2 }
[[references]]
label = "paper, every layer"
coverage = 1.0
gap = 3.23
'''


@pytest.mark.heavy
def test_eval_only_variants_share_training_and_report_a_coverage_frontier(tmp_path, corpus, monkeypatch):
    lm = tiny_lm("llama")
    path = spec(tmp_path, corpus, COVERAGE)
    path.write_text(path.read_text().replace("seeds = [0, 1]", "seeds = [0]"))
    trial = load_trial(path)
    some, front = trial.runs
    assert front.train.out == some.train.out and front.eval.checkpoint == some.eval.checkpoint
    assert front.eval.out != some.eval.out and trial.references[0]["gap"] == 3.23
    trained = []
    real = trial_mod.train_projections
    monkeypatch.setattr(trial_mod, "train_projections",
                        lambda cfg, **kw: trained.append(real(cfg, **kw)["resumed_from"]))
    res = run_trial(trial, lm=lm, progress=False)
    assert trained == [0, 3]  # the second variant finds the first one's finished training
    st = res["variants"]["frontier"]
    cov = st["coverage"]
    assert cov["n_layers"] == 8 and cov["sets"] == {"5": 1, "2,5": 2}
    assert set(cov["per_layer_mass"]) == {"learned K=4", "learned K=8", "oracle K=4", "oracle K=8"}
    assert set(cov["per_layer_mass"]["oracle K=4"]) == {"2", "5"}
    assert "2,5:learned/gap@8" in st["mean"] and "learned/gap@8" in res["variants"]["some"]["mean"]
    own = json.loads((tmp_path / "runs" / "frontier" / "seed0" / "eval" / "results.json").read_text())
    assert {(r["layer_set"], r["K"], tuple(r["wide_layers"]), r["wide_K"]) for r in own["rows"]} >= {
        ("2,5", 4, (2,), 8), ("5", 4, (), 8)}
    report = (tmp_path / "report.md").read_text()
    assert "## Coverage frontier: frontier" in report and "| 2,5" in report and "paper, every layer: 3.23" in report
    assert "| layer | learned K=4" in report
    assert (tmp_path / "coverage.png").stat().st_size > 1000
    # rules may name a layer set's metrics when a variant has several
    path.write_text(path.read_text() + '[[verdict]]\nmetric = "2,5:learned/gap@8"\nbetter = "lower"\n'
                    'variant = "frontier"\nthreshold = 100.0\n')
    assert load_trial(path).rules[-1]["metric"] == "2,5:learned/gap@8"


@pytest.mark.parametrize("ref", ['label = "x"\ncoverage = 1.5\ngap = 1.0', 'label = "x"\ngap = 1.0'])
def test_bad_reference_fails_before_work(tmp_path, corpus, ref):
    with pytest.raises(ConfigError, match=r"references\[0\]"):
        load_trial(spec(tmp_path, corpus, f"[[references]]\n{ref}\n"))
    assert not (tmp_path / "runs").exists()


def test_full_baseline_is_computed_once_per_model_and_contexts(tmp_path, corpus, monkeypatch):
    import attnlab.search.sweep as sweep_mod
    from attnlab.search.capture import pack_contexts

    lm = tiny_lm("llama")
    texts = ["def f(x):\n    return x\n" * 3, "class A:\n    pass\n" * 4]
    packed = pack_contexts(texts, lm.encode, lm.eos_id, context=24, n_contexts=2, seed=None)
    calls = []
    real = sweep_mod.forward_packed
    monkeypatch.setattr(sweep_mod, "forward_packed", lambda m, b: calls.append(1) or real(m, b))
    plain = sweep_mod.full_baseline(lm, packed)
    first = sweep_mod.full_baseline(lm, packed, tmp_path)
    assert len(calls) == 4 and first == plain and len(list(tmp_path.glob("full-*.json"))) == 1
    assert sweep_mod.full_baseline(lm, packed, tmp_path) == plain and len(calls) == 4  # read back
    other = pack_contexts(texts[::-1], lm.encode, lm.eos_id, context=24, n_contexts=2, seed=None)
    sweep_mod.full_baseline(lm, other, tmp_path)  # other tokens: another file
    assert len(calls) == 6 and len(list(tmp_path.glob("full-*.json"))) == 2


def test_trial_launcher_options_are_checked_before_any_work(tmp_path, corpus, capsys):
    pytest.importorskip("submitit")
    path = spec(tmp_path, corpus)
    for bad, words in ((["--launcher", "local", "--slurm-time", "5"], "needs --launcher slurm"),
                       (["--launcher", "local", "--report-only"], "--report-only"),
                       (["--launcher", "slurm"], "not on PATH")):
        assert main(["search", "trial", str(path), *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and words in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.toml"]


@pytest.mark.slow
def test_trial_through_the_local_launcher_equals_the_trial_in_one_process(tmp_path, corpus):
    """`attnlab search trial --launcher local`: one submitit job per training folder (real subprocesses,
    each loading the model from a folder), the same results as the trial run in this process."""
    pytest.importorskip("submitit")
    model = tmp_path / "model"  # a folder the jobs load the model from, as they would a real one
    tiny_lm("llama").model.save_pretrained(model)
    from attnlab.data.tokenizer import ByteTokenizer
    from attnlab.hf.tokenizer import hf_tokenizer

    hf_tokenizer(ByteTokenizer(), None).save_pretrained(model)
    paths = {}
    for name in ("here", "jobs"):
        (tmp_path / name).mkdir()
        paths[name] = spec(tmp_path / name, corpus)
        paths[name].write_text(paths[name].read_text().replace('model = "tiny"', f'model = "{model.as_posix()}"'))
    here = run_trial(load_trial(paths["here"]), progress=False)
    path = paths["jobs"]
    assert main(["search", "trial", str(path), "--launcher", "local"]) == 0
    jobs = json.loads((tmp_path / "jobs" / "results.json").read_text())
    assert jobs["variants"]["some"]["runs"] == here["variants"]["some"]["runs"]
    assert sorted(json.loads((tmp_path / "jobs" / "submitit" / "jobs.json").read_text())) == [
        "runs/some/seed0", "runs/some/seed1"]
