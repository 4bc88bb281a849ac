"""Loading a model to retrofit by spec, `--set` values, and writing the result as an HF folder.

Loading goes through attnlab.search.hf_model (sources, config, tokenizer, weights); the errors
here name `--model` and are RetrofitError.

    OUT/  config.json  model.safetensors  generation_config.json  (tokenizer files)  retrofit.json

The folder is built in a hidden temporary sibling, loaded back and checked (same logits within
1e-6 relative), and renamed into place, under `FolderLock(out, beside=True)`
(attnlab.hf.export.write_folder): a failure leaves no OUT behind, and a second writer of the same
OUT gets FolderBusy before any work.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .convert import Plan, RetrofitError, convert, plan
from .finetune import FINETUNE_DIR
from .transfer import TRANSFER_DIR

RESUMABLE = (TRANSFER_DIR, FINETUNE_DIR)  # checkpoint folders a rerun continues from


def parse_settings(items: list[str] | dict | None) -> dict:
    """`KEY=VALUE` words (values as TOML literals, bare words as strings, none/null as None) -> dict."""
    from attnlab.layers.config import option_keys
    from attnlab.train.overrides import parse_value

    if isinstance(items, dict) or items is None:
        return dict(items or {})
    fields = set(option_keys())
    out = {}
    for item in items:
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise RetrofitError(f"--set {item!r} must look like KEY=VALUE (e.g. output_gate=elementwise)")
        if key not in fields:
            raise RetrofitError(f"--set {key}: unknown AttentionConfig field; known: {', '.join(sorted(fields))}")
        value = parse_value(text)
        out[key] = None if isinstance(value, str) and value.lower() in ("none", "null") else value
    return out


def _source(spec: str):
    from attnlab.search.hf_model import resolve_source

    try:
        return resolve_source(spec, hub=False, what="--model")
    except ValueError as e:
        raise RetrofitError(str(e)) from None


def plan_source(spec: str, layers, mechanism: str, settings: dict | None = None):
    """(source, Plan) of a model spec, from its config alone: no weights are read."""
    from attnlab.search.hf_model import load_hf_config

    source = _source(spec)
    try:
        config = load_hf_config(source, use=None)  # plan() checks the family, as RetrofitError
    except (OSError, ValueError) as e:
        raise RetrofitError(f"--model {spec!r}: no readable model config ({str(e).splitlines()[0]})") from None
    return source, plan(config, layers, mechanism, settings)


def load_source(source, device=None, dtype: torch.dtype = torch.float32):
    """(hf model in eval mode, tokenizer or None) of a resolved ModelSource; device: where the model
    goes (None: the CPU); dtype: its weights' (float32 by default; the retrofitted model built from it
    is float32 whatever this is)."""
    from attnlab.search.hf_model import load_model, load_tokenizer

    return load_model(source, dtype, device, frozen=False), load_tokenizer(source, optional=True)


def resolve_device(name: str | None) -> torch.device:
    """--device: 'auto' (CUDA when available, else the CPU), 'cpu' or 'cuda' (RetrofitError without
    CUDA), as the loader resolves it (`search.hf_model.resolve_device`)."""
    from attnlab.search.hf_model import resolve_device as resolve

    try:
        return resolve("auto" if name is None else name)
    except ValueError as e:
        raise RetrofitError(f"--{e}") from None


def resolve_dtype(name: str | None) -> torch.dtype:
    """--dtype: the original model's weights, 'float32' (default) or 'bfloat16'."""
    from attnlab.search.hf_model import resolve_dtype as resolve

    try:
        return resolve("float32" if name is None else name)
    except ValueError as e:
        raise RetrofitError(f"--{e}") from None


def tokenizer_encoding(tok):
    """(encode: text -> token ids, eos id) of a tokenizer, or (None, None) for none (then transfer's
    text_encoding falls back to search.hf_model.byte_encode and the model config's EOS)."""
    from attnlab.search.hf_model import hf_encode

    if tok is None:
        return None, None
    return hf_encode(tok), tok.eos_token_id


def retrofit(model, layers="middle6", attn: str = "softmax", settings=None, seed: int = 0):
    """The retrofitted model (an AttnlabForCausalLM). model: a transformers LlamaForCausalLM /
    Qwen2ForCausalLM, or a spec: 'smollm2', a folder, a .gguf file. Everything that can be checked
    without weights is checked first (RetrofitError).

    layers: the layers that get `attn` ('middle<N>', 'all', '3,4,5' or a list of ints); every other
    layer becomes attnlab's softmax layer, equal to the model's own. attn: a registered mechanism
    name. settings: AttentionConfig overrides for the chosen layers, a dict or `KEY=VALUE` words
    (`parse_settings`); they win over the exact-start values. seed: the initialisation of the new
    parameters that have no exact start. Raises RetrofitError naming what is wrong (family, RoPE
    scaling, layer spec, mechanism, a setting, shapes that cannot carry the model's weights)."""
    settings = parse_settings(settings)
    if isinstance(model, str):
        source, _ = plan_source(model, layers, attn, settings)
        model, _ = load_source(source)
    return convert(model, layers, attn, settings, seed)


def check_out(out: str | os.PathLike, resume: bool = False) -> Path:
    """`out` as a Path, RetrofitError unless it is new or empty (with resume=True it may also hold the
    `transfer/` and `finetune/` checkpoints of an interrupted transfer or fine-tuning, which the run
    continues)."""
    from attnlab.hf.export import check_out_dir

    out = Path(out)
    hint = "" if resume or not any((out / d).is_dir() for d in RESUMABLE) else \
        "; it holds an interrupted transfer or fine-tuning: rerun with the same --transfer-*/--finetune-* options"
    return check_out_dir(out, "--out", RetrofitError, RESUMABLE if resume else (), hint)


def _summary(p: Plan) -> dict:
    return {"family": p.family, "layers": p.layers, "mechanism": p.mechanism, "settings": p.settings}


def save(model, out: str | os.PathLike, tokenizer=None, rtol: float = 1e-6) -> Path:
    """Write retrofitted `model` (with `tokenizer`) into the new or empty folder `out`, atomically.
    A model that went through `transfer` / `finetune` / `evaluate_retrofit` also gets transfer.json /
    finetune.json / eval.json (their reports); their checkpoints in OUT/transfer/ and OUT/finetune/
    are removed once the folder is in place.

    The folder is written beside `out`, loaded back as AttnlabForCausalLM and compared on 16 random
    tokens, then renamed into place (attnlab.hf.export.write_folder); returns `out` as a Path. Raises
    RetrofitError when `out` is a file or not empty, FolderBusy when another process writes it,
    RuntimeError (nothing written) when the reloaded logits differ by more than `rtol` relative."""
    from attnlab.hf.export import check_reload, write_folder

    resume = any(getattr(model, f"{d}_report", None) is not None for d in RESUMABLE)  # OUT may hold checkpoints
    out = check_out(out, resume)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        plan_ = getattr(model, "retrofit_plan", None)
        if plan_ is not None:
            (tmp / "retrofit.json").write_text(json.dumps(_summary(plan_), indent=2) + "\n")
        for d in (*RESUMABLE, "eval"):
            report = getattr(model, f"{d}_report", None)
            if report is not None:
                (tmp / f"{d}.json").write_text(json.dumps(report, indent=2) + "\n")

    def verify(tmp: Path) -> None:
        idx = torch.randint(model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():  # the ids on the model's device (drawn on the CPU, so every device checks the same ids)
            want = model(idx.to(next(model.parameters()).device)).logits
        check_reload(tmp, idx, want, rtol, "the retrofitted model")

    return write_folder(out, write, verify, recheck=lambda o: check_out(o, resume), keep=RESUMABLE)
