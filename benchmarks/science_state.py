"""The run a science batch cuts at its cap, carried to the next batch: `pack` puts the run folder's newest
checkpoint, logs and config in a tar split into parts small enough to come back from the GPU machine,
`unpack` checks the parts (each and the whole, by SHA-256) and rebuilds the folder. STATE_JSON, beside
the parts, describes them (`read_state`).
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

MIB = 1 << 20
PART_MIB = 15.0  # a part of the state, under the 16 MiB a returned file may have
LIMIT_MIB = 15.9  # the largest part written when PART_MIB would need too many
STATE_JSON = "state.json"


def sha256(data: bytes | Path) -> str:
    """The SHA-256 (hex) of bytes or of a file's contents, as the manifests and state.json hold it."""
    h = hashlib.sha256()
    if isinstance(data, Path):
        with open(data, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    else:
        h.update(data)
    return h.hexdigest()


def pack(run_dir: Path, name: str, out: Path, part_mib: float, max_parts: int | None = None) -> dict:
    """The run folder's newest checkpoint, logs and config as a tar in parts OUT/state.tar.NNN of
    `part_mib` MiB (larger, up to LIMIT_MIB, where more than `max_parts` parts would be needed); returns
    their description (what STATE's state.json holds). ValueError when it cannot fit."""
    from attnlab.train.checkpoint import latest_checkpoint
    from attnlab.train.resume import CKPT_DIR

    ckpt = latest_checkpoint(run_dir / CKPT_DIR)
    if ckpt is None:
        raise ValueError(f"{run_dir} has no checkpoint to carry")
    step = json.loads((ckpt / "state.json").read_text())["step"] if (ckpt / "state.json").is_file() else None
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for p in sorted(run_dir.rglob("*")):
            rel = p.relative_to(run_dir)
            if not p.is_file() or p.name.startswith(".") or (rel.parts[0] == CKPT_DIR and len(rel.parts) > 2
                                                              and rel.parts[1] != ckpt.name):
                continue
            info = tar.gettarinfo(str(p), arcname=rel.as_posix())
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            with open(p, "rb") as f:
                tar.addfile(info, f)
    data = buf.getvalue()
    size = max(1, int(part_mib * MIB))
    if max_parts and -(-len(data) // size) > max_parts:
        size = -(-len(data) // max_parts)
        if size > LIMIT_MIB * MIB:
            raise ValueError(f"{run_dir}: {len(data):,} bytes do not fit {max_parts} parts of {LIMIT_MIB} MiB")
    parts = []
    for i in range(0, len(data), size):
        part = out / f"state.tar.{i // size:03d}"
        part.write_bytes(data[i:i + size])
        parts.append({"name": part.name, "bytes": part.stat().st_size, "sha256": sha256(part)})
    return {"run": name, "step": step, "checkpoint": ckpt.name, "bytes": len(data), "sha256": sha256(data), "parts": parts}


def check_parts(state: dict, folder: Path) -> bytes:
    """The parts under FOLDER joined, each part and the whole checked against STATE (their sizes and
    SHA-256); SystemExit naming the first that differs."""
    data = b""
    for part in state["parts"]:
        blob = (folder / part["name"]).read_bytes()
        if len(blob) != part["bytes"] or sha256(blob) != part["sha256"]:
            raise SystemExit(f"state part {folder / part['name']} is damaged: {len(blob)} bytes, expected {part['bytes']} "
                             f"with sha256 {part['sha256'][:12]}")
        data += blob
    if sha256(data) != state["sha256"]:
        raise SystemExit(f"state {folder}: its parts join to another file than state.json names")
    return data


def unpack(state: dict, folder: Path, run_dir: Path) -> None:
    """Parts under FOLDER, checked (each part and the whole), extracted into RUN_DIR."""
    data = check_parts(state, folder)
    run_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        for m in tar.getmembers():
            if not m.isfile() or m.name.startswith("/") or ".." in Path(m.name).parts:
                raise SystemExit(f"state {folder}: member {m.name!r} is not a file inside the run folder")
        tar.extractall(run_dir, filter="data")


def read_state(state_dir: Path) -> dict | None:
    try:
        return json.loads((state_dir / STATE_JSON).read_text())
    except (OSError, ValueError):
        return None
