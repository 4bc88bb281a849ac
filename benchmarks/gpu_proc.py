"""The GPU check's processes: each part in a session of its own under a hard time limit, every process it
starts marked in its environment, and all of them ended before the next part starts.

A part is killed as one process group (SIGTERM, then SIGKILL); what left the group (a pytest worker's
own session, a compile worker started with setsid) still carries the mark `ATTNLAB_GPU_CHECK=<token>`
in /proc/PID/environ, and what lost its parent is re-parented to the check (a child subreaper), so
`sweep` finds and kills both. Linux only (the GPU machines and the CPU smoke mode)."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

MARK = "ATTNLAB_GPU_CHECK"
ROOT = Path(__file__).resolve().parents[1]


def become_subreaper() -> bool:
    """Orphaned descendants are re-parented to this process instead of init (prctl
    PR_SET_CHILD_SUBREAPER), so a part's stray processes stay findable. Returns whether it took."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def spawn(cmd: list[str], env: dict, cap_s: float, **kw) -> subprocess.Popen:
    """`cmd` in a new session (its own process group, pgid = the returned pid), under coreutils'
    `timeout` a few seconds past `cap_s` as well: the cap holds even if the caller dies."""
    if shutil.which("timeout"):
        cmd = ["timeout", "--kill-after=5", f"{cap_s + 5:.0f}", *cmd]
    return subprocess.Popen(cmd, env=env, cwd=kw.pop("cwd", ROOT), start_new_session=True, **kw)


def _state(pid: int) -> str | None:
    """The process's state letter (R, S, D, Z, ...), None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2]


def alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z")


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    members = [int(d) for d in os.listdir("/proc") if d.isdigit() and _pgid(int(d)) == pgid]
    return any(alive(p) for p in members)


def _pgid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[2])


def kill_group(pgid: int, grace_s: float = 2.0) -> None:
    """SIGTERM to the whole group, SIGKILL to what is left after `grace_s`; returns once none of it runs."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        end = time.time() + wait
        while time.time() < end and group_alive(pgid):
            time.sleep(0.05)
        if not group_alive(pgid):
            return


def marked(prefix: str) -> list[int]:
    """Live processes whose environment holds ATTNLAB_GPU_CHECK=<prefix...>, this one excepted."""
    key, me, found = f"{MARK}={prefix}".encode(), os.getpid(), []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            env = Path(f"/proc/{d}/environ").read_bytes()
        except OSError:
            continue
        if any(e.startswith(key) for e in env.split(b"\0")) and alive(int(d)):
            found.append(int(d))
    return found


def reap() -> None:
    """Collect the exit status of every finished child (orphans re-parented here included)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def orphans() -> list[int]:
    """Live children of this process: after a part is waited for, only its re-parented strays."""
    me, found = os.getpid(), []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == me and alive(int(d)):
                found.append(int(d))
    return found


def sweep(prefix: str, wait_s: float = 10.0) -> tuple[list[int], list[int]]:
    """Kill every process of the part (`marked(prefix)`) and every orphan left to this process; returns
    (their pids, those still running after `wait_s` of SIGKILL: none unless one is stuck in the kernel)."""
    found = sorted(set(marked(prefix)) | set(orphans()))
    for sig, wait in ((signal.SIGTERM, 1.0), (signal.SIGKILL, wait_s)):
        for pid in found:
            if alive(pid):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        end = time.time() + wait
        while time.time() < end and any(alive(p) for p in found):
            time.sleep(0.05)
            reap()
    reap()
    return found, [p for p in found if alive(p)]


def gpu_pids() -> list[int]:
    """Processes nvidia-smi lists on the GPU ([] without nvidia-smi or a GPU)."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        p = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [int(x) for x in p.stdout.split() if x.isdigit()]
