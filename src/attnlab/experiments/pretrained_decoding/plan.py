"""The items of a decoding comparison, generated from its spec with the model's tokenizer (no weights).

An item of length L uses positions 0..L-1. Task items: for each task, length and depth, the spec's
n_examples passkey examples (`attnlab.data.synthetic.passkey`, the keys drawn from the tasks' seed,
the needle haystack from held-out text); the prefill is everything before the question, and the
question and answer go through each method. Perplexity items: n_contexts held-out contexts per
length, L - continuation tokens of prefill, then `continuation` tokens predicted through each
method. Timing items: `prompts` contexts per length, `steps` single-token steps timed after
L - steps tokens of prefill. Every item's id names what it is (`passkey/2048/0.5/7`, `ppl/4096/3`,
`time/8192/0`) and its token ids have a digest the records keep, so a record made from other tokens
(another tokenizer or corpus) is refused.
"""

from __future__ import annotations

import hashlib
import random

import torch

from attnlab.data.synthetic import IGNORE, PASSKEY_QUESTION, passkey
from attnlab.search.capture import load_texts
from attnlab.search.hf_model import encoding, load_hf_config, load_tokenizer, resolve_source
from attnlab.search.task_plan import _Tokenizer

from .spec import Spec


def digest(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()[:16]


def _item(kind: str, name: str, ids: torch.Tensor, split: int, length: int, **extra) -> dict:
    """An item (`attnlab.search.decode_items`): its context `length` is the spec's, its prefill `split`."""
    ids = ids.to(torch.int32)
    return {"id": name, "kind": kind, "ids": ids, "split": int(split), "length": int(length), "sha": digest(ids),
            **extra}


def task_items(spec: Spec, tok: _Tokenizer) -> list[dict]:
    t = spec.tasks
    question = len(tok.encode(PASSKEY_QUESTION))
    filler = "\n\n".join(load_texts(t.corpus, t.split)) if "needle" in t.tasks else None
    if filler is not None and len(tok.encode(filler)) < max(spec.lengths):
        raise ValueError(f"[tasks] corpus={t.corpus!r} split={t.split!r} holds fewer tokens than the longest length "
                         f"{max(spec.lengths)}; the needle haystack would repeat")
    items = []
    for task in t.tasks:
        for L in spec.lengths:
            for depth in t.depths:
                inputs, labels = passkey(tok, L, depth, t.n_examples, seed=t.seed, digits=t.digits,
                                         filler=filler if task == "needle" else None)
                for i in range(inputs.shape[0]):
                    first = int((labels[i] != IGNORE).nonzero()[0, 0])  # the last question token
                    split = first + 1 - question
                    items.append(_item("task", f"{task}/{L}/{depth:g}/{i}", inputs[i], split, L,
                                       labels=labels[i, first:].clone(), task=task, depth=float(depth)))
    return items


def stream(encode, eos: int, corpus: str, split: str, seed: int, need: int) -> torch.Tensor:
    """`need` tokens of held-out text: the corpus split's documents in an order drawn from `seed`,
    joined by EOS (ValueError when they hold fewer)."""
    texts = load_texts(corpus, split)
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    ids = []
    for i in order:
        ids += list(encode(texts[i])) + [eos]
        if len(ids) >= need:
            return torch.tensor(ids[:need])
    raise ValueError(f"corpus {corpus!r} split {split!r} holds {len(ids)} tokens, fewer than the {need} needed")


def ppl_items(spec: Spec, encode, eos: int) -> list[dict]:
    """At length L: L - continuation tokens of prefill, then `continuation` tokens each predicting the next
    (the last input at position L - 1, as in the tasks)."""
    p = spec.perplexity
    items = []
    for L in spec.lengths:
        ids = stream(encode, eos, p.corpus, p.split, p.seed + L, (L + 1) * p.n_contexts).view(p.n_contexts, L + 1)
        for i in range(p.n_contexts):
            items.append(_item("ppl", f"ppl/{L}/{i}", ids[i, :-1], L - p.continuation, L,
                               labels=ids[i, L - p.continuation + 1:].clone()))
    return items


def time_items(spec: Spec, encode, eos: int) -> list[dict]:
    """At length L: L - steps tokens of prefill, then `steps` single-token steps."""
    t = spec.timing
    items = []
    for L in spec.lengths:
        ids = stream(encode, eos, spec.perplexity.corpus, spec.perplexity.split, 7919 + L, L * t.prompts)
        for i in range(t.prompts):
            items.append(_item("time", f"time/{L}/{i}", ids[i * L:(i + 1) * L], L - t.steps, L, steps=t.steps,
                               rounds=t.rounds))
    return items


def plan(spec: Spec) -> list[dict]:
    """Every item of the spec, in run order: by length (shortest first), then timing, task, perplexity."""
    source = resolve_source(spec.model, hub=False)
    config = load_hf_config(source)
    encode, eos = encoding(config, load_tokenizer(source, optional=True))
    tok = _Tokenizer(encode)
    max_pos = getattr(config, "max_position_embeddings", None)
    if isinstance(max_pos, int) and max(spec.lengths) > max_pos:
        raise ValueError(f"lengths: {max(spec.lengths)} exceeds the model's max_position_embeddings {max_pos}")
    items = time_items(spec, encode, eos) + task_items(spec, tok) + ppl_items(spec, encode, eos)
    return sorted(items, key=lambda it: it["length"])  # stable: timing, task, ppl within a length
