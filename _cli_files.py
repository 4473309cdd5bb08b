"""``meshplan files push``: ship a file tree (plans, code, checkpoints) to every rank.

    meshplan files push SRC --dest PATH_TEMPLATE --ranks N [--launcher local|mpi|slurm]
                        [--bwlimit RATE] [--json]

``PATH_TEMPLATE`` may use ``{rank}`` and ``{host}``. The design (pipelined chain broadcast,
checksums, resume) is in ``meshplan/runtime/_files.py``. Every failure is one line on stderr and
exit status 1; ``--debug`` also prints the traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ._cli_run import _guarded, parse_size
from ._errors import MeshplanError, RuntimeFailure


def add_files_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``files push``."""
    files = sub.add_parser("files", help="distribute files to the ranks")
    files_sub = files.add_subparsers(dest="files_command", required=True)
    p = files_sub.add_parser("push", help="copy SRC to PATH_TEMPLATE on every rank (chain "
                             "broadcast; unchanged files are skipped, interrupted pushes resume)")
    p.add_argument("src", metavar="SRC", help="the folder (or file) to ship")
    p.add_argument("--dest", required=True, metavar="PATH_TEMPLATE",
                   help="destination on each rank; may use {rank} and {host}")
    p.add_argument("--ranks", type=int, required=True, help="how many ranks to push to")
    p.add_argument("--launcher", default="local", help="local (default), mpi (mpiexec) or "
                   "slurm (srun: one rank on each of N nodes)")
    p.add_argument("--chunk-size", default="4MiB", help="transfer chunk, e.g. 4MiB (default)")
    p.add_argument("--bwlimit", default=None, metavar="RATE",
                   help="bytes per second each sender may use, e.g. 100MB (default: no limit)")
    p.add_argument("--timeout", type=float, default=None, help="seconds before giving up")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    p.set_defaults(func=_guarded(cmd_files_push))


def cmd_files_push(args: argparse.Namespace) -> int:
    from .runtime._files import check_template, push_files

    if args.launcher not in ("local", "mpi", "slurm"):
        raise RuntimeFailure(f"unknown --launcher {args.launcher!r}; use local, mpi or slurm")
    if args.ranks < 1:
        raise RuntimeFailure(f"--ranks {args.ranks}: push to at least one rank")
    check_template(args.dest)
    try:
        chunk = parse_size(args.chunk_size)
    except MeshplanError:
        raise RuntimeFailure(f"--chunk-size {args.chunk_size!r}: expected a size such as "
                             "4MiB") from None
    rate = None
    if args.bwlimit is not None:
        try:
            rate = parse_size(args.bwlimit)
        except MeshplanError:
            rate = 0
        if rate <= 0:
            raise RuntimeFailure(f"--bwlimit {args.bwlimit!r}: expected bytes per second "
                                 "such as 100MB or 1GiB")
    opts = dict(ranks=args.ranks, chunk_bytes=chunk, timeout_s=args.timeout,
                launcher=args.launcher, bwlimit=rate)
    if args.json or not sys.stderr.isatty():
        result = push_files(args.src, args.dest, **opts)
    else:
        result = _with_progress(args, opts)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
        return 0
    from rich.console import Console

    mib = 1 << 20
    Console(highlight=False, soft_wrap=True).print(
        f"pushed {result.files} files ({result.bytes / mib:.1f} MiB) to {args.ranks} ranks in "
        f"{result.seconds:.1f} s: sent {result.files_sent} files "
        f"({result.bytes_sent / mib:.1f} MiB), skipped {result.files_skipped} unchanged "
        f"({result.bytes_skipped / mib:.1f} MiB)")
    return 0


def _with_progress(args: argparse.Namespace, opts: dict[str, Any]) -> Any:
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    from .runtime._files import push_files

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), transient=True) as bar:
        task = bar.add_task(f"push to {args.ranks} ranks", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        return push_files(args.src, args.dest, progress=progress, **opts)
