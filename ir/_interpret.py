"""The reference interpreter: runs a graph on one process. The oracle for distributed runs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from .._errors import IRError
from ._graph import Graph, Node
from ._ops import resolve
from ._types import NodeKind, Ref, ScalarMeta, TensorMeta


def constant_tensor(node: Node, device: torch.device | str | None = None) -> torch.Tensor:
    v = node.value
    assert v is not None
    dtype = getattr(torch, v.dtype)
    if v.data is None:
        return torch.empty(v.shape, dtype=dtype, device="meta")
    t = torch.frombuffer(bytearray(v.data), dtype=dtype) if v.data else torch.empty(0, dtype=dtype)
    return t.reshape(v.shape).to(device or "cpu")


def _flatten(result: Any) -> tuple[Any, ...]:
    if isinstance(result, (tuple, list)):
        return tuple(pytree.tree_leaves(list(result), is_leaf=lambda x: x is None))
    return (result,)


def _materialize(a: Any, env: Mapping[str, tuple], device: torch.device | None) -> Any:
    if isinstance(a, Ref):
        return env[a.node][a.index]
    if isinstance(a, tuple):
        return [_materialize(x, env, device) for x in a]
    if isinstance(a, torch.device) and device is not None:
        return device
    return a


def _call(node: Node, env: Mapping[str, tuple], device: torch.device | None) -> tuple[Any, ...]:
    fn = resolve(node)
    args = [_materialize(a, env, device) for a in node.args]
    kwargs = {k: _materialize(v, env, device) for k, v in node.kwargs}
    return _flatten(fn(*args, **kwargs))


def last_uses(graph: Graph) -> dict[int, list[str]]:
    """Step index -> names of nodes whose values are dead after that step (graph outputs
    stay alive)."""
    last: dict[str, int] = {}
    for i, node in enumerate(graph.nodes):
        for r in node.refs():
            last[r.node] = i
    pinned = {o.ref.node for o in graph.outputs}
    out: dict[int, list[str]] = {}
    for name, i in last.items():
        if name not in pinned:
            out.setdefault(i, []).append(name)
    return out


def interpret(
    graph: Graph,
    inputs: Mapping[str, torch.Tensor],
    *,
    device: torch.device | str | None = None,
) -> list[Any]:
    """Run ``graph`` with ``inputs`` (input state name -> tensor); return the graph outputs in
    order. Values are freed after their last use, so peak memory follows the graph's liveness."""
    dev = torch.device(device) if device is not None else None
    env: dict[str, tuple] = {}
    free = last_uses(graph)
    with torch.no_grad():
        for i, node in enumerate(graph.nodes):
            if node.kind is NodeKind.INPUT:
                env[node.name] = (_take_input(node, inputs),)
            elif node.kind is NodeKind.CONSTANT:
                env[node.name] = (constant_tensor(node, dev),)
            else:
                env[node.name] = _call(node, env, dev)
            for name in free.get(i, ()):
                del env[name]
    return [env[o.ref.node][o.ref.index] for o in graph.outputs]


def _take_input(node: Node, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    try:
        t = inputs[node.target]
    except KeyError:
        raise IRError(f"missing graph input {node.target!r}") from None
    m = node.meta
    assert isinstance(m, TensorMeta)
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != m.shape or (
        str(t.dtype).removeprefix("torch.") != m.dtype
    ):
        got = f"{t.dtype}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise IRError(f"input {node.target!r}: expected {m.dtype}{list(m.shape)}, got {got}")
    return t


def run_node_on_meta(graph: Graph, node: Node, env: Mapping[str, tuple]) -> tuple[Any, ...]:
    """Execute one node on meta tensors (shape propagation); used by ``verify(shapes=True)``."""
    if node.kind is NodeKind.INPUT or node.kind is NodeKind.CONSTANT:
        m = node.meta
        assert isinstance(m, TensorMeta)
        return (torch.empty(m.shape, dtype=getattr(torch, m.dtype), device="meta"),)
    if node.kind is NodeKind.HOST:
        m = node.meta
        assert isinstance(m, ScalarMeta)
        return ({"float": 1.0, "int": 1, "bool": True}[m.dtype],)
    if node.target == "aten._local_scalar_dense.default":
        return ({"float": 1.0, "int": 1, "bool": True}[node.meta.dtype],)
    return _call(node, env, torch.device("meta"))
