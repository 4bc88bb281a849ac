"""Training the search projections on a frozen LM: capture once, distil many steps.

Activations of the selected layers are captured from the frozen model (block-causal packed
contexts) and kept in memory or cached on disk, so later epochs do not re-run the model. Each
step rebuilds the teacher from the captured q/k and minimises alpha * L_NCE + beta * L_KL averaged
over layers. Checkpoints (projections + optimizer state) are written atomically; `resume` picks up.

Everything runs where the frozen model is (`device`, in `dtype`): captured activations (read back
from disk onto it), the block-causal masks, the projections (float32) and their optimizer.
Checkpoints are written from CPU copies, so a run started on one device resumes on another.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from attnlab.checks import check_choice, check_int

from attnlab.data.cache import atomic_save_tensors, atomic_write_text
from attnlab.interrupt import Interrupted, graceful, requested
from attnlab.lock import FolderLock, check_free
from attnlab.train.checkpoint import optimizer_state_dict, optimizer_tensors
from attnlab.data.packing import doc_causal_mask

from .capture import Captured, Packed, capture, teacher_attention
from .hf_model import model_device, resolve_device, resolve_dtype
from .lm import FrozenLM, prepare
from ..index.projections import SCORES, SearchProjections, search_losses
from .retrieval import check_group_spec, resolve_groups

CHECKPOINT = "projections.safetensors"


@dataclass
class SearchTrainConfig:
    """What `train_projections` (`attnlab search train`) does; each field is a command-line option.

    model: 'smollm2', a hub id, a folder or a .gguf file; layers: the layer set trained ('all',
    'middle<N>', 'reserved-edge' or '3,4,5'). The projections map the hidden state entering attention
    to d_search dims (rotated by position with `rope`), one search space per candidate group
    (`groups`: an int dividing the query heads, or 'kv'), ranked by inner product of unit vectors
    (`score` "dot") or by distance (`score` "distance", no rope: with d_search 1 the scalar
    selection that the `sorted` method reads from a sorted array); the loss is alpha · InfoNCE over the
    teacher's k_pos top keys (temperature tau) + beta · KL to the teacher distribution. Data:
    n_contexts packed contexts of `context` tokens from corpus/split; steps of AdamW at lr with
    `warmup` steps; `query_rows` scores that many query rows per step (0: all). `activations` keeps
    captured activations on disk under `out`, in memory (on the model's device), or recomputes them.
    Checkpoints go to out/projections.safetensors every checkpoint_every steps and `resume` continues
    from it. device: where the frozen model loads and training runs ('auto': CUDA when available,
    else the CPU; 'cpu'; 'cuda'); dtype: the frozen model's weights ('float32' or 'bfloat16'; the
    projections train in float32 either way). Bad values raise ValueError (or NotAnIntError) naming
    the field, 'cuda' without a CUDA device included.
    """

    model: str = "smollm2"
    layers: str = "all"  # trained once; any subset can be substituted at evaluation
    d_search: int = 128
    groups: int | str = 1  # candidate sets per token: an int dividing the query heads, or "kv" (one per KV head)
    tau: float = 0.05
    rope: bool = True  # rotate search vectors by position (recency becomes expressible); False = plain h W
    score: str = "dot"  # "dot": unit vectors, inner product; "distance": -|q - k|^2 (needs rope=False)
    rope_theta: float = 10000.0
    k_pos: int = 16
    alpha: float = 1.0
    beta: float = 1.0
    corpus: str = "stdlib"
    split: str = "train"
    context: int = 2048
    n_contexts: int = 32
    steps: int = 400
    lr: float = 2e-3
    warmup: int = 20
    eval_k: int = 64  # K of the Mass@K / Recall@K logged on the training batch
    query_rows: int = 0  # query positions scored per step, drawn uniformly (0: all); the teacher costs rows x context
    log_every: int = 10
    checkpoint_every: int = 50
    activations: str = "disk"  # "disk" (cache under out/), "memory", or "none" (re-run the model)
    out: str = "runs/search"
    seed: int = 0
    resume: bool = True
    device: str = "auto"  # where the frozen model loads and training runs: auto (CUDA when available), cpu, cuda
    dtype: str = "float32"  # the frozen model's weights: float32 or bfloat16

    def __post_init__(self):
        for name in ("d_search", "k_pos", "context", "n_contexts", "steps", "log_every", "checkpoint_every", "eval_k"):
            check_int(name, getattr(self, name))
        check_int("query_rows", self.query_rows, 0)
        for name in ("tau", "lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("alpha", "beta", "warmup"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        check_group_spec(self.groups)
        check_choice("score", self.score, SCORES)
        if self.score == "distance" and self.rope:
            raise ValueError("score='distance' needs rope=False (a rotation would change the distances it ranks by)")
        if self.activations not in ("disk", "memory", "none"):
            raise ValueError(f"activations must be 'disk', 'memory' or 'none', got {self.activations!r}")
        resolve_device(self.device)
        resolve_dtype(self.dtype)


class ActivationStore:
    """Captured activations per context: computed on first use, then served from memory or disk, on
    the model's device."""

    def __init__(self, lm: FrozenLM, packed: Packed, layers: list[int], mode: str, folder: Path | None):
        self.lm, self.packed, self.layers, self.mode, self.folder = lm, packed, layers, mode, folder
        self.device = model_device(lm.model)
        self.mem: dict[int, dict[int, Captured]] = {}
        weights = next(lm.model.parameters()).dtype
        self.tag = json.dumps({"model": lm.name, "layers": layers, "context": packed.input_ids.shape[1],
                               "ids": int(packed.input_ids.sum()),
                               # another dtype captures other activations; float32 caches keep their old tag
                               **({"dtype": str(weights)} if weights != torch.float32 else {})})

    def _path(self, i: int) -> Path:
        return self.folder / f"ctx_{i:05d}.safetensors"

    def _read(self, i: int):
        from safetensors import safe_open

        p = self._path(i)
        if not p.is_file():
            return None
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("tag") != self.tag:
                return None
            sc = json.loads(meta["scaling"])
            return {l: Captured(*(f.get_tensor(f"{l}.{n}").to(self.device).float() for n in ("hidden", "q", "k")),
                                sc[str(l)]) for l in self.layers}

    def _write(self, i: int, caps: dict[int, Captured]) -> None:
        tensors = {}
        for l, c in caps.items():
            tensors.update({f"{l}.hidden": c.hidden.half().contiguous(), f"{l}.q": c.q.half().contiguous(),
                            f"{l}.k": c.k.half().contiguous()})
        meta = {"tag": self.tag, "scaling": json.dumps({str(l): c.scaling for l, c in caps.items()})}
        atomic_save_tensors(self._path(i), tensors, meta)

    def get(self, i: int) -> dict[int, Captured]:
        if i in self.mem:
            return self.mem[i]
        caps = self._read(i) if self.mode == "disk" else None
        if caps is None:
            caps = capture(self.lm.model, self.packed.batch(i), self.layers)
            if self.mode == "disk":  # train on what a resumed run will read back: the fp16 copy
                self._write(i, caps)
                caps = {l: Captured(c.hidden.half().float(), c.q.half().float(), c.k.half().float(), c.scaling)
                        for l, c in caps.items()}
        if self.mode == "memory":
            self.mem[i] = caps
        return caps


def query_rows(T: int, n: int, seed: int, step: int) -> torch.Tensor | None:
    """The query rows one training step scores: n of the T positions, uniformly without replacement
    and sorted, drawn from a generator seeded by (seed, step) so a resumed run draws the same rows.
    None (every row) when n is 0 or at least T."""
    if not n or n >= T:
        return None
    g = torch.Generator().manual_seed(seed * 1000003 + step)
    return torch.randperm(T, generator=g)[:n].sort().values


def step_losses(proj: SearchProjections, caps: dict[int, Captured], segments: torch.Tensor, k_pos: int,
                eval_k: int | None = None, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Layer-averaged (L_NCE, L_KL) on one context; with eval_k also the student's Mass/Recall@K.

    rows: score only these query positions (every key stays a candidate). Both losses are means
    over query rows, so over uniformly drawn rows their expectation is the full loss, while the
    teacher and the dense logits shrink from T x T to len(rows) x T. segments and rows go to the
    projections' device (where the captured activations are)."""
    device = next(proj.parameters()).device
    segments = segments.to(device)
    rows = None if rows is None else rows.to(device)
    allowed4 = doc_causal_mask(segments)  # (B, 1, T, T)
    if rows is not None:
        allowed4 = allowed4[:, :, rows]  # (B, 1, n, T)
    G = proj.groups
    allowed = allowed4[:, 0].repeat_interleave(G, dim=0)  # (B * G, n, T)
    nce_sum, kl_sum, mass, recall = 0.0, 0.0, [], []
    for layer, c in caps.items():
        q = c.q if rows is None else c.q[:, :, rows]
        with torch.no_grad():
            teacher = teacher_attention(q, c.k, allowed4, c.scaling, groups=G)  # (B, G, n, T)
        qs, ks = proj(layer, c.hidden)  # (B, G, T, d)
        if rows is not None:
            qs = qs[:, :, rows]
        nce, kl = search_losses(qs.flatten(0, 1), ks.flatten(0, 1), teacher.flatten(0, 1), allowed, proj.tau, k_pos)
        nce_sum, kl_sum = nce_sum + nce, kl_sum + kl
        if eval_k:
            from .metrics import retrieval_stats
            from ..index.retrieval import topk_candidates

            with torch.no_grad():
                idx, valid = topk_candidates(qs @ ks.transpose(-1, -2), allowed4, eval_k)
                s = retrieval_stats(idx, valid, teacher, allowed4, eval_k)
            if s["n"]:
                mass.append(s["mass"] / s["n"])
                recall.append(s["recall"] / s["n"])
    n = len(caps)
    info = {"mass": sum(mass) / len(mass), "recall": sum(recall) / len(recall)} if mass else {}
    return nce_sum / n, kl_sum / n, info


def _logged_step(line: str) -> float:
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return math.inf  # a line cut short by a kill


def train_projections(cfg: SearchTrainConfig, lm: FrozenLM | None = None, progress: bool = True,
                      until: int | None = None) -> dict:
    """Train (or resume) search projections; returns a summary with the checkpoint path.

    `until` stops after that many steps of the cfg.steps schedule (a time-boxed part of a run that a
    later call resumes); the learning-rate schedule always spans cfg.steps. lm: an already loaded
    `FrozenLM` (default: load cfg.model); progress: show a bar.

    The model loads on cfg.device in cfg.dtype; a given `lm` stays where it is and training follows it.
    The summary holds checkpoint, layers, steps_done, resumed_from, the last logged row,
    trainable_params and device. Raises ValueError for layers or groups the model does not have,
    FolderBusy when another process writes cfg.out; SIGINT/SIGTERM stop it after the current step
    with a checkpoint."""
    resolved = {}

    def check(sets, dims):
        resolved["groups"] = resolve_groups(cfg.groups, dims)

    check_free(cfg.out)  # another process writing this output: FolderBusy before the model is loaded
    lm, (layers,), packed = prepare(cfg.model, [cfg.layers], cfg.corpus, cfg.split, cfg.context,
                                    cfg.n_contexts, cfg.seed, lm=lm, check=check, device=resolve_device(cfg.device),
                                    dtype=resolve_dtype(cfg.dtype))
    with FolderLock(cfg.out), graceful():
        return _train(cfg, lm, layers, packed, resolved["groups"], progress, until)


def _train(cfg: SearchTrainConfig, lm: FrozenLM, layers: list[int], packed: Packed, groups, progress: bool,
           until: int | None) -> dict:
    out = Path(cfg.out)
    ckpt = out / CHECKPOINT
    torch.manual_seed(cfg.seed)
    device = model_device(lm.model)
    proj = SearchProjections(layers, lm.dims.d_model, cfg.d_search, cfg.tau, meta={"model": lm.name},
                             rope=cfg.rope, rope_theta=cfg.rope_theta, groups=groups, score=cfg.score)
    proj.to(device)  # initialised on the CPU: the same start on every device
    opt = torch.optim.Adam(proj.parameters(), lr=cfg.lr)
    start = 0
    if cfg.resume and ckpt.is_file():
        loaded, meta, extra = SearchProjections.load(ckpt)
        have = (loaded.layers, loaded.d_search, loaded.d_model, loaded.rope, loaded.groups, loaded.score)
        want = (layers, cfg.d_search, lm.dims.d_model, cfg.rope, groups, cfg.score)
        if have != want:
            raise ValueError(f"checkpoint {ckpt} was trained with (layers, d_search, d_model, rope, groups, score)={have}; "
                             f"the config asks {want} (use another --out)")
        proj.load_state_dict(loaded.state_dict())  # copied onto proj's device
        if "optim" in meta:
            opt.load_state_dict(optimizer_state_dict(extra, meta["optim"], "optim."))  # onto its parameters' device
        start = int(meta.get("step", 0))

    def lr_at(step):
        warm = min(1.0, (step + 1) / cfg.warmup) if cfg.warmup else 1.0
        return cfg.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / cfg.steps)))

    def save(step):
        tensors, ometa = optimizer_tensors(opt, "optim.")
        proj.save(ckpt, tensors, {"step": step, "optim": ometa, "config": asdict(cfg)})

    store = ActivationStore(lm, packed, layers, cfg.activations, out / "activations")
    log_path = out / "train_log.jsonl"
    if log_path.is_file():  # rows a killed run logged past its checkpoint are logged again: keep them once
        kept = [line for line in log_path.read_text().splitlines(keepends=True) if _logged_step(line) <= start]
        atomic_write_text(log_path, "".join(kept))
    log = open(log_path, "a")
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="search train", disable=not progress)
    last = {}
    t0 = time.time()
    stop = cfg.steps if until is None else min(until, cfg.steps)
    for step in bar:
        if step >= stop:
            break
        epoch, pos = divmod(step, len(packed))
        order = list(range(len(packed)))
        random.Random(cfg.seed * 1000003 + epoch).shuffle(order)
        i = order[pos]
        caps = store.get(i)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        want = (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps
        rows = query_rows(packed.segments.shape[1], cfg.query_rows, cfg.seed, step)
        nce, kl, info = step_losses(proj, caps, packed.segments[i:i + 1], cfg.k_pos, cfg.eval_k if want else None, rows)
        loss = cfg.alpha * nce + cfg.beta * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if want:
            last = {"step": step + 1, "loss": loss.item(), "nce": nce.item(), "kl": kl.item(),
                    **{f"{k}@{cfg.eval_k}": v for k, v in info.items()}, "elapsed_s": time.time() - t0}
            log.write(json.dumps(last) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{last['loss']:.3f}", mass=f"{info.get('mass', float('nan')):.3f}")
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 in (cfg.steps, stop):
            save(step + 1)
        if requested() is not None and step + 1 < stop:
            save(step + 1)
            log.close()
            bar.close()
            raise Interrupted(requested(), f"{out} stopped after step {step + 1} of {cfg.steps}; "
                                           f"checkpoint {ckpt} saved")
    log.close()
    if start >= cfg.steps and not ckpt.is_file():
        save(start)
    return {"checkpoint": str(ckpt), "layers": layers, "steps_done": max(start, stop), "resumed_from": start,
            "last": last, "trainable_params": sum(p.numel() for p in proj.parameters()), "device": str(device)}
