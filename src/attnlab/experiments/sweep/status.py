"""What a sweep still has to do, without doing any of it (`attnlab sweep SPEC... --plan`).

For every (variant, seed): its state (recorded in results.json, finished, in a records folder not
yet merged, to resume from a checkpoint, to evaluate, new), the step it stands at, its tokens per
parameter, and the training time left at the speed the sweep's own runs measured; per spec, whether
it meets the budget rule. Reads the run folders, results.json and the records; writes nothing.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from attnlab.models.config import ConfigError

from .budget import check_budget, is_language, params_of, tokens_per_param
from .records import SUFFIX, _read, spec_hash
from .runs import plan, recorded_runs, scalar_of
from .spec import Spec

LEFT_STATES = ("resume", "restart", "new")  # what trains; "evaluate" only measures


def spec_records(spec: Spec, folder: str | os.PathLike) -> list[Path]:
    """The records files in `folder` of this spec (its spec hash), whatever folder name wrote them."""
    import json

    mine = spec_hash(spec)
    found = []
    for f in sorted(Path(folder).glob(f"*{SUFFIX}")):
        try:
            head = json.loads(f.read_text())
        except (OSError, ValueError):
            continue  # another spec's damaged file is not this plan's business
        if isinstance(head, dict) and head.get("spec_hash") == mine:
            found.append(f)
    return found


def _checkpoint_step(run_dir: Path) -> int:
    from attnlab.train.checkpoint import latest_checkpoint
    from attnlab.train.trainer import CKPT_DIR

    ckpt = latest_checkpoint(run_dir / CKPT_DIR)
    try:
        return int(ckpt.name.rsplit("_", 1)[1]) if ckpt is not None else 0
    except (IndexError, ValueError):
        return 0


def _logged_rate(run_dir: Path) -> float | None:
    """The tokens/s of the run's last logged training interval (None without one)."""
    from attnlab.train import read_log

    rates = [r["tokens_per_s"] for r in read_log(run_dir, "train") if r.get("tokens_per_s")]
    return rates[-1] if rates else None


def sweep_plan(spec: Spec, out: str | os.PathLike | None = None, *, jobs: int = 1,
               records: str | os.PathLike | None = None) -> dict:
    """{"spec", "title", "budget", "rows", "seconds_left", "unknown", "rates"}: one row per run (variant,
    seed, state, step, steps, tokens_per_param, tokens_per_step, rate, rate_from, seconds_left). A run's speed is its own last
    logged tokens/s, else the median of its variant's finished runs, else of the spec's (None: no run
    of the spec has finished; those runs are counted in "unknown"). Raises what `plan` raises."""
    out = Path(out) if out is not None else spec.out
    plans = plan(spec, out, jobs=jobs)
    finished = dict(recorded_runs(spec, out))
    in_records = set()
    for f in spec_records(spec, records) if records is not None else []:
        for r in _read(f, spec)["runs"]:
            in_records.add((r["variant"], r["seed"]))
            finished.setdefault((r["variant"], r["seed"]), r)
    rates: dict[str, list[float]] = {}
    for (variant, _), r in finished.items():
        rate = scalar_of({"metrics": {}, **r}, "tokens_per_s")
        if rate:
            rates.setdefault(variant, []).append(rate)
    everyone = [x for v in rates.values() for x in v]
    try:
        check_budget(spec, plans)
        budget = f"exception: {spec.below_budget}" if spec.below_budget else "meets"
    except ConfigError as e:
        budget = f"refused: {e}"
    params: dict[str, int] = {}
    rows, total, unknown = [], 0.0, 0
    for p in plans:
        if p.variant not in params:
            params[p.variant] = params_of(p.cfg)
        steps = p.cfg.train.steps
        state = p.state
        if state not in ("done", "recorded") and (p.variant, p.seed) in in_records:
            state = "in records"
        step = steps if state in ("done", "recorded", "evaluate", "in records") else \
            (_checkpoint_step(p.run_dir) if state == "resume" else 0)
        rate, rate_from = None, None
        if state in LEFT_STATES:
            own = _logged_rate(p.run_dir) if state == "resume" else None
            if own:
                rate, rate_from = own, "its log"
            elif rates.get(p.variant):
                rate, rate_from = statistics.median(rates[p.variant]), "its variant's runs"
            elif everyone:
                rate, rate_from = statistics.median(everyone), "the spec's runs"
        left = None
        if state in LEFT_STATES:
            if rate:
                left = (steps - step) * p.cfg.train.tokens_per_step / rate
                total += left
            else:
                unknown += 1
        elif state not in ("evaluate",):
            left = 0.0
        rows.append({"variant": p.variant, "seed": p.seed, "state": state, "step": step, "steps": steps,
                     "tokens_per_param": round(tokens_per_param(p.cfg, params[p.variant]), 2)
                     if is_language(p.cfg) else None,
                     "tokens_per_step": p.cfg.train.tokens_per_step, "rate": rate, "rate_from": rate_from,
                     "seconds_left": left})
    return {"spec": str(spec.path), "title": spec.title, "budget": budget, "rows": rows, "jobs": jobs,
            "seconds_left": total, "unknown": unknown, "rates": everyone}


def fill_from_others(plans: list[dict]) -> list[dict]:
    """Runs of a spec none of whose runs has finished, timed at the median speed of the other specs'
    finished runs in the same plan (a queue on one machine); `plans` are updated and returned."""
    others = [x for p in plans for x in p["rates"]]
    if not others:
        return plans
    rate = statistics.median(others)
    for p in plans:
        for r in p["rows"]:
            if r["state"] in LEFT_STATES and r["rate"] is None:
                r["rate"], r["rate_from"] = rate, "other specs' runs"
                r["seconds_left"] = (r["steps"] - r["step"]) * r["tokens_per_step"] / rate
                p["seconds_left"] += r["seconds_left"]
                p["unknown"] -= 1
    return plans


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def plan_text(p: dict) -> str:
    """The plan of one spec as the command prints it."""
    from collections import Counter

    counts = Counter(r["state"] for r in p["rows"])
    lines = [f"{p['spec']}: {p['title']}",
             f"  {len(p['rows'])} runs: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())),
             f"  budget rule: {p['budget']}"]
    width = max(len(f"{r['variant']}/seed{r['seed']}") for r in p["rows"])
    for r in p["rows"]:
        name = f"{r['variant']}/seed{r['seed']}"
        tpp = "—" if r["tokens_per_param"] is None else f"{r['tokens_per_param']:.1f} tok/param"
        if r["state"] in LEFT_STATES:
            left = (f"{_hours(r['seconds_left'])} left at {r['rate']:,.0f} tok/s ({r['rate_from']})"
                    if r["seconds_left"] is not None else "time left unknown (no run of the spec has finished)")
        elif r["state"] == "evaluate":
            left = "trained; its metrics are measured next"
        else:
            left = ""
        lines.append(f"  {name:<{width}}  {r['state']:<10}  {r['step']:>7,}/{r['steps']:<7,}  {tpp:<16}  {left}".rstrip())
    return "\n".join(lines)


def total_text(plans: list[dict], jobs: int) -> str:
    """The line under the tables: training time left in all, and spread over `jobs`."""
    total = sum(p["seconds_left"] for p in plans)
    unknown = sum(p["unknown"] for p in plans)
    runs = sum(1 for p in plans for r in p["rows"] if r["state"] in LEFT_STATES)
    text = f"training left: {runs} runs, {_hours(total)} of one job"
    if jobs > 1 and total:
        text += f", about {_hours(total / jobs)} at --jobs {jobs} (each at the speed measured)"
    if unknown:
        text += f"; {unknown} runs of unknown speed not counted"
    return text + "; evaluation not counted"
