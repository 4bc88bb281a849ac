"""`attnlab export RUN_DIR OUT_DIR`: a trained run as a Hugging Face model folder (needs the [hf] extra).

Everything is checked before anything is written (the run, its checkpoint, its config, OUT_DIR absent
or empty); a problem is one line `error: ...` with exit status 2. The folder is built beside OUT_DIR
and renamed into place (`attnlab.hf.export_run`)."""

from __future__ import annotations

from ._common import Formatter, UsageError

HF_EXTRA = "pip install 'attnlab[hf]'"


def add_export(sub) -> None:
    p = sub.add_parser(
        "export", help="write a trained run as a Hugging Face model folder (AutoModelForCausalLM, AutoTokenizer)",
        formatter_class=Formatter,
        description="Write the newest checkpoint of a run folder as a Hugging Face model folder: config.json,\n"
                    "model.safetensors, generation_config.json and the run's tokenizer (tokenizer.json, pad = eos).\n"
                    "After `import attnlab.hf`, AutoModelForCausalLM.from_pretrained(OUT_DIR) and\n"
                    "AutoTokenizer.from_pretrained(OUT_DIR) load it; `python -m attnlab.harness` evaluates it with\n"
                    "lm-evaluation-harness. Needs the [hf] extra.\n\n"
                    "  attnlab export runs/tiny hf\n"
                    "  python -m attnlab.harness run --model hf --model_args pretrained=hf --device cpu \\\n"
                    "      --include_path examples/lm_eval --tasks attnlab_python_mc,attnlab_python_gen",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder written by attnlab train")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the folder to write (must not exist, or be empty)")
    p.add_argument("--checkpoint", metavar="PATH", help="export this checkpoint instead of the newest")
    p.add_argument("--window", type=int, metavar="K",
                   help="default decode window of generate() for scalar/hybrid layers (the sorted scalar cache)")
    p.set_defaults(func=cmd_export)


def cmd_export(ns) -> int:
    try:
        from attnlab.hf import ExportError, export_run
    except ImportError as e:
        if (e.name or "").split(".")[0] in ("transformers", "tokenizers", "safetensors"):
            raise UsageError(f"attnlab export needs the optional package {e.name.split('.')[0]}, not installed here; "
                             f"install the [hf] extra: {HF_EXTRA}") from None
        raise
    if ns.window is not None and ns.window < 1:
        raise UsageError(f"--window must be >= 1, got {ns.window}")
    try:
        out = export_run(ns.run_dir, ns.out_dir, checkpoint=ns.checkpoint, window=ns.window)
    except ExportError as e:
        raise UsageError(str(e)) from None
    print(f"wrote {out} (load with: import attnlab.hf; AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    if not (out / "tokenizer.json").is_file():
        print("  no tokenizer: this run trained on synthetic token ids (data.source=mqar)")
    return 0
