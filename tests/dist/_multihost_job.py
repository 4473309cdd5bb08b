"""Run by ``test_sandbox.py`` as the controller inside a sandbox (``meshplan sandbox run``):
the example GPT under ``launcher="mpi"`` on ``$MESHPLAN_HOSTS``, next to one process.

    python _multihost_job.py MESH_JSON STRATEGY DB STEPS [LAUNCHER [OPTIONS_JSON]]
                                    (OPTIONS_JSON: slurm= or k8s=, by LAUNCHER,
                                     and "distribute": more distribute() options,
                                     "faults": $MESHPLAN_TEST_FAULTS for _faults.py)
    python _multihost_job.py cut RESULT   (see ``cut``)
    python _multihost_job.py unreachable RESULT
    python _multihost_job.py lose RESULT            (see ``lose``)
    python _multihost_job.py lose-only-host RESULT  (see ``lose_only_host``)
    python _multihost_job.py die RESULT             (slurm: a rank is killed; see ``die``)
    python _multihost_job.py hold                   (slurm: one step, ``ready``, then sleep)
    python _multihost_job.py refused MESH SLURM RESULT  (slurm: the launch's error)
    python _multihost_job.py transfer               (see ``transfer_between_hosts``)

Prints one JSON line: the mesh's and one process's losses, the largest parameter difference
after the steps, and the host of every rank as telemetry recorded it.
"""

from __future__ import annotations

import json
import sys

import torch

import meshplan
from meshplan.examples import gpt
from meshplan.telemetry import Store


def cut(result: str, launcher: str = "mpi") -> None:
    """Two steps, then ``cut-now`` on stdout; after a line on stdin (the test has cut a host's
    link), one more step, whose failure is written to ``result`` as JSON."""
    import time

    from meshplan._errors import RuntimeFailure

    ex = gpt.build(seed=0)
    more = {"slurm": {"nodes": 2}} if launcher == "slurm" else {}
    # without fault tolerance (on by default): the failure itself is what the test reads
    step = meshplan.distribute(ex.step, mesh={"dp": 4}, launcher=launcher, strategy="dp",
                               telemetry=False, timeout_s=120, fault_tolerance=False, **more)
    out: dict = {"type": None}
    with step:
        for i in range(2):
            step(*ex.batch(i))
        print("cut-now", flush=True)
        sys.stdin.readline()
        t0 = time.monotonic()
        try:
            step(*ex.batch(2))
        except RuntimeFailure as exc:
            out = {"type": type(exc).__name__, "reason": getattr(exc, "reason", None),
                   "hosts": list(getattr(exc, "hosts", ())), "message": str(exc),
                   "after_s": time.monotonic() - t0}
    with open(result, "w") as f:
        json.dump(out, f)


def lose(result: str, launcher: str = "mpi") -> None:
    """``fault_tolerance=True, elastic=True`` on dp4 FSDP over three hosts of 2 slots
    (``hosts=h0:2,h1:2,h2:2``: h2 is a spare; under slurm, ``slurm={"nodes": 2,
    "spare_nodes": 1}``: a third node of the allocation is). ``cut-now`` on stdout before step 2 and again
    before step 4; after a line on stdin each time (the test has cut h1's link, then h2's),
    the run goes on: six steps. Next to it, the same run on h0 and h1 without a fault (four
    steps, and its state after them) and one process (six steps). As JSON in ``result``: the
    losses, whether the first four steps and the state after them equal the fault-free run's,
    the largest parameter difference from one process after six, and the mesh, hosts and
    restarts after each cut."""
    import os
    import socket

    names = os.environ.get("MESHPLAN_HOSTS", "").split(",")

    def run(steps: int, cuts: tuple[int, ...] = (), **more):
        ex = gpt.build(optimizer="adamw", clip=1.0)
        step = meshplan.distribute(ex.step, mesh={"dp": 4}, launcher=launcher,
                                   strategy="fsdp", telemetry=False, timeout_s=120, **more)
        losses, sd, after = [], None, []
        with step:
            for i in range(steps):
                if i in cuts:
                    print("cut-now", flush=True)
                    sys.stdin.readline()
                losses.append(step(*ex.batch(i)).detach())
                if i + 1 in cuts or i + 1 == steps:
                    after.append({"mesh": step.mesh, "restarts": step.restarts,
                                  "hosts": list(step._workers.hostnames)})
                if i == 3:
                    sd = step.state_dict()
            step.sync()                    # the live model holds the mesh's state
        return ex, losses, sd, after

    if launcher == "slurm":
        _, want, want_sd, _ = run(4, slurm={"nodes": 2})
        ex, got, sd, after = run(6, (2, 4), slurm={"nodes": 2, "spare_nodes": 1},
                                 fault_tolerance=True, elastic=True)
    else:
        _, want, want_sd, _ = run(4, hosts=[f"{h}:2" for h in names[:2]])
        ex, got, sd, after = run(6, (2, 4), hosts=[f"{h}:2" for h in names],
                                 fault_tolerance=True, elastic=True)
    ref = gpt.build(optimizer="adamw", clip=1.0)
    one = [float(ref.step(*ref.batch(i)).detach()) for i in range(6)]
    equal = all(torch.equal(a, b) for a, b in zip(got[:4], want)) and all(
        torch.equal(sd["model"][k], v) for k, v in want_sd["model"].items()) and all(
        torch.equal(sd["optim"]["state"][i][k], v)
        for i, e in want_sd["optim"]["state"].items() for k, v in e.items())
    out = {"got": [float(x) for x in got], "one": one, "equal_first_four": equal,
           "after": after, "controller": socket.gethostname(),
           "param_diff": max(float((p - q).detach().abs().max()) for p, q in
                             zip(ex.model.parameters(), ref.model.parameters()))}
    with open(result, "w") as f:
        json.dump(out, f)


def lose_only_host(result: str) -> None:
    """``fault_tolerance=True`` on dp4 FSDP with ``hosts=h0:4,h1:4``: every rank on h0, h1 a
    spare, so h0 is the one host of keepers and the controller holds the copies of its
    ranks' snapshots. ``cut-now`` on stdout before step 2; after a line on stdin (the test
    has cut h0's link) the run goes on on h1: four steps. Next to it, the same run on h0
    without a fault. As JSON in ``result``: whether the losses and the state after four
    steps are equal, and the hosts and restarts after the cut."""
    import os

    names = os.environ.get("MESHPLAN_HOSTS", "").split(",")

    def run(cut: int | None, hosts: list[str], **more):
        ex = gpt.build(optimizer="adamw", clip=1.0)
        step = meshplan.distribute(ex.step, mesh={"dp": 4}, launcher="mpi", hosts=hosts,
                                   strategy="fsdp", telemetry=False, timeout_s=120, **more)
        losses = []
        with step:
            for i in range(4):
                if i == cut:
                    print("cut-now", flush=True)
                    sys.stdin.readline()
                losses.append(step(*ex.batch(i)).detach())
            after = {"restarts": step.restarts, "hosts": list(step._workers.hostnames)}
            sd = step.state_dict()
        return losses, sd, after

    want, want_sd, _ = run(None, [f"{names[0]}:4"])
    got, sd, after = run(2, [f"{h}:4" for h in names[:2]], fault_tolerance=True)
    equal = all(torch.equal(a, b) for a, b in zip(got, want)) and all(
        torch.equal(sd["model"][k], v) for k, v in want_sd["model"].items()) and all(
        torch.equal(sd["optim"]["state"][i][k], v)
        for i, e in want_sd["optim"]["state"].items() for k, v in e.items())
    with open(result, "w") as f:
        json.dump({"equal": equal, "after": after, "got": [float(x) for x in got],
                   "want": [float(x) for x in want]}, f)


def unreachable(result: str) -> None:
    """A host list with an address nobody holds beside the first sandbox host: the error,
    as JSON in ``result``."""
    import os

    from meshplan._errors import RuntimeFailure

    ex = gpt.build(seed=0)
    hosts = os.environ["MESHPLAN_HOSTS"].split(",")[:1] + ["10.213.0.99"]
    step = meshplan.distribute(ex.step, mesh={"dp": 2}, launcher="mpi", strategy="dp",
                               telemetry=False, hosts=hosts, timeout_s=60)
    out: dict = {"type": None}
    try:
        step(*ex.batch(0))
    except RuntimeFailure as exc:
        out = {"type": type(exc).__name__, "message": str(exc)}
    with open(result, "w") as f:
        json.dump(out, f)


def _failure(exc: BaseException, t0: float) -> dict:
    import time

    return {"type": type(exc).__name__, "reason": getattr(exc, "reason", None),
            "hosts": list(getattr(exc, "hosts", ())), "ranks": list(getattr(exc, "ranks", ())),
            "exit_code": getattr(exc, "exit_code", None), "message": str(exc),
            "after_s": time.monotonic() - t0}


def die(result: str) -> None:
    """Under the slurm launcher, in the allocation it runs in: one step, then rank 3 is
    killed (SIGKILL) and the next step's failure goes to ``result``."""
    import os
    import signal
    import time

    from meshplan._errors import RuntimeFailure

    ex = gpt.build(seed=0)
    step = meshplan.distribute(ex.step, mesh={"dp": 4}, launcher="slurm", strategy="dp",
                               telemetry=False, timeout_s=60, fault_tolerance=False)
    out: dict = {"type": None}
    with step:
        step(*ex.batch(0))
        out["hostnames"] = list(step._workers.hostnames)
        os.kill(step._workers.pids[3], signal.SIGKILL)
        t0 = time.monotonic()
        try:
            step(*ex.batch(1))
        except RuntimeFailure as exc:
            out.update(_failure(exc, t0))
    with open(result, "w") as f:
        json.dump(out, f)


def hold() -> None:
    import time

    ex = gpt.build(seed=0)
    step = meshplan.distribute(ex.step, mesh={"dp": 4}, launcher="slurm", strategy="dp",
                               telemetry=False, timeout_s=60, slurm={"nodes": 2})
    step(*ex.batch(0))
    print("ready", " ".join(map(str, step._workers.pids)), flush=True)
    time.sleep(300)


def refused(mesh: str, slurm: str, result: str) -> None:
    import time

    from meshplan._errors import RuntimeFailure

    ex = gpt.build(seed=0)
    out: dict = {"type": None}
    t0 = time.monotonic()
    try:
        step = meshplan.distribute(ex.step, mesh=json.loads(mesh), launcher="slurm",
                                   strategy="dp", telemetry=False, timeout_s=60,
                                   slurm=json.loads(slurm))
        with step:
            step(*ex.batch(0))
    except RuntimeFailure as exc:
        out = _failure(exc, t0)
    with open(result, "w") as f:
        json.dump(out, f)


def transfer_between_hosts() -> None:
    """Two meshes of 2 ranks under mpi, an FSDP trainer on the first host of
    ``$MESHPLAN_HOSTS`` and a Megatron-style one on the second, each its own mpiexec world:
    the trainer's model copied into the other by ``method="tcp"`` (what ranks of slurm or k8s
    use), read over the sandbox's network. Prints the report and whether every tensor
    arrived bit for bit."""
    import os

    h0, h1 = os.environ["MESHPLAN_HOSTS"].split(",")[:2]
    ex, other = gpt.build(seed=0), gpt.build(seed=1)
    src = meshplan.distribute(ex.step, mesh={"dp": 2}, strategy="fsdp", launcher="mpi",
                              hosts=f"{h0}:2", telemetry=False, timeout_s=120)
    dst = meshplan.distribute(other.step, mesh={"tp": 2}, strategy="megatron_tp",
                              launcher="mpi", hosts=f"{h1}:2", telemetry=False, timeout_s=120)
    with src, dst:
        src(*ex.batch(0))
        dst(*other.batch(0))
        before = dst.state_dict()["model"]
        report = meshplan.transfer(src, dst, method="tcp")
        want, got = src.state_dict()["model"], dst.state_dict()["model"]
        hosts = [list(src._workers.hostnames), list(dst._workers.hostnames)]
    print(json.dumps({"method": report.method, "controller_bytes": report.controller_bytes,
                      "nbytes": report.nbytes, "hosts": hosts,
                      "equal": sorted(got) == sorted(want) and
                      all(torch.equal(got[k], want[k]) for k in want),
                      "changed": any(not torch.equal(before[k], want[k]) for k in want)}))


def main() -> None:
    if sys.argv[1] == "transfer":
        return transfer_between_hosts()
    if sys.argv[1] == "cut":
        return cut(*sys.argv[2:4])
    if sys.argv[1] == "unreachable":
        return unreachable(sys.argv[2])
    if sys.argv[1] == "lose":
        return lose(*sys.argv[2:4])
    if sys.argv[1] == "lose-only-host":
        return lose_only_host(sys.argv[2])
    if sys.argv[1] == "die":
        return die(sys.argv[2])
    if sys.argv[1] == "hold":
        return hold()
    if sys.argv[1] == "refused":
        return refused(*sys.argv[2:5])
    mesh, strategy, db, steps = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    launcher = sys.argv[5] if len(sys.argv) > 5 else "mpi"
    options = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
    if "faults" in options:
        import os

        os.environ["MESHPLAN_TEST_FAULTS"] = json.dumps(options.pop("faults"))
    more = options.pop("distribute", {})
    slurm = options if launcher == "slurm" else None
    k8s = options if launcher == "k8s" else None
    ex, ref = gpt.build(seed=0), gpt.build(seed=0)
    step = meshplan.distribute(ex.step, mesh=mesh, launcher=launcher, strategy=strategy,
                               telemetry=db, timeout_s=120, slurm=slurm, k8s=k8s, **more)
    got, want, pids = [], [], set()
    with step:
        for i in range(steps):
            got.append(float(step(*ex.batch(i)).detach()))
            want.append(float(ref.step(*ref.batch(i)).detach()))
            pids.update(step._workers.pids)
        step.sync()
        run = step.run_id
        files = step._ft.files if step._ft is not None else None
        keepers = getattr(files, "keepers", None)
        extra = {"restarts": step.restarts, "keeper_hosts": list(getattr(files, "hosts", ())),
                 "pids": sorted(pids | set(keepers.pids if keepers else ()))}
    diff = max(float((p - q).abs().max()) for p, q in zip(ex.model.parameters(),
                                                          ref.model.parameters()))
    with Store.open(db) as store:
        # DISTINCT: a rank started again (fault_tolerance=True) has a row per process
        hosts = store.sql(f"SELECT DISTINCT rank, host FROM ranks WHERE run_id = '{run}' "
                          "AND rank >= 0 ORDER BY rank").column("host").to_pylist()
        failed = [[r["rank"], r["kind"]] for r in store.sql(
            f"SELECT rank, kind FROM failures WHERE run_id = '{run}' AND kind <> 'snapshot' "
            "ORDER BY time_us, rank").to_pylist()]
    print(json.dumps({"got": got, "want": want, "param_diff": diff, "hosts": hosts,
                      "failed": failed,
                      "controller": __import__("socket").gethostname(), **extra}))


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
