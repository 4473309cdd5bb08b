"""A bound on the TCP connections that have not authenticated yet (the control channel over TCP).

ZeroMQ accepts every TCP connection and gives it ``HANDSHAKE_IVL`` to finish CURVE; it has no
limit of its own on how many such connections it holds, so a flood of idle connections could
exhaust the controller's file descriptors. ``Gate`` watches the listening socket's monitor
events (ZeroMQ reports each accepted connection with its file descriptor) and shuts down, at
once, a new connection beyond ``per_peer`` still-authenticating connections from the same
address or beyond ``total`` overall. A connection still open ``grace_s`` after it was accepted
has authenticated (ZeroMQ drops the others at the handshake deadline) and no longer counts.

A refused rank is not lost: its DEALER reconnects on its own and gets in as soon as the
connections ahead of it have authenticated (milliseconds) or been dropped (the deadline).
"""

from __future__ import annotations

import logging
import os
import socket as _socket
import threading
import time
from collections import Counter
from typing import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from ._throttle import Throttle

logger = logging.getLogger(__name__)

PER_PEER, TOTAL = 16, 256           # still-authenticating connections: per address, in all
_LOG_FIRST, _LOG_EVERY_S = 3, 10.0  # refusal lines: the first few, then one per interval
_TICK_S = 0.25


class Gate:
    """Run a thread that bounds ``socket``'s unauthenticated TCP connections; ``stop()`` it
    before the socket's context is terminated. ``on_end(fd)`` is called (from that thread) as
    each connection ends: the socket's one monitor is the Gate's."""

    def __init__(self, socket: zmq.Socket, run_id: str, grace_s: float,
                 per_peer: int | None = None, total: int | None = None,
                 on_end: Callable[[int], None] | None = None) -> None:
        per_peer = PER_PEER if per_peer is None else per_peer
        total = TOTAL if total is None else total
        if per_peer < 1 or total < per_peer:
            raise ValueError(f"need 1 <= per_peer <= total, got {per_peer}, {total}")
        self.run_id, self.grace_s, self.per_peer, self.total = run_id, grace_s, per_peer, total
        self.refused = 0
        self._throttle = Throttle(_LOG_FIRST, _LOG_EVERY_S)
        self._young: dict[int, tuple[str, float]] = {}    # fd -> (peer address, accepted at)
        self._on_end = on_end           # told of each connection's end (its descriptor)
        self._monitor = socket.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._socket = socket
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"meshplan-gate-{run_id}",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()
            self._socket.disable_monitor()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                fresh: dict[int, None] = {}
                if self._monitor.poll(int(_TICK_S * 1000)):
                    # the whole batch first: an fd accepted and closed in it is not vetted
                    while self._monitor.poll(0):
                        event = recv_monitor_message(self._monitor)
                        fd = int(event["value"])
                        if event["event"] == zmq.EVENT_ACCEPTED:
                            fresh[fd] = None
                        else:
                            fresh.pop(fd, None)
                            self._young.pop(fd, None)
                            if self._on_end is not None:
                                self._on_end(fd)
                now = time.monotonic()
                self._young = {fd: v for fd, v in self._young.items() if now - v[1] < self.grace_s}
                for fd in fresh:
                    self._vet(fd, now)
        finally:
            self._monitor.close(linger=0)

    def _vet(self, fd: int, now: float) -> None:
        try:
            conn = _socket.socket(fileno=os.dup(fd))
        except OSError:
            return                                  # already gone
        with conn:
            try:
                peer = conn.getpeername()[0]
            except OSError:
                return
            from_peer = Counter(p for p, _ in self._young.values())[peer]
            if from_peer < self.per_peer and len(self._young) < self.total:
                self._young[fd] = (peer, now)
                return
            # shutdown acts on the connection itself; ZeroMQ then closes its descriptor
            try:
                conn.shutdown(_socket.SHUT_RDWR)
            except OSError:
                return
        self.refused += 1
        more = self._throttle.due(self.refused, now)
        if more is not None:
            since = f" ({more} more refused since the last line)" if more > 0 else ""
            logger.warning(
                "control channel (run %s): refused a TCP connection from %s: %d connections "
                "from it and %d in all are still authenticating (limits %d and %d)%s",
                self.run_id, peer, from_peer, len(self._young), self.per_peer, self.total, since)
