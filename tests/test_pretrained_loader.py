"""The one pretrained-model loader (attnlab.search.hf_model) as search and retrofit use it, and the
one atomic, verified folder write (attnlab.hf.export.write_folder) behind export and retrofit.save."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from attnlab.search import hf_model as M  # noqa: E402


def test_one_family_table_for_search_and_retrofit():
    from attnlab.retrofit import FAMILIES
    from attnlab.retrofit.convert import RetrofitError

    assert M.SUPPORTED_FAMILIES == ("llama", "mistral", "qwen2", "qwen3")
    assert M.RETROFIT_FAMILIES == FAMILIES == ("llama", "qwen2")
    assert set(M.RETROFIT_FAMILIES) <= set(M.SUPPORTED_FAMILIES)
    qwen3 = M.tiny_model("qwen3", n_layers=1).config
    M.check_family(qwen3)  # search reads it
    with pytest.raises(RetrofitError, match=r"model family 'qwen3' is not supported: need one of \('llama', 'qwen2'\)"):
        M.check_family(qwen3, "retrofit", RetrofitError)
    with pytest.raises(ValueError, match="use must be one of"):
        M.families("train")


def test_resolve_source_errors(tmp_path):
    with pytest.raises(ValueError, match="model must be a non-empty string"):
        M.resolve_source("")
    with pytest.raises(ValueError, match=r"^--model must be 'smollm2', a model folder or a \.gguf file"):
        M.resolve_source("", hub=False, what="--model")
    with pytest.raises(ValueError, match="is not 'smollm2', an existing folder or a .gguf file"):
        M.resolve_source(str(tmp_path / "missing"), hub=False)
    assert M.resolve_source("org/name") == M.ModelSource("org/name")  # a hub id, not looked up here
    with pytest.raises(ValueError, match="looks like a GGUF file but does not exist"):
        M.resolve_source(str(tmp_path / "x.gguf"), hub=False)
    (tmp_path / "x.gguf").write_bytes(b"")
    src = M.resolve_source(str(tmp_path / "x.gguf"))
    assert src == M.ModelSource(str(tmp_path), "x.gguf")
    assert M.gguf_kwargs(src) == {"gguf_file": "x.gguf"} and M.gguf_kwargs(M.ModelSource("f")) == {}


def test_retrofit_source_errors_name_the_flag(tmp_path):
    from attnlab.retrofit import RetrofitError, plan_source

    with pytest.raises(RetrofitError, match="--model must be"):
        plan_source("", "0", "softmax")
    with pytest.raises(RetrofitError, match="--model '.*' is not 'smollm2'"):
        plan_source(str(tmp_path / "missing"), "0", "softmax")
    with pytest.raises(RetrofitError, match="--model '.*' looks like a GGUF file"):
        plan_source(str(tmp_path / "missing.gguf"), "0", "softmax")
    with pytest.raises(RetrofitError, match="no readable model config"):
        plan_source(str(tmp_path), "0", "softmax")


def test_one_byte_encoding():
    from attnlab.retrofit.transfer import byte_encode, text_encoding
    from attnlab.search.lm import tiny_lm

    text = bytes(range(256)).decode("latin-1")  # every code point below 256: 1- and 2-byte UTF-8
    lm = tiny_lm("llama", n_layers=1)
    assert lm.encode(text) == [b + 3 for b in text.encode("utf-8")] and lm.eos_id == 2  # ids 3..258 of 260
    assert max(lm.encode(text)) < lm.model.config.vocab_size
    assert byte_encode(260)(text) == lm.encode(text)
    small = M.byte_encode(97)(text)
    assert small == [3 + b % 94 for b in text.encode("utf-8")] and max(small) < 97
    assert text_encoding(lm.model.config)[0](text) == lm.encode(text)


def test_encoding_and_eos():
    class Tok:
        eos_token_id = 7

        def __call__(self, text, add_special_tokens=True):
            assert not add_special_tokens
            return {"input_ids": [len(text)]}

    class Config:
        vocab_size, eos_token_id = 300, [5, 6]

    encode, eos = M.encoding(Config(), Tok())
    assert encode("abc") == [3] and eos == 7
    encode, eos = M.encoding(Config())
    assert encode("a") == [ord("a") + 3] and eos == 5
    Config.eos_token_id = None
    with pytest.raises(ValueError, match="the model config has no EOS token"):
        M.encoding(Config())
    Tok.eos_token_id = None
    with pytest.raises(ValueError, match="the tokenizer has no EOS token"):
        M.encoding(Config(), Tok())


def test_load_model_for_search_and_retrofit(tmp_path):
    from attnlab.retrofit import load_source
    from attnlab.retrofit.io import tokenizer_encoding

    M.tiny_model("llama", n_layers=2, d_model=32, vocab=50).save_pretrained(tmp_path)
    src = M.resolve_source(str(tmp_path))
    config = M.load_hf_config(src)
    dims = M.model_dims(config)
    assert (dims.n_layers, dims.d_model, dims.n_heads, dims.n_kv_heads, dims.head_dim) == (2, 32, 4, 2, 8)
    frozen = M.load_model(src, device="cpu")
    assert not frozen.training and not any(p.requires_grad for p in frozen.parameters())
    assert next(frozen.parameters()).device == torch.device("cpu")
    model, tok = load_source(src)  # retrofit: eval mode, weights left trainable, no tokenizer in the folder
    assert not model.training and all(p.requires_grad for p in model.parameters()) and tok is None
    assert tokenizer_encoding(tok) == (None, None)
    with pytest.raises((OSError, ValueError)):
        M.load_tokenizer(src)
    assert M.load_tokenizer(src, optional=True) is None
    idx = torch.randint(50, (1, 5))
    with torch.no_grad():
        assert torch.equal(frozen(idx).logits, model(idx).logits)


def test_write_folder_is_atomic_and_keeps_checkpoints(tmp_path):
    from attnlab.hf.export import write_folder

    out = tmp_path / "out"
    (out / "transfer").mkdir(parents=True)
    (out / "transfer" / "layer1.safetensors").write_text("state")

    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps({"ok": True}))

    def refuse(tmp: Path) -> None:
        assert (tmp / "config.json").is_file()
        raise RuntimeError("logits differ")

    with pytest.raises(RuntimeError, match="logits differ"):
        write_folder(out, write, refuse, keep=("transfer", "finetune"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary sibling, no lock file
    assert sorted(p.name for p in out.iterdir()) == ["transfer"]
    assert (out / "transfer" / "layer1.safetensors").read_text() == "state"  # back for a rerun
    seen = []
    assert write_folder(out, write, lambda tmp: None, recheck=seen.append, keep=("transfer", "finetune")) == out
    assert seen == [out] and sorted(p.name for p in out.iterdir()) == ["config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_check_reload_uses_one_relative_error(tmp_path):
    from attnlab.hf.export import check_reload
    from attnlab.retrofit import convert, logit_error
    from attnlab.testing import rel_rms

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 5, 7, generator=g), torch.randn(2, 5, 7, generator=g)
    assert rel_rms(a, b, floor=1e-30) == logit_error(a, b)
    assert logit_error(a, torch.zeros_like(b)) == rel_rms(a, torch.zeros_like(b), floor=1e-30)
    r = convert(M.tiny_model("llama", n_layers=2, d_model=32, vocab=50), "1", "softmax")
    r.save_pretrained(tmp_path)
    idx = torch.randint(50, (1, 8), generator=g)
    with torch.no_grad():
        want = r(idx).logits
    check_reload(tmp_path, idx, want, 1e-6, "the model")
    with pytest.raises(RuntimeError, match="differ from the model's by .* relative"):
        check_reload(tmp_path, idx, want + 1.0, 1e-6, "the model")


def test_a_config_is_read_once_per_file_version(tmp_path, monkeypatch):
    """load_hf_config reads a model's config once while its file is unchanged (a GGUF's metadata takes
    seconds; a trial spec validates every variant against it), hands out a copy each time, and reads
    it again once the file changes."""
    from transformers import AutoConfig

    M.tiny_model("llama", n_layers=2, d_model=32, vocab=50).save_pretrained(tmp_path)
    src = M.resolve_source(str(tmp_path))
    reads, real = [], AutoConfig.from_pretrained
    monkeypatch.setattr(AutoConfig, "from_pretrained", lambda *a, **k: reads.append(a) or real(*a, **k))
    M._read_config.cache_clear()
    first, second = M.load_hf_config(src), M.load_hf_config(src)
    assert len(reads) == 1 and first is not second and first.to_dict() == second.to_dict()
    first.num_hidden_layers = 99  # a caller's change reaches no other caller
    assert M.load_hf_config(src).num_hidden_layers == 2
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(cfg) + "\n" * 3)  # a new size: a new version
    assert M.load_hf_config(src).num_hidden_layers == 3 and len(reads) == 2
