"""Converting the functional fx graph of a step into a meshplan IR graph."""

from __future__ import annotations

import logging
import operator
import re
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor

from .._errors import TraceError
from ..ir import (
    ConstantValue,
    Graph,
    GraphInfo,
    Node,
    NodeKind,
    Output,
    OutputKind,
    Phase,
    Ref,
    ResultSpec,
    Role,
    ScalarMeta,
    SourceLocation,
    TensorMeta,
    op_name,
)
from ..ir._ops import host_function_name

logger = logging.getLogger(__name__)
aten = torch.ops.aten

# Size queries fold to ints (shapes are static); checks and profiler markers carry no data.
_FOLD_SIZE = {aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int,
              aten.sym_storage_offset.default}
_DROP = {"aten._assert_scalar.default", "aten.sym_constrain_range_for_size.default",
         "aten.sym_constrain_range.default", "aten._assert_async.msg",
         "profiler._record_function_enter_new.default", "profiler._record_function_exit._RecordFunction"}
_INPUT_PREFIX = {Role.PARAM: "p", Role.GRAD: "g", Role.BUFFER: "b", Role.OPT_STATE: "s",
                 Role.DATA: "d", Role.HYPER: "h"}


def _dtype(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _meta_of(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        return TensorMeta(tuple(int(s) for s in val.shape), _dtype(val.dtype))
    if isinstance(val, torch.SymFloat) or isinstance(val, float):
        return ScalarMeta("float")
    if isinstance(val, torch.SymBool) or isinstance(val, bool):
        return ScalarMeta("bool")
    if isinstance(val, torch.SymInt) or isinstance(val, int):
        return ScalarMeta("int")
    return None


def _ident(name: str) -> str:
    return re.sub(r"\W", "_", name).strip("_") or "v"


class _Converter:
    def __init__(self, gm: torch.fx.GraphModule, input_names: list[tuple[str, Role]]) -> None:
        self.gm = gm
        self.input_names = input_names
        self.nodes: list[Node] = []
        self.names: set[str] = set()
        # fx node -> what reading it gives: Ref, literal, or (ir node name, pytree paths)
        self.env: dict[torch.fx.Node, Any] = {}
        self.mutated: list[tuple[str, Role]] = []
        self.placeholders: dict[torch.fx.Node, tuple[str, Role]] = {}

    def fresh(self, base: str) -> str:
        base = _ident(base)
        name, k = base, 1
        while name in self.names:
            k += 1
            name = f"{base}_{k}"
        self.names.add(name)
        return name

    def arg(self, a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            v = self.env[a]
            if isinstance(v, _Multi):
                raise TraceError(f"internal: multi-output value {a.name} read without index")
            return v
        if isinstance(a, (list, tuple)):
            return tuple(self.arg(x) for x in a)
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise TraceError(f"internal: unresolved symbolic value {a} in the graph")
        return a

    def annotations(self, n: torch.fx.Node) -> tuple[Phase, SourceLocation | None, str]:
        c = n.meta.get("custom") or {}
        src = c.get("src")
        loc = SourceLocation(*src) if src else None
        return Phase(c.get("phase", "forward")), loc, c.get("module", "")

    def emit(self, n: torch.fx.Node, kind: NodeKind, target: str, args: tuple, kwargs: tuple,
             outputs: tuple, value: ConstantValue | None = None, name: str | None = None,
             role: Role | None = None) -> str:
        phase, src, module = self.annotations(n)
        if role is not None:
            outputs = (outputs[0].with_role(role),)
        ir_name = self.fresh(name or n.name)
        self.nodes.append(Node(ir_name, kind, target, args, kwargs, outputs, phase, src, module,
                               value))
        return ir_name

    def placeholder(self, n: torch.fx.Node, index: int) -> None:
        state, role = self.input_names[index]
        self.placeholders[n] = (state, role)
        meta = _meta_of(n.meta["val"])
        name = self.emit(n, NodeKind.INPUT, state, (), (), (meta,),
                         name=f"{_INPUT_PREFIX[role]}_{state}", role=role)
        self.nodes[-1] = _with(self.nodes[-1], phase=Phase.FORWARD, source=None, module_path="")
        self.env[n] = Ref(name, 0)

    def get_attr(self, n: torch.fx.Node) -> None:
        t = getattr(self.gm, n.target)
        real = t.constant if isinstance(t, FakeTensor) else t
        data = None
        if isinstance(real, torch.Tensor) and not real.is_meta:
            data = real.detach().contiguous().cpu().numpy().tobytes() if real.numel() else b""
        meta = TensorMeta(tuple(t.shape), _dtype(t.dtype), Role.CONSTANT)
        value = ConstantValue(meta.dtype, meta.shape, data)
        self.env[n] = Ref(self.emit(n, NodeKind.CONSTANT, "", (), (), (meta,), value), 0)

    def call(self, n: torch.fx.Node) -> None:
        t = n.target
        if t is operator.getitem:
            src, idx = n.args
            v = self.env[src]
            if not isinstance(v, _Multi):
                raise TraceError(f"internal: getitem on single value {src.name}")
            self.env[n] = v.child(idx)
            return
        if t in _FOLD_SIZE:
            self.env[n] = int(n.meta["val"])
            return
        args = tuple(self.arg(a) for a in n.args)
        kwargs = tuple((k, self.arg(v)) for k, v in n.kwargs.items())
        if isinstance(t, torch._ops.OpOverload):
            target = op_name(t)
            if target in _DROP:
                self.env[n] = None
                return
            if target == "aten.copy_.default" and n.args[0].op == "placeholder":
                self.mutated.append(self.placeholders[n.args[0]])
                self.env[n] = None
                return
            self._op(n, target, args, kwargs)
            return
        host = host_function_name(t) if callable(t) else None
        if host is None:
            raise TraceError(f"the step calls {getattr(t, '__name__', t)!r}, which meshplan's IR "
                             "cannot represent (higher-order ops and custom Python calls are "
                             "not supported yet)")
        if not any(isinstance(a, Ref) for a in pytree.tree_leaves(list(args))):
            self.env[n] = t(*args, **dict(kwargs))     # all literal: fold
            return
        name = self.emit(n, NodeKind.HOST, host, args, kwargs, (_meta_of(n.meta["val"]),))
        self.env[n] = Ref(name, 0)

    def _op(self, n: torch.fx.Node, target: str, args: tuple, kwargs: tuple) -> None:
        val = n.meta.get("val")
        if isinstance(val, (tuple, list)):
            leaves, spec = pytree.tree_flatten(list(val))
            outs = tuple(_meta_of(v) for v in leaves)
            name = self.emit(n, NodeKind.OP, target, args, kwargs, outs)
            self.env[n] = _Multi(name, val)
        else:
            name = self.emit(n, NodeKind.OP, target, args, kwargs, (_meta_of(val),))
            self.env[n] = Ref(name, 0)


class _Multi:
    """A container-valued op result; ``child(i)`` walks into it down to a flat output Ref."""

    def __init__(self, node: str, val: Any, offset: int = 0) -> None:
        self.node, self.val, self.offset = node, val, offset

    def child(self, i: int) -> Any:
        before = sum(len(pytree.tree_leaves(v)) if isinstance(v, (list, tuple)) else 1
                     for v in list(self.val)[:i])
        v = self.val[i]
        if isinstance(v, (list, tuple)):
            return _Multi(self.node, v, self.offset + before)
        return Ref(self.node, self.offset + before)


def _with(node: Node, **changes: Any) -> Node:
    import dataclasses

    return dataclasses.replace(node, **changes)


def convert(
    gm: torch.fx.GraphModule,
    input_names: list[tuple[str, Role]],
    output_names: list[tuple[str, Role]],
    n_results: int,
    result: ResultSpec,
    n_marks: int,
    info: GraphInfo,
) -> tuple[Graph, list[tuple[str, Role]], list[Ref]]:
    """Returns the IR graph, the inputs that the step wrote in place (state name, role) and the
    refs of the gradient marks (clones of each gradient taken when backward produced it)."""
    c = _Converter(gm, input_names)
    out_node = None
    index = 0
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            c.placeholder(n, index)
            index += 1
        elif n.op == "get_attr":
            c.get_attr(n)
        elif n.op == "call_function":
            c.call(n)
        elif n.op == "output":
            out_node = n
        else:
            raise TraceError(f"internal: unexpected fx node {n.op} {n.target}")
    assert out_node is not None
    leaves = pytree.tree_leaves(out_node.args[0])
    refs = [c.arg(x) for x in leaves]
    expected = n_results + len(output_names) + n_marks
    if len(refs) != expected:
        raise TraceError(f"internal: traced {len(refs)} outputs, expected {expected}")
    outputs: list[Output] = []
    for i, r in enumerate(refs[:n_results]):
        key = result.keys[i] if result.kind == "dict" else str(i)
        outputs.append(Output(r, OutputKind.RESULT, key))
    for (name, role), r in zip(output_names, refs[n_results:n_results + len(output_names)]):
        outputs.append(Output(r, OutputKind.STATE, name, role))
    marks = refs[n_results + len(output_names):]
    return Graph(tuple(c.nodes), tuple(outputs), info), c.mutated, marks
