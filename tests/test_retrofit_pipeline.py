"""The retrofit pipeline (convert, transfer, fine-tune, evaluate as one function), the one resumable
loop of transfer and fine-tuning, the one packing of contexts and the one perplexity rule."""

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

import attnlab.hf  # noqa: E402,F401
from attnlab.data.packing import pack_contexts  # noqa: E402
from attnlab.retrofit import (EvalConfig, FinetuneConfig, TransferConfig, convert, evaluate_retrofit,  # noqa: E402
                              finetune, new_parameters, plan, transfer_attention)
from attnlab.retrofit.evaluate import perplexity as model_perplexity  # noqa: E402
from attnlab.retrofit.loop import resume, train_steps  # noqa: E402
from attnlab.retrofit.pipeline import run_pipeline  # noqa: E402
from attnlab.search.metrics import perplexity  # noqa: E402

from test_retrofit import tiny  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

DOCS = ["abc", "de", "fghij", "k", "lmnopq", "rs", "tuvwxyz", "0123"]


def _encode(text):
    return [3 + b % 90 for b in text.encode()]


@pytest.fixture(scope="module")
def llama():
    return tiny("llama", n_layers=3)


def test_packing_layout_documents_then_eos_with_segments_and_positions():
    p = pack_contexts(DOCS, _encode, 2, 6, 3, seed=None)
    stream = [t for d in DOCS for t in [*_encode(d), 2]][:18]
    assert p.input_ids.flatten().tolist() == stream and len(p) == 3
    assert p.segments[0].tolist() == [0, 0, 0, 0, 1, 1]  # "abc" EOS | "de" ...
    assert p.segments[1].tolist() == [0, 1, 1, 1, 1, 1]  # each context counts from 0
    assert p.position_ids[0].tolist() == [0, 1, 2, 3, 0, 1]
    assert p.batch(1, 2).input_ids.tolist() == p.input_ids[1:].tolist()
    with pytest.raises(ValueError, match="corpus too short"):
        pack_contexts(DOCS, _encode, 2, 64, 4)


def test_search_packing_is_the_same_packing():
    from attnlab.search.capture import pack_contexts as search_pack

    a, b = pack_contexts(DOCS, _encode, 2, 5, 4, seed=3), search_pack(DOCS, _encode, 2, 5, 4, seed=3)
    for name in ("input_ids", "position_ids", "segments"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_perplexity_scores_only_predictions_inside_a_document():
    """The rule: the prediction of a document's first token from the EOS before it is left out, every
    other one (the EOS that ends a document included) is scored, each once, token-weighted."""
    p = pack_contexts(DOCS, _encode, 2, 8, 2, seed=None)
    logits = torch.randn(2, 8, 100, generator=torch.Generator().manual_seed(0))
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1), p.input_ids[:, 1:].flatten(), reduction="none").view(2, 7)
    inside = p.segments[:, 1:] == p.segments[:, :-1]
    assert 0 < int((~inside).sum()) < inside.numel()  # the contexts hold boundaries
    want = math.exp(float(nll[inside].mean()))
    assert perplexity(lambda b: logits, p, rows=2) == pytest.approx(want, rel=1e-6)
    by_row = {tuple(p.input_ids[i].tolist()): logits[i] for i in range(2)}  # one context at a time: the same mean
    assert perplexity(lambda b: by_row[tuple(b.input_ids[0].tolist())][None], p) == pytest.approx(want, rel=1e-6)
    i, t = (~inside).nonzero()[0].tolist()
    moved = logits.clone()
    moved[i, t] += 5 * torch.randn(100)  # the logits of a prediction across a boundary do not count
    assert perplexity(lambda b: moved, p, rows=2) == pytest.approx(want, rel=1e-6)


def test_retrofit_perplexity_is_the_search_rule_on_the_models_logits(llama):
    p = pack_contexts(DOCS * 3, _encode, 2, 16, 3, seed=1)
    with torch.no_grad():
        logits = llama(input_ids=p.input_ids, use_cache=False).logits
    want = perplexity(lambda b: logits, p, rows=len(p))
    llama.train()
    assert model_perplexity(llama, p) == pytest.approx(want, rel=1e-5)
    assert llama.training  # the model's mode is put back
    llama.eval()


def test_one_loop_resumes_exactly_and_saves_on_a_budget(tmp_path):
    """train_steps: a run cut by its budget and resumed from its state file ends where one run ends."""
    def run(path, budget, steps=7):
        w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
        opt = torch.optim.AdamW([w], lr=0.1)
        params = {"w": w}
        meta = resume(path, params, opt, {"k": 1}, "toy")
        start = 0 if meta is None else int(meta["step"])

        def step(s):
            opt.zero_grad()
            ((w - s) ** 2).sum().backward()
            opt.step()

        done, ran = train_steps(step, path, params, opt, {"fingerprint": {"k": 1}}, start, steps, 3, budget)
        return w.detach().clone(), done, ran, start

    whole = run(tmp_path / "one.safetensors", math.inf)
    assert whole[1:] == (7, 7, 0)
    part = run(tmp_path / "two.safetensors", 2)
    assert part[1:] == (2, 2, 0) and (tmp_path / "two.safetensors").is_file()  # saved when the budget ran out
    rest = run(tmp_path / "two.safetensors", math.inf)
    assert rest[1:] == (7, 5, 2) and torch.equal(rest[0], whole[0])
    from attnlab.retrofit import RetrofitError

    w = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(RetrofitError, match="toy options"):
        resume(tmp_path / "two.safetensors", {"w": w}, torch.optim.AdamW([w]), {"k": 2}, "toy")


def test_pipeline_equals_the_stages_run_by_hand(llama, tmp_path):
    """run_pipeline = convert, transfer, fine-tune, evaluate with the same configs, and reports
    how far the new parameters moved; a stage without steps does not run."""
    tcfg = TransferConfig(steps=3, contexts=2, context=32)
    fcfg = FinetuneConfig(steps=3, lr=1e-2, context=32, contexts=4, batch=2, eval_contexts=1, warmup=1, kl=0.1)
    ecfg = EvalConfig(contexts=2, context=32)
    lines = []
    done = run_pipeline(llama, plan(llama.config, "1,2", "hybrid"), tmp_path / "a", seed=3, transfer=tcfg,
                        finetune=fcfg, evaluate=ecfg, progress=False, log=lines.append)

    ref = convert(llama, "1,2", "hybrid", seed=3)
    start = {n: p.detach().clone() for n, p in new_parameters(ref.model, ref.retrofit_plan).items()}
    transfer_attention(llama, ref, [1, 2], tcfg, tmp_path / "b")
    finetune(ref, fcfg, tmp_path / "b", original=llama, progress=False)
    rep = evaluate_retrofit(ref, ecfg, original=llama)
    got = done.model.state_dict()
    assert all(torch.equal(v, got[k]) for k, v in ref.state_dict().items())
    assert [done.eval[k] for k in ("perplexity", "perplexity_original")] == [rep["perplexity"],
                                                                            rep["perplexity_original"]]
    assert done.transfer["layers"].keys() == {"1", "2"} and done.finetune["steps"] == 3
    moved = [(p.detach() - start[n]).pow(2) for n, p in new_parameters(ref.model, ref.retrofit_plan).items()]
    assert done.new_change_rms == pytest.approx(math.sqrt(sum(float(x.sum()) for x in moved)
                                                          / sum(x.numel() for x in moved)))
    assert [line.split(":")[0] for line in lines] == ["layer 1", "layer 2", "finetune", "eval"]

    bare = run_pipeline(llama, plan(llama.config, "1", "softmax"), tmp_path / "c", evaluate=ecfg, compare=False)
    assert bare.transfer is None and bare.finetune is None and bare.new_change_rms is None
    assert "perplexity_original" not in bare.eval and not (tmp_path / "c").exists()


@pytest.mark.cuda
def test_cuda_pipeline_end_to_end(tmp_path):
    """`attnlab retrofit --device cuda` on a tiny random Llama: convert, attention transfer, a few
    fine-tuning steps and the evaluation run on the GPU (the original in bf16), and the folder reloads."""
    from attnlab.cli import main

    src = tmp_path / "llama"
    tiny("llama", n_layers=3).save_pretrained(src)
    out = tmp_path / "out"
    assert main(["retrofit", "--model", str(src), "--layers", "1", "--attn", "hybrid", "--device", "cuda",
                 "--dtype", "bfloat16", "--transfer-steps", "3", "--transfer-contexts", "2", "--transfer-context", "64",
                 "--finetune-steps", "3", "--finetune-batch", "2", "--finetune-context", "64",
                 "--eval-contexts", "2", "--eval-context", "64", "--out", str(out)]) == 0
    assert (out / "eval.json").is_file() and (out / "finetune.json").is_file()
