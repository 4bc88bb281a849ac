"""`evaluate(run_dir or cfg) -> dict`: what `attnlab eval` reports about a trained model.

- validation loss and perplexity at one or more context lengths (same text budget each);
- per layer and head, on one batch: attention entropy, attention-sink share (mass on the
  first token; with a learned sink also the mass on it), and for heads with scalar
  queries/keys the share of each query's mass inside its k nearest keys in scalar space,
  k in (8, 16, 32, 64) -- what a k-entry window of the sorted cache would capture; for the
  linear family (whose effective matrix A need not be a distribution) the first-token share of
  |A|'s mass; with an output gate, the fraction of its values below 0.1 and their histogram;
- for principled attention, the ground weight w0 per head and the mean suppression of its gate;
- windowed decoding (k nearest keys per scalar head): its loss over the same text, optionally
  under a memory budget (eviction) and, token by token on one batch, with density compression;
- MQAR accuracy for MQAR runs (also at s times the length with s times the pairs, same distance
  rule, and through a decode window of k scalar-nearest keys) and, per layer, how much of the
  queries' attention reaches the pairs, and the queried value among them; passkey accuracy at the
  requested lengths and depths.

The weights come from each layer's `attention_weights`, which builds (B, H, T, T): the
analysis runs at a small length (`analysis_len`, default min(seq_len, 256)).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from attnlab.data.cache import atomic_write_text
from attnlab.data.corpus import load_corpus
from attnlab.data.packing import pack_documents, sequential_batches
from attnlab.eval.metrics import (
    TOPK_KS, alignment_profile, layer_inputs, attention_entropy, gate_profile, gate_suppression, ground_weight,
    loss_at_lengths, sink_share, topk_scalar_mass,
)
from attnlab.eval.repeat import repeated_span_loss
from attnlab.eval.window import compressed_loss, decode_window, next_token_loss, windowed_layers
from attnlab.eval.tasks import passkey_accuracy

from .checkpoint import CheckpointError, latest_checkpoint, load_checkpoint
from .evaluate_mqar import check_mqar_scales, mqar_attention_report, mqar_report  # noqa: F401  (importable here)
from .config import RunConfig, load_config
from .data import data_tokenizer
from .trainer import CKPT_DIR, build_model, resolve_device



def load_run(source: RunConfig | str | os.PathLike, overrides: list[str] | None = None, checkpoint: str | None = None):
    """(cfg, model, state) of a run folder (its config.toml and newest checkpoint), or of a
    RunConfig / TOML path whose run folder holds a checkpoint. `checkpoint` picks another one.

    The model is in eval mode on the CPU; state is the checkpoint's JSON state with its "path".
    Raises FileNotFoundError when there is no checkpoint and CheckpointError when it is damaged; a
    checkpoint pruned by a run in progress while it is read is replaced by the newest one."""
    if isinstance(source, RunConfig):
        cfg = source
    else:
        path = Path(source)
        cfg = load_config(path / "config.toml" if path.is_dir() else path, overrides)
    ckpt = Path(checkpoint) if checkpoint else latest_checkpoint(Path(cfg.run_dir) / CKPT_DIR)
    if ckpt is None:
        raise FileNotFoundError(f"no checkpoint in {str(Path(cfg.run_dir) / CKPT_DIR)!r}: train the run first")
    if not cfg.model.vocab_size:
        raise ValueError(f"the config of {cfg.run_dir!r} has no resolved model.vocab_size; load the run folder's config.toml")
    model = build_model(cfg, cfg.model.vocab_size)
    for _ in range(5):
        try:
            state = load_checkpoint(ckpt, model)
            break
        except (FileNotFoundError, CheckpointError):
            # a run in progress may prune the checkpoint we picked while we read it: take the newest again
            newer = None if checkpoint or ckpt.exists() else latest_checkpoint(Path(cfg.run_dir) / CKPT_DIR)
            if newer is None or newer == ckpt:
                raise
            ckpt = newer
    return cfg, model.eval(), state


@torch.no_grad()
@torch.no_grad()
def attention_report(model, x: torch.Tensor, topk=TOPK_KS, *, alignment: bool = True) -> list[dict]:
    """Per-layer, per-head attention statistics of `model` on tokens x (B, T); `alignment`: also
    the alignment profile of scalar heads (sorts every visible pair: the costly part at long T)."""
    inputs = layer_inputs(model, x, record=True)
    report = []
    for i, blk in enumerate(model.blocks):
        layer = blk.attn
        entry = {"layer": i, "mechanism": layer.mechanism}
        if layer.gate is not None and layer.gate.mode != "prenorm":  # sparsity of the sigmoid gate's values
            # σ itself: a gate c·σ (c = output_gate_scale, 2 in a retrofit's identity start) is divided by c
            entry["gate_low"], entry["gate_hist"] = gate_profile(layer.gate(inputs[i]) / layer.gate.scale)
        if layer.recurrent:
            # the effective causal matrix A (o = A v) is not a distribution for GLA/SSD: the
            # first-token share is that of |A|'s row mass; entropy and top-k do not apply
            w = layer.attention_weights(inputs[i]).float().abs()  # (B, H, T, T)
            entry["first_token_share"] = sink_share(w).tolist()
            report.append(entry)
            continue
        w = layer.attention_weights(inputs[i]).float()  # (B, H, T, T + n_prefix)
        n_prefix = w.shape[-1] - w.shape[-2]
        entry["entropy"] = attention_entropy(w).tolist()
        entry["first_token_share"] = sink_share(w, sink=n_prefix).tolist()
        if n_prefix:
            entry["learned_sink_share"] = sink_share(w, sink=0, skip_first_query=False).tolist()
        rec = layer.last
        if "v0" in layer.options and rec is not None:  # a ground state (principled) and its suppress-only gate
            entry["ground_weight"] = ground_weight(w).tolist()
            p = rec.heads
            entry["gate_suppression"], entry["gate_suppression_strong"] = gate_suppression(p.qg, p.kg, p.beta)
        if rec is not None and rec.qs is not None:
            H_s = rec.heads.qs.shape[1]  # scalar heads come first in a mixed layer
            # queries that see k keys or fewer hold all their mass in any k-window: leave them out
            visible = torch.arange(w.shape[-2], device=w.device) + 1  # (T,) keys each query sees, sink aside
            entry["topk_scalar_mass"] = {
                str(k): topk_scalar_mass(
                    w[:, :H_s], rec.heads.qs, rec.ks, int(k), n_prefix=n_prefix,
                    query_mask=(visible > int(k)).expand(w.shape[0], -1) if bool((visible > int(k)).any()) else None,
                ).tolist()
                for k in topk
            }
            if alignment:
                entry["alignment"] = alignment_profile(w[:, :H_s], rec.heads.qs, rec.ks, n_prefix=n_prefix).tolist()
        report.append(entry)
    return report


def evaluate(
    source: RunConfig | str | os.PathLike,
    *,
    overrides: list[str] | None = None,
    checkpoint: str | None = None,
    split: str = "val",
    seq_lens: list[int] | None = None,
    max_tokens: int | None = 65536,
    batch_size: int | None = None,
    analysis_len: int | None = None,
    analysis_batch: int = 4,
    topk=TOPK_KS,
    passkey_lengths: list[int] | None = None,
    passkey_depths: tuple[float, ...] = (0.0, 0.5, 1.0),
    windows: list[int] | None = None,
    budgets: list[int] | None = None,
    context_lengths: list[int] | None = None,
    compress: list[float] | None = None,
    mqar_scales: list[int] | None = None,
    mqar_windows: list[int] | None = None,
    mqar_scale_pairs: bool = True,
    mqar_attention: bool = True,
    heldout: str | None = None,
    heldout_lengths: list[int] | None = None,
    repeat_lengths: list[int] | None = None,
    repeat_span: int = 32,
    repeat_probes: int = 64,
    device: str | None = None,
    write: bool = True,
) -> dict:
    """Evaluate the newest checkpoint of a run (what is measured: the module docstring).

    source: a run folder (its config.toml), a TOML path or a RunConfig whose run folder holds a
    checkpoint; overrides: dotted overrides applied to a TOML path; checkpoint: another checkpoint
    folder than the newest. split: "val" or "test"; seq_lens: context lengths of the loss (default
    data.seq_len); max_tokens: text budget per length (None: the whole split); batch_size: default
    train.batch_size. analysis_len / analysis_batch: the one batch whose attention weights are
    analysed (default min(seq_len, 256) tokens, 4 rows); topk: the k of the top-k scalar mass.
    passkey_lengths / passkey_depths: passkey accuracy at these lengths and needle depths.
    windows: k of the windowed-decode loss; budgets: also with the sorted cache capped at M keys per
    head; compress: also with density compression at these key spans (token by token, one batch);
    context_lengths: everything again per context length T, with the slope of the missed mass
    against ln T. MQAR runs: `mqar_scales` also measures the accuracy at s x data.seq_len with s x
    the pairs and queries (the same ones with mqar_scale_pairs=False) and the same data.mqar_min_gap;
    `mqar_windows` (default `windows`) also with every scalar/hybrid head reading its k nearest keys
    (`decode_window`), at each length; `mqar_attention`: also where each layer's attention at the
    queries goes (`mqar_attention_report`). heldout: a corpus source the run did not train on (e.g.
    "stdlib-tests"), read from its `split`: its loss at each of `heldout_lengths`, and the text of the
    retrieval-in-language probe (`attnlab.eval.repeat`: `repeat_probes` spans of `repeat_span` tokens
    at each of `repeat_lengths`; from the run's own `split` without heldout). device: default run.device.

    Returns a dict: "loss" {T: {"loss", "ppl", "tokens", "batches"}}, "layers" (per layer and head),
    "heldout" {T: {"loss", ...}} and "repeat" {T: {"repeat", "control", "gain", ...}} when asked for,
    and "windowed_loss", "compressed", "by_length", "passkey" or "mqar_accuracy" when asked for
    (MQAR: "mqar_accuracy", "mqar" {"<s>x": {"exact": acc, "window=<k>": acc}} and "mqar_attention",
    where the queries' attention goes: `mqar_attention_report`);
    with `write` it is also stored as run_dir/eval.json ("written_to"). Raises FileNotFoundError
    when the run has no checkpoint, CheckpointError when it is damaged, ConfigError for a bad
    override."""
    cfg, model, state = load_run(source, overrides, checkpoint)
    dev = resolve_device(device or cfg.run.device)
    model.to(dev)
    d = cfg.data
    B = batch_size or cfg.train.batch_size
    out = {"run_dir": cfg.run_dir, "checkpoint": state["path"], "step": state["step"], "attn": cfg.model.layer_attn}

    def logits_of(x):
        return model(x)[0]

    if d.source == "mqar":
        mw = mqar_windows if mqar_windows is not None else windows
        out["mqar"] = mqar_report(model, cfg, [1, *(mqar_scales or [])], list(mw or []), dev, mqar_scale_pairs)
        out["mqar_accuracy"] = out["mqar"]["1x"]["exact"]
        if mqar_attention:
            out["mqar_attention"] = mqar_attention_report(model, cfg, list(mw or []), dev)
        return _finish(out, cfg, write)

    cache_dir, max_docs = d.cache_dir or None, d.max_docs or None
    tok = data_tokenizer(d)
    stream = pack_documents(load_corpus(d.source, split, cache_dir=cache_dir, max_docs=max_docs), tok)
    lens = list(seq_lens or [d.seq_len])
    fn = (lambda b: model(b.x, doc_ids=b.doc_ids)[0]) if not d.cross_doc else logits_of
    losses = loss_at_lengths(fn, stream, lens, batch_size=B, max_tokens=max_tokens, cross_doc=d.cross_doc,
                             device=dev, pass_batch=not d.cross_doc)
    out["loss"] = {str(T): v for T, v in losses.items()}
    if windows and windowed_layers(model):
        out["windowed_loss"] = {
            str(T): {str(k): v[T] for k, v in _windowed_losses(model, fn, stream, [T], windows, B, max_tokens, d, dev,
                                                                          budgets).items()}
            for T in lens
        }

    if windows and compress and windowed_layers(model):  # token by token (no batched form) on one batch
        first = next(iter(sequential_batches(stream, d.seq_len, analysis_batch, max_batches=1)))
        x, y = first.x.to(dev), first.y.to(dev)
        with torch.no_grad():
            exact = next_token_loss(model(x)[0], y)  # the same for every (k, span)
        out["compressed"] = {f"{k}/span={s:g}": compressed_loss(model, x, y, int(k), float(s), exact)
                             for k in windows for s in compress}

    T_a = analysis_len or min(d.seq_len, 256)
    batch = next(iter(sequential_batches(stream, T_a, analysis_batch, max_batches=1)))
    out["analysis_len"] = T_a
    out["layers"] = attention_report(model, batch.x.to(dev), topk)

    if context_lengths:
        out["by_length"] = by_length(model, fn, stream, context_lengths, windows or [], topk, max_tokens=max_tokens,
                                     budgets=budgets,
                                     batch_size=B, data=d, device=dev)
    if passkey_lengths:
        acc = passkey_accuracy(logits_of, tok, lengths=passkey_lengths, depths=passkey_depths, device=dev)
        out["passkey"] = {f"{L}@{dep}": v for (L, dep), v in acc.items()}
    if heldout_lengths or repeat_lengths:
        held = stream
        if heldout:
            held = pack_documents(load_corpus(heldout, split, cache_dir=cache_dir), tok)
            out["heldout_source"] = f"{heldout} ({split} split)"
        if heldout_lengths:
            lh = loss_at_lengths(logits_of, held, list(heldout_lengths), batch_size=B, max_tokens=max_tokens, device=dev)
            out["heldout"] = {str(T): v for T, v in lh.items()}
        if repeat_lengths:
            out["repeat"] = {str(T): repeated_span_loss(logits_of, held, T, span=repeat_span, n=repeat_probes,
                                                        batch_size=B, device=dev) for T in repeat_lengths}
    return _finish(out, cfg, write)


def _windowed_losses(model, fn, stream, lens, windows, batch_size, max_tokens, d, dev, budgets=None) -> dict:
    """{"k": {T: lm_loss}}: the loss with every scalar/hybrid head reading only its k nearest keys
    (eval.window.decode_window), on the same windows of text as the exact loss; and for each
    memory budget M, {"k/M=M": ...}: the same with the sorted cache capped at M keys per head."""
    out = {}
    for k in windows:
        for M in [None, *(budgets or [])]:
            with decode_window(model, int(k), None if M is None else int(M)):
                out[str(k) if M is None else f"{k}/M={M}"] = loss_at_lengths(
                    fn, stream, lens, batch_size=batch_size, max_tokens=max_tokens, cross_doc=d.cross_doc,
                    device=dev, pass_batch=not d.cross_doc)
    return out


ANALYSIS_MAX_LEN = 4096  # by_length's attention analysis (T x T weights per head) stops here


def by_length(model, fn, stream, lengths, windows, topk, *, max_tokens, batch_size, data, device, budgets=None) -> dict:
    """Per context length T: exact loss, windowed-decode loss per k, top-k scalar mass (mean over
    scalar heads) and attention entropy (up to T = ANALYSIS_MAX_LEN: they form the full T x T
    weights; beyond it {} and None); and per k the least-squares slope of (1 - mass@k) against
    ln T over the lengths analysed. Batches shrink with T (at most max_tokens / T rows, at least one), so every length reads
    about the same text; the attention analysis uses one sequence of length T."""
    import math

    from attnlab.eval.metrics import topk_summary

    from tqdm.auto import tqdm

    rows = {}
    bar = tqdm(lengths, desc="eval by length", unit="length", disable=len(lengths) < 2 or not sys.stderr.isatty(),
               dynamic_ncols=True)
    for T in bar:
        bar.set_postfix_str(f"T={T}" + (f", windows {','.join(map(str, windows))}" if windows else ""))
        B = max(1, min(batch_size, (max_tokens or T * batch_size) // T))
        exact = loss_at_lengths(fn, stream, [T], batch_size=B, max_tokens=max_tokens, cross_doc=data.cross_doc,
                                device=device, pass_batch=not data.cross_doc)[T]
        row = {"loss": exact["loss"], "tokens": exact["tokens"]}
        if windows and windowed_layers(model):
            row["windowed_loss"] = {str(k): v[T]["loss"] for k, v in
                                    _windowed_losses(model, fn, stream, [T], windows, B, max_tokens, data, device,
                                                                     budgets).items()}
        row["topk_mass"], row["entropy"] = {}, None
        if T <= ANALYSIS_MAX_LEN:  # the analysis forms every head's T x T weights
            batch = next(iter(sequential_batches(stream, T, 1, max_batches=1)))
            layers = attention_report(model, batch.x.to(device), topk, alignment=False)
            row["topk_mass"] = topk_summary(layers)
            ent = [h for layer in layers for h in layer.get("entropy", [])]
            row["entropy"] = sum(ent) / len(ent) if ent else None
        rows[str(T)] = row
    out = {"lengths": rows}
    analysed = [T for T in lengths if T <= ANALYSIS_MAX_LEN]
    if len(analysed) >= 2:
        xs = [math.log(T) for T in analysed]
        slopes = {}
        for k in topk:
            ys = [1.0 - rows[str(T)]["topk_mass"][str(k)] for T in analysed if str(k) in rows[str(T)]["topk_mass"]]
            if len(ys) == len(xs):
                mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
                slopes[str(k)] = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        out["miss_slope"] = slopes  # d(1 - mass@k) / d ln T
    return out


def _finish(out: dict, cfg: RunConfig, write: bool) -> dict:
    if write:
        path = Path(cfg.run_dir) / "eval.json"
        atomic_write_text(path, json.dumps(out, indent=2) + "\n")  # beside a run in progress: never half-written
        out["written_to"] = str(path)
    return out
