"""The GPU check's schedule (benchmarks/gpu_check.sh runs it): its parts in order of what is still unknown
and worth most, each under a hard cap, one after another, none started while a process of the one
before it is alive.

    python benchmarks/gpu_check.py OUT [MINUTES] [--smoke] [--resume DIR] [--parts a,b]

1. tests: the cuda tests that have never passed on a GPU (benchmarks/gpu_tests.py);
2. train: training throughput, compiled, against the plain PyTorch baseline (benchmarks/gpu_train.py);
3. kernels: forward + backward at 8K against SDPA flash, flash-linear-attention's paths after the
   others, pinned to their first autotuning config that runs (benchmarks/gpu.py --parts speed);
4. decode: the windowed model's step from 4K to 128K (benchmarks/decode_speed.py);
5. recheck: the cuda tests that passed on a GPU before, for regressions;
6. errors: the kernel-error table against float64, paths no committed check measured first.

Parts 1-4 get a share of MINUTES each plus what the parts before them left unused; 5 and 6 only what
is left. A part runs in a session of its own, its processes marked in their environment
(benchmarks/gpu_proc.py); at its cap the whole group is killed and every marked or orphaned process
left is killed before the next part. A row that outlives its own cap (named in its part's JSON while it
runs, benchmarks/gpu_rows.py), or whose process dies during it, is recorded as such, and the part
starts again from the rows it has.
Run again on the same OUT, the check measures only what the files there lack (parts that finished
are not started); --resume DIR first copies an earlier check's files (its measured rows and passed
tests) into an empty OUT. OUT/gpu_check.json: each run's parts with cap, seconds, outcome, the rows
killed and the processes swept; OUT/gpu_check.log: everything printed.

--smoke: every part's code path on the CPU at tiny sizes (stand-in tests, eager models, Triton's
interpreter), and after the tests a part that overruns its cap on purpose (a pytest with two xdist workers, each
holding a child in a session of its own) to show the kill of a whole part.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import gpu_proc  # noqa: E402
from gpu_rows import complete, load, record_kill, save  # noqa: E402

PY = sys.executable
SPEED_PATHS = ("sdpa-flash,hybrid-gaussian/triton,hybrid-cauchy/triton,goat/triton,principled/triton,"
               "hybrid-cauchy-window16+32/triton,gla/fla,ssd/fla,hybrid-gaussian-window16+32/triton,"
               "hybrid-gaussian/flex,hybrid-cauchy/flex,goat/flex")
SMOKE_PATHS = "sdpa-flash,hybrid-gaussian/triton,principled/tiled,gla/fla"
ERROR_PATHS = SPEED_PATHS + ",softmax-ktotal/sdpa,cosformer/chunked,gla/chunked,ssd/chunked"
DECODE = dict(model="windowed", batch=1, contexts=(4096, 32768, 131072))
ROW_GRACE_S = 2.0  # past a row's cap before it is killed (its process writes the row itself if it can)


class Cut(Exception):
    """The check itself was stopped (SIGTERM or SIGINT: its command's time limit)."""


@dataclass
class Part:
    name: str
    share: float  # of the check's time; 0: only what the parts before it left
    argv: Callable[[float], list[str] | None]  # the command for a cap of s seconds; None: nothing left to do
    rows: Path | None = None  # the part's row file, whose running row the check watches
    cap_s: float | None = None  # a fixed cap instead of a share
    min_s: float = 20.0  # not started with less time than this


def measured_errors(history: Path) -> set[str]:
    """Paths with a bf16 error row in a gpu.json of the committed checks (`history`) or benchmarks/results."""
    files = [*Path(history).rglob("gpu.json"), HERE / "results" / "gpu.json"]
    return {e["path"] for f in files for e in (load(f) or {}).get("errors", [])
            if e.get("dtype") == "bfloat16" and e.get("rel_err") is not None}


def _decode_todo(path: Path, model: str, batch: int, contexts) -> list[int]:
    have = {(r.get("model"), r.get("batch"), r.get("context")) for r in (load(path) or {}).get("rows", [])}
    return [c for c in contexts if (model, batch, c) not in have]


OVERRUN_TEST = '''import os, subprocess, sys, time
from pathlib import Path
def _hold():  # a worker, and a child of it in a session of its own: both must die with the part
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    with open(Path(__file__).parent / "pids", "a") as fh:
        fh.write(f"{os.getppid()} {os.getpid()} {child.pid}\\n")
    time.sleep(600)
def test_holds_a():
    _hold()
def test_holds_b():
    _hold()
'''


def plan(out: Path, smoke: bool, history: Path) -> list[Part]:
    s = ["--smoke"] if smoke else []
    tests = out / "gpu_tests.json"

    def tests_argv(part: str, key: str) -> Callable[[float], list[str] | None]:
        def argv(cap: float) -> list[str] | None:
            if complete(tests, key):
                return None
            per_test = 6.0 if smoke else min(40.0, cap / 3)  # well under the part's cap
            return [PY, str(HERE / "gpu_tests.py"), "--out", str(tests), "--part", part, "--seconds", f"{cap:.0f}",
                    "--per-test", f"{per_test:.0f}", *s]
        return argv

    def train(cap: float) -> list[str] | None:
        if complete(out / "gpu_train.json"):
            return None
        rows = (["--models", "baseline,windowed,trainer", "--at-scale", "softmax", "--long", "windowed", "--row-cap", "30",
                 "--trainer-cap", "40"] if smoke else  # one row of each kind
                ["--models", "baseline,windowed,softmax,trainer,hybrid", "--at-scale", "softmax", "--long",
                 "baseline,windowed,softmax,hybrid", "--row-cap", "60", "--trainer-cap", "100"])
        return [PY, str(HERE / "gpu_train.py"), "--out", str(out / "gpu_train.json"), "--seconds", f"{cap:.0f}", *rows, *s]

    def kernels(part: str, paths: str, section: str) -> Callable[[float], list[str] | None]:
        def argv(cap: float) -> list[str] | None:
            if complete(out / "gpu.json", section):
                return None
            shapes = ["--T", "32", "--err-T", "16", "--rounds", "2", "--reps", "1"] if smoke else [
                "--T", "8192", "--err-T", "1024"]
            return [PY, str(HERE / "gpu.py"), "--parts", part, "--out", str(out / "gpu.json"), "--paths", paths,
                    "--seconds", f"{cap:.0f}", "--row-cap", "40", *shapes, *s]
        return argv

    def decode(cap: float) -> list[str] | None:
        model, batch, contexts = ("windowed", 2, (48,)) if smoke else (DECODE["model"], DECODE["batch"], DECODE["contexts"])
        todo = _decode_todo(out / "decode_speed_gpu.json", model, batch, contexts)
        if not todo:
            return None
        what = ["--smoke", "--methods", "exact,window"] if smoke else [
            "--device", "cuda", "--steps", "16", "--rounds", "3", "--warmup", "3", "--methods",
            "window_compiled,exact_compiled,window_ops_compiled,hf_static,exact", "--models", model, "--batches",
            str(batch), "--contexts", ",".join(map(str, todo)), "--window-max", "131072", "--learned-max", "0",
            "--max-hf-context", "131072"]
        return [PY, str(HERE / "decode_speed.py"), "--out", str(out / "decode_speed_gpu.json"), "--keep", *what]

    done_before = measured_errors(history)
    err_paths = ",".join(sorted((SMOKE_PATHS if smoke else ERROR_PATHS).split(","), key=lambda p: p in done_before))
    parts = [Part("tests", 0.22, tests_argv("tests", "cuda_tests")),
             Part("train", 0.36, train, rows=out / "gpu_train.json"),
             Part("kernels", 0.20, kernels("speed", SMOKE_PATHS if smoke else SPEED_PATHS, "rows"), rows=out / "gpu.json"),
             Part("decode", 0.12, decode),
             Part("recheck", 0.0, tests_argv("recheck", "recheck")),
             Part("errors", 0.0, kernels("errors", err_paths, "errors"), rows=out / "gpu.json", min_s=10.0)]
    if smoke:
        folder = out / "smoke" / "overrun"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "pytest.ini").write_text("[pytest]\n")
        (folder / "test_overrun.py").write_text(OVERRUN_TEST)
        overrun = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", str(folder)]
        shown = folder / "pids"  # written by its workers: once they ran, a rerun need not show the kill again
        # 20 s: on a loaded 2-core machine pytest and its two xdist workers took over 6 s to start, and the
        # cap killed them before they wrote their pids
        parts.insert(1, Part("overrun", 0.0, lambda cap: None if shown.exists() else overrun, cap_s=20.0, min_s=0.0))
    return parts


class Check:
    def __init__(self, out: Path, minutes: float, smoke: bool):
        self.out, self.smoke, self.total = out, smoke, 60 * minutes
        self.start = time.time()
        self.id = f"{os.getpid()}-{int(self.start)}"
        self.log = open(out / "gpu_check.log", "a", buffering=1)
        self.lock = threading.Lock()
        self.summary = load(out / "gpu_check.json") or {"runs": []}
        self.run = {"check": self.id, "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "minutes": minutes, "smoke": smoke, "host": os.uname().nodename,
                    "subreaper": gpu_proc.become_subreaper(), "parts": []}
        self.summary["runs"].append(self.run)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
            [str(HERE.parent / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
        if smoke:  # Triton's interpreter; the pure PyTorch CPU paths (no C++ build of attnlab's CPU kernels)
            self.env.update(TRITON_INTERPRET="1", ATTNLAB_NO_EXT="1", OMP_NUM_THREADS="1")
        self.current = None  # (the running part's process, its record)
        self.stopping = False

    def say(self, text: str) -> None:
        with self.lock:
            sys.stdout.write(text if text.endswith("\n") else text + "\n")
            sys.stdout.flush()
            self.log.write(text if text.endswith("\n") else text + "\n")

    def save(self) -> None:
        self.run["seconds"] = round(time.time() - self.start, 1)
        save(self.out / "gpu_check.json", self.summary)

    def wait_gpu_free(self) -> list[int]:
        """Before a part: wait (up to 30 s) while a live process still holds the GPU; returns those seen."""
        end, seen = time.time() + 30, []
        while (busy := [p for p in gpu_proc.gpu_pids() if gpu_proc.alive(p)]) and time.time() < end:
            seen = sorted(set(seen) | set(busy))
            time.sleep(0.5)
        return seen

    def part(self, part: Part, cap: float, held: list[int]) -> dict:
        rec = {"part": part.name, "cap_s": round(cap, 1), "launches": 0, "row_kills": [], "swept": []}
        if held:
            rec["gpu_held_by"] = held
        self.run["parts"].append(rec)
        t0 = time.time()
        end = t0 + cap
        while True:
            left = end - time.time()
            argv = part.argv(left)
            if argv is None:
                rec["outcome"] = "finished" if rec["launches"] else "nothing left: complete in an earlier run"
                break
            if rec["launches"] and left < max(part.min_s, 5.0):
                rec["outcome"] = f"not started again: {left:.0f} s left"
                break
            token = f"{self.id}/{part.name}/{rec['launches']}"
            self.say(f"== {part.name} ({left:.0f} s): {shlex.join(argv)}")
            p = gpu_proc.spawn(argv, {**self.env, gpu_proc.MARK: token}, left, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, bufsize=1, errors="replace")
            self.current = (p, rec)
            rec["launches"] += 1
            reader = threading.Thread(target=self.copy, args=(p.stdout,), daemon=True)
            reader.start()
            why, running = self.watch(p, part, end)
            if why != "exited":
                gpu_proc.kill_group(p.pid)
            p.wait()
            found, stuck = gpu_proc.sweep(token)
            self.current = None
            reader.join(timeout=5)
            rec["swept"] += found
            if stuck:
                rec["still_running"] = stuck
            rec["returncode"] = p.returncode
            crashed = why == "exited" and p.returncode != 0 and part.rows and (load(part.rows) or {}).get("running")
            if why == "row cap" or crashed:  # the row is recorded, the rest of the part measured after it
                row = record_kill(part.rows, f"killed at its cap of {running['cap_s']:.0f} s" if why == "row cap" else
                                  f"its process ended with {p.returncode} during the row")
                rec["row_kills"].append(row)
                self.say(f"== {part.name}: row {row}; the part starts again from its rows")
                continue
            rec["outcome"] = "finished" if why == "exited" and p.returncode == 0 else (
                f"exited with {p.returncode}" if why == "exited" else f"killed at its cap of {cap:.0f} s")
            if running:
                rec["cut_row"] = running["row"]
            break
        rec["seconds"] = round(time.time() - t0, 1)
        self.say(f"== {part.name}: {rec['outcome']} in {rec['seconds']} s (cap {cap:.0f} s)"
                 + (f", swept {rec['swept']}" if rec["swept"] else ""))
        self.save()
        return rec

    def copy(self, stream) -> None:
        for line in stream:
            self.say(line)

    def stop(self) -> None:
        """The check was stopped: its running part killed as a group, then every process it marked."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if self.current:
            p, rec = self.current
            gpu_proc.kill_group(p.pid)
            p.wait()
            rec.update(outcome="cut: the check was stopped", returncode=p.returncode)
        found, stuck = gpu_proc.sweep(self.id)
        if self.current:
            self.current[1]["swept"] += found
        self.run.update(stopped="SIGTERM or SIGINT", swept=found, still_running=stuck)
        self.save()
        self.say(f"gpu check: stopped; swept {found}; the files keep every finished row")

    def watch(self, p, part: Part, end: float):
        """Until the part exits ("exited"), reaches its cap ("part cap") or runs a row past the row's
        cap ("row cap"); returns that and the running row."""
        running = None
        while p.poll() is None:
            now = time.time()
            running = (load(part.rows) or {}).get("running") if part.rows else None
            if now >= end:
                return "part cap", running
            if running and now > running["since"] + running["cap_s"] + ROW_GRACE_S:
                return "row cap", running
            time.sleep(0.2)
        return "exited", None

    def schedule(self, parts: list[Part]) -> None:
        deadline, carry = self.start + self.total, 0.0
        for part in parts:
            held = self.wait_gpu_free()
            left = deadline - time.time()
            cap = part.cap_s if part.cap_s is not None else part.share * self.total + carry if part.share else left
            cap = min(cap, left)
            if cap < part.min_s:
                self.run["parts"].append({"part": part.name, "cap_s": round(cap, 1), "outcome": f"not started: {cap:.0f} s"})
                self.say(f"== {part.name}: not started ({cap:.0f} s left for it)")
                self.save()
                continue
            t = time.time()
            self.part(part, cap, held)
            used = time.time() - t
            carry = (carry + part.share * self.total - used) if part.share else carry - (used if part.cap_s else 0.0)


def _resume(out: Path, source: Path) -> None:
    """An earlier check's measured rows and passed tests into OUT, for the files OUT lacks."""
    for name in ("gpu_train.json", "gpu.json", "decode_speed_gpu.json", "gpu_tests.jsonl"):
        src, dst = source / name, out / name
        if not src.exists() or dst.exists():
            continue
        if name.endswith(".jsonl"):
            lines = [x for x in src.read_text().splitlines() if x.strip() and json.loads(x)["outcome"] == "PASSED"]
            dst.write_text("".join(x + "\n" for x in lines))
            continue
        doc = load(src) or {}
        for key in ("rows", "errors"):
            doc[key] = [r for r in doc.get(key, []) if not r.get("error") and "from" not in r]
        doc.pop("complete", None)
        save(dst, doc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the folder the check writes (and resumes from)")
    ap.add_argument("minutes", nargs="?", type=float, default=6.5)
    ap.add_argument("--smoke", action="store_true", help="every part's code path on the CPU at tiny sizes")
    ap.add_argument("--resume", default=None, help="an earlier check's folder whose measured rows are kept")
    ap.add_argument("--parts", default=None, help="only these parts, comma-separated")
    ap.add_argument("--history", default=str(HERE / "results" / "gpu_logs"), help="the committed checks")
    a = ap.parse_args(argv)
    if not 0 < a.minutes <= 30:
        raise SystemExit(f"MINUTES must be in (0, 30], got {a.minutes}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.resume:
        if not Path(a.resume).is_dir():
            raise SystemExit(f"--resume: {a.resume} is not a folder")
        _resume(out, Path(a.resume))
    parts = plan(out, a.smoke, Path(a.history))
    if a.parts:
        names = a.parts.split(",")
        unknown = sorted(set(names) - {p.name for p in parts})
        if unknown:
            raise SystemExit(f"--parts: unknown {unknown}; parts are {[p.name for p in parts]}")
        parts = [p for p in parts if p.name in names]
    check = Check(out, a.minutes, a.smoke)

    def stop(signum, frame):  # once: timeout(1) and a kill of the process group may both deliver one
        if not check.stopping:
            check.stopping = True
            raise Cut

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    check.say(f"gpu check {check.id}: {a.minutes} min, parts {[p.name for p in parts]}, into {out}")
    try:
        check.schedule(parts)
    except Cut:
        check.stop()
        return 143
    check.save()
    check.say(f"gpu check: done in {check.run['seconds']} s; files in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
