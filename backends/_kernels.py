"""Kernel substitution: the lowering pass that replaces matched op chains by kernel calls.

``substitute(instrs, ...)`` asks the kernel registry (``meshplan.kernels.find_kernels``) which
patterns of the plan's graph a kernel for this program's device can replace, and rewrites the
rank's instruction list: the ``Compute`` instructions of a match's nodes go and one
``KernelCall`` runs instead. A kernel that updates operands in place runs where its last node
ran; any other as soon as its operands are there (in the layouts its nodes read them in), so
a backward kernel can hand out a gradient the program reads before its last replaced op would
have run. Matches of a ``batch`` kernel with equal constants become one call (AdamW over all
of a rank's shards is one multi-tensor update).

A match is substituted only where that computes exactly what the ops did on this rank's pieces:

- every value a replaced node produces that anything else reads (another op, a redistribution,
  a bucket, the step's results or new state) is one of the kernel's results, and every such
  reader runs after the call;
- each operand is read in one layout by all of the match's nodes, values passed between the
  match's nodes are read in the layout they are made in, and element-wise kernels see pieces
  of one local shape (the planner may shard an update; the kernel then updates shards);
- an operand the kernel updates in place (``KernelSpec.mutates``: param, optimizer state) is
  read by nothing after the call, not even by a redistribution of the old value, and is not
  partial;
- a private value (``Match.private``: a forward kernel's own value left in a replaced node's
  slot for its backward kernel, like cross-entropy's log-sum-exp) is read only by the kernels
  of its pair, in the layout it is made in; otherwise neither of the pair is substituted.

Anything else keeps its ops. ``MESHPLAN_KERNELS=off`` (``kernels.set_kernels_enabled(False)``)
or ``lower(..., kernels=False)`` turns the pass off; the program is then the plan's op by op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import kernels as _kernels
from ..ir import Graph, Node, Ref, TensorMeta
from ..kernels._apply import ADAPTERS
from ..planner import Layout, Partial
from ..planner._placement import local_shape
from ._layout import plain_layout

__all__ = ["KernelCall", "instruction_reads", "kernel_summary", "kernels_report", "run_kernel",
           "substitute"]


@dataclass(frozen=True, slots=True)
class KernelCall:
    """One kernel call on this rank: ``members`` matches (anchor node names), each with its
    operands ``(name, Ref or literal, layout read in)`` and results ``(name, Ref, arity of the
    producing node)``. ``replaced`` lists every node whose op no longer runs."""

    kernel: str
    anchors: tuple[str, ...]
    replaced: tuple[str, ...]
    operands: tuple[tuple[tuple[str, Any, Layout | None], ...], ...]
    results: tuple[tuple[tuple[str, Ref, int], ...], ...]
    attrs: tuple[tuple[str, Any], ...]
    mutates: frozenset[str]

    # what telemetry records for the call (``RunObserver.compute`` reads these two)
    @property
    def name(self) -> str:
        return self.anchors[0] if len(self.anchors) == 1 else f"{self.anchors[0]}+{len(self.anchors) - 1}"

    @property
    def target(self) -> str:
        return f"kernel.{self.kernel}"

    @property
    def attr_refs(self) -> tuple[Ref, ...]:
        """The attributes that are host scalars of the step (read when the call runs)."""
        return tuple(v for _, v in self.attrs if isinstance(v, Ref))


def instruction_reads(ins: Any) -> Iterable[Ref]:
    """The values an instruction of any kind reads (a Compute's operands, a redistribution's
    value, every member of a bucket)."""
    node = getattr(ins, "node", None)
    if isinstance(node, Node):
        return node.refs()
    if isinstance(ins, KernelCall):
        return [*(r for member in ins.operands for _, r, _ in member if isinstance(r, Ref)),
                *ins.attr_refs]
    members = getattr(getattr(ins, "bucket", ins), "members", None)    # a bucket or its start
    if members is not None:
        return [m.ref for m in members]
    ref = getattr(ins, "ref", None)
    return [ref] if isinstance(ref, Ref) else []


def substitute(instrs: Sequence[Any], graph: Graph, out_layout: Mapping[str, tuple],
               sizes: tuple[int, ...], device: str, tail_reads: Iterable[Ref] = (),
               check_available: bool = True) -> list[Any]:
    """``instrs`` with kernels substituted (see the module docstring). ``out_layout``: node name
    -> its output layouts in the plan; ``tail_reads``: values read after the last instruction
    (the step's results and new state); ``check_available=False``: kernels for a device this
    process lacks too (what a plan would use there, for reports)."""
    from ._lower import Compute, Free

    device = str(device).split(":")[0]               # "cuda:1" -> "cuda"
    matches = [m for m in _kernels.find_kernels(graph, device, check_available=check_available)
               if m.kernel in ADAPTERS]
    if not matches:
        return list(instrs)
    pos: dict[str, int] = {}
    reads: dict[str, dict[Ref, Layout | None]] = {}
    for i, ins in enumerate(instrs):
        if isinstance(ins, Compute):
            pos[ins.node.name] = i
            reads[ins.node.name] = dict(zip(ins.node.refs(), ins.reads))
    readers: dict[Ref, list[int]] = {}        # value -> instructions reading it (any layout)
    for i, ins in enumerate(instrs):
        for r in instruction_reads(ins):
            readers.setdefault(r, []).append(i)
    for r in tail_reads:
        readers.setdefault(r, []).append(len(instrs))

    def inside(nodes: Iterable[str]) -> set[int]:
        """The instructions a kernel for ``nodes`` replaces."""
        return {pos[n] for n in nodes}

    claimed: set[str] = set()
    planned: list[_Member] = []
    for m in matches:
        if claimed.intersection(m.nodes) or not all(n in pos for n in m.nodes):
            continue
        member = _check(m, graph, reads, out_layout, sizes, readers, inside(m.nodes))
        if member is not None:
            planned.append(member)
            claimed.update(m.nodes)

    ready = _ready(instrs, graph, out_layout, sizes)
    made_by: dict[Ref, _Member] = {}

    def at_of(group: list[_Member]) -> int:
        """Where the call goes: after the group's last node for kernels that update operands
        in place (an in-place update must not move before a reader of the old value); else
        as soon as every operand is there, in the layout it is read in (a backward kernel
        whose first result the program reads before its last replaced node would run), and
        after the call making any operand that another kernel makes."""
        last = max(pos[n] for g in group for n in g.match.nodes)
        if _kernels.get_kernel(group[0].match.kernel).mutates:
            return last
        at = -1
        for g in group:
            for _, ref, layout in g.operands:
                if isinstance(ref, Ref):
                    maker = made_by.get(ref)
                    at = max(at, ready.get((ref, layout), last) if maker is None
                             else at_of([maker]))
        return min(at, last)

    while True:                       # placing a group may drop a private value's partner
        planned = _paired(planned, readers, inside, out_layout, sizes)
        made_by = {ref: g for g in planned for _, ref, _ in g.results}
        groups = [g for g in (_place(g, readers, at_of, inside) for g in _groups(planned)) if g]
        if sum(map(len, groups)) == len(planned):
            break
        planned = [m for g in groups for m in g]
    if not groups:
        return list(instrs)

    replaced = {n for g in groups for m in g for n in m.match.nodes}
    after: dict[int, list[KernelCall]] = {}         # instruction index -> calls right after it
    spans = []
    for group in groups:
        call = _call(group, _kernels.get_kernel(group[0].match.kernel).mutates)
        at = at_of(group)
        after.setdefault(at, []).append(call)
        spans.append((at, {r.node for r in instruction_reads(call)}))
    # an operand freed at or before its call's place (the logits cross-entropy's backward
    # reads, which none of its replaced nodes reads) is freed right after the call instead
    deferred: dict[int, set[str]] = {}
    out: list[Any] = []

    def emit_calls(i: int) -> None:
        out.extend(after.get(i, ()))
        if i in deferred:
            out.append(Free(tuple(sorted(deferred.pop(i)))))

    emit_calls(-1)
    for i, ins in enumerate(instrs):
        if isinstance(ins, Compute) and ins.node.name in replaced:
            pass
        elif isinstance(ins, Free):
            keep = []
            for name in ins.names:
                later = [at for at, names in spans if i <= at and name in names]
                if later:
                    deferred.setdefault(max(later), set()).add(name)
                else:
                    keep.append(name)
            if keep:
                out.append(Free(tuple(keep)))
        else:
            out.append(ins)
        emit_calls(i)
    return out


def _ready(instrs: Sequence[Any], graph: Graph, out_layout: Mapping[str, tuple],
           sizes: tuple[int, ...]) -> dict[tuple[Ref, Layout | None], int]:
    """``(value, layout) -> index of the instruction that makes it`` (its op, or the
    redistribution or bucket that brings it into that layout); -1 for the step's inputs. Keys
    carry both the plain layout and None (a read that takes the value as produced)."""
    from ._lower import Bucket, Compute, Reshard

    made: dict[tuple[Ref, Layout | None], int] = {}
    for node in graph.inputs:
        ref = Ref(node.name)
        made[(ref, None)] = made[(ref, _produced(out_layout, ref, sizes))] = -1
    for i, ins in enumerate(instrs):
        if isinstance(ins, Compute):
            for k in range(len(ins.node.outputs)):
                ref = Ref(ins.node.name, k)
                made[(ref, None)] = i
                if ins.node.name in out_layout:
                    made[(ref, _produced(out_layout, ref, sizes))] = i
        elif isinstance(ins, Reshard):
            made.setdefault((ins.ref, plain_layout(ins.dst, sizes)), i)
        elif isinstance(ins, Bucket):
            for m in ins.members:
                made.setdefault((m.ref, plain_layout(m.dst, sizes)), i)
    return made


@dataclass(frozen=True, slots=True)
class _Member:
    match: Any                                   # kernels.Match
    operands: tuple[tuple[str, Any, Layout | None], ...]
    results: tuple[tuple[str, Ref, int], ...]
    mutated: tuple[Ref, ...]


def _check(m: Any, graph: Graph, reads: Mapping[str, Mapping[Ref, Layout | None]],
           out_layout: Mapping[str, tuple], sizes: tuple[int, ...],
           readers: Mapping[Ref, list[int]], inside: set[int]) -> _Member | None:
    spec = _kernels.get_kernel(m.kernel)
    for n in m.nodes:                   # values passed between the replaced nodes stay put
        for ref, layout in reads[n].items():
            if (ref.node in m.nodes and layout is not None
                    and plain_layout(layout, sizes) != _produced(out_layout, ref, sizes)):
                return None
    operands = []
    shapes = set()
    layout_from = dict(m.layout_from)
    for name, ref in m.operands:
        if not isinstance(ref, Ref):
            operands.append((name, ref, None))
            continue
        by = [layout_from[name]] if name in layout_from else m.nodes
        read_as = {reads[n][ref] for n in by if n in reads and ref in reads[n]}
        layouts = {None if lay is None else plain_layout(lay, sizes) for lay in read_as}
        if len(layouts) != 1:
            return None                 # read in several layouts (or by no replaced node)
        (layout,) = layouts
        meta = graph.meta(ref)
        if isinstance(meta, TensorMeta) and layout is not None:
            if name in spec.mutates and any(isinstance(p, Partial) for p in layout):
                return None
            if spec.batch:
                shapes.add(local_shape(meta.shape, layout, sizes))
        # read as the replaced ops read it (the copy a reshard or a transfer made, keyed by
        # that layout), where they agree; ``plain_layout`` only drops what a size-1 axis says
        # (a stage sent a gradient as P(avg) over dp=1: read as R it was found nowhere)
        operands.append((name, ref, next(iter(read_as)) if len(read_as) == 1 else layout))
    if len(shapes) > 1:
        return None                     # element-wise kernel on pieces of different shapes
    results = {ref for _, ref in m.results}
    for n in m.nodes:                   # everything read outside the match must be a result
        for k in range(len(graph.node(n).outputs)):
            ref = Ref(n, k)
            if ref not in results and any(i not in inside for i in readers.get(ref, [])):
                return None
    by_name = {name: (ref, layout) for name, ref, layout in operands}
    mutated = []
    for name, ref in m.results:
        if name in spec.mutates:
            if name not in by_name or not isinstance(by_name[name][0], Ref):
                return None
            src_ref, src_layout = by_name[name]
            if plain_layout(out_layout[ref.node][ref.index], sizes) != (
                    None if src_layout is None else plain_layout(src_layout, sizes)):
                return None             # the result must be the updated piece itself
            mutated.append(src_ref)
    arity = [(name, ref, len(graph.node(ref.node).outputs)) for name, ref in m.results]
    return _Member(m, tuple(operands), tuple(arity), tuple(mutated))


def _produced(out_layout: Mapping[str, tuple], ref: Ref, sizes: tuple[int, ...]) -> Layout | None:
    layout = out_layout[ref.node][ref.index]
    return None if layout is None else plain_layout(layout, sizes)


def _paired(planned: list[_Member], readers: Mapping[Ref, list[int]],
            inside_of: Callable[[Iterable[str]], set[int]], out_layout: Mapping[str, tuple],
            sizes: tuple[int, ...]) -> list[_Member]:
    """``planned`` without the members whose private values (``Match.private``) cannot be
    handed over: a private result must be read only by the members that read it privately, in
    the layout it is produced in (no redistribution, no op left reading the graph's value
    there), and a private operand must come from a planned member's private result."""
    while True:
        made: dict[Ref, _Member] = {}
        taken: dict[Ref, list[tuple[_Member, Layout | None]]] = {}
        for g in planned:
            private = set(g.match.private)
            for name, ref, _ in g.results:
                if name in private:
                    made[ref] = g
            for name, ref, layout in g.operands:
                if name in private and isinstance(ref, Ref):
                    taken.setdefault(ref, []).append((g, layout))
        bad = {id(g) for ref, users in taken.items() if ref not in made for g, _ in users}
        for ref, g in made.items():
            users = taken.get(ref, [])
            allowed = set().union(*(inside_of(m.match.nodes) for m in (g, *(u for u, _ in users))))
            if (any(i not in allowed for i in readers.get(ref, []))
                    or any(layout != _produced(out_layout, ref, sizes) for _, layout in users)):
                bad |= {id(g), *(id(u) for u, _ in users)}
        if not bad:
            return planned
        planned = [g for g in planned if id(g) not in bad]


def _groups(planned: list[_Member]) -> list[list[_Member]]:
    groups: dict[tuple, list[_Member]] = {}
    for i, member in enumerate(planned):
        spec = _kernels.get_kernel(member.match.kernel)
        key = (member.match.kernel, member.match.attrs) if spec.batch else (member.match.kernel, i)
        groups.setdefault(key, []).append(member)
    return list(groups.values())


def _place(group: list[_Member], readers: Mapping[Ref, list[int]],
           at_of: Callable[[list[_Member]], int],
           inside_of: Callable[[Iterable[str]], set[int]]) -> list[_Member]:
    """Drop members until one call right after instruction ``at_of(group)`` works for all: no
    outside reader of a result at or before it, no reader of an updated-in-place value after
    it."""
    group = list(group)
    while group:
        at = at_of(group)
        inside = inside_of(n for g in group for n in g.match.nodes)
        bad = []
        for g in group:
            result_readers = [i for _, ref, _ in g.results for i in readers.get(ref, [])
                              if i not in inside]
            old_readers = [i for ref in g.mutated for i in readers.get(ref, [])
                           if i not in inside]
            if any(i <= at for i in result_readers) or any(i > at for i in old_readers):
                bad.append(g)
        if not bad:
            return group
        group = [g for g in group if g not in bad]
    return group


def _call(group: list[_Member], mutates: frozenset[str]) -> KernelCall:
    m0 = group[0].match
    return KernelCall(
        kernel=m0.kernel, anchors=tuple(g.match.anchor for g in group),
        replaced=tuple(n for g in group for n in g.match.nodes),
        operands=tuple(g.operands for g in group), results=tuple(g.results for g in group),
        attrs=m0.attrs, mutates=mutates)


def run_kernel(call: KernelCall, read: Callable[[Ref, Layout | None], Any],
               env: dict[str, tuple], inputs: Mapping[str, Any], donate: bool) -> None:
    """Run ``call`` on this rank's values and put its results into ``env``. An operand the
    kernel updates in place is copied first when it is one of the caller's tensors
    (``inputs``: input node name -> value) and the caller did not ``donate`` them."""
    names = [name for name, _, _ in call.operands[0]]
    ops: dict[str, list[Any]] = {name: [] for name in names}
    for member in call.operands:
        for name, ref, layout in member:
            value = read(ref, layout) if isinstance(ref, Ref) else ref
            if (name in call.mutates and not donate and isinstance(ref, Ref)
                    and _is_callers(value, inputs.get(ref.node))):
                value = value.clone()
            ops[name].append(value)
    attrs = {k: read(v, None) if isinstance(v, Ref) else v for k, v in call.attrs}
    out = ADAPTERS[call.kernel](ops, attrs)
    for i, member in enumerate(call.results):
        for name, ref, arity in member:
            have = env.get(ref.node)
            outputs = list(have) if have is not None and len(have) == arity else [None] * arity
            outputs[ref.index] = out[name][i]
            env[ref.node] = tuple(outputs)


def _is_callers(value: Any, original: Any) -> bool:
    if not isinstance(value, torch.Tensor) or not isinstance(original, torch.Tensor):
        return False
    if value is original:
        return True
    try:
        return value.untyped_storage().data_ptr() == original.untyped_storage().data_ptr()
    except RuntimeError:
        return False


def kernels_report(plan: Any, device: str | None = None, rank: int = 0) -> dict[str, Any]:
    """Which kernels rank ``rank``'s program uses on ``device`` (default: the topology's,
    ``cpu`` for the ``cpu`` preset and machines fitted on CPUs, else ``cuda``), whether or not
    this process has that device:
    ``{"device", "rank", "enabled", "kernels": [{"kernel", "backend", "calls", "updates",
    "replaced_nodes", "doc"}]}`` (``updates``: matches, e.g. parameters an optimizer kernel
    updates)."""
    from ._lower import lower

    device = device or plan.mesh.topology.device
    prog = lower(plan, rank, device=device, check_available=False)
    rows = []
    for kernel, calls, updates, replaced in kernel_summary(prog.instructions):
        spec = _kernels.get_kernel(kernel)
        rows.append({"kernel": kernel, "backend": spec.backend.value, "calls": calls,
                     "updates": updates, "replaced_nodes": replaced, "doc": spec.doc})
    return {"device": device, "rank": rank, "enabled": _kernels.kernels_enabled(),
            "kernels": rows}


def kernel_summary(instrs: Iterable[Any]) -> list[tuple[str, int, int, int]]:
    """``(kernel, calls, updates, replaced nodes)`` per kernel in a program (``updates``: the
    matches its calls serve, e.g. parameters an optimizer kernel updates)."""
    seen: dict[str, list[int]] = {}
    for ins in instrs:
        if isinstance(ins, KernelCall):
            s = seen.setdefault(ins.kernel, [0, 0, 0])
            s[0] += 1
            s[1] += len(ins.anchors)
            s[2] += len(ins.replaced)
    return [(k, *v) for k, v in seen.items()]

