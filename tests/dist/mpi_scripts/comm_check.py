"""Run under ``mpiexec -n N``: every Communicator check of ``test_comm._program`` on an
``MPICommunicator``, the MPI timeout, and one-sided (RMA) transfers. Writes ``OUTDIR/rank{r}.pt``.

Usage: mpiexec -n N python comm_check.py OUTDIR
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # tests/dist: test_comm

from meshplan._errors import LoweringError, RuntimeFailure
from meshplan.backends import Communicator, MPICommunicator, Transfer
from test_comm import AXES, _declared, _program

TIMEOUT_S = 1.0


def _rma(comm: MPICommunicator) -> dict:
    """Every rank puts a disjoint slice into rank 0's buffer and into its right neighbour's;
    then every rank gets every other rank's tensors (shapes differ per rank)."""
    r, n = comm.rank, comm.world_size
    out: dict = {"errors": {}}
    with Transfer(comm) as tr:
        target = tr.expose("board", torch.full((n, 5), -1.0))
        mine = tr.expose("mine", torch.arange(3 + r, dtype=torch.int64) * (r + 1))
        bf = tr.expose("bf", (torch.arange(4, dtype=torch.float32) + r).to(torch.bfloat16))
        empty = tr.expose("empty", torch.empty(0))
        tr.sync()
        row = torch.arange(5, dtype=torch.float32) + 10 * r
        tr.put(0, "board", row, offset=5 * r)               # disjoint rows of rank 0's board
        if n > 1:
            tr.put((r + 1) % n, "board", row, offset=5 * r)
        tr.sync()
        out["board"] = target.clone()
        out["got"] = {q: tr.get(q, "mine") for q in range(n)}
        out["got_bf"] = {q: tr.get(q, "bf") for q in range(n)}
        out["part"] = tr.get((r + 1) % n, "mine", offset=1, numel=2)
        buf = torch.empty(2, dtype=torch.int64)
        out["part_out"] = tr.get((r + 1) % n, "mine", offset=1, numel=2, out=buf) is buf
        out["empty"] = [tuple(tr.get(q, "empty").shape) for q in range(n)]
        out["shape"] = tr.shape((r + 1) % n, "mine")
        out["exposed_in_place"] = target.data_ptr() != 0 and mine.numel() == 3 + r
        for name, call in (("range", lambda: tr.get(0, "mine", offset=2, numel=5)),
                           ("dtype", lambda: tr.put(0, "mine", torch.ones(1))),
                           ("unknown", lambda: tr.get(0, "nosuch")),
                           ("out", lambda: tr.get(0, "mine", out=torch.empty(3)))):
            try:
                call()
            except LoweringError as exc:
                out["errors"][name] = str(exc)
        out["records"] = len(tr.records)
        del empty, bf
        tr.sync()
    out["closed_names"] = tr.names
    return out


def _mailbox(comm: MPICommunicator) -> dict:
    """A pipeline's sends as one-sided puts (``Mailbox``): each rank takes, from its left
    neighbour, tag 3 twice then tag 5 (a 0-d float64, a bool mask, an empty and a bf16
    tensor) in two steps, each ended by ``end()``, through the communicator's
    ``send_start``/``recv``; the neighbour sends tag 5 first. A send of the wrong size is
    refused by name."""
    from meshplan.backends._rma import Mailbox

    r, n = comm.rank, comm.world_size
    left, right = (r - 1) % n, (r + 1) % n
    takes = [(3, (2, 3), torch.float32), (3, (), torch.float64), (5, (4,), torch.bool),
             (5, (0,), torch.float32), (5, (3,), torch.bfloat16)]

    def value(src: int, step: int, i: int, shape, dtype) -> torch.Tensor:
        return (torch.arange(max(1, torch.Size(shape).numel())) + 100 * src + 10 * step + i
                )[:torch.Size(shape).numel()].reshape(shape).remainder(7).to(dtype)

    mail = Mailbox(comm, [(left, tag, torch.Size(shape).numel() * dtype.itemsize)
                          for tag, shape, dtype in takes])
    out: dict = {"got": []}
    comm.mailbox = mail
    try:
        for step in (1, 2):
            mail.begin()
            comm.records.clear()
            order = [i for i, t in enumerate(takes) if t[0] == 5] + \
                [i for i, t in enumerate(takes) if t[0] == 3]
            for i in order:
                tag, shape, dtype = takes[i]
                comm.send_start(value(r, step, i, shape, dtype), right, tag).wait()
            out["got"].append([comm.recv(shape, dtype, left, tag) for tag, shape, dtype in takes])
            mail.end()
            out["want"] = [value(left, step, i, shape, dtype)
                           for i, (_, shape, dtype) in enumerate(takes)]
            out["kinds"] = sorted({rec.kind.value for rec in comm.records})
        try:
            mail.begin()
            mail.send(torch.ones(5), right, 3)
        except LoweringError as exc:
            out["wrong_size"] = str(exc)
    finally:
        comm.mailbox = None
        comm.barrier()
        mail.close()
    return out


def main(outdir: Path) -> None:
    torch.set_num_threads(1)
    comm = MPICommunicator(_declared(int(os.environ.get("PMI_SIZE", "0")) or 2), timeout_s=60)
    world = comm.world_size
    assert world in AXES
    out = _program(comm)
    out["is_communicator"] = isinstance(comm, Communicator)
    out["rma"] = _rma(comm)
    out["mailbox"] = _mailbox(comm)
    comm.barrier()
    if world == 2:                               # rank 1 never joins: rank 0 times out
        comm2 = MPICommunicator(timeout_s=TIMEOUT_S, comm=comm.world.Dup())
        if comm.rank == 0:
            start = time.monotonic()
            try:
                comm2.all_reduce(torch.ones(4), (0, 1))
                out["timeout"] = ("no error", time.monotonic() - start)
            except RuntimeFailure as exc:
                out["timeout"] = (str(exc), time.monotonic() - start)
            try:
                comm2.all_reduce(torch.ones(4), (0, 1))
            except RuntimeFailure as exc:
                out["after_timeout"] = str(exc)
        comm3 = MPICommunicator(timeout_s=TIMEOUT_S, comm=comm.world.Dup())
        if comm.rank == 0:                       # the same, started and then waited for
            start = time.monotonic()
            try:
                comm3.all_reduce_start(torch.ones(4), (0, 1)).wait()
                out["timeout_wait"] = ("no error", time.monotonic() - start)
            except RuntimeFailure as exc:
                out["timeout_wait"] = (str(exc), time.monotonic() - start)
        comm.barrier()
        if comm.rank == 1:                       # now join, so nothing is left pending
            comm2._closed = False
            comm2.all_reduce(torch.ones(4), (0, 1))
            comm3.all_reduce(torch.ones(4), (0, 1))
    comm.barrier()
    comm.close()
    torch.save(out, outdir / f"rank{comm.rank}.tmp")
    os.replace(outdir / f"rank{comm.rank}.tmp", outdir / f"rank{comm.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
