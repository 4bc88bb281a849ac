"""Independent runs in worker processes: what `attnlab sweep --jobs N` and `attnlab retrofit trial
--jobs N` share.

Workers are spawned (no fork of a process holding threads and open models), die with the parent
(Linux), and run in a session of their own, so a terminal's Ctrl-C reaches the parent alone; the
parent passes one SIGINT/SIGTERM on to every worker, each finishes its step, checkpoints and
stops, queued runs are not started, and `interrupt.Interrupted` is raised in the parent. A second
signal ends the parent at once, and its workers with it.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Callable, Sequence

from attnlab import interrupt


def worker_init(parent: int) -> None:
    """A pool worker dies with its parent (Linux), so a killed parent leaves no run going; it runs in
    a session of its own and stops on the first signal its parent passes on."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        os._exit(1)
    try:
        os.setsid()
    except OSError:
        pass
    interrupt.install()


def run_pool(fn: Callable, args: Sequence[tuple], jobs: int, *, on_done: Callable[[int], None] | None = None,
             stopped: Callable[[], str] = lambda: "stopped") -> None:
    """fn(*args[i]) for every i in min(jobs, len(args)) spawned workers (fn must be importable at
    module level). on_done(i) runs here as each call finishes. The first failure stops the queued
    calls and is raised once the running ones end; after a signal, `interrupt.check(stopped)` raises
    Interrupted with stopped()'s message."""
    import multiprocessing as mp

    if not args:
        return
    pool = ProcessPoolExecutor(max_workers=min(jobs, len(args)), mp_context=mp.get_context("spawn"),
                               initializer=worker_init, initargs=(os.getpid(),))

    def forward(signum: int) -> None:
        for proc in list((getattr(pool, "_processes", None) or {}).values()):
            try:
                os.kill(proc.pid, signum)
            except (ProcessLookupError, AttributeError):
                pass

    failure: BaseException | None = None
    with interrupt.graceful(on_signal=forward):
        futures = {pool.submit(fn, *a): i for i, a in enumerate(args)}
        try:
            for fut in as_completed(futures):
                if interrupt.requested() is not None:
                    for f in futures:
                        f.cancel()
                if fut.cancelled():
                    continue
                try:
                    fut.result()
                except interrupt.Interrupted:
                    continue
                except BaseException as e:  # a run that failed: stop the others, then report it
                    if failure is None:
                        failure = e
                        for f in futures:
                            f.cancel()
                    continue
                if on_done is not None:
                    on_done(futures[fut])
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        if failure is not None:
            raise failure
        interrupt.check(stopped)
