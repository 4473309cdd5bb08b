"""The README's demo: trace the example GPT training step, show its IR, plan it on a 2x2 mesh,
and replay the traced step next to the eager single-process run of the same code.

Then the same step runs on 4 local worker processes (``meshplan.distribute``) next to the
single-process run. The telemetry query arrives with its issue.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .gpt import build


def run_demo(steps: int = 5, console: Any = None) -> int:
    import meshplan
    from meshplan.cli import print_summary
    from meshplan.planner import HAND_STRATEGIES, plan_graph
    from meshplan.ir import summarize
    from rich.console import Console
    from rich.table import Table

    console = console or Console(highlight=False)
    eager, replay = build(seed=0), build(seed=0)

    t0 = time.perf_counter()
    traced = meshplan.trace(replay.step, *replay.batch(0))
    console.print(f"[bold]1. trace[/bold]  {traced.graph.info.name} captured in "
                  f"{time.perf_counter() - t0:.2f} s: forward, backward and AdamW in one graph")
    print_summary(summarize(traced.graph), console)

    mesh = {"dp": 2, "tp": 2}
    plans = {s: plan_graph(traced.graph, mesh, topology="cpu", strategy=s)
             for s in ("auto", *HAND_STRATEGIES)}
    console.print(f"[bold]2. plan[/bold]  on mesh {mesh} with the 'cpu' topology "
                  "(gloo on loopback), chosen by the ILP:")
    console.print(plans["auto"].summary(), markup=False)
    versus = Table(title="the automatic plan against the hand-written families (same cost model)")
    for col in ("strategy", "est. step", "communication", "peak memory/device"):
        versus.add_column(col, justify="left" if col == "strategy" else "right")
    for name, plan in plans.items():
        versus.add_row(name, f"{plan.estimated_step_time_s * 1e3:.3f} ms",
                       f"{plan.comm_time_s * 1e3:.3f} ms", f"{plan.peak_memory_bytes / 2**20:.2f} MiB")
    console.print(versus)

    table = Table(title=f"3. losses: eager PyTorch vs meshplan's traced graph ({steps} steps)")
    for col in ("step", "eager", "meshplan", "|diff|"):
        table.add_column(col, justify="right")
    worst = 0.0
    for i in range(steps):
        le = eager.step(*eager.batch(i))
        lr = traced(*replay.batch(i))
        diff = (le - lr).abs().item()
        worst = max(worst, diff)
        table.add_row(str(i), f"{le.item():.6f}", f"{lr.item():.6f}", f"{diff:.1e}")
    console.print(table)
    same = all(torch.equal(a, b) for a, b in zip(eager.model.parameters(),
                                                 replay.model.parameters()))
    console.print(f"parameters after {steps} steps bit-identical: {same}")
    ok = _distributed(steps, console)
    return 0 if same and worst == 0.0 and ok else 1


def _distributed(steps: int, console: Any) -> bool:
    """The same step on 4 local processes: Megatron TP on ``tp``, data parallel on ``dp``
    (the automatic plan keeps this tiny model replicated: on loopback every collective costs
    more than the compute it splits)."""
    import meshplan
    from rich.table import Table

    single, dist_ex = build(seed=0), build(seed=0)
    mesh = {"dp": 2, "tp": 2}
    step = meshplan.distribute(dist_ex.step, mesh=mesh, strategy="megatron_tp",
                               topology="cpu")
    table = Table(title=f"4. losses: one process vs meshplan on 4 processes {mesh} "
                        "(megatron_tp plan, gloo)")
    for col in ("step", "one process", "meshplan x4", "|diff|", "collectives/rank"):
        table.add_column(col, justify="right")
    worst = 0.0
    t0 = time.perf_counter()
    with step:
        for i in range(steps):
            a = single.step(*single.batch(i))
            b = step(*dist_ex.batch(i))
            diff = (a - b).abs().item()
            worst = max(worst, diff)
            table.add_row(str(i), f"{a.item():.6f}", f"{b.item():.6f}", f"{diff:.1e}",
                          str(len(step.last_comm[0])))
    console.print(table)
    console.print(f"4 workers started, ran {steps} steps and stopped in "
                  f"{time.perf_counter() - t0:.1f} s; largest loss difference {worst:.1e} "
                  "(fp32 sums in another order)")
    console.print("next: telemetry (a SQL store of every rank's steps and collectives) arrives "
                  "with its issue (see README)")
    return worst < 1e-4
