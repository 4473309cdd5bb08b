"""One-sided transfers benchmark (issue 7): MPI RMA Put / Get next to two-sided MPI Send / Recv
and torch.distributed gloo send / recv, all in one ``mpiexec`` job per rank count.

    python benchmarks/rma.py [--ranks 2 4] [--max 256MiB] [--repeats 5]

Sizes run from 1 KiB in powers of 4 up to ``--max``. The ranks form pairs (r, r + N/2), all
pairs at once; in each pair the upper rank's buffer goes to the lower rank:

- ``put``: the upper rank ``Lock(lower, SHARED)`` / ``Put`` / ``Unlock`` into the lower rank's
  window (``MPI.Win.Create`` over a torch tensor, as ``Transfer.expose`` does); timed on the
  upper rank, until ``Unlock`` returned (the data is in the target's memory);
- ``get``: the lower rank ``Lock`` / ``Get`` / ``Unlock`` from the upper rank's window;
- ``Transfer.get``: the same through ``meshplan.backends.Transfer`` (``out=`` a preallocated
  buffer; ``Rget`` polled with ``Test`` against the timeout, plus the API's checks);
- ``send/recv``: mpi4py ``Send`` / ``Recv`` of the same buffers, timed on the receiver;
- ``gloo``: ``torch.distributed`` send / recv on gloo over loopback TCP, timed on the receiver.

Every repeat starts after a barrier; a repeat's time is the slowest pair's; the table shows the
median over repeats (more repeats for small sizes) as latency (microseconds) and bandwidth
(GB/s = 1e9 bytes/s). All ranks share one host, so MPI moves data through shared memory and
gloo through the loopback interface: this measures copies and software overhead, not a network.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = ("put", "get", "Transfer.get", "send/recv", "gloo")


def _size(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 1 << 10, "mb": 1 << 20,
             "gb": 1 << 30, "b": 1}
    low = text.strip().lower()
    for unit, mult in units.items():
        if low.endswith(unit):
            return int(float(low[: -len(unit)]) * mult)
    return int(low)


def _sizes(limit: int) -> list[int]:
    out, s = [], 1 << 10
    while s <= limit:
        out.append(s)
        s *= 4
    return out


def _repeats(size: int, base: int) -> int:
    return base * 10 if size <= (1 << 20) else base


# ---- inside mpiexec ----------------------------------------------------------------------------

def worker(limit: int, base_repeats: int, port: int, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from meshplan.backends import MPICommunicator, Transfer
    from mpi4py import MPI

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    half = n // 2
    lower = rank < half
    peer = rank + half if lower else rank - half
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=n)
    comm = MPICommunicator(timeout_s=600)
    rows: dict[tuple[str, int], list[float]] = {}
    for size in _sizes(limit):
        buf = torch.full((size,), rank % 251, dtype=torch.uint8)
        win_mem = torch.zeros(size, dtype=torch.uint8)
        win = MPI.Win.Create(win_mem.numpy(), 1, comm=world)
        spec = [buf.numpy(), MPI.BYTE]
        tr = Transfer(comm)
        tr.expose("x", buf)
        for _ in range(2):                 # warm: first touches, connections
            world.Barrier()
            if not lower:
                world.Send(spec, peer, tag=1)
            else:
                world.Recv(spec, peer, tag=1)
        for variant in VARIANTS:
            times = []
            for _ in range(_repeats(size, base_repeats)):
                world.Barrier()
                t0 = time.perf_counter()
                timed = True
                if variant == "put":
                    timed = not lower
                    if timed:
                        win.Lock(peer, MPI.LOCK_SHARED)
                        win.Put(spec, peer)
                        win.Unlock(peer)
                elif variant == "get":
                    timed = lower
                    if timed:
                        win.Lock(peer, MPI.LOCK_SHARED)
                        win.Get(spec, peer)
                        win.Unlock(peer)
                elif variant == "Transfer.get":
                    timed = lower
                    if timed:
                        tr.get(peer, "x", out=win_mem)
                elif variant == "send/recv":
                    timed = lower
                    if lower:
                        world.Recv(spec, peer, tag=2)
                    else:
                        world.Send(spec, peer, tag=2)
                else:
                    timed = lower
                    if lower:
                        dist.recv(buf, peer)
                    else:
                        dist.send(buf, peer)
                dt = time.perf_counter() - t0 if timed else 0.0
                times.append(max(world.allreduce(dt, op=MPI.MAX), 1e-9))
            rows[(variant, size)] = times
        world.Barrier()
        tr.close()
        win.Free()
    if rank == 0:
        import json

        out.write_text(json.dumps([[v, s, t] for (v, s), t in rows.items()]))
    comm.close()
    dist.destroy_process_group()


# ---- the driver --------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mpiexec() -> str:
    near = Path(sys.executable).parent / "mpiexec"
    return str(near) if near.exists() else "mpiexec"


def _human(size: int) -> str:
    for unit, mult in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= mult:
            return f"{size // mult} {unit}"
    return f"{size} B"


def main() -> None:
    import json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--max", default="256MiB", help="largest message (default 256MiB)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="repeats per size above 1 MiB (10x that up to 1 MiB)")
    ap.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(int(args.worker[0]), int(args.worker[1]), int(args.worker[2]),
               Path(args.worker[3]))
        return
    limit = _size(args.max)
    print(f"sizes 1 KiB .. {_human(limit)}, ranks {args.ranks}, median of repeats; "
          "latency us / bandwidth GB/s")
    md = ["| ranks | size | " + " | ".join(f"{v} us" for v in VARIANTS) + " | "
          + " | ".join(f"{v} GB/s" for v in VARIANTS) + " |",
          "|---:|---:|" + "---:|" * (2 * len(VARIANTS))]
    for n in args.ranks:
        if n % 2:
            sys.exit("--ranks: pairs need an even number of ranks")
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rows.json"
            env = dict(os.environ, OMP_NUM_THREADS="1")
            cmd = [_mpiexec(), "-n", str(n), sys.executable, __file__, "--worker", str(limit),
                   str(args.repeats), str(_free_port()), str(out)]
            subprocess.run(cmd, check=True, env=env, stdin=subprocess.DEVNULL)
            rows = json.loads(out.read_text())
        med = {(v, s): statistics.median(t) for v, s, t in rows}
        for size in _sizes(limit):
            us = [med[(v, size)] * 1e6 for v in VARIANTS]
            gbs = [size / med[(v, size)] / 1e9 for v in VARIANTS]
            line = (f"| {n} | {_human(size)} | " + " | ".join(f"{x:.1f}" for x in us) + " | "
                    + " | ".join(f"{x:.3f}" if x < 1 else f"{x:.2f}" for x in gbs) + " |")
            md.append(line)
            print(line, flush=True)
    print("\n".join(md))


if __name__ == "__main__":
    main()
