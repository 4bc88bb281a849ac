"""The README's Python examples run as written.

Every ```python block of README.md is executed, in README order, each in a fresh namespace (every
example carries its own imports) and in a temporary working directory, so an example that stops
working fails here. A block that cannot run in the test suite (it needs the optional [hf] extra,
the network, a trained checkpoint or minutes of CPU) is marked in the README by an HTML comment on
the line above its fence:

    <!-- readme-test: skip (why) -->

Only marked blocks are skipped, and the markers are counted: a marker that is not directly above
a python block, or one without a reason, fails `test_skip_markers`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
MARKER = re.compile(r"<!--\s*readme-test:\s*skip\s*\((?P<why>[^)]*\S[^)]*)\)\s*-->")


@dataclass(frozen=True)
class Block:
    line: int  # README line of the first code line
    code: str
    skip: str | None  # the marker's reason, or None


def readme_blocks(text: str) -> list[Block]:
    blocks = []
    for m in FENCE.finditer(text):
        line_above = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        mark = MARKER.fullmatch(line_above)
        line = text.count("\n", 0, m.start(1)) + 1
        blocks.append(Block(line, m.group(1), mark.group("why") if mark else None))
    return blocks


TEXT = README.read_text(encoding="utf-8")
BLOCKS = readme_blocks(TEXT)


def test_readme_has_examples():
    assert sum(b.skip is None for b in BLOCKS) >= 3, "the README's python examples were not found"


def test_skip_markers():
    """Every readme-test comment is a well-formed skip marker directly above a python block."""
    mentions = TEXT.count("readme-test")
    well_formed = len(MARKER.findall(TEXT))
    assert mentions == well_formed, f"{mentions - well_formed} malformed readme-test comment(s) in README.md"
    skipped = [b.line for b in BLOCKS if b.skip is not None]
    assert len(skipped) == well_formed, (
        f"README.md has {well_formed} skip marker(s) but {len(skipped)} python block(s) directly below one "
        f"(blocks skipped at lines {skipped}): a marker must be the line right before the ```python fence"
    )


@pytest.mark.parametrize("block", BLOCKS, ids=[f"line{b.line}" for b in BLOCKS])
def test_readme_example(block: Block, tmp_path, monkeypatch):
    if block.skip is not None:
        pytest.skip(f"marked in README.md: {block.skip}")
    monkeypatch.chdir(tmp_path)
    # leading newlines make tracebacks give README line numbers
    code = compile("\n" * (block.line - 1) + block.code, str(README), "exec")
    exec(code, {"__name__": "__readme__"})
