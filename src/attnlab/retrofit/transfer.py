"""Attention transfer: train each new attention layer to reproduce the original layer's output.

For a mechanism with no exact start (scalar, cosFormer, GLA, SSD) the converted layer holds the
model's q/k/v/o weights but computes something else. Transfer fits it back, layer by layer:

1. the original HF model runs once over `contexts` packed contexts of `context` tokens of a corpus
   (`contexts`: attnlab.data.packing.pack_corpus, stdlib by default; the packed stream is read as
   one causal sequence, positions 0..T-1); for every replaced layer i a hook keeps the input of its
   self-attention x_i (the normed hidden state, on the original residual stream) and its output y_i;
2. for each replaced layer in turn, every parameter of the new layer `blocks[i].attn` (and nothing
   else) is trained with AdamW (no weight decay, constant lr) on MSE(attn(x_i), y_i), full batch,
   `steps` steps;
3. the relative error  mean((attn(x) − y)²) / mean(y²)  is reported before and after, on the
   training contexts and on `heldout_contexts` contexts of the corpus's val split that transfer never
   trains on (captured the same way; `heldout_before` / `heldout_after`): a layer that fits its
   training contexts but not these has memorised them.

Resumable (the loop of loop.py, which fine-tuning shares): `OUT/transfer/layer<i>.safetensors`
holds the layer's parameters, the optimizer state, the step and the error before, written atomically
every `checkpoint_every` steps, at the end of a layer and when SIGINT/SIGTERM stops the loop
(attnlab.interrupt: the step finishes, the state is saved, Interrupted says where). A rerun with the
same options continues from there and ends with exactly the parameters of one uninterrupted run;
other options are refused (RetrofitError).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from attnlab.interrupt import Interrupted, graceful, requested
from attnlab.lock import FolderLock

from .convert import RetrofitError
from .loop import resume, train_steps

TRANSFER_DIR = "transfer"


@dataclass
class TransferConfig:
    """Options of attention transfer (`--transfer-*`): `steps` optimizer steps per layer at `lr` on
    `contexts` captured contexts of `context` tokens from corpus/split (drawn with `seed`), each new
    layer trained alone to reproduce the replaced layer's output (MSE), its error also reported on
    `heldout_contexts` contexts of the val split (0: none); checkpoints every checkpoint_every steps.
    `check()` raises RetrofitError naming the option."""

    steps: int = 0
    contexts: int = 8
    context: int = 256
    lr: float = 1e-3
    corpus: str = "stdlib"
    split: str = "train"
    seed: int = 0
    checkpoint_every: int = 50
    heldout_contexts: int = 2

    def check(self, max_positions: int | None = None) -> "TransferConfig":
        """RetrofitError naming the option, for a value that cannot work."""
        for name, flag, low in (("steps", "--transfer-steps", 0), ("contexts", "--transfer-contexts", 1),
                                ("context", "--transfer-context", 2), ("checkpoint_every", "checkpoint_every", 1),
                                ("heldout_contexts", "--transfer-heldout-contexts", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise RetrofitError(f"{flag} must be an integer >= {low}, got {v!r}")
        lr = self.lr
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
            raise RetrofitError(f"--transfer-lr must be a finite number > 0, got {lr!r}")
        if max_positions and self.context > max_positions:
            raise RetrofitError(f"--transfer-context {self.context} exceeds the model's max_position_embeddings "
                                f"{max_positions}")
        return self


def byte_encode(vocab_size: int):
    """A tokenizer-free encoding (UTF-8 bytes folded into ids 3..vocab-1) for models without a tokenizer:
    attnlab.search.hf_model.byte_encode."""
    from attnlab.search.hf_model import byte_encode as encode

    return encode(vocab_size)


def text_encoding(config, encode=None, eos_id: int | None = None):
    """(encode, eos_id): those given, else byte_encode and the EOS id of the model `config`."""
    if encode is None:
        encode = byte_encode(config.vocab_size)
    if eos_id is None:
        eos = getattr(config, "eos_token_id", None)
        eos_id = int((eos[0] if isinstance(eos, (list, tuple)) else eos) or 0)
    return encode, eos_id


def contexts(corpus: str, split: str, context: int, n: int, seed: int, encode, eos_id: int, flags: str):
    """`n` packed contexts of `context` tokens of corpus/split, documents shuffled by `seed`
    (attnlab.data.packing.pack_corpus, a Packed): what transfer, fine-tuning and evaluation read.
    RetrofitError starting with `flags` (the options that ask for them) when they cannot be had."""
    from attnlab.data.packing import pack_corpus

    try:
        return pack_corpus(corpus, split, encode, eos_id, context, n, seed)
    except ValueError as e:
        raise RetrofitError(f"{flags}: {e}") from None


@torch.no_grad()
def capture(hf_model, layers: list[int], input_ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{layer: (input of its self-attention (N, T, C), its output (N, T, C))} of the original model, float32."""
    caps: dict[int, list] = {i: [None, None] for i in layers}
    hooks = []
    for i in layers:
        attn = hf_model.model.layers[i].self_attn

        def pre(module, args, kwargs, i=i):
            caps[i][0] = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).detach().float()

        def post(module, args, kwargs, output, i=i):
            caps[i][1] = (output[0] if isinstance(output, tuple) else output).detach().float()

        hooks.append(attn.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(attn.register_forward_hook(post, with_kwargs=True))
    try:
        hf_model(input_ids=input_ids.to(next(hf_model.parameters()).device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {i: (x, y) for i, (x, y) in caps.items()}


def relative_error(attn, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float(_loss(attn, x, y) / y.pow(2).mean().clamp_min(1e-30))


def _loss(attn, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(attn(x), y)


def _fingerprint(cfg: TransferConfig, layer: int, mechanism: str) -> dict:
    """The options that decide a layer's training (a checkpoint resumes only under the same): not how
    often it checkpoints, nor the held-out contexts it is only measured on."""
    d = asdict(cfg)
    d.pop("checkpoint_every")
    d.pop("heldout_contexts")
    return {**d, "layer": layer, "mechanism": mechanism}


def transfer_attention(hf_model, model, layers: list[int], cfg: TransferConfig, out, encode=None, eos_id: int | None = None,
             until: int | None = None, log=None) -> dict:
    """Train the attention of `layers` of `model` (an AttnlabForCausalLM converted from `hf_model`)
    to reproduce `hf_model`'s attention outputs; checkpoints in OUT/transfer/ (resumed when present).

    encode/eos_id: the tokenizer (default: byte_encode and the config's EOS). `until`: stop after
    that many optimizer steps of this call (a part of the run that a later call resumes). `log`: a
    function called with one line per layer. Returns the report {"config", "layers": {i: {...}}},
    also kept as `model.transfer_report` (written to transfer.json by `save`)."""
    cfg.check()
    layers = sorted(int(i) for i in layers)
    plan_ = getattr(model, "retrofit_plan", None)
    mechanism = plan_.mechanism if plan_ is not None else "?"
    encode, eos_id = text_encoding(hf_model.config, encode, eos_id)
    folder = Path(out) / TRANSFER_DIR
    report = {"config": _fingerprint(cfg, -1, mechanism), "layers": {}}
    report["config"].pop("layer")
    report["config"]["heldout_contexts"] = cfg.heldout_contexts
    if cfg.steps == 0:
        return report
    ids = contexts(cfg.corpus, cfg.split, cfg.context, cfg.contexts, cfg.seed, encode, eos_id,
                   "--transfer-contexts/--transfer-context").input_ids
    held = None if cfg.heldout_contexts == 0 else contexts(
        cfg.corpus, "val", cfg.context, cfg.heldout_contexts, cfg.seed, encode, eos_id,
        f"--transfer-heldout-contexts/--transfer-context ({cfg.corpus} val split)").input_ids
    caps = capture(hf_model, layers, ids)
    held_caps = None if held is None else capture(hf_model, layers, held)
    budget = math.inf if until is None else until
    with FolderLock(out, beside=True), graceful():
        for i in layers:
            attn = model.model.blocks[i].attn
            x, y = caps[i]
            rec = _layer(attn, x, y, cfg, folder / f"layer{i}.safetensors", _fingerprint(cfg, i, mechanism), budget,
                         None if held_caps is None else held_caps[i])
            budget -= rec.pop("ran")
            report["layers"][str(i)] = rec
            if log is not None and rec["step"] == cfg.steps:
                log(f"layer {i}: relative error {rec['before']:.4g} -> {rec['after']:.4g} ({cfg.steps} steps)"
                    + ("" if held_caps is None else f"; held out {_g(rec['heldout_before'])} -> "
                                                    f"{rec['heldout_after']:.4g}"))
            if rec["step"] < cfg.steps:
                report["stopped"] = f"layer {i} at step {rec['step']} of {cfg.steps}"
                break
            if requested() is not None and i != layers[-1]:
                raise Interrupted(requested(), f"{folder} stopped after layer {i}; rerun the same command to resume")
    model.eval()
    model.transfer_report = report
    return report


def _g(v) -> str:
    return "?" if v is None else f"{v:.4g}"


def _layer(attn, x, y, cfg: TransferConfig, path: Path, fingerprint: dict, budget: float,
           held: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict:
    """Train one layer (resuming its checkpoint); its errors before and after, and on `held` (the
    held-out capture) as heldout_before / heldout_after (before: None when resumed from a checkpoint
    written without it or with another number of held-out contexts)."""
    for p in attn.parameters():
        p.requires_grad_(True)
    opt = torch.optim.AdamW(attn.parameters(), lr=cfg.lr, weight_decay=0.0)
    params = attn.state_dict(keep_vars=True)  # the live tensors: a resume sets them, a save reads them
    meta = resume(path, params, opt, fingerprint, "transfer")
    start, before = (0, None) if meta is None else (int(meta["step"]), meta["before"])
    same_held = meta is not None and meta.get("heldout_contexts") == cfg.heldout_contexts
    held_before = meta.get("heldout_before") if same_held else None  # measured on these contexts, else unknown
    if before is None:
        before = relative_error(attn, x, y)
        held_before = None if held is None else relative_error(attn, *held)

    def step(_: int) -> None:
        loss = _loss(attn, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    state = {"fingerprint": fingerprint, "before": before, "heldout_before": held_before,
             "heldout_contexts": cfg.heldout_contexts}
    done, ran = train_steps(step, path, params, opt, state, start, cfg.steps, cfg.checkpoint_every, budget)
    for p in attn.parameters():
        p.grad = None
    after = relative_error(attn, x, y)
    rec = {"before": before, "after": after, "step": done, "resumed_from": start, "ran": ran}
    if held is not None:
        rec.update(heldout_before=held_before, heldout_after=relative_error(attn, *held))
    return rec
