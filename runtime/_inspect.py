"""Looking inside a running mesh: ``DistributedStep.watch`` and ``inspect`` (README, "Live
debugging").

``inspect(name, rank=None)`` answers with a tensor the ranks hold now:

- a state tensor (a ``state_dict()`` key of the model, or its internal name, such as
  ``opt.state.model.fc.weight.exp_avg`` for optimizer state): with ``rank``, that rank's piece
  as it holds it (its plan's layout); without, the whole tensor, gathered;
- a node of the plan's graph that ``watch`` named before the last step (``meshplan plan show``
  and ``explain`` list the nodes): with ``rank``, that rank's piece of its value in that step;
  without, the whole value: the pieces put together by the node's output layout (summed over a
  partial axis, as the plan would). A node the lowering runs inside a fused kernel is not made
  on its own and is refused by name, as are nodes of a pipeline's stages and of a step run in
  micro-batches (each part makes its own value).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

import torch

from .._errors import RuntimeFailure
from ..backends import assemble, rank_coords
from ..planner import Partial, ReduceOp, Replicate
from ..ir import STATE_ROLES


def _state_name(step: Any, name: str) -> str | None:
    from ..frontend._state_dict import _model_keys

    internal = {n.target for n in step.plan.graph.inputs if n.meta.role in STATE_ROLES}
    if name in internal:
        return name
    return _model_keys(step._traced_or_prepared().inventory).get(name)


def _node(step: Any, name: str) -> Any:
    from ..frontend._state_dict import _model_keys

    graph = step.plan.graph
    for node in graph.nodes:
        if node.name == name:
            return node
    keys = list(_model_keys(step._traced_or_prepared().inventory))
    internal = [n.target for n in graph.inputs if n.meta.role in STATE_ROLES]
    near = difflib.get_close_matches(name, [*keys, *internal, *(n.name for n in graph.nodes)],
                                     n=3)
    hint = f" (close: {', '.join(near)})" if near else ""
    raise RuntimeFailure(
        f"{step.__name__}: {name!r} is neither a state tensor (a key of state_dict()['model'] "
        f"or an internal name) nor a node of the plan{hint}; `meshplan plan show` lists the "
        "nodes")


def _check_nodes_runnable(step: Any, what: str) -> None:
    if step._pp:
        raise RuntimeFailure(f"{step.__name__}: {what} of a pipeline's stages is not built yet "
                             "(state tensors can be inspected)")
    if step.microbatches > 1:
        raise RuntimeFailure(f"{step.__name__}: {what} under microbatches={step.microbatches} "
                             "is not built (each part makes its own value); run without "
                             "micro-batches to look at a node's value")


def watch(step: Any, nodes: Sequence[str]) -> None:
    """From the next step on, every rank also keeps its pieces of ``nodes``' values (the
    last step's); ``watch()`` with none stops watching every node."""
    names = list(nodes)
    if names:
        _check_nodes_runnable(step, "watching nodes")
    for name in names:
        node = _node(step, name)
        if node.kind.value == "input":
            raise RuntimeFailure(
                f"{step.__name__}: {name!r} is an input of the step, not a value it computes: "
                "inspect a state tensor by its name (a state_dict() key) without watching it; "
                "the batch is the caller's")
        kernel = _in_kernel(step, name)
        if kernel:
            raise RuntimeFailure(
                f"{step.__name__}: node {name!r} runs inside the fused kernel {kernel}, which "
                "does not make it on its own; watch a node outside it, or pass kernels=False")
    step._watched = step._watched | set(names) if names else set()
    if step._workers is not None:
        step._workers.broadcast("watch", {"nodes": sorted(step._watched)})
        step._workers.gather("watch", step.timeout_s)


def _in_kernel(step: Any, name: str) -> str | None:
    """The fused kernel the lowering runs ``name`` inside (the cost model's view of it,
    ``planner/_kernel_cost.py``), or None."""
    if not step.kernels:
        return None
    from ..planner._kernel_cost import fused_kernel_of

    plan = step.plan
    return fused_kernel_of(plan.graph, plan.mesh.topology).get(name)


def inspect(step: Any, name: str, rank: int | None = None, index: int = 0) -> torch.Tensor:
    """See the module docstring."""
    workers = step._workers
    if rank is not None:
        if workers is None:
            raise RuntimeFailure(f"{step.__name__}: inspect(rank={rank}) needs a running mesh; "
                                 "call the step first")
        if not isinstance(rank, int) or not 0 <= rank < workers.n:
            raise RuntimeFailure(f"{step.__name__}: inspect(rank={rank!r}): the mesh has ranks "
                                 f"0..{workers.n - 1}")
    state = _state_name(step, name)
    if state is not None:
        if rank is None:
            return step._named_state([state])[state]
        if not step._held_by(rank, [state]):
            raise RuntimeFailure(f"{step.__name__}: rank {rank} holds no piece of {name!r} "
                                 "(another pipeline stage holds it)")
        workers.send(rank, "get_state", {"names": [state]})
        reply = workers.gather("get_state", step.timeout_s, ranks=[rank])[0]
        return reply.tensors[0]
    node = _node(step, name)
    _check_nodes_runnable(step, "inspecting a node's value")
    if name not in getattr(step, "_watched", set()):
        raise RuntimeFailure(
            f"{step.__name__}: node {name!r} is not watched: a step frees its values as it "
            f"goes; call step.watch({name!r}) and run a step, then inspect it")
    if workers is None:
        raise RuntimeFailure(f"{step.__name__}: no mesh is running; call the step first")
    n_out = len(step.plan.placement(name).outputs)
    if not 0 <= index < n_out:
        raise RuntimeFailure(f"{step.__name__}: node {name!r} has {n_out} output(s); "
                             f"index={index} is out of range")
    ranks = [rank] if rank is not None else list(range(workers.n))
    for r in ranks:
        workers.send(r, "inspect", {"node": name, "index": index})
    replies = workers.gather("inspect", step.timeout_s, ranks=ranks)
    pieces = {r: m.tensors[0] for r, m in zip(ranks, replies) if m.header.get("held")}
    if len(pieces) < len(ranks):
        missing = [r for r in ranks if r not in pieces]
        raise RuntimeFailure(
            f"{step.__name__}: node {name!r} was not made in the last step on rank(s) "
            f"{', '.join(map(str, missing))} (watched since; run a step first, or the lowering "
            f"did not run it as an op of its own: {node.target})")
    if rank is not None:
        return pieces[rank]
    layout = step.plan.placement(name).outputs[index]
    return _whole(pieces, layout, step.plan.mesh.sizes)


def _whole(pieces: dict[int, torch.Tensor], layout: Any, sizes: tuple[int, ...]
           ) -> torch.Tensor:
    """The whole value from every rank's piece: partial axes reduced first (their pieces
    combined as the plan's ``ReduceOp`` says), then the shards put together."""
    if layout is None:                    # not a tensor's layout: every rank has the value
        return pieces[0]
    parts = {rank_coords(r, sizes): t for r, t in pieces.items()}
    layout = tuple(layout)
    for axis, p in enumerate(layout):
        if not isinstance(p, Partial):
            continue
        merged = {}
        for coords, t in parts.items():
            if coords[axis] != 0:
                continue
            group = [parts[coords[:axis] + (i,) + coords[axis + 1:]] for i in range(sizes[axis])]
            stack = torch.stack([g.to(torch.float64) for g in group])
            if p.op is ReduceOp.SUM:
                v = stack.sum(0)
            elif p.op is ReduceOp.AVG:
                v = stack.mean(0)
            else:                          # NORM2: each piece is a norm of its share
                v = stack.square().sum(0).sqrt()
            merged[coords] = v.to(t.dtype)
        parts = {c: merged[c[:axis] + (0,) + c[axis + 1:]] for c in parts}
        layout = layout[:axis] + (Replicate(),) + layout[axis + 1:]
    return assemble(parts, layout, sizes)


