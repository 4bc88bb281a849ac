"""Fine-tuning a retrofitted model end to end on next-token loss (optionally with a KL to the original).

After the exact start (and attention transfer, for mechanisms without one) the retrofit's new
parameters are trained with the trainer's machinery on `contexts` packed contexts of `context`
tokens of a corpus (stdlib by default, read as in transfer.py):

- trained: the new parameters (`convert.new_parameters`: gates, scalar projections, τ, priors) with
  train="new" (default), or every parameter with train="all"; everything else has requires_grad
  False and stays bit-identical;
- AdamW (attnlab.train.trainer.make_optimizer: weight decay on matrices only), linear warmup then
  cosine decay (attnlab.train.config.TrainConfig.lr_at), global-norm gradient clipping;
- loss = CE(next token) + kl · KL(p_original ‖ p_new), the KL per token on the next-token
  distributions, the original HF model's logits under no_grad (only when kl > 0 and it is given);
- the batch of step s is a pure function of (seed, s): `batch_indices`;
- held-out perplexity (evaluate.perplexity) on `eval_contexts` contexts of the corpus's test split,
  before and after.

Resumable (the loop of loop.py, which transfer shares): `OUT/finetune/state.safetensors` holds the
trained parameters, the optimizer state, the step (= the data position) and the loss/perplexity
before, written atomically every `checkpoint_every` steps, at the end and when SIGINT/SIGTERM stops
the loop (the step finishes, the state is saved, Interrupted says where). `OUT/finetune/log.jsonl`
(+ train.csv) has one row per step (attnlab.train.logging.RunLogger; rows past the checkpoint are
dropped on resume). A rerun with the same options ends with exactly the parameters of one
uninterrupted run; other options are refused (RetrofitError).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from attnlab.lock import FolderLock
from attnlab.models.lm import token_loss

from .convert import RetrofitError, new_parameters
from .evaluate import logits as _logits, model_device, perplexity, split_contexts
from .loop import resume, train_steps
from .transfer import text_encoding

FINETUNE_DIR = "finetune"
STATE = "state.safetensors"
TRAIN_CHOICES = ("new", "all")


@dataclass
class FinetuneConfig:
    """Options of fine-tuning (`--finetune-*`): `steps` of AdamW at `lr` (`warmup` steps, then a cosine
    down to min_lr_ratio · lr; weight_decay; gradient clipping at grad_clip) on batches of `batch` contexts of `context`
    tokens drawn from `contexts` packed contexts of `corpus`; kl: the weight of a KL to the original
    model's next-token distribution; train: "new" (the retrofit's new parameters) or "all"; lora:
    the rank of peft LoRA adapters on every q/k/v/o (0: none), merged at the end; eval_contexts:
    held-out contexts of the perplexity before and after; new_lr_scale: the new parameters' learning
    rate as a multiple of lr (LoRA adapters and train="all" weights keep lr). `check()` raises
    RetrofitError naming the option."""

    steps: int = 0
    lr: float = 1e-3
    warmup: int = 10
    min_lr_ratio: float = 0.1
    batch: int = 4
    context: int = 256
    contexts: int = 64
    eval_contexts: int = 4
    corpus: str = "stdlib"
    kl: float = 0.0
    seed: int = 0
    train: str = "new"
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    checkpoint_every: int = 50
    lora: int = 0  # LoRA rank on every layer's q/k/v/o projections (peft); 0: none
    lora_alpha: float = 16.0
    new_lr_scale: float = 1.0
    align: float = 0.0  # weight of L_align (attnlab.regularizers) over the scalar/hybrid layers

    def check(self, max_positions: int | None = None) -> "FinetuneConfig":
        """RetrofitError naming the option, for a value that cannot work."""
        for name, low in (("steps", 0), ("warmup", 0), ("batch", 1), ("context", 2), ("contexts", 1),
                          ("eval_contexts", 1), ("seed", 0), ("checkpoint_every", 1), ("lora", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise RetrofitError(f"--finetune-{name.replace('_', '-')} must be an integer >= {low}, got {v!r}")
        for name, positive in (("lr", True), ("kl", False), ("weight_decay", False), ("grad_clip", False),
                               ("lora_alpha", True), ("new_lr_scale", True), ("align", False)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (positive and v == 0):
                raise RetrofitError(f"--finetune-{name.replace('_', '-')} must be a finite number "
                                    f"{'> 0' if positive else '>= 0'}, got {v!r}")
        if not (isinstance(self.min_lr_ratio, (int, float)) and 0 <= self.min_lr_ratio <= 1):
            raise RetrofitError(f"--finetune-min-lr-ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.batch > self.contexts:
            raise RetrofitError(f"--finetune-batch {self.batch} exceeds --finetune-contexts {self.contexts}")
        if self.train not in TRAIN_CHOICES:
            raise RetrofitError(f"--finetune-train must be one of {TRAIN_CHOICES}, got {self.train!r}")
        if max_positions and self.context > max_positions:
            raise RetrofitError(f"--finetune-context {self.context} exceeds the model's max_position_embeddings "
                                f"{max_positions}")
        return self

    def schedule(self):
        """The trainer's TrainConfig with these optimizer settings (for lr_at and make_optimizer)."""
        from attnlab.train.config import TrainConfig

        return TrainConfig(steps=max(1, self.steps), lr=float(self.lr), warmup_steps=min(self.warmup, self.steps),
                           min_lr_ratio=float(self.min_lr_ratio), weight_decay=float(self.weight_decay),
                           grad_clip=float(self.grad_clip), betas=(0.9, 0.95))


def batch_indices(seed: int, step: int, n: int, batch: int) -> torch.Tensor:
    """The contexts of step `step`: `batch` distinct indices in [0, n), a pure function of (seed, step)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randperm(n, generator=g)[:batch]


def _losses(model, ids: torch.Tensor, original, kl: float, align: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(total, next-token CE, {"kl": KL(original ‖ model), "align": Σ_layers L_align} where weighted),
    each a mean over predicted tokens (L_align: over the scalar/hybrid layers' query-key pairs)."""
    extra = {}
    ids = ids.to(model_device(model))  # the batch follows the model
    if align > 0:  # the LM's own forward, recording the scalar layers' qs/ks for L_align
        from attnlab.regularizers import regularization

        logits = model.model(ids, record=True)[0][:, :-1].float()
        extra["align"] = regularization([a.last for a in model.model.attention_layers()], {"align": 1.0})["total"]
    else:
        logits = _logits(model, ids)[:, :-1].float()  # (B, T-1, V)
    ce = token_loss(logits, ids[:, 1:])
    total = ce + align * extra["align"] if align > 0 else ce
    if kl > 0 and original is not None:
        with torch.no_grad():
            ref = F.log_softmax(_logits(original, ids)[:, :-1].float(), -1)
        extra["kl"] = F.kl_div(F.log_softmax(logits, -1), ref, log_target=True, reduction="none").sum(-1).mean()
        total = total + kl * extra["kl"]
    return total, ce, extra


def check_trainable(plan_, train: str, lora: int = 0, align: float = 0.0) -> None:
    """RetrofitError when train="new", no LoRA is asked for and the planned layers have no new parameters
    (checked on layers built on the meta device: no weights, no memory); when L_align is weighted and
    no planned layer has scalar heads; or LoRA without peft installed."""
    from types import SimpleNamespace

    from attnlab.layers import Attention

    if lora:
        _peft()
    configs = plan_.model.attention_configs()
    with torch.device("meta"):
        blocks = {i: SimpleNamespace(attn=Attention(configs[i])) for i in plan_.layers}
    if align and not any(b.attn.n_scalar for b in blocks.values()):
        raise RetrofitError(f"--finetune-align {align}: L_align needs scalar or hybrid heads, and the "
                            f"{plan_.mechanism!r} layers have none")
    if train != "new" or lora:
        return
    _trainable(SimpleNamespace(model=SimpleNamespace(blocks=blocks)), plan_, train)


LORA_TARGETS = ["wq", "wk", "wv", "wo"]  # every attention layer's projections (attnlab.layers.Attention)


def trainable_count(plan_, cfg: FinetuneConfig) -> int:
    """The parameters `finetune(model, cfg)` trains on a model retrofitted by `plan_`, counted on layers
    built on the meta device (no weights): the retrofit's new parameters (train="new") or every
    parameter (train="all"), plus rank x (in + out) for each LoRA-adapted q/k/v/o projection of every
    layer; 0 when nothing is fine-tuned. How parameter-matched controls are sized (docs/retrofit.md)."""
    from types import SimpleNamespace

    from attnlab.layers import Attention
    from attnlab.models import LM

    if cfg.steps == 0:
        return 0
    with torch.device("meta"):
        if cfg.train == "all":
            lm = LM(plan_.model)
            count, blocks = sum(p.numel() for p in lm.parameters()), [b.attn for b in lm.blocks]
        else:
            blocks = [Attention(c) for c in plan_.model.attention_configs()]
            shell = SimpleNamespace(blocks=[SimpleNamespace(attn=a) for a in blocks])
            count = sum(p.numel() for p in new_parameters(shell, plan_).values())
    if cfg.lora:
        for a in blocks:
            for name in LORA_TARGETS:
                proj = getattr(a, name, None)
                if isinstance(proj, torch.nn.Linear):
                    count += cfg.lora * (proj.in_features + proj.out_features)
    return count


def _peft():
    try:
        import peft
    except ImportError:
        raise RetrofitError("--finetune-lora needs the optional package peft, not installed here: pip install peft") from None
    return peft


def add_lora(model, cfg: FinetuneConfig) -> dict[str, torch.nn.Parameter]:
    """LoRA adapters (rank cfg.lora, peft) on the q/k/v/o projections of every layer of `model` (an
    AttnlabForCausalLM), initialised from cfg.seed; returns them by name."""
    peft = _peft()
    torch.manual_seed(cfg.seed)
    peft.inject_adapter_in_model(peft.LoraConfig(r=cfg.lora, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                                                 target_modules=LORA_TARGETS), model.model)
    return {n: p for n, p in model.model.named_parameters() if "lora_" in n}


def remove_lora(model, merge: bool) -> None:
    """Take the adapters out again, each folded into its projection first when `merge` (the saved model
    then has attnlab's plain structure), else dropped (the base weights as they were)."""
    from peft.tuners.lora import LoraLayer

    for name, module in list(model.model.named_modules()):
        if isinstance(module, LoraLayer):
            if merge:
                module.merge()
            parent = model.model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model.model
            setattr(parent, name.rsplit(".", 1)[-1], module.get_base_layer())
    if hasattr(model.model, "peft_config"):  # what peft's injection left on the module
        del model.model.peft_config


def _trainable(model, plan_, train: str, lora: bool = False) -> dict[str, torch.nn.Parameter]:
    if train == "all":
        return dict(model.model.named_parameters())
    if plan_ is None:
        raise RetrofitError("--finetune-train new needs a retrofitted model (one with .retrofit_plan)")
    params = new_parameters(model.model, plan_)
    if not params and not lora:
        raise RetrofitError(f"--finetune-train new: the {plan_.mechanism!r} layers with settings {plan_.settings} "
                            f"have no new parameters to train; add one (e.g. --set output_gate=elementwise) or "
                            f"use --finetune-train all")
    return params


def _scale_new(opt, new: dict, scale: float) -> None:
    """Split each of the optimizer's groups into the retrofit's new parameters (learning rate × scale,
    kept as the group's "lr_scale") and the rest; before any step, so no state moves."""
    ids = {id(p) for p in new.values()}
    groups = []
    for g in opt.param_groups:
        for mine in (True, False):
            ps = [p for p in g["params"] if (id(p) in ids) == mine]
            if ps:
                groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ps,
                               "lr_scale": scale if mine else 1.0})
    opt.param_groups.clear()
    for g in groups:
        opt.add_param_group(g)


def _fingerprint(cfg: FinetuneConfig, plan_) -> dict:
    d = asdict(cfg)
    d.pop("checkpoint_every")
    for k in ("new_lr_scale", "align"):  # states written before these options existed stay resumable
        if d[k] == FinetuneConfig.__dataclass_fields__[k].default:
            d.pop(k)
    if plan_ is not None:
        d.update(layers=list(plan_.layers), mechanism=plan_.mechanism, settings=plan_.settings)
    return json.loads(json.dumps(d, default=str))


def finetune(model, cfg: FinetuneConfig, out, original=None, encode=None, eos_id: int | None = None,
             until: int | None = None, progress: bool = True, log=None) -> dict:
    """Fine-tune `model` (an AttnlabForCausalLM, usually from `convert`) in place; state in OUT/finetune/
    (resumed when present). original: the HF model it came from (the KL target when cfg.kl > 0).
    encode/eos_id: the tokenizer (default: byte_encode and the config's EOS). `until`: stop after that
    many optimizer steps of this call. `log`: a function called with a summary line. Returns the report
    {"config", "loss_start", "loss_end", "perplexity_before", "perplexity_after", "steps", "history"},
    also kept as `model.finetune_report` (written to finetune.json by `save`)."""
    from tqdm.auto import tqdm

    from attnlab.train.logging import RunLogger
    from attnlab.train.trainer import make_optimizer

    cfg.check()
    plan_ = getattr(model, "retrofit_plan", None)
    fingerprint = _fingerprint(cfg, plan_)
    report: dict = {"config": fingerprint}
    if cfg.steps == 0:
        return report
    if cfg.kl > 0 and original is None:
        raise RetrofitError("--finetune-kl > 0 needs the original model (finetune(..., original=hf_model))")
    if cfg.align and not any(blk.attn.n_scalar for blk in model.model.blocks):
        raise RetrofitError(f"--finetune-align {cfg.align}: L_align needs scalar or hybrid heads; this model has none")
    encode, eos_id = text_encoding(model.config, encode, eos_id)
    train_ids = split_contexts(cfg.corpus, "train", cfg.context, cfg.contexts, cfg.seed, encode, eos_id).input_ids
    eval_ids = split_contexts(cfg.corpus, "test", cfg.context, cfg.eval_contexts, cfg.seed, encode, eos_id)
    params = _trainable(model, plan_, cfg.train, lora=cfg.lora > 0)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    if cfg.lora:
        params = {**params, **add_lora(model, cfg)}
    trained = {id(p) for p in params.values()}
    for p in model.parameters():
        p.requires_grad_(id(p) in trained)
    if original is not None:
        original.eval()
    tcfg = cfg.schedule()
    opt = make_optimizer(model, tcfg)
    if cfg.new_lr_scale != 1.0 and plan_ is not None:
        _scale_new(opt, new_parameters(model.model, plan_), cfg.new_lr_scale)
    folder = Path(out) / FINETUNE_DIR
    path = folder / STATE
    finished = False
    try:
        with FolderLock(out, beside=True):
            folder.mkdir(parents=True, exist_ok=True)
            state = {"fingerprint": fingerprint}
            meta = resume(path, params, opt, fingerprint, "fine-tuning")
            if meta is not None:
                start = int(meta["step"])
                state.update({k: meta[k] for k in ("perplexity_before", "loss_start")})
            else:
                start = 0
                state["perplexity_before"] = perplexity(model, eval_ids)
            logger = RunLogger(folder, tensorboard=False)
            logger.truncate_after(start)
            model.train()
            bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="retrofit finetune",
                       disable=not progress)

            def one_step(s: int) -> None:
                lr = tcfg.lr_at(s)
                for g in opt.param_groups:
                    g["lr"] = lr * g.get("lr_scale", 1.0)
                ids = train_ids[batch_indices(cfg.seed, s, cfg.contexts, cfg.batch)]
                loss, ce, extra = _losses(model, ids, original, cfg.kl, cfg.align)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(list(params.values()), tcfg.grad_clip) \
                    if tcfg.grad_clip > 0 else None
                opt.step()
                row = {"step": s + 1, "loss": float(loss.detach()), "ce": float(ce.detach()), "lr": lr}
                row.update({k: float(v.detach()) for k, v in extra.items()})
                if norm is not None:
                    row["grad_norm"] = float(norm)
                if s == 0:
                    state["loss_start"] = row["loss"]
                logger.log("train", row)
                bar.update(1)
                bar.set_postfix(loss=f"{row['loss']:.4f}")

            step, _ = train_steps(one_step, path, params, opt, state, start, cfg.steps, cfg.checkpoint_every,
                                  math.inf if until is None else until, on_stop=bar.close)
            finished = step >= cfg.steps
            bar.close()
            logger.close()
            history = logger.history("train")
    finally:
        opt.zero_grad(set_to_none=True)
        if cfg.lora:  # merged only once finished; an interrupted run leaves the base weights as they were
            remove_lora(model, merge=finished)
        for n, p in model.named_parameters():
            p.requires_grad_(flags[n])
        model.eval()
    report.update(steps=step, resumed_from=start, trained=sorted(params),
                  trainable_params=sum(p.numel() for p in params.values()), loss_start=state["loss_start"],
                  loss_end=history[-1]["loss"] if history else None, perplexity_before=state["perplexity_before"],
                  history=history)
    if step < cfg.steps:
        report["stopped"] = f"at step {step} of {cfg.steps}"
        return report
    report["perplexity_after"] = perplexity(model, eval_ids)
    model.finetune_report = report
    if log is not None:
        log(f"finetune: loss {report['loss_start']:.4f} -> {report['loss_end']:.4f} ({cfg.steps} steps); held-out "
            f"perplexity {report['perplexity_before']:.4g} -> {report['perplexity_after']:.4g}")
    return report
