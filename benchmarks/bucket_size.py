"""Gradient bucket size (issue 8): the cost model's choice against the other model's.

    python benchmarks/bucket_size.py [--rounds 3] [--ranks 2] [--steps 10]

The `dp` plan of ``step_time.py``'s GPT on N local CPU processes, planned twice: with the
``cpu`` topology (``comm_overlap=0``: gloo runs on the cores the ranks compute on, so the cost
model puts every gradient in one bucket) and with the same topology claiming full overlap
(``comm_overlap=1``: the model then picks small buckets, ~sqrt(total x latency x bandwidth)).
Rounds alternate the two; the median step time of each (controller's call, as in
``step_time.py``) says which model this machine follows.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import meshplan  # noqa: E402
import step_time as st  # noqa: E402
from meshplan.examples import gpt  # noqa: E402
from meshplan.planner._mesh import PRESETS  # noqa: E402


def one(topology, n: int, steps: int, warmup: int = 2) -> tuple[int, float]:
    """(the plan's bucket_bytes, median step seconds) for the `dp` plan on ``topology``."""
    ex = gpt.build(config=st.CONFIG, optimizer="adamw", clip=st.CLIP, seed=st.SEED)
    batches = st._batches(2 + warmup + steps)
    step = meshplan.distribute(ex.step, mesh={"dp": n}, strategy="dp", topology=topology,
                               example_inputs=batches[0], timeout_s=st.TIMEOUT_S,
                               fault_tolerance=False)     # the bare step, as step_time.py
    with st._meshplan_env(st._threads(n)), step:
        bucket_bytes = step.plan.bucket_bytes
        for b in batches[:2 + warmup]:
            step(*b)
        times = [st._timed_call(step, b)[1] for b in batches[2 + warmup:]]
    return bucket_bytes, statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    cpu = PRESETS["cpu"]
    topologies = [cpu, dataclasses.replace(cpu, name="cpu, comm_overlap=1", comm_overlap=1.0)]
    got: dict[str, list[float]] = {t.name: [] for t in topologies}
    sizes: dict[str, int] = {}
    for r in range(args.rounds):
        for t in topologies:
            sizes[t.name], s = one(t, args.ranks, args.steps)
            got[t.name].append(s)
            print(f"  round {r + 1}: {t.name}: {s * 1e3:.1f} ms", file=sys.stderr, flush=True)
    print(f"| topology | bucket | step ms (median of {args.rounds} rounds) | rounds |")
    print("|---|---:|---:|---|")
    for t in topologies:
        v = got[t.name]
        print(f"| {t.name} | {sizes[t.name] / 2**20:.0f} MiB | {statistics.median(v) * 1e3:.1f} "
              f"| {', '.join(f'{x * 1e3:.0f}' for x in v)} |")


if __name__ == "__main__":
    main()
