"""A sweep spec: load and validate the TOML (format in experiments/README.md)."""


from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from attnlab.eval.metrics import GATE_BINS
from attnlab.eval.tasks import MQAR_ATTENTION
from attnlab.models.config import ConfigError
from attnlab.train.config import read_toml

from .verdict import check_answer, check_rules



SPEC_KEYS = ("title", "claim", "description", "base", "seeds", "overrides", "variants", "out", "per_seed",
             "metrics", "verdict", "answer", "below_budget", "earlier")
VARIANT_KEYS = ("name", "overrides", "description")
# [metrics]: what to collect per run from attnlab.train.evaluate, and evaluate's arguments
METRIC_KEYS = ("loss_at", "topk_mass", "entropy", "sink_share", "learned_sink_share", "alignment", "gate", "principled", "windowed_loss",
               "budgets", "compress", "lengths", "passkey", "mqar_accuracy", "mqar_scales", "mqar_windows", "mqar_scale_pairs",
               "mqar_attention", "heldout", "heldout_lengths", "repeat_lengths", "repeat_span", "repeat_probes", "at_steps")
EVAL_ARG_KEYS = ("max_tokens", "batch_size", "analysis_len", "analysis_batch", "split", "passkey_depths")
OWNED_KEYS = ("run.seed", "run.name", "run.out_dir", "run.resume", "run.overwrite", "run.progress")
SUMMARY_SCALARS = ("val_loss", "val_ppl", "val_accuracy", "train_loss", "tokens_per_s", "train_seconds",
                   "stopped_at", "best_step")
RECORD = "sweep.json"  # per run folder: the collected metrics and the wall time of the run
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")




class SweepError(ValueError):
    """A run folder that the sweep cannot use as it stands (another config, a damaged checkpoint)."""


# --------------------------------------------------------------------------- the spec


@dataclass
class Variant:
    """One [[variants]] entry: its folder-safe `name`, the dotted `overrides` it applies after the
    spec's shared ones, and an optional `description` shown in the report."""

    name: str
    overrides: list[str]
    description: str = ""


@dataclass
class Spec:
    """A loaded and checked sweep spec (`load_spec`; the format: experiments/README.md).

    path: the spec file; title, claim, description: the report's heading and hypothesis; base: the
    base run config as written (a path relative to the spec, or an inline table) and base_raw the raw
    config it gives; seeds; overrides shared by every run; variants; out: the output folder (default
    the spec's); per_seed: also a table per run; metrics: the [metrics] table; verdict: the first
    rule and verdicts every rule (empty without any); answer: the [answer] table (None without one);
    below_budget: why the spec may train a language model below the budget rule (`.budget`), "" for
    none; earlier: the results.json (a path relative to the spec) of the same question asked before,
    whose verdicts the report shows beside this spec's; raw: the TOML as read.
    """

    path: Path
    title: str
    claim: str
    description: str
    base: str | dict  # the path as written (relative to the spec) or the inline table
    base_raw: dict  # the raw run config the base gives
    seeds: list[int]
    overrides: list[str]
    variants: list[Variant]
    out: Path
    per_seed: bool
    metrics: dict
    verdict: dict | None  # the first rule (None without any)
    verdicts: list[dict] = field(default_factory=list)  # every rule, in the spec's order
    answer: dict | None = None  # the [answer] table, checked (`verdict.check_answer`); None without one
    below_budget: str = ""  # why this spec may train below the budget rule (.budget); "" for none
    earlier: Path | None = None  # the results.json of the same question asked at an earlier budget
    raw: dict = field(repr=False, default_factory=dict)

    def run_dir(self, variant: str, seed: int, out: str | os.PathLike | None = None) -> Path:
        """The run folder of (variant, seed): RUNS/<variant>/seed<k>, RUNS = `runs_root(OUT)`, OUT = `out`
        or the spec's."""
        return runs_root(out if out is not None else self.out) / variant / f"seed{seed}"


RUNS_ENV = "ATTNLAB_RUNS"  # a folder for every sweep's run folders, outside the checkout


def runs_root(out: str | os.PathLike) -> Path:
    """Where the run folders of a sweep writing into OUT live: OUT/runs, or, with $ATTNLAB_RUNS set,
    $ATTNLAB_RUNS/<OUT's path inside its git checkout>/runs, so that the runs of an experiment outlive
    the checkout (a fresh clone of the same repository finds them there)."""
    out = Path(out)
    folder = os.environ.get(RUNS_ENV)
    if not folder:
        return out / "runs"
    here = out.resolve()
    top = next((p for p in [here, *here.parents] if (p / ".git").exists()), None)
    key = here.relative_to(top) if top is not None else Path(*here.parts[1:])
    return Path(folder).expanduser().resolve() / key / "runs"


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _unknown(table: dict, allowed: Sequence[str], where: str) -> None:
    for key in table:
        _need(key in allowed, f"unknown key {where}{key} in the spec; allowed: {', '.join(allowed)}")


def _str_list(value, key: str) -> list[str]:
    _need(isinstance(value, list) and all(isinstance(v, str) for v in value),
          f"{key} must be a list of strings, got {value!r}")
    return list(value)


def _int_list(value, key: str, lo: int) -> list[int]:
    ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= lo for v in value)
    _need(ok, f"{key} must be a list of integers >= {lo}, got {value!r}")
    return list(value)


def _check_overrides(items: list[str], key: str) -> None:
    for item in items:
        _need("=" in item, f"{key}: {item!r} must look like section.key=value (e.g. train.steps=500)")
        name = item.split("=", 1)[0].strip()
        _need(name not in OWNED_KEYS,
              f"{key}: {name} is set by the sweep for every run; it owns {', '.join(OWNED_KEYS)}")


def _nest(table: dict, key: str) -> dict:
    """An inline [base] table as a raw config: dotted keys (quoted or not) become nested tables."""
    out: dict = {}
    for k, v in table.items():
        node = out
        parts = k.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            _need(isinstance(node, dict), f"{key}.{k}: {p} is a value, not a table")
        last = parts[-1]
        if isinstance(v, dict):
            v = _nest(v, f"{key}.{k}")
            if isinstance(node.get(last), dict):
                node[last].update(v)
                continue
        node[last] = v
    run = out.get("run")
    for name in run if isinstance(run, dict) else ():
        _need(f"run.{name}" not in OWNED_KEYS, f"{key}: run.{name} is set by the sweep; it owns {', '.join(OWNED_KEYS)}")
    return out


def window_keys(metrics: dict) -> list[str]:
    """The windowed-decode settings a [metrics] table asks for: "k" per windowed_loss k, and
    "k/M=M" per k and memory budget M (budgets)."""
    return [str(k) if M is None else f"{k}/M={M}" for k in metrics.get("windowed_loss", [])
            for M in [None, *metrics.get("budgets", [])]]


def metric_names(metrics: dict) -> list[str]:
    """The per-run scalars a [metrics] table asks for, in order: those of the final checkpoint, then with
    at_steps each of them again on the checkpoint of each step N ("<name>/step=N")."""
    names = final_metric_names(metrics)
    return names + [f"{n}/step={N}" for N in metrics.get("at_steps", []) for n in names]


def step_of(name: str) -> tuple[str, int | None]:
    """(the metric's name on the final checkpoint, the step of `at_steps` it was measured at, or None)."""
    head, sep, step = name.rpartition("/step=")
    return (head, int(step)) if sep and step.isdigit() else (name, None)


def final_metric_names(metrics: dict) -> list[str]:
    """The per-run scalars a [metrics] table asks for on the final checkpoint, in order."""
    names = [f"loss@{L}" for L in metrics.get("loss_at", [])]
    names += [f"topk_mass@{k}" for k in metrics.get("topk_mass", [])]
    names += [n for n in ("entropy", "sink_share", "learned_sink_share") if metrics.get(n)]
    names += ["align_top", "align_ratio"] + [f"align_d{i}" for i in range(1, 11)] if metrics.get("alignment") else []
    names += ["gate_low"] + [f"gate_h{i}" for i in range(1, GATE_BINS + 1)] if metrics.get("gate") else []
    names += ["ground_weight", "gate_suppression", "gate_suppression_strong"] if metrics.get("principled") else []
    for k in window_keys(metrics):
        names += [f"wloss@{k}", f"wgap@{k}"]
    for k in metrics.get("windowed_loss", []) if metrics.get("compress") else []:
        names += [f"{w}@{k}/span={s:g}" for s in metrics["compress"] for w in ("wloss", "wgap", "kept")]
    for T in metrics.get("lengths", []):
        names += [f"loss/T={T}"]
        names += [f"{w}@{k}/T={T}" for k in window_keys(metrics) for w in ("wloss", "wgap")]
        names += [f"topk_mass@{k}/T={T}" for k in metrics.get("topk_mass", [])]
    if len(metrics.get("lengths", [])) >= 2:
        names += [f"miss_slope@{k}" for k in metrics.get("topk_mass", [])]
    names += [f"passkey@{L}" for L in metrics.get("passkey", [])]
    names += [f"heldout/T={T}" for T in metrics.get("heldout_lengths", [])]
    names += [f"{w}/T={T}" for T in metrics.get("repeat_lengths", []) for w in ("repeat", "repeat_control", "repeat_gain")]
    names += mqar_metric_names(metrics)
    return names


def mqar_metric_names(metrics: dict) -> list[str]:
    """MQAR accuracy at the training length ("mqar_accuracy"), at s times it with s times the pairs
    ("mqar_accuracy@<s>x", mqar_scales), and each through a decode window of k keys
    ("mqar_accuracy/window=<k>", "mqar_accuracy@<s>x/window=<k>", mqar_windows); for each layer i of
    mqar_attention, where its attention at the queries goes ("mqar_region_mass@L<i>",
    "mqar_value_share@L<i>", "mqar_value_reach@L<i>": `attnlab.eval.tasks.mqar_attention_summary`),
    exactly and through each decode window."""
    scales = [""] + [f"@{s}x" for s in metrics.get("mqar_scales", [])]
    if not metrics.get("mqar_accuracy"):
        scales = scales[1:]
    windows = [""] + [f"/window={k}" for k in metrics.get("mqar_windows", [])]
    names = [f"mqar_accuracy{s}{w}" for s in scales for w in windows]
    return names + [f"mqar_{m}@L{i}{w}" for i in metrics.get("mqar_attention", []) for m in MQAR_ATTENTION for w in windows]


def mqar_values(ev: dict, metrics: dict) -> dict[str, float | None]:
    """The MQAR scalars of `mqar_metric_names` from what `attnlab.train.evaluate` returned (its "mqar"
    table); None where a run has no value (a window for a model without scalar/hybrid layers)."""
    table, where = ev.get("mqar") or {}, ev.get("mqar_attention") or {}
    out = {}
    for name in mqar_metric_names(metrics):
        head, _, window = name.partition("/")
        if not head.startswith("mqar_accuracy"):  # mqar_<measure>@L<i>: the attention at the queries
            measure, _, layer = head[len("mqar_"):].partition("@L")
            layers = where.get(window or "exact") or []
            out[name] = layers[int(layer)].get(measure) if int(layer) < len(layers) else None
            continue
        scale = head.partition("@")[2] or "1x"
        out[name] = (table.get(scale) or {}).get(window or "exact")
    return out


def _check_metrics(m, key: str = "metrics") -> dict:
    _need(isinstance(m, dict), f"{key} must be a table, got {m!r}")
    _unknown(m, METRIC_KEYS + EVAL_ARG_KEYS, f"{key}.")
    for name in ("loss_at", "topk_mass", "passkey", "windowed_loss", "budgets", "lengths", "mqar_windows",
                 "heldout_lengths", "repeat_lengths", "at_steps"):
        if name in m:
            _int_list(m[name], f"{key}.{name}", 1)
    if "at_steps" in m:
        steps = m["at_steps"]
        _need(steps and steps == sorted(set(steps)), f"{key}.at_steps must be increasing steps without repeats, got {steps!r}")
    if "heldout" in m:
        _need(isinstance(m["heldout"], str) and m["heldout"], f"{key}.heldout must be a corpus source the runs did not "
              f"train on (e.g. 'stdlib-tests' or a path), got {m['heldout']!r}")
        _need(m.get("heldout_lengths") or m.get("repeat_lengths"), f"{key}.heldout is the text of "
              f"{key}.heldout_lengths and {key}.repeat_lengths: give one of them as well")
    for name in ("repeat_span", "repeat_probes"):
        if name in m:
            v = m[name]
            _need(isinstance(v, int) and not isinstance(v, bool) and v >= 2, f"{key}.{name} must be an integer >= 2, got {v!r}")
            _need(m.get("repeat_lengths"), f"{key}.{name} shapes the repeated-span probe: give {key}.repeat_lengths as well")
    if "mqar_attention" in m:
        _int_list(m["mqar_attention"], f"{key}.mqar_attention", 0)
    if "mqar_scales" in m:
        v = m["mqar_scales"]
        ok = isinstance(v, list) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 2 for s in v)
        _need(ok, f"{key}.mqar_scales must be a list of integers >= 2 (the training length, 1x, is "
                  f"{key}.mqar_accuracy), got {v!r}")
    _need("mqar_scale_pairs" not in m or m.get("mqar_scales"), f"{key}.mqar_scale_pairs says whether mqar_scales "
          f"scales the pairs with the length: give {key}.mqar_scales as well")
    _need(not m.get("mqar_windows") or m.get("mqar_accuracy") or m.get("mqar_scales"),
          f"{key}.mqar_windows reads MQAR accuracy through a decode window: set {key}.mqar_accuracy = true "
          f"or {key}.mqar_scales as well")
    for name in ("entropy", "sink_share", "learned_sink_share", "alignment", "gate", "principled", "mqar_accuracy",
                 "mqar_scale_pairs"):
        if name in m:
            _need(isinstance(m[name], bool), f"{key}.{name} must be true or false, got {m[name]!r}")
    for name in ("max_tokens", "batch_size", "analysis_len", "analysis_batch"):
        if name in m:
            v = m[name]
            _need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"{key}.{name} must be an integer >= 1, got {v!r}")
    _need(not m.get("budgets") or m.get("windowed_loss"), f"{key}.budgets caps the sorted cache of windowed decoding: "
          f"give {key}.windowed_loss as well")
    if "compress" in m:
        c = m["compress"]
        ok = isinstance(c, list) and c and all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < 1e6
                                               for x in c)
        _need(ok, f"{key}.compress must be a non-empty list of key spans >= 0, got {c!r}")
        _need(m.get("windowed_loss"), f"{key}.compress merges keys of the sorted cache of windowed decoding: "
              f"give {key}.windowed_loss as well")
    if "split" in m:
        _need(m["split"] in ("val", "test"), f"{key}.split must be 'val' or 'test', got {m['split']!r}")
    if "passkey_depths" in m:
        d = m["passkey_depths"]
        ok = isinstance(d, list) and d and all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= 1 for x in d)
        _need(ok, f"{key}.passkey_depths must be a non-empty list of numbers in [0, 1], got {d!r}")
    return dict(m)


def load_spec(path: str | os.PathLike) -> Spec:
    """Read and check a sweep spec; raises ConfigError naming the key (the run configs
    themselves are checked by `plan`)."""
    path = Path(path)
    _need(path.is_file(), f"spec file {str(path)!r} does not exist")
    raw = read_toml(path)
    _unknown(raw, SPEC_KEYS, "")
    here = path.parent
    for key in ("title", "claim", "description", "out", "below_budget", "earlier"):
        _need(isinstance(raw.get(key, ""), str), f"{key} must be a string, got {raw.get(key)!r}")
    _need("base" in raw, "base is missing: give a run config path (relative to the spec) or a [base] table")
    base = raw["base"]
    if isinstance(base, str):
        base_path = here / base
        _need(base_path.is_file(), f"base: config file {str(base_path)!r} does not exist")
        base_raw = read_toml(base_path)
    else:
        _need(isinstance(base, dict), f"base must be a config path or a table of dotted keys, got {base!r}")
        base_raw = _nest(base, "base")
    _need("seeds" in raw, "seeds is missing: list at least one seed, e.g. seeds = [0, 1, 2]")
    seeds = _int_list(raw["seeds"], "seeds", 0)
    _need(len(seeds) >= 1, "seeds must list at least one seed, got []")
    _need(len(set(seeds)) == len(seeds), f"seeds must not repeat, got {seeds}")
    overrides = _str_list(raw.get("overrides", []), "overrides")
    _check_overrides(overrides, "overrides")
    vs = raw.get("variants")
    _need(isinstance(vs, list) and vs and all(isinstance(v, dict) for v in vs),
          "variants must be a non-empty array of tables ([[variants]] with name and overrides)")
    variants = []
    for i, v in enumerate(vs):
        _unknown(v, VARIANT_KEYS, f"variants[{i}].")
        name = v.get("name")
        _need(isinstance(name, str) and bool(NAME_RE.match(name)),
              f"variants[{i}].name must be a folder-safe name (letters, digits, _ . + -), got {name!r}")
        _need(name not in [x.name for x in variants], f"variants[{i}].name: {name!r} is a duplicate variant name")
        ov = _str_list(v.get("overrides", []), f"variants[{i}].overrides")
        _check_overrides(ov, f"variant {name!r}")
        _need(isinstance(v.get("description", ""), str), f"variants[{i}].description must be a string")
        variants.append(Variant(name, ov, v.get("description", "")))
    _need(isinstance(raw.get("per_seed", False), bool), f"per_seed must be true or false, got {raw.get('per_seed')!r}")
    metrics = _check_metrics(raw["metrics"]) if "metrics" in raw else {}
    allowed = list(SUMMARY_SCALARS) + metric_names(metrics)
    verdicts = check_rules(raw["verdict"], [v.name for v in variants], allowed) if "verdict" in raw else []
    earlier = here / raw["earlier"] if raw.get("earlier") else None
    _need(earlier is None or earlier.is_file(), f"earlier: results file {str(earlier)!r} does not exist")
    _need("answer" not in raw or verdicts, "answer chooses among the verdict rules' variants: give [[verdict]] rules with it")
    answer = check_answer(raw["answer"], [v.name for v in variants], verdicts, allowed) if "answer" in raw else None
    return Spec(
        path=path, title=raw.get("title") or path.stem, claim=raw.get("claim", ""), description=raw.get("description", ""),
        base=base, base_raw=base_raw, seeds=seeds, overrides=overrides, variants=variants,
        out=here / raw["out"] if raw.get("out") else here, per_seed=raw.get("per_seed", False), metrics=metrics,
        verdict=verdicts[0] if verdicts else None, verdicts=verdicts, answer=answer,
        below_budget=raw.get("below_budget", "").strip(), earlier=earlier, raw=raw,
    )
