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

A rank on another host than the controller's opens a file that a keeper holds instead: one
process per such host, started with the ranks' launcher, that outlives them
(``_keepers.py``). A file lives on its rank's host only: a lost host takes its files along
(copies on a peer host, Gemini style, are not built yet).
"""

from __future__ import annotations

import hmac
import json
import mmap
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch

from .._errors import RuntimeFailure

__all__ = ["Held", "Replica", "Snapshot", "SnapshotFiles", "read_mesh", "serve_replica"]

MAGIC = b"MPSNAP01"
_HEAD = struct.Struct("<8sQqq")          # magic, index length, step of slot 0, step of slot 1
_PAGE = 4096
_ALIGN = 64
# a slot's step when it holds nothing valid: no step can be it (a fresh mesh's launch state is
# the snapshot of step -1, the step before its first; with -1 as the marker that snapshot did
# not count, and a rank lost in step 0, or in step 1 while its copy of step 0 was still being
# written, left no step to go back to)
INVALID = -(2**63)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class SnapshotFiles:
    """Memory files of ``ranks`` (a count: ranks 0 to n-1), held by this process for as long
    as the run: the controller's for the ranks on its host, a keeper's (``_keepers.py``) for
    the ranks on the keeper's host."""

    def __init__(self, ranks: int | Iterable[int]) -> None:
        if not hasattr(os, "memfd_create"):
            raise RuntimeFailure("fault_tolerance=True keeps each rank's snapshots in memory "
                                 "files (memfd_create), which this platform lacks (Linux only)")
        self.fds = {r: os.memfd_create(f"meshplan-snapshot-r{r}", os.MFD_CLOEXEC)
                    for r in (range(ranks) if isinstance(ranks, int) else ranks)}

    def path(self, rank: int) -> str:
        """Where rank ``rank`` opens its file (any process of this host, as this user)."""
        return f"/proc/{os.getpid()}/fd/{self.fds[rank]}"

    def nbytes(self) -> int:
        return sum(os.fstat(fd).st_size for fd in self.fds.values())

    def held(self, ranks: Iterable[int]) -> dict[int, list[int] | None]:
        """The steps each of ``ranks``' files holds a snapshot of; None for a file no rank
        has laid out yet."""
        out: dict[int, list[int] | None] = {}
        for r in ranks:
            try:
                snap = Snapshot.existing(self.path(r), rank=r)
            except RuntimeFailure:
                out[r] = None
                continue
            try:
                out[r] = snap.steps()
            finally:
                snap.close()
        return out

    def read(self, step: int, want: Mapping[int, Sequence[str]]
             ) -> dict[int, dict[str, torch.Tensor]]:
        """The pieces ``want`` names (rank -> names) of the snapshot of ``step``, from each
        rank's file, without touching its slots."""
        out = {}
        for r, names in want.items():
            snap = Snapshot.existing(self.path(r), rank=r)
            try:
                out[r] = snap.read(step, sorted(names), mine=False)
            finally:
                snap.close()
        return out

    def close(self) -> None:
        for fd in self.fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = {}


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
        # the copy on a peer host (``Replica``), sent after each local copy; None: none
        self.replica: Replica | None = None
        self.text = json.dumps(index, separators=(",", ":")).encode()
        self._map, have = _open(path, rank, self.header_bytes + 2 * self.slot_bytes)
        if have == 0:
            self._map[:_HEAD.size + len(self.text)] = _HEAD.pack(
                MAGIC, len(self.text), INVALID, INVALID) + self.text
        else:
            self.check(self.text)

    @classmethod
    def mirror(cls, path: str, text: bytes, *, rank: int) -> Snapshot:
        """The file at ``path`` laid out as another host's file of rank ``rank`` is (its index,
        ``text``), to receive that file's slots (``serve_replica``): kept when it already is,
        else emptied and laid out afresh (a copy of another plan's layout is of no use)."""
        self = cls.__new__(cls)
        self.rank, self._copying, self._failed, self.lost, self.replica = rank, None, None, [], None
        self.index, self.text = json.loads(text), text
        self.header_bytes, self.slot_bytes = _layout(self.index)
        size = self.header_bytes + 2 * self.slot_bytes
        self._map, have = _open(path, rank, size)
        magic, length, *_ = _HEAD.unpack_from(self._map, 0)
        if have and (magic != MAGIC or bytes(self._map[_HEAD.size:_HEAD.size + length]) != text
                     or have != size):
            self._map.close()
            os.truncate(path, 0)
            self._map, have = _open(path, rank, size)
        if not have:
            self._map[:_HEAD.size + len(text)] = _HEAD.pack(MAGIC, len(text), INVALID,
                                                            INVALID) + text
        return self

    @classmethod
    def existing(cls, path: str, *, rank: int) -> Snapshot:
        """Rank ``rank``'s file as its owner laid it out, to read from (``read(mine=False)``)."""
        self = cls.__new__(cls)
        self.rank, self._copying, self._failed, self.lost, self.replica = rank, None, None, [], None
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
        """Copy ``state`` (every piece of the index) into the older slot, as ``step``; then
        the slot to the replica, when there is one (its failure is not this copy's:
        ``Replica.broken``)."""
        steps = _HEAD.unpack_from(self._map, 0)[2:]
        slot = 0 if steps[0] == INVALID else 1 if steps[1] == INVALID else \
            int(steps[1] < steps[0])
        self._set(slot, INVALID)           # a copy cut short leaves this slot invalid
        for name, view in self._views(slot).items():
            view.copy_(state[name])
        self._set(slot, step)
        if self.replica is not None:
            base = self.header_bytes + slot * self.slot_bytes
            with memoryview(self._map) as whole, whole[base:base + self.slot_bytes] as data:
                self.replica.send(slot, step, data,
                                  list(_HEAD.unpack_from(self._map, 0)[2:]))

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
        if self.replica is not None:
            self.replica.close()
        try:
            self._map.close()
        except BufferError:           # a view still exported: the mapping goes with the process
            pass


# ---- copies on a peer host ---------------------------------------------------------------------
#
# A rank on another host than the controller's sends each snapshot it writes to a keeper on
# the next host too (``_keepers.py``), which holds the copy in a memory file of the same
# layout: when the rank's host is lost, its snapshot is still there (Gemini, SOSP '23). The
# wire: the keeper sends a 16-byte nonce; every frame after is a JSON header with its sequence
# number and an HMAC-SHA256 under HMAC(run key, nonce), so a frame from anyone without the
# key, or replayed from another connection, is refused. A slot's bytes follow its header raw
# and are checked at its seal (their HMAC); the keeper marks the slot valid only then, and
# answers ``ok``, so the rank's copy of a step is done (``Snapshot.settle``) only once its
# replica is whole too.

_LEN = struct.Struct("<I")
_NONCE = 16
_MAC = 32
_MAX_HEAD = 1 << 26            # an index of some 10^5 pieces
_CHUNK = 4 << 20


class Wire:
    """Framing of one replica connection (see above), over a connected socket."""

    def __init__(self, sock: socket.socket, key: bytes, nonce: bytes) -> None:
        self.sock, self.key = sock, hmac.digest(key, nonce, "sha256")
        self.sent = self.got = 0

    def send(self, head: dict, payload: memoryview | None = None, mac: Any = None) -> None:
        self.sent += 1
        text = json.dumps({**head, "seq": self.sent}, separators=(",", ":")).encode()
        self.sock.sendall(_LEN.pack(len(text)) + text + hmac.digest(self.key, text, "sha256"))
        for start in range(0, 0 if payload is None else len(payload), _CHUNK):
            piece = payload[start:start + _CHUNK]
            mac.update(piece)
            self.sock.sendall(piece)

    def recv(self) -> dict | None:
        """The next header; None when the peer closed the connection between frames."""
        first = self.sock.recv(_LEN.size)
        if not first:
            return None
        first += self._exact(_LEN.size - len(first))
        if _LEN.unpack(first)[0] > _MAX_HEAD:
            raise RuntimeFailure("a replica connection sent a bad frame")
        text = self._exact(_LEN.unpack(first)[0])
        if not hmac.compare_digest(self._exact(_MAC), hmac.digest(self.key, text, "sha256")):
            raise RuntimeFailure("a replica frame failed its MAC (wrong key, or tampered)")
        head = json.loads(text)
        self.got += 1
        if head.get("seq") != self.got:
            raise RuntimeFailure("a replica frame is out of sequence")
        return head

    def recv_into(self, view: memoryview, mac: Any) -> None:
        got = 0
        while got < len(view):
            n = self.sock.recv_into(view[got:got + _CHUNK])
            if not n:
                raise RuntimeFailure("the replica connection closed in the middle of a slot")
            mac.update(view[got:got + n])
            got += n

    def _exact(self, n: int) -> bytes:
        return _exact(self.sock, n)


def _exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``sock`` (a socket with a timeout reads in pieces: no MSG_WAITALL)."""
    data = bytearray()
    while len(data) < n:
        got = sock.recv(n - len(data))
        if not got:
            raise RuntimeFailure("the replica connection closed in the middle of a frame")
        data += got
    return bytes(data)


class Replica:
    """A rank's side of its snapshot's copy on a peer host: ``send`` each slot written, and
    wait for the keeper's ``ok``. A copy that fails (the peer host is gone, a timeout) is not
    the step's failure: ``broken`` says why, and the snapshots go on without a copy."""

    def __init__(self, address: Sequence[Any], key: bytes, rank: int, text: bytes,
                 timeout_s: float) -> None:
        self.address, self.key, self.rank, self.text = tuple(address), key, rank, text
        self.timeout_s = timeout_s
        self.wire: Wire | None = None
        self.broken: str | None = None
        self.said = False                 # whether the worker has told the controller

    def send(self, slot: int, step: int, data: memoryview, steps: list[int]) -> None:
        if self.broken is not None:
            return
        try:
            if self.wire is None:
                sock = socket.create_connection(self.address[:2], timeout=self.timeout_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.wire = Wire(sock, self.key, _exact(sock, _NONCE))
                self.wire.send({"k": "hello", "rank": self.rank, "index": self.text.decode()})
            mac = hmac.new(self.wire.key, digestmod="sha256")
            self.wire.send({"k": "slot", "slot": slot, "nbytes": len(data)}, data, mac)
            self.wire.send({"k": "seal", "slot": slot, "step": step, "steps": steps,
                            "mac": mac.hexdigest()})
            answer = self.wire.recv()
            if answer is None or answer.get("k") != "ok":
                raise RuntimeFailure(f"the keeper did not take the copy ({answer})")
        except (OSError, RuntimeFailure, ValueError) as exc:
            self.broken = (f"its copy on {self.address[0]}:{self.address[1]} failed: "
                           f"{type(exc).__name__}: {exc}")
            self.close()

    def close(self) -> None:
        if self.wire is not None:
            try:
                self.wire.sock.close()
            except OSError:
                pass
            self.wire = None


def serve_replica(sock: socket.socket, key: bytes, path_of: Callable[[int], str],
                  hello_s: float = 5.0, vetted: Callable[[], None] = lambda: None) -> None:
    """A keeper's side of one rank's replica connection (``Replica``): lay the copy out as
    the rank's file is (``path_of(rank)``: the memory file the keeper holds for it), then
    take each slot into it, valid once sealed. The MAC'd hello must come within ``hello_s``
    (then ``vetted()``; a silent or keyless connection holds nothing longer). Returns when the
    rank closes the connection; raises on a frame that is not the rank's."""
    sock.settimeout(hello_s)
    nonce = os.urandom(_NONCE)
    sock.sendall(nonce)
    wire = Wire(sock, key, nonce)
    hello = wire.recv()
    if hello is None or hello.get("k") != "hello":
        raise RuntimeFailure("a replica connection did not say hello")
    sock.settimeout(None)
    vetted()
    rank = int(hello["rank"])
    snap = Snapshot.mirror(path_of(rank), str(hello["index"]).encode(), rank=rank)
    try:
        while (head := wire.recv()) is not None:
            if head.get("k") != "slot" or int(head["nbytes"]) != snap.slot_bytes \
                    or head.get("slot") not in (0, 1):
                raise RuntimeFailure(f"rank {rank}'s replica: unexpected frame {head}")
            slot = int(head["slot"])
            snap._set(slot, INVALID)
            base = snap.header_bytes + slot * snap.slot_bytes
            mac = hmac.new(wire.key, digestmod="sha256")
            with memoryview(snap._map) as whole, whole[base:base + snap.slot_bytes] as view:
                wire.recv_into(view, mac)
            seal = wire.recv()
            if seal is None or seal.get("k") != "seal" or seal.get("slot") != slot or \
                    not hmac.compare_digest(str(seal.get("mac")), mac.hexdigest()):
                raise RuntimeFailure(f"rank {rank}'s replica: the slot did not check out")
            snap._set(slot, int(seal["step"]))
            other = 1 - slot                 # the rank dropped its other slot: so does the copy
            if _HEAD.unpack_from(snap._map, 0)[2 + other] != int(seal["steps"][other]):
                snap._set(other, INVALID)
            wire.send({"k": "ok"})
    finally:
        snap.close()


class Held(Protocol):
    """Snapshot files the controller reads: ``SnapshotFiles`` on its host, or
    ``_keepers.MeshSnapshots`` for a mesh whose ranks' files are on several hosts."""

    def held(self, ranks: Iterable[int]) -> Mapping[int, list[int] | None]: ...

    def read(self, step: int, want: Mapping[int, Sequence[str]]
             ) -> Mapping[int, Mapping[str, torch.Tensor]]: ...


def read_mesh(files: Held, owners: Mapping[tuple[int, str], int],
              choose: Callable[[list[list[int]]], int | None]
              ) -> tuple[int, list[dict[str, torch.Tensor]]] | None:
    """The controller reads a whole mesh's snapshot itself (``distribute(elastic=)``: the
    ranks are gone, their files are not): the step ``choose`` picks from the steps each file
    holding pieces has (``Recovery.restore_point``), and every rank's pieces of it
    (``owners``: (rank, name) -> the rank whose file holds that piece). None when no step is
    chosen or a file was never written."""
    holders = sorted(set(owners.values()))
    held = files.held(holders)
    if any(held[r] is None for r in holders):
        return None
    step = choose([list(held[r] or ()) for r in holders])
    if step is None:
        return None
    wanted: dict[int, set[str]] = {}
    for (_, name), owner in owners.items():
        wanted.setdefault(owner, set()).add(name)
    got = files.read(step, {r: sorted(names) for r, names in wanted.items()})
    n = 1 + max(rank for rank, _ in owners)
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
    for (rank, name), owner in owners.items():
        out[rank][name] = got[owner][name]
    return step, out
