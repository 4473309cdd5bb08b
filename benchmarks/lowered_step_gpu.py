"""The lowered GPT step on one GPU with the lowering's kernels on and off (issue 8).

    python benchmarks/lowered_step_gpu.py [--steps 20] [--json PATH]

The GPT of ``benchmarks/step_time.py`` (d_model 256, 4 layers, vocab 2048, seq 64, batch 16,
AdamW, clipping) traced on the CPU, planned for one rank (``{"dp": 1}``), lowered for
``cuda`` with ``kernels=True`` (the optimizer update becomes the Triton AdamW: one launch per
dtype group) and ``kernels=False`` (the plan's ops one by one), run on a one-rank thread mesh
with the state on the GPU. Each step is timed with ``torch.cuda.synchronize()`` around it;
medians over ``--steps`` steps after 3 warm-up steps, the two variants interleaved. The
program runs op by op from Python, so at this size the time is mostly launch overhead: the
numbers show what the substitution saves there, not a GPU's throughput.

Exit status 1 when the two variants' state is more than ``--max-state-diff`` (default 1e-3)
apart after the run: both compute the same AdamW steps in fp32 (measured 6.6e-5 apart after
23 steps on an H200: rounding, amplified where a gradient is ~0), while a wrong update moves a
weight by ~lr = 3e-3 a step. A benchmark whose programs disagree has not measured anything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import meshplan  # noqa: E402
from meshplan.backends import ThreadMesh  # noqa: E402
from meshplan.backends._kernels import kernel_summary  # noqa: E402
from meshplan.backends._lower import lower, run  # noqa: E402
from meshplan.examples import gpt  # noqa: E402
from meshplan.planner import plan_graph  # noqa: E402
from step_time import CONFIG  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json")
    ap.add_argument("--max-state-diff", type=float, default=1e-3)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ex = gpt.build(optimizer="adamw", clip=1.0, config=CONFIG)
    ex.step(*ex.batch(0))
    traced = meshplan.trace(ex.step, *ex.batch(1))
    graph = traced.graph
    plan = plan_graph(graph, {"dp": 1}, topology="h100", strategy="dp")
    values = traced.input_values(*ex.batch(1))
    state_names = [n.target for n in graph.inputs if n.meta.role.value != "data"]
    data_names = [n.target for n in graph.inputs if n.meta.role.value == "data"]
    comm = ThreadMesh(1).communicators[0]
    variants = {}
    for on in (True, False):
        prog = lower(plan, 0, device=device, kernels=on)
        state = {k: values[k].clone().to(device) for k in state_names}
        variants["kernels on" if on else "kernels off"] = (prog, state, [])
    batches = [{k: v.to(device) for k, v in zip(data_names, ex.batch(i + 2))}
               for i in range(args.steps + 3)]
    for i, batch in enumerate(batches):
        for name, (prog, state, times) in variants.items():
            torch.cuda.synchronize() if device == "cuda" else None
            t0 = time.perf_counter()
            _, new = run(prog, comm, state, batch, donate=True)
            torch.cuda.synchronize() if device == "cuda" else None
            if i >= 3:
                times.append(time.perf_counter() - t0)
            state.update(new)
    report = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
              "torch": torch.__version__, "rows": []}
    for name, (prog, state, times) in variants.items():
        row = {"variant": name, "median_ms": statistics.median(times) * 1e3,
               "kernels": kernel_summary(prog.instructions),
               "instructions": len(prog.instructions)}
        report["rows"].append(row)
        print(f"{name:12s} {row['median_ms']:8.2f} ms  {row['instructions']} instructions  "
              f"{row['kernels']}")
    on, off = (r["median_ms"] for r in report["rows"])
    print(f"kernels on / off: {on / off:.3f}")
    state_gap = max((a - b).abs().max().item() for a, b in zip(
        variants["kernels on"][1].values(), variants["kernels off"][1].values()))
    print(f"max |state on - state off| after {len(batches)} steps: {state_gap:.3g}")
    report["max_state_diff"] = state_gap
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if not state_gap <= args.max_state_diff:          # NaN fails too
        print(f"FAILED: kernels on and off disagree by {state_gap:.3g} > --max-state-diff "
              f"{args.max_state_diff:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
