"""The decode-time protocol of retrieve-then-attend: an exact prefill shared by several selectors
(`attnlab.search.prefill`) and the tasks' prefill="full" mode, on a tiny random Llama."""

import json

import pytest
import torch

import attnlab.search.tasks as tasks
from attnlab.search.hf_model import attention_modules
from attnlab.search.hooks import Installed
from attnlab.search.lm import tiny_lm
from attnlab.search.patch import SelectorConfig, substitute
from attnlab.search.prefill import prefilled_logits, record_prefix
from attnlab.index.projections import SearchProjections
from attnlab.search.retrieval import METHODS
from attnlab.search.tasks import TaskConfig, answer_logits, plan_tasks, run_tasks
from attnlab.testing import rel_rms

from test_search_tasks import Forwards, small, strip_time


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("llama")


@pytest.fixture(scope="module")
def example(lm, tmp_path_factory):
    inputs, labels = plan_tasks(small(tmp_path_factory.mktemp("p") / "out"), lm).examples["passkey", 256, 0.5]
    return inputs[:1], labels[:1]


def projections(lm, layers, groups=1):
    torch.manual_seed(0)
    return SearchProjections(layers, lm.dims.d_model, 8, groups=groups, meta={"model": "tiny"})


def null():
    import contextlib

    return contextlib.nullcontext()


def test_exact_prefill_then_the_rest_is_the_whole_forward(lm, example):
    inputs, labels = example
    ref, _ = answer_logits(lm.model, inputs, labels)
    got, secs = prefilled_logits(lm.model, [1, 4, 6], inputs, 200, ref.shape[1], [("full", null), ("again", null)])
    for name in ("full", "again"):  # the cache is cut back after each: the second read is the same
        assert rel_rms(got[name][0], ref) < 1e-5 and torch.equal(got[name][0].argmax(-1), ref.argmax(-1))
    assert secs > 0


@pytest.mark.parametrize("method", METHODS)
def test_every_selector_reading_every_key_after_an_exact_prefill_is_full_attention(lm, example, method):
    inputs, labels = example
    ref, _ = answer_logits(lm.model, inputs, labels)
    proj = projections(lm, [1, 4, 6]) if method.startswith("learned") else None
    cfg = SelectorConfig(method, K=256, ivf_nlist=4, ivf_nprobe=4, ivf_train_at=64)
    got, _ = prefilled_logits(lm.model, [1, 4, 6], inputs, 180, ref.shape[1],
                              [(method, lambda: substitute(lm.model, [1, 4, 6], cfg, proj))])
    assert rel_rms(got[method][0], ref) < 1e-5, method


def test_learned_selection_after_the_prefill_matches_a_dense_masked_reference(lm, example):
    """One substituted layer: its inputs at the question positions are those of the exact model, so
    its output there is top-K of the search scores over the causal keys, as a dense mask."""
    inputs, _ = example
    L, K, split, G = 4, 16, 200, 2
    proj = projections(lm, [L], groups=G)
    mod = attention_modules(lm.model)[L]
    seen = {}

    def record(module, hidden, q, k, v, allowed, scaling):
        seen.update(hidden=hidden, q=q, k=k, v=v, scaling=scaling)

    with Installed(lm.model, {L: record}), torch.no_grad():
        lm.model(input_ids=inputs)
    q, k, v = seen["q"], seen["k"], seen["v"]
    H, Hkv, T = q.shape[1], k.shape[1], q.shape[2]
    with torch.no_grad():
        sq, sk = proj(L, seen["hidden"])  # (1, G, T, d)
        scores = sq[:, :, split:] @ sk.transpose(-1, -2)  # (1, G, Tq, T)
        causal = torch.arange(T)[None, :] <= torch.arange(split, T)[:, None]
        best = scores.masked_fill(~causal, float("-inf")).topk(K, dim=-1).indices
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, best, True) & causal
        keep = keep.repeat_interleave(H // G, dim=1)  # (1, H, Tq, T)
        kh, vh = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
        logits = (q[:, :, split:] @ kh.transpose(-1, -2)) * seen["scaling"]
        attn = torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=-1) @ vh  # (1, H, Tq, D)
        want = mod.o_proj(attn.transpose(1, 2).reshape(1, T - split, -1))
    outs = []
    handle = mod.register_forward_hook(lambda m, a, out: outs.append(out[0]))
    try:
        prefilled_logits(lm.model, [L], inputs, split, 1,
                         [("learned", lambda: substitute(lm.model, [L], SelectorConfig("learned", K=K, groups=G), proj))])
    finally:
        handle.remove()
    assert [o.shape[1] for o in outs] == [split, T - split]  # the prefill, then the rest
    assert rel_rms(outs[1], want) < 1e-5
    full = mod.o_proj(((q[:, :, split:] @ kh.transpose(-1, -2) * seen["scaling"]).masked_fill(~causal, float("-inf"))
                       .softmax(-1) @ vh).transpose(1, 2).reshape(1, T - split, -1))
    assert rel_rms(outs[1], full) > 1e-3  # K = 16 of about 230 keys really changes the output


def test_prime_needs_every_substituted_layer_recorded(lm, example):
    inputs, _ = example
    installed, record = record_prefix(lm.model, [1])
    with installed, torch.no_grad():
        lm.model(input_ids=inputs[:, :100])
    with substitute(lm.model, [1, 4], SelectorConfig("streaming", K=8)) as sub:
        with pytest.raises(ValueError, match="layer 4 is substituted but its prefill was not recorded"):
            record.prime(sub)
    with pytest.raises(ValueError, match="layers must be a non-empty list"):
        record_prefix(lm.model, [99])
    with pytest.raises(ValueError, match="split must be in 1..255"):
        prefilled_logits(lm.model, [1], inputs, 256, 1, [])


@pytest.mark.heavy
def test_tasks_with_an_exact_prefill_share_it_across_methods_and_resume(lm, tmp_path):
    plain = ["streaming", "quest"]
    cfg = small(tmp_path / "out", depths=[0.1, 0.9], n_examples=2, methods=["full", *plain], ks=[288],
                prefill="full")
    hook = Forwards(lm.model)
    try:
        res = run_tasks(cfg, lm, progress=False)
        assert hook.n == 2 * 2 * (1 + 1 + len(plain))  # per example one prefill and one short read per method
    finally:
        hook.remove()
    rows = {(r["depth"], r["method"]): r for r in res["rows"]}
    whole = run_tasks(small(tmp_path / "whole", depths=[0.1, 0.9], n_examples=2), lm, progress=False)
    for r in whole["rows"]:  # the exact prefill and the whole forward agree on full attention
        got = rows[r["depth"], "full"]
        assert (got["accuracy"], got["token_accuracy"]) == (r["accuracy"], r["token_accuracy"])
    for (depth, method), r in rows.items():  # K = 288 >= every length: each selector reads every key
        assert (r["accuracy"], r["token_accuracy"]) == (rows[depth, "full"]["accuracy"],
                                                        rows[depth, "full"]["token_accuracy"])
        assert r["prefill_seconds"] > 0
    again = tmp_path / "again"
    hook = Forwards(lm.model, fail_after=10)  # stops inside the second cell (8 forwards per cell)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_tasks(TaskConfig(**{**vars(cfg), "out": str(again)}), lm, progress=False)
    finally:
        hook.remove()
    part = json.loads((again / "results.json").read_text())
    assert len(part["rows"]) == 1 + len(plain) and not part.get("complete")
    done = run_tasks(TaskConfig(**{**vars(cfg), "out": str(again)}), lm, progress=False)
    assert strip_prefill(done["rows"]) == strip_prefill(res["rows"])


def strip_prefill(rows):
    return [{k: v for k, v in r.items() if k != "prefill_seconds"} for r in strip_time(rows)]


def test_prefill_option_is_checked_and_reaches_the_config(tmp_path):
    with pytest.raises(ValueError, match=r"^prefill must be one of \('selected', 'full'\)"):
        small(tmp_path / "out", prefill="exact")
    import argparse

    from attnlab.cli.search_commands import add_search_commands, tasks_config

    parser = argparse.ArgumentParser()
    add_search_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["search", "tasks", "--model", "tiny", "--methods", "full", "--prefill", "full"])
    assert tasks_config(args).prefill == "full"
    assert tasks_config(parser.parse_args(["search", "tasks", "--model", "tiny", "--methods", "full"])).prefill == "selected"
    assert tasks.PREFILLS == ("selected", "full")
