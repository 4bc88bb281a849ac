"""The Python examples of the README and of the documentation run as written.

Every ```python block of README.md and of every page under docs/ (the guides, the mechanisms, the
results pages) is executed, in the order of the file, each in a fresh namespace (every example
carries its own imports) and in a temporary working directory, so an example that stops working
fails here. A block that cannot run in the test suite (it needs the optional [hf] extra, the
network, a trained checkpoint or minutes of CPU) is marked by an HTML comment on the line above
its fence:

    <!-- readme-test: skip (why) -->

Only marked blocks are skipped, and the markers are counted: a marker that is not directly above
a python block, or one without a reason, fails `test_skip_markers`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
MARKER = re.compile(r"<!--\s*readme-test:\s*skip\s*\((?P<why>[^)]*\S[^)]*)\)\s*-->")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # line of the file where the code starts
    code: str
    skip: str | None  # the marker's reason, or None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT).as_posix()}:line{self.line}"


def code_blocks(path: Path, text: str) -> list[Block]:
    blocks = []
    for m in FENCE.finditer(text):
        line_above = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        mark = MARKER.fullmatch(line_above)
        line = text.count("\n", 0, m.start(1)) + 1
        blocks.append(Block(path, line, m.group(1), mark.group("why") if mark else None))
    return blocks


DOCUMENTS = [README, *sorted(DOCS.rglob("*.md"))]
TEXTS = {path: path.read_text(encoding="utf-8") for path in DOCUMENTS}
BLOCKS = [b for path in DOCUMENTS for b in code_blocks(path, TEXTS[path])]


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
    skipped = [b.line for b in BLOCKS if b.path == path and b.skip is not None]
    assert len(skipped) == well_formed, (
        f"{name} has {well_formed} skip marker(s) but {len(skipped)} python block(s) directly below one "
        f"(blocks skipped at lines {skipped}): a marker must be the line right before the ```python fence"
    )


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_example(block: Block, tmp_path, monkeypatch):
    if block.skip is not None:
        pytest.skip(f"marked in {block.path.name}: {block.skip}")
    monkeypatch.chdir(tmp_path)
    # leading newlines make tracebacks give the file's line numbers
    code = compile("\n" * (block.line - 1) + block.code, str(block.path), "exec")
    exec(code, {"__name__": "__readme__"})
