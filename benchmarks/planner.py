"""Planner benchmark: the automatic plan next to each hand-written plan family, every one
solved under the same cost model, on several models and meshes.

    python benchmarks/planner.py [--quick] [--with-8b]

Prints a table (model x mesh: estimated step time, peak memory per device, fits, plan time)
and the same as Markdown for benchmarks/README.md. Estimated times come from the planner's
cost model (roofline compute + alpha-beta collectives on the named topology), not from runs.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Callable

import torch

import meshplan
from meshplan.examples import gpt, llama, mlp
from meshplan.planner import HAND_STRATEGIES, PlanError, plan_graph


@dataclass
class Case:
    model: str
    build: Callable[[], object]
    meshes: list[dict[str, int]]
    topology: str = "h100"
    memory_limit: int | None = None


def _gpt_medium() -> object:
    cfg = gpt.GPTConfig(vocab_size=8192, seq_len=512, n_layer=4, n_head=8, d_model=512,
                        batch_size=16)
    with torch.device("meta"):
        return gpt.build(config=cfg)


def _llama_8b() -> object:
    return llama.build(config="llama3_8b", device="meta")


def cases(quick: bool, with_8b: bool) -> list[Case]:
    out = [
        Case("mlp (tiny)", lambda: mlp.build(optimizer="adamw"), [{"dp": 2}, {"dp": 2, "tp": 2}]),
        Case("gpt (tiny)", lambda: gpt.build(), [{"dp": 2}, {"dp": 2, "tp": 2}]),
    ]
    if not quick:
        out.append(Case("gpt d512 x4 (meta)", _gpt_medium, [{"dp": 8}, {"dp": 4, "tp": 2}]))
    if with_8b:
        out.append(Case("llama3-8b (meta)", _llama_8b, [{"dp": 8, "tp": 8}]))
    return out


def run(quick: bool, with_8b: bool) -> list[dict[str, object]]:
    rows = []
    for case in cases(quick, with_8b):
        ex = case.build()
        t0 = time.perf_counter()
        graph = meshplan.trace(ex.step, *ex.batch(0)).graph
        trace_s = time.perf_counter() - t0
        for mesh in case.meshes:
            for strategy in ("auto", *HAND_STRATEGIES):
                if strategy == "megatron_tp" and "tp" not in mesh:
                    continue
                t1 = time.perf_counter()
                try:
                    plan = plan_graph(graph, mesh, topology=case.topology, strategy=strategy,
                                      memory_limit_bytes=case.memory_limit)
                    row = {"time_ms": plan.estimated_step_time_s * 1e3,
                           "comm_ms": plan.comm_time_s * 1e3,
                           "mem_gib": plan.peak_memory_bytes / 2**30, "fits": plan.fits}
                except PlanError as e:
                    row = {"time_ms": float("nan"), "comm_ms": float("nan"),
                           "mem_gib": float("nan"), "fits": False, "error": str(e)[:80]}
                row.update(model=case.model, mesh=",".join(f"{k}={v}" for k, v in mesh.items()),
                           strategy=strategy, plan_s=time.perf_counter() - t1, trace_s=trace_s)
                rows.append(row)
    return rows


def markdown(rows: list[dict[str, object]]) -> str:
    head = ("| model | mesh | strategy | est. step (ms) | comm (ms) | peak GiB/device | fits "
            "| plan s | trace s |\n|---|---|---|---:|---:|---:|---|---:|---:|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['model']} | {r['mesh']} | {r['strategy']} | {r['time_ms']:.3f} | "
                     f"{r['comm_ms']:.3f} | {r['mem_gib']:.3f} | {'yes' if r['fits'] else 'no'} "
                     f"| {r['plan_s']:.2f} | {r['trace_s']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the tiny models")
    ap.add_argument("--with-8b", action="store_true", help="also the LLaMA-3 8B plan")
    args = ap.parse_args()
    rows = run(args.quick, args.with_8b)
    print(markdown(rows))


if __name__ == "__main__":
    main()
