"""Launching jobs: local ranks, torchrun, MPI (mpi4py) and SLURM.

User scripts call :func:`init_distributed`; ``aps-launch`` starts them.

Example:
    >>> from launch import init_distributed
    >>> info = init_distributed()  # doctest: +SKIP
    >>> info.rank, info.world_size, info.local_rank, info.device  # doctest: +SKIP
    (0, 1, 0, device(type='cpu'))
"""

from launch.distributed import BACKEND_ENV, DistInfo, init_distributed, resolve_backend
from launch.env import DistEnv, DistEnvError, detect_env

__all__ = [
    "BACKEND_ENV",
    "DistEnv",
    "DistEnvError",
    "DistInfo",
    "detect_env",
    "init_distributed",
    "resolve_backend",
]
