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


def _file_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


_FILE_MODE = _file_mode()


class WriteError(RuntimeError):
    """A file could not be written (disk full, permission, a file-size limit). One line naming the
    file; whatever that file replaced is still in place, since writes go through a temporary file."""

    def __init__(self, path: str | os.PathLike, error: BaseException | str, what: str = "file"):
        self.path, self.what = str(path), what
        self.reason = error if isinstance(error, str) else (getattr(error, "strerror", None) or str(error))
        super().__init__(f"could not write {what} {self.path!r}: {self.reason}")

    def __reduce__(self):
        return (WriteError, (self.path, self.reason, self.what))


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` through a temporary file + fsync + rename. A failure raises WriteError
    naming `path`, leaves the old file (if any) untouched and removes the temporary file."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _FILE_MODE)  # mkstemp's 0600 would make results unreadable to others
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise WriteError(path, e) from e
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """`atomic_write_bytes` for UTF-8 text."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_save_tensors(path: str | os.PathLike, tensors: dict, metadata: dict | None = None) -> Path:
    """`safetensors.torch.save_file` through a temporary file + fsync + rename: WriteError naming
    `path` on failure (the old file, if any, untouched; the temporary file removed)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata=metadata)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, SafetensorError) as e:
        tmp.unlink(missing_ok=True)
        raise WriteError(path, e) from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
