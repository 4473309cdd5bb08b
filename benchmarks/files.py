"""File distribution benchmark (issue 7): the pipelined chain of ``meshplan files push`` next to
a naive star and one local ``cp``, all in one invocation.

    python benchmarks/files.py [--size 1GiB] [--ranks 2 4 8] [--dir /tmp] [--chunk 4MiB]
                               [--link-rate RATE] [--only chain,star-seq,star-pull,cp]

One file of ``--size`` random bytes goes to N ranks, each into its own folder (all on this
machine's one disk). Every variant ends with the data fsynced, as ``push_files`` does:

- ``chain``: ``push_files`` on N local workers (controller -> 0 -> 1 -> ... -> N-1, over TCP);
  the workers are launched before the clock starts. ``push`` is its whole call (scan and hash
  of SRC included), ``xfer`` the transfer after the prepare round;
- ``star-seq``: the controller sends to each rank in turn (``push_files`` to one rank, N times);
- ``star-pull``: every rank copies SRC itself at the same time (read, write, fsync in 4 MiB
  blocks; a worker plugin in this file), as on a shared filesystem;
- ``cp``: one ``cp SRC DST && sync DST`` on the controller: what this disk allows for one copy.

SRC is fsynced after it is written and one untimed 1-rank push warms caches and imports first.

Ratios are time to N ranks / time to 1 rank of the same variant. The goal for ``chain`` is
<= 1.15 for every N; on one machine every rank's copy lands on the same disk and CPUs, so the
bound here is N copies' worth of disk writes, not one (see the README's section).

``--link-rate RATE`` (e.g. ``50MB``) emulates a cluster's hosts on this one machine: every
sender's link is held to RATE bytes/s (``push_files(bwlimit=)``: the controller's and each
forwarding rank's), as each host's NIC would hold it, and RATE is chosen low enough that the
shared CPUs and disk are not the bound. The chain then shows what it does across hosts: every
link carries the data once, so time to N stays near time to 1. ``star-seq`` is paced the same
(the controller's one link carries N copies); ``star-pull`` is left out (it models a shared
filesystem, not links).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

_PLUGIN = "meshplan.benchmarks.files"      # this file, as a worker plugin (star-pull)
_BLOCK = 4 << 20


def _copy(src: str, dst: str) -> None:
    """Read, write and fsync ``src`` to ``dst`` in blocks (one rank of star-pull)."""
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    buf = memoryview(bytearray(_BLOCK))
    with open(src, "rb", buffering=0) as fin, open(dst, "wb", buffering=0) as fout:
        while n := fin.readinto(buf):
            fout.write(buf[:n])
        os.fsync(fout.fileno())


def _install_handler() -> None:
    from meshplan.runtime._worker import register

    @register("bench.copy")
    def _bench_copy(state: Any, header: dict[str, Any], tensors: list) -> tuple[dict, list]:
        t = time.perf_counter()
        _copy(header["src"], header["dst"].format(rank=state.rank))
        return {"seconds": time.perf_counter() - t}, []


def _make_source(path: str, size: int) -> None:
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 64 << 20)
            f.write(os.urandom(n))
            left -= n
        os.fsync(f.fileno())          # no writeback of SRC during the first measurement


def _launch(n: int) -> Any:
    from meshplan.runtime import FILES_PLUGIN, LocalLauncher

    return LocalLauncher().launch(n, env={"MESHPLAN_WORKER_PLUGINS": f"{FILES_PLUGIN},{_PLUGIN}"})


def _chain(workers: Any, src: str, out: str, chunk: int,
           rate: float | None) -> tuple[float, float]:
    from meshplan.runtime import push_files

    result = push_files(src, os.path.join(out, "r{rank}"), workers=workers, chunk_bytes=chunk,
                        bwlimit=rate)
    assert result.bytes_sent == os.path.getsize(src)
    return result.seconds, result.transfer_seconds


def _star_pull(workers: Any, src: str, out: str) -> float:
    t = time.perf_counter()
    workers.broadcast("bench.copy", {"src": src, "dst": os.path.join(out, "r{rank}", "data")})
    workers.gather("bench.copy")
    return time.perf_counter() - t


def _star_seq(one: Any, n: int, src: str, out: str, chunk: int, rate: float | None) -> float:
    t = time.perf_counter()
    for r in range(n):
        _chain(one, src, os.path.join(out, f"seq{r}"), chunk, rate)
    return time.perf_counter() - t


def _cp(src: str, out: str) -> float:
    dst = os.path.join(out, "cp.data")
    t = time.perf_counter()
    subprocess.run(["cp", src, dst], check=True)
    subprocess.run(["sync", dst], check=True)
    return time.perf_counter() - t


VARIANTS = ("chain", "star-pull", "star-seq", "cp")


def run(size: int, ranks: list[int], base: str, chunk: int, rate: float | None = None,
        only: tuple[str, ...] = VARIANTS) -> list[dict[str, Any]]:
    work = tempfile.mkdtemp(prefix="meshplan-files-bench-", dir=base)
    src = os.path.join(work, "src", "data")
    os.makedirs(os.path.dirname(src))
    rows = []
    try:
        _make_source(src, size)
        with _launch(1) as one:
            out = os.path.join(work, "out")
            _chain(one, src, os.path.join(work, "warmup"), chunk, None)   # untimed: caches, imports
            shutil.rmtree(os.path.join(work, "warmup"))
            for n in [1, *ranks]:
                workers = one if n == 1 else _launch(n)
                row: dict[str, Any] = {"n": n}
                for name, fn in [("chain", lambda: _chain(workers, src, out, chunk, rate)),
                                 ("star-pull", lambda: _star_pull(workers, src, out)),
                                 ("star-seq", lambda: _star_seq(one, n, src, out, chunk, rate)),
                                 ("cp", lambda: _cp(src, out))]:
                    if (name not in only or (name == "cp" and n != 1)
                            or (name == "star-pull" and rate)):
                        continue
                    shutil.rmtree(out, ignore_errors=True)
                    os.makedirs(out)
                    got = fn()
                    if name == "chain":
                        row["chain"], row["chain-xfer"] = got
                    else:
                        row[name] = got
                    print(f"  n={n} {name}: {row[name]:.2f} s", file=sys.stderr, flush=True)
                shutil.rmtree(out, ignore_errors=True)
                if workers is not one:
                    workers.shutdown()
                rows.append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def markdown(rows: list[dict[str, Any]], size: int, rate: float | None = None) -> str:
    one = rows[0]
    cols = [("chain push s", lambda r: f"{r['chain']:.2f}"),
            ("chain xfer s", lambda r: f"{r['chain-xfer']:.2f}"),
            ("chain ratio", lambda r: f"{r['chain'] / one['chain']:.2f}")]
    for name in ("star-seq", "star-pull"):
        if name in one:
            cols += [(f"{name} s", lambda r, k=name: f"{r[k]:.2f}"),
                     (f"{name} ratio", lambda r, k=name: f"{r[k] / one[k]:.2f}")]
    if "cp" in one:
        cols.append(("cp + sync s (1 copy)", lambda r: f"{one['cp']:.2f}"))
    lines = ["| ranks | " + " | ".join(c for c, _ in cols) + " |",
             "|---:|" + "---:|" * len(cols)]
    lines += ["| " + " | ".join([str(r["n"])] + [f(r) for _, f in cols]) + " |" for r in rows]
    goal = all(r["chain"] / one["chain"] <= 1.15 for r in rows)
    lines.append("")
    links = f"; every link held to {rate / 1e6:.0f} MB/s" if rate else ""
    lines.append(f"{size / 2**30:.2f} GiB{links}; chain goal (<= 1.15 x the 1-rank time for "
                 f"every N): {'met' if goal else 'not met'}")
    return "\n".join(lines)


def main() -> None:
    from meshplan._cli_run import parse_size

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1GiB", help="file size (default 1GiB)")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where to write (needs "
                   "(max ranks + 2) x size free)")
    p.add_argument("--chunk", default="4MiB", help="chain chunk size")
    p.add_argument("--link-rate", default=None, help="emulate one link per host: hold every "
                   "sender to this many bytes/s, e.g. 50MB (default: no limit)")
    p.add_argument("--only", default=",".join(VARIANTS),
                   help=f"comma-separated variants to run (default: all of {','.join(VARIANTS)}; "
                   "chain always runs)")
    args = p.parse_args()
    only = tuple({"chain", *args.only.split(",")})
    if set(only) - set(VARIANTS):
        sys.exit(f"--only: unknown variant(s) {sorted(set(only) - set(VARIANTS))}; "
                 f"choose from {', '.join(VARIANTS)}")
    size, chunk = parse_size(args.size), parse_size(args.chunk)
    rate = parse_size(args.link_rate) if args.link_rate else None
    need = (max(args.ranks) + 2) * size
    free = shutil.disk_usage(args.dir).free
    if free < need:
        sys.exit(f"{args.dir} has {free / 2**30:.1f} GiB free; this run needs {need / 2**30:.1f}")
    print(f"{len(os.sched_getaffinity(0))} cores; {args.size} to {args.ranks} ranks in "
          f"{args.dir}" + (f"; links held to {args.link_rate}/s" if rate else ""),
          file=sys.stderr)
    print(markdown(run(size, sorted(args.ranks), args.dir, chunk, rate, only), size, rate))


if __name__ == "__main__":
    main()
elif __name__ == _PLUGIN and "meshplan.runtime._worker" in sys.modules:
    _install_handler()          # loaded into a meshplan worker through its plugin list
