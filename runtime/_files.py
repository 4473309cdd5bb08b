"""File distribution: ``push_files`` ships a file tree from the controller to every rank.

Design (the controller side lives here, the worker side in ``_files_worker``):

* **Manifest.** The controller scans SRC once: folders, symlinks, and each regular file's size,
  mode and one sha256 digest per chunk (``chunk_bytes``, 4 MiB by default). A file's content hash
  is the sha256 of its concatenated chunk digests (a hash list, like Dropbox's content hash).
* **Who writes.** ``PATH_TEMPLATE`` may use ``{rank}`` and ``{host}``; relative results resolve
  against the controller's working directory. The first rank of each distinct (host, path) writes
  it; the others are reported as ``shared`` and get no data.
* **Prepare.** Over the authenticated control channel each writer gets the manifest, its path, its
  chain position and a fresh random 32-byte key for this push. It creates the folders, skips files
  whose destination already has the same content hash (fixing only the mode), resumes partial
  files (below), opens a listening TCP port and answers with the chunks it still needs.
* **Chain.** controller -> writer 0 -> writer 1 -> ... over direct TCP connections, never through
  the control channel. The controller sends each needed chunk once, tagged with the last chain
  position that needs it; a writer forwards a chunk when a later writer needs it and writes it
  when it does. A forwarding thread per writer and a window of ``window`` unacknowledged chunks
  per link keep several chunks in flight: a rank forwards chunk k while it receives chunk k+1.
* **Frames.** ``(header length, payload length) | JSON header | HMAC-SHA256(key, the two before) |
  payload``. The MAC authenticates the header (push id, sender, receiver, sequence number, file,
  chunk, lengths); the payload must match its chunk digest from the manifest, which came over the
  authenticated control channel. Nothing is unpickled. A chunk failing its digest is NACKed and
  resent from the sender's window (at most 3 times); a header failing its MAC ends the push.
  The per-file check: a writer refuses a manifest entry whose content hash does not match its
  chunk list, and renames a file into place only once every chunk matched its digest.
* **Writing.** Chunks go by offset into ``.NAME.mppart`` in the destination folder; when a file's
  last chunk is verified: fchmod, fsync, ``os.replace``; folders are fsynced at the end. Next to
  a partial file a JSON sidecar ``.NAME.mppart.json`` lists its verified chunks (rewritten at
  most every 0.5 s and when a push fails; a hint only, see below).
* **A dead rank.** The launcher's contract is that one failed rank stops every worker, so the
  chain is *not* repaired around a dead rank: the push raises :class:`RuntimeFailure` naming it.
  Complete files stay in place, partial files keep their sidecars, and running the same push
  again (on fresh workers) resumes: it skips complete files, re-hashes the chunks a sidecar lists
  against the manifest, and sends only what is missing (tested: strictly fewer bytes).
* **Tree semantics.** Nested and empty folders are created (modes preserved, applied last); empty
  files are written; file modes (the executable bit included) are preserved; owners and times
  are not. A symlink whose resolved target lies inside SRC is recreated as a (relative) symlink;
  one pointing outside SRC is refused with an error naming it (copying it would ship data the
  caller did not choose). FIFOs, sockets and devices are refused. Files at the destination that
  are not in SRC are left alone: this is a push, not a mirror.

Every data link has a socket timeout (``io_timeout_s``), so a stuck peer ends as an error.
``bwlimit`` holds every sender (the controller and each forwarding writer) to that many bytes/s
(``Pacer``, a token bucket); each link carries the data once, so it is also each host's share.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import stat
import string
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .._errors import RuntimeFailure

__all__ = ["FILES_PLUGIN", "PushResult", "RankStatus", "push_files"]

logger = logging.getLogger(__name__)

FILES_PLUGIN = "meshplan.runtime._files_worker"     # the worker handlers, for MESHPLAN_WORKER_PLUGINS
CONTROLLER_POS = -1
DEFAULT_CHUNK = 4 << 20
MAX_RESENDS = 3
_PREFIX = struct.Struct("!II")           # header length, payload length
_MAC_SIZE = 32
_MAX_HEADER = 1 << 16
_TEMPLATE_KEYS = ("rank", "host")


# ---------------------------------------------------------------------------------------------
# the source tree


@dataclass(frozen=True, slots=True)
class FileEntry:
    path: str                      # relative, '/'-separated
    size: int
    mode: int                      # permission bits (stat.S_IMODE)
    hash: str                      # sha256 of the concatenated chunk digests
    chunks: tuple[str, ...]        # sha256 hex of each chunk


@dataclass(frozen=True, slots=True)
class Tree:
    root: str
    chunk_bytes: int
    dirs: tuple[tuple[str, int], ...]         # (relative path, mode), parents first
    files: tuple[FileEntry, ...]
    links: tuple[tuple[str, str], ...]        # (relative path, link text)

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    def manifest(self) -> dict[str, Any]:
        return {"chunk_bytes": self.chunk_bytes, "dirs": [list(d) for d in self.dirs],
                "links": [list(link) for link in self.links],
                "files": [[f.path, f.size, f.mode, f.hash, list(f.chunks)] for f in self.files]}


def content_hash(digests: Sequence[bytes]) -> str:
    return hashlib.sha256(b"".join(digests)).hexdigest()


def hash_file(path: str, chunk_bytes: int, size: int) -> tuple[str, tuple[str, ...]]:
    """(content hash, chunk digests) of the file at ``path``."""
    digests: list[bytes] = []
    buf = bytearray(min(chunk_bytes, max(size, 1)))
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(view)
            if not n:
                break
            digests.append(hashlib.sha256(view[:n]).digest())
    return content_hash(digests), tuple(d.hex() for d in digests)


def scan_tree(src: str | os.PathLike, chunk_bytes: int = DEFAULT_CHUNK) -> Tree:
    """The manifest of ``src`` (a folder, or one file pushed as ``DEST/NAME``)."""
    root = os.path.abspath(os.fspath(src))
    if not os.path.lexists(root):
        raise RuntimeFailure(f"files push: SRC {root} does not exist; pass an existing folder or file")
    if not os.path.isdir(root):
        if not os.path.isfile(root):
            raise RuntimeFailure(f"files push: SRC {root} is not a folder or a regular file")
        return Tree(os.path.dirname(root), chunk_bytes, (),
                    (_file_entry(root, os.path.basename(root), chunk_bytes),), ())
    real_root = os.path.realpath(root)
    dirs, files, links = [], [], []
    for here, dirnames, filenames in os.walk(root, followlinks=False, onerror=_walk_error):
        dirnames.sort()
        rel_here = os.path.relpath(here, root)
        for name in sorted(dirnames + filenames):
            path = os.path.join(here, name)
            rel = name if rel_here == "." else f"{rel_here}/{name}".replace(os.sep, "/")
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                links.append((rel, _link_text(real_root, path)))
            elif stat.S_ISDIR(st.st_mode):
                dirs.append((rel, stat.S_IMODE(st.st_mode)))
            elif stat.S_ISREG(st.st_mode):
                files.append(_file_entry(path, rel, chunk_bytes))
            else:
                raise RuntimeFailure(f"files push: {path} is not a regular file, folder or symlink "
                                     "(a FIFO, socket or device); remove it from SRC")
    return Tree(root, chunk_bytes, tuple(dirs), tuple(files), tuple(links))


def _walk_error(exc: OSError) -> None:
    raise RuntimeFailure(f"files push: cannot read {exc.filename}: {exc.strerror}") from exc


def _file_entry(path: str, rel: str, chunk_bytes: int) -> FileEntry:
    st = os.stat(path)
    try:
        digest, chunks = hash_file(path, chunk_bytes, st.st_size)
    except OSError as exc:
        raise RuntimeFailure(f"files push: cannot read {path}: {exc.strerror}") from exc
    return FileEntry(rel, st.st_size, stat.S_IMODE(st.st_mode), digest, chunks)


def _link_text(real_root: str, path: str) -> str:
    """The target to recreate for the symlink ``path``; refuses links that leave the tree."""
    text = os.readlink(path)
    real = os.path.realpath(path)
    if real != real_root and not real.startswith(real_root + os.sep):
        raise RuntimeFailure(
            f"files push: symlink {path} -> {text} points outside SRC ({real}); only links "
            "inside the tree are recreated: replace it with a copy of its target, or push the "
            "target's folder instead")
    if os.path.isabs(text):     # keep the tree relocatable
        text = os.path.relpath(real, os.path.realpath(os.path.dirname(path)))
    return text


# ---------------------------------------------------------------------------------------------
# destinations


def check_template(template: str) -> None:
    """Raise RuntimeFailure unless ``template`` uses only ``{rank}`` and ``{host}``."""
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise RuntimeFailure(f"files push: --dest {template!r} is not a valid template ({exc}); "
                             "use {rank} and {host}, and {{ }} for literal braces") from None
    bad = [f for f in fields if f not in _TEMPLATE_KEYS]
    if bad:
        raise RuntimeFailure(f"files push: --dest {template!r} uses {{{bad[0]}}}; a destination "
                             "template may only use {rank} and {host}")
    try:
        template.format(rank=0, host="h")
    except (ValueError, TypeError) as exc:
        raise RuntimeFailure(f"files push: --dest {template!r}: {exc}") from None


def destinations(template: str, hostnames: Sequence[str]) -> list[str]:
    check_template(template)
    return [os.path.abspath(template.format(rank=r, host=h)) for r, h in enumerate(hostnames)]


# ---------------------------------------------------------------------------------------------
# the data link: authenticated frames over one TCP connection


class LinkError(RuntimeFailure):
    """A data link broke, timed out or received a frame that failed its checks."""


class Pacer:
    """Holds one sender's payload bytes to ``rate`` bytes/s, like rsync's ``--bwlimit``.

    A token bucket, as a NIC draining its send queue is: bytes go out in slices of ``SLICE``,
    each once the previous ones' share of time has passed; a sender that comes back late
    (descheduled, busy hashing) may catch up by at most ``BURST`` bytes, so a moment's delay
    does not lose the link's time for good, and no stretch ever exceeds the rate by more than
    ``BURST`` + ``SLICE`` bytes. A push keeps the links it uses from starving a running job's
    traffic this way; the benchmark gives each rank a link of its own speed with it
    (``benchmarks/files.py --link-rate``).
    """

    SLICE = 256 << 10
    BURST = 1 << 20

    def __init__(self, rate: float) -> None:
        if not rate > 0:
            raise RuntimeFailure(f"files push: bwlimit={rate!r}: expected bytes per second > 0")
        self.rate = float(rate)
        self._next = time.monotonic()      # when the bytes sent so far have had their time

    def send(self, sock: socket.socket, payload: Any) -> None:
        view = memoryview(payload).cast("B")
        for start in range(0, len(view), self.SLICE):
            piece = view[start:start + self.SLICE]
            now = time.monotonic()
            if self._next > now:
                time.sleep(self._next - now)
                now = time.monotonic()
            self._next = max(self._next, now - self.BURST / self.rate) + len(piece) / self.rate
            sock.sendall(piece)


class Link:
    """One direction-agnostic TCP connection between two chain positions of one push.
    ``rate``: bytes/s this end may send payload at (None: as fast as the socket takes it)."""

    def __init__(self, sock: socket.socket, key: bytes, push: str, me: int, peer: int,
                 max_payload: int, peer_name: str | None = None,
                 rate: float | None = None) -> None:
        self.sock, self.key, self.push, self.me, self.peer = sock, key, push, me, peer
        self.name = peer_name or _who(peer)
        self.max_payload = max_payload
        self._pacer = Pacer(rate) if rate is not None else None
        self._send_lock = threading.Lock()
        self._seq = 0
        self._last_seq = 0

    def send(self, header: dict[str, Any], payload: bytes | bytearray | memoryview = b"") -> None:
        with self._send_lock:
            self._seq += 1
            doc = dict(header, push=self.push, src=self.me, dst=self.peer, seq=self._seq)
            head = json.dumps(doc, separators=(",", ":")).encode()
            prefix = _PREFIX.pack(len(head), memoryview(payload).nbytes)
            mac = hmac.digest(self.key, prefix + head, "sha256")
            try:
                self.sock.sendall(prefix + head + mac)
                if payload and self._pacer is not None:
                    self._pacer.send(self.sock, payload)
                elif payload:
                    self.sock.sendall(payload)
            except OSError as exc:
                raise LinkError(f"sending to {self.name} failed: {exc}") from exc

    def recv(self) -> tuple[dict[str, Any], bytearray]:
        prefix = self._read(_PREFIX.size)
        head_len, payload_len = _PREFIX.unpack(prefix)
        if head_len > _MAX_HEADER or payload_len > self.max_payload:
            raise LinkError(f"a frame from {self.name} announces {head_len} header and "
                            f"{payload_len} payload bytes: not a frame of this push")
        head = self._read(head_len)
        mac = self._read(_MAC_SIZE)
        if not hmac.compare_digest(mac, hmac.digest(self.key, prefix + head, "sha256")):
            raise LinkError(f"a frame from {self.name} failed its MAC (wrong key or tampered)")
        doc = json.loads(head)
        if (doc.get("push") != self.push or doc.get("src") != self.peer or doc.get("dst") != self.me
                or not isinstance(doc.get("seq"), int) or doc["seq"] <= self._last_seq):
            raise LinkError(f"a frame from {self.name} has a bad push/src/dst/seq: {doc}")
        self._last_seq = doc["seq"]
        payload = bytearray(payload_len)
        self._read_into(memoryview(payload))
        return doc, payload

    def _read(self, n: int) -> bytes:
        buf = bytearray(n)
        self._read_into(memoryview(buf))
        return bytes(buf)

    def _read_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            try:
                n = self.sock.recv_into(view[got:])
            except OSError as exc:
                raise LinkError(f"receiving from {self.name} failed: {exc}") from exc
            if not n:
                raise LinkError(f"{self.name} closed the data connection mid-push")
            got += n

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _who(pos: int) -> str:
    return "the controller" if pos == CONTROLLER_POS else f"chain position {pos}"


def connect(address: Sequence[Any], key: bytes, push: str, me: int, peer: int,
            timeout_s: float, max_payload: int, peer_name: str | None = None,
            rate: float | None = None) -> Link:
    sock = socket.create_connection((address[0], int(address[1])), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    link = Link(sock, key, push, me, peer, max_payload, peer_name, rate)
    link.send({"k": "hello"})
    return link


class Sender:
    """Sends chunks on ``link`` with at most ``window`` unacknowledged; resends on a NACK.

    ``corrupt_frame``: fault injection for tests; the k-th chunk frame (0-based) goes out once
    with one payload byte flipped *after* signing, as a wire fault would.
    """

    def __init__(self, link: Link, window: int, corrupt_frame: int | None = None,
                 on_ack: Callable[[int], None] | None = None) -> None:
        self.link, self.window, self.on_ack = link, window, on_ack
        self._corrupt = corrupt_frame
        self._sent_frames = 0
        self._unacked: dict[tuple[int, int], tuple[dict[str, Any], Any]] = {}
        self._cv = threading.Condition()
        self._done = False
        self.error: BaseException | None = None
        self.resent = 0
        self.sent_bytes = 0
        self._reader = threading.Thread(target=self._read_acks, daemon=True,
                                        name=f"meshplan-files-acks-{link.me}")
        self._reader.start()

    def put(self, f: int, c: int, upto: int, payload: Any) -> None:
        header = {"k": "chunk", "f": f, "c": c, "u": upto}
        with self._cv:
            while len(self._unacked) >= self.window and self.error is None:
                self._cv.wait(1.0)
            self._raise()
            self._unacked[(f, c)] = (header, payload)
        if self._corrupt is not None and self._sent_frames == self._corrupt:
            bad = bytearray(payload)
            bad[len(bad) // 2] ^= 0xFF
            self.link.send(header, bad)
        else:
            self.link.send(header, payload)
        self._sent_frames += 1
        self.sent_bytes += memoryview(payload).nbytes

    def finish(self, count: int, timeout_s: float) -> None:
        """Announce ``count`` chunks in all; wait until the receiver has verified every one."""
        self.link.send({"k": "end", "n": count})
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while not self._done and self.error is None:
                if time.monotonic() > deadline:
                    raise LinkError(f"{self.link.name} did not confirm the end of the "
                                    f"push within {timeout_s} s")
                self._cv.wait(1.0)
            self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise LinkError(str(self.error)) from self.error

    def _read_acks(self) -> None:
        try:
            while True:
                doc, _ = self.link.recv()
                kind = doc.get("k")
                if kind == "ack":
                    with self._cv:
                        _, payload = self._unacked.pop((doc["f"], doc["c"]))
                        self._cv.notify_all()
                    if self.on_ack is not None:
                        self.on_ack(memoryview(payload).nbytes)
                elif kind == "nack":
                    with self._cv:
                        header, payload = self._unacked[(doc["f"], doc["c"])]
                    self.resent += 1
                    self.link.send(header, payload)
                elif kind == "done":
                    with self._cv:
                        self._done = True
                        self._cv.notify_all()
                    return
                elif kind == "fail":
                    raise LinkError(f"{self.link.name} failed: {doc.get('why')}")
        except BaseException as exc:  # noqa: BLE001 - handed to the sending thread
            with self._cv:
                if not self._done:
                    self.error = exc
                self._cv.notify_all()


def needed_ranges(chunks: Sequence[int]) -> list[list[int]]:
    """Sorted chunk indices -> ``[[start, stop), ...]``."""
    out: list[list[int]] = []
    for c in chunks:
        if out and out[-1][1] == c:
            out[-1][1] = c + 1
        else:
            out.append([c, c + 1])
    return out


# ---------------------------------------------------------------------------------------------
# results


@dataclass(frozen=True, slots=True)
class RankStatus:
    """What one rank did. ``role``: ``writer``, or ``shared`` (rank ``shares_with`` wrote the same
    destination on the same host)."""

    rank: int
    host: str
    dest: str
    role: str
    shares_with: int | None = None
    files_written: int = 0
    files_skipped: int = 0
    bytes_written: int = 0         # chunk bytes received and written by this push
    bytes_resumed: int = 0         # chunk bytes found verified in partial files from a former push
    chunks_rejected: int = 0       # received chunks that failed their digest (then resent)
    chunks_resent: int = 0         # chunks this rank resent to its successor after a NACK


@dataclass(frozen=True, slots=True)
class PushResult:
    """``bytes_sent``: payload bytes the controller put into the chain (each chunk once, however
    many ranks need it); files count as sent when any rank needed them."""

    files: int
    dirs: int
    symlinks: int
    bytes: int
    files_sent: int
    files_skipped: int
    bytes_sent: int
    bytes_skipped: int
    seconds: float
    scan_seconds: float
    transfer_seconds: float
    ranks: tuple[RankStatus, ...]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# the controller


def push_files(src: str | os.PathLike, dest_template: str, *, workers: Any = None,
               ranks: int | None = None, chunk_bytes: int = DEFAULT_CHUNK, window: int = 8,
               timeout_s: float | None = None, io_timeout_s: float = 60.0,
               bind_host: str | None = None, bwlimit: float | None = None,
               progress: Callable[[int, int], None] | None = None, launcher: str = "local",
               _faults: dict[str, Any] | None = None) -> PushResult:
    """Copy the tree ``src`` to ``dest_template`` (may use ``{rank}``, ``{host}``) on every rank.

    Pass running ``workers`` (launched with ``FILES_PLUGIN`` in ``MESHPLAN_WORKER_PLUGINS``) or
    ``ranks=N`` to launch N workers for this push only (``launcher``: ``"local"`` subprocesses,
    ``"mpi"``, started by ``mpiexec``, or ``"slurm"``: one rank on each of N nodes of the Slurm
    allocation this runs in, or of a new one). Raises RuntimeFailure on bad input
    or a failed rank (after which, per the launcher's contract, all workers are stopped).
    ``progress(done, total)`` gets the bytes rank 0 has verified, from a background thread.
    ``bwlimit``: bytes/s each sender (the controller and every forwarding rank) may put on its
    link, like rsync's ``--bwlimit``; in a chain every link carries the data once, so this is
    also each host's share of its network. None: no limit.
    ``_faults`` (tests): ``{"corrupt": [[sender_rank or -1, frame]], "delay": [rank, s],
    "squat": True}`` (squat: a silent connection to every writer's listener before the chain's).
    """
    if (workers is None) == (ranks is None):
        raise RuntimeFailure("files push: pass either workers= (running workers) or ranks=N")
    if launcher not in ("local", "mpi", "slurm"):
        raise RuntimeFailure(f"files push: unknown launcher {launcher!r}; use 'local', 'mpi' "
                             "or 'slurm'")
    if not isinstance(chunk_bytes, int) or chunk_bytes < 4096 or window < 1:
        raise RuntimeFailure(f"files push: chunk_bytes={chunk_bytes!r} (at least 4096) and "
                             f"window={window!r} (at least 1) are out of range")
    check_template(dest_template)
    if bwlimit is not None:
        Pacer(bwlimit)                      # a bad limit fails here, before any worker starts
    t0 = time.perf_counter()
    tree = scan_tree(src, chunk_bytes)
    scan_s = time.perf_counter() - t0
    opts = dict(window=window, timeout_s=timeout_s, io_timeout_s=io_timeout_s,
                bind_host=bind_host, bwlimit=bwlimit, progress=progress, faults=_faults or {})
    if workers is not None:
        return _push(tree, dest_template, workers, t0, scan_s, **opts)
    if not isinstance(ranks, int) or ranks < 1:
        raise RuntimeFailure(f"files push: --ranks {ranks!r}: push to at least one rank")
    from ._channel import ENV_PLUGINS
    from ._launch import LocalLauncher
    from ._mpi_launch import MPILauncher
    from ._slurm_launch import SlurmLauncher

    plugins = ",".join(filter(None, (os.environ.get(ENV_PLUGINS, ""), FILES_PLUGIN)))
    starter = (MPILauncher() if launcher == "mpi"
               else SlurmLauncher({"nodes": ranks}) if launcher == "slurm" else LocalLauncher())
    with starter.launch(ranks, env={ENV_PLUGINS: plugins}) as launched:
        return _push(tree, dest_template, launched, t0, scan_s, **opts)


def _push(tree: Tree, template: str, workers: Any, t0: float, scan_s: float, *, window: int,
          timeout_s: float | None, io_timeout_s: float, bind_host: str | None,
          bwlimit: float | None, progress: Callable[[int, int], None] | None,
          faults: dict[str, Any]) -> PushResult:
    hosts = list(workers.hostnames)
    dests = destinations(template, hosts)
    owner: dict[tuple[str, str], int] = {}
    for rank, where in enumerate(zip(hosts, dests)):
        owner.setdefault(where, rank)
    chain = sorted(set(owner.values()))
    push, key = secrets.token_hex(8), secrets.token_bytes(32)
    corrupt = {int(r): int(k) for r, k in faults.get("corrupt", [])}
    delay = dict([faults["delay"]]) if "delay" in faults else {}
    common = {"push": push, "key": key.hex(), "manifest": tree.manifest(), "window": window,
              "io_timeout_s": io_timeout_s, "bind": bind_host or workers.master_addr,
              "rate": bwlimit}
    feed: dict[str, Any] = {}
    squatters: list[socket.socket] = []
    try:
        for rank in range(workers.n):
            header = {"push": push, "role": "shared"}
            if rank in chain:
                header = dict(common, dest=dests[rank], pos=chain.index(rank),
                              corrupt_frame=corrupt.get(rank), delay_s=delay.get(rank, 0.0))
            workers.send(rank, "files.prepare", header)
        prepared = [m.header for m in workers.gather("files.prepare", timeout_s)]
        # a peer without the push's key connecting first (tests): it must not hold the push
        squatters += [socket.create_connection(tuple(prepared[r]["addr"]), timeout=5)
                      for r in chain if faults.get("squat")]
        plan = _plan(tree, [prepared[r]["need"] for r in chain])
        for rank in range(workers.n):
            workers.send(rank, "files.start", _neighbours(push, rank, chain, prepared))
        workers.gather("files.start", timeout_s)
        t1 = time.perf_counter()
        thread = threading.Thread(target=_feed, name="meshplan-files-feed", daemon=True, args=(
            tree, plan, chain[0], prepared[chain[0]]["addr"], key, push, window, io_timeout_s,
            bwlimit, corrupt.get(CONTROLLER_POS), progress, feed))
        thread.start()
        workers.broadcast("files.wait", {"push": push})
        done = [m.header for m in workers.gather("files.wait", timeout_s)]
        thread.join()
    except RuntimeFailure as exc:
        link = feed.get("link")
        if link is not None:
            link.close()
        error = feed.get("error")
        if error is not None and not isinstance(error, LinkError):
            raise RuntimeFailure(f"files push: reading SRC failed: {error}") from exc
        raise _explain(exc) from exc
    finally:
        for sock in squatters:
            sock.close()
    if feed.get("error") is not None:
        raise RuntimeFailure(f"files push: {feed['error']}") from feed["error"]
    return _result(tree, plan, chain, hosts, dests, owner, done, t0, scan_s,
                   time.perf_counter() - t1)


def _neighbours(push: str, rank: int, chain: Sequence[int],
                prepared: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The ``files.start`` header of ``rank``: its successor's address, both neighbours' ranks."""
    pos = chain.index(rank) if rank in chain else None
    last = pos is None or pos + 1 == len(chain)
    return {"push": push, "succ": None if last else prepared[chain[pos + 1]]["addr"],
            "succ_rank": None if last else chain[pos + 1],
            "pred_rank": None if not pos else chain[pos - 1]}


def _plan(tree: Tree, needs: Sequence[dict[str, list[list[int]]]]) -> list[tuple[int, int, int]]:
    """(file, chunk, last chain position that needs it) for every chunk some writer needs."""
    plan = []
    for f, entry in enumerate(tree.files):
        upto = [-1] * len(entry.chunks)
        for pos, need in enumerate(needs):
            for start, stop in need.get(str(f), ()):
                for c in range(start, stop):
                    upto[c] = pos
        plan += [(f, c, u) for c, u in enumerate(upto) if u >= 0]
    return plan


def _feed(tree: Tree, plan: Sequence[tuple[int, int, int]], first_rank: int,
          addr: Sequence[Any], key: bytes,
          push: str, window: int, io_timeout_s: float, rate: float | None,
          corrupt_frame: int | None,
          progress: Callable[[int, int], None] | None, out: dict[str, Any]) -> None:
    """The controller's end of the chain: read each planned chunk of SRC and send it to rank 0."""
    total = sum(min(tree.chunk_bytes, tree.files[f].size - c * tree.chunk_bytes)
                for f, c, _ in plan)
    done = [0]

    def on_ack(n: int) -> None:
        done[0] += n
        if progress is not None:
            progress(done[0], total)

    fds: dict[int, int] = {}
    try:
        link = out["link"] = connect(addr, key, push, CONTROLLER_POS, 0, io_timeout_s,
                                     tree.chunk_bytes, f"rank {first_rank}", rate)
        sender = Sender(link, window, corrupt_frame, on_ack)
        if progress is not None:
            progress(0, total)
        for f, c, upto in plan:
            if f not in fds:
                fds[f] = os.open(os.path.join(tree.root, tree.files[f].path), os.O_RDONLY)
            sender.put(f, c, upto, os.pread(fds[f], tree.chunk_bytes, c * tree.chunk_bytes))
        sender.finish(len(plan), io_timeout_s)
        out["resent"] = sender.resent
        link.close()
    except BaseException as exc:  # noqa: BLE001 - reported by the controller's main thread
        out["error"] = exc
        if "link" in out:
            out["link"].close()
    finally:
        for fd in fds.values():
            os.close(fd)


def _explain(exc: RuntimeFailure) -> RuntimeFailure:
    """One clear RuntimeFailure (first line of the workers' report, plus what to do)."""
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    reason = getattr(exc, "reason", None)
    if reason == "error" and getattr(exc, "remote_type", None) == "LookupError" \
            and "no handler for 'files." in str(exc):
        return RuntimeFailure(
            "files push: the workers have no file handlers; launch them with "
            f"env={{'MESHPLAN_WORKER_PLUGINS': '{FILES_PLUGIN}'}} or call push_files(ranks=N)")
    if reason == "exit":
        return RuntimeFailure(
            f"files push: {first}; all workers were stopped. Complete files are in place and "
            "partial ones keep a sidecar of verified chunks: run the same push again to resume")
    if reason is not None:
        return RuntimeFailure(f"files push failed: {first}; all workers were stopped")
    return RuntimeFailure(f"files push: {first}")


def _result(tree: Tree, plan: Sequence[tuple[int, int, int]], chain: Sequence[int],
            hosts: Sequence[str], dests: Sequence[str], owner: dict[tuple[str, str], int],
            done: Sequence[dict[str, Any]], t0: float, scan_s: float,
            transfer_s: float) -> PushResult:
    statuses = []
    for rank, h in enumerate(done):
        if rank in chain:
            statuses.append(RankStatus(rank, hosts[rank], dests[rank], "writer", None, **h["stats"]))
        else:
            statuses.append(RankStatus(rank, hosts[rank], dests[rank], "shared",
                                       owner[(hosts[rank], dests[rank])]))
    sent = set()
    for h in (done[r] for r in chain):
        sent.update(h["needed"])
    bytes_sent = sum(min(tree.chunk_bytes, tree.files[f].size - c * tree.chunk_bytes)
                     for f, c, _ in plan)
    return PushResult(
        files=len(tree.files), dirs=len(tree.dirs), symlinks=len(tree.links), bytes=tree.bytes,
        files_sent=len(sent), files_skipped=len(tree.files) - len(sent), bytes_sent=bytes_sent,
        bytes_skipped=sum(f.size for i, f in enumerate(tree.files) if i not in sent),
        seconds=time.perf_counter() - t0, scan_seconds=scan_s, transfer_seconds=transfer_s,
        ranks=tuple(statuses))
