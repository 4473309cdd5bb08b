"""Stamping: the graph of a step whose model has ``n`` identical blocks, built from the graph
traced with the first ``k`` (>= 3) of them.

Every node of the traced graph gets a block tag: inputs by their state name
(``model.layers.2.attn.wq.weight``), forward and backward ops by their module path, update ops
(clipping, the optimizer) by the block of the values they read (and, when they read none, by
their users and the state they become). The node sequence must then consist of untagged nodes
and *sweeps*: runs that visit every block once, in ascending or descending order, with equally
long segments per block.

Block 0 (the first), block 1 (an interior block) and block ``k-1`` (the last) are compared node
by node: same op, literals, metadata, source and phase; references into other blocks by relative
offset (-1, 0, +1) and position. The interior block is the template of blocks ``1..n-2``; the
first and last differ from it only where it reads its neighbour and they read something outside
the blocks. Untagged nodes read the first or last block, or a complete sweep of all blocks inside
one argument list (``torch.stack`` of per-parameter norms), which is extended to ``n`` blocks and
its metadata recomputed on meta tensors. Anything else raises ``NotTemplatable`` and the step is
traced whole.

Known blind spot: an untagged node reading block ``k-1`` is taken to read the last block. A step
that collects every block's output in a Python list and reads entry ``k-1`` (``feats[2]``) by a
fixed index would be stamped as reading the last one; nothing in the traced graph tells the two
apart.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..ir import Graph, Node, NodeKind, Output, OutputKind, Phase, Ref, TensorMeta, resolve_op
from ._convert import _INPUT_PREFIX, _ident
from ._template import BlockNaming, NotTemplatable

_FREE = "free"     # an update node that reads no block: tagged by its users


@dataclasses.dataclass(frozen=True, slots=True)
class _BRef:
    """A reference into block ``own + d`` at sweep position ``loc``, output ``index``."""

    d: int
    loc: int
    index: int


@dataclasses.dataclass(frozen=True, slots=True)
class _URef:
    node: str
    index: int


Sweep = tuple[bool, dict[int, list[Node]]]      # (ascending, block -> its segment)


def stamp(graph: Graph, naming: BlockNaming, k: int, n: int) -> Graph:
    """The graph of ``n`` blocks from ``graph``, traced with ``k`` (raises NotTemplatable)."""
    if k < 3 or n < k:
        raise NotTemplatable(f"need at least 3 traced blocks and n >= k, got k={k}, n={n}")
    tags = _tags(graph, naming)
    items, sweeps, loc = _layout(graph, tags, k)
    _check(sweeps, tags, loc, naming, k)
    out = _Emitter(graph, tags, loc, naming, k, n)
    for kind, x in items:
        if kind == "u":
            out.untagged(x)
        else:
            out.sweep(*sweeps[x])
    return Graph(tuple(out.nodes), out.outputs(), graph.info)


# ---- tags and layout --------------------------------------------------------------------------

def _tags(graph: Graph, naming: BlockNaming) -> dict[str, Any]:
    tags: dict[str, Any] = {}
    for node in graph.nodes:
        if node.kind is NodeKind.INPUT:
            t = naming.state_block(node.target)
        elif node.phase is not Phase.UPDATE or node.module_path:
            t = naming.module_block(node.module_path)
        else:
            t = _by_inputs(node, tags)
        tags[node.name] = t
    users = graph.users
    written: dict[str, set[Any]] = {}      # graph outputs count as users, tagged by state name
    for o in graph.outputs:
        b = naming.state_block(o.name) if o.kind is OutputKind.STATE else None
        written.setdefault(o.ref.node, set()).add(b)
    for node in reversed(graph.nodes):
        if tags[node.name] == _FREE:
            found = {tags[u] for u in users[node.name]} | written.get(node.name, set())
            one = found.pop() if len(found) == 1 else None
            tags[node.name] = one if isinstance(one, int) else None
    return tags


def _by_inputs(node: Node, tags: dict[str, Any]) -> Any:
    blocks: set[int] = set()
    other = False
    for r in node.refs():
        t = tags[r.node]
        if isinstance(t, int):
            blocks.add(t)
        elif t is None:
            other = True
    if len(blocks) == 1:
        return blocks.pop()
    return None if blocks or other else _FREE


def _layout(graph: Graph, tags: dict[str, Any],
            k: int) -> tuple[list[tuple[str, Any]], list[Sweep], dict[str, int]]:
    """Untagged nodes and sweeps, in order; ``loc`` numbers the positions inside the blocks'
    segments (a node of block b and the same node of block c share their number)."""
    items: list[tuple[str, Any]] = []
    sweeps: list[Sweep] = []
    loc: dict[str, int] = {}
    top = [0]
    run: list[tuple[tuple, list[Node]]] = []

    def flush() -> None:
        if len(run) % k:
            raise NotTemplatable(f"a run of {len(run)} block segments is not a whole sweep")
        for c in range(0, len(run), k):
            chunk = run[c:c + k]
            order = [key[0] for key, _ in chunk]
            if order not in (list(range(k)), list(range(k - 1, -1, -1))) or len(
                {key[1:] for key, _ in chunk}) != 1 or len({len(v) for _, v in chunk}) != 1:
                raise NotTemplatable(f"blocks appear in order {order}, not as one sweep")
            for _, nodes in chunk:
                for p, node in enumerate(nodes):
                    loc[node.name] = top[0] + p
            top[0] += len(chunk[0][1])
            items.append(("s", len(sweeps)))
            sweeps.append((order[0] == 0, {key[0]: nodes for key, nodes in chunk}))
        run.clear()

    for node in graph.nodes:
        t = tags[node.name]
        if t is None:
            flush()
            items.append(("u", node))
            continue
        key = (t, node.phase, node.kind is NodeKind.INPUT)
        if run and run[-1][0] == key:
            run[-1][1].append(node)
        else:
            run.append((key, [node]))
    flush()
    return items, sweeps, loc


# ---- checking that the blocks repeat ----------------------------------------------------------

def _sig(node: Node, b: int, tags: dict[str, Any], loc: dict[str, int],
         naming: BlockNaming) -> tuple:
    def arg(a: Any) -> Any:
        if isinstance(a, Ref):
            t = tags[a.node]
            return _BRef(t - b, loc[a.node], a.index) if isinstance(t, int) else _URef(a.node,
                                                                                       a.index)
        if isinstance(a, tuple):
            return tuple(arg(x) for x in a)
        return (type(a).__name__, repr(a))

    target = naming.rename_state(node.target, "*") if node.kind is NodeKind.INPUT else node.target
    return (node.kind, target, arg(node.args), tuple((k, arg(v)) for k, v in node.kwargs),
            node.outputs, node.phase, node.source, naming.rename_module(node.module_path, "*"),
            node.value)


def _match(x: Any, y: Any, first: bool) -> bool:
    """``x`` (first or last block) against ``y`` (interior): equal, except that where the
    interior reads the neighbour the first/last block lacks, it reads an untagged value."""
    if isinstance(y, _BRef):
        if abs(y.d) > 1:
            return False
        if (first and y.d < 0) or (not first and y.d > 0):
            return isinstance(x, _URef)
        return x == y
    if isinstance(y, tuple):
        return isinstance(x, tuple) and len(x) == len(y) and all(
            _match(a, c, first) for a, c in zip(x, y))
    return x == y


def _check(sweeps: list[Sweep], tags: dict[str, Any], loc: dict[str, int],
           naming: BlockNaming, k: int) -> None:
    for _, segs in sweeps:
        for p in range(len(segs[0])):
            inner = _sig(segs[1][p], 1, tags, loc, naming)
            for b in range(2, k - 1):
                if _sig(segs[b][p], b, tags, loc, naming) != inner:
                    raise NotTemplatable(f"interior blocks differ at {segs[b][p].name}")
            if not _match(_sig(segs[0][p], 0, tags, loc, naming), inner, True):
                raise NotTemplatable(f"the first block differs at {segs[0][p].name}")
            if not _match(_sig(segs[k - 1][p], k - 1, tags, loc, naming), inner, False):
                raise NotTemplatable(f"the last block differs at {segs[k - 1][p].name}")


# ---- building the stamped graph ---------------------------------------------------------------

class _Emitter:
    def __init__(self, graph: Graph, tags: dict[str, Any], loc: dict[str, int],
                 naming: BlockNaming, k: int, n: int) -> None:
        self.g, self.tags, self.loc, self.naming, self.k, self.n = graph, tags, loc, naming, k, n
        self.width = max(loc.values(), default=0) + 1
        self.nodes: list[Node] = []
        self.namer = _Namer()
        self.untagged_name: dict[str, str] = {}
        self.block_name: dict[int, str] = {}                 # block * width + position -> name
        self.outs: dict[str, tuple] = {}                     # new name -> output metadata
        self.changed: set[str] = set()                       # untagged, metadata recomputed

    def _emit(self, node: Node, target: str, args: tuple, kwargs: tuple, outputs: tuple,
              module_path: str) -> str:
        new = Node(self.namer.name(node.kind, node.role, target, node.name), node.kind, target,
                   args, kwargs, outputs, node.phase, node.source, module_path, node.value)
        self.nodes.append(new)
        self.outs[new.name] = outputs
        return new.name

    def _at(self, block: int, where: int) -> str:
        name = self.block_name.get(block * self.width + where)
        if name is None:
            raise NotTemplatable("a block reads a value that is defined after it")
        return name

    def sweep(self, ascending: bool, segs: dict[int, list[Node]]) -> None:
        n, k, tags, loc = self.n, self.k, self.tags, self.loc
        for j in (range(n) if ascending else range(n - 1, -1, -1)):
            src = 0 if j == 0 else k - 1 if j == n - 1 else 1

            def ref(a: Any) -> Any:
                if isinstance(a, Ref):
                    t = tags[a.node]
                    if isinstance(t, int):
                        return Ref(self._at(j + t - src, loc[a.node]), a.index)
                    if a.node in self.changed:
                        raise NotTemplatable(f"a block reads {a.node}, which grew")
                    return Ref(self.untagged_name[a.node], a.index)
                return tuple(ref(x) for x in a) if isinstance(a, tuple) else a

            for node in segs[src]:
                target = (self.naming.rename_state(node.target, j)
                          if node.kind is NodeKind.INPUT else node.target)
                self.block_name[j * self.width + loc[node.name]] = self._emit(
                    node, target, ref(node.args), tuple((kw, ref(v)) for kw, v in node.kwargs),
                    node.outputs, self.naming.rename_module(node.module_path, j))

    def _single(self, a: Ref) -> Ref:
        t = self.tags[a.node]
        if not isinstance(t, int):
            return Ref(self.untagged_name[a.node], a.index)
        if t not in (0, self.k - 1):
            raise NotTemplatable(f"{a.node} of an interior block is read outside the blocks")
        return Ref(self._at(0 if t == 0 else self.n - 1, self.loc[a.node]), a.index)

    def _arg(self, a: Any, grew: list[bool]) -> Any:
        if isinstance(a, Ref):
            return self._single(a)
        if not isinstance(a, tuple):
            return a
        blocks = {self.tags[x.node] for x in a if isinstance(x, Ref)}
        if len({t for t in blocks if isinstance(t, int)}) > 1:
            grew.append(True)
            return self._extend(a)
        return tuple(self._arg(x, grew) for x in a)

    def _extend(self, a: tuple) -> tuple:
        """A list argument holding a sweep of all blocks, extended to all ``n`` blocks."""
        tagged = [i for i, x in enumerate(a) if isinstance(x, Ref)
                  and isinstance(self.tags[x.node], int)]
        lo, hi = tagged[0], tagged[-1]
        if tagged != list(range(lo, hi + 1)):
            raise NotTemplatable("a list argument mixes block values with others")
        groups = _groups([(self.tags[x.node], (self.loc[x.node], x.index)) for x in a[lo:hi + 1]])
        blocks = self._sweep_blocks([b for b, _ in groups], [g for _, g in groups])
        mid = tuple(Ref(self._at(j, where), i) for j in blocks for where, i in groups[0][1])
        return tuple(self._arg(x, []) for x in a[:lo]) + mid + tuple(
            self._arg(x, []) for x in a[hi + 1:])

    def _sweep_blocks(self, order: list[int], patterns: list[list]) -> range:
        k, n = self.k, self.n
        if any(pt != patterns[0] for pt in patterns):
            raise NotTemplatable("blocks contribute differently to one list")
        if order == list(range(k)):
            return range(n)
        if order == list(range(k - 1, -1, -1)):
            return range(n - 1, -1, -1)
        raise NotTemplatable(f"a list holds blocks in order {order}")

    def untagged(self, node: Node) -> None:
        grew: list[bool] = []
        args = tuple(self._arg(a, grew) for a in node.args)
        kwargs = tuple((kw, self._arg(v, grew)) for kw, v in node.kwargs)
        outputs = node.outputs
        if node.kind is NodeKind.OP and (grew or any(r.node in self.changed
                                                    for r in node.refs())):
            outputs = self._recompute(node, args, kwargs)
        name = self._emit(node, node.target, args, kwargs, outputs, node.module_path)
        self.untagged_name[node.name] = name
        if outputs != node.outputs:
            self.changed.add(node.name)

    def _recompute(self, node: Node, args: tuple, kwargs: tuple) -> tuple:
        def mat(a: Any) -> Any:
            if isinstance(a, Ref):
                m = self.outs[a.node][a.index]
                if isinstance(m, TensorMeta):
                    return torch.empty(m.shape, dtype=getattr(torch, m.dtype), device="meta")
                return {"float": 1.0, "int": 1, "bool": True}[m.dtype]
            if isinstance(a, tuple):
                return [mat(x) for x in a]
            return torch.device("meta") if isinstance(a, torch.device) else a

        got = resolve_op(node.target)(*[mat(a) for a in args], **{kw: mat(v) for kw, v in kwargs})
        flat = pytree.tree_leaves(list(got) if isinstance(got, (tuple, list)) else [got],
                                  is_leaf=lambda x: x is None)
        if len(flat) != len(node.outputs):
            raise NotTemplatable(f"{node.target} changes its number of outputs")
        return tuple(
            TensorMeta(tuple(v.shape), str(v.dtype).removeprefix("torch."), m.role)
            if isinstance(m, TensorMeta) and isinstance(v, torch.Tensor) else m
            for m, v in zip(node.outputs, flat))

    def outputs(self) -> tuple[Output, ...]:
        out: list[Output] = []
        run: list[Output] = []

        def flush() -> None:
            if not run:
                return
            groups = _groups([(self.naming.state_block(o.name), o) for o in run])
            k = self.k
            if len(groups) % k:
                raise NotTemplatable("block state outputs are not whole sweeps")
            for c in range(0, len(groups), k):
                chunk = groups[c:c + k]
                pats = [[self._out_key(o) for o in g] for _, g in chunk]
                for j in self._sweep_blocks([b for b, _ in chunk], pats):
                    out.extend(Output(Ref(self._at(j, self.loc[o.ref.node]), o.ref.index), o.kind,
                                      self.naming.rename_state(o.name, j), o.role)
                               for o in chunk[0][1])
            run.clear()

        for o in self.g.outputs:
            b = self.naming.state_block(o.name) if o.kind is OutputKind.STATE else None
            if b is None:
                flush()
                out.append(dataclasses.replace(o, ref=self._single(o.ref)))
                continue
            if self.tags[o.ref.node] != b:
                raise NotTemplatable(f"state {o.name} is computed outside its block")
            run.append(o)
        flush()
        return tuple(out)

    def _out_key(self, o: Output) -> tuple:
        return (o.kind, self.naming.rename_state(o.name, "*"), o.role, self.loc[o.ref.node],
                o.ref.index)


def _groups(pairs: list[tuple[Any, Any]]) -> list[tuple[Any, list]]:
    groups: list[tuple[Any, list]] = []
    for key, value in pairs:
        if groups and groups[-1][0] == key:
            groups[-1][1].append(value)
        else:
            groups.append((key, [value]))
    return groups


# ---- names ------------------------------------------------------------------------------------

_COUNTER = re.compile(r"_?\d+$")


class _Namer:
    """Names that depend only on the nodes in order: inputs after their state, other nodes
    ``<op>``, ``<op>_1``, ... (the op part taken from the traced name)."""

    def __init__(self) -> None:
        self.taken: set[str] = set()
        self.count: dict[str, int] = {}

    def name(self, kind: NodeKind, role: Any, target: str, old: str) -> str:
        if kind is NodeKind.INPUT:
            base = _ident(f"{_INPUT_PREFIX[role]}_{target}")
            name, i = base, 1
            while name in self.taken:
                i += 1
                name = f"{base}_{i}"
        else:
            base = _COUNTER.sub("", old) or old
            i = self.count.get(base, 0)
            name = base if i == 0 else f"{base}_{i}"
            while name in self.taken:
                i += 1
                name = f"{base}_{i}"
            self.count[base] = i + 1
        self.taken.add(name)
        return name


def canonical_names(graph: Graph) -> Graph:
    """The same graph with names that depend only on its nodes in order (see ``_Namer``).
    Stamped graphs come out this way, so a direct trace put through this function must equal
    the stamped graph exactly."""
    namer = _Namer()
    rename = {n.name: namer.name(n.kind, n.role, n.target, n.name) for n in graph.nodes}

    def ref(a: Any) -> Any:
        if isinstance(a, Ref):
            return Ref(rename[a.node], a.index)
        return tuple(ref(x) for x in a) if isinstance(a, tuple) else a

    nodes = tuple(dataclasses.replace(node, name=rename[node.name], args=ref(node.args),
                                      kwargs=tuple((kw, ref(v)) for kw, v in node.kwargs))
                  for node in graph.nodes)
    outputs = tuple(dataclasses.replace(o, ref=ref(o.ref)) for o in graph.outputs)
    return Graph(nodes, outputs, graph.info)
