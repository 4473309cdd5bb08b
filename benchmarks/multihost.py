"""Several hosts (issue 21, point 5): the benchmark GPT on 2 hosts x 2 ranks against 1 host x 4
ranks, and the control channel's round trip with and without encryption.

    python benchmarks/multihost.py [--steps 6] [--rates none 1gbit] [--strategies dp fsdp]
                                   [--skip-steps] [--skip-channel]

Needs root (``meshplan sandbox``: the hosts are Linux namespaces on this machine, so every
variant shares the same CPU cores, and only the path between ranks differs: MPICH's shared
memory inside a host, TCP over a veth pair and a bridge between hosts).

1. **Step time.** The benchmark GPT of ``benchmarks/step_time.py`` (d_model 256, 4 layers,
   vocab 2048, seq 64, global batch 16, AdamW, clipping) under ``launcher="mpi"`` with the
   controller on the sandbox's controller host: ``{"dp": 4}`` on ``h0:4`` (one host) and on
   ``h0:2,h1:2`` (two hosts), per strategy, the median of ``--steps`` calls after two warm-up
   calls, as the controller sees each (split, send, every rank's step, gather). ``--rates``:
   the link between hosts as it is (``none``: a veth, many Gbit/s) and shaped with ``tc``
   (a token bucket of that rate on both ends of every host's link).
2. **Control channel.** One message from the controller to a worker thread and back, through
   ``ControllerChannel`` / ``WorkerChannel``: on a local ``ipc://`` socket (one host), on TCP
   with CURVE (another host: encrypted and authenticated), and a bare ZeroMQ TCP pair without
   CURVE and without the channel's signature (what encryption and signing cost), on loopback,
   for a 0-byte header, 1 MiB and 64 MiB; median of 20 (5 for 64 MiB).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch
import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def job(hosts: str, strategy: str, steps: int, out: str) -> None:
    """Run inside the sandbox, as the controller: median step time, to ``out`` as JSON."""
    import meshplan
    from calibration import CONFIG, _batches
    from meshplan.examples import gpt

    ex = gpt.build(config=CONFIG, optimizer="adamw", clip=1.0, seed=0)
    batches = _batches(steps + 2)
    step = meshplan.distribute(ex.step, mesh={"dp": 4}, launcher="mpi", strategy=strategy,
                               hosts=hosts, telemetry=False, timeout_s=300)
    times = []
    with step:
        for i, b in enumerate(batches):
            t0 = time.perf_counter()
            step(*b)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        hostnames = list(step._workers.hostnames)
    with open(out, "w") as f:
        json.dump({"median_s": statistics.median(times), "times": times, "hosts": hostnames}, f)


def _shape(box, rate: str | None) -> None:
    """A token bucket of ``rate`` on both ends of every host's link (None: remove it)."""
    for i, h in enumerate([box.ctl, *box.hosts]):
        for pid, dev in ((h.pid, "eth0"), (box.switch_pid, f"mp{i}")):
            base = ["nsenter", "--target", str(pid), "--net", "--", "tc", "qdisc"]
            subprocess.run([*base, "del", "dev", dev, "root"], capture_output=True)
            if rate is not None:
                subprocess.run([*base, "add", "dev", dev, "root", "tbf", "rate", rate,
                                "burst", "256kb", "latency", "50ms"], check=True)


def steps_table(strategies: list[str], rates: list[str], steps: int) -> list[dict]:
    from meshplan.runtime._sandbox import Sandbox

    box = Sandbox.up(2, "mpbench", owner=os.getpid())
    rows = []
    try:
        h0, h1 = (h.name for h in box.hosts)
        work = tempfile.mkdtemp(prefix="meshplan-bench-", dir="/var/tmp")
        for rate in rates:
            _shape(box, None if rate == "none" else rate)
            for strategy in strategies:
                for label, hosts in (("1 host x 4", f"{h0}:4"), ("2 hosts x 2", f"{h0}:2,{h1}:2")):
                    out = os.path.join(work, "r.json")
                    done = box.run([sys.executable, os.path.abspath(__file__), "--job", hosts,
                                    strategy, str(steps), out], capture_output=True, text=True,
                                   timeout=900)
                    if done.returncode:
                        raise SystemExit(f"job failed ({label}, {strategy}, {rate}):\n"
                                         f"{done.stderr[-3000:]}")
                    with open(out) as f:
                        r = json.load(f)
                    rows.append({"rate": rate, "strategy": strategy, "layout": label,
                                 "ms": r["median_s"] * 1e3, "hosts": r["hosts"]})
                    print(f"  {rate:>6} {strategy:<5} {label:<12} {r['median_s'] * 1e3:8.1f} ms "
                          f"({', '.join(sorted(set(r['hosts'])))})", flush=True)
    finally:
        box.down()
    return rows


def _echo(worker, n: int) -> None:
    for _ in range(n):
        m = worker.recv(60)
        worker.send("echo", m.header, m.tensors)


def channel_table(sizes: tuple[int, ...] = (0, 1 << 20, 64 << 20)) -> list[dict]:
    from meshplan.runtime import ControllerChannel, Secret, WorkerChannel

    rows = []
    for size in sizes:
        reps = 5 if size >= 64 << 20 else 20
        t = torch.ones(size // 4) if size else None
        tensors = [t] if t is not None else []
        for name, transport in (("ipc (one host)", "ipc"), ("tcp + CURVE", "tcp")):
            secret = Secret.new()
            ctrl = ControllerChannel(secret, "bench", transport=transport)
            worker = WorkerChannel(ctrl.address, secret, "bench", rank=0)
            worker.send("hello")                 # the controller learns the rank's identity
            ctrl.recv(30)
            th = threading.Thread(target=_echo, args=(worker, reps + 1), daemon=True)
            th.start()
            times = []
            for i in range(reps + 1):
                t0 = time.perf_counter()
                ctrl.send(0, "ping", {"i": i}, tensors)
                ctrl.recv(60)
                if i:
                    times.append(time.perf_counter() - t0)
            th.join()
            worker.close()
            ctrl.close()
            rows.append({"transport": name, "bytes": size, "us": statistics.median(times) * 1e6})
        rows.append({"transport": "bare tcp (no CURVE, no signature)", "bytes": size,
                     "us": _bare_tcp(size, reps) * 1e6})
    return rows


def _bare_tcp(size: int, reps: int) -> float:
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    payload = bytes(size) if size else b""

    def echo() -> None:
        for _ in range(reps + 1):
            dealer.send_multipart(dealer.recv_multipart(copy=False), copy=False)

    th = threading.Thread(target=echo, daemon=True)
    dealer.send(b"hi")
    ident, _ = router.recv_multipart()
    th.start()
    times = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        router.send_multipart([ident, b"h", payload], copy=False)
        router.recv_multipart(copy=False)
        if i:
            times.append(time.perf_counter() - t0)
    th.join()
    router.close(0)
    dealer.close(0)
    ctx.term()
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", nargs=4, metavar=("HOSTS", "STRATEGY", "STEPS", "OUT"),
                   help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rates", nargs="+", default=["none", "1gbit"])
    p.add_argument("--strategies", nargs="+", default=["dp", "fsdp"])
    p.add_argument("--skip-steps", action="store_true")
    p.add_argument("--skip-channel", action="store_true")
    args = p.parse_args()
    if args.job:
        hosts, strategy, steps, out = args.job
        return job(hosts, strategy, int(steps), out)
    if not args.skip_channel:
        print("control channel round trip (median):")
        for r in channel_table():
            print(f"  {r['transport']:<36} {r['bytes']:>10} B {r['us']:>12.1f} us", flush=True)
    if not args.skip_steps:
        print(f"GPT step, mesh {{'dp': 4}}, launcher mpi, median of {args.steps}:")
        steps_table(args.strategies, args.rates, args.steps)


if __name__ == "__main__":
    main()
