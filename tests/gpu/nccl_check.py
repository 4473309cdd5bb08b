"""meshplan's ``TorchCommunicator`` on NCCL, 2 processes, as many GPUs as there are (rank r on
``cuda:r % device_count``): all-reduce, all-gather, reduce-scatter and broadcast, each result
compared exactly with the value it must have (small integers in fp32: exact on any order).

    python tests/gpu/nccl_check.py [--timeout 60] [--record-only]

Prints one JSON line per rank: the collectives that ran, whether their results were right, or
the error. As a check (the default) it exits 1 when there is no CUDA device, when a rank
reports an error or a wrong result, or when a rank sends no report (hung or died), naming the
ranks and collectives on stderr; 0 only when both ranks ran every collective right.

``--record-only`` makes it a probe: it prints the same lines under a ``RECORD ONLY`` header and
exits 0 whatever NCCL did (it still exits non-zero if this script itself breaks). That is for a
machine with one GPU, where both ranks share it and NCCL refuses two ranks on one device
("Duplicate GPU detected", NCCL 2.28.9): there the run shows how meshplan reports the refusal,
and is not a check of the collectives. ``tests/gpu/device_check.sh`` runs it as a check with two
GPUs or more and as a record-only probe, apart from the checks, with one.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import traceback

import torch
import torch.multiprocessing as mp

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


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
    except Exception as exc:  # noqa: BLE001 - sent to the parent, which decides the exit status
        report["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        report["traceback"] = traceback.format_exc()[-3000:]
    out.put(report)


def failures(reports: list[dict]) -> list[str]:
    """What went wrong, one line per problem: a rank's error, a collective whose result was
    wrong or that did not run, a missing report. Empty when both ranks ran every collective
    right."""
    bad = []
    for i, r in enumerate(reports):
        who = f"rank {r.get('rank', i)}"
        if "error" in r:
            bad.append(f"{who}: {r['error'].splitlines()[0][:300]}")
            continue
        ok = r.get("ok", {})
        bad += [f"{who}: {k} {'gave a wrong result' if k in ok else 'did not run'}"
                for k in COLLECTIVES if not ok.get(k)]
    return bad


def _run(timeout: float) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, timeout, out)) for r in range(2)]
    for p in procs:
        p.start()
    reports = []
    for _ in procs:
        try:
            reports.append(out.get(timeout=timeout + 30))
        except Exception:  # noqa: BLE001 - queue.Empty: recorded as a missing report
            reports.append({"error": "no report (rank hung or died)"})
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
    return sorted(reports, key=lambda r: r.get("rank", 99))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--record-only", action="store_true",
                    help="a probe: print what happened and exit 0 whatever NCCL did")
    args = ap.parse_args()
    if args.record_only:
        print(f"RECORD ONLY (not a check): {torch.cuda.device_count()} CUDA device(s)")
    if not torch.cuda.is_available():
        reports = [{"error": "no CUDA device: torch.cuda.is_available() is false"}]
    else:
        reports = _run(args.timeout)
    for r in reports:
        tb = r.pop("traceback", None)
        print(json.dumps(r))
        if tb:
            print(tb, file=sys.stderr)
    bad = failures(reports)
    if args.record_only:
        print(f"recorded: {len(bad)} problem(s); not a check, exit 0")
        return 0
    for line in bad:
        print(f"FAILED nccl: {line}", file=sys.stderr)
    print(f"nccl check: {'FAILED' if bad else 'passed'}"
          f"{f' ({len(bad)} problem(s))' if bad else ''}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
