"""File distribution benchmark (issue 7): the pipelined chain of ``meshplan files push`` next to
a naive star and one local ``cp``, all in one invocation.

    python benchmarks/files.py [--size 1GiB] [--ranks 2 4 8] [--dir /tmp] [--chunk 4MiB]

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


def _chain(workers: Any, src: str, out: str, chunk: int) -> tuple[float, float]:
    from meshplan.runtime import push_files

    result = push_files(src, os.path.join(out, "r{rank}"), workers=workers, chunk_bytes=chunk)
    assert result.bytes_sent == os.path.getsize(src)
    return result.seconds, result.transfer_seconds


def _star_pull(workers: Any, src: str, out: str) -> float:
    t = time.perf_counter()
    workers.broadcast("bench.copy", {"src": src, "dst": os.path.join(out, "r{rank}", "data")})
    workers.gather("bench.copy")
    return time.perf_counter() - t


def _star_seq(one: Any, n: int, src: str, out: str, chunk: int) -> float:
    t = time.perf_counter()
    for r in range(n):
        _chain(one, src, os.path.join(out, f"seq{r}"), chunk)
    return time.perf_counter() - t


def _cp(src: str, out: str) -> float:
    dst = os.path.join(out, "cp.data")
    t = time.perf_counter()
    subprocess.run(["cp", src, dst], check=True)
    subprocess.run(["sync", dst], check=True)
    return time.perf_counter() - t


def run(size: int, ranks: list[int], base: str, chunk: int) -> list[dict[str, Any]]:
    work = tempfile.mkdtemp(prefix="meshplan-files-bench-", dir=base)
    src = os.path.join(work, "src", "data")
    os.makedirs(os.path.dirname(src))
    rows = []
    try:
        _make_source(src, size)
        with _launch(1) as one:
            out = os.path.join(work, "out")
            _chain(one, src, os.path.join(work, "warmup"), chunk)      # untimed: caches, imports
            shutil.rmtree(os.path.join(work, "warmup"))
            for n in [1, *ranks]:
                workers = one if n == 1 else _launch(n)
                row: dict[str, Any] = {"n": n}
                for name, fn in [("chain", lambda: _chain(workers, src, out, chunk)),
                                 ("star-pull", lambda: _star_pull(workers, src, out)),
                                 ("star-seq", lambda: _star_seq(one, n, src, out, chunk)),
                                 ("cp", lambda: _cp(src, out))]:
                    if name == "cp" and n != 1:
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


def markdown(rows: list[dict[str, Any]], size: int) -> str:
    one = rows[0]
    lines = ["| ranks | chain push s | chain xfer s | chain ratio | star-seq s | star-seq ratio "
             "| star-pull s | star-pull ratio | cp + sync s (1 copy) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['n']} | {r['chain']:.2f} | {r['chain-xfer']:.2f} | {r['chain'] / one['chain']:.2f} "
            f"| {r['star-seq']:.2f} | {r['star-seq'] / one['star-seq']:.2f} "
            f"| {r['star-pull']:.2f} | {r['star-pull'] / one['star-pull']:.2f} "
            f"| {one['cp']:.2f} |")
    goal = all(r["chain"] / one["chain"] <= 1.15 for r in rows)
    lines.append("")
    lines.append(f"{size / 2**30:.2f} GiB; chain goal (<= 1.15 x the 1-rank time for every N): "
                 f"{'met' if goal else 'not met'}")
    return "\n".join(lines)


def main() -> None:
    from meshplan._cli_run import parse_size

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1GiB", help="file size (default 1GiB)")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where to write (needs "
                   "(max ranks + 2) x size free)")
    p.add_argument("--chunk", default="4MiB", help="chain chunk size")
    args = p.parse_args()
    size, chunk = parse_size(args.size), parse_size(args.chunk)
    need = (max(args.ranks) + 2) * size
    free = shutil.disk_usage(args.dir).free
    if free < need:
        sys.exit(f"{args.dir} has {free / 2**30:.1f} GiB free; this run needs {need / 2**30:.1f}")
    print(f"{len(os.sched_getaffinity(0))} cores; {args.size} to {args.ranks} ranks in "
          f"{args.dir}", file=sys.stderr)
    print(markdown(run(size, sorted(args.ranks), args.dir, chunk), size))


if __name__ == "__main__":
    main()
elif __name__ == _PLUGIN and "meshplan.runtime._worker" in sys.modules:
    _install_handler()          # loaded into a meshplan worker through its plugin list
