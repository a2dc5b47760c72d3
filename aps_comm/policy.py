"""Precision policies: which layer travels in which format, and when.

A policy is a list of rules applied in order; each may change the format of
some layers, so a later rule wins over an earlier one. Static rules decide once, when the hook binds to the model
(names and sizes are known then); dynamic rules decide every step from
statistics every rank shares, so all ranks always agree.

- :class:`ByName`: glob patterns on parameter names, or a callable
  ``(name, param) -> format | None``.
- :class:`KeepLast`: the last layer (the classifier) in a high format, the
  APS paper's hybrid (+0.5 to +0.9 top-1 on ImageNet ResNet-50).
- :class:`MinNumel`: tensors with fewer than ``min_numel`` elements (biases,
  norms: cheap in bytes, sensitive in value) in a high format.
- :class:`LowRatio`: precision demotion to a target ratio (Lee, Sharma,
  Aiken): the largest tensors go low until at least ``ratio`` of all elements
  travel in the low format; the rest stay high.
- :class:`Promote`: underflow-driven promotion (Zhao et al., gamma = 1e-3):
  a layer whose underflow rate (the maximum over ranks, all-reduced together
  with the layer maxima, so no extra collective) exceeds gamma moves one step
  up a ladder of wider formats from the next step, and back down after
  ``patience`` steps below ``gamma * calm`` (hysteresis: no flapping).
- :class:`Schedule`: every layer in a high format for the first ``steps``
  steps, then the policy's formats (the APS paper's FP32-then-FP8 run).

Example:
    >>> state = register(ddp, fmt="e4m3",
    ...                  policy=[KeepLast("fp32"), MinNumel(1024), Promote()])  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from aps_comm.formats import FloatFormat, get_format

__all__ = [
    "Assignment",
    "ByName",
    "KeepLast",
    "LayerInfo",
    "LowRatio",
    "MinNumel",
    "Promote",
    "Rule",
    "Schedule",
    "policy_rules",
    "static_formats",
]


@dataclasses.dataclass(frozen=True)
class LayerInfo:
    """A parameter as the policy sees it.

    Attributes:
        index: position among the model's trainable parameters.
        name: qualified parameter name.
        numel: number of elements.
        module: qualified name of the module that owns the parameter.
        param: the parameter itself (for callables).
    """

    index: int
    name: str
    numel: int
    module: str
    param: torch.nn.Parameter | None = dataclasses.field(default=None, compare=False, repr=False)


class Rule:
    """Base class of policy rules. Static rules override :meth:`assign`."""

    needs_names = True

    def assign(self, layers: Sequence[LayerInfo], formats: list[FloatFormat]) -> None:
        """Change ``formats`` (one per layer, in place) at bind time."""

    def describe(self) -> str:
        return repr(self)


@dataclasses.dataclass
class ByName(Rule):
    """Formats by parameter name: ``{"*.bias": "fp32", "head.*": "bf16"}`` (first match
    wins), or a callable ``(name, param) -> format or None`` (None: no change)."""

    rules: Mapping[str, FloatFormat | str] | Callable[[str, torch.nn.Parameter], Any]

    def assign(self, layers: Sequence[LayerInfo], formats: list[FloatFormat]) -> None:
        for i, layer in enumerate(layers):
            if callable(self.rules):
                fmt = self.rules(layer.name, layer.param)
                if fmt is not None:
                    formats[i] = get_format(fmt)
                continue
            for pattern, fmt in self.rules.items():
                if fnmatch.fnmatchcase(layer.name, pattern):
                    formats[i] = get_format(fmt)
                    break

    def describe(self) -> str:
        return f"ByName({'callable' if callable(self.rules) else dict(self.rules)})"


@dataclasses.dataclass
class KeepLast(Rule):
    """The parameters of the last module that has any (the classifier) in ``fmt``."""

    fmt: FloatFormat | str = "fp32"

    def assign(self, layers: Sequence[LayerInfo], formats: list[FloatFormat]) -> None:
        if not layers:
            return
        last = max(layers, key=lambda layer: layer.index).module
        for i, layer in enumerate(layers):
            if layer.module == last:
                formats[i] = get_format(self.fmt)


@dataclasses.dataclass
class MinNumel(Rule):
    """Tensors with fewer than ``min_numel`` elements in ``fmt``."""

    min_numel: int = 1024
    fmt: FloatFormat | str = "fp32"
    needs_names = False

    def assign(self, layers: Sequence[LayerInfo], formats: list[FloatFormat]) -> None:
        for i, layer in enumerate(layers):
            if layer.numel < self.min_numel:
                formats[i] = get_format(self.fmt)


@dataclasses.dataclass
class LowRatio(Rule):
    """Demote the largest tensors to ``low`` until at least ``ratio`` of all elements
    are low; the rest in ``high`` (Lee, Sharma, Aiken, TMLR 2023).

    ``low`` defaults to the state's format (the one layers have when this rule runs).
    """

    ratio: float = 0.9
    high: FloatFormat | str = "fp32"
    low: FloatFormat | str | None = None
    needs_names = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"LowRatio.ratio must be in [0, 1], got {self.ratio!r}")

    def assign(self, layers: Sequence[LayerInfo], formats: list[FloatFormat]) -> None:
        total = sum(layer.numel for layer in layers)
        # Largest first; ties by position so every rank orders them the same way.
        order = sorted(range(len(layers)), key=lambda i: (-layers[i].numel, layers[i].index))
        low_count = 0
        for i in order:
            if total and low_count >= self.ratio * total:
                formats[i] = get_format(self.high)
            else:
                if self.low is not None:
                    formats[i] = get_format(self.low)
                low_count += layers[i].numel


@dataclasses.dataclass
class Schedule(Rule):
    """Every layer in ``fmt`` for the first ``steps`` steps (optimizer steps that
    communicated), then the other rules' formats."""

    steps: int = 100
    fmt: FloatFormat | str = "fp32"
    needs_names = False

    def override(self, step: int) -> FloatFormat | None:
        return get_format(self.fmt) if step < self.steps else None


@dataclasses.dataclass
class Promote(Rule):
    """Underflow-driven promotion with hysteresis.

    A layer's underflow rate is the fraction of its nonzero gradient elements
    that scale to zero under its agreed exponent (on hierarchical and grid
    routes the first level's, which ``stats=True`` records), the maximum over
    ranks.

    Args:
        gamma: underflow rate above which a layer moves one format up.
        ladder: formats from narrowest to widest; a layer whose static format
            is not on the ladder is left alone.
        patience: steps in a row below ``gamma * calm`` before moving down.
        calm: fraction of gamma that counts as "well under".

    Example:
        >>> Promote(gamma=0.01).step(level=0, calm_steps=0, rate=0.02, base_level=0)
        (1, 0)
    """

    gamma: float = 1e-3
    ladder: Sequence[FloatFormat | str] = ("e4m3", "e5m2", "fp16")
    patience: int = 50
    calm: float = 0.1
    needs_names = False

    def __post_init__(self) -> None:
        if not 0.0 < self.gamma < 1.0:
            raise ValueError(f"Promote.gamma must be in (0, 1), got {self.gamma!r}")
        if self.patience < 1:
            raise ValueError(f"Promote.patience must be >= 1, got {self.patience!r}")
        self.ladder = tuple(get_format(f) for f in self.ladder)

    def step(self, level: int, calm_steps: int, rate: float, base_level: int) -> tuple[int, int]:
        """Next (level, calm_steps) of one layer from the all-reduced underflow rate."""
        levels, calm = self.steps(
            np.array([level]), np.array([calm_steps]), np.array([rate]), np.array([base_level])
        )
        return int(levels[0]), int(calm[0])

    def steps(
        self, levels: np.ndarray, calm_steps: np.ndarray, rates: np.ndarray, base: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`step` of many layers at once (a bucket's, in a few array ops whatever
        their number): their next levels and calm steps.

        ``rates`` must be float64: compared as float32, a rate and ``gamma``
        round apart (float32 rates are widened exactly).

        Example:
            >>> lv, calm = Promote(gamma=0.01, patience=1).steps(
            ...     np.array([0, 1]), np.array([0, 0]), np.array([0.02, 0.0]), np.array([0, 0]))
            >>> lv.tolist(), calm.tolist()
            ([1, 0], [0, 0])
        """
        up = rates > self.gamma
        calm = ~up & (rates < self.gamma * self.calm) & (levels > base)
        calm_steps = np.where(calm, calm_steps + 1, 0)
        down = calm_steps >= self.patience  # only where calm: patience >= 1
        levels = np.where(up, np.minimum(levels + 1, len(self.ladder) - 1), levels - down)
        return levels, np.where(down, 0, calm_steps)


def static_formats(
    rules: Sequence[Rule], layers: Sequence[LayerInfo], base: FloatFormat
) -> list[FloatFormat]:
    """Apply the static rules in order to every layer, starting from ``base``."""
    formats = [base] * len(layers)
    for rule in rules:
        rule.assign(layers, formats)
    return formats


_POLICY_EXAMPLE = 'policy=[KeepLast("fp32")] (a list of rules from aps_comm.policy)'


def policy_rules(policy: Sequence[Rule] | Rule | None) -> list[Rule]:
    """``policy`` as a list of rules; a TypeError naming the value passed otherwise.

    A string is a sequence too: ``policy="fp32"`` would otherwise be read as
    four rules named "f", "p", "3" and "2".

    Example:
        >>> policy_rules([KeepLast("fp32")])
        [KeepLast(fmt='fp32')]
        >>> policy_rules("fp32")
        Traceback (most recent call last):
        ...
        TypeError: policy must be a list of aps_comm.policy rules, got 'fp32'; e.g. policy=[KeepLast("fp32")] (a list of rules from aps_comm.policy)
    """
    if policy is None:
        return []
    if isinstance(policy, Rule):
        # One rule where a list is expected: what was meant is clear, but say it,
        # since the other rules of the list would silently be missing otherwise.
        raise TypeError(
            f"policy must be a list of aps_comm.policy rules, got the single rule {policy!r}; "
            f"e.g. policy=[{policy!r}]"
        )
    try:
        if isinstance(policy, str | bytes):
            raise TypeError  # iterable, but as letters, not rules
        rules = list(policy)
    except TypeError:
        raise TypeError(
            f"policy must be a list of aps_comm.policy rules, got {policy!r}; "
            f"e.g. {_POLICY_EXAMPLE}"
        ) from None
    for rule in rules:
        if not isinstance(rule, Rule):
            raise TypeError(
                f"policy entries must be aps_comm.policy rules, got {rule!r} in "
                f"policy={policy!r}; e.g. {_POLICY_EXAMPLE}"
            )
    return rules


def describe(rules: Sequence[Rule]) -> str:
    """A stable text form of a policy, compared across ranks at bind time."""
    return "[" + ", ".join(r.describe() for r in rules) + "]"


@dataclasses.dataclass
class _Laddered:
    """A bucket's layers on Promote's ladder: their positions among its keys, their
    slots in :class:`Assignment`'s arrays, their base levels; ``quiet``: all at their
    base level, no calm step counted (a step then moves nothing unless a rate exceeds
    gamma: the common step, in one check), as of the assignment's ``seen`` version."""

    at: np.ndarray
    slots: np.ndarray
    base: np.ndarray
    quiet: bool = True
    seen: int = -1


class Assignment:
    """Each layer's wire format, step by step: the static rules, Schedule and Promote applied.

    Layers are keyed by whatever identifies them to the caller (DDP: the
    parameter's ``id``; FSDP: its name). Promote's underflow rates come
    from the previous step; its decisions are the same on every rank because
    the rates it reads are all-reduced (the maximum over ranks).

    Args:
        rules: the policy.
        base: the state's format.

    Example:
        >>> a = Assignment([Schedule(2, "fp16")], get_format("e4m3"))
        >>> a.bind({"w": LayerInfo(0, "w", 10, "")})
        >>> [f.name for f in a.formats(["w"], step=1)], [f.name for f in a.formats(["w"], step=2)]
        (['fp16'], ['e4m3'])
    """

    def __init__(self, rules: Sequence[Rule], base: FloatFormat) -> None:
        self.rules = policy_rules(rules)
        self.base = base
        self.schedule = [r for r in self.rules if isinstance(r, Schedule)]
        self.promoter = next((r for r in self.rules if isinstance(r, Promote)), None)
        self.layers: dict[Any, tuple[LayerInfo, FloatFormat]] = {}
        # Per key on Promote's ladder: (its name, its static format's level), found once at
        # bind so that a step compares no formats (O(layers) dataclass compares per bucket).
        self._laddered: dict[Any, tuple[str, int]] = {}
        # Promote's (level, calm steps) per parameter name, in arrays (a slot per name, kept
        # for good) so that a bucket's step is a few array ops, not a loop over its layers.
        self._slot: dict[str, int] = {}
        self._levels = np.zeros(0, dtype=np.int64)
        self._calm = np.zeros(0, dtype=np.int64)
        self._held = np.zeros(0, dtype=bool)
        # Per bucket's keys, their layers on the ladder; a bucket's keys may be another's
        # too (a format group's), so its ``quiet`` holds only until a step changes any
        # level or calm step (``_version``).
        self._found: dict[tuple[Any, ...], _Laddered] = {}
        self._version = 0
        # Bumped where Promote's levels are replaced (a checkpoint loaded): every
        # settled bucket is bound again (see :meth:`epoch`). A level that Promote
        # moves is seen by its own bucket, which then binds again by itself.
        self.revision = 0

    def bind(self, layers: Mapping[Any, LayerInfo]) -> None:
        """Apply the static rules to the model's layers (keyed as the caller keys them)."""
        infos = list(layers.values())
        formats = static_formats(self.rules, infos, self.base)
        self.layers = {k: (info, f) for k, info, f in zip(layers, infos, formats, strict=True)}
        self._laddered, self._found = {}, {}
        if self.promoter is not None:
            ladder = list(self.promoter.ladder)
            for key, info, f in zip(layers, infos, formats, strict=True):
                if f in ladder:
                    at = self._place(info.name)
                    if not self._held[at]:  # a checkpoint's level stays
                        self._levels[at], self._calm[at], self._held[at] = ladder.index(f), 0, True
                    self._laddered[key] = info.name, ladder.index(f)

    @property
    def promote(self) -> dict[str, tuple[int, int]]:
        """Promote's (level on its ladder, calm steps) per parameter name (a checkpoint's)."""
        return {
            name: (int(self._levels[i]), int(self._calm[i]))
            for name, i in self._slot.items()
            if self._held[i]
        }

    @promote.setter
    def promote(self, levels: Mapping[str, tuple[int, int]]) -> None:
        self._held[:] = False
        for name, (level, calm) in levels.items():
            at = self._place(name)
            self._levels[at], self._calm[at], self._held[at] = level, calm, True
        self._found = {}

    def _place(self, name: str) -> int:
        """``name``'s slot in Promote's arrays, made where it has none."""
        at = self._slot.get(name)
        if at is None:
            at = self._slot[name] = len(self._slot)
            self._levels, self._calm = np.append(self._levels, 0), np.append(self._calm, 0)
            self._held = np.append(self._held, False)
        return at

    @property
    def bound(self) -> bool:
        return bool(self.layers)

    def possible(self) -> set[FloatFormat]:
        """Every format a layer may travel in."""
        formats = {self.base} | {f for _, f in self.layers.values()}
        formats |= {get_format(r.fmt) for r in self.schedule}
        if self.promoter is not None:
            formats |= set(self.promoter.ladder)  # type: ignore[arg-type]
        return formats

    def static(self, keys: Sequence[Any]) -> list[FloatFormat]:
        """Each layer's format from the static rules alone (no Schedule, no Promote)."""
        return [self.layers.get(key, (None, self.base))[1] for key in keys]

    def formats(self, keys: Sequence[Any], step: int) -> list[FloatFormat]:
        """This step's format of each layer (Promote's decisions so far applied)."""
        for rule in self.schedule:
            fmt = rule.override(step)
            if fmt is not None:
                return [fmt] * len(keys)
        out = []
        ladder = self.promoter.ladder if self.promoter is not None else ()
        for key in keys:
            info, fmt = self.layers.get(key, (None, self.base))
            at = self._slot.get(info.name) if info is not None else None
            if at is not None and self._held[at]:
                fmt = ladder[self._levels[at]]  # type: ignore[index]
            out.append(fmt)
        return out

    def promote_step(self, keys: Sequence[Any], rates: Sequence[float] | np.ndarray) -> bool:
        """Move each layer on Promote's ladder from its all-reduced underflow rate; whether
        a layer's level moved (its format, unless a Schedule rule overrides it).

        A few array ops per call whatever the number of layers (the keys'
        slots are found once per bucket), and one check while every layer is
        quiet and no rate exceeds gamma."""
        assert self.promoter is not None
        if len(rates) != len(keys):
            raise ValueError(f"{len(rates)} underflow rates for {len(keys)} layers")
        keys = tuple(keys)
        found = self._found.get(keys)
        if found is None:
            found = self._found[keys] = self._ladder_slots(keys)
        if found.seen != self._version:  # another step moved a level or counted: look again
            moving = (self._levels[found.slots] != found.base) | (self._calm[found.slots] != 0)
            found.quiet, found.seen = not moving.any(), self._version
        # float(): a float32 maximum compared exactly (numpy compares it to gamma as float32)
        if found.quiet and (not len(keys) or float(np.max(rates)) <= self.promoter.gamma):
            return False
        at, slots, base = found.at, found.slots, found.base
        levels, counted = self._levels[slots], self._calm[slots]
        new, calm = self.promoter.steps(
            levels, counted, np.asarray(rates, dtype=np.float64)[at], base
        )
        self._levels[slots], self._calm[slots] = new, calm
        moved = bool((new != levels).any())
        if moved or (calm != counted).any():
            self._version += 1
        found.quiet = not (new != base).any()  # calm steps count only above the base
        found.seen = self._version
        return moved

    def _ladder_slots(self, keys: tuple[Any, ...]) -> _Laddered:
        """Of ``keys``, those on Promote's ladder."""
        found = [
            (i, self._slot[name], base)
            for i, (name, base) in enumerate(self._laddered.get(k, ("", -1)) for k in keys)
            if base >= 0 and self._held[self._slot[name]]
        ]
        at, slots, base = np.array(found, dtype=np.int64).reshape(-1, 3).T
        return _Laddered(at, slots, base)

    def epoch(self, step: int) -> tuple[int, ...]:
        """What ``step``'s formats depend on besides the layers and Promote's steps: the
        revision and which Schedule rules still hold. Two steps of the same epoch give
        every layer the same format but for Promote's moves (which the layer's own
        bucket sees), so a bucket bound to one epoch's formats runs bound through it.

        Example:
            >>> a = Assignment([Schedule(2, "fp16")], get_format("e4m3"))
            >>> a.epoch(1) == a.epoch(0), a.epoch(2) == a.epoch(1)
            (True, False)
        """
        return (self.revision, *(int(step < rule.steps) for rule in self.schedule))
