"""The ``Communicator`` implementations against one reference computed from every rank's inputs.

One program (``_program``) calls every collective on every group of a mesh: world 2 with the
groups (0, 1) and (1, 0) (order kept), world 4 as a 2x2 mesh with (0, 1), (2, 3), (0, 2), (1, 3)
and the world group; six dtypes, dims 0..2, sum / avg / max, (non-)contiguous inputs that
differ on every rank, send / recv on a ring, a barrier, one-member groups. It runs on a
``ThreadMesh`` (threads) and on ``TorchCommunicator`` over gloo (real processes on loopback, one
job per world size, batching every check; world 2's job once more in the same processes with
``MESHPLAN_SHM=0``, so that all-reduces, all-gathers and reduce-scatters take gloo's own TCP
path instead of shared memory), and the results are compared with the reference:

- ThreadMesh: bit-equal everywhere (its sums run in group order, as the reference's do).
- gloo: bit-equal for all_gather, all_to_all, broadcast, send / recv, max, int64 and bool, and for
  every reduction over two ranks (a + b does not depend on the order). Floating sums over four
  ranks run in gloo's order, so they may differ from the group-order sum by reassociation: both
  are within (n - 1) unit roundoffs of sum(|x_i|) of the exact sum, so they are demanded to agree
  within n * eps * sum(|x_i|) (eps = finfo.eps = 2 unit roundoffs; divided by n for avg).

The workers are this file run as a script.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from itertools import cycle
from pathlib import Path

import pytest
import torch
from meshplan._errors import LoweringError, RuntimeFailure
from meshplan.backends import (
    CollectiveKind,
    CommRecord,
    Communicator,
    HostStagedCommunicator,
    ThreadMesh,
    TorchCommunicator,
)

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.bool)
AXES = {2: (((0, 1),), ((1, 0),)),
        4: (((0, 1), (2, 3)), ((0, 2), (1, 3)), ((0, 1, 2, 3),))}
TIMEOUT_S = 3.0                     # the gloo timeout test's process-group timeout


@dataclass(frozen=True)
class Case:
    kind: str                       # the Communicator method
    dtype: torch.dtype
    shape: tuple[int, ...]
    args: tuple = ()                # (op,) (dim,) (dim, op) (split_dim, cat_dim) (src index,)
    noncontig: bool = False


def _cases() -> list[Case]:
    out, flip = [], cycle([False, True])
    for dt in DTYPES:
        ops = ("sum", "max", "avg") if dt.is_floating_point else ("sum", "max")
        out += [Case("all_reduce", dt, (4, 6), (op,), next(flip)) for op in ops]
        out += [Case("all_gather", dt, (2, 3, 4), (d,), next(flip)) for d in (0, 1, -1)]
        out += [Case("reduce_scatter", dt, (4, 8), (d, op), next(flip))
                for d in (0, 1) for op in ops]
        out += [Case("all_to_all", dt, (4, 8, 2), sc, next(flip))
                for sc in ((0, 1), (1, 0), (1, 1), (0, 2))]
        out += [Case("broadcast", dt, (3, 5), (i,), next(flip)) for i in (0, -1)]
    return out


CASES = _cases()


def _input(seed: int, rank: int, dtype: torch.dtype, shape: tuple[int, ...],
           noncontig: bool = False) -> torch.Tensor:
    """Different on every rank and every case; non-contiguous by a transpose if asked."""
    g = torch.Generator().manual_seed(7919 * seed + rank + 1)
    gen_shape = (*shape[:-2], shape[-1], shape[-2]) if noncontig else shape
    if dtype == torch.bool:
        x = torch.rand(gen_shape, generator=g) < 0.5
    elif dtype == torch.int64:
        x = torch.randint(-50, 50, gen_shape, generator=g)
    else:
        x = (torch.randn(gen_shape, generator=g, dtype=torch.float64) * (1 + rank)).to(dtype)
    return x.transpose(-1, -2) if noncontig else x


def _case_input(k: int, rank: int) -> torch.Tensor:
    c = CASES[k]
    return _input(k, rank, c.dtype, c.shape, c.noncontig)


def _call(comm, case: Case, x: torch.Tensor, g: tuple[int, ...]) -> torch.Tensor:
    if case.kind == "broadcast":
        return comm.broadcast(x, g[case.args[0]], g)
    return getattr(comm, case.kind)(x, g, *case.args)


def _program(comm) -> dict:
    """Every check that needs the ranks to talk; the same on every rank and implementation."""
    r, world = comm.rank, comm.world_size
    out: dict = {"results": {}, "unmutated": True, "contiguous": True, "errors": {}}
    for k, case in enumerate(CASES):
        x = _case_input(k, r)
        for a, axis in enumerate(AXES[world]):
            res = _call(comm, case, x, next(g for g in axis if r in g))
            out["results"][f"{k}/{a}"] = res
            out["contiguous"] &= res.is_contiguous()
        out["unmutated"] &= _bitequal(x, _case_input(k, r))
    nxt, prv = (r + 1) % world, (r - 1) % world
    for i, dt in enumerate(DTYPES):                 # a ring; even ranks send first
        x = _input(1000 + i, r, dt, (3, 4), noncontig=i % 2 == 1)
        if r % 2 == 0:
            comm.send(x, nxt)
        got = comm.recv((3, 4), dt, prv)
        if r % 2 == 1:
            comm.send(x, nxt)
        out["results"][f"p2p/{i}"] = got
        out["unmutated"] &= _bitequal(x, _input(1000 + i, r, dt, (3, 4), noncontig=i % 2 == 1))
    # tags: two sends started to the next rank (tag 3, then tag 1), taken by tag in the other
    # order (a pipeline stage's forward and backward values), then waited for
    started = [comm.send_start(_input(1100, r, torch.float32, (2, 3)), nxt, tag=3),
               comm.send_start(_input(1101, r, torch.float32, (5,)), nxt, tag=1)]
    out["results"]["tag/1"] = comm.recv((5,), torch.float32, prv, tag=1)
    out["results"]["tag/3"] = comm.recv((2, 3), torch.float32, prv, tag=3)
    for pending in started:
        pending.wait()
    _overlapped(comm, out)
    comm.barrier()
    solo, n = torch.arange(8.0).reshape(2, 4), len(comm.records)
    out["solo_is_input"] = all(t is solo for t in (
        comm.all_reduce(solo, (r,), "avg"), comm.all_gather(solo, (r,), 1),
        comm.reduce_scatter(solo, (r,), 0), comm.all_to_all(solo, (r,), 0, 1),
        comm.broadcast(solo, r, (r,)), comm.all_reduce_start(solo, (r,), "avg").wait()))
    comm.barrier((r,))
    out["solo_recorded"] = len(comm.records) - n
    full = tuple(range(world))
    for name, call in (("reduce_scatter", lambda: comm.reduce_scatter(torch.ones(3, 4), full, 0)),
                       ("all_to_all", lambda: comm.all_to_all(torch.ones(4, 5), full, 1, 0)),
                       ("avg_int", lambda: comm.all_reduce(torch.ones(2, dtype=torch.int64),
                                                           full, "avg")),
                       ("not_member", lambda: comm.all_reduce(torch.ones(2),
                                                              tuple(q for q in full if q != r))),
                       ("bad_dim", lambda: comm.all_gather(torch.ones(2, 2), full, 2))):
        try:
            call()
        except LoweringError as exc:
            out["errors"][name] = str(exc)
    out["records"] = [(rec.kind.value, rec.group, rec.nbytes) for rec in comm.records]
    out["record_times_ok"] = all(rec.dur_s >= 0 and rec.start_s > 1e9 for rec in comm.records)
    return out


def _overlapped(comm, out: dict) -> None:
    """Non-blocking all-reduces: every all_reduce case started on each of its groups, all in
    flight together with a blocking all_gather issued after them, then waited for in reverse
    order (records: the all_gather's, then one per wait). Every other start donates its input
    (``donate=True``: the transport may reduce in it); the others' inputs are overwritten right
    after their start (the transport must have its own copy); a second wait gives the same
    tensor."""
    r = comm.rank
    pending = []
    for k, case in enumerate(CASES):
        if case.kind != "all_reduce":
            continue
        for a, axis in enumerate(AXES[comm.world_size]):
            x, donate = _case_input(k, r).clone(), (k + a) % 2 == 1
            pending.append((f"async/{k}/{a}", comm.all_reduce_start(
                x, next(g for g in axis if r in g), case.args[0], donate=donate)))
            if not donate:
                x.zero_()
    out["results"]["async/gather"] = comm.all_gather(_case_input(0, r), tuple(
        range(comm.world_size)), 0)
    for name, handle in reversed(pending):
        out["results"][name] = handle.wait()
        out["contiguous"] &= out["results"][name].is_contiguous()
        out["unmutated"] &= handle.wait() is out["results"][name] and handle.done


# ---- the reference ---------------------------------------------------------------------------

def _bitequal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))
    return torch.equal(a, b)


def _reduce(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    if op == "max":
        return functools.reduce(torch.maximum, xs)
    total = functools.reduce(torch.add, xs)           # group order
    return total / len(xs) if op == "avg" else total


def _expected(case: Case, xs: list[torch.Tensor], i: int) -> torch.Tensor:
    """Member ``i``'s result from every member's input, in group order."""
    n, a = len(xs), case.args
    if case.kind == "all_reduce":
        return _reduce(xs, a[0])
    if case.kind == "all_gather":
        return torch.cat(xs, a[0])
    if case.kind == "reduce_scatter":
        return torch.chunk(_reduce(xs, a[1]), n, a[0])[i]
    if case.kind == "all_to_all":
        return torch.cat([torch.chunk(x, n, a[0])[i] for x in xs], a[1])
    return xs[a[0]]                                   # broadcast: the source's input


def _expected_nbytes(case: Case, n: int) -> int:
    x = torch.empty(case.shape, dtype=case.dtype)
    return x.nbytes * n if case.kind == "all_gather" else x.nbytes


def _check(outs: list[dict], world: int, exact: bool) -> None:
    """Every rank's results and records against the reference; ``exact=False`` allows the
    reassociation bound of the module docstring for floating sums over more than two ranks."""
    expected_records: list[list] = [[] for _ in range(world)]
    for k, case in enumerate(CASES):
        for a, axis in enumerate(AXES[world]):
            for g in axis:
                xs = [_case_input(k, r) for r in g]
                for i, r in enumerate(g):
                    got, want = outs[r]["results"][f"{k}/{a}"], _expected(case, xs, i)
                    where = f"{case} on group {g}, rank {r}"
                    assert got.dtype == want.dtype and got.shape == want.shape, where
                    op = case.args[-1] if case.kind in ("all_reduce", "reduce_scatter") else None
                    if (exact or len(g) == 2 or op in (None, "max")
                            or not case.dtype.is_floating_point):
                        assert _bitequal(got, want), where
                    else:
                        bound = _reassociation_bound(case, xs, i)
                        err = (got.double() - want.double()).abs()
                        assert bool((err <= bound).all()), (where, float((err - bound).max()))
                    expected_records[r].append((case.kind, g, _expected_nbytes(case, len(g))))
    for i, dt in enumerate(DTYPES):
        for r in range(world):
            prv, nxt = (r - 1) % world, (r + 1) % world
            assert _bitequal(outs[r]["results"][f"p2p/{i}"],
                             _input(1000 + i, prv, dt, (3, 4), noncontig=i % 2 == 1)), (dt, r)
            nbytes = 12 * dt.itemsize
            send, recv = ("send", (r, nxt), nbytes), ("recv", (prv, r), nbytes)
            expected_records[r] += [send, recv] if r % 2 == 0 else [recv, send]
    for r in range(world):
        prv, nxt = (r - 1) % world, (r + 1) % world
        assert _bitequal(outs[r]["results"]["tag/1"], _input(1101, prv, torch.float32, (5,)))
        assert _bitequal(outs[r]["results"]["tag/3"], _input(1100, prv, torch.float32, (2, 3)))
        expected_records[r] += [("recv", (prv, r), 20), ("recv", (prv, r), 24),
                                ("send", (r, nxt), 24), ("send", (r, nxt), 20)]
    full = tuple(range(world))
    for r in range(world):
        want = torch.cat([_case_input(0, q) for q in full], 0)
        assert _bitequal(outs[r]["results"]["async/gather"], want), r
    waits = [[] for _ in range(world)]
    for k, case in enumerate(CASES):
        if case.kind != "all_reduce":
            continue
        for a, axis in enumerate(AXES[world]):
            for g in axis:
                xs = [_case_input(k, q) for q in g]
                want = _expected(case, xs, 0)
                for r in g:
                    got, where = outs[r]["results"][f"async/{k}/{a}"], f"started {case} on {g}"
                    if (exact or len(g) == 2 or not case.dtype.is_floating_point
                            or case.args[0] == "max"):
                        assert _bitequal(got, want), where
                    else:
                        err = (got.double() - want.double()).abs()
                        assert bool((err <= _reassociation_bound(case, xs, 0)).all()), where
                    waits[r].append((case.kind, g, _expected_nbytes(case, len(g))))
    for r in range(world):
        gather = ("all_gather", full, torch.empty(CASES[0].shape, dtype=CASES[0].dtype).nbytes
                  * world)
        expected_records[r] += [gather] + waits[r][::-1]
    for r, out in enumerate(outs):
        assert out["unmutated"] and out["contiguous"] and out["record_times_ok"], r
        assert out["solo_is_input"] and out["solo_recorded"] == 0, r
        assert out["records"] == expected_records[r] + [("barrier", full, 0)], r
        err = out["errors"]
        assert set(err) == {"reduce_scatter", "all_to_all", "avg_int", "not_member", "bad_dim"}
        assert f"reduce_scatter: dim 0 of shape (3, 4) does not split into {world} equal " \
               f"chunks (group size {world}" in err["reduce_scatter"]
        assert f"all_to_all: dim 1 of shape (4, 5) does not split into {world}" in err["all_to_all"]
        assert "'avg' needs a floating dtype" in err["avg_int"]
        assert f"rank {r} called a collective on group" in err["not_member"]
        assert "dim=2 is out of range for a tensor of shape (2, 2)" in err["bad_dim"]


def _reassociation_bound(case: Case, xs: list[torch.Tensor], i: int) -> torch.Tensor:
    n, eps = len(xs), torch.finfo(case.dtype).eps
    bound = sum(x.double().abs() for x in xs) * n * eps
    if case.kind == "reduce_scatter":
        bound = torch.chunk(bound, n, case.args[0])[i]
    return bound / n if case.args[-1] == "avg" else bound


# ---- ThreadMesh ------------------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
def test_thread_mesh_matches_the_reference_bit_for_bit(world) -> None:
    mesh = ThreadMesh(world, timeout_s=20)
    assert all(isinstance(c, Communicator) for c in mesh.communicators)
    _check(mesh.run(_program), world, exact=True)


def test_thread_mesh_results_are_separate_tensors() -> None:
    outs = ThreadMesh(2).run(lambda c: c.all_reduce(torch.ones(3) * c.rank, (0, 1)))
    assert outs[0].data_ptr() != outs[1].data_ptr() and torch.equal(outs[0], outs[1])


def test_thread_mesh_a_rank_that_never_arrives_times_out() -> None:
    def fn(comm):
        if comm.rank == 0:
            comm.all_reduce(torch.ones(2), (0, 1))
    start = time.monotonic()
    with pytest.raises(RuntimeFailure, match=r"rank 0: all_reduce #0 on group \(0, 1\) timed out "
                                             r"after 0.3 s: rank\(s\) \[1\] .* did not arrive"):
        ThreadMesh(2, timeout_s=0.3).run(fn)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize(("kind", "match"), [("send", "rank 1 did not receive"),
                                             ("recv", "rank 1 sent nothing to rank 0")])
def test_thread_mesh_point_to_point_times_out(kind, match) -> None:
    def fn(comm):
        if comm.rank == 0:
            comm.send(torch.ones(2), 1) if kind == "send" else comm.recv((2,), torch.float32, 1)
    with pytest.raises(RuntimeFailure, match=match):
        ThreadMesh(2, timeout_s=0.3).run(fn)


def test_a_failing_rank_wakes_the_waiting_ones_and_is_reraised_with_its_rank() -> None:
    def fn(comm):
        if comm.rank == 2:
            raise ValueError("boom")
        comm.all_gather(torch.ones(2), (0, 1, 2, 3), 0)
    mesh = ThreadMesh(4, timeout_s=60)
    start = time.monotonic()
    with pytest.raises(ValueError, match="boom") as info:
        mesh.run(fn)
    assert time.monotonic() - start < 10
    if sys.version_info >= (3, 11):
        assert "raised on rank 2 of a ThreadMesh of 4 ranks" in info.value.__notes__[0]
    with pytest.raises(RuntimeFailure, match="aborted"):
        mesh.run(fn)                                  # an aborted mesh stays aborted


def test_abort_wakes_waiting_ranks() -> None:
    mesh = ThreadMesh(2, timeout_s=60)
    comm = mesh.communicators[0]
    import threading
    threading.Timer(0.2, mesh.abort, args=(KeyError("stop"),)).start()
    with pytest.raises(RuntimeFailure, match="was aborted: KeyError") as info:
        comm.recv((1,), torch.float32, 1)
    assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.parametrize(("fn", "match"), [
    (lambda c: c.all_reduce(torch.ones(2), (0, 1)) if c.rank == 0
     else c.all_gather(torch.ones(2), (0, 1), 0),
     r"disagree on their collective #0.*rank 0: all_reduce\('sum',\), rank 1: all_gather"),
    (lambda c: c.all_reduce(torch.ones(2 + c.rank), (0, 1)),
     r"same shape and dtype, got rank 0: \(2,\) torch.float32, rank 1: \(3,\)"),
    (lambda c: c.send(torch.ones(2), 1) if c.rank == 0 else c.recv((3,), torch.float32, 0),
     r"expected a \(3,\) torch.float32 tensor from rank 0, which sent a \(2,\)"),
])
def test_thread_mesh_members_that_disagree_get_a_lowering_error(fn, match) -> None:
    with pytest.raises(LoweringError, match=match):
        ThreadMesh(2, timeout_s=10).run(fn)


def test_bad_arguments_are_lowering_errors() -> None:
    with pytest.raises(LoweringError, match="world_size must be >= 1"):
        ThreadMesh(0)
    comm = ThreadMesh(2).communicators[0]
    with pytest.raises(LoweringError, match="unknown reduce op 'min'"):
        comm.all_reduce(torch.ones(2), (0, 1), "min")
    with pytest.raises(LoweringError, match="distinct global ranks in 0..1"):
        comm.all_reduce(torch.ones(2), (0, 0))
    with pytest.raises(LoweringError, match="peer rank 0 must be another rank"):
        comm.send(torch.ones(2), 0)
    with pytest.raises(LoweringError, match=r"tag 32768 must be an int in 0..32767"):
        comm.send_start(torch.ones(2), 1, tag=1 << 15)
    with pytest.raises(LoweringError, match=r"tag -1 must be"):
        comm.recv((2,), torch.float32, 1, tag=-1)
    with pytest.raises(LoweringError, match="source rank 1 is not in group"):
        comm.broadcast(torch.ones(2), 1, (0,))
    with pytest.raises(LoweringError, match="rank 5 is not in 0..1"):
        TorchCommunicator(5, 2, [(0, 1)])


def test_records_are_frozen_and_clearable() -> None:
    comm = ThreadMesh(1).communicators[0]
    rec = CommRecord(CollectiveKind.BARRIER, (0,), 0, 0.0, 0.0)
    with pytest.raises(AttributeError):
        rec.nbytes = 1                                # type: ignore[misc]
    comm.records.append(rec)
    comm.records.clear()
    assert comm.records == []


# ---- TorchCommunicator on gloo, real processes -----------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _declared(world: int) -> list[tuple[int, ...]]:
    return list(dict.fromkeys(g for axis in AXES[world] for g in axis))


def _gloo_timeout(rank: int, port: int, flag: Path,
                  started: bool = False) -> tuple[str, float] | None:
    """Rank 1 never joins rank 0's all_reduce (it waits for rank 0 to give up, then leaves).
    ``started``: rank 0 starts it (``all_reduce_start``) and times out in the wait."""
    comm = TorchCommunicator(rank, 2, [(0, 1)], backend="gloo", timeout_s=TIMEOUT_S,
                             init_method=f"tcp://127.0.0.1:{port}")
    result = None
    if rank == 0:
        start = time.monotonic()
        try:
            if started:
                comm.all_reduce_start(torch.ones(4), (0, 1)).wait()
            else:
                comm.all_reduce(torch.ones(4), (0, 1))
            result = ("no error", time.monotonic() - start)
        except RuntimeFailure as exc:
            result = (str(exc), time.monotonic() - start)
        flag.touch()
    else:
        deadline = time.monotonic() + 60
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    comm.close()
    return result


def _job(world: int, rank: int, ports: list[int], outdir: Path, tag: str) -> dict:
    """``_program`` on a gloo communicator (shared memory as ``MESHPLAN_SHM`` says), then, on
    world 2, the two timeout checks (each on a process group of its own)."""
    comm = TorchCommunicator(rank, world, _declared(world), backend="gloo", timeout_s=60,
                             init_method=f"tcp://127.0.0.1:{ports[0]}")
    out = _program(comm)
    out["is_communicator"] = isinstance(comm, Communicator)
    out["shm"] = any(group is not None for group in comm._shm.values())
    if world == 4:
        try:
            comm.all_reduce(torch.ones(2), (3, 2, 1, 0))
        except LoweringError as exc:
            out["undeclared"] = str(exc)
    comm.barrier()
    comm.close()
    if world == 2:
        out["timeout"] = _gloo_timeout(rank, ports[1], outdir / f"timed_out{tag}")
        out["timeout_wait"] = _gloo_timeout(rank, ports[2], outdir / f"timed_out_wait{tag}",
                                            True)
    return out


def _worker(world: int, rank: int, ports: list[int], outdir: Path) -> None:
    """World 4: one job. World 2: one job with shared memory, then the same job again in the
    same processes with ``MESHPLAN_SHM=0`` (read when a communicator is built), which saves
    the second job a process start and a torch import; its results under ``"no_shm"``."""
    torch.set_num_threads(1)
    out = _job(world, rank, ports[:3], outdir, "")
    if world == 4:
        # the front ranks that share one GPU use (device "cpu" here: its copies are no-ops,
        # so this checks the calls pass through unchanged; tests/gpu runs it on a GPU)
        comm = HostStagedCommunicator(rank, world, _declared(world), device="cpu",
                                      timeout_s=60, init_method=f"tcp://127.0.0.1:{ports[3]}")
        out["staged"] = _program(comm)
        out["staged"]["is_communicator"] = isinstance(comm, Communicator)
        comm.close()
    if world == 2:
        os.environ["MESHPLAN_SHM"] = "0"
        out["no_shm"] = _job(world, rank, ports[3:], outdir, "_no_shm")
    torch.save(out, outdir / f"rank{rank}.tmp")
    os.replace(outdir / f"rank{rank}.tmp", outdir / f"rank{rank}.pt")


def _run_gloo(world: int, outdir: Path, timeout_s: float = 100) -> list[dict]:
    """The job on ``world`` processes. Its ports are picked free in advance, so another test
    may take one first: a job whose gloo store found its port in use runs once more on
    others (only then: any other failure fails the test)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MESHPLAN_SHM="1")
    if any(name == "lo" for _, name in socket.if_nameindex()):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    for attempt in (1, 2):
        ports = [_free_port() for _ in range(6)]
        with contextlib.ExitStack() as stack:
            logs = [stack.enter_context(open(outdir / f"rank{r}.log", "w+", encoding="utf-8"))
                    for r in range(world)]
            procs = [subprocess.Popen([sys.executable, __file__, str(world), str(r),
                                       str(outdir), *map(str, ports)],
                                      stdin=subprocess.DEVNULL, stdout=logs[r],
                                      stderr=subprocess.STDOUT, env=env)
                     for r in range(world)]
            failed = _wait(procs, logs, timeout_s)
        if failed is None:
            return [torch.load(outdir / f"rank{r}.pt", weights_only=False)
                    for r in range(world)]
        if attempt == 2 or "EADDRINUSE" not in failed and "ddress already in use" not in failed:
            pytest.fail(failed)
    raise AssertionError("unreachable")


def _wait(procs: list[subprocess.Popen], logs: list, timeout_s: float) -> str | None:
    """Until every worker exited: None, or the first failed rank's output. Kills leftovers."""
    try:
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
        for r, (p, log) in enumerate(zip(procs, logs)):
            if p.poll() != 0:
                log.flush()
                log.seek(0)
                return f"gloo rank {r} exited with {p.poll()}:\n{log.read()[-3000:]}"
        return None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def test_torch_communicator_of_one_rank_and_a_second_init() -> None:
    """In this process: world 1 needs no peer; its collectives are local no-ops."""
    comm = TorchCommunicator(0, 1, [(0,)], backend="gloo",
                             init_method=f"tcp://127.0.0.1:{_free_port()}")
    try:
        x = torch.arange(6.0).reshape(2, 3)
        assert comm.all_gather(x, (0,), 1) is x and comm.all_reduce(x, (0,), "avg") is x
        comm.barrier()
        assert comm.records == []
        with pytest.raises(RuntimeFailure, match="rank 0: cannot start the gloo process group"):
            TorchCommunicator(0, 1, [], backend="gloo",
                              init_method=f"tcp://127.0.0.1:{_free_port()}")
    finally:
        comm.close()
    with pytest.raises(RuntimeFailure, match="is closed"):
        comm.all_reduce(x, (0,))
    comm.close()                                      # idempotent


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def gloo_run(request, tmp_path_factory) -> tuple[int, list[list[dict]]]:
    """Each job's outputs per rank: all-reduces, all-gathers and reduce-scatters through shared
    memory (the default between ranks of one host, ``backends/_shm.py``) and, on world 2, the
    same job again through gloo's own TCP collectives (``MESHPLAN_SHM=0``)."""
    world = request.param
    outs = _run_gloo(world, tmp_path_factory.mktemp(f"gloo{world}"))
    jobs = [outs] + ([[out["no_shm"] for out in outs]] if world == 2 else [])
    for job, shm in zip(jobs, (True, False)):
        for out in job:
            assert out["shm"] == shm
    return world, jobs


@pytest.mark.timeout(120)
def test_gloo_matches_the_reference(gloo_run) -> None:
    world, jobs = gloo_run
    if world == 4:
        jobs = [*jobs, [out["staged"] for out in jobs[0]]]
    for outs in jobs:
        _check(outs, world, exact=False)
        for out in outs:
            assert out["is_communicator"]
            if world == 4 and "undeclared" in out:       # the first job's
                assert "group (3, 2, 1, 0) was not declared" in out["undeclared"]
                assert str(_declared(world)) in out["undeclared"]


@pytest.mark.timeout(120)
def test_gloo_a_rank_that_never_joins_raises_within_the_timeout(gloo_run) -> None:
    world, jobs = gloo_run
    if world != 2:
        pytest.skip("checked in the world-2 jobs")
    for outs in jobs:                            # with and without shared memory
        for key in ("timeout", "timeout_wait"):  # blocking; started, then waited for
            message, seconds = outs[0][key]
            assert "all_reduce on group (0, 1) failed on rank 0 (gloo, timeout 3 s)" in \
                message, (key, message)
            assert TIMEOUT_S - 0.5 <= seconds <= TIMEOUT_S + 7, (key, seconds)


if __name__ == "__main__":                 # a gloo worker: WORLD RANK DIR PORT x 6
    _worker(int(sys.argv[1]), int(sys.argv[2]), [int(p) for p in sys.argv[4:]],
            Path(sys.argv[3]))
