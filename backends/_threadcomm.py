"""``ThreadMesh``: N ranks as N threads of one process, for tests of the lowering.

Each rank's ``Communicator`` meets its group's other members at a rendezvous: the k-th collective
a rank calls on a group matches the k-th call of every other member on that group (as on a real
backend), the last member to arrive computes every member's result from all inputs, and each
member gets its own new tensor. Sums run in group order, one ``add_`` at a time in the tensor's
dtype, so results are deterministic and bit-equal to ``functools.reduce(torch.add, inputs)``.
Members that disagree (another collective, op, dim, shape or dtype) all get ``LoweringError``.

``all_reduce_start`` completes the all-reduce at the start (``CommBase``'s default) and its
``wait()`` only hands the result over: every member starts its collectives in the same order, so
meeting at the start cannot deadlock where a real backend would not, and the sums are the same.

``send`` is synchronous: it returns once the receiver has copied the tensor, like gloo's and NCCL's
blocking send, so a schedule that deadlocks there deadlocks here too (and then times out).
Messages between one pair of ranks arrive in the order they were sent.

A wait longer than ``timeout_s`` raises ``RuntimeFailure`` naming the ranks that did not arrive;
``abort(exc)`` wakes every waiting rank with ``RuntimeFailure`` (and fails every later call), and
``run`` aborts the mesh as soon as one rank raises, so no thread is left waiting.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from .._errors import LoweringError, RuntimeFailure
from ._comm import CollectiveKind, CommBase, contiguous_copy

T = TypeVar("T")


class _Aborted(RuntimeFailure):
    """A wait ended because the mesh was aborted (the cause is ``__cause__``)."""


@dataclass(slots=True)
class _Slot:
    """One collective of one group: every member's signature and input, then the results."""

    signatures: dict[int, tuple] = field(default_factory=dict)
    inputs: dict[int, torch.Tensor | None] = field(default_factory=dict)
    results: list | None = None
    error: tuple[type[Exception], str] | None = None
    taken: int = 0


@dataclass(slots=True)
class _Message:
    tensor: torch.Tensor
    result: torch.Tensor | None = None
    error: str | None = None


def _reduce(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    acc = contiguous_copy(inputs[0])
    for x in inputs[1:]:
        if op == "max":
            torch.maximum(acc, x, out=acc)
        else:
            acc.add_(x)                           # bool: logical or, as torch.add does
    return acc.div_(len(inputs)) if op == "avg" else acc


def _compute(kind: CollectiveKind, params: tuple, inputs: list, group: tuple[int, ...]) -> list:
    """Every member's result, in group order, each a tensor of its own."""
    n = len(group)
    if kind is CollectiveKind.BARRIER:
        return [None] * n
    if kind is CollectiveKind.ALL_REDUCE:
        acc = _reduce(inputs, params[0])
        return [acc] + [acc.clone() for _ in range(n - 1)]
    if kind is CollectiveKind.ALL_GATHER:
        out = torch.cat(inputs, dim=params[0])
        return [out] + [out.clone() for _ in range(n - 1)]
    if kind is CollectiveKind.REDUCE_SCATTER:
        dim, op = params
        return [contiguous_copy(c) for c in torch.chunk(_reduce(inputs, op), n, dim)]
    if kind is CollectiveKind.ALL_TO_ALL:
        split_dim, cat_dim = params
        pieces = [torch.chunk(x, n, split_dim) for x in inputs]
        return [torch.cat([pieces[i][j] for i in range(n)], dim=cat_dim) for j in range(n)]
    if kind is CollectiveKind.BROADCAST:
        src = inputs[group.index(params[0])]
        return [contiguous_copy(src) for _ in range(n)]
    raise AssertionError(kind)


def _mismatch(kind: CollectiveKind, slot: _Slot, group: tuple[int, ...], seq: int) -> str | None:
    """Why the members' calls do not match, or None."""
    sigs = [slot.signatures[r] for r in group]
    if len(set(sigs)) > 1:
        calls = ", ".join(f"rank {r}: {s[0].value}{s[1]}" for r, s in zip(group, sigs))
        return (f"the members of group {group} disagree on their collective #{seq} on it "
                f"({calls}); every member must make the same calls in the same order")
    metas = [(tuple(x.shape), x.dtype) for x in (slot.inputs[r] for r in group) if x is not None]
    if len(set(metas)) > 1:
        shapes = ", ".join(f"rank {r}: {tuple(s)} {d}" for r, (s, d) in zip(group, metas))
        return (f"{kind.value} on group {group}: every member must pass the same shape and "
                f"dtype, got {shapes}")
    return None


class _ThreadCommunicator(CommBase):
    """One rank of a ``ThreadMesh``; use it from one thread."""

    def __init__(self, mesh: ThreadMesh, rank: int) -> None:
        self.mesh, self.rank, self.world_size = mesh, rank, mesh.world_size
        self.records: list = []
        self._seq: dict[tuple[int, ...], int] = {}

    def _collective(self, kind: CollectiveKind, group: tuple[int, ...], params: tuple,
                    t: torch.Tensor | None):
        seq = self._seq.get(group, 0)
        self._seq[group] = seq + 1
        return self.mesh._rendezvous(self.rank, kind, group, seq, params, t)

    def _all_reduce(self, t, g, op):
        return self._collective(CollectiveKind.ALL_REDUCE, g, (op,), t)

    def _all_gather(self, t, g, dim):
        return self._collective(CollectiveKind.ALL_GATHER, g, (dim,), t)

    def _reduce_scatter(self, t, g, dim, op):
        return self._collective(CollectiveKind.REDUCE_SCATTER, g, (dim, op), t)

    def _all_to_all(self, t, g, split_dim, cat_dim):
        return self._collective(CollectiveKind.ALL_TO_ALL, g, (split_dim, cat_dim), t)

    def _broadcast(self, t, src, g):
        return self._collective(CollectiveKind.BROADCAST, g, (src,), t)

    def _barrier(self, g):
        self._collective(CollectiveKind.BARRIER, g, (), None)

    def _send(self, t, dst, tag):
        self.mesh._send(self.rank, dst, t, tag)

    def _send_start(self, t, dst, tag):
        return self.mesh._send_start(self.rank, dst, t, tag)

    def _recv(self, shape, dtype, src, tag):
        return self.mesh._recv(self.rank, src, shape, dtype, tag)

    def __repr__(self) -> str:
        return f"ThreadMesh communicator(rank={self.rank}, world_size={self.world_size})"


class ThreadMesh:
    """``world_size`` in-process ranks; ``communicators[r]`` is rank ``r``'s ``Communicator``.

    Any group of distinct ranks may be used without declaring it. Each communicator must be used
    by one thread at a time (``run`` gives each rank its own thread). Once aborted (by
    ``abort``, or by a failing rank inside ``run``), a mesh stays aborted: make a new one.
    """

    def __init__(self, world_size: int, timeout_s: float = 30.0) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise LoweringError(f"ThreadMesh: world_size must be >= 1, got {world_size!r}")
        if not timeout_s > 0:
            raise LoweringError(f"ThreadMesh: timeout_s must be positive, got {timeout_s!r}")
        self.world_size, self.timeout_s = world_size, float(timeout_s)
        self._cond = threading.Condition()
        self._slots: dict[tuple[tuple[int, ...], int], _Slot] = {}
        self._mail: dict[tuple[int, int, int], deque[_Message]] = {}   # (src, dst, tag)
        self._aborted: BaseException | None = None
        self.communicators: list[_ThreadCommunicator] = [
            _ThreadCommunicator(self, r) for r in range(world_size)]

    # ---- failure ----------------------------------------------------------------------------

    def abort(self, exc: BaseException) -> None:
        """Wake every waiting rank with ``RuntimeFailure`` caused by ``exc``; later calls fail
        too. The first abort's cause is kept."""
        with self._cond:
            if self._aborted is None:
                self._aborted = exc
            self._cond.notify_all()

    def _wait(self, ready: Callable[[], bool], deadline: float, rank: int, what: str,
              on_timeout: Callable[[], str]) -> None:
        """Wait (holding ``_cond``) until ``ready()``; raise on abort or at ``deadline``."""
        while True:
            if self._aborted is not None:
                cause = self._aborted
                raise _Aborted(f"rank {rank}: {what} was aborted: {type(cause).__name__}: "
                               f"{cause}") from cause
            if ready():
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeFailure(f"rank {rank}: {what} timed out after {self.timeout_s:g} s: "
                                     f"{on_timeout()}")
            self._cond.wait(left)

    # ---- collectives ------------------------------------------------------------------------

    def _rendezvous(self, rank: int, kind: CollectiveKind, group: tuple[int, ...], seq: int,
                    params: tuple, t: torch.Tensor | None):
        deadline = time.monotonic() + self.timeout_s
        key = (group, seq)
        what = f"{kind.value} #{seq} on group {group}"
        with self._cond:
            self._wait(lambda: True, deadline, rank, what, str)     # fails if aborted
            slot = self._slots.setdefault(key, _Slot())
            slot.signatures[rank], slot.inputs[rank] = (kind, params), t
            last = len(slot.inputs) == len(group)
            if not last:
                self._wait(lambda: slot.results is not None or slot.error is not None, deadline,
                           rank, what, lambda: self._late(slot, group))
        if last:
            self._finish(slot, kind, group, seq)
        with self._cond:
            slot.taken += 1
            if slot.taken == len(group):
                del self._slots[key]
            if slot.error is not None:
                cls, msg = slot.error
                raise cls(msg)
            return slot.results[group.index(rank)]

    def _late(self, slot: _Slot, group: tuple[int, ...]) -> str:
        missing = [r for r in group if r not in slot.inputs]
        if not missing:
            return f"the members of group {group} arrived but the collective did not finish"
        why = f"this collective was abandoned: rank(s) {missing} of group {group} were late"
        slot.error = (RuntimeFailure, why)
        return (f"rank(s) {missing} of group {group} did not arrive (did a rank skip the call, "
                "call another group first, or fail?)")

    def _finish(self, slot: _Slot, kind: CollectiveKind, group: tuple[int, ...],
                seq: int) -> None:
        """Run by the last member to arrive, outside the lock: the others only wait."""
        results, error = None, slot.error
        if error is None:
            why = _mismatch(kind, slot, group, seq)
            if why is not None:
                error = (LoweringError, why)
            else:
                try:
                    results = _compute(kind, slot.signatures[group[0]][1],
                                       [slot.inputs[r] for r in group], group)
                except (RuntimeError, TypeError, ValueError) as exc:   # e.g. an unaddable dtype
                    why = f"{kind.value} on group {group} failed: {type(exc).__name__}: {exc}"
                    error = (LoweringError, why)
        with self._cond:
            slot.inputs.clear()                   # the callers' tensors are no longer needed
            slot.results, slot.error = results, error
            self._cond.notify_all()

    # ---- point to point ---------------------------------------------------------------------

    def _send(self, src: int, dst: int, t: torch.Tensor, tag: int = 0) -> None:
        self._send_start(src, dst, t, tag)()

    def _send_start(self, src: int, dst: int, t: torch.Tensor,
                    tag: int = 0) -> Callable[[], None]:
        """Post ``t`` in ``dst``'s box for ``tag`` from ``src``; the function returned waits
        for it to be taken."""
        msg = _Message(t)
        with self._cond:
            self._mail.setdefault((src, dst, tag), deque()).append(msg)
            self._cond.notify_all()
        return lambda: self._taken(src, dst, tag, t, msg)

    def _taken(self, src: int, dst: int, tag: int, t: torch.Tensor, msg: _Message) -> None:
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            box = self._mail.setdefault((src, dst, tag), deque())
            try:
                self._wait(lambda: msg.result is not None or msg.error is not None, deadline,
                           src, f"send to rank {dst}",
                           lambda: f"rank {dst} did not receive the {tuple(t.shape)} {t.dtype} "
                                   "tensor")
            except RuntimeFailure:
                if msg in box:
                    box.remove(msg)
                raise
            if msg.error is not None:
                raise LoweringError(msg.error)

    def _recv(self, dst: int, src: int, shape: tuple[int, ...], dtype: torch.dtype,
              tag: int = 0):
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            box = self._mail.setdefault((src, dst, tag), deque())
            self._wait(lambda: bool(box), deadline, dst, f"recv from rank {src}",
                       lambda: f"rank {src} sent nothing to rank {dst}")
            msg = box.popleft()
            sent = msg.tensor
            if tuple(sent.shape) != shape or sent.dtype != dtype:
                msg.error = (f"recv on rank {dst} expected a {shape} {dtype} tensor from rank "
                             f"{src}, which sent a {tuple(sent.shape)} {sent.dtype} one")
                self._cond.notify_all()
                raise LoweringError(msg.error)
            msg.result = contiguous_copy(sent)
            self._cond.notify_all()
            return msg.result

    # ---- running ranks as threads -----------------------------------------------------------

    def run(self, fn: Callable[[_ThreadCommunicator], T]) -> list[T]:
        """``fn(comm)`` on every rank, each in its own thread; the results in rank order.

        If any rank raises, the mesh is aborted (waiting ranks stop) and the first exception
        raised by ``fn`` itself, rather than by an abort, is re-raised with a note naming its
        rank (its traceback stays attached). ``fn`` must terminate on its own: only waits
        inside the communicators are bounded by ``timeout_s``.
        """
        if self._aborted is not None:
            raise RuntimeFailure(f"this ThreadMesh was aborted ({self._aborted!r}); make a new one")
        results: list = [None] * self.world_size
        failures: list[tuple[int, BaseException]] = []
        lock = threading.Lock()

        def body(rank: int) -> None:
            try:
                results[rank] = fn(self.communicators[rank])
            except BaseException as exc:          # noqa: BLE001 - handed to the caller below
                with lock:
                    failures.append((rank, exc))
                self.abort(RuntimeFailure(f"rank {rank} raised {type(exc).__name__}: {exc}"))

        threads = [threading.Thread(target=body, args=(r,), name=f"meshplan-rank{r}",
                                    daemon=True) for r in range(self.world_size)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if failures:
            rank, exc = next((f for f in failures if not isinstance(f[1], _Aborted)),
                             failures[0])
            if hasattr(exc, "add_note"):         # Python 3.11+; the traceback stays attached
                exc.add_note(f"raised on rank {rank} of a ThreadMesh of {self.world_size} ranks")
            raise exc
        return results

    def __repr__(self) -> str:
        return f"ThreadMesh(world_size={self.world_size}, timeout_s={self.timeout_s:g})"
