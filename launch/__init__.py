"""Launching jobs: local ranks, torchrun, MPI (mpi4py) and SLURM.

User scripts call :func:`init_distributed`; ``aps-launch`` starts them.

Installed as ``aps_launch`` (the checkout keeps it in ``launch/``): a top-level
``launch`` would clash with ROS 2's package of that name. The modules import
each other relatively so that they work under the installed name.

Example:
    >>> from aps_launch import init_distributed
    >>> info = init_distributed()  # doctest: +SKIP
    >>> info.rank, info.world_size, info.local_rank, info.device  # doctest: +SKIP
    (0, 1, 0, device(type='cpu'))
"""

from .distributed import BACKEND_ENV, DistInfo, init_distributed, resolve_backend
from .env import DistEnv, DistEnvError, detect_env

__all__ = [
    "BACKEND_ENV",
    "DistEnv",
    "DistEnvError",
    "DistInfo",
    "detect_env",
    "init_distributed",
    "resolve_backend",
]
