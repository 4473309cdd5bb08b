"""The graph: an immutable, topologically ordered tuple of nodes plus the graph's outputs."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .._errors import IRError
from ._types import (
    NodeKind,
    OutputKind,
    Phase,
    Ref,
    Role,
    ScalarMeta,
    SourceLocation,
    TensorMeta,
    ValueMeta,
)

# An argument is a Ref, a literal (None, bool, int, float, str, torch.dtype/device/layout/
# memory_format) or a tuple of arguments. Lists from fx are stored as tuples.
Arg = Any


@dataclass(frozen=True, slots=True)
class ConstantValue:
    """The bytes of a tensor baked into the graph; ``data`` is None when traced from meta tensors."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes | None


@dataclass(frozen=True, slots=True)
class Node:
    """One node. ``target`` is the aten op (``aten.addmm.default``), the host function
    (``operator.pow``) or, for an input, the qualified state name (``model.fc1.weight``)."""

    name: str
    kind: NodeKind
    target: str
    args: tuple[Arg, ...] = ()
    kwargs: tuple[tuple[str, Arg], ...] = ()
    outputs: tuple[ValueMeta, ...] = ()
    phase: Phase = Phase.FORWARD
    source: SourceLocation | None = None
    module_path: str = ""
    value: ConstantValue | None = None
    # every Ref among the arguments, in order (``refs()``; the planner reads them millions of
    # times on a 405B graph)
    _refs: tuple[Ref, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise IRError(f"node name must be a non-empty identifier, got {self.name!r}")
        if not isinstance(self.target, str):
            raise IRError(f"node {self.name}: target must be a string, got {self.target!r}")
        if not isinstance(self.kind, NodeKind):
            raise IRError(f"node {self.name}: kind must be a NodeKind, got {self.kind!r}")
        if (self.kind is NodeKind.CONSTANT) != (self.value is not None):
            raise IRError(f"node {self.name}: a value is carried by CONSTANT nodes and only by them")
        object.__setattr__(self, "_refs", (*_iter_refs(self.args),
                                           *_iter_refs(tuple(v for _, v in self.kwargs))))

    @property
    def meta(self) -> ValueMeta:
        """The metadata of output 0 (most nodes have exactly one output)."""
        return self.outputs[0] if self.outputs else None

    @property
    def role(self) -> Role | None:
        m = self.meta
        return m.role if isinstance(m, TensorMeta) else None

    def refs(self) -> Iterator[Ref]:
        """Every Ref among the arguments, in order."""
        return iter(self._refs)


def _iter_refs(args: tuple[Arg, ...]) -> Iterator[Ref]:
    for a in args:
        if isinstance(a, Ref):
            yield a
        elif isinstance(a, tuple):
            yield from _iter_refs(a)


@dataclass(frozen=True, slots=True)
class Output:
    """One graph output: a result of the step, or the new value of a stateful input."""

    ref: Ref
    kind: OutputKind
    name: str = ""            # state name for STATE outputs ("model.fc1.weight"), key for results
    role: Role | None = None  # the state's role for STATE outputs


@dataclass(frozen=True, slots=True)
class ResultSpec:
    """How the RESULT outputs are packed into what the user's step returns."""

    kind: str = "tensor"          # "none" | "tensor" | "tuple" | "list" | "dict"
    keys: tuple[str, ...] = ()     # dict keys, in order

    def __post_init__(self) -> None:
        if self.kind not in ("none", "tensor", "tuple", "list", "dict"):
            raise IRError(f"unknown result kind {self.kind!r}")


@dataclass(frozen=True, slots=True)
class GraphInfo:
    """Facts about the traced step that are not nodes."""

    name: str = ""                              # the step function's qualified name
    source: SourceLocation | None = None        # where the step function is defined
    result: ResultSpec = field(default_factory=ResultSpec)
    torch_version: str = ""


@dataclass(frozen=True)
class Graph:
    """A pure dataflow graph: no node mutates anything; new state leaves through ``outputs``."""

    nodes: tuple[Node, ...]
    outputs: tuple[Output, ...]
    info: GraphInfo = field(default_factory=GraphInfo)

    # ---- lookups -------------------------------------------------------------------------
    @functools.cached_property
    def _by_name(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    def node(self, name: str) -> Node:
        try:
            return self._by_name[name]
        except KeyError:
            raise IRError(f"no node named {name!r} in graph {self.info.name!r}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def meta(self, ref: Ref) -> ValueMeta:
        outs = self.node(ref.node).outputs
        if not 0 <= ref.index < len(outs):
            raise IRError(f"{ref} points past the {len(outs)} outputs of node {ref.node}")
        return outs[ref.index]

    @property
    def inputs(self) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if n.kind is NodeKind.INPUT)

    def inputs_with_role(self, role: Role) -> tuple[Node, ...]:
        return tuple(n for n in self.inputs if n.role is role)

    def outputs_of(self, kind: OutputKind) -> tuple[Output, ...]:
        return tuple(o for o in self.outputs if o.kind is kind)

    @functools.cached_property
    def users(self) -> dict[str, tuple[str, ...]]:
        """Node name -> names of the nodes that read any of its outputs (graph outputs excluded)."""
        acc: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for r in dict.fromkeys(r.node for r in n.refs()):
                acc[r].append(n.name)
        return {k: tuple(v) for k, v in acc.items()}

    # ---- facts ---------------------------------------------------------------------------
    def num_params(self) -> int:
        """Number of parameter elements (a tied parameter is one input, counted once)."""
        return sum(n.meta.numel for n in self.inputs_with_role(Role.PARAM))

    def state_bytes(self) -> dict[Role, int]:
        acc: dict[Role, int] = {}
        for n in self.inputs:
            if isinstance(n.meta, TensorMeta):
                acc[n.meta.role] = acc.get(n.meta.role, 0) + n.meta.nbytes
        return acc

    # ---- conversions (implemented in sibling modules) ------------------------------------
    def to_json(self, *, indent: int | None = None) -> str:
        from ._serialize import graph_to_json

        return graph_to_json(self, indent=indent)

    @staticmethod
    def from_json(text: str) -> Graph:
        from ._serialize import graph_from_json

        return graph_from_json(text)

    def save(self, path: str) -> None:
        from ._serialize import save_graph

        save_graph(self, path)

    @staticmethod
    def load(path: str) -> Graph:
        from ._serialize import load_graph

        return load_graph(path)

    def to_networkx(self) -> Any:
        from ._nx import to_networkx

        return to_networkx(self)

    def __repr__(self) -> str:
        return f"Graph({self.info.name!r}, {len(self.nodes)} nodes, {len(self.outputs)} outputs)"

    def format(self) -> str:
        """A readable listing, one line per node (like ``torch.fx.Graph.__str__``)."""
        lines = [f"graph {self.info.name}:"]
        for n in self.nodes:
            outs = ", ".join(_fmt_meta(m) for m in n.outputs)
            args = ", ".join(_fmt_arg(a) for a in n.args)
            kw = "".join(f", {k}={_fmt_arg(v)}" for k, v in n.kwargs)
            lines.append(f"  %{n.name}: {outs} = {n.kind.value} {n.target}({args}{kw})")
        outs = ", ".join(f"{o.kind.value}:{o.name or '-'}={o.ref}" for o in self.outputs)
        lines.append(f"  return ({outs})")
        return "\n".join(lines)


def _fmt_meta(m: ValueMeta) -> str:
    if isinstance(m, TensorMeta):
        return f"{m.dtype}{list(m.shape)}"
    if isinstance(m, ScalarMeta):
        return m.dtype
    return "None"


def _fmt_arg(a: Arg) -> str:
    if isinstance(a, tuple):
        return "[" + ", ".join(_fmt_arg(x) for x in a) + "]"
    return str(a) if isinstance(a, Ref) else repr(a)
