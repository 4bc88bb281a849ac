"""MQAR in `evaluate`: which scales a run can hold (`check_mqar_scales`), accuracy per scale and decode
window (`mqar_report`), and where each layer's attention goes at the queries (`mqar_attention_report`)."""

from __future__ import annotations

import torch

from attnlab import interrupt
from attnlab.data.synthetic import mqar
from attnlab.eval.metrics import EVAL_STOPPED, layer_inputs
from attnlab.eval.tasks import MQAR_TEST_SEED, mqar_accuracy, mqar_attention_summary, mqar_pair_attention
from attnlab.eval.window import decode_window, windowed_layers

from .config import RunConfig

__all__ = ["MQAR_BATCH_TOKENS", "check_mqar_scales", "mqar_attention_report", "mqar_report"]


def check_mqar_scales(cfg: RunConfig, scales, key: str = "mqar_scales", scale_pairs: bool = True) -> list[int]:
    """The MQAR scales s (ints >= 1) that the run's vocabulary and positions can hold: s x data.mqar_pairs
    distinct keys (data.mqar_pairs without scale_pairs) must fit [1, V // 2) and s x data.seq_len a
    learned position table. Raises ValueError naming `key` (and the config keys) before any work."""
    if isinstance(scales, (int, bool)) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1
                                                   for s in scales or []):
        raise ValueError(f"{key} must be a list of ints >= 1, got {scales!r}")
    d, V = cfg.data, cfg.model.vocab_size
    if scales and d.source != "mqar":
        raise ValueError(f"{key}={list(scales)} measures MQAR accuracy; data.source is {d.source!r}, not 'mqar'")
    for s in scales or []:
        if scale_pairs and s * d.mqar_pairs > V // 2 - 1:
            raise ValueError(
                f"{key}: {s}x needs {s} x data.mqar_pairs = {s * d.mqar_pairs} distinct keys from [1, V // 2), but "
                f"model.vocab_size={V} holds {V // 2 - 1}; set model.vocab_size >= {2 * s * d.mqar_pairs + 2}, drop {s} "
                f"or keep the pairs (mqar_scale_pairs = false)")
        if cfg.model.pos_embedding == "learned" and s * d.seq_len > cfg.model.max_seq_len:
            raise ValueError(f"{key}: {s}x is {s * d.seq_len} tokens, beyond model.max_seq_len={cfg.model.max_seq_len} "
                             f"of the learned position embedding")
    return list(scales or [])


# tokens per batch of the MQAR accuracy: on the CPU a window-trained hybrid's forward over 64 sequences
# took 1.6-2.2x as long in batches of 32K tokens as in batches of 2K-8K, with the same logits bit for bit
MQAR_BATCH_TOKENS = 8192


def mqar_report(model, cfg: RunConfig, scales: list[int], windows: list[int], device, scale_pairs: bool = True) -> dict:
    """MQAR accuracy per scale s: {"<s>x": {"exact": acc, "window=<k>": acc}} on 256 test sequences of
    s x data.seq_len tokens with s x the pairs and queries (the same ones without `scale_pairs`), the
    same data.mqar_min_gap and filler: exactly as the model runs and, for each k in `windows` where the
    model has scalar/hybrid layers, with each of them reading only its k nearest keys (`decode_window`;
    a window-trained layer keeps its local window)."""
    d = cfg.data
    check_mqar_scales(cfg, scales, scale_pairs=scale_pairs)

    def logits_of(x):
        return model(x)[0]

    out = {}
    for s in dict.fromkeys(scales):
        m = s if scale_pairs else 1
        task = dict(vocab_size=cfg.model.vocab_size, seq_len=s * d.seq_len, num_kv_pairs=m * d.mqar_pairs,
                    power_a=d.mqar_power_a, num_queries=m * d.mqar_queries or None, min_gap=d.mqar_min_gap,
                    random_non_queries=d.mqar_filler == "random",
                    batch_size=max(1, MQAR_BATCH_TOKENS // (s * d.seq_len)), device=device)
        row = {"exact": mqar_accuracy(logits_of, **task)}
        for k in windows if windows and windowed_layers(model) else []:
            with decode_window(model, int(k)):
                row[f"window={k}"] = mqar_accuracy(logits_of, **task)
        out[f"{s}x"] = row
    return out


@torch.no_grad()
def mqar_attention_report(model, cfg: RunConfig, windows: list[int], device, num_examples: int = 64,
                          batch_size: int = 4) -> dict:
    """Where each layer's attention goes at the MQAR queries, on `num_examples` test sequences of the
    training length (`attnlab.eval.tasks.mqar_pair_attention`): {"exact": per layer its
    `mqar_attention_summary`, "window=<k>": the same with each scalar/hybrid head reading only its k
    nearest keys}, windows as in `mqar_report`. The weights are (B, H, T, T): batches of
    `batch_size` sequences."""
    d = cfg.data
    inputs, labels = mqar(cfg.model.vocab_size, d.seq_len, d.mqar_pairs, num_examples, seed=MQAR_TEST_SEED,
                          power_a=d.mqar_power_a, num_queries=d.mqar_queries or None, min_gap=d.mqar_min_gap,
                          random_non_queries=d.mqar_filler == "random")

    def measure(rules: dict) -> list[dict]:  # rules: the layers' KeyRules (decode_window's)
        parts = []
        for i in range(0, num_examples, batch_size):
            interrupt.check(EVAL_STOPPED)
            x, y = inputs[i : i + batch_size].to(device), labels[i : i + batch_size].to(device)
            xs = layer_inputs(model, x)
            ws = [blk.attn.attention_weights(xs[j], rules.get(j)) for j, blk in enumerate(model.blocks)]
            parts.append(mqar_pair_attention(ws, x, y, d.mqar_pairs))
        return [mqar_attention_summary([p[j] for p in parts]) for j in range(len(model.blocks))]

    out = {"exact": measure({})}
    for k in windows if windows and windowed_layers(model) else []:
        with decode_window(model, int(k)) as rules:
            out[f"window={k}"] = measure(rules)
    return out
