"""Collectives through shared memory for ranks on one host (the gloo communicator's fast path).

Gloo moves every byte through TCP on loopback, even between processes of one machine: an
all-reduce of the benchmark GPT's 14 MiB of gradients waited 22 ms on 2 ranks and 48 ms on 4
(benchmarks/README.md). NCCL has its SHM/P2P transports and MPI its shared-memory channel for
the same reason. ``ShmGroup`` is that channel for the CPU ranks of one group on one host:

- one file in ``/dev/shm`` per group, mapped by every member and unlinked as soon as all have
  mapped it (nothing outlives the processes, ``kill -9`` included);
- two process-shared POSIX semaphores per member (glibc/musl ``sem_post`` /
  ``sem_timedwait`` through ctypes), which block instead of spinning, so 4 ranks on 2 cores do
  not steal each other's time, and which order memory on every architecture;
- ``2 x members`` slots of ``capacity`` bytes: each member copies its tensor (or a chunk of
  ``capacity`` bytes) into its slot, the members wait for each other, member ``i`` reduces
  segment ``i`` of every slot into its own slot, the members wait again, and each copies the
  ``n`` reduced segments out. Two barriers an all-reduce, every element reduced once, so all
  members get bit-identical results in a deterministic order (own slot first, then the others
  in group order);
- all-gather, reduce-scatter and all-to-all take one barrier per slot-sized chunk: copy in,
  wait, then copy every slot out (all-gather), reduce this member's piece of every slot
  (reduce-scatter) or copy it out (all-to-all);
- one operation at a time per group: starting one while another is in flight finishes the
  earlier one first (same order on every member, as the Communicator protocol requires).
  Consecutive operations alternate between two halves of the slots, so a member copying the
  next input in never overwrites a slot a slower member still reads: it starts operation
  ``k + 2`` only after a barrier of ``k + 1``, which every member reaches after finishing
  ``k``.

Why two semaphores per member: member ``j`` posts ``s[i][p % 2]`` for every other ``i`` at
barrier ``p`` and then takes ``s[j][p % 2]`` ``n - 1`` times. A post for barrier ``p + 2`` can
only come after its poster took every post of ``p + 1``, which each member sends after taking
all of ``p``: posts of two barriers never mix on one semaphore.

A member that never arrives makes the others raise ``RuntimeFailure`` after ``timeout_s``; one
that died (its process gone or a zombie: each member writes its pid in the file) or gave up
(``abort``: its step failed elsewhere) makes them raise within ``_SLICE_S`` of it, so a rank
that fails never leaves its peers waiting on it (``distribute(fault_tolerance=True)`` replaces
it and the others go on).
Linux only (``posix_fallocate`` reserves the file up front, so a full ``/dev/shm`` is an error
at setup, not a ``SIGBUS`` in the middle of a step).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import sys
import time
from collections.abc import Callable

import torch

from .._errors import RuntimeFailure

DEFAULT_CAPACITY = 4 << 20          # bytes per slot (one chunk of one member's input)
SHM_DIR = "/dev/shm"
_ALIGN = 64
_SEM_STRIDE = 64                    # >= sizeof(sem_t) (32 on 64-bit Linux), one cache line
TOKEN_BYTES = 16                    # random bytes at offset 0: proof a member mapped our file
# sem_timedwait slices: signals are handled, and the members' pids checked, between them. A
# member that died is seen within one slice (a fault-tolerance replacement waits for it)
_SLICE_S = 0.02


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    lib = ctypes.CDLL(None, use_errno=True)      # the process's libc (and libpthread)
    for name in ("sem_init", "sem_post", "sem_timedwait", "sem_destroy"):
        if not hasattr(lib, name):
            return None
    lib.sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
    lib.sem_post.argtypes = [ctypes.c_void_p]
    lib.sem_timedwait.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Timespec)]
    return lib


_LIB = _libc()


def available() -> bool:
    """Whether this platform has what ``ShmGroup`` needs (Linux, process-shared semaphores,
    a writable ``/dev/shm``)."""
    return _LIB is not None and os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def region_bytes(members: int, capacity: int) -> int:
    """Size of a group's file: the semaphores, then ``2 x members`` slots."""
    return _data_offset(members) + 2 * members * capacity


def _control_offset(members: int) -> int:
    """Where the abort word (8 bytes) lies, then each member's pid and pid namespace."""
    return TOKEN_BYTES + 2 * members * _SEM_STRIDE


def _data_offset(members: int) -> int:
    head = _control_offset(members) + 8 + 16 * members
    return -(-head // _ALIGN) * _ALIGN


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


_PIDNS = _pid_namespace()


def _gone(pid: int) -> bool:
    """Whether process ``pid`` (of this pid namespace) has ended: no entry, or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rfind(b")") + 2:][:1] in (b"Z", b"X")


def file_tag(rank: int) -> str:
    """``<run id>-r<rank>``: the launchers' run id (``MESHPLAN_RUN_ID``) names the files, so
    the controller removes what a rank killed between creating and unlinking one left
    (``remove_run_files``)."""
    run = os.environ.get("MESHPLAN_RUN_ID", "")
    return f"{run}-r{rank}" if run.isalnum() else f"r{rank}"


def remove_run_files(run_id: str) -> list[str]:
    """Remove the group files of run ``run_id`` still in ``/dev/shm``; returns their paths."""
    if not run_id.isalnum():
        return []
    gone = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    for name in names:
        if name.startswith(f"meshplan-{run_id}-r"):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                gone.append(name)
            except OSError:
                pass
    return gone


def create_file(members: int, capacity: int, tag: str) -> tuple[str, bytes]:
    """Create and reserve a group's file (by its first member, before the others map it);
    returns its path and the token written at its start. Raises ``OSError`` when
    ``/dev/shm`` has no room."""
    path = os.path.join(SHM_DIR, f"meshplan-{tag}-{secrets.token_hex(8)}")
    token = secrets.token_bytes(TOKEN_BYTES)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, region_bytes(members, capacity))
        os.pwrite(fd, token, 0)
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return path, token


class ShmGroup:
    """One member's view of a group's shared region (see the module docstring).

    ``path``/``token`` come from ``create_file`` on the group's first member (``index`` 0),
    which also initialises the semaphores (``init=True``) BEFORE any other member maps the
    file; the caller then makes sure every member mapped it (a collective) and unlinks it.
    ``check_token()`` tells a member whether it mapped the creator's file (a container with
    its own ``/dev/shm`` would not)."""

    def __init__(self, path: str, token: bytes, members: int, index: int, capacity: int, *,
                 init: bool, timeout_s: float) -> None:
        assert _LIB is not None
        self.members, self.index, self.capacity = members, index, capacity
        self.timeout_s, self._token = float(timeout_s), token
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size != region_bytes(members, capacity):
                raise OSError(f"{path}: {size} bytes, expected {region_bytes(members, capacity)}")
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)
        base = self._bytes.data_ptr()
        self._sems = [[base + TOKEN_BYTES + (2 * i + p) * _SEM_STRIDE for p in (0, 1)]
                      for i in range(members)]
        if init:
            for pair in self._sems:
                for s in pair:
                    if _LIB.sem_init(s, 1, 0) != 0:
                        raise OSError(ctypes.get_errno(), "sem_init failed")
        self._data = _data_offset(members)
        ctl = _control_offset(members)
        self._abort = self._bytes[ctl:ctl + 8].view(torch.int64)
        self._pids = self._bytes[ctl + 8:ctl + 8 + 16 * members].view(torch.int64).view(
            members, 2)
        self._pids[index, 0], self._pids[index, 1] = os.getpid(), _PIDNS
        self._barriers = 0          # barriers passed (their parity picks the semaphore)
        self._ops = 0               # operations started (their parity picks the half)
        self._pending: Callable[[], None] | None = None

    def check_token(self) -> bool:
        return bytes(self._mm[:TOKEN_BYTES]) == self._token

    # ---- synchronisation -----------------------------------------------------------------

    def _arrive(self) -> None:
        p = self._barriers % 2
        for i in range(self.members):
            if i != self.index and _LIB.sem_post(self._sems[i][p]) != 0:
                raise RuntimeFailure(f"shared-memory group: sem_post failed "
                                     f"({os.strerror(ctypes.get_errno())})")

    def _depart(self, what: str) -> None:
        sem = self._sems[self.index][self._barriers % 2]
        deadline = time.monotonic() + self.timeout_s
        ts = _Timespec()
        for _ in range(self.members - 1):
            while True:
                now = time.time()
                end = now + min(_SLICE_S, max(0.0, deadline - time.monotonic()))
                ts.tv_sec, ts.tv_nsec = int(end), int((end % 1) * 1e9)
                if _LIB.sem_timedwait(sem, ctypes.byref(ts)) == 0:
                    break
                self._check_members(what)
                if time.monotonic() >= deadline:
                    raise RuntimeFailure(
                        f"{what}: a member of this rank's shared-memory group did not arrive "
                        f"within {self.timeout_s:g} s (member {self.index} of {self.members}); "
                        "a peer died or issued its collectives in another order")
        self._barriers += 1

    def _check_members(self, what: str) -> None:
        """Raise when a member gave up on the group or its process ended."""
        if int(self._abort[0]):
            raise RuntimeFailure(f"{what}: member {int(self._abort[0]) - 1} of this rank's "
                                 "shared-memory group gave up on it (its step failed)")
        for i in range(self.members):
            pid, ns = int(self._pids[i, 0]), int(self._pids[i, 1])
            if i != self.index and pid and ns == _PIDNS and _gone(pid):
                raise RuntimeFailure(f"{what}: member {i} of this rank's shared-memory group "
                                     f"(pid {pid}) died")

    def abort(self) -> None:
        """Give up on the group: every member waiting in it, now or later, raises."""
        if self._mm is not None:
            self._abort[0] = self.index + 1
        self._pending = None

    # ---- operations ------------------------------------------------------------------------

    def _slot(self, half: int, member: int, dtype: torch.dtype, n: int) -> torch.Tensor:
        off = self._data + (half * self.members + member) * self.capacity
        return self._bytes[off:off + n * dtype.itemsize].view(dtype)

    def _segment(self, n: int, i: int) -> tuple[int, int]:
        q, r = divmod(n, self.members)
        lo = i * q + min(i, r)
        return lo, lo + q + (i < r)

    def finish_pending(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending()

    def _publish(self, src: torch.Tensor) -> int:
        """Begin the next operation: copy ``src`` into this member's slot of the next half
        (shaped as ``src``) and arrive at the barrier; returns the half."""
        half = self._ops % 2
        self._ops += 1
        self._slot(half, self.index, src.dtype, src.numel()).view(src.shape).copy_(src)
        self._arrive()
        return half

    def _combine(self, acc: torch.Tensor, others: list[torch.Tensor], op: str) -> None:
        """``acc`` (this member's part) reduced with ``others`` in their order, in place."""
        for other in others:
            if op == "max":
                torch.maximum(acc, other, out=acc)
            else:
                acc.add_(other)
        if op == "avg":
            acc.div_(self.members)

    def all_reduce_start(self, flat: torch.Tensor, out: torch.Tensor, op: str
                         ) -> Callable[[], torch.Tensor]:
        """Start reducing the 1-D contiguous ``flat`` across the group into ``out`` (same
        shape and dtype; may be ``flat`` itself); ``op`` is ``"sum"``, ``"avg"`` or ``"max"``
        (``bool`` comes as ``uint8`` with ``"max"``). Returns the function that finishes it."""
        self.finish_pending()
        if flat.numel() == 0:
            return lambda: out
        per = max(1, self.capacity // flat.element_size())
        chunks = [(lo, min(lo + per, flat.numel())) for lo in range(0, flat.numel(), per)]
        first = self._publish(flat[chunks[0][0]:chunks[0][1]])
        done = [False]

        def finish() -> torch.Tensor:
            if not done[0]:
                done[0] = True
                if self._pending is finish:
                    self._pending = None
                for i, (lo, hi) in enumerate(chunks):
                    half = self._publish(flat[lo:hi]) if i else first
                    self._reduce_out(half, out[lo:hi], op)
            return out

        self._pending = finish
        return finish

    def _reduce_out(self, half: int, out: torch.Tensor, op: str) -> None:
        """The rest of an all-reduce whose input is in ``half``: wait, reduce this member's
        segment, wait, copy every segment out."""
        n, dtype = out.numel(), out.dtype
        self._depart("all_reduce")
        lo, hi = self._segment(n, self.index)
        if hi > lo:
            self._combine(self._slot(half, self.index, dtype, n)[lo:hi],
                          [self._slot(half, j, dtype, n)[lo:hi]
                           for j in range(self.members) if j != self.index], op)
        self._arrive()
        self._depart("all_reduce")
        for j in range(self.members):
            a, b = self._segment(n, j)
            if b > a:
                out[a:b].copy_(self._slot(half, j, dtype, n)[a:b])

    # ---- all-gather and reduce-scatter -----------------------------------------------------

    def all_gather(self, flat: torch.Tensor, out: torch.Tensor) -> None:
        """Gather every member's 1-D contiguous ``flat`` into ``out`` (``members x`` its
        length, in member order), in chunks of one slot."""
        self.finish_pending()
        n, per = flat.numel(), max(1, self.capacity // flat.element_size())
        for lo in range(0, n, per):
            hi = min(lo + per, n)
            half = self._publish(flat[lo:hi])
            self._depart("all_gather")
            for j in range(self.members):
                out[j * n + lo:j * n + hi].copy_(self._slot(half, j, flat.dtype, hi - lo))

    def reduce_scatter(self, flat: torch.Tensor, out: torch.Tensor, op: str) -> None:
        """Reduce every member's 1-D contiguous ``flat`` (``members`` equal pieces) and keep
        piece ``index`` in ``out``: own piece first, then the others in member order."""
        self.finish_pending()
        for lo, hi, mine in self._exchange(flat, out.numel(), "reduce_scatter"):
            acc = out[lo:hi]
            acc.copy_(mine[self.index])
            self._combine(acc, [x for j, x in enumerate(mine) if j != self.index], op)

    def all_to_all(self, flat: torch.Tensor, out: torch.Tensor) -> None:
        """Every member's 1-D contiguous ``flat`` holds ``members`` equal pieces, piece ``j``
        for member ``j``; ``out`` (same length) receives them in member order: piece ``index``
        of member ``j`` at position ``j``."""
        self.finish_pending()
        m = out.numel() // self.members
        got = out.view(self.members, m)
        for lo, hi, mine in self._exchange(flat, m, "all_to_all"):
            for j, piece in enumerate(mine):
                got[j, lo:hi].copy_(piece)

    def _exchange(self, flat: torch.Tensor, m: int, what: str):  # noqa: ANN202 - a generator
        """Columns ``lo:hi`` of ``flat``'s ``members`` pieces of ``m`` elements, one slot-sized
        chunk at a time (every member copies the same columns of all its pieces in, one
        barrier): yields ``(lo, hi, [piece index of member j's columns for every j])``, views
        of the slots that stay valid until the next chunk is asked for."""
        k = self.members
        pieces = flat.view(k, m)
        per = max(1, self.capacity // (flat.element_size() * k))
        for lo in range(0, m, per):
            hi = min(lo + per, m)
            half = self._publish(pieces[:, lo:hi])
            self._depart(what)
            yield lo, hi, [self._slot(half, j, flat.dtype, k * (hi - lo)).view(k, hi - lo)[
                self.index] for j in range(k)]

    def close(self) -> None:
        """Unmap; an operation still in flight is dropped (its peers time out)."""
        self._pending = None
        mm, self._mm = self._mm, None
        self._bytes = self._abort = self._pids = None
        if mm is not None:
            try:
                mm.close()
            except BufferError:      # a view still exported: the mapping goes with the process
                pass
