"""A Kubernetes pod's entry (``python -m meshplan.runtime._k8s_pod``, the container command of
``_k8s.manifests``): start this pod's ranks and stay until they end.

The pod's index is ``$JOB_COMPLETION_INDEX`` (an Indexed Job sets it); its ranks are ``index x
$MESHPLAN_RANKS_PER_POD + local rank``. Each rank is a worker process (``_worker``), started as
the local launcher starts one: the channel key on its stdin (read here from the Secret mounted
at ``$MESHPLAN_SECRET_FILE``; it never enters argv or the environment), this process as its
parent (a worker exits when its stdin closes, so the ranks never outlive the pod's entry).
The workers connect to the controller themselves (``$MESHPLAN_CONTROLLER``, CURVE over TCP);
they send heartbeats, as ranks on another host than the controller do.

Exit: the first rank to exit non-zero ends the others and the pod, with its code (the Job's
``podFailurePolicy`` fails the Job on it; the controller has already seen the rank go); a
SIGTERM (the pod deleted, evicted, or its node drained) is passed to every rank and the pod
ends with 143 (``TERMINATED``) whatever the ranks did with it (under fault tolerance the Job
makes a pod in its place: ``_k8s.manifests``); 0 when every rank ended with 0.

With ``$MESHPLAN_RELAY_PORT`` (``k8s={"reach": "port-forward"}``: the controller is outside
the cluster) it first runs the pod's relay (``_k8s_relay.py``) and waits until the
controller, through a port-forward, has exposed its channel and store there; the ranks connect
to those pod-local ports.

With fault tolerance (``$MESHPLAN_POD_AGENT`` = 1) it starts one process instead, the pod's
agent (``_k8s_agent.py``: rank = the pod's index in a "mesh" of pods), which holds the pod's
snapshots and starts its ranks when the controller says so; the pod ends with the agent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from ._k8s import AGENT_PLUGINS, ENV_AGENT, ENV_RANKS_PER_POD, ENV_SECRET_FILE, TERMINATED
from ._k8s_relay import ENV_PORT_SHIFT, ENV_RELAY_PORT, Relay

RELAY_WAIT_S = 600.0       # for the controller to come through the relay


def _fail(message: str, code: int = 2) -> int:
    print(f"meshplan pod: {message}", file=sys.stderr, flush=True)
    return code


def main() -> int:
    env = os.environ
    try:
        index = int(env["JOB_COMPLETION_INDEX"])
        per = int(env[ENV_RANKS_PER_POD])
        world = int(env["MESHPLAN_WORLD_SIZE"])
        with open(env[ENV_SECRET_FILE], "rb") as f:
            key = f.read().strip()
    except KeyError as exc:
        return _fail(f"${exc.args[0]} is not set; this entry runs in a pod of the Job "
                     "that meshplan made (an Indexed Job sets JOB_COMPLETION_INDEX)")
    except (ValueError, OSError) as exc:
        return _fail(f"bad start ({exc}); the pod must mount the run's Secret and set the "
                     "variables of its manifest")
    first = index * per
    if index < 0 or per < 1 or first + per > world:
        return _fail(f"pod index {index} x {per} ranks per pod does not fit a mesh of {world} "
                     "ranks")
    procs: list[subprocess.Popen] = []
    agent = env.get(ENV_AGENT) == "1"
    terminated = []

    def stop(signum: int, _frame: object) -> None:
        terminated.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)
    signal.signal(signal.SIGTERM, stop)      # (PID 1 in a container: no default action)
    relay = None
    if env.get(ENV_RELAY_PORT):        # the controller is outside: it comes through a relay
        try:
            port = int(env[ENV_RELAY_PORT]) + int(env.get(ENV_PORT_SHIFT) or 0)
            relay = Relay(key, port)
            deadline = time.monotonic() + RELAY_WAIT_S
            while not terminated:
                try:
                    ports = relay.exposed(["channel", "store"], 0.5)
                    break
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise
            if terminated:
                return TERMINATED
        except (OSError, ValueError, TimeoutError) as exc:
            return _fail(f"the relay for the controller outside the cluster: {exc}")
        env = dict(env, MESHPLAN_CONTROLLER=f"tcp://127.0.0.1:{ports['channel']}",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports["store"]))
    for local in range(1 if agent else per):
        rank = first + local
        child = dict(env, MESHPLAN_RANK=str(rank), RANK=str(rank), LOCAL_RANK=str(local),
                     MESHPLAN_PARENT_PID=str(os.getpid()), MESHPLAN_PDEATHSIG="1")
        child.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // per)))
        if agent:                  # one per pod: the pods are its mesh
            pods = -(-world // per)
            child.update(MESHPLAN_RANK=str(index), RANK=str(index), LOCAL_RANK="0",
                         MESHPLAN_WORLD_SIZE=str(pods), WORLD_SIZE=str(pods),
                         MESHPLAN_WORKER_PLUGINS=AGENT_PLUGINS)
        proc = subprocess.Popen([sys.executable, "-m", "meshplan.runtime._worker"],
                                stdin=subprocess.PIPE, env=child, close_fds=True)
        assert proc.stdin is not None
        try:
            proc.stdin.write(key + b"\n")
            proc.stdin.flush()
        except BrokenPipeError:
            pass
        procs.append(proc)
    code = 0
    while procs:
        for p in list(procs):
            rc = p.poll()
            if rc is None:
                continue
            procs.remove(p)
            if rc != 0 and code == 0:
                code = rc if rc > 0 else 128 - rc        # a signal: the shell's convention
                for other in procs:
                    if other.poll() is None:
                        other.terminate()
        time.sleep(0.05)
    return TERMINATED if terminated else code


if __name__ == "__main__":
    sys.exit(main())
