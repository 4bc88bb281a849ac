"""A file too large for one device call, carried over several (benchmarks/carry_parts.py): split here,
each call's carry list from `plan` copied to a stand-in for the machine the way a call carries it (each
named path replaced there, the rest kept), joined there byte for byte; damaged or missing parts and bad
arguments refused by name with nothing written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import carry_parts as cp  # noqa: E402
from science_fit import MIB  # noqa: E402


@pytest.fixture
def repo(tmp_path):
    """A checkout whose .cache/ is ignored, as the parts' folder must be."""
    r = tmp_path / "repo"
    r.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=r, check=True)
    (r / ".gitignore").write_text(".cache/\n")
    return r


def make(path: Path, size: int) -> bytes:
    data = os.urandom(size)
    path.write_bytes(data)
    return data


def entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def carry(calls: list[list[str]], here: Path, there: Path) -> None:
    """Each call as the device tool carries it: a named path replaces the one there (removed when absent here)."""
    for call in calls:
        for rel in call:
            dst = there / rel
            if dst.is_dir():
                shutil.rmtree(dst)
            dst.unlink(missing_ok=True)
            if (here / rel).exists():
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(here / rel, dst)


@pytest.mark.parametrize("size", [int(3.5 * MIB), 3 * MIB, 0], ids=["uneven", "exact-multiple", "empty"])
def test_split_plan_join_round_trip(repo, tmp_path, size):
    data = make(tmp_path / "model.gguf", size)
    parts = repo / ".cache" / "gguf"
    assert cp.main(["split", str(tmp_path / "model.gguf"), "--mib", "1", "--out", str(parts)]) == 0
    m = json.loads((parts / "manifest.json").read_text())
    assert m["file"] == "model.gguf" and m["bytes"] == size and len(m["parts"]) == -(-size // MIB)
    assert all(p["bytes"] == MIB for p in m["parts"][:-1]) and all(0 < p["bytes"] <= MIB for p in m["parts"])
    calls = cp.plan(parts, 2.5, root=repo)
    assert calls[0][0] == ".cache/gguf/manifest.json"
    assert len(calls) == max(1, -(-(size + 1000) // (2 * MIB)))  # two 1 MiB parts a call in 2.5 MiB

    there = tmp_path / "device"
    carry(calls, repo, there)
    out = there / "models" / "model.gguf"
    assert cp.main(["join", str(there / ".cache/gguf"), "--to", str(out)]) == 0
    assert out.read_bytes() == data
    assert entries(out.parent) == ["model.gguf"]  # no temporary file left beside it


def test_the_plan_keeps_every_call_in_its_room_and_never_names_a_path_twice(repo, tmp_path):
    make(tmp_path / "f", int(5.3 * MIB))
    parts = repo / ".cache" / "p"
    cp.split(tmp_path / "f", 0.4, parts)
    files = [".cache/p/manifest.json", *(f".cache/p/{p['name']}" for p in cp.read_manifest(parts)["parts"])]
    for room, paths in [(0.4, 8), (0.5, 8), (1.0, 8), (1.3, 3), (2.0, 2), (9.9, 8), (64, 1)]:
        calls = cp.plan(parts, room, root=repo, paths=paths)
        named = [c for call in calls for c in call]
        assert named == files, (room, paths)  # each file once, in order: no path named by two calls
        for call in calls:
            assert 1 <= len(call) <= paths
            assert sum((repo / c).stat().st_size for c in call) <= room * MIB, (room, paths, call)
        if room >= 2.0:  # a fuller call would have fitted: the limit that closed each call was reached
            assert all(len(call) == paths or sum((repo / c).stat().st_size for c in call) + 0.4 * MIB > room * MIB
                       for call in calls[:-1])


def test_the_plan_prints_each_calls_carry_list(repo, tmp_path, capsys):
    make(tmp_path / "f", 3 * MIB)
    parts = repo / ".cache" / "p"
    cp.split(tmp_path / "f", 1, parts)
    cp.main(["plan", str(parts), "--room-mib", "2.5", "--root", str(repo), "--to", "model.gguf"])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("call ")]
    printed = [json.loads(ln.split("carry ", 1)[1].split("  command:", 1)[0]) for ln in lines]
    assert printed == cp.plan(parts, 2.5, root=repo)
    assert lines[-1].endswith("join .cache/p --to model.gguf") and "join" not in lines[0]


def test_a_damaged_part_is_named_and_nothing_is_written(repo, tmp_path):
    make(tmp_path / "f", int(2.5 * MIB))
    parts = repo / ".cache" / "p"
    cp.split(tmp_path / "f", 1, parts)
    blob = bytearray((parts / "part-001").read_bytes())
    blob[100] ^= 1  # same size, one bit off
    (parts / "part-001").write_bytes(bytes(blob))
    out = tmp_path / "there" / "f"
    with pytest.raises(SystemExit, match=r"part-001 damaged"):
        cp.join(parts, out)
    assert not out.parent.exists()


def test_a_missing_part_is_named_and_nothing_is_written(repo, tmp_path):
    make(tmp_path / "f", int(2.5 * MIB))
    parts = repo / ".cache" / "p"
    cp.split(tmp_path / "f", 1, parts)
    (parts / "part-002").unlink()
    (tmp_path / "there").mkdir()
    with pytest.raises(SystemExit, match=r"part-002 missing"):
        cp.join(parts, tmp_path / "there" / "f")
    assert entries(tmp_path / "there") == []
    shutil.rmtree(parts)
    with pytest.raises(SystemExit, match=r"DIR .*no manifest\.json"):
        cp.join(parts, tmp_path / "there" / "f")


def test_a_cut_split_or_join_leaves_nothing_that_looks_finished(repo, tmp_path, monkeypatch):
    data = make(tmp_path / "f", int(2.5 * MIB))
    real, calls = cp._copy, []

    def cut(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(cp, "_copy", cut)
    with pytest.raises(KeyboardInterrupt):
        cp.split(tmp_path / "f", 1, repo / ".cache" / "p")
    assert not (repo / ".cache").exists()  # the folders it made went with the parts

    monkeypatch.setattr(cp, "_copy", real)
    cp.split(tmp_path / "f", 1, repo / ".cache" / "p")
    calls.clear()
    monkeypatch.setattr(cp, "_copy", cut)
    (tmp_path / "there").mkdir()
    with pytest.raises(KeyboardInterrupt):
        cp.join(repo / ".cache" / "p", tmp_path / "there" / "f")
    assert entries(tmp_path / "there") == []
    monkeypatch.setattr(cp, "_copy", real)
    cp.join(repo / ".cache" / "p", tmp_path / "there" / "f")
    assert (tmp_path / "there" / "f").read_bytes() == data


@pytest.mark.parametrize("args, match", [
    (["--mib", "0"], r"^--mib must be a positive"),
    (["--mib", "-1"], r"^--mib must be a positive"),
    (["--mib", "inf"], r"^--mib must be a positive"),
    (["--mib", "1e-9"], r"^--mib must be a positive"),
], ids=["zero", "negative", "inf", "under-a-byte"])
def test_split_refuses_a_bad_part_size_before_writing(tmp_path, args, match):
    make(tmp_path / "f", 1000)
    with pytest.raises(SystemExit, match=match):
        cp.main(["split", str(tmp_path / "f"), *args, "--out", str(tmp_path / "new" / "p")])
    assert entries(tmp_path) == ["f"]


def test_split_refuses_a_missing_file_and_a_folder_holding_other_files(tmp_path):
    with pytest.raises(SystemExit, match=r"^FILE .*nope: no such file"):
        cp.main(["split", str(tmp_path / "nope"), "--mib", "1", "--out", str(tmp_path / "p")])
    assert entries(tmp_path) == []

    make(tmp_path / "a", 3000)
    make(tmp_path / "b", 3000)
    cp.split(tmp_path / "a", 0.001, tmp_path / "p")
    before = {p.name: p.read_bytes() for p in (tmp_path / "p").iterdir()}
    with pytest.raises(SystemExit, match=r"^--out .* already holds the parts of another file \(a, 3,000 bytes\)"):
        cp.split(tmp_path / "b", 0.001, tmp_path / "p")
    with pytest.raises(SystemExit, match=r"^--out .* already holds this file's parts of 1048 bytes"):
        cp.split(tmp_path / "a", 0.002, tmp_path / "p")
    assert {p.name: p.read_bytes() for p in (tmp_path / "p").iterdir()} == before
    assert cp.split(tmp_path / "a", 0.001, tmp_path / "p")["parts"] == json.loads(before["manifest.json"])["parts"]
    assert sorted(entries(tmp_path)) == ["a", "b", "p"]  # no temporary folder left

    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match=r"^--out .* is not empty and holds no readable manifest"):
        cp.split(tmp_path / "a", 1, tmp_path / "other")
    assert entries(tmp_path / "other") == ["notes.txt"]
    with pytest.raises(SystemExit, match=r"^--out .* is a file"):
        cp.split(tmp_path / "a", 1, tmp_path / "b")

    (tmp_path / "empty").mkdir()
    cp.split(tmp_path / "a", 1, tmp_path / "empty")
    assert entries(tmp_path / "empty") == ["manifest.json", "part-000"]


def test_plan_refuses_what_a_call_cannot_carry(repo, tmp_path):
    make(tmp_path / "f", 2 * MIB)
    parts = repo / ".cache" / "p"
    cp.split(tmp_path / "f", 1, parts)
    with pytest.raises(SystemExit, match=r"^--room-mib must be a positive"):
        cp.plan(parts, 0, root=repo)
    with pytest.raises(SystemExit, match=r"^--room-mib 0\.5: .*part-000 alone is 1\.00 MiB"):
        cp.plan(parts, 0.5, root=repo)
    with pytest.raises(SystemExit, match=r"^--paths must be in 1\.\.8"):
        cp.plan(parts, 10, root=repo, paths=9)
    with pytest.raises(SystemExit, match=r"^DIR .* is outside the checkout"):
        cp.plan(parts, 10, root=repo / ".cache" / "elsewhere")
    (parts / "part-001").unlink()  # carried, a path absent here would remove it there
    with pytest.raises(SystemExit, match=r"^DIR .*: part part-001 is missing here"):
        cp.plan(parts, 10, root=repo)

    tracked = repo / "parts"
    cp.split(tmp_path / "f", 1, tracked)
    with pytest.raises(SystemExit, match=r"^DIR .* is not ignored by git"):
        cp.plan(tracked, 10, root=repo)
