"""``verify(graph)``: the structural invariants every pass must keep."""

from __future__ import annotations

import torch

from .._errors import IRError
from ._graph import Graph, Node
from ._ops import HOST_FUNCTIONS, is_mutating_op, resolve_op
from ._types import STATE_ROLES, NodeKind, OutputKind, Role, ScalarMeta, TensorMeta

_RESULT_COUNTS = {"none": 0, "tensor": 1}


def verify(graph: Graph, *, shapes: bool = False) -> Graph:
    """Check the graph and return it unchanged; raise IRError naming the first broken node.

    With ``shapes=True`` every op is re-run on meta tensors and its output shapes and dtypes must
    equal the recorded metadata (slower; catches a pass that rewires a node wrongly).
    """
    seen: dict[str, Node] = {}
    input_names: dict[str, Node] = {}
    for node in graph.nodes:
        if node.name in seen:
            raise IRError(f"duplicate node name {node.name!r}")
        _check_refs(graph, node, seen)
        _check_kind(node)
        if node.kind is NodeKind.INPUT:
            if node.target in input_names:
                raise IRError(f"two inputs for state {node.target!r}: {node.name}, "
                              f"{input_names[node.target].name}")
            input_names[node.target] = node
        seen[node.name] = node
    _check_outputs(graph, seen, input_names)
    if shapes:
        _check_shapes(graph)
    return graph


def _check_refs(graph: Graph, node: Node, seen: dict[str, Node]) -> None:
    for r in node.refs():
        src = seen.get(r.node)
        if src is None:
            raise IRError(f"node {node.name} reads {r}, which is not defined before it "
                          "(nodes must be in topological order)")
        if not 0 <= r.index < len(src.outputs) or src.outputs[r.index] is None:
            raise IRError(f"node {node.name} reads {r}, which {src.name} does not produce")


def _check_kind(node: Node) -> None:
    kind, outs = node.kind, node.outputs
    if kind is NodeKind.INPUT:
        if node.args or node.kwargs or len(outs) != 1 or not isinstance(outs[0], TensorMeta):
            raise IRError(f"input {node.name} must have no arguments and one tensor output")
        if outs[0].role not in STATE_ROLES | {Role.DATA, Role.HYPER}:
            raise IRError(f"input {node.name} has role {outs[0].role.value}; inputs are "
                          "params, grads, optimizer state, buffers, data or hyperparameters")
    elif kind is NodeKind.CONSTANT:
        m, v = outs[0] if len(outs) == 1 else None, node.value
        if not isinstance(m, TensorMeta) or v is None or (m.shape, m.dtype) != (v.shape, v.dtype):
            raise IRError(f"constant {node.name}: value does not match its metadata")
        if v.data is not None and len(v.data) != m.nbytes:
            raise IRError(f"constant {node.name}: {len(v.data)} bytes for {m.nbytes} expected")
    elif kind is NodeKind.OP:
        resolve_op(node.target)
        if is_mutating_op(node.target):
            raise IRError(f"node {node.name} calls mutating op {node.target}; the IR is pure "
                          "(functionalise the graph first)")
        if not outs:
            raise IRError(f"op node {node.name} has no outputs")
    elif kind is NodeKind.HOST:
        if node.target not in HOST_FUNCTIONS:
            raise IRError(f"node {node.name}: unknown host function {node.target!r}")
        if len(outs) != 1 or not isinstance(outs[0], ScalarMeta):
            raise IRError(f"host node {node.name} must produce one scalar")


def _check_outputs(graph: Graph, seen: dict[str, Node], inputs: dict[str, Node]) -> None:
    state_names: set[str] = set()
    for o in graph.outputs:
        src = seen.get(o.ref.node)
        if src is None or not 0 <= o.ref.index < len(src.outputs):
            raise IRError(f"graph output {o.name or o.ref} reads {o.ref}, which does not exist")
        m = src.outputs[o.ref.index]
        if o.kind is OutputKind.STATE:
            if o.role not in STATE_ROLES or not o.name:
                raise IRError(f"state output {o.ref} needs a state name and a state role")
            if o.name in state_names:
                raise IRError(f"state {o.name!r} is written twice")
            state_names.add(o.name)
            old = inputs.get(o.name)
            if old is not None and isinstance(m, TensorMeta) and (
                (old.meta.shape, old.meta.dtype) != (m.shape, m.dtype)
            ):
                raise IRError(f"state {o.name!r}: new value {m.dtype}{list(m.shape)} differs "
                              f"from input {old.meta.dtype}{list(old.meta.shape)}")
    n_results = len(graph.outputs_of(OutputKind.RESULT))
    spec = graph.info.result
    expected = _RESULT_COUNTS.get(spec.kind, len(spec.keys) if spec.kind == "dict" else None)
    if expected is not None and expected != n_results:
        raise IRError(f"result spec {spec.kind} expects {expected} results, graph has {n_results}")


def _check_shapes(graph: Graph) -> None:
    from ._interpret import run_node_on_meta

    env: dict[str, tuple] = {}
    for node in graph.nodes:
        got = run_node_on_meta(graph, node, env)
        for i, (want, have) in enumerate(zip(node.outputs, got)):
            if isinstance(want, TensorMeta):
                if not isinstance(have, torch.Tensor) or (
                    tuple(have.shape), str(have.dtype).removeprefix("torch.")
                ) != (want.shape, want.dtype):
                    raise IRError(f"node {node.name} output {i}: recorded "
                                  f"{want.dtype}{list(want.shape)}, op gives {_describe(have)}")
        env[node.name] = got


def _describe(v: object) -> str:
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}"
    return type(v).__name__
