"""Kernel benchmarks (issue 8), CPU parts: numba bucket kernels against torch, and bucketed
against per-tensor gradient all-reduce on gloo.

    python benchmarks/kernels.py [--repeats 30] [--ranks 2 4] [--steps 10] [--quick]

1. flatten/unflatten: every parameter-gradient shape of the GPT example (d_model 256, vocab
   4096; 4 layers = 52 tensors, 6 layers = 76 tensors) and of a ~100 MB one (d_model 512,
   8 layers), copied into one flat buffer and back. ``numba`` = ``flatten_into`` /
   ``unflatten_from``; ``torch`` = ``flatten_into_torch`` (``torch.cat(..., out=)``) /
   ``unflatten_from_torch`` (per-tensor ``copy_``).
2. strided packing: each MLP/attention weight split into ``tp`` column shards with
   ``narrow`` (non-contiguous views), packed back to back; ``numba`` = ``pack_strided``,
   ``torch`` = ``pack_strided_torch`` (one strided ``copy_`` per view into the buffer) and
   ``torch.cat`` = ``torch.cat([v.reshape(-1) ...])`` (the naive way, a temporary per view).
3. all-reduce: N gloo processes (``torch.multiprocessing``), each holding the 76 GPT gradients;
   ``per-tensor`` = one ``all_reduce`` per gradient; ``bucketed`` = ``plan_buckets`` (25 MB
   buckets, reverse parameter order like DDP), ``flatten_into``, one ``all_reduce`` per bucket,
   ``unflatten_from``. A step is timed after a barrier; the slowest rank's time counts.

Medians over repeats; ratios are measured side by side in one run (variants interleaved).
Each all-reduce rank uses one torch and one numba thread (N ranks share the machine's cores).
GPU kernels are not measured here.

``OMP_WAIT_POLICY=PASSIVE`` is set (unless given) before torch and numba load: both bring their
own OpenMP runtime, and with the default policy each pool's threads spin after a parallel
region while the other pool needs the cores - on a loaded 2-core machine that made torch's
copies 10-50x slower whenever numba had just run (and the reverse). Pass
``OMP_WAIT_POLICY=ACTIVE`` to see it.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch/numba load OpenMP (docstring)
import socket
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from meshplan.examples import gpt
from meshplan.kernels import (
    flatten_into, flatten_into_torch, pack_strided, pack_strided_torch, plan_buckets,
    unflatten_from, unflatten_from_torch,
)

BUCKET_BYTES = 25 << 20


def grad_shapes(d_model: int, n_layer: int, vocab: int = 4096) -> list[torch.Size]:
    cfg = gpt.GPTConfig(vocab_size=vocab, seq_len=128, n_layer=n_layer, n_head=4,
                        d_model=d_model)
    return [p.shape for p in gpt.GPT(cfg).parameters()]


def medians_s(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, run round-robin (interleaved, so that load from other
    processes hits every variant alike); one warm-up call each (numba compiles or loads its
    on-disk cache on its first call)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_flatten(shapes: list[torch.Size], repeats: int) -> dict[str, float]:
    grads = [torch.randn(s) for s in shapes]
    offsets, at = [], 0
    for g in grads:
        offsets.append(at)
        at += g.numel()
    buf = torch.empty(at)
    out = [torch.empty_like(g) for g in grads]
    res = medians_s({
        "numba flatten": lambda: flatten_into(buf, grads, offsets),
        "torch flatten": lambda: flatten_into_torch(buf, grads, offsets),
        "numba unflatten": lambda: unflatten_from(buf, out, offsets),
        "torch unflatten": lambda: unflatten_from_torch(buf, out, offsets),
    }, repeats)
    flatten_into(buf, grads, offsets)
    unflatten_from(buf, out, offsets)
    assert all(torch.equal(a, b) for a, b in zip(out, grads))
    res["MB"] = at * 4 / 1e6
    return res


def bench_pack(shapes: list[torch.Size], tp: int, repeats: int) -> dict[str, float]:
    mats = [torch.randn(s) for s in shapes if len(s) == 2 and s[1] % tp == 0 and s[0] != s[1]]
    views = [m.narrow(1, k * (m.shape[1] // tp), m.shape[1] // tp) for m in mats
             for k in range(tp)]
    total = sum(v.numel() for v in views)
    out = torch.empty(total)
    res = medians_s({
        "numba pack": lambda: pack_strided(views, out),
        "torch pack": lambda: pack_strided_torch(views, out),
        "torch.cat": lambda: torch.cat([v.reshape(-1) for v in views], out=out),
    }, repeats)
    assert torch.equal(pack_strided(views, out), pack_strided_torch(views))
    res["MB"] = total * 4 / 1e6
    return res


# ---- all-reduce ----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, shapes, steps: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import numba

    numba.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(rank)
    grads = [torch.randn(s) for s in shapes]
    order = list(reversed(range(len(grads))))     # ready order in backward, as DDP buckets
    buckets = plan_buckets([grads[i].numel() * 4 for i in order], ["float32"] * len(order),
                           BUCKET_BYTES)
    buffers = [b.buffer() for b in buckets]

    def per_tensor() -> list[torch.Tensor]:
        work = [g.clone() for g in grads]
        t0 = _synced()
        for w in work:
            dist.all_reduce(w)
        return work, time.perf_counter() - t0

    def bucketed() -> list[torch.Tensor]:
        work = [g.clone() for g in grads]
        t0 = _synced()
        for b, buf in zip(buckets, buffers):
            members = [work[order[i]] for i in b.indices]
            flatten_into(buf, members, b.offsets)
            dist.all_reduce(buf)
            unflatten_from(buf, members, b.offsets)
        return work, time.perf_counter() - t0

    result = {}
    for name, fn in (("per-tensor", per_tensor), ("bucketed", bucketed)):
        fn()
        times = []
        for _ in range(steps):
            work, dt = fn()
            times.append(_slowest(dt))
        result[name] = statistics.median(times)
        result[name + " out"] = work
    same = all(torch.allclose(a, b, rtol=1e-6, atol=1e-6)
               for a, b in zip(result.pop("per-tensor out"), result.pop("bucketed out")))
    result["equal"] = same
    result["buckets"] = len(buckets)
    if rank == 0:
        queue.put(result)
    dist.barrier()
    dist.destroy_process_group()


def _synced() -> float:
    dist.barrier()
    return time.perf_counter()


def _slowest(dt: float) -> float:
    t = torch.tensor([dt])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def bench_allreduce(shapes, world: int, steps: int) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_rank_main, args=(world, _free_port(), shapes, steps, queue),
                       nprocs=world, join=True, start_method="spawn")
    return queue.get()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--ranks", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="few repeats, small model only")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.steps = 3, 3
    import numba

    print(f"torch {torch.__version__} threads={torch.get_num_threads()}, numba {numba.__version__}"
          f" threads={numba.get_num_threads()}, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    models = {"GPT d256 L4": grad_shapes(256, 4), "GPT d256 L6": grad_shapes(256, 6)}
    if not args.quick:
        models["GPT d512 L8"] = grad_shapes(512, 8)
    print("\n| gradients | tensors | MB | numba flatten ms | torch flatten ms | ratio | "
          "numba unflatten ms | torch unflatten ms | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, shapes in models.items():
        r = bench_flatten(shapes, args.repeats)
        print(f"| {name} | {len(shapes)} | {r['MB']:.1f} | {r['numba flatten']*1e3:.2f} | "
              f"{r['torch flatten']*1e3:.2f} | {r['torch flatten']/r['numba flatten']:.2f} | "
              f"{r['numba unflatten']*1e3:.2f} | {r['torch unflatten']*1e3:.2f} | "
              f"{r['torch unflatten']/r['numba unflatten']:.2f} |")
    print("\n| weights, column shards | tp | MB | numba pack ms | torch pack ms | ratio | "
          "torch.cat ms | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, shapes in models.items():
        for tp in (2, 4):
            r = bench_pack(shapes, tp, args.repeats)
            print(f"| {name} | {tp} | {r['MB']:.1f} | {r['numba pack']*1e3:.2f} | "
                  f"{r['torch pack']*1e3:.2f} | {r['torch pack']/r['numba pack']:.2f} | "
                  f"{r['torch.cat']*1e3:.2f} | {r['torch.cat']/r['numba pack']:.2f} |")
    shapes = models["GPT d256 L6"]
    print(f"\nall-reduce of {len(shapes)} gradients "
          f"({sum(s.numel() for s in shapes) * 4 / 1e6:.1f} MB), gloo, 25 MB buckets")
    print("| ranks | buckets | per-tensor ms | bucketed ms | per-tensor / bucketed | same sums |")
    print("|---:|---:|---:|---:|---:|---|")
    for world in args.ranks:
        r = bench_allreduce(shapes, world, args.steps)
        print(f"| {world} | {r['buckets']} | {r['per-tensor']*1e3:.1f} | {r['bucketed']*1e3:.1f} | "
              f"{r['per-tensor']/r['bucketed']:.2f} | {r['equal']} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
