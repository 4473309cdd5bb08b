"""The README's demo: trace the example GPT training step, show its IR, and replay it next to
the eager single-process run of the same code.

Later issues grow this into the full demo (plan, distributed run, telemetry query); today it
stops at what exists: capture and the reference interpreter.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .gpt import build


def run_demo(steps: int = 5, console: Any = None) -> int:
    import meshplan
    from meshplan.cli import print_summary
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

    table = Table(title=f"2. losses: eager PyTorch vs meshplan's traced graph ({steps} steps)")
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
    console.print("next: planning and running on a process mesh arrive with the planner and "
                  "runtime issues (see README)")
    return 0 if same and worst == 0.0 else 1
