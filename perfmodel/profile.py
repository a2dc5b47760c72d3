"""Calibrated profiles: fitted link and codec parameters saved as JSON.

``python -m aps_comm calibrate`` writes one; ``predict --profile`` turns it into a
flat :class:`~aps_perfmodel.cluster.Cluster` whose collectives and codec passes use
the measured fits instead of the analytic presets.

Example:
    >>> from aps_perfmodel.collectives import LinkParams
    >>> p = Profile(world_size=2, backend="gloo", link=LinkParams(1e-4, 1e-9, 1e-10))
    >>> p.to_cluster().world_size
    2
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .cluster import Cluster, OpCost, get_device
from .collectives import LinkParams, Topology

__all__ = ["PROFILE_KIND", "Profile"]

PROFILE_KIND = "aps-perfmodel-profile"
_VERSION = 1


@dataclass(frozen=True)
class Profile:
    """What calibration measured and fitted on one group of machines.

    Attributes:
        world_size: ranks the measurements ran on.
        backend: ``torch.distributed`` backend.
        link: one alpha/beta/gamma fitted jointly to every collective.
        collectives: per-collective fits (``all_reduce.<dtype>``, ``all_to_all``,
            ``all_gather``, ``all_reduce_max``), gamma folded into beta.
        codec: per-pass fits keyed ``<op>.<format>`` or ``accumulate``/``amax``.
        codec_source: which codec was measured ("aps_comm.formats",
            "torch-cast" or "none").
        fit_errors: per fit, the median and worst relative error on its samples.
        samples: the raw timings (trimmed means of repeats): ``{"op", "n", "seconds"}``
            (n bytes or elements).
        host: host name of rank 0.
        created: ISO time stamp.
        cores_per_rank: CPU cores per rank on the calibrated machines (None:
            not recorded). Below 1, ranks share cores, and a rank's codec and
            its network stack compete for them instead of overlapping.
    """

    world_size: int
    backend: str
    link: LinkParams
    collectives: dict[str, LinkParams] = field(default_factory=dict)
    codec: dict[str, OpCost] = field(default_factory=dict)
    codec_source: str = "none"
    fit_errors: dict[str, dict[str, float]] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    host: str = ""
    created: str = ""
    cores_per_rank: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dictionary (the file format)."""
        return {
            "kind": PROFILE_KIND,
            "version": _VERSION,
            "world_size": self.world_size,
            "backend": self.backend,
            "host": self.host,
            "created": self.created,
            "link": asdict(self.link),
            "collectives": {k: asdict(v) for k, v in self.collectives.items()},
            "codec_source": self.codec_source,
            "codec": {k: asdict(v) for k, v in self.codec.items()},
            "fit_errors": self.fit_errors,
            "samples": self.samples,
            "cores_per_rank": self.cores_per_rank,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        """Parse the file format.

        Raises:
            ValueError: not a profile, or a version this code cannot read.
        """
        if data.get("kind") != PROFILE_KIND:
            raise ValueError("not an aps-perfmodel profile (missing kind)")
        if data.get("version") != _VERSION:
            raise ValueError(f"unsupported profile version {data.get('version')}")
        return cls(
            world_size=int(data["world_size"]),
            backend=data["backend"],
            link=LinkParams(**data["link"]),
            collectives={k: LinkParams(**v) for k, v in data["collectives"].items()},
            codec={k: OpCost(**v) for k, v in data["codec"].items()},
            codec_source=data.get("codec_source", "none"),
            fit_errors=data.get("fit_errors", {}),
            samples=data.get("samples", []),
            host=data.get("host", ""),
            created=data.get("created", ""),
            cores_per_rank=data.get("cores_per_rank"),
        )

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read a profile written by :meth:`save`."""
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_cluster(self, world_size: int | None = None, device: str = "cpu") -> Cluster:
        """A flat cluster (one rank per node) using the measured fits.

        Args:
            world_size: ranks to predict for (default: the calibrated count).
                The fits keep their alpha/beta and the formulas scale with it.
            device: preset pricing anything the profile did not measure and
                estimating compute.
        """
        topo = Topology(self.world_size, 1, self.link, self.link)
        cluster = Cluster(
            name=f"profile({self.host or 'unknown'}, {self.backend}, p={self.world_size})",
            topology=topo,
            device=get_device(device),
            collective_fits=dict(self.collectives),
            codec_fits=dict(self.codec),
            source=f"calibrated on {self.host} ({self.created})",
            cores_per_rank=self.cores_per_rank,
            backend=self.backend.lower(),
        )
        if world_size is not None:
            cluster = replace(cluster, topology=replace(topo, nodes=world_size))
        return cluster
