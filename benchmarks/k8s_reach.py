"""A controller outside the cluster (``k8s={"reach": "port-forward"}``) against one the pods
connect to (``reach="direct"``): what the relays and port-forwards cost (issue 23).

    python benchmarks/k8s_reach.py [--pods 2] [--ranks 4] [--steps 20] [--rounds 2]

The GPT of ``benchmarks/step_time.py``'s default example (``meshplan.examples.gpt``) on
``--ranks`` ranks in ``--pods`` pods, data parallel, against the tests' loopback stand-in API
server and kubelet (``tests/dist/_k8s_standin.py``: no cluster can run here; its
``pods/portforward`` is a websocket on loopback, so what this measures is the relays' and the
client's port-forward proxy's own cost, not a real API server's latency or bandwidth). Per
reach, alternating, ``--rounds`` times: the time from ``distribute`` to the first step's
return (pods made, ranks connected, the first step traced and run), the median step after
it, and ``state_dict()`` (the whole state through the channel to the controller).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pods", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "dist"))
    from _k8s_standin import StandIn

    import meshplan
    from meshplan.examples import gpt

    rows: dict[str, list[tuple[float, float, float]]] = {"direct": [], "port-forward": []}
    with StandIn() as k:
        os.environ["KUBECONFIG"] = k.kubeconfig
        os.environ.pop("KUBERNETES_SERVICE_HOST", None)
        for _ in range(args.rounds):
            for reach in rows:
                ex = gpt.build(seed=0)
                opts = {"image": "img:1", "pods": args.pods, "reach": reach}
                if reach == "direct":
                    opts["controller_host"] = "127.0.0.1"
                else:
                    opts["relay_port"] = _free_port()
                start = time.perf_counter()
                step = meshplan.distribute(ex.step, mesh={"dp": args.ranks}, launcher="k8s",
                                           k8s=opts, telemetry=False, timeout_s=120)
                with step:
                    step(*ex.batch(0))
                    first = time.perf_counter() - start
                    times = []
                    for i in range(1, args.steps + 1):
                        t = time.perf_counter()
                        step(*ex.batch(i))
                        times.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    step.state_dict()
                    state = time.perf_counter() - t
                rows[reach].append((first, statistics.median(times), state))
                median = rows[reach][-1][1]
                print(f"{reach:>12}: first step {first:6.2f} s  step {median * 1e3:6.1f} ms  "
                      f"state_dict {state * 1e3:6.1f} ms", flush=True)
    direct = statistics.median(r[1] for r in rows["direct"])
    relayed = statistics.median(r[1] for r in rows["port-forward"])
    print(f"step through the relays / direct: {relayed / direct:.3f}x "
          f"({args.ranks} ranks in {args.pods} pods, medians over {args.rounds} rounds)")


if __name__ == "__main__":
    main()
