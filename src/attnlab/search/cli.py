"""`attnlab search train | eval`: argparse subcommands (registered by the main CLI).

Option values become a SearchTrainConfig / EvalConfig here, at the edge: a value the config rejects,
or a float option that is NaN or ±inf, is a ConfigError naming the option (one line, exit 2
through `attnlab.cli.main`), before any model is loaded or file written.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import fields

from attnlab.layers.typed_fields import field_problem
from attnlab.models.config import ConfigError

from . import tasks
from .retrieval import METHODS
from .sweep import DEFAULT_KS, DEFAULT_LAYER_SETS, EvalConfig
from .train import SearchTrainConfig


def _csv(kind):
    def parse(text: str):
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}, got {text!r}")

    return parse


def _groups(text: str) -> int | str:
    if text == "kv":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int or 'kv', got {text!r}")


def _layer_sets(text: str) -> list[str]:
    """';'-separated layer sets, each a name or a comma list: 'middle6;all;3,4,5'."""
    return [s.strip() for s in text.split(";") if s.strip()]


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def _build(cls, args, command: str):
    """`cls` from the parsed options; errors name the option (`--tau`), what it got and needs."""
    names = {f.name for f in fields(cls)}
    try:
        cfg = cls(**{k: v for k, v in vars(args).items() if k in names and v is not None})
    except (ValueError, TypeError) as e:
        text = re.sub(r"^(\w+)", lambda m: _option(m.group(1)) if m.group(1) in names else m.group(1), str(e))
        raise ConfigError(f"attnlab search {command}: {text}") from None
    found = field_problem(cfg)  # NaN / inf floats and wrongly typed values the config itself lets through
    if found:
        path, got, need = found
        raise ConfigError(f"attnlab search {command}: {_option(path)} must be {need}, got {got!r}")
    return cfg


def train_config(args) -> SearchTrainConfig:
    return _build(SearchTrainConfig, args, "train")


def eval_config(args) -> EvalConfig:
    return _build(EvalConfig, args, "eval")


def _train(args) -> int:
    from .train import train_projections

    print(json.dumps(train_projections(train_config(args)), indent=2))
    return 0


def _eval(args) -> int:
    from .report import results_markdown
    from .sweep import run_eval

    cfg = eval_config(args)
    print(results_markdown(run_eval(cfg)))
    print(f"wrote {cfg.out}/results.json, results.md, gap_vs_k.png")
    return 0


def _trial(args) -> int:
    from .trial import load_trial, run_trial

    trial = load_trial(args.spec)  # every run's configs checked before any work
    res = run_trial(trial, report_only=args.report_only, launch=getattr(args, "launch", None))
    for v in res["verdicts"]:
        print(f"{v.get('name') or v['metric']}: {v['outcome']} ({v['reason']})")
    print(f"wrote {trial.out}/results.json, report.md")
    return 0


def tasks_config(args) -> tasks.TaskConfig:
    return _build(tasks.TaskConfig, args, "tasks")


def _tasks(args) -> int:
    """Validate the options, then everything checkable without weights (model config, layers,
    checkpoint, lengths, the out folder), each failure a one-line error naming the option; then run."""
    cfg = tasks_config(args)
    try:
        plan = tasks.plan_tasks(cfg)
    except ValueError as e:
        names = {f.name for f in fields(tasks.TaskConfig)}
        text = re.sub(r"^(\w+)", lambda m: _option(m.group(1)) if m.group(1) in names else m.group(1), str(e))
        raise ConfigError(f"attnlab search tasks: {text}") from None
    print(tasks.tasks_markdown(tasks.run_tasks(cfg, plan=plan)))
    print(f"wrote {cfg.out}/results.json, results.md")
    return 0


def add_search_commands(subparsers, trial_options=None) -> argparse.ArgumentParser:
    """Register `search` with `train` and `eval` under an argparse subparsers object. Each leaf
    parser sets `func`; the caller runs `args.func(args)` (returns an exit code). `trial_options(parser)`
    adds options to `search trial` (the main CLI's --launcher options); the caller then sets
    `args.launch(work, folder)` for `run_trial`."""
    search = subparsers.add_parser("search", help="learned search projections on a frozen pretrained LM")
    sub = search.add_subparsers(dest="search_command", required=True)
    d = SearchTrainConfig()

    t = sub.add_parser("train", help="train W_Qs/W_Ks per layer by InfoNCE + KL distillation (resumes)")
    t.add_argument("--model", default=d.model, help="'smollm2' (embedded GGUF), a hub id, a folder or a .gguf file")
    t.add_argument("--layers", default=d.layers, help="middle6 | all | reserved-edge | comma list of indices")
    t.add_argument("--d-search", dest="d_search", type=int, default=d.d_search)
    t.add_argument("--groups", type=_groups, default=d.groups,
                   help="candidate sets per token: 1 (shared by all heads), 'kv' (one per KV head) or a divisor of the heads")
    t.add_argument("--tau", type=float, default=d.tau, help="temperature of the search similarity")
    t.add_argument("--rope", action=argparse.BooleanOptionalAction, default=d.rope,
                   help="rotate search vectors by position (search RoPE); --no-rope: the plain h W form")
    t.add_argument("--rope-theta", dest="rope_theta", type=float, default=d.rope_theta)
    t.add_argument("--k-pos", dest="k_pos", type=int, default=d.k_pos, help="teacher top-K positives for InfoNCE")
    t.add_argument("--alpha", type=float, default=d.alpha, help="weight of L_NCE")
    t.add_argument("--beta", type=float, default=d.beta, help="weight of L_KL")
    t.add_argument("--corpus", default=d.corpus, help="stdlib | tinystories | wikitext103 | hf:<path> | file/folder")
    t.add_argument("--split", default=d.split)
    t.add_argument("--context", type=int, default=d.context)
    t.add_argument("--n-contexts", dest="n_contexts", type=int, default=d.n_contexts)
    t.add_argument("--steps", type=int, default=d.steps)
    t.add_argument("--lr", type=float, default=d.lr)
    t.add_argument("--query-rows", dest="query_rows", type=int, default=d.query_rows,
                   help="query positions scored per step, drawn uniformly (0: all); cuts the T x T teacher to rows x T")
    t.add_argument("--activations", choices=("disk", "memory", "none"), default=d.activations,
                   help="where captured activations are kept between epochs")
    t.add_argument("--checkpoint-every", dest="checkpoint_every", type=int, default=d.checkpoint_every)
    t.add_argument("--out", default=d.out)
    t.add_argument("--seed", type=int, default=d.seed)
    t.add_argument("--no-resume", dest="resume", action="store_false", help="start over even if a checkpoint exists")
    t.set_defaults(func=_train)

    e = sub.add_parser("eval", help="PPL gap, Recall@K, Mass@K vs full attention: methods x K x layer sets")
    e.add_argument("--checkpoint", default=None, help="projections.safetensors from `search train`")
    e.add_argument("--model", default=None, help="default: the checkpoint's model")
    e.add_argument("--layer-sets", dest="layer_sets", type=_layer_sets, default=list(DEFAULT_LAYER_SETS),
                   help="';'-separated, e.g. 'middle6;all;reserved-edge' or '12,13;all'")
    e.add_argument("--groups", type=_groups, default=None,
                   help="candidate sets per token for every method (default: the checkpoint's, else 1)")
    e.add_argument("--ks", type=_csv(int), default=list(DEFAULT_KS), help="comma list, e.g. 16,32,64,128,256")
    e.add_argument("--methods", type=_csv(str), default=list(METHODS), help=f"comma list from {','.join(METHODS)}")
    e.add_argument("--corpus", default="stdlib")
    e.add_argument("--split", default="test")
    e.add_argument("--context", type=int, default=2048)
    e.add_argument("--n-contexts", dest="n_contexts", type=int, default=4)
    e.add_argument("--hnsw-ef-search", dest="hnsw_ef_search", type=int, default=512)
    e.add_argument("--ivf-nlist", dest="ivf_nlist", type=int, default=256, help="learned-ivf: lists per index")
    e.add_argument("--ivf-nprobe", dest="ivf_nprobe", type=int, default=16, help="learned-ivf: lists a query scores")
    e.add_argument("--wide-layers", dest="wide_layers", default=None,
                   help="a layer set whose substituted layers search --wide-factor x K keys (e.g. '0,1,2,29')")
    e.add_argument("--wide-factor", dest="wide_factor", type=int, default=1)
    e.add_argument("--out", default="runs/search-eval")
    e.add_argument("--seed", type=int, default=0)
    e.set_defaults(func=_eval)

    k = sub.add_parser("tasks", help="passkey / needle-in-a-haystack accuracy: methods x K x length x depth (resumes)")
    k.add_argument("--checkpoint", default=None, help="projections.safetensors (needed by the learned methods)")
    k.add_argument("--model", default=None, help="default: the checkpoint's model")
    k.add_argument("--tasks", type=_csv(str), default=None, help=f"comma list from {','.join(tasks.TASKS)}")
    k.add_argument("--lengths", type=_csv(int), default=None,
                   help=f"context lengths in tokens (default {','.join(map(str, tasks.DEFAULT_LENGTHS))})")
    k.add_argument("--depths", type=_csv(float), default=None,
                   help=f"needle depths in [0, 1] (default {','.join(map(str, tasks.DEFAULT_DEPTHS))})")
    k.add_argument("--methods", type=_csv(str), default=None,
                   help=f"comma list from {','.join(tasks.TASK_METHODS)} (default {','.join(tasks.DEFAULT_METHODS)})")
    k.add_argument("--ks", type=_csv(int), default=None,
                   help=f"budgets K (default {','.join(map(str, tasks.DEFAULT_KS))})")
    k.add_argument("--layer-set", dest="layer_set", default=None,
                   help="substituted layers: middle6 | all | reserved-edge | comma list (default middle6)")
    k.add_argument("--groups", type=_groups, default=None,
                   help="candidate sets per token for every method (default: the checkpoint's, else 1)")
    k.add_argument("--n-examples", dest="n_examples", type=int, default=None,
                   help="examples per cell (default 4)")
    k.add_argument("--corpus", default=None, help="held-out text for the needle task (default stdlib)")
    k.add_argument("--split", default=None, help="(default test)")
    k.add_argument("--hnsw-ef-search", dest="hnsw_ef_search", type=int, default=None)
    k.add_argument("--ivf-nlist", dest="ivf_nlist", type=int, default=None, help="learned-ivf: lists (default 256)")
    k.add_argument("--ivf-nprobe", dest="ivf_nprobe", type=int, default=None, help="learned-ivf: lists probed (default 16)")
    k.add_argument("--prefill", choices=tasks.PREFILLS, default=None,
                   help="selected: every position through the method (default); full: the haystack read exactly, "
                        "the question and answer through the method (a decoder's protocol; one prefill per example)")
    k.add_argument("--seed", type=int, default=None)
    k.add_argument("--out", default=None, help="(default runs/search-tasks)")
    k.set_defaults(func=_tasks)

    r = sub.add_parser("trial", help="a learned-search experiment over training seeds: train, evaluate, report, verdict")
    r.add_argument("spec", metavar="SPEC.toml", help="the trial spec (format in attnlab.search.trial)")
    r.add_argument("--report-only", action="store_true", help="rebuild results.json and report.md from finished runs")
    if trial_options is not None:
        trial_options(r)
    r.set_defaults(func=_trial)
    return search
