"""The one registry of sharding rules.

A rule is written for ONE mesh axis: given a node of the graph (its input and output metadata),
it lists the ways the op can run with its operands split along that axis. The all-Replicate
strategy is implied and never listed. The planner expands rules to N axes. Registering an op
twice is an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from ..._errors import PlanError
from ...ir import Graph, Node, TensorMeta
from .._placement import Placement, R

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class OpStrategy:
    """One way to run a node along one mesh axis.

    ``inputs`` has one entry per Ref the node reads (``node.refs()`` order: positional args,
    then keyword args; a Ref used twice appears twice); ``outputs`` one per node output.
    Non-tensor values (host scalars, absent outputs) have ``None``.
    """

    inputs: tuple[Placement | None, ...]
    outputs: tuple[Placement | None, ...]

    def __str__(self) -> str:
        f = lambda ps: ", ".join("-" if p is None else str(p) for p in ps)  # noqa: E731
        return f"({f(self.inputs)}) -> ({f(self.outputs)})"


@dataclass(frozen=True, slots=True)
class OpInfo:
    """What a rule sees: the node plus the metadata of what it reads and writes."""

    node: Node
    inputs: tuple[TensorMeta | None, ...]     # aligned with node.refs(); None for scalars
    outputs: tuple[TensorMeta | None, ...]    # aligned with node.outputs

    @property
    def args(self) -> tuple[Any, ...]:
        return self.node.args

    def kwarg(self, name: str, default: Any = None) -> Any:
        return dict(self.node.kwargs).get(name, default)

    def same(self, p: Placement) -> OpStrategy:
        """Every tensor input and output placed ``p`` (pointwise-style)."""
        return OpStrategy(
            tuple(None if m is None else p for m in self.inputs),
            tuple(None if m is None else p for m in self.outputs),
        )


# localize(node, local input shapes, local output shapes) -> (args, kwargs) for the local op
Localize = Callable[[Node, Sequence[Shape | None], Sequence[Shape | None]], tuple[tuple, tuple]]
# a per-rank stand-in for the op itself, called with the localized arguments: for an op whose
# local result needs a global count no argument of the op carries (``loss.py``'s mse backward)
LocalOp = Callable[..., Any]
RuleFn = Callable[[OpInfo], Iterable[OpStrategy]]


@dataclass(frozen=True, slots=True)
class Rule:
    target: str
    strategies: RuleFn
    localize: Localize | None = None
    family: str = ""
    local_op: LocalOp | None = None

    def local_args(self, node: Node, ins: Sequence[Shape | None],
                   outs: Sequence[Shape | None]) -> tuple[tuple, tuple]:
        """The literal arguments of the per-rank op: the rule's ``localize``, or the node's own
        arguments unchanged (ops whose literals are shapes opt in to ``default_localize``)."""
        if self.localize is None:
            return node.args, node.kwargs
        return self.localize(node, ins, outs)


_REGISTRY: dict[str, Rule] = {}


def sharding_rule(*targets: str, localize: Localize | None = None, family: str = "",
                  local_op: LocalOp | None = None) -> Callable[[RuleFn], RuleFn]:
    """Register ``fn`` as the one-axis rule of each op in ``targets`` (``aten.mm.default``).
    ``local_op``: what each rank calls instead of the op, with ``localize``'s arguments."""

    def deco(fn: RuleFn) -> RuleFn:
        for t in targets:
            if t in _REGISTRY:
                raise PlanError(f"a sharding rule for {t} is already registered "
                                f"({_REGISTRY[t].strategies.__qualname__})")
            _REGISTRY[t] = Rule(t, fn, localize, family or fn.__module__.rsplit(".", 1)[-1],
                                local_op)
        return fn

    return deco


def rule_for(target: str) -> Rule | None:
    return _REGISTRY.get(target)


def registered() -> dict[str, Rule]:
    return dict(_REGISTRY)


def op_info(node: Node, graph: Graph) -> OpInfo:
    ins = []
    for r in node.refs():
        m = graph.meta(r)
        ins.append(m if isinstance(m, TensorMeta) else None)
    outs = tuple(m if isinstance(m, TensorMeta) else None for m in node.outputs)
    return OpInfo(node, tuple(ins), outs)


def replicated(info: OpInfo) -> OpStrategy:
    return info.same(R)


def strategies_for(node: Node, graph: Graph) -> tuple[list[OpStrategy], bool]:
    """All one-axis strategies of ``node`` (all-Replicate first) and whether a rule exists."""
    info = op_info(node, graph)
    base = replicated(info)
    rule = rule_for(node.target)
    if rule is None:
        return [base], False
    out = [base]
    for s in rule.strategies(info):
        if len(s.inputs) != len(info.inputs) or len(s.outputs) != len(info.outputs):
            raise PlanError(f"rule for {node.target} returned {s} with the wrong arity "
                            f"({len(info.inputs)} inputs, {len(info.outputs)} outputs expected)")
        if s not in out:
            out.append(s)
    return out, True


def default_localize(node: Node, ins: Sequence[Shape | None],
                     outs: Sequence[Shape | None]) -> tuple[tuple, tuple]:
    """Rewrite literal shapes for local execution: an int-tuple argument equal to an output's
    global shape becomes that output's local shape (``zeros``, ``full``...). Opt-in only: for
    an op whose tuples are dims or sizes (``sum(x, [2, 3])``) a match would be a coincidence."""
    global_outs = [m.shape if isinstance(m, TensorMeta) else None for m in node.outputs]
    swap = {g: l for g, l in zip(global_outs, outs) if g is not None and l is not None}

    def fix(a: Any) -> Any:
        if isinstance(a, tuple) and a and all(type(x) is int for x in a) and a in swap:
            return swap[a]
        return a

    return tuple(fix(a) for a in node.args), tuple((k, fix(v)) for k, v in node.kwargs)
