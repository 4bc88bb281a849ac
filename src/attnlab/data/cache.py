"""Where attnlab keeps files it derives locally (trained BPE vocabularies), and atomic writes.

The cache folder is `$ATTNLAB_CACHE` when set, else `~/.cache/attnlab`. Files are written
to a temporary name in the same folder and renamed into place, so a reader (or a second
process writing the same file) never sees a half-written file.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def default_cache_dir() -> Path:
    """`$ATTNLAB_CACHE`, or `~/.cache/attnlab` when it is unset or empty."""
    env = os.environ.get("ATTNLAB_CACHE", "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "attnlab"


def resolve_cache_dir(cache_dir: str | os.PathLike | None) -> Path:
    """The given folder, or the default one; created if missing."""
    path = default_cache_dir() if cache_dir is None else Path(cache_dir).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` through a temporary file + fsync + rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """`atomic_write_bytes` for UTF-8 text."""
    return atomic_write_bytes(path, text.encode("utf-8"))
