"""What every rank of :func:`aps_comm.testing.run_distributed` needs, set up once.

Its fork server imports this module before it forks any rank, so the ranks
inherit, rather than each repeat, the imports and numba's CPU target
(:func:`aps_comm.cpu_kernels.prepare`): about 0.8 s of CPU per rank on a
small machine, most of a short test's rank. Importing it anywhere else only
costs that time once, early.

Example:
    >>> import aps_comm.rank_preload  # noqa: F401
"""

from __future__ import annotations

import importlib

from aps_comm import cpu_kernels

__all__: list[str] = []

# Loaded here so that no rank loads them: DDP's, torch.compile's and the hook's.
for _name in ("torch.distributed", "torch._dynamo", "aps_comm.hook"):
    importlib.import_module(_name)
cpu_kernels.prepare()
