"""The commands and code of the README and of every page in docs/, run as written.

Every shell command in a ```bash block, and every command shown inline
(`python -m ...`, `python script.py`, `pip install ...`, `aps-launch ...`,
...), in README.md or docs/*.md, is either run here verbatim (:data:`RUN`)
or listed in :data:`EXEMPT` with the reason; a command in neither, or an
entry no longer in any of them, fails
:func:`test_every_doc_command_is_run_or_exempt`. A command shown on several
pages runs once. Python blocks are all compiled. A block followed by a
paragraph starting "Saved as `NAME.py`" is a script: it is written to
NAME.py beside every command that names it, and runs only there. The
``init_distributed`` training script (docs/launching-and-restarts.md) runs
under that page's ``aps-launch`` commands. The other blocks run together per
page and section in a world of one (so alternatives shown side by side must
not conflict). Relative links between the pages must resolve.
"""

from __future__ import annotations

import ast
import configparser
import csv
import dataclasses
import inspect
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import Starter

from aps_comm import APSState, fsdp, register
from aps_comm.config import BlockExponents, Reduction, Scaling, default_block_size
from aps_comm.hook import StateOptions
from aps_perfmodel import get_cluster, get_device, get_model, predict
from aps_perfmodel.units import format_time

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
_JOB_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "APS_BACKEND")
# Inline code that is a command rather than a name: `python -m x`, `pip install x`,
# or a launcher/tool followed by arguments.
_INLINE_COMMAND = re.compile(
    r"^(python -m \S+.*|python \S+\.py.*|pip install \S.*|"
    r"(aps-launch|aps-demo|aps-perfmodel|mpirun|srun|torchrun|pytest|ruff) \S.*)$"
)

_PIP = (
    "installs into the environment the tests run in; .ci/run installs the quick-start "
    "test line into a fresh venv, and tests/test_packaging.py builds and inspects the wheel"
)
_MULTI_NODE = "needs two machines (10.0.0.1 is node 0's address)"
_SLURM = "needs a SLURM allocation"
_MPI = "needs an MPI hostfile with several nodes (and NCCL for --backend nccl)"

EXEMPT: dict[str, str] = {
    'pip install torch==2.13.0 ".[demo]"': _PIP,
    'pip install torch==2.13.0 -e ".[test]"': _PIP,
    'pip install ".[demo]"': _PIP,
    'pip install -e ".[lightning]"': _PIP,
    'pip install -e ".[mpi]"': _PIP,
    'pip install -e ".[lightning,tensorboard]"': _PIP,
    'pip install -e ".[accelerate]"': _PIP,
    'pip install -e ".[transformers]"': _PIP,
    'pip install -e ".[tensorboard]"': _PIP,
    "pip install .": _PIP,
    "python -m benchmarks.gpu --out gpu-results": (
        "needs a CUDA GPU for its measurements; tests/test_benchmarks_gpu.py runs it on this "
        "machine, where it records every step as skipped and exits 0"
    ),
    "pytest": (
        "the test suite itself (it would run this test again); .ci/run runs it, and "
        "test_quick_start_test_command_is_what_ci_runs checks that the line is CI's"
    ),
    "pytest -n 0 tests/test_hook.py": (
        "one file of the suite in one process: the suite runs it (this is that suite)"
    ),
    "aps-demo": (
        "the same run as `aps-demo --json results.json --plot loss.png`, which runs here: "
        "the two flags only add the two files"
    ),
    "aps-launch --nproc-per-node 4 -m mypackage.train": (
        "4 ranks on 2 cores take ~30 s; the same 4-rank launch of the same script runs "
        "here as `aps-launch --nproc-per-node 4 --backend gloo train.py`, and -m runs in "
        "tests/test_launch.py"
    ),
    "aps-launch --nproc-per-node 2 -m aps_comm calibrate --out profile.json": (
        "times collectives and codec passes up to 64 MiB for over two minutes; "
        "tests/test_perfmodel_calibrate.py runs the same command on 2 ranks and small sizes"
    ),
    "python -m aps_comm calibrate": (
        "named inline, not a command line: the full command, `aps-launch --nproc-per-node 2 "
        "-m aps_comm calibrate --out profile.json`, is in docs/performance-model.md (exempt "
        "above)"
    ),
    "aps-perfmodel calibrate": (
        "the old command, named inline where the docs say it only points to the new one; "
        "tests/test_perfmodel_cli.py runs it and checks the pointer"
    ),
    "aps-perfmodel sweep ... | head -2": (
        "an elided command; tests/test_perfmodel_cli.py runs a sweep whose reader has gone "
        "and checks that it ends quietly"
    ),
    "python -m benchmarks.codec": (
        "a timing benchmark (64 MiB, 9 repeats, ~15 s of a core) whose numbers are not "
        "a pass/fail check; its results are benchmarks/results/codec.json"
    ),
    "python -m benchmarks.restarts --runs 20": (
        "20 crash-and-resume jobs (~3 min); its results are benchmarks/results/restarts.json, "
        "and one crash-and-resume runs here (the aps-launch --max-restarts line) and in "
        "tests/test_faults.py"
    ),
    "python -m benchmarks.hostcost": (
        "a benchmark (timing belongs in benchmarks); tests/test_hostcost.py runs its "
        "op count and the settled path's bits"
    ),
    "python -m benchmarks.hostcost --device cuda": "needs a CUDA device",
    "python -m benchmarks.triton_launches --configs two_phase,promote --layers 4,32": (
        "a benchmark under Triton's interpreter (a minute for 32 layers); "
        "tests/test_triton_launches.py runs it on smaller buckets, and its results for "
        "every configuration are benchmarks/results/triton_launches.json"
    ),
    "python -m benchmarks.hostcost --memory 8 --configs all": (
        "a benchmark of the state's bytes over a model of 8.4M parameters (minutes of CPU); "
        "tests/test_workspace.py runs measure_memory and pins its bound"
    ),
    "python -m benchmarks.hostcost --configs fsdp": (
        "a benchmark (timing belongs in benchmarks); tests/test_hostcost.py runs its HSDP "
        "op count; its results are benchmarks/results/hostcost_cpu_fsdp.json"
    ),
    "python -m benchmarks.gpu --out gpu --steps step,codec --preset h200": (
        "needs a CUDA GPU for its measurements, and would rewrite the shipped h200 preset; "
        "tests/test_benchmarks_gpu.py runs --preset with --from into a scratch folder"
    ),
    "python -m benchmarks.gpu --preset h200 --from gpu/gpu.json": (
        "needs a report of a GPU run, and would rewrite the shipped h200 preset; "
        "tests/test_benchmarks_gpu.py runs it on the H200 run into a scratch folder and "
        "checks that the shipped preset is what it derives"
    ),
    "python -m benchmarks.accuracy": (
        "the full benchmark, 4 ranks x 3 seeds x 9 hooks x 2 tasks (944 s for the committed "
        "benchmarks/results/accuracy.json); tests/test_benchmarks.py runs it with tiny "
        "settings and checks accuracy_layers.png"
    ),
    "accelerate launch --multi_gpu --num_processes 2 train_accelerate.py": (
        "needs 2 GPUs; the same script runs here on 2 CPU processes (the torchrun line)"
    ),
    "tensorboard --logdir runs": (
        "a server that runs until stopped; the event files it shows are read back after "
        "the train_tensorboard.py and train_lightning.py runs here"
    ),
    "python -m aps_comm": (
        "runs in tests/test_formats.py as `python -W error -m aps_comm`, which also fails "
        "on any warning it prints"
    ),
    "python -m build": (
        "needs the build package and the index for its isolated build environment; "
        "tests/test_packaging.py builds the sdist and wheel with the same backend offline"
    ),
    "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint "
    "10.0.0.1:29400 --rdzv-id job42 train.py --epochs 90": _MULTI_NODE,
    "aps-launch --nnodes 2 --nproc-per-node 8 --rdzv-endpoint 10.0.0.1:29400 "
    "--rdzv-id job42 train.py --epochs 90": _MULTI_NODE,
    "aps-launch --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr 10.0.0.1 "
    "--master-port 29500 train.py": _MULTI_NODE,
    "export OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK": _SLURM,
    "srun aps-launch --slurm --backend nccl train.py --epochs 90": _SLURM,
    'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)': _SLURM,
    'srun aps-launch --nnodes "$SLURM_NNODES" --nproc-per-node 8 --rdzv-endpoint '
    '"$head:29400" --rdzv-id "$SLURM_JOB_ID" train.py': _SLURM,
    "srun python train.py": _SLURM,
    "mpirun -n 16 -ppn 8 -f hosts aps-launch --mpi --backend nccl train.py": _MPI,
    "mpirun -np 16 --hostfile hosts --map-by ppr:8:node aps-launch --mpi train.py": _MPI,
    "mpirun -n 16 python train.py": _MPI,
    "aps-demo --fsdp": (
        "the demo's five runs under FSDP2 (~2 min on 2 cores); tests/test_fsdp.py checks its "
        "setup names and runs FSDP2 training with and without APS"
    ),
    "python -m benchmarks.fsdp --ranks 2 --bandwidth 1gbit --json "
    "benchmarks/results/fsdp_2ranks.json": (
        "a timing benchmark on the emulated cluster (needs root for network namespaces); "
        "its results are benchmarks/results/fsdp_*.json"
    ),
    "python -m benchmarks.fsdp --nodes 2 --ranks 4 --bandwidth 250mbit --repeats 3 --warmup 1 "
    "--rounds 3 --json benchmarks/results/fsdp_hsdp_250mbit.json": (
        "a timing benchmark on the emulated cluster with nodes (needs root for network "
        "namespaces); tests/test_benchmarks_fsdp.py runs its setups on 4 loopback ranks"
    ),
    "python -m benchmarks.fsdp --nodes 2 --ranks 4 --bandwidth 250mbit --repeats 3 --warmup 1 "
    "--rounds 3 --setups hsdp-fp32,hsdp-bf16,hsdp-aps-e4m3,hsdp-aps-e2m1-block "
    "--no-reshard-after-forward --json benchmarks/results/fsdp_hsdp_250mbit_keep.json": (
        "a timing benchmark on the emulated cluster with nodes (needs root for network "
        "namespaces); tests/test_benchmarks_fsdp.py prices its --no-reshard-after-forward"
    ),
    "python -m benchmarks.accuracy --hooks fp32 aps-e4m3 aps-e2m1-block powersgd-r1 "
    "powersgd-r4 --merge benchmarks/results/accuracy.json --out benchmarks/results": (
        "5 hooks x 2 tasks x 3 seeds on 4 ranks (851 s for the rows merged into the "
        "committed benchmarks/results/accuracy.json); tests/test_benchmarks.py checks the "
        "PowerSGD hooks' bytes and state and the merge"
    ),
    "python -m benchmarks.accuracy --fsdp": (
        "the FSDP2 accuracy benchmark, 4 ranks x 3 seeds x 4 setups x 2 tasks; its results "
        "are benchmarks/results/accuracy_fsdp.json"
    ),
    "python -m benchmarks.accuracy --hsdp": (
        "the HSDP accuracy benchmark, 2 x 2 ranks x 3 seeds x 3 setups x 2 tasks (403 s at "
        "8 digits epochs and 200 TinyLM steps for benchmarks/results/accuracy_hsdp_2x2.json); "
        "tests/test_accuracy_hsdp.py runs every setup on a 2 x 2 mesh with tiny settings"
    ),
}


# --------------------------------------------------------------------------
# Reading the README and docs/


def _pages() -> list[Path]:
    """The README and every page of docs/: the files whose commands and code run here."""
    return [README, *sorted(DOCS.glob("*.md"))]


def _page(path: Path) -> str:
    return str(path.relative_to(ROOT))


@dataclasses.dataclass(frozen=True)
class _Block:
    heading: str
    lang: str
    body: str
    page: str = "README.md"


def _blocks(text: str, page: str = "README.md") -> list[_Block]:
    blocks, heading, lang, body = [], "", None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, body = line[3:].strip(), []
            else:
                blocks.append(_Block(heading, lang, "\n".join(body) + "\n", page))
                lang = None
        elif lang is not None:
            body.append(line)
        elif line.startswith("#"):
            heading = line.lstrip("#").strip()
    return blocks


def _all_blocks() -> list[_Block]:
    return [b for path in _pages() for b in _blocks(path.read_text(), _page(path))]


def _strip_comment(line: str) -> str:
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _shell_commands(body: str) -> list[str]:
    """Commands of a bash block: continuations joined, comments dropped, split at &&."""
    commands, pending = [], ""
    for raw in body.splitlines():
        line = pending + raw
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        for part in _strip_comment(line).split(" && "):
            if part.strip():
                commands.append(" ".join(part.split()))
    return commands


def _inline_commands(text: str) -> list[str]:
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    # A span may wrap onto the next line of the paragraph.
    spans = [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
    return [s for s in spans if _INLINE_COMMAND.match(s)]


def _doc_commands() -> dict[str, list[str]]:
    """Every command of the README and docs/ -> the pages that show it."""
    found: dict[str, list[str]] = {}
    for path in _pages():
        text = path.read_text()
        bash = [c for b in _blocks(text) if b.lang == "bash" for c in _shell_commands(b.body)]
        for command in bash + _inline_commands(text):
            found.setdefault(command, []).append(_page(path))
    return found


# A block (whose lines never start with ```), then the paragraph that names it.
_SAVED_AS = re.compile(r"^```python\n((?:(?!^```).)*)^```\n\nSaved as `([\w.-]+\.py)`", re.S | re.M)


def _saved_scripts() -> dict[str, str]:
    """NAME.py -> the Python block right before a paragraph starting "Saved as `NAME.py`"."""
    scripts: dict[str, str] = {}
    for path in _pages():
        for body, name in _SAVED_AS.findall(path.read_text()):
            assert name not in scripts, f"two blocks saved as {name} (the second in {path.name})"
            scripts[name] = body
    return scripts


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {_slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


# [text](target): relative targets only; a URL, or an image's own link, is not checked here.
_LINK = re.compile(r"\]\((?!https?://|mailto:)([^)\s]*)\)")


def _links(text: str) -> list[str]:
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return _LINK.findall(re.sub(r"`[^`]*`", "", prose))


# --------------------------------------------------------------------------
# Running a command as the README shows it


def _env() -> dict[str, str]:
    # The venv's console scripts first, as after `pip install`; and a test run
    # under a launcher must not make the commands join that job.
    env = {k: v for k, v in os.environ.items() if k not in _JOB_VARS}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _run(command: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    # Its own session: a command that runs past the timeout is killed with every
    # process it started (ranks, launchers), not only the shell.
    with subprocess.Popen(
        ["bash", "-c", command],
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _train_script() -> str:
    """The docs' ``init_distributed`` DDP script, with the model and data it leaves to the reader."""
    (block,) = [b.body for b in _all_blocks() if "init_distributed()" in b.body]
    preamble = (
        "import os\n"
        "import torch\n\n"
        "torch.manual_seed(int(os.environ.get('RANK', '0')))  # each rank its own data\n\n\n"
        "class MyModel(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.net = torch.nn.Sequential(\n"
        "            torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)\n"
        "        )\n\n"
        "    def forward(self, x):\n"
        "        return self.net(x)\n\n\n"
        "loader = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(3)]\n\n"
    )
    postamble = (
        "\nwith torch.no_grad():\n"
        "    total = sum(float(p.double().sum()) for p in ddp_model.parameters())\n"
        # One write per line: the ranks share the launcher's stdout.
        "print(f'README script: rank {info.rank} of {torch.distributed.get_world_size()}, '\n"
        "      f'params {total!r}\\n', end='', flush=True)\n"
    )
    return preamble + block + postamble


def _write_scripts(cwd: Path) -> None:
    (cwd / "train.py").write_text(_train_script())
    (cwd / "mypackage").mkdir()
    (cwd / "mypackage" / "__init__.py").write_text("")
    (cwd / "mypackage" / "train.py").write_text(_train_script())


def _write_saved_scripts(command: str, cwd: Path) -> None:
    """Write the README's saved scripts that ``command`` names (as a word) into ``cwd``."""
    for name, body in _saved_scripts().items():
        if name in command.split():
            (cwd / name).write_text(body)


def _copy_benchmarks(cwd: Path) -> None:
    shutil.copytree(
        ROOT / "benchmarks", cwd / "benchmarks", ignore=shutil.ignore_patterns("__pycache__")
    )


# --------------------------------------------------------------------------
# What each command must print


# What an exit handler, or a thread dying in the interpreter's shutdown, prints:
# a job that finished has nothing to say at exit.
_EXIT_NOISE = re.compile(r"^.*(aps_comm: .*at exit|terminate called).*$", re.M)


def _check_ok(proc: subprocess.CompletedProcess[str], cwd: Path) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not _EXIT_NOISE.findall(proc.stdout + proc.stderr), proc.stderr


def _launched(world_size: int) -> Callable[[subprocess.CompletedProcess[str], Path], None]:
    def check(proc: subprocess.CompletedProcess[str], cwd: Path) -> None:
        _check_ok(proc, cwd)
        lines = re.findall(r"README script: rank (\d+) of (\d+), params ([-+.e\d]+)", proc.stdout)
        assert sorted(int(r) for r, _, _ in lines) == list(range(world_size)), proc.stdout
        assert {int(w) for _, w, _ in lines} == {world_size}
        # Different data on every rank, identical weights after the steps: the
        # APS-reduced gradients were the same everywhere.
        assert len({p for _, _, p in lines}) == 1, lines

    return check


def _rows(lines: list[str]) -> dict[str, list[str]]:
    start = next(i for i, line in enumerate(lines) if line.startswith("hook "))
    rows = {}
    for line in lines[start + 1 :]:
        fields = line.split()
        if len(fields) != 6:
            break
        rows[fields[0]] = fields[1:]
    return rows


def _poisoned_folder(cwd: Path) -> None:
    """An ``aps_comm`` in the working folder: the demo's ranks must import the installed one."""
    (cwd / "aps_comm").mkdir()
    (cwd / "aps_comm" / "__init__.py").write_text("raise ImportError('the folder\\'s aps_comm')\n")


def _check_demo(proc: subprocess.CompletedProcess[str], cwd: Path) -> None:
    _check_ok(proc, cwd)
    # Started in a folder holding an aps_comm (a checkout), the ranks (`python -m`,
    # which puts the working folder on sys.path) still imported what is installed.
    assert "the folder's aps_comm" not in proc.stdout + proc.stderr
    (shown,) = [b.body for b in _all_blocks() if b.body.startswith("2 ranks,")]
    shown_lines = shown.splitlines()
    printed = proc.stdout.splitlines()
    assert shown_lines[0] in printed, proc.stdout  # same configuration line
    readme, run = _rows(shown_lines), _rows(printed[printed.index(shown_lines[0]) :])
    assert list(run) == list(readme)
    for name, (acc, _loss, nbytes, vs_fp32, _seconds) in readme.items():
        # Bytes are exact by construction; accuracy moves on other CPUs' float kernels
        # (aps-e4m3 by 3.55 points between two machines, one seed).
        assert run[name][2:4] == [nbytes, vs_fp32], (name, run[name])
        assert abs(float(run[name][0].rstrip("%")) - float(acc.rstrip("%"))) <= 4.0, name
    accuracy = {name: float(r[0].rstrip("%")) for name, r in run.items()}
    # docs/demo.md's reading of the table: the naive cast does not learn, APS
    # stays within a few points of FP32 (one seed of a small model: the same run
    # gave aps-e4m3 96.44% and 92.89% on two machines' float kernels).
    assert accuracy["naive-e4m3"] < 20.0
    for name in ("aps-e4m3", "aps-e5m2"):
        assert abs(accuracy[name] - accuracy["fp32"]) <= 4.5, accuracy
    saved = json.loads((cwd / "results.json").read_text())
    assert [r["name"] for r in saved["runs"]] == list(readme)
    epochs = saved["config"]["epochs"]
    for r in saved["runs"]:
        assert {"name", "test_accuracy", "loss", "bytes_per_step", "seconds"} <= r.keys()
        assert 0.0 < r["loss"] < 10.0 and r["seconds"] > 0, r
        assert len(r["loss_curve"]) == len(r["test_accuracy_curve"]) == epochs, r
    by_name = {r["name"]: r for r in saved["runs"]}
    fp32, aps = by_name["fp32"], by_name["aps-e4m3"]
    # One byte instead of four per element, plus the per-layer maxima and the
    # two-phase padding: a few dozen bytes on tens of kilobytes.
    assert 0.25 <= aps["bytes_per_step"] / fp32["bytes_per_step"] <= 0.26
    assert (cwd / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _check_report(proc: subprocess.CompletedProcess[str], cwd: Path) -> None:
    _check_ok(proc, cwd)
    # The committed RESULTS.md is what the command makes of the committed results.
    regenerated = (cwd / "benchmarks" / "RESULTS.md").read_text()
    assert regenerated == (ROOT / "benchmarks" / "RESULTS.md").read_text()


def _check_perfmodel_table(proc: subprocess.CompletedProcess[str], cwd: Path) -> None:
    _check_ok(proc, cwd)
    speedup = {
        line.split()[0]: float(line.split()[-1].rstrip("x"))
        for line in proc.stdout.splitlines()
        if line.split() and line.split()[0] in ("fp32", "fp16", "e4m3")
    }
    # docs/performance-model.md explains why FP8 beats FP32 and FP16 here, with these numbers.
    assert 1.0 < speedup["fp16"] < speedup["e4m3"], speedup
    text = (DOCS / "performance-model.md").read_text()
    assert f"e4m3 {speedup['e4m3']:.2f}x faster than FP32" in text
    assert f"FP16 ({speedup['fp16']:.2f}x)" in text
    assert "auto for e4m3: grid for 5 buckets" in proc.stdout


def _check_perfmodel_block(proc: subprocess.CompletedProcess[str], cwd: Path) -> None:
    _check_ok(proc, cwd)
    row = next(line.split() for line in proc.stdout.splitlines() if line.startswith("e2m1 "))
    flat = " ".join(proc.stdout.split())
    # docs/performance-model.md quotes these numbers.
    text = " ".join((DOCS / "performance-model.md").read_text().split())
    speedup = float(row[-1].rstrip("x"))
    assert f"a step {speedup:.2f}x faster than FP32's for e2m1 with blocks of 32" in text
    per_layer = predict(get_model("resnet50"), get_cluster("1gbe", world_size=8), ["e2m1"])
    assert f"({per_layer.formats['e2m1'].speedup_vs_fp32:.2f}x with one exponent per tensor" in text
    assert f"`wire/rank` of {row[2]} {row[3]} includes" in text
    assert "scaling block for e2m1: one exponent byte per 32 elements" in flat
    exponents = flat.split("e2m1's wire/rank includes ")[1].split(" of block exponents")[0]
    assert f"includes {exponents} of block exponents" in text


def _check_perfmodel_block_levels(proc: subprocess.CompletedProcess[str], cwd: Path) -> None:
    _check_ok(proc, cwd)
    # docs/performance-model.md: blocks of 8 tip the planner to hierarchical, of 256 to grid.
    text = " ".join((DOCS / "performance-model.md").read_text().split())
    assert "auto for e2m1: hierarchical for 18 buckets, fp32 for 1 bucket" in proc.stdout
    assert "reduces 18 of its 19 buckets" in text
    wide = _run(proc.args[-1].replace("--block-size 8", "--block-size 256"), cwd, 120.0)
    _check_ok(wide, cwd)
    assert "auto for e2m1: grid for 13 buckets, hierarchical for 5 buckets" in wide.stdout
    assert "`--block-size 256` sends 13 of them by grid" in text


def _check_perfmodel_scale(proc: subprocess.CompletedProcess[str], cwd: Path) -> None:
    _check_ok(proc, cwd)
    # The committed table is what the command computes (it is a model: no noise).
    out = cwd / "benchmarks" / "results"
    committed = ROOT / "benchmarks" / "results"
    for name in ("perfmodel_scale.json", "perfmodel_scale.md"):
        assert (out / name).read_text() == (committed / name).read_text(), name
    assert (out / "perfmodel_scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _check_perfmodel_h200(proc: subprocess.CompletedProcess[str], cwd: Path) -> None:
    _check_ok(proc, cwd)
    comm = {
        line.split()[0]: " ".join(line.split()[6:8])
        for line in proc.stdout.splitlines()
        if line.split() and line.split()[0] in ("fp32", "fp16", "e4m3")
    }
    flat = " ".join(proc.stdout.split())
    assert "measured codec and hook costs per bucket of the h200 preset" in flat
    assert "commit 35adf17" in flat
    # docs/performance-model.md quotes these numbers, and the same device's ideal ones.
    text = " ".join((DOCS / "performance-model.md").read_text().split())
    assert f"spends {comm['e4m3']} per step in e4m3 two_phase" in text, comm
    assert f"and {comm['fp16']} in FP16's" in text, comm
    assert f"FP32's {comm['fp32']} runs no hook" in text, comm
    # The same device from its datasheet alone: the preset without its measured constants.
    h200 = get_device("h200")
    datasheet = dataclasses.replace(h200, measured={})
    cluster = dataclasses.replace(get_cluster("dgx-h100", world_size=16), device=datasheet)
    ideal = predict(get_model("gpt2-xl"), cluster, ["e4m3"], strategy="two_phase").formats
    e4m3, fp16 = (format_time(ideal[f].comm_s) for f in ("e4m3", "fp16"))
    assert f"against {e4m3} and {fp16} for the same device from its datasheet" in text


def _check_comm_only(proc: subprocess.CompletedProcess[str], cwd: Path) -> None:
    _check_ok(proc, cwd)
    out = json.loads(proc.stdout)
    assert out["communication_only"] is True and out["compute"] is None
    assert list(out["formats"]) == ["fp32", "fp16", "e4m3"]


def _check_sweep(proc: subprocess.CompletedProcess[str], cwd: Path) -> None:
    _check_ok(proc, cwd)
    with open(cwd / "sweep.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    # 2 world sizes x the cluster's one bandwidth x fp32, fp16, e4m3.
    assert sorted({r["world_size"] for r in rows}) == ["64", "8"] and len(rows) == 6


def _check_resumed(proc: subprocess.CompletedProcess[str], cwd: Path) -> None:
    _check_ok(proc, cwd)
    out = proc.stdout + proc.stderr
    # Rank 1 crashed once, the launcher restarted the group, both ranks resumed.
    assert "rank 1: crashing at step 5" in out, out
    assert out.count("resumed at step 5") == 2, out
    assert re.search(r"RESUME-DIGEST [0-9a-f]{64}", out), out


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of the one TensorBoard run in ``logdir``: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert list(logdir.glob("events.out.tfevents.*")), sorted(logdir.rglob("*"))
    events = EventAccumulator(str(logdir))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


_LAYER_FIGURES = ("exponent", "amax", "underflow_rate", "saturated")


def _check_lightning(proc: subprocess.CompletedProcess[str], cwd: Path) -> None:
    _check_ok(proc, cwd)
    # Both ranks trained max_steps=8 steps through the APS hook (Lightning's CPU
    # DDPStrategy would not have registered it: step would stay 0).
    # (Not anchored: a line may follow the progress bar's last \r-update.)
    done = dict(re.findall(r"rank (\d): 8 steps, (\d+) bytes in the last one\n", proc.stdout))
    assert sorted(done) == ["0", "1"] and all(int(b) > 0 for b in done.values()), proc.stdout
    scalars = _scalars(cwd / "runs" / "lightning" / "version_0")
    # stats=True: the strategy's figures through self.log (log_every_n_steps=1).
    for tag in ("bytes_sent", "underflowing_layers", "max_underflow_rate", "saturated"):
        assert len(scalars[f"aps/{tag}"]) == 8, (tag, sorted(scalars))
    assert len(scalars["aps/mean_exponent"]) == 8
    # PerLayerStats: every layer's figures, at state.step 1..8.
    layers = ("net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias")
    for tag in [f"aps_layers/{f}/{n}" for f in _LAYER_FIGURES for n in layers]:
        assert [s for s, _ in scalars[tag]] == list(range(1, 9)), (tag, sorted(scalars))
    assert [v for _, v in scalars["aps_layers/bytes_sent"]] == [float(done["0"])] * 8


def _check_accelerate(proc: subprocess.CompletedProcess[str], cwd: Path) -> None:
    _check_ok(proc, cwd)
    # 256 samples, batch 32, 2 processes: 4 steps each; printed by the main process only.
    steps = re.findall(r"^(\d+) steps so far, \d+ bytes in the last one$", proc.stdout, re.M)
    assert steps == ["4"], proc.stdout + proc.stderr
    # save_state kept every rank's own hook state (GatheredState), residuals included.
    saved = torch.load(cwd / "aps_checkpoint" / "custom_checkpoint_0.pkl", weights_only=False)
    assert saved["world_size"] == 2 and [r["step"] for r in saved["ranks"]] == [4, 4]
    residuals = [r["residuals"] for r in saved["ranks"]]
    assert set(residuals[0]) == {"0.weight", "0.bias", "2.weight", "2.bias"} == set(residuals[1])
    # Each rank's data differ, so do their rounding residuals.
    assert not all(torch.equal(residuals[0][k], residuals[1][k]) for k in residuals[0])


def _check_trainer(proc: subprocess.CompletedProcess[str], cwd: Path) -> None:
    _check_ok(proc, cwd)
    # Not anchored: the ranks share torchrun's stdout, and their lines may interleave.
    done = re.findall(
        r"rank (\d): (\d+) steps, loss ([.\d]+), (\d+) bytes in the last one", proc.stdout
    )
    assert sorted(rank for rank, *_ in done) == ["0", "1"], proc.stdout + proc.stderr
    # Trainer went distributed (use_cpu=True on this CPU machine) and every one of its
    # steps went through the hook: docs/integrations.md says how many.
    assert {steps for _, steps, _, _ in done} == {"8"}, done
    assert "Each rank prints `8 steps`" in (DOCS / "integrations.md").read_text()
    assert all(int(nbytes) > 0 for *_, nbytes in done), done


def _check_ddp_script(proc: subprocess.CompletedProcess[str], cwd: Path) -> None:
    _check_ok(proc, cwd)
    # Not anchored: the ranks share torchrun's stdout, and their lines may interleave.
    done = re.findall(
        r"rank (\d): (\d+) steps, loss ([.\d]+), (\d+) bytes sent in the last one", proc.stdout
    )
    assert sorted(rank for rank, *_ in done) == ["0", "1"], proc.stdout + proc.stderr
    # Every step went through the hook, and the model learned (its loss starts near 16).
    assert {steps for _, steps, _, _ in done} == {"50"}, done
    assert all(float(loss) < 1.0 for _, _, loss, _ in done), done
    # The README accounts for these bytes: 1 per padded element, 4 per layer, 4 per bucket.
    (nbytes,) = {int(b) for *_, b in done}
    assert nbytes == 1154 + 4 * 4 + 4, done
    assert f"`{nbytes} bytes sent`" in README.read_text()


def _check_fsdp(proc: subprocess.CompletedProcess[str], cwd: Path) -> None:
    _check_ok(proc, cwd)
    (line,) = re.findall(
        r"^30 steps, loss ([.\d]+), (\d+) bytes in the last one$", proc.stdout, re.M
    )
    # e4m3: one byte per padded gradient element (4866) plus 4 per parameter and unit (36).
    assert float(line[0]) < 2.0 and int(line[1]) == 4902, proc.stdout


def _check_hsdp(proc: subprocess.CompletedProcess[str], cwd: Path) -> None:
    _check_ok(proc, cwd)
    (line,) = re.findall(
        r"^30 steps, loss ([.\d]+), (\d+) bytes across nodes in the last one$", proc.stdout, re.M
    )
    # docs/fsdp2.md accounts for these bytes: e4m3's all_to_all of the shard (2433),
    # the all_gather of this rank's half (1218), 4 per parameter and unit (36).
    assert float(line[0]) < 2.0 and int(line[1]) == 2433 + 1218 + 36, proc.stdout
    assert f"{line[0]}, {line[1]} bytes across nodes" in (DOCS / "fsdp2.md").read_text()


def _check_tensorboard(proc: subprocess.CompletedProcess[str], cwd: Path) -> None:
    _check_ok(proc, cwd)
    scalars = _scalars(cwd / "runs" / "aps")  # written by rank 0 only: one event file
    assert len(list((cwd / "runs" / "aps").glob("events.out.tfevents.*"))) == 1
    sent = scalars["aps/bytes_sent"]
    assert [s for s, _ in sent] == list(range(1, 21)) and all(v > 0 for _, v in sent), sent
    for tag in [f"aps/{f}/{n}" for f in _LAYER_FIGURES for n in ("0.weight", "2.bias")]:
        assert len(scalars[tag]) == 20, (tag, sorted(scalars))


def _fsdp_table(proc: subprocess.CompletedProcess[str], cwd: Path) -> dict[str, str]:
    """The rows of ``aps-perfmodel fsdp``'s table, by format, spaces collapsed."""
    _check_ok(proc, cwd)
    rows = [" ".join(line.split()) for line in proc.stdout.splitlines()]
    # A row is a format and its reduce-scatter's kind (HSDP's: "fp32+APS", the
    # reduce-scatter's and the replica all-reduce's); the notes below name formats too.
    table = {}
    for row in rows:
        words = row.split()
        if len(words) < 2 or words[0] == "format":
            continue
        if words[1] in ("reduce_dtype", "APS") or re.fullmatch(r"\w+\+\w+", words[1]):
            table[words[0]] = row
    return table


def _check_fsdp_model(proc: subprocess.CompletedProcess[str], cwd: Path) -> None:
    lines = _fsdp_table(proc, cwd)
    # docs/fsdp2.md quotes these figures.
    assert "499 ms 1.00x" in lines["fp32"], proc.stdout
    assert "252 ms 1.98x" in lines["bf16"], proc.stdout
    assert "142 ms 3.51x 991 ms" in lines["e4m3"], proc.stdout


def _check_fsdp_shared_link(proc: subprocess.CompletedProcess[str], cwd: Path) -> None:
    lines = _fsdp_table(proc, cwd)
    # docs/fsdp2.md quotes these figures, and why e4m3 is slower here.
    assert "2.00x" in lines["bf16"] and "0.87x" in lines["e4m3"], proc.stdout
    assert "e4m3 sends 2.00x fp32's bytes" in " ".join(proc.stdout.split()), proc.stdout


def _fsdp_quoted(
    quoted: dict[str, str],
) -> Callable[[subprocess.CompletedProcess[str], Path], None]:
    """A check that each format's row of ``aps-perfmodel fsdp`` shows what the docs quote."""

    def check(proc: subprocess.CompletedProcess[str], cwd: Path) -> None:
        lines = _fsdp_table(proc, cwd)
        # docs/fsdp2.md's HSDP table quotes these rows.
        for fmt, figures in quoted.items():
            assert figures in lines[fmt], (fmt, proc.stdout)

    return check


_HSDP_7B = "aps-perfmodel fsdp --model llama-7b --units 32 --cluster dgx-h100 --nodes 4"


@dataclasses.dataclass(frozen=True)
class _Run:
    check: Callable[[subprocess.CompletedProcess[str], Path], None]
    setup: Callable[[Path], None] | None = None
    in_checkout: bool = False  # run in the repository root instead of a scratch directory
    slow: bool = False
    timeout: float = 120.0
    # A torchrun command whose ranks fork from the preloaded starter (_run_forked)
    # instead of each starting an interpreter: the modules the starter imports for them.
    forked: tuple[str, ...] | None = None


# --------------------------------------------------------------------------
# torchrun commands whose ranks fork from a starter that has imported torch
#
# Each rank of a `torchrun` command of the docs imports torch,
# torch._dynamo and aps_comm (and Accelerate, Transformers) before its
# script's first line: ~8 s of CPU per process on 2 cores, most of these tests'
# cost. For the torchrun commands marked `forked`, the test runs each rank the
# command starts as a child of tests/launch_scripts/preloaded.py, which imported
# them once: the script, its arguments, its working folder and its whole
# environment are the ones the command gives it (torchrun's rank variables,
# its store at MASTER_PORT hosted here as torchrun's agent hosts it); only the
# imports are not repeated. The launchers themselves still run as written:
# `torchrun` for train_ddp.py (the README's command, and
# test_forked_ranks_get_torchruns_environment checks the environment against
# a real torchrun's), `aps-launch` and `aps-demo` below.

_FORKED = re.compile(
    r"^(?P<vars>(?:\w+=\S+ )*)torchrun --standalone --nproc_per_node (?P<nproc>\d+) "
    r"(?P<script>\S+\.py)(?P<args>(?: \S+)*)$"
)


def _torchrun_env(rank: int, world_size: int, port: int, run_id: str, cwd: Path) -> dict[str, str]:
    """What torchrun --standalone adds to its own environment for one of its ranks.

    As torch.distributed.elastic's LocalElasticAgent sets it (one node,
    no restarts); torchrun sets OMP_NUM_THREADS=1 for several ranks.
    """
    return {
        "OMP_NUM_THREADS": "1",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": str(world_size),
        "WORLD_SIZE": str(world_size),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "localhost",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "LOCAL_RANK": str(rank),
        "TORCHELASTIC_ERROR_FILE": str(cwd / ".torchelastic" / run_id / str(rank) / "error.json"),
    }


def _forked_specs(command: str, cwd: Path, port: int) -> list[dict]:
    """The starter's request for a ``torchrun --standalone`` command: one process per rank."""
    match = _FORKED.match(command)
    assert match is not None, f"not a torchrun command the starter runs: {command}"
    # What `bash -c` exports to the program it runs, asked of bash itself (it sets PWD,
    # SHLVL and `_`, and drops an inherited PS1, as a venv's activate script exports it).
    exported = subprocess.run(
        ["bash", "-c", f"{match['vars']}env -0"],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        check=True,
    ).stdout.decode()
    env = dict(item.split("=", 1) for item in exported.split("\0") if item)
    env["_"] = str(shutil.which("torchrun", path=env["PATH"]))
    nproc, run_id = int(match["nproc"]), str(uuid.uuid4())
    return [
        {
            "script": match["script"],
            "args": match["args"].split(),
            "env": env | _torchrun_env(rank, nproc, port, run_id, cwd),
            "log": str(cwd / f".rank-{rank}.log"),
            "cwd": str(cwd),
        }
        for rank in range(nproc)
    ]


@pytest.fixture(scope="module")
def doc_starter() -> Iterator[list[Starter]]:
    """This module's starter for the forked commands, made when the first needs it
    (:func:`_run_forked`), and again after one that failed."""
    holder: list[Starter] = []
    yield holder
    for starter in holder:
        starter.close()


def _run_forked(
    command: str, cwd: Path, timeout: float, holder: list[Starter], preload: tuple[str, ...]
) -> subprocess.CompletedProcess[str]:
    """``command``'s ranks forked from the starter in ``holder``: the exit code is the
    first failing rank's (else 0), stdout every rank's log (stdout and stderr), in rank
    order. ``timeout`` bounds the whole command, the starter's imports included, as the
    ranks' own imports counted in it under torchrun."""
    if not holder:
        holder.append(Starter(ROOT / "tests" / "launch_scripts" / "preloaded.py", _env()))
    starter, deadline = holder[0], time.monotonic() + timeout
    # torchrun's agent hosts the ranks' store (TORCHELASTIC_USE_AGENT_STORE): here, this test.
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    specs = _forked_specs(command, cwd, store.port)
    for spec in specs:
        spec["preload"] = list(preload)
    codes: dict[int, int | None] = {}
    try:
        codes = dict.fromkeys(starter.start(specs, deadline - time.monotonic()))
        codes.update((pid, code) for pid, code, _ in starter.exits(deadline - time.monotonic()))
        assert None not in codes.values(), f"{command} ran past {timeout} s"
    except BaseException:
        # Its own session: what a rank that ran past the timeout started dies with it; and
        # a starter that did not answer in time is out of step: the next command gets a new one.
        for pid in [pid for pid, code in codes.items() if code is None]:
            os.killpg(pid, signal.SIGKILL)
        holder.remove(starter)
        starter.close()
        raise
    finally:
        del store
    out = "".join(Path(spec["log"]).read_text() for spec in specs)
    code = next((c for c in codes.values() if c != 0), 0)
    return subprocess.CompletedProcess(command, code, out, "")


RUN: dict[str, _Run] = {
    "torchrun --standalone --nproc-per-node 2 train_ddp.py": _Run(_check_ddp_script, slow=True),
    "aps-demo --json results.json --plot loss.png": _Run(
        _check_demo, _poisoned_folder, slow=True, timeout=280
    ),
    "aps-launch train.py --epochs 1": _Run(
        _launched(torch.cuda.device_count() or 2), _write_scripts, slow=True
    ),
    "aps-launch --nproc-per-node 4 --backend gloo train.py": _Run(
        _launched(4), _write_scripts, slow=True
    ),
    "python -m benchmarks.report": _Run(_check_report, _copy_benchmarks),
    "aps-launch --nproc-per-node 2 --max-restarts 1 -m benchmarks.resume_train --ckpt ckpt "
    "--crash-at 5": _Run(_check_resumed, _copy_benchmarks, slow=True),
    "aps-perfmodel predict --model resnet50 --world-size 64 --cluster 100gbe --fmt e4m3": _Run(
        _check_perfmodel_table
    ),
    "aps-perfmodel predict --model resnet50 --world-size 8 --cluster 1gbe --fmt e2m1 "
    "--scaling block": _Run(_check_perfmodel_block),
    "aps-perfmodel predict --model resnet50 --nodes 2 --gpus-per-node 8 --device h100 "
    "--bandwidth 400Gbit --latency 6us --intra-bandwidth 450GB/s --intra-latency 3us "
    "--bucket-cap-mb 4 --fmt e2m1 --scaling block --block-size 8": _Run(
        _check_perfmodel_block_levels
    ),
    "aps-perfmodel predict --model gpt2-xl --cluster dgx-h100 --world-size 16 --device h200 "
    "--fmt e4m3 --strategy two_phase": _Run(_check_perfmodel_h200),
    "python -m aps_perfmodel.scale --out benchmarks/results": _Run(_check_perfmodel_scale),
    "aps-perfmodel predict --params 25.6M --bandwidth 10Gbit --latency 20us --nodes 16 --json": (
        _Run(_check_comm_only)
    ),
    "aps-perfmodel sweep --model gpt2-xl --cluster 100gbe --world-sizes 8,64 --out sweep.csv": (
        _Run(_check_sweep)
    ),
    "aps-perfmodel fsdp --model gpt2-xl --world-size 64 --cluster 100gbe --fmt e4m3": _Run(
        _check_fsdp_model
    ),
    "aps-perfmodel fsdp --model llama-7b --nodes 2 --gpus-per-node 8 --bandwidth 100Gbit": _Run(
        _check_fsdp_shared_link
    ),
    f"{_HSDP_7B} --bandwidth 100Gbit": _Run(
        _fsdp_quoted(
            {
                "fp32": "2.35 GiB 1.68 s 1.00x 3.34 s 5.02 s",
                "bf16": "1.18 GiB 840 ms 2.00x 3.34 s 4.18 s",
                "e4m3": "4.71 GiB 3.28 s 0.51x 3.34 s 6.62 s",
            }
        )
    ),
    f"{_HSDP_7B} --bandwidth 100Gbit --replicate 4": _Run(
        _fsdp_quoted(
            {
                "fp32": "4.71 GiB 60.1 ms 3.24 s 1.00x 106 ms 3.4 s",
                "bf16": "2.35 GiB 30.4 ms 1.62 s 2.00x 106 ms 1.76 s",
                "e4m3": "1.18 GiB 60.1 ms 841 ms 3.66x 106 ms 1.01 s",
            }
        )
    ),
    f"{_HSDP_7B} --bandwidth 400Gbit": _Run(
        _fsdp_quoted(
            {
                "fp32": "2.35 GiB 466 ms 1.00x 916 ms 1.38 s",
                "bf16": "1.18 GiB 234 ms 1.99x 916 ms 1.15 s",
                "e4m3": "4.71 GiB 855 ms 0.54x 916 ms 1.77 s",
            }
        )
    ),
    f"{_HSDP_7B} --bandwidth 400Gbit --replicate 4": _Run(
        _fsdp_quoted(
            {
                "fp32": "4.71 GiB 60.1 ms 811 ms 1.00x 106 ms 977 ms",
                "bf16": "2.35 GiB 30.4 ms 406 ms 2.00x 106 ms 542 ms",
                "e4m3": "1.18 GiB 60.1 ms 220 ms 3.11x 106 ms 386 ms",
            }
        )
    ),
    "python train_lightning.py": _Run(_check_lightning, slow=True),
    "ACCELERATE_USE_CPU=1 torchrun --standalone --nproc_per_node 2 train_accelerate.py": _Run(
        _check_accelerate, slow=True, forked=("accelerate",)
    ),
    "torchrun --standalone --nproc_per_node 2 train_trainer.py": _Run(
        _check_trainer, slow=True, forked=("transformers", "transformers.trainer")
    ),
    "torchrun --standalone --nproc_per_node 2 train_tensorboard.py": _Run(
        _check_tensorboard, slow=True, forked=("torch.utils.tensorboard",)
    ),
    "torchrun --standalone --nproc_per_node 2 train_fsdp.py": _Run(
        _check_fsdp, slow=True, forked=("torch.distributed.fsdp",)
    ),
    "torchrun --standalone --nproc_per_node 4 train_hsdp.py": _Run(
        _check_hsdp, slow=True, timeout=240, forked=("torch.distributed.fsdp",)
    ),
    "ruff check .": _Run(_check_ok, in_checkout=True),
    "ruff format --check .": _Run(_check_ok, in_checkout=True),
}


# --------------------------------------------------------------------------
# Tests


def test_every_doc_command_is_run_or_exempt() -> None:
    commands = _doc_commands()
    assert len(commands) > 20  # the parser found the blocks
    # Every page with commands was read (a page without any would not be listed).
    assert {"README.md", "docs/launching-and-restarts.md", "docs/integrations.md"} <= {
        page for pages in commands.values() for page in pages
    }
    unlisted = {c: p for c, p in commands.items() if c not in RUN and c not in EXEMPT}
    assert not unlisted, f"commands neither run nor exempt in {__file__}: {unlisted}"
    stale = sorted((RUN.keys() | EXEMPT.keys()) - commands.keys())
    assert not stale, f"listed here but no longer in the README or docs/: {stale}"
    assert not RUN.keys() & EXEMPT.keys()


def test_readme_is_a_front_door() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    # Everything moved out of the README is one link away from it.
    linked = {(ROOT / link.split("#")[0]).resolve() for link in _links(text)}
    unlinked = sorted(p.name for p in DOCS.glob("*.md") if p.resolve() not in linked)
    assert not unlinked, f"docs/ pages the README does not link to: {unlinked}"
    assert (ROOT / "CHANGELOG.md").resolve() in linked


def test_relative_links_resolve() -> None:
    pages = [*_pages(), ROOT / "CHANGELOG.md"]
    broken = []
    for path in pages:
        for link in _links(path.read_text()):
            target, _, anchor = link.partition("#")
            dest = (path.parent / target).resolve() if target else path
            if not dest.exists():
                broken.append(f"{_page(path)}: {link} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{_page(path)}: {link} (no such heading)")
    assert not broken, broken
    assert _slug("FSDP2: APS reduce-scatter") == "fsdp2-aps-reduce-scatter"
    assert _slug("The demo: `aps-demo`") == "the-demo-aps-demo"
    text = "See [a](b.md#c), `[x](y)`, [u](https://e.org/#z) and ![p](q.png).\n```\n[d](e)\n```\n"
    assert _links(text) == ["b.md#c", "q.png"]


# The options whose values are an enum of aps_comm.config: a table lists every value.
_OPTION_ENUMS = {"scaling": Scaling, "reduction": Reduction, "block_exponents": BlockExponents}
_CODE = re.compile(r"`([^`]+)`")


def _option_tables() -> dict[str, tuple[str, dict[str, list[str]]]]:
    """Every table whose first column is "option", by page and line: (second header, rows).

    Rows are keyed by the option's name; a row's cells follow it.
    """
    tables: dict[str, tuple[str, dict[str, list[str]]]] = {}
    for path in _pages():
        current: dict[str, list[str]] | None = None
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.startswith("|"):
                current = None
                continue
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            if current is None and cells[0] == "option":
                current = {}
                tables[f"{_page(path)}:{number}"] = (cells[1], current)
            elif current is not None and not set(cells[0]) <= set("-:|"):
                current[cells[0].strip("`")] = cells[1:]
    return tables


def _documented_default(column: str, cells: list[str]) -> str | None:
    """The default a row states, as code: its "default" cell, or the value marked "(default)"."""
    if column == "default":
        code = _CODE.search(cells[0])
    else:
        assert column == "values", f"an options table with columns option, {column}"
        code = re.search(r"`([^`]+)` \(default\)", cells[0])
    return code.group(1) if code is not None else None


def test_options_tables_match_register() -> None:
    params = inspect.signature(register).parameters
    assert [(n, p.kind) for n, p in params.items()] == [
        ("ddp", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("fmt", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("options", inspect.Parameter.VAR_KEYWORD),
    ]
    # register(ddp, fmt, **options) passes APSState(fmt, **options) the same options (README
    # says so), every one of them typed in StateOptions.
    options = {n: p.default for n, p in inspect.signature(APSState).parameters.items()}
    assert options["fmt"] == params["fmt"].default
    assert set(StateOptions.__annotations__) == set(options) - {"fmt"}
    tables = _option_tables()
    assert {t.split(":")[0] for t in tables} >= {"README.md", "docs/design-and-guarantees.md"}
    wrong = []
    for where, (column, rows) in tables.items():
        if rows.keys() != options.keys():
            wrong.append(
                f"{where}: missing {sorted(options.keys() - rows.keys())}, "
                f"not options of register {sorted(rows.keys() - options.keys())}"
            )
        for name, cells in rows.items():
            if name not in options:
                continue
            stated = _documented_default(column, cells)
            if stated is None or ast.literal_eval(stated) != options[name]:
                wrong.append(f"{where}: {name} defaults to {options[name]!r}, not {stated}")
            values = set(_CODE.findall(" ".join(cells)))
            for value in _OPTION_ENUMS.get(name, ()):
                if f'"{value}"' not in values:
                    wrong.append(f'{where}: {name} does not list "{value}"')
        # None: the format decides; the row says how.
        resolved = f"{default_block_size(8)} for 8-bit formats, {default_block_size(4)} below"
        if "block_size" in rows and resolved not in " ".join(rows["block_size"]):
            wrong.append(f"{where}: block_size does not say {resolved!r}")
    assert not wrong, wrong


def test_fsdp_register_signature_is_the_documented_one() -> None:
    def shown(value: object) -> str:
        return f'"{value}"' if isinstance(value, str) else repr(value)

    params = list(inspect.signature(fsdp.register).parameters.values())
    parts = [p.name if p.default is p.empty else f"{p.name}={shown(p.default)}" for p in params]
    first_kw = next(i for i, p in enumerate(params) if p.kind is p.KEYWORD_ONLY)
    parts.insert(first_kw, "*")
    text = (DOCS / "fsdp2.md").read_text()
    assert f"`register({', '.join(parts)})`" in text


def test_readme_names_every_extra() -> None:
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    extras = set(setup["options.extras_require"])
    (paragraph,) = [p for p in README.read_text().split("\n\n") if p.startswith("Optional extras:")]
    named = set(_CODE.findall(paragraph))
    assert extras and extras <= named, f"extras README does not name: {sorted(extras - named)}"


def test_command_parser() -> None:
    body = (
        "# a comment\n"
        'pip install ".[x]" && run --flag  # trailing comment\n'
        "tool --a 1 \\\n"
        '    --b "#not a comment" \\\n'
        "    file\n"
    )
    assert _shell_commands(body) == [
        'pip install ".[x]"',
        "run --flag",
        'tool --a 1 --b "#not a comment" file',
    ]
    text = "Run `python -m aps_comm`, see `aps-launch`, or `pip\ninstall .`.\n```bash\nx\n```\n"
    assert _inline_commands(text) == ["python -m aps_comm", "pip install ."]
    assert _inline_commands("then `python train_x.py --epochs 2`, not `python`") == [
        "python train_x.py --epochs 2"
    ]


def test_saved_scripts_are_found_and_run() -> None:
    saved = _saved_scripts()
    assert {
        "train_ddp.py",
        "train_fsdp.py",
        "train_lightning.py",
        "train_accelerate.py",
        "train_tensorboard.py",
        "train_trainer.py",
    } <= saved.keys()
    for name, body in saved.items():
        assert body in [b.body for b in _all_blocks() if b.lang == "python"], name
        # A saved script no command runs would be checked by nothing but ast.parse.
        assert [c for c in RUN if name in c.split()], f"no RUN command runs {name}"
    text = (
        "```python\nz = 0\n```\n\nText.\n\n```python\nx = 1\n```\n\nSaved as `a.py`:\n\n"
        "```python\ny = 2\n```\n\nSee `b.py`.\n"
    )
    assert _SAVED_AS.findall(text) == [("x = 1\n", "a.py")]


def test_quick_start_test_command_is_what_ci_runs() -> None:
    (quick_start,) = [b for b in _blocks(README.read_text()) if b.heading == "Quick start"]
    (test_line,) = [line for line in quick_start.body.splitlines() if "pytest" in line]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_line in ci, f"{test_line!r} is not a line of .ci/run"


@pytest.mark.parametrize(
    "command",
    [pytest.param(c, marks=[pytest.mark.slow] if r.slow else []) for c, r in RUN.items()],
)
def test_doc_command_runs(command: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    spec = RUN[command]
    _write_saved_scripts(command, tmp_path)
    if spec.setup is not None:
        spec.setup(tmp_path)
    cwd = ROOT if spec.in_checkout else tmp_path
    if spec.forked is None:
        proc = _run(command, cwd, spec.timeout)
    else:
        starter = request.getfixturevalue("doc_starter")
        proc = _run_forked(command, cwd, spec.timeout, starter, spec.forked)
    spec.check(proc, tmp_path)


# One file per rank: the ranks' prints share one pipe, and unbuffered (PYTHONUNBUFFERED=1)
# a print is several writes, so two ranks' lines interleave ("ENVENV  [...").
_ENV_DUMP = (
    "import json, os, sys\n"
    "with open(f\"env-{os.environ['RANK']}.json\", 'w') as f:\n"
    "    json.dump([sys.argv, os.getcwd(), dict(os.environ)], f)\n"
)


def _env_dumps(cwd: Path) -> list:
    """The ranks' dumps in ``cwd`` in rank order, removed (the next command writes its own)."""
    paths = sorted(cwd.glob("env-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    dumps = [json.loads(p.read_text()) for p in paths]
    for p in paths:
        p.unlink()
    return dumps


def test_forked_ranks_get_torchruns_environment(tmp_path: Path, doc_starter: list[Starter]) -> None:
    """The forked commands' ranks see what a real torchrun shows its ranks."""
    (tmp_path / "dump.py").write_text(_ENV_DUMP)
    command = "X=1 torchrun --standalone --nproc_per_node 2 dump.py --a 1"
    seen = {}
    real = _run(command, tmp_path, 120.0)
    assert real.returncode == 0, real.stdout + real.stderr
    seen["real"] = _env_dumps(tmp_path)
    forked = _run_forked(command, tmp_path, 120.0, doc_starter, ())
    assert forked.returncode == 0, forked.stdout + forked.stderr
    seen["forked"] = _env_dumps(tmp_path)
    assert len(seen["real"]) == len(seen["forked"]) == 2
    # Different in every run: the store's port, the run's id and its error files.
    varying = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}
    for real_rank, forked_rank in zip(seen["real"], seen["forked"], strict=True):
        assert real_rank[:2] == forked_rank[:2] == [["dump.py", "--a", "1"], str(tmp_path)]
        real_env, forked_env = real_rank[2], forked_rank[2]
        assert real_env.keys() == forked_env.keys()
        assert {k: v for k, v in real_env.items() if k not in varying} == {
            k: v for k, v in forked_env.items() if k not in varying
        }
        assert forked_env["X"] == "1"


def test_python_blocks_compile() -> None:
    blocks = [b for b in _all_blocks() if b.lang == "python"]
    assert len(blocks) >= 5
    for block in blocks:
        ast.parse(block.body, filename=f"{block.page}, {block.heading}")


_HARNESS = """
import json
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
for heading, code in json.loads(open(sys.argv[1]).read()):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 4))
    ddp = DDP(model)
    # What the docs' snippets take as given: "your DDP model".
    exec(compile(code, heading, "exec"), {"ddp": ddp, "ddp_model": ddp})
    ddp(torch.randn(16, 8)).square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters()), heading
    print("ran:", heading, flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_python_blocks_run_together_per_section(tmp_path: Path) -> None:
    sections: dict[str, str] = {}
    scripts = set(_saved_scripts().values())
    for b in _all_blocks():
        # The init_distributed script runs under the aps-launch commands instead,
        # and the saved scripts under the commands that name them.
        if b.lang == "python" and "init_distributed()" not in b.body and b.body not in scripts:
            key = f"{b.page}, {b.heading}"
            sections[key] = sections.get(key, "") + b.body
    assert {
        "README.md, aps-comm",
        "README.md, FSDP2",
        "docs/design-and-guarantees.md, Using the hook",
        "docs/precision-policies.md, Policies",
        "docs/launching-and-restarts.md, Resuming from a checkpoint",
    } <= sections.keys()
    (tmp_path / "sections.json").write_text(json.dumps(list(sections.items())))
    (tmp_path / "harness.py").write_text(_HARNESS)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = _env() | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env |= {"RANK": "0", "WORLD_SIZE": "1"}
    proc = subprocess.run(
        [sys.executable, "harness.py", "sections.json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.findall(r"^ran: (.*)$", proc.stdout, re.M) == list(sections)
