"""In-memory snapshots of every rank's state, from which a mesh restarts after a rank failure.

``distribute(fault_tolerance=True)``: the controller creates one memory file per rank
(``memfd_create``: RAM, no name in any file system) and keeps it open for the run; each rank
opens its own through ``/proc/<controller pid>/fd/<fd>`` and, after every ``snapshot_every``-th
step, copies its state pieces into it. The file outlives the rank's process (the controller
holds it), so the rank that replaces a dead one reads its predecessor's pieces back; and it
dies with the controller, even by ``kill -9``, so nothing is left behind in ``/dev/shm`` or
anywhere else.

A file holds two slots. A snapshot goes into the older one: its step is marked invalid
(``-1``), the pieces are copied, then the step is written. A rank killed in the middle of a
copy leaves that slot invalid and the other (one snapshot older) intact, so every rank always
holds a snapshot of a step every other rank holds too; the controller restores the newest such
step and replays the steps after it (it keeps their batches, ``_distributed``).

Layout: a header (``MAGIC``, the index's length, the two slots' steps, the index as JSON: every
piece's name, dtype, shape and offset inside a slot), padded to 4 KiB, then the two slots. The
index is written once, by the first rank that uses the file; a replacement checks it against
the pieces its plan says it holds (``check``).

Same host only: the ranks must see the controller's ``/proc``, which the local launcher gives
(and the mpi launcher when every rank runs on the controller's host). Ranks on other hosts
need the peer copies of issue 22's point 2, not built yet.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import threading
from collections.abc import Callable, Mapping, Sequence

import torch

from .._errors import RuntimeFailure

__all__ = ["SnapshotFiles", "Snapshot", "read_mesh"]

MAGIC = b"MPSNAP01"
_HEAD = struct.Struct("<8sQqq")          # magic, index length, step of slot 0, step of slot 1
_PAGE = 4096
_ALIGN = 64
INVALID = -1


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class SnapshotFiles:
    """The controller's side: one memory file per rank, open for as long as the run."""

    def __init__(self, n: int) -> None:
        if not hasattr(os, "memfd_create"):
            raise RuntimeFailure("fault_tolerance=True keeps each rank's snapshots in memory "
                                 "files (memfd_create), which this platform lacks (Linux only)")
        self.fds = [os.memfd_create(f"meshplan-snapshot-r{r}", os.MFD_CLOEXEC) for r in range(n)]

    def path(self, rank: int) -> str:
        """Where rank ``rank`` opens its file (any process of this host, as this user)."""
        return f"/proc/{os.getpid()}/fd/{self.fds[rank]}"

    def nbytes(self) -> int:
        return sum(os.fstat(fd).st_size for fd in self.fds)

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []


def _layout(index: list[dict]) -> tuple[int, int]:
    """(header bytes, slot bytes) of a file with this index."""
    text = json.dumps(index, separators=(",", ":")).encode()
    end = max((e["offset"] + -(-e["nbytes"] // _ALIGN) * _ALIGN for e in index), default=0)
    return -(-(_HEAD.size + len(text)) // _PAGE) * _PAGE, max(end, _ALIGN)


def _open(path: str, rank: int, size: int) -> tuple[mmap.mmap, int]:
    """Map the file at ``path``, sized to ``size`` when it is new; returns it and its old size."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise RuntimeFailure(f"rank {rank}: cannot open the snapshot file {path} ({exc}); the "
                             "controller must run on this host") from exc
    try:
        have = os.fstat(fd).st_size
        if have == 0 and not size:
            raise RuntimeFailure(f"rank {rank}'s snapshot file holds no snapshot")
        if have == 0:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, max(have, size)), have
    finally:
        os.close(fd)


class Snapshot:
    """A rank's side: its file, mapped. ``pieces``: name -> (shape, dtype) of the state pieces
    it snapshots (the ranks share replicated pieces out: ``_distributed._snapshot_owners``);
    a fresh file is laid out for them, a used one must hold exactly them. ``existing`` opens
    another rank's file to read pieces from it."""

    def __init__(self, path: str, pieces: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                 *, rank: int) -> None:
        self.rank = rank
        index, offset = [], 0
        for name in sorted(pieces):
            shape, dtype = pieces[name]
            nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
            index.append({"name": name, "dtype": _dtype_name(dtype), "shape": list(shape),
                          "offset": offset, "nbytes": nbytes})
            offset += -(-nbytes // _ALIGN) * _ALIGN
        self.index = index
        self.header_bytes, self.slot_bytes = _layout(index)
        self._copying: threading.Thread | None = None
        self._failed: tuple[int, BaseException] | None = None
        # (step, why) of copies that failed since the owner last looked (``settle``): their
        # slot is invalid, the snapshot before is kept, and the run goes on
        self.lost: list[tuple[int, str]] = []
        text = json.dumps(index, separators=(",", ":")).encode()
        self._map, have = _open(path, rank, self.header_bytes + 2 * self.slot_bytes)
        if have == 0:
            self._map[:_HEAD.size + len(text)] = _HEAD.pack(MAGIC, len(text), INVALID,
                                                            INVALID) + text
        else:
            self.check(text)

    @classmethod
    def existing(cls, path: str, *, rank: int) -> Snapshot:
        """Rank ``rank``'s file as its owner laid it out, to read from (``read(mine=False)``)."""
        self = cls.__new__(cls)
        self.rank, self._copying, self._failed, self.lost = rank, None, None, []
        self._map, have = _open(path, rank, 0)
        magic, length, *_ = _HEAD.unpack_from(self._map, 0) if have >= _HEAD.size else (
            b"", 0)
        if magic != MAGIC:
            raise RuntimeFailure(f"rank {rank}'s snapshot file holds no snapshot")
        self.index = json.loads(bytes(self._map[_HEAD.size:_HEAD.size + length]))
        self.header_bytes, self.slot_bytes = _layout(self.index)
        return self

    def check(self, text: bytes) -> None:
        magic, length, *_ = _HEAD.unpack_from(self._map, 0)
        held = bytes(self._map[_HEAD.size:_HEAD.size + length])
        if magic != MAGIC or held != text:
            raise RuntimeFailure(
                f"rank {self.rank}: its snapshot file holds other pieces than its plan gives it "
                f"({'not a snapshot' if magic != MAGIC else 'another layout'}); the run cannot "
                "restore from it")

    def steps(self) -> list[int]:
        """The steps whose state the valid slots hold."""
        self.settle()
        return [s for s in _HEAD.unpack_from(self._map, 0)[2:] if s != INVALID]

    def _set(self, slot: int, step: int) -> None:
        struct.pack_into("<q", self._map, 16 + 8 * slot, step)

    def _views(self, slot: int) -> dict[str, torch.Tensor]:
        base = self.header_bytes + slot * self.slot_bytes
        out = {}
        for e in self.index:
            dtype = getattr(torch, e["dtype"])
            raw = torch.frombuffer(self._map, dtype=torch.uint8, count=e["nbytes"],
                                   offset=base + e["offset"]) if e["nbytes"] else \
                torch.empty(0, dtype=torch.uint8)
            out[e["name"]] = raw.view(dtype).view(e["shape"])
        return out

    def write(self, step: int, state: Mapping[str, torch.Tensor]) -> None:
        """Copy ``state`` (every piece of the index) into the older slot, as ``step``."""
        steps = _HEAD.unpack_from(self._map, 0)[2:]
        slot = 0 if steps[0] == INVALID else 1 if steps[1] == INVALID else \
            int(steps[1] < steps[0])
        self._set(slot, INVALID)           # a copy cut short leaves this slot invalid
        for name, view in self._views(slot).items():
            view.copy_(state[name])
        self._set(slot, step)

    def reset(self, step: int, state: Mapping[str, torch.Tensor]) -> None:
        """The state changed outside a step (a state dict or checkpoint loaded): it is the
        only snapshot now, as ``step``; the older ones are of another timeline."""
        self.settle()
        self._set(0, INVALID)
        self._set(1, INVALID)
        self.write(step, state)

    def write_behind(self, step: int, state: Mapping[str, torch.Tensor]) -> None:
        """``write`` in a thread, so the copy overlaps what comes next (the reply, the
        controller's next request). The caller must ``settle()`` before it changes any tensor
        of ``state`` in place or reads the snapshots."""
        self.settle()
        held = dict(state)

        def copy() -> None:
            try:
                self.write(step, held)
            except BaseException as exc:  # noqa: BLE001 - kept in lost by settle()
                self._failed = (step, exc)
        self._copying = threading.Thread(target=copy, name="meshplan-snapshot", daemon=True)
        self._copying.start()

    def settle(self) -> None:
        """Wait for a ``write_behind`` in flight. A copy that failed (out of memory, say) is
        not an error of the step: its slot stays invalid, the snapshot before it is kept, and
        ``lost`` says so (the worker tells the controller, which then counts on the older
        snapshot and keeps the batches since)."""
        if self._copying is not None:
            self._copying.join()
            self._copying = None
        failed, self._failed = self._failed, None
        if failed is not None:
            step, exc = failed
            self.lost.append((step, f"{type(exc).__name__}: {exc}"))

    def read(self, step: int, names: Sequence[str] | None = None, *,
             mine: bool = True) -> dict[str, torch.Tensor]:
        """The pieces of ``step`` (copies; only ``names`` when given). Reading its own file
        (``mine``), a rank drops any newer slot: the run goes on from ``step``, so what came
        after it is another timeline's."""
        self.settle()
        steps = _HEAD.unpack_from(self._map, 0)[2:]
        if step not in steps:
            raise RuntimeFailure(f"rank {self.rank}: no snapshot of step {step} (it holds "
                                 f"{[s for s in steps if s != INVALID] or 'none'})")
        slot = steps.index(step)
        if mine:
            for other, s in enumerate(steps):
                if other != slot and s > step:
                    self._set(other, INVALID)
        views = self._views(slot)
        missing = [n for n in names or () if n not in views]
        if missing:
            raise RuntimeFailure(f"rank {self.rank}'s snapshot has no piece {missing[0]!r}")
        return {name: views[name].clone() for name in (views if names is None else names)}

    def close(self) -> None:
        self.settle()
        try:
            self._map.close()
        except BufferError:           # a view still exported: the mapping goes with the process
            pass


def read_mesh(paths: Sequence[str], owners: Mapping[tuple[int, str], int],
              choose: Callable[[list[list[int]]], int | None]
              ) -> tuple[int, list[dict[str, torch.Tensor]]] | None:
    """The controller reads a whole mesh's snapshot itself (``distribute(elastic=)``: the
    ranks are gone, their files are not): the step ``choose`` picks from the steps each file
    holding pieces has (``Recovery.restore_point``), and every rank's pieces of it
    (``owners``: (rank, name) -> the rank whose file holds that piece). None when no step is
    chosen."""
    holders = sorted(set(owners.values()))
    files: dict[int, Snapshot] = {}
    try:
        for r in holders:
            try:
                files[r] = Snapshot.existing(paths[r], rank=r)
            except RuntimeFailure:              # a file no rank ever wrote
                return None
        step = choose([f.steps() for f in files.values()])
        if step is None:
            return None
        wanted: dict[int, set[str]] = {}
        for (_, name), owner in owners.items():
            wanted.setdefault(owner, set()).add(name)
        got = {r: files[r].read(step, sorted(names), mine=False) for r, names in wanted.items()}
        n = 1 + max(rank for rank, _ in owners)
        held: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
        for (rank, name), owner in owners.items():
            held[rank][name] = got[owner][name]
        return step, held
    finally:
        for f in files.values():
            f.close()
