"""Collectives between ranks of one host: shared memory (``backends/_shm.py``) vs gloo's TCP.

    python benchmarks/shm.py [--ranks 2 4] [--max 64MiB] [--repeats 9]

One job per rank count: N processes, one ``TorchCommunicator`` (gloo) each, and for every size
and collective the two transports one after the other: ``shm`` (the default between ranks of
one host) and ``tcp`` (the same communicator with its shared-memory path switched off, i.e.
gloo's own all-reduce / all-gather / reduce-scatter over loopback). Collectives as the
lowered programs issue them: ``all_reduce`` started with a donated buffer and waited for (a
gradient bucket), ``all_gather`` and ``reduce_scatter`` blocking, float32, dim 0. A barrier
before each call; each rank's median over ``--repeats`` calls, then the slowest rank. Sizes are
the all-reduce's buffer, the all-gather's output and the reduce-scatter's input; inputs larger
than a slot (4 MiB by default) move through shared memory in slot-sized chunks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rma import _free_port, _size, _sizes  # noqa: E402  (the rma benchmark's size helpers)

KINDS = ("all_reduce", "all_gather", "reduce_scatter")
MIN_SIZE = 4 << 10


def _call(comm, kind: str, x: torch.Tensor, g: tuple[int, ...]) -> None:
    if kind == "all_reduce":
        comm.all_reduce_start(x, g, "sum", donate=True).wait()
    elif kind == "all_gather":
        comm.all_gather(x[: x.numel() // len(g)], g, 0)
    else:
        comm.reduce_scatter(x, g, 0, "sum")


def _rank(rank: int, n: int, port: int, sizes: list[int], repeats: int, q) -> None:
    from meshplan.backends import TorchCommunicator
    torch.set_num_threads(1)
    comm = TorchCommunicator(rank, n, [tuple(range(n))], backend="gloo", timeout_s=120,
                             init_method=f"tcp://127.0.0.1:{port}")
    g = tuple(range(n))
    out = {}
    for size in sizes:
        for kind in KINDS:
            for transport in ("shm", "tcp"):
                comm._shm_on = transport == "shm"
                times = []
                for _ in range(repeats + 1):
                    x = torch.ones(size // 4)
                    comm.barrier(g)
                    t0 = time.perf_counter()
                    _call(comm, kind, x, g)
                    times.append(time.perf_counter() - t0)
                out[(size, kind, transport)] = statistics.median(times[1:])
    q.put((rank, out))
    comm.barrier(g)
    comm.close()


def _label(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--max", default="64MiB")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    sizes = [s for s in _sizes(_size(args.max)) if s >= MIN_SIZE]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"{os.cpu_count()} cores; torch {torch.__version__}; median of {args.repeats} calls, "
          "slowest rank", file=sys.stderr)
    print("| ranks | size | collective | shm ms | tcp ms | tcp / shm |")
    print("|---:|---:|---|---:|---:|---:|")
    for n in args.ranks:
        q = mp.get_context("spawn").SimpleQueue()
        ctx = mp.spawn(_rank, args=(n, _free_port(), sizes, args.repeats, q), nprocs=n,
                       join=False)
        results = [q.get()[1] for _ in range(n)]
        ctx.join()
        for size in sizes:
            for kind in KINDS:
                shm, tcp = (max(r[(size, kind, t)] for r in results) for t in ("shm", "tcp"))
                print(f"| {n} | {_label(size)} | {kind} | {shm * 1e3:.3f} | {tcp * 1e3:.3f} | "
                      f"{tcp / shm:.2f} |", flush=True)


if __name__ == "__main__":
    main()
