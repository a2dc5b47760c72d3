"""Issue 46, item 4: functions in ``aps_comm`` that a reader can hold in their head.

No function outside the Triton kernels (``@triton.jit``: their arguments are
what the launchers pass, one per pointer and scalar) is longer than 120 lines
or takes more than 12 parameters. The ones that still do are listed below
with their size today: the list may only shrink (a listed function that grew,
or one that now fits and is still listed, fails too).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 120
MAX_PARAMS = 12

# (module, function): (lines, parameters) today. Shrink it; never add to it.
KNOWN: dict[tuple[str, str], tuple[int, int]] = {}


def _is_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any("triton.jit" in ast.unparse(d) for d in fn.decorator_list)


def function_shapes(path: Path) -> dict[str, tuple[int, int]]:
    """Every function of ``path`` but the Triton kernels: name -> (lines, parameters),
    ``self`` and ``cls`` not counted."""
    shapes: dict[str, tuple[int, int]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or _is_kernel(node):
            continue
        a = node.args
        params = [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
        names = [p.arg for p in params if p is not None]
        count = len(names) - int(bool(names) and names[0] in ("self", "cls"))
        lines = (node.end_lineno or node.lineno) - node.lineno + 1
        name = node.name
        # Two functions of one name in a module: keep the larger.
        shapes[name] = max(shapes.get(name, (0, 0)), (lines, count))
    return shapes


def test_no_function_is_longer_or_wider_than_the_limits() -> None:
    problems = []
    for path in sorted((ROOT / "aps_comm").glob("*.py")):
        for name, (lines, params) in function_shapes(path).items():
            key = (path.stem, name)
            over = lines > MAX_LINES or params > MAX_PARAMS
            known = KNOWN.get(key)
            if over and known is None:
                problems.append(f"{key}: {lines} lines, {params} parameters (new)")
            elif over and known is not None and (lines > known[0] or params > known[1]):
                problems.append(f"{key}: {lines} lines, {params} parameters, was {known}")
            elif not over and known is not None:
                problems.append(f"{key}: fits now ({lines} lines, {params}): drop it from KNOWN")
    assert not problems, problems


def test_the_scan_counts_lines_and_parameters(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(130))
    src.write_text(
        "import triton\n"
        f"def long(a, b):\n{body}\n"
        "class C:\n    def wide(self, a, b, c, d, e, f, g, h, i, j, k, l, m):\n        pass\n"
        "@triton.jit\ndef kernel(a, b, c, d, e, f, g, h, i, j, k, l, m):\n    pass\n"
    )
    shapes = function_shapes(src)
    assert shapes["long"] == (131, 2)
    assert shapes["wide"] == (2, 13)
    assert "kernel" not in shapes
