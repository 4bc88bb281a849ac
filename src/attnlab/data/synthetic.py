"""Synthetic recall tasks: multi-query associative recall (MQAR) and passkey retrieval.

Both return `(inputs, labels)`, int64 tensors of shape (N, seq_len) aligned for
next-token prediction: labels[:, t] is the token the model should output after reading
inputs[:, :t+1], and -100 (ignored by cross-entropy) wherever nothing is asked.
Generation is deterministic: a CPU `torch.Generator` seeded with `seed`.
"""

from __future__ import annotations

import torch

from ..checks import check_int

IGNORE = -100

PASSKEY_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the important information there.\n"
)
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
PASSKEY_NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"


def mqar(
    vocab_size: int,
    seq_len: int,
    num_kv_pairs: int,
    num_examples: int = 1,
    *,
    seed: int = 0,
    power_a: float = 0.01,
    num_queries: int | None = None,
    random_non_queries: bool = True,
    min_gap: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-query associative recall as the Zoology benchmark defines it.

    Each example opens with `num_kv_pairs` key-value pairs `k1 v1 k2 v2 ...`: keys are
    distinct ids drawn from [1, V//2), values distinct ids from [V//2, V) (disjoint halves).
    The rest of the sequence holds (N query) slots at even offsets 2g from the end of the
    pairs, g in [0, S), S = (seq_len - 2*num_kv_pairs) // 2; the pairs' slots g are drawn
    without replacement with P(g) proportional to power_a * (g+1)^(power_a - 1), a power
    law that favours short gaps as power_a -> 0. A key sits in its slot and the label at
    that position is its value; every other label is -100. The remaining positions are
    uniform random tokens from the whole vocabulary (or 0 if random_non_queries is False).

    num_queries: how many pairs are queried (default all, as in Zoology; the seed's MVE
    queries 2 of 4). min_gap: every query lies at least this many positions after every
    pair token (query position - pair position >= min_gap for every pair, the last value at
    2*num_kv_pairs - 1 included), so a model that reads only the last min_gap tokens sees
    no pair: the query slots start at offset max(0, min_gap - 1) after the pairs instead of
    0 (min_gap <= 1 is Zoology's layout, the same sequences bit for bit). Returns inputs,
    labels: (num_examples, seq_len) int64."""
    check_int("vocab_size", vocab_size, 4)
    check_int("num_kv_pairs", num_kv_pairs)
    check_int("num_examples", num_examples)
    check_int("seed", seed, 0)
    n_q = num_kv_pairs if num_queries is None else check_int("num_queries", num_queries)
    if n_q > num_kv_pairs:
        raise ValueError(f"num_queries must be <= num_kv_pairs={num_kv_pairs}, got {n_q}")
    half = vocab_size // 2
    if num_kv_pairs > half - 1:
        raise ValueError(
            f"num_kv_pairs must be <= vocab_size // 2 - 1 = {half - 1} (distinct keys from [1, {half})), got {num_kv_pairs}"
        )
    if not isinstance(power_a, (int, float)) or isinstance(power_a, bool) or not 0 < power_a <= 1:
        raise ValueError(f"power_a must be a float in (0, 1], got {power_a!r}")
    check_int("min_gap", min_gap, 0)
    ctx = 2 * num_kv_pairs
    start = ctx + max(0, min_gap - 1)  # the first query slot: min_gap after the last value (ctx - 1)
    space = (check_int("seq_len", seq_len) - start) // 2
    if space < n_q:
        need = start + 2 * n_q
        raise ValueError(
            f"seq_len must be >= 2*num_kv_pairs + max(0, min_gap - 1) + 2*num_queries = {need} to fit the pairs and "
            f"their queries (num_kv_pairs={num_kv_pairs}, num_queries={n_q}, min_gap={min_gap}), got {seq_len}"
        )
    g = torch.Generator().manual_seed(seed)
    N = num_examples
    # distinct keys and values per example: the first columns of a random permutation
    keys = torch.rand(N, half - 1, generator=g).argsort(dim=1)[:, :num_kv_pairs] + 1  # (N, P) in [1, V//2)
    values = torch.rand(N, vocab_size - half, generator=g).argsort(dim=1)[:, :num_kv_pairs] + half  # (N, P)
    p = power_a * torch.arange(1, space + 1, dtype=torch.float64) ** (power_a - 1)  # (S,)
    gaps = torch.multinomial((p / p.sum()).expand(N, space), n_q, replacement=False, generator=g)  # (N, Q)
    if n_q == num_kv_pairs:
        asked = torch.arange(num_kv_pairs).expand(N, n_q)  # all pairs, in order, as in Zoology
    else:
        asked = torch.rand(N, num_kv_pairs, generator=g).argsort(dim=1)[:, :n_q]  # (N, Q) which pairs

    full = torch.zeros(N, seq_len, dtype=torch.long)
    full[:, 0:ctx:2] = keys
    full[:, 1:ctx:2] = values
    qpos = start + 2 * gaps  # (N, Q) position of each query key
    full.scatter_(1, qpos, keys.gather(1, asked))
    labels = torch.full((N, seq_len), IGNORE, dtype=torch.long)
    labels.scatter_(1, qpos, values.gather(1, asked))
    if random_non_queries:
        fill = torch.randint(vocab_size, (N, seq_len), generator=g)
        full = torch.where(full == 0, fill, full)
    return full, labels


def passkey(
    tokenizer,
    length: int,
    depth: float,
    num_examples: int = 1,
    *,
    seed: int = 0,
    digits: int = 5,
    filler: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Passkey (needle-in-a-haystack) retrieval: `length` input tokens made of an intro, a
    haystack with the needle "The pass key is K. Remember it. K is the pass key." inserted
    at fraction `depth` (0 = right after the intro, 1 = right before the question), then
    "What is the pass key? The pass key is" followed by " K". K is a random `digits`-digit
    number per example; the labels are the tokens of " K" at the positions that predict
    them, -100 elsewhere. The haystack is a fixed sentence repeated (filler=None) or
    `filler` text (e.g. held-out corpus text) read cyclically from a random offset.
    Returns inputs, labels: (num_examples, length) int64."""
    check_int("length", length)
    check_int("num_examples", num_examples)
    check_int("seed", seed, 0)
    check_int("digits", digits)
    if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be a float in [0, 1], got {depth!r}")
    if not callable(getattr(tokenizer, "encode", None)):
        raise TypeError(f"tokenizer must have encode(str) -> list[int], got {type(tokenizer).__name__}")
    if filler is not None and (not isinstance(filler, str) or not filler.strip()):
        raise ValueError(f"filler must be None or a non-empty string, got {filler!r:.60}")
    g = torch.Generator().manual_seed(seed)
    hay = torch.tensor(tokenizer.encode(PASSKEY_FILLER if filler is None else filler), dtype=torch.long)
    intro = tokenizer.encode(PASSKEY_INTRO)
    question = tokenizer.encode(PASSKEY_QUESTION)
    inputs = torch.empty(num_examples, length, dtype=torch.long)
    labels = torch.full((num_examples, length), IGNORE, dtype=torch.long)
    for i in range(num_examples):
        key = int(torch.randint(10 ** (digits - 1), 10**digits, (1,), generator=g))
        needle = tokenizer.encode(PASSKEY_NEEDLE.format(key=key))
        answer = tokenizer.encode(f" {key}")
        fixed = len(intro) + len(needle) + len(question) + len(answer)
        budget = length + 1 - fixed
        if budget < 0:
            raise ValueError(f"length must be >= {fixed - 1} to hold the intro, needle, question and answer, got {length}")
        offset = 0 if filler is None else int(torch.randint(hay.numel(), (1,), generator=g))
        reps = (offset + budget) // hay.numel() + 1
        stack = hay.repeat(reps)[offset : offset + budget].tolist()
        cut = round(depth * budget)
        full = intro + stack[:cut] + needle + stack[cut:] + question + answer  # length + 1 tokens
        inputs[i] = torch.tensor(full[:length])
        labels[i, length - len(answer) :] = torch.tensor(answer)
    return inputs, labels
