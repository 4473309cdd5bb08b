"""Several hosts (issue 21, point 5): the benchmark GPT on 2 hosts x 2 ranks against 1 host x 4
ranks, and the control channel's round trip with and without encryption.

    python benchmarks/multihost.py [--steps 6] [--rates none 1gbit] [--strategies dp fsdp]
                                   [--skip-steps] [--skip-channel] [--slurm]

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
3. **Slurm** (``--slurm``; needs Slurm's daemons, ``meshplan sandbox up --slurm``): the same
   GPT, ``{"dp": 4}`` on 2 nodes x 2 ranks, started from the controller's host by
   ``launcher="slurm"`` in a new allocation (``slurm={"nodes": 2}``: salloc, then srun), by
   ``launcher="slurm"`` inside ``salloc -N2 -n4``, and by ``launcher="mpi"`` with the two
   hosts, against what people run under Slurm today: ``srun -N2 -n4 python`` of a script
   with torch's ``DistributedDataParallel`` on gloo (the same model, optimizer and batches,
   each rank its quarter of the batch). For each, the wall time of the whole command
   (start-up, ``--steps`` + 2 steps, shutdown: a new Python, torch's import, tracing and
   planning for meshplan, the allocation) and the median step after two warm-up steps.
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
    """Run inside the sandbox, as the controller: median step time, to ``out`` as JSON.
    ``hosts``: mpiexec's host list, or ``slurm``: ``launcher="slurm"`` on 2 nodes."""
    import meshplan
    from calibration import CONFIG, _batches
    from meshplan.examples import gpt

    ex = gpt.build(config=CONFIG, optimizer="adamw", clip=1.0, seed=0)
    batches = _batches(steps + 2)
    where = ({"launcher": "slurm", "slurm": {"nodes": 2}} if hosts == "slurm"
             else {"launcher": "mpi", "hosts": hosts})
    step = meshplan.distribute(ex.step, mesh={"dp": 4}, strategy=strategy, telemetry=False,
                               timeout_s=300, fault_tolerance=False, **where)
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


def ddp_job(steps: int, out: str) -> None:
    """One rank of the baseline under ``srun``: torch DDP on gloo, the same GPT, optimizer,
    clipping and batches as ``job`` (each rank its quarter); rank 0 writes the median step."""
    import subprocess as sp

    import torch.distributed as dist
    import torch.nn.functional as F
    from calibration import CONFIG, _batches
    from torch.nn.parallel import DistributedDataParallel as DDP

    from meshplan.examples import gpt

    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    first = sp.check_output(["scontrol", "show", "hostnames",
                             os.environ["SLURM_JOB_NODELIST"]], text=True).split()[0]
    dist.init_process_group("gloo", init_method=f"tcp://{first}:29517", rank=rank,
                            world_size=world)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    ex = gpt.build(config=CONFIG, optimizer="adamw", clip=1.0, seed=0)
    model = DDP(ex.model)
    times = []
    for i, (x, y) in enumerate(_batches(steps + 2)):
        t0 = time.perf_counter()
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        ex.opt.step()
        ex.opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        dist.all_reduce(loss)        # the loss every rank's step ends with, as meshplan's does
        if i >= 2:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"median_s": statistics.median(times)}, f)
    dist.barrier()
    del model                 # before the group it uses: the other order hangs its teardown
    dist.destroy_process_group()


def slurm_table(steps: int) -> list[dict]:
    from meshplan.runtime._sandbox import Sandbox

    box = Sandbox.up(2, "mpbench", owner=os.getpid(), slurm=True, cpus=2)
    me, rows = os.path.abspath(__file__), []
    try:
        h0, h1 = (h.name for h in box.hosts)
        work = tempfile.mkdtemp(prefix="meshplan-bench-", dir="/var/tmp")
        out = os.path.join(work, "r.json")
        variants = [
            ("meshplan, launcher=slurm, new allocation",
             [sys.executable, me, "--job", "slurm", "dp", str(steps), out]),
            ("meshplan, launcher=slurm, inside salloc",
             ["salloc", "-N2", "-n4", sys.executable, me, "--job", "slurm", "dp", str(steps),
              out]),
            ("meshplan, launcher=mpi, 2 hosts",
             [sys.executable, me, "--job", f"{h0}:2,{h1}:2", "dp", str(steps), out]),
            ("torch DDP (gloo) under srun -N2 -n4",
             ["srun", "-N2", "-n4", "--mpi=none", "--export=ALL,OMP_NUM_THREADS=1",
              sys.executable, me, "--ddp-job", str(steps), out]),
        ]
        for label, cmd in variants:
            t0 = time.perf_counter()
            done = box.run(cmd, capture_output=True, text=True, timeout=900)
            wall = time.perf_counter() - t0
            if done.returncode:
                raise SystemExit(f"{label} failed:\n{done.stderr[-3000:]}")
            with open(out) as f:
                r = json.load(f)
            os.unlink(out)
            rows.append({"variant": label, "wall_s": wall, "step_ms": r["median_s"] * 1e3})
            print(f"  {label:<42} wall {wall:6.1f} s   step {r['median_s'] * 1e3:7.1f} ms",
                  flush=True)
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
    p.add_argument("--slurm", action="store_true", help="also the Slurm table (section 3)")
    p.add_argument("--ddp-job", nargs=2, metavar=("STEPS", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.job:
        hosts, strategy, steps, out = args.job
        return job(hosts, strategy, int(steps), out)
    if args.ddp_job:
        return ddp_job(int(args.ddp_job[0]), args.ddp_job[1])
    if not args.skip_channel:
        print("control channel round trip (median):")
        for r in channel_table():
            print(f"  {r['transport']:<36} {r['bytes']:>10} B {r['us']:>12.1f} us", flush=True)
    if not args.skip_steps:
        print(f"GPT step, mesh {{'dp': 4}}, launcher mpi, median of {args.steps}:")
        steps_table(args.strategies, args.rates, args.steps)
    if args.slurm:
        print(f"GPT on 2 Slurm nodes x 2 ranks, dp, {args.steps} + 2 steps:")
        slurm_table(args.steps)


if __name__ == "__main__":
    main()
