"""What ``pip install`` gets: the sdist and wheel, built as ``python -m build`` does.

The wheel is built from the sdist with setuptools' PEP 517 backend in a
process where torch cannot be imported (``setup.cfg`` must read the version
without importing the package), then inspected, unpacked and imported from
outside the checkout.
"""

from __future__ import annotations

import ast
import configparser
import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from conftest import made_once

import aps_comm

ROOT = Path(__file__).resolve().parents[1]
# Installed name -> directory in the checkout (setup.cfg's package_dir).
PACKAGES = {"aps_comm": "aps_comm", "aps_launch": "launch", "aps_perfmodel": "perfmodel"}
ENTRY_POINTS = {
    "aps-launch": "aps_launch.cli:main",
    "aps-demo": "aps_launch.demo:main",
    "aps-perfmodel": "aps_perfmodel.cli:main",
}
# Top-level names that must not be imported: the checkout's directory names
# (not installed) and the benchmarks (run from the checkout only).
_NOT_INSTALLED = {"launch", "perfmodel", "benchmarks"}

_BUILD = """
import json, os, sys, tarfile

sys.modules["torch"] = None  # importing torch now raises ImportError
from setuptools import build_meta

out = sys.argv[1]
sdist = build_meta.build_sdist(out)
with tarfile.open(os.path.join(out, sdist)) as tar:
    # filter= exists from Python 3.12 and in 3.10/3.11 security releases.
    safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    tar.extractall(os.path.join(out, "unpacked"), **safe)
os.chdir(os.path.join(out, "unpacked", sdist[: -len(".tar.gz")]))
wheel = build_meta.build_wheel(out)
print(json.dumps({"sdist": sdist, "wheel": wheel}))
"""

_IMPORT_ALL = """
import importlib, json, sys

site, modules = sys.argv[1], json.loads(sys.argv[2])
ours = {"aps_comm", "aps_launch", "aps_perfmodel", "launch", "perfmodel", "benchmarks"}
skipped = {}
for name in modules:
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] in ours:
            raise
        skipped[name] = exc.name  # an optional dependency this environment lacks
        continue
    assert module.__file__.startswith(site), (name, module.__file__)
from aps_perfmodel import get_model

preset = get_model("resnet50")  # package data, found next to the installed module
print(json.dumps({"skipped": skipped, "resnet50": preset.total_params}))
"""


def _source_files(directory: str) -> set[str]:
    base = ROOT / directory
    return {
        p.relative_to(base).as_posix() for p in base.rglob("*.py") if "__pycache__" not in p.parts
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> dict[str, Path]:
    # Two tests read it, and xdist hands a module's tests to different workers.
    return made_once(
        tmp_path_factory, worker_id, "test_packaging.built", lambda: _build(tmp_path_factory)
    )


def _build(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sdist and the wheel built from a copy of the checkout, in a scratch folder."""
    tmp = tmp_path_factory.mktemp("packaging")
    # A copy, so that the build's egg-info and build/ stay out of the checkout.
    src = tmp / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"
        ),
    )
    out = tmp / "dist"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", _BUILD, str(out)],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = json.loads(proc.stdout.splitlines()[-1])
    return {"sdist": out / names["sdist"], "wheel": out / names["wheel"], "tmp": tmp}


@pytest.mark.slow
def test_wheel_installs_exactly_the_packages_with_license_data_and_entry_points(
    built: dict[str, Path],
) -> None:
    wheel = built["wheel"]
    assert wheel.name == f"aps_comm-{aps_comm.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        dist_info = f"aps_comm-{aps_comm.__version__}.dist-info"
        top = {n.split("/")[0] for n in names} - {dist_info}
        assert top == set(PACKAGES), top  # no benchmarks, tests, launch or perfmodel
        for installed, directory in PACKAGES.items():
            in_wheel = {n[len(installed) + 1 :] for n in names if n.startswith(installed + "/")}
            missing = _source_files(directory) - in_wheel
            assert not missing, f"{directory}/ files not in the wheel's {installed}/: {missing}"
        data_dir = ROOT / "perfmodel" / "data"
        data = {p.relative_to(data_dir).as_posix() for p in data_dir.rglob("*.json")}
        assert "devices/h200.json" in data
        assert data and {f"aps_perfmodel/data/{n}" for n in data} <= set(names)

        metadata = zf.read(f"{dist_info}/METADATA").decode()
        assert f"\nVersion: {aps_comm.__version__}\n" in metadata
        assert "\nLicense-File: LICENSE\n" in metadata
        (license_name,) = [n for n in names if n.startswith(dist_info) and n.endswith("LICENSE")]
        license_text = zf.read(license_name).decode()
        assert license_text == (ROOT / "LICENSE").read_text()
        assert "BSD 3-Clause License" in license_text and "the aps-comm authors" in license_text

        entry_points = configparser.ConfigParser()
        entry_points.read_string(zf.read(f"{dist_info}/entry_points.txt").decode())
        assert dict(entry_points["console_scripts"]) == ENTRY_POINTS

    with tarfile.open(built["sdist"]) as tar:
        members = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    assert {"LICENSE", "README.md", "setup.cfg", "pyproject.toml"} <= members
    assert {f"perfmodel/data/{n}" for n in data} <= members


@pytest.mark.slow
def test_wheel_imports_from_outside_the_checkout(built: dict[str, Path]) -> None:
    site = built["tmp"] / "site"
    with zipfile.ZipFile(built["wheel"]) as zf:
        zf.extractall(site)
        modules = sorted(
            n[: -len(".py")].replace("/", ".").removesuffix(".__init__")
            for n in zf.namelist()
            if n.endswith(".py") and not n.endswith("__main__.py")
        )
    outside = built["tmp"] / "elsewhere"
    outside.mkdir()
    # Only the unpacked wheel on PYTHONPATH, run from an empty directory.
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, str(site), json.dumps(modules)],
        cwd=outside,
        env={"PYTHONPATH": str(site), "PATH": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["resnet50"] > 25_000_000
    assert set(result["skipped"]) < set(modules)  # optional integrations at most


def test_version_is_read_without_importing_torch() -> None:
    # setup.cfg's `attr:` evaluates the assignment statically; the build test
    # above proves it in a process without torch, this one names the cause.
    tree = ast.parse((ROOT / "aps_comm" / "__init__.py").read_text())
    versions = [
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["__version__"]
        and isinstance(node.value, ast.Constant)
    ]
    assert versions == [aps_comm.__version__]
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    assert setup["metadata"]["version"] == "attr: aps_comm.__version__"


def test_nothing_imports_the_checkout_directory_names() -> None:
    # Installed, launch/ and perfmodel/ are aps_launch and aps_perfmodel; an
    # import by the directory name works only from the checkout.
    offenders = []
    for directory in ("aps_comm", "launch", "perfmodel", "benchmarks", "tests"):
        for path in sorted((ROOT / directory).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                bad = [n for n in names if n.split(".")[0] in {"launch", "perfmodel"}]
                if bad:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {bad}")
    assert not offenders, "import aps_launch / aps_perfmodel instead:\n" + "\n".join(offenders)
