"""Dependencies run one way: ``aps_comm`` plans with ``aps_perfmodel``, never the reverse.

The model fits and predicts from plain numbers; timing the real hook and codec
is ``aps_comm``'s own business (``python -m aps_comm calibrate``,
``aps_comm.measure``). A model that imported ``aps_comm``, even lazily inside
a function, would tie the two packages into a cycle and make the model
unusable where ``aps_comm`` cannot load.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PERFMODEL = ROOT / "perfmodel"
# The calls that import a module named by a string.
_IMPORT_CALLS = {"import_module", "__import__"}


def _aps_comm_imports(path: Path) -> list[tuple[str, str, int]]:
    """Every ``aps_comm`` import in ``path``: (enclosing function or "", module, line).

    Import statements anywhere (inside functions too), and calls of
    ``importlib.import_module`` or ``__import__`` with a literal name.
    """
    found: list[tuple[str, str, int]] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = function
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                inner = function or child.name
            modules: list[str] = []
            if isinstance(child, ast.Import):
                modules = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                # `from aps_comm import codec` imports aps_comm.codec.
                modules = (
                    [f"aps_comm.{a.name}" for a in child.names]
                    if child.module == "aps_comm"
                    else [child.module]
                )
            elif isinstance(child, ast.Call) and child.args:
                func = child.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                first = child.args[0]
                if name in _IMPORT_CALLS and isinstance(first, ast.Constant):
                    modules = [str(first.value)]
            for module in modules:
                if module == "aps_comm" or module.startswith("aps_comm."):
                    found.append((inner, module, child.lineno))
            visit(child, inner)

    visit(ast.parse(path.read_text(), filename=str(path)), "")
    return found


def test_the_model_imports_nothing_of_aps_comm() -> None:
    wrong = [
        f"perfmodel/{path.name}:{line} imports {module}" + (f" in {fn}()" if fn else "")
        for path in sorted(PERFMODEL.rglob("*.py"))
        for fn, module, line in _aps_comm_imports(path)
    ]
    assert not wrong, "aps_perfmodel must not import aps_comm, even lazily:\n" + "\n".join(wrong)


def test_the_scan_sees_imports_inside_functions(tmp_path: Path) -> None:
    sample = tmp_path / "m.py"
    sample.write_text(
        "import aps_comm.config\n"
        "def f():\n    from aps_comm import codec, hook\n"
        "def g():\n    def h():\n        import aps_comm\n"
        "def k():\n    importlib.import_module('aps_comm.calibrate')\n    __import__('aps_comm')\n"
        "import_module('numpy')\n"
    )
    assert _aps_comm_imports(sample) == [
        ("", "aps_comm.config", 1),
        ("f", "aps_comm.codec", 3),
        ("f", "aps_comm.hook", 3),
        ("g", "aps_comm", 6),
        ("k", "aps_comm.calibrate", 8),
        ("k", "aps_comm", 9),
    ]


_WITHOUT_APS_COMM = """
import importlib, json, pkgutil, sys

# Importing either now raises ImportError: the model must not need them.
sys.modules["aps_comm"] = None
sys.modules["torch"] = None
import aps_perfmodel
from aps_perfmodel.cli import main

names = sorted(
    m.name
    for m in pkgutil.iter_modules(aps_perfmodel.__path__, "aps_perfmodel.")
    # A developer's script that builds the presets from torch models.
    if m.name != "aps_perfmodel._generate_presets"
)
for name in names:
    importlib.import_module(name)
codes = [
    main(["predict", "--model", "resnet50", "--world-size", "8", "--cluster", "1gbe"]),
    main(["fsdp", "--model", "gpt2-xl", "--world-size", "8", "--cluster", "100gbe"]),
    # Measuring is the plugin's: the old command only points to it, without aps_comm.
    main(["calibrate", "--out", "unused.json"]),
]
print(json.dumps({"modules": names, "codes": codes}))
"""


def test_the_model_imports_and_predicts_without_aps_comm_or_torch() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_APS_COMM],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["codes"] == [0, 0, 2]
    assert "-m aps_comm calibrate --out unused.json" in proc.stderr
    assert {"aps_perfmodel.calibrate", "aps_perfmodel.cli", "aps_perfmodel.strategies"} <= set(
        result["modules"]
    )
