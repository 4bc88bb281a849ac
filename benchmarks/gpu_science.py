"""The science batch: the next unfinished piece of a sweep run in batches on lent GPU machines, under a
time cap, each run checkpointed at the cap and resumed in the next batch (benchmarks/gpu_science.sh runs
`batch` there; docs/contributing.md has the standing order).

    python benchmarks/gpu_science.py batch OUT MINUTES     # on the GPU machine: what gpu_science.sh runs
    python benchmarks/gpu_science.py absorb DIR            # here, with the files that came back; then commit
    python benchmarks/gpu_science.py status                # the runs left, and what the next batch would start
    python benchmarks/gpu_science.py room                  # here: the --carry-mib of the next batch
    python benchmarks/gpu_science.py corpus [--copy|--write] # check the carried corpus (--copy: make it here)

The spec is experiments/seed000/window-language-at-scale/spec.toml unless --spec names another; its
in-progress run travels in STATE (--state, default the spec folder's state/), which git ignores: it is
kept on this machine and carried by the device call beside the wheels and the corpus.

A batch (every step logged; OUT/science.json says what happened):
1. checks the corpus the spec reads (its data.source and metrics.heldout folders) against the
   MANIFEST.json beside them, file by file, before anything trains;
2. restores the run in progress from STATE (its parts' and the whole file's SHA-256 checked) into its
   run folder, where `attnlab sweep` resumes it from its checkpoint;
3. trains the runs the committed results.json does not hold, the one in progress first, then seed by
   seed in the spec's variant order: each run one `attnlab sweep SPEC --only RUN --records OUT` in a
   process group of its own; a run that fails is logged and the next one starts; none starts with less
   than --min-start seconds left (a run's start includes its compile), and a run is passed over when,
   at the speed earlier batches measured for its variant, it would not finish and its state would not
   fit the --carry-mib the next call has room for (benchmarks/science_fit.py; an untimed variant starts);
4. at the cap (MINUTES less RESERVE_S) sends the running sweep SIGTERM: the trainer finishes its step,
   writes a checkpoint and stops; SIGKILL GRACE_S later if it has not (then its last periodic
   checkpoint stands);
5. packs the run then in progress (its newest checkpoint, logs and config) as a tar in parts of at most
   --part-mib MiB under OUT, and drops them again when they exceed --carry-mib (that run starts over).
What comes back (at most MAX_FILES files, each under 16 MiB): science.log, science.json, the records
file of the runs finished in the batch and the state parts. `absorb` merges the records into the
spec's results.json and report (`attnlab sweep SPEC --merge DIR`), puts the parts in STATE and appends
the batch to the spec folder's batches.json.

The corpus lives in science_corpus.py, the packing of the run in progress in science_state.py; this
file holds the batch, `absorb`, `status` and the command line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from science_corpus import check_corpus, corpus_folders, materialise_corpus, write_corpus
import science_fit as fit
from science_state import PART_MIB, STATE_JSON, check_parts, pack, read_state, unpack

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "experiments" / "seed000" / "window-language-at-scale" / "spec.toml"
MAX_FILES = 8  # what a device command may send back
RESERVE_S = 30.0  # before MINUTES ends: the stop, the checkpoint and the packing
GRACE_S = 40.0  # SIGTERM to SIGKILL (the step, the checkpoint)
MIN_START_S = 75.0  # no run starts with less left
MINUTES = 6.0  # the batch `status` plans for: gpu_science.sh's default MINUTES
FORMAT = "attnlab science batch"


def say(text: str) -> None:
    print(f"gpu_science: {text}", flush=True)


def _env() -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}


# --------------------------------------------------------------------------- the queue


def queue(spec, state: dict | None) -> list[str]:
    """The runs left to train: the one in progress first, then seed by seed in the spec's variant order,
    leaving out what results.json records (or, on this machine, what is finished)."""
    from attnlab.experiments.sweep import plan

    plans = plan(spec)
    left = [f"{p.variant}/seed{p.seed}" for p in sorted(plans, key=lambda p: (spec.seeds.index(p.seed),
            [v.name for v in spec.variants].index(p.variant))) if p.state not in ("done", "recorded")]
    if state and state["run"] in left:
        left.remove(state["run"])
        left.insert(0, state["run"])
    return left


def run_of(spec, name: str) -> Path:
    variant, _, seed = name.partition("/seed")
    return spec.run_dir(variant, int(seed))


def speed(run_dir: Path) -> dict:
    """The step a run folder's log reached and its median tokens/s (its first row, the compile's, left out)."""
    rows = []
    try:
        rows = [r for r in map(json.loads, filter(str.strip, (run_dir / "log.jsonl").read_text().splitlines()))
                if r.get("kind") == "train"]
    except (OSError, ValueError):
        pass
    rates = [r["tokens_per_s"] for r in rows[1:] if r.get("tokens_per_s")]
    return {"step": rows[-1]["step"] if rows else 0, "tokens_per_s": round(statistics.median(rates)) if rates else None}


class Batch:
    def __init__(self, out: Path, minutes: float, spec_path: Path, state_dir: Path, part_mib: float, min_start: float,
                 carry_mib: float | None = None):
        self.out, self.spec_path, self.state_dir, self.part_mib, self.min_start = out, spec_path, state_dir, part_mib, min_start
        self.carry_mib = carry_mib  # room for a cut run's state in the next call (`room`); None: not limited
        self.t0 = time.time()
        self.deadline = self.t0 + 60 * minutes - RESERVE_S
        self.child = None
        self.doc = {"format": FORMAT, "spec": self.spec_path.resolve().relative_to(ROOT).as_posix()
                    if self.spec_path.resolve().is_relative_to(ROOT) else str(self.spec_path),
                    "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "minutes": minutes, "runs": [], "in_progress": None}

    def save(self) -> None:
        self.doc["seconds"] = round(time.time() - self.t0, 1)
        tmp = self.out / "science.json.tmp"
        tmp.write_text(json.dumps(self.doc, indent=1) + "\n")
        os.replace(tmp, self.out / "science.json")

    def stop(self, signum, frame) -> None:  # the command's own limit: end now, still packing the run
        self.deadline = min(self.deadline, time.time())

    def run_one(self, name: str) -> tuple[str, int]:
        cmd = [sys.executable, "-m", "attnlab", "sweep", str(self.spec_path), "--only", name, "--records", str(self.out),
               "--no-progress"]
        say(f"{name}: {shlex.join(cmd[1:])} ({self.deadline - time.time():.0f} s to the cap)")
        self.child = subprocess.Popen(cmd, cwd=ROOT, env=_env(), start_new_session=True)
        how = "exited"
        while self.child.poll() is None:
            if time.time() >= self.deadline:
                how = "stopped"
                os.killpg(self.child.pid, signal.SIGTERM)
                try:
                    self.child.wait(timeout=GRACE_S)
                except subprocess.TimeoutExpired:
                    os.killpg(self.child.pid, signal.SIGKILL)
                    self.child.wait()
                    how = "killed"
                break
            time.sleep(0.5)
        rc, self.child = self.child.returncode, None
        return how, rc

    def run(self) -> int:
        from attnlab.experiments.sweep import load_spec
        import torch

        self.doc.update(torch=torch.__version__, python=".".join(map(str, sys.version_info[:3])),
                        device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
        say(f"{self.doc['spec']}: {self.doc['minutes']} min on {self.doc['device']} (torch {self.doc['torch']}), into {self.out}")
        try:
            self.doc["corpus"] = check_corpus(corpus_folders(self.spec_path))
        except SystemExit as e:
            self.doc["corpus"] = {"error": str(e)}
            self.save()
            say(f"corpus check failed, nothing trained: {e}")
            return 3
        say(f"corpus checked: {self.doc['corpus']}")
        spec = load_spec(self.spec_path)
        state = read_state(self.state_dir)
        if state:
            target = run_of(spec, state["run"])
            have = speed(target)["step"] if target.exists() else 0
            if have < (state["step"] or 0):  # a folder already here that is further along is kept
                shutil.rmtree(target, ignore_errors=True)
                unpack(state, self.state_dir, target)
            self.doc["restored"] = {"run": state["run"], "step": state["step"], "sha256": state["sha256"]}
            say(f"restored {state['run']} at step {state['step']} ({state['bytes']:,} bytes in {len(state['parts'])} part(s))")
        todo = queue(spec, state)
        say(f"queue: {', '.join(todo) if todo else 'nothing left: every run is recorded'}")
        self.save()
        speeds = fit.measured_speeds(read_batches(self.spec_path))
        for name in todo:
            left = self.deadline - time.time()
            late = fit.too_late(name, left, self.min_start)
            if late:
                say(f"{name}: {late.why}")
                break
            decision = fit.decide(candidate(spec, name, state), left, self.carry_mib, speeds)
            say(f"{name}: {decision.why}")
            if not decision.start:
                self.doc.setdefault("passed_over", []).append({"run": name, "why": decision.why})
                continue
            t = time.time()
            how, rc = self.run_one(name)
            entry = {"run": name, "seconds": round(time.time() - t, 1), "returncode": rc, **speed(run_of(spec, name))}
            finished = how == "exited" and rc == 0
            entry["outcome"] = "finished" if finished else ("failed" if how == "exited" else how)
            self.doc["runs"].append(entry)
            say(f"{name}: {entry['outcome']} after {entry['seconds']} s, step {entry['step']}, "
                f"{entry['tokens_per_s'] or 0:,} tokens/s (rc {rc})")
            self.save()
            if not finished and how != "exited":
                self.carry(spec, name)
                break
        files = sorted(p for p in self.out.iterdir() if p.is_file() and p.suffix != ".tmp")
        self.doc["files"] = [p.name for p in files] + ([] if (self.out / "science.json") in files else ["science.json"])
        if len(self.doc["files"]) > MAX_FILES:
            say(f"{len(self.doc['files'])} files under {self.out}: more than the {MAX_FILES} that come back")
        self.save()
        say(f"done in {self.doc['seconds']} s: {sum(r['outcome'] == 'finished' for r in self.doc['runs'])} run(s) finished"
            + (f", {self.doc['in_progress']['run']} carried at step {self.doc['in_progress']['step']}"
               if self.doc["in_progress"] else ""))
        return 0

    def carry(self, spec, name: str) -> None:
        try:  # beside science.log, science.json and the records file
            packed = pack(run_of(spec, name), name, self.out, self.part_mib, max_parts=MAX_FILES - 3)
        except (ValueError, OSError) as e:
            say(f"{name}: nothing carried ({e}); the next batch starts it again")
            return
        if self.carry_mib is not None and packed["bytes"] > self.carry_mib * fit.MIB:
            for part in packed["parts"]:
                (self.out / part["name"]).unlink()
            self.doc["dropped"] = {"run": name, "step": packed["step"], "bytes": packed["bytes"]}
            say(f"{name}: its state ({packed['bytes'] / fit.MIB:.1f} MiB) cannot travel in the "
                f"{self.carry_mib:.1f} MiB the next call has room for: dropped, the next batch starts it again")
            return
        self.doc["in_progress"] = packed
        say(f"{name}: step {packed['step']} carried in {len(packed['parts'])} part(s), {packed['bytes']:,} bytes")


# --------------------------------------------------------------------------- here, with what came back


def absorb(folder: Path, spec_path: Path, state_dir: Path) -> int:
    doc = json.loads((folder / "science.json").read_text())
    if doc.get("format") != FORMAT:
        raise SystemExit(f"{folder / 'science.json'} is not a science batch's")
    records = sorted(folder.glob("*.records.json"))
    if records:
        cmd = [sys.executable, "-m", "attnlab", "sweep", str(spec_path), "--merge", str(folder), "--no-progress"]
        if subprocess.run(cmd, cwd=ROOT, env=_env()).returncode != 0:
            raise SystemExit(f"merging the records of {folder} failed: nothing else absorbed")
    old = read_state(state_dir)
    restored = (doc.get("restored") or {}).get("sha256")
    if old and restored != old["sha256"]:
        say(f"the batch did not start from {state_dir}'s {old['run']} at step {old['step']}: that state is kept")
    else:
        if state_dir.is_dir():
            for p in state_dir.glob("state.tar.*"):
                p.unlink()
            (state_dir / STATE_JSON).unlink(missing_ok=True)
        new = doc.get("in_progress")
        if new:
            state_dir.mkdir(parents=True, exist_ok=True)
            for part in new["parts"]:
                shutil.copyfile(folder / part["name"], state_dir / part["name"])
            check_parts(new, state_dir)
            (state_dir / STATE_JSON).write_text(json.dumps(new, indent=1) + "\n")
            say(f"{state_dir}: {new['run']} at step {new['step']}, {len(new['parts'])} part(s)")
    ledger = spec_path.parent / "batches.json"
    batches = read_batches(spec_path)
    if not any(b.get("started") == doc["started"] and b.get("device") == doc.get("device") for b in batches):
        batches.append({k: doc.get(k) for k in ("started", "seconds", "minutes", "device", "torch", "python", "runs")}
                       | {"in_progress": (doc.get("in_progress") or {}).get("run"),
                          "in_progress_step": (doc.get("in_progress") or {}).get("step")})
        ledger.write_text(json.dumps(batches, indent=1) + "\n")
    say(f"absorbed {folder}: commit {spec_path.parent.relative_to(ROOT) if spec_path.parent.is_relative_to(ROOT) else spec_path.parent}"
        f" (results.json, report, plots, batches.json; state/ stays here, ignored, for the next call to carry)")
    return 0


def read_batches(spec_path: Path) -> list[dict]:
    """The spec folder's batches.json (what `absorb` appends), or none."""
    ledger = spec_path.parent / "batches.json"
    return json.loads(ledger.read_text()) if ledger.is_file() else []


def candidate(spec, name: str, state: dict | None) -> fit.Candidate:
    """RUN as science_fit weighs it: the tokens it has left (all of them, or from the carried step) and
    the MiB its state would take."""
    from attnlab.experiments.sweep import plan
    from attnlab.experiments.sweep.budget import params_of

    cfg = next(p.cfg for p in plan(spec) if f"{p.variant}/seed{p.seed}" == name)
    done = (state.get("step") or 0) if state and state.get("run") == name else 0
    return fit.Candidate(name, (cfg.train.steps - done) * cfg.train.tokens_per_step, fit.state_mib(params_of(cfg)))


def carried_paths(spec_path: Path, state_dir: Path) -> list[str]:
    """What a science call carries besides the tree, relative to the checkout: the fla wheels, the
    spec's corpus folders and the state folder."""
    paths = [ROOT / ".whl", *corpus_folders(spec_path), state_dir]
    return [p.resolve().relative_to(ROOT).as_posix() for p in paths]


def next_room(spec_path: Path, state_dir: Path) -> float:
    """--carry-mib for the next batch: what 64 MiB leave beside the tree, the wheels and the corpus (the
    old state is replaced by the new one, so it is not counted)."""
    carried = carried_paths(spec_path, state_dir)
    return fit.carry_room(ROOT, carried, keep=[carried[-1]])


def room(spec_path: Path, state_dir: Path) -> int:
    """Prints `next_room`, and on stderr the paths it leaves room beside."""
    carried = carried_paths(spec_path, state_dir)
    mib = next_room(spec_path, state_dir)
    print(f"{mib:.1f}")
    print(f"carry: {carried} (the tree and these, less the state, leave {mib:.1f} MiB for the state)", file=sys.stderr)
    return 0


def status(spec_path: Path, state_dir: Path, minutes: float = MINUTES, carry_mib: float | None = None,
           min_start: float = MIN_START_S) -> int:
    """Prints the runs left in queue order, each with what a batch of MINUTES would do with it: science_fit's
    plan at the speeds of batches.json, with CARRY_MIB (None: `next_room`, what `room` prints) for a cut
    run's state; the batch decides the same way (`fit.too_late`, `fit.decide`) on the clock."""
    from attnlab.experiments.sweep import load_spec

    check_corpus(corpus_folders(spec_path))
    spec = load_spec(spec_path)
    state = read_state(state_dir)
    todo = queue(spec, state)
    print(f"{spec_path}: {len(todo)} run(s) left" + (f"; {state['run']} in progress at step {state['step']}" if state else ""))
    if not todo:
        return 0
    room_mib = next_room(spec_path, state_dir) if carry_mib is None else carry_mib
    batches = read_batches(spec_path)
    left = 60 * minutes - RESERVE_S
    print(f"a batch of {minutes:g} min ({left:.0f} s to the cap, {room_mib:.1f} MiB for a cut run's state, "
          f"speeds from {len(batches)} batch(es) in batches.json) would:")
    decisions = fit.plan([candidate(spec, name, state) for name in todo], left, room_mib,
                         fit.measured_speeds(batches), min_start)
    for d in decisions:
        print(f"  {'start' if d.start else 'pass '} {d.name}: {d.why}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("batch", help="on the GPU machine: the next batch, into OUT")
    b.add_argument("out")
    b.add_argument("minutes", type=float)
    b.add_argument("--part-mib", type=float, default=PART_MIB)
    b.add_argument("--min-start", type=float, default=MIN_START_S)
    b.add_argument("--carry-mib", type=float, default=None, help="room for a cut run's state in the next call, "
                   "as `room` prints it here (default: not limited)")
    a = sub.add_parser("absorb", help="here: fold a batch's files into the spec folder")
    a.add_argument("folder")
    s = sub.add_parser("status", help="what the next batch trains: the runs left, and which of them it would start")
    s.add_argument("--minutes", type=float, default=MINUTES, help=f"the batch's MINUTES (default: {MINUTES:g})")
    s.add_argument("--carry-mib", type=float, default=None,
                   help="room for a cut run's state in the next call (default: what `room` prints)")
    sub.add_parser("room", help="here: the --carry-mib for the next batch (64 MiB less the tree and the carried paths)")
    c = sub.add_parser("corpus", help="check the carried corpus (--copy: copy it from this Python as its "
                                      "manifest lists it; --write: copy every file and write a new manifest)")
    c.add_argument("--write", action="store_true")
    c.add_argument("--copy", action="store_true")
    for p in (b, a, s, sub.choices["room"], c):
        p.add_argument("--spec", default=str(SPEC))
        p.add_argument("--state", default=None, help="the in-progress run's folder (default: the spec folder's state/)")
    ns = ap.parse_args(argv)
    spec_path = Path(ns.spec)
    state_dir = Path(ns.state) if ns.state else spec_path.parent / "state"
    sys.path.insert(0, str(ROOT / "src"))
    if ns.cmd == "batch":
        if not 0 < ns.minutes <= 30:
            raise SystemExit(f"MINUTES must be in (0, 30], got {ns.minutes}")
        out = Path(ns.out)
        out.mkdir(parents=True, exist_ok=True)
        batch = Batch(out, ns.minutes, spec_path, state_dir, ns.part_mib, ns.min_start, ns.carry_mib)
        signal.signal(signal.SIGTERM, batch.stop)
        return batch.run()
    if ns.cmd == "absorb":
        return absorb(Path(ns.folder), spec_path, state_dir)
    if ns.cmd == "status":
        return status(spec_path, state_dir, ns.minutes, ns.carry_mib)
    if ns.cmd == "room":
        return room(spec_path, state_dir)
    if ns.copy:
        print(materialise_corpus(spec_path.parent / "corpus"))
        return 0
    if ns.write:
        m = write_corpus(spec_path.parent / "corpus")
        print({k: len(v["files"]) for k, v in m["folders"].items()})
        return 0
    print(check_corpus(corpus_folders(spec_path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
