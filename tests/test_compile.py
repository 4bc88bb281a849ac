"""torch.compile(LM, fullgraph=True): no graph break in forward or backward, the same numbers as the
eager model, and the input policy kept (docs/guide/input-policy.md): eagerly every op and layer raises a
ValueError naming a non-finite input, and the model names a non-finite parameter that only its
logits show; compiled, the same checks are asserts inside the graph (RuntimeError on the CPU).

Compiled with backend "aot_eager": dynamo traces the whole model and AOTAutograd its backward, without
inductor's code generation (the inductor case is marked slow)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnlab import checks
from attnlab.layers import MECHANISMS
from attnlab.models import LM
from attnlab.models.config import ModelConfig
from attnlab.ops import hybrid_attention, scalar_attention, softmax_attention

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes: more threads only add barriers

V, B, T = 64, 2, 16
EXTRA = {"goat": {"goat_rank": 2}, "goat_hybrid": {"goat_rank": 2}}  # room for GOAT's prior in head_dim 8
MAIN = ("softmax", "scalar", "hybrid")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model(mechanism: str, seed: int = 0, **attention) -> LM:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, attn=mechanism, max_seq_len=T,
                      attention={**EXTRA.get(mechanism, {}), **attention})
    return LM(cfg)


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, V, (B, T), generator=g)
    idx[0, 0] = 0  # token 0 is read: a NaN in embedding row 0 must show
    return idx, torch.randint(0, V, (B, T), generator=g)


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> bool:
    return bool(((a - b).norm() <= tol * max(b.norm().item(), 1.0)).item())


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.heavy
@pytest.mark.parametrize("mechanism", MAIN)
def test_fullgraph_training_steps_equal_eager(mechanism):
    """Compiled with fullgraph=True (a graph break raises): logits, loss and every gradient equal the
    eager model's, two AdamW steps land on the same parameters, and then a NaN parameter is
    stopped by an assert inside the graph, never returned as NaN logits."""
    models = [_model(mechanism), _model(mechanism)]
    steps = [models[0], torch.compile(models[1], fullgraph=True, backend="aot_eager")]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    for i in range(2):
        idx, tgt = _batch(i)
        outs = []
        for fn, model, opt in zip(steps, models, opts):
            logits, loss = fn(idx, tgt)
            loss.backward()
            outs.append((logits, loss, _grads(model)))
            opt.step()
            opt.zero_grad(set_to_none=True)
        (logits, loss, grads), (c_logits, c_loss, c_grads) = outs
        assert _close(c_logits, logits) and _close(c_loss, loss)
        assert grads.keys() == c_grads.keys() and all(_close(c_grads[n], grads[n]) for n in grads)
    for (n, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert _close(b, a), n
    attn = models[1].blocks[1].attn
    wq = (attn.wqs if mechanism == "scalar" else attn.wq).weight
    keep = wq.detach().clone()
    _nan_at(wq)  # read by the op's queries: the layers leave their checks to the model's boundary
    with pytest.raises(RuntimeError, match=r"^logits must be finite: a parameter or an activation"):
        steps[1](*_batch())
    with torch.no_grad():
        wq.copy_(keep)
    _nan_at(models[1].norm_f.weight)  # after every layer: only the logits show it
    with pytest.raises(RuntimeError, match=r"logits must be finite"):
        steps[1](*_batch())


@pytest.mark.heavy
@pytest.mark.parametrize("backend", ["eager", pytest.param("aot_eager", marks=pytest.mark.slow)])
def test_fullgraph_every_other_mechanism(backend):
    """One model with a layer of every other registered mechanism (and scalar/hybrid variants:
    sink, per-token τ, GQA, output gate) compiles with fullgraph=True and equals eager, forward and
    backward. GLA and principled run their compiled C++ kernels as torch custom ops. With backend "eager"
    dynamo traces the forward (and custom autograd functions); "aot_eager" traces the backward too (slow:
    about 12 s for the eight layers)."""
    layers = [m for m in MECHANISMS if m not in MAIN] + ["scalar", "hybrid"]
    per_layer = [{} for _ in layers]
    per_layer[-2] = {"sink": True, "tau": "token"}
    per_layer[-1] = {"n_kv_heads": 2, "output_gate": "elementwise"}
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=len(layers), n_heads=4, attn=layers, max_seq_len=T,
                      attention={"goat_rank": 2}, layer_attention=per_layer)
    model = LM(cfg)
    idx, tgt = _batch()
    logits, loss = model(idx, tgt)
    loss.backward()
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    c_logits, c_loss = torch.compile(model, fullgraph=True, backend=backend)(idx, tgt)
    c_loss.backward()
    c_grads = _grads(model)
    assert _close(c_logits, logits) and _close(c_loss, loss)
    assert grads.keys() == c_grads.keys()
    for n in grads:
        assert _close(c_grads[n], grads[n]), n


# ---------------------------------------------------------------------------------- the input policy


def _nan_at(param: torch.nn.Parameter, value=float("nan")) -> None:
    with torch.no_grad():
        param.view(-1)[0] = value


@pytest.mark.parametrize("mechanism", MAIN)
def test_eager_model_rejects_every_nonfinite_parameter(mechanism):
    """Each parameter the forward reads, NaN in one entry: a ValueError naming what went non-finite,
    the input of the op or layer that reads it, or, past the last layer, the logits and the parameter."""
    idx, tgt = _batch()
    model = _model(mechanism)
    for name, param in model.named_parameters():
        keep = param.detach().clone()
        _nan_at(param)
        with pytest.raises(ValueError, match=r"^\w+ must be finite, got \d+ NaN") as err:
            model(idx, tgt)
        if str(err.value).startswith("logits"):
            assert f"parameter {name} has 1 NaN" in str(err.value)
        with torch.no_grad():
            param.copy_(keep)


def test_eager_model_inf_parameter_and_overflow():
    idx, tgt = _batch()
    model = _model("hybrid")
    _nan_at(model.norm_f.weight, float("-inf"))
    with pytest.raises(ValueError, match=r"^logits must be finite.*parameter norm_f.weight has 0 NaN and 1 inf"):
        model(idx, tgt)
    model = _model("softmax")
    with torch.no_grad():
        model.norm_f.weight.fill_(1e38)  # finite, but the logits overflow
        model.head.weight.mul_(50)
    with pytest.raises(ValueError, match=r"^logits must be finite.*no parameter is non-finite: an activation overflowed"):
        model(idx)


def test_ops_called_directly_still_check_values():
    q = torch.randn(1, 2, 8, 4)
    bad = q.clone()
    bad[0, 1, 7, 0] = float("nan")
    qs, ks = torch.randn(1, 2, 8), torch.randn(1, 2, 8)
    with pytest.raises(ValueError, match=r"^k must be finite"):
        softmax_attention(q, bad, q)
    with pytest.raises(ValueError, match=r"^qs must be finite"):
        scalar_attention(qs.masked_fill(qs > 0, float("inf")), ks, q, 0.5)
    with pytest.raises(ValueError, match=r"^tau must be > 0"):
        hybrid_attention(q, q, q, qs, ks, torch.tensor([0.5, -1.0]))
    with checks.async_value_checks():  # the model's block: CPU tensors are still checked eagerly
        with pytest.raises(ValueError, match=r"^k must be finite"):
            softmax_attention(q, bad, q)


@pytest.mark.heavy
def test_op_compiled_alone_asserts_in_graph():
    """An op compiled on its own traces without a break and keeps its checks as asserts; the fused
    SDPA kernel would otherwise turn a NaN query row into zeros, silently."""
    fn = torch.compile(softmax_attention, fullgraph=True, backend="eager")
    q = torch.randn(1, 2, 8, 4)
    assert _close(fn(q, q, q), softmax_attention(q, q, q))
    bad = q.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(RuntimeError, match=r"q must be finite \(checked in a compiled graph\)"):
        fn(bad, q, q)
    taus = torch.compile(hybrid_attention, fullgraph=True, backend="eager")
    qs = torch.randn(1, 2, 8)
    with pytest.raises(RuntimeError, match=r"tau must be > 0"):
        taus(q, q, q, qs, qs, torch.tensor([0.5, -1.0]))


def test_compiled_value_checks_off():
    """checks.COMPILED_VALUE_CHECKS = False leaves them out of graphs traced from then on."""
    q = torch.randn(1, 2, 8, 4)
    bad = q.clone()
    bad[0, 0, 3, 0] = float("nan")
    old, checks.COMPILED_VALUE_CHECKS = checks.COMPILED_VALUE_CHECKS, False
    try:
        out = torch.compile(softmax_attention, fullgraph=True, backend="eager")(q, bad, q)
    finally:
        checks.COMPILED_VALUE_CHECKS = old
    assert torch.isnan(out).any()
    with pytest.raises(ValueError, match=r"^k must be finite"):
        softmax_attention(q, bad, q)  # eager calls check as ever


def test_eager_doc_ids_path_still_checks():
    model = _model("scalar")
    idx, tgt = _batch()
    doc_ids = torch.zeros_like(idx)
    doc_ids[:, 9:] = 1
    model(idx, tgt, doc_ids=doc_ids)
    _nan_at(model.blocks[0].attn.wks.weight)
    with pytest.raises(ValueError, match=r"^ks must be finite"):
        model(idx, tgt, doc_ids=doc_ids)


@pytest.mark.slow
@pytest.mark.parametrize("mechanism", MAIN)
def test_inductor_fullgraph_equal_eager(mechanism):
    model = _model(mechanism)
    idx, tgt = _batch()
    logits, loss = model(idx, tgt)
    compiled = torch.compile(model, fullgraph=True)
    c_logits, c_loss = compiled(idx, tgt)
    c_loss.backward()
    assert _close(c_logits, logits, 1e-4) and _close(c_loss, loss, 1e-4)


@pytest.mark.heavy
def test_compiled_check_keeps_no_float32_logits_for_the_backward():
    """The compiled step's value check reads the final hidden state and the loss, not the logits: its
    reduction over the logits made Inductor save the float32 log-softmax (B x T x vocab) for the backward,
    1.6 GB more peak memory at GPT-2 small's shape on a GPU. The LM's buffers of logits' size are those
    of the plain PyTorch model in benchmarks/gpu_train.py: the bf16 logits, no float32 copy. And a batch
    whose every target is left out (a NaN mean loss) still passes the check."""
    import re
    import sys

    from torch._inductor.utils import run_and_get_code

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_train
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    shape, B, T = dict(vocab=4096, d_model=32, n_layers=1, n_heads=2), 2, 64
    found = {}
    for name in ("baseline", "softmax"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.compile(gpu_train.build(name, T, shape))
        idx = torch.randint(0, shape["vocab"], (B, T + 1))

        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(idx[:, :-1], idx[:, 1:])
            loss.backward()

        _, codes = run_and_get_code(step)
        found[name] = sorted(d for c in codes for n, d in re.findall(
            r"empty_strided_cpu\(\(([^)]*)\), \([^)]*\), torch\.(\w+)\)", c) if _numel(n) >= B * T * shape["vocab"])
    assert found["softmax"] == found["baseline"] and "float32" not in found["softmax"], found
    targets = torch.full((B, T), -100)
    _, loss = model(idx[:, :-1], targets)  # every target left out: nothing to score, no fault
    assert loss.isnan()


def _numel(dims: str) -> int:
    n = 1
    for d in filter(None, (x.strip() for x in dims.split(","))):
        n *= int(d)
    return n
