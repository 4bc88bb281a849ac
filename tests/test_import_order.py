"""The package's imports point down the documented order and close no circle.

The order is ../shared/DESIGN.md's list (docs/adding-a-mechanism.md points here), written once:
cli -> experiments -> retrofit -> search -> hf -> train / eval -> models -> layers -> cache -> index ->
ops -> data. Every `import` / `from ... import` of attnlab, at the top of a module or inside a
function, is read from the source; an import of a higher layer fails the test unless it is listed in
UPWARD with the reason it is still there; any circle among modules fails it (a module and its own
package aside). Top-level utility modules (checks, masks, lock, interrupt, pool, testing,
report_format, regularizers, harness) sit outside the layers."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "attnlab"
ORDER = ["cli", "experiments", "retrofit", "search", "hf", "train eval", "models", "layers", "cache", "index", "ops",
         "data"]
UPWARD: dict[tuple[str, str], str] = {}  # (importer, imported): why it stays for now (none today)


def _modules() -> dict[str, Path]:
    mods = {}
    for p in SRC.rglob("*.py"):
        parts = list(p.relative_to(SRC.parent).with_suffix("").parts)
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return mods


def _imports() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                names = [f"{target}.{a.name}" for a in node.names] + [target]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            hit = next((n for n in names if n in mods), None)
            if hit and hit != mod and not mod.startswith(hit + "."):
                graph[mod].add(hit)
    return graph


def _layer(mod: str) -> int | None:
    top = mod.split(".")[1] if "." in mod else ""
    return next((i for i, names in enumerate(ORDER) if top in names.split()), None)


@pytest.mark.heavy
def test_no_import_points_up_the_order():
    found = {(m, t) for m, targets in _imports().items() for t in targets
             if _layer(m) is not None and _layer(t) is not None and _layer(t) < _layer(m)}
    assert found - set(UPWARD) == set(), "imports that point up: " + ", ".join(f"{m} -> {t}" for m, t in sorted(found - set(UPWARD)))
    assert set(UPWARD) - found == set(), f"listed but gone (take them off UPWARD): {sorted(set(UPWARD) - found)}"


@pytest.mark.heavy
def test_no_import_circle():
    graph, state = _imports(), {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


@pytest.mark.heavy
def test_scalar_family_imports_point_one_way():
    """Inside ops/scalar/ (its __init__ states the order): the formula first, the public ops last."""
    order = ["args", "naive", "fused", "chunked", "selected", "nearest", "tree", "window_cpu", "triton_math", "triton_kernel",
             "triton_backward", "triton_op", "route", "budget", "window", "attention", "approx", "flex"]
    rank = {f"attnlab.ops.scalar.{n}": i for i, n in enumerate(order)}
    for m, targets in _imports().items():
        for t in targets:
            if m in rank and t in rank:
                assert rank[t] < rank[m], f"{m} imports {t}, which comes after it"
