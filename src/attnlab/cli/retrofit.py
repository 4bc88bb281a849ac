"""`attnlab retrofit --model M --layers SPEC --attn MECHANISM [--set KEY=VALUE ...] --out OUT` (needs [hf]).

Every check that needs no weights runs first (model family and config, RoPE scaling, layer spec,
mechanism, --set fields, whether the new layers' shapes can carry the model's q/k/v/o, OUT new or
empty, no other writer of OUT): a problem is one line `error: ...` with exit status 2, before any
weights load. The folder is written atomically under a lock (`attnlab.retrofit.save`)."""

from __future__ import annotations

from ._common import Formatter, UsageError

HF_EXTRA = "pip install 'attnlab[hf]'"


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
                    "  attnlab retrofit --model smollm2 --layers all --attn softmax --set output_gate=elementwise --out OUT",
    )
    p.add_argument("--model", default="smollm2", metavar="M",
                   help="smollm2 (SmolLM2-135M from its PyPI GGUF), a model folder, or a .gguf file (default: smollm2)")
    p.add_argument("--layers", default="middle6", metavar="SPEC",
                   help="middle6 | middle<N> | all | reserved-edge | comma list of indices (default: middle6)")
    p.add_argument("--attn", required=True, metavar="MECHANISM", help="the attnlab mechanism of the chosen layers")
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                   help="an AttentionConfig field of the new layers, e.g. output_gate=elementwise (repeatable)")
    p.add_argument("--out", required=True, metavar="OUT", help="the folder to write (must not exist, or be empty)")
    p.add_argument("--seed", type=int, default=0, help="seed of the new parameters' random init (default: 0)")
    p.set_defaults(func=cmd_retrofit)


def cmd_retrofit(ns) -> int:
    try:
        import attnlab.hf  # noqa: F401
        from attnlab.retrofit import RetrofitError, check_out, convert, load_source, parse_settings, plan_source, save
    except ImportError as e:
        if (e.name or "").split(".")[0] in ("transformers", "tokenizers", "safetensors", "gguf"):
            raise UsageError(f"attnlab retrofit needs the optional package {e.name.split('.')[0]}, not installed here; "
                             f"install the [hf] extra: {HF_EXTRA}") from None
        raise
    from attnlab.lock import check_free

    try:
        settings = parse_settings(ns.settings)
        check_out(ns.out)
        source, plan = plan_source(ns.model, ns.layers, ns.attn, settings)
    except RetrofitError as e:
        raise UsageError(str(e)) from None
    check_free(ns.out, beside=True)  # FolderBusy (exit 2) before any weights load
    model, tok = load_source(source)
    out = save(convert(model, plan.layers, ns.attn, settings, ns.seed), ns.out, tok)
    print(f"wrote {out}: layers {plan.layers} of {plan.model.n_layers} now {ns.attn!r} "
          f"(load with: import attnlab.hf; AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return 0
