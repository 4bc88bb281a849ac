"""The tokenizer a GGUF file carries, rebuilt as a `tokenizers` tokenizer.

A GGUF file (llama.cpp's format) holds no tokenizer.json; it stores the vocabulary under llama.cpp's
metadata keys, read here with the `gguf` package:

    tokenizer.ggml.model        "gpt2": byte-level BPE (SmolLM2, GPT-2, Llama 3, Qwen 2, ...)
    tokenizer.ggml.pre          how text is split before BPE ("smollm", "gpt2", "llama-bpe", "qwen2", ...)
    tokenizer.ggml.tokens       the vocabulary, token i having id i, in GPT-2's byte alphabet
    tokenizer.ggml.merges       the BPE merges, "a b", best first
    tokenizer.ggml.token_type   per token: 1 normal, 3 control (special), 4 user-defined, ...
    tokenizer.ggml.eos_token_id the end-of-sequence token (attnlab's document separator)

The rebuilt tokenizer is what llama.cpp runs for that `pre` type: a BPE model over the tokens and
merges, the pre-tokenizer below, a byte-level decoder; control tokens are special tokens (matched
whole in text, dropped by decode), user-defined ones added tokens. SmolLM2's "smollm" splits every
digit off on its own before GPT-2's byte-level split, as its tokenizer.json does. Sentencepiece
vocabularies ("llama") and `pre` types not listed in PRE_TOKENIZERS (a file without one included:
llama.cpp then runs its "default" split, not GPT-2's) are refused by name rather than split
differently from the model's own tokenizer.
"""

from __future__ import annotations

# llama.cpp's split for Llama 3 ("llama-bpe") and, with single digits, Qwen 2
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")

# tokenizer.ggml.pre -> (what runs before byte-level BPE, match whole words in the vocabulary first)
PRE_TOKENIZERS = {
    "gpt2": ("gpt2", False),
    "smollm": ("digits", False),
    "llama-bpe": (_LLAMA3_SPLIT, True),
    "llama3": (_LLAMA3_SPLIT, True),
    "llama-v3": (_LLAMA3_SPLIT, True),
    "qwen2": (_QWEN2_SPLIT, False),
}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types (gguf.TokenType)


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def read_gguf_tokenizer(path: str):
    """(tokenizers.Tokenizer, its EOS token) of the GGUF file `path`; ValueError naming the file and
    the key when it is not a GGUF file, carries no tokenizer, or one attnlab cannot rebuild exactly."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ValueError("reading a GGUF file's tokenizer needs the gguf package: pip install 'attnlab[hf]'") from None
    try:
        reader = GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - gguf raises ValueError, struct and numpy errors on a bad file
        raise ValueError(f"{path!r} is not a readable GGUF file: {type(e).__name__}: {str(e)[:200]}") from None
    model = _field(reader, "tokenizer.ggml.model")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if model is None or not tokens:
        raise ValueError(f"the GGUF file {path!r} carries no tokenizer "
                         f"(no tokenizer.ggml.model / tokenizer.ggml.tokens)")
    if model != "gpt2":
        raise ValueError(f"the GGUF file {path!r} has a {model!r} tokenizer (tokenizer.ggml.model); attnlab reads "
                         f"byte-level BPE ('gpt2') tokenizers only")
    pre = _field(reader, "tokenizer.ggml.pre")
    if pre is None:
        raise ValueError(f"the GGUF file {path!r} names no pre-tokenizer (tokenizer.ggml.pre; llama.cpp would split "
                         f"its 'default' way); attnlab knows {', '.join(sorted(PRE_TOKENIZERS))}")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"the GGUF file {path!r} splits text the {pre!r} way (tokenizer.ggml.pre); attnlab knows "
                         f"{', '.join(sorted(PRE_TOKENIZERS))}")
    merges = _field(reader, "tokenizer.ggml.merges") or []
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    eos_id = _field(reader, "tokenizer.ggml.eos_token_id")
    if eos_id is None:
        raise ValueError(f"the GGUF file {path!r} names no EOS token (tokenizer.ggml.eos_token_id)")
    if not 0 <= int(eos_id) < len(tokens) or len(types) != len(tokens):
        raise ValueError(f"the GGUF file {path!r} is inconsistent: {len(tokens)} tokens, {len(types)} token types, "
                         f"EOS id {eos_id}")
    prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix") or False)
    return build_byte_level_bpe(list(tokens), list(merges), list(types), pre, prefix), tokens[int(eos_id)]


def build_byte_level_bpe(tokens: list[str], merges: list[str], types: list[int], pre: str = "gpt2",
                         add_prefix_space: bool = False):
    """A `tokenizers` byte-level BPE tokenizer from llama.cpp's description of one (see the module)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    pairs = []
    for m in merges:
        parts = m.split(" ")
        if len(parts) != 2:
            raise ValueError(f"a BPE merge must be two tokens separated by one space, got {m!r}")
        pairs.append((parts[0], parts[1]))
    split, ignore_merges = PRE_TOKENIZERS[pre]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False, ignore_merges=ignore_merges))
    if split == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    elif split == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space,
                                                                              use_regex=True)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)
    return tok
