"""Measure THIS machine and describe it as a ``Topology`` (``meshplan calibrate``).

``world_size`` worker processes are started on this host, joined into a torch.distributed gloo
group over TCP loopback, and measured while they run side by side, as the devices of a local mesh
would: a float32 (and float64, bfloat16) matmul, a large tensor copy, the cost of one tiny op, and
all-reduce / all-gather for message sizes from 1 KiB to 64 MiB. The collective times are fitted to
the ring alpha-beta formulas of ``_comm.collective_time`` by least squares, so the fitted link is in
exactly the terms the cost model uses.

Workers import only torch (not meshplan): they run the source of this module's worker functions
as a script, which keeps their start-up to one torch import and leaves them unaffected by the rest
of the package.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import math
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from .._errors import PlanError, RuntimeFailure
from ._comm import Collective, bucket_call_time, collective_time
from ._kernel_cost import KERNEL_PREFIX
from ._mesh import Link, Topology, get_topology
from ._summary import format_bytes

logger = logging.getLogger(__name__)

MiB = 1 << 20
DEFAULT_SIZES: tuple[int, ...] = tuple(1 << k for k in range(10, 27, 2))   # 1 KiB .. 64 MiB
QUICK_SIZES: tuple[int, ...] = tuple(1 << k for k in range(10, 23, 2))     # 1 KiB .. 4 MiB
DTYPES: tuple[str, ...] = ("float32", "float64", "bfloat16")
COLLECTIVES: tuple[Collective, ...] = (Collective.ALL_REDUCE, Collective.ALL_GATHER)


@dataclass(frozen=True, slots=True)
class Sample:
    """One measured collective: the slowest rank's median seconds for a ``nbytes`` buffer (the
    full buffer, as ``collective_time`` counts it) over ``world_size`` ranks."""

    collective: Collective
    nbytes: int
    seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    """Everything one run measured; ``topology`` is what the planner uses."""

    topology: Topology
    world_size: int
    threads: int                                  # torch threads per worker process
    samples: tuple[Sample, ...]
    fits: Mapping[Collective, Link] = field(default_factory=dict)   # per collective
    matmul_sizes: Mapping[str, int] = field(default_factory=dict)   # dtype -> n of the n^3 matmul
    phase_s: Mapping[str, float] = field(default_factory=dict)      # slowest rank, per phase
    wall_s: float = 0.0


def calibrate(world_size: int = 2, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 3,
              timeout_s: float = 120.0, threads: int | None = None) -> Topology:
    """Measure this machine and return a ``Topology`` named ``"calibrated"``.

    One "device" is one of ``world_size`` local processes, so every number is per process while
    all of them run at once. Compute and memory take the best of ``repeats`` trials (what the
    hardware does when nothing else interferes), collectives the median (their waiting is part
    of their cost):

    - ``flops``: FLOP/s of an n^3 matmul per dtype (n doubled from 128 until one matmul
      takes ~6 ms, at most 1024), with
      ``threads`` torch threads per process (default: usable CPUs // ``world_size``, at least 1);
      the slowest rank counts.
    - ``memory_bandwidth``: bytes read + written per second by a 64 MiB tensor copy.
    - ``memory_bytes``: total RAM (``os.sysconf``) divided by ``world_size``, i.e. an even share of
      the host's memory; nothing is allocated to check it.
    - ``intra_node`` = ``inter_node``: the gloo link over TCP loopback, fitted jointly to
      all-reduce and all-gather times with the ring formulas of ``collective_time``.
    - ``devices_per_node``: at least 64 and at least ``os.cpu_count()`` (every process is local).
    - ``kernel_floor_s``: time of a tiny elementwise op (dispatch overhead).
    - ``compute_efficiency`` is 1.0: the numbers are already achieved ones, not peaks.

    ``sizes`` are message sizes in bytes, ``repeats`` the timed trials per measurement,
    ``timeout_s`` bounds the whole run: on expiry the workers are killed and
    ``RuntimeFailure`` is raised. Defaults take ~10-20 s on a 2-core machine.
    """
    return measure(world_size, sizes, repeats, timeout_s, threads).topology


def measure(world_size: int = 2, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 3,
            timeout_s: float = 120.0, threads: int | None = None) -> Calibration:
    """``calibrate`` with the raw samples and per-collective fits kept (for the CLI's table)."""
    _check_args(world_size, sizes, repeats, timeout_s, threads)
    threads = threads or max(1, _usable_cpus() // world_size)
    cfg = {"world_size": world_size, "sizes": sorted({int(s) for s in sizes}),
           "repeats": repeats, "timeout_s": timeout_s, "threads": threads,
           "dtypes": list(DTYPES), "copy_bytes": 64 * MiB, "matmul_target_s": 0.05,
           "collectives": [c.value for c in COLLECTIVES]}
    start = time.perf_counter()
    for attempt in range(1, FLAT_ATTEMPTS + 1):
        ranks = _run_workers(cfg)
        try:
            return _combine(ranks, cfg, time.perf_counter() - start)
        except _FlatTimes as e:
            # a busy machine can make a 1 KiB collective as slow as a 4 MiB one: measure
            # again before giving up
            if attempt == FLAT_ATTEMPTS:
                raise RuntimeFailure(f"{e} (measured {FLAT_ATTEMPTS} times; is the machine "
                                     "busy? run it again when it is quieter)") from None
            logger.warning("calibrate: %s; measuring again (%d of %d)", str(e).split(" (")[0],
                           attempt + 1, FLAT_ATTEMPTS)
    raise AssertionError("unreachable")


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))          # what this process may run on (containers)
    except AttributeError:
        return os.cpu_count() or 1


def _check_args(world_size: int, sizes: Sequence[int], repeats: int, timeout_s: float,
                threads: int | None) -> None:
    if not isinstance(world_size, int) or world_size < 2:
        raise PlanError(f"calibrate needs world_size >= 2 to time collectives, got {world_size!r}")
    if not sizes or any(not isinstance(s, int) or s < 4 * world_size for s in sizes):
        raise PlanError(f"calibrate sizes must be byte counts >= {4 * world_size}, got "
                        f"{list(sizes)!r}")
    if len(set(sizes)) < 2:
        raise PlanError("calibrate needs at least two different message sizes to separate "
                        "latency from bandwidth, e.g. sizes=(1024, 1 << 20)")
    if not isinstance(repeats, int) or repeats < 1:
        raise PlanError(f"calibrate repeats must be a positive integer, got {repeats!r}")
    if not timeout_s > 0:
        raise PlanError(f"calibrate timeout_s must be positive, got {timeout_s!r}")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise PlanError(f"calibrate threads must be a positive integer, got {threads!r}")


# ---- the parent: start, watch and collect the workers ---------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _loopback_interface() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (AttributeError, OSError):
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def _worker_env(rank: int, world_size: int, port: int, threads: int) -> dict[str, str]:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
               WORLD_SIZE=str(world_size), OMP_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads))
    lo = _loopback_interface()
    if lo:
        env["GLOO_SOCKET_IFNAME"] = lo           # keep gloo on loopback whatever the hostname is
    return env


def _run_workers(cfg: dict) -> list[dict]:
    """Start the workers, wait for them, return each rank's JSON; retries once if the chosen port
    was taken between choosing and binding it."""
    for _ in range(2):
        with tempfile.TemporaryDirectory(prefix="meshplan-calibrate-") as tmp:
            try:
                return _run_workers_once(cfg, tmp)
            except _PortTaken:
                logger.info("calibrate: port taken before rank 0 bound it")
    raise RuntimeFailure("calibrate: two free loopback ports were taken before the workers bound "
                         "them; run it again")


class _PortTaken(Exception):
    pass


def _worker_source() -> str:
    """The helpers' and ``_worker``'s source, then a call of ``_worker``."""
    parts = [textwrap.dedent(inspect.getsource(fn)) for fn in (*_WORKER_SCRIPT, _worker)]
    return "\n\n".join(parts) + f"\n\n{_worker.__name__}()\n"


def _run_workers_once(cfg: dict, tmp: str) -> list[dict]:
    script = os.path.join(tmp, "calibrate_worker.py")
    with open(script, "w", encoding="utf-8") as f:
        f.write(_worker_source())
    port, n = _free_port(), cfg["world_size"]
    procs, logs = [], []
    try:
        for rank in range(n):
            out = os.path.join(tmp, f"rank{rank}.json")
            log = open(os.path.join(tmp, f"rank{rank}.log"), "w+", encoding="utf-8")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, script, json.dumps(cfg), out], stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT,
                env=_worker_env(rank, n, port, cfg["threads"])))
        _wait(procs, logs, cfg["timeout_s"])
        results = []
        for rank in range(n):
            with open(os.path.join(tmp, f"rank{rank}.json"), encoding="utf-8") as f:
                results.append(json.load(f))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for log in logs:
            log.close()


def _wait(procs: list[subprocess.Popen], logs: list, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank = failed[0]
            text = _tail(logs[rank])
            if "EADDRINUSE" in text or "ddress already in use" in text:
                raise _PortTaken()
            raise RuntimeFailure(f"calibrate: worker rank {rank} exited with code "
                                 f"{codes[rank]}; its output ends with:\n{text}")
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            waiting = [r for r, c in enumerate(codes) if c is None]
            raise RuntimeFailure(
                f"calibrate: ranks {waiting} did not finish within {timeout_s:g} s and were "
                f"killed; pass a larger timeout_s (--timeout) or fewer/smaller sizes. Rank "
                f"{waiting[0]}'s output ends with:\n{_tail(logs[waiting[0]]) or '(nothing)'}")
        time.sleep(0.02)


def _tail(log, limit: int = 2000) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-limit:].strip()


# ---- combining and fitting ------------------------------------------------------------------

def _combine(ranks: list[dict], cfg: dict, wall_s: float) -> Calibration:
    """The slowest rank counts: min of rates, max of times."""
    flops = {dt: min(r["flops"][dt] for r in ranks) for dt in cfg["dtypes"]}
    samples = tuple(
        Sample(Collective(kind), int(ranks[0]["collectives"][i][1]),
               max(r["collectives"][i][2] for r in ranks))
        for i, (kind, _, _) in enumerate(ranks[0]["collectives"]))
    n = cfg["world_size"]
    link = fit_link(samples, n)
    fits = {c: fit_link([s for s in samples if s.collective is c], n) for c in COLLECTIVES}
    topo = Topology(
        name="calibrated", flops=flops,
        memory_bandwidth=min(r["memory_bandwidth"] for r in ranks),
        memory_bytes=_total_ram() // n, devices_per_node=max(64, os.cpu_count() or 1),
        intra_node=link, inter_node=link, compute_efficiency=1.0,
        kernel_floor_s=max(r["kernel_floor_s"] for r in ranks),
        comm_overlap=get_topology("cpu").comm_overlap,     # gloo on the ranks' own cores
        device="cpu")
    return Calibration(topology=topo, world_size=n, threads=cfg["threads"], samples=samples,
                       fits=fits, matmul_sizes=ranks[0]["matmul_sizes"], wall_s=wall_s,
                       phase_s={k: max(r["phases"][k] for r in ranks) for k in ranks[0]["phases"]})


def _total_ram() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        logger.warning("calibrate: cannot read the total RAM; assuming 8 GiB")
        return 8 << 30


class _FlatTimes(RuntimeFailure):
    """The collective times did not grow with message size: no bandwidth to fit."""


# measurements taken before collective times that do not grow with size are an error
FLAT_ATTEMPTS = 3


def fit_link(samples: Sequence[Sample], world_size: int | Sequence[int]) -> Link:
    """Least-squares latency and bandwidth such that ``collective_time(kind, nbytes, n, link)``
    matches the measured seconds, in relative terms (each sample weighs by 1/time, so small
    messages pin latency and large ones bandwidth). Latency is clamped at 0. ``world_size``:
    the ranks of every sample's group, or one per sample."""
    if len({s.nbytes for s in samples}) < 2:
        raise PlanError("fitting a link needs samples of at least two message sizes")
    ns = ([world_size] * len(samples) if isinstance(world_size, int) else list(world_size))
    per_alpha, per_inv_bw = Link(bandwidth=math.inf, latency=1.0), Link(bandwidth=1.0, latency=0.0)
    a = np.array([collective_time(s.collective, s.nbytes, n, per_alpha)
                  for s, n in zip(samples, ns)])
    b = np.array([collective_time(s.collective, s.nbytes, n, per_inv_bw)
                  for s, n in zip(samples, ns)])
    t = np.array([s.seconds for s in samples])
    if not np.all(t > 0):
        raise RuntimeFailure(f"calibrate measured non-positive times: {t.tolist()}")
    w = 1.0 / t
    (alpha, inv_bw), *_ = np.linalg.lstsq(np.stack([a * w, b * w], axis=1), t * w, rcond=None)
    if alpha < 0:                                # refit bandwidth alone through the origin
        alpha = 0.0
        inv_bw = float(np.sum(b * w * t * w) / np.sum((b * w) ** 2))
    if not inv_bw > 0:
        raise _FlatTimes("calibrate: collective times do not grow with message size, so no "
                             f"bandwidth can be fitted (samples: {list(samples)})")
    return Link(bandwidth=float(1.0 / inv_bw), latency=float(alpha))


# ---- reading it -----------------------------------------------------------------------------

def _si(x: float, unit: str) -> str:
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.2f} {unit}"


def _time(s: float) -> str:
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def calibration_tables(cal: Calibration) -> list:
    """Two rich tables: the topology's numbers, and every sample beside the fitted model."""
    from rich.table import Table

    topo, link = cal.topology, cal.topology.intra_node
    per = f"per process, {cal.world_size} running, {cal.threads} torch thread(s) each"
    main = Table(title=f"this machine as a topology ({per})")
    for col in ("quantity", "value", "how"):
        main.add_column(col, justify="right" if col == "value" else "left")
    for dtype, rate in dict(topo.flops).items():
        n = cal.matmul_sizes.get(dtype, 0)
        main.add_row(f"{dtype} matmul", _si(rate, "FLOP/s"), f"best {n}^3 matmul")
    main.add_row("memory bandwidth", _si(topo.memory_bandwidth, "B/s"), "copy, read + write")
    main.add_row("memory", f"{topo.memory_bytes / 2**30:.2f} GiB",
                 f"total RAM / {cal.world_size}")
    main.add_row("link bandwidth", _si(link.bandwidth, "B/s"),
                 "gloo, loopback; ring fit to both")
    main.add_row("link latency", _time(link.latency), "per ring step, same fit")
    for kind, fit in cal.fits.items():
        main.add_row(f"  {kind.value} alone", f"{_si(fit.bandwidth, 'B/s')}, {_time(fit.latency)}",
                     "fit to that collective only")
    main.add_row("op floor", _time(topo.kernel_floor_s), "a tiny elementwise op")
    main.add_row("wall time", f"{cal.wall_s:.1f} s", ", ".join(
        f"{k} {v:.1f} s" for k, v in cal.phase_s.items()))
    kinds = list(dict.fromkeys(s.collective for s in cal.samples))
    fit = Table(title=f"collectives on {cal.world_size} ranks: measured / fitted model")
    fit.add_column("bytes", justify="right")
    for kind in kinds:
        fit.add_column(kind.value, justify="right")
    by_size: dict[int, dict[Collective, Sample]] = {}
    n = cal.world_size
    for smp in cal.samples:
        by_size.setdefault(smp.nbytes, {})[smp.collective] = smp
    for nbytes, row in sorted(by_size.items()):
        cells = [f"{_time(row[k].seconds)} / {_time(collective_time(k, nbytes, n, link))}"
                 if k in row else "" for k in kinds]
        fit.add_row(format_bytes(nbytes), *cells)
    return [main, fit]


# ---- the worker: these functions' sources are a script each spawned process runs -------------
# They import only torch and the standard library, each for itself, so none may use this
# module's globals.

def _timings(fn, repeats, iters=1):
    """Seconds per ``fn()`` in each of ``repeats`` trials of ``iters`` calls, after one warm-up
    call."""
    import time

    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - t0) / iters)
    return times


def _matmul_flops(dtype_name, target_s, repeats):
    """Best FLOP/s of an n^3 matmul, n doubled from 128 (up to 1024) until one takes
    target_s / 8."""
    import time

    import torch

    dtype, n = getattr(torch, dtype_name), 128
    while True:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        t0 = time.perf_counter()
        a @ b
        if n >= 1024 or time.perf_counter() - t0 >= target_s / 8:
            return 2 * n ** 3 / min(_timings(lambda: a @ b, repeats)), n
        n *= 2


def _copy_bandwidth(nbytes, repeats):
    """Best bytes read + written per second by a tensor copy of ``nbytes``."""
    import torch

    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / min(_timings(lambda: dst.copy_(src), repeats))


def _op_floor(repeats):
    """Seconds of one tiny elementwise op (best of ``repeats`` x 1000): dispatch overhead."""
    import torch

    x, y = torch.ones(256), torch.empty(256)
    return min(_timings(lambda: torch.add(x, x, out=y), repeats, iters=1000))


def _collective_times(kinds, sizes, world, repeats):
    """[[kind, nbytes of the full buffer, median seconds], ...]; every rank runs the same loop."""
    import statistics

    import torch
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch 2.13+
    biggest = max(sizes) // 4
    buf, gathered = torch.zeros(biggest), torch.empty(biggest)   # zeros stay finite when summed
    samples = []
    for kind in kinds:
        for size in sizes:
            numel = size // 4 // world * world       # all-gather needs `world` equal pieces
            if kind == "all_reduce":
                def op(t=buf[:numel]):
                    dist.all_reduce(t)
            else:
                def op(inp=buf[:numel // world], out=gathered[:numel]):
                    gather(out, inp)
            dist.barrier()
            iters = max(1, min(20, (4 << 20) // size))
            samples.append([kind, numel * 4, statistics.median(_timings(op, repeats, iters))])
    return samples


def _worker():
    """One rank: argv = [script, config JSON, output path]; the environment carries RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT. Writes the rank's measurements as JSON."""
    import time

    t_start = time.perf_counter()
    import json
    import os
    import sys
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    cfg, out_path = json.loads(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(cfg["threads"])
    dist.init_process_group("gloo", init_method="env://",
                            timeout=timedelta(seconds=cfg["timeout_s"]))
    r, phases, last = cfg["repeats"], {}, [t_start]

    def phase_done(name):                            # seconds since the previous phase ended
        now = time.perf_counter()
        phases[name], last[0] = now - last[0], now

    phase_done("start")
    dist.barrier()                                   # all ranks compute at once, as devices do
    mm = {dt: _matmul_flops(dt, cfg["matmul_target_s"], r) for dt in cfg["dtypes"]}
    phase_done("compute")
    result = {"flops": {dt: f for dt, (f, _) in mm.items()},
              "matmul_sizes": {dt: n for dt, (_, n) in mm.items()},
              "memory_bandwidth": _copy_bandwidth(cfg["copy_bytes"], r),
              "kernel_floor_s": _op_floor(r), "phases": phases}
    phase_done("memory")
    result["collectives"] = _collective_times(cfg["collectives"], cfg["sizes"],
                                              cfg["world_size"], r)
    phase_done("collectives")
    dist.barrier()
    dist.destroy_process_group()
    with open(out_path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(result, f)
    os.replace(out_path + ".tmp", out_path)


_WORKER_SCRIPT = (_timings, _matmul_flops, _copy_bandwidth, _op_floor, _collective_times)


# ---- from a run's telemetry -------------------------------------------------------------------

_FITTED = {c.value: c for c in (Collective.ALL_REDUCE, Collective.ALL_GATHER,
                                Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL)}


@dataclass(frozen=True, slots=True, kw_only=True)
class OpSample:
    """One planned node's sampled time: the median over ranks and steps of the op's measured
    seconds, and the work the cost model priced for one rank (``plan_nodes``)."""

    target: str
    flops: float
    nbytes: float
    dtype: str
    seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ComputeFit:
    """Compute rates fitted to a run's op times, in the cost model's terms."""

    flops: Mapping[str, float]            # dtype -> FLOP/s (measured dtypes; others scaled)
    memory_bandwidth: float
    kernel_floor_s: float
    op_factors: Mapping[str, float]       # target -> measured / fitted roofline time
    ops: int                              # samples used
    measured_s: float                     # their total measured time
    roofline_s: float                     # the fitted rates' total, before op factors


@dataclass(frozen=True, slots=True, kw_only=True)
class TelemetryFit:
    """What ``from_telemetry`` found: the topology and the fits behind it."""

    topology: Topology
    samples: tuple[Sample, ...]           # collectives: probes, or the run's own
    link: Link | None                     # None when the run issued too few collectives
    compute: ComputeFit | None            # None when the run sampled no ops
    measured_step_s: float | None = None  # the run's median step (slowest rank; first left out)
    model_step_s: float | None = None     # the run's own plan priced on the fitted machine,
                                          # before the step overhead (which is the difference)
    probed: bool = False                  # samples are the run's link_probes rows


# An op does at least this many FLOPs per byte it moves to count as compute-bound when rates
# are fitted (an n x n x n fp32 matmul does n/6; elementwise ops do at most 1/4).
COMPUTE_BOUND_INTENSITY = 8.0
# Ops moving less than this are priced at the floor: their time is the dispatch overhead.
SMALL_OP_BYTES = 64 * 1024
# An op's own factor is fitted only when its nodes take this share of the sampled time or more
# (a factor from a few microseconds of samples would be noise).
FACTOR_MIN_SHARE = 0.002


def fit_compute(samples: Sequence[OpSample], base: Topology) -> ComputeFit:
    """Fit the roofline ``max(flops / F[dtype], bytes / W, floor)`` to sampled op times, then
    one factor per op for what the roofline misses (a kernel slower or faster than its class).

    - ``floor``: the mean time of small ops (under ``SMALL_OP_BYTES``): dispatch overhead.
    - ``F[dtype]``: the typical rate of the compute-bound ops of that dtype
      (``COMPUTE_BOUND_INTENSITY``): each op kind's total FLOPs over its total time, and the
      time-weighted median over kinds (one kind far off its roofline, such as CPU attention,
      does not move it). A dtype the run did not compute in keeps ``base``'s rate scaled by
      the measured dtype's ratio to base.
    - ``W``: the same over bytes, for the other ops slower than twice the floor.
    - ``op_factors[target]``: the target's measured time over the fitted roofline's, for
      targets holding at least ``FACTOR_MIN_SHARE`` of the time. With the factors, the run's
      own sampled compute is reproduced per op kind; the rates price the kinds it did not
      sample."""
    use = [s for s in samples if s.seconds > 0 and (s.flops > 0 or s.nbytes > 0)]
    if len(use) < 8:
        raise PlanError(f"fitting compute needs sampled times of at least 8 ops, got {len(use)} "
                        "(record at level 'ops': TelemetryConfig(level='ops'))")
    small = [s for s in use if s.nbytes < SMALL_OP_BYTES
             and s.flops < COMPUTE_BOUND_INTENSITY * SMALL_OP_BYTES]
    floor = float(np.mean([s.seconds for s in small])) if small else base.kernel_floor_s
    big = [s for s in use if s not in small]
    bound = [s for s in big if s.flops >= COMPUTE_BOUND_INTENSITY * s.nbytes]
    mem = [s for s in big if s not in bound and s.seconds > 2 * floor and s.nbytes > 0]
    rates: dict[str, float] = {}
    for dtype in sorted({s.dtype for s in bound}):
        rates[dtype] = _typical_rate([s for s in bound if s.dtype == dtype], "flops")
    if rates:                      # the dtype with the most compute-bound ops sets the scale
        ref = max(rates, key=lambda d: sum(s.dtype == d for s in bound))
        scale = rates[ref] / base.flops_for(ref) / base.compute_efficiency
    else:
        scale = 1.0
    flops = {d: f * base.compute_efficiency * scale for d, f in base.flops} | rates
    bw = (_typical_rate(mem, "nbytes") if mem
          else base.memory_bandwidth * base.compute_efficiency)
    slowest = min(flops.values())          # as Topology.flops_for prices an unlisted dtype

    def roofline(s: OpSample) -> float:
        return max(s.flops / flops.get(s.dtype, slowest), s.nbytes / bw, floor)

    total = sum(s.seconds for s in use)
    factors = {t: m / r for t, (m, r) in _per_target(use, roofline).items()
               if m >= FACTOR_MIN_SHARE * total and r > 0}
    return ComputeFit(flops=flops, memory_bandwidth=bw, kernel_floor_s=floor, op_factors=factors,
                      ops=len(use), measured_s=total, roofline_s=sum(roofline(s) for s in use))


def _per_target(samples: Sequence[OpSample],
                of: Callable[[OpSample], float]) -> dict[str, tuple[float, float]]:
    """Per op kind (target), sorted: (total measured seconds, total of ``of``)."""
    per: dict[str, tuple[float, float]] = {}
    for s in samples:
        t, v = per.get(s.target, (0.0, 0.0))
        per[s.target] = (t + s.seconds, v + of(s))
    return dict(sorted(per.items()))


def _typical_rate(samples: Sequence[OpSample], work: str) -> float:
    """Per op kind (target): total ``work`` over total seconds; then the median over kinds,
    each weighted by its time."""
    per = _per_target(samples, lambda s: getattr(s, work))
    kinds = sorted((w / t, t) for t, w in per.values() if t > 0)
    half, run = sum(t for _, t in kinds) / 2, 0.0
    for rate, t in kinds:
        run += t
        if run >= half:
            return rate
    return kinds[-1][0]


def from_telemetry(store: object, run_id: str | None = None,
                   base: str | Topology | None = None) -> TelemetryFit:
    """A topology fitted to what a recorded run measured.

    Links: from the run's ``link_probes`` rows when it has them (``backends/_probe.py``:
    blocking collectives timed on the run's mesh, which ``distribute(calibrate=)`` records
    after its calibrating steps; the median over ranks per kind, group size and bytes; and
    the link's ``wait``, from the ``wait`` rows of ``probe_wait``), else
    from the run's own collectives: every (kind, group size, bytes) becomes one sample, the median over ranks
    and steps of the call's duration, waits for slower peers included (what a step pays).
    Gradient buckets are left out (started during the backward and finished at its end,
    their durations hold compute), and a link is fitted only when the sizes span 16x or more
    (a data-parallel run's other collectives are a 4-byte loss and an 8-byte vote: how far
    the ranks drift apart, not what the link does). ``fit_link`` fits the link, and each
    collective kind measured at two sizes or more its own (``Link.kinds``). Compute: when
    the run sampled op times (level ``ops``), the
    rates and per-op factors of ``fit_compute``, from each planned node's median time (the
    first step, which warms caches up, is left out when later ones were sampled). What the
    run did not measure comes from ``base`` (default: the run's own topology when it is a
    preset)."""
    from ._mesh import PRESETS, get_topology

    run = run_id or _latest_run(store)
    if base is None:
        rows = store.sql(f"SELECT topology FROM runs WHERE run_id = '{_sq(run)}'").to_pylist()
        name = rows[0]["topology"] if rows else None
        if name not in PRESETS:
            raise PlanError(f"run {run} was planned with topology {name!r}, which is not a "
                            f"preset; pass --topology (one of {sorted(PRESETS)} or a file) for "
                            "the numbers the run did not measure")
        base = name
    topo = get_topology(base)
    kinds = ", ".join(f"'{k}'" for k in _FITTED)
    rows = store.sql(f"""
        SELECT kind, group_size, bytes, quantile_cont(dur_us, 0.5) AS us
        FROM link_probes WHERE run_id = '{_sq(run)}' AND kind IN ({kinds})
        GROUP BY ALL ORDER BY kind, group_size, bytes""").to_pylist()
    probed = bool(rows)
    if not probed:
        rows = store.sql(f"""
            SELECT kind, group_size, bytes, quantile_cont(dur_us, 0.5) AS us, count(*) AS calls
            FROM collectives WHERE run_id = '{_sq(run)}' AND group_size > 1 AND bytes > 0
              AND kind IN ({kinds}) AND value IS DISTINCT FROM '<bucket>'
            GROUP BY ALL ORDER BY kind, group_size, bytes""").to_pylist()
    samples = tuple(Sample(_FITTED[r["kind"]], int(r["bytes"]), max(float(r["us"]), 1.0) * 1e-6)
                    for r in rows)
    link = _fit_links(samples, [int(r["group_size"]) for r in rows])
    wait = _probed_wait(store, run)
    ops = _op_samples(store, run)
    compute = fit_compute(ops, topo) if ops else None
    if link is None and compute is None:
        raise PlanError(f"run {run} recorded {len(samples)} distinct collectives and no op "
                        f"times: fitting a link needs message sizes {LINK_SPAN}x apart, "
                        "gradient buckets aside (record at level 'collectives' and run a plan "
                        "that reshards activations, e.g. megatron_tp), fitting compute needs "
                        "level 'ops'")
    fitted = dataclasses.replace(topo, name=f"{topo.name}+run-{run}")
    if link is not None:
        fitted = dataclasses.replace(fitted, intra_node=link, inter_node=link)
    if wait is not None:
        fitted = dataclasses.replace(
            fitted, intra_node=dataclasses.replace(fitted.intra_node, wait=wait),
            inter_node=dataclasses.replace(fitted.inter_node, wait=wait))
    if compute is not None:
        fitted = dataclasses.replace(
            fitted, flops=compute.flops, memory_bandwidth=compute.memory_bandwidth,
            compute_efficiency=1.0, kernel_floor_s=compute.kernel_floor_s,
            op_factors=compute.op_factors)
    measured = _measured_step(store, run)
    model = _priced_step(store, run, fitted) if compute is not None else None
    if measured is not None and model is not None:
        # what the step takes beyond the priced ops and collectives, as a constant per step
        fitted = dataclasses.replace(fitted, step_overhead_s=max(0.0, measured - model))
    return TelemetryFit(topology=fitted, samples=samples, link=link, compute=compute,
                        measured_step_s=measured, model_step_s=model, probed=probed)


LINK_SPAN = 16      # the largest sample over the smallest: below it no link is fitted


def _fit_links(samples: Sequence[Sample], group_sizes: Sequence[int]) -> Link | None:
    """One link for all ``samples`` and, within it, one per kind measured at two sizes or
    more; None when the sizes span less than ``LINK_SPAN``."""
    sizes = [s.nbytes for s in samples]
    if not sizes or max(sizes) < LINK_SPAN * min(sizes):
        return None
    whole = fit_link(samples, list(group_sizes))
    kinds = []
    for kind in sorted({s.collective for s in samples}, key=lambda c: c.value):
        mine = [(s, n) for s, n in zip(samples, group_sizes) if s.collective is kind]
        if len({s.nbytes for s, _ in mine}) >= 2:
            one = fit_link([s for s, _ in mine], [n for _, n in mine])
            kinds.append((kind.value, one.bandwidth, one.latency))
    return Link(bandwidth=whole.bandwidth, latency=whole.latency, kinds=tuple(kinds))


def _probed_wait(store: object, run: str) -> float | None:
    """The run's ``probe_wait`` rows (kind ``wait``): the median over ranks and mesh axes of
    what a blocking collective waits for busy members; None when the run has none."""
    rows = store.sql(f"SELECT quantile_cont(dur_us, 0.5) AS us FROM link_probes "
                     f"WHERE run_id = '{_sq(run)}' AND kind = 'wait'").to_pylist()
    us = rows[0]["us"] if rows else None
    return None if us is None else float(us) * 1e-6


def _measured_step(store: object, run: str) -> float | None:
    """The median over steps of the step's time as the controller saw it (the call: split,
    send, every rank's step, gather; the slowest rank's own time where the controller
    recorded none), the run's first step (which warms up) left out when there are others."""
    q = _sq(run)
    rows = store.sql(f"""
        WITH c AS (SELECT count(*) AS n FROM steps WHERE run_id = '{q}' AND rank = -1),
             s AS (SELECT step, max(dur_us) AS d FROM steps, c
                   WHERE run_id = '{q}' AND (rank = -1) = (c.n > 0) GROUP BY step)
        SELECT quantile_cont(d, 0.5) AS us FROM s
        WHERE step > (SELECT min(step) FROM s) OR (SELECT count(*) FROM s) = 1""").to_pylist()
    us = rows[0]["us"] if rows else None
    return None if us is None else float(us) * 1e-6


def _priced_step(store: object, run: str, topo: Topology) -> float | None:
    """The run's own plan (``plan_nodes``, ``plan_collectives``) priced on ``topo`` as the
    planner prices a plan (compute plus collectives, the all-reduces the lowering merges at
    one call per bucket; the step's vote, which plans do not list, is left to the step
    overhead)."""
    from ._problem import _compute_time

    q = _sq(run)
    nodes = store.sql(f"SELECT target, flops, bytes, dtype, kernel FROM plan_nodes "
                      f"WHERE run_id = '{q}'").to_pylist()
    if not nodes or any(n["flops"] is None for n in nodes):
        return None
    # a fused kernel's members share its work: priced without a floor each (the anchor's
    # one launch, microseconds against the kernel's milliseconds, is left to the overhead)
    compute = sum(_compute_time(n["flops"], n["bytes"], 1, n["dtype"] or "float32", topo,
                                n["kernel"] or n["target"], floor=n["kernel"] is None)
                  for n in nodes)
    colls = store.sql(f"SELECT value, kind, group_size, bytes, bucket, bucket_overlaps "
                      f"FROM plan_collectives WHERE run_id = '{q}' AND value <> '<vote>'"
                      ).to_pylist()
    comm = sum(collective_time(Collective(c["kind"]), c["bytes"], c["group_size"],
                               topo.intra_node) for c in colls if c["bucket"] is None)
    buckets: dict[int, tuple[int, bool, dict[str, int]]] = {}
    for c in colls:                  # one call per bucket, each value once (planning.comm_time)
        if c["bucket"] is not None:
            n, overlaps, values = buckets.setdefault(
                int(c["bucket"]), (int(c["group_size"]), bool(c["bucket_overlaps"]), {}))
            values[c["value"]] = int(c["bytes"])
    comm += sum(bucket_call_time(sum(values.values()), n, topo.intra_node,
                                 topo.comm_overlap if overlaps else 0.0)
                for n, overlaps, values in buckets.values())
    return compute + comm


def _op_samples(store: object, run: str) -> list[OpSample]:
    """Each planned node's median sampled time (``ops`` joined to ``plan_nodes``), and each
    fused kernel's (its calls in a step, against the work of every node it replaces), leaving
    out step 0 when later steps were sampled. Empty when the run sampled none or its plan rows
    predate the work columns."""
    try:
        rows = store.sql(f"""
            WITH o AS (SELECT * FROM ops WHERE run_id = '{_sq(run)}'),
                 first AS (SELECT CASE WHEN max(step) > min(step) THEN min(step) ELSE -1 END AS s
                           FROM o)
            SELECT p.target, any_value(p.flops) AS flops, any_value(p.bytes) AS bytes,
                   any_value(p.dtype) AS dtype, quantile_cont(o.dur_us, 0.5) AS us
            FROM plan_nodes p JOIN o ON o.node = p.node, first
            WHERE p.run_id = '{_sq(run)}' AND o.step <> first.s AND p.flops IS NOT NULL
              AND p.kernel IS NULL AND o.target NOT LIKE '{KERNEL_PREFIX}%'
            GROUP BY p.node, p.target""").to_pylist()
        # a fused kernel's calls (one per group of matches: node "anchor+N") against the work
        # of all its matches: the median over ranks and steps of the step's calls together
        fused = store.sql(f"""
            WITH o AS (SELECT * FROM ops WHERE run_id = '{_sq(run)}'),
                 first AS (SELECT CASE WHEN max(step) > min(step) THEN min(step) ELSE -1 END AS s
                           FROM o),
                 calls AS (SELECT o.target, o.rank, o.step, sum(o.dur_us) AS us FROM o, first
                           WHERE o.target LIKE '{KERNEL_PREFIX}%' AND o.step <> first.s
                           GROUP BY ALL),
                 work AS (SELECT kernel AS target, sum(flops) AS flops, sum(bytes) AS bytes,
                                 any_value(dtype) AS dtype
                          FROM plan_nodes WHERE run_id = '{_sq(run)}' AND kernel IS NOT NULL
                          GROUP BY kernel)
            SELECT w.target, w.flops, w.bytes, w.dtype, quantile_cont(c.us, 0.5) AS us
            FROM work w JOIN calls c ON c.target = w.target
            WHERE w.bytes > 0 GROUP BY ALL""").to_pylist()
    except Exception as e:  # noqa: BLE001 - a store from before the ops/work/kernel columns
        logger.debug("no op samples for run %s: %s", run, e)
        return []
    return [OpSample(target=r["target"], flops=float(r["flops"]), nbytes=float(r["bytes"]),
                     dtype=r["dtype"] or "float32", seconds=float(r["us"]) * 1e-6)
            for r in (*rows, *fused)]


def node_work(graph: object, placement: object, mesh: object) -> tuple[float, float, str]:
    """(FLOPs, bytes read + written, dtype) that one rank runs for ``placement``'s node: the
    numbers the cost model prices (``_problem._compute_time``). A node's work is divided by
    every mesh axis along which its placement is not all-Replicate (the planner's split). A
    node a fused kernel replaces carries its share of the kernel's work
    (``_kernel_cost.kernel_work``)."""
    from ..ir import TensorMeta
    from ._kernel_cost import kernel_work, node_work_of
    from ._placement import R

    node = graph.node(placement.node)
    split = 1
    for a, n in enumerate(mesh.sizes):
        if any(lay is not None and lay[a] != R for lay in (*placement.inputs, *placement.outputs)):
            split *= n
    dtype = next((m.dtype for m in node.outputs if isinstance(m, TensorMeta)), "float32")
    flops, nbytes, _, _ = node_work_of(graph, node, kernel_work(graph, mesh.topology))
    return flops / split, nbytes / split, dtype


def _latest_run(store: object) -> str:
    rows = store.sql("SELECT run_id FROM runs ORDER BY start_us DESC LIMIT 1").to_pylist()
    if not rows:
        raise PlanError("the telemetry store holds no runs; run a step with telemetry first")
    return rows[0]["run_id"]


def _sq(text: str) -> str:
    return str(text).replace("'", "''")
