"""The README's demo: trace the example GPT training step, show its IR, plan it on a 2x2 mesh,
and replay the traced step next to the eager single-process run of the same code.

Then the same step runs on 4 local worker processes (``meshplan.distribute``) next to the
single-process run, and two telemetry queries show what every rank did: one asked live of the
running workers, one of the DuckDB store after the run.
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
    print_summary(summarize(traced.graph), console, traced.graph)

    mesh = {"dp": 2, "tp": 2}
    auto = plan_graph(traced.graph, mesh, topology="cpu", compare_sharded=True)
    # a fully replicated automatic plan was already compared with the families: reuse that
    known = {p.strategy: p for p in getattr(auto.sharded_alternatives, "plans", ())}
    plans = {"auto": auto.estimate()}
    for s in HAND_STRATEGIES:
        plans[s] = known.get(s) or plan_graph(traced.graph, mesh, topology="cpu",
                                              strategy=s).estimate()
    console.print(f"[bold]2. plan[/bold]  on mesh {mesh} with the 'cpu' topology "
                  "(gloo on loopback), chosen by the ILP:")
    console.print(auto.summary(), markup=False)
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
        live = (step.query(_LIVE_SQL, merge=_MERGE_SQL) if step.telemetry is not None
                else None)
    console.print(table)
    console.print(f"4 workers started, ran {steps} steps and stopped in "
                  f"{time.perf_counter() - t0:.1f} s; largest loss difference {worst:.1e} "
                  "(fp32 sums in another order)")
    if live is not None:
        _print_arrow(console, "5. telemetry, asked live of the 4 workers (step.query)",
                     f"{_LIVE_SQL}\nmerged: {_MERGE_SQL}", live.table)
        _stored(console, step)
    return worst < 1e-4


_LIVE_SQL = ("SELECT kind, axis, count(*) AS calls, sum(bytes) AS bytes, "
             "sum(dur_us) AS us FROM collectives GROUP BY ALL")
_MERGE_SQL = ("SELECT kind, axis, sum(calls) AS calls, sum(bytes) AS bytes, "
              "round(sum(us) / sum(calls)) AS avg_us FROM result GROUP BY ALL "
              "ORDER BY calls DESC")
_STORE_SQL = ("SELECT rank, count(*) AS steps, quantile_cont(dur_us, 0.5) AS p50_us, "
              "round(sum(comm_us) / sum(dur_us), 2) AS comm_share FROM steps "
              "WHERE run_id = '{run}' AND rank >= 0 GROUP BY rank ORDER BY rank")


def _stored(console: Any, step: Any) -> None:
    """The same run, read back from the DuckDB store the controller loaded at shutdown."""
    from meshplan.telemetry import Store

    with Store.open(step.telemetry.db) as store:
        run = store.sql("SELECT run_id FROM runs ORDER BY start_us DESC LIMIT 1")
        run_id = run.column("run_id")[0].as_py()
        sql = _STORE_SQL.format(run=run_id)
        _print_arrow(console, f"6. telemetry store {step.telemetry.db} (meshplan telemetry sql)",
                     sql, store.sql(sql))


def _print_arrow(console: Any, title: str, sql: str, table: Any) -> None:
    from rich.table import Table

    out = Table(title=title, caption=sql, caption_justify="left")
    for name in table.column_names:
        out.add_column(name, justify="right")
    for row in table.to_pylist():
        out.add_row(*(_cell(v) for v in row.values()))
    console.print(out)


def _cell(v: Any) -> str:
    """Whole numbers (DuckDB sums are decimals) with thousands separators."""
    if isinstance(v, (int, float)) or type(v).__name__ == "Decimal":
        return f"{int(v):,}" if v == int(v) else f"{float(v):,.2f}"
    return str(v)
