"""Probe: meshplan's ``TorchCommunicator`` on NCCL, 2 processes, as many GPUs as there are
(rank r on ``cuda:r % device_count``). On a one-GPU machine both ranks share the GPU, which NCCL
may refuse ("duplicate GPU"); the probe records what happens rather than asserting. Prints one
JSON line per rank: the collectives that ran, whether their results were right, or the error.

    python tests/gpu/nccl_probe.py [--timeout 60]
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import traceback

import torch
import torch.multiprocessing as mp


def _rank(rank: int, port: int, timeout: float, out: "mp.Queue") -> None:
    report: dict = {"rank": rank, "devices": torch.cuda.device_count()}
    try:
        from meshplan.backends import TorchCommunicator

        comm = TorchCommunicator(rank, 2, [(0, 1)], backend="nccl", timeout_s=timeout,
                                 init_method=f"tcp://127.0.0.1:{port}")
        dev = comm.device
        report["device"] = str(dev)
        g = (0, 1)
        x = torch.arange(8, dtype=torch.float32, device=dev) + 10 * rank
        checks = {
            "all_reduce": (comm.all_reduce(x, g, "sum"),
                           torch.arange(8.0, device=dev) * 2 + 10),
            "all_gather": (comm.all_gather(x.view(2, 4), g, 0),
                           torch.cat([torch.arange(8.0, device=dev).view(2, 4),
                                      torch.arange(8.0, device=dev).view(2, 4) + 10])),
            "reduce_scatter": (comm.reduce_scatter(x, g, 0, "sum"),
                               (torch.arange(8.0, device=dev) * 2 + 10).chunk(2)[rank]),
            "broadcast": (comm.broadcast(x, 0, g), torch.arange(8.0, device=dev)),
        }
        report["ok"] = {k: bool(torch.equal(a, b)) for k, (a, b) in checks.items()}
        report["records"] = [(r.kind.value, r.nbytes) for r in comm.records]
        comm.close()
    except Exception as exc:  # noqa: BLE001 - the probe reports, never raises
        report["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        report["traceback"] = traceback.format_exc()[-3000:]
    out.put(report)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, args.timeout, out)) for r in range(2)]
    for p in procs:
        p.start()
    reports = []
    for _ in procs:
        try:
            reports.append(out.get(timeout=args.timeout + 30))
        except Exception:  # noqa: BLE001
            reports.append({"error": "no report (rank hung or died)"})
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
    for r in reports:
        tb = r.pop("traceback", None)
        print(json.dumps(r))
        if tb:
            print(tb, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
