"""A controller outside the cluster (``k8s={"reach": "port-forward"}``): the pods cannot
connect to it (a laptop behind NAT, a workstation off the cluster's network), but it can reach
each pod through the API server's port-forward, which carries connections that the controller
opens, never ones a pod opens. So each pod's entry runs a **relay** that turns the connections
its ranks open into connections the controller opens:

- the relay listens on ``127.0.0.1:PORT`` in the pod (``relay_port``; only the port-forward,
  which enters the pod's network namespace, reaches it, and only with the run's key);
- the controller opens a port-forward to it and makes it its *control* stream, then asks it to
  **expose** each of its own endpoints that the ranks use (the control channel, the
  rendezvous store): the relay listens on a fresh loopback port in the pod for each and says
  which, and the pod's ranks are given those ports as the controller's address;
- when a rank connects to an exposed port, the relay says so on the control stream (``open``,
  with a number for the connection), the controller opens a new port-forward to the relay,
  names the connection (``attach``) and connects the new stream to its own endpoint; both
  sides then copy bytes until either end closes.

The controller pings its control stream every ``PING_S`` (API servers, kubelets and load
balancers cut idle streams) and makes a cut one again while the pod runs; the relay closes
the connections waiting on a cut control stream, and any the controller has not attached
within ``PENDING_S``, so a rank sees its connection end instead of waiting on it. A refused
port-forward (401 / 403 / 404) fails at once, naming the permission.

Every stream opens with the relay's challenge (a random nonce) and the controller's answer,
HMAC-SHA256 of it under the run's key (the Secret the pods mount), so nothing else in the pod or
the cluster can attach to a rank's connection or expose a port. What crosses the relay is the
control channel's CURVE-encrypted frames and the store's bytes; the port-forward itself is the
API server's TLS connection. The wire is JSON lines until a stream is spliced.

``Relay`` is the pod's side (started by ``_k8s_pod.py`` when ``$MESHPLAN_RELAY_PORT`` is set),
``Tunnel`` the controller's side for one pod, ``Tunnels`` the controller's for the run's pods.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from .._errors import RuntimeFailure

logger = logging.getLogger("meshplan.runtime")

ENV_RELAY_PORT = "MESHPLAN_RELAY_PORT"
# added to the relay's port in the pod: set by a stand-in kubelet whose pods share one network
# namespace (the tests'), which shifts its port-forwards to a pod by as much; never in a cluster
ENV_PORT_SHIFT = "MESHPLAN_RELAY_PORT_SHIFT"
RELAY_PORT = 29400
_TAG = b"meshplan-relay v1 "
_LINE_MAX = 1 << 16
_CHUNK = 1 << 16
PING_S = 30.0            # the control stream's keep-alive (API servers and kubelets cut idle
                         # streams: streaming-connection-idle-timeout, load balancers)
PENDING_S = 30.0         # a rank's connection the controller did not attach by then is closed
HANDSHAKE_S = 10.0


def _mac(key: bytes, nonce: str) -> str:
    return hmac.new(key, _TAG + nonce.encode(), hashlib.sha256).hexdigest()


def _end(sock: Any) -> None:
    """Shut down and close: ``close`` alone neither wakes a thread blocked in ``recv`` on it
    nor tells the peer."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except (OSError, AttributeError):
        pass
    try:
        sock.close()
    except OSError:
        pass


class _Lines:
    """JSON lines over a socket (or the port-forward's socket-like end)."""

    def __init__(self, sock: Any) -> None:
        self.sock, self.buf = sock, b""
        self.lock = threading.Lock()

    def send(self, obj: dict[str, Any]) -> None:
        with self.lock:
            self.sock.sendall(json.dumps(obj).encode() + b"\n")

    def recv(self) -> dict[str, Any] | None:
        while b"\n" not in self.buf:
            if len(self.buf) > _LINE_MAX:
                raise ValueError("line too long")
            data = self.sock.recv(_CHUNK)
            if not data:
                return None
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)


def _splice(a: Any, b: Any, first: bytes = b"") -> None:
    """Copy bytes both ways between ``a`` and ``b`` until either side ends (two threads);
    ``first``: bytes already read from ``a``."""
    def pump(src: Any, dst: Any, head: bytes) -> None:
        try:
            if head:
                dst.sendall(head)
            while data := src.recv(_CHUNK):
                dst.sendall(data)
        except OSError:
            pass
        _end(dst)
        _end(src)

    threading.Thread(target=pump, args=(a, b, first), daemon=True,
                     name="meshplan-relay-pump").start()
    threading.Thread(target=pump, args=(b, a, b""), daemon=True,
                     name="meshplan-relay-pump").start()


class Relay:
    """The pod's side: listen on ``127.0.0.1:port`` for the controller's streams; see the
    module docstring. ``exposed(names, timeout_s)`` waits until the controller has exposed
    those endpoints and returns their pod-local ports."""

    def __init__(self, key: bytes, port: int) -> None:
        self.key = key
        self.listener = socket.create_server(("127.0.0.1", port))
        self.ports: dict[str, int] = {}
        self._control: _Lines | None = None
        self._pending: dict[int, socket.socket] = {}
        self._ids = iter(range(1, 1 << 62))
        self._cond = threading.Condition()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="meshplan-relay").start()

    def close(self) -> None:
        self._closed = True
        _end(self.listener)

    def exposed(self, names: list[str], timeout_s: float) -> dict[str, int]:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not all(n in self.ports for n in names):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the controller did not expose {names} within "
                                       f"{timeout_s:g} s")
                self._cond.wait(left)
            return {n: self.ports[n] for n in names}

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._stream, args=(conn,), daemon=True).start()

    def _stream(self, conn: socket.socket) -> None:
        """One of the controller's streams: prove the key, then either the control stream
        or a rank's connection to attach."""
        lines = _Lines(conn)
        control = False
        try:
            nonce = secrets.token_hex(16)
            lines.send({"nonce": nonce})
            conn.settimeout(HANDSHAKE_S)
            hello = lines.recv()
            conn.settimeout(None)
            mac = hello.get("mac") if isinstance(hello, dict) else None
            if not isinstance(mac, str) or not hmac.compare_digest(
                    mac.encode(), _mac(self.key, nonce).encode()):
                _end(conn)                    # not the controller
                return
            if hello.get("op") == "attach":
                with self._cond:
                    rank_conn = self._pending.pop(int(hello["conn"]), None)
                if rank_conn is None:
                    _end(conn)
                    return
                _splice(conn, rank_conn, lines.buf)
                return
            if hello.get("op") != "control":
                _end(conn)
                return
            lines.send({"op": "ok"})
            with self._cond:
                old, self._control = self._control, lines
            control = True
            if old is not None:               # the controller came again (a new tunnel)
                _end(old.sock)
            while (msg := lines.recv()) is not None:
                if isinstance(msg, dict) and msg.get("op") == "expose":
                    self._expose(str(msg["name"]))
        except Exception:  # noqa: BLE001 - a broken or hostile stream: it ends, nothing else
            pass
        _end(conn)
        if control:                           # its pending connections cannot be attached
            with self._cond:
                if self._control is lines:
                    self._control = None
                    pending, self._pending = list(self._pending.values()), {}
                else:
                    pending = []
            for c in pending:
                _end(c)

    def _expose(self, name: str) -> None:
        with self._cond:
            port = self.ports.get(name)
        if port is None:
            listener = socket.create_server(("127.0.0.1", 0))
            port = listener.getsockname()[1]
            threading.Thread(target=self._serve, args=(name, listener), daemon=True).start()
        with self._cond:
            self.ports[name] = port
            self._cond.notify_all()
            control = self._control
        if control is not None:
            control.send({"op": "exposed", "name": name, "port": port})

    def _serve(self, name: str, listener: socket.socket) -> None:
        """A rank connects to exposed endpoint ``name``: ask the controller for a stream."""
        while not self._closed:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with self._cond:
                cid = next(self._ids)
                self._pending[cid] = conn
                control = self._control
            try:
                if control is None:
                    raise OSError("no control stream")
                control.send({"op": "open", "name": name, "conn": cid})
            except OSError:
                with self._cond:
                    self._pending.pop(cid, None)
                _end(conn)
                continue
            threading.Timer(PENDING_S, self._expire, args=(cid,)).start()

    def _expire(self, cid: int) -> None:
        """A rank's connection the controller never attached: closed (the rank sees it end
        and says so, instead of waiting on it for ever)."""
        with self._cond:
            conn = self._pending.pop(cid, None)
        if conn is not None:
            _end(conn)


class Tunnel:
    """The controller's side of one pod's relay: ``connect`` (retried until the relay
    answers), ``expose(name, target)`` (the pod-local port the ranks use for ``target``, an
    endpoint on this machine). ``stream()`` opens one port-forward to the relay: a socket-like
    object."""

    def __init__(self, stream: Callable[[], Any], key: bytes) -> None:
        self._open, self.key = stream, key
        self.targets: dict[str, tuple[str, int]] = {}
        self.ports: dict[str, int] = {}
        self._cond = threading.Condition()
        self._control: _Lines | None = None
        self.closed = False

    def _stream(self, op: str, **fields: Any) -> _Lines:
        sock = self._open()
        lines = _Lines(sock)
        try:
            sock.settimeout(HANDSHAKE_S)
            challenge = lines.recv()
            if not isinstance(challenge, dict) or "nonce" not in challenge:
                raise OSError("the relay did not answer")
            lines.send({"mac": _mac(self.key, str(challenge["nonce"])), "op": op, **fields})
            if op == "control":
                said = lines.recv()
                if said != {"op": "ok"}:
                    raise PermissionError("the pod's relay refused the controller's key "
                                          "(another run's relay on relay_port?)")
            sock.settimeout(None)
        except BaseException:
            _end(sock)
            raise
        return lines

    def connect(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                control = self._stream("control")
                break
            except PermissionError as exc:
                raise RuntimeFailure(str(exc)) from exc
            except Exception as exc:  # noqa: BLE001 - the pod's relay not up yet: again
                refused = _refused(exc)
                if refused or time.monotonic() > deadline or self.closed:
                    raise RuntimeFailure(
                        f"the API server refused the port-forward ({refused}): the user "
                        "needs 'create' on pods/portforward in the namespace" if refused
                        else f"the pod's relay did not answer within {timeout_s:g} s "
                        f"({exc})") from exc
                time.sleep(0.2)
        self._control = control
        threading.Thread(target=self._read, args=(control,), daemon=True,
                         name="meshplan-tunnel").start()
        threading.Thread(target=self._ping, args=(control,), daemon=True,
                         name="meshplan-tunnel-ping").start()

    def expose(self, name: str, target: tuple[str, int], timeout_s: float = 30.0) -> int:
        with self._cond:
            self.targets[name] = target
            known = self.ports.get(name)
        if known is not None:
            return known
        assert self._control is not None
        self._control.send({"op": "expose", "name": name})
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while name not in self.ports:
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    raise RuntimeFailure(f"the pod's relay did not expose {name!r}")
                self._cond.wait(min(left, 0.5))
            return self.ports[name]

    def close(self) -> None:
        self.closed = True
        if self._control is not None:
            _end(self._control.sock)
        with self._cond:
            self._cond.notify_all()

    def _ping(self, control: _Lines) -> None:
        while not self.closed:
            time.sleep(PING_S)
            try:
                control.send({"op": "ping"})
            except OSError:
                return

    def _read(self, control: _Lines) -> None:
        try:
            while (msg := control.recv()) is not None:
                if not isinstance(msg, dict):
                    break
                if msg.get("op") == "exposed":
                    with self._cond:
                        self.ports[str(msg["name"])] = int(msg["port"])
                        self._cond.notify_all()
                elif msg.get("op") == "open":
                    threading.Thread(target=self._attach, args=(str(msg["name"]),
                                                                int(msg["conn"])),
                                     daemon=True).start()
        except (OSError, ValueError, KeyError, TypeError):
            pass
        _end(control.sock)
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def _attach(self, name: str, cid: int) -> None:
        target = self.targets.get(name)
        try:
            if target is None:
                raise OSError(f"nothing exposed as {name!r}")
            local = socket.create_connection(target, timeout=10)   # first: nothing to undo
            local.settimeout(None)
        except OSError as exc:           # the relay closes the rank's connection (PENDING_S)
            logger.debug("meshplan: a rank's connection through the relay: %s", exc)
            return
        try:
            stream = self._stream("attach", conn=cid)
        except Exception as exc:  # noqa: BLE001 - the rank sees its connection end
            logger.debug("meshplan: a rank's connection through the relay failed (%s)", exc)
            _end(local)
            return
        _splice(stream.sock, local, stream.buf)


def _refused(exc: BaseException) -> str | None:
    """The API server's refusal of a port-forward (the client raises ``ApiException`` with
    status 0 and the websocket handshake's status in its reason), or None."""
    text = str(exc)
    for code, what in (("401", "401 Unauthorized"), ("403", "403 Forbidden"),
                       ("404", "404 Not Found")):
        if f"status {code}" in text.lower() or f"handshake status {code}" in text.lower():
            return what
    return None


class Tunnels:
    """The controller's tunnels to the relays of a run's pods (``reach="port-forward"``): one
    per running pod, made as each pod is seen Running (``pods``: the watch's view, ``_Pods``)
    and again for a pod made in a lost one's place; each exposes every endpoint the run has
    asked for so far (``expose``). ``open_stream(pod_name, port)``: a port-forward to a pod's
    port, a socket-like object."""

    def __init__(self, pods: Any, open_stream: Callable[[str, int], Any], key: bytes,
                 port: int, connect_timeout_s: float = 300.0) -> None:
        self.pods, self._open, self.key = pods, open_stream, key
        self.relay_port, self.connect_timeout_s = port, connect_timeout_s
        self.targets: dict[str, tuple[str, int]] = {}
        self.by_index: dict[int, tuple[str, Tunnel]] = {}     # index -> (pod, its tunnel)
        self.failed: dict[int, str] = {}      # index -> why its tunnel could not be made
        self._cond = threading.Condition()
        self._stop = threading.Event()
        threading.Thread(target=self._watch, daemon=True, name="meshplan-tunnels").start()

    def expose(self, name: str, target: tuple[str, int]) -> None:
        """Every pod's relay exposes ``target`` as ``name`` (now, and each pod seen later)."""
        with self._cond:
            self.targets[name] = target
            tunnels = [t for _, t in self.by_index.values()]
        for t in tunnels:
            if t._control is not None and not t.closed:
                try:
                    t.expose(name, target)
                except (RuntimeFailure, OSError):
                    pass                     # the pod is going: its successor exposes it

    def port(self, index: int, name: str, timeout_s: float = 60.0) -> int:
        """The pod-local port of ``name`` in pod ``index`` (waits for its tunnel)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                held = self.by_index.get(index)
                if held is not None and name in held[1].ports:
                    return held[1].ports[name]
                left = deadline - time.monotonic()
                if left <= 0 or index in self.failed:
                    raise RuntimeFailure(
                        f"launcher='k8s': pod {index}'s relay has not exposed {name!r}"
                        + (f": {self.failed[index]}" if index in self.failed else
                           f" within {timeout_s:g} s"))
                self._cond.wait(min(left, 0.2))

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            tunnels = [t for _, t in self.by_index.values()]
        for t in tunnels:
            t.close()

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            with self.pods.lock:
                running = {i: v["name"] for i, v in self.pods.by_index.items()
                           if v["phase"] == "Running"
                           and v["pod"].metadata.deletion_timestamp is None}
            for index, name in running.items():
                with self._cond:
                    held = self.by_index.get(index)
                    # a tunnel of this pod that ended (its control stream cut) is made again
                    if held is not None and held[0] == name and not (
                            held[1].closed and held[1]._control is not None):
                        continue
                    if held is not None:
                        held[1].close()       # the lost pod's
                    tunnel = Tunnel(lambda name=name: self._open(name, self.relay_port),
                                    self.key)
                    self.by_index[index] = (name, tunnel)
                    self.failed.pop(index, None)
                threading.Thread(target=self._start, args=(index, tunnel), daemon=True).start()

    def _start(self, index: int, tunnel: Tunnel) -> None:
        try:
            tunnel.connect(self.connect_timeout_s)
            with self._cond:
                targets = dict(self.targets)
            for name, target in targets.items():
                tunnel.expose(name, target)
        except (RuntimeFailure, OSError) as exc:
            logger.warning("meshplan: pod %d's relay: %s", index, exc)
            with self._cond:
                self.failed[index] = str(exc)
        with self._cond:
            self._cond.notify_all()
