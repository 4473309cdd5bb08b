"""The worker side of ``push_files`` (loaded through ``MESHPLAN_WORKER_PLUGINS``); the design is
in ``_files``.

Three handlers per push: ``files.prepare`` (create folders, find what is missing, open a
listening port; blocks while it hashes existing destination files), ``files.start`` (start the
transfer thread; returns at once) and ``files.wait`` (blocks the worker's serving thread until
the transfer thread is done, then reports). A rank that only shares another rank's destination
answers all three at once.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import queue
import socket
import stat
import threading
import time
from collections import Counter
from typing import Any

from ._files import (
    MAX_RESENDS,
    FileEntry,
    Link,
    LinkError,
    Sender,
    connect,
    content_hash,
    hash_file,
    needed_ranges,
)
from ._channel import address_toward
from ._worker import WorkerState, register

_CHECKPOINT_S = 0.5
HELLO_S = 5.0           # a connection to a writer's listener must authenticate by then
MAX_PENDING = 16        # connections vetted at once; more are closed when accepted
_REPORT_GRACE_S = 2.0


def _pushes(state: WorkerState) -> dict[str, Push]:
    if not hasattr(state.ns, "file_pushes"):
        state.ns.file_pushes = {}
    return state.ns.file_pushes


@register("files.prepare")
def _prepare(state: WorkerState, header: dict[str, Any], tensors: list) -> tuple[dict, list]:
    if header.get("role") == "shared":
        return {"role": "shared"}, []
    push = Push(header)
    _pushes(state)[push.id] = push
    return {"need": {str(f): needed_ranges(sorted(c)) for f, c in push.need.items()},
            "addr": list(push.address)}, []


@register("files.start")
def _start(state: WorkerState, header: dict[str, Any], tensors: list) -> tuple[dict, list]:
    push = _pushes(state).get(header["push"])
    if push is not None:
        push.start(header["succ"], header.get("succ_rank"), header.get("pred_rank"))
    return {}, []


@register("files.wait")
def _wait(state: WorkerState, header: dict[str, Any], tensors: list) -> tuple[dict, list]:
    push = _pushes(state).pop(header["push"], None)
    if push is None:
        return {"role": "shared"}, []
    push.thread.join()
    if isinstance(push.error, LinkError):
        # A neighbour vanished, most likely: give the controller time to see that exit (the
        # cause) before this rank's error (the consequence) reaches it.
        time.sleep(_REPORT_GRACE_S)
    if push.error is not None:
        raise push.error
    return {"stats": dict(push.stats), "needed": sorted(push.need)}, []


def _partial(path: str) -> str:
    head, name = os.path.split(path)
    return os.path.join(head, f".{name}.mppart")


class Push:
    """One push on one writer: its files, the chunks it still needs, and the transfer thread."""

    def __init__(self, h: dict[str, Any]) -> None:
        self.id, self.key, self.pos = h["push"], bytes.fromhex(h["key"]), int(h["pos"])
        self.root, self.window, self.io_timeout_s = h["dest"], int(h["window"]), h["io_timeout_s"]
        self.corrupt_frame, self.delay_s = h.get("corrupt_frame"), float(h.get("delay_s") or 0)
        self.rate = h.get("rate")             # bytes/s on the link to the successor, or None
        m = h["manifest"]
        self.chunk_bytes = int(m["chunk_bytes"])
        self.files = [FileEntry(p, s, mode, digest, tuple(ch)) for p, s, mode, digest, ch in m["files"]]
        self.dirs, self.links = [tuple(d) for d in m["dirs"]], [tuple(x) for x in m["links"]]
        self.stats: Counter[str] = Counter(files_written=0, files_skipped=0, bytes_written=0,
                                           bytes_resumed=0, chunks_rejected=0, chunks_resent=0)
        self.need: dict[int, set[int]] = {}     # file -> chunks still to receive
        self.have: dict[int, set[int]] = {}     # file -> chunks verified in its partial file
        self.fds: dict[int, int] = {}
        self.dirty: set[int] = set()
        self.error: BaseException | None = None
        self._make_folders()
        for f, entry in enumerate(self.files):
            self._plan_file(f, entry)
        bind = h.get("bind") or "127.0.0.1"
        try:
            self.listener = socket.create_server((bind, 0))
        except OSError as exc:
            if exc.errno != errno.EADDRNOTAVAIL:
                raise
            # the controller's address, on another host: listen on this host's address on
            # the way there, which the other ranks (on that network) reach too
            bind = address_toward(socket.AF_INET6 if ":" in bind else socket.AF_INET,
                                  (bind, 9))
            self.listener = socket.create_server((bind, 0))
        self.listener.settimeout(self.io_timeout_s)
        host = socket.gethostname() if bind in ("", "0.0.0.0", "::") else bind
        self.address = (host, self.listener.getsockname()[1])
        self.thread = threading.Thread(target=self._run, name="meshplan-files", daemon=True)

    # -- prepare ----------------------------------------------------------------------------

    def _make_folders(self) -> None:
        os.makedirs(self.root, exist_ok=True)
        probe = os.path.join(self.root, f".meshplan-probe-{self.id}")
        with open(probe, "wb"):
            pass
        os.remove(probe)
        for rel, _ in self.dirs:
            os.makedirs(self._dest(rel), exist_ok=True)

    def _dest(self, rel: str) -> str:
        parts = rel.split("/")
        if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"manifest path {rel!r} is not a plain relative path")
        return os.path.join(self.root, *parts)

    def _plan_file(self, f: int, entry: FileEntry) -> None:
        if content_hash([bytes.fromhex(c) for c in entry.chunks]) != entry.hash:
            raise ValueError(f"manifest entry {entry.path}: its hash does not match its chunks")
        dest = self._dest(entry.path)
        try:
            st = os.lstat(dest)
        except FileNotFoundError:
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(f"{dest} is a folder at the destination; SRC has a file there")
        if (st is not None and stat.S_ISREG(st.st_mode) and st.st_size == entry.size
                and hash_file(dest, self.chunk_bytes, entry.size)[0] == entry.hash):
            if stat.S_IMODE(st.st_mode) != entry.mode:
                os.chmod(dest, entry.mode)
            self.stats["files_skipped"] += 1
            return
        self.have[f] = self._resume(entry, _partial(dest))
        self.need[f] = set(range(len(entry.chunks))) - self.have[f]

    def _resume(self, entry: FileEntry, part: str) -> set[int]:
        """Chunks of a former push's partial file that still match the manifest (re-hashed)."""
        try:
            with open(part + ".json") as f:
                side = json.load(f)
            ok = (isinstance(side, dict) and side.get("hash") == entry.hash
                  and side.get("chunk_bytes") == self.chunk_bytes
                  and isinstance(side.get("chunks"), list) and os.path.getsize(part) == entry.size)
        except (OSError, ValueError):
            ok = False
        if not ok:
            for path in (part, part + ".json"):
                if os.path.lexists(path):
                    os.remove(path)
            return set()
        have = set()
        with open(part, "rb") as f:
            for c in side["chunks"]:
                if isinstance(c, int) and 0 <= c < len(entry.chunks):
                    data = os.pread(f.fileno(), self.chunk_bytes, c * self.chunk_bytes)
                    if hashlib.sha256(data).hexdigest() == entry.chunks[c]:
                        have.add(c)
                        self.stats["bytes_resumed"] += len(data)
        return have

    # -- transfer ---------------------------------------------------------------------------

    def start(self, succ: list[Any] | None, succ_rank: int | None, pred_rank: int | None) -> None:
        self.succ = succ
        self.succ_name = f"rank {succ_rank}"
        self.pred_name = "the controller" if pred_rank is None else f"rank {pred_rank}"
        self.thread.start()

    def _run(self) -> None:
        link = fwd = None
        try:
            for f in [f for f, need in self.need.items() if not need]:
                self._finish_file(f)
            if self.succ is not None:
                fwd = _Forwarder(connect(self.succ, self.key, self.id, self.pos, self.pos + 1,
                                         self.io_timeout_s, self.chunk_bytes, self.succ_name,
                                         self.rate),
                                 self.window, self.corrupt_frame)
            link = self._accept()
            self._receive(link, fwd)
            link.send({"k": "done"})
            if fwd is not None:
                fwd.finish(self.io_timeout_s)
                self.stats["chunks_resent"] = fwd.sender.resent
            self._finish_tree()
        except BaseException as exc:  # noqa: BLE001 - reported by files.wait
            self.error = exc
            self._checkpoint()
            if link is not None:
                try:
                    link.send({"k": "fail", "why": f"{type(exc).__name__}: {exc}"})
                except LinkError:
                    pass
        finally:
            for part in (link, fwd and fwd.sender.link):
                if part is not None:
                    part.close()
            self.listener.close()
            for fd in self.fds.values():
                os.close(fd)
            self.fds.clear()

    def _accept(self) -> Link:
        """The first connection that says a valid hello for this push. Each connection is
        vetted on a thread of its own and must send its MAC'd hello within ``HELLO_S``, so a
        connection that stays silent (or many: at most ``MAX_PENDING`` are vetted at once,
        more are closed at accept) cannot hold the listener until the push times out."""
        deadline = time.monotonic() + self.io_timeout_s
        found: queue.Queue[Link] = queue.Queue()
        pending = threading.BoundedSemaphore(MAX_PENDING)
        won = threading.Event()

        def vet(sock: socket.socket) -> None:
            link = Link(sock, self.key, self.id, self.pos, self.pos - 1, self.chunk_bytes,
                        self.pred_name)
            try:
                sock.settimeout(HELLO_S)
                if link.recv()[0].get("k") == "hello" and not won.is_set():
                    won.set()
                    sock.settimeout(self.io_timeout_s)
                    found.put(link)
                    return
            except (LinkError, ValueError, OSError):
                pass
            finally:
                pending.release()
            link.close()

        self.listener.settimeout(0.1)
        while found.empty():
            if time.monotonic() >= deadline:
                raise LinkError(f"{self.pred_name} did not connect within "
                                f"{self.io_timeout_s} s")
            try:
                sock, _ = self.listener.accept()
            except socket.timeout:
                continue
            if not pending.acquire(blocking=False):
                sock.close()                      # too many unauthenticated connections
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=vet, args=(sock,), name="meshplan-files-hello",
                             daemon=True).start()
        return found.get()

    def _receive(self, link: Link, fwd: _Forwarder | None) -> None:
        expected, received = None, set()
        nacks: Counter[tuple[int, int]] = Counter()
        last = time.monotonic()
        while expected is None or len(received) < expected:
            doc, payload = link.recv()
            if doc.get("k") == "end":
                expected = int(doc["n"])
                continue
            f, c, upto = int(doc["f"]), int(doc["c"]), int(doc["u"])
            if hashlib.sha256(payload).hexdigest() != self.files[f].chunks[c]:
                self.stats["chunks_rejected"] += 1
                nacks[(f, c)] += 1
                if nacks[(f, c)] > MAX_RESENDS:
                    raise LinkError(f"chunk {c} of {self.files[f].path} failed its checksum "
                                    f"{nacks[(f, c)]} times (did SRC change during the push?)")
                link.send({"k": "nack", "f": f, "c": c})
                continue
            if (f, c) in received:
                continue
            received.add((f, c))
            if fwd is not None and upto > self.pos:
                fwd.put(f, c, upto, payload)
            link.send({"k": "ack", "f": f, "c": c})
            if c in self.need.get(f, ()):
                self._write(f, c, payload)
            if self.delay_s:
                time.sleep(self.delay_s)
            if time.monotonic() - last > _CHECKPOINT_S:
                self._checkpoint()
                last = time.monotonic()

    def _write(self, f: int, c: int, payload: bytearray) -> None:
        entry = self.files[f]
        if f not in self.fds:
            fd = os.open(_partial(self._dest(entry.path)), os.O_RDWR | os.O_CREAT, 0o600)
            os.ftruncate(fd, entry.size)
            self.fds[f] = fd
        view, offset = memoryview(payload), c * self.chunk_bytes
        while view:
            n = os.pwrite(self.fds[f], view, offset)
            view, offset = view[n:], offset + n
        self.stats["bytes_written"] += len(payload)
        self.need[f].discard(c)
        self.have[f].add(c)
        self.dirty.add(f)
        if not self.need[f]:
            self._finish_file(f)

    def _finish_file(self, f: int) -> None:
        """Mode, fsync, rename into place; drop the sidecar."""
        entry = self.files[f]
        dest = self._dest(entry.path)
        part = _partial(dest)
        fd = self.fds.pop(f, None)
        if fd is None:
            fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o600)
            os.ftruncate(fd, entry.size)
        try:
            os.fchmod(fd, entry.mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(part, dest)
        if os.path.exists(part + ".json"):
            os.remove(part + ".json")
        self.dirty.discard(f)
        self.stats["files_written"] += 1

    def _checkpoint(self) -> None:
        """Rewrite the sidecar of every partial file that got chunks since the last one."""
        for f in sorted(self.dirty):
            entry = self.files[f]
            side = _partial(self._dest(entry.path)) + ".json"
            try:
                with open(side + ".tmp", "w") as out:
                    json.dump({"hash": entry.hash, "chunk_bytes": self.chunk_bytes,
                               "size": entry.size, "chunks": sorted(self.have[f])}, out)
                os.replace(side + ".tmp", side)
            except OSError:
                pass
        self.dirty.clear()

    def _finish_tree(self) -> None:
        """Symlinks, folder modes (deepest first), then fsync every folder we wrote into."""
        for rel, text in self.links:
            dest = self._dest(rel)
            if os.path.islink(dest) and os.readlink(dest) == text:
                continue
            if os.path.isdir(dest) and not os.path.islink(dest):
                raise IsADirectoryError(f"{dest} is a folder at the destination; SRC has a "
                                        "symlink there")
            tmp = os.path.join(os.path.dirname(dest), f".{os.path.basename(dest)}.mplink")
            if os.path.lexists(tmp):
                os.remove(tmp)
            os.symlink(text, tmp)
            os.replace(tmp, dest)
        for rel, mode in reversed(self.dirs):
            os.chmod(self._dest(rel), mode)
        folders = {self.root} | {os.path.dirname(self._dest(e.path)) for e in self.files}
        for folder in folders:
            fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


class _Forwarder:
    """Sends verified chunks on to the successor from its own thread (bounded queue)."""

    def __init__(self, link: Link, window: int, corrupt_frame: int | None) -> None:
        self.sender = Sender(link, window, corrupt_frame)
        self.queue: queue.Queue = queue.Queue(maxsize=window)
        self.count = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="meshplan-files-fwd", daemon=True)
        self.thread.start()

    def put(self, f: int, c: int, upto: int, payload: bytearray) -> None:
        self._put((f, c, upto, payload))
        self.count += 1

    def finish(self, timeout_s: float) -> None:
        self._put(None)
        self.thread.join()
        self._raise()
        self.sender.finish(self.count, timeout_s)

    def _put(self, item: Any) -> None:
        while True:
            self._raise()
            try:
                self.queue.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def _raise(self) -> None:
        if self.error is not None:
            raise LinkError(f"forwarding to the next rank failed: {self.error}") from self.error

    def _run(self) -> None:
        try:
            while (item := self.queue.get()) is not None:
                self.sender.put(*item)
        except BaseException as exc:  # noqa: BLE001 - raised in the receiving thread
            self.error = exc
