"""The Python examples and the shell commands of the README and of the documentation run as written.

Every ```python block of README.md and of every page under docs/ (the guides, the mechanisms, the
results pages) is executed, in the order of the file, each in a fresh namespace (every example
carries its own imports) and in a temporary working directory, so an example that stops working
fails here. A block that cannot run in the test suite (it needs the optional [hf] extra, the
network, a trained checkpoint or minutes of CPU) is marked by an HTML comment on the line above
its fence:

    <!-- readme-test: skip (why) -->

Only marked blocks are skipped, and the markers are counted: a marker that is not directly above
a python or bash block, or one without a reason, fails `test_skip_markers`.

The ```bash blocks of a file run in the order a reader meets them, in one fresh folder holding
copies of configs/, experiments/ (results, no run folders) and examples/, as a reader's clone would:
`test_commands_in_order` (slow: they train) runs every unmarked block; `test_quick_commands` (in
`make test`) runs their lines that train nothing (`--help`, `--report-only`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
BASH_FENCE = re.compile(r"^```bash[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
MARKER = re.compile(r"<!--\s*readme-test:\s*skip\s*\((?P<why>[^)]*[^)\s][^)]*)\)\s*-->")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # line of the file where the code starts
    code: str
    skip: str | None  # the marker's reason, or None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT).as_posix()}:line{self.line}"


def code_blocks(path: Path, text: str, fence: re.Pattern = FENCE) -> list[Block]:
    blocks = []
    for m in fence.finditer(text):
        line_above = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        mark = MARKER.fullmatch(line_above)
        line = text.count("\n", 0, m.start(1)) + 1
        blocks.append(Block(path, line, m.group(1), mark.group("why") if mark else None))
    return blocks


DOCUMENTS = [README, *sorted(DOCS.rglob("*.md"))]
TEXTS = {path: path.read_text(encoding="utf-8") for path in DOCUMENTS}
BLOCKS = [b for path in DOCUMENTS for b in code_blocks(path, TEXTS[path])]
BASH = [b for path in DOCUMENTS for b in code_blocks(path, TEXTS[path], BASH_FENCE)]


def test_examples_found():
    readme = [b for b in BLOCKS if b.path == README and b.skip is None]
    docs = [b for b in BLOCKS if b.path != README and b.skip is None]
    assert len(readme) >= 3, "the README's python examples were not found"
    assert len(docs) >= 5, "the python examples of docs/ were not found"


@pytest.mark.parametrize("path", DOCUMENTS, ids=[p.relative_to(ROOT).as_posix() for p in DOCUMENTS])
def test_skip_markers(path: Path):
    """Every readme-test comment is a well-formed skip marker directly above a python block."""
    text = TEXTS[path]
    name = path.relative_to(ROOT).as_posix()
    mentions = text.count("readme-test")
    well_formed = len(MARKER.findall(text))
    assert mentions == well_formed, f"{mentions - well_formed} malformed readme-test comment(s) in {name}"
    skipped = [b.line for b in BLOCKS + BASH if b.path == path and b.skip is not None]
    assert len(skipped) == well_formed, (
        f"{name} has {well_formed} skip marker(s) but {len(skipped)} python or bash block(s) directly below one "
        f"(blocks skipped at lines {skipped}): a marker must be the line right before the ```python / ```bash fence"
    )


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_example(block: Block, tmp_path, monkeypatch):
    if block.skip is not None:
        pytest.skip(f"marked in {block.path.name}: {block.skip}")
    monkeypatch.chdir(tmp_path)
    # leading newlines make tracebacks give the file's line numbers
    code = compile("\n" * (block.line - 1) + block.code, str(block.path), "exec")
    exec(code, {"__name__": "__readme__"})


# --------------------------------------------------------------------------- shell commands


def commands(block: Block) -> list[str]:
    """The block's command lines, continuation lines joined, comments and blank lines left out."""
    out, cur = [], ""
    for raw in block.code.splitlines():
        line = raw.rstrip()
        if cur:
            cur += " " + line.strip()
        elif line.strip() and not line.lstrip().startswith("#"):
            cur = line.strip()
        if cur.endswith("\\"):
            cur = cur[:-1].rstrip()
            continue
        if cur:
            out.append(cur)
        cur = ""
    return out


def clone_like(dest: Path) -> Path:
    """A reader's working folder: configs/, experiments/ without run folders, examples/."""
    shutil.copytree(ROOT / "configs", dest / "configs")
    shutil.copytree(ROOT / "experiments", dest / "experiments", ignore=shutil.ignore_patterns("runs"))
    shutil.copytree(ROOT / "examples", dest / "examples")
    return dest


def run_command(command: str, cwd: Path, timeout: int) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"`{command}` exited {proc.returncode}:\n{proc.stderr[-3000:]}"


RUNNABLE = [b for b in BASH if b.skip is None]
BASH_FILES = sorted({b.path for b in RUNNABLE}, key=lambda p: p.as_posix())
QUICK = list({c: (b, c) for b in reversed(RUNNABLE) for c in commands(b)  # each command once, where first met
              if "--help" in c.split() or "--report-only" in c.split()}.values())[::-1]


def test_bash_blocks_found():
    assert any(b.path == README for b in RUNNABLE) and QUICK, "no runnable bash block or quick command was found"


@pytest.mark.heavy
@pytest.mark.parametrize("block,command", QUICK, ids=[f"{b.id}:{c.split()[1] if len(c.split()) > 1 else c}"
                                                      for b, c in QUICK])
def test_quick_commands(block: Block, command: str, tmp_path):
    """The lines that train nothing run as written on a reader's folder (a report rebuilt from the
    committed results.json alone, a --help)."""
    run_command(command, clone_like(tmp_path), timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("path", BASH_FILES, ids=[p.relative_to(ROOT).as_posix() for p in BASH_FILES])
def test_commands_in_order(path: Path, tmp_path):
    """Every unmarked bash block of a file, in order, in one reader's folder: each line exits 0."""
    folder = clone_like(tmp_path)
    for block in (b for b in RUNNABLE if b.path == path):
        for command in commands(block):
            run_command(command, folder, timeout=1200)
