"""The shared-memory all-reduce (``backends/_shm.py``) that gloo communicators use between ranks
of one host.

- ``ShmGroup`` alone, its members as threads of this process (the semaphores and the mapping
  are the same as between processes): odd sizes, inputs larger than a slot (chunks), every
  op and dtype, members at different speeds, several operations back to back, all-gathers
  and reduce-scatters between started all-reduces, a member that never arrives. (Every
  collective of ``TorchCommunicator`` also runs through it in ``test_comm.py``.)
- ``TorchCommunicator`` in real processes: the group's file is gone once every member mapped
  it, a ``/dev/shm`` without room falls back to gloo on every member, and a peer that stops
  joining makes the others raise within the timeout.

Tolerances: integer, bool and max results are exact. Float sums are compared with the
group-order sum within ``n * eps * sum(|x_i|)``: each member reduces its segment in its own
order (own slot first), and any two summation orders are within ``(n - 1)`` unit roundoffs of
``sum(|x_i|)`` of the exact sum (``eps`` = 2 unit roundoffs). Every member must get
bit-identical results: each element is reduced once, by one member.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from meshplan._errors import RuntimeFailure
from meshplan.backends import _shm

pytestmark = pytest.mark.skipif(not _shm.available(), reason="needs Linux and /dev/shm")


def _group(members: int, capacity: int, timeout_s: float = 20.0) -> list[_shm.ShmGroup]:
    path, token = _shm.create_file(members, capacity, "test")
    try:
        first = _shm.ShmGroup(path, token, members, 0, capacity, init=True, timeout_s=timeout_s)
        rest = [_shm.ShmGroup(path, token, members, i, capacity, init=False,
                              timeout_s=timeout_s) for i in range(1, members)]
    finally:
        os.unlink(path)
    return [first, *rest]


def _threads(fn, members: int) -> list:
    out: list = [None] * members
    errors: list = []

    def run(i: int) -> None:
        try:
            out[i] = fn(i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    ts = [threading.Thread(target=run, args=(i,)) for i in range(members)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    if errors:
        raise errors[0]
    return out


def _input(seed: int, i: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + i)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) < 0.3
    if not dtype.is_floating_point:
        return torch.randint(-100, 100, (n,), generator=g, dtype=dtype)
    return (torch.randn(n, generator=g, dtype=torch.float64) * (1 + i)).to(dtype)


def _reference(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    if xs[0].dtype == torch.bool:
        return torch.stack(xs).any(0)
    if op == "max":
        return torch.stack(xs).amax(0)
    total = xs[0].clone()
    for x in xs[1:]:
        total = total + x
    return total / len(xs) if op == "avg" else total


def _close(got: torch.Tensor, xs: list[torch.Tensor], op: str) -> bool:
    want = _reference(xs, op)
    if not got.is_floating_point() or op == "max":
        return torch.equal(got, want)
    n = len(xs)
    bound = n * torch.finfo(got.dtype).eps * sum(x.double().abs() for x in xs)
    if op == "avg":
        bound = bound / n
    return bool(((got.double() - want.double()).abs() <= bound).all())


CASES = [(torch.float32, "sum"), (torch.float32, "avg"), (torch.float32, "max"),
         (torch.float64, "sum"), (torch.float16, "sum"), (torch.bfloat16, "avg"),
         (torch.int64, "sum"), (torch.int32, "max"), (torch.bool, "max")]
SIZES = (1, 2, 3, 17, 64, 1000, 4099)


@pytest.mark.parametrize("members", [2, 3, 4])
def test_every_op_dtype_and_size_back_to_back_with_chunks(members: int) -> None:
    """Slots of 256 bytes: 4099 float64 elements take 129 chunks, each a full operation on
    alternating halves. Members sleep at random between operations, so some copy in the next
    input while others still copy out the last one."""
    groups = _group(members, 256)
    plan = [(k, dt, op, n) for k, (dt, op) in enumerate(CASES) for n in SIZES]

    def member(i: int) -> list[torch.Tensor]:
        rng, out = random.Random(i), []
        for k, dt, op, n in plan:
            x = _input(k * 100 + n, i, dt, n)
            wire = x.view(torch.uint8) if dt == torch.bool else x
            res = torch.empty_like(wire)
            groups[i].all_reduce_start(wire, res, op)()
            out.append(res.view(torch.bool) if dt == torch.bool else res)
            if rng.random() < 0.2:
                time.sleep(rng.random() * 0.002)
        return out

    results = _threads(member, members)
    for j, (k, dt, op, n) in enumerate(plan):
        xs = [_input(k * 100 + n, i, dt, n) for i in range(members)]
        for i in range(members):
            assert torch.equal(results[i][j], results[0][j]), (dt, op, n, "member", i)
        assert _close(results[0][j], xs, op), (dt, op, n)


@pytest.mark.parametrize("members", [2, 3])
def test_all_gather_and_reduce_scatter_between_started_all_reduces(members: int) -> None:
    """A started all-reduce is finished by the next operation; all-gather, reduce-scatter and
    all-to-all give what they should; inputs larger than a slot go in chunks."""
    groups = _group(members, 512)

    def member(i: int) -> dict:
        g = groups[i]
        x = _input(1, i, torch.float32, 6 * members)
        pending = g.all_reduce_start(x, torch.empty_like(x), "sum")
        gathered = torch.empty(members * 5, dtype=torch.int64)
        g.all_gather(_input(2, i, torch.int64, 5), gathered)
        scattered = torch.empty(6)
        g.reduce_scatter(_input(3, i, torch.float64, 6 * members).float(), scattered, "avg")
        maxed = torch.empty(2, dtype=torch.uint8)
        g.reduce_scatter(_input(4, i, torch.bool, 2 * members).view(torch.uint8), maxed, "max")
        big_gather = torch.empty(301 * members)          # 301 floats: 3 chunks of a 512 B slot
        g.all_gather(_input(5, i, torch.float32, 301), big_gather)
        big_scatter = torch.empty(301)                   # in chunks of 512 / (4 x members) B
        g.reduce_scatter(_input(6, i, torch.float32, 301 * members), big_scatter, "sum")
        exchanged = torch.empty(7 * members, dtype=torch.int64)
        g.all_to_all(_input(7, i, torch.int64, 7 * members), exchanged)
        big_exchanged = torch.empty(301 * members)       # chunks, as reduce-scatter's
        g.all_to_all(_input(8, i, torch.float32, 301 * members), big_exchanged)
        return {"ar": pending(), "ag": gathered, "rs": scattered, "or": maxed.bool(),
                "big_ag": big_gather, "big_rs": big_scatter, "a2a": exchanged,
                "big_a2a": big_exchanged}
    outs = _threads(member, members)
    want_rs = _reference([_input(3, i, torch.float64, 6 * members).float()
                          for i in range(members)], "avg")
    want_or = _reference([_input(4, i, torch.bool, 2 * members) for i in range(members)], "max")
    for i, out in enumerate(outs):
        assert _close(out["ar"], [_input(1, j, torch.float32, 6 * members)
                                  for j in range(members)], "sum")
        assert torch.equal(out["ag"], torch.cat([_input(2, j, torch.int64, 5)
                                                 for j in range(members)]))
        assert torch.allclose(out["rs"], want_rs[6 * i:6 * (i + 1)], rtol=1e-6, atol=1e-6)
        assert torch.equal(out["or"], want_or[2 * i:2 * (i + 1)])
        assert torch.equal(out["big_ag"], torch.cat([_input(5, j, torch.float32, 301)
                                                     for j in range(members)]))
        xs = [_input(6, j, torch.float32, 301 * members)[301 * i:301 * (i + 1)]
              for j in range(members)]
        assert _close(out["big_rs"], xs, "sum")
        for key, seed, n, dt in (("a2a", 7, 7, torch.int64), ("big_a2a", 8, 301, torch.float32)):
            # piece i of every member, in member order
            want = [_input(seed, j, dt, n * members)[n * i:n * (i + 1)] for j in range(members)]
            assert torch.equal(out[key], torch.cat(want)), key


def test_in_place_and_started_operations_finish_in_issue_order() -> None:
    """``out`` may be the input (a donated bucket). A second start finishes the first one
    (every member starts in the same order), and a finish called late or twice is a no-op."""
    groups = _group(2, 1 << 12)

    def member(i: int) -> tuple:
        a = torch.full((1500,), float(i + 1))
        b = torch.arange(10.0) * (i + 1)
        fa = groups[i].all_reduce_start(a, a, "sum")           # reduced in place
        fb = groups[i].all_reduce_start(b, torch.empty_like(b), "avg")
        rb = fb()
        ra = fa()
        return ra, rb, ra is a, fa() is ra
    for ra, rb, same, again in _threads(member, 2):
        assert torch.equal(ra, torch.full((1500,), 3.0)) and same and again
        assert torch.equal(rb, torch.arange(10.0) * 1.5)


def test_a_member_that_never_arrives_raises_within_the_timeout() -> None:
    groups = _group(3, 1024, timeout_s=1.0)

    def member(i: int):
        if i == 2:
            return None
        t0 = time.monotonic()
        with pytest.raises(RuntimeFailure, match=r"did not arrive within 1 s \(member "):
            groups[i].all_reduce_start(torch.ones(8), torch.empty(8), "sum")()
        return time.monotonic() - t0
    waited = _threads(member, 3)
    assert all(0.9 <= w <= 5.0 for w in waited[:2]), waited


def test_a_bad_slot_size_is_one_clear_error() -> None:
    from meshplan.backends._comm import _shm_bytes
    assert _shm_bytes(None) == _shm.DEFAULT_CAPACITY and _shm_bytes("1000") == 960
    for bad in ("4MiB", "-1", "10"):
        with pytest.raises(RuntimeFailure,
                           match=r"MESHPLAN_SHM_BYTES=.*at least 64.*MESHPLAN_SHM=0"):
            _shm_bytes(bad)


def test_a_full_dev_shm_is_an_error_at_creation_and_leaves_no_file() -> None:
    before = set(os.listdir(_shm.SHM_DIR))
    with pytest.raises(OSError):
        _shm.create_file(4, 1 << 50, "test")
    assert set(os.listdir(_shm.SHM_DIR)) <= before


# ---- TorchCommunicator in processes -------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(world: int, rank: int, port: int, mode: str, outdir: Path) -> dict:
    from meshplan.backends import TorchCommunicator
    comm = TorchCommunicator(rank, world, [tuple(range(world))], backend="gloo",
                             timeout_s=3.0 if mode == "stop" else 60.0,
                             init_method=f"tcp://127.0.0.1:{port}")
    g = tuple(range(world))
    x = torch.arange(5000.0) * (rank + 1)
    before = set(os.listdir(_shm.SHM_DIR))
    out = {"sum": comm.all_reduce(x, g, "sum"), "shm": comm._shm[g] is not None,
           # rows of a (world x 3, 4) block: rank r sends rows 3j..3j+2 to rank j, and the
           # pieces come back stacked along dim 1 (as an all-to-all resharding S(0) -> S(1))
           "a2a": comm.all_to_all(torch.arange(world * 12.0).view(world * 3, 4) + 100 * rank,
                                  g, 0, 1)}
    comm.barrier()
    out["files"] = sorted(set(os.listdir(_shm.SHM_DIR)) - before)
    if mode == "stop":                # rank 1 leaves; rank 0's next all-reduce must give up
        if rank == 0:
            t0 = time.monotonic()
            try:
                comm.all_reduce(x, g, "sum")
                out["stop"] = ("no error", time.monotonic() - t0)
            except RuntimeFailure as exc:
                out["stop"] = (str(exc), time.monotonic() - t0)
            (outdir / "gave_up").touch()
        else:
            deadline = time.monotonic() + 60
            while not (outdir / "gave_up").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
    comm.close()
    return out


def _worker(world: int, rank: int, modes: str, outdir: Path, ports: list[int]) -> None:
    """One job per mode, one after another in this process, each on a process group of its
    own: "plain", "no-room" (as "plain" with ``MESHPLAN_SHM_BYTES`` beyond any /dev/shm, read
    when the communicator is built) or "stop". {mode: the job's results}."""
    torch.set_num_threads(1)
    out, given = {}, os.environ.get("MESHPLAN_SHM_BYTES")
    for mode, port in zip(modes.split(","), ports):
        if mode == "no-room":
            os.environ["MESHPLAN_SHM_BYTES"] = str(1 << 50)
        elif given is None:
            os.environ.pop("MESHPLAN_SHM_BYTES", None)
        else:
            os.environ["MESHPLAN_SHM_BYTES"] = given
        out[mode] = _job(world, rank, port, "plain" if mode == "no-room" else mode, outdir)
    torch.save(out, outdir / f"rank{rank}.tmp")
    os.replace(outdir / f"rank{rank}.tmp", outdir / f"rank{rank}.pt")


def _run(world: int, modes: str, outdir: Path) -> list[dict]:
    """``world`` worker processes running the jobs ``modes`` (comma-separated) in order."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ports = [str(_free_port()) for _ in modes.split(",")]
    procs = [subprocess.Popen([sys.executable, __file__, str(world), str(r), modes,
                               str(outdir), *ports], env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(world)]
    try:
        logs = [p.communicate(timeout=90)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            p.kill()
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{log[-3000:]}"
    return [torch.load(outdir / f"rank{r}.pt") for r in range(world)]


@pytest.mark.timeout(120)
def test_processes_use_shared_memory_and_leave_no_file(tmp_path: Path) -> None:
    outs = [out["plain"] for out in _run(3, "plain", tmp_path)]
    want = torch.arange(5000.0) * 6
    for r, out in enumerate(outs):
        assert out["shm"] and torch.equal(out["sum"], want)
        rows = torch.arange(3 * 12.0).view(3 * 3, 4)[3 * r:3 * r + 3]
        assert torch.equal(out["a2a"], torch.cat([rows + 100 * j for j in range(3)], dim=1))
        assert out["files"] == [], out["files"]       # unlinked once every member mapped it


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The two 2-rank jobs of the tests below in one pair of processes (a process start and a
    torch import each, once): no room in /dev/shm, then a peer that stops joining."""
    return _run(2, "no-room,stop", tmp_path_factory.mktemp("shm2"))


@pytest.mark.timeout(120)
def test_no_room_in_dev_shm_falls_back_to_gloo_on_every_member(two_ranks: list[dict]) -> None:
    outs = [out["no-room"] for out in two_ranks]
    for out in outs:
        assert not out["shm"] and torch.equal(out["sum"], torch.arange(5000.0) * 3)


@pytest.mark.timeout(120)
def test_a_peer_that_stops_joining_raises_within_the_timeout(two_ranks: list[dict]) -> None:
    outs = [out["stop"] for out in two_ranks]
    message, seconds = outs[0]["stop"]
    assert outs[0]["shm"]
    assert "did not arrive within 3 s" in message and "all_reduce" in message, message
    assert 2.5 <= seconds <= 10, seconds


if __name__ == "__main__":                 # a worker: WORLD RANK MODES DIR PORT...
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]),
            [int(p) for p in sys.argv[5:]])
