"""The ``Communicator`` protocol over MPI (mpi4py), for processes started by ``mpiexec``.

Same semantics and errors as ``TorchCommunicator`` (see ``_comm.py``): the checks, the
one-member no-op and the records come from ``CommBase``; this module only moves bytes.

- Buffers: every call hands mpi4py a numpy view of a contiguous CPU tensor (no Python copy);
  inputs that are already contiguous and laid out dim-0-first travel as they are. Data that is
  not reduced travels as raw bytes (``MPI.BYTE``), so every dtype works, bfloat16 included.
- Reductions use MPI's built-in ops on the native type (float32/64, int64, ...). ``bool`` travels
  as uint8 and reduces with ``MPI.MAX`` (logical or). float16 and bfloat16 have no portable MPI
  type: they are reduced in float32 and rounded once at the end (for two ranks that is exactly
  torch's own ``a + b``, which also adds halves in float32). ``avg`` is a sum, then one division.
- Groups: a sub-communicator per group, created with ``Comm.Create_group`` (collective over the
  group's members only) on first use and cached; group rank ``i`` is ``group[i]``. Pass
  ``groups=`` to create them up front, in the same order on every rank, as for torch.
- Timeouts: MPI has no per-call timeout, so every call is the non-blocking variant
  (``Iallreduce``, ``Iallgather``, ``Ireduce_scatter_block``, ``Ialltoall``, ``Ibcast``,
  ``Issend``, ``Irecv``, ``Ibarrier``) polled with ``Test`` until a deadline ``timeout_s`` away;
  then ``RuntimeFailure``. The poll spins (``sched_yield`` between tests), as MPI's blocking
  calls do: each ``Test`` is also what drives MPI's progress, and sleeping between tests made a
  pipelined 4 MiB transfer take 0.5 s instead of 1 ms. A request cannot be cancelled, so after a timeout the communicator is
  unusable (``close()`` it; the launcher stops the job). ``Comm.Create_group`` itself blocks
  without a deadline: declare groups up front when a member might never arrive.
- ``all_reduce_start`` issues the ``Iallreduce`` and returns; its ``wait()`` polls it as above
  (the deadline counts from the wait). MPI progresses a request only inside MPI calls, so on
  most MPI builds the bytes move during the wait and during other calls' polls, not while the
  rank computes in between.
- ``send`` is synchronous (``Issend``): it returns once the receiver has matched it, as the
  protocol says.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from .._errors import LoweringError, RuntimeFailure
from ._comm import CommBase, contiguous_copy, merge_leading, split_leading

logger = logging.getLogger(__name__)

__all__ = ["MPICommunicator", "import_mpi"]

MPI_FIX = "pip install 'meshplan[mpi]' (mpi4py and the mpich wheel, which brings mpiexec)"
_HALF = (torch.float16, torch.bfloat16)


def import_mpi() -> Any:
    """``mpi4py.MPI`` (initialising MPI), or one ``RuntimeFailure`` that names the fix."""
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError, OSError) as exc:   # no mpi4py, or no libmpi behind it
        raise RuntimeFailure(f"MPI is not available in this Python ({exc}); {MPI_FIX}") from exc
    return MPI


def _bytes(t: torch.Tensor) -> list[Any]:
    """A contiguous tensor as an mpi4py buffer spec of raw bytes (a view, no copy)."""
    MPI = import_mpi()
    return [t.reshape(-1).view(torch.uint8).numpy(), MPI.BYTE]


def _reduce_view(t: torch.Tensor) -> Any:
    """A numpy view of a contiguous tensor of a dtype MPI reduces natively (see module doc)."""
    return (t.view(torch.uint8) if t.dtype == torch.bool else t).reshape(-1).numpy()


class MPICommunicator(CommBase):
    """``Communicator`` over ``mpi4py`` on CPU tensors; see the module docstring.

    ``comm`` is the world (default ``MPI.COMM_WORLD``); rank and world size are taken from it.
    """

    def __init__(self, groups: Sequence[tuple[int, ...]] = (), *, timeout_s: float = 300.0,
                 comm: Any = None) -> None:
        MPI = import_mpi()
        if not timeout_s > 0:
            raise LoweringError(f"MPICommunicator: timeout_s must be positive, got {timeout_s!r}")
        self._MPI = MPI
        self.world = comm if comm is not None else MPI.COMM_WORLD
        self.world.Set_errhandler(MPI.ERRORS_RETURN)
        self.rank, self.world_size = self.world.Get_rank(), self.world.Get_size()
        self.records = []
        self.timeout_s = float(timeout_s)
        # a pipeline's one-sided sends and receives while its step runs (``_rma.Mailbox``)
        self.mailbox: Any = None
        self.device = torch.device("cpu")
        self._closed = False
        self._abandoned: list[Any] = []
        self._comms: dict[tuple[int, ...], Any] = {tuple(range(self.world_size)): self.world}
        for g in dict.fromkeys(tuple(g) for g in groups):
            if len(g) > 1 and self.rank in g:
                self._sub(self._group(g, "MPICommunicator"))

    # ---- plumbing --------------------------------------------------------------------------

    def _group(self, group: Sequence[int] | None, where: str) -> tuple[int, ...]:
        if self._closed:
            raise RuntimeFailure(f"{where}: this MPICommunicator (rank {self.rank}) is closed")
        return super()._group(group, where)

    def _sub(self, g: tuple[int, ...]) -> Any:
        """The cached sub-communicator of ``g`` (members only; collective over them)."""
        sub = self._comms.get(g)
        if sub is None:
            world_group = self.world.Get_group()
            mpi_group = world_group.Incl(list(g))            # keeps g's order: rank i = g[i]
            sub = self.world.Create_group(mpi_group, tag=7)
            mpi_group.Free()
            world_group.Free()
            sub.Set_errhandler(self._MPI.ERRORS_RETURN)
            self._comms[g] = sub
        return sub

    def _guard(self, kind, group, fn):
        if self._closed:
            raise RuntimeFailure(f"{kind.value}: this MPICommunicator (rank {self.rank}) is closed")
        try:
            return fn()
        except self._MPI.Exception as exc:
            raise RuntimeFailure(f"{kind.value} on group {group} failed on rank {self.rank} "
                                 f"(MPI): {exc.Get_error_string()}") from exc

    def wait(self, req: Any, what: str, *keep: Any, status: Any = None) -> None:
        """Poll ``req`` with ``Test`` until it completes or ``timeout_s`` passes. ``keep``: the
        buffers ``req`` reads or writes; after a timeout they are kept alive for good, since
        MPI may still write into them when a late peer arrives."""
        if req.Test(status):
            return
        deadline = time.monotonic() + self.timeout_s
        while not req.Test(status):
            now = time.monotonic()
            if now >= deadline:
                self._closed = True         # an MPI request cannot be cancelled: unusable now
                self._abandoned.append((req, keep))
                raise RuntimeFailure(
                    f"{what} timed out on rank {self.rank} after {self.timeout_s:g} s (MPI): a "
                    "peer never joined, or joined another call. The request cannot be "
                    "cancelled, so this MPICommunicator is closed; stop the job")
            os.sched_yield()        # let a rank sharing this core run; no sleep: see module doc

    # ---- the transport -----------------------------------------------------------------------

    def _op(self, op: str, dtype: torch.dtype) -> Any:
        return self._MPI.MAX if op == "max" or dtype == torch.bool else self._MPI.SUM

    def _all_reduce(self, t, g, op):
        return self._all_reduce_start(t, g, op)()

    def _all_reduce_start(self, t, g, op, donate=False):
        """Issues the ``Iallreduce``; the returned function polls it (``wait``) and finishes."""
        if t.dtype in _HALF:
            wide = t.to(torch.float32, memory_format=torch.contiguous_format)
        elif donate and t.is_contiguous():
            wide = t
        else:
            wide = contiguous_copy(t)
        dtype = t.dtype
        req = self._sub(g).Iallreduce(self._MPI.IN_PLACE, _reduce_view(wide), self._op(op, dtype))

        def finish() -> torch.Tensor:
            self.wait(req, f"all_reduce on group {g}", wide)
            if op == "avg":
                wide.div_(len(g))
            return wide.to(dtype) if dtype in _HALF else wide
        return finish

    def _all_gather(self, t, g, dim):
        n, src = len(g), t.contiguous()
        flat = torch.empty((n * t.shape[0], *t.shape[1:]), dtype=t.dtype)
        self.wait(self._sub(g).Iallgather(_bytes(src), _bytes(flat)), f"all_gather on group {g}",
                  src, flat)
        return merge_leading(flat.view(n, *t.shape), dim)

    def _reduce_scatter(self, t, g, dim, op):
        n = len(g)
        stacked = split_leading(t, dim, n)
        if t.dtype in _HALF:
            stacked = stacked.to(torch.float32)
        out = torch.empty(stacked.shape[1:], dtype=stacked.dtype)
        self.wait(self._sub(g).Ireduce_scatter_block(_reduce_view(stacked), _reduce_view(out),
                                                     self._op(op, t.dtype)),
                  f"reduce_scatter on group {g}", stacked, out)
        if op == "avg":
            out.div_(n)
        return out.to(t.dtype) if t.dtype in _HALF else out

    def _all_to_all(self, t, g, split_dim, cat_dim):
        stacked = split_leading(t, split_dim, len(g))
        received = torch.empty_like(stacked)
        self.wait(self._sub(g).Ialltoall(_bytes(stacked), _bytes(received)),
                  f"all_to_all on group {g}", stacked, received)
        return merge_leading(received, cat_dim)

    def _broadcast(self, t, src, g):
        out = contiguous_copy(t) if src == self.rank else torch.empty(t.shape, dtype=t.dtype)
        self.wait(self._sub(g).Ibcast(_bytes(out), root=g.index(src)), f"broadcast on group {g}",
                  out)
        return out

    def _send(self, t, dst, tag):
        self._send_start(t, dst, tag)()

    def _send_start(self, t, dst, tag):
        if self.mailbox is not None and self.mailbox.carries_send(dst, tag):
            self.mailbox.send(t, dst, tag)         # one-sided: in dst's memory already
            return lambda: None
        src = t.contiguous()
        req = self.world.Issend(_bytes(src), dst, tag=tag)
        return lambda: self.wait(req, f"send to rank {dst}", src)

    def _recv(self, shape, dtype, src, tag):
        if self.mailbox is not None and self.mailbox.carries_recv(src, tag):
            return self.mailbox.recv(shape, dtype, src, tag)
        out = torch.empty(shape, dtype=dtype)
        status = self._MPI.Status()
        self.wait(self.world.Irecv(_bytes(out), src, tag=tag), f"recv from rank {src}", out,
                  status=status)
        got = status.Get_count(self._MPI.BYTE)
        if got != out.nbytes:
            raise LoweringError(f"recv: expected a {shape} {dtype} tensor ({out.nbytes} bytes) "
                                f"from rank {src}, which sent {got} bytes")
        return out

    def _barrier(self, g):
        self.wait(self._sub(g).Ibarrier(), f"barrier on group {g}")

    def close(self) -> None:
        """Free the sub-communicators (not the world); idempotent. MPI itself is finalised by
        mpi4py at interpreter exit."""
        if getattr(self, "_freed", False):
            return
        self._closed = self._freed = True
        for sub in self._comms.values():
            if sub is not self.world:
                try:
                    sub.Free()
                except self._MPI.Exception:
                    pass
        self._comms.clear()

    def __repr__(self) -> str:
        return (f"MPICommunicator(rank={self.rank}, world_size={self.world_size}, "
                f"groups={[g for g in self._comms if len(g) < self.world_size]})")
