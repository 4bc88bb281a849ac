"""Evaluating a retrofitted model: held-out perplexity against the original model's, and per layer
what `attnlab eval` reports for attnlab models where it applies (first-token share, the learned
sink's share, the ground state's mass, the output gate's low values), through the same code
(`attnlab.train.evaluate.attention_report` on the wrapped `attnlab.models.LM`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .convert import RetrofitError

PER_LAYER = ("first_token_share", "learned_sink_share", "ground_weight", "gate_low")


@dataclass
class EvalConfig:
    """Options of the evaluation (`--eval-*`): held-out contexts of the corpus's test split."""

    contexts: int = 4
    context: int = 256
    analysis_contexts: int = 1  # contexts the per-layer statistics read (they build T x T weights)
    corpus: str = "stdlib"
    seed: int = 0

    def check(self, max_positions: int | None = None) -> "EvalConfig":
        """Validate the options (and the context against the model's `max_positions`, when given);
        returns self, or raises RetrofitError naming the `--eval-*` option."""
        for name, low in (("contexts", 1), ("context", 2), ("analysis_contexts", 1), ("seed", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise RetrofitError(f"--eval-{name.replace('_', '-')} must be an integer >= {low}, got {v!r}")
        if self.analysis_contexts > self.contexts:
            raise RetrofitError(f"--eval-analysis-contexts {self.analysis_contexts} exceeds --eval-contexts "
                                f"{self.contexts}")
        if max_positions and self.context > max_positions:
            raise RetrofitError(f"--eval-context {self.context} exceeds the model's max_position_embeddings "
                                f"{max_positions}")
        return self


def _mean(values) -> float | None:
    flat = [float(v) for v in (values if isinstance(values, list) else [values])]
    return sum(flat) / len(flat) if flat else None


@torch.no_grad()
def _perplexity(model, ids: torch.Tensor) -> float:
    """exp(mean next-token cross-entropy) over the contexts ids (N, T), one at a time."""
    total = 0.0
    for row in ids:
        out = model(input_ids=row[None], use_cache=False)
        logits = out.logits if hasattr(out, "logits") else out[0]
        total += float(torch.nn.functional.cross_entropy(logits[0, :-1].float(), row[1:]))
    return math.exp(total / len(ids))


@torch.no_grad()
def evaluate_retrofit(model, cfg: EvalConfig, original=None, encode=None, eos_id: int | None = None) -> dict:
    """Held-out perplexity of `model` (an AttnlabForCausalLM, e.g. from `convert`) and of `original` (the
    HF model it came from, when given), and per layer the means over heads and analysed contexts of
    PER_LAYER where the layer has them; also kept as `model.eval_report` (written to eval.json by `save`)."""
    from attnlab.train.evaluate import attention_report

    from .finetune import FinetuneConfig, _pack
    from .transfer import text_encoding

    cfg.check()
    encode, eos_id = text_encoding(model.config, encode, eos_id)
    pack = FinetuneConfig(context=cfg.context, corpus=cfg.corpus, seed=cfg.seed)
    ids = _pack(pack, "test", cfg.contexts, encode, eos_id)  # (N, T)
    was = model.training
    model.eval()
    try:
        report = {"config": vars(cfg).copy(), "perplexity": _perplexity(model, ids)}
        if original is not None:
            original.eval()
            report["perplexity_original"] = _perplexity(original, ids)
            report["perplexity_gap"] = report["perplexity"] / report["perplexity_original"] - 1.0
        plan = getattr(model, "retrofit_plan", None)
        replaced = set(plan.layers) if plan is not None else set()
        layers = []
        for entry in attention_report(model.model, ids[: cfg.analysis_contexts], alignment=False):
            row = {"layer": entry["layer"], "mechanism": entry["mechanism"], "replaced": entry["layer"] in replaced}
            row.update({k: _mean(entry[k]) for k in PER_LAYER if k in entry})
            layers.append(row)
        report["layers"] = layers
    finally:
        model.train(was)
    model.eval_report = report
    return report
