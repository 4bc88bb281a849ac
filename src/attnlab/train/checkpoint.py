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

state.json also records the size and SHA-256 of each safetensors file. Loading checks them
(and that state.json parses) before reading any tensor. A checkpoint that fails the check
raises `CheckpointError` naming the damaged file; it is never skipped in favour of an older
one. Because writing is atomic, a damaged checkpoint is not what a killed run leaves behind:
it is later damage (a failing disk, a partial copy, an edit), and silently training on from an
older state would hide it and discard steps. The error names the previous intact checkpoint,
when there is one, so resuming from it is one explicit `rm -r` away.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, load_model, save_file, save_model

from attnlab.data.cache import WriteError, atomic_write_text

LATEST = "latest"
_PREFIX = "step_"


class CheckpointError(ValueError):
    """A checkpoint on disk cannot be used: a file is truncated, corrupted or unreadable."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _digest(path: Path) -> dict:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def _write_text_atomic(path: Path, text: str) -> None:
    atomic_write_text(path, text)
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


def optimizer_tensors(optimizer: torch.optim.Optimizer | dict, prefix: str = "") -> tuple[dict[str, torch.Tensor], dict]:
    """An optimizer's state_dict (or the optimizer's) as named CPU tensors "<prefix><param index>.<key>"
    and a JSON-able remainder {"param_groups", "scalars"} (its non-tensor values): the one flat form of
    optimizer state in attnlab's files (training checkpoints, retrofit and search state files)."""
    sd = optimizer if isinstance(optimizer, dict) else optimizer.state_dict()
    tensors, scalars = {}, {}
    for idx, per_param in sd["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{prefix}{idx}.{key}"] = value.detach().to("cpu", copy=True).contiguous()
            else:
                scalars[f"{idx}.{key}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_state_dict(tensors: dict[str, torch.Tensor], meta: dict, prefix: str = "") -> dict:
    """The state_dict that `optimizer_tensors` flattened (tensors whose names lack `prefix` are
    ignored), for `optimizer.load_state_dict`; list-valued group options come back as tuples."""
    state: dict[int, dict] = {}
    flat = [(k[len(prefix):], v) for k, v in tensors.items() if k.startswith(prefix)]
    for name, value in flat + list(meta.get("scalars", {}).items()):
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
    optimizer: torch.optim.Optimizer | dict | None,
    state: dict,
    keep: int = 2,
) -> Path:
    """Write checkpoint `step` atomically into `folder`, point `latest` at it, keep the newest `keep`.
    `optimizer`: the optimizer, its state_dict, or None (weights only).

    `state` is any JSON-able dict (the trainer puts the data position, scheduler, config and
    RNG states there); "step" is added to it. A write that fails part-way (disk full, permission)
    raises WriteError naming the file; the temporary folder is removed and `latest` still names
    the previous checkpoint, which stays the one resume and eval use."""
    folder = Path(folder)
    final = folder / checkpoint_name(step)
    current, tmp = folder, None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if final.exists() and latest_checkpoint(folder) == final:
            return final  # this step is already saved and current
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=folder))
        current = final / "model.safetensors"
        save_model(model, str(tmp / "model.safetensors"))
        files = ["model.safetensors"]
        payload = dict(state, step=step)
        if optimizer is not None:
            current = final / "optimizer.safetensors"
            tensors, meta = optimizer_tensors(optimizer)
            save_file(tensors, str(tmp / "optimizer.safetensors"))
            files.append("optimizer.safetensors")
            payload["optimizer"] = meta
        payload["files"] = {name: _digest(tmp / name) for name in files}
        current = final / "state.json"
        with open(tmp / "state.json", "w") as f:
            json.dump(payload, f)
        files.append("state.json")
        for name in files:
            current = final / name
            _fsync_file(tmp / name)
        current = final
        _fsync_dir(tmp)
        if final.exists():  # a stale copy no pointer refers to (e.g. left by a killed run)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(folder)
        current = folder / LATEST
        _write_text_atomic(folder / LATEST, final.name + "\n")
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, WriteError):
            raise _write_failed(folder, current, e.reason) from e
        if isinstance(e, (OSError, SafetensorError)):
            raise _write_failed(folder, current, getattr(e, "strerror", None) or str(e)) from e
        raise
    _prune(folder, keep, final)
    return final


def _write_failed(folder: Path, file: Path, reason: str) -> WriteError:
    kept = latest_checkpoint(folder)
    then = (f"; the previous checkpoint {kept.name} is still the latest" if kept is not None
            else "; no earlier checkpoint exists")
    return WriteError(file, f"{reason}{then}", what="checkpoint file")


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


def find_checkpoint(path: str | os.PathLike) -> Path:
    """`path` itself when it is a complete checkpoint folder, else the latest checkpoint in it
    (a checkpoints folder). Raises FileNotFoundError when there is none."""
    path = Path(path)
    if _complete(path):
        return path
    found = latest_checkpoint(path) if path.is_dir() else None
    if found is None:
        raise FileNotFoundError(f"no complete checkpoint in {str(path)!r}")
    return found


def _damaged(file: Path, reason: str) -> CheckpointError:
    folder = file.parent
    older = sorted(p for p in folder.parent.glob(f"{_PREFIX}*") if p.is_dir() and _complete(p) and p.name < folder.name)
    hint = (f"delete {str(folder)!r} to resume from the previous checkpoint {older[-1].name}, or restore the file"
            if older else "restore the file, or start the run afresh (run.overwrite=true)")
    return CheckpointError(f"checkpoint file {str(file)!r} is damaged: {reason}; {hint}")


def read_state(path: str | os.PathLike) -> dict:
    """The JSON state of checkpoint folder `path`, without checking or loading its tensors."""
    file = Path(path) / "state.json"
    try:
        state = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _damaged(file, f"not readable JSON ({e})") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise _damaged(file, "not a checkpoint state (no integer 'step')")
    return state


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """Check checkpoint folder `path` before anything is loaded from it and return its JSON state.

    state.json must parse; each safetensors file must exist and match the size and SHA-256 that
    state.json recorded (checkpoints written before those were recorded: its header must parse
    and cover the whole file). Raises CheckpointError naming the first damaged file; a damaged
    checkpoint is never replaced by an older one behind the caller's back (see the module docstring)."""
    path = Path(path)
    state = read_state(path)
    names = ["model.safetensors"] + (["optimizer.safetensors"] if "optimizer" in state else [])
    recorded = state.get("files") if isinstance(state.get("files"), dict) else {}
    for name in names:
        file = path / name
        if not file.is_file():
            raise _damaged(file, "the file is missing")
        want = recorded.get(name)
        if isinstance(want, dict):
            got = _digest(file)
            if got["bytes"] != want.get("bytes"):
                raise _damaged(file, f"{got['bytes']} bytes, but {want.get('bytes')} were written")
            if got["sha256"] != want.get("sha256"):
                raise _damaged(file, "its SHA-256 differs from the one recorded when it was written")
            continue
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise _damaged(file, f"not a readable safetensors file ({e})") from None
    return state


def load_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    device: str | torch.device = "cpu",
) -> dict:
    """Load a checkpoint folder (or a checkpoints folder, taking its latest) into `model`
    and `optimizer`; return the JSON state. Raises FileNotFoundError when there is none, and
    CheckpointError naming the file when it is truncated or corrupted (checked before any
    tensor is loaded, so `model` and `optimizer` are untouched then). There is no fallback to
    an older checkpoint: see the module docstring."""
    path = find_checkpoint(path)
    state = verify_checkpoint(path)
    if optimizer is not None and "optimizer" not in state:
        raise FileNotFoundError(f"checkpoint {str(path)!r} holds no optimizer state")
    file = path / "model.safetensors"
    try:
        load_model(model, str(file), strict=True, device=str(device))
        if optimizer is not None:
            optimizer.load_state_dict(optimizer_state(path, state, device))
    except SafetensorError as e:
        raise _damaged(file, f"not a readable safetensors file ({e})") from None
    state["path"] = str(path)
    return state


def optimizer_state(path: str | os.PathLike, state: dict, device: str | torch.device = "cpu") -> dict:
    """The optimizer's state_dict stored in checkpoint folder `path` (`state`: its JSON state, as
    `load_checkpoint` or `verify_checkpoint` returns it)."""
    file = Path(path) / "optimizer.safetensors"
    try:
        return optimizer_state_dict(load_file(str(file), device=str(device)), state["optimizer"])
    except SafetensorError as e:
        raise _damaged(file, f"not a readable safetensors file ({e})") from None
