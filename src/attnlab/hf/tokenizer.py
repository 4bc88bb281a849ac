"""attnlab's tokenizers as transformers `PreTrainedTokenizerFast` objects that `AutoTokenizer` loads.

- byte: a `tokenizers` BPE model with no merges over GPT-2's byte-to-character alphabet, so each
  UTF-8 byte b is one token with id b, and "<|endoftext|>" is id 256 (the ByteTokenizer's EOS).
  `encode` gives exactly `ByteTokenizer.encode`'s ids (tested on non-ASCII text).
- bpe: the trained vocabulary itself (its tokenizers JSON), EOS "<|endoftext|>".
- a model's own tokenizer (data.tokenizer = a tokenizer.json or a GGUF file): its tokenizers JSON,
  EOS the one it names (SmolLM2-Instruct's "<|im_end|>").

All define eos_token = pad_token = the tokenizer's EOS (byte and bpe vocabularies have no other
special token, and a pad id must lie inside the model's vocabulary) and pad on the left by default, which
is what batched generation wants (right padding works too in plain forwards: see
`attnlab.hf.modeling`). No BOS is added.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from attnlab.data.tokenizer import EOS_TOKEN, ByteTokenizer, TokenizersTokenizer


def _byte_backend() -> Tokenizer:
    alphabet = _bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_TOKEN])
    if tok.token_to_id(EOS_TOKEN) != ByteTokenizer.eos_id:
        raise AssertionError(f"the byte vocabulary put {EOS_TOKEN} at {tok.token_to_id(EOS_TOKEN)}, not {ByteTokenizer.eos_id}")
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 byte values to printable characters (the alphabet the
    ByteLevel pre-tokenizer writes bytes in): printable Latin-1 bytes map to themselves, the rest
    to the characters from U+0100 on, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def hf_tokenizer(tok, model_max_length: int | None = None) -> PreTrainedTokenizerFast:
    """The transformers tokenizer of an attnlab ByteTokenizer, BPETokenizer or PretrainedTokenizer."""
    if isinstance(tok, ByteTokenizer):
        backend, eos = _byte_backend(), EOS_TOKEN
    elif isinstance(tok, TokenizersTokenizer):  # a trained BPE, or a model's own tokenizer
        backend, eos = Tokenizer.from_str(tok.to_str()), tok.eos_token
    else:
        raise TypeError(f"tok must be an attnlab ByteTokenizer, BPETokenizer or PretrainedTokenizer, "
                        f"got {type(tok).__name__}")
    kwargs = {"model_max_length": model_max_length} if model_max_length else {}
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, pad_token=eos,
                                   padding_side="left", clean_up_tokenization_spaces=False,
                                   model_input_names=["input_ids", "attention_mask"], **kwargs)
