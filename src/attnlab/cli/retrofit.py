"""`attnlab retrofit --model M --layers SPEC --attn MECHANISM [--set KEY=VALUE ...] --out OUT` (needs [hf]).

Every check that needs no weights runs first (model family and config, RoPE scaling, layer spec,
mechanism, --set fields, whether the new layers' shapes can carry the model's q/k/v/o, OUT new or
empty, no other writer of OUT, the --transfer-* and --finetune-* values): a problem is one line
`error: ...` with exit status 2, before any weights load. Then `attnlab.retrofit.pipeline.run_pipeline`
converts the model with that plan; with --transfer-steps N the new layers are trained to reproduce
the original attention outputs (`attnlab.retrofit.transfer`; resumable from OUT/transfer/), with
--finetune-steps N the new parameters are fine-tuned end to end on next-token loss
(`attnlab.retrofit.finetune`; resumable from OUT/finetune/, finetune.json in OUT), and with
--eval-contexts N the model is evaluated (eval.json in OUT); Ctrl-C saves and exits 130. The
folder is written atomically under a lock (`attnlab.retrofit.save`).

`attnlab retrofit trial SPEC.toml` runs a retrofit experiment over training seeds (variants x seeds,
each converted, transferred, fine-tuned and evaluated; resumable) and writes its report with the
spec's verdicts (`attnlab.experiments.retrofit_trial`)."""

from __future__ import annotations

from ._common import HF_EXTRA, Formatter, UsageError

# the options of a stage beside its --<stage>-steps: (name, type or choices, metavar, help); each is the
# stage config's field of that name (dashes for underscores), and None when not given: the config's default
TRANSFER_OPTIONS = (
    ("contexts", int, "M", "packed stdlib-corpus contexts captured for transfer (default: 8)"),
    ("context", int, "T", "tokens per context (default: 256)"),
    ("lr", float, "LR", "AdamW learning rate (default: 1e-3)"),
    ("heldout-contexts", int, "M", "contexts of the corpus's val split on which each layer's error is also "
                                   "reported, never trained on; 0: none (default: 2)"),
)
FINETUNE_OPTIONS = (
    ("lr", float, "LR", "peak learning rate, linear warmup then cosine decay (default: 1e-3)"),
    ("kl", float, "W", "weight of KL(original || retrofit) on the next-token distributions (default: 0)"),
    ("context", int, "T", "tokens per context (default: 256)"),
    ("batch", int, "B", "contexts per step (default: 4)"),
    ("train", ("new", "all"), None, "new: only the retrofit's new parameters (gates, scalar projections, τ, ...); "
                                    "all: every parameter (default: new)"),
    ("new-lr-scale", float, "X", "the new parameters' learning rate as X times --finetune-lr (default: 1)"),
    ("align", float, "W", "weight of L_align (scalar distance against attention weight) over the scalar/hybrid "
                          "layers (default: 0)"),
    ("lora", int, "R", "also train LoRA adapters of rank R (peft) on every layer's q/k/v/o projections, merged "
                       "into them when fine-tuning ends (default: none)"),
)


def _stage_options(group, stage: str, options) -> None:
    """--<stage>-<name> for each of `options`, None when not given."""
    for name, kind, metavar, help in options:
        typed = {"choices": list(kind)} if isinstance(kind, tuple) else {"type": kind, "metavar": metavar}
        group.add_argument(f"--{stage}-{name}", default=None, help=help, **typed)


def add_retrofit(sub) -> None:
    p = sub.add_parser(
        "retrofit", help="give a pretrained Llama/Qwen2 model attnlab attention in chosen layers, as an HF folder",
        formatter_class=Formatter,
        description="Replace the self-attention of the chosen layers of a pretrained Llama or Qwen2 model with\n"
                    "attnlab's layer for MECHANISM, reusing the model's q/k/v/o weights, GQA layout and RoPE, and\n"
                    "write the whole model as an attnlab Hugging Face folder (AutoModelForCausalLM after\n"
                    "`import attnlab.hf`). New layers start exactly at the original where the math allows\n"
                    "(docs/retrofit.md): softmax with an output gate, hybrid, goat; principled within ~1e-6.\n\n"
                    "  attnlab retrofit --model smollm2 --layers middle6 --attn hybrid --out runs/retrofit/hybrid\n"
                    "  attnlab retrofit --model smollm2 --layers all --attn softmax --set output_gate=elementwise --out OUT\n"
                    "  attnlab retrofit trial experiments/retrofit/gate/spec.toml   # an experiment: variants x seeds, report",
    )
    p.add_argument("trial", nargs="*", metavar="trial SPEC.toml",
                   help="run the retrofit experiment SPEC.toml (variants x seeds, resumable) and write its report")
    p.add_argument("--report-only", action="store_true", help="with trial: rebuild the report from finished runs")
    p.add_argument("--no-progress", action="store_true", help="with trial: no progress bars")
    p.add_argument("--no-reuse", action="store_true",
                   help="with trial: run every run here, even one a trial in a folder beside it finished for the "
                        "same settings and seed (by default that run's result is copied, its source named)")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="with trial: run N (variant, seed) runs at once, each in its own process with 1/N of the "
                        "threads (default: 1)")
    p.add_argument("--model", default="smollm2", metavar="M",
                   help="smollm2 (SmolLM2-135M from its PyPI GGUF), a model folder, or a .gguf file (default: smollm2)")
    p.add_argument("--layers", default="middle6", metavar="SPEC",
                   help="middle6 | middle<N> | all | reserved-edge | comma list of indices (default: middle6)")
    p.add_argument("--attn", metavar="MECHANISM", help="the attnlab mechanism of the chosen layers")
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                   help="an AttentionConfig field of the new layers, e.g. output_gate=elementwise (repeatable)")
    p.add_argument("--out", metavar="OUT", help="the folder to write (must not exist, or be empty)")
    p.add_argument("--seed", type=int, default=0, help="seed of the new parameters' random init (default: 0)")
    p.add_argument("--device", default="auto", metavar="D",
                   help="auto (CUDA when available), cpu or cuda: where the models run (also for trial)")
    p.add_argument("--dtype", default="float32", metavar="T",
                   help="float32 or bfloat16: the original model's weights (the retrofitted model trains in "
                        "float32; also for trial)")
    t = p.add_argument_group("attention transfer (docs/retrofit.md#attention-transfer)")
    t.add_argument("--transfer-steps", type=int, default=0, metavar="N",
                   help="train each new layer N AdamW steps to reproduce the original attention output (MSE); "
                        "0: none (default: 0). Resumes from OUT/transfer/ after an interruption")
    _stage_options(t, "transfer", TRANSFER_OPTIONS)
    f = p.add_argument_group("fine-tuning (docs/retrofit.md#fine-tuning)")
    f.add_argument("--finetune-steps", type=int, default=0, metavar="N",
                   help="fine-tune N AdamW steps on next-token loss over the stdlib corpus, after transfer; 0: none "
                        "(default: 0). Resumes from OUT/finetune/ after an interruption")
    _stage_options(f, "finetune", FINETUNE_OPTIONS)
    e = p.add_argument_group("evaluation (eval.json in OUT)")
    e.add_argument("--eval-contexts", type=int, default=0, metavar="N",
                   help="held-out contexts (stdlib test split) for the perplexity of the retrofitted and the original "
                        "model and the per-layer first-token share, sink share, ground-state mass and gate values; "
                        "0: no evaluation (default: 0)")
    e.add_argument("--eval-context", type=int, default=None, metavar="T", help="tokens per context (default: 256)")
    p.set_defaults(func=cmd_retrofit)


def cmd_retrofit(ns) -> int:
    if ns.trial:
        return cmd_trial(ns)
    for flag in ("attn", "out"):
        if getattr(ns, flag) is None:
            raise UsageError(f"attnlab retrofit: --{flag} is required (or: attnlab retrofit trial SPEC.toml)")
    if ns.report_only or ns.no_progress or ns.no_reuse or ns.jobs != 1:
        raise UsageError("--report-only, --no-progress, --no-reuse and --jobs belong to "
                         "`attnlab retrofit trial SPEC.toml`")
    try:
        import attnlab.hf  # noqa: F401
        from attnlab.retrofit import RetrofitError, check_out, load_source, parse_settings, plan_source, save
        from attnlab.retrofit.io import resolve_device, resolve_dtype
    except ImportError as e:
        if (e.name or "").split(".")[0] in ("transformers", "tokenizers", "safetensors", "gguf"):
            raise UsageError(f"attnlab retrofit needs the optional package {e.name.split('.')[0]}, not installed here; "
                             f"install the [hf] extra: {HF_EXTRA}") from None
        raise
    from attnlab.lock import FolderLock, check_free
    from attnlab.retrofit.evaluate import EvalConfig
    from attnlab.retrofit.finetune import FinetuneConfig, check_trainable
    from attnlab.retrofit.pipeline import run_pipeline
    from attnlab.retrofit.transfer import TransferConfig

    try:
        settings = parse_settings(ns.settings)
        device, dtype = resolve_device(ns.device), resolve_dtype(ns.dtype)
        tcfg = _transfer_config(ns, TransferConfig)
        fcfg = _finetune_config(ns, FinetuneConfig)
        ecfg = _eval_config(ns, EvalConfig)
        check_out(ns.out, resume=tcfg.steps > 0 or fcfg.steps > 0)
        source, plan = plan_source(ns.model, ns.layers, ns.attn, settings)
        tcfg.check(plan.model.max_seq_len or None)
        fcfg.check(plan.model.max_seq_len or None)
        if ecfg is not None:
            ecfg.check(plan.model.max_seq_len or None)
        if fcfg.steps > 0:
            check_trainable(plan, fcfg.train, fcfg.lora, fcfg.align)
    except RetrofitError as e:
        raise UsageError(str(e)) from None
    check_free(ns.out, beside=True)  # FolderBusy (exit 2) before any weights load
    model, tok = load_source(source, device, dtype)
    with FolderLock(ns.out, beside=True):
        try:
            retro = run_pipeline(model, plan, ns.out, seed=ns.seed, transfer=tcfg, finetune=fcfg, evaluate=ecfg,
                                 tokenizer=tok, log=print).model
        except RetrofitError as e:
            raise UsageError(str(e)) from None
        out = save(retro, ns.out, tok)
    print(f"wrote {out}: layers {plan.layers} of {plan.model.n_layers} now {ns.attn!r} "
          f"(load with: import attnlab.hf; AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return 0


def _eval_config(ns, EvalConfig):
    """The EvalConfig of --eval-contexts / --eval-context (None: no evaluation)."""
    from attnlab.retrofit import RetrofitError

    if ns.eval_contexts == 0:
        if ns.eval_context is not None:
            raise RetrofitError("--eval-context given without --eval-contexts N (N > 0): no evaluation would run")
        return None
    given = {"context": ns.eval_context} if ns.eval_context is not None else {}
    cfg = EvalConfig(contexts=ns.eval_contexts, **given)
    cfg.analysis_contexts = min(cfg.analysis_contexts, max(cfg.contexts, 1))
    return cfg.check()


def _stage_config(ns, stage: str, options, Config, what: str):
    """The Config of --<stage>-steps and the --<stage>-* options given, and which were given
    (RetrofitError for a --<stage>-* option given without --<stage>-steps)."""
    from attnlab.retrofit import RetrofitError

    given = {name.replace("-", "_"): getattr(ns, f"{stage}_{name.replace('-', '_')}") for name, *_ in options}
    given = {k: v for k, v in given.items() if v is not None}
    steps = getattr(ns, f"{stage}_steps")
    if steps == 0 and given:
        flags = ", ".join(f"--{stage}-{k.replace('_', '-')}" for k in given)
        raise RetrofitError(f"{flags} given without --{stage}-steps N (N > 0): no {what} would run")
    return Config(steps=steps, **given), given


def _transfer_config(ns, TransferConfig):
    """The TransferConfig of the --transfer-* options (RetrofitError for a bad value, or for a
    --transfer-* option given without --transfer-steps)."""
    return _stage_config(ns, "transfer", TRANSFER_OPTIONS, TransferConfig, "transfer")[0].check()


def _finetune_config(ns, FinetuneConfig):
    """The FinetuneConfig of the --finetune-* options (RetrofitError for a bad value, or for a
    --finetune-* option given without --finetune-steps)."""
    cfg, given = _stage_config(ns, "finetune", FINETUNE_OPTIONS, FinetuneConfig, "fine-tuning")
    if "batch" in given and cfg.batch > cfg.contexts:  # the pool of contexts grows with the batch
        cfg.contexts = cfg.batch
    return cfg.check()


def cmd_trial(ns) -> int:
    """`attnlab retrofit trial SPEC.toml`: every other retrofit option is refused (the spec holds them)."""
    from pathlib import Path

    if len(ns.trial) != 2 or ns.trial[0] != "trial":
        raise UsageError(f"expected `attnlab retrofit trial SPEC.toml`, got positional arguments {ns.trial}")
    defaults = {"model": "smollm2", "layers": "middle6", "attn": None, "settings": [], "out": None, "seed": 0,
                "transfer_steps": 0, "finetune_steps": 0, "eval_contexts": 0}
    given = [k for k, v in vars(ns).items()
             if (k in defaults and v != defaults[k]) or (k.split("_")[0] in ("transfer", "finetune", "eval")
                                                         and k not in defaults and v is not None)]
    if given:
        raise UsageError(f"attnlab retrofit trial takes its settings from the spec; remove "
                         f"{', '.join('--' + k.replace('_', '-') for k in sorted(given))}")
    try:
        from attnlab.experiments.retrofit_trial import load_trial, run_trial
    except ImportError as e:
        raise UsageError(f"attnlab retrofit trial needs the optional package {e.name}; install the [hf] extra: "
                         f"{HF_EXTRA}") from None
    if ns.jobs < 1:
        raise UsageError(f"--jobs must be an int >= 1, got {ns.jobs}")
    if not Path(ns.trial[1]).is_file():
        raise UsageError(f"spec file {ns.trial[1]!r} does not exist")
    from attnlab.retrofit.convert import RetrofitError
    from attnlab.retrofit.io import resolve_device, resolve_dtype

    try:
        device, dtype = resolve_device(ns.device), resolve_dtype(ns.dtype)
    except RetrofitError as e:
        raise UsageError(str(e)) from None
    trial = load_trial(ns.trial[1])  # ConfigError names the key; every variant's plan checked
    res = run_trial(trial, progress=not ns.no_progress, report_only=ns.report_only, jobs=ns.jobs, device=device,
                    dtype=dtype, reuse=not ns.no_reuse)
    for v in res["verdicts"]:
        print(f"{v['name'] or v['metric']}: {v['outcome']}")
    print(f"wrote {trial.out}/results.json, report.md")
    return 0
