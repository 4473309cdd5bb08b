"""The step's vote (``backends/_lower.py``): one 8-byte all-reduce (max, int64) over every rank.

    python benchmarks/vote.py [--ranks 2 4] [--calls 2000]

N processes, one ``TorchCommunicator`` (gloo, with its shared-memory path as the runtime uses
it) each; 200 warm-up calls, then ``--calls`` calls timed back to back on rank 0. It prints
the mean time of one vote, the fixed cost every distributed step pays since issue 19.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rma import _free_port  # noqa: E402


def _rank(rank: int, world: int, port: int, calls: int, out) -> None:  # noqa: ANN001
    torch.set_num_threads(1)
    from meshplan.backends import TorchCommunicator

    comm = TorchCommunicator(rank, world, [], init_method=f"tcp://127.0.0.1:{port}")
    group, flag = tuple(range(world)), torch.zeros(1, dtype=torch.int64)
    for _ in range(200):
        comm.all_reduce(flag, group, "max")
    t0 = time.perf_counter()
    for _ in range(calls):
        comm.all_reduce(flag, group, "max")
    if rank == 0:
        out.put((time.perf_counter() - t0) / calls)
    comm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    for world in args.ranks:
        out = ctx.SimpleQueue()
        mp.spawn(_rank, args=(world, _free_port(), args.calls, out), nprocs=world)
        print(f"{world} ranks: one vote (8-byte all-reduce, max) {out.get() * 1e6:.1f} us")


if __name__ == "__main__":
    main()
