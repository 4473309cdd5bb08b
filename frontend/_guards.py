"""Guards: a Python read of a tensor value, specialised on the value the call's arguments give.

A step (or library code it calls: transformers' padding check, a ``lengths.tolist()``) may read
a tensor's value into Python, ``if mask.any():`` or ``n = int(ids.max()) + 1``. A traced graph
cannot branch on it, so the read is specialised, as torch.compile does: while tracing, the ops
that compute the read tensor are cut out of the graph being built (a small fx graph over the
step's tensor arguments), run on the call's real arguments, and the read returns the real
value. The graph is then correct for every call that gives the same value; a :class:`Guard`
keeps the small graph and the value, and a later call whose arguments give another value is
traced again (``TracedStep`` keeps one graph per outcome).

Only reads that depend on nothing but the step's tensor arguments can be guarded: their values
are known on the controller before any rank runs. A read of a value computed from the model's
parameters, gradients, buffers or optimizer state (``if loss > 1``, ``loss.item()``), or from
random ops, changes at every step and is refused with the line that does it
(:class:`Unguardable`).
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _disable_current_modes

from ..ir import SourceLocation
from ..ir._random import draws

_READ_NAMES = {
    torch.Tensor.item: "item()", torch.Tensor.tolist: "tolist()", torch.Tensor.numpy: "numpy()",
    torch.Tensor.__bool__: "bool()", torch.Tensor.__float__: "float()",
    torch.Tensor.__int__: "int()", torch.Tensor.__index__: "index",
    torch.Tensor.__contains__: "`in`", torch.Tensor.__format__: "format()",
    torch.equal: "torch.equal", torch.allclose: "torch.allclose",
    torch.is_nonzero: "torch.is_nonzero",
}
# the reads a trace specialises (``_capture`` sends them to ``Guarding.read``)
READS = frozenset(_READ_NAMES)


_TENSOR = object()      # where a guard's read takes a tensor the guard's graph computes


class Unguardable(Exception):
    """A value read that no guard can hold; ``why`` says what it depends on."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


@dataclass(eq=False)
class Guard:
    """One specialised read: the fx graph computing the read tensor from the step's tensor
    arguments ``data`` (positions among them), the read, and the value the trace used."""

    where: SourceLocation | None
    what: str                          # the read, in words: "bool()", "number of True in a mask"
    read: Callable[..., Any]
    args: tuple                        # the read's arguments, ``_TENSOR`` for each tensor
    gm: fx.GraphModule                 # the tensors, as a tuple, from the step's arguments
    data: tuple[int, ...]
    value: Any
    _code: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        self._code = self.gm.code

    @property
    def key(self) -> tuple:
        """What identifies this guard and its outcome (equal keys: the same branch)."""
        return (str(self.where), self.what, self._code, self.data, _comparable(self.value))

    def value_for(self, tensors: list[torch.Tensor]) -> Any:
        """The read's value for a call with these tensor arguments."""
        with torch.no_grad():
            got = iter(self.gm(*[tensors[i] for i in self.data]))
        return self.read(*[next(got) if a is _TENSOR else a for a in self.args])

    def holds(self, tensors: list[torch.Tensor]) -> bool:
        return _comparable(self.value_for(tensors)) == _comparable(self.value)


def _comparable(v: Any) -> Any:
    """A value equal to itself for the guard's comparison (NaN equals NaN; arrays as lists)."""
    if hasattr(v, "tolist") and not isinstance(v, (int, float, bool)):
        v = v.tolist()
    if isinstance(v, float) and math.isnan(v):
        return ("nan",)
    if isinstance(v, (list, tuple)):
        return tuple(_comparable(x) for x in v)
    return v


class Guarding:
    """Specialises reads during one trace (``_capture._Annotator`` calls :meth:`read`).

    ``data_at``: the position of the first tensor argument among make_fx's placeholders, and
    ``data``: the call's real tensor arguments (meta or fake ones cannot be read)."""

    def __init__(self, data_at: int, data: list[torch.Tensor]) -> None:
        self.data_at = data_at
        self.data = data
        self.guards: list[Guard] = []
        # the unbacked sizes of value-dependent lengths (``x[mask]``...) and the length this
        # call gives: ``make_static`` rewrites every op making one to a static-shape op (an op
        # on the same mask again reuses the size's symbol, so it is found by symbol, not op)
        self.static: dict[Any, int] = {}
        self._placeholders: dict[fx.Node, int] | None = None
        self._writes: dict[Any, list[fx.Node]] = {}     # in-place ops by storage written
        self._placeholder_storages: set[Any] = set()
        self._scanned: fx.Node | None = None

    def read(self, func: Callable[..., Any], args: tuple, kwargs: dict | None,
             where: SourceLocation | None) -> Any:
        """The real value of ``func(*args)`` for this call, recorded as a guard; raises
        :class:`Unguardable` when the read tensor depends on more than the arguments."""
        mode = get_proxy_mode()
        if mode is None or kwargs:
            raise Unguardable("it is read outside the traced graph")
        nodes = []
        for a in args:
            if isinstance(a, torch.Tensor):
                slot = get_proxy_slot(a, mode.tracer, None)
                if slot is None:
                    raise Unguardable("it is not computed in the traced graph")
                nodes.append(slot.proxy.node)
            elif isinstance(a, (list, tuple, dict)) and any(
                    isinstance(x, torch.Tensor) for x in pytree.tree_leaves(a)):
                raise Unguardable("it reads tensors inside a container")
        gm, data = self._cut_node(mode.tracer, nodes)
        if any(self.data[i].is_meta or isinstance(self.data[i], FakeTensor) for i in data):
            raise Unguardable("the step's arguments are meta or fake tensors here, so the value "
                              "is unknown; trace with real example values")
        template = tuple(_TENSOR if isinstance(a, torch.Tensor) else a for a in args)
        guard = Guard(where, _READ_NAMES.get(func, getattr(func, "__name__", "read")), func,
                      template, gm, data, None)
        with _disable_current_modes():
            guard.value = guard.value_for(self.data)
        self.guards.append(guard)
        return guard.value

    def sizes(self, out: Any, where: SourceLocation | None) -> None:
        """Specialise the lengths of ``out``'s tensors that depend on values (``x[mask]``,
        ``masked_select``, ``nonzero``) on this call's, with a guard on each; raises
        :class:`Unguardable` for a length no guard can hold."""
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                for sym in free_unbacked_symbols(t.shape) - set(self.static):
                    self._size(sym, where)

    def _size(self, sym: Any, where: SourceLocation | None) -> None:
        mode = get_proxy_mode()
        if mode is None:
            raise Unguardable("its shape depends on tensor values")
        origin, dim = _origin(mode.tracer.graph, sym)
        count = self._count_guard(mode.tracer, origin, where)
        torch._check(origin.meta["val"].shape[dim] == count)
        self.static[sym] = count

    def _count_guard(self, tracer: Any, origin: fx.Node, where: SourceLocation | None) -> int:
        """Guard the length ``origin`` (x[mask], masked_select, nonzero) makes on the number of
        True values in its mask; returns this call's."""
        op = origin.target
        vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in origin.args]
        if op is torch.ops.aten.nonzero.default:
            mask, shape = origin.args[0], tuple(vals[0].shape)
        elif op is torch.ops.aten.masked_select.default:
            mask, shape = origin.args[1], tuple(torch.broadcast_shapes(vals[0].shape,
                                                                        vals[1].shape))
        elif op is torch.ops.aten.index.Tensor and _one_mask(origin.args[1]) is not None:
            mask = _one_mask(origin.args[1])
            shape = tuple(mask.meta["val"].shape)
        else:
            raise Unguardable(f"{op} makes a tensor whose shape depends on tensor values; "
                              "meshplan specialises only x[mask], masked_select and nonzero")
        gm, data = self._cut_node(tracer, [mask])
        if any(self.data[i].is_meta or isinstance(self.data[i], FakeTensor) for i in data):
            raise Unguardable("the step's arguments are meta or fake tensors here, so the "
                              "mask is unknown; trace with real example values")
        guard = Guard(where, "number of True in a mask", functools.partial(_count, shape=shape),
                      (_TENSOR,), gm, data, None)
        with _disable_current_modes():
            guard.value = guard.value_for(self.data)
        self.guards.append(guard)
        return guard.value

    def finish(self, gm: fx.GraphModule) -> None:
        """Guard the value-dependent lengths no call of the step's showed (ops autograd made
        in backward, like indexing a gradient by a mask): each gets its guard and size, so
        ``make_static`` can rewrite it too."""
        graph = gm.graph
        self._placeholders, self._scanned = None, None        # index the final graph afresh
        self._writes, self._placeholder_storages = {}, set()
        view = SimpleNamespace(graph=graph, root=gm)
        for n in graph.nodes:
            at = _length_dim(n)
            if at is None or _count_of(n, self.static) is not None:
                continue
            syms = getattr(n.meta["val"].shape[at].node, "_expr", None)
            src = (n.meta.get("custom") or {}).get("src")
            where = SourceLocation(*src) if src else None
            count = self._count_guard(view, n, where)
            for sym in (syms.free_symbols if syms is not None else ()):
                self.static[sym] = count

    def _cut_node(self, tracer: Any, targets: list[fx.Node]
                  ) -> tuple[fx.GraphModule, tuple[int, ...]]:
        """The nodes of the graph being traced that compute ``targets``, as a graph over the
        step's tensor arguments (those it reads: ``data``) returning them as a tuple: their
        ancestors and the in-place ops that wrote into those. Costs those nodes, not the
        graph (an optimizer reads a step counter per parameter, each refused at its
        placeholder); in-place ops are indexed once as the graph grows."""
        if self._placeholders is None:      # make_fx makes them first, before the step runs
            self._placeholders = {}
            for n in tracer.graph.nodes:
                if n.op != "placeholder":
                    break
                self._placeholders[n] = len(self._placeholders)
        nodes = self._ancestors(targets)
        # in-place ops since (a fill_ through a view, an optimizer's foreach add_ to its step
        # counters) wrote values the ancestors alone miss: take them and their inputs too
        self._index_writes(tracer.graph)
        seen_storages: set[Any] = set()
        while True:
            storages = {s for n in nodes for s in _storages(n)} - seen_storages
            if not storages:
                break
            seen_storages |= storages
            writers = {w for s in storages for w in self._writes.get(s, ())} - nodes
            if any(s in self._placeholder_storages for w in writers for s in _written(w)):
                raise Unguardable("an in-place op writes into the step's arguments or state "
                                  "before it is read")
            nodes |= self._ancestors(sorted(writers))
        order = sorted(nodes)               # graph order: inputs before users
        ph = [n for n in order if n.op == "placeholder"]
        out = fx.Graph()
        env = {n: out.node_copy(n) for n in ph}
        for n in order:
            if n.op != "placeholder":
                env[n] = out.node_copy(n, lambda x: env[x])
        out.output(tuple(env[t] for t in targets))
        data = tuple(self._placeholders[n] - self.data_at for n in ph)
        return fx.GraphModule(tracer.root, out), data

    def _ancestors(self, targets: list[fx.Node]) -> set[fx.Node]:
        seen: set[fx.Node] = set()
        todo = list(targets)
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                self._check(n)
                todo.extend(n.all_input_nodes)
        return seen

    def _index_writes(self, graph: fx.Graph) -> None:
        """Index the graph's in-place ops by the storage they write, from where the last call
        stopped (the graph only grows while it is traced)."""
        n = graph._root if self._scanned is None else self._scanned
        while n.next is not graph._root:
            n = n.next
            if n.op == "placeholder":
                self._placeholder_storages.update(_storages(n))
            for st in _written(n):
                self._writes.setdefault(st, []).append(n)
        self._scanned = n

    def _check(self, n: fx.Node) -> None:
        """Refuse a node a guard cannot recompute from the step's arguments."""
        if n.op == "placeholder":
            i = self._placeholders.get(n, -1) - self.data_at
            if not 0 <= i < len(self.data):
                raise Unguardable("it is computed from the model's parameters, gradients, "
                                  "buffers, optimizer state or hyperparameters, which change "
                                  "at every step")
        elif n.op == "call_function" and draws(str(n.target), n.args, n.kwargs):
            raise Unguardable(f"it is computed from a random op ({n.target})")
        elif n.op not in ("call_function", "get_attr"):
            raise Unguardable(f"it is computed by a {n.op} node")


def _storages(n: fx.Node) -> list[Any]:
    """The storages of a node's output tensors (views share their base's)."""
    val = n.meta.get("val")
    return [StorageWeakRef(v.untyped_storage())
            for v in (val if isinstance(val, (tuple, list)) else (val,))
            if isinstance(v, torch.Tensor)]


def _written(n: fx.Node) -> list[Any]:
    """The storages an in-place op writes (its schema's ``Tensor(a!)`` arguments)."""
    schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
    if schema is None or not schema.is_mutable:
        return []
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        arg = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
        for m in arg if isinstance(arg, (tuple, list)) else (arg,):
            if isinstance(m, fx.Node):
                out.extend(_storages(m))
    return out


def _count(mask: torch.Tensor, shape: tuple[int, ...]) -> int:
    return int(torch.count_nonzero(mask.expand(shape)))


def _one_mask(indices: Any) -> fx.Node | None:
    """The one boolean index of an ``aten.index`` whose other indices are all None."""
    masks = [i for i in indices if i is not None]
    if len(masks) != 1 or not isinstance(masks[0], fx.Node):
        return None
    val = masks[0].meta.get("val")
    return masks[0] if val is not None and val.dtype in (torch.bool, torch.uint8) else None


def _origin(graph: fx.Graph, sym: Any) -> tuple[fx.Node, int]:
    """The node that made the unbacked size ``sym``, and the dimension it sizes."""
    for n in graph.nodes:
        val = n.meta.get("val")
        for v in val if isinstance(val, (tuple, list)) else (val,):
            if isinstance(v, torch.Tensor):
                for d, size in enumerate(v.shape):
                    if isinstance(size, torch.SymInt) and size.node.expr == sym:
                        return n, d
    raise Unguardable("its shape depends on tensor values")


def make_static(gm: fx.GraphModule, static: dict[Any, int]) -> fx.GraphModule:
    """Rewrite every op whose output length is a size ``Guarding.sizes`` specialised to a
    static-shape op: ``nonzero`` to ``nonzero_static``, ``x[mask]`` and ``masked_select`` to
    an index by ``nonzero_static`` of the mask (exact while the guard on the mask's count
    holds)."""
    aten = torch.ops.aten
    g = gm.graph
    for n in list(g.nodes):
        size = _count_of(n, static)
        if size is None:
            continue
        with g.inserting_before(n):
            if n.target is aten.nonzero.default:
                new = g.call_function(aten.nonzero_static.default, (n.args[0],), {"size": size})
            elif n.target is aten.masked_select.default:
                x, mask = n.args[0], n.args[1]
                shape = list(torch.broadcast_shapes(x.meta["val"].shape, mask.meta["val"].shape))
                xb = g.call_function(aten.expand.default, (x, shape))
                mb = g.call_function(aten.expand.default, (mask, shape))
                new = g.call_function(aten.index.Tensor, (xb, _columns(g, mb, len(shape), size)))
            else:
                x, indices = n.args[0], list(n.args[1])
                mask = _one_mask(indices)
                at = indices.index(mask)
                cols = _columns(g, mask, mask.meta["val"].dim(), size)
                new = g.call_function(aten.index.Tensor,
                                      (x, indices[:at] + cols + indices[at + 1:]))
        m = n.prev              # the new nodes, just before n, carry its line and module
        while m.op == "call_function" and not m.meta:
            m.meta.update({k: v for k, v in n.meta.items() if k != "val"})
            m = m.prev
        n.replace_all_uses_with(new)
        g.erase_node(n)
    g.lint()
    gm.recompile()
    return gm


_DYNAMIC = (torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default,
            torch.ops.aten.index.Tensor)


def _length_dim(n: fx.Node) -> int | None:
    """The output dimension whose length values decide, when ``n`` is ``nonzero``,
    ``masked_select`` or an index by one mask (``x[mask]``); None for any other node."""
    if n.op != "call_function" or n.target not in _DYNAMIC:
        return None
    if n.target is not torch.ops.aten.index.Tensor:
        return 0
    mask = _one_mask(n.args[1])
    return None if mask is None else list(n.args[1]).index(mask)


def _count_of(n: fx.Node, static: dict[Any, int]) -> int | None:
    """The length a value-dependent op made while traced: its specialised size, or the value
    the shape environment already gave it (the same mask indexed again after its count was
    specialised, or a constant mask); None when neither is known, or ``n`` is no such op."""
    at, val = _length_dim(n), n.meta.get("val")
    if at is None or not isinstance(val, torch.Tensor):
        return None
    d = val.shape[at]
    if isinstance(d, int):
        return d
    syms = getattr(d.node, "_expr", d.node.expr).free_symbols
    return next((static[x] for x in syms if x in static), None)


def _columns(g: fx.Graph, mask: fx.Node, ndim: int, size: int) -> list[fx.Node]:
    """``nonzero_static(mask, size)`` split into one index tensor per dimension."""
    where = g.call_function(torch.ops.aten.nonzero_static.default, (mask,), {"size": size})
    return [g.call_function(torch.ops.aten.select.int, (where, 1, j)) for j in range(ndim)]


def branch(guards: tuple[Guard, ...]) -> tuple:
    """The outcome of a graph's reads, as part of a call's key (``TracedStep.call_key``)."""
    return tuple(g.key for g in guards)


def branch_change(old: tuple | None, new: tuple | None) -> str:
    """Which read's value differs between two outcomes (``branch``), in words."""
    old_at = {k[:4]: k[4] for k in old or ()}
    changed = [f"{k[1]} at {k[0]}: {_short(old_at[k[:4]])} before, {_short(k[4])} now"
               for k in new or () if old_at.get(k[:4], k[4]) != k[4]]
    if not changed:
        return "values the step reads from its arguments in Python"
    more = f"; {len(changed) - 3} more" if len(changed) > 3 else ""
    return f"values read from the arguments ({'; '.join(changed[:3])}{more})"



def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


__all__ = ["Guard", "Guarding", "Unguardable", "branch", "branch_change", "make_static"]
