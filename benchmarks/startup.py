"""How long a mesh takes to start on local processes, with and without the zygote.

    python benchmarks/startup.py [--ranks 2 4] [--starts 4]

For each rank count, a fresh Python process (torch and meshplan imported before the clock
starts) times ``--starts`` mesh starts of the MLP example, one after the other: each is a new
``distribute(...)`` of the same step, timed from the decoration to the end of its first mesh
call (trace, plan, start every worker, set it up, one step), then shut down. The first start
pays the zygote's own imports (overlapped with tracing and planning), the later ones only
forks. The same again with ``MESHPLAN_ZYGOTE=0`` (every worker a new interpreter: what every
start cost before). Telemetry and fault tolerance are off, so only the start is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
import meshplan, torch
from meshplan.examples import mlp

n, starts = int(sys.argv[1]), int(sys.argv[2])
ex = mlp.build()
x, y = ex.batch(0)
out = []
for _ in range(starts):
    t0 = time.perf_counter()
    step = meshplan.distribute(ex.step, mesh={"dp": n}, telemetry=False, fault_tolerance=False)
    with step:
        step(x, y)
        out.append(time.perf_counter() - t0)
print(json.dumps(out))
"""


def run(n: int, starts: int, zygote: bool) -> list[float]:
    env = dict(os.environ, MESHPLAN_ZYGOTE="1" if zygote else "0")
    done = subprocess.run([sys.executable, "-c", CHILD, str(n), str(starts)], env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"the timing process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--starts", type=int, default=4)
    args = ap.parse_args()
    print("| ranks | workers | first start s | later starts s (median, each) |")
    print("|---:|---|---:|---|")
    for n in args.ranks:
        for zygote in (False, True):
            t = run(n, args.starts, zygote)
            later = ", ".join(f"{v:.2f}" for v in t[1:])
            print(f"| {n} | {'forked by the zygote' if zygote else 'new interpreters'} | "
                  f"{t[0]:.2f} | {statistics.median(t[1:]):.2f} ({later}) |", flush=True)


if __name__ == "__main__":
    main()
