"""``split_foreach``: every ``aten._foreach_*`` node becomes per-tensor nodes, bit-identically.

Tolerance: none. The per-tensor ops are exactly the ops ATen's CPU foreach kernels (the "slow
path" of ``ForeachOpsKernels.cpp``) call element by element, on the same tensors in the same
order, so every output must be bit-equal (``torch.equal``) to the foreach graph's, both for the
traced example steps (SGD with momentum, AdamW, ``clip_grad_norm_(foreach=True)``) and for every
mapped foreach overload on its own. ``verify(shapes=True)`` holds after the pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

import meshplan
from meshplan import IRError
from meshplan.examples import cnn, gpt, mlp
from meshplan.examples._common import Example
from meshplan.frontend._traced import _Args
from meshplan.ir import (
    Graph,
    GraphInfo,
    Node,
    NodeKind,
    Output,
    OutputKind,
    Ref,
    ResultSpec,
    Role,
    TensorMeta,
    interpret,
    resolve_op,
    split_foreach,
    verify,
)
from meshplan.ir._foreach import FOREACH_TARGETS

EXAMPLES: dict[str, Callable[[], Example]] = {
    "mlp-adamw-clip": lambda: mlp.build("adamw", foreach=True, clip=0.5),
    "mlp-sgd-clip": lambda: mlp.build("sgd", foreach=True, clip=1.0),
    "gpt-layernorm-adamw-clip": lambda: gpt.build("adamw", foreach=True),
    "gpt-rmsnorm-silu-sgd": lambda: gpt.build(
        "sgd", foreach=True, clip=None, config=gpt.GPTConfig(norm="rms", activation="silu")),
    "cnn-sgd-momentum": lambda: cnn.build("sgd", foreach=True),
    "cnn-adamw-clip": lambda: cnn.build("adamw", foreach=True, clip=2.0),
}


def _traced(build: Callable[[], Example]) -> tuple[Graph, dict[str, torch.Tensor]]:
    ex = build()
    ex.step(*ex.batch(0))                     # optimizer state exists: the steady-state graph
    args = ex.batch(1)
    traced = meshplan.trace(ex.step, *args)
    return traced.graph, traced._inputs(traced.graph, _Args.of(args))


def _run(graph: Graph, inputs: dict[str, torch.Tensor]) -> list[Any]:
    # batch norm updates its running statistics in place: give each run its own copies
    return interpret(graph, {k: v.clone() for k, v in inputs.items()})


def _assert_bit_equal(before: list[Any], after: list[Any], where: str) -> None:
    assert len(before) == len(after)
    for i, (a, b) in enumerate(zip(before, after)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: output {i} differs in kind"
        assert torch.equal(a, b), f"{where}: output {i} is not bit-equal"


@pytest.mark.parametrize("case", list(EXAMPLES))
def test_split_example_is_bit_identical(case: str) -> None:
    graph, inputs = _traced(EXAMPLES[case])
    assert any(n.target.startswith("aten._foreach_") for n in graph.nodes)
    split = verify(split_foreach(graph), shapes=True)
    assert not [n.target for n in split.nodes if n.target.startswith("aten._foreach_")]
    assert [o.name for o in split.outputs] == [o.name for o in graph.outputs]
    _assert_bit_equal(_run(graph, inputs), _run(split, inputs), case)


def test_readers_are_rewired_and_provenance_kept() -> None:
    """A reader of foreach output k now reads the k-th new node, which keeps the foreach
    node's phase, source location and module path; graph outputs are rewired alike."""
    graph, _ = _traced(EXAMPLES["mlp-adamw-clip"])
    split = split_foreach(graph)
    foreach = {n.name: n for n in graph.nodes if n.target.startswith("aten._foreach_")}
    kept = {n.name for n in graph.nodes} - set(foreach)
    before, after = _refs_of(graph, kept), _refs_of(split, kept)
    assert len(before) == len(after)
    checked = 0
    for old, new in zip(before, after):
        src = foreach.get(old.node)
        if src is None:
            assert new == old
            continue
        made = split.node(new.node)
        assert new.index == 0 and made.outputs == (src.outputs[old.index],)
        assert (made.phase, made.source, made.module_path) == (
            src.phase, src.source, src.module_path)
        checked += 1
    assert checked > 20


def _refs_of(graph: Graph, kept: set[str]) -> list[Ref]:
    """Refs read by the nodes named in ``kept`` (in order), then by the graph outputs."""
    return [r for n in graph.nodes if n.name in kept for r in n.refs()] + [
        o.ref for o in graph.outputs]


# ---- every mapped overload on its own ------------------------------------------------------

SHAPES = [(3, 4), (5,), ()]


def _schema_cases() -> list[str]:
    return sorted(FOREACH_TARGETS)


def _value(arg: Any, nodes: list[Node], inputs: dict[str, torch.Tensor], g: torch.Generator,
           op: str) -> Any:
    """An argument for schema argument ``arg``; tensors become graph inputs."""
    t = str(arg.type)

    def tensor(shape: tuple[int, ...]) -> Ref:
        name = f"in{len(inputs)}"
        inputs[name] = torch.rand(shape, generator=g) * 0.8 + 0.1  # in (0.1, 0.9): every op
        meta = TensorMeta(tuple(shape), "float32", Role.DATA)       # is finite there
        nodes.append(Node(name, NodeKind.INPUT, name, outputs=(meta,)))
        return Ref(name)

    if t == "List[Tensor]":
        if op.startswith("aten._foreach_mm"):
            shapes = [(3, 4), (2, 5)] if arg.name == "self" else [(4, 2), (5, 3)]
        else:
            shapes = SHAPES
        return tuple(tensor(s) for s in shapes)
    if t == "List[number]":
        return (0.5, 1.5, -0.25)
    if t == "Tensor":
        return tensor((len(SHAPES),) if arg.name == "scalars" else ())
    if t == "number":
        return 0.75
    if t == "bool":
        return False
    return None


def _one_op_graph(target: str) -> tuple[Graph, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    nodes: list[Node] = []
    inputs: dict[str, torch.Tensor] = {}
    args, kwargs = [], []
    for a in resolve_op(target)._schema.arguments:
        v = _value(a, nodes, inputs, g, target)
        if a.kwarg_only:
            kwargs.append((a.name, v))
        else:
            args.append(v)
    env = {n.name: inputs[n.name] for n in nodes}
    live = [[env[r.node] for r in x] if isinstance(x, tuple) and x and isinstance(x[0], Ref)
            else env[x.node] if isinstance(x, Ref) else list(x) if isinstance(x, tuple) else x
            for x in args]
    outs = resolve_op(target)(*live, **dict(kwargs))
    metas = tuple(TensorMeta(tuple(o.shape), str(o.dtype).removeprefix("torch.")) for o in outs)
    nodes.append(Node("foreach_op", NodeKind.OP, target, tuple(args), tuple(kwargs), metas))
    outputs = tuple(Output(Ref("foreach_op", k), OutputKind.RESULT) for k in range(len(metas)))
    return Graph(tuple(nodes), outputs, GraphInfo(result=ResultSpec("tuple"))), inputs


@pytest.mark.parametrize("target", _schema_cases())
def test_each_mapped_overload_is_bit_identical(target: str) -> None:
    graph, inputs = _one_op_graph(target)
    split = verify(split_foreach(verify(graph)), shapes=True)
    assert not any(n.target.startswith("aten._foreach_") for n in split.nodes)
    _assert_bit_equal(_run(graph, inputs), _run(split, inputs), target)


def test_the_brief_overloads_are_mapped() -> None:
    wanted = ["add.List", "add.Scalar", "add.Tensor", "mul.ScalarList", "mul.Scalar",
              "mul.Tensor", "lerp.Scalar", "addcmul.Scalar", "addcdiv.ScalarList",
              "addcdiv.Scalar", "addcdiv.Tensor", "sqrt.default", "div.ScalarList",
              "div.Scalar", "div.List", "div.Tensor", "norm.Scalar", "maximum.List",
              "neg.default", "sub.List", "sub.Scalar", "pow.ScalarAndTensor",
              "reciprocal.default", "sign.default"]
    missing = [w for w in wanted if f"aten._foreach_{w}" not in FOREACH_TARGETS]
    assert not missing
    assert FOREACH_TARGETS["aten._foreach_norm.Scalar"] == "aten.linalg_vector_norm.default"


def test_unmapped_foreach_op_is_named() -> None:
    known = {s.name.removeprefix("aten::") + "." + (s.overload_name or "default")
             for s in torch._C._jit_get_all_schemas() if s.name.startswith("aten::_foreach_")}
    unmapped = sorted(f"aten.{k}" for k in known if f"aten.{k}" not in FOREACH_TARGETS
                      and not k.split(".")[0].endswith("_") and not k.endswith("out"))
    if not unmapped:
        pytest.skip("every foreach op of this torch version is mapped")
    graph, _ = _one_op_graph(unmapped[0])
    with pytest.raises(IRError, match=unmapped[0].replace(".", r"\.")):
        split_foreach(graph)


def test_new_names_do_not_collide() -> None:
    """An existing node already named like a generated one keeps its name; the new one differs."""
    graph, inputs = _one_op_graph("aten._foreach_sqrt.default")
    clash = Node("foreach_op_0", NodeKind.OP, "aten.neg.default", (Ref("in0"),),
                 outputs=(graph.node("in0").meta,))
    nodes = (*graph.nodes[:-1], clash, graph.nodes[-1])
    outputs = (*graph.outputs, Output(Ref("foreach_op_0"), OutputKind.RESULT))
    graph = dataclasses.replace(graph, nodes=nodes, outputs=outputs)
    split = verify(split_foreach(graph))
    assert split.node("foreach_op_0").target == "aten.neg.default"
    _assert_bit_equal(_run(graph, inputs), _run(split, inputs), "collision")
