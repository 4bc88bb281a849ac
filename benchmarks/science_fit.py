"""What a science batch may start, and whether what it cuts can travel to the next one.

A device call carries the working tree (tracked files and untracked files git does not ignore) and the
ignored paths it names, 64 MiB in all (CARRY_MIB). A run cut at a batch's cap continues in the next
batch only if its packed state (the newest checkpoint: float32 parameters and AdamW's two moments,
about 12 bytes a parameter, with its logs) fits in what the tree and the other carried paths leave:
`carry_room` measures that here, before the call, and the batch is told it (`--carry-mib`). A run
whose state cannot travel is started only when the batch can finish it: at a speed measured by an
earlier batch (batches.json) the batch predicts each run's seconds and starts, in queue order, the
runs it can finish or carry; a run of a variant no batch has timed is started anyway (its speed is
what the batch measures), and if it is cut its state is dropped and the run starts again later.
"""

from __future__ import annotations

import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20
CARRY_MIB = 64.0  # the working tree and the carried paths of one device call together
MARGIN_MIB = 2.0  # kept free: what the tree gains between the measurement and the call (a log, a records file)
START_S = 60.0  # a run's start before its first step: the sweep's imports and data (15 s), the compile (45 s)
FINISH_S = 35.0  # after its last step: the final metrics and the records
STATE_BYTES_PER_PARAM = 12  # float32 parameters, AdamW's exp_avg and exp_avg_sq


def tree_bytes(root: Path) -> int:
    """Bytes of what a device call carries from ROOT without being told: the files git tracks and the
    untracked ones it does not ignore (a deleted tracked file counts nothing)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         check=True, capture_output=True).stdout
    names = {n for n in out.decode().split("\0") if n}
    return sum((root / n).stat().st_size for n in names if (root / n).is_file())


def path_bytes(path: Path) -> int:
    """Bytes of a carried path: a file, or every file under a folder (0 when absent)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def carry_room(root: Path, carried: list[str], keep: list[str] = ()) -> float:
    """MiB left for a cut run's state in the next device call: CARRY_MIB less the tree, less the carried
    paths other than the state itself (`keep`: carried but replaced by the new state, e.g. the old
    state/ folder, not counted), less MARGIN_MIB."""
    kept = {Path(k) for k in keep}
    used = tree_bytes(root) + sum(path_bytes(root / c) for c in carried if Path(c) not in kept)
    return CARRY_MIB - MARGIN_MIB - used / MIB


def state_mib(n_params: int) -> float:
    """The packed state of a run of N parameters, MiB, from what its checkpoint holds; the logs and the
    config it carries beside them are small and covered by MARGIN_MIB."""
    return STATE_BYTES_PER_PARAM * n_params / MIB


def measured_speeds(batches: list[dict]) -> dict[str, float]:
    """Tokens/s by variant: the median over every batch's runs that logged a speed (batches.json)."""
    rates: dict[str, list[float]] = {}
    for b in batches:
        for r in b.get("runs") or []:
            if r.get("tokens_per_s"):
                rates.setdefault(r["run"].partition("/seed")[0], []).append(float(r["tokens_per_s"]))
    return {v: statistics.median(rs) for v, rs in rates.items()}


@dataclass(frozen=True)
class Candidate:
    """A run the batch could start: its name (variant/seedK), the tokens it has left to train, and the
    MiB its state would take if cut."""
    name: str
    tokens_left: int
    state_mib: float

    @property
    def variant(self) -> str:
        return self.name.partition("/seed")[0]


@dataclass(frozen=True)
class Decision:
    name: str
    start: bool
    why: str
    seconds: float | None  # the predicted seconds from start to record; None for an untimed variant


def decide(c: Candidate, seconds_left: float, room_mib: float | None, speeds: dict[str, float]) -> Decision:
    """Whether to start C with SECONDS_LEFT to the cap: yes when it is predicted to finish, or its state
    fits ROOM_MIB (None: no limit is known, as on a machine whose carry is not measured), or no batch
    has timed its variant; otherwise no, saying why."""
    carries = room_mib is None or c.state_mib <= room_mib
    rate = speeds.get(c.variant)
    if rate is None:
        return Decision(c.name, True, "no batch has timed " + c.variant + ": this one measures it"
                        + ("" if carries else f" (cut, its {c.state_mib:.1f} MiB state cannot travel in "
                                              f"{room_mib:.1f} MiB: it starts again)"), None)
    need = START_S + c.tokens_left / rate + FINISH_S
    if need <= seconds_left:
        return Decision(c.name, True, f"finishes: {need:.0f} s of the {seconds_left:.0f} s left", need)
    if carries:
        return Decision(c.name, True, f"cut and carried: {need:.0f} s against {seconds_left:.0f} s left, its state "
                        f"{c.state_mib:.1f} MiB of the {'unlimited' if room_mib is None else f'{room_mib:.1f}'} MiB room",
                        need)
    return Decision(c.name, False, f"not started: it needs {need:.0f} s, {seconds_left:.0f} s are left, and its "
                    f"{c.state_mib:.1f} MiB state cannot travel in the {room_mib:.1f} MiB the next call has room for", need)


def too_late(name: str, seconds_left: float, min_start: float) -> Decision | None:
    """No run starts with less than MIN_START seconds to the cap (its start includes its compile): the
    decision not to start NAME then, or None."""
    if seconds_left >= min_start:
        return None
    return Decision(name, False, f"not started, {seconds_left:.0f} s to the cap (a run needs {min_start:.0f} s "
                    f"to start)", None)


def plan(candidates: list[Candidate], seconds_left: float, room_mib: float | None,
         speeds: dict[str, float], min_start: float = 0.0) -> list[Decision]:
    """Every candidate's decision in queue order, each started run's predicted seconds taken from what is
    left for the next (an untimed run, or one cut at the cap, is taken to use the rest of the batch); with
    less than MIN_START seconds left, none starts (`too_late`), as in the batch."""
    out = []
    for c in candidates:
        d = too_late(c.name, seconds_left, min_start) or decide(c, seconds_left, room_mib, speeds)
        out.append(d)
        if d.start:
            seconds_left = seconds_left - d.seconds if d.seconds is not None and d.seconds <= seconds_left else 0.0
    return out

