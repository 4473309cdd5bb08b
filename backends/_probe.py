"""Timing the collectives a plan uses, on the running mesh, as blocking calls.

A calibration run (``distribute(..., calibrate=True)``) fits the cost model to its own steps,
but the collectives of those steps say little about links: a data-parallel step's gradient
buckets are started during the backward and finished at its end, so their durations hold
compute, and its small all-reduces (the loss, the vote) measure how far the ranks drift apart,
not the link. ``probe_links`` times each collective kind at a few sizes on every mesh axis
of the same communicator the steps use (shared memory, gloo, MPI), the ranks lined up by a
barrier and a warm-up call before each timed batch, so that the samples measure the link
and the implementation. Every rank runs the same loop (collective order is the contract).

``probe_wait`` measures what those idle probes cannot: how long a blocking collective waits
for its members to be running again when every rank is busy, as in a step. Where ranks
outnumber cores (4 processes on 2), a member that posts its arrival and blocks wakes a peer
that may have to wait for a time slice; a plan with 60 collectives a step pays that 60 times,
a data-parallel one 3 times. The probe runs the same fixed compute burst on every rank with
and without a tiny all-reduce after each, and the difference per call, less the idle
all-reduce's own time, is the wait (``Link.wait``); on a host with a core per rank it is near
zero.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from ._layout import axis_group, rank_coords

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
SIZES = (64 << 10, 1 << 20, 4 << 20, 16 << 20)       # bytes, the planner's convention


def probe_links(comm: Any, rank: int, sizes: tuple[int, ...], *, kinds: tuple[str, ...] = KINDS,
                nbytes: tuple[int, ...] = SIZES, repeats: int = 3, iters: int = 3,
                device: str = "cpu") -> list[dict[str, Any]]:
    """Per mesh axis of more than one rank, kind and size: ``{"kind", "axis" (index),
    "group_size", "bytes" (all-reduce / reduce-scatter / all-to-all input, all-gather
    output, as telemetry records them), "seconds"}``, the median over ``repeats`` batches of
    ``iters`` back-to-back calls (each batch after a barrier and one untimed call)."""
    coords = rank_coords(rank, sizes)
    out = []
    for axis, n in enumerate(sizes):
        if n < 2:
            continue
        group = axis_group(coords, axis, sizes)
        for kind in kinds:
            for want in nbytes:
                numel = max(n, want // 4 // n * n)          # float32, n equal pieces
                call = _call(comm, kind, group, numel, n, device)
                times = []
                for _ in range(repeats):
                    comm.barrier(group)
                    call()
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        call()
                    times.append((time.perf_counter() - t0) / iters)
                out.append({"kind": kind, "axis": axis, "group_size": n, "bytes": numel * 4,
                            "seconds": statistics.median(times)})
    return out


WAIT_ITERS = 16        # bursts per timed batch
# batches whose median is the wait (a calibration's probe_links takes 3): with 3, the wait
# fitted on 4 ranks sharing 2 cores moved 209-658 us between calibrations minutes apart, and
# a plan of ~100 collectives carried it all (fsdp +8..+39 %); with 9, ten calibrations fell
# in 325-504 us and in three benchmark runs every plan's estimate was within -8..+7 %
# (benchmarks/README.md); a calibration on 4 ranks took 5.0-5.3 s, against 4.5-5.8 s
WAIT_REPEATS = 9
WAIT_MATMULS, WAIT_SIZE = 24, 128   # a burst: 24 float32 128x128 matmuls (~2 ms on an idle core)


def probe_wait(comm: Any, rank: int, sizes: tuple[int, ...], *, repeats: int = WAIT_REPEATS,
               iters: int = WAIT_ITERS, device: str = "cpu") -> list[dict[str, Any]]:
    """Per mesh axis of more than one rank: ``{"kind": "wait", "axis", "group_size",
    "bytes": 4, "seconds"}``, the seconds a blocking collective waits beyond its idle time
    when every rank computes between collectives (clamped at 0): the median over ``repeats``
    of ``(busy + tiny all-reduce) - busy - idle all-reduce``, per call. The burst is the same
    work on every rank (not a duration each rank measures for itself), so ranks drift only
    as their scheduling lets them."""
    coords = rank_coords(rank, sizes)
    k = WAIT_SIZE
    a = torch.full((k, k), 1.0 / k, device=device)     # stays 1/k: no rng, no overflow
    out = torch.empty(k, k, device=device)
    one = torch.zeros(1, device=device)

    def burst() -> None:
        for _ in range(WAIT_MATMULS):
            torch.mm(a, a, out=out)
        if device != "cpu":
            torch.cuda.synchronize()

    samples = []
    for axis, n in enumerate(sizes):
        if n < 2:
            continue
        group = axis_group(coords, axis, sizes)
        reduce = lambda: comm.all_reduce(one, group, "sum")   # noqa: E731
        waits = []
        for _ in range(repeats):
            per = []
            for body in ((burst,), (burst, reduce), (reduce,)):
                comm.barrier(group)
                for f in body:
                    f()
                comm.barrier(group)
                t0 = time.perf_counter()
                for _ in range(iters):
                    for f in body:
                        f()
                per.append((time.perf_counter() - t0) / iters)
            busy, busy_sync, idle_sync = per
            waits.append(busy_sync - busy - idle_sync)
        samples.append({"kind": "wait", "axis": axis, "group_size": n, "bytes": 4,
                        "seconds": max(0.0, statistics.median(waits))})
    return samples


def _call(comm: Any, kind: str, group: tuple[int, ...], numel: int, n: int, device: str):
    """The collective of ``kind`` on ``numel`` float32 elements (zeros: sums stay finite)."""
    whole = torch.zeros(numel, device=device)
    if kind == "all_reduce":
        return lambda: comm.all_reduce(whole, group, "sum")
    if kind == "all_gather":
        piece = torch.zeros(numel // n, device=device)
        return lambda: comm.all_gather(piece, group, 0)
    if kind == "reduce_scatter":
        return lambda: comm.reduce_scatter(whole, group, 0, "sum")
    if kind == "all_to_all":
        block = whole.view(n, numel // n)
        return lambda: comm.all_to_all(block, group, 0, 1)
    raise ValueError(f"probe_links: unknown collective kind {kind!r}")
