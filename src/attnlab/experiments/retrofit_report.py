"""The report of a retrofit trial (`attnlab.experiments.retrofit_trial`): per-variant statistics over
the finished seeds, the verdicts (a perplexity comparison across perplexity rules is not judged),
`results.json` and `report.md`."""

from __future__ import annotations

from attnlab.experiments.report import fmt, markdown_table, mean as _mean_or_none, report_head
from attnlab.experiments.sweep.verdict import judge, verdict_lines
from attnlab.experiments.trial import Trial, keep_recorded, pm, recorded_results, seed_stats, write_outputs

from ..retrofit.evaluate import PER_LAYER
from ..search.metrics import PERPLEXITY_RULE
from .retrofit_runs import ORIGINAL, SCALARS, _fingerprint, finished, metric_names, same_settings


def collect(trial: Trial) -> tuple[dict, dict]:
    """(per-variant statistics over finished seeds, per-variant per-layer means), the original included."""
    ev = trial.runs[0].eval
    stats, layers = {}, {}
    orig = finished(trial.out / "runs" / ORIGINAL, _fingerprint(None, ev))
    if orig is not None:
        base = {"ppl": orig["ppl"], "nll": orig["nll"], "ppl_gap": 0.0, "wall_s": orig["wall_s"],
                "first_token_share_all": orig["first_token_share_all"]}
        stats[ORIGINAL] = seed_stats({s: base for s in trial.seeds})
        stats[ORIGINAL]["sd"] = {k: (0.0 if v is not None else None) for k, v in stats[ORIGINAL]["mean"].items()}
        if orig.get("perplexity_rule") != PERPLEXITY_RULE:
            stats[ORIGINAL]["earlier_rule"] = True
        if orig.get("reused_from"):
            stats[ORIGINAL]["reused_from"] = [orig["reused_from"]]
        layers[ORIGINAL] = {k: [row.get(k) for row in orig["eval"]["layers"]] for k in PER_LAYER}
    for v in trial.variants:
        done, per_layer, earlier, current, reused = {}, [], False, False, []
        for run in (r for r in trial.runs if r.variant == v):
            res = finished(run.folder, _fingerprint(run, ev))
            if res is None:
                continue
            m = {k: res.get(k) for k in metric_names(ev)}
            if orig is not None:
                m["ppl_gap"] = 100.0 * (res["ppl"] / orig["ppl"] - 1.0)
                m["first_token_share_before"] = _mean_or_none(
                    [row.get("first_token_share") for row in orig["eval"]["layers"] if row["layer"] in res["layers"]])
            done[run.seed] = m
            per_layer.append(res["eval"]["layers"])
            earlier = earlier or res.get("perplexity_rule") != PERPLEXITY_RULE
            current = current or res.get("perplexity_rule") == PERPLEXITY_RULE
            if res.get("reused_from"):
                reused.append(res["reused_from"])
        stats[v] = seed_stats(done)
        if reused:
            stats[v]["reused_from"] = reused
        if earlier:
            stats[v]["earlier_rule"] = True
            if current:
                stats[v]["mixed_rule"] = True  # some seeds rerun under today's rule, some not yet
        stats[v]["tokens"] = next((r.finetune.steps * r.finetune.batch * r.finetune.context
                                   for r in trial.runs if r.variant == v), 0)
        if per_layer:
            layers[v] = {k: [_mean_or_none([rows[i].get(k) for rows in per_layer]) for i in range(len(per_layer[0]))]
                         for k in PER_LAYER}
    return stats, layers


def write_report(trial: Trial) -> dict:
    """Write OUT/results.json and report.md from the finished runs (and, for variants whose run
    folders are absent, the committed results measured with the same fingerprint: `keep_recorded`)."""
    stats, layers = collect(trial)
    old, ev = recorded_results(trial.out), trial.runs[0].eval
    fingerprints = {r.variant: _fingerprint(r, r.eval) for r in trial.runs}

    def same(v: str) -> bool:
        if v == ORIGINAL:  # the unchanged model, measured by the shared evaluation
            return any(same_settings({"eval": fp.get("eval")}, _fingerprint(None, ev))
                       for fp in (old.get("runs") or {}).values() if isinstance(fp, dict))
        fp = (old.get("runs") or {}).get(v)
        return isinstance(fp, dict) and same_settings(fp, fingerprints[v])

    seeds = {v: [r.seed for r in trial.runs if r.variant == v] for v in trial.variants}
    for v in keep_recorded(stats, old, {ORIGINAL: list(trial.seeds), **seeds}, same):
        if (old.get("per_layer") or {}).get(v) is not None:
            layers[v] = old["per_layer"][v]
    judged = [_same_rule(r, judge(r, stats), stats) for r in trial.rules]
    results = {"title": trial.title, "claim": trial.claim, "spec": str(trial.path), "variants": stats,
               "per_layer": layers, "verdicts": judged,
               "runs": {r.variant: _fingerprint(r, r.eval) for r in trial.runs}}
    write_outputs(trial.out, results, report_markdown(trial, stats, layers, judged))
    return results


def _rule_of(stats: dict, v: str) -> str:
    s = stats.get(v, {})
    return "mixed" if s.get("mixed_rule") else "earlier" if s.get("earlier_rule") else "current"


def _same_rule(rule: dict, judged: dict, stats: dict) -> dict:
    """A comparison of perplexities scored under different perplexity rules (or a variant whose seeds
    mix them) is not judged: inconclusive, saying which to rerun. Attention statistics are unaffected."""
    metric = rule.get("metric", "")
    if "compare" not in rule or not (metric in ("ppl", "nll", "ppl_gap")
                                     or metric.startswith(("exact@", "gap:", "window", "learned"))):
        return judged
    if not all(stats.get(v, {}).get("seeds") for v in rule["compare"]):
        return judged  # a variant with no finished run: the judge already says what is missing
    rules = {v: _rule_of(stats, v) for v in rule["compare"]}
    if len(set(rules.values())) == 1 and "mixed" not in rules.values():
        return judged
    said = ", ".join(f"{v} {r}" for v, r in rules.items())
    return {**judged, "outcome": "inconclusive",
            "reason": f"not judged: scored under different perplexity rules ({said}); rerun the earlier runs "
                      f"(measured: {judged['reason']})"}


def report_markdown(trial: Trial, stats: dict, layers: dict, judged: list[dict]) -> str:
    first = {r.variant: r for r in reversed(trial.runs)}
    lines = report_head(trial.title, "attnlab retrofit trial", trial.path.name, trial.claim, trial.description)
    ev = trial.runs[0].eval
    lines += ["## Setup", "",
              f"Model {trial.runs[0].retrofit.model}; evaluated on {ev.contexts} held-out contexts of {ev.context} "
              f"tokens ({ev.corpus} test split, the same for every run; per-layer statistics on the first "
              f"{ev.analysis_contexts}); seeds {trial.seeds}. The variant `original` is the unmodified model.", ""]
    for v in trial.variants:
        r, f, t = first[v].retrofit, first[v].finetune, first[v].transfer
        tune = (f"fine-tuned {f.steps} steps × {f.batch} × {f.context} tokens = {f.steps * f.batch * f.context:,} "
                f"tokens (train {f.train}{f', LoRA rank {f.lora}' if f.lora else ''}, lr {f.lr:g}"
                f"{f', new parameters × {f.new_lr_scale:g}' if f.new_lr_scale != 1 else ''}"
                f"{f', KL {f.kl:g}' if f.kl else ''})" if f.steps else "not fine-tuned")
        moved = f"attention transfer {t.steps} steps per layer on {t.contexts} × {t.context} tokens; " if t.steps else ""
        wall = stats[v]["mean"].get("wall_s")
        lines.append(f"- **{v}**: layers {r.layers} → {r.attn}{' ' + str(r.settings) if r.settings else ''}; {moved}{tune}; "
                     f"wall time per run {fmt(wall, 3) if wall else '—'} s; seeds done {stats[v]['seeds']}.")
    reused = [f"{v} ({', '.join(f'`{p}`' for p in stats[v]['reused_from'])})" for v in [ORIGINAL, *trial.variants]
              if stats.get(v, {}).get("reused_from")]
    if reused:
        lines += ["", "Taken from another trial's runs of the same settings and seeds (the same computation, run "
                  "once; `attnlab retrofit trial` copies them; paths from the folder that holds this trial): "
                  + "; ".join(reused) + "."]
    lines += ["", "## Results: mean ± sd over training seeds", "",
              "ppl: held-out perplexity; ppl_gap: % against the original model; nll = ln ppl. first-token share, "
              "gate_low (share of gate values below 0.1), ground_weight (the ground state's mass) and "
              "learned_sink_share: means over the replaced layers' heads; first_token_share_all: over every layer. "
              "new_change_rms: how far the new parameters moved; trainable_params: the parameters fine-tuning trained "
              "(LoRA included).", ""]
    shown = [k for k in SCALARS if k != "wall_s" and any(s["mean"].get(k) is not None for s in stats.values())]
    rows = [[v, len(stats[v]["seeds"])] + [pm(stats[v]["mean"].get(k), stats[v]["sd"].get(k)) for k in shown]
            for v in [ORIGINAL, *trial.variants] if v in stats]
    lines += [markdown_table(["variant", "seeds", *shown], rows), ""]
    earlier = [v + (" (some seeds)" if stats[v].get("mixed_rule") else "") for v in [ORIGINAL, *trial.variants]
               if stats.get(v, {}).get("earlier_rule")]
    if earlier:
        lines += [f"Scored under the earlier perplexity rule (every prediction, the first token of a document "
                  f"from the previous document's EOS included; the rule now is {PERPLEXITY_RULE}, "
                  f"docs/retrofit.md): {', '.join(earlier)}. Rerunning those runs regenerates their numbers; "
                  f"until then a rule comparing perplexities scored under different rules is not judged.", ""]
    decode = [n for n in ev.decode_names() if not n.startswith("exact@")]
    if decode:
        lines += ["### Decoding through key selection: perplexity gap (%) against each model's exact loss", "",
                  markdown_table(["variant", *(f"exact@{n.split('@')[1]} (nats)" for n in ev.decode_names()
                                               if n.startswith("exact@")), *decode],
                                 [[v, *(pm(stats[v]["mean"].get(n), stats[v]["sd"].get(n)) for n in ev.decode_names()
                                        if n.startswith("exact@")),
                                   *(pm(stats[v]["mean"].get("gap:" + n), stats[v]["sd"].get("gap:" + n)) for n in decode)]
                                  for v in trial.variants]), ""]
    for key in PER_LAYER:
        have = [v for v in [ORIGINAL, *trial.variants] if v in layers and any(x is not None for x in layers[v][key])]
        if not have:
            continue
        n = len(layers[have[0]][key])
        lines += [f"### {key} per layer (mean over seeds)", "",
                  markdown_table(["layer", *have], [[i, *[layers[v][key][i] for v in have]] for i in range(n)]), ""]
    lines += verdict_lines(trial.rules, judged)
    return "\n".join(lines).rstrip() + "\n"
