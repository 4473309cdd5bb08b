"""What the controller keeps to go on after a rank fails (``distribute(fault_tolerance=True)``).

On a rank that exits, is killed, stays stopped or goes silent, the controller stops the mesh,
starts it again with the same launcher, every rank takes back its pieces of the newest
snapshot all ranks hold (``_snapshot.py``: in memory, kept by the controller, or by a keeper
on each other host, ``_keepers.py``), the steps after
that snapshot run again from the batches kept here (the interrupted one last), and the call
returns as if nothing happened. Every step is deterministic given its batch, its
hyperparameters, the run's seed and its number (``backends/_rng.py``), and collectives sum in
the same order on the same mesh, so the state after the replay is bit for bit the state the
fault-free run reaches.

With ``elastic``, a failed rank is not started again: the mesh shrinks to one the surviving
ranks can form (``smaller_meshes``), the step is planned again for it, the state of the newest
common snapshot moves to it through the controller, and the kept steps re-run on it. The result
then equals a run on the smaller mesh from that step on, not bit for bit the old mesh's (the
sums of a collective run in another order). A host lost under the mpi launcher is left out
of the smaller mesh, its ranks' snapshots read from their copies on the next host
(``_keepers.py``).

This module is the bookkeeping: which steps a snapshot covers, the batches since the last
one, the restart budget, the step deadline derived from measured step times, the meshes a
shrink may choose.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._errors import RuntimeFailure

__all__ = ["RECOVERABLE", "Recovery", "Remembered", "smaller_meshes"]

# WorkerFailure reasons a restart can cure: a process that ended, stopped, went silent, lost
# its control connection or broke the protocol. "error" (a handler raised: the user's code, an
# index out of range) would raise again on the replay, and is raised to the caller as it is.
RECOVERABLE = ("exit", "stopped", "dropped", "lost", "timeout", "protocol")

_DEADLINE_STEPS = 3       # measured steps before the step deadline follows the step time
_DEADLINE_FACTOR = 10.0   # a step may take this many times the median step before it hangs


@dataclasses.dataclass(frozen=True, slots=True)
class Remembered:
    """A step the mesh ran since the newest snapshot: what re-runs it exactly."""

    step: int
    variant: int
    header: dict[str, Any]
    batch: dict[str, torch.Tensor]        # data and hyperparameter tensors, cloned


class Recovery:
    """The controller's fault-tolerance state for one ``DistributedStep``."""

    def __init__(self, *, max_restarts: int, snapshot_every: int, hang_s: float,
                 elastic: int | None = None) -> None:
        self.max_restarts, self.snapshot_every, self.hang_s = max_restarts, snapshot_every, hang_s
        self.elastic = elastic    # None: replace failed ranks; n: shrink, to no fewer than n
        # a shrink under way: the step whose state the controller's live model holds and the
        # kept steps after it (a failure while the smaller mesh starts goes on from there)
        self.held: tuple[int, list[Remembered]] | None = None
        self.relocating = False   # whether that move keeps the mesh (spare hosts) or shrinks
        self.shrunk: tuple[dict[str, int], dict[str, int]] | None = None   # the last: from, to
        self.moved: list[str] = []       # the lost hosts whose ranks the last recovery moved
        self.files: Any = None    # every rank's snapshot file (_keepers.MeshSnapshots)
        self.restarts = 0
        self.generation = 0       # communicators built after a rank was replaced
        self.replaced: list[int] = []             # the ranks the last recovery started
        # the last recovery's parts, seconds by name, in order (logged at INFO once it is over)
        self.phases: dict[str, float] = {}
        # (rank, state name) -> the rank whose snapshot holds that piece (_snapshot_owners)
        self.owners: dict[tuple[int, str], int] | None = None
        # the last two snapshot steps every rank ran: a snapshot is copied while the next
        # request comes (``Snapshot.write_behind``), so a rank that dies then holds only the
        # one before; the batches since that one are kept
        self._snaps: list[int] = []
        self._since: dict[int, Remembered] = {}    # steps after the older one, by number
        self._durations: deque[float] = deque(maxlen=20)
        self._fresh = False          # the next step is the first after a recovery

    def close(self) -> None:
        if self.files is not None:
            self.files.close()
            self.files = None
        self._snaps = []
        self._since.clear()
        self._durations.clear()
        self.owners = None

    def started(self, first_step: int) -> None:
        """A fresh launch wrote the state it got as the snapshot of ``first_step - 1`` (also
        after the state changed outside a step: every rank's only snapshot now)."""
        self._snaps = [first_step - 1]
        self._since.clear()

    def wants_snapshot(self, step: int) -> bool:
        return (step + 1) % self.snapshot_every == 0

    def remember(self, step: int, variant: int, header: Mapping[str, Any],
                 batch: Mapping[str, torch.Tensor]) -> Remembered:
        """Keep what re-runs ``step`` (the batch cloned: the caller may reuse its tensors)."""
        kept = Remembered(step, variant, dict(header),
                          {k: v.clone() if isinstance(v, torch.Tensor) else v
                           for k, v in batch.items()})
        self._since[step] = kept
        return kept

    def committed(self, step: int, dur_s: float | None) -> None:
        """Every rank ran ``step``; when it snapshotted, the batches up to the snapshot
        before go."""
        if dur_s is not None:
            if self._fresh:
                self._fresh = False
            else:
                self._durations.append(dur_s)
        if self._since.get(step) is not None and self._since[step].header.get("snapshot"):
            self._snaps = [*self._snaps, step][-2:]
            oldest = self._snaps[0]
            self._since = {s: r for s, r in self._since.items() if s > oldest}

    def lost(self, step: int) -> None:
        """A rank's snapshot of ``step`` failed (its older one is whole): a restart cannot go
        back to ``step``, so the batches after the snapshot before it stay kept."""
        self._snaps = [s for s in self._snaps if s != step]

    def kept_after(self, step: int) -> list[Remembered]:
        """Every kept step after ``step`` (the interrupted one too, if it was kept), in order."""
        return [self._since[s] for s in sorted(self._since) if s > step]

    def replay(self, restored: int, in_flight: int) -> list[Remembered]:
        """The kept steps after ``restored`` and before ``in_flight``, in order."""
        missing = [s for s in range(restored + 1, in_flight) if s not in self._since]
        if missing:
            raise RuntimeFailure(f"cannot replay steps {missing}: their batches were not kept")
        return [self._since[s] for s in range(restored + 1, in_flight)]

    def restore_point(self, held: Sequence[Sequence[int]], in_flight: int) -> int | None:
        """The newest step before ``in_flight`` whose snapshot every rank holds."""
        common = set(held[0]).intersection(*held[1:]) if held else set()
        usable = [s for s in common if s < in_flight]
        return max(usable) if usable else None

    def restarted(self) -> None:
        """A recovery started ranks anew: their first step (new communicators, kernels
        loaded, memory first touched) is not held to the steady steps' deadline, nor
        measured among them (a relaunched mesh's first step counted as hung, and restarted
        again, under load)."""
        self._fresh = True

    def deadline(self, timeout_s: float) -> float:
        """How long a step may take before the ranks that have not answered count as hung:
        ``_DEADLINE_FACTOR`` times the median of the recent steps once a few were measured,
        never under ``hang_s`` nor over ``timeout_s``; ``timeout_s`` for the first step after
        a recovery (``restarted``)."""
        if len(self._durations) < _DEADLINE_STEPS or self._fresh:
            return timeout_s
        return min(timeout_s, max(self.hang_s,
                                  _DEADLINE_FACTOR * statistics.median(self._durations)))


def smaller_meshes(mesh: Mapping[str, int], world: int, least: int = 1,
                   limit: int = 8) -> list[dict[str, int]]:
    """The meshes ``world`` surviving ranks can form in place of ``mesh``: the same axes, each
    no larger than before, ``least`` to ``world`` ranks in all; the largest first (on a tie,
    the one that keeps the outer axes larger first), at most ``limit``."""
    names = list(mesh)
    found = [dict(zip(names, sizes))
             for sizes in itertools.product(*(range(mesh[a], 0, -1) for a in names))
             if least <= math.prod(sizes) <= world]
    found.sort(key=lambda m: -math.prod(m.values()))      # stable: the tie order above
    return found[:limit]
