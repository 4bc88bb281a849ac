"""The trainer's speed options, on the CPU (a step that reads nothing back: tests/test_no_host_sync.py):
activation checkpointing that changes no number, fused AdamW and TF32 where they apply,
torch.compile through train.compile, and gradient checkpointing from the Hugging Face wrapper."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnlab.train import load_config
from attnlab.train.setup import allow_tf32, make_optimizer
from attnlab.train.trainer import Trainer

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"


@pytest.fixture(scope="module")
def corpus(argparse_corpus) -> str:
    return argparse_corpus


def trainer(tmp_path, corpus, *overrides) -> Trainer:
    return Trainer(load_config(TINY, [f"run.out_dir={tmp_path}", f"data.source={corpus}", "run.threads=1",
                                      "train.eval_every=0", *overrides]))


def test_checkpoint_activations_changes_no_number(tmp_path, corpus, monkeypatch):
    """Three steps with block activations recomputed in the backward pass equal three without, bit for
    bit (float32, one thread), and the recomputation did happen on the steps that record nothing."""
    used = []
    real = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: used.append(1) or real(*a, **k))
    params = {}
    for on in (False, True):
        t = trainer(tmp_path, corpus, "train.steps=3", "train.log_every=3", "model.attn=hybrid",
                    f"train.checkpoint_activations={str(on).lower()}", f"run.name=ckpt-{on}")
        for _ in range(3):
            t.train_step()
        params[on] = [p.detach().clone() for p in t.model.parameters()]
        t.close()
    assert len(used) == 2 * 2  # steps 1 and 2 (step 3 logs, so it records) x 2 blocks
    assert all(torch.equal(a, b) for a, b in zip(params[False], params[True]))


def test_fused_adamw_and_tf32_only_where_they_apply():
    model = torch.nn.Linear(4, 4)
    tcfg = load_config(TINY, []).train
    assert not make_optimizer(model, tcfg, torch.device("cpu")).defaults.get("fused")
    before = torch.backends.cuda.matmul.allow_tf32
    allow_tf32(torch.device("cpu"), not before)  # the CPU has no TF32 switch to flip
    assert torch.backends.cuda.matmul.allow_tf32 == before


@pytest.mark.heavy
def test_train_compile_runs_the_compiled_model(tmp_path, corpus, monkeypatch):
    """train.compile wraps the model in torch.compile (aot_eager here, for the CPU's time); the
    checkpointed module stays the plain one and the losses equal eager's closely."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda m, **k: real(m, backend="aot_eager"))
    rows = {}
    for on in (False, True):
        t = trainer(tmp_path, corpus, "train.steps=2", "train.log_every=1", f"train.compile={str(on).lower()}",
                    f"run.name=compile-{on}")
        rows[on] = [float(t.train_step()["loss"]) for _ in range(2)]
        assert (t.ddp_model is not t.model) == on
        t.close()
    assert rows[True] == pytest.approx(rows[False], rel=1e-5)


def test_hf_gradient_checkpointing_sets_the_lm_flag():
    """transformers' gradient_checkpointing_enable() (what its Trainer calls) turns on the LM's own
    recomputation, and the gradients stay those of the plain model."""
    pytest.importorskip("transformers")
    from attnlab.hf.configuration import AttnlabConfig
    from attnlab.hf.modeling import AttnlabForCausalLM
    from attnlab.models import ModelConfig

    torch.manual_seed(0)
    hf = AttnlabForCausalLM(AttnlabConfig.from_model_config(
        ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, attn="hybrid", max_seq_len=16))).train()
    ids = torch.randint(0, 64, (2, 16))
    grads = {}
    for on in (False, True):
        if on:
            enable = getattr(hf, "activation_checkpointing_enable", None) or hf.gradient_checkpointing_enable
            enable()  # transformers 5 renamed it; 4.x has the old name
            assert hf.model.gradient_checkpointing
        hf.zero_grad()
        hf(input_ids=ids, labels=ids).loss.backward()
        grads[on] = [p.grad.clone() for p in hf.parameters()]
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(grads[False], grads[True]))


def test_train_compile_is_auto_by_default():
    """train.compile defaults to 'auto': compiled on CUDA (where one graph trains at a plain GPT's speed),
    eager on the CPU; true and false are kept as given, anything else is refused naming the key."""
    from attnlab.models.config import ConfigError
    from attnlab.train.config import TrainConfig

    auto = TrainConfig()
    assert auto.compile == "auto" and auto.compiles("cuda") and not auto.compiles(torch.device("cpu"))
    assert TrainConfig(compile=True).compiles("cpu") and not TrainConfig(compile=False).compiles("cuda")
    with pytest.raises(ConfigError, match="train.compile"):
        load_config(None, ["train.compile=sometimes"])


def test_cpu_kernels_load_before_the_graph_is_traced(monkeypatch):
    """On the CPU, compile_model loads attnlab's compiled CPU kernels before torch.compile: a graph traced
    while they are not loaded keeps the PyTorch paths for good (ops/_ext.py, `_loaded`)."""
    from attnlab.ops import _ext
    from attnlab.train.setup import compile_model

    order = []
    monkeypatch.setattr(_ext, "library", lambda: order.append("load"))
    monkeypatch.setattr(torch, "compile", lambda m, **k: order.append("compile") or m)
    m = torch.nn.Linear(2, 2)
    assert compile_model(m, torch.device("cpu")) is m and order == ["load", "compile"]
    order.clear()
    compile_model(m, torch.device("meta"))  # elsewhere: nothing to load
    assert order == ["compile"]
