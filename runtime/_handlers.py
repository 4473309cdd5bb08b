"""What a worker does for the controller: set up its program and communicator from a plan,
run steps, and hand out or take in its pieces of the state. Loaded into every worker through
``MESHPLAN_WORKER_PLUGINS``."""

from __future__ import annotations

from typing import Any

import torch

from ..backends import TorchCommunicator, all_axis_groups, lower, run
from ..planner import Plan
from ._worker import WorkerState, register


@register("setup")
def _setup(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    plan = Plan.from_json(header["plan"], where="the plan the controller sent")
    ns = state.ns
    ns.plan = plan
    ns.program = lower(plan, state.rank)
    ns.state = dict(zip(header["state"], tensors))
    ns.data_names = header["data"]
    if getattr(ns, "comm", None) is None:
        ns.comm = TorchCommunicator(
            state.rank, state.world_size, all_axis_groups(plan.mesh.sizes),
            timeout_s=float(header.get("timeout_s", 300.0)),
            init_method=f"tcp://{state.master_addr}:{state.master_port}")
    return {"rank": state.rank}, []


@register("step")
def _step(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    ns = state.ns
    data = dict(zip(ns.data_names, tensors))
    ns.comm.records.clear()
    results, new_state = run(ns.program, ns.comm, ns.state, data)
    ns.state.update(new_state)
    comm = [{"kind": r.kind.value, "group": list(r.group), "nbytes": r.nbytes,
             "dur_s": r.dur_s} for r in ns.comm.records]
    if state.rank == 0:
        return {"comm": comm}, [r for r in results if isinstance(r, torch.Tensor)]
    return {"comm": comm}, []


@register("get_state")
def _get_state(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    names = sorted(state.ns.state)
    return {"names": names}, [state.ns.state[n] for n in names]


@register("set_state")
def _set_state(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    state.ns.state.update(dict(zip(header["names"], tensors)))
    return {}, []
