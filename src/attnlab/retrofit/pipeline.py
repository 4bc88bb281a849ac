"""The retrofit pipeline: convert, attention transfer, fine-tuning, evaluation.

`run_pipeline` is what `attnlab retrofit` runs before it writes the model folder, and what each run
of a retrofit trial (`attnlab.experiments.retrofit_trial`) runs before it writes its result.json.
The caller plans first (`convert.plan` / `io.plan_source`, from the config alone: every check that
needs no weights) and passes the Plan with the loaded HF model. Transfer and fine-tuning keep their
state in OUT/transfer/ and OUT/finetune/ and resume from it (loop.py); Ctrl-C saves and raises
Interrupted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .convert import Plan, convert, new_parameters
from .evaluate import EvalConfig, evaluate_retrofit
from .finetune import FinetuneConfig, finetune as run_finetune
from .transfer import TransferConfig, transfer_attention


@dataclass
class Retrofitted:
    """What `run_pipeline` made: the model (an AttnlabForCausalLM in eval mode, its reports also kept
    on it as transfer_report / finetune_report / eval_report) and each stage's report, None for a
    stage that did not run; new_change_rms: the root mean square of how far the retrofit's new
    parameters moved (None when there are none)."""

    model: object
    transfer: dict | None = None
    finetune: dict | None = None
    eval: dict | None = None
    new_change_rms: float | None = None


def run_pipeline(hf_model, plan_: Plan, out, *, seed: int = 0, transfer: TransferConfig | None = None,
                 finetune: FinetuneConfig | None = None, evaluate: EvalConfig | None = None, tokenizer=None,
                 compare: bool = True, partial=None, progress: bool = True, log=None) -> Retrofitted:
    """Convert `hf_model` as `plan_` says (the new parameters initialised from `seed`), then run
    attention transfer and fine-tuning where their configs ask for steps (state in `out`, resumed
    when present; the KL target of fine-tuning is `hf_model`) and evaluate with `evaluate` when
    given (compare: also the original's perplexity; partial: evaluate_retrofit's file of decode
    losses measured so far). tokenizer: the HF tokenizer (None: bytes and the config's EOS).
    progress: fine-tuning's bar. log: called with each stage's summary line."""
    from .io import tokenizer_encoding

    model = convert(hf_model, plan_, seed=seed).to(next(hf_model.parameters()).device)  # on the original's device
    start = {n: p.detach().clone() for n, p in new_parameters(model.model, plan_).items()}
    encode, eos = tokenizer_encoding(tokenizer)
    done = Retrofitted(model)
    if transfer is not None and transfer.steps > 0:
        done.transfer = transfer_attention(hf_model, model, plan_.layers, transfer, out, encode, eos, log=log)
    if finetune is not None and finetune.steps > 0:
        done.finetune = run_finetune(model, finetune, out, original=hf_model if finetune.kl > 0 else None,
                                     encode=encode, eos_id=eos, progress=progress, log=log)
    if evaluate is not None:
        rep = done.eval = evaluate_retrofit(model, evaluate, original=hf_model if compare else None, encode=encode,
                                            eos_id=eos, partial=partial)
        if log is not None and compare:
            log(f"eval: held-out perplexity {rep['perplexity']:.4g} (original {rep['perplexity_original']:.4g}, "
                f"{100 * rep['perplexity_gap']:+.3f} %) on {evaluate.contexts} x {evaluate.context} tokens")
    moved = [(p.detach() - start[n]).pow(2) for n, p in new_parameters(model.model, plan_).items()]
    if moved:
        done.new_change_rms = math.sqrt(sum(float(x.sum()) for x in moved) / sum(x.numel() for x in moved))
    return done
