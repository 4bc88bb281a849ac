"""`attnlab retrofit trial SPEC.toml`: a retrofit experiment over training seeds, with a verdict.

A trial spec gives shared `[retrofit]` settings (model, layers, attn, settings: what `attnlab
retrofit` takes), shared `[transfer]`, `[finetune]` and `[eval]` settings (TransferConfig,
FinetuneConfig and EvalConfig fields), variants that override any of the four, and seeds. Every
(variant, seed) converts the model, runs attention transfer and fine-tuning (each resumable from
its state in OUT/runs/<variant>/seed<k>/) with that seed, evaluates on the same held-out contexts
(the eval seed is fixed) and writes `result.json` there; a finished run is not repeated. The
original model is evaluated once (OUT/runs/original/result.json) and reported as the variant
"original" (sd 0: nothing in it depends on a training seed).

A control is a variant whose layers keep the model's attention (attn = "softmax", no settings) and
that fine-tunes the same way (e.g. the same LoRA adapters): it separates the fine-tuning's own
effect from the mechanism's.

Per-run metrics (the names `[[verdict]]` rules use): ppl, nll (ln ppl), ppl_gap (% against the
original model), and the per-layer statistics of `evaluate_retrofit` averaged over the replaced
layers (first_token_share, gate_low, ground_weight, learned_sink_share) and over all layers
(first_token_share_all); first_token_share_before: the original's share over the same layers;
new_change_rms (how far the new parameters moved), trainable_params (what fine-tuning trained, LoRA
included: a control matches a variant's count to within 10 %) and wall_s. The report adds each layer's
statistics per variant.

The report (statistics, verdicts, report.md): `attnlab.experiments.retrofit_report`.
The format, with an example: experiments/README.md ("Retrofit trials"); the metrics: docs/retrofit.md.
Decode metrics (with `[eval] windows`): exact@T, window<K>@T, learned<K>@T in nats per token and
gap:<name>, the perplexity gap in % against exact@T.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch

from attnlab import interrupt
from attnlab.data.cache import atomic_write_text
from attnlab.experiments.report import mean as _mean_or_none
from attnlab.experiments.sweep.verdict import check_rules
from attnlab.experiments.trial import Trial, need, read_spec, section, table as _table, variant_name
from attnlab.checks import check_int
from attnlab.lock import FolderLock, check_free
from attnlab.pool import run_pool
from attnlab.models.config import ConfigError

from ..retrofit.convert import RetrofitError
from ..retrofit.evaluate import PER_LAYER, EvalConfig, selector_path
from ..retrofit.finetune import FinetuneConfig
from ..retrofit.transfer import TransferConfig
from ..search.metrics import PERPLEXITY_RULE
from .retrofit_report import write_report
from .retrofit_runs import (ORIGINAL, PARTIAL, RESULT, RetrofitSpec, TrialRun, _current, _fingerprint, borrow,
                            metric_names, same_settings)

SPEC_KEYS = ("title", "claim", "description", "seeds", "retrofit", "transfer", "finetune", "eval", "variants",
             "verdict", "out")
SECTIONS = {"retrofit": (RetrofitSpec, ()), "transfer": (TransferConfig, ("seed",)),
            "finetune": (FinetuneConfig, ("seed", "checkpoint_every")), "eval": (EvalConfig, ())}


def _section(name: str, shared: dict, own: dict, where: str, **owned):
    cls, fixed = SECTIONS[name]
    if name == "retrofit":  # a variant's settings add to the shared ones
        own = {**own, "settings": {**_table(shared.get("settings", {}), "retrofit.settings"),
                                   **_table(own.get("settings", {}), f"{where}: retrofit.settings")}}
    return section(cls, name, shared, own, where, fixed, **owned)


def load_trial(path) -> Trial:
    """Read and check the spec and build every run's configs (ConfigError naming the key); the layer
    plan of each variant is checked against the model's config (RetrofitError) before any weights load."""
    from ..retrofit.finetune import check_trainable
    from ..retrofit.io import parse_settings, plan_source

    head = read_spec(path, SPEC_KEYS)
    raw, seeds, out = head.raw, head.seeds, head.out
    shared = {k: _table(raw.get(k, {}), k) for k in SECTIONS}
    runs, names, plans = [], [], {}
    for i, v in enumerate(head.variants):
        name = variant_name(v, i, names, set(SECTIONS), reserved=ORIGINAL)
        for seed in seeds:
            where = f"variant {name!r}, seed {seed}"
            cfg = {k: _section(k, shared[k], _table(v.get(k, {}), f"variants[{i}].{k}"), where,
                               **({"seed": seed} if k in ("transfer", "finetune") else {})) for k in SECTIONS}
            rs = cfg["retrofit"]
            try:
                rs.settings = parse_settings(rs.settings)
                for k in ("transfer", "finetune", "eval"):
                    cfg[k].check()
                if name not in plans:
                    plans[name] = plan_source(rs.model, rs.layers, rs.attn, rs.settings)[1]
                    if cfg["finetune"].steps > 0:
                        check_trainable(plans[name], cfg["finetune"].train, cfg["finetune"].lora,
                                        cfg["finetune"].align)
            except RetrofitError as e:
                raise ConfigError(f"{where}: {e}") from None
            runs.append(TrialRun(name, seed, out / "runs" / name / f"seed{seed}", rs, cfg["transfer"],
                                 cfg["finetune"], cfg["eval"]))
    need(len({r.retrofit.model for r in runs}) == 1, "every variant must retrofit the same model (retrofit.model)")
    need(len({json.dumps(asdict(r.eval), sort_keys=True) for r in runs}) == 1,
         "every variant must be evaluated the same way ([eval] is shared, not set per variant)")
    rules = check_rules(raw["verdict"], [*names, ORIGINAL], metric_names(runs[0].eval)) if "verdict" in raw else []
    return Trial(head.path, head.title, head.claim, head.description, seeds, names, runs, rules, out)


def _summary(report: dict, replaced: set[int]) -> dict:
    """The run's scalars from an `evaluate_retrofit` report."""
    layers = report["layers"]
    out = {"ppl": report["perplexity"], "nll": math.log(report["perplexity"])}
    for key in PER_LAYER:
        out[key] = _mean_or_none([row.get(key) for row in layers if row["layer"] in replaced])
    out["first_token_share_all"] = _mean_or_none([row.get("first_token_share") for row in layers])
    decode = report.get("decode", {})
    for name, nll in decode.items():  # nats per token, and the perplexity gap (%) against exact at that length
        out[name] = nll
        if not name.startswith("exact@"):
            out["gap:" + name] = 100.0 * math.expm1(nll - decode["exact@" + name.split("@")[1]])
    return out


def run_one(run: TrialRun | None, ev: EvalConfig, folder: Path, hf_model, tok, progress: bool = True) -> dict:
    """Convert, transfer, fine-tune and evaluate one run through `attnlab.retrofit.pipeline.run_pipeline`
    (run=None: the original model, through a softmax conversion that computes exactly its attention);
    writes and returns folder/result.json."""
    from ..retrofit.convert import plan as make_plan
    from ..retrofit.pipeline import run_pipeline

    t0 = time.perf_counter()
    rs = run.retrofit if run is not None else RetrofitSpec(layers="0")
    mark = folder / "fingerprint.json"  # a run folder left by other settings (an edited spec) starts afresh
    if mark.is_file() and not same_settings(json.loads(mark.read_text()), _fingerprint(run, ev)):
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(mark, json.dumps(_fingerprint(run, ev)) + "\n")
    done = run_pipeline(hf_model, make_plan(hf_model.config, rs.layers, rs.attn, rs.settings), folder,
                        seed=run.seed if run is not None else 0, transfer=run.transfer if run else None,
                        finetune=run.finetune if run else None, evaluate=ev, tokenizer=tok, compare=run is None,
                        partial=folder / PARTIAL,  # an interrupted evaluation keeps its decode losses
                        progress=progress)
    res: dict = {"variant": run.variant if run else ORIGINAL, "seed": run.seed if run else None,
                 "layers": list(done.model.retrofit_plan.layers) if run else []}
    if done.transfer is not None:
        res["transfer"] = json.loads(json.dumps(done.transfer, default=str))
    if done.finetune is not None:
        res["finetune"] = {k: done.finetune.get(k) for k in ("steps", "resumed_from", "loss_start", "loss_end",
                                                             "perplexity_before", "perplexity_after", "trained")}
        res["finetune"]["trained"] = len(done.finetune.get("trained") or [])
        f = run.finetune
        res["finetune"]["tokens"] = f.steps * f.batch * f.context
        res["trainable_params"] = done.finetune.get("trainable_params")
    report = done.eval
    res.update(_summary(report, set(res["layers"])), eval=report, new_change_rms=done.new_change_rms,
               wall_s=time.perf_counter() - t0, fingerprint=_fingerprint(run, ev), perplexity_rule=PERPLEXITY_RULE)
    if run is None:
        res["ppl_original_hf"] = report.get("perplexity_original")
    atomic_write_text(folder / RESULT, json.dumps(res, indent=1, default=str) + "\n")
    (folder / PARTIAL).unlink(missing_ok=True)
    selector_path(folder / PARTIAL).unlink(missing_ok=True)
    return res


def run_trial(trial: Trial, hf_model=None, tok=None, progress: bool = True, report_only: bool = False,
              jobs: int = 1, device=None, dtype=None, reuse: bool = True) -> dict:
    """Run every unfinished (variant, seed), then write OUT/results.json and report.md. OUT is locked
    meanwhile; SIGINT/SIGTERM stop it after the current step, and the same command resumes.

    jobs > 1 runs that many (variant, seed) runs at once, each in a worker process with its own copy
    of the model and 1/jobs of this process's threads (`attnlab.pool`); the runs' folders are disjoint.
    device, dtype: where the original model loads and in which dtype (None: the CPU, float32), when
    hf_model is not given; the runs follow it. reuse: a run that a trial in a folder beside this
    one finished for the same settings and seed (`retrofit_runs.borrow`: the control of one trial is
    often another's) is copied with its source named, not run again; False runs everything here."""
    check_int("jobs", jobs)
    ev = trial.runs[0].eval
    check_free(trial.out)
    with FolderLock(trial.out), interrupt.graceful():
        orig = trial.out / "runs" / ORIGINAL
        todo = [] if report_only else [r for r in [None, *trial.runs]
                                       if not _current(orig if r is None else r.folder, _fingerprint(r, ev))]
        stale = len(todo)
        if reuse:  # a run another trial beside this one already did with the same settings is copied, not redone
            todo = [r for r in todo if borrow(orig if r is None else r.folder, _fingerprint(r, ev),
                                              None if r is None else r.seed, trial.out.parent) is None]
        if not report_only:
            print(f"trial {trial.title!r}: {len(trial.runs) + 1} runs ({len(trial.runs) + 1 - stale} done, "
                  f"{stale - len(todo)} copied from identical runs beside it, {len(todo)} to run) in {trial.out}",
                  flush=True)
        names, count = [ORIGINAL if r is None else f"{r.variant}/seed{r.seed}" for r in todo], [0]

        def done(i: int) -> None:  # one line per finished run: a trial of hours says where it is
            res = json.loads(((orig if todo[i] is None else todo[i].folder) / RESULT).read_text())
            count[0] += 1
            print(f"finished {names[i]} ({count[0]} of {len(todo)}): nll {res['nll']:.4f}, {res['wall_s']:,.0f} s",
                  flush=True)
        if jobs > 1 and len(todo) > 1:
            threads = max(1, torch.get_num_threads() // jobs)
            keys = [None if r is None else (r.variant, r.seed) for r in todo]
            run_pool(_trial_job, [(str(trial.path), key, threads, None if device is None else str(device),
                                   None if dtype is None else str(dtype).removeprefix("torch."))
                                  for key in keys], jobs, on_done=done,
                     stopped=lambda: "stopped; finished runs are kept and the rerun resumes the others")
            todo = []
        if todo and hf_model is None:
            from ..retrofit.io import load_source, plan_source

            hf_model, tok = load_source(plan_source(trial.runs[0].retrofit.model, "0", "softmax")[0], device,
                                        dtype or torch.float32)
        for i, run in enumerate(todo):
            torch.manual_seed(0)
            run_one(run, ev, orig if run is None else run.folder, hf_model, tok, progress)
            done(i)
            if interrupt.requested() is not None:
                raise interrupt.Interrupted(interrupt.requested(), "stopped between runs; rerun to resume")
        return write_report(trial)


def _trial_job(spec: str, key: tuple[str, int] | None, threads: int, device: str | None = None,
               dtype: str | None = None) -> None:
    """One run of a trial in a pool worker: key (variant, seed), or None for the original model."""
    from ..retrofit.io import load_source, plan_source, resolve_dtype

    torch.set_num_threads(threads)
    trial = load_trial(spec)
    run = None if key is None else next(r for r in trial.runs if (r.variant, r.seed) == tuple(key))
    hf_model, tok = load_source(plan_source(trial.runs[0].retrofit.model, "0", "softmax")[0], device,
                                resolve_dtype(dtype))
    torch.manual_seed(0)
    run_one(run, trial.runs[0].eval, trial.out / "runs" / ORIGINAL if run is None else run.folder, hf_model, tok,
            progress=False)
