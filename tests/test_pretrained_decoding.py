"""The decoding comparison on a pretrained model (`attnlab search compare`,
`attnlab.experiments.pretrained_decoding`): its intervals and rules, its spec checks, and a smoke
run on a tiny random Llama saved with a byte-level tokenizer that takes every method path: full
attention, learned search (exact and HNSW), Quest, StreamingLLM and the sorted scalar selection in
this environment, and kvpress's five presses in .venv-kvpress (skipped, with the reason, where that
environment is missing). A smoke run's numbers are no result."""

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from attnlab.experiments.pretrained_decoding import load_spec, merge, run, write_report
from attnlab.experiments.pretrained_decoding.plan import plan
from attnlab.experiments.pretrained_decoding.runner import kvpress_python, recorded
from attnlab.experiments.pretrained_decoding.verdict import cell_outcome, judge, newcombe, wilson
from attnlab.models.config import ConfigError
from attnlab.search.decode_items import combos
from attnlab.search.records import append_record, read_records

PRESSES = ["streaming_llm", "snapkv", "tova", "knorm", "expected_attention"]
ATTNLAB = ["full", "learned", "learned-hnsw", "quest", "streaming", "sorted"]

SPEC = """title = "smoke"
claim = "a smoke run of the code paths"
model = "{model}"
lengths = [512, 640]
budgets = [16, 64]

[tasks]
depths = [0.5]
n_examples = 2

[perplexity]
n_contexts = 1
continuation = 8
corpus = "stdlib"
split = "val"

[timing]
steps = 2
rounds = 2

[train.learned]
layers = "all"
groups = "kv"
d_search = 8
context = 128
n_contexts = 2
steps = 2
checkpoint_every = 1
activations = "memory"

[train.sorted]
layers = "all"
groups = "kv"
d_search = 1
score = "distance"
rope = false
context = 128
n_contexts = 2
steps = 2
checkpoint_every = 1
activations = "memory"

[[rules]]
name = "learned beats every press"
kind = "beats"
method = "learned"
against = {presses}

[[rules]]
name = "sorted within 0.1 of learned"
kind = "within"
method = "sorted"
of = "learned"
margin = 0.1
"""


# ------------------------------------------------------------------ intervals and rules (no model)


def test_wilson_and_newcombe_intervals():
    assert wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson(0, 0) == (0.0, 1.0)
    # Newcombe (1998), method 10, his example 56/70 - 48/80: 0.0524 to 0.3339
    assert newcombe(56, 70, 48, 80) == pytest.approx((0.0524, 0.3339), abs=1e-4)


def test_rules_in_a_cell():
    beats = {"kind": "beats", "method": "a", "against": ["b", "c"]}
    assert cell_outcome(beats, {"a": (50, 50), "b": (20, 50), "c": (30, 50)})[0] == "supported"
    assert cell_outcome(beats, {"a": (45, 50), "b": (40, 50), "c": (10, 50)})[0] == "inconclusive"
    assert cell_outcome(beats, {"a": (10, 50), "b": (45, 50), "c": (10, 50)})[0] == "not supported"
    assert cell_outcome(beats, {"a": (0, 0), "b": (0, 0), "c": (0, 0)})[0] == "inconclusive"
    within = {"kind": "within", "method": "s", "of": "a", "margin": 0.1}
    assert cell_outcome(within, {"s": (149, 150), "a": (150, 150)})[0] == "supported"
    assert cell_outcome(within, {"s": (60, 150), "a": (150, 150)})[0] == "not supported"
    assert cell_outcome(within, {"s": (9, 10), "a": (10, 10)})[0] == "inconclusive"


def test_judge_needs_every_cell_of_a_budget():
    rule = {"kind": "beats", "method": "a", "against": ["b"]}
    good = {"a": (50, 50), "b": (0, 50)}
    cells = {("passkey", 2048, 64): good, ("passkey", 4096, 64): good, ("passkey", 2048, 128): good}
    v = judge(rule, cells, [64, 128], [2048, 4096], ["passkey"])
    assert v["by_budget"] == {64: "supported", 128: "inconclusive"} and v["outcome"] == "inconclusive"
    assert [c["outcome"] for c in v["cells"]].count("missing") == 1
    cells[("passkey", 4096, 128)] = {"a": (0, 50), "b": (50, 50)}
    assert judge(rule, cells, [64, 128], [2048, 4096], ["passkey"])["outcome"] == "not supported"


def test_records_keep_whole_lines_only(tmp_path):
    path = tmp_path / "r.jsonl"
    append_record(path, {"item": "a", "side": "attnlab", "x": 1})
    append_record(path, {"item": "b", "side": "attnlab", "x": 2})
    with open(path, "a") as f:
        f.write('{"item": "c", "side": "attn')  # a write cut short
    assert [r["item"] for r in read_records([tmp_path])] == ["a", "b"]


# ------------------------------------------------------------------ the spec


def write_spec(folder: Path, model: str, **replace) -> Path:
    text = SPEC.format(model=model, presses=json.dumps(PRESSES))
    for old, new in replace.items():
        text = text.replace(old, new)
    path = folder / "spec.toml"
    path.write_text(text)
    return path


def test_spec_checks_name_the_key(tmp_path):
    ok = load_spec(write_spec(tmp_path, "smollm2"))
    assert ok.budgets == [16, 64] and set(ok.train) == {"learned", "sorted"}
    for change, message in [({'title = "smoke"': 'title = "smoke"\nwindow = 3'}, "unknown key"),
                            ({"d_search = 1\n": "d_search = 2\n"}, r"\[train.sorted\] must set d_search = 1"),
                            ({'of = "learned"': 'of = "oracle"'}, "of must be one of"),
                            ({"budgets = [16, 64]": "budgets = [16, 1024]"}, "below the shortest length"),
                            ({"n_examples = 2": "n_examples = 2\nwidth = 4"}, r"\[tasks\]: unknown key")]:
        with pytest.raises(ConfigError, match=message):
            load_spec(write_spec(tmp_path, "smollm2", **change))


def test_settings_cover_what_records_depend_on(tmp_path):
    base = load_spec(write_spec(tmp_path, "smollm2")).settings()
    assert load_spec(write_spec(tmp_path, "smollm2", **{'title = "smoke"': 'title = "other"',
                                                         "margin = 0.1": "margin = 0.2"})).settings() == base
    assert load_spec(write_spec(tmp_path, "smollm2", **{"n_examples = 2": "n_examples = 3"})).settings() != base
    assert load_spec(write_spec(tmp_path, "smollm2", **{"steps = 2\ncheckpoint_every = 1\nactivations = \"memory\"\n\n"
                                                         "[train.sorted]": "steps = 3\ncheckpoint_every = 1\n"
                                                         "activations = \"memory\"\n\n[train.sorted]"})).settings() != base


# ------------------------------------------------------------------ the smoke run


def save_tiny(folder: Path) -> None:
    """A 2-layer random Llama and a byte-level tokenizer (ids 3..258, EOS 2) that both transformers
    versions load."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from attnlab.search.hf_model import tiny_model

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab, [], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(folder)
    tiny_model(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2).save_pretrained(folder)


def has_kvpress() -> bool:
    python = kvpress_python()
    return python.is_file() and subprocess.run([str(python), "-c", "import kvpress"], capture_output=True).returncode == 0


needs_kvpress = pytest.mark.skipif(not has_kvpress(), reason=f"kvpress is not installed ({kvpress_python()} is "
                                                             "missing or cannot import it; `make kvpress-env`)")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The attnlab side of the smoke spec, run as a batch into its own records folder and merged."""
    root = tmp_path_factory.mktemp("smoke")
    save_tiny(root / "tiny")
    spec = load_spec(write_spec(root, str(root / "tiny")))
    batch = root / "batch"
    ran = run(spec, ["attnlab"], records=batch, device="cpu", progress=False)
    return spec, batch, ran


@pytest.mark.heavy
def test_every_attnlab_method_records_every_item(smoke):
    spec, batch, ran = smoke
    items = plan(spec)
    assert ran == {"attnlab": len(items)} and {it["kind"] for it in items} == {"task", "ppl", "time"}
    recs = recorded(spec, items, [batch])
    names = {f"{m}@{K}" if K else m for m, K in combos(ATTNLAB, spec.budgets)}
    for it in items:
        r = recs["attnlab", it["id"]]["results"]
        assert set(r) == names, it["id"]
        if it["kind"] == "task":
            assert all(v["asked"] == len(it["labels"]) and v["solved"] in (0, 1) for v in r.values())
        elif it["kind"] == "ppl":
            assert all(v["tokens"] == 8 and math.isfinite(v["nll"]) and v["nll"] > 0 for v in r.values())
        else:
            assert all(len(v["ms"]) == 4 for v in r.values())  # 2 steps x 2 rounds
            assert all(n > 0 for n in r["sorted@16"]["sorted_reads"]) and sum(r["learned-hnsw@64"]["hnsw_ndis"]) > 0
            assert sum(r["learned@16"]["sorted_reads"]) == 0
    ppl = [recs["attnlab", it["id"]]["results"] for it in items if it["kind"] == "ppl"]
    assert all(p["learned@16"]["nll"] != p["full"]["nll"] for p in ppl)  # 16 of 512 keys: a real budget


@pytest.mark.heavy
def test_a_rerun_skips_what_is_recorded_and_redoes_a_cut_item(smoke, tmp_path):
    spec, batch, _ = smoke
    again = tmp_path / "again"
    again.mkdir()
    lines = (batch / "attnlab.jsonl").read_text().splitlines(keepends=True)
    (again / "attnlab.jsonl").write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])  # cut mid-write
    ran = run(spec, ["attnlab"], records=again, device="cpu", progress=False)
    assert ran == {"attnlab": 1}
    got = read_records([again])
    assert [r["item"] for r in got] == [json.loads(line)["item"] for line in lines]


@pytest.mark.heavy
def test_merge_and_report(smoke):
    spec, batch, _ = smoke
    first = merge(spec, [batch])
    assert first["added"] == len(plan(spec)) and first["foreign"] == 0
    assert merge(spec, [batch]) == {"added": 0, "known": first["added"], "foreign": 0}
    foreign = batch.parent / "foreign"
    rec = json.loads((batch / "attnlab.jsonl").read_text().splitlines()[0])
    append_record(foreign / "x.jsonl", {**rec, "settings": "0" * 12})
    append_record(foreign / "x.jsonl", {**rec, "sha": "0" * 16})
    assert merge(spec, [foreign])["foreign"] == 2
    res = write_report(spec)
    text = (spec.folder / "report.md").read_text()
    for part in ("## Verdicts", "## Which selector at which budget", "## Perplexity of continuations",
                 "## Decode step", "| learned-hnsw"):
        assert part in text, part
    expect_partial = not has_kvpress() or not (spec.folder / "records" / "presses.jsonl").exists()
    assert ("Partial" in text) == expect_partial and res["complete"] == (not expect_partial)
    assert (spec.folder / "accuracy_vs_budget.png").is_file()


@pytest.mark.heavy
def test_presses_are_skipped_with_a_message_without_kvpress(smoke, tmp_path, monkeypatch, capsys):
    spec, _, _ = smoke
    monkeypatch.setenv("ATTNLAB_KVPRESS_PYTHON", str(tmp_path / "missing" / "python"))
    assert run(spec, ["presses"], records=tmp_path / "none", device="cpu", progress=False) == {"presses": None}
    assert "kvpress is not installed" in capsys.readouterr().err and not (tmp_path / "none").exists()


@pytest.mark.heavy
@needs_kvpress
def test_every_press_records_every_item_through_kvpress(smoke):
    spec, batch, _ = smoke
    ran = run(spec, ["presses"], records=batch, device="cpu", progress=False)
    items = plan(spec)
    assert ran == {"presses": len(items)}
    recs = recorded(spec, items, [batch])
    names = {"full"} | {f"{p}@{K}" for p in PRESSES for K in spec.budgets}
    for it in items:
        r, mine = recs["presses", it["id"]]["results"], recs["attnlab", it["id"]]["results"]
        assert set(r) == names, it["id"]
        if it["kind"] == "ppl":  # full attention in both environments: the same model on the same tokens
            assert r["full"]["nll"] == pytest.approx(mine["full"]["nll"], rel=1e-5)
            assert all(r[f"{p}@16"]["nll"] != r["full"]["nll"] for p in PRESSES)
        if it["kind"] == "time":
            assert all(len(v["ms"]) == 4 for v in r.values()) and r["snapkv@16"]["kept"] == 16


@pytest.mark.heavy
@needs_kvpress
def test_one_prefill_replayed_per_press_is_what_kvpress_leaves(smoke, tmp_path):
    """`with press(model): model.model(ids, past_key_values=cache)` against the press's own hook
    replayed on one recorded prefill: the same keys and values, bit for bit, for every press."""
    import torch

    from attnlab.search.records import save_work

    spec, _, _ = smoke
    ids = torch.randint(3, 259, (300,), generator=torch.Generator().manual_seed(0))
    work = tmp_path / "work.pt"
    save_work(work, {"model": spec.model, "device": "cpu", "dtype": "float32", "budgets": [16, 200],
                     "items": [{"id": "x", "kind": "task", "ids": ids, "split": 300}]})
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    out = subprocess.run([str(kvpress_python()), "-m", "attnlab.search.presses", "--work", str(work), "--records",
                          str(tmp_path / "r.jsonl"), "--self-check"], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(report) == {f"{p}@{K}" for p in PRESSES for K in (16, 200)}
    for name, r in report.items():
        assert r["equal"] and r["kept"] == [int(name.split("@")[1])] * 2, (name, r)


@pytest.mark.heavy
def test_the_command_line_reports_and_refuses_bad_options(smoke, capsys):
    from attnlab.cli import main

    spec, _, _ = smoke
    assert main(["search", "compare", str(spec.path), "--report-only"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["search", "compare", str(spec.path), "--side", "elsewhere"]) == 2
    assert "--side must name" in capsys.readouterr().err


def test_threads_are_refused_before_any_work(tmp_path, capsys):
    """A bad thread count names the argument before anything is planned or written (the model folder
    does not even exist), from Python and from the command line."""
    from attnlab.cli import main

    spec = load_spec(write_spec(tmp_path, str(tmp_path / "no-model")))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="threads must be an int >= 1"):
            run(spec, ["attnlab"], records=tmp_path / "out", threads=bad)
    assert main(["search", "compare", str(spec.path), "--threads", "0", "--records", str(tmp_path / "out")]) == 2
    assert "--threads must be >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (spec.folder / "records").exists()


@pytest.mark.heavy
@needs_kvpress
def test_both_sides_run_on_the_threads_given(smoke, tmp_path):
    """threads=1 reaches this process (the attnlab side, restored afterwards) and the kvpress worker;
    each record says how many threads scored it."""
    import shutil

    import torch

    spec, _, _ = smoke  # a copy of its folder with its trained projections and none of its records
    shutil.copy(spec.path, tmp_path / "spec.toml")
    shutil.copytree(spec.folder / "runs", tmp_path / "runs")
    spec = load_spec(tmp_path / "spec.toml")
    item = [it for it in plan(spec) if it["kind"] == "ppl"][:1]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ran = run(spec, ["attnlab", "presses"], records=tmp_path / "out", only={"kinds": ["ppl"], "lengths": [item[0]["length"]]},
                  device="cpu", progress=False, threads=1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert ran == {"attnlab": 1, "presses": 1}
    assert [r["threads"] for r in read_records([tmp_path / "out"])] == [1, 1]


def test_the_worker_refuses_a_budget_it_cannot_keep():
    if not has_kvpress():
        pytest.skip("kvpress is not installed (`make kvpress-env`)")
    code = "from attnlab.search.presses import make_press; make_press('snapkv', 600, 512)"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    out = subprocess.run([str(kvpress_python()), "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode != 0 and "0 < K < context" in out.stderr


def test_compare_help_is_full(capsys):
    """`attnlab search compare --help`: what it does, with examples, and every option described."""
    import argparse

    from attnlab.cli import build_parser, main

    parser = build_parser()
    for word in ("search", "compare"):
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    assert "  attnlab search compare " in parser.description
    assert not [a.option_strings or a.dest for a in parser._actions if not a.help]
    with pytest.raises(SystemExit) as e:
        main(["search", "compare", "--help"])
    assert e.value.code == 0 and "--minutes" in capsys.readouterr().out


def test_projections_train_where_the_sweeps_runs_live(tmp_path, monkeypatch):
    """The projections' training folders are runs/<name> beside the spec, or, with $ATTNLAB_RUNS set,
    under it at the spec folder's path inside its checkout, as a sweep's run folders: a fresh clone
    finds the trained projections of an earlier one."""
    (tmp_path / "repo" / ".git").mkdir(parents=True)
    folder = tmp_path / "repo" / "exp"
    folder.mkdir()
    path = write_spec(folder, str(tmp_path / "no-model"))
    monkeypatch.delenv("ATTNLAB_RUNS", raising=False)
    assert {Path(c.out) for c in load_spec(path).train.values()} == {folder / "runs" / n for n in load_spec(path).train}
    monkeypatch.setenv("ATTNLAB_RUNS", str(tmp_path / "elsewhere"))
    spec = load_spec(path)
    assert {Path(c.out) for c in spec.train.values()} == {tmp_path / "elsewhere" / "exp" / "runs" / n for n in spec.train}
