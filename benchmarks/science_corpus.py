"""The corpus a science batch trains on, carried to the GPU machine beside the committed MANIFEST.json
that describes it: copied from this interpreter's stdlib (`write_corpus` makes the folders and a new
manifest, `materialise_corpus` the folders as the manifest lists them) and checked file by file
against the manifest before anything trains (`check_corpus`). `python benchmarks/gpu_science.py
corpus [--copy|--write]` runs them.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from science_state import sha256

ROOT = Path(__file__).resolve().parents[1]


def corpus_folders(spec_path: Path) -> list[Path]:
    """The local folders a spec reads text from (its base data.source, its metrics.heldout), as paths
    from the repository root, where the commands run."""
    from attnlab.train.config import read_toml

    raw = read_toml(spec_path)
    base = raw.get("base")
    base = read_toml((spec_path.parent / base).resolve()) if isinstance(base, str) else (base or {})
    names = [(base.get("data") or {}).get("source"), (raw.get("metrics") or {}).get("heldout")]
    return [ROOT / n for n in names if isinstance(n, str) and "/" in n]


def write_corpus(folder: Path) -> dict:
    """Copy this interpreter's stdlib corpus (every split) and the test split of its regression suite
    ("stdlib-tests", what metrics.heldout reads) into FOLDER/stdlib and FOLDER/stdlib-tests, each file
    under its path relative to the stdlib (so the path-hash splits are the stdlib's own), and write
    FOLDER/MANIFEST.json: the Python they came from, each file's SHA-256, the byte tokens per split."""
    from attnlab.data.corpus import _stdlib_tests_listing, stdlib_files, stdlib_root
    from attnlab.data.splits import split_of

    root = stdlib_root()
    picks = {"stdlib": [(rel, root / rel) for rel in stdlib_files("all")],
             "stdlib-tests": [(rel, root / "test" / rel) for rel, s in _stdlib_tests_listing(str(root)) if s == "test"]}
    manifest = {"python": ".".join(map(str, sys.version_info[:3])), "copied_from": str(root), "folders": {}}
    for name, files in picks.items():
        target = folder / name
        shutil.rmtree(target, ignore_errors=True)
        entry = {"files": {}, "tokens": {}}
        for rel, src in files:
            data = src.read_bytes()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:  # the corpus readers skip such a file: so does the copy
                continue
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            (target / rel).write_bytes(data)
            entry["files"][rel] = sha256(data)
            split = split_of(rel)
            entry["tokens"][split] = entry["tokens"].get(split, 1) + len(data) + 1  # pack_documents' separators
        manifest["folders"][name] = entry
    (folder / "MANIFEST.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def materialise_corpus(folder: Path) -> dict:
    """FOLDER's corpus copied again from this interpreter's stdlib, file by file as FOLDER/MANIFEST.json
    lists them (the folders are not committed: they are carried to the GPU machine), then checked
    against it: a Python whose files differ from the manifest's stops here, naming them."""
    from attnlab.data.corpus import stdlib_root

    manifest = json.loads((folder / "MANIFEST.json").read_text())
    root = stdlib_root()
    bases = {"stdlib": root, "stdlib-tests": root / "test"}
    for name, entry in manifest["folders"].items():
        target = folder / name
        shutil.rmtree(target, ignore_errors=True)
        for rel in entry["files"]:
            src = bases[name] / rel
            if not src.is_file():
                raise SystemExit(f"corpus {target}: {rel} is not in this Python's stdlib ({bases[name]}); "
                                 f"the manifest lists Python {manifest['python']}'s")
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, target / rel)
    return check_corpus([folder / name for name in manifest["folders"]])


def check_corpus(folders: list[Path]) -> dict:
    """Each folder against the MANIFEST.json beside it: the same files, byte for byte, and no other.
    Returns what was checked; raises SystemExit naming the first difference."""
    out = {}
    for folder in folders:
        manifest = folder.parent / "MANIFEST.json"
        try:
            entry = json.loads(manifest.read_text())["folders"][folder.name]
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"corpus {folder}: no manifest entry in {manifest} ({e})")
        have = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []
        missing = sorted(set(entry["files"]) - set(have))
        extra = sorted(set(have) - set(entry["files"]))
        if missing or extra:
            raise SystemExit(f"corpus {folder}: {len(missing)} file(s) missing (first {missing[:3]}), {len(extra)} not in "
                             f"{manifest.name} (first {extra[:3]})")
        bad = [rel for rel in have if sha256(folder / rel) != entry["files"][rel]]
        if bad:
            raise SystemExit(f"corpus {folder}: {len(bad)} file(s) differ from {manifest.name} (first {bad[:3]})")
        key = folder.relative_to(ROOT).as_posix() if folder.resolve().is_relative_to(ROOT) else str(folder)
        out[key] = {"files": len(have), "tokens": entry["tokens"]}
    return out
