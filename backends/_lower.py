"""Lowering: a Plan becomes one program per rank.

A ``Program`` is a straight-line list of instructions built from the plan's graph for one
rank: ``Reshard`` (the collectives and local slices that change a value's layout on its way to a
consumer, to the state it updates or back to the user) and ``Compute`` (the aten op on local
shards, its literal arguments rewritten for local shapes by the op's sharding rule). Running it
needs only a ``Communicator``; the same program runs on gloo, NCCL, MPI or threads.

The collectives are the plan's: axis by axis in mesh order, as the planner priced them. Where
that order would be wrong for a dim sharded by several axes (gathering an outer axis first
interleaves pieces), the lowering gathers inner axes first, or, failing that, gathers the whole
value and slices it: always correct, and the bytes it moves differ from the plan's only there
(``Reshard.exact`` says which).

A step is applied on every rank or on none. An op that fails on one rank (an index only that
rank holds out of range, memory it cannot get) does not leave its peers waiting in a collective:
the failing rank goes on through the program's collectives with zero-filled pieces of the right
shapes (``Program.placeholders``), skipping every op, and before the first instruction that
changes state in place (``Program.commit``: an optimizer kernel updating donated state) or at
the end, all ranks vote with one 8-byte all-reduce (max) over the world. Any failure and no
rank keeps the step's new state: the failing rank raises its error and the others
``StepAborted``, both marked ``meshplan_intact`` (the state each rank holds is as before the
step). A failure at or past the commit point, or in a collective, leaves the ranks
inconsistent and is raised as it is.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Protocol

import torch
from torch import Tensor

from .._errors import LoweringError, RuntimeFailure
from ..ir import Graph, Node, NodeKind, OutputKind, Phase, Ref, TensorMeta, is_random, last_uses
from ..ir._graph import _iter_refs
from ..ir._interpret import constant_tensor
from ..ir._ops import resolve
from ..ir._random import takes_generator
from ..planner import Layout, Partial, Plan, ReduceOp, Replicate, Shard
from ..planner._placement import local_shape
from ..planner.rules import rule_for
from ._bucket import (DEFAULT_BUCKET_BYTES, Bucket, BucketStart, PendingBucket, bucket,
                      pending_name, run_bucket, start_bucket)
from ._early import Drop, drop, free_copies, reduce_early
from ._kernels import KernelCall, run_kernel, substitute
from ._live import Counter, LiveCopies, LiveEnv
from ._portable import DEVICE_TWINS
from ._layout import axis_group, local_part, plain_layout, rank_coords
from ._rng import StepRNG, call_seeded, op_seed, stream

Value = Any


@dataclass(frozen=True, slots=True)
class Step:
    """One change along one mesh axis: ``kind`` is a collective (``all_gather``,
    ``all_reduce``, ``reduce_scatter``, ``all_to_all``) or a local ``slice`` / ``partial``."""

    kind: str
    axis: int
    group: tuple[int, ...]
    src: Any            # Placement
    dst: Any


@dataclass(frozen=True, slots=True)
class Reshard:
    ref: Ref
    src: Layout
    dst: Layout
    steps: tuple[Step, ...]
    exact: bool          # the steps are the plan's (same collectives, same bytes)
    consumer: str        # a node name, "<state NAME>" or "<result>"


@dataclass(frozen=True, slots=True)
class Compute:
    node: Node
    reads: tuple[Layout | None, ...]     # the layout each Ref is read in (None: not a tensor)
    args: tuple
    kwargs: tuple
    stream: int | None = None            # a random op's stream on this rank (``_rng.py``)


@dataclass(frozen=True, slots=True)
class Free:
    names: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Send:
    """Send this rank's piece of a value (``layout`` None: as made; else its copy in that
    layout) to rank ``peer``: a pipeline stage's value another stage reads. ``tag``: the part
    of the step it belongs to (``_pipeline_run.TAGS``); the receiver takes it by that tag."""

    ref: Ref
    layout: Layout | None
    peer: int
    tag: int = 0


@dataclass(frozen=True, slots=True)
class Recv:
    """Take a value's piece (as ``Send`` names it) from rank ``peer``."""

    ref: Ref
    layout: Layout | None
    peer: int
    shape: tuple[int, ...]
    dtype: str
    tag: int = 0


Instruction = Reshard | Compute | Free | Drop | Bucket | KernelCall | Send | Recv


@dataclass(frozen=True)
class Program:
    """What one rank runs for one step."""

    rank: int
    coords: tuple[int, ...]
    sizes: tuple[int, ...]
    instructions: tuple[Instruction, ...]
    inputs: dict[str, Layout]             # input node target -> the layout this rank holds
    input_nodes: dict[str, str]           # input node name -> target
    state_out: dict[str, tuple[Ref, Layout]]   # state name -> (new value, its stored layout)
    results: tuple[Ref, ...]
    device: str = "cpu"                   # what the kernels were chosen for
    # (node, index) -> (local shape, dtype) of every value a collective reads: a rank whose
    # op failed sends zeros of these shapes so its peers finish the step (``run``)
    placeholders: dict[tuple[str, int], tuple[tuple[int, ...], str]] = field(
        default_factory=dict)
    commit: int | None = None             # first instruction that may change donated state
    # the layout each result is read in (None: as made); default: whole, on every rank
    result_layouts: tuple[Layout | None, ...] | None = None

    @property
    def commit_index(self) -> int:
        return len(self.instructions) if self.commit is None else self.commit

    @cached_property
    def prepared(self) -> tuple[_Op | None, ...]:
        """Per instruction: the ready-to-call ``Compute`` (``run``'s hot path), else None.
        Built on the first run and kept (the program is immutable)."""
        return tuple(_Op(i, self.device) if isinstance(i, Compute) else None
                     for i in self.instructions)

    @cached_property
    def random(self) -> tuple[str, ...]:
        """The random nodes this rank runs (``run`` then needs a ``StepRNG``)."""
        return tuple(i.node.name for i in self.instructions
                     if isinstance(i, Compute) and i.stream is not None)


def lower(plan: Plan, rank: int, *, bucket_bytes: int | None = None,
          device: str = "cpu", kernels: bool = True, check_available: bool = True,
          free_early: bool = True) -> Program:
    """The program of ``rank`` (row-major over the plan's mesh axes). All-reduces of values
    that exist together are merged into buckets of up to ``bucket_bytes`` (``_bucket.py``;
    None: the plan's ``bucket_bytes``, which the cost model chose, else DDP's 25 MiB; 0 turns
    bucketing off and every collective is then exactly the plan's). Where a registered
    kernel for ``device`` can replace a chain of ops on this rank's pieces, one ``KernelCall``
    does (``_kernels.py``; ``kernels=False`` or ``MESHPLAN_KERNELS=off``: none;
    ``check_available=False``: also kernels this process could not run, for reports). A
    partial sum read only reduce-scattered is reduced where it is made and its original
    dropped, and a value's copy in another layout is freed after its last reader
    (``_early.py``; FSDP2 does both with gradients and gathered parameters). ``free_early=
    False``: changes at their first reader, originals and copies kept until the value's
    last reader (for comparison)."""
    raw = lower_raw(plan, rank, device=device)
    program = finish(plan, raw, raw.instrs, raw.state_out, raw.results,
                     bucket_bytes=bucket_bytes, kernels=kernels,
                     check_available=check_available, free_early=free_early)
    swallowed = sorted({n.name for n in plan.graph.nodes if is_random(n)} - set(program.random))
    if swallowed:
        raise LoweringError(f"rank {rank}: random nodes {', '.join(swallowed)} were replaced by a "
                            "kernel, which would draw unseeded; a kernel pattern must not match "
                            "random ops (or lower with kernels=False)")
    return program


@dataclass(frozen=True)
class RawProgram:
    """A rank's instructions straight from the plan (``lower_raw``): one ``Reshard`` per layout
    change at its first reader, one ``Compute`` per op, a ``Free`` after each node's last
    reader; no buckets, kernels or early frees yet (``finish`` adds them)."""

    rank: int
    coords: tuple[int, ...]
    sizes: tuple[int, ...]
    instrs: tuple[Instruction, ...]
    inputs: dict[str, Layout]
    state_out: dict[str, tuple[Ref, Layout]]
    results: tuple[Ref, ...]
    device: str
    out_layout: dict[str, tuple[Layout | None, ...]]      # node -> its outputs' layouts


def lower_raw(plan: Plan, rank: int, *, device: str = "cpu") -> RawProgram:
    """The instructions of ``rank`` before the passes ``finish`` runs (see ``lower``)."""
    graph, sizes = plan.graph, plan.mesh.sizes
    world = math.prod(sizes)
    if not 0 <= rank < world:
        raise LoweringError(f"rank {rank} is outside the mesh {plan.mesh} ({world} ranks)")
    coords = rank_coords(rank, sizes)
    placed = {p.node: p for p in plan.placements}
    out_layout = {name: p.outputs for name, p in placed.items()}
    instrs: list[Instruction] = []
    inputs: dict[str, Layout] = {}
    available: dict[tuple[str, int], set[tuple[Layout, bool]]] = {}
    last = last_uses(graph)

    def need(ref: Ref, layout: Layout, consumer: str, forward: bool = False) -> None:
        # a copy serves the forward's readers, or the later ones (FSDP's reshard after
        # forward: a parameter gathered for the forward is gathered again for the backward
        # rather than held in between); each copy is freed after its last reader (_early.py).
        # A sum made whole (all-reduces only) is no larger than its pieces, which it frees:
        # the forward's copy serves the later readers too, reduced once
        have = out_layout[ref.node][ref.index]
        side = available.setdefault((ref.node, ref.index), set())
        if layout == have or (layout, forward) in side:
            return
        steps, exact = plan_steps(have, layout, sizes, coords)
        if (layout, True) in side and all(s.kind == "all_reduce" for s in steps):
            return
        instrs.append(Reshard(ref, have, layout, steps, exact, consumer))
        side.add((layout, forward))

    for i, node in enumerate(graph.nodes):
        if node.kind is NodeKind.INPUT:
            inputs[node.target] = placed[node.name].outputs[0]
        elif node.kind is NodeKind.OP:
            p = placed[node.name]
            for ref, layout in zip(node.refs(), p.inputs):
                if layout is not None and isinstance(graph.meta(ref), TensorMeta):
                    need(ref, layout, node.name, node.phase is Phase.FORWARD)
            ins = _compute(graph, node, p.inputs, p.outputs, sizes)
            if is_random(node):
                ins = replace(ins, stream=stream(node, p.outputs, coords, sizes))
            instrs.append(_on_device(ins, device))
        elif node.kind in (NodeKind.HOST, NodeKind.CONSTANT):
            instrs.append(_on_device(Compute(node, tuple(None for _ in node.refs()), node.args,
                                             node.kwargs), device))
        if i in last:
            instrs.append(Free(tuple(last[i])))
    inputs_by_name = {n.target: n.name for n in graph.inputs}
    state_out: dict[str, tuple[Ref, Layout]] = {}
    results = []
    rep = tuple(Replicate() for _ in sizes)
    for o in graph.outputs:
        if o.kind is OutputKind.STATE:
            target = (placed[inputs_by_name[o.name]].outputs[0] if o.name in inputs_by_name
                      else out_layout[o.ref.node][o.ref.index])
            need(o.ref, target, f"<state {o.name}>")
            state_out[o.name] = (o.ref, target)
        else:
            need(o.ref, rep, "<result>")
            results.append(o.ref)
    return RawProgram(rank, coords, sizes, tuple(instrs), inputs, state_out, tuple(results),
                      device, out_layout)


def finish(plan: Plan, raw: RawProgram, instrs: Sequence[Instruction],
           state_out: dict[str, tuple[Ref, Layout]], results: Sequence[Ref], *,
           bucket_bytes: int | None = None, kernels: bool = True, check_available: bool = True,
           free_early: bool = True, result_layouts: tuple[Layout | None, ...] | None = None,
           input_nodes: dict[str, str] | None = None) -> Program:
    """The program that runs ``instrs`` (``raw``'s, or a part of them) and ends with
    ``state_out`` and ``results`` (read in ``result_layouts``; default whole): buckets,
    kernels and early frees as ``lower`` describes, the commit point and the placeholders.
    ``input_nodes``: the inputs it reads (default: every input of the graph)."""
    graph, sizes, device = plan.graph, raw.sizes, raw.device
    rep = tuple(Replicate() for _ in sizes)
    layouts = result_layouts if result_layouts is not None else tuple(rep for _ in results)
    if bucket_bytes is None:
        bucket_bytes = plan.bucket_bytes if plan.bucket_bytes is not None else DEFAULT_BUCKET_BYTES
    instrs = bucket(list(instrs), graph, sizes, bucket_bytes)
    if kernels:
        instrs = substitute(instrs, graph, raw.out_layout, sizes, device,
                            tail_reads=[*(r for r, _ in state_out.values()), *results],
                            check_available=check_available)
    # a result read as made keeps its original (the producer's layout)
    tail = [*((r, layout) for r, layout in state_out.values()),
            *((r, layout if layout is not None else raw.out_layout[r.node][r.index])
              for r, layout in zip(results, layouts))]
    if free_early:
        instrs = free_copies(reduce_early(instrs, graph, sizes, tail_reads=tail), tail)
    commit = next((i for i, ins in enumerate(instrs)
                   if isinstance(ins, KernelCall) and ins.mutates), None)
    return Program(raw.rank, raw.coords, sizes, tuple(instrs), raw.inputs,
                   input_nodes if input_nodes is not None
                   else {n.name: n.target for n in graph.inputs}, state_out, tuple(results),
                   device, _placeholders(instrs, graph, sizes), commit,
                   None if result_layouts is None else tuple(layouts))


def _placeholders(instrs: Sequence[Instruction], graph: Graph, sizes: tuple[int, ...]
                  ) -> dict[tuple[str, int], tuple[tuple[int, ...], str]]:
    out = {}
    for ins in instrs:
        members = (ins.members if isinstance(ins, Bucket) else ins.bucket.members
                   if isinstance(ins, BucketStart) else (ins,) if isinstance(ins, Reshard) else ())
        for r in members:
            meta = graph.meta(r.ref)
            if isinstance(meta, TensorMeta):
                out[(r.ref.node, r.ref.index)] = (local_shape(meta.shape, r.src, sizes),
                                                   meta.dtype)
    return out


def _compute(graph: Graph, node: Node, ins: tuple[Layout | None, ...],
             outs: tuple[Layout | None, ...], sizes: tuple[int, ...]) -> Compute:
    rule = rule_for(node.target)
    if rule is None:
        return Compute(node, ins, node.args, node.kwargs)
    in_shapes = [_local(graph.meta(r), l, sizes) for r, l in zip(node.refs(), ins)]
    out_shapes = [_local(m, l, sizes) for m, l in zip(node.outputs, outs)]
    args, kwargs = rule.local_args(node, in_shapes, out_shapes)
    return Compute(node, ins, args, kwargs)


def _local(meta: Any, layout: Layout | None, sizes: tuple[int, ...]) -> tuple[int, ...] | None:
    if not isinstance(meta, TensorMeta) or layout is None:
        return None
    return local_shape(meta.shape, layout, sizes)


# ---- redistribution ---------------------------------------------------------------------------

def _kind(a: Any, b: Any) -> str | None:
    if a == b:
        return None
    if isinstance(a, Replicate):
        return "slice" if isinstance(b, Shard) else "partial"
    if isinstance(a, Shard):
        return "all_gather" if isinstance(b, Replicate) else (
            "all_to_all" if isinstance(b, Shard) else None)
    if isinstance(b, Replicate):
        return "all_reduce"
    if isinstance(b, Shard) and a.op is not ReduceOp.NORM2:
        return "reduce_scatter"
    return None                     # P(sum) <-> P(avg); a 2-norm's pieces only all-reduce


def _innermost(cur: list, axis: int, dims: set[int]) -> bool:
    """No axis after ``axis`` shards one of ``dims``: its pieces are the innermost."""
    return not any(isinstance(p, Shard) and p.dim in dims for p in cur[axis + 1:])


def _valid(cur: list, axis: int, kind: str, a: Any, b: Any) -> bool:
    dims = {p.dim for p in (a, b) if isinstance(p, Shard)}
    return kind in ("all_reduce", "partial") or _innermost(cur, axis, dims)


def plan_steps(src: Layout, dst: Layout, sizes: tuple[int, ...],
               coords: tuple[int, ...]) -> tuple[tuple[Step, ...], bool]:
    """The steps from ``src`` to ``dst``: the plan's (axis order) when they are valid, else
    inner axes first, else gather everything and slice. Second value: whether the steps are
    the plan's. Placements on an axis of size 1 all mean the whole value: nothing moves there."""
    src, dst = plain_layout(src, sizes), plain_layout(dst, sizes)
    changing = [a for a in range(len(sizes)) if src[a] != dst[a]]
    for order, exact in ((changing, True), (changing[::-1], False)):
        steps = _try(src, dst, order, sizes, coords)
        if steps is not None:
            return steps, exact
    rep = tuple(Replicate() for _ in sizes)
    mid = tuple(p if isinstance(p, Partial) and p == q else Replicate()
                for p, q in zip(src, dst))
    gather = [a for a in range(len(sizes)) if src[a] != mid[a]][::-1]
    first = _try(src, mid, gather, sizes, coords)
    then = _try(mid, dst, [a for a in range(len(sizes)) if mid[a] != dst[a]], sizes, coords)
    if first is None or then is None:
        raise LoweringError(f"no way to change layout {src} into {dst} (via {rep})")
    return first + then, False


def _try(src: Layout, dst: Layout, order: Sequence[int], sizes: tuple[int, ...],
         coords: tuple[int, ...]) -> tuple[Step, ...] | None:
    cur = list(src)
    steps = []
    for axis in order:
        a, b = cur[axis], dst[axis]
        kind = _kind(a, b)
        if kind is None or not _valid(cur, axis, kind, a, b):
            return None
        steps.append(Step(kind, axis, axis_group(coords, axis, sizes), a, b))
        cur[axis] = b
    return tuple(steps)


def reshard(t: Tensor, steps: Sequence[Step], comm: Any, coords: tuple[int, ...]) -> Tensor:
    """Apply ``steps`` to this rank's piece ``t``."""
    for s in steps:
        n = len(s.group)
        if s.kind == "slice":
            t = t.chunk(n, s.dst.dim)[coords[s.axis]].contiguous()
        elif s.kind == "partial":
            if s.dst.op is not ReduceOp.AVG and coords[s.axis] != 0:   # sum, norm2: zeros
                t = torch.zeros_like(t)
        elif s.kind == "all_gather":
            t = comm.all_gather(t, s.group, s.src.dim)
        elif s.kind == "all_reduce" and s.src.op is ReduceOp.NORM2:
            t = comm.all_reduce(t * t, s.group, "sum").sqrt()   # the norm of the pieces' norms
        elif s.kind == "all_reduce":
            t = comm.all_reduce(t, s.group, s.src.op.value)
        elif s.kind == "reduce_scatter":
            t = comm.reduce_scatter(t, s.group, s.dst.dim, s.src.op.value)
        elif s.kind == "all_to_all":
            t = comm.all_to_all(t, s.group, s.dst.dim, s.src.dim)
        else:
            raise LoweringError(f"unknown redistribution step {s.kind}")
    return t


# ---- running ----------------------------------------------------------------------------------

class RunObserver(Protocol):
    """What ``run`` tells an observer (telemetry). ``time_ops``: call ``compute`` for every op
    (two clock reads per op); ``reshard`` is always called, after the instruction, with the
    slice ``comm.records[first:last]`` of collectives it made, and ``vote`` likewise for the
    step's vote (the all-or-nothing check, module docstring). ``track_memory``: count the
    tensor storage the program holds as it runs, into the ``_live.Counter`` that ``memory()``
    gives (its ``peak`` is the step's)."""

    time_ops: bool
    track_memory: bool

    def memory(self) -> Counter: ...

    def reshard(self, ins: Reshard | Bucket, first: int, last: int) -> None: ...

    def compute(self, node: Node | KernelCall, start_s: float, dur_s: float) -> None: ...

    def vote(self, first: int, last: int) -> None:
        """The step's vote made ``comm.records[first:last]`` (``run``)."""


def run(program: Program, comm: Any, state: Mapping[str, Tensor],
        data: Mapping[str, Tensor], observer: RunObserver | None = None, *,
        donate: bool = False, rng: StepRNG | None = None,
        preset: Mapping[tuple[str, int, Layout | None], Tensor] | None = None,
        vote: bool = True,
        sends: list[Any] | None = None,
        keep: dict[str, Any] | None = None) -> tuple[list[Tensor], dict[str, Tensor]]:
    """One step on this rank: ``state`` and ``data`` hold this rank's pieces by input name.
    Returns the results (whole, on every rank) and the new state pieces. ``observer`` sees
    each redistribution's collectives and, if it asks, each op's (and kernel call's) time
    (``perf_counter``). ``donate=True``: the caller gives up ``state``'s tensors, and kernels
    that update state in place (the optimizer's) may overwrite them instead of copying.
    ``rng``: the run's seed and this step's number, which seed the program's random ops
    (``_rng.py``); required when it has any (``program.random``). ``preset``: values the
    program reads but does not make, by ``(node, output index, layout)`` (layout None: the
    value as made; else its copy in that layout): a part of a step (``_microbatch.py``).
    ``vote=False``: no all-or-nothing vote (a part of a step whose ranks run different
    programs, a pipeline stage's: ``_pipeline_run.py``); an op that fails raises here.
    ``sends``: ``Send`` instructions do not wait for their receiver; each one's pending send
    is appended there, for the caller to ``wait()`` (default: each waits). ``keep``: nodes
    whose values (this rank's pieces, all outputs) to keep, by name: each one the program
    computes as its own op is put there as it is made (``DistributedStep.watch``)."""
    if rng is None and program.random:
        raise LoweringError(
            f"rank {program.rank}: the program has random ops ({', '.join(program.random[:3])}"
            f"{', ...' if len(program.random) > 3 else ''}) and run() got no rng; pass "
            "rng=StepRNG(seed, step), the same seed on every rank and a new step number each "
            "step, so replicas draw equal values and steps different ones")
    env: dict[str, tuple] = {}
    copies: dict[str, dict[tuple[int, Layout], Tensor]] = {}   # node -> (index, layout) -> piece
    counter = (observer.memory() if getattr(observer, "track_memory", False)
               else None)
    if counter is not None:                  # count the storages the program holds (_live.py)
        env, copies = LiveEnv(counter), LiveCopies(counter)
    graph_inputs = {**state, **data}
    for name, target in program.input_nodes.items():
        try:
            env[name] = (graph_inputs[target],)
        except KeyError:
            raise LoweringError(f"rank {program.rank}: no value for input {target!r}") from None
    for (name, index, layout), v in (preset or {}).items():
        _put(env, copies, name, index, layout, v)

    def read(ref: Ref, layout: Layout | None) -> Any:
        v = env[ref.node][ref.index]            # None where a Drop released the original
        if layout is None:
            return v
        c = copies.get(ref.node)
        return v if c is None else c.get((ref.index, layout), v)

    timed = observer is not None and observer.time_ops
    caller_inputs = {name: v[0] for name, v in env.items()}
    instructions = program.instructions
    # before ``commit`` nothing the caller holds is changed, so a failure there can be undone
    commit = program.commit_index if donate else len(instructions)
    vote = vote and getattr(comm, "world_size", 1) > 1
    i = -1
    with torch.no_grad():
        try:
            for i, (ins, op) in enumerate(zip(instructions, program.prepared)):
                if i == commit and vote:
                    _vote(comm, program, None, observer)
                if op is not None:                       # a Compute: the hot path, kept flat
                    vals = []
                    for node, index, layout in op.reads:
                        v = env[node][index]
                        if layout is not None:
                            c = copies.get(node)
                            if c is not None:
                                v = c.get((index, layout), v)
                        vals.append(v)
                    t0 = time.perf_counter() if timed else 0.0
                    env[op.name] = op(vals) if op.stream is None else op(
                        vals, op_seed(rng, op.stream))   # type: ignore[arg-type]
                    if keep is not None and op.name in keep:
                        keep[op.name] = env[op.name]
                    if timed:
                        observer.compute(ins.node, t0, time.perf_counter() - t0)
                elif isinstance(ins, Free):
                    for name in ins.names:
                        env.pop(name, None)
                        copies.pop(name, None)
                elif isinstance(ins, Drop):
                    drop(env, copies, ins.items)
                elif isinstance(ins, Reshard):
                    v = env[ins.ref.node][ins.ref.index]
                    first = len(comm.records)
                    copies.setdefault(ins.ref.node, {})[(ins.ref.index, ins.dst)] = reshard(
                        v, ins.steps, comm, program.coords)
                    if observer is not None:
                        observer.reshard(ins, first, len(comm.records))
                elif isinstance(ins, BucketStart):       # pending until its Bucket (the wait)
                    values = [env[m.ref.node][m.ref.index] for m in ins.bucket.members]
                    env[pending_name(ins.bucket)] = (start_bucket(ins.bucket, values, comm),)
                elif isinstance(ins, Bucket):            # records its all-reduce when it returns
                    first = len(comm.records)
                    pending = env.pop(pending_name(ins), None)
                    if pending is None:                  # never started: run it here, blocking
                        values = [env[m.ref.node][m.ref.index] for m in ins.members]
                        pieces = run_bucket(ins, values, comm)
                    else:
                        pieces = pending[0].wait()
                    for m, v in zip(ins.members, pieces):
                        copies.setdefault(m.ref.node, {})[(m.ref.index, m.dst)] = v
                    if observer is not None:
                        observer.reshard(ins, first, len(comm.records))
                elif isinstance(ins, KernelCall):
                    t0 = time.perf_counter()
                    run_kernel(ins, read, env, caller_inputs, donate)
                    if timed:
                        observer.compute(ins, t0, time.perf_counter() - t0)
                elif isinstance(ins, Send):
                    v = read(ins.ref, ins.layout)
                    v = (v.contiguous() if isinstance(v, Tensor) else
                         torch.tensor(v, dtype=torch.float64))
                    if sends is None:
                        comm.send(v, ins.peer, ins.tag)
                    else:
                        sends.append(comm.send_start(v, ins.peer, ins.tag))
                elif isinstance(ins, Recv):
                    if ins.dtype.startswith("scalar:"):      # a host scalar: sent as float64
                        got = comm.recv((), torch.float64, ins.peer, ins.tag).item()
                        kind = ins.dtype[len("scalar:"):]
                        v = int(got) if kind.startswith("int") else (
                            bool(got) if kind == "bool" else got)
                    else:
                        v = comm.recv(ins.shape, getattr(torch, ins.dtype), ins.peer, ins.tag)
                    _put(env, copies, ins.ref.node, ins.ref.index, ins.layout, v)
                else:
                    raise LoweringError(f"rank {program.rank}: unknown instruction {ins!r}")
            if commit >= len(instructions) and vote:
                i = commit                               # a failed vote cannot be undone
                _vote(comm, program, None, observer)
        except StepAborted:
            _settle(env)
            raise
        except Exception as exc:
            if i >= commit or not isinstance(instructions[i], (Compute, KernelCall, Free, Drop)):
                raise                # a collective failed, or state may have changed in place
            _drain(program, i + 1, commit, env, copies, comm)
            try:
                if vote:             # the same collectives as the others, in the same order
                    _vote(comm, program, exc, observer)
            finally:
                _settle(env)
            exc.meshplan_intact = True                   # type: ignore[attr-defined]
            raise
    rep = tuple(Replicate() for _ in program.sizes)
    results = [read(r, rep) for r in program.results] if program.result_layouts is None else \
        [read(r, layout) for r, layout in zip(program.results, program.result_layouts)]
    new_state = {name: read(ref, layout) for name, (ref, layout) in program.state_out.items()}
    if counter is not None:      # counted from nothing by the next program run in this step
        env.release()            # (a step in parts, ``_microbatch.py``)
        copies.release()
    return results, new_state


def _put(env: dict, copies: dict, name: str, index: int, layout: Layout | None,
         v: Any) -> None:
    """Output ``index`` of node ``name`` as made (``layout`` None), else its copy in
    ``layout`` (the node then exists in ``env``, its other outputs None)."""
    have = env.get(name)
    if layout is None or have is None or len(have) <= index:
        have = list(have or ())
        have += [None] * (index + 1 - len(have))
        if layout is None:
            have[index] = v
        env[name] = tuple(have)
    if layout is not None:
        copies.setdefault(name, {})[(index, layout)] = v


class StepAborted(RuntimeFailure):
    """This rank did not apply the step because another rank failed in it (``run``); its state
    is as before the step. ``failed``: the lowest rank that failed."""

    meshplan_intact = True

    def __init__(self, message: str, failed: int) -> None:
        super().__init__(message)
        self.failed = failed


def _vote(comm: Any, program: Program, exc: BaseException | None,
          observer: RunObserver | None) -> None:
    """Every rank says whether it failed (one all-reduce, max, over the world); returns when
    none did, else raises: ``exc`` on a failed rank, ``StepAborted`` on the others."""
    world, first = comm.world_size, len(comm.records)
    flag = torch.tensor([world - program.rank if exc is not None else 0], dtype=torch.int64,
                        device=getattr(comm, "device", None) or program.device)
    got = int(comm.all_reduce(flag, tuple(range(world)), "max").reshape(-1)[0])
    if observer is not None:
        observer.vote(first, len(comm.records))
    if got == 0:
        return
    if exc is not None:
        exc.meshplan_intact = True                       # type: ignore[attr-defined]
        raise exc
    raise StepAborted(f"rank {world - got} failed in this step; rank {program.rank} did not "
                      "apply it (its state is as before the step)", world - got)


def _settle(env: dict[str, tuple]) -> None:
    """Wait for the bucket all-reduces still in flight when a step is abandoned (started before
    the vote, waited after it): every rank started them, so they finish, and no transport is
    left holding requests nobody completes."""
    for v in list(env.values()):
        if len(v) == 1 and isinstance(v[0], PendingBucket):
            v[0].wait()


def _drain(program: Program, start: int, stop: int, env: dict[str, tuple],
           copies: dict[str, dict[tuple[int, Layout], Tensor]], comm: Any) -> None:
    """After an op failed on this rank: run the collectives of instructions ``start:stop`` so
    the other ranks are not left waiting, on zeros where a value was never made; skip every
    op. The results are thrown away: nobody applies this step."""

    def value(ref: Ref) -> Tensor:
        have = env.get(ref.node)
        v = have[ref.index] if have is not None and ref.index < len(have) else None
        if isinstance(v, Tensor):
            return v
        shape, dtype = program.placeholders[(ref.node, ref.index)]
        return torch.zeros(shape, dtype=getattr(torch, dtype), device=program.device)

    for ins in program.instructions[start:stop]:
        if isinstance(ins, Free):
            for name in ins.names:
                env.pop(name, None)
                copies.pop(name, None)
        elif isinstance(ins, Drop):
            drop(env, copies, ins.items)
        elif isinstance(ins, Reshard):
            copies.setdefault(ins.ref.node, {})[(ins.ref.index, ins.dst)] = reshard(
                value(ins.ref), ins.steps, comm, program.coords)
        elif isinstance(ins, BucketStart):
            env[pending_name(ins.bucket)] = (start_bucket(
                ins.bucket, [value(m.ref) for m in ins.bucket.members], comm),)
        elif isinstance(ins, Bucket):
            pending = env.pop(pending_name(ins), None)
            if pending is None:
                run_bucket(ins, [value(m.ref) for m in ins.members], comm)
            else:
                pending[0].wait()


class _Op:
    """A ``Compute`` made ready to call: its function resolved for the program's device, its
    literal arguments built once, and where each value read goes. ``op(values)`` (values in
    ``reads`` order) returns the node's outputs, flattened."""

    __slots__ = ("name", "reads", "stream", "_node", "_fn", "_args", "_kwargs", "_slots",
                 "_device", "_generator")

    def __init__(self, ins: Compute, device: str) -> None:
        node = ins.node
        self._node, self._device, self.name = node, device, node.name
        self.stream = ins.stream
        self._generator = ins.stream is not None and takes_generator(node.target)
        self.reads = tuple((r.node, r.index, layout) for r, layout in zip(node.refs(), ins.reads))
        fn = None if node.kind is NodeKind.CONSTANT else (
            (device != "cpu" and DEVICE_TWINS.get(node.target)) or _LOCAL_OPS.get(node.target)
            or _rule_op(node.target) or resolve(node))
        # an aten overload's own callable: OpOverload.__call__ is one Python frame around it
        self._fn = fn._op if isinstance(fn, torch._ops.OpOverload) else fn
        # Refs only at the top level of the arguments (most ops): fill slots in a copied
        # template; otherwise ``_fill`` walks the nested arguments on every call.
        flat = not any(isinstance(a, tuple) and any(_iter_refs(a))
                       for a in (*ins.args, *(v for _, v in ins.kwargs)))
        if flat:
            none = iter(())
            self._args = [a if isinstance(a, Ref) else _fill(a, none) for a in ins.args]
            self._kwargs = {k: v if isinstance(v, Ref) else _fill(v, none) for k, v in ins.kwargs}
            self._slots = ([i for i, a in enumerate(ins.args) if isinstance(a, Ref)],
                           [k for k, v in ins.kwargs if isinstance(v, Ref)])
        else:
            self._args, self._kwargs, self._slots = ins.args, dict(ins.kwargs), None

    def __call__(self, values: list[Any], seed: int | None = None) -> tuple:
        """``seed``: a random op's generator seed for this call (``_rng.py``)."""
        if self._fn is None:                          # a constant: a fresh tensor each step
            t = constant_tensor(self._node)
            return (t if self._device == "cpu" else t.to(self._device),)
        if self._slots is None:                       # Refs nested in tuples: walk them
            it = iter(values)
            args = [_fill(a, it) for a in self._args]
            kwargs = {k: _fill(v, it) for k, v in self._kwargs.items()}
        else:
            arg_slots, kw_slots = self._slots
            args = self._args.copy()
            for i, v in zip(arg_slots, values):
                args[i] = v
            kwargs = self._kwargs
            if kw_slots:
                kwargs = kwargs.copy()
                for k, v in zip(kw_slots, values[len(arg_slots):]):
                    kwargs[k] = v
        try:
            out = self._fn(*args, **kwargs) if seed is None else call_seeded(
                self._fn, args, kwargs, seed, self._device, self._generator)
        except Exception as e:
            raise _op_error(self._node, e) from e
        return (out,) if isinstance(out, Tensor) else tuple(_flatten(out))


def _on_device(ins: Compute, device: str) -> Compute:
    """A traced factory op names the tracing device (``arange(..., device=cpu)``); a program
    for another device creates its tensors there."""
    if device == "cpu":
        return ins
    dev = torch.device(device)
    swap = lambda v: dev if isinstance(v, torch.device) else v  # noqa: E731
    return Compute(ins.node, ins.reads, tuple(swap(a) for a in ins.args),
                   tuple((k, swap(v)) for k, v in ins.kwargs), ins.stream)


def _op_error(node: Node, e: Exception) -> LoweringError:
    """The error of an op that failed on this rank's pieces: the node, its source line."""
    where = f" at {node.source}" if node.source else ""
    err = LoweringError(f"{node.target} ({node.name}){where} failed on local shards: "
                        f"{type(e).__name__}: {e}")
    err.meshplan_where = str(node.source) if node.source else None  # type: ignore[attr-defined]
    return err


# A view in the traced graph may rely on the strides its input had in the traced run (a
# ``.contiguous()`` that was a no-op there is not in the graph); a local piece that came out of
# a collective is contiguous in its own order. The graph is functional, so a copy where a view
# is impossible changes nothing a later op can observe.
_LOCAL_OPS = {"aten.view.default": torch.ops.aten.reshape.default,
              "aten._unsafe_view.default": torch.ops.aten.reshape.default}


def _rule_op(target: str) -> Any:
    """The sharding rule's per-rank stand-in for ``target``, if it has one (``Rule.local_op``)."""
    rule = rule_for(target)
    return rule.local_op if rule is not None else None


def _fill(a: Any, vals: Iterator[Any]) -> Any:
    if isinstance(a, Ref):
        return next(vals)
    if isinstance(a, tuple):
        return [_fill(x, vals) for x in a]
    return a


def _flatten(out: Any) -> Iterator[Any]:
    if isinstance(out, (tuple, list)):
        for x in out:
            yield from _flatten(x) if isinstance(x, (tuple, list)) else (x,)
    else:
        yield out


def split_inputs(plan: Plan, rank: int, values: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """This rank's pieces of whole input tensors (by input name), per the plan's layouts."""
    sizes = plan.mesh.sizes
    coords = rank_coords(rank, sizes)
    layouts = plan.input_layouts
    return {k: local_part(v, layouts[k], sizes, coords) for k, v in values.items()}


__all__ = ["Bucket", "Compute", "Free", "KernelCall", "Program", "RawProgram", "Reshard",
           "Recv", "RunObserver", "Send", "Step", "StepAborted", "StepRNG", "finish", "lower",
           "lower_raw",
           "plan_steps", "reshard", "run", "split_inputs"]
