"""Block copies the runner must execute before the next step, in stages.

The KV manager plans copies as it goes: swap-out and spill of evicted cached blocks (device ->
host), swap-in and reload of cached blocks (host -> device), and writes of cached blocks to the
disk tier (device or host -> disk: the block is read when its turn in the plan comes, before a
later copy overwrites it). A block or host slot freed by one operation may be handed out again by the
next one in the same scheduling round, so the order matters: the plan's meaning is "execute the
copies one by one, in the order they were planned, then run the step".

To let the runner batch them, consecutive copies are grouped into stages. Within a stage every
copy has the same kind, no two copies write the same location, and no copy reads what another copy
of its stage writes (only STATE copies read the space they write: a stage ends before one that
would), so a stage can run as one gather followed by one scatter (`dst[...] = src[...]` with fancy
indexing). Stages must run in order.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np


class CopyKind(enum.Enum):
    DEVICE_TO_HOST = "device_to_host"
    HOST_TO_DEVICE = "host_to_device"
    # Writes to the disk tier: `dst` is a ticket of `DiskTier.plan_write`, not a location.
    DEVICE_TO_DISK = "device_to_disk"
    HOST_TO_DISK = "host_to_disk"
    # A hybrid's per-sequence state, state slot to state slot (a snapshot taken or restored: state_snapshots.py).
    STATE = "state"


@dataclass
class CopyStage:
    """Copies of one kind that can run together: `dst[i] <- src[i]` for all i at once."""

    kind: CopyKind
    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)
    _written: set[int] = field(default_factory=set, repr=False)

    @property
    def pairs(self) -> list[tuple[int, int]]:
        return list(zip(self.src, self.dst))

    def as_array(self) -> np.ndarray:
        """int32 array of shape [n, 2]: column 0 the sources, column 1 the destinations."""
        return np.array([self.src, self.dst], dtype=np.int32).T.reshape(-1, 2)

    def __len__(self) -> int:
        return len(self.src)


class CopyPlan:
    """An ordered list of copy stages, filled by the KV manager, drained by the scheduler."""

    def __init__(self) -> None:
        self._stages: list[CopyStage] = []

    def add(self, kind: CopyKind, src: int, dst: int) -> None:
        stages = self._stages
        stage = stages[-1] if stages else None
        reads_written = kind is CopyKind.STATE and stage is not None and src in stage._written
        if stage is None or stage.kind is not kind or dst in stage._written or reads_written:
            stage = CopyStage(kind)
            stages.append(stage)
        stage.src.append(src)
        stage.dst.append(dst)
        stage._written.add(dst)

    def take(self) -> list[CopyStage]:
        """Return the planned stages and start an empty plan."""
        stages, self._stages = self._stages, []
        return stages

    def __len__(self) -> int:
        return sum(len(stage) for stage in self._stages)

    def __bool__(self) -> bool:
        return bool(self._stages)
