"""The hook's per-layer figures as TensorBoard scalars.

:func:`log_stats` writes the last step's :class:`~aps_comm.telemetry.LayerStats`
(``APSState(stats=True)``) and the bytes sent to any writer with
``add_scalar``: ``torch.utils.tensorboard.SummaryWriter`` (needs the
``tensorboard`` package: ``pip install ".[tensorboard]"`` from the checkout),
tensorboardX, or Lightning's ``TensorBoardLogger.experiment``. Tags:

- ``aps/bytes_sent``: payload bytes this rank handed to the collectives that
  match an all-reduce (:attr:`aps_comm.APSState.bytes_sent`: the all-gathers
  left out).
- ``aps/bytes_total``: every payload byte this rank handed to a collective
  (:attr:`aps_comm.APSState.bytes_total`).
- ``aps/exponent/<layer>``: the power of two the layer was scaled by.
- ``aps/amax/<layer>``: the all-reduced max |gradient|.
- ``aps/underflow_rate/<layer>``: fraction of this rank's nonzero elements flushed to zero.
- ``aps/saturated/<layer>``: this rank's elements clamped to the format's maximum.

Underflow and saturation are this rank's; write from one rank (rank 0).

Example:
    >>> from torch.utils.tensorboard import SummaryWriter
    >>> writer = SummaryWriter("runs/aps")  # doctest: +SKIP
    >>> state = register(ddp, "e4m3", stats=True)  # doctest: +SKIP
    >>> for x, y in loader:  # doctest: +SKIP
    ...     loss_fn(ddp(x), y).backward()
    ...     opt.step()
    ...     if dist.get_rank() == 0:
    ...         log_stats(writer, state)
"""

from __future__ import annotations

from typing import Protocol

from aps_comm.hook import APSState

__all__ = ["ScalarWriter", "log_stats"]


class ScalarWriter(Protocol):
    """What :func:`log_stats` needs of a writer: ``SummaryWriter.add_scalar``."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None) -> None:
        """Record one value of the series ``tag`` at ``global_step``."""


def log_stats(
    writer: ScalarWriter, state: APSState, step: int | None = None, *, prefix: str = "aps"
) -> None:
    """Write the last step's per-layer figures and bytes handed to collectives as scalars.

    Args:
        writer: a ``SummaryWriter`` (or anything with its ``add_scalar``).
        state: the hook's state, built with ``stats=True``.
        step: the x value; default ``state.step`` (steps communicated so far).
        prefix: first part of every tag.

    Raises:
        ValueError: the state collects no stats.

    Example:
        >>> log_stats(SummaryWriter("runs/aps"), state)  # doctest: +SKIP
    """
    if not state.collect_stats:
        raise ValueError("log_stats needs per-layer stats: build the state with stats=True")
    step = state.step if step is None else step
    writer.add_scalar(f"{prefix}/bytes_sent", float(state.bytes_sent), step)
    writer.add_scalar(f"{prefix}/bytes_total", float(state.bytes_total), step)
    for i, s in enumerate(state.stats):
        # Unbound states know no names: number the layers in DDP's bucket order.
        layer = s.name if s.name is not None else f"layer{i}"
        writer.add_scalar(f"{prefix}/exponent/{layer}", float(s.exponent), step)
        writer.add_scalar(f"{prefix}/amax/{layer}", s.amax, step)
        writer.add_scalar(f"{prefix}/underflow_rate/{layer}", s.underflow_rate, step)
        writer.add_scalar(f"{prefix}/saturated/{layer}", float(s.saturated), step)
