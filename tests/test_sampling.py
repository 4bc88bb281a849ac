"""Sampling the next token (attnlab.models.sampling) and `attnlab sample`: top-k and top-p keep what they
say, a seed fixes the text, top_k = 1 is greedy, and bad options are refused by name."""

from __future__ import annotations

import pytest
import torch

from attnlab.models import LM, ModelConfig
from attnlab.models.sampling import check_sampling, filter_logits, next_token


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1], [0.1, 0.2, 0.3, 0.4]]))
    kept = torch.isfinite(filter_logits(logits, top_k=2))
    assert kept.tolist() == [[True, True, False, False], [False, False, True, True]]
    kept = torch.isfinite(filter_logits(logits, top_p=0.7))  # 0.5 + 0.25 reach 0.7; 0.4 + 0.3 do
    assert kept.tolist() == [[True, True, False, False], [False, False, True, True]]
    kept = torch.isfinite(filter_logits(logits, top_p=0.1))  # the most likely token always stays
    assert kept.sum(-1).tolist() == [1, 1]
    assert torch.equal(filter_logits(logits, top_k=4, top_p=1.0), logits)


def test_draws_follow_the_filtered_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(20000, 4)
    g = torch.Generator().manual_seed(0)
    draws = next_token(logits, greedy=False, top_k=2, generator=g).flatten()
    share = torch.bincount(draws, minlength=4).float() / draws.numel()
    assert share[2:].sum() == 0 and abs(share[0] - 0.5 / 0.8) < 0.02


@pytest.mark.parametrize("bad", [dict(temperature=0.0), dict(top_k=0), dict(top_p=0.0), dict(top_p=1.2), dict(top_k=True)])
def test_bad_options_are_named(bad):
    opts = dict(greedy=False, temperature=1.0, top_k=None, top_p=None) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        check_sampling(**opts)


def _model():
    torch.manual_seed(0)
    return LM(ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, attn=["softmax", "hybrid"]))


def test_generate_is_fixed_by_its_seed_and_top_k_1_is_greedy():
    model, idx = _model(), torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(1))
    run = lambda seed, **kw: model.generate(idx, 12, greedy=False, generator=torch.Generator().manual_seed(seed), **kw)  # noqa: E731
    assert torch.equal(run(3, top_p=0.9, temperature=0.7), run(3, top_p=0.9, temperature=0.7))
    assert not torch.equal(run(3), run(4))
    assert torch.equal(run(5, top_k=1), model.generate(idx, 12))


def test_sample_command(tmp_path, capsys):
    from attnlab.cli import main

    assert main(["train", "configs/tiny.toml", f"run.out_dir={tmp_path}", "train.steps=2", "run.threads=1",
                 "train.eval_every=0", "data.max_docs=5"]) == 0
    run = str(tmp_path / "tiny")
    capsys.readouterr()
    assert main(["sample", run, "--prompt", "def ", "--max-tokens", "8", "--top-k", "5", "--seed", "2"]) == 0
    first = capsys.readouterr().out
    assert first.startswith("def ") and main(["sample", run, "--prompt", "def ", "--max-tokens", "8", "--top-k", "5",
                                               "--seed", "2"]) == 0
    assert capsys.readouterr().out == first
    assert main(["sample", run, "--top-p", "2"]) == 2
    assert "--top-p must be" in capsys.readouterr().err
    assert main(["sample", str(tmp_path / "nothing")]) == 2


@pytest.mark.heavy
def test_compare_command(tmp_path, capsys):
    """Two runs side by side: a table of their numbers, written with its JSON and the loss-curve plot;
    a folder that is not a finished run is refused by name, before anything is written."""
    from attnlab.cli import main

    for attn in ("softmax", "hybrid"):
        assert main(["train", "configs/tiny.toml", f"run.out_dir={tmp_path}", f"run.name={attn}", f"model.attn={attn}",
                     "train.steps=2", "run.threads=1", "train.eval_every=0", "data.max_docs=5"]) == 0
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "softmax"), str(tmp_path / "hybrid"), "--out", str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    assert "| softmax | softmax |" in out and "| hybrid | hybrid |" in out
    assert {p.name for p in (tmp_path / "cmp").iterdir()} == {"compare.md", "compare.json", "compare_loss.png"}
    assert main(["compare", str(tmp_path / "softmax"), str(tmp_path / "nothing"), "--out", str(tmp_path / "c2")]) == 2
    assert "not a finished run" in capsys.readouterr().err and not (tmp_path / "c2").exists()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, 0.9), (0.7, 5, None), (0.7, None, 0.8),
                                                     (1.5, 10, 0.9), (0.3, 3, 0.5), (2.0, None, 0.95)])
def test_the_distribution_is_hugging_faces(temperature, top_k, top_p):
    """The distribution a sampled token is drawn from equals what transformers' generate draws from
    with the same options (its warpers: temperature, then top-k, then top-p), token for token."""
    pytest.importorskip("transformers")
    from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(3)) * 3
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)]
                                  + ([TopKLogitsWarper(top_k)] if top_k else [])
                                  + ([TopPLogitsWarper(top_p)] if top_p else []))
    want = torch.softmax(warpers(torch.zeros(64, 1, dtype=torch.long), logits.clone()), dim=-1)
    got = torch.softmax(filter_logits(logits / temperature, top_k, top_p), dim=-1)
    assert torch.equal(got > 0, want > 0)
    assert torch.allclose(got, want, atol=1e-6)
    draws = next_token(logits, greedy=False, temperature=temperature, top_k=top_k, top_p=top_p,
                       generator=torch.Generator().manual_seed(0))
    assert bool((want.gather(-1, draws) > 0).all())  # every draw is one transformers could make
