"""`PipeshardParallel`: the user's choice of pipeline parallelism (plain data)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from autopar.pipeline.schedule import SCHEDULES


@dataclass(frozen=True)
class PipeshardParallel:
    """Pipeline stages on submeshes, each with its own intra-op sharding.

    num_micro_batches: micro-batches per step (the batch's leading dim must divide by it).
    schedule: "1f1b" (at most S micro-batches of activations alive) or "gpipe".
    num_stages: None lets the stage DP choose.
    layers: "auto" (layer clustering searches L; `mark_stage_boundary` markers, when
        present, define the layers) or an int L.
    submeshes: "auto" or a list of (hosts, devices) shapes, one per stage.
    profile: measure candidate stages on the devices instead of the cost model.
    devices_per_host: the width of a host when planning (default: all given devices
        form one host).
    imbalance_tolerance: Alpa's pruning of the stage DP's slowest-stage bound: a new bound
        is tried only when it exceeds the last one by this fraction (0 = exact).
    """

    num_micro_batches: int = 1
    schedule: str = "1f1b"
    num_stages: int | None = None
    layers: str | int = "auto"
    submeshes: str | Sequence[tuple[int, int]] = "auto"
    profile: bool = False
    devices_per_host: int | None = None
    imbalance_tolerance: float = 0.0

    def __post_init__(self):
        if not isinstance(self.num_micro_batches, int) or self.num_micro_batches < 1:
            raise ValueError(f"num_micro_batches must be a positive int, got {self.num_micro_batches!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.num_stages is not None and (not isinstance(self.num_stages, int) or self.num_stages < 1):
            raise ValueError(f"num_stages must be None or a positive int, got {self.num_stages!r}")
        if self.layers != "auto" and (not isinstance(self.layers, int) or self.layers < 1):
            raise ValueError(f"layers must be 'auto' or a positive int, got {self.layers!r}")
        if self.submeshes != "auto":
            shapes = [tuple(s) for s in self.submeshes]
            if any(len(s) != 2 or min(s) < 1 for s in shapes):
                raise ValueError(f"submeshes must be 'auto' or a list of (hosts, devices) pairs, "
                                 f"got {self.submeshes!r}")
            if self.num_stages is not None and len(shapes) != self.num_stages:
                raise ValueError(f"{len(shapes)} submeshes given for num_stages={self.num_stages}")
            object.__setattr__(self, "submeshes", tuple(shapes))
        if self.imbalance_tolerance < 0:
            raise ValueError("imbalance_tolerance must be >= 0")
