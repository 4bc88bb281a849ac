"""benchmarks/generate.py on a tiny trained hybrid: every decoder steps the same tokens, a window
as large as the text decodes exactly, a small one does not, and the probe's mass left out is 0 for
the full window."""

from __future__ import annotations

import importlib.util
import json
import sysconfig
from pathlib import Path

from attnlab.train import train
from attnlab.train.config import load_config

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORPUS = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").as_posix()


def _bench():
    spec = importlib.util.spec_from_file_location("generate_bench", ROOT / "benchmarks" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.heavy
def test_generate_benchmark_on_a_tiny_run(tmp_path):
    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        "model.attn=hybrid", "model.d_model=16", "model.n_heads=2", "data.seq_len=16", f"data.source={CORPUS}",
        "train.steps=2", "train.warmup_steps=0", "train.eval_batches=1", "run.tensorboard=false", "run.threads=1",
        f"run.out_dir={tmp_path.as_posix()}", "run.name=tiny", "run.progress=false"])
    train(cfg)
    out = tmp_path / "gen.json"
    _bench().main(["--run", str(tmp_path / "tiny"), "--tokens", "40", "--ks", "2,64", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["decoders"] == ["exact", "k=2", "k=64"] and r["tokens"] == 40
    assert abs(r["overall"]["k=64"]["gap"]) < 1e-5 and r["overall"]["k=2"]["gap"] != 0
    assert sum(row["to"] - row["from"] for row in r["rows"] if row["decoder"] == "exact") == 40
    full = [m for row in r["mass_out"] if row["k"] == 64 for m in row["mass_out"]]
    small = [m for row in r["mass_out"] if row["k"] == 2 and row["n"] > 2 for m in row["mass_out"]]
    assert full and max(full) < 1e-9 and max(small) > 0
    assert (tmp_path / "gen.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.heavy
def test_generate_benchmark_with_learned_selection_and_a_softmax_model(tmp_path):
    """--selector decodes through search projections trained on the run (K as large as the text:
    every key, so no gap), --softmax-run adds another model's exact loss on the same tokens."""
    base = ["model.d_model=16", "model.n_heads=2", "data.seq_len=16", f"data.source={CORPUS}", "train.steps=2",
            "train.warmup_steps=0", "train.eval_batches=1", "run.tensorboard=false", "run.threads=1",
            f"run.out_dir={tmp_path.as_posix()}", "run.progress=false"]
    for attn in ("hybrid", "softmax"):
        train(load_config(ROOT / "configs" / "tiny.toml", [f"model.attn={attn}", f"run.name={attn}", *base]))
    out = tmp_path / "gen.json"
    _bench().main(["--run", str(tmp_path / "hybrid"), "--tokens", "30", "--ks", "2", "--selector", "learned",
                   "learned-hnsw", "learned-ivf", "quest", "--ivf-nlist", "1", "--ivf-nprobe", "1", "--selector-rope", "off", "--K", "40", "--selector-steps", "2", "--selector-batches", "8",
                   "--softmax-run", str(tmp_path / "softmax"), "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["decoders"] == ["exact", "k=2", "learned@40", "learned-hnsw@40", "learned-ivf@40", "quest@40", "softmax"]
    assert r["selector"]["ivf_nlist"] == 1 and r["selector"]["rope"] is False
    for name in ("learned@40", "learned-hnsw@40", "learned-ivf@40", "quest@40"):
        assert abs(r["overall"][name]["gap"]) < 1e-5, name
    assert r["selector"]["steps"] == 2 and all("gap_softmax" in row for row in r["rows"])
    soft = r["overall"]["softmax"]["nll"] - r["overall"]["exact"]["nll"]
    assert abs(r["overall"]["softmax"]["gap"] - soft) < 1e-5


def test_decode_speed_benchmark_rows(tmp_path):
    """benchmarks/decode_speed.py at a tiny context: one row per method with a positive step time, in
    the JSON shape the docs table reads (compiled and HF rows are left to the real run)."""
    spec = importlib.util.spec_from_file_location("decode_speed", ROOT / "benchmarks" / "decode_speed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "ds.json"
    methods = "exact,exact_static,window,window_ops_static"
    mod.main(["--out", str(out), "--models", "windowed", "--contexts", "24", "--methods", methods,
              "--steps", "1", "--rounds", "1", "--warmup", "1"])
    doc = json.loads(out.read_text())
    assert doc["device"].startswith("cpu") and doc["threads"] == 1
    assert [(r["method"], r["context"]) for r in doc["rows"]] == [(m, 24) for m in methods.split(",")]
    assert all(r["step_ms"] > 0 and r["tokens_per_s"] > 0 for r in doc["rows"])
    with pytest.raises(SystemExit, match="--methods: unknown"):
        mod.main(["--out", str(tmp_path / "no.json"), "--methods", "window_compild"])
    assert not (tmp_path / "no.json").exists()


def test_decode_speed_across_contexts(tmp_path):
    """--across-contexts: every context's decoders at once, rounds interleaved; each row's
    x_first_context is the median of per-round ratios to the first context's step (1 for the first),
    and the window rows count the sorted runs a step searches (the prompt's run and the buffer here)."""
    spec = importlib.util.spec_from_file_location("decode_speed_across", ROOT / "benchmarks" / "decode_speed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "ds.json"
    mod.main(["--out", str(out), "--models", "windowed", "--contexts", "100,400", "--methods", "window,exact",
              "--steps", "2", "--rounds", "3", "--warmup", "1", "--across-contexts"])
    rows = {(r["method"], r["context"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(m, T) for m in ("window", "exact") for T in (100, 400)}
    for m in ("window", "exact"):
        assert rows[m, 100]["x_first_context"] == 1.0 and rows[m, 100]["x_first_context_rounds"] == [1.0] * 3
        ratios = rows[m, 400]["x_first_context_rounds"]
        assert len(ratios) == 3 and all(r > 0 for r in ratios)
        assert rows[m, 400]["x_first_context"] == round(sorted(ratios)[1], 4)
    assert all(1 <= rows["window", T]["sorted_runs"] <= 3 for T in (100, 400))
    assert "sorted_runs" not in rows["exact", 400]
