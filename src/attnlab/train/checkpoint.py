"""Checkpoints: model and optimizer tensors in safetensors, everything else in a JSON state.

Layout inside a run folder::

    checkpoints/
      step_000100/  model.safetensors  optimizer.safetensors  state.json
      step_000200/  ...
      latest        # one line: the name of the newest complete checkpoint

A checkpoint is written into a hidden temporary folder beside the others; every file is
fsynced, the folder is renamed into place (atomic on POSIX), and only then is `latest`
replaced (temp file + fsync + os.replace). Older checkpoints are pruned after that. So a
kill at any moment leaves `latest` pointing at a complete checkpoint: the previous one
until the new one is entirely on disk.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, load_model, save_file, save_model

LATEST = "latest"
_PREFIX = "step_"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _write_text_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


# --------------------------------------------------------------------------- RNG state


def capture_rng() -> dict:
    """The states of Python's, NumPy's and torch's generators (CPU and CUDA) as JSON values."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    out = {
        "python": [py_state[0], list(py_state[1]), py_state[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return out


def restore_rng(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


# --------------------------------------------------------------------------- optimizer <-> flat tensors


def _optimizer_to_flat(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Split an optimizer state_dict into named tensors and a JSON-able remainder."""
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for idx, per_param in sd["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{idx}.{key}"] = value.detach().contiguous().cpu()
            else:
                scalars[f"{idx}.{key}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _optimizer_from_flat(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict] = {}
    for name, value in list(tensors.items()) + list(meta["scalars"].items()):
        idx, key = name.split(".", 1)
        state.setdefault(int(idx), {})[key] = value
    groups = [{k: (tuple(v) if isinstance(v, list) and k != "params" else v) for k, v in g.items()} for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


# --------------------------------------------------------------------------- save / load


def checkpoint_name(step: int) -> str:
    return f"{_PREFIX}{step:06d}"


def save_checkpoint(
    folder: str | os.PathLike,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    state: dict,
    keep: int = 2,
) -> Path:
    """Write checkpoint `step` atomically into `folder`, point `latest` at it, keep the newest `keep`.

    `state` is any JSON-able dict (the trainer puts the data position, scheduler, config and
    RNG states there); "step" is added to it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / checkpoint_name(step)
    if final.exists() and latest_checkpoint(folder) == final:
        return final  # this step is already saved and current
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=folder))
    try:
        save_model(model, str(tmp / "model.safetensors"))
        files = ["model.safetensors"]
        payload = dict(state, step=step)
        if optimizer is not None:
            tensors, meta = _optimizer_to_flat(optimizer)
            save_file(tensors, str(tmp / "optimizer.safetensors"))
            files.append("optimizer.safetensors")
            payload["optimizer"] = meta
        with open(tmp / "state.json", "w") as f:
            json.dump(payload, f)
        files.append("state.json")
        for name in files:
            _fsync_file(tmp / name)
        _fsync_dir(tmp)
        if final.exists():  # a stale copy no pointer refers to (e.g. left by a killed run)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_text_atomic(folder / LATEST, final.name + "\n")
    _prune(folder, keep, final)
    return final


def _prune(folder: Path, keep: int, current: Path) -> None:
    done = sorted(p for p in folder.glob(f"{_PREFIX}*") if p.is_dir())
    for old in done[:-keep] if keep > 0 else done:
        if old != current:
            shutil.rmtree(old, ignore_errors=True)
    for stale in folder.glob(f".tmp-{_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)


def _complete(path: Path) -> bool:
    return (path / "state.json").is_file() and (path / "model.safetensors").is_file()


def latest_checkpoint(folder: str | os.PathLike) -> Path | None:
    """The checkpoint `latest` names; if that file is missing, the newest complete one."""
    folder = Path(folder)
    pointer = folder / LATEST
    if pointer.is_file():
        target = folder / pointer.read_text().strip()
        if target.name and _complete(target):
            return target
    candidates = sorted(p for p in folder.glob(f"{_PREFIX}*") if p.is_dir() and _complete(p))
    return candidates[-1] if candidates else None


def load_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    device: str | torch.device = "cpu",
) -> dict:
    """Load a checkpoint folder (or a checkpoints folder, taking its latest) into `model`
    and `optimizer`; return the JSON state. Raises FileNotFoundError when there is none."""
    path = Path(path)
    if not _complete(path):
        found = latest_checkpoint(path)
        if found is None:
            raise FileNotFoundError(f"no complete checkpoint in {str(path)!r}")
        path = found
    missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=True, device=str(device))
    with open(path / "state.json") as f:
        state = json.load(f)
    if optimizer is not None:
        if "optimizer" not in state:
            raise FileNotFoundError(f"checkpoint {str(path)!r} holds no optimizer state")
        tensors = load_file(str(path / "optimizer.safetensors"), device=str(device))
        optimizer.load_state_dict(_optimizer_from_flat(tensors, state["optimizer"]))
    state["path"] = str(path)
    return state
