"""``meshplan.distribute``: the user's step, run by one controller on a process mesh.

The first call traces the step (``meshplan.trace``), plans it (or loads ``plan=PATH``), starts
the workers, and ships each rank the plan and only its own pieces of the state. Every call then
splits the batch as the plan lays out the data inputs, runs one step on every rank and returns
the results as ordinary tensors on the controller.

Before the optimizer holds state, the controller gives it the zeros its first step would
create (Adam, AdamW, SGD without dampening: the steady step from them IS the first step), so
the mesh runs from the first call. Other optimizers take their first step on the controller
through the traced first-step graph, exactly as one process would.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .._errors import RuntimeFailure
from ..backends import assemble, rank_coords, split_inputs
from ..frontend import trace
from ..frontend._traced import _pack
from ..ir import OutputKind, Role
from ..planner import Plan, plan_graph
from ._launch import LocalLauncher, Workers

logger = logging.getLogger(__name__)

_HANDLERS = "meshplan.runtime._handlers"
_STATE_ROLES = (Role.PARAM, Role.BUFFER, Role.OPT_STATE, Role.GRAD)


class DistributedStep:
    """A training step bound to a mesh; see ``distribute``."""

    def __init__(self, fn: Callable[..., Any], *, mesh: Mapping[str, int], launcher: str,
                 topology: Any, strategy: str, plan: str | Plan | None,
                 example_inputs: Any, memory_limit_bytes: int | None, timeout_s: float) -> None:
        if launcher != "local":
            raise RuntimeFailure(f"launcher {launcher!r} is not available yet; use "
                                 "launcher='local'")
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.mesh = dict(mesh)
        self.topology = topology or "cpu"
        self.strategy = strategy
        self.example_inputs = example_inputs
        self.memory_limit_bytes = memory_limit_bytes
        self.timeout_s = timeout_s
        self._plan_arg = plan
        self._plan: Plan | None = None
        self._traced = None
        self._workers: Workers | None = None
        self.last_comm: list[list[dict[str, Any]]] = []

    # ---- the public surface --------------------------------------------------------------------

    @property
    def plan(self) -> Plan:
        if self._plan is None:
            if self.example_inputs is None:
                raise RuntimeFailure(f"{self.__name__}: no plan yet; call the step once or pass "
                                     "example_inputs= to distribute")
            ex = self.example_inputs() if callable(self.example_inputs) else self.example_inputs
            self._prepare(tuple(ex))
        assert self._plan is not None
        return self._plan

    def __call__(self, *args: Any) -> Any:
        if self._traced is None:
            self._prepare(args)
        traced = self._traced
        if not self._has_opt_state() and not self._zero_state():
            logger.info("meshplan: first step (creates optimizer state) runs on the controller")
            return traced(*args)
        if self._workers is None:
            self._launch()
        return self._step(args)

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """The whole model and optimizer state, gathered from every rank:
        ``{"model": {name: tensor}, "optim": {name: tensor}}`` (names as the plan's inputs)."""
        values = self._gather_state() if self._workers is not None else self._local_state()
        roles = {n.target: n.meta.role for n in self.plan.graph.inputs}
        out: dict[str, dict[str, torch.Tensor]] = {"model": {}, "optim": {}}
        for name, t in values.items():
            out["optim" if roles.get(name) is Role.OPT_STATE else "model"][name] = t
        return out

    def load_state_dict(self, sd: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Scatter a state dict from ``state_dict()`` to every rank (each gets its pieces)."""
        values = {**sd.get("model", {}), **sd.get("optim", {})}
        if self._workers is None:
            self._write_local(values)
            return
        plan = self.plan
        for rank in range(self._workers.n):
            pieces = split_inputs(plan, rank, values)
            names = sorted(pieces)
            self._workers.send(rank, "set_state", {"names": names}, [pieces[n] for n in names])
        self._workers.gather("set_state", self.timeout_s)

    def sync(self) -> None:
        """Write the mesh's state back into the live model and optimizer on the controller."""
        if self._workers is not None:
            self._write_local(self._gather_state())

    def shutdown(self) -> None:
        if self._workers is not None:
            self._workers.shutdown()
            self._workers = None

    def __enter__(self) -> DistributedStep:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "running" if self._workers is not None else "idle"
        return f"DistributedStep({self.__name__}, mesh={self.mesh}, {state})"

    # ---- internals ---------------------------------------------------------------------------

    def _prepare(self, args: tuple) -> None:
        self._traced = trace(self.fn, *args)
        if isinstance(self._plan_arg, Plan):
            self._plan = self._plan_arg
        elif self._plan_arg is not None:
            self._plan = Plan.load(self._plan_arg)
        if self._plan is not None:     # a saved plan: for this step, this mesh, this torch?
            self._plan.check_compatible(graph=self._traced.graph, mesh=self.mesh)
        else:
            self._plan = plan_graph(self._traced.graph, self.mesh, topology=self.topology,
                                    strategy=self.strategy,
                                    memory_limit_bytes=self.memory_limit_bytes)

    def _has_opt_state(self) -> bool:
        graph = self.plan.graph
        return (not graph.inputs_with_role(Role.OPT_STATE)
                or any(opt.state for _, opt in self._traced.inventory.optimizers))

    def _zero_state(self) -> bool:
        """Give the optimizers the state their first step would create, when the steady step
        from it is exactly that first step: Adam and AdamW create zeros (and step 0) and run
        their usual update; SGD's first step copies the gradient into the momentum buffer,
        which the steady update from a zero buffer reproduces only without dampening.
        Returns False (the first step then runs on the controller) otherwise."""
        for _, opt in self._traced.inventory.optimizers:
            exact = isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)) or (
                isinstance(opt, torch.optim.SGD)
                and all(g.get("dampening", 0) == 0 for g in opt.param_groups))
            if not exact:
                return False
        zeros = {n.target: torch.zeros(n.meta.shape, dtype=getattr(torch, n.meta.dtype))
                 for n in self.plan.graph.inputs_with_role(Role.OPT_STATE)}
        self._write_local(zeros)
        return True

    def _state_names(self) -> list[str]:
        return [n.target for n in self.plan.graph.inputs if n.meta.role in _STATE_ROLES]

    def _local_state(self) -> dict[str, torch.Tensor]:
        values = self._traced.input_values(*self._example_data())
        return {k: values[k].detach().clone() for k in self._state_names() if k in values}

    def _example_data(self) -> tuple:
        ex = self.example_inputs
        if ex is None:     # state only: data inputs are not read
            return tuple(torch.empty(n.meta.shape, dtype=getattr(torch, n.meta.dtype))
                         for n in self.plan.graph.inputs_with_role(Role.DATA))
        return tuple(ex() if callable(ex) else ex)

    def _launch(self) -> None:
        plan = self.plan
        world = math.prod(plan.mesh.sizes)
        state = self._local_state()
        data = [n.target for n in plan.graph.inputs_with_role(Role.DATA)]
        self._workers = LocalLauncher().launch(world, env={"MESHPLAN_WORKER_PLUGINS": _HANDLERS})
        text = plan.to_json()
        for rank in range(world):
            pieces = split_inputs(plan, rank, state)
            names = sorted(pieces)
            self._workers.send(rank, "setup", {"plan": text, "state": names, "data": data,
                                               "timeout_s": self.timeout_s},
                               [pieces[n] for n in names])
        self._workers.gather("setup", self.timeout_s)

    def _step(self, args: tuple) -> Any:
        plan, workers = self.plan, self._workers
        assert workers is not None
        names = [n.target for n in plan.graph.inputs_with_role(Role.DATA)]
        flat = self._traced_args(args)
        if len(flat) != len(names):
            raise RuntimeFailure(f"{self.__name__}: expected {len(names)} tensor arguments "
                                 f"({', '.join(names)}), got {len(flat)}")
        batch = dict(zip(names, flat))
        for rank in range(workers.n):
            pieces = split_inputs(plan, rank, batch)
            workers.send(rank, "step", {}, [pieces[n] for n in names])
        replies = workers.gather("step", self.timeout_s)
        self.last_comm = [list(r.header["comm"]) for r in replies]
        results = list(replies[0].tensors)
        return _pack(plan.graph.info.result, results)

    def _traced_args(self, args: tuple) -> list[torch.Tensor]:
        from ..frontend._traced import _Args
        return list(_Args.of(args).tensors)

    def _gather_state(self) -> dict[str, torch.Tensor]:
        workers, plan = self._workers, self.plan
        assert workers is not None
        workers.broadcast("get_state")
        replies = workers.gather("get_state", self.timeout_s)
        sizes = plan.mesh.sizes
        pieces = [(rank_coords(rank, sizes), dict(zip(msg.header["names"], msg.tensors)))
                  for rank, msg in enumerate(replies)]
        return {name: assemble({c: held[name] for c, held in pieces},
                               plan.input_layouts[name], sizes)
                for name in replies[0].header["names"]}

    def _write_local(self, values: Mapping[str, torch.Tensor]) -> None:
        traced = self._traced
        inputs = traced.input_values(*self._example_data())
        outs = {o.name: o for o in self.plan.graph.outputs if o.kind is OutputKind.STATE}
        for name, value in values.items():
            role = outs[name].role if name in outs else None
            traced._write(name, role, value, inputs)


def distribute(fn: Callable[..., Any] | None = None, *, mesh: Mapping[str, int],
               launcher: str = "local", topology: Any = None, strategy: str = "auto",
               plan: str | Plan | None = None, example_inputs: Any = None,
               memory_limit_bytes: int | None = None, timeout_s: float = 300.0) -> Any:
    """Run ``fn`` (an ordinary training step: forward, ``loss.backward()``, ``opt.step()``)
    on a mesh of processes, e.g. ``@meshplan.distribute(mesh={"dp": 2, "tp": 2})``.

    ``strategy``: ``"auto"`` (the planner's search) or a hand family (``"dp"``, ``"fsdp"``,
    ``"megatron_tp"``); ``plan``: a saved plan (path) or a ``Plan`` to run instead of
    planning; ``topology``: the cost model's machine (default ``"cpu"``); ``timeout_s``: how
    long any rank may take to answer before the run is stopped with ``RuntimeFailure``.
    """
    def wrap(f: Callable[..., Any]) -> DistributedStep:
        return DistributedStep(f, mesh=mesh, launcher=launcher, topology=topology,
                               strategy=strategy, plan=plan, example_inputs=example_inputs,
                               memory_limit_bytes=memory_limit_bytes, timeout_s=timeout_s)

    return wrap(fn) if fn is not None else wrap
