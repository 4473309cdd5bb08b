"""One-sided transfers (MPI RMA): read or write another rank's tensor without it posting a receive.

``Transfer(comm)`` works over an ``MPICommunicator`` (all ranks) or one of its groups::

    with Transfer(comm) as tr:
        tr.expose("w", local_shard)          # collective: every member, same names, same order
        tr.sync()                            # optional; exposure itself is collective
        full = [tr.get(r, "w") for r in range(comm.world_size)]   # no call on rank r
        tr.put(1, "w", patch, offset=8)      # write into rank 1's tensor, in place
        tr.sync()                            # everyone: puts done, visible to their targets

- ``expose`` puts a tensor's own memory in an MPI window (``MPI.Win.Create``; a contiguous CPU
  tensor is exposed in place, anything else as a contiguous copy, which ``expose`` returns).
  Shape and dtype of every member's tensor are exchanged once, at exposure (JSON through
  ``Allgatherv``), so a ``get`` needs nothing from its target: it knows what to read.
- ``get``/``put`` are passive-target: ``Win.Lock(target, SHARED)``, ``Rget``/``Rput``
  (polled against the communicator's ``timeout_s``), ``Win.Unlock(target)``, after which the
  data is in our buffer (get) or in the target's memory (put). Several ranks may put to
  DISJOINT parts of one tensor concurrently; overlapping puts without ordering are undefined,
  as in MPI. ``offset``/``numel`` count elements of the flattened tensor.
- ``sync()`` is a barrier of the group plus ``Win.Sync`` on every window: after it every member
  sees the puts that completed before it, and its local writes are visible to later gets.
- ``close()`` (or leaving the ``with`` block) frees every window (``Win.Free``, collective, in
  exposure order); ``unexpose(name)`` frees one. A window must not outlive its tensor: the
  ``Transfer`` holds a reference until it is freed.

Progress: "one-sided" means the target posts no matching call, not that it may be anywhere.
With the mpich wheel's defaults a passive-target get or put completes only while the target is
inside the MPI library (any call: a collective, a polled ``Test``, ``Win.Free``); a target busy
in Python or torch for 0.5 s delayed a 1 KiB get by 0.5 s here. ``MPIR_CVAR_ASYNC_PROGRESS=1``
in the workers' environment gives every rank a progress thread (then that get took 30 us), at
the price of a core each spinning: not the default on a 2-core host. On a cluster with an RDMA
network the NIC serves the reads and writes. Used by the runtime on the MPI launcher (see
``runtime/_handlers.py``): ``get_state`` (rank 0 reads every rank's state pieces one-sidedly)
and ``share_state`` (a rank holding a replica of a state piece reads it from the one rank the
controller sent it to); and, with ``MESHPLAN_STAGE_TRANSFERS=rma``, by pipeline stages for
their activations and gradients (``Mailbox``, below).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self

import numpy as np
import torch

from .._errors import LoweringError, RuntimeFailure
from ._comm import check_group
from ._mpi import MPICommunicator

__all__ = ["Mailbox", "Transfer", "TransferRecord"]


@dataclass(frozen=True, slots=True)
class TransferRecord:
    """One get or put: ``rank`` is the target (global rank)."""

    op: str
    rank: int
    name: str
    nbytes: int
    start_s: float
    dur_s: float


@dataclass(frozen=True, slots=True)
class _Window:
    win: Any
    tensor: torch.Tensor                       # keeps the exposed memory alive
    shapes: tuple[tuple[int, ...], ...]        # per group member
    dtypes: tuple[torch.dtype, ...]


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise LoweringError(f"Transfer: unknown dtype {name!r} from a peer")
    return dt


class Transfer:
    """One-sided gets and puts between the members of ``group`` (default: every rank)."""

    def __init__(self, comm: MPICommunicator, group: tuple[int, ...] | None = None) -> None:
        if not isinstance(comm, MPICommunicator):
            raise LoweringError(f"Transfer needs an MPICommunicator, got {type(comm).__name__}: "
                                "one-sided transfers are MPI RMA windows")
        self.comm, self._MPI = comm, comm._MPI
        self.group = check_group(group, comm.rank, comm.world_size, "Transfer")
        self._sub = comm._sub(self.group) if len(self.group) > 1 else comm._MPI.COMM_SELF
        self._windows: dict[str, _Window] = {}
        self.records: list[TransferRecord] = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._windows)

    def expose(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Collective over the group: put ``tensor`` (this member's) in window ``name``.
        Returns the exposed tensor (``tensor`` itself when it is a contiguous CPU tensor)."""
        if name in self._windows:
            raise LoweringError(f"Transfer.expose: {name!r} is already exposed; unexpose it first")
        t = tensor.detach()
        if t.device.type != "cpu" or not t.is_contiguous():
            t = t.to("cpu").contiguous()
        meta = json.dumps([list(t.shape), str(t.dtype).removeprefix("torch."), name]).encode()
        metas = self._allgather_bytes(meta)
        names = {m[2] for m in metas}
        if names != {name}:
            raise LoweringError(f"Transfer.expose: the members of {self.group} exposed different "
                                f"names at once: {sorted(names)}; expose in the same order")
        memory = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
        win = self._MPI.Win.Create(memory, 1, comm=self._sub)
        self._windows[name] = _Window(win, t, tuple(tuple(m[0]) for m in metas),
                                      tuple(_dtype(m[1]) for m in metas))
        return t

    def shape(self, rank: int, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of ``rank``'s tensor in window ``name``."""
        w, i = self._window(name, "shape"), self._index(rank, "shape")
        return w.shapes[i], w.dtypes[i]

    def get(self, rank: int, name: str, *, offset: int = 0, numel: int | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of ``rank``'s exposed tensor (or ``numel`` elements of it from ``offset``, as a
        flat tensor); ``rank`` does nothing. ``out``: a contiguous CPU tensor of the result's
        dtype and number of elements to read into (saves allocating and faulting in pages)."""
        w, i = self._window(name, "get"), self._index(rank, "get")
        shape, dtype = w.shapes[i], w.dtypes[i]
        total = torch.Size(shape).numel()
        count = total - offset if numel is None else numel
        self._check_range("get", rank, name, offset, count, total)
        whole = offset == 0 and count == total and numel is None
        if out is None:
            out = torch.empty(shape if whole else (count,), dtype=dtype)
        elif (out.dtype != dtype or out.numel() != count or out.device.type != "cpu"
              or not out.is_contiguous()):
            raise LoweringError(f"Transfer.get: out= must be a contiguous CPU {dtype} tensor of "
                                f"{count} elements, got {out.dtype} {tuple(out.shape)}")
        self._rma("get", w, rank, i, name, out, offset * dtype.itemsize)
        return out

    def put(self, rank: int, name: str, tensor: torch.Tensor, offset: int = 0) -> None:
        """Write ``tensor`` (flattened) into ``rank``'s exposed tensor from element ``offset``;
        ``rank`` does nothing. Returns once the data is in the target's memory."""
        w, i = self._window(name, "put"), self._index(rank, "put")
        shape, dtype = w.shapes[i], w.dtypes[i]
        if tensor.dtype != dtype:
            raise LoweringError(f"Transfer.put: {name!r} on rank {rank} holds {dtype}, got a "
                                f"{tensor.dtype} tensor; convert it first")
        self._check_range("put", rank, name, offset, tensor.numel(), torch.Size(shape).numel())
        src = tensor.detach().to("cpu").contiguous()
        self._rma("put", w, rank, i, name, src, offset * dtype.itemsize)

    def local(self, name: str) -> torch.Tensor:
        """This member's exposed tensor ``name``, with every put that completed on it before
        visible (a lock epoch on its own window: ``Win.Sync`` inside ``Lock``/``Unlock``)."""
        w = self._window(name, "local")
        me = self._index(self.comm.rank, "local")
        w.win.Lock(me, self._MPI.LOCK_SHARED)
        w.win.Sync()
        w.win.Unlock(me)
        return w.tensor

    def sync(self) -> None:
        """Collective over the group: every put that completed before is visible everywhere."""
        self.comm.barrier(self.group) if len(self.group) > 1 else None
        for w in self._windows.values():
            w.win.Lock_all()
            w.win.Sync()
            w.win.Unlock_all()

    def unexpose(self, name: str) -> None:
        """Collective over the group: free window ``name``."""
        self._window(name, "unexpose").win.Free()
        del self._windows[name]

    def close(self) -> None:
        """Collective over the group: free every window, in exposure order. Idempotent."""
        for name in list(self._windows):
            self.unexpose(name)

    # ---- internals --------------------------------------------------------------------------

    def _window(self, name: str, where: str) -> _Window:
        w = self._windows.get(name)
        if w is None:
            raise LoweringError(f"Transfer.{where}: nothing is exposed as {name!r} (exposed: "
                                f"{sorted(self._windows)}); call expose on every member first")
        return w

    def _index(self, rank: int, where: str) -> int:
        if rank not in self.group:
            raise LoweringError(f"Transfer.{where}: rank {rank!r} is not in the group "
                                f"{self.group}")
        return self.group.index(rank)

    @staticmethod
    def _check_range(op: str, rank: int, name: str, offset: int, count: int, total: int) -> None:
        if not (0 <= offset and 0 <= count and offset + count <= total):
            raise LoweringError(f"Transfer.{op}: elements [{offset}, {offset + count}) are "
                                f"outside {name!r} on rank {rank}, which has {total} elements")

    def _rma(self, op: str, w: _Window, rank: int, i: int, name: str, buf: torch.Tensor,
             disp: int) -> None:
        MPI, nbytes = self._MPI, buf.nbytes
        start, t0 = time.time(), time.perf_counter()
        if nbytes:
            spec = [buf.reshape(-1).view(torch.uint8).numpy(), MPI.BYTE]
            target = (disp, nbytes, MPI.BYTE)
            try:
                w.win.Lock(i, MPI.LOCK_SHARED)
                req = (w.win.Rget if op == "get" else w.win.Rput)(spec, i, target)
                self.comm.wait(req, f"Transfer.{op} of {name!r} on rank {rank}", buf)
                w.win.Unlock(i)
            except MPI.Exception as exc:
                raise RuntimeFailure(f"Transfer.{op} of {name!r} on rank {rank} failed on rank "
                                     f"{self.comm.rank} (MPI): {exc.Get_error_string()}") from exc
        self.records.append(TransferRecord(op, rank, name, nbytes, start,
                                           time.perf_counter() - t0))

    def _allgather_bytes(self, data: bytes) -> list[Any]:
        """Every member's ``data`` (JSON), in group order, without pickle."""
        MPI = self._MPI
        n = len(self.group)
        sizes = np.zeros(n, dtype=np.int64)
        mine = np.array([len(data)], dtype=np.int64)
        self.comm.wait(self._sub.Iallgather(mine, sizes), "Transfer.expose", mine, sizes)
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        out = np.empty(int(sizes.sum()), dtype=np.uint8)
        send = np.frombuffer(data, dtype=np.uint8)
        self.comm.wait(self._sub.Iallgatherv(
            [send, MPI.BYTE], [out, (sizes.tolist(), displs.tolist()), MPI.BYTE]),
            "Transfer.expose", send, out, data)
        return [json.loads(out[int(d):int(d) + int(s)].tobytes())
                for d, s in zip(displs, sizes)]


_ALIGN = 64                               # each message's slot starts on a cache line


class Mailbox:
    """A pipeline's sends and receives as one-sided puts (``MESHPLAN_STAGE_TRANSFERS=rma``
    under ``launcher="mpi"``; ``backends/_pipeline_run.py``).

    A stage's transfers of one step are known before it runs: each receive's source, tag and
    size. So every rank exposes an inbox (one slot of bytes per receive of a step, the
    ``k``-th receive from ``src`` with ``tag`` in slot ``(src, tag, k)``) and a flag per slot,
    and tells every sender where its messages go (JSON, once). A send is two puts into the
    receiver's memory: the bytes into their slot, then, once they are there (the first put's
    epoch closed), the step's number into the slot's flag. A receive waits for its flag to
    read this step's number, polling its own window (so MPI progresses the puts meanwhile)
    until the communicator's ``timeout_s``, and copies the bytes out. The receiver posts
    nothing. The ``k``-th send to a peer with a tag meets that peer's ``k``-th receive from
    this rank with it, as MPI's two-sided matching does (the lowering checked the stages'
    orders against it).

    A slot is written again only in the next step, and every step ends in ``end()``, a
    barrier, so a slot is read before it is overwritten. Construction is collective over
    every rank: ``receives`` is this rank's, ``(src, tag, nbytes)`` in the order it takes
    them within a step.
    """

    def __init__(self, comm: MPICommunicator,
                 receives: Sequence[tuple[int, int, int]]) -> None:
        self.comm = comm
        self.transfer = Transfer(comm)
        self.step = 0
        slots: dict[tuple[int, int, int], tuple[int, int, int]] = {}
        counts: dict[tuple[int, int], int] = {}
        offset = 0
        for src, tag, nbytes in receives:
            k = counts.get((src, tag), 0)
            counts[(src, tag)] = k + 1
            slots[(src, tag, k)] = (offset, int(nbytes), len(slots))
            offset += -(-int(nbytes) // _ALIGN) * _ALIGN
        self.inbox = self.transfer.expose("inbox", torch.zeros(max(offset, 1), dtype=torch.uint8))
        self.flags = self.transfer.expose("flags", torch.zeros(max(len(slots), 1),
                                                               dtype=torch.int64))
        tables = self.transfer._allgather_bytes(json.dumps(
            [[src, tag, k, *slot] for (src, tag, k), slot in slots.items()]).encode())
        self.receives = slots
        self.sends = {(dst, tag, k): (o, n, f) for dst, table in enumerate(tables)
                      for src, tag, k, o, n, f in table if src == comm.rank}
        self._sent: dict[tuple[int, int], int] = {}
        self._taken: dict[tuple[int, int], int] = {}

    def end(self) -> None:
        """The step's end, collective over every rank: a barrier. No rank starts the next
        step (whose puts reuse the slots) before every rank has taken this one's, and none
        leaves while a put to it is pending: without RDMA hardware a put completes only while
        its target is inside MPI."""
        self.comm.barrier()

    def begin(self) -> None:
        """A new step: its messages' numbering starts again."""
        self.step += 1
        self._sent.clear()
        self._taken.clear()
        self.transfer.records.clear()          # (the communicator records each send/recv)

    def carries_send(self, dst: int, tag: int) -> bool:
        return (dst, tag, self._sent.get((dst, tag), 0)) in self.sends

    def carries_recv(self, src: int, tag: int) -> bool:
        return (src, tag, self._taken.get((src, tag), 0)) in self.receives

    def send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        """Put ``t`` in ``dst``'s slot for it, then raise its flag. Returns once both are in
        ``dst``'s memory."""
        k = self._sent.get((dst, tag), 0)
        offset, nbytes, flag = self.sends[(dst, tag, k)]
        data = t.detach().to("cpu").contiguous().reshape(-1)
        if data.nbytes != nbytes:
            raise LoweringError(f"send to rank {dst} (tag {tag}, message {k} of the step): rank "
                                f"{dst} takes {nbytes} bytes there, this rank sends "
                                f"{data.nbytes}: the stages' programs disagree (a meshplan "
                                "bug: please report it with the step)")
        self._sent[(dst, tag)] = k + 1
        if nbytes:
            self.transfer.put(dst, "inbox", data.view(torch.uint8), offset=offset)
        self.transfer.put(dst, "flags", torch.tensor([self.step], dtype=torch.int64),
                          offset=flag)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int,
             tag: int) -> torch.Tensor:
        """The next tensor ``src`` puts here with ``tag`` this step, once its flag is up."""
        k = self._taken.get((src, tag), 0)
        offset, nbytes, flag = self.receives[(src, tag, k)]
        want = torch.Size(shape).numel() * dtype.itemsize
        if want != nbytes:
            raise LoweringError(f"recv from rank {src} (tag {tag}): a {tuple(shape)} {dtype} "
                                f"tensor is {want} bytes, its slot {nbytes}")
        self._taken[(src, tag)] = k + 1
        deadline = time.monotonic() + self.comm.timeout_s
        while (got := int(self.transfer.local("flags")[flag])) != self.step:
            if got > self.step:
                raise LoweringError(
                    f"recv from rank {src} (tag {tag}): its put of step {got} came before "
                    f"this rank took step {self.step}'s; every rank must call Mailbox.end() "
                    "before the next step")
            if time.monotonic() >= deadline:
                raise RuntimeFailure(
                    f"recv from rank {src} (tag {tag}, one-sided) timed out on rank "
                    f"{self.comm.rank} after {self.comm.timeout_s:g} s (MPI): rank {src} never "
                    "put it; stop the job")
            os.sched_yield()
        out = self.inbox[offset:offset + nbytes].clone()
        return out.view(dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)

    def close(self) -> None:
        """Collective over every rank: free the windows."""
        self.transfer.close()
