"""Error feedback: what rounding lost this step, added back to the next step's gradients.

Residuals are kept per parameter name (unscaled, float32, on the gradients'
device), so they do not depend on DDP's bucketing, which changes after the
first iteration (and so after a resume). Two losses are kept: this rank's
encoding of its gradient, and, for two_phase, its re-encoding of the mean
as a shard owner (times N, so that the next step's mean gets it back).

Example:
    >>> fb = ErrorFeedback(rank=0, world_size=2)
    >>> x = torch.zeros(3)
    >>> fb.add(x, [3], ["w"])        # nothing kept yet: x is unchanged
    >>> x
    tensor([0., 0., 0.])
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """The residuals of one rank.

    Args:
        rank: this rank in the state's group.
        world_size: N.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self._residuals: dict[str, torch.Tensor] = {}
        # Settled buckets' flat residuals (:meth:`share`): each name's token, and
        # the tokens whose views are still every one of their names' residuals.
        self._owner: dict[str, int] = {}
        self._live: set[int] = set()
        self._tokens = itertools.count(1)

    @property
    def residuals(self) -> dict[str, torch.Tensor]:
        """The residuals per parameter name (unscaled float32)."""
        return self._residuals

    @residuals.setter
    def residuals(self, value: dict[str, torch.Tensor]) -> None:
        # A restored checkpoint: no settled bucket's buffer holds these.
        self._residuals = value
        self._owner.clear()
        self._live.clear()

    def share(self, names: Sequence[str], numels: Sequence[int], flat: torch.Tensor) -> int:
        """Make views of ``flat`` (float32, the layers end to end) the residuals of ``names``.

        ``flat`` takes their current residuals (every name must have one). A
        settled bucket then updates ``flat`` in place with whole-bucket
        kernels, no per-layer work; the views keep :attr:`residuals` (and
        checkpoints) current. Any other change to those names' residuals
        (:meth:`drop`, a restored
        :attr:`residuals`) ends the sharing: :meth:`shared` then says False.

        Returns:
            The token :meth:`shared` takes.
        """
        torch.cat([self._residuals[n] for n in names], out=flat)
        token = next(self._tokens)
        for name, part in zip(names, torch.split(flat, list(numels)), strict=True):
            self._residuals[name] = part
            old = self._owner.get(name)
            if old is not None:
                self._live.discard(old)
            self._owner[name] = token
        self._live.add(token)
        return token

    def shared(self, token: int) -> bool:
        """Whether the views :meth:`share` gave ``token`` are still their names' residuals."""
        return token in self._live

    def _release(self, names: Sequence[str | None]) -> None:
        for name in names:
            token = self._owner.pop(name or "", None)
            if token is not None:
                self._live.discard(token)

    def add(self, x: torch.Tensor, numels: Sequence[int], names: Sequence[str | None]) -> None:
        """Add the kept residuals to the layers of ``x`` (in place)."""
        have = [
            (t, self.residuals[n])
            for t, n in zip(torch.split(x, list(numels)), names, strict=True)
            if n in self.residuals
        ]
        if have:
            torch._foreach_add_([t for t, _ in have], [r for _, r in have])

    def drop(self, names: Sequence[str | None]) -> None:
        """Forget the residuals of layers sent exactly (FP32)."""
        self._release(names)
        for name in names:
            self.residuals.pop(name or "", None)
