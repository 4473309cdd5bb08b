"""The ``Communicator`` protocol that lowered programs call, and its torch.distributed version.

A communicator belongs to one rank. Every collective takes ``group``, a tuple of GLOBAL ranks that
includes ``self.rank``; its order is the group's order (``all_gather`` concatenates in it, chunk
``i`` of ``reduce_scatter`` goes to ``group[i]``). Shared rules, whatever the transport:

- inputs are never mutated; results are new contiguous tensors (inputs may be non-contiguous);
- a one-member group is a local no-op: the result is ``t.contiguous()`` (no copy when ``t`` is
  already contiguous, so it may alias the input) and nothing is recorded;
- chunking must be even: ``t.shape[dim] % len(group) == 0``, else ``LoweringError``;
- reductions: ``"sum"``, ``"avg"`` (sum, then divide by ``len(group)``; floating dtypes only),
  ``"max"``; on ``bool`` tensors ``"sum"`` and ``"max"`` are both a logical or (what ``+`` does
  on bool tensors), ``"avg"`` is an error;
- every call that moves data appends a ``CommRecord`` to ``self.records``; ``nbytes`` follows the
  planner's convention (the full buffer, see ``planner/_comm.py``): all_reduce the input,
  all_gather the OUTPUT, reduce_scatter the INPUT, all_to_all the input, broadcast / send / recv
  the tensor, barrier 0.

Non-blocking all-reduce: ``all_reduce_start(t, group, op)`` issues the all-reduce and returns a
``PendingReduce`` at once; its ``wait()`` returns what ``all_reduce`` would have (same checks,
same result, same bytes). Every rank of the group must start its collectives in the same order,
blocking ones included, as always; waits may come in any order and other collectives may run
while one is in flight. ``t`` may be reused as soon as the start returns (the transport works on
its own copy), unless the caller donates it: ``all_reduce_start(t, group, op, donate=True)``
says the caller reads ``t`` no more, and the transport may reduce in ``t`` itself when it is
contiguous (the result may then be ``t``). The ``CommRecord`` is appended when ``wait()``
returns, once: ``start_s`` is when the all-reduce was issued and ``dur_s`` runs until the wait
returned, so it spans whatever the rank did in between (a record whose span overlaps the next
records' is an overlapped one); a failure surfaces from ``start`` or ``wait`` as from the
blocking call. A one-member group is done at the start and records nothing.

``ThreadMesh`` (``_threadcomm.py``) runs every rank as a thread of one process with the same
semantics; tests of the lowering use it.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
import torch.distributed as dist

from .._errors import LoweringError, RuntimeFailure
from . import _shm

logger = logging.getLogger(__name__)

T = TypeVar("T")
REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "max")


class CollectiveKind(enum.Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    SEND = "send"
    RECV = "recv"
    BARRIER = "barrier"


@dataclass(frozen=True, slots=True)
class CommRecord:
    """One call, for telemetry and for checking bytes against the plan. ``start_s`` is wall-clock
    time (``time.time()``, comparable across ranks of one host), ``dur_s`` the call's duration on
    the host (with NCCL: until the work was enqueued, not finished on the GPU). ``group`` is the
    collective's group; for send it is ``(self.rank, dst)``, for recv ``(src, self.rank)``."""

    kind: CollectiveKind
    group: tuple[int, ...]
    nbytes: int
    start_s: float
    dur_s: float


class PendingReduce:
    """An all-reduce in flight (``Communicator.all_reduce_start``); ``wait()`` returns its
    result (the same tensor when called again)."""

    __slots__ = ("_finish", "_record", "_out")

    def __init__(self, finish: Callable[[], torch.Tensor],
                 record: Callable[[], None] | None = None) -> None:
        self._finish, self._record = finish, record
        self._out: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._out is None:
            self._out = self._finish()
            if self._record is not None:
                self._record()
            self._finish = self._record = None        # drop the transport's buffers and work
        return self._out

    @property
    def done(self) -> bool:
        """Whether ``wait()`` has returned."""
        return self._out is not None


@runtime_checkable
class Communicator(Protocol):
    """What a lowered per-rank program calls; semantics in this module's docstring."""

    rank: int
    world_size: int
    records: list[CommRecord]

    def all_reduce(self, t: torch.Tensor, group: tuple[int, ...],
                   op: str = "sum") -> torch.Tensor: ...

    def all_reduce_start(self, t: torch.Tensor, group: tuple[int, ...],
                         op: str = "sum", *, donate: bool = False) -> PendingReduce: ...

    def all_gather(self, t: torch.Tensor, group: tuple[int, ...], dim: int) -> torch.Tensor: ...

    def reduce_scatter(self, t: torch.Tensor, group: tuple[int, ...], dim: int,
                       op: str = "sum") -> torch.Tensor: ...

    def all_to_all(self, t: torch.Tensor, group: tuple[int, ...], split_dim: int,
                   cat_dim: int) -> torch.Tensor: ...

    def broadcast(self, t: torch.Tensor, src: int, group: tuple[int, ...]) -> torch.Tensor: ...

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> None: ...

    def send_start(self, t: torch.Tensor, dst: int, tag: int = 0) -> PendingReduce: ...

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int,
             tag: int = 0) -> torch.Tensor: ...

    def barrier(self, group: tuple[int, ...] | None = None) -> None: ...

    def close(self) -> None: ...


# ---- checks shared by every implementation ---------------------------------------------------

def check_reduce_op(op: object, dtype: torch.dtype, where: str) -> str:
    """``op`` as one of ``REDUCE_OPS`` (a ``planner.ReduceOp`` is accepted by its value)."""
    name = getattr(op, "value", op)
    if name not in REDUCE_OPS:
        raise LoweringError(f"{where}: unknown reduce op {op!r}; use one of {list(REDUCE_OPS)}")
    if name == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise LoweringError(f"{where}: op 'avg' needs a floating dtype, got {dtype}; reduce with "
                            "'sum' and divide where the rounding is wanted")
    return str(name)


def check_dim(t: torch.Tensor, dim: int, where: str, name: str = "dim") -> int:
    """``dim`` normalised to ``0 <= dim < t.ndim``."""
    if not isinstance(dim, int) or t.ndim == 0 or not -t.ndim <= dim < t.ndim:
        raise LoweringError(f"{where}: {name}={dim!r} is out of range for a tensor of shape "
                            f"{tuple(t.shape)}")
    return dim % t.ndim


def check_even(t: torch.Tensor, dim: int, group: tuple[int, ...], where: str) -> None:
    n = len(group)
    if t.shape[dim] % n:
        raise LoweringError(
            f"{where}: dim {dim} of shape {tuple(t.shape)} does not split into {n} equal chunks "
            f"(group size {n}, group {group}); every rank must get the same chunk size: pad dim "
            f"{dim} to a multiple of {n} or shard another dim")


def check_group(group: Sequence[int] | None, rank: int, world_size: int,
                where: str) -> tuple[int, ...]:
    """``group`` as a tuple of distinct global ranks that includes ``rank`` (None: everyone)."""
    if group is None:
        return tuple(range(world_size))
    g = tuple(group)
    if (not g or any(not isinstance(r, int) or not 0 <= r < world_size for r in g)
            or len(set(g)) != len(g)):
        raise LoweringError(f"{where}: group {group!r} must be a tuple of distinct global ranks "
                            f"in 0..{world_size - 1}")
    if rank not in g:
        raise LoweringError(f"{where}: rank {rank} called a collective on group {g}, which it "
                            "is not a member of")
    return g


def check_peer(peer: int, rank: int, world_size: int, where: str) -> int:
    if not isinstance(peer, int) or not 0 <= peer < world_size or peer == rank:
        raise LoweringError(f"{where}: peer rank {peer!r} must be another rank in "
                            f"0..{world_size - 1} (this is rank {rank})")
    return peer


MAX_TAG = (1 << 15) - 1          # MPI promises tags up to 32767 (MPI_TAG_UB >= 2**15 - 1)


def check_tag(tag: int) -> int:
    if not isinstance(tag, int) or isinstance(tag, bool) or not 0 <= tag <= MAX_TAG:
        raise LoweringError(f"point-to-point tag {tag!r} must be an int in 0..{MAX_TAG}")
    return tag


def contiguous_copy(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format)


def split_leading(t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """``t`` as ``(n, *chunk_shape)``: entry ``i`` is ``torch.chunk(t, n, dim)[i]``. A view of a
    contiguous ``t`` when ``dim == 0``, otherwise one contiguous copy."""
    return t.unflatten(dim, (n, t.shape[dim] // n)).movedim(dim, 0).contiguous()


def merge_leading(stacked: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse direction: ``(n, *piece)`` -> ``torch.cat(list(stacked), dim)``, contiguous (a
    view when ``dim == 0``)."""
    piece = stacked.shape[1:]
    shape = (*piece[:dim], stacked.shape[0] * piece[dim], *piece[dim + 1:])
    return stacked.movedim(0, dim).reshape(shape).contiguous()


# ---- the shared front: checks, the one-member shortcut, records ------------------------------

class CommBase:
    """Implements the public methods once; a transport provides ``_all_reduce`` etc., called only
    for groups of two or more with arguments already checked (``dim`` normalised), and may
    translate its errors in ``_guard`` (around every transport call: a start and a wait
    included). ``_all_reduce_start`` returns a function that finishes the all-reduce; by
    default it runs the blocking ``_all_reduce`` at the start (correct wherever every rank
    starts its collectives in the same order, which the protocol demands anyway)."""

    rank: int
    world_size: int
    records: list[CommRecord]

    def _group(self, group: Sequence[int] | None, where: str) -> tuple[int, ...]:
        return check_group(group, self.rank, self.world_size, where)

    def _guard(self, kind: CollectiveKind, group: tuple[int, ...], fn: Callable[[], T]) -> T:
        return fn()

    def _timed(self, kind: CollectiveKind, group: tuple[int, ...], nbytes: int,
               fn: Callable[[], T]) -> T:
        start, t0 = time.time(), time.perf_counter()
        out = self._guard(kind, group, fn)
        self.records.append(CommRecord(kind, group, int(nbytes), start, time.perf_counter() - t0))
        return out

    def all_reduce(self, t: torch.Tensor, group: tuple[int, ...], op: str = "sum") -> torch.Tensor:
        g = self._group(group, "all_reduce")
        op = check_reduce_op(op, t.dtype, "all_reduce")
        if len(g) == 1:
            return t.contiguous()
        return self._timed(CollectiveKind.ALL_REDUCE, g, t.nbytes,
                           lambda: self._all_reduce(t, g, op))

    def all_reduce_start(self, t: torch.Tensor, group: tuple[int, ...],
                         op: str = "sum", *, donate: bool = False) -> PendingReduce:
        """``all_reduce`` without waiting for it: see the module docstring (``donate``)."""
        g = self._group(group, "all_reduce_start")
        op = check_reduce_op(op, t.dtype, "all_reduce_start")
        if len(g) == 1:
            out = t.contiguous()
            return PendingReduce(lambda: out)
        kind, nbytes = CollectiveKind.ALL_REDUCE, int(t.nbytes)
        start, t0 = time.time(), time.perf_counter()
        finish = self._guard(kind, g, lambda: self._all_reduce_start(t, g, op, donate))

        def record() -> None:
            self.records.append(CommRecord(kind, g, nbytes, start, time.perf_counter() - t0))
        return PendingReduce(lambda: self._guard(kind, g, finish), record)

    def all_gather(self, t: torch.Tensor, group: tuple[int, ...], dim: int) -> torch.Tensor:
        g = self._group(group, "all_gather")
        d = check_dim(t, dim, "all_gather")
        if len(g) == 1:
            return t.contiguous()
        return self._timed(CollectiveKind.ALL_GATHER, g, t.nbytes * len(g),
                           lambda: self._all_gather(t, g, d))

    def reduce_scatter(self, t: torch.Tensor, group: tuple[int, ...], dim: int,
                       op: str = "sum") -> torch.Tensor:
        g = self._group(group, "reduce_scatter")
        d = check_dim(t, dim, "reduce_scatter")
        op = check_reduce_op(op, t.dtype, "reduce_scatter")
        check_even(t, d, g, "reduce_scatter")
        if len(g) == 1:
            return t.contiguous()
        return self._timed(CollectiveKind.REDUCE_SCATTER, g, t.nbytes,
                           lambda: self._reduce_scatter(t, g, d, op))

    def all_to_all(self, t: torch.Tensor, group: tuple[int, ...], split_dim: int,
                   cat_dim: int) -> torch.Tensor:
        g = self._group(group, "all_to_all")
        s = check_dim(t, split_dim, "all_to_all", "split_dim")
        c = check_dim(t, cat_dim, "all_to_all", "cat_dim")
        check_even(t, s, g, "all_to_all")
        if len(g) == 1:
            return t.contiguous()
        return self._timed(CollectiveKind.ALL_TO_ALL, g, t.nbytes,
                           lambda: self._all_to_all(t, g, s, c))

    def broadcast(self, t: torch.Tensor, src: int, group: tuple[int, ...]) -> torch.Tensor:
        """Non-source members pass a tensor of the source's shape and dtype; its values are
        ignored."""
        g = self._group(group, "broadcast")
        if src not in g:
            raise LoweringError(f"broadcast: source rank {src!r} is not in group {g}")
        if len(g) == 1:
            return t.contiguous()
        return self._timed(CollectiveKind.BROADCAST, g, t.nbytes,
                           lambda: self._broadcast(t, src, g))

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Blocks until the receiver has the data (or the timeout expires). ``tag``: a
        ``recv`` from this rank takes only what was sent with its tag (0 to 2**15 - 1)."""
        check_peer(dst, self.rank, self.world_size, "send")
        check_tag(tag)
        self._timed(CollectiveKind.SEND, (self.rank, dst), t.nbytes,
                    lambda: self._send(t, dst, tag))

    def send_start(self, t: torch.Tensor, dst: int, tag: int = 0) -> PendingReduce:
        """``send`` without waiting for the receiver: ``wait()`` on the result blocks until it
        has the data (``t`` must not change before). Sends to one peer with one tag arrive in
        the order they were started. The record's time is from the start to the end of
        ``wait()``."""
        check_peer(dst, self.rank, self.world_size, "send")
        check_tag(tag)
        kind, g, nbytes = CollectiveKind.SEND, (self.rank, dst), int(t.nbytes)
        start, t0 = time.time(), time.perf_counter()
        finish = self._guard(kind, g, lambda: self._send_start(t, dst, tag))

        def record() -> None:
            self.records.append(CommRecord(kind, g, nbytes, start, time.perf_counter() - t0))
        return PendingReduce(lambda: self._guard(kind, g, lambda: (finish(), t)[1]), record)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int,
             tag: int = 0) -> torch.Tensor:
        """The next tensor ``src`` sent this rank with ``tag``."""
        check_peer(src, self.rank, self.world_size, "recv")
        check_tag(tag)
        shape = tuple(int(s) for s in shape)
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        return self._timed(CollectiveKind.RECV, (src, self.rank), nbytes,
                           lambda: self._recv(shape, dtype, src, tag))

    def barrier(self, group: tuple[int, ...] | None = None) -> None:
        g = self._group(group, "barrier")
        if len(g) > 1:
            self._timed(CollectiveKind.BARRIER, g, 0, lambda: self._barrier(g))

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # transports implement these
    def _all_reduce(self, t, g, op): raise NotImplementedError

    def _all_reduce_start(self, t, g, op, donate=False):
        out = self._all_reduce(t, g, op)
        return lambda: out

    def _send_start(self, t, dst, tag):
        self._send(t, dst, tag)
        return lambda: None

    def _all_gather(self, t, g, dim): raise NotImplementedError
    def _reduce_scatter(self, t, g, dim, op): raise NotImplementedError
    def _all_to_all(self, t, g, split_dim, cat_dim): raise NotImplementedError
    def _broadcast(self, t, src, g): raise NotImplementedError
    def _send(self, t, dst, tag): raise NotImplementedError
    def _recv(self, shape, dtype, src, tag): raise NotImplementedError
    def _barrier(self, g): raise NotImplementedError


# ---- torch.distributed -----------------------------------------------------------------------

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


_SHM_MSG = 256                 # the shared-memory setup broadcast: flag, path, NUL, token


_ABORT_JOIN_S = 2.0


def _destroy_quietly() -> None:
    try:
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - a broken group may fail to go; it is abandoned
        logger.info("destroying a failed process group: %s", exc)


def _shm_bytes(text: str | None) -> int:
    """``MESHPLAN_SHM_BYTES``: the slot size, rounded down to a multiple of 64 bytes."""
    if text is None:
        return _shm.DEFAULT_CAPACITY
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 64:
        raise RuntimeFailure(f"MESHPLAN_SHM_BYTES={text!r}: the shared-memory slot size must be "
                             "a whole number of bytes, at least 64 (default 4194304); unset it "
                             "or set MESHPLAN_SHM=0 to use gloo's TCP collectives")
    return value // 64 * 64


def _wire(t: torch.Tensor) -> torch.Tensor:
    """bool travels as uint8 (same bytes): gloo sums bool bytes to 2, which is no bool."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _wire_op(op: str, dtype: torch.dtype) -> str:
    """The reduction on the wire: or on bool is max of 0/1 bytes."""
    return "max" if dtype == torch.bool else op


def _dist_op(op: str, dtype: torch.dtype):
    if _wire_op(op, dtype) == "max":
        return dist.ReduceOp.MAX
    return dist.ReduceOp.SUM                     # avg = sum, then one division by us


class TorchCommunicator(CommBase):
    """``Communicator`` over ``torch.distributed``: gloo on CPU, NCCL on GPU.

    The constructor initialises the default process group (on ``store`` when given: the
    launchers pass the controller's, ``runtime/_launch.RendezvousStore``; else ``init_method``:
    ``env://`` by default, reading MASTER_ADDR / MASTER_PORT, or ``"tcp://127.0.0.1:PORT"``) and then
    calls ``dist.new_group`` once per declared group. ``new_group`` is collective over ALL ranks,
    members or not, so every rank must pass the SAME ``groups`` in the SAME order, including
    groups it is not in (all groups of the mesh); otherwise construction hangs until the timeout.
    Collectives accept only declared groups and the world group ``(0, .., world_size - 1)``,
    which uses the default process group. Group rank ``i`` is ``group[i]`` (``sort_ranks=False``),
    so a group's order is kept.

    ``timeout_s`` applies to the default group and to every sub-group (``new_group`` would
    otherwise fall back to torch's 30 minute default): a collective or recv that a peer never
    joins raises ``RuntimeFailure`` after about ``timeout_s`` on gloo. After that the process
    group is broken; ``close()`` it. NCCL enforces the timeout through its watchdog, which may
    abort the process instead.

    Every call maps onto ONE native call in torch 2.13, gloo included:
    ``all_reduce``; ``all_gather_single`` (``all_gather_into_tensor`` before 2.13);
    ``reduce_scatter_single``; ``all_to_all_single``; ``broadcast``; ``send`` / ``recv``;
    ``barrier``; ``all_reduce_start`` is ``all_reduce(..., async_op=True)`` and its wait
    ``Work.wait`` (bounded by ``timeout_s`` too; ``avg`` divides after it). Gloo's native
    reduce-scatter timed the same as all_reduce + chunk on 2 and 4 loopback ranks (1 KiB -
    4 MiB) and its native all-to-all as fast as or faster than pairwise isend/irecv, so no
    emulation is kept. Other dims than 0 are brought to the front by one
    contiguous copy (``split_leading`` / ``merge_leading``); dim 0 of a contiguous tensor costs
    no extra copy. ``bool`` travels as ``uint8`` and reduces with MAX (logical or); ``avg`` is
    SUM then one in-place division, the same arithmetic as ``ThreadMesh``. The summation order
    inside gloo/NCCL is theirs (ring, halving-doubling), so sums match a rank-order sum only up
    to floating-point reassociation.

    With NCCL the communicator uses ``device`` (a worker passes the one it placed its state on),
    else ``cuda:(LOCAL_RANK or rank) % device_count``, and sets it as the current device;
    ``recv`` allocates there (``self.device``).

    Shared memory (``shm``): on gloo, all-reduces (blocking and started), all-gathers and
    reduce-scatters of a group whose members share this host's ``/dev/shm`` go through a
    ``_shm.ShmGroup`` instead of TCP on loopback. The group's members set it up at their first
    such collective on it (a broadcast and an all-reduce over gloo: the first member creates
    the file, the others map it and prove it with its token; if any member cannot, the group
    keeps gloo, the same on every member). ``shm=None`` (default) turns it on for gloo on Linux
    unless ``MESHPLAN_SHM=0``; ``MESHPLAN_SHM_BYTES`` sets the slot size (default 4 MiB; a
    group's file holds ``2 x members`` slots). Both must be the same on every rank (the
    launchers pass one environment to all). Sums then run in a fixed order (each member
    reduces one segment, own slot first), so every member gets bit-identical results.
    """

    def __init__(self, rank: int, world_size: int, groups: Sequence[tuple[int, ...]], *,
                 backend: str | None = None, timeout_s: float = 300.0,
                 init_method: str | None = None, shm: bool | None = None,
                 store: dist.Store | None = None,
                 device: torch.device | str | None = None) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise LoweringError(f"TorchCommunicator: world_size must be >= 1, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise LoweringError(f"TorchCommunicator: rank {rank!r} is not in 0..{world_size - 1}")
        if not timeout_s > 0:
            raise LoweringError(f"TorchCommunicator: timeout_s must be positive, got {timeout_s!r}")
        declared = list(dict.fromkeys(tuple(g) for g in groups))
        for g in declared:
            if not g or len(set(g)) != len(g) or any(
                    not isinstance(r, int) or not 0 <= r < world_size for r in g):
                raise LoweringError(f"TorchCommunicator: group {g!r} must be a non-empty tuple of "
                                    f"distinct ranks in 0..{world_size - 1}")
        self.rank, self.world_size, self.records = rank, world_size, []
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.timeout_s = float(timeout_s)
        self.device = torch.device("cpu")
        if self.backend == "nccl":
            if device is None:
                local = int(os.environ.get("LOCAL_RANK", rank)) % max(1, torch.cuda.device_count())
                device = torch.device("cuda", local)
            self.device = torch.device(device)
            torch.cuda.set_device(self.device)
        timeout = timedelta(seconds=timeout_s)
        try:
            if store is not None:
                dist.init_process_group(self.backend, store=store, rank=rank,
                                        world_size=world_size, timeout=timeout)
            else:
                dist.init_process_group(self.backend, init_method=init_method or "env://",
                                        rank=rank, world_size=world_size, timeout=timeout)
        except (RuntimeError, ValueError) as exc:     # taken port, missing env, second init
            raise RuntimeFailure(
                f"rank {rank}: cannot start the {self.backend} process group of {world_size} "
                f"ranks ({init_method or 'env://'}, timeout {timeout_s:g} s): {exc}") from exc
        self._closed = False
        self._destroyed = False          # abort() destroyed the process groups
        world = tuple(range(world_size))
        self._declared: tuple[tuple[int, ...], ...] = tuple(declared)
        self._pgs: dict[tuple[int, ...], object] = {world: None}      # None: the default group
        for g in declared:                       # same order on every rank: collective over all
            if g == world or len(g) == 1:
                continue
            pg = dist.new_group(list(g), timeout=timeout, backend=self.backend, sort_ranks=False)
            if rank in g:
                self._pgs[g] = pg
        if shm is None:
            shm = os.environ.get("MESHPLAN_SHM", "1") != "0"
        self._shm_on = bool(shm) and self.backend == "gloo" and _shm.available()
        self._shm_capacity = _shm_bytes(os.environ.get("MESHPLAN_SHM_BYTES"))
        self._shm: dict[tuple[int, ...], _shm.ShmGroup | None] = {}
        logger.debug("rank %s: %s process group of %s ranks, %s groups", rank, self.backend,
                     world_size, len(declared))

    def _group(self, group: Sequence[int] | None, where: str) -> tuple[int, ...]:
        if self._closed:
            raise RuntimeFailure(f"{where}: this TorchCommunicator (rank {self.rank}) is closed")
        g = check_group(group, self.rank, self.world_size, where)
        if len(g) > 1 and g not in self._pgs:
            raise LoweringError(
                f"{where}: group {g} was not declared when rank {self.rank}'s TorchCommunicator "
                f"was built; declared groups: {list(self._declared)} (plus the world group). "
                "Pass every group of the mesh in `groups=`, the same list on every rank")
        return g

    def _guard(self, kind: CollectiveKind, group: tuple[int, ...], fn: Callable[[], T]) -> T:
        if self._closed:
            raise RuntimeFailure(f"{kind.value}: this TorchCommunicator (rank {self.rank}) is "
                                 "closed")
        try:
            return fn()
        except RuntimeError as exc:          # DistBackendError, gloo timeouts, closed peers
            raise RuntimeFailure(
                f"{kind.value} on group {group} failed on rank {self.rank} ({self.backend}, "
                f"timeout {self.timeout_s:g} s): {exc}. If a peer never joined or exited, "
                "the process group is now unusable: close() it") from exc

    def _all_reduce(self, t, g, op):
        return self._all_reduce_start(t, g, op)()

    def _shm_group(self, g: tuple[int, ...]) -> _shm.ShmGroup | None:
        """``g``'s shared-memory region, set up by its members at their first all-reduce,
        all-gather or reduce-scatter on it; None where a member cannot map it (another host,
        no room in ``/dev/shm``)."""
        if g in self._shm:
            return self._shm[g]
        pg, index, n = self._pgs[g], g.index(self.rank), len(g)
        cap = self._shm_capacity
        msg = torch.zeros(_SHM_MSG, dtype=torch.uint8)
        mine: _shm.ShmGroup | None = None
        path = ""
        try:
            if index == 0:
                try:
                    path, token = _shm.create_file(n, cap, _shm.file_tag(self.rank))
                    mine = _shm.ShmGroup(path, token, n, 0, cap, init=True,
                                         timeout_s=self.timeout_s)
                    raw = path.encode() + b"\0" + token
                    msg[0] = 1
                    msg[1:1 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                except OSError as exc:
                    logger.info("rank %s: no shared memory for group %s (%s); gloo it is",
                                self.rank, g, exc)
            dist.broadcast(msg, src=g[0], group=pg)
            if index != 0 and msg[0] == 1:
                raw = bytes(msg[1:].tolist())
                name, token = raw.split(b"\0", 1)
                try:
                    mine = _shm.ShmGroup(name.decode(), token[:_shm.TOKEN_BYTES], n, index, cap,
                                         init=False, timeout_s=self.timeout_s)
                except OSError:
                    mine = None
                if mine is not None and not mine.check_token():
                    mine.close()
                    mine = None
            ok = torch.tensor([int(mine is not None)], dtype=torch.int32)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=pg)
        finally:
            if path:
                os.unlink(path)          # every member has mapped it, given up, or failed
        if not ok.item() and mine is not None:
            mine.close()
            mine = None
        self._shm[g] = mine
        return mine

    def _all_reduce_start(self, t, g, op, donate=False):
        shm = self._shm_group(g) if self._shm_on else None
        if shm is not None:
            src = t if t.is_contiguous() else contiguous_copy(t)
            out = src if donate or src is not t else torch.empty_like(src)
            finish = shm.all_reduce_start(_wire(src).view(-1), _wire(out).view(-1),
                                          _wire_op(op, t.dtype))
            return lambda: (finish(), out)[1]
        out = t if donate and t.is_contiguous() else contiguous_copy(t)
        work = dist.all_reduce(_wire(out), op=_dist_op(op, t.dtype), group=self._pgs[g],
                               async_op=True)

        def finish() -> torch.Tensor:
            work.wait(timedelta(seconds=self.timeout_s))
            return out.div_(len(g)) if op == "avg" else out
        return finish

    def _all_gather(self, t, g, dim):
        n = len(g)
        flat = torch.empty((n * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        src = _wire(t.contiguous())
        shm = self._shm_group(g) if self._shm_on else None
        if shm is not None:
            shm.all_gather(src.view(-1), _wire(flat).view(-1))
        else:
            _all_gather_single(_wire(flat), src, group=self._pgs[g])
        return merge_leading(flat.view(n, *t.shape), dim)

    def _reduce_scatter(self, t, g, dim, op):
        n = len(g)
        stacked = split_leading(t, dim, n)
        out = torch.empty(stacked.shape[1:], dtype=t.dtype, device=t.device)
        shm = self._shm_group(g) if self._shm_on else None
        if shm is not None:
            shm.reduce_scatter(_wire(stacked).reshape(-1), _wire(out).view(-1),
                               _wire_op(op, t.dtype))
            return out
        _reduce_scatter_single(_wire(out), _wire(stacked.flatten(0, 1)),
                               op=_dist_op(op, t.dtype), group=self._pgs[g])
        return out.div_(n) if op == "avg" else out

    def _all_to_all(self, t, g, split_dim, cat_dim):
        stacked = split_leading(t, split_dim, len(g))
        received = torch.empty_like(stacked)
        shm = self._shm_group(g) if self._shm_on else None
        if shm is not None:
            shm.all_to_all(_wire(stacked).reshape(-1), _wire(received).view(-1))
        else:
            dist.all_to_all_single(_wire(received.flatten(0, 1)), _wire(stacked.flatten(0, 1)),
                                   group=self._pgs[g])
        return merge_leading(received, cat_dim)

    def _broadcast(self, t, src, g):
        if src == self.rank:
            out = contiguous_copy(t)
        else:
            out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        dist.broadcast(_wire(out), src=src, group=self._pgs[g])
        return out

    def _send(self, t, dst, tag):
        dist.send(_wire(t.contiguous()), dst, tag=tag)

    def _send_start(self, t, dst, tag):
        src = _wire(t.contiguous())
        work = dist.isend(src, dst, tag=tag)
        return lambda: (work.wait(timedelta(seconds=self.timeout_s)), src)

    def _recv(self, shape, dtype, src, tag):
        out = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(_wire(out), src, tag=tag)
        return out

    def _barrier(self, g):
        dist.barrier(group=self._pgs[g])

    def abort(self) -> None:
        """Give up after a failed collective: every peer waiting for this rank in a
        shared-memory group raises now instead of at its timeout (``_shm.ShmGroup.abort``);
        peers waiting in gloo see this rank's sockets close at ``close()``. The communicator
        is unusable afterwards; ``close()`` it."""
        for group in self._shm.values():
            if group is not None:
                group.abort()
        if self.backend == "gloo" and not self._closed and not self._destroyed \
                and dist.is_initialized():
            # gloo has no abort: destroying the process group closes this rank's sockets, and
            # its peers' pending receives from it fail. A destroy that blocks (a collective of
            # this rank still running in gloo's threads) is left behind in its thread.
            self._destroyed = True
            done = threading.Thread(target=_destroy_quietly, name="meshplan-gloo-abort",
                                    daemon=True)
            done.start()
            done.join(_ABORT_JOIN_S)

    def close(self) -> None:
        """Destroy the default process group and every sub-group; idempotent."""
        if not self._closed:
            self._closed = True
            for group in self._shm.values():
                if group is not None:
                    group.close()
            if dist.is_initialized() and not self._destroyed:
                dist.destroy_process_group()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, "
                f"backend={self.backend!r}, groups={list(self._declared)})")


class HostStagedCommunicator(TorchCommunicator):
    """gloo for ranks whose tensors live on a GPU another rank of the host also uses (NCCL
    refuses two ranks on one device): every call copies its input to host memory, runs the
    collective there (gloo, shared memory inside the host) and copies the result back to the
    tensor's device. Slower than NCCL by the two copies and the host collective; what it is
    for is running several ranks on one GPU at all (tests, a small machine)."""

    def __init__(self, rank: int, world_size: int, groups: Sequence[tuple[int, ...]], *,
                 device: torch.device | str, **kwargs: Any) -> None:
        super().__init__(rank, world_size, groups, backend="gloo", **kwargs)
        self.gpu = torch.device(device)

    def all_reduce(self, t: torch.Tensor, group: tuple[int, ...], op: str = "sum") -> torch.Tensor:
        return super().all_reduce(t.cpu(), group, op).to(t.device)

    def all_reduce_start(self, t: torch.Tensor, group: tuple[int, ...],
                         op: str = "sum", *, donate: bool = False) -> PendingReduce:
        host = t.cpu()
        pending = super().all_reduce_start(host, group, op, donate=donate or host is not t)
        return PendingReduce(lambda: pending.wait().to(t.device))

    def all_gather(self, t: torch.Tensor, group: tuple[int, ...], dim: int) -> torch.Tensor:
        return super().all_gather(t.cpu(), group, dim).to(t.device)

    def reduce_scatter(self, t: torch.Tensor, group: tuple[int, ...], dim: int,
                       op: str = "sum") -> torch.Tensor:
        return super().reduce_scatter(t.cpu(), group, dim, op).to(t.device)

    def all_to_all(self, t: torch.Tensor, group: tuple[int, ...], split_dim: int,
                   cat_dim: int) -> torch.Tensor:
        return super().all_to_all(t.cpu(), group, split_dim, cat_dim).to(t.device)

    def broadcast(self, t: torch.Tensor, src: int, group: tuple[int, ...]) -> torch.Tensor:
        return super().broadcast(t.cpu(), src, group).to(t.device)

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> None:
        super().send(t.cpu(), dst, tag)

    def send_start(self, t: torch.Tensor, dst: int, tag: int = 0) -> PendingReduce:
        return super().send_start(t.cpu(), dst, tag)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int,
             tag: int = 0) -> torch.Tensor:
        return super().recv(shape, dtype, src, tag).to(self.gpu)
