"""lm-evaluation-harness on an exported tiny model, with the two tasks of examples/lm_eval read from
local files (no download): a multiple-choice task (loglikelihood, right-padded batches) and a
generate_until task (left-padded batches through generate). Both routes: the harness loading the
folder through the Auto classes, and `HFLM(pretrained=model, tokenizer=tok)`. The numbers are
checked against attnlab's own: each choice's log-likelihood, and each greedy continuation."""

import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
lm_eval = pytest.importorskip("lm_eval")

from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import attnlab.hf as H  # noqa: E402
from attnlab.data.tokenizer import ByteTokenizer  # noqa: E402
from attnlab.models import LM, ModelConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "lm_eval"
TASKS = ["attnlab_python_mc", "attnlab_python_gen"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(the attnlab LM, its exported folder, a TaskManager over the example tasks with absolute paths)."""
    root = tmp_path_factory.mktemp("lm_eval")
    torch.manual_seed(0)
    lm = LM(ModelConfig(vocab_size=257, d_model=32, n_layers=2, n_heads=4, attn=["gla", "hybrid"], max_seq_len=64)).eval()
    H.export.save_folder(lm, root / "hf", ByteTokenizer())
    tasks = root / "tasks"
    tasks.mkdir()
    for name in ("python_mc", "python_gen"):
        text = (EXAMPLES / f"{name}.yaml").read_text()
        (tasks / f"{name}.yaml").write_text(text.replace(f"examples/lm_eval/{name}.jsonl", str(EXAMPLES / f"{name}.jsonl")))
    return lm, root / "hf", TaskManager(include_path=str(tasks), include_defaults=False)


def loglikelihood(lm, context: str, continuation: str) -> float:
    """log p(continuation | context) under attnlab's LM; as lm-eval does, trailing whitespace of the
    context are scored as part of the continuation."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    ctx, cont = ByteTokenizer().encode(context), ByteTokenizer().encode(continuation)
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(lm(ids)[0][0].double(), -1)
    return sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))


def greedy_text(lm, prompt: str, n: int) -> str:
    tok = ByteTokenizer()
    out = lm.generate(torch.tensor([tok.encode(prompt)]), n)[0, len(tok.encode(prompt)):].tolist()
    if tok.eos_id in out:
        out = out[: out.index(tok.eos_id)]
    return tok.decode(out).split("\n")[0]


@pytest.mark.heavy
def test_harness_on_the_exported_folder(setup):
    lm, folder, tm = setup
    res = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(folder), "device": "cpu"}, tasks=TASKS,
                                  task_manager=tm, batch_size=4, log_samples=True, verbosity="ERROR")
    assert 0.0 <= res["results"]["attnlab_python_mc"]["acc,none"] <= 1.0
    assert 0.0 <= res["results"]["attnlab_python_gen"]["exact_match,none"] <= 1.0
    mc = res["samples"]["attnlab_python_mc"]
    assert len(mc) == 8
    for s in mc:
        doc = s["doc"]
        got = [r[0][0] for r in s["resps"]]
        want = [loglikelihood(lm, doc["context"], c) for c in doc["choices"]]
        assert all(math.isclose(g, w, abs_tol=1e-3) for g, w in zip(got, want)), (got, want)
    gen = res["samples"]["attnlab_python_gen"]
    assert len(gen) == 8
    for s in gen:
        assert s["filtered_resps"][0] == greedy_text(lm, s["doc"]["prompt"], 8)


def test_python_route_hflm(setup):
    lm, folder, tm = setup
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    res = lm_eval.simple_evaluate(model=HFLM(pretrained=model, tokenizer=tok, batch_size=8), tasks=TASKS[:1],
                                  task_manager=tm, log_samples=True, verbosity="ERROR")
    first = res["samples"]["attnlab_python_mc"][0]
    want = loglikelihood(lm, first["doc"]["context"], first["doc"]["choices"][0])
    assert math.isclose(first["resps"][0][0][0], want, abs_tol=1e-3)
