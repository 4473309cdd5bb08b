"""A pod's agent under ``launcher="k8s"`` with fault tolerance: the one process of the pod that
lives for the whole run, a worker plugin (``MESHPLAN_WORKER_PLUGINS``) beside the snapshot
keeper's (``_keepers.py``).

Without fault tolerance a pod's entry (``_k8s_pod.py``) starts its ranks and ends with the
first that fails. With it, the entry starts this agent instead, which connects to the
controller on a channel of its own (the pods' channel, keyed by the run's Secret) and

- keeps its pod's ranks' snapshot files in memory (``keep_open``...: it is the pod's keeper,
  so a rank's snapshot outlives the rank's process);
- starts the pod's ranks when the controller says so (``pod_start``: every rank of a fresh
  mesh, or one rank replacing a dead one), on the ranks' channel the controller names, with
  that channel's key on each rank's stdin (never in argv or the environment); the ranks are
  its children (a rank exits when its stdin closes: they never outlive the agent);
- tells the controller how its ranks are (``pod_poll``: exited with a code, stopped, or
  running), which a controller on another host cannot see for itself;
- kills ranks (``pod_kill``), before a replacement is started or when the mesh stops;
- keeps a warm spare (``pod_spare``, once the launch's ranks are set up): a worker of the
  launch started ahead, torch imported, at nice 19, waiting to be told its rank; a
  replacement rank then costs no start-up (as the local launcher's spare).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import torch

from ._channel import (
    ENV_ADDRESS,
    ENV_PARENT_PID,
    ENV_PDEATHSIG,
    ENV_PLUGINS,
    ENV_RANK,
    ENV_RUN_ID,
    ENV_WORLD_SIZE,
)
from ._launch import _close_pipes
from ._worker import WorkerState, register

__all__: list[str] = []     # handlers only; its name is in _k8s.AGENT_PLUGINS
_KILL_WAIT_S = 5.0


def _procs(state: WorkerState) -> dict[int, subprocess.Popen]:
    if not hasattr(state.ns, "ranks"):
        state.ns.ranks = {}
    return state.ns.ranks


def _code(proc: subprocess.Popen) -> int | None:
    """The rank's exit code as a shell tells it (128 + signal for a signal), or None."""
    rc = proc.poll()
    return None if rc is None else (rc if rc >= 0 else 128 - rc)


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()                       # SIGKILL ends a stopped process too
    try:
        proc.wait(_KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        pass
    _close_pipes([proc])


def _spawn(header: dict[str, Any], rank: int | None) -> subprocess.Popen:
    """A worker of the launch ``header`` describes (``pod_start``): rank ``rank``, or with
    None a spare that waits to be told its rank."""
    world, per = int(header["world"]), max(1, int(header["per"]))
    store_host, store_port = header["store"]
    env = {k: v for k, v in os.environ.items() if k != ENV_PLUGINS}
    env.update({str(k): str(v) for k, v in header.get("env", {}).items()})
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // per)))
    env.update({ENV_WORLD_SIZE: str(world), "WORLD_SIZE": str(world),
                ENV_ADDRESS: str(header["address"]), ENV_RUN_ID: str(header["run_id"]),
                "MASTER_ADDR": str(store_host), "MASTER_PORT": str(store_port),
                ENV_PARENT_PID: str(os.getpid()), ENV_PDEATHSIG: "1"})
    if rank is None:
        env["MESHPLAN_SPARE"] = "1"
    else:
        env.update({ENV_RANK: str(rank), "RANK": str(rank), "LOCAL_RANK": str(rank % per)})
    proc = subprocess.Popen([sys.executable, "-m", "meshplan.runtime._worker"],
                            stdin=subprocess.PIPE, env=env, close_fds=True)
    _tell(proc, str(header["key"]))
    return proc


def _tell(proc: subprocess.Popen, line: str) -> bool:
    assert proc.stdin is not None
    try:
        proc.stdin.write(line.encode() + b"\n")
        proc.stdin.flush()
        return True
    except (BrokenPipeError, ValueError):
        return False                      # it died: its poll says so


@register("pod_start")
def _pod_start(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    """Start ``ranks`` (killing any process still running as one of them) as workers of the
    ranks' channel ``address`` / ``run_id`` (key ``key``, hex) for a mesh of ``world`` ranks,
    rendezvous at ``store``, with ``env`` (the launch's variables, the worker plugins); a
    warm spare of this launch (``pod_spare``) takes the first of them where one is ready."""
    procs = _procs(state)
    spare, run = getattr(state.ns, "spare", None), str(header["run_id"])
    if spare is not None and (spare[1] != run or spare[0].poll() is not None):
        _kill(spare[0])                   # another launch's: its channel is gone
        spare = None
    state.ns.spare = None
    pids = {}
    for rank in (int(r) for r in header["ranks"]):
        old = procs.pop(rank, None)
        if old is not None:
            _kill(old)
        if spare is not None and _tell(spare[0], f"{rank} {rank % int(header['per'])}"):
            procs[rank], spare = spare[0], None
        else:
            procs[rank] = _spawn(header, rank)
        pids[str(rank)] = procs[rank].pid
    if spare is not None:
        _kill(spare[0])
    return {"pids": pids, "nonce": header.get("nonce")}, []


@register("pod_spare")
def _pod_spare(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    """Keep a spare of the launch ``header`` describes (as ``pod_start``'s): start one unless
    one of this launch is alive."""
    spare, run = getattr(state.ns, "spare", None), str(header["run_id"])
    if spare is None or spare[1] != run or spare[0].poll() is not None:
        if spare is not None:
            _kill(spare[0])
        state.ns.spare = (_spawn(header, None), run)
    return {"pid": state.ns.spare[0].pid, "nonce": header.get("nonce")}, []


@register("pod_poll")
def _pod_poll(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    """How each of ``ranks`` is: ``{"code": exit code or None, "stopped": bool}``."""
    procs = _procs(state)
    out = {}
    for rank in (int(r) for r in header["ranks"]):
        proc = procs.get(rank)
        if proc is None:
            out[str(rank)] = {"code": None, "stopped": False, "unknown": True}
            continue
        code = _code(proc)
        out[str(rank)] = {"code": code, "stopped": code is None and _stopped(proc.pid)}
    return {"ranks": out, "nonce": header.get("nonce")}, []


@register("pod_kill")
def _pod_kill(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    """SIGKILL ``ranks`` (every rank of the pod when not given), reap them, and say how each
    had ended (its code; 137 for the kill itself)."""
    procs = _procs(state)
    ranks = [int(r) for r in header.get("ranks", list(procs))]
    spare = getattr(state.ns, "spare", None)
    if "ranks" not in header and spare is not None:     # the mesh stops: its spare too
        _kill(spare[0])
        state.ns.spare = None
    codes = {}
    for rank in ranks:
        proc = procs.pop(rank, None)
        if proc is not None:
            _kill(proc)
            codes[str(rank)] = _code(proc)
    return {"codes": codes, "nonce": header.get("nonce")}, []

