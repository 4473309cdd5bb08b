"""Step-time benchmark (issue 4): meshplan's plans next to DDP and FSDP2 (gloo's TCP).

    python benchmarks/step_time.py [--ranks 2 4] [--steps 10] [--warmup 2] [--quick]
                                   [--rounds 1] [--only ddp,dp,...]

The GPT example (d_model 256, 4 layers, 4 heads, vocab 2048, seq 64, global batch 16, AdamW,
gradient clipping at 1.0) trained on N CPU processes, all variants in one invocation on the
same global batches:

- ``eager``: one process on one thread, the whole batch (reference; two threads are erratic
  when another job holds one of the cores);
- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` on gloo, batch/N per rank;
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every block and on the root, gloo;
- ``meshplan <strategy>``: ``meshplan.distribute(step, mesh={"dp": N}, strategy=...)``; the
  workers' collectives between ranks of this host run through shared memory (see
  ``backends/_shm.py``); ``meshplan dp-tcp`` (``fsdp-tcp``, ``auto-tcp``) is the ``dp``
  (``fsdp``, ``auto``) plan with ``MESHPLAN_SHM=0``, on gloo's own TCP collectives as DDP and
  FSDP2 are.

Transports differ between the sides of the headline ratios: ``dp`` / DDP and ``fsdp`` /
FSDP2 put meshplan's shared-memory collectives against gloo's TCP on loopback (the real
alternative a CPU user has), so after the tables the run prints every ratio with each side's
transport and the same-transport figure beside it (``dp-tcp`` / DDP, ``fsdp-tcp`` / FSDP2,
``auto-tcp`` / FSDP2), which tells the planner's share from the transport's.

Baselines time each step on every rank after a barrier and keep the slowest rank. meshplan is
timed around each call on the controller (split the batch, ZeroMQ round trip, gather the loss);
a worker plugin loaded by this file times the ``step`` handler inside every worker, so the
controller's overhead per step is the call minus the slowest rank's in-worker step. meshplan's
trace + plan (``step.plan``), its first call (worker launch + first mesh step; on a runtime
that takes the first step on the controller, that step) and its second call (then the launch)
are reported apart and not in the medians. ``--rounds R`` runs the whole list R times, one
variant after another in each round, so that a slow minute on a shared machine hits every
variant alike: medians are then over every round's steps, and ``x DDP`` adds the range of the
rounds' own ratios (each round's median against the same round's DDP). Peak memory is each
rank's peak RSS (``VmHWM``; see ``_rss_kib`` for why not ``ru_maxrss``), not an allocator
peak; ``+MiB`` is its growth over the RSS the rank had before it built the model (meshplan:
before setup).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import resource
import socket
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import meshplan
import torch
import torch.nn.functional as F
from meshplan.examples import gpt
from meshplan.examples._common import decay_groups, make_optimizer
from torch import Tensor, nn

CONFIG = gpt.GPTConfig(vocab_size=2048, seq_len=64, n_layer=4, n_head=4, d_model=256,
                       batch_size=16)
CLIP = 1.0
SEED = 0
STRATEGIES = ("dp", "auto", "fsdp")
# meshplan variants beyond the strategies: (strategy, environment of the workers); the -tcp
# ones turn meshplan's shared-memory collectives off, so they run on gloo's TCP as DDP does
_TCP = {"MESHPLAN_SHM": "0"}
MESHPLAN_EXTRA = {"dp-tcp": ("dp", _TCP), "fsdp-tcp": ("fsdp", _TCP), "auto-tcp": ("auto", _TCP)}
BASELINES = ("ddp", "fsdp2")
TIMEOUT_S = 180.0           # per variant; a rank that takes longer is stopped and reported
MICROBATCHES = 1            # --microbatches: every variant runs each rank's batch in parts

_PLUGIN = "meshplan.benchmarks.step_time"     # this file, as a meshplan worker plugin
_TIMER = "bench_step"                          # the kind of the record the plugin adds


@dataclass(frozen=True, slots=True, kw_only=True)
class Result:
    """One variant on one rank count; times in seconds, one entry per timed step."""

    variant: str
    ranks: int
    step_s: tuple[float, ...] = ()      # slowest rank (baselines) or the controller's call
    worker_s: tuple[float, ...] = ()    # meshplan: slowest rank's step inside its worker
    comm_s: tuple[float, ...] = ()      # meshplan: slowest rank's time in collectives
    collectives: str = ""               # per step on rank 0 (meshplan; DDP: its buckets)
    rss_kib: tuple[int, ...] = ()       # peak RSS per rank
    base_kib: tuple[int, ...] = ()      # RSS per rank before the model was built
    plan_s: float | None = None         # meshplan: trace + plan
    first_s: float | None = None        # meshplan: first call (launch + first step)
    second_s: float | None = None       # meshplan: second call
    loss: float | None = None           # loss of the last step (global batch)
    load: float | None = None           # the machine's 1-minute load average after the run
    error: str | None = None
    round_s: tuple[float, ...] = ()     # median step of each round (--rounds)


# ---- shared pieces -------------------------------------------------------------------------

def _rss_kib(field: str = "VmHWM") -> int:
    """This process's peak (``VmHWM``) or current (``VmRSS``) resident set, KiB.

    Not ``getrusage().ru_maxrss``: Linux carries the parent's peak across fork + exec into it,
    so every spawned rank would report at least the launching process's peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss     # no procfs: an upper bound


def _batches(n: int) -> list[tuple[Tensor, Tensor]]:
    ex = gpt.build(config=CONFIG, optimizer="adamw", clip=CLIP, seed=SEED)
    return [ex.batch(i) for i in range(n)]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _threads(ranks: int) -> int:
    """Intra-op threads per rank: the cores this process may use, shared by the ranks."""
    return max(1, len(os.sched_getaffinity(0)) // ranks)


def _error_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"[:200]


# ---- baselines: eager, DDP, FSDP2 in spawned processes -------------------------------------

def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: Tensor, y: Tensor,
                m: int = 1) -> Tensor:
    """The GPT example's step (examples/gpt.py) around a wrapped model; ``m`` > 1: gradient
    accumulation as its users write it, the batch in ``m`` parts, each part's mean loss over
    ``m``, the gradients synchronised on the last part only (DDP's ``no_sync()``, FSDP2's
    ``set_requires_gradient_sync``)."""
    total = torch.zeros(())
    for j, (xj, yj) in enumerate(zip(x.chunk(m), y.chunk(m))):
        last = j == m - 1
        if hasattr(model, "set_requires_gradient_sync"):             # FSDP2
            model.set_requires_gradient_sync(last)
        quiet = model.no_sync() if hasattr(model, "no_sync") and not last else \
            contextlib.nullcontext()
        with quiet:
            logits = model(xj)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), yj.view(-1)) / m
            loss.backward()
        total += loss.detach()
    nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def _baseline_model(kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    ex = gpt.build(config=CONFIG, optimizer="adamw", clip=CLIP, seed=SEED)
    if kind == "eager":
        return ex.model, ex.opt
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(ex.model), ex.opt
    from torch.distributed.fsdp import fully_shard
    model = ex.model
    for block in model.transformer["h"]:
        fully_shard(block)
    fully_shard(model)       # root: embeddings, tied lm_head, final norm
    # parameters are DTensors now: the same optimizer (groups, lr, foreach) built on them
    return model, make_optimizer(decay_groups(model, 0.1), "adamw", foreach=False, lrs=gpt._LR)


def _baseline_rank(rank: int, kind: str, n: int, port: int, threads: int, skip: int,
                   steps: int, out: Any, m: int = 1) -> None:
    """One rank of a baseline (spawned); puts its times and RSS on ``out``."""
    import torch.distributed as dist
    faulthandler.dump_traceback_later(TIMEOUT_S - 5)     # say where a hung rank is stuck
    base = _rss_kib("VmRSS")
    torch.set_num_threads(threads)
    if n > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=n)
    model, opt = _baseline_model(kind)
    batches = [(x.chunk(n)[rank], y.chunk(n)[rank]) for x, y in _batches(skip + steps)]
    times, loss = [], torch.zeros(())
    for i, (x, y) in enumerate(batches):
        if n > 1:
            dist.barrier()
        t0 = time.perf_counter()
        loss = _train_step(model, opt, x, y, m)
        if i >= skip:
            times.append(time.perf_counter() - t0)
    if n > 1:
        dist.all_reduce(loss)
        dist.destroy_process_group()
    out.put({"rank": rank, "times": times, "rss": _rss_kib(), "base": base,
             "loss": float(loss) / n, "collectives": _ddp_buckets(model)})


def _ddp_buckets(model: nn.Module) -> str:
    """DDP's gradient all-reduces per step: its buckets (after the first step's rebuild)."""
    try:
        data = model._get_ddp_logging_data()        # DDP only; private, so best effort
    except Exception:  # noqa: BLE001 - not DDP, or the API moved
        return ""
    sizes = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or "")
    nbytes = [int(b) for b in sizes.replace(",", " ").split()]
    return f"all_reduce {len(nbytes)} ({sum(nbytes) / 2**20:.1f} MiB)" if nbytes else ""


def run_baseline(kind: str, n: int, skip: int, steps: int) -> Result:
    port, threads = _free_port(), 1 if kind == "eager" else _threads(n)
    reps = spawn_ranks(kind, n, _baseline_rank, lambda q: (kind, n, port, threads, skip, steps,
                                                          q, MICROBATCHES))
    if isinstance(reps, Result):
        return reps
    return Result(variant=kind, ranks=n,
                  step_s=tuple(max(ts) for ts in zip(*(r["times"] for r in reps))),
                  rss_kib=tuple(r["rss"] for r in reps), base_kib=tuple(r["base"] for r in reps),
                  collectives=reps[0]["collectives"], loss=reps[0]["loss"])


def spawn_ranks(variant: str, n: int, fn: Any, args: Any) -> list[dict[str, Any]] | Result:
    """Run ``fn(rank, *args(queue))`` in ``n`` spawned processes; each puts one report (a
    dict with ``rank``) on the queue. Returns the reports in rank order, or a ``Result``
    carrying the error (a rank that failed, or ``TIMEOUT_S`` passed)."""
    import torch.multiprocessing as mp
    q = mp.get_context("spawn").SimpleQueue()
    try:
        ctx = mp.spawn(fn, args=args(q), nprocs=n, join=False)
        deadline = time.monotonic() + TIMEOUT_S
        reps: list[dict[str, Any]] = []
        while not ctx.join(timeout=1.0):
            while not q.empty():               # ranks report before they tear down
                reps.append(q.get())
            if time.monotonic() > deadline:
                for proc in ctx.processes:     # our own children; their stacks are on stderr
                    proc.kill()
                if len(reps) == n:             # every rank measured, then hung at exit
                    print(f"  {variant} on {n}: every rank reported, then hung tearing down "
                          "(stopped)", file=sys.stderr, flush=True)
                    break
                return Result(variant=variant, ranks=n,
                              error=f"timed out after {TIMEOUT_S:.0f} s")
    except Exception as exc:  # noqa: BLE001 - reported in the table, not hidden
        return Result(variant=variant, ranks=n, error=_error_line(exc))
    reps += [q.get() for _ in range(n - len(reps))]
    return sorted(reps, key=lambda r: r["rank"])


# ---- meshplan ------------------------------------------------------------------------------

def _install_worker_timer() -> None:
    """In a meshplan worker: wrap the ``step`` handler to time itself; the time and the rank's
    RSS travel back as one extra record in the reply's ``comm`` list (``step.last_comm``)."""
    from meshplan.runtime import _worker
    handlers = getattr(_worker, "_HANDLERS", {})
    if "step" not in handlers:      # the runtime changed: run untimed rather than fail
        return
    inner, base = handlers["step"], _rss_kib("VmRSS")

    def timed(state: Any, header: dict[str, Any], tensors: list[Tensor]) -> Any:
        t0 = time.perf_counter()
        reply, out = inner(state, header, tensors)
        rec = {"kind": _TIMER, "group": [], "nbytes": 0, "dur_s": time.perf_counter() - t0,
               "rss": _rss_kib(), "base": base}
        return {**reply, "comm": [*reply.get("comm", []), rec]}, out

    handlers["step"] = timed


@contextmanager
def _meshplan_env(threads: int, env: dict[str, str] | None = None) -> Iterator[bool]:
    """Workers launched inside get ``threads`` intra-op threads, ``env`` and this file as a
    plugin. Yields whether the plugin could be added (no runtime file is edited for it)."""
    from meshplan.runtime import _distributed
    env = {"OMP_NUM_THREADS": str(threads), **(env or {})}
    saved, old = {k: os.environ.get(k) for k in env}, getattr(_distributed, "_HANDLERS", None)
    os.environ.update(env)
    if isinstance(old, str):
        _distributed._HANDLERS = f"{old},{_PLUGIN}"
    try:
        yield isinstance(old, str)
    finally:
        if isinstance(old, str):
            _distributed._HANDLERS = old
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _split_records(last_comm: Sequence[Sequence[dict[str, Any]]]) -> tuple[list, list]:
    """Per rank: (the timer record or None, the real collective records)."""
    timers = [next((r for r in recs if r["kind"] == _TIMER), None) for recs in last_comm]
    comms = [[r for r in recs if r["kind"] != _TIMER] for recs in last_comm]
    return timers, comms


def _summary(records: Sequence[dict[str, Any]]) -> str:
    """``kind count (MiB)`` for each collective kind in one rank's step."""
    count, nbytes = Counter(r["kind"] for r in records), Counter()
    for r in records:
        nbytes[r["kind"]] += r["nbytes"]
    return ", ".join(f"{k} {count[k]} ({nbytes[k] / 2**20:.1f} MiB)" for k in sorted(count))


def _timed_call(step: Any, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, float]:
    t0 = time.perf_counter()
    loss = step(*batch)
    return loss, time.perf_counter() - t0


def run_meshplan(variant: str, n: int, warmup: int, steps: int) -> Result:
    """``variant``: a strategy, or a name in ``MESHPLAN_EXTRA``."""
    strategy, env = MESHPLAN_EXTRA.get(variant, (variant, {}))
    ex = gpt.build(config=CONFIG, optimizer="adamw", clip=CLIP, seed=SEED)
    batches = _batches(2 + warmup + steps)
    step = meshplan.distribute(ex.step, mesh={"dp": n}, strategy=strategy, topology="cpu",
                               example_inputs=batches[0], timeout_s=TIMEOUT_S,
                               fault_tolerance=False,      # DDP keeps no snapshots either
                               microbatches=MICROBATCHES)
    return measure_mesh(step, batches, warmup, f"meshplan {variant}", n, env)


def measure_mesh(step: Any, batches: Sequence[tuple[Tensor, Tensor]], warmup: int, name: str,
                 n: int, env: dict[str, str] | None = None) -> Result:
    """A distributed step's trace + plan, its first and second calls, then its steps on
    ``batches[2:]`` (``_mesh_steps``), its workers given ``env`` and this file's timer."""
    try:
        with _meshplan_env(_threads(n), env), step:
            t0 = time.perf_counter()
            _ = step.plan                                  # trace + plan; changes no state
            plan_s = time.perf_counter() - t0
            first_s = _timed_call(step, batches[0])[1]
            second_s = _timed_call(step, batches[1])[1]
            r = _mesh_steps(step, batches[2:], warmup, Result(variant=name, ranks=n))
    except meshplan.MeshplanError as exc:
        return Result(variant=name, ranks=n, error=_error_line(exc))
    return replace(r, plan_s=plan_s, first_s=first_s, second_s=second_s)


def _mesh_steps(step: Any, batches: Sequence[tuple[Tensor, Tensor]], warmup: int,
                r: Result) -> Result:
    """Run the steps; time those after ``warmup``; worker times and RSS from the plugin."""
    calls, workers, comm, timers, comms = [], [], [], [], []
    for i, b in enumerate(batches):
        loss, dt = _timed_call(step, b)
        if i < warmup:
            continue
        timers, comms = _split_records(step.last_comm)
        calls.append(dt)
        if all(timers):
            workers.append(max(t["dur_s"] for t in timers))
        comm.append(max(sum(rec["dur_s"] for rec in c) for c in comms))
    return replace(r, step_s=tuple(calls), worker_s=tuple(workers), comm_s=tuple(comm),
                   collectives=_summary(comms[0] if comms else []),
                   rss_kib=tuple(t["rss"] for t in timers if t),
                   base_kib=tuple(t["base"] for t in timers if t), loss=float(loss))


# ---- the run and its tables ----------------------------------------------------------------

VARIANTS = ("eager", *BASELINES, *STRATEGIES, *MESHPLAN_EXTRA)


def run(ranks: Sequence[int], warmup: int, steps: int, rounds: int = 1,
        only: Sequence[str] = VARIANTS) -> list[Result]:
    skip = 2 + warmup       # baselines skip as many steps as meshplan does (same batches)
    for n in ranks:
        if CONFIG.batch_size % n:
            raise SystemExit(f"--ranks {n}: the global batch of {CONFIG.batch_size} does not "
                             "split evenly; use a divisor of it")
    todo = [("eager", 1, lambda: run_baseline("eager", 1, skip, steps))] if "eager" in only else []
    for n in ranks:
        todo += [(k, n, lambda n=n, k=k: _baseline_retried(k, n, skip, steps))
                 for k in BASELINES if k in only]
        todo += [(s, n, lambda n=n, s=s: run_meshplan(s, n, warmup, steps))
                 for s in (*STRATEGIES, *MESHPLAN_EXTRA) if s in only]
    merged: dict[tuple[str, int], Result] = {}
    for rnd in range(rounds):
        if rounds > 1:
            print(f"round {rnd + 1} of {rounds}", file=sys.stderr, flush=True)
        for kind, n, job in todo:
            r = replace(job(), load=os.getloadavg()[0])
            _progress(r)
            merged[(kind, n)] = _merge(merged.get((kind, n)), r)
    return [merged[(kind, n)] for kind, n, _ in todo]


def _merge(a: Result | None, b: Result) -> Result:
    """One variant over rounds: the steps of every round that ran, each round's median (None
    for a round that failed); the first round's one-off times (trace, first calls); the last
    error if no round ran."""
    b = replace(b, round_s=(statistics.median(b.step_s) if b.step_s and not b.error else None,))
    if a is None:
        return b
    rounds = a.round_s + b.round_s
    if a.error or b.error:
        ok = b if a.error else a          # both failed: the last error
        return replace(ok, round_s=rounds)
    variant = a.variant if a.variant == b.variant else a.variant.split(" (")[0] + " (restarted)"
    rss = (tuple(map(max, a.rss_kib, b.rss_kib)) if len(a.rss_kib) == len(b.rss_kib)
           else a.rss_kib)
    return replace(a, variant=variant, step_s=a.step_s + b.step_s,
                   worker_s=a.worker_s + b.worker_s, comm_s=a.comm_s + b.comm_s, rss_kib=rss,
                   round_s=rounds, loss=b.loss,
                   load=max((x for x in (a.load, b.load) if x is not None), default=None))


def _baseline_retried(kind: str, n: int, skip: int, steps: int) -> Result:
    """A baseline, run once more if it timed out. Gloo baselines hung in some runs here: at
    start-up (no rank reached its first line, so no stack), and after the work, in a rank whose
    function had returned (its stack ends in torch's spawn wrapper: tearing down DDP and gloo
    objects). ``run_baseline`` keeps the times of ranks that all reported before hanging; a
    start-up hang runs again, and the variant's name says so."""
    r = run_baseline(kind, n, skip, steps)
    if r.error and "timed out" in r.error:
        print(f"  {kind} on {n}: {r.error}; starting it again", file=sys.stderr, flush=True)
        again = run_baseline(kind, n, skip, steps)
        r = replace(again, variant=f"{kind} (2nd start)") if not again.error else r
    return r


def _progress(r: Result) -> None:
    what = r.error or f"{_ms(r.step_s)} ms/step"
    print(f"  {r.variant} on {r.ranks}: {what}", file=sys.stderr, flush=True)


def _ms(xs: Sequence[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.1f}" if xs else "-"


def _mib(kib: int) -> str:
    return f"{kib / 1024:.0f}"


def _ratio(r: Result, ref: Result | None) -> str:
    """Median step time of ``r`` over ``ref``'s, with the range of the rounds' own ratios."""
    ratio = (f"{statistics.median(r.step_s) / statistics.median(ref.step_s):.2f}"
             if ref and ref.step_s and r.step_s else "-")
    per = [x / y for x, y in zip(r.round_s, ref.round_s if ref else ())
           if x is not None and y is not None]
    if ratio != "-" and r is not ref and len(per) > 1:     # rounds where both ran
        ratio += f" ({min(per):.2f}-{max(per):.2f})"
    return ratio


def _cells(r: Result, ddp: dict[int, Result]) -> list[str]:
    if r.error:
        return [str(r.ranks), r.variant, f"failed: {r.error}", *[""] * (len(HEAD) - 3)]
    ref = ddp.get(r.ranks)
    ratio = _ratio(r, ref)
    over = ([c - w for c, w in zip(r.step_s, r.worker_s)]
            if len(r.worker_s) == len(r.step_s) else [])
    grow = max((a - b for a, b in zip(r.rss_kib, r.base_kib)), default=None)
    return [str(r.ranks), r.variant, _ms(r.step_s), ratio, _ms(r.worker_s), _ms(over),
            _ms(r.comm_s), r.collectives or "-", "/".join(_mib(k) for k in r.rss_kib) or "-",
            _mib(grow) if grow is not None else "-",
            *(f"{x:.1f}" if x is not None else "-" for x in (r.plan_s, r.first_s, r.second_s)),
            f"{r.loss:.5f}" if r.loss is not None else "-",
            f"{r.load:.1f}" if r.load is not None else "-"]


HEAD = ("ranks", "variant", "step ms", "x DDP", "worker ms", "overhead ms", "comm ms",
        "collectives/step (rank 0)", "peak RSS MiB/rank", "+MiB", "trace+plan s", "1st call s",
        "2nd call s", "last loss", "load")


def _ddp_refs(results: Sequence[Result]) -> dict[int, Result]:
    """The DDP result each rank count's ratios are taken against."""
    return {r.ranks: r for r in results if r.variant.startswith("ddp") and not r.error}


SHM = "shared memory"
TCP = "gloo TCP on loopback"
# the headline ratios and their same-transport twins: (meshplan variant, its transport, baseline)
RATIOS = (("dp", SHM, "ddp"), ("dp-tcp", TCP, "ddp"), ("fsdp", SHM, "fsdp2"),
          ("fsdp-tcp", TCP, "fsdp2"), ("auto", SHM, "fsdp2"), ("auto-tcp", TCP, "fsdp2"))


def ratio_lines(results: Sequence[Result]) -> list[str]:
    """Every meshplan / baseline ratio the run can give, each side's transport named
    (baselines: gloo's TCP; meshplan's plans: shared memory between ranks of this host, its
    ``-tcp`` variants: gloo's TCP as the baselines), medians with the rounds' range."""
    by = {(r.variant.split(" (")[0].removeprefix("meshplan "), r.ranks): r
          for r in results if not r.error}
    lines = []
    for n in sorted({r.ranks for r in results if r.ranks > 1}):
        for mine, transport, base in RATIOS:
            r, ref = by.get((mine, n)), by.get((base, n))
            if r and ref:
                lines.append(f"{n} ranks: meshplan {mine} ({transport}) / {base.upper()} ({TCP})"
                             f" = {_ratio(r, ref)}")
    return lines


def markdown(results: Sequence[Result]) -> str:
    ddp = _ddp_refs(results)
    lines = ["| " + " | ".join(HEAD) + " |",
             "|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += ["| " + " | ".join(_cells(r, ddp)) + " |" for r in results]
    return "\n".join(lines)


def plain(results: Sequence[Result]) -> str:
    ddp = _ddp_refs(results)
    rows = [list(HEAD), *(_cells(r, ddp) for r in results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEAD))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=None, help="rank counts (2 4)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per variant (10)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed mesh steps (2)")
    ap.add_argument("--quick", action="store_true", help="2 ranks, 4 timed steps, 1 warm-up")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every variant this many times, interleaved (1)")
    ap.add_argument("--microbatches", type=int, default=1,
                    help="each rank's batch in this many parts, gradients accumulated: "
                         "no_sync() for DDP, set_requires_gradient_sync for FSDP2, "
                         "distribute(microbatches=) for meshplan (1)")
    ap.add_argument("--only", default=",".join(VARIANTS),
                    help=f"comma-separated variants to run ({','.join(VARIANTS)})")
    args = ap.parse_args()
    only = [v.strip() for v in args.only.split(",") if v.strip()]
    if unknown := sorted(set(only) - set(VARIANTS)) or not only:
        raise SystemExit(f"--only {args.only!r}: unknown variants {unknown or '(none given)'}; "
                         f"choose among {', '.join(VARIANTS)}")
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: must be at least 1")
    global MICROBATCHES
    MICROBATCHES = args.microbatches
    ranks = args.ranks or ([2] if args.quick else [2, 4])
    steps = args.steps or (4 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    print(f"GPT {CONFIG}, AdamW, clip {CLIP}; {len(os.sched_getaffinity(0))} cores; "
          f"torch {torch.__version__}; median of {steps} steps after {warmup} warm-up"
          + (f"; {MICROBATCHES} micro-batches per rank" if MICROBATCHES > 1 else "")
          + (f", {args.rounds} rounds" if args.rounds > 1 else ""), file=sys.stderr)
    results = run(ranks, warmup, steps, args.rounds, only)
    print(plain(results))
    print()
    print(markdown(results))
    print()
    print("\n".join(ratio_lines(results)))


if __name__ == "__main__":
    main()
elif __name__ == _PLUGIN and "meshplan.runtime._worker" in sys.modules:
    _install_worker_timer()      # loaded into a meshplan worker through its plugin list
