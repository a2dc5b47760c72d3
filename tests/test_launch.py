"""Tests for launch/: aps-launch (elastic, -m, MPI, SLURM) and init_distributed.

Every multi-rank test runs real processes on Gloo and checks the all-reduce
result each rank printed (tests/launch_scripts/allreduce_check.py asserts it
too), with a hard timeout per subprocess.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch.distributed as dist

from aps_launch import DistEnvError, detect_env, init_distributed
from aps_launch import slurm as slurm_env
from aps_launch.cli import main as cli_main
from aps_launch.elastic import LOOPBACK_RDZV, torchrun_argv
from aps_launch.env import from_slurm

SCRIPTS = Path(__file__).parent / "launch_scripts"
SCRIPT = str(SCRIPTS / "allreduce_check.py")
TIMEOUT = 90
_OK = re.compile(
    r"APS-OK rank=(\d) world=(\d) local=(\d) backend=(\w+) aps_backend=(\w+|-) sum=([0-9.e+-]+?)"
    r"(?=APS-OK|\s|$)"
)
_JOB_VARS = re.compile(
    r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|APS_BACKEND"
    r"|SLURM_.*|OMPI_.*|PMI_.*|PMIX_.*|MPI_LOCAL.*|TORCHELASTIC_.*)$"
)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _JOB_VARS.match(k)}
    env.update(extra)
    return env


def _aps_launch() -> list[str]:
    script = Path(sysconfig.get_path("scripts")) / "aps-launch"
    return [str(script)] if script.exists() else [sys.executable, "-m", "aps_launch.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT, cwd=SCRIPTS.parent
    )


def _ranks(output: str, world: int, sum_expected: float) -> dict[int, tuple[str, ...]]:
    """Parse the per-rank lines and check every rank saw the exact sum."""
    found = {int(m.group(1)): m.groups() for m in _OK.finditer(output)}
    assert sorted(found) == list(range(world)), output
    for rank, (_, w, local, _, _, total) in found.items():
        assert int(w) == world, output
        assert float(total) == sum_expected, output
        assert 0 <= int(local) < world, (rank, output)
    return found


@pytest.mark.slow
def test_elastic_two_ranks_allreduce_on_loopback() -> None:
    proc = _run(
        [*_aps_launch(), "--nproc-per-node", "2", "--backend", "gloo", SCRIPT, "--check-loopback"],
        _clean_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = _ranks(proc.stdout, world=2, sum_expected=3.0)
    assert {r[2] for r in ranks.values()} == {"0", "1"}  # local ranks
    assert all(r[3] == "gloo" and r[4] == "gloo" for r in ranks.values())  # APS_BACKEND reached


@pytest.mark.slow
def test_elastic_module_form_propagates_exit_code() -> None:
    env = _clean_env(PYTHONPATH=os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")]))
    proc = _run(
        [*_aps_launch(), "--nproc-per-node", "2", "-m", "allreduce_check", "--fail-rank", "1"],
        env,
    )
    _ranks(proc.stdout, world=2, sum_expected=3.0)  # both ran the module
    assert proc.returncode == 3, proc.stdout + proc.stderr


def _mpi_missing() -> str | None:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed"
    if shutil.which("mpirun") is None:
        return "no mpirun on PATH"
    return None


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("via_launcher", [True, False], ids=["aps-launch--mpi", "init-only"])
def test_mpi_two_ranks(via_launcher: bool) -> None:
    reason = _mpi_missing()
    if reason:
        pytest.skip(reason)
    launcher = [*_aps_launch(), "--mpi"] if via_launcher else [sys.executable]
    cmd = ["mpirun", "-n", "2", *launcher, SCRIPT, "--check-loopback", "--world", "2"]
    proc = _run(cmd, _clean_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _ranks(proc.stdout, world=2, sum_expected=3.0)


@pytest.mark.slow
@pytest.mark.parametrize("via_launcher", [True, False], ids=["aps-launch--slurm", "init-only"])
def test_slurm_faked_two_tasks(via_launcher: bool) -> None:
    port = str(_free_port())
    common = {
        "SLURM_NTASKS": "2",
        "SLURM_NNODES": "1",
        "SLURM_TASKS_PER_NODE": "2",
        "SLURM_NODELIST": "localhost",
        "SLURM_JOB_ID": "4242",
    }
    if via_launcher:
        cmd = [*_aps_launch(), "--slurm", "--master-port", port, SCRIPT]
    else:
        cmd = [sys.executable, SCRIPT]
        common["MASTER_PORT"] = port
    cmd += ["--check-loopback", "--world", "2"]
    procs = [
        subprocess.Popen(
            cmd,
            env=_clean_env(**common, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT)
            outputs.append(out + err)
            assert p.returncode == 0, out + err
    finally:
        for p in procs:
            p.kill()
    _ranks("\n".join(outputs), world=2, sum_expected=3.0)


@pytest.mark.slow
def test_single_process_world_of_one() -> None:
    proc = _run([sys.executable, SCRIPT, "--check-loopback", "--world", "1"], _clean_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = _ranks(proc.stdout, world=1, sum_expected=1.0)
    assert ranks[0][3] == "gloo"


@pytest.mark.parametrize(
    ("environ", "names"),
    [
        ({"RANK": "3", "WORLD_SIZE": "2"}, ["RANK=3", "WORLD_SIZE=2"]),
        ({"RANK": "0"}, ["RANK", "WORLD_SIZE"]),
        ({"WORLD_SIZE": "2"}, ["WORLD_SIZE", "RANK"]),
        ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}, ["MASTER_ADDR"]),
        ({"RANK": "1", "WORLD_SIZE": "2"}, ["MASTER_ADDR", "MASTER_PORT"]),
        ({"RANK": "x", "WORLD_SIZE": "2"}, ["RANK='x'"]),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
            ["LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2"],
        ),
        ({"PMI_RANK": "0", "PMI_SIZE": "2"}, ["MPI_LOCALRANKID"]),
        (
            {
                "OMPI_COMM_WORLD_RANK": "1",
                "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            },
            ["MASTER_ADDR", "MASTER_PORT"],
        ),
        ({"SLURM_PROCID": "2", "SLURM_NTASKS": "2"}, ["SLURM_PROCID=2", "SLURM_NTASKS=2"]),
        ({"SLURM_PROCID": "0"}, ["SLURM_NTASKS"]),
    ],
)
def test_inconsistent_env_names_the_variables(environ: dict[str, str], names: list[str]) -> None:
    with pytest.raises(DistEnvError) as info:
        detect_env(environ)
    for name in names:
        assert name in str(info.value)


def test_init_distributed_raises_before_touching_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    if dist.is_initialized():
        pytest.skip("another test left torch.distributed initialised in this process")
    for key in list(os.environ):
        if _JOB_VARS.match(key):
            monkeypatch.delenv(key)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(DistEnvError, match=r"RANK=2 must satisfy 0 <= RANK < WORLD_SIZE=2"):
        init_distributed()
    assert not dist.is_initialized()


def test_detect_env_sources() -> None:
    assert detect_env({}).source == "single"
    torchrun = detect_env(
        {
            "RANK": "1",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "n1",
            "MASTER_PORT": "29500",
        }
    )
    assert (torchrun.rank, torchrun.world_size, torchrun.local_rank) == (1, 4, 1)
    assert (torchrun.master_addr, torchrun.master_port, torchrun.source) == (
        "n1",
        29500,
        "torchrun",
    )
    hydra = detect_env(
        {
            "PMI_RANK": "3",
            "PMI_SIZE": "4",
            "MPI_LOCALRANKID": "1",
            "MPI_LOCALNRANKS": "2",
            "MASTER_ADDR": "n1",
            "MASTER_PORT": "1234",
        }
    )
    assert (hydra.rank, hydra.local_rank, hydra.local_world_size, hydra.source) == (3, 1, 2, "mpi")


def test_slurm_parsing() -> None:
    assert slurm_env.first_host("gpu[07-09,12],login1") == "gpu07"
    assert slurm_env.first_host("rack[2-3]-n[001-004]") == "rack2-n001"
    assert slurm_env.first_host("single") == "single"
    assert slurm_env.tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert slurm_env.port_from_job_id(123456) == slurm_env.port_from_job_id(123456 + 15000)
    assert 15000 <= slurm_env.port_from_job_id(987654321) < 30000
    env = from_slurm(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "8",
            "SLURM_LOCALID": "1",
            "SLURM_NODEID": "1",
            "SLURM_NNODES": "2",
            "SLURM_TASKS_PER_NODE": "4(x2)",
            "SLURM_JOB_ID": "77",
            "SLURM_NODELIST": "node[03-04]",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert (env.master_addr, env.master_port) == ("node03", slurm_env.port_from_job_id(77))
    one_node = from_slurm(
        {
            "SLURM_PROCID": "1",
            "SLURM_NTASKS": "2",
            "SLURM_NNODES": "1",
            "SLURM_JOB_ID": "77",
            "SLURM_NODELIST": "node03",
            "MASTER_PORT": "1234",
        }
    )
    assert (one_node.master_addr, one_node.master_port) == ("127.0.0.1", 1234)


def test_torchrun_argv_rendezvous_choice() -> None:
    local = torchrun_argv("t.py", ["-x"], nproc_per_node=2)
    assert local[local.index("--rdzv-backend") + 1] == LOOPBACK_RDZV
    assert local[local.index("--rdzv-endpoint") + 1] == "127.0.0.1:0"
    assert local[-2:] == ["t.py", "-x"]
    multi = torchrun_argv("t.py", [], nproc_per_node=4, nnodes="2", rdzv_endpoint="n1:29400")
    assert multi[multi.index("--rdzv-backend") + 1] == "c10d"
    static = torchrun_argv(
        "t.py", [], nproc_per_node=4, nnodes="2", node_rank=1, master_addr="n1", master_port=1234
    )
    assert static[static.index("--rdzv-backend") + 1] == "static"
    assert static[static.index("--rdzv-endpoint") + 1] == "n1:1234"
    assert static[static.index("--node-rank") + 1] == "1"
    with pytest.raises(ValueError, match="--rdzv-endpoint"):
        torchrun_argv("t.py", [], nproc_per_node=4, nnodes="2")


def test_cli_rejects_bad_combinations(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["--nnodes", "2", "t.py"]) == 2
    assert "--rdzv-endpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli_main(["--mpi", "--nproc-per-node", "2", "t.py"])
    assert info.value.code == 2
    assert "--nproc-per-node" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["--mpi", "--slurm", "t.py"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # 0 used to launch the default 2 ranks; -1 was torch.elastic's AssertionError.
        (["--nproc-per-node", "0"], "argument --nproc-per-node: must be at least 1, got '0'"),
        (["--nproc-per-node", "-1"], "argument --nproc-per-node: must be at least 1, got '-1'"),
        (["--nnodes", "0"], "argument --nnodes: expected a node count N or MIN:MAX"),
        (["--nnodes", "3:2"], "with 1 <= MIN <= MAX, got '3:2'"),
        (["--node-rank", "-1"], "argument --node-rank: must be at least 0, got '-1'"),
        (["--max-restarts", "-1"], "argument --max-restarts: must be at least 0, got '-1'"),
        (["--master-port", "70000"], "argument --master-port: a port is at most 65535"),
    ],
)
def test_cli_refuses_impossible_counts_before_launching(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import aps_launch.cli

    # Nothing may start: an argument error comes from the parser, before any rank.
    monkeypatch.setattr(aps_launch.cli, "launch_elastic", lambda argv: pytest.fail(str(argv)))
    with pytest.raises(SystemExit) as info:
        cli_main([*argv, "t.py"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("aps-launch: error:")


def test_loopback_rendezvous_gives_every_round_a_fresh_store() -> None:
    # A restarted worker group must not find the dead group's keys (its Gloo
    # addresses) in the store: each round gets its own server and port.
    from torch.distributed.elastic.rendezvous import (
        RendezvousParameters,
        rendezvous_handler_registry,
    )

    from aps_launch.elastic import register_loopback_rendezvous

    register_loopback_rendezvous()
    handler = rendezvous_handler_registry.create_handler(
        RendezvousParameters(LOOPBACK_RDZV, "127.0.0.1:0", "job", min_nodes=1, max_nodes=1)
    )
    ports = []
    for _ in range(2):
        info = handler.next_rendezvous()
        port = info.bootstrap_store_info.master_port
        workers = dist.TCPStore("127.0.0.1", port, 1, is_master=False)
        assert not workers.check(["default_pg/rank_0"]), "a key from the last round survived"
        workers.set("default_pg/rank_0", "127.0.0.1:1")
        ports.append(port)
    assert ports[0] != ports[1]


@pytest.mark.slow
def test_a_missing_script_is_one_line_before_any_rank_starts(tmp_path: Path) -> None:
    # Each rank used to fail in its own traceback under torchelastic's failure report.
    proc = subprocess.run(
        [*_aps_launch(), "--nproc-per-node", "2", "no_such_script.py"],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "aps-launch: error: no script 'no_such_script.py' to run: no such file"
    ], proc.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["folder"], "no script 'folder' to run: it is a folder, not a file"),
        (["-m", "no_such_module"], "no module 'no_such_module' to run with -m: not importable"),
        (["-m", "no_such_package.train"], "no module 'no_such_package.train' to run with -m"),
    ],
)
def test_a_missing_module_or_folder_is_refused_before_launching(
    argv: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import aps_launch.cli

    (tmp_path / "folder").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(aps_launch.cli, "launch_elastic", lambda argv: pytest.fail(str(argv)))
    assert cli_main(["--nproc-per-node", "2", *argv]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"aps-launch: error: {message}"), err
    # A module in the working folder is found, as `python -m` on the ranks finds it.
    (tmp_path / "mytrain.py").write_text("")
    started: list[list[str]] = []
    monkeypatch.setattr(aps_launch.cli, "launch_elastic", lambda argv: started.append(argv) or 0)
    monkeypatch.setattr(aps_launch.cli, "pin_loopback", lambda: None)
    assert cli_main(["--nproc-per-node", "2", "-m", "mytrain"]) == 0 and started
