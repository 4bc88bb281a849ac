"""attnlab.ops imports without circles: every `from .x import` (at the top of a module or inside a
function) read from the source, resolved to a module of the package, and the graph checked acyclic.
The scalar family's folder also keeps its stated order (ops/scalar/__init__.py)."""

from __future__ import annotations

import ast
from pathlib import Path

OPS = Path(__file__).resolve().parents[1] / "src" / "attnlab" / "ops"


def _module(path: Path) -> str:
    rel = path.relative_to(OPS.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    mods = {_module(p): p for p in OPS.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:  # `from . import x` names a module; `from .m import f` the module m
                candidates = (f"{target}.{alias.name}", target)
                hit = next((c for c in candidates if c in mods and c != mod), None)
                if hit:
                    graph[mod].add(hit)
    return graph


def test_ops_import_graph_has_no_circle():
    graph = _imports()
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if m.startswith(n + "."):
                continue  # a module and the package it sits in (loading a submodule loads its package)
            if state.get(n) == 1:
                raise AssertionError("import circle: " + " -> ".join(path + [n]))
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_scalar_family_imports_point_one_way():
    graph = _imports()
    order = ["naive", "fused", "chunked", "selected", "window", "triton_kernel", "triton_op", "attention", "approx"]
    rank = {f"ops.scalar.{n}": i for i, n in enumerate(order)}
    for m, targets in graph.items():
        for t in targets:
            if m in rank and t in rank:
                assert rank[t] < rank[m], f"{m} imports {t}, which comes after it"
