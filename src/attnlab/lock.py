"""One writer per folder: an exclusive OS file lock on every folder attnlab writes.

A run folder, a sweep's or a trial's output, a search output with its capture cache and an
export each belong to one process while it writes them. The lock is `flock` on the file
`FOLDER/.attnlab.lock`, which also records who holds it (pid and command). The kernel releases
it when the process dies, however it dies, so a crash or a SIGKILL never leaves a stale lock;
the file itself stays, holding the last holder's name, and means nothing once unlocked.

    with FolderLock("runs/tiny"):       # FolderBusy (one line, naming the holder) if taken
        ...write...

A folder that must stay empty until it appears whole (an export, renamed into place) is locked
`beside=True`: the lock file is `PARENT/.NAME.attnlab.lock`, removed on release.

Locks are re-entrant within a process (the sweep holds a run's lock while the trainer it calls
takes it again). Readers (`attnlab eval` of a run in progress) take no lock. `check_free` asks
whether a folder is taken without creating anything, so a command can refuse before any work.
This module imports nothing heavy: a lock can be tested in a bare subprocess.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

LOCK_FILE = ".attnlab.lock"

try:  # POSIX; elsewhere folders are not locked (documented in docs/guide/input-policy.md)
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

_held: dict[str, list] = {}  # real path of the folder -> [fd, depth, lock file to remove on release]


class FolderBusy(RuntimeError):
    """Another process holds the folder's lock. Reported as one line with exit status 2."""

    def __init__(self, folder: str | os.PathLike, holder: dict | None):
        self.folder, self.holder = str(folder), holder or {}
        who = (f"process {self.holder.get('pid', '?')} ({self.holder.get('command') or 'unknown command'})"
               if self.holder else "another process")
        super().__init__(f"folder {self.folder!r} is being written by {who}; wait for it to finish or stop it, "
                         f"or choose another folder")

    def __reduce__(self):
        return (FolderBusy, (self.folder, self.holder))


def current_command() -> str:
    """The command line recorded as a lock's holder: `$ATTNLAB_COMMAND` (set by the CLI, inherited
    by sweep workers), else this process's argv."""
    return os.environ.get("ATTNLAB_COMMAND") or " ".join([Path(sys.argv[0]).name if sys.argv else "python",
                                                          *sys.argv[1:]])


def _read_holder(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _lock_path(folder: Path, beside: bool) -> Path:
    return folder.parent / f".{folder.name}{LOCK_FILE}" if beside else folder / LOCK_FILE


def holder(folder: str | os.PathLike, beside: bool = False) -> dict | None:
    """{'pid', 'command'} of the process holding `folder`'s lock, or None when nobody does
    (this process's own locks count as free). Creates nothing."""
    path = _lock_path(Path(folder), beside)
    if fcntl is None or not path.is_file() or os.path.realpath(folder) in _held:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return _read_holder(path) or {}
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def check_free(folder: str | os.PathLike, beside: bool = False) -> None:
    """Raise FolderBusy when another process holds `folder`; writes nothing."""
    found = holder(folder, beside)
    if found is not None:
        raise FolderBusy(folder, found)


class FolderLock:
    """The exclusive lock on `folder` (created, with its parents, when acquired; with beside=True only
    its parent is created, and the lock file sits beside the folder)."""

    def __init__(self, folder: str | os.PathLike, beside: bool = False):
        self.folder, self.beside = Path(folder), beside
        self._key: str | None = None

    def acquire(self) -> "FolderLock":
        if self._key is not None:
            return self
        (self.folder.parent if self.beside else self.folder).mkdir(parents=True, exist_ok=True)
        key = os.path.realpath(self.folder)
        if key in _held:
            _held[key][1] += 1
            self._key = key
            return self
        path = _lock_path(self.folder, self.beside)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise FolderBusy(self.folder, _read_holder(path)) from None
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps({"pid": os.getpid(), "command": current_command()}) + "\n").encode())
        _held[key] = [fd, 1, path if self.beside else None]
        self._key = key
        return self

    def release(self) -> None:
        key, self._key = self._key, None
        if key is None or key not in _held:
            return
        _held[key][1] -= 1
        if _held[key][1] == 0:
            fd, _, remove = _held.pop(key)
            if remove is not None:  # still held: a process that opened it meanwhile fails, and re-checks
                remove.unlink(missing_ok=True)
            os.close(fd)  # closing the only descriptor releases the flock

    @property
    def held(self) -> bool:
        return self._key is not None

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
