"""``aps_comm``'s modules import each other one way: no cycle, lazy and type-only imports included.

A cycle hidden behind ``TYPE_CHECKING`` or an import inside a function still
ties the modules together: neither can be read, tested or moved without the
other, and a change of import order can break at run time. The geometry that
the codec, the scaling rules and the Triton kernels share lives below all
three (:mod:`aps_comm.layout`).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "aps_comm"


def imports(path: Path, modules: set[str]) -> set[str]:
    """The sibling modules ``path`` imports anywhere: top level, functions, ``TYPE_CHECKING``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "aps_comm":
                names = [f"aps_comm.{a.name}" for a in node.names]
            else:
                names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "aps_comm" and len(parts) > 1 and parts[1] in modules:
                found.add(parts[1])
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_scan_finds_lazy_and_type_only_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_aps_comm_has_no_import_cycle(tmp_path: Path) -> None:
    sample = tmp_path / "m.py"
    sample.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from aps_comm.codec import Layout\n"
        "def f():\n    from aps_comm import triton_codec\n"
    )
    assert imports(sample, {"codec", "triton_codec"}) == {"codec", "triton_codec"}
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    graph = {m: imports(PACKAGE / f"{m}.py", modules) for m in modules}
    found = cycles(graph)
    detail = [" <-> ".join(c) for c in found]
    assert not found, "import cycles inside aps_comm:\n" + "\n".join(detail)
