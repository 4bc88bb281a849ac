"""One file too large for a device call, moved to the GPU machine over several consecutive calls.

A call carries the working tree and at most 8 ignored paths, 64 MiB in all (science_fit.CARRY_MIB);
on a machine still warm from the last call, the ignored files earlier calls left are kept unless a
later call names the same path. So the file is cut into parts under an ignored folder here, each call
carries other parts of it (never a path an earlier call named: that would replace or remove it
there), and the last call joins them on the machine:

    python benchmarks/carry_parts.py split FILE --mib N --out DIR   # here: DIR/part-000 ..., DIR/manifest.json
    python benchmarks/carry_parts.py plan DIR --room-mib R          # here: the carry list of each call
    python3 benchmarks/carry_parts.py join DIR --to FILE            # there, in the last call: checked, joined

Layout: the parts lie flat in DIR, named in the manifest; `plan` gives each call consecutive parts
(the manifest with the first) up to R MiB and at most --paths paths, each part a path of its own, so
no two calls name one path and nothing moves here: the plan reads DIR and can be printed again. The
calls must follow each other within the machine's idle window (about 30 s); if it was released
between them, `join` names the parts that did not arrive and the calls start again from the first.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from science_fit import MIB, carry_room
from science_state import sha256

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = "manifest.json"
MAX_PATHS = 8  # the ignored paths one device call may carry
CHUNK = 1 << 22


def _copy(src, dst, n: int, *hashes) -> int:
    """Up to N bytes from SRC to DST, fed to HASHES; the bytes copied."""
    done = 0
    while done < n and (chunk := src.read(min(CHUNK, n - done))):
        dst.write(chunk)
        for h in hashes:
            h.update(chunk)
        done += len(chunk)
    return done


def _first_missing(folder: Path) -> Path | None:
    """The outermost folder of FOLDER's ancestry (itself included) that does not exist yet, or None."""
    missing = None
    for p in (folder, *folder.parents):
        if p.exists():
            return missing
        missing = p
    return missing


def part_bytes(mib: float) -> int:
    size = int(mib * MIB) if 0 < mib < float("inf") else 0
    if size < 1:
        raise SystemExit(f"--mib must be a positive size in MiB (at least one byte), got {mib:g}")
    return size


def read_manifest(folder: Path) -> dict:
    """DIR's manifest.json, its part names checked to be plain file names in DIR; SystemExit naming DIR."""
    try:
        m = json.loads((folder / MANIFEST).read_text())
        lacking = {"file", "bytes", "sha256", "parts"} - m.keys()
        names = [p["name"] for p in m["parts"]] if not lacking else []
        ok = all(isinstance(n, str) and n.startswith("part-") and Path(n).name == n for n in names)
    except FileNotFoundError:
        raise SystemExit(f"DIR {folder}: no {MANIFEST} (carry_parts.py split writes it, the first call carries it)")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise SystemExit(f"DIR {folder}: {MANIFEST} cannot be read ({type(e).__name__}: {e})")
    if lacking:
        raise SystemExit(f"DIR {folder}: {MANIFEST} lacks {', '.join(sorted(lacking))}")
    if not ok:
        raise SystemExit(f"DIR {folder}: {MANIFEST} names parts that are not part-NNN files inside it")
    return m


# --------------------------------------------------------------------------- split (here)


def _already_split(file: Path, size: int, out: Path) -> dict | None:
    """None when OUT is absent or empty; its manifest when it holds FILE's parts of SIZE bytes, intact in
    size; otherwise SystemExit naming --out."""
    if out.exists() and not out.is_dir():
        raise SystemExit(f"--out {out} is a file, not a folder")
    if not out.is_dir() or not any(out.iterdir()):
        return None
    try:
        m = read_manifest(out)
    except SystemExit:
        raise SystemExit(f"--out {out} is not empty and holds no readable {MANIFEST}: give a new or empty folder")
    if (m["file"], m["bytes"]) != (file.name, file.stat().st_size) or m["sha256"] != sha256(file):
        raise SystemExit(f"--out {out} already holds the parts of another file ({m['file']}, {m['bytes']:,} bytes): "
                         f"give a new or empty folder")
    if m.get("part_bytes") != size:
        raise SystemExit(f"--out {out} already holds this file's parts of {m.get('part_bytes')} bytes, not {size:,}: "
                         f"give a new or empty folder")
    lost = [p["name"] for p in m["parts"] if not (out / p["name"]).is_file()
            or (out / p["name"]).stat().st_size != p["bytes"]]
    if lost:
        raise SystemExit(f"--out {out} holds this file's manifest but not its parts {', '.join(lost)}: "
                         f"remove the folder")
    return m


def split(file: Path, mib: float, out: Path) -> dict:
    """FILE as OUT/part-NNN of at most MIB MiB each and OUT/manifest.json (returned). Written under a
    temporary name beside OUT and renamed into place whole, so a cut split leaves no finished-looking part;
    OUT already holding this split: nothing is written."""
    size = part_bytes(mib)
    if not file.is_file():
        raise SystemExit(f"FILE {file}: no such file")
    done = _already_split(file, size, out)
    if done is not None:
        return done
    total = file.stat().st_size
    n_parts = -(-total // size)
    width = max(3, len(str(n_parts - 1)))
    created = _first_missing(out.parent)
    tmp = out.parent / f".{out.name}.{os.getpid()}.split"  # a folder of this pid's name is left by a dead process
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        whole, parts = hashlib.sha256(), []
        with open(file, "rb") as src:
            for i in range(n_parts):
                name, h = f"part-{i:0{width}d}", hashlib.sha256()
                with open(tmp / name, "wb") as dst:
                    n = _copy(src, dst, size, h, whole)
                parts.append({"name": name, "bytes": n, "sha256": h.hexdigest()})
            if sum(p["bytes"] for p in parts) != total or src.read(1):
                raise SystemExit(f"FILE {file} changed while it was split: nothing written")
        manifest = {"file": file.name, "bytes": total, "sha256": whole.hexdigest(), "part_bytes": size, "parts": parts}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(tmp, out)  # OUT is absent or an empty folder
    except BaseException:
        shutil.rmtree(created or tmp, ignore_errors=True)
        raise
    return manifest


# --------------------------------------------------------------------------- plan (here)


def _group(items: list[tuple[str, int]], room: int, paths: int) -> list[list[str]]:
    """Consecutive ITEMS (name, bytes) in calls of at most ROOM bytes and PATHS names."""
    calls, cur, used = [], [], 0
    for name, b in items:
        if cur and (used + b > room or len(cur) == paths):
            calls.append(cur)
            cur, used = [], 0
        cur.append(name)
        used += b
    return [*calls, cur]


def _layout(folder: Path, room_mib: float, root: Path, paths: int) -> tuple[str, dict, list[list[str]]]:
    """FOLDER relative to ROOT, the bytes of each file to carry (the manifest first) and their calls."""
    if not 0 < room_mib < float("inf"):
        raise SystemExit(f"--room-mib must be a positive number of MiB, got {room_mib:g}")
    if not 1 <= paths <= MAX_PATHS:
        raise SystemExit(f"--paths must be in 1..{MAX_PATHS} (what a call may carry), got {paths}")
    m = read_manifest(folder)
    try:
        rel = folder.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        raise SystemExit(f"DIR {folder} is outside the checkout {root}: a call carries only paths inside it")
    probe = subprocess.run(["git", "check-ignore", "-q", f"{rel}/{MANIFEST}"], cwd=root, capture_output=True)
    if probe.returncode == 1:
        raise SystemExit(f"DIR {folder} is not ignored by git: its parts would travel in every call's tree; "
                         f"put it under an ignored folder (.cache/, build/)")
    if probe.returncode != 0:
        raise SystemExit(f"DIR {folder}: git cannot say whether it is ignored in {root}: "
                         f"{probe.stderr.decode().strip()}")
    for p in m["parts"]:  # a carried path absent here is removed there
        f = folder / p["name"]
        if not f.is_file() or f.stat().st_size != p["bytes"]:
            raise SystemExit(f"DIR {folder}: part {p['name']} is missing here or not its {p['bytes']:,} bytes: "
                             f"split again")
    items = {f"{rel}/{MANIFEST}": (folder / MANIFEST).stat().st_size,
             **{f"{rel}/{p['name']}": p["bytes"] for p in m["parts"]}}
    room = int(room_mib * MIB)
    big = next(((n, b) for n, b in items.items() if b > room), None)
    if big:
        raise SystemExit(f"--room-mib {room_mib:g}: {big[0]} alone is {big[1] / MIB:.2f} MiB; split with --mib at most "
                         f"{room_mib:g}")
    return rel, items, _group(list(items.items()), room, paths)


def plan(folder: Path, room_mib: float, root: Path = ROOT, paths: int = MAX_PATHS) -> list[list[str]]:
    """The paths (relative to ROOT, as a device call's carry names them) each successive call carries:
    the manifest and the parts of FOLDER, in order, at most ROOM_MIB MiB and PATHS paths a call. FOLDER
    must be inside ROOT, ignored by git and hold every part; SystemExit naming the argument otherwise."""
    return _layout(folder, room_mib, root, paths)[2]


def print_plan(folder: Path, room_mib: float, root: Path, paths: int, to: str) -> None:
    rel, items, calls = _layout(folder, room_mib, root, paths)
    m = read_manifest(folder)
    print(f"{m['file']}: {m['bytes']:,} bytes in {len(m['parts'])} part(s), {len(calls)} call(s) of at most "
          f"{room_mib:g} MiB and {paths} path(s), each right after the last (within the machine's idle window):")
    for i, call in enumerate(calls, 1):
        cmd = (f"python3 benchmarks/carry_parts.py join {shlex.quote(rel)} --to {shlex.quote(to)}" if i == len(calls)
               else f"ls -l {shlex.quote(rel)}")
        print(f"call {i} ({sum(items[c] for c in call) / MIB:.2f} MiB): carry {json.dumps(call)}  command: {cmd}")
    if len(calls) > len(_group(list(items.items()), int(room_mib * MIB), len(items))):
        print(f"the {paths}-path limit sets the calls, not the room: split with --mib "
              f"{int(10 * room_mib / paths) / 10:g} for fewer")
    print(f"join names the parts that did not arrive (a machine released between calls): then start again from call 1; "
          f"later calls must not name {rel} or its parts")


# --------------------------------------------------------------------------- join (there)


def join(folder: Path, to: Path) -> dict:
    """FOLDER's parts, each checked against its manifest, concatenated into TO (through a temporary file
    renamed into place) and the whole checked; SystemExit naming every missing or damaged part, TO not
    written."""
    if to.is_dir():
        raise SystemExit(f"--to {to} is a folder, not a file")
    m = read_manifest(folder)
    bad = []
    for p in m["parts"]:
        f = folder / p["name"]
        if not f.is_file():
            bad.append(f"{p['name']} missing")
        elif f.stat().st_size != p["bytes"] or sha256(f) != p["sha256"]:
            bad.append(f"{p['name']} damaged ({f.stat().st_size:,} bytes, expected {p['bytes']:,} with sha256 "
                       f"{p['sha256'][:12]})")
    if bad:
        raise SystemExit(f"join {folder}: {'; '.join(bad)}: {to} not written "
                         f"(carry the plan's calls again from the first)")
    created = _first_missing(to.parent)
    tmp = to.parent / f".{to.name}.{os.getpid()}.join"
    try:
        to.parent.mkdir(parents=True, exist_ok=True)
        whole = hashlib.sha256()
        with open(tmp, "wb") as dst:
            for p in m["parts"]:
                with open(folder / p["name"], "rb") as src:
                    _copy(src, dst, p["bytes"], whole)
        if whole.hexdigest() != m["sha256"]:
            raise SystemExit(f"join {folder}: the parts join to another file than {MANIFEST} names: {to} not written")
        os.replace(tmp, to)
    except BaseException:
        tmp.unlink(missing_ok=True)
        if created:
            shutil.rmtree(created, ignore_errors=True)
        raise
    return m


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split", help="here: FILE as DIR/part-NNN of at most --mib MiB and DIR/manifest.json")
    s.add_argument("file", metavar="FILE")
    s.add_argument("--mib", type=float, required=True, help="the largest part, MiB")
    s.add_argument("--out", required=True, help="the folder of the parts: new or empty, ignored by git")
    p = sub.add_parser("plan", help="here: what each successive device call carries")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--room-mib", type=float, default=None,
                   help="MiB a call may carry beside the tree (default: 64 MiB less this checkout's tree and a margin)")
    p.add_argument("--paths", type=int, default=MAX_PATHS,
                   help=f"paths a call may carry for the parts (default {MAX_PATHS}; fewer when it carries others)")
    p.add_argument("--to", default="FILE", help="where join puts the file there, for the printed command")
    p.add_argument("--root", default=str(ROOT), help="the checkout the calls carry from (default: this one)")
    j = sub.add_parser("join", help="there: the parts checked and joined into --to")
    j.add_argument("dir", metavar="DIR")
    j.add_argument("--to", required=True, help="the joined file")
    ns = ap.parse_args(argv)
    if ns.cmd == "split":
        m = split(Path(ns.file), ns.mib, Path(ns.out))
        print(f"{ns.out}: {m['file']} ({m['bytes']:,} bytes, sha256 {m['sha256'][:12]}) in {len(m['parts'])} part(s) "
              f"of at most {m['part_bytes']:,} bytes")
        return 0
    if ns.cmd == "plan":
        root = Path(ns.root)
        room = carry_room(root, []) if ns.room_mib is None else ns.room_mib
        print_plan(Path(ns.dir), room, root, ns.paths, ns.to)
        return 0
    m = join(Path(ns.dir), Path(ns.to))
    print(f"{ns.to}: {m['bytes']:,} bytes from {len(m['parts'])} part(s), sha256 {m['sha256'][:12]} "
          f"as the manifest says")
    return 0


if __name__ == "__main__":
    sys.exit(main())
