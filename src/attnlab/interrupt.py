"""Stop at a step boundary on SIGINT / SIGTERM, save, and say how to resume.

Long loops (the trainer, `attnlab search train`, sweeps and trials) run inside `graceful()`.
The first SIGINT (Ctrl-C) or SIGTERM (`kill`, a cluster scheduler's preemption notice) only
records the signal; the loop finishes its current optimizer step, writes a checkpoint and
raises `Interrupted`, which the CLI reports as one line and exit status 128 + signal (130 for
SIGINT, 143 for SIGTERM). A second signal exits at once with that status: checkpoints are
written atomically, so the previous one stays intact.

    with graceful():
        for step in ...:
            train_step()
            if requested():
                save()
                raise Interrupted(requested(), f"{run_dir}: stopped after step {step}")

Handlers are installed by the outermost `graceful()` in the main thread (elsewhere it does
nothing, and the loop runs as before); nested uses share them. `on_signal` callbacks run inside
the handler (a sweep uses one to pass the signal on to its worker processes).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
from typing import Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_depth = 0
_signum: int | None = None
_previous: dict[int, object] = {}
_callbacks: list[Callable[[int], None]] = []
_wakeup: tuple | None = None  # (reader, writer, the wakeup fd it replaced)


class Interrupted(KeyboardInterrupt):
    """A loop stopped on SIGINT/SIGTERM after saving its state; `where` says where it stopped."""

    def __init__(self, signum: int, where: str = ""):
        super().__init__(signum, where)
        self.signum, self.where = int(signum), where

    @property
    def signame(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        return f"interrupted by {self.signame}" + (f": {self.where}" if self.where else "")


def requested() -> int | None:
    """The signal number received since the outermost `graceful()` began, or None."""
    return _signum


def check(where: str | Callable[[], str] = "") -> None:
    """Raise Interrupted when a stop was requested (`where` may be a function, called only then)."""
    if _signum is not None:
        raise Interrupted(_signum, where() if callable(where) else where)


def _on_signal(signum: int) -> None:
    global _signum
    if _signum is not None:  # the second signal: stop now, the last checkpoint stays as it is
        try:
            os.write(2, f"\n{signal.Signals(signum).name} again: stopped at once; the previous checkpoint is "
                        f"intact\n".encode())
        finally:
            os._exit(128 + signum)
    _signum = signum
    for callback in list(_callbacks):
        try:
            callback(signum)
        except Exception as e:  # a callback must never turn the first signal into a crash
            print(f"warning: while passing {signal.Signals(signum).name} on: {e}", file=sys.stderr)


def _handler(signum, frame) -> None:
    """The Python-level handler. The work is done by the watcher thread, which hears every delivery
    through the wakeup fd at once, even while the main thread is inside a long C++ call (a backward
    pass), where Python handlers wait and two quick signals would merge into one call."""


def _watch(sock: socket.socket) -> None:
    while True:
        try:
            data = sock.recv(64)
        except OSError:
            return
        if not data:
            return
        for signum in data:
            if signum in SIGNALS:
                _on_signal(signum)


def install() -> None:
    """Install the handlers for the rest of this process's life (a sweep's worker processes)."""
    global _depth, _signum, _wakeup
    if threading.current_thread() is not threading.main_thread():
        return
    if _depth == 0:
        _signum = None
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        old_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        _wakeup = (reader, writer, old_fd)
        threading.Thread(target=_watch, args=(reader,), name="attnlab-signals", daemon=True).start()
        for s in SIGNALS:
            _previous[s] = signal.signal(s, _handler)
    _depth += 1


def _uninstall() -> None:
    global _depth, _wakeup, _signum
    _depth -= 1
    if _depth == 0:  # the request ends with the block: later checks (an evaluation after it) run on
        _signum = None
        for s, old in _previous.items():
            signal.signal(s, old)
        _previous.clear()
        reader, writer, old_fd = _wakeup
        signal.set_wakeup_fd(old_fd)
        writer.close()
        reader.close()  # the watcher's recv fails and it ends
        _wakeup = None


def exit_on_next_signal() -> None:
    """From now on SIGINT/SIGTERM end the process at once (a command that has saved its state and
    is on its way out: a late second signal must not turn into a traceback during shutdown)."""
    if threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, lambda signum, frame: os._exit(128 + signum))


@contextlib.contextmanager
def graceful(on_signal: Callable[[int], None] | None = None):
    """Within this block, SIGINT/SIGTERM set `requested()` instead of raising (see the module doc).
    The outermost block clears the request when it starts and when it ends."""
    main = threading.current_thread() is threading.main_thread()
    if main:
        install()
    if on_signal is not None:
        _callbacks.append(on_signal)
    try:
        yield
    finally:
        if on_signal is not None:
            _callbacks.remove(on_signal)
        if main:
            _uninstall()
