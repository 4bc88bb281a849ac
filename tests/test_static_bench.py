"""benchmarks/decode_speed.py's memory-bandwidth floor: the bytes a step must read (weights, and the cache
entries each method reads) counted from the model's shapes, for attnlab's methods and for the Llama of
transformers' static-cache row, and every row of a tiny run carrying step_ms, tokens_per_s,
bytes_per_step, floor_ms and x_floor."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("decode_speed_bytes", ROOT / "benchmarks" / "decode_speed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_step_bytes_follow_each_methods_reads(bench):
    from attnlab.models.config import ModelConfig
    from attnlab.models.lm import LM

    m = LM(ModelConfig(max_seq_len=64, **bench.MODELS["windowed"]))  # 4 layers of 4 hybrid heads, a tied head
    a = m.blocks[0].attn
    per_position = 4 * (a.n_kv * a.qk_dim * 4 + a.n_kv * a.config.head_dim * 4 + a.n_scalar * 4)  # k, v, ks; 4 layers
    weights = bench.step_bytes(m, "exact", 1, 0)
    params = sum(p.numel() * 4 for p in m.parameters())
    assert weights == params  # a tied embedding is the head's matrix: read whole
    assert bench.step_bytes(m, "exact_compiled", 2, 1000) - weights == 2 * 1000 * per_position
    w4k, w128k = bench.step_bytes(m, "window_compiled", 1, 4096), bench.step_bytes(m, "window", 1, 131072)
    assert w4k > weights and w128k / w4k < 1.001  # the window reads k + w entries whatever the context
    grow = bench.step_bytes(m, "learned", 1, 2000) - bench.step_bytes(m, "learned", 1, 1000)
    assert grow == 4 * a.n_scalar * 1000 * 32 * 4  # every search key, 32 float32 wide


def test_hf_step_bytes_count_the_llama_cache(bench):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    c = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(c)
    params = sum(p.numel() * 4 for p in model.parameters())
    emb = 64 * 32 * 4
    want = params - emb + 3 * 32 * 4 + 2 * 3 * 100 * 2 * 2 * 8 * 4  # 3 embedding rows; 2 layers of k and v
    assert bench.hf_step_bytes(model, 3, 100) == want


def test_rows_carry_the_floor(bench, tmp_path):
    out = tmp_path / "ds.json"
    bench.main(["--out", str(out), "--models", "windowed", "--contexts", "16", "--methods", "exact,window_static",
                "--steps", "1", "--rounds", "1", "--warmup", "1", "--bandwidth", "100"])
    doc = json.loads(out.read_text())
    assert doc["bandwidth_gbps"] == 100 and doc["bandwidth_source"] == "given (--bandwidth)"
    for r in doc["rows"]:
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["bytes_per_step"] > 0
        assert r["floor_ms"] == pytest.approx(r["bytes_per_step"] / 1e8, rel=1e-3)
        assert r["x_floor"] == pytest.approx(r["step_ms"] / r["floor_ms"], rel=2e-2)
    for r in doc["rows"]:  # the merges of a static decoder's codes over its steps; the mean elsewhere
        assert r["amortised_ms"] >= r["step_ms"] if r["method"] == "window_static" else r["amortised_ms"] == r["mean_ms"]


def test_the_profile_splits_a_step_and_times_both_merges(tmp_path):
    """benchmarks/decode_profile.py at tiny sizes: per-op rows for each context, the growth from the
    first context to the last, the static decoder's merges apart from its step's ops, and one layer's
    merge timed both ways (the script asserts the two merges agree bit for bit)."""
    spec = importlib.util.spec_from_file_location("decode_profile_t", ROOT / "benchmarks" / "decode_profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "dp.json"
    mod.main(["--out", str(out), "--batch", "2", "--contexts", "40,300", "--methods", "window,window_static",
              "--steps", "2", "--rounds", "1", "--warmup", "1", "--prefill-threads", "1", "--top", "100"])
    rows = {(r["method"], r["context"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(k, T) for k in ("window", "window_static") for T in (40, 300)}
    assert all(r["top"] and r["step_ms"] > 0 for r in rows.values())
    assert "growth" in rows[("window", 300)] and "growth" not in rows[("window", 40)]
    assert any(t["op"] == mod.MERGE for t in rows[("window_static", 40)]["top"] + rows[("window_static", 300)]["top"])
    merge = rows[("window_static", 300)]["merge_one_layer_ms"]
    assert merge["extend_codes"] > 0 and merge["merge_codes"] > 0 and merge["keys"] > 0
    with pytest.raises(SystemExit, match="at least two"):
        mod.main(["--out", str(out), "--contexts", "40"])
