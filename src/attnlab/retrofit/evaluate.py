"""Evaluating a retrofitted model: held-out perplexity against the original model's, and per layer
what `attnlab eval` reports for attnlab models where it applies (first-token share, the learned
sink's share, the ground state's mass, the output gate's low values), through the same code
(`attnlab.train.evaluate.attention_report` on the wrapped `attnlab.models.LM`).

Perplexity (`perplexity`, also fine-tuning's before and after): each packed context is read as one
causal sequence (positions 0..T-1, attention across its documents, as in transfer and fine-tuning)
and scored by the rule of `attnlab.search.metrics`, the one search evaluations use: exp of the
mean next-token NLL over the predictions inside a document (a document's first token is not
scored from the previous document's EOS; the EOS that ends a document is)."""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from attnlab import interrupt
from attnlab.data.cache import atomic_write_text
from attnlab.search.hf_model import model_device

from .convert import RetrofitError
from .transfer import contexts, text_encoding

PER_LAYER = ("first_token_share", "learned_sink_share", "ground_weight", "gate_low")


@dataclass
class EvalConfig:
    """Options of the evaluation (`--eval-*`): held-out contexts of the corpus's test split."""

    contexts: int = 4
    context: int = 256
    analysis_contexts: int = 1  # contexts the per-layer statistics read (they build T x T weights)
    corpus: str = "stdlib"
    seed: int = 0
    # decoding through key selection (scalar/hybrid layers): each K in `windows` reads the sorted
    # cache's K nearest keys ("window"), and with learned_steps > 0 also the K keys of search
    # projections trained on the model (`eval.selector_training`, learned_contexts x learned_context
    # training-split tokens); loss on window_contexts held-out contexts of each length in
    # window_lengths (default: context), beside the exact loss on the same contexts
    windows: list = field(default_factory=list)
    window_lengths: list = field(default_factory=list)
    window_contexts: int = 2
    learned_steps: int = 0
    learned_context: int = 512
    learned_contexts: int = 4

    def decode_names(self) -> list[str]:
        """The decode metrics this config reports: exact@T, window<K>@T, learned<K>@T (nats per token)."""
        out = []
        for T in self.window_lengths or ([self.context] if self.windows else []):
            out.append(f"exact@{T}")
            for k in self.windows:
                out += [f"window{k}@{T}"] + ([f"learned{k}@{T}"] if self.learned_steps else [])
        return out

    def check(self, max_positions: int | None = None) -> "EvalConfig":
        """Validate the options (and the context against the model's `max_positions`, when given);
        returns self, or raises RetrofitError naming the `--eval-*` option."""
        for name, low in (("contexts", 1), ("context", 2), ("analysis_contexts", 1), ("seed", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise RetrofitError(f"--eval-{name.replace('_', '-')} must be an integer >= {low}, got {v!r}")
        for name in ("window_contexts", "learned_steps", "learned_context", "learned_contexts"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "learned_steps" else 1):
                raise RetrofitError(f"eval {name} must be an integer >= {0 if name == 'learned_steps' else 1}, "
                                    f"got {v!r}")
        for name in ("windows", "window_lengths"):
            v = getattr(self, name)
            if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 2 for x in v):
                raise RetrofitError(f"eval {name} must be a list of integers >= 2, got {v!r}")
        if self.window_lengths and not self.windows:
            raise RetrofitError("eval window_lengths given without windows: no decode would be measured")
        if max_positions and max(self.window_lengths or [0]) > max_positions:
            raise RetrofitError(f"eval window_lengths {self.window_lengths} exceed the model's max_position_embeddings "
                                f"{max_positions}")
        if self.analysis_contexts > self.contexts:
            raise RetrofitError(f"--eval-analysis-contexts {self.analysis_contexts} exceeds --eval-contexts "
                                f"{self.contexts}")
        if max_positions and self.context > max_positions:
            raise RetrofitError(f"--eval-context {self.context} exceeds the model's max_position_embeddings "
                                f"{max_positions}")
        return self


def split_contexts(corpus: str, split: str, context: int, n: int, seed: int, encode, eos_id: int):
    """`transfer.contexts` of the train or test split, as fine-tuning and evaluation read them (the
    error names --finetune-contexts for the train split, eval_contexts for the test split)."""
    flag = "--finetune-contexts" if split == "train" else "eval_contexts"
    return contexts(corpus, split, context, n, seed, encode, eos_id,
                    f"{flag}/--finetune-context ({corpus} {split} split)")


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The (B, T, V) next-token logits of an AttnlabForCausalLM or an HF model on token ids (B, T), which
    go to the model's device first."""
    out = model(input_ids=ids.to(model_device(model)), use_cache=False)
    return out.logits if hasattr(out, "logits") else out[0]


@torch.no_grad()
def perplexity(model, packed) -> float:
    """Perplexity of `model` (in eval mode meanwhile) on packed contexts (a Packed), one context at a
    time, each read as one causal sequence; the score is `attnlab.search.metrics.perplexity`'s rule
    (predictions inside a document only)."""
    from attnlab.search.metrics import perplexity as packed_perplexity

    was = model.training
    model.eval()
    try:
        return packed_perplexity(lambda b: logits(model, b.input_ids), packed)
    finally:
        model.train(was)


def _mean(values) -> float | None:
    flat = [float(v) for v in (values if isinstance(values, list) else [values])]
    return sum(flat) / len(flat) if flat else None


@torch.no_grad()
def evaluate_retrofit(model, cfg: EvalConfig, original=None, encode=None, eos_id: int | None = None,
                      partial=None) -> dict:
    """Held-out perplexity of `model` (an AttnlabForCausalLM, e.g. from `convert`) and of `original` (the
    HF model it came from, when given), and per layer the means over heads and analysed contexts of
    PER_LAYER where the layer has them; also kept as `model.eval_report` (written to eval.json by `save`).

    partial: a json path where each decode loss is kept as soon as it is measured (the long part of
    an evaluation), and the learned selector's trained search projections beside it
    (`selector_path`); a rerun with the same cfg measures only the losses missing there and reads
    the projections instead of training them again."""
    from attnlab.train.evaluate import attention_report

    cfg.check()
    encode, eos_id = text_encoding(model.config, encode, eos_id)
    ids = split_contexts(cfg.corpus, "test", cfg.context, cfg.contexts, cfg.seed, encode, eos_id)
    was = model.training
    model.eval()
    try:
        report = {"config": vars(cfg).copy(), "perplexity": perplexity(model, ids)}
        if original is not None:
            original.eval()
            report["perplexity_original"] = perplexity(original, ids)
            report["perplexity_gap"] = report["perplexity"] / report["perplexity_original"] - 1.0
        plan = getattr(model, "retrofit_plan", None)
        replaced = set(plan.layers) if plan is not None else set()
        layers = []
        for entry in attention_report(model.model, ids.input_ids[: cfg.analysis_contexts].to(model_device(model)),
                                     alignment=False):
            row = {"layer": entry["layer"], "mechanism": entry["mechanism"], "replaced": entry["layer"] in replaced}
            row.update({k: _mean(entry[k]) for k in PER_LAYER if k in entry})
            layers.append(row)
        report["layers"] = layers
        if cfg.windows:
            report["decode"] = _decode_losses(model, cfg, encode, eos_id, partial)
    finally:
        model.train(was)
    model.eval_report = report
    return report


def _decode_losses(model, cfg: EvalConfig, encode, eos_id, partial=None) -> dict:
    """{name: nats per token} of `EvalConfig.decode_names`: exact, through the sorted cache's window and
    through learned search projections, on the same held-out contexts of each length (the exact loss
    only for a model without scalar/hybrid layers)."""
    from attnlab.eval.selectors import select_keys
    from attnlab.models.lm import selectable_layers

    lm, proj = model.model, None
    selectable = bool(selectable_layers(lm))  # no scalar/hybrid layer (a control): the exact loss only
    out = _kept(partial, cfg)
    lengths = cfg.window_lengths or [cfg.context]
    learned = [f"learned{k}@{T}" for T in lengths for k in cfg.windows]
    if cfg.learned_steps and selectable and any(n not in out for n in learned):
        proj = _kept_projections(partial, cfg)
        if proj is None:
            from attnlab.eval.selector_training import train_selector_projections

            train = split_contexts(cfg.corpus, "train", cfg.learned_context, cfg.learned_contexts, cfg.seed, encode,
                                   eos_id).input_ids
            with torch.enable_grad():  # evaluate_retrofit runs under no_grad; the projections train
                proj = train_selector_projections(lm, [row[None] for row in train], cfg.learned_steps, seed=cfg.seed)
            if partial is not None:  # a resumed evaluation reads them instead of training them again
                proj.save(selector_path(partial), extra_meta={"eval_config": _plain(cfg)})

    def measure(name: str, ids, selection=None) -> None:
        if name in out:
            return
        with selection if selection is not None else contextlib.nullcontext():
            out[name] = math.log(perplexity(model, ids))
        if partial is not None:
            atomic_write_text(Path(partial), json.dumps({"config": _plain(cfg), "decode": out}) + "\n")
            interrupt.check(lambda: f"evaluation stopped after {name}; {partial} keeps {len(out)} decode losses")

    for T in lengths:
        ids = split_contexts(cfg.corpus, "test", T, cfg.window_contexts, cfg.seed, encode, eos_id)
        measure(f"exact@{T}", ids)
        for k in cfg.windows if selectable else ():
            measure(f"window{k}@{T}", ids, select_keys(lm, "window", k))
            if proj is not None or f"learned{k}@{T}" in out:
                measure(f"learned{k}@{T}", ids, None if proj is None else select_keys(lm, "learned", k, projections=proj))
    return {n: out[n] for n in cfg.decode_names() if n in out} if selectable else out


def _plain(cfg: EvalConfig) -> dict:
    return json.loads(json.dumps(vars(cfg), default=str))


def selector_path(partial) -> Path:
    """Where an evaluation with `partial` keeps the search projections it trained for the learned
    selector (beside the partial file), until the evaluation ends."""
    partial = Path(partial)
    return partial.with_name(partial.stem + ".selector.safetensors")


def _kept_projections(partial, cfg: EvalConfig):
    """The search projections an interrupted evaluation with the same cfg trained (None if none)."""
    if partial is None or not selector_path(partial).is_file():
        return None
    from attnlab.index.projections import SearchProjections

    try:
        proj, meta, _ = SearchProjections.load(selector_path(partial))
    except (OSError, ValueError):
        return None
    return proj.eval() if meta.get("eval_config") == _plain(cfg) else None


def _kept(partial, cfg: EvalConfig) -> dict:
    """The decode losses an interrupted evaluation with the same cfg left in `partial` ({} if none)."""
    if partial is None:
        return {}
    try:
        saved = json.loads(Path(partial).read_text())
    except (OSError, ValueError):
        return {}
    return dict(saved.get("decode") or {}) if saved.get("config") == _plain(cfg) else {}
