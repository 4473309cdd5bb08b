"""Fault tolerance (issue 22): how fast a run gets back after a rank is killed, what snapshots
cost when nothing fails, and the same kills under torchrun.

    python benchmarks/faults.py [--ranks 4] [--kills 20] [--steps 30] [--rounds 2]
                                [--gap 0] [--torchrun-kills 4] [--elastic 0] [--quick]
                                [--k8s PODS [--evictions N]] [--churn KILLS [--every S]]

The GPT of ``benchmarks/step_time.py`` (d_model 256, 4 layers, 4 heads, vocab 2048, seq 64,
global batch 16, AdamW, clipping at 1.0) on ``--ranks`` local CPU processes, data parallel:

- **overhead**: the same steps with ``fault_tolerance=False``, ``True`` (a snapshot after every
  step) and ``True, snapshot_every=5``, ``--rounds`` rounds alternating them; medians of each
  call's time on the controller after two warm-up calls; ratios against off.
- **recovery**: one run with ``fault_tolerance=True`` and ``max_restarts=kills``; before each of
  ``--kills`` chosen steps a timer thread SIGKILLs a random worker at a random moment within
  one median step after the call starts (so the kill lands anywhere in the step, or just after
  it). Measured, each from the kill: when the controller saw the failure (its warning line),
  and when the interrupted call returned: the next committed step. The restarts say whether
  only the killed rank started again (it should) or every rank.
- **torchrun** (``--torchrun-kills N``, 0 to skip): ``torchrun --standalone --max-restarts N``
  with the same model under DDP (gloo), a ``torch.distributed.checkpoint`` save after every
  step and a load at start (what users do to survive restarts), with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (without it torch 2.13's restarts fail on a stale
  store address); a worker SIGKILLed at a random moment of a step; measured from the kill to
  the next step every rank completed after it (the steps the restart re-runs since the last
  checkpoint included), i.e. to the first step rank 0 logs with torchrun's restart count above
  0 (a step that was finishing as the kill landed does not count).

- **elastic** (``--elastic N``): ``shrinking``: N shrinks of a ``dp`` mesh under
  ``elastic=True``, from the kill to the interrupted call's return on the smaller mesh.
- **k8s** (``--k8s PODS``): the recovery's kills under ``launcher="k8s"`` on ``PODS`` pods,
  against the tests' loopback stand-in API server and kubelet (``tests/dist/_k8s_standin.py``:
  no cluster runs here; the pods are local processes, so this times meshplan's side only:
  the pod agents, the replacement rank's start, the restore); ``--evictions N``: N times a
  random pod is evicted before a step (its agent and snapshots go; the Job makes the pod
  again), timed from the eviction to the interrupted call's return.

Churn follows from the recovery's cost: a run that loses ``c`` seconds per kill (kill to the
next committed step, less one step) at one kill per ``T`` seconds of training keeps
``T / (T + c)`` of its throughput; the table prints it for a few rates. ``--churn KILLS
[--every S]`` measures it: one run with KILLS SIGKILLs at random moments (one per S seconds on
average, landing in steps and in recoveries alike), its throughput against the same steps
without a kill, and whether both end in the same state.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import torch

import meshplan
from meshplan.examples import gpt

CONFIG = gpt.GPTConfig(vocab_size=2048, seq_len=64, n_layer=4, n_head=4, d_model=256,
                       batch_size=16)


def _example():
    return gpt.build(optimizer="adamw", clip=1.0, config=CONFIG)


class _Seen(logging.Handler):
    """Times when the controller said it saw a failure (its warning line), and the parts of
    each recovery it timed (its INFO line)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.failures: list[float] = []
        self.lines: list[str] = []
        self.parts: list[dict[str, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "from its in-memory snapshots (restart" in text:
            self.failures.append(time.monotonic())
        if "recovered" in text:
            self.lines.append(text)
        if "the recovery's parts: " in text:
            body = text.split("the recovery's parts: ")[1].split(", then")[0]
            self.parts.append({name: float(ms) for name, ms in
                               (part.rsplit(" ", 2)[:2] for part in body.split(", "))})


_VARIANTS = {"off": {"fault_tolerance": False}, "every step": {"fault_tolerance": True},
             "every 5 steps": {"fault_tolerance": True, "snapshot_every": 5}}


def overhead(ranks: int, steps: int, rounds: int) -> dict[str, float]:
    """Median call time (ms) of each of ``_VARIANTS``."""
    times: dict[str, list[float]] = {k: [] for k in _VARIANTS}
    for _ in range(rounds):
        for name, options in _VARIANTS.items():
            ex = _example()
            with meshplan.distribute(ex.step, mesh={"dp": ranks}, strategy="dp",
                                     telemetry=False, **options) as step:
                for i in range(steps + 2):
                    t0 = time.perf_counter()
                    step(*ex.batch(i))
                    if i >= 2:
                        times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def recovery(ranks: int, kills: int, seed: int = 0, gap_s: float = 0.0,
             **launch: object) -> dict[str, object]:
    rng = random.Random(seed)
    seen = _Seen()
    logging.getLogger("meshplan").addHandler(seen)
    logging.getLogger("meshplan").setLevel(logging.INFO)
    ex = _example()
    step = meshplan.distribute(ex.step, mesh={"dp": ranks}, strategy="dp", telemetry=False,
                               fault_tolerance=True, max_restarts=kills + 1, **launch)
    detect, back, replaced = [], [], []
    try:
        with step:
            i, typical = _warm_up(step, ex)
            for k in range(kills):
                for _ in range(2):                   # a couple of clean steps between kills
                    step(*ex.batch(i))
                    i += 1
                time.sleep(gap_s)          # idle: time for the last recovery's new spare
                seen_s, back_s, i = _kill_in_a_step(step, ex, i, rng, typical, seen)
                detect.append(seen_s)
                back.append(back_s)
                replaced.append(len(step._ft.replaced))
                print(f"  kill {k + 1}/{kills}: seen after {detect[-1]:.2f} s, next committed "
                      f"step after {back[-1]:.2f} s ({replaced[-1]} rank"
                      f"{'s' * (replaced[-1] != 1)} started)", flush=True)
            restarts = step.restarts
    finally:
        logging.getLogger("meshplan").removeHandler(seen)
        logging.getLogger("meshplan").setLevel(logging.WARNING)
    return {"detect": detect, "back": back, "replaced": replaced, "restarts": restarts,
            "step_s": typical, "parts": seen.parts}


def churn(ranks: int, kills: int, every_s: float, seed: int = 0) -> dict[str, object]:
    """The issue's churn: one run with ``fault_tolerance=True`` in which a thread SIGKILLs a
    random worker ``kills`` times, at random moments (gaps uniform in 0.5-1.5 x ``every_s``,
    whether a step or a recovery is under way), and the same number of steps of the same run
    with no kill; throughput (steps per second of the loop) of each, and whether the two end
    in the same state (``torch.equal``: a lost or doubled step would show)."""
    rng = random.Random(seed)

    def run(with_kills: bool, steps: int | None) -> tuple[int, float, dict, int]:
        ex = _example()
        done = threading.Event()
        fired: list[float] = []
        with meshplan.distribute(ex.step, mesh={"dp": ranks}, strategy="dp", telemetry=False,
                                 fault_tolerance=True, max_restarts=4 * kills + 4) as step:
            i, _ = _warm_up(step, ex)

            def killer() -> None:
                while len(fired) < kills and not done.wait(rng.uniform(0.5, 1.5) * every_s):
                    try:
                        os.kill(rng.choice(step._workers.pids), signal.SIGKILL)
                        fired.append(time.monotonic())
                    except (ProcessLookupError, AttributeError, IndexError):
                        pass                 # between meshes: the next gap tries again
            thread = threading.Thread(target=killer, daemon=True)
            start = time.monotonic()
            if with_kills:
                thread.start()
            n = 0
            while (len(fired) < kills or n == 0) if steps is None else n < steps:
                step(*ex.batch(i))
                i, n = i + 1, n + 1
            if with_kills:                   # the last kill's recovery is in the time
                step(*ex.batch(i))
                i, n = i + 1, n + 1
            wall = time.monotonic() - start
            done.set()
            if with_kills:
                thread.join()
            return n, wall, step.state_dict(), step.restarts

    n, wall, state, restarts = run(True, None)
    print(f"  churn: {n} steps in {wall:.1f} s with {kills} kills ({restarts} restarts)",
          flush=True)
    _, clean, want, _ = run(False, n)
    print(f"  churn: the same {n} steps in {clean:.1f} s without a kill", flush=True)
    same = all(torch.equal(state["model"][k], v) for k, v in want["model"].items())
    return {"steps": n, "with": wall, "without": clean, "restarts": restarts, "same": same}


def shrinking(ranks: int, kills: int, seed: int = 0) -> dict[str, object]:
    """``elastic=True``: runs on ``ranks`` ranks, each killed one rank at a time (at a random
    moment of a step, as ``recovery``) until one rank is left, then a new run, until ``kills``
    shrinks were measured. Measured from the kill to the interrupted call's return on the
    smaller mesh (re-planned, the state moved through the controller, every rank started)."""
    rng = random.Random(seed)
    seen = _Seen()
    logging.getLogger("meshplan").addHandler(seen)
    logging.getLogger("meshplan").setLevel(logging.WARNING)
    back: list[float] = []
    meshes: list[tuple[int, int]] = []
    try:
        while len(back) < kills:
            ex = _example()
            with meshplan.distribute(ex.step, mesh={"dp": ranks}, strategy="dp",
                                     telemetry=False, fault_tolerance=True, elastic=True,
                                     max_restarts=ranks) as step:
                i, typical = _warm_up(step, ex)
                while step._workers.n > 1 and len(back) < kills:
                    before = step._workers.n
                    _, back_s, i = _kill_in_a_step(step, ex, i, rng, typical, seen)
                    back.append(back_s)
                    meshes.append((before, step._workers.n))
                    print(f"  shrink {len(back)}/{kills}: dp{before} -> dp{step._workers.n}, "
                          f"next committed step after {back_s:.2f} s", flush=True)
                    i, typical = _warm_up(step, ex, i)
    finally:
        logging.getLogger("meshplan").removeHandler(seen)
    return {"back": back, "meshes": meshes}


def evictions(ranks: int, pods: int, count: int, standin, seed: int = 0  # noqa: ANN001
              ) -> list[float]:
    """``count`` times, a random pod of the run evicted before a step (the stand-in's Job
    controller makes it again); seconds from the eviction to that call's return."""
    rng = random.Random(seed)
    ex = _example()
    back = []
    with meshplan.distribute(ex.step, mesh={"dp": ranks}, strategy="dp", telemetry=False,
                             fault_tolerance=True, max_restarts=count + 1, launcher="k8s",
                             k8s={"image": "bench:1", "pods": pods,
                                  "controller_host": "127.0.0.1"}) as step:
        i, _ = _warm_up(step, ex)
        for k in range(count):
            for _ in range(2):
                step(*ex.batch(i))
                i += 1
            pod = rng.choice(standin.live()["pods"])
            t0 = time.monotonic()
            standin.evict(pod)
            step(*ex.batch(i))
            i += 1
            back.append(time.monotonic() - t0)
            print(f"  eviction {k + 1}/{count}: {pod}, next committed step after "
                  f"{back[-1]:.2f} s", flush=True)
    return back


def _warm_up(step, ex, i: int = 0) -> tuple[int, float]:  # noqa: ANN001
    """A few calls; the index of the next batch and the median call's time."""
    durations = []
    for _ in range(5):
        t0 = time.perf_counter()
        step(*ex.batch(i))
        durations.append(time.perf_counter() - t0)
        i += 1
    return i, statistics.median(durations)


def _kill_in_a_step(step, ex, i: int, rng: random.Random, typical: float,  # noqa: ANN001
                    seen: _Seen) -> tuple[float, float, int]:
    """SIGKILL a random worker at a random moment within one typical step after a call starts;
    from the kill: when the controller saw it, when the next committed step returned."""
    pid = rng.choice(step._workers.pids)
    delay = rng.uniform(0.0, typical)
    killed: list[float] = []
    timer = threading.Timer(delay, lambda p=pid: (killed.append(time.monotonic()),
                                                  os.kill(p, signal.SIGKILL)))
    before = len(seen.failures)
    timer.start()
    step(*ex.batch(i))
    i += 1
    timer.join()
    if len(seen.failures) == before:     # the kill came after the step: the next call sees
        step(*ex.batch(i))               # it and recovers
        i += 1
    done = time.monotonic()
    return seen.failures[before] - killed[0], done - killed[0], i


_TORCHRUN_SCRIPT = textwrap.dedent('''
    import os, sys, time
    import torch, torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.nn.parallel import DistributedDataParallel as DDP
    from meshplan.examples import gpt
    import torch.nn.functional as F
    from torch import nn

    cfg = gpt.GPTConfig(**{cfg})
    out, ckpt, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(os.path.join(out, f"pid{{rank}}"), "w") as f:
        f.write(str(os.getpid()))
    ex = gpt.build(optimizer="adamw", clip=1.0, config=cfg)
    model = DDP(ex.model)
    opt = ex.opt
    start = 0
    if os.path.exists(os.path.join(ckpt, "step")):
        with open(os.path.join(ckpt, "step")) as f:
            start = int(f.read()) + 1
        sd = {{"model": model.state_dict(), "optim": opt.state_dict()}}
        dcp.load(sd, checkpoint_id=os.path.join(ckpt, "dcp"))
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
    for i in range(start, steps):
        x, y = ex.batch(i)
        n = x.shape[0] // world
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dcp.save({{"model": model.state_dict(), "optim": opt.state_dict()}},
                 checkpoint_id=os.path.join(ckpt, "dcp"))
        dist.barrier()
        if rank == 0:
            with open(os.path.join(ckpt, "step.tmp"), "w") as f:
                f.write(str(i))
            os.replace(os.path.join(ckpt, "step.tmp"), os.path.join(ckpt, "step"))
            with open(os.path.join(out, "steps"), "a") as f:
                f.write(f"{{i}} {{time.time()}} {{os.environ['TORCHELASTIC_RESTART_COUNT']}}\\n")
    dist.destroy_process_group()
''')


def torchrun(ranks: int, kills: int, seed: int = 0) -> dict[str, object]:
    """``kills`` runs of torchrun, one kill each (see the module docstring)."""
    rng = random.Random(seed)
    cfg = {k: getattr(CONFIG, k) for k in ("vocab_size", "seq_len", "n_layer", "n_head",
                                           "d_model", "batch_size")}
    back, recovered = [], 0
    for k in range(kills):
        with tempfile.TemporaryDirectory(prefix="meshplan-torchrun-") as tmp:
            script = os.path.join(tmp, "train.py")
            with open(script, "w") as f:
                f.write(_TORCHRUN_SCRIPT.format(cfg=json.dumps(cfg)))
            out, ckpt = os.path.join(tmp, "out"), os.path.join(tmp, "ckpt")
            os.makedirs(out)
            os.makedirs(ckpt)
            env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS=str(
                max(1, (os.cpu_count() or 1) // ranks)))
            steps = 20
            proc = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc-per-node={ranks}", "--max-restarts=3", script, out, ckpt,
                 str(steps)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                start_new_session=True)          # its workers die with it (killpg below)
            try:
                log = os.path.join(out, "steps")
                deadline = time.monotonic() + 240
                while time.monotonic() < deadline and _steps_done(log) < 5:
                    time.sleep(0.05)
                times = [t for _, t, _ in _rows(log)]
                typical = statistics.median(b - a for a, b in zip(times[1:-1], times[2:])) \
                    if len(times) > 3 else 0.2
                time.sleep(rng.uniform(0.0, typical))
                victim = rng.randrange(ranks)
                with open(os.path.join(out, f"pid{victim}")) as f:
                    pid = int(f.read())
                done_before = _steps_done(log)
                killed = time.time()
                os.kill(pid, signal.SIGKILL)
                while time.monotonic() < deadline:
                    after = [t for i, t, restart in _rows(log) if restart > 0]
                    if after:
                        back.append(after[0] - killed)
                        recovered += 1
                        break
                    if proc.poll() is not None:
                        break
                    time.sleep(0.05)
                ok = len(back) == recovered and recovered == k + 1
                print(f"  torchrun kill {k + 1}/{kills}: rank {victim} after {done_before} "
                      f"steps; " + (f"next step after {back[-1]:.2f} s" if ok else
                                    "not recovered (no step after the kill within 240 s "
                                    "of the run's start, or the run ended)"), flush=True)
                if ok:
                    proc.wait(240)
            except subprocess.TimeoutExpired:
                print(f"  torchrun kill {k + 1}/{kills}: the restarted run did not finish "
                      "within 240 s", flush=True)
            finally:
                try:        # the agent and every worker it started (not yet reaped: its
                    os.killpg(proc.pid, signal.SIGKILL)      # group id is still its own)
                except ProcessLookupError:
                    pass
                proc.wait()
    return {"back": back, "recovered": recovered, "kills": kills}


def _rows(path: str) -> list[tuple[int, float, int]]:
    """(step, wall time, torchrun's restart count) of every step rank 0 logged."""
    try:
        with open(path) as f:
            return [(int(a), float(b), int(c))
                    for a, b, c in (line.split() for line in f if line.strip())]
    except OSError:
        return []


def _steps_done(path: str) -> int:
    return len(_rows(path))


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--steps", type=int, default=30, help="overhead: steps per run")
    ap.add_argument("--rounds", type=int, default=2,
                    help="overhead: rounds of off/on (0: skip the overhead)")
    ap.add_argument("--gap", type=float, default=0.0,
                    help="recovery: seconds idle before each kill (0: kills 2 steps apart, "
                    "before the last recovery's new spare has started)")
    ap.add_argument("--torchrun-kills", type=int, default=4)
    ap.add_argument("--elastic", type=int, default=0,
                    help="also measure this many shrinks under elastic=True (0: skip)")
    ap.add_argument("--quick", action="store_true", help="2 ranks, 3 kills, 1 torchrun kill")
    ap.add_argument("--churn", type=int, default=0, metavar="KILLS",
                    help="churn: KILLS kills during one run, throughput against no kill")
    ap.add_argument("--every", type=float, default=10.0,
                    help="churn: seconds between kills on average")
    ap.add_argument("--k8s", type=int, default=0, metavar="PODS",
                    help="the kills under launcher='k8s' on PODS pods of the tests' stand-in "
                    "API server (no overhead, no torchrun)")
    ap.add_argument("--evictions", type=int, default=0,
                    help="with --k8s: also evict a random pod this many times")
    a = ap.parse_args(argv)
    if a.k8s:
        return _k8s(a)
    if a.quick:
        a.ranks, a.kills, a.steps, a.rounds, a.torchrun_kills = 2, 3, 10, 1, 1
    logging.basicConfig(level=logging.ERROR)
    for handler in logging.getLogger().handlers:    # meshplan's INFO lines go to _Seen only
        handler.setLevel(logging.WARNING)
    torch.manual_seed(0)
    print(f"# faults: GPT d_model {CONFIG.d_model}, {CONFIG.n_layer} layers, batch "
          f"{CONFIG.batch_size}, {a.ranks} ranks (dp), {os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    if a.rounds:
        ov = overhead(a.ranks, a.steps, a.rounds)
        print(f"overhead: step {ov['off']:.1f} ms without fault tolerance; with snapshots "
              + ", ".join(f"{k} {v:.1f} ms ({v / ov['off']:.3f}x)" for k, v in ov.items()
                          if k != "off"), flush=True)
    back: list[float] = []
    if a.kills:                # --kills 0: only the parts asked for (--elastic, torchrun)
        rec = recovery(a.ranks, a.kills, gap_s=a.gap)
        det, back = rec["detect"], rec["back"]
        one = sum(1 for r in rec["replaced"] if r == 1)
        print(f"meshplan: {len(back)} of {a.kills} kills recovered ({one} by starting the "
              f"killed rank alone); failure seen after p50 {_pct(det, .5):.2f} s / p99 "
              f"{_pct(det, .99):.2f} s; kill -> next committed step p50 {_pct(back, .5):.2f} s"
              f" / p99 {_pct(back, .99):.2f} s (a step takes {rec['step_s'] * 1e3:.0f} ms)",
              flush=True)
        names = list(dict.fromkeys(k for p in rec["parts"] for k in p))
        if names:
            print("  a replacement's parts, p50: " + ", ".join(
                f"{k} {statistics.median(p.get(k, 0.0) for p in rec['parts']):.0f} ms"
                for k in names), flush=True)
        lost = statistics.median(back) - rec["step_s"]
        rates = [60, 600, 3600]
        print("churn: throughput kept at one kill per " + ", ".join(
            f"{r} s: {r / (r + lost):.1%}" for r in rates) + f" (each kill costs {lost:.2f} s)")
    if a.churn:
        ch = churn(a.ranks, a.churn, a.every)
        print(f"churn measured: {a.churn} kills, one per {a.every:g} s on average, over "
              f"{ch['steps']} steps: {ch['without'] / ch['with']:.1%} of the fault-free "
              f"throughput ({ch['with']:.1f} s against {ch['without']:.1f} s); final state "
              f"{'torch.equal to' if ch['same'] else 'DIFFERENT from'} the fault-free run's",
              flush=True)
    if a.elastic:
        sh = shrinking(a.ranks, a.elastic)
        print(f"meshplan elastic: {len(sh['back'])} shrinks ("
              + ", ".join(f"dp{x}->dp{y}" for x, y in sorted(set(sh["meshes"])))
              + f"); kill -> next committed step p50 {_pct(sh['back'], .5):.2f} s / p99 "
              f"{_pct(sh['back'], .99):.2f} s", flush=True)
    if a.torchrun_kills:
        tr = torchrun(a.ranks, a.torchrun_kills)
        if tr["back"] and back:
            print(f"torchrun + DDP + DCP: {tr['recovered']} of {tr['kills']} kills recovered; "
                  f"kill -> next step p50 {_pct(tr['back'], .5):.2f} s (max "
                  f"{max(tr['back']):.2f} s); meshplan is "
                  f"{_pct(tr['back'], .5) / _pct(back, .5):.1f}x faster at p50", flush=True)
        elif tr["back"]:
            print(f"torchrun + DDP + DCP: {tr['recovered']} of {tr['kills']} kills recovered; "
                  f"kill -> next step p50 {_pct(tr['back'], .5):.2f} s", flush=True)
        else:
            print(f"torchrun + DDP + DCP: 0 of {tr['kills']} kills recovered", flush=True)
    return 0


def _k8s(a: argparse.Namespace) -> int:
    """``--k8s PODS``: the recovery's kills, then ``--evictions``, against the stand-in."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                    "dist"))
    from _k8s_standin import StandIn

    logging.basicConfig(level=logging.ERROR)
    for handler in logging.getLogger().handlers:    # meshplan's INFO lines go to _Seen only
        handler.setLevel(logging.WARNING)
    torch.manual_seed(0)
    print(f"# faults under k8s (stand-in): GPT d_model {CONFIG.d_model}, {a.ranks} ranks (dp) "
          f"on {a.k8s} pods, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
          flush=True)
    with StandIn() as standin:
        os.environ["KUBECONFIG"] = standin.kubeconfig
        if a.kills:
            rec = recovery(a.ranks, a.kills, gap_s=a.gap, launcher="k8s",
                           k8s={"image": "bench:1", "pods": a.k8s,
                                "controller_host": "127.0.0.1"})
            det, back = rec["detect"], rec["back"]
            one = sum(1 for r in rec["replaced"] if r == 1)
            print(f"meshplan k8s: {len(back)} of {a.kills} kills recovered ({one} by starting "
                  f"the killed rank alone in its pod); failure seen after p50 "
                  f"{_pct(det, .5):.2f} s / p99 {_pct(det, .99):.2f} s; kill -> next "
                  f"committed step p50 {_pct(back, .5):.2f} s / p99 {_pct(back, .99):.2f} s "
                  f"(a step takes {rec['step_s'] * 1e3:.0f} ms)", flush=True)
        if a.evictions:
            back = evictions(a.ranks, a.k8s, a.evictions, standin)
            print(f"meshplan k8s: {len(back)} of {a.evictions} evicted pods replaced; eviction "
                  f"-> next committed step p50 {_pct(back, .5):.2f} s / p99 "
                  f"{_pct(back, .99):.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
