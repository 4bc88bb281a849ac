"""`attnlab export RUN_DIR OUT_DIR`: a trained run as a Hugging Face model folder (needs the [hf] extra).

Everything is checked before anything is written (the run, its checkpoint, its config, OUT_DIR absent
or empty); a problem is one line `error: ...` with exit status 2. The folder is built beside OUT_DIR
and renamed into place (`attnlab.hf.export_run`)."""

from __future__ import annotations

from ._common import HF_EXTRA, Formatter, UsageError


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
    p.add_argument("--push-to-hub", metavar="REPO",
                   help="then upload OUT_DIR to the Hugging Face Hub repository REPO (user/name; created if absent; "
                        "the token from `huggingface-cli login` or HF_TOKEN)")
    p.add_argument("--private", action="store_true", help="with --push-to-hub: create the repository private")
    p.set_defaults(func=cmd_export)


def push_to_hub(folder, repo: str, private: bool = False) -> str:
    """Upload an exported folder to the Hub repository `repo` (created if absent) with huggingface_hub;
    returns the commit's URL."""
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id=repo, repo_type="model", private=private, exist_ok=True)
    info = api.upload_folder(repo_id=repo, repo_type="model", folder_path=str(folder),
                             commit_message="Upload an attnlab model (attnlab export)")
    return str(getattr(info, "commit_url", info))


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
    if ns.push_to_hub is not None and (ns.push_to_hub.count("/") != 1 or not all(ns.push_to_hub.split("/"))):
        raise UsageError(f"--push-to-hub must name a repository as user/name, got {ns.push_to_hub!r}")
    if ns.private and ns.push_to_hub is None:
        raise UsageError("--private applies to --push-to-hub: give the repository too")
    try:
        out = export_run(ns.run_dir, ns.out_dir, checkpoint=ns.checkpoint, window=ns.window)
    except ExportError as e:
        raise UsageError(str(e)) from None
    print(f"wrote {out} (load with: import attnlab.hf; AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    if not (out / "tokenizer.json").is_file():
        print("  no tokenizer: this run trained on synthetic token ids (data.source=mqar)")
    if ns.push_to_hub is not None:
        print(f"pushed to {push_to_hub(out, ns.push_to_hub, ns.private)}")
    return 0
