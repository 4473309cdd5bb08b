"""The in-memory snapshot files (``runtime/_snapshot.py``) and the controller's recovery
bookkeeping (``runtime/_recovery.py``), without processes."""

from __future__ import annotations

import pytest
import torch

from meshplan import RuntimeFailure
from meshplan.runtime._recovery import Recovery, smaller_meshes
from meshplan.runtime._snapshot import Snapshot, SnapshotFiles, read_mesh

PIECES = {"w": ((3, 4), torch.float32), "step": ((), torch.float32),
          "ids": ((5,), torch.int64), "h": ((2, 2), torch.bfloat16)}


def _state(k: float) -> dict[str, torch.Tensor]:
    k = float(k)
    return {"w": torch.full((3, 4), k), "step": torch.tensor(k),
            "ids": torch.arange(5) * int(k), "h": torch.full((2, 2), k, dtype=torch.bfloat16)}


@pytest.fixture
def files():
    f = SnapshotFiles(2)
    yield f
    f.close()


def test_two_slots_keep_the_last_two_steps_and_a_replacement_reads_them(files) -> None:
    snap = Snapshot(files.path(0), PIECES, rank=0)
    for step in (-1, 0, 1):
        snap.write(step, _state(step + 10))
    assert sorted(snap.steps()) == [0, 1]
    again = Snapshot(files.path(0), PIECES, rank=0)       # what a replacement rank opens
    got = again.read(0)
    for k, v in _state(10).items():
        assert torch.equal(got[k], v) and got[k].dtype == v.dtype, k
    assert again.steps() == [0], "a newer snapshot is another timeline once restored"


def test_a_copy_cut_short_leaves_the_older_snapshot(files) -> None:
    snap = Snapshot(files.path(1), PIECES, rank=1)
    snap.write(4, _state(4))
    snap.write(5, _state(5))
    broken = {**_state(6), "w": None}          # the copy of "w" fails half way through
    with pytest.raises(TypeError):
        snap.write(6, broken)
    assert snap.steps() == [5]
    assert torch.equal(snap.read(5)["w"], _state(5)["w"])


def test_a_snapshot_copied_behind_is_settled_before_it_is_read(files) -> None:
    snap = Snapshot(files.path(0), PIECES, rank=0)
    state = _state(1)
    snap.write_behind(1, state)
    assert snap.steps() == [1]                  # steps() waits for the copy
    snap.write_behind(2, _state(2))
    snap.reset(7, _state(7))                    # the state changed outside a step
    assert snap.steps() == [7]
    assert torch.equal(snap.read(7)["w"], _state(7)["w"])
    snap.write_behind(8, {**_state(8), "w": None})   # the copy fails: the older one is kept
    snap.settle()
    assert snap.steps() == [7] and [s for s, _ in snap.lost] == [8]
    assert "TypeError" in snap.lost[0][1]


def test_a_file_laid_out_for_other_pieces_is_refused(files) -> None:
    Snapshot(files.path(0), PIECES, rank=0).write(0, _state(0))
    with pytest.raises(RuntimeFailure, match="other pieces than its plan"):
        Snapshot(files.path(0), {**PIECES, "w": ((4, 3), torch.float32)}, rank=0)
    with pytest.raises(RuntimeFailure, match="no snapshot of step 7"):
        Snapshot(files.path(0), PIECES, rank=0).read(7)


def test_the_controller_keeps_the_batches_since_the_newest_snapshot() -> None:
    r = Recovery(max_restarts=3, snapshot_every=2, hang_s=5.0)
    r.started(0)
    assert r._snaps == [-1]
    for step in range(5):
        kept = r.remember(step, 0, {"step": step, "snapshot": r.wants_snapshot(step)},
                          {"x": torch.tensor([step])})
        assert kept.batch["x"] is not None
        r.committed(step, 0.1)
    assert r._snaps == [1, 3]                   # snapshots after steps 1 and 3
    assert [k.step for k in r.replay(3, 5)] == [4]
    # a rank killed while copying snapshot 3 holds only 1: the batches since 1 are kept
    assert [k.step for k in r.replay(1, 5)] == [2, 3, 4]
    with pytest.raises(RuntimeFailure, match="not kept"):
        r.replay(0, 5)
    assert r.restore_point([[1, 3], [3], [3, 5]], in_flight=5) == 3
    assert r.restore_point([[1, 3], [1, 5]], in_flight=5) == 1
    assert r.restore_point([[5], [5]], in_flight=5) is None


def test_the_step_deadline_follows_the_measured_steps() -> None:
    r = Recovery(max_restarts=1, snapshot_every=1, hang_s=2.0)
    assert r.deadline(300.0) == 300.0          # nothing measured yet
    for _ in range(3):
        r.committed(0, 0.5)
    assert r.deadline(300.0) == 5.0            # 10 x the median
    assert r.deadline(3.0) == 3.0              # never over timeout_s
    r = Recovery(max_restarts=1, snapshot_every=1, hang_s=2.0)
    for _ in range(3):
        r.committed(0, 0.01)
    assert r.deadline(300.0) == 2.0            # never under hang_s
    # the first step after a recovery (ranks started anew) is held to timeout_s only, and
    # its time is not measured among the steady steps'
    r.restarted()
    assert r.deadline(300.0) == 300.0
    r.committed(1, 9.0)
    assert r.deadline(300.0) == 2.0


def test_a_rank_reads_the_pieces_another_rank_snapshots(files) -> None:
    """Replicated pieces are snapshotted by one of their holders; the others read theirs
    from that holder's file, without touching its slots."""
    owner = Snapshot(files.path(1), {"w": PIECES["w"]}, rank=1)
    owner.write(3, _state(3))
    owner.write(4, _state(4))
    peer = Snapshot.existing(files.path(1), rank=1)
    assert torch.equal(peer.read(3, ["w"], mine=False)["w"], _state(3)["w"])
    assert sorted(owner.steps()) == [3, 4], "a reader does not drop the owner's newer slot"
    with pytest.raises(RuntimeFailure, match="no piece 'ids'"):
        peer.read(3, ["ids"], mine=False)
    peer.close()
    with pytest.raises(RuntimeFailure, match="holds no snapshot"):
        Snapshot.existing(files.path(0), rank=0)      # never written


def test_the_controller_reads_a_whole_mesh_back_from_the_files_of_ranks_that_are_gone(files):
    """``elastic=``: the newest step every holding file has (rank 0 has no snapshot of step 5,
    so step 4), every rank's pieces from their owners' files (rank 1 holds rank 0's ``w``)."""
    a = Snapshot(files.path(0), {"ids": PIECES["ids"]}, rank=0)
    b = Snapshot(files.path(1), {"w": PIECES["w"], "ids": PIECES["ids"]}, rank=1)
    for k in (3, 4):
        a.write(k, _state(k))
        b.write(k, {"w": _state(k)["w"], "ids": _state(k)["ids"] + 1})
    b.write(5, _state(5))
    owners = {(0, "w"): 1, (0, "ids"): 0, (1, "w"): 1, (1, "ids"): 1}
    choose = Recovery(max_restarts=1, snapshot_every=1, hang_s=1.0).restore_point
    step, held = read_mesh(files, owners, lambda h: choose(h, 9))
    assert step == 4
    assert torch.equal(held[0]["w"], _state(4)["w"]) and torch.equal(held[1]["w"], held[0]["w"])
    assert torch.equal(held[0]["ids"], _state(4)["ids"])
    assert torch.equal(held[1]["ids"], _state(4)["ids"] + 1)
    assert read_mesh(files, owners, lambda h: choose(h, 3)) is None
    a.close()
    b.close()


def test_a_shrink_chooses_among_the_meshes_the_survivors_can_form() -> None:
    assert smaller_meshes({"dp": 4}, 3) == [{"dp": 3}, {"dp": 2}, {"dp": 1}]
    assert smaller_meshes({"dp": 2, "tp": 2}, 3, least=2) == [{"dp": 2, "tp": 1},
                                                               {"dp": 1, "tp": 2}]
    big = smaller_meshes({"dp": 4, "tp": 8}, 31)
    assert big[0] == {"dp": 4, "tp": 7} and len(big) == 8
    assert all(m["dp"] <= 4 and m["tp"] <= 8 and m["dp"] * m["tp"] <= 31 for m in big)
    assert smaller_meshes({"dp": 2}, 1, least=2) == []


def _replica_pair(files, key_send=b"k" * 32, key_serve=b"k" * 32):
    """A rank's snapshot (file 0) with its replica served into file 1 by a keeper thread."""
    import socket
    import threading

    from meshplan.runtime._snapshot import Replica, serve_replica

    listener = socket.create_server(("127.0.0.1", 0))
    errors: list[BaseException] = []

    def keeper() -> None:
        conn, _ = listener.accept()
        try:
            serve_replica(conn, key_serve, lambda rank: files.path(1))
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            errors.append(exc)
        finally:
            conn.close()
    thread = threading.Thread(target=keeper, daemon=True)
    thread.start()
    snap = Snapshot(files.path(0), PIECES, rank=0)
    snap.replica = Replica(listener.getsockname(), key_send, 0, snap.text, timeout_s=10.0)
    return snap, thread, errors, listener


def test_a_replica_on_a_peer_keeps_each_snapshot_and_drops_what_the_rank_drops(files) -> None:
    """Each slot written goes to the peer's file too, valid once sealed; a rank that goes back
    to a step (``read``) or starts over (``reset``) has its dropped slots dropped in the copy
    at its next snapshot; the copy reads as the rank's file does."""
    snap, thread, errors, listener = _replica_pair(files)
    for step in (0, 1, 2):
        snap.write(step, _state(step))
    copy = Snapshot.existing(files.path(1), rank=0)
    assert sorted(copy.steps()) == [1, 2] and snap.replica.broken is None
    for k, v in _state(1).items():
        assert torch.equal(copy.read(1, mine=False)[k], v), k
    snap.read(1)                          # a restore to step 1 drops step 2 ...
    snap.write(2, _state(20))             # ... and the replay writes it anew
    assert sorted(copy.steps()) == [1, 2]
    assert torch.equal(copy.read(2, mine=False)["w"], _state(20)["w"])
    snap.reset(7, _state(7))              # a state loaded: the only snapshot now
    assert copy.steps() == [7]
    snap.close()
    thread.join(10)
    assert not errors
    copy.close()
    listener.close()


def test_a_replica_refuses_a_sender_without_the_key(files) -> None:
    snap, thread, errors, listener = _replica_pair(files, key_send=b"x" * 32)
    snap.write(0, _state(0))              # the rank's own copy is whole ...
    assert snap.steps() == [0]
    thread.join(10)                       # ... the keeper refused the copy, and said why
    assert errors and "MAC" in str(errors[0])
    assert snap.replica.broken and "failed" in snap.replica.broken
    snap.write(1, _state(1))              # no copy any more, and no error either
    assert sorted(snap.steps()) == [0, 1]
    snap.close()
    listener.close()


def test_a_replica_connection_that_does_not_say_hello_is_dropped(files) -> None:
    """A silent connection holds a keeper's thread for ``hello_s`` only."""
    import socket
    import time

    from meshplan.runtime._snapshot import serve_replica

    a, b = socket.socketpair()
    t0 = time.monotonic()
    with pytest.raises(OSError):             # socket.timeout
        serve_replica(a, b"k" * 32, files.path, hello_s=0.3)
    assert time.monotonic() - t0 < 3
    a.close()
    b.close()


def test_a_frame_that_arrives_in_pieces_is_read_whole() -> None:
    """A socket with a timeout reads without MSG_WAITALL's help: a header that arrives a few
    bytes at a time (a large index on a slow link) is still one frame."""
    import socket
    import threading
    import time

    from meshplan.runtime._snapshot import Wire

    class Capture:
        data = b""

        def sendall(self, b) -> None:
            Capture.data += bytes(b)

    Wire(Capture(), b"k" * 32, b"n" * 16).send({"k": "hello", "index": "x" * 5000})
    a, b = socket.socketpair()
    a.settimeout(5.0)

    def trickle() -> None:
        for i in range(0, len(Capture.data), 700):
            b.sendall(Capture.data[i:i + 700])
            time.sleep(0.01)
    threading.Thread(target=trickle, daemon=True).start()
    head = Wire(a, b"k" * 32, b"n" * 16).recv()
    assert head is not None and head["index"] == "x" * 5000
    a.close()
    b.close()
