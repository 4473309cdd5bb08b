"""Telemetry benchmark (issue 6): what recording costs a run, and how fast the store is.

    python benchmarks/telemetry.py [--ranks 4] [--steps 20] [--rows 10000000] [--quick]

1. Step time with telemetry at the default level (``collectives``) and at ``ops`` against
   telemetry off, on the GPT example of ``benchmarks/step_time.py`` (d_model 256, 4 layers,
   batch 16, AdamW, clipping) on ``--ranks`` local processes, Megatron plan on dp x tp
   (2 x 2 for 4 ranks; dp only for 2). The meshes run side by side: all are launched
   first, then their steps are interleaved (off, collectives, ops, off, ...) on the same
   batches, so machine noise hits all alike; the ratio is of per-step medians on the
   controller after ``--warmup`` steps. Goal: default level <= 1.03x off.
2. Recording: rows per second through ``Recorder.add`` + flush (one Python tuple per row,
   the way the runtime records a collective).
3. The store: ``--rows`` synthetic ``collectives`` rows written as 100 Parquet segments
   (4 ranks x 25 flushes), then ingested into a fresh DuckDB file (rows/s), then
   ``SELECT rank, kind, axis, count(*), sum(bytes), avg(dur_us) ... GROUP BY ALL`` over them
   (median of 5, after one warm-up).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

GOAL = 1.03


def step_overhead(ranks: int, steps: int, warmup: int, root: Path) -> dict[str, list[float]]:
    import meshplan
    from meshplan.examples import gpt
    from meshplan.telemetry import TelemetryConfig

    sys_path = Path(__file__).resolve().parent
    import sys
    sys.path.insert(0, str(sys_path))
    from step_time import CONFIG          # the same model as the step-time benchmark

    mesh = {"dp": 2, "tp": ranks // 2} if ranks >= 4 else {"dp": ranks}
    strategy = "megatron_tp" if "tp" in mesh else "dp"
    variants = {"off": False,
                "collectives": TelemetryConfig(db=root / "c.duckdb", level="collectives"),
                "ops": TelemetryConfig(db=root / "o.duckdb", level="ops", ops_every=10)}
    meshes = {}
    for name, tel in variants.items():
        ex = gpt.build(optimizer="adamw", clip=1.0, config=CONFIG)
        meshes[name] = (ex, meshplan.distribute(ex.step, mesh=mesh, strategy=strategy,
                                                telemetry=tel, fault_tolerance=False))
    times: dict[str, list[float]] = {name: [] for name in variants}
    losses: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for i in range(warmup + steps):
            for name, (ex, step) in meshes.items():
                batch = ex.batch(i)
                t0 = time.perf_counter()
                loss = step(*batch)
                dt = time.perf_counter() - t0
                losses[name].append(float(loss))
                if i >= warmup:
                    times[name].append(dt)
    finally:
        for _, step in meshes.values():
            step.shutdown()
    assert losses["off"] == losses["collectives"] == losses["ops"], "telemetry changed a loss"
    return times


def recorder_rate(rows: int, root: Path) -> float:
    from meshplan.telemetry import Recorder

    rec = Recorder(root / "rec", "bench", 0, flush_interval_s=None, live_rows=0)
    row = (0, 0, "all_reduce", "dp", 2, 1 << 20, 0, 100, "mm_1", "addmm_2")
    t0 = time.perf_counter()
    for i in range(rows):
        rec.add("collectives", row)
        if i % 100_000 == 99_999:
            rec.flush()
    rec.close()
    return rows / (time.perf_counter() - t0)


def synthetic_segments(rows: int, root: Path, files: int = 100) -> None:
    from meshplan.telemetry import TABLES

    schema = TABLES["collectives"]
    per = rows // files
    rng = np.random.default_rng(0)
    kinds = np.array(["all_reduce", "all_gather", "reduce_scatter", "all_to_all"])
    axes = np.array(["dp", "tp"])
    for f in range(files):
        rank, flush = f % 4, f // 4
        d = root / "runbench" / f"rank-{rank:05d}"
        d.mkdir(parents=True, exist_ok=True)
        seq = np.arange(per, dtype=np.int32) % 64
        cols = {
            "run_id": pa.array(["runbench"] * per),
            "rank": pa.array(np.full(per, rank, dtype=np.int32)),
            "step": pa.array((flush * per + np.arange(per)) // 64),
            "seq": pa.array(seq),
            "kind": pa.array(kinds[rng.integers(0, 4, per)]),
            "axis": pa.array(axes[rng.integers(0, 2, per)]),
            "group_size": pa.array(np.full(per, 2, dtype=np.int32)),
            "bytes": pa.array(rng.integers(1 << 10, 1 << 24, per)),
            "start_us": pa.array(np.arange(per, dtype=np.int64) * 50),
            "dur_us": pa.array(rng.integers(10, 5000, per)),
            "value": pa.array([f"mm_{i % 97}" for i in range(per)]),
            "node": pa.array([f"addmm_{i % 89}" for i in range(per)]),
        }
        table = pa.Table.from_pydict(cols, schema=schema)
        pq.write_table(table, d / f"collectives-1-{flush:06d}.parquet")


def store_numbers(rows: int, root: Path) -> tuple[float, float, float]:
    from meshplan.telemetry import Store

    db = root / "bench.duckdb"
    seg = db.with_name(db.stem + ".segments")
    t0 = time.perf_counter()
    synthetic_segments(rows, seg)
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with Store.open(db, ingest=False) as store:
        got = store.ingest()
    ingest_s = time.perf_counter() - t0
    n = getattr(got, "rows", got)
    assert n == rows // 100 * 100, got
    q = ("SELECT rank, kind, axis, count(*) AS n, sum(bytes) AS bytes, avg(dur_us) AS us "
         "FROM collectives GROUP BY ALL")
    with Store.open(db, ingest=False) as store:
        store.sql(q)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            out = store.sql(q)
            times.append(time.perf_counter() - t0)
        assert sum(out.column("n").to_pylist()) == n
    return n / ingest_s, statistics.median(times), n / write_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--quick", action="store_true", help="5 steps, 1M rows")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.rows = 5, 1_000_000
    root = Path(tempfile.mkdtemp(prefix="meshplan-bench-telemetry-"))
    try:
        times = step_overhead(a.ranks, a.steps, a.warmup, root)
        off = statistics.median(times["off"])
        print(f"\nstep time, GPT on {a.ranks} ranks, {a.steps} steps after {a.warmup} warm-up "
              "(median on the controller):")
        print("| telemetry | median ms | ratio vs off |")
        print("|---|---:|---:|")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"| {name} | {med * 1e3:.1f} | {med / off:.3f}x |")
        ratio = statistics.median(times["collectives"]) / off
        print(f"default level: {ratio:.3f}x off (goal <= {GOAL}x: "
              f"{'met' if ratio <= GOAL else 'NOT met'})")
        rate = recorder_rate(1_000_000, root)
        print(f"\nrecording: {rate / 1e6:.2f} M rows/s through Recorder.add + flush")
        ingest, group_s, write = store_numbers(a.rows, root)
        print(f"\nstore, {a.rows / 1e6:.0f}M collective rows in 100 segments "
              f"(written at {write / 1e6:.1f} M rows/s by pyarrow):")
        print(f"ingest into DuckDB: {ingest / 1e6:.2f} M rows/s")
        print(f"GROUP BY rank, kind, axis: {group_s * 1e3:.0f} ms (median of 5)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
