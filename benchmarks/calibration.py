"""The cost model against measured steps, before and after one calibration run (issue 20, point 6).

    python benchmarks/calibration.py [--ranks 2 4] [--steps 8] [--calibrate-with dp] [--calibration-steps N]
                                     [--only dp,fsdp,megatron_tp,auto] [--save DIR]

The benchmark GPT of ``benchmarks/step_time.py`` (d_model 256, 4 layers, vocab 2048, seq 64,
global batch 16, AdamW, clipping at 1.0) on N local CPU processes:

1. One calibration run: ``distribute(step, mesh={"dp": N}, strategy=<--calibrate-with>,
   calibrate=True)`` times every op of its first 16 mesh steps, fits the machine
   (``planner/_calibrate.py``: ``from_telemetry``: compute rates, per-op factors, the links
   per collective kind from blocking probes on the mesh, the step overhead) and re-plans; the
   fitted topology is kept.
2. For each strategy (``dp`` and ``fsdp`` on ``{"dp": N}``, ``megatron_tp`` on ``{"tp": N}``,
   ``auto`` on ``{"dp": N}``): the plan on the ``cpu`` preset and on the fitted machine, and a
   run of the fitted plan, ``--steps`` mesh steps after one warm-up, measured as the controller
   sees each call (telemetry ``steps`` rows of rank -1: split, send, every rank's step,
   gather), and the tensor memory its program holds at its peak (telemetry ``memory``'s
   ``tensor_peak_bytes``, counted on every 4th step) next to the plan's peak.

Prints one table per rank count: estimate before, estimate after, measured, the error of each,
the peak memory estimated and measured, and whether the estimates rank the plans as the
measurements do. Load from other processes
changes every measured number; run it on an idle machine.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import meshplan
import torch
from meshplan.examples import gpt
from meshplan.planner._calibrate import _measured_step
from meshplan.runtime._distributed import CALIBRATION_STEPS
from meshplan.telemetry import Store, TelemetryConfig

CONFIG = gpt.GPTConfig(vocab_size=2048, seq_len=64, n_layer=4, n_head=4, d_model=256,
                       batch_size=16)
STRATEGIES = ("dp", "fsdp", "megatron_tp", "auto")


def _mesh(strategy: str, n: int) -> dict[str, int]:
    return {"tp": n} if strategy == "megatron_tp" else {"dp": n}


def _batches(k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, CONFIG.vocab_size, (CONFIG.batch_size, CONFIG.seq_len), generator=g),
             torch.randint(0, CONFIG.vocab_size, (CONFIG.batch_size, CONFIG.seq_len), generator=g))
            for _ in range(k)]


def calibrate(n: int, strategy: str, db: Path, steps: int | None = None
              ) -> tuple[meshplan.planner.Topology, float]:
    """The fitted machine from a ``calibrate=True`` run (``steps``: ``calibrate=steps``);
    and the seconds the calibration took (its mesh steps after the first, the probes, the
    fit and the re-plan)."""
    ex = gpt.build(config=CONFIG, optimizer="adamw", clip=1.0, seed=0)
    batches = _batches(steps or CALIBRATION_STEPS)
    step = meshplan.distribute(ex.step, mesh={"dp": n}, strategy=strategy, topology="cpu",
                               telemetry=TelemetryConfig(db=db), calibrate=steps or True,
                               fault_tolerance=False)     # the model prices the bare step
    with step:
        step(*batches[0])                       # launch + the first mesh step
        t0 = time.perf_counter()
        for b in batches[1:]:
            step(*b)
        took = time.perf_counter() - t0
    cal = step.calibration
    if cal is None:
        raise SystemExit("the calibration run did not fit (see the warning above)")
    print(f"  calibration ({strategy} on {n}): {cal.summary()}", flush=True)
    fit = cal.fit
    if fit.compute is not None:
        c = fit.compute
        print(f"    fitted: float32 {c.flops.get('float32', 0) / 1e9:.1f} GFLOP/s, memory "
              f"{c.memory_bandwidth / 1e9:.2f} GB/s, op floor {c.kernel_floor_s * 1e6:.1f} us, "
              f"{len(c.op_factors)} op factors, link "
              f"{fit.topology.intra_node.latency * 1e6:.0f} us + "
              f"{fit.topology.intra_node.bandwidth / 1e9:.2f} GB/s, wait "
              f"{fit.topology.intra_node.wait * 1e6:.0f} us per collective, step overhead "
              f"{fit.topology.step_overhead_s * 1e3:.1f} ms", flush=True)
    return fit.topology, took


def measure(strategy: str, n: int, topo: object, steps: int, db: Path,
            save: Path | None = None) -> dict[str, float]:
    ex = gpt.build(config=CONFIG, optimizer="adamw", clip=1.0, seed=0)
    batches = _batches(steps + 1)
    x, y = batches[0]
    before = meshplan.compile(ex.step, x, y, mesh=_mesh(strategy, n), strategy=strategy,
                              topology="cpu")
    after = meshplan.compile(ex.step, x, y, mesh=_mesh(strategy, n), strategy=strategy,
                             topology=topo)
    if save is not None:                # the plan measured, to look into a row afterwards
        save.mkdir(parents=True, exist_ok=True)
        after.save(str(save / f"{strategy}{n}.plan.json"))
    # level ops on every 4th step: those steps also count the tensor memory the program holds
    step = meshplan.distribute(ex.step, mesh=_mesh(strategy, n), plan=after,
                               telemetry=TelemetryConfig(db=db, level="ops", ops_every=4),
                               fault_tolerance=False)
    with step:
        for b in batches:
            step(*b)
        run = step.run_id
    with Store.open(db) as store:
        measured = _measured_step(store, run)
        peak = store.sql(f"SELECT max(tensor_peak_bytes) AS p FROM memory "
                         f"WHERE run_id = '{run}'").to_pylist()[0]["p"]
    return {"before": before.estimated_step_time_s, "after": after.estimated_step_time_s,
            "measured": measured or float("nan"), "est_peak": after.peak_memory_bytes,
            "peak": peak or float("nan"),
            "layout_changed": _layouts(before) != _layouts(after)}


def _layouts(plan: object) -> tuple:
    return tuple((p.inputs, p.outputs) for p in plan.placements)


def _order(values: dict[str, float]) -> list[str]:
    return [k for k, _ in sorted(values.items(), key=lambda kv: kv[1])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=8, help="timed mesh steps per plan")
    ap.add_argument("--calibrate-with", default="dp", help="the calibration run's strategy")
    ap.add_argument("--calibration-steps", type=int, default=None,
                    help=f"calibrate=N (default: True, {CALIBRATION_STEPS} steps)")
    ap.add_argument("--only", default=",".join(STRATEGIES))
    ap.add_argument("--save", type=Path, default=None,
                    help="write each fitted topology and measured plan (JSON) into this folder")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    strategies = [s for s in args.only.split(",") if s]
    with tempfile.TemporaryDirectory(prefix="meshplan-calibration-") as tmp:
        for n in args.ranks:
            os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
            topo, took = calibrate(n, args.calibrate_with, Path(tmp) / f"cal{n}.duckdb",
                                   args.calibration_steps)
            if args.save is not None:
                args.save.mkdir(parents=True, exist_ok=True)
                topo.save(str(args.save / f"topology{n}.json"))
            rows = {s: measure(s, n, topo, args.steps, Path(tmp) / f"{s}{n}.duckdb", args.save)
                    for s in strategies}
            print(f"\n{n} ranks (calibrated on {args.calibrate_with}; the calibration's steps, "
                  f"fit and re-plan took {took:.1f} s)")
            print(f"  {'plan':12} {'before ms':>10} {'err':>6} {'after ms':>10} {'err':>6} "
                  f"{'measured ms':>12} {'peak MiB est':>13} {'measured':>9} {'err':>6}  layouts")
            for s, r in rows.items():
                eb = r["before"] / r["measured"] - 1
                ea = r["after"] / r["measured"] - 1
                em = r["est_peak"] / r["peak"] - 1
                print(f"  {s:12} {r['before'] * 1e3:10.1f} {eb:+6.0%} {r['after'] * 1e3:10.1f} "
                      f"{ea:+6.0%} {r['measured'] * 1e3:12.1f} {r['est_peak'] / 2**20:13.1f} "
                      f"{r['peak'] / 2**20:9.1f} {em:+6.0%}  "
                      f"{'changed' if r['layout_changed'] else 'same'}")
            meas = _order({s: r["measured"] for s, r in rows.items()})
            print(f"  measured order: {' < '.join(meas)}")
            for key in ("before", "after"):
                est = _order({s: r[key] for s, r in rows.items()})
                print(f"  {key:>6} order: {' < '.join(est)}  "
                      f"({'same' if est == meas else 'differs'})")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
