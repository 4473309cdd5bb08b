"""The signed control channel (runtime/_channel.py): a controller and a worker end in one process
over real loopback ZeroMQ sockets.

Tensors are copied byte for byte, so every round trip demands bit-equality (compared as raw
bytes, which also covers bool, bfloat16 and float8). Forged, tampered, replayed and misaddressed
messages must be dropped and counted, and the channel must keep working afterwards.
"""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch
import zmq
from meshplan._errors import RuntimeFailure
from meshplan.runtime import ControllerChannel, Message, Secret, WorkerChannel, _channel

RUN = "run-test"


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and _bytes(a) == _bytes(b)


@pytest.fixture
def pair():
    """A controller and a connected worker (rank 0) that has said hello."""
    secret = Secret.new()
    ctrl = ControllerChannel(secret, RUN)
    worker = WorkerChannel(ctrl.address, secret, RUN, rank=0)
    worker.send("hello")
    assert ctrl.recv(5)[1].kind == "hello"
    yield ctrl, worker
    worker.close()
    ctrl.close()


@pytest.fixture
def raw(pair):
    """A raw DEALER connected to the controller with rank 1's identity, to send crafted frames."""
    ctrl, _ = pair
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, _channel.identity(ctrl.secret, 1))
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(ctrl.address)
    yield sock
    sock.close()
    ctx.term()


def _frames(secret: Secret, seq: int, *, src: int = 1, dst: int = _channel.CONTROLLER,
            run: str = RUN, kind: str = "x", tensors=()) -> list[bytes]:
    envelope = {"run": run, "seq": seq, "src": src, "dst": dst, "kind": kind}
    return [bytes(f) for f in _channel._encode(secret, envelope, {"n": seq}, list(tensors))]


def _expect_dropped(ctrl: ControllerChannel, before: int) -> None:
    with pytest.raises(TimeoutError):
        ctrl.recv(0.3)
    assert ctrl.rejected == before + 1


def _cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    f = torch.randn(3, 5, generator=g)
    out = [
        f, f.double(), f.half(), f.bfloat16(), torch.complex(f, -f),
        torch.arange(-7, 8, dtype=torch.int8), torch.arange(12, dtype=torch.int16).reshape(3, 4),
        torch.arange(10, dtype=torch.int32) * -3, torch.arange(6, dtype=torch.int64) << 40,
        torch.arange(200, 256, dtype=torch.uint8), torch.tensor([True, False, False, True]),
        torch.tensor(3.25),                                   # 0-dim
        torch.empty(0), torch.empty(2, 0, 3, dtype=torch.bfloat16), torch.empty(0, dtype=torch.bool),
        f.t(), f[:, ::2], torch.randn(4, 6, generator=g).bfloat16()[1:, 2:5],  # non-contiguous
    ]
    if hasattr(torch, "float8_e4m3fn"):
        out.append(f.to(torch.float8_e4m3fn))
    if hasattr(torch, "uint16"):
        out.append(torch.arange(5, dtype=torch.int32).to(torch.uint16))
    return out


@pytest.mark.timeout(60)
def test_tensors_round_trip_both_ways(pair) -> None:
    ctrl, worker = pair
    sent = _cases()
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # no "non-writable buffer" warnings
        worker.send("up", {"a": [1, 2.5, None, "s"], "nested": {"k": True}}, sent)
        rank, up = ctrl.recv(5)
        ctrl.send(0, "down", {"echo": 1}, list(up.tensors))
        down = worker.recv(5)
    assert rank == 0 and up == Message("up", up.header, up.tensors)
    assert up.header == {"a": [1, 2.5, None, "s"], "nested": {"k": True}}
    assert down.kind == "down" and down.header == {"echo": 1}
    for a, b, c in zip(sent, up.tensors, down.tensors, strict=True):
        assert _same(a, b) and _same(a, c), (a.dtype, a.shape)
        assert b.is_contiguous() and not b.requires_grad
    up.tensors[0].add_(1)                        # received tensors are writable copies
    assert ctrl.rejected == worker.rejected == 0


@pytest.mark.timeout(60)
def test_large_tensor_round_trip(pair) -> None:
    ctrl, worker = pair
    """Sent zero-copy; send() returns once ZeroMQ released the buffer, so it may change then."""
    big = torch.arange(16 * 1024 * 1024, dtype=torch.float32)     # 64 MiB
    t0 = time.perf_counter()
    ctrl.send(0, "big", None, [big])
    big.add_(1)
    got = worker.recv(30).tensors[0]
    worker.send("big", None, [got])
    got.mul_(0)
    back = ctrl.recv(30)[1].tensors[0]
    assert time.perf_counter() - t0 < 20
    expected = torch.arange(16 * 1024 * 1024, dtype=torch.float32)
    assert torch.equal(back, expected) and ctrl.rejected == worker.rejected == 0


@pytest.mark.timeout(60)
def test_tampered_frames_are_dropped(pair, raw) -> None:
    ctrl, _ = pair
    secret = ctrl.secret
    base = time.time_ns()
    good = _frames(secret, base, tensors=[torch.arange(4.0)])
    for i, frame in enumerate(good):           # flip one byte in each frame: header, buffer, MAC
        bad = list(good)
        bad[i] = bytes([frame[0] ^ 1]) + frame[1:]
        before = ctrl.rejected
        raw.send_multipart(bad)
        _expect_dropped(ctrl, before)
    before = ctrl.rejected
    raw.send_multipart(good[:1] + good[2:])     # a dropped buffer frame
    _expect_dropped(ctrl, before)
    raw.send_multipart([b"{}"])                 # no MAC at all
    _expect_dropped(ctrl, before + 1)
    raw.send_multipart(good)                    # the untouched message still gets through
    rank, msg = ctrl.recv(5)
    assert rank == 1 and torch.equal(msg.tensors[0], torch.arange(4.0))


@pytest.mark.timeout(60)
def test_replayed_message_is_dropped(pair, raw) -> None:
    ctrl, _ = pair
    base = time.time_ns()
    first = _frames(ctrl.secret, base + 10)
    raw.send_multipart(first)
    assert ctrl.recv(5)[1].header == {"n": base + 10}
    before = ctrl.rejected
    raw.send_multipart(first)                                    # replay
    _expect_dropped(ctrl, before)
    raw.send_multipart(_frames(ctrl.secret, base + 5))          # older sequence number
    _expect_dropped(ctrl, before + 1)
    raw.send_multipart(_frames(ctrl.secret, base + 11))
    assert ctrl.recv(5)[1].header == {"n": base + 11}


@pytest.mark.timeout(60)
def test_wrong_secret_run_or_sender_is_dropped(pair, raw) -> None:
    ctrl, worker = pair
    seq = time.time_ns()
    cases = [
        _frames(Secret.new(), seq + 1),                 # another secret
        _frames(ctrl.secret, seq + 2, run="other-run"),  # unknown run id
        _frames(ctrl.secret, seq + 3, src=0),           # identity 1 signs as rank 0
        _frames(ctrl.secret, seq + 4, dst=3),           # addressed to someone else
    ]
    for frames in cases:
        before = ctrl.rejected
        raw.send_multipart(frames)
        _expect_dropped(ctrl, before)
    forged = WorkerChannel(ctrl.address, Secret.new(), RUN, rank=2)
    forged.send("hello")
    _expect_dropped(ctrl, ctrl.rejected)
    forged.close()
    # controller -> worker: a controller with another secret cannot even address the worker
    # (identities carry a tag of the secret), and a message that reached it would be dropped
    other = ControllerChannel(Secret.new(), RUN)
    w2 = WorkerChannel(other.address, ctrl.secret, RUN, rank=0)
    w2.send("hello")                                    # `other` drops it
    with pytest.raises(TimeoutError):
        other.recv(0.3)
    with pytest.raises(RuntimeFailure, match="not connected"):
        other.send(0, "ping")
    assert w2.rejected == 0 and other.rejected == 1
    w2.close()
    other.close()
    worker.send("still-ok")
    assert ctrl.recv(5)[1].kind == "still-ok"


@pytest.mark.timeout(60)
def test_secret_api_and_bad_input(pair) -> None:
    ctrl, worker = pair
    s = Secret.new()
    assert len(s.key) == 32 and Secret.from_hex(s.hex()) == s and s.hex() not in repr(s)
    with pytest.raises(ValueError):
        Secret(b"short")
    with pytest.raises(TypeError, match="JSON"):
        worker.send("x", {"t": object()})
    with pytest.raises(TypeError, match="torch tensors"):
        worker.send("x", None, [[1, 2]])
    with pytest.raises(RuntimeFailure, match="rank 7: it is not connected"):
        ctrl.send(7, "ping")
    with pytest.raises(TimeoutError):
        worker.recv(0.05)
    ctrl.close()
    ctrl.close()                                        # idempotent
    with pytest.raises(RuntimeFailure, match="closed"):
        ctrl.send(0, "ping")


# ---- who may connect at all (issue 19, point 1) ---------------------------------------------

_NOBODY_PY = "/usr/bin/python3"      # the system interpreter: `nobody` cannot enter the venv


def _as_nobody(code: str) -> str:
    import pwd
    import subprocess

    if os.geteuid() != 0 or not os.path.exists(_NOBODY_PY):
        pytest.skip("needs root (to run a peer as `nobody`) and /usr/bin/python3")
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no `nobody` user")
    out = subprocess.run([_NOBODY_PY, "-c", code], user="nobody", capture_output=True,
                         text=True, timeout=20)
    return out.stdout + out.stderr


@pytest.mark.timeout(60)
def test_another_local_user_cannot_connect_on_one_host(pair) -> None:
    """One host: the controller's socket admits its own user only. `nobody` connecting and
    sending ZeroMQ's greeting is closed before any reply (an admitted peer gets the 10-byte
    start of the controller's greeting), and leaves no trace on the channel."""
    ctrl, worker = pair
    assert ctrl.address.startswith("ipc://@"), ctrl.address      # no file to leave behind
    probe = f"""
import socket
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(5)
try:
    s.connect({ctrl.address[len("ipc://"):].replace("@", chr(0), 1)!r})
    s.sendall(b"\\xff" + bytes(8) + b"\\x7f\\x03")
    print("reply", len(s.recv(64)))
except OSError as e:
    print("closed", type(e).__name__)
"""
    said = _as_nobody(probe)
    assert "reply 0" in said or "closed" in said, said
    worker.send("still-ok")
    assert ctrl.recv(5)[1].kind == "still-ok" and ctrl.rejected == 0


@pytest.mark.timeout(60)
def test_over_tcp_only_holders_of_the_run_key_get_in(monkeypatch) -> None:
    """TCP (ranks on other hosts): a peer without the run's secret cannot take a rank's
    identity even when it knows it, nor get a frame through, with no key or with a CURVE key
    of its own; an idle connection is dropped after the handshake deadline; the real rank
    then connects and talks."""
    import socket

    monkeypatch.setattr(_channel, "HANDSHAKE_S", 0.5)
    secret = Secret.new()
    ctrl = ControllerChannel(secret, RUN, transport="tcp")
    ctx = zmq.Context()
    rogues = []
    for keys in (None, zmq.curve_keypair()):
        rogue = ctx.socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.setsockopt(zmq.IDENTITY, _channel.identity(secret, 0))
        if keys is not None:
            rogue.setsockopt(zmq.CURVE_SERVERKEY, _channel._curve_keys(secret, "server")[0])
            rogue.setsockopt(zmq.CURVE_PUBLICKEY, keys[0])
            rogue.setsockopt(zmq.CURVE_SECRETKEY, keys[1])
        rogue.connect(ctrl.address)
        rogue.send_multipart(_frames(secret, time.time_ns(), src=0))   # even correctly signed
        rogues.append(rogue)
    host, port = ctrl.address[len("tcp://"):].rsplit(":", 1)
    idle = socket.create_connection((host, int(port)), timeout=5)
    with pytest.raises(TimeoutError):
        ctrl.recv(1.0)
    assert ctrl.rejected == 0                # nothing reached the channel at all
    assert idle.recv(64)[:1] == b"\xff" and idle.recv(64) == b""   # greeting, then dropped
    worker = WorkerChannel(ctrl.address, secret, RUN, rank=0)
    worker.send("hello")
    rank, msg = ctrl.recv(5)
    assert (rank, msg.kind) == (0, "hello")
    ctrl.send(0, "ping")
    assert worker.recv(5).kind == "ping"
    for sock in (*rogues, idle):
        sock.close()
    worker.close()
    ctrl.close()
    ctx.term()


@pytest.mark.timeout(60)
def test_a_flood_of_tcp_connections_is_bounded(monkeypatch) -> None:
    """Over TCP, idle connections from one address beyond the gate's limit are shut down at
    once (the controller does not hold their descriptors for the handshake deadline), and a
    rank from another address still gets in and talks during the flood."""
    import socket

    from meshplan.runtime import _gate

    monkeypatch.setattr(_gate, "PER_PEER", 4)
    secret = Secret.new()
    ctrl = ControllerChannel(secret, RUN, transport="tcp")
    host, port = ctrl.address[len("tcp://"):].rsplit(":", 1)
    flood = [socket.create_connection((host, int(port)), timeout=3, source_address=("127.0.0.2", 0))
             for _ in range(12)]
    worker = WorkerChannel(ctrl.address, secret, RUN, rank=0)
    worker.send("hello")
    assert ctrl.recv(5)[1].kind == "hello"          # the rank is not held back by the flood

    time.sleep(1.0)                                 # well inside the 5 s handshake deadline

    def closed(conn: socket.socket) -> bool:        # ZeroMQ's greeting, then EOF if refused
        conn.setblocking(False)
        try:
            while conn.recv(64):
                pass
            return True
        except BlockingIOError:
            return False
    closed = [closed(c) for c in flood]
    assert closed.count(False) == 4 and closed[:4] == [False] * 4, closed
    assert ctrl._gate.refused == 8
    for conn in flood:
        conn.close()
    worker.close()
    ctrl.close()


@pytest.mark.timeout(60)
def test_rejections_are_counted_and_their_lines_rate_limited(pair, raw, caplog) -> None:
    ctrl, _ = pair
    seq = time.time_ns()
    with caplog.at_level("WARNING", logger="meshplan.runtime._channel"):
        for i in range(40):
            raw.send_multipart(_frames(Secret.new(), seq + i))
        with pytest.raises(TimeoutError):
            ctrl.recv(1.0)
    assert ctrl.rejected == 40
    lines = [r for r in caplog.records if "dropped a message" in r.getMessage()]
    assert len(lines) == _channel._LOG_FIRST, len(lines)


@pytest.mark.timeout(60)
def test_no_frame_exceeds_the_message_limit(monkeypatch) -> None:
    """Issue 19, point 1: the sender refuses a tensor past the limit, naming it and the knob;
    a peer that sends such a frame anyway is dropped by ZeroMQ before the receiver holds it,
    and the channel goes on."""
    monkeypatch.setenv(_channel.ENV_MAX_MESSAGE, str(1 << 20))
    secret = Secret.new()
    with ControllerChannel(secret, RUN) as ctrl, \
            WorkerChannel(ctrl.address, secret, RUN, rank=0) as worker:
        worker.send("hello", tensors=[torch.zeros(1 << 18)])        # 1 MiB: at the limit
        assert ctrl.recv(5)[1].tensors[0].numel() == 1 << 18
        with pytest.raises(RuntimeFailure, match=r"tensor 0 of 'big' \(float32 \(262145,\), "
                           r"1048580 bytes\) exceeds the 1048576-byte.*MESHPLAN_MAX_MESSAGE"):
            worker.send("big", tensors=[torch.zeros((1 << 18) + 1)])
        ctx = zmq.Context()
        rogue = ctx.socket(zmq.DEALER)      # holds the run's identity tag, skips the check
        rogue.setsockopt(zmq.IDENTITY, _channel.identity(secret, 1))
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.connect(ctrl.address)
        try:
            frames = _frames(secret, time.time_ns(), tensors=[torch.zeros(1 << 19)])
            rogue.send_multipart(frames)
            with pytest.raises(TimeoutError):
                ctrl.recv(0.5)
        finally:
            rogue.close()
            ctx.term()
        worker.send("after")
        assert ctrl.recv(5)[1].kind == "after"
    with pytest.raises(RuntimeFailure, match="MESHPLAN_MAX_MESSAGE_BYTES='lots'"):
        monkeypatch.setenv(_channel.ENV_MAX_MESSAGE, "lots")
        ControllerChannel(secret, RUN)


def test_heartbeats_mark_a_rank_alive_and_a_silent_controller_lost(monkeypatch) -> None:
    """A rank on another host beats from its own socket: the controller records the beat and
    never hands it out as a message (nor mixes its sequence numbers with the rank's own
    messages); when the controller goes away, the rank's ``on_lost`` runs after the limit."""
    import threading

    monkeypatch.setattr(_channel, "BEAT_INTERVAL_S", 0.1)
    secret = Secret.new()
    ctrl = ControllerChannel(secret, RUN, transport="tcp")
    worker = WorkerChannel(ctrl.address, secret, RUN, rank=3)
    lost = threading.Event()
    try:
        worker.send("hello")
        assert ctrl.recv(5)[0] == 3
        worker.start_heartbeat(1.0, lost.set)
        deadline = time.monotonic() + 10      # its own CURVE handshake first: slow under load
        while 3 not in ctrl.last_beat and time.monotonic() < deadline:
            with pytest.raises(TimeoutError):
                ctrl.recv(0.1)                # beats are read, never handed out
        time.sleep(0.3)
        worker.send("step")
        rank, msg = ctrl.recv(5)               # the beats before it are not handed out
        assert (rank, msg.kind) == (3, "step") and ctrl.rejected == 0
        assert time.monotonic() - ctrl.last_beat[3] < 0.5
        with pytest.raises(TimeoutError):
            ctrl.recv(0.3)
        assert not lost.is_set()
    finally:
        ctrl.close()
    assert lost.wait(10)                       # the controller is gone: about 1 s later
    worker.close()


def test_lost_after_is_checked(monkeypatch) -> None:
    assert _channel.lost_after_s({}) == _channel.DEFAULT_LOST_AFTER_S
    assert _channel.lost_after_s({"MESHPLAN_LOST_AFTER_S": "7.5"}) == 7.5
    for bad in ("soon", "1", "-3"):
        with pytest.raises(RuntimeFailure, match="MESHPLAN_LOST_AFTER_S"):
            _channel.lost_after_s({"MESHPLAN_LOST_AFTER_S": bad})


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_the_end_of_a_ranks_connection_is_seen_in_order(transport) -> None:
    """A rank whose newest message came on a connection that then ends is in ``ended``, in
    the order the connections ended (which rank of a job ended first: over TCP the Gate's
    thread passes the ends on); a message from the rank's new connection clears it, and
    ``forget`` drops a rank being replaced. Only on one host (ipc) are ends seen in step
    with the messages, so only there does the channel say it ``sees_drops``."""
    secret = Secret.new()
    with ControllerChannel(secret, RUN, transport=transport) as ctrl:
        assert ctrl.sees_drops is (transport == "ipc")
        workers = [WorkerChannel(ctrl.address, secret, RUN, rank=r) for r in range(3)]
        for w in workers:
            w.send("hello")
        assert sorted(ctrl.recv(10)[0] for _ in workers) == [0, 1, 2]
        for r in (2, 0):
            workers[r].close()
            deadline = time.monotonic() + 10
            while r not in ctrl.ended and time.monotonic() < deadline:
                with pytest.raises(TimeoutError):
                    ctrl.recv(0.05)
        assert sorted(ctrl.ended, key=ctrl.ended.get) == [2, 0]
        again = WorkerChannel(ctrl.address, secret, RUN, rank=2)
        again.send("hello")
        assert ctrl.recv(10)[0] == 2 and sorted(ctrl.ended) == [0]
        ctrl.forget(0)
        assert ctrl.ended == {}
        for w in (again, workers[1]):
            w.close()
