"""Every mechanism's LM compiles as one graph: torch.compile(fullgraph=True) traces it with no break,
and training steps of one shape (the parameters changing between them) reuse that graph: no
recompile. Counted with dynamo's own counters (graphs, breaks, recompiles) for each configuration a
model can run: softmax and its scalings, hybrid and scalar under both kernels, exact and through the
window, goat, goat_hybrid, principled, gla, ssd, cosformer, with gates, sinks, sliding windows, GQA
and packed documents.

The oldest torch the project runs on (the GPU machine's 2.11) cannot trace every construct that 2.13
can (`id()` of a tensor breaks its graph): `make test-compat` runs this file under that torch, and
tests/test_traceable.py forbids such constructs in the code a model calls."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

from attnlab.models import LM
from attnlab.models.config import ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")

V, B, T = 64, 2, 32

CONFIGS = {
    "softmax": {"attn": "softmax"},
    "softmax-ktotal": {"attn": "softmax", "attention": {"scale": "ktotal"}},
    "softmax-swa-gqa": {"attn": "softmax", "attention": {"sliding_window": 8, "n_kv_heads": 2}},
    "softmax-gate": {"attn": "softmax", "attention": {"output_gate": "elementwise"}},
    "scalar": {"attn": "scalar"},
    "scalar-cauchy-sink": {"attn": "scalar", "attention": {"kernel": "cauchy", "sink": True}},
    "hybrid": {"attn": "hybrid"},
    "hybrid-cauchy-gqa": {"attn": "hybrid", "attention": {"kernel": "cauchy", "n_kv_heads": 2}},
    "hybrid-window": {"attn": "hybrid", "attention": {"train_window": 4, "local_window": 8}},
    "hybrid-window-cauchy": {"attn": "hybrid", "attention": {"train_window": 4, "local_window": 8, "kernel": "cauchy"}},
    "scalar-window": {"attn": "scalar", "attention": {"train_window": 8}},
    "hybrid-swa-sink-gate": {"attn": "hybrid", "attention": {"sliding_window": 8, "sink": True, "output_gate": "headwise"}},
    "goat": {"attn": "goat", "attention": {"goat_rank": 2}},
    "goat_hybrid": {"attn": "goat_hybrid", "attention": {"goat_rank": 2}},
    "principled": {"attn": "principled"},
    "gla": {"attn": "gla"},
    "gla-output-norm-gate": {"attn": "gla", "attention": {"output_norm": True, "output_gate": "elementwise"}},
    "ssd": {"attn": "ssd"},
    "cosformer": {"attn": "cosformer"},
}


def _model(name: str) -> LM:
    torch.manual_seed(0)
    c = CONFIGS[name]
    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, attn=c["attn"], max_seq_len=T,
                      attention=dict(c.get("attention", {})))
    return LM(cfg)


def _count(model: LM, steps: int = 3, docs: bool = False) -> tuple[CompileCounter, dict]:
    torch._dynamo.reset()
    counters.clear()
    cnt = CompileCounter()
    fn = torch.compile(model, fullgraph=True, backend=cnt)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(0, V, (B, T), generator=g)
        doc_ids = None
        if docs:  # two documents per row, cut at the same place in every step (one shape)
            doc_ids = (torch.arange(T) >= T // 2).long().expand(B, T).contiguous()
        _, loss = fn(idx, idx, doc_ids=doc_ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return cnt, {k: dict(v) for k, v in counters.items() if k in ("graph_break", "recompiles")}


@pytest.mark.heavy
@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_graph_no_recompile(name):
    cnt, seen = _count(_model(name))
    assert cnt.frame_count == 1, f"{name}: {cnt.frame_count} graphs over 3 steps of one shape ({seen})"
    assert not seen.get("graph_break") and not seen.get("recompiles"), seen


@pytest.mark.heavy
@pytest.mark.parametrize("name", ["softmax", "hybrid-cauchy-gqa", "principled", "hybrid-window-cauchy"])
def test_packed_documents_one_graph(name):
    """Packed documents (doc_ids) through a compiled model: every mechanism that keeps documents apart
    inside its op (takes_documents) traces as one graph; the others are re-padded per step, which needs
    the segment lengths on the host, so the model refuses it under compile with a ValueError naming
    doc_ids and the layers (under fullgraph Dynamo reports the user error it observed as Unsupported,
    its message ours), and the trainer refuses train.compile with data.pack='documents' for such a
    model before anything is written."""
    model = _model(name)
    if model.takes_documents(torch.device("cpu")):
        cnt, seen = _count(model, docs=True)
        assert cnt.frame_count == 1 and not seen.get("graph_break"), seen
        return
    with pytest.raises(torch._dynamo.exc.Unsupported):
        _count(model, docs=True)
    # the error it observed is ours (the wording of Dynamo's report differs between torch versions)
    idx = torch.zeros(B, T, dtype=torch.long)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.compiler, "is_compiling", lambda: True)
        with pytest.raises(ValueError, match=r"doc_ids: packed documents under torch.compile need every layer to "
                                             r"keep documents apart .* layer 0 \(hybrid\)"):
            model(idx, doc_ids=torch.zeros_like(idx))


def test_the_trainer_refuses_compiled_packed_documents_it_would_re_pad(tmp_path):
    from pathlib import Path

    from attnlab.models.config import ConfigError
    from attnlab.train import load_config, train

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "configs" / "tiny.toml", [
        "model.attn=hybrid", "model.attention.train_window=4", "model.attention.local_window=8",
        "data.pack=documents", "train.compile=true", f"run.out_dir={tmp_path}", "run.name=r", "train.steps=2",
        "run.progress=false", "run.tensorboard=false"])
    with pytest.raises(ConfigError, match=r"train.compile with data.pack='documents': layer 0 \(hybrid\), .* "
                                          r"set train.compile=false or data.pack='stream'"):
        train(cfg)
    assert not (tmp_path / "r").exists()
