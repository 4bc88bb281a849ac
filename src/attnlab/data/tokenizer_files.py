"""A model's own tokenizer, from its files: `data.tokenizer = "path/to/tokenizer.json"` (or a folder
holding one) or `"path/to/model.gguf"` (the tokenizer a GGUF file carries in its metadata).

    tok = load_tokenizer_file("SmolLM2-135M-Instruct.Q4_1.gguf")   # 49,152 ids, EOS "<|im_end|>"
    tok.save_pretrained("runs/x/tokenizer")                        # tokenizer.json + tokenizer_config.json

A tokenizer.json is loaded by `tokenizers` as it is. Its EOS (the document separator in packed
training data) is the `eos_token` of a `tokenizer_config.json` beside it, as Hugging Face model
folders have; without one, the first of EOS_NAMES that the tokenizer holds. A GGUF file's
tokenizer is rebuilt as a `tokenizers` tokenizer (`attnlab.data.gguf_tokenizer`), its EOS the one
the file names.

A run records the tokenizer it trained with in its folder (`save_pretrained`: the same two files,
the second also naming the file it came from), so a resumed run, `attnlab sample` and
`attnlab export` read back exactly that tokenizer, wherever the original file has gone since.

Loading is cached per process by (path, size, modification time): reading a GGUF's tokenizer with
the `gguf` package takes seconds for a 49K vocabulary.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from .cache import atomic_write_text
from .tokenizer_base import TokenizersTokenizer

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# document separators that tokenizers without a tokenizer_config.json commonly name, in this order
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>")
WHAT = "'byte', 'bpe', or the path of a tokenizer.json, a folder holding one, or a .gguf file"


class PretrainedTokenizer(TokenizersTokenizer):
    """A tokenizer read from a model's files; `source` is the file it came from."""

    def __init__(self, tok, eos_token: str, source: str):
        super().__init__(tok, eos_token, "")
        self.source = source
        self.name = f"{Path(source).name} ({self.vocab_size} ids)"

    def save_pretrained(self, folder: str | os.PathLike) -> Path:
        """Write tokenizer.json and tokenizer_config.json (eos_token, and the source file) into
        `folder`, atomically each; returns the tokenizer.json path, which loads this tokenizer back."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        config = {"eos_token": self.eos_token, "source": self.source}
        atomic_write_text(folder / TOKENIZER_CONFIG, json.dumps(config, indent=1) + "\n")
        return atomic_write_text(folder / TOKENIZER_JSON, self.to_str())


def tokenizer_file(spec: str, name: str = "path") -> Path:
    """The tokenizer file `spec` names (a .json or .gguf file, or a folder holding tokenizer.json),
    or ValueError naming `name` and what it accepts."""
    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(f"{name} must be {WHAT}, got {type(spec).__name__}")
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / TOKENIZER_JSON).is_file():
            raise ValueError(f"{name} must be {WHAT}; the folder {str(spec)!r} holds no {TOKENIZER_JSON}")
        return path / TOKENIZER_JSON
    if not path.is_file():
        raise ValueError(f"{name} must be {WHAT}, got {str(spec)!r} (no such file or folder)")
    if path.suffix.lower() not in (".json", ".gguf"):
        raise ValueError(f"{name} must be {WHAT}, got {str(spec)!r} (a file that is neither .json nor .gguf)")
    return path


def load_tokenizer_file(spec: str | os.PathLike, name: str = "path") -> PretrainedTokenizer:
    """The tokenizer of a tokenizer.json (or a folder holding one) or a GGUF file. Errors are
    ValueErrors naming `name` (e.g. "data.tokenizer") and the file."""
    path = tokenizer_file(spec, name)
    st = path.stat()
    try:
        return _load(str(path.resolve()), st.st_size, st.st_mtime_ns)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def tokenizer_vocab_size(spec: str | os.PathLike, name: str = "path") -> int:
    """The vocabulary size of the tokenizer file `spec` (loading it, cached)."""
    return load_tokenizer_file(spec, name).vocab_size


@functools.lru_cache(maxsize=4)
def _load(path: str, size: int, mtime_ns: int) -> PretrainedTokenizer:
    if path.lower().endswith(".gguf"):
        from .gguf_tokenizer import read_gguf_tokenizer

        tok, eos = read_gguf_tokenizer(path)
        return PretrainedTokenizer(tok, eos, path)
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises its own Exception type for a malformed file
        raise ValueError(f"{path!r} is not a tokenizers JSON file: {str(e).splitlines()[0][:200]}") from None
    return PretrainedTokenizer(tok, _json_eos(tok, Path(path)), path)


def _json_eos(tok, path: Path) -> str:
    """The EOS of a tokenizer.json: tokenizer_config.json's eos_token beside it, else a known name."""
    config = path.with_name(TOKENIZER_CONFIG)
    if config.is_file():
        try:
            eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
        except (ValueError, AttributeError) as e:
            raise ValueError(f"{str(config)!r} is not a JSON object: {e}") from None
        if isinstance(eos, dict):  # {"content": "</s>", ...} in older files
            eos = eos.get("content")
        if eos is not None:
            if not isinstance(eos, str) or tok.token_to_id(eos) is None:
                raise ValueError(f"the eos_token {eos!r} of {str(config)!r} is not a token of {str(path)!r}")
            return eos
    for eos in EOS_NAMES:
        if tok.token_to_id(eos) is not None:
            return eos
    raise ValueError(f"{str(path)!r} has no EOS token to separate documents: put a {TOKENIZER_CONFIG} "
                     f"with an eos_token beside it, or give the tokenizer one of {', '.join(EOS_NAMES)}")
