"""The resumable training loop of attention transfer and fine-tuning, and its state file.

A run trains some tensors (by name) with an optimizer for `steps` steps, one call of its step
function each. Its state file (`save_state`) holds those tensors, the optimizer's state, the step and
a JSON `state` of the caller's (its options' fingerprint among them). `train_steps` writes it
atomically every `every` steps, at the last step, when the call's budget of steps is spent, and when
SIGINT/SIGTERM stops the loop (attnlab.interrupt: the step in progress finishes, the state is saved,
Interrupted says where). `resume` puts a saved state back, so a rerun with the same options ends
with exactly the tensors of one uninterrupted run; a file written with other options is refused
(RetrofitError).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import torch

from attnlab.data.cache import atomic_save_tensors
from attnlab.interrupt import Interrupted, graceful, requested
from attnlab.train.checkpoint import optimizer_state_dict, optimizer_tensors

from .convert import RetrofitError


def save_state(path: Path, params: dict, opt, step: int, state: dict) -> None:
    """Tensors being trained (by name), the optimizer's state and a JSON `state` (+ step) in one
    safetensors file, atomically."""
    optim, flat = optimizer_tensors(opt, "optim.")
    tensors = {**{f"param.{k}": v.detach().clone().contiguous() for k, v in params.items()}, **optim}
    meta = {**state, "step": step, **flat}
    atomic_save_tensors(path, tensors, {"state": json.dumps(meta)})


def load_state(path: Path, opt, fingerprint: dict, what: str) -> tuple[dict, dict]:
    """(tensors by name, JSON state) of a `save_state` file, the optimizer restored; RetrofitError when
    it was written with other options (`fingerprint`; `what` names the stage in the message)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["state"])
    if meta.get("fingerprint") != fingerprint:
        raise RetrofitError(f"{path} was made with {what} options {meta.get('fingerprint')}; this run asks "
                            f"{fingerprint}: rerun with the same options or use another --out")
    tensors = load_file(str(path))
    opt.load_state_dict(optimizer_state_dict(tensors, meta, "optim."))
    return {k[len("param."):]: v for k, v in tensors.items() if k.startswith("param.")}, meta


def resume(path: Path, params: dict, opt, fingerprint: dict, what: str) -> dict | None:
    """The JSON state of the state file at `path` (its "step" among it), with `params` (the live
    tensors, by name) and the optimizer set from it; None when there is no file."""
    if not path.is_file():
        return None
    saved, meta = load_state(path, opt, fingerprint, what)
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(saved[k])
    return meta


def train_steps(step: Callable[[int], None], path: Path, params: dict, opt, state: dict, start: int, steps: int,
                every: int, budget: float = math.inf, on_stop: Callable[[], None] | None = None) -> tuple[int, int]:
    """Call `step(s)` for s = start, start + 1, ... (each one optimizer step) until `steps` steps are
    done or `budget` calls made; the state file `path` (`params`, `opt`, the step, `state`) written
    every `every` steps, at the last step and when the budget is spent. On SIGINT/SIGTERM the step
    in progress finishes, the state is saved, `on_stop` runs and Interrupted names `path` and the
    step. Returns (steps done, steps run by this call)."""
    s, ran = start, 0
    with graceful():
        while s < steps and ran < budget:
            step(s)
            s += 1
            ran += 1
            if s % every == 0 or s == steps or ran >= budget:
                save_state(path, params, opt, s, state)
            if requested() is not None and s < steps:
                save_state(path, params, opt, s, state)
                if on_stop is not None:
                    on_stop()
                raise Interrupted(requested(), f"{path} stopped after step {s} of {steps}; rerun the same "
                                               f"command to resume")
    return s, ran
