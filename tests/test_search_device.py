"""Where learned search runs: --device / --dtype checked before any weights load (config, CLI,
trial specs), the frozen model in bf16 on the CPU through training and evaluation, and (on a GPU)
capture, training, evaluation and the long-context tasks on CUDA."""

import json
import math

import pytest
import torch

import attnlab.search.lm as lm_mod
import attnlab.search.tasks as tasks
from attnlab.cli import main
from attnlab.experiments.search_trial import load_trial
from attnlab.models.config import ConfigError
from attnlab.search.hf_model import resolve_device, resolve_dtype, tiny_model
from attnlab.search.sweep import EvalConfig, run_eval
from attnlab.search.tasks import TaskConfig
from attnlab.search.train import SearchTrainConfig, train_projections


@pytest.fixture(scope="module")
def corpus(code_corpus):
    return code_corpus


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama saved as a folder with a byte-level tokenizer: loaded as a real model is."""
    from attnlab.data.tokenizer import ByteTokenizer
    from attnlab.hf.tokenizer import hf_tokenizer

    folder = tmp_path_factory.mktemp("model")
    tiny_model("llama", n_layers=2).save_pretrained(folder)
    hf_tokenizer(ByteTokenizer(), None).save_pretrained(folder)
    return str(folder)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_device_and_dtype_resolve_or_name_the_field(no_cuda, monkeypatch):
    assert resolve_device("auto") == resolve_device("cpu") == torch.device("cpu")
    assert resolve_dtype("float32") is torch.float32 and resolve_dtype("bfloat16") is torch.bfloat16
    for make in (lambda **kw: SearchTrainConfig(**kw), lambda **kw: EvalConfig(model="m", methods=["quest"], **kw),
                 lambda **kw: TaskConfig(model="m", methods=["full"], **kw)):
        assert (make().device, make().dtype) == ("auto", "float32")
        with pytest.raises(ValueError, match=r"^device must be one of \('auto', 'cpu', 'cuda'\), got 'tpu'"):
            make(device="tpu")
        with pytest.raises(ValueError, match=r"^dtype must be one of \('float32', 'bfloat16'\), got 'float16'"):
            make(dtype="float16")
        with pytest.raises(ValueError, match=r"^device is 'cuda' but no CUDA device is available; use 'auto' or 'cpu'"):
            make(device="cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # nothing touches the GPU to resolve it
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda")
    assert SearchTrainConfig(device="cuda").device == "cuda"


def test_cli_options_become_the_config_fields():
    import argparse

    from attnlab.cli.search_commands import add_search_commands, eval_config, tasks_config, train_config

    parser = argparse.ArgumentParser()
    add_search_commands(parser.add_subparsers(dest="command"))
    where = ["--device", "cpu", "--dtype", "bfloat16"]
    for cfg in (train_config(parser.parse_args(["search", "train", *where])),
                eval_config(parser.parse_args(["search", "eval", "--checkpoint", "p", *where])),
                tasks_config(parser.parse_args(["search", "tasks", "--model", "m", "--methods", "full", *where]))):
        assert (cfg.device, cfg.dtype) == ("cpu", "bfloat16")
    cfg = tasks_config(parser.parse_args(["search", "tasks", "--model", "m", "--methods", "full"]))
    assert (cfg.device, cfg.dtype) == ("auto", "float32")


@pytest.mark.parametrize("argv, words", [
    (["train", "--device", "tpu"], ["attnlab search train:", "--device must be one of", "'tpu'"]),
    (["train", "--dtype", "float16"], ["attnlab search train:", "--dtype must be one of", "'float16'"]),
    (["train", "--device", "cuda"], ["attnlab search train:", "--device is 'cuda' but no CUDA device"]),
    (["eval", "--checkpoint", "p", "--device", "gpu"], ["attnlab search eval:", "--device must be one of"]),
    (["eval", "--checkpoint", "p", "--device", "cuda"], ["attnlab search eval:", "no CUDA device"]),
    (["eval", "--checkpoint", "p", "--dtype", "half"], ["attnlab search eval:", "--dtype must be one of"]),
    (["tasks", "--model", "m", "--methods", "full", "--device", "cuda"], ["attnlab search tasks:", "no CUDA device"]),
    (["tasks", "--model", "m", "--methods", "full", "--dtype", "fp8"], ["attnlab search tasks:", "--dtype"]),
    (["trial", "spec.toml", "--device", "cuda"], ["attnlab search trial:", "--device is 'cuda' but no CUDA"]),
    (["trial", "spec.toml", "--dtype", "float64"], ["attnlab search trial:", "--dtype must be one of"]),
], ids=["train-device", "train-dtype", "train-cuda", "eval-device", "eval-cuda", "eval-dtype", "tasks-cuda",
        "tasks-dtype", "trial-cuda", "trial-dtype"])
def test_cli_device_errors_are_one_line_before_any_work(argv, words, tmp_path, capsys, monkeypatch, no_cuda):
    fail = lambda *a, **k: pytest.fail("weights loaded despite a bad option")  # noqa: E731
    monkeypatch.setattr(lm_mod, "load_model", fail)
    monkeypatch.setattr(tasks, "load_model", fail)
    monkeypatch.setattr(tasks, "plan_tasks", lambda *a, **k: pytest.fail("planned despite a bad option"))
    monkeypatch.chdir(tmp_path)
    out = [] if argv[0] == "trial" else ["--out", str(tmp_path / "o")]
    assert main(["search", *argv, *out]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert list(tmp_path.iterdir()) == []


SPEC = '''title = "where"
claim = "it runs"
seeds = [0]
[train]
model = "tiny"
layers = "1"
context = 32
{train}
[eval]
layer_sets = ["1"]
ks = [4]
methods = ["learned"]
context = 40
'''


def test_trial_specs_take_device_and_dtype_and_the_flags_set_every_run(tmp_path, no_cuda):
    path = tmp_path / "spec.toml"
    path.write_text(SPEC.format(train='dtype = "bfloat16"\ndevice = "cpu"'))
    run = load_trial(path).runs[0]
    assert (run.train.device, run.train.dtype, run.eval.device, run.eval.dtype) == ("cpu", "bfloat16", "auto",
                                                                                    "float32")
    run = load_trial(path, device="auto", dtype="float32").runs[0]
    assert (run.train.device, run.train.dtype, run.eval.device, run.eval.dtype) == ("auto", "float32", "auto",
                                                                                    "float32")
    path.write_text(SPEC.format(train='device = "cuda"'))
    with pytest.raises(ConfigError, match="train: device is 'cuda' but no CUDA device"):
        load_trial(path)
    assert load_trial(path, device="cpu").runs[0].train.device == "cpu"  # the flag wins over the spec


def test_finished_work_counts_on_any_device_but_not_in_another_dtype(tmp_path, no_cuda):
    """A trial's finished evaluation and a tasks folder's finished cells are not redone on another
    device (or when written before the fields existed), and are redone in another dtype."""
    from dataclasses import asdict

    from attnlab.experiments.search_trial import _finished
    from attnlab.search.lm import tiny_lm

    cfg = EvalConfig(model="m", methods=["quest"], ks=[4], layer_sets=["1"], out=str(tmp_path / "ev"))
    (tmp_path / "ev").mkdir()
    for config, done in ((asdict(cfg), True), ({**asdict(cfg), "device": "cpu"}, True),
                         ({k: v for k, v in asdict(cfg).items() if k not in ("device", "dtype")}, True),
                         ({**asdict(cfg), "dtype": "bfloat16"}, False)):
        (tmp_path / "ev" / "results.json").write_text(json.dumps({"config": config, "rows": [{}], "full": {}}))
        assert (_finished(cfg) is not None) is done, config
    lm = tiny_lm("llama", n_layers=2)
    small = dict(model="tiny", tasks=["passkey"], lengths=[256], depths=[0.5], n_examples=1, methods=["full"],
                 layer_set="1", out=str(tmp_path / "tasks"))
    first = tasks.run_tasks(TaskConfig(**small, device="cpu"), lm, progress=False)
    assert first["device"] == "cpu" and "device" not in first["config"] and len(first["rows"]) == 1
    again = tasks.run_tasks(TaskConfig(**small, device="auto"), lm, progress=False)
    assert again["complete"] and again["rows"] == first["rows"] and "device" not in again  # nothing re-run
    saved = json.loads((tmp_path / "tasks" / "results.json").read_text())
    del saved["config"]["dtype"]  # as written before the field existed: float32
    (tmp_path / "tasks" / "results.json").write_text(json.dumps(saved))
    assert tasks.run_tasks(TaskConfig(**small), lm, progress=False)["rows"] == first["rows"]
    with pytest.raises(ValueError, match="differs in: dtype"):
        tasks.plan_tasks(TaskConfig(**small, dtype="bfloat16"), lm)


def _finite(x):
    return x is None or math.isfinite(x)


@pytest.mark.heavy  # 2.1 s
def test_bf16_model_on_the_cpu_trains_and_evaluates(tmp_path, corpus, model_dir, capsys):
    """`attnlab search train --device cpu --dtype bfloat16` from a model folder, then the evaluation with
    the model in bf16 and in float32: finite numbers, full attention's perplexity close to float32's
    but not equal to it (the weights really are bf16), and full budget still equals full attention."""
    out = tmp_path / "train"
    assert main(["search", "train", "--model", model_dir, "--layers", "1", "--d-search", "8", "--context", "32",
                 "--n-contexts", "2", "--corpus", corpus, "--split", "all", "--steps", "3", "--device", "cpu",
                 "--dtype", "bfloat16", "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["device"] == "cpu" and summary["steps_done"] == 3 and _finite(summary["last"]["loss"])
    from safetensors import safe_open

    with safe_open(str(next((out / "activations").glob("ctx_*.safetensors"))), framework="pt") as f:
        assert "torch.bfloat16" in f.metadata()["tag"]  # captured from the bf16 weights
    res = {}
    for dtype in ("float32", "bfloat16"):
        cfg = EvalConfig(checkpoint=summary["checkpoint"], model=model_dir, layer_sets=["1"], ks=[4, 40],
                         methods=["learned", "quest", "oracle"], context=40, n_contexts=1, corpus=corpus, split="all",
                         device="cpu", dtype=dtype, out=str(tmp_path / dtype))
        res[dtype] = run_eval(cfg, progress=False)
        saved = json.loads((tmp_path / dtype / "results.json").read_text())
        assert saved["device"] == "cpu" and saved["config"]["dtype"] == dtype
        for r in res[dtype]["rows"]:
            if r["K"] == 40:  # budget >= context: full attention (no query has more than K keys: no Mass@K)
                assert abs(r["rel_gap"]) < (1e-5 if dtype == "float32" else 1e-2), r
            else:
                assert all(_finite(r[k]) for k in ("ppl", "rel_gap", "recall")) and 0 < r["mass"] <= 1, r
    f32, bf16 = res["float32"]["full"]["ppl"], res["bfloat16"]["full"]["ppl"]
    assert f32 != bf16 and abs(bf16 - f32) / f32 < 0.05


@pytest.mark.cuda
def test_search_capture_train_eval_and_tasks_on_cuda(tmp_path, corpus, model_dir):
    """A tiny random Llama on the GPU: captured activations on CUDA, a few training steps (activations
    in memory and on disk), every method of the evaluation (the FAISS ones through the CPU boundary),
    the tasks both prefill ways, and bf16 weights through the CLI; finite numbers, plain JSON."""
    from attnlab.search.capture import capture, load_texts, pack_contexts
    from attnlab.search.lm import tiny_lm
    from attnlab.search.retrieval import METHODS

    lm = tiny_lm("llama", n_layers=4, device="cuda")
    packed = pack_contexts(load_texts(corpus, "all"), lm.encode, lm.eos_id, 32, 2, 0)
    caps = capture(lm.model, packed.batch(0), [1, 2])
    assert all(c.q.is_cuda and c.k.is_cuda and c.hidden.is_cuda for c in caps.values())
    common = dict(model="tiny", layers="1,2", d_search=8, context=32, n_contexts=2, corpus=corpus, split="all",
                  steps=3, log_every=1, eval_k=4, warmup=1, groups="kv")
    for mode in ("memory", "disk"):
        res = train_projections(SearchTrainConfig(**common, activations=mode, out=str(tmp_path / mode)), lm=lm,
                                progress=False)
        assert res["device"].startswith("cuda") and json.dumps(res)  # plain numbers: no tensor in the summary
        assert all(_finite(v) for v in res["last"].values() if isinstance(v, float))
    methods = [m for m in METHODS if not (m.endswith(("-hnsw", "-ivf")) and not _has_faiss())]
    ev = run_eval(EvalConfig(checkpoint=res["checkpoint"], layer_sets=["1,2"], ks=[4, 40], methods=methods,
                             context=40, n_contexts=1, corpus=corpus, split="all", ivf_nlist=2, ivf_nprobe=2,
                             out=str(tmp_path / "ev")), lm=lm, progress=False)
    assert ev["device"].startswith("cuda") and {r["method"] for r in ev["rows"]} == set(methods)
    for r in ev["rows"]:
        if r["K"] == 40:  # budget >= context: full attention
            assert abs(r["rel_gap"]) < 1e-3, r  # loose: TF32 may be on in a GPU session
        else:
            assert all(_finite(r[k]) for k in ("ppl", "rel_gap", "recall")) and 0 < r["mass"] <= 1, r
    json.loads((tmp_path / "ev" / "results.json").read_text())
    for prefill in ("selected", "full"):
        cfg = TaskConfig(model="tiny", checkpoint=res["checkpoint"], tasks=["passkey"], lengths=[256], depths=[0.5],
                         n_examples=1, methods=["full", "learned", "quest"], ks=[16], layer_set="1,2", prefill=prefill,
                         out=str(tmp_path / f"tasks-{prefill}"))
        out = tasks.run_tasks(cfg, lm, progress=False)
        assert out["device"].startswith("cuda") and len(out["rows"]) == 3
        assert all(0 <= r["accuracy"] <= 1 for r in out["rows"])
    bf = tmp_path / "bf16"
    assert main(["search", "train", "--model", model_dir, "--layers", "1", "--d-search", "8", "--context", "32",
                 "--n-contexts", "2", "--corpus", corpus, "--split", "all", "--steps", "3", "--device", "cuda",
                 "--dtype", "bfloat16", "--out", str(bf)]) == 0
    assert main(["search", "eval", "--checkpoint", str(bf / "projections.safetensors"), "--model", model_dir,
                 "--layer-sets", "1", "--ks", "4", "--methods", "learned,quest", "--context", "40", "--n-contexts", "1",
                 "--corpus", corpus, "--split", "all", "--device", "cuda", "--dtype", "bfloat16",
                 "--out", str(tmp_path / "bf16-ev")]) == 0
    rows = json.loads((tmp_path / "bf16-ev" / "results.json").read_text())["rows"]
    assert len(rows) == 2 and all(_finite(r["ppl"]) and _finite(r["mass"]) for r in rows)


def _has_faiss() -> bool:
    try:
        import faiss  # noqa: F401
    except ImportError:
        return False
    return True
