"""Every docstring example of the packages and the benchmarks runs and shows what it prints.

One test per docstring with examples, in every module of ``aps_comm``,
``aps_launch``, ``aps_perfmodel`` and ``benchmarks`` (``__main__`` modules
aside: importing one runs its command), so the README's ``pytest`` checks
them and they cannot go stale. Examples that need what a unit test lacks (a
GPU, a cluster, a launcher, a DDP job) are marked ``# doctest: +SKIP``; a
docstring whose examples are all skipped is reported as skipped. The
examples run in the test process, so each one gets the environment back as it
was and fails if it leaves a default process group behind.

The modules are imported under the names users import, not collected with
``--doctest-modules`` from the checkout's directories: that imports
``launch/`` and ``perfmodel/`` a second time as ``launch`` and ``perfmodel``
(under either ``--import-mode``), whose classes are then not the installed
ones an example imports (``aps_perfmodel.formats.get_format`` returns a
``FormatSpec`` that ``perfmodel.strategies`` does not recognise); it would
also import the scripts in ``tests/launch_scripts`` and run the examples of
the tests' own helpers. Option flags are pytest's default (``ELLIPSIS``), so
``--doctest-modules`` on a single file agrees with this test.
"""

from __future__ import annotations

import doctest
import functools
import importlib
import os
import pkgutil
from unittest import mock

import pytest
import torch.distributed as dist

PACKAGES = ("aps_comm", "aps_launch", "aps_perfmodel", "benchmarks")


class _Finder(doctest.DocTestFinder):
    """The standard finder, which before Python 3.13 skips ``cached_property`` docstrings.

    ``functools.cached_property`` does not carry its function's ``__module__``
    there, so the finder takes it for an import from ``functools``
    (cpython#107995); pytest's doctest plugin unwraps it the same way.
    """

    def _from_module(self, module, obj) -> bool:
        if isinstance(obj, functools.cached_property):
            obj = obj.func
        return super()._from_module(module, obj)


def module_names() -> list[str]:
    """Every importable module of :data:`PACKAGES`, packages included."""
    names = []
    for package in PACKAGES:
        names.append(package)
        path = importlib.import_module(package).__path__
        for info in pkgutil.walk_packages(path, f"{package}."):
            if info.name.rpartition(".")[2] != "__main__":
                names.append(info.name)
    return names


def _doctests() -> list[doctest.DocTest]:
    finder = _Finder()
    found = []
    for name in module_names():
        found += [t for t in finder.find(importlib.import_module(name), name) if t.examples]
    return found


DOCTESTS = _doctests()


def test_every_module_is_searched() -> None:
    names = module_names()
    # The renamed directories are walked under their installed names, and
    # subpackages are entered.
    for name in (
        "aps_comm.hook",
        "aps_launch.slurm",
        "aps_perfmodel.comm",
        "benchmarks.cluster.cli",
    ):
        assert name in names
    assert not any(n.startswith(("launch", "perfmodel")) or n.endswith("__main__") for n in names)
    # cached_property docstrings are found too.
    assert "aps_comm.layout.Layout.longest" in {t.name for t in DOCTESTS}


@pytest.mark.parametrize("test", DOCTESTS, ids=[t.name for t in DOCTESTS])
def test_docstring_example(test: doctest.DocTest) -> None:
    if all(example.options.get(doctest.SKIP) for example in test.examples):
        pytest.skip("every example is +SKIP (needs a GPU, a cluster, a launcher or a DDP job)")
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    # The examples run in this process: what one exports (aps_launch's
    # pin_loopback, say) must not reach the tests after it.
    with mock.patch.dict(os.environ):
        failed, _ = runner.run(test, out=report.append)
    if dist.is_initialized():
        dist.destroy_process_group()
        report.append("the example left torch.distributed initialised for the tests after it\n")
        failed += 1
    if failed:
        pytest.fail("".join(report), pytrace=False)
