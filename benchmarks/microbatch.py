"""Micro-batches (``distribute(microbatches=m)``): what a rank's program holds, and the step.

    python benchmarks/microbatch.py [--parts 1 2 4 8] [--ranks 2] [--steps 6]

The GPT example (d_model 128, 2 layers, 4 heads, vocab 512, sequences of 128, global batch 16,
AdamW) on ``dp=N`` local processes, the same batches for every ``m``: per ``m``, the largest
``memory.tensor_peak_bytes`` any rank recorded (the distinct tensor storage its program held at
its peak, counted as it runs: ``backends/_live.py``; telemetry level ``ops`` on every step), the
median step after two, and the last loss (equal for every ``m`` up to float32 summation order).
The step time against DDP's own accumulation (``no_sync()``) is ``benchmarks/step_time.py
--microbatches M``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import duckdb
import torch

import meshplan
from meshplan.examples import gpt
from meshplan.telemetry import Level, TelemetryConfig

CONFIG = gpt.GPTConfig(vocab_size=512, seq_len=128, n_layer=2, n_head=4, d_model=128,
                       batch_size=16)


def measure(parts: int, ranks: int, steps: int, folder: Path) -> tuple[float, float, float]:
    ex = gpt.build(optimizer="adamw", config=CONFIG, seed=0)
    db = folder / f"m{parts}.duckdb"
    step = meshplan.distribute(ex.step, mesh={"dp": ranks}, strategy="dp",
                               microbatches=parts, fault_tolerance=False,
                               telemetry=TelemetryConfig(db=db, level=Level.OPS, ops_every=1))
    times, loss = [], torch.zeros(())
    with step:
        for i in range(steps):
            t0 = time.perf_counter()
            loss = step(*ex.batch(i))
            times.append(time.perf_counter() - t0)
    con = duckdb.connect(str(db), read_only=True)
    try:
        peak = con.sql("SELECT max(tensor_peak_bytes) FROM memory").fetchall()[0][0]
    finally:
        con.close()
    return float(peak or 0), statistics.median(times[2:]), float(loss.detach())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    print(f"GPT {CONFIG}, AdamW, dp={args.ranks}; median of {args.steps - 2} steps after 2")
    print("| micro-batches | tensor peak per rank | of the whole batch's | step | last loss |")
    print("|---:|---:|---:|---:|---:|")
    whole = None
    with tempfile.TemporaryDirectory(prefix="meshplan-mb-") as folder:
        for m in args.parts:
            peak, step_s, loss = measure(m, args.ranks, args.steps, Path(folder))
            whole = whole or peak
            print(f"| {m} | {peak / 2**20:.2f} MiB | {peak / whole:.2f} | "
                  f"{step_s * 1e3:.0f} ms | {loss:.6f} |", flush=True)


if __name__ == "__main__":
    main()
