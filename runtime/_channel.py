"""The signed control channel between the controller and its workers (ZeroMQ).

The controller binds a ROUTER socket; each worker connects a DEALER whose identity is its rank
and a tag only holders of the run's secret can make (``rank.<hmac>``), so nobody can occupy a
rank's identity before the rank connects. Who may connect at all:

* **one host** (the controller binds loopback): an ``ipc://`` socket in Linux's abstract
  namespace (no file to leave behind, gone with the process) that admits only peers of the
  controller's own user id (``IPC_FILTER_UID``, checked by the kernel's ``SO_PEERCRED``):
  another local user's connection is closed before a byte is read. Where that filter is not
  available, the socket lives in a fresh directory only the run's user may enter (0700);
* **over TCP** (another interface, for ranks on other hosts): ZeroMQ's CURVE with keys derived
  from the run's secret, and a ZAP handler that admits only the run's client key, so a peer
  without the secret cannot finish the handshake, send a frame or take an identity; a peer that
  does not finish its handshake within ``HANDSHAKE_S`` is dropped, and a ``Gate`` bounds how
  many connections may be authenticating at once (per address and in all), so a flood of
  them cannot exhaust the controller's file descriptors.

A message travels as the multipart frames ``[header_json, *tensor_buffers, mac]``:

* ``header_json`` (UTF-8 JSON) holds the wire version, the run id, the sender and the receiver,
  a per-sender sequence number, the command ``kind``, the caller's JSON-able header and, for
  each tensor buffer, its dtype and shape;
* each tensor buffer is the raw bytes of one contiguous CPU tensor, sent without a Python copy
  (``send`` returns once ZeroMQ has released the memory, so tensors may be reused at once);
* ``mac = HMAC-SHA256(secret, len(f0) f0 len(f1) f1 ...)`` over every preceding frame, each
  prefixed by its length as 8 bytes big-endian.

The receiver checks the MAC (``hmac.compare_digest``) before it parses anything, then the run
id, the sender and receiver, and that the sequence number grows (a replayed message is refused).
A bad message is dropped, counted in ``rejected`` and logged (the first few, then at most one
line per ``_LOG_EVERY_S`` with the count since); it is never parsed further and nothing is ever
unpickled. Bulk data belongs on the communicators, not on this channel.

No frame may exceed ``max_message_bytes`` (``MESHPLAN_MAX_MESSAGE_BYTES``, default 2 GiB): the
sender refuses a larger tensor with an error that names it, and ZeroMQ's ``MAXMSGSIZE`` makes
the receiver drop a peer that sends one anyway before it holds the bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import itertools
import json
import logging
import math
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import zmq
import zmq.utils.z85

from .._errors import RuntimeFailure
from ._gate import Gate
from ._throttle import Throttle

__all__ = ["CONTROLLER", "ControllerChannel", "Message", "Secret", "WorkerChannel", "identity", "store_prefix"]

logger = logging.getLogger(__name__)

WIRE_VERSION = 1
CONTROLLER = -1                  # the sender/receiver id of the controller in a header
_NOT_A_RANK = -2                 # a socket identity that is not a rank
_MAC_SIZE = hashlib.sha256().digest_size
_POLL_SLICE_S = 0.5              # recv(None) wakes this often; it never returns without a message
_SHARED_SLICE_S = 0.01           # a read's poll while another thread waits for the socket
_ASK_SLICE_S = 0.05              # ``ask_sides``'s polls (the stepping thread may want to send)
PUMP_IDLE_S = 0.25               # the pump reads once the socket was left alone this long
HANDSHAKE_S = 5.0                # a TCP peer that has not authenticated by then is dropped
_LOG_FIRST, _LOG_EVERY_S = 5, 10.0   # rejection lines: the first few, then one per interval
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
ENV_MAX_MESSAGE = "MESHPLAN_MAX_MESSAGE_BYTES"
DEFAULT_MAX_MESSAGE = 2 << 30    # a frame's limit: a batch slice or a state piece fits easily

# The contract between launchers and workers: built-in message kinds and the environment a
# launcher sets for each worker (the secret is not among them: it comes on the worker's stdin).
HELLO, ERROR, PING, SHUTDOWN = "hello", "error", "ping", "shutdown"
BEAT = "beat"
# on a rank's side socket (``_Side``): its output lines, and, when asked, its Python stacks
# and its recent telemetry rows (``ROWS``: for ``meshplan serve``, runtime/_live.py)
LOG, STACKS, ROWS = "log", "stacks", "rows"
_SIDE_ASKS = (STACKS, ROWS)
_LOG_BATCH_BYTES = 64 << 10      # a LOG message carries at most this much text
_BEAT_BASE = -1000     # a rank's heartbeat socket signs as _BEAT_BASE - rank (its own sequence)
ENV_LOST_AFTER = "MESHPLAN_LOST_AFTER_S"
DEFAULT_LOST_AFTER_S = 30.0
BEAT_INTERVAL_S = 1.0
ENV_RANK = "MESHPLAN_RANK"
ENV_WORLD_SIZE = "MESHPLAN_WORLD_SIZE"
ENV_ADDRESS = "MESHPLAN_CONTROLLER"
ENV_RUN_ID = "MESHPLAN_RUN_ID"
ENV_PARENT_PID = "MESHPLAN_PARENT_PID"
ENV_PDEATHSIG = "MESHPLAN_PDEATHSIG"
ENV_PLUGINS = "MESHPLAN_WORKER_PLUGINS"
ENV_CONTROLLER_HOST = "MESHPLAN_CONTROLLER_HOST"   # set by launchers that may cross hosts


def controller_elsewhere(env: Any = None) -> bool:
    """Whether this process runs on another host than the controller (``$MESHPLAN_CONTROLLER_
    HOST`` names a host that is not this one): its pid and stdin are then not ours to watch."""
    host = (env if env is not None else os.environ).get(ENV_CONTROLLER_HOST)
    return bool(host) and host != socket.gethostname()


def address_toward(family: int, addr: tuple) -> str:
    """This machine's address on its route to ``addr`` (a UDP connect: no packet is sent);
    OSError when there is no route."""
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return s.getsockname()[0]


def lost_after_s(env: Any = None) -> float:
    """How long a rank on another host may go without a heartbeat before the controller calls
    its host lost (and such a rank calls the controller lost): ``$MESHPLAN_LOST_AFTER_S``,
    default 30 s (a long pause of the Python thread that beats, such as a compile holding the
    GIL, must not look like a dead network)."""
    raw = (env if env is not None else os.environ).get(ENV_LOST_AFTER)
    if not raw:
        return DEFAULT_LOST_AFTER_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 2 * BEAT_INTERVAL_S:
        raise RuntimeFailure(f"${ENV_LOST_AFTER}={raw!r}: give seconds, more than "
                             f"{2 * BEAT_INTERVAL_S:g}")
    return value


_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "complex64", "complex128",
        "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


@dataclass(frozen=True, slots=True)
class Secret:
    """The per-run HMAC key. Its repr never shows the key."""

    key: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.key, bytes) or len(self.key) < 16:
            raise ValueError("a Secret needs at least 16 bytes of key; use Secret.new()")

    @classmethod
    def new(cls) -> Secret:
        return cls(secrets.token_bytes(32))

    @classmethod
    def from_hex(cls, text: str) -> Secret:
        return cls(bytes.fromhex(text.strip()))

    def hex(self) -> str:
        return self.key.hex()


@dataclass(frozen=True, slots=True)
class Message:
    """One received message: the command ``kind``, its JSON header and its CPU tensors."""

    kind: str
    header: dict[str, Any]
    tensors: tuple[torch.Tensor, ...] = ()


class _Rejected(Exception):
    """A frame set failed a check; it is dropped (internal)."""


def identity(secret: Secret, rank: int) -> bytes:
    """The socket identity of ``rank``: the rank and a tag only the secret's holders can make."""
    tag = hmac.new(secret.key, f"identity:{rank}".encode(), hashlib.sha256).hexdigest()[:32]
    return f"{rank}.{tag}".encode()


def store_prefix(secret: Secret) -> str:
    """The run's key prefix in the torch.distributed rendezvous store (``_launch``)."""
    return "meshplan/" + hmac.new(secret.key, b"store", hashlib.sha256).hexdigest()[:32] + "/"


def _rank_of(secret: Secret, ident: bytes) -> int:
    """The rank an identity belongs to (``_BEAT_BASE - rank`` for a rank's heartbeat socket),
    or ``_NOT_A_RANK`` when its tag is not the run's."""
    head = ident.split(b".", 1)[0]
    if not head.removeprefix(b"-").isdigit():
        return _NOT_A_RANK
    rank = int(head)
    return rank if hmac.compare_digest(identity(secret, rank), ident) else _NOT_A_RANK


def _curve_keys(secret: Secret, role: str) -> tuple[bytes, bytes]:
    """A CURVE key pair (public, secret; Z85) derived from the run's secret for ``role``
    (``server``: the controller; ``client``: every worker)."""
    seed = hmac.new(secret.key, f"curve:{role}".encode(), hashlib.sha256).digest()
    private = zmq.utils.z85.encode(seed)
    return zmq.curve_public(private), private


class _RunKey:
    """The ZAP credentials check: only the run's client key is admitted."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(zmq.utils.z85.encode(key) if len(key) == 32 else key,
                                   self.public)


# ---------------------------------------------------------------------------------------------
# encoding


def _tensor_buffer(t: torch.Tensor) -> tuple[list[Any], memoryview]:
    """(dtype name, shape) and a zero-copy byte view of ``t`` (copied only if not contiguous)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"a message carries torch tensors, got {type(t).__name__}")
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise TypeError(f"dtype {t.dtype} cannot travel on the control channel")
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    # numpy's view keeps the tensor alive until ZeroMQ has sent the frame.
    return [name, list(t.shape)], memoryview(flat.view(torch.uint8).numpy())


def _mac(key: bytes, frames: Sequence[Any]) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for frame in frames:
        view = memoryview(frame)
        mac.update(view.nbytes.to_bytes(8, "big"))
        mac.update(view)
    return mac.digest()


def max_message_bytes(value: int | None = None) -> int:
    """``value``, else ``MESHPLAN_MAX_MESSAGE_BYTES``, else the default; checked."""
    where, given = "max_message_bytes", value
    if value is None:
        given = os.environ.get(ENV_MAX_MESSAGE)
        if given is None:
            return DEFAULT_MAX_MESSAGE
        where = ENV_MAX_MESSAGE
        value = int(given) if given.strip().isdigit() else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 4096:
        raise RuntimeFailure(f"{where}={given!r}: expected a whole number of bytes >= 4096")
    return value


def _encode(secret: Secret, envelope: dict[str, Any], header: dict[str, Any] | None,
            tensors: Sequence[torch.Tensor], limit: int = DEFAULT_MAX_MESSAGE) -> list[Any]:
    """Frames ``[header_json, *buffers, mac]`` for one message (``envelope``: run/seq/src/dst/kind);
    RuntimeFailure when a frame would exceed ``limit`` bytes."""
    specs, buffers = [], []
    for i, t in enumerate(tensors):
        spec, buf = _tensor_buffer(t)
        if buf.nbytes > limit:
            raise RuntimeFailure(
                f"control channel: tensor {i} of {envelope.get('kind')!r} ({spec[0]} "
                f"{tuple(spec[1])}, {buf.nbytes} bytes) exceeds the {limit}-byte limit on one "
                f"message; set {ENV_MAX_MESSAGE} higher (the same for controller and ranks), or "
                "move bulk state through a checkpoint file (save_checkpoint / load_checkpoint)")
        specs.append(spec)
        buffers.append(buf)
    if header is None:
        header = {}
    if not isinstance(header, dict):
        raise TypeError(f"a message header is a dict, got {type(header).__name__}")
    doc = dict(envelope, v=WIRE_VERSION, header=header, tensors=specs)
    try:
        head = json.dumps(doc, separators=(",", ":"), allow_nan=True).encode()
    except (TypeError, ValueError) as exc:
        raise TypeError(f"message header for {envelope.get('kind')!r} is not JSON-able: {exc}") from exc
    if len(head) > limit:
        raise RuntimeFailure(f"control channel: the header of {envelope.get('kind')!r} "
                             f"({len(head)} bytes) exceeds the {limit}-byte limit on one message")
    frames: list[Any] = [head, *buffers]
    frames.append(_mac(secret.key, frames))
    return frames


# ---------------------------------------------------------------------------------------------
# decoding


def _verify(secret: Secret, frames: Sequence[zmq.Frame]) -> dict[str, Any]:
    """Check the MAC over the raw frames, then parse the JSON document; raise _Rejected."""
    if len(frames) < 2:
        raise _Rejected(f"{len(frames)} frame(s), at least 2 expected")
    mac = frames[-1].buffer
    if mac.nbytes != _MAC_SIZE:
        raise _Rejected("MAC frame has the wrong size")
    expected = _mac(secret.key, [f.buffer for f in frames[:-1]])
    if not hmac.compare_digest(expected, bytes(mac)):
        raise _Rejected("bad MAC (wrong secret or tampered frames)")
    try:
        doc = json.loads(bytes(frames[0].buffer))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _Rejected(f"header is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("v") != WIRE_VERSION:
        raise _Rejected(f"not a wire-version-{WIRE_VERSION} header")
    return doc


def _decode_tensor(spec: Any, frame: zmq.Frame) -> torch.Tensor:
    if not (isinstance(spec, list) and len(spec) == 2 and spec[0] in _DTYPES
            and isinstance(spec[1], list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in spec[1])):
        raise _Rejected(f"bad tensor spec {spec!r}")
    dtype, shape = _DTYPES[spec[0]], spec[1]
    out = torch.empty(shape, dtype=dtype)
    nbytes = math.prod(shape) * out.element_size()
    buf = frame.buffer
    if buf.nbytes != nbytes:
        raise _Rejected(f"tensor {spec!r} needs {nbytes} bytes, the frame has {buf.nbytes}")
    if nbytes:
        # One copy out of ZeroMQ's (read-only) frame into a fresh, writable tensor.
        out.reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(buf, dtype=np.uint8)
    return out


def _decode(doc: dict[str, Any], frames: Sequence[zmq.Frame]) -> Message:
    kind, header, specs = doc.get("kind"), doc.get("header"), doc.get("tensors")
    if not isinstance(kind, str) or not isinstance(header, dict) or not isinstance(specs, list):
        raise _Rejected("header lacks kind/header/tensors")
    if len(specs) != len(frames) - 2:
        raise _Rejected(f"{len(specs)} tensor specs for {len(frames) - 2} buffers")
    tensors = tuple(_decode_tensor(spec, frame) for spec, frame in zip(specs, frames[1:-1]))
    return Message(kind, header, tensors)


def _send(socket: zmq.Socket, frames: list[Any]) -> None:
    """Send without copying tensor buffers, and return only once ZeroMQ is done with them: the
    caller may then modify its tensors (a change in flight would break the MAC and the message
    would be dropped). pyzmq copies small frames anyway (``zmq.COPY_THRESHOLD``)."""
    trackers = []
    for i, frame in enumerate(frames):
        more = zmq.SNDMORE if i < len(frames) - 1 else 0
        if memoryview(frame).nbytes < zmq.COPY_THRESHOLD:
            socket.send(frame, more)
        else:
            trackers.append(socket.send(frame, more, copy=False, track=True))
    for tracker in trackers:
        tracker.wait()


class _Endpoint:
    """What both ends share: the secret, the run id, sequence numbers and the receive checks."""

    def __init__(self, secret: Secret, run_id: str, me: int,
                 max_message: int | None = None) -> None:
        if not isinstance(secret, Secret):
            raise TypeError("secret must be a meshplan.runtime.Secret")
        if not isinstance(run_id, str) or not run_id:
            raise ValueError("run_id must be a non-empty string")
        self.secret, self.run_id, self.me = secret, run_id, me
        self.max_message = max_message_bytes(max_message)
        # Start at the clock so a restarted sender with the same id keeps growing (replay check).
        self._seq = time.time_ns()
        self._last_seq: dict[int, int] = {}
        self.rejected = 0
        self._throttle = Throttle(_LOG_FIRST, _LOG_EVERY_S)
        self._ctx = zmq.Context()
        self._closed = False

    def _frames(self, dst: int, kind: str, header: dict[str, Any] | None,
                tensors: Sequence[torch.Tensor]) -> list[Any]:
        if not isinstance(kind, str) or not kind:
            raise ValueError("a message kind is a non-empty string")
        self._seq += 1
        envelope = {"run": self.run_id, "seq": self._seq, "src": self.me, "dst": dst, "kind": kind}
        return _encode(self.secret, envelope, header, tensors, self.max_message)

    def _accept(self, frames: Sequence[zmq.Frame], src: int) -> tuple[int, Message] | None:
        """The (sender, message) of ``frames``, or None after counting and logging a rejection."""
        try:
            doc = _verify(self.secret, frames)
            sender, seq = doc.get("src"), doc.get("seq")
            if doc.get("run") != self.run_id:
                raise _Rejected(f"unknown run id {doc.get('run')!r}")
            if doc.get("dst") != self.me or not isinstance(sender, int) or isinstance(sender, bool):
                raise _Rejected(f"addressed {doc.get('src')!r} -> {doc.get('dst')!r}, not to {self.me}")
            if sender != src:
                raise _Rejected(f"socket identity {src} signed as {sender}")
            if not isinstance(seq, int) or seq <= self._last_seq.get(sender, 0):
                raise _Rejected(f"sequence number {seq!r} from {sender} does not grow (replay)")
            message = _decode(doc, frames)
        except _Rejected as exc:
            self.rejected += 1
            self._log_rejection(exc)
            return None
        self._last_seq[sender] = seq
        return sender, message

    def _log_rejection(self, exc: _Rejected) -> None:
        more = self._throttle.due(self.rejected, time.monotonic())
        if more is not None:
            since = f" ({more} more dropped since the last line)" if more > 0 else ""
            logger.warning("control channel (run %s): dropped a message: %s%s", self.run_id,
                           exc, since)

    def _poll(self, socket: zmq.Socket, deadline: float | None) -> bool:
        remaining = _POLL_SLICE_S if deadline is None else deadline - time.monotonic()
        if remaining <= 0:
            return False
        return bool(socket.poll(max(1, int(min(remaining, _POLL_SLICE_S) * 1000)), zmq.POLLIN))

    @staticmethod
    def _deadline(timeout_s: float | None) -> float | None:
        return None if timeout_s is None else time.monotonic() + max(0.0, timeout_s)

    def _close(self, socket: zmq.Socket, linger_s: float) -> None:
        if self._closed:
            return
        self._closed = True
        socket.close(linger=int(linger_s * 1000))
        self._ctx.term()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeFailure("the control channel is closed")


class ControllerChannel(_Endpoint):
    """The controller's end: a ROUTER on an ``ipc://`` socket in a private directory when
    ``host`` is loopback (the default), else on a random TCP port of ``host`` with CURVE
    (``transport="tcp"`` forces TCP on loopback too).

    One thread (the one that runs the steps) sends and receives; another may ask the ranks'
    side sockets at the same time (``ask_sides``: ``meshplan serve``'s live rows and stacks).
    The socket is used under a lock, by whichever thread reads next: what it reads for the
    other (a reply for the stepping thread, a side answer) is left where the other looks.
    """

    def __init__(self, secret: Secret, run_id: str, host: str = "127.0.0.1",
                 transport: str | None = None, max_message_bytes: int | None = None) -> None:
        super().__init__(secret, run_id, CONTROLLER, max_message_bytes)
        transport = transport or ("ipc" if host in _LOOPBACK else "tcp")
        if transport not in ("ipc", "tcp"):
            raise ValueError(f"transport must be 'ipc' or 'tcp', got {transport!r}")
        self._socket = self._ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)   # an unknown rank raises, not drops
        # a rank started again (fault tolerance) takes its identity over from the dead one
        self._socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, self.max_message)
        self._dir: str | None = None
        self._auth: Any = None
        self._gate: Gate | None = None
        self.last_beat: dict[int, float] = {}    # rank -> monotonic time of its last heartbeat
        # a rank's output lines (``LOG`` from its side socket) go to ``on_log(rank, lines)``;
        # its answers to ``ask_sides`` land in ``_answers[request id]``
        self.on_log: Callable[[int, list[Any]], None] | None = None
        self._answers: dict[int, dict[int, Message]] = {}
        self._asks = itertools.count(1)         # request ids (next() is atomic)
        # the socket's users (module docstring): the holder of ``_lock`` reads; a reply read
        # for the stepping thread by another waits in ``_inbox``; ``_waiting`` counts the
        # threads that want the lock (the reader polls in short slices then)
        self._lock = threading.Lock()
        self._inbox: deque[tuple[int, Message]] = deque()
        self._waiting = 0
        self._waiting_lock = threading.Lock()
        # the pump (``start_pump``): its thread, the pipe that wakes it, whether it polls now
        self._last_use = time.monotonic()
        self._pump: threading.Thread | None = None
        self._pump_wake: tuple[int, int] = (-1, -1)
        self._pump_stop = threading.Event()
        self._pumping = False
        # rank -> monotonic time the connection its newest message came on ended (it exited,
        # or closed its socket); a message from the rank, or ``forget``, clears it. Which rank
        # ended first, when a job ends every rank; on one host (``sees_drops``) also a rank
        # that lives on without its connection.
        self.ended: dict[int, float] = {}
        self.sees_drops = False
        self._monitor: zmq.Socket | None = None
        self._rank_fd: dict[int, int] = {}      # rank -> the connection its newest message came on
        self._fd_rank: dict[int, int] = {}      # and back (read by the Gate's thread too)
        if transport == "ipc":
            try:
                self._socket.setsockopt(zmq.IPC_FILTER_UID, os.getuid())
                self.address = f"ipc://@meshplan-{run_id}-{secrets.token_hex(8)}"
            except (AttributeError, zmq.ZMQError):
                # mkdtemp makes it 0700: only this user can reach the socket inside
                self._dir = tempfile.mkdtemp(prefix="meshplan-ctl-")
                self.address = f"ipc://{self._dir}/control"
            self._socket.bind(self.address)
            # each message's socket (SRCFD) names the connection a rank is on, and this
            # monitor reports the connection's end. Its event is queued before the descriptor
            # closes, and ``recv`` reads the events before every message, so a later
            # connection that reuses the descriptor is never taken for the ended one: a rank
            # that closes its connection while it lives is seen at once.
            self._monitor = self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self.sees_drops = True
        else:
            from zmq.auth.thread import ThreadAuthenticator

            self._auth = ThreadAuthenticator(self._ctx, log=logging.getLogger(__name__ + ".zap"))
            self._auth.start()
            self._auth.configure_curve_callback("*", _RunKey(_curve_keys(secret, "client")[0]))
            _, private = _curve_keys(secret, "server")
            self._socket.setsockopt(zmq.CURVE_SERVER, 1)
            self._socket.setsockopt(zmq.CURVE_SECRETKEY, private)
            self._socket.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
            # the Gate's thread owns the socket's one monitor: it passes connection ends on
            # (in its own time, so only for the order in which ranks ended)
            self._gate = Gate(self._socket, run_id, grace_s=HANDSHAKE_S + 1.0,
                              on_end=self._connection_ended)
            port = self._socket.bind_to_random_port(f"tcp://{host}")
            self.address = f"tcp://{host}:{port}"

    def send(self, rank: int, kind: str, header: dict[str, Any] | None = None,
             tensors: Sequence[torch.Tensor] = ()) -> None:
        self._check_open()
        try:
            with self._locked():     # sequence numbers grow in the order messages leave
                frames = self._frames(rank, kind, header, tensors)
                _send(self._socket, [identity(self.secret, rank), *frames])
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise RuntimeFailure(f"cannot send {kind!r} to rank {rank}: it is not connected") from None
            raise

    def ask_sides(self, ranks: Sequence[int], kind: str, header: dict[str, Any] | None = None,
                  timeout_s: float = 3.0) -> dict[int, Message]:
        """Ask ``ranks``' side sockets (``_Side``: they answer while the rank's main thread
        computes or waits in a collective) and return the answers that come within
        ``timeout_s``, by rank; a rank not connected is skipped. Any thread may ask (the
        class docstring); replies for the stepping thread read meanwhile stay for its
        ``recv``."""
        if kind not in _SIDE_ASKS:
            raise ValueError(f"a side socket answers {_SIDE_ASKS}, not {kind!r}")
        req = next(self._asks)
        self._answers[req] = {}
        asked = []
        try:
            for rank in ranks:
                try:
                    self.send(_BEAT_BASE - rank, kind, {**(header or {}), "req": req})
                    asked.append(rank)
                except RuntimeFailure:       # its side socket is not connected (gone)
                    pass
            deadline = time.monotonic() + timeout_s
            answers = self._answers[req]
            while any(r not in answers for r in asked) and time.monotonic() < deadline:
                got = self._read(min(deadline, time.monotonic() + _ASK_SLICE_S))
                if got is not None:
                    self._inbox.append(got)
        finally:
            answers = self._answers.pop(req)
        return dict(answers)

    def recv(self, timeout_s: float | None = None) -> tuple[int, Message]:
        """The next valid ``(rank, message)``; TimeoutError after ``timeout_s`` (None: wait)."""
        self._check_open()
        deadline = self._deadline(timeout_s)
        while True:
            if self._inbox:
                return self._inbox.popleft()
            got = self._read(deadline)
            if got is not None:
                return got
            if deadline is not None and time.monotonic() >= deadline and not self._inbox:
                raise TimeoutError(f"no message from any worker within {timeout_s} s")

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The socket's lock, taken soon also while another thread reads (it polls in
        short slices while another waits; the pump is woken)."""
        self._want(1)
        self._lock.acquire()
        self._want(-1)
        self._last_use = time.monotonic()
        try:
            yield
        finally:
            self._lock.release()

    def _want(self, n: int) -> None:
        with self._waiting_lock:
            self._waiting += n
        if n > 0 and self._pumping:
            try:
                os.write(self._pump_wake[1], b"x")
            except OSError:              # full: a wake-up is pending anyway
                pass

    def _read(self, deadline: float | None) -> tuple[int, Message] | None:
        """At most one message for the stepping thread, read within one poll slice (side
        messages are handled on the way); None when there was none, or another thread
        reads now (it leaves replies in ``_inbox``)."""
        wait = _POLL_SLICE_S if deadline is None else max(0.0, deadline - time.monotonic())
        self._want(1)
        took = self._lock.acquire(timeout=min(wait, _SHARED_SLICE_S) if wait > 0 else 0)
        self._want(-1)
        if not took:
            return None
        self._last_use = time.monotonic()
        try:
            self._check_open()
            while True:
                self._poll_connections()
                if self._waiting:           # another thread wants the socket: short turns
                    deadline = min(deadline or math.inf, time.monotonic() + _SHARED_SLICE_S)
                if not self._poll(self._socket, deadline):
                    return None
                got = self._take_one()
                if got is not None:
                    return got
        finally:
            self._lock.release()
            if self._waiting:
                time.sleep(0.0005)           # let the waiting thread take the lock

    def _take_one(self) -> tuple[int, Message] | None:
        """Read the message that is there (the lock held): a message for the stepping
        thread, or None after handling a side message or dropping a bad one."""
        self._poll_connections()  # an end queued before this message's connection began
        ident, *frames = self._socket.recv_multipart(copy=False)
        # an identity without the run's tag fails the sender check in _accept
        got = self._accept(frames, _rank_of(self.secret, bytes(ident.buffer)))
        if got is not None and got[0] <= _BEAT_BASE:
            self._side_message(_BEAT_BASE - got[0], got[1])
            return None
        if got is not None:
            self._on(got[0], ident.get(zmq.SRCFD))
        return got

    def start_pump(self, idle_s: float = PUMP_IDLE_S) -> None:
        """Read the socket from a thread of its own whenever no other thread has used it for
        ``idle_s`` (the program runs its own code between steps): the ranks' output lines
        are printed as they come, and their heartbeats counted; a reply read meanwhile waits
        in ``_inbox`` for ``recv``. A thread that wants the socket wakes the pump at once."""
        if self._pump is not None:
            return
        self._pump_wake = os.pipe()
        os.set_blocking(self._pump_wake[1], False)
        self._pump = threading.Thread(target=self._pump_loop, args=(idle_s,), daemon=True,
                                      name="meshplan-channel-pump")
        self._pump.start()

    def _pump_loop(self, idle_s: float) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._pump_wake[0], zmq.POLLIN)
        while not self._closed and not self._pump_stop.is_set():
            wait = idle_s - (time.monotonic() - self._last_use)
            if wait > 0 or self._waiting:
                self._pump_stop.wait(max(wait, 0.005))
                continue
            if not self._lock.acquire(timeout=0.05):
                continue
            try:
                if self._closed or self._waiting:
                    continue
                self._pumping = True
                if self._waiting:          # it came before it could see _pumping: no poll
                    continue
                ready = dict(poller.poll(int(_POLL_SLICE_S * 1000)))
                self._pumping = False
                if self._pump_wake[0] in ready:
                    os.read(self._pump_wake[0], 4096)
                while self._socket in ready and not self._waiting and not self._closed and \
                        self._socket.poll(0, zmq.POLLIN):
                    got = self._take_one()
                    if got is not None:
                        self._inbox.append(got)
            except (zmq.ZMQError, OSError):       # closed under it: the loop ends
                pass
            except Exception:      # noqa: BLE001 - the stepping thread's reads take over
                logger.exception("control channel (run %s): the pump stopped", self.run_id)
                return
            finally:
                self._pumping = False
                self._lock.release()

    def _side_message(self, rank: int, message: Message) -> None:
        if message.kind == BEAT:
            self.last_beat[rank] = time.monotonic()
        elif message.kind == LOG and self.on_log is not None:
            self.on_log(rank, list(message.header.get("lines", ())))
        elif message.kind in _SIDE_ASKS:
            answers = self._answers.get(message.header.get("req"))
            if answers is not None:          # else asked by a request given up on
                answers[rank] = message

    def _on(self, rank: int, fd: int) -> None:
        """``rank``'s newest message came on connection ``fd``."""
        old = self._rank_fd.get(rank)
        if old != fd:
            if old is not None:
                self._fd_rank.pop(old, None)
            self._rank_fd[rank] = fd
            self._fd_rank[fd] = rank
        self.ended.pop(rank, None)

    def _connection_ended(self, fd: int) -> None:
        """Connection ``fd`` ended (over TCP, told from the Gate's thread: only single dict
        operations here, which may interleave with ``_on`` and ``forget``)."""
        rank = self._fd_rank.pop(fd, None)
        if rank is not None and self._rank_fd.get(rank) == fd:
            self._rank_fd.pop(rank, None)
            self.ended[rank] = time.monotonic()

    def poll_connections(self) -> None:
        """Read the connection ends the monitor reported (one host; over TCP the Gate's
        thread passes them on by itself)."""
        if self._monitor is None or self._closed:
            return
        with self._locked():
            self._poll_connections()

    def _poll_connections(self) -> None:
        if self._monitor is None or self._closed:
            return
        from zmq.utils.monitor import recv_monitor_message

        while self._monitor.poll(0):
            self._connection_ended(int(recv_monitor_message(self._monitor)["value"]))

    def forget(self, rank: int) -> None:
        """``rank``'s process is being replaced (killed, or started again): the end of its
        old connection is not news, and its new process has not connected yet."""
        self.poll_connections()
        fd = self._rank_fd.pop(rank, None)
        if fd is not None:
            self._fd_rank.pop(fd, None)
        self.ended.pop(rank, None)

    def close(self) -> None:
        if self._gate is not None:
            self._gate.stop()
        self._pump_stop.set()
        with self._locked():              # not while another thread reads
            if self._monitor is not None and not self._closed:
                self._socket.disable_monitor()
                self._monitor.close(linger=0)
            if self._auth is not None and not self._closed:
                self._auth.stop()
            self._close(self._socket, 0)
        if self._pump is not None:
            if self._pump is not threading.current_thread():
                self._pump.join(2.0)
            for fd in self._pump_wake:
                os.close(fd)
            self._pump = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> ControllerChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class WorkerChannel(_Endpoint):
    """A worker's end: a DEALER with the rank's identity (``identity``) connected to the
    controller; over TCP it authenticates with the run's CURVE client key."""

    def __init__(self, address: str, secret: Secret, run_id: str, rank: int,
                 max_message_bytes: int | None = None) -> None:
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be a non-negative int, got {rank!r}")
        super().__init__(secret, run_id, rank, max_message_bytes)
        self.rank = rank
        self._socket = self._ctx.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.IDENTITY, identity(secret, rank))
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, self.max_message)
        if address.startswith("tcp://"):
            public, private = _curve_keys(secret, "client")
            self._socket.setsockopt(zmq.CURVE_SERVERKEY, _curve_keys(secret, "server")[0])
            self._socket.setsockopt(zmq.CURVE_PUBLICKEY, public)
            self._socket.setsockopt(zmq.CURVE_SECRETKEY, private)
        self.address = address
        self._socket.connect(address)

    def send(self, kind: str, header: dict[str, Any] | None = None,
             tensors: Sequence[torch.Tensor] = ()) -> None:
        self._check_open()
        _send(self._socket, self._frames(CONTROLLER, kind, header, tensors))

    def recv(self, timeout_s: float | None = None) -> Message:
        """The next valid message from the controller; TimeoutError after ``timeout_s``."""
        self._check_open()
        deadline = self._deadline(timeout_s)
        while True:
            if not self._poll(self._socket, deadline):
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"rank {self.rank}: no message within {timeout_s} s")
                continue
            got = self._accept(self._socket.recv_multipart(copy=False), CONTROLLER)
            if got is not None:
                return got[1]

    def start_heartbeat(self, lost_after_s: float, on_lost: Callable[[], None]) -> None:
        """Beat to the controller every ``BEAT_INTERVAL_S`` from a thread with its own socket
        (so it goes on while this rank computes or waits in a collective), and call
        ``on_lost`` when the connection to the controller has been down for ``lost_after_s``
        (ZeroMQ's own heartbeats close a connection whose peer stops answering, so a cut
        network is seen as such, not only a closed socket)."""
        self.start_side(beats=True, lost_after_s=lost_after_s, on_lost=on_lost)

    def start_side(self, *, beats: bool, lost_after_s: float = DEFAULT_LOST_AFTER_S,
                   on_lost: Callable[[], None] | None = None,
                   stacks: Callable[[], dict[str, Any]] | None = None,
                   rows: Callable[[list[str]], tuple[dict[str, Any], list[torch.Tensor]]]
                   | None = None, lines: Any = None) -> _Side:
        """Start this rank's side thread and socket (``_Side``): heartbeats when ``beats``
        (the controller is on another host), the output lines queued in ``lines`` (a deque
        of ``[stream, text]``), and ``stacks()``'s and ``rows(tables)``'s answers whenever
        the controller asks."""
        self._beats = _Side(self, lost_after_s, on_lost, beats=beats, stacks=stacks,
                            rows=rows, lines=lines)
        return self._beats

    def close(self, linger_s: float = 0.0) -> None:
        """Close; ``linger_s`` lets queued messages (a last reply) go out first."""
        beats = getattr(self, "_beats", None)
        if beats is not None:
            beats.stop(drain_s=min(linger_s, 2.0))
        self._close(self._socket, linger_s)

    def __enter__(self) -> WorkerChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Side(_Endpoint):
    """A rank's side socket and thread: its own DEALER (identity and signature of
    ``_BEAT_BASE - rank``, so its sequence numbers are its own) that goes on while the rank's
    main thread computes or waits in a collective. It sends

    - ``BEAT`` every ``BEAT_INTERVAL_S`` when ``beats`` (the controller is on another host),
      and watches the connection: ``on_lost`` once it has been down for ``lost_after_s``;
    - ``LOG``: the rank's output lines queued in ``lines`` (``[stream, text]``; the worker's
      ``LogCapture`` fills it), soon after they are written, in batches;
    - ``STACKS``: ``stacks()`` (its threads' Python stacks) when the controller asks;
    - ``ROWS``: ``rows(tables)`` (its recent telemetry rows: a header and one tensor per
      table) when the controller asks.

    Beats never block: beats a dead link cannot take are dropped; lines wait (up to the
    queue's length, ``_logs.MAX_QUEUED``; then the oldest go)."""

    def __init__(self, channel: WorkerChannel, lost_after_s: float,
                 on_lost: Callable[[], None] | None, *, beats: bool = True,
                 stacks: Callable[[], dict[str, Any]] | None = None,
                 rows: Callable[[list[str]], tuple[dict[str, Any], list[torch.Tensor]]]
                 | None = None, lines: Any = None) -> None:
        super().__init__(channel.secret, channel.run_id, _BEAT_BASE - channel.rank,
                         channel.max_message)
        self.lost_after_s, self.on_lost = lost_after_s, on_lost
        self.beats, self.stacks, self.rows, self.lines = beats, stacks, rows, lines
        sock = self._socket = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity(self.secret, self.me))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 64)
        if beats:
            sock.setsockopt(zmq.HEARTBEAT_IVL, int(BEAT_INTERVAL_S * 1000))
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(lost_after_s * 500))
        if channel.address.startswith("tcp://"):
            public, private = _curve_keys(self.secret, "client")
            sock.setsockopt(zmq.CURVE_SERVERKEY, _curve_keys(self.secret, "server")[0])
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, private)
        self._monitor = sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sock.connect(channel.address)
        self._stop = threading.Event()
        self._send_lock = threading.Lock()
        # a byte here wakes the thread at once (``wake``: a line was queued)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._thread = threading.Thread(target=self._run, name="meshplan-side", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Send the queued lines now (called by whoever queues one; never blocks)."""
        try:
            os.write(self._wake_w, b"x")
        except OSError:                  # the pipe is full: a wake-up is pending anyway
            pass

    def _send(self, kind: str, header: dict[str, Any] | None,
              tensors: Sequence[torch.Tensor] = ()) -> bool:
        """One message, without blocking; False when the link cannot take it now."""
        with self._send_lock:
            try:
                frames = self._frames(CONTROLLER, kind, header, tensors)
                for i, frame in enumerate(frames):
                    more = zmq.SNDMORE if i < len(frames) - 1 else 0
                    self._socket.send(frame, zmq.NOBLOCK | more)
                return True
            except zmq.Again:
                return False

    def _send_lines(self) -> None:
        """The queued output lines, in batches of at most ``_LOG_BATCH_BYTES``."""
        lines = self.lines
        while lines:
            batch, size = [], 0
            while lines and size < _LOG_BATCH_BYTES:
                item = lines.popleft()
                batch.append(item)
                size += len(item[1]) + 8
            if not self._send(LOG, {"lines": batch}):
                lines.extendleft(reversed(batch))       # the link is busy: next time
                return

    def _run(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        down_since: float | None = time.monotonic()       # until the first connection
        next_beat = time.monotonic() + BEAT_INTERVAL_S
        while not self._stop.is_set():
            now = time.monotonic()
            wait = max(0.0, next_beat - now)
            if self.lines:
                wait = min(wait, 0.02)                 # lines go out soon after they come
            ready = dict(self._poller.poll(max(1, int(min(wait, 0.25) * 1000))))
            if self._wake_r in ready:
                try:
                    os.read(self._wake_r, 4096)
                except OSError:
                    pass
            if self._socket in ready:
                got = self._accept(self._socket.recv_multipart(copy=False), CONTROLLER)
                if got is not None and got[1].kind in _SIDE_ASKS:
                    self._answer(got[1])
            if self.lines:
                self._send_lines()
            if time.monotonic() < next_beat:
                continue
            next_beat += BEAT_INTERVAL_S
            if not self.beats:
                continue
            while self._monitor.poll(0):
                event = recv_monitor_message(self._monitor)["event"]
                if event == zmq.EVENT_DISCONNECTED:
                    down_since = down_since or time.monotonic()
                elif event in (zmq.EVENT_CONNECTED, zmq.EVENT_HANDSHAKE_SUCCEEDED):
                    down_since = None
            if down_since is not None and time.monotonic() - down_since >= self.lost_after_s:
                if self.on_lost is not None:
                    self.on_lost()
                return
            self._send(BEAT, None)

    def _answer(self, ask: Message) -> None:
        """Answer ``STACKS`` or ``ROWS``, naming the request (its ``req``). An answer the
        link cannot take at once gets a second try a little later, then is dropped (the
        controller counts the rank as not answering)."""
        tensors: list[torch.Tensor] = []
        try:
            if ask.kind == STACKS:
                answer = self.stacks() if self.stacks is not None else {}
            elif self.rows is None:
                answer = {"error": "this rank records no telemetry"}
            else:
                answer, tensors = self.rows([str(t) for t in ask.header.get("tables", ())])
        except Exception as exc:  # noqa: BLE001 - say why instead of nothing
            answer, tensors = {"error": f"{type(exc).__name__}: {exc}"}, []
        answer = {**answer, "req": ask.header.get("req")}
        if not self._send(ask.kind, answer, tensors):
            time.sleep(0.05)
            self._send(ask.kind, answer, tensors)

    def stop(self, drain_s: float = 0.0) -> None:
        """Stop the thread; ``drain_s``: first give the queued lines that long to go out."""
        deadline = time.monotonic() + drain_s
        while self.lines and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        self._stop.set()
        self.wake()                      # out of its poll now, not at the next beat
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._close(self._socket, drain_s)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
