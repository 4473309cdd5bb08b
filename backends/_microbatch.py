"""Micro-batches: a step's batch run in ``m`` parts on every rank, its gradients accumulated,
the optimizer once (``distribute(microbatches=m)``; issue 24's first runtime piece).

The plan of the step (any mesh, any strategy) gains one more axis, ``microbatch`` of size
``m``, outermost: ``microbatch_plan`` plans the step on that axis alone as data parallelism
(the ``dp`` family: the batch split on dim 0, the state replicated, all-reduces only) and joins
each value's layout on it to the plan's. A value is then split over the micro-batches where it
depends on the batch, and ``Partial`` where it sums over it (a weight's gradient, the loss).
Outermost, so that micro-batch ``j`` is the ``j``-th contiguous part of the whole batch, which
the other axes then split as the plan splits the whole: a gather over ``dp`` of a batch-split
value gives every ``dp`` rank micro-batch ``j`` whole, as the plan's gather gives it the batch.

The ranks of that plan are ``(rank, micro-batch)``. ``lower_microbatched`` lowers rank ``c``'s
programs for every micro-batch ``j`` and cuts each into two parts:

- the **micro-batch part**: everything that differs from one micro-batch to the next (what
  reads the batch), with what it needs of the rest (a parameter's cast, its gather under
  FSDP). Its results are the partial values the plan all-reduces over ``microbatch``;
- the **step part**: everything after those reductions that does not read the batch (the
  gradients' reductions over the other axes, clipping, the optimizer, the loss), run once.

Each all-reduce over ``microbatch`` is an accumulation: the micro-batch parts run one after
another (the activations of one at a time), their partials are summed (in fp32 for 16-bit
values), and the step part reads the sums. The collectives over the other axes run as the plan
has them; those of the step part once per step, so data parallelism's gradient all-reduce is
paid once, not once per micro-batch.

A value the batch's other micro-batches must finish first couples them: ``nll_loss``'s
``total_weight`` (the count of the whole batch's targets, which its mean and the backward
divide by) is one, and is worked out before the micro-batches from the targets alone (the
ops that make them, then the count), so the loss and its backward are the whole batch's
exactly, as one process computes them. So is any value made from the data inputs alone that
the plan reads whole over the micro-batches, summed or gathered (label smoothing's count of
the targets that are not ignored, a mask of them): the rank has all of its batch before the
first part, so what makes the value runs on each micro-batch's data first, and the pieces
are joined (``hoisted_value``). Where such a whole value meets the model's state (a
sequence-first model's input gathered into a Linear), the parts would not split the
model's work at all, and that is refused. Any other such value (a batch norm's statistics
over the whole batch, an op that gathers the batch) is refused by name: running the parts
in turn cannot make it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from .._errors import LoweringError, PlanError
from ..ir import NodeKind, Ref, Role, TensorMeta
from ..planner import Layout, Partial, Plan, ReduceOp, Replicate, Shard
from ..planner._mesh import Mesh
from ..planner._placement import divides, local_shape
from ..planner._plan import NodePlacement
from ..planner.rules import rule_for
from ._layout import axis_group, rank_coords
from ._lower import (Compute, Free, Program, RawProgram, Recv, Reshard, Send, StepRNG, _Op,
                     finish, lower_raw, plan_steps, reshard, run)
from ._rng import op_seed

MB_AXIS = "microbatch"
_LOCAL_KINDS = ("slice", "partial")            # steps on the micro-batch axis that move nothing
_TOTAL_WEIGHT = ("aten.nll_loss_forward.default", "aten.nll_loss2d_forward.default")
_LIKE = frozenset({"aten.ones_like.default", "aten.zeros_like.default",
                   "aten.empty_like.default", "aten.full_like.default"})


def check_microbatches(m: Any) -> int:
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise PlanError(f"microbatches={m!r}: give a positive int, the number of parts each "
                        "rank's batch is run in (1: the whole batch at once)")
    return m


def microbatch_plan(plan: Plan, m: int) -> Plan:
    """``plan`` with an outermost mesh axis ``microbatch`` of size ``m`` (module docstring):
    every layout gains its placement on that axis from the ``dp`` family's plan of the step on
    it. PlanError, naming the input, where a rank's batch does not split into ``m``."""
    from ..planner._planning import plan_graph

    check_microbatches(m)
    if MB_AXIS in plan.mesh.names:
        raise PlanError(f"mesh {plan.mesh} has an axis named {MB_AXIS!r}, the name micro-"
                        "batches use; rename it")
    data = [n for n in plan.graph.inputs
            if isinstance(n.outputs[0], TensorMeta) and n.outputs[0].role is Role.DATA]
    mesh = Mesh(((MB_AXIS, m), *plan.mesh.axes), plan.mesh.topology)
    for n in data:
        meta, layout = n.outputs[0], plan.input_layouts[n.target]
        ranks = 1
        for p, size in zip(layout, plan.mesh.sizes):
            ranks *= size if isinstance(p, Shard) and p.dim == 0 else 1
        if meta.shape and meta.shape[0] % (ranks * m):
            split = (f"dim 0 over {ranks} ranks of {plan.mesh}" if ranks > 1 else
                     f"the plan does not split it over {plan.mesh}: every rank runs all of it")
            raise PlanError(
                f"microbatches={m}: input {n.target!r} of shape {list(meta.shape)} gives each "
                f"rank {meta.shape[0] // ranks} rows ({split}), which do not split into {m} "
                f"micro-batches; use a batch of a multiple of {ranks * m} rows, or "
                f"microbatches= a divisor of {meta.shape[0] // ranks}")
    try:
        on_axis = plan_graph(plan.graph, {MB_AXIS: m}, topology=plan.mesh.topology,
                             strategy="dp", memory_limit_bytes=1 << 62, recompute="none",
                             axis_order="given")
    except PlanError as e:
        raise PlanError(f"microbatches={m}: the step does not split into micro-batches: "
                        f"{e}") from None
    if [n.name for n in on_axis.graph.nodes] != [n.name for n in plan.graph.nodes]:
        raise PlanError(f"internal: planning the micro-batch axis changed the graph of "
                        f"{plan.graph.info.name!r}")
    by_node = _settle_step_part(plan.graph, {p.node: p for p in on_axis.placements})

    def join(a: Layout | None, b: Layout | None) -> Layout | None:
        return None if a is None or b is None else (*b, *a)

    placements = []
    for p in plan.placements:
        q = by_node[p.node]
        placements.append(NodePlacement(p.node, p.target,
                                        tuple(join(a, b) for a, b in zip(p.inputs, q.inputs)),
                                        tuple(join(a, b) for a, b in zip(p.outputs, q.outputs)),
                                        p.compute_s))
    out = dataclasses.replace(plan, mesh=mesh, placements=tuple(placements),
                              redistributions=())
    for n in data:
        layout = out.input_layouts[n.target]
        if n.outputs[0].shape and not divides(n.outputs[0].shape, layout, mesh.sizes):
            raise PlanError(f"microbatches={m}: input {n.target!r} of shape "
                            f"{list(n.outputs[0].shape)} does not split as {layout} on "
                            f"{mesh}; use a batch the mesh and the micro-batches divide")
    return out


def _settle_step_part(graph: Any, placed: dict[str, NodePlacement]) -> dict[str, NodePlacement]:
    """The micro-batch axis's placements with every op that reads nothing of one micro-batch
    (only values replicated on the axis, or sums over it) replicated on it too. The solver may
    slice such a value over the axis for free (a gradient's norm computed in pieces); run once
    per step, it must be whole."""
    rep = (Replicate(),)
    out = dict(placed)
    whole: set[str] = set()       # nodes run once per step on sums (the whole batch's mean)
    for n in graph.nodes:
        p = out.get(n.name)
        if p is None or n.kind is NodeKind.INPUT:
            continue
        if _reads_sums(n, out, whole) and all(q is None or isinstance(q[0], Replicate)
                                              for q in p.outputs):
            whole.add(n.name)
        if n.target in _LIKE and p.inputs and p.inputs[0] is not None:
            # reads only its input's shape: as made, a sum's partial whole (the backward's
            # seed, ones_like(loss), needs no sum of the loss over the micro-batches)
            ref = next(iter(n.refs()))
            made = out[ref.node].outputs[ref.index] if ref.node in out else None
            if made is not None:
                like = made if isinstance(made[0], Shard) else rep
                out[n.name] = replace(p, inputs=(made, *p.inputs[1:]),
                                      outputs=tuple(None if q is None else like
                                                    for q in p.outputs))
                continue
        if _sum_meets_part(graph, n, p, out, placed, whole):
            # a sum over the whole batch meets a micro-batch's partial (the loss: a summed
            # term reduced, then added to a mean term): run it once on both sums, which
            # running the micro-batches in turn can make, where the partial cannot wait
            out[n.name] = replace(p, inputs=tuple(None if q is None else rep for q in p.inputs),
                                  outputs=tuple(None if q is None else rep for q in p.outputs))
            whole.add(n.name)
            continue
        per_mb = False
        for ref, q in zip(n.refs(), p.inputs):
            made = out[ref.node].outputs[ref.index] if ref.node in out else None
            if made is None or q is None:
                continue
            if not isinstance(made[0], Replicate) and not (
                    isinstance(made[0], Partial) and isinstance(q[0], Replicate)):
                per_mb = True             # a piece of one micro-batch, or its partial
        if not per_mb:
            out[n.name] = replace(p, inputs=tuple(None if q is None else rep for q in p.inputs),
                                  outputs=tuple(None if q is None else rep for q in p.outputs))
    return out


def _reads_sums(n: Any, out: Mapping[str, NodePlacement], whole: set[str]) -> bool:
    """Does ``n`` read, on the micro-batch axis, a sum over it (made partial, read whole),
    or a value made once per step from such sums (``whole``)?"""
    p = out[n.name]
    for ref, q in zip(n.refs(), p.inputs):
        made = out[ref.node].outputs[ref.index] if ref.node in out else None
        if made is not None and q is not None and isinstance(q[0], Replicate) and (
                isinstance(made[0], Partial) or ref.node in whole):
            return True
    return False


def _sum_meets_part(graph: Any, n: Any, p: NodePlacement, out: Mapping[str, NodePlacement],
                    placed: Mapping[str, NodePlacement], whole: set[str] = frozenset()) -> bool:
    """Does ``n`` read, on the micro-batch axis, one value summed over it (made partial, read
    whole; or made once per step from such sums, ``whole``: a mean's division) and another
    still partial, no piece of a micro-batch, and every reader of its result read it whole
    (or its shape only)? Then all of it can run once per step."""
    sums = parts = False
    for ref, q in zip(n.refs(), p.inputs):
        made = out[ref.node].outputs[ref.index] if ref.node in out else None
        if made is None or q is None:
            continue
        if isinstance(made[0], Shard):
            return False
        if ref.node in whole and isinstance(q[0], Replicate):
            sums = True
        if isinstance(made[0], Partial):
            sums = sums or isinstance(q[0], Replicate)
            parts = parts or isinstance(q[0], Partial)
    if not (sums and parts):
        return False
    for user in graph.users.get(n.name, ()):
        u = placed.get(user)
        if u is None or graph.node(user).target in _LIKE:
            continue
        for ref, q in zip(graph.node(user).refs(), u.inputs):
            if ref.node == n.name and q is not None and not isinstance(q[0], Replicate):
                return False
    return True


_BATCH_NORMS = ("aten._native_batch_norm_legit_functional.default",
                "aten._native_batch_norm_legit.default", "aten.native_batch_norm.default",
                "aten._native_batch_norm_legit_no_training.default")


_CHANGE_OP = "change that op"


def _refused(why: str, fix: str | None = None) -> PlanError:
    """The PlanError for what running the step's batch in parts cannot do, with its ``why``
    (the op, its line, the reason) and ``fix``, the way out other than ``microbatches=1``
    (None where there is none) as attributes: a mesh with stages, always in micro-batches,
    offers that alone."""
    e = PlanError(f"{why}. Use microbatches=1, or {fix}" if fix else f"{why}; use microbatches=1")
    e.why, e.fix = why, fix                      # type: ignore[attr-defined]
    return e


def _culprit(graph: Any) -> tuple[str, str]:
    """The first op of the step that needs its whole batch at once, named for the user (a
    batch norm in training, an op that reads the batch and has no sharding rule, a reshape
    that merges the batch inside), and what to do about it."""
    # batch-dependent value -> the dim its batch is on (None where not followed)
    batch: dict[str, int | None] = {
        n.name: 0 for n in graph.inputs
        if isinstance(n.outputs[0], TensorMeta) and n.outputs[0].role is Role.DATA}
    rows = {graph.node(b).outputs[0].shape[0] for b in batch
            if graph.node(b).outputs[0].shape} - {1}
    for n in graph.nodes:
        if n.kind is not NodeKind.OP:
            continue
        where = f"{n.target} ({n.name})" + (f" at {n.source}" if n.source else "")
        if n.target in _BATCH_NORMS and "no_training" not in n.target:
            training = next((a for a in n.args if isinstance(a, bool)), True)
            if training:
                return (f"{where} is a batch norm in training: its statistics are the whole "
                        "batch's (put the model in eval mode, or use a LayerNorm/GroupNorm)",
                        _CHANGE_OP)
        if any(r.node in batch for r in n.refs()):
            batch[n.name] = _batch_dim(graph, n, batch)
            if rule_for(n.target) is None:
                return (f"{where} reads the batch and has no sharding rule, so it runs on the "
                        "whole batch at once (write it with ops meshplan splits: elementwise "
                        "terms and a mean or sum)", _CHANGE_OP)
            inner = _batch_merged_inside(graph, n, rows, batch)
            if inner is not None:
                return (f"{where} merges the batch's dim into one with an outer dim before "
                        f"it ({inner}): a piece of the batch is no contiguous piece of the "
                        "result, so the plan gathers the batch first (a model run "
                        "sequence-first, the batch at dim 1, does this in every Linear on "
                        "3-D activations: run it batch-first, as nn.Transformer*(..., "
                        "batch_first=True) and F.scaled_dot_product_attention on (batch, "
                        "heads, sequence, dim) do; nn.GRU, nn.LSTM and nn.RNN do it inside, "
                        "batch_first or not, and do not split into micro-batches yet)",
                        "run the model batch-first")
    return ("an op after it needs the whole batch at once (a batch norm's statistics, an op "
            "without a sharding rule)", _CHANGE_OP)


_RESHAPES = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default")


def _batch_merged_inside(graph: Any, n: Any, rows: set[int],
                         batch: Mapping[str, int | None]) -> str | None:
    """``"[5, 8, 16] -> [40, 16]"`` where reshape ``n`` merges the batch's dim (where not
    followed, a dim of the batch's size) into an output dim as other than its outermost
    part, else None."""
    from ..planner.rules.view import reshape_groups

    if n.target not in _RESHAPES or not rows:
        return None
    ref = next(iter(n.refs()))
    src, dst = graph.meta(ref), n.outputs[0]
    if not isinstance(src, TensorMeta) or not isinstance(dst, TensorMeta):
        return None
    d = batch.get(ref.node)
    for a, b in reshape_groups(tuple(src.shape), tuple(dst.shape)):
        # where not followed: a dim of the batch's size merged inside, and none outside the
        # merge that could be the batch instead (a head_dim equal to the batch size)
        inner = (d in a[1:] if d is not None
                 else any(src.shape[k] in rows for k in a[1:]) and src.shape[a[0]] not in rows
                 and not any(src.shape[k] in rows for k in range(len(src.shape))
                             if k not in a))
        if len(a) > 1 and b and inner and src.shape[a[0]] > 1:
            return f"{list(src.shape)} -> {list(dst.shape)}"
    return None


def _batch_dim(graph: Any, n: Any, batch: Mapping[str, int | None]) -> int | None:
    """The dim of ``n``'s result its batch is on, followed through the ops that move dims
    (transposes, permutes, reshapes, an embedding's lookup) and those that keep the shape;
    None where not followed."""
    from ..planner.rules.view import reshape_groups

    refs = [r for r in n.refs() if r.node in batch]
    out = n.outputs[0] if n.outputs else None
    if not refs or not isinstance(out, TensorMeta):
        return None
    src = graph.meta(refs[0])
    d = batch[refs[0].node]
    if d is None or not isinstance(src, TensorMeta):
        return None
    t, args = n.target, n.args
    if t == "aten.embedding.default":
        return batch.get(args[1].node) if isinstance(args[1], Ref) else None
    if t == "aten.t.default":
        return 1 - d if len(src.shape) == 2 else d
    if t == "aten.transpose.int":
        a, b = (x % len(src.shape) for x in args[1:3])
        return b if d == a else a if d == b else d
    if t == "aten.permute.default":
        dims = [x % len(src.shape) for x in args[1]]
        return dims.index(d) if d in dims else None
    if t in _RESHAPES:
        for a, b in reshape_groups(tuple(src.shape), tuple(out.shape)):
            if a and a[0] == d:
                return b[0] if b else None
        return None
    if t == "aten.unsqueeze.default":
        return d + (args[1] % len(out.shape) <= d)
    if t in ("aten.select.int", "aten.squeeze.dim"):
        at = args[1] % len(src.shape)
        return None if at == d else d - (at < d)
    if len(out.shape) == len(src.shape) and out.shape[d] == src.shape[d]:
        return d        # elementwise, a matmul's rows, a slice or reduction of other dims
    if len(out.shape) > len(src.shape):         # broadcast against a larger operand
        return d + len(out.shape) - len(src.shape)
    return None


def check_microbatched(plan: Plan) -> None:
    """Raise the PlanError ``lower_microbatched`` would raise on the ranks, here (rank 0's
    first micro-batch is cut as every rank's is)."""
    _cut(plan, lower_parts(plan, 0), 0)


# ---- lowering -------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Hoist:
    """A value the micro-batches share, made before them from the data alone (module
    docstring): ``nll_loss``'s ``total_weight``, or a value of the targets (a mask, a count)
    read whole over the micro-batches."""

    node: Any                              # what makes it: its node (the nll_loss_forward)
    index: int                             # which of the node's outputs
    reads: tuple[Layout | None, ...]       # how the node reads its inputs
    ancestors: tuple[tuple[Any, ...], ...]   # per micro-batch: the instructions that make it
    steps: tuple                           # from its layout as made to ``dst`` (real groups)
    dst: Layout                            # the layout the readers take it in

    @property
    def count(self) -> bool:
        """``nll_loss``'s count: the ancestors make its targets, not the loss."""
        return self.node.target in _TOTAL_WEIGHT and self.index == 1

    @property
    def key(self) -> tuple[str, int, Layout]:
        return (self.node.name, self.index, self.dst)


@dataclass(frozen=True)
class MicrobatchProgram:
    """Rank ``rank``'s step in ``m`` micro-batches (module docstring): ``parts[j]`` makes the
    partial values ``partials`` of micro-batch ``j`` (its batch's pieces cut on ``split``);
    ``step`` reads their sums and makes the step's results and new state."""

    rank: int
    m: int
    parts: tuple[Program, ...]
    step: Program
    partials: tuple[tuple[Ref, ReduceOp], ...]
    split: dict[str, int]                  # data input -> the dim its micro-batches cut
    hoisted: tuple[_Hoist, ...]
    device: str
    # (node, index, layout or None, local shape, dtype): values whose shape alone ops read
    part_stand_ins: tuple[tuple[Any, ...], ...] = ()
    step_stand_ins: tuple[tuple[Any, ...], ...] = ()
    hoist_inputs: dict[str, str] = dataclasses.field(default_factory=dict)   # node -> input

    @property
    def random(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r for p in (*self.parts, self.step) for r in p.random))


def lower_microbatched(plan: Plan, rank: int, *, device: str = "cpu", kernels: bool = True,
                       bucket_bytes: int | None = None,
                       free_early: bool = True) -> MicrobatchProgram:
    """Rank ``rank`` (of the plan without the micro-batch axis) of ``microbatch_plan``'s
    ``plan``, cut into its micro-batch part and its step part (module docstring)."""
    sizes = plan.mesh.sizes
    if plan.mesh.names[0] != MB_AXIS:
        raise LoweringError(f"lower_microbatched needs microbatch_plan's plan (its first axis "
                            f"{MB_AXIS!r}), got mesh {plan.mesh}")
    m, ax = sizes[0], 0
    world = math.prod(sizes[1:])
    raws = [lower_parts(plan, j * world + rank, device=device) for j in range(m)]
    n_ins = {len(r.instrs) for r in raws}
    if len(n_ins) != 1:
        raise LoweringError("internal: micro-batch programs differ in length")
    cut = _cut(plan, raws[0], ax)
    graph = plan.graph
    mb_data = {n.target: p.dim for n in graph.inputs
               if isinstance(p := plan.input_layouts[n.target][ax], Shard)}
    real = lambda raw: replace(raw, rank=rank, instrs=tuple(    # noqa: E731
        _real_groups(i, world) for i in raw.instrs))
    raws = [real(r) for r in raws]
    partials = cut.partials

    parts = []
    for j, raw in enumerate(raws):
        instrs = [raw.instrs[i] for i in cut.per_mb]
        instrs = _with_frees(instrs, keep={r.node for r, _ in partials})
        parts.append(finish(plan, raw, instrs, {}, [r for r, _ in partials],
                            result_layouts=tuple(None for _ in partials),
                            input_nodes=_inputs_read(graph, instrs), kernels=kernels,
                            bucket_bytes=bucket_bytes, free_early=free_early))
    raw = raws[0]
    coords = raw.coords
    instrs = []
    for i in cut.per_step:
        ins = raw.instrs[i]
        if i in cut.hoisted:               # made before the micro-batches: preset
            continue
        if i in cut.reductions:
            src = (Replicate(), *ins.src[1:])
            if src != ins.dst:
                steps, exact = plan_steps(src, ins.dst, sizes, coords)
                instrs.append(_real_groups(Reshard(ins.ref, src, ins.dst, steps, exact,
                                                   ins.consumer), world))
            continue
        instrs.append(ins)
    keep = {r.node for r, _ in raw.state_out.values()} | {r.node for r in raw.results}
    instrs = _with_frees(instrs, keep=keep)
    step = finish(plan, raw, instrs, raw.state_out, raw.results,
                  input_nodes=_inputs_read(graph, instrs, keep), kernels=kernels,
                  bucket_bytes=bucket_bytes, free_early=free_early)
    hoisted = []
    for i in cut.hoisted:
        r = raws[0].instrs[i]
        node, node_reads = hoist_source(graph, raws[0].instrs, r, cut.hoist_makers[i])
        hoisted.append(_Hoist(node, r.ref.index, node_reads,
                              tuple(tuple(rw.instrs[k] for k in cut.hoist_ancestors[i])
                                    for rw in raws),
                              tuple(_real_step(s, world) for s in r.steps), r.dst))
    return MicrobatchProgram(rank, m, tuple(parts), step, partials, mb_data, tuple(hoisted),
                             device, stand_in_spec(cut, cut.per_mb, plan, raws[0]),
                             stand_in_spec(cut, cut.per_step, plan, raws[0]),
                             hoist_inputs(graph, cut, raws[0].instrs))


def hoist_source(graph: Any, instrs: Sequence[Any], copy: Reshard,
                 made: int | None) -> tuple[Any, tuple[Layout | None, ...]]:
    """The node a hoisted copy's value comes from, and how it reads its inputs (an input
    itself: its node, reading nothing)."""
    if made is None:
        return graph.node(copy.ref.node), ()
    return instrs[made].node, instrs[made].reads


def hoist_inputs(graph: Any, cut: _Cut, instrs: Sequence[Any],
                 only: Any = None) -> dict[str, str]:
    """The inputs (node -> name) the hoisted values of ``cut`` read (those of ``only``
    when given): the targets themselves, when the loss reads them, or a mask the step was
    given and the plan gathers."""
    names = {n.name: n.target for n in graph.inputs}
    out = {}
    for i in cut.hoisted if only is None else only:
        made = cut.hoist_makers[i]
        if made is None:
            out[instrs[i].ref.node] = names[instrs[i].ref.node]
            continue
        for k in (*cut.hoist_ancestors[i], made):
            if isinstance(instrs[k], Compute):
                out.update({x.node: names[x.node] for x in instrs[k].node.refs()
                            if x.node in names})
    return out


def stand_in_spec(cut: _Cut, chosen: Sequence[int], plan: Plan,
                  raw: RawProgram) -> tuple[tuple[Any, ...], ...]:
    """``(node, index, layout or None, local shape, dtype)`` of the values that the ops among
    instructions ``chosen`` which read a shape only (``_LIKE``) read: a tensor of that shape
    stands in for each (``_stand_ins``)."""
    out = {}
    for i in chosen:
        for ref, layout in cut.shapes.get(i, ()):
            meta, made = plan.graph.meta(ref), raw.out_layout[ref.node][ref.index]
            given = plan.graph.node(ref.node).kind is NodeKind.INPUT
            for lay in {made, layout if layout is not None else made}:
                if given and lay == made:
                    # an input the part is given (``empty_like(y)``): a stand-in would take
                    # its place for every other reader (``1 - y`` read uninitialised memory)
                    continue
                out[(ref.node, ref.index, None if lay == made else lay)] = (
                    local_shape(meta.shape, lay, plan.mesh.sizes), meta.dtype)
    return tuple((*k, *v) for k, v in out.items())


def lower_parts(plan: Plan, rank: int, device: str = "cpu") -> RawProgram:
    """``lower_raw`` of ``microbatch_plan``'s ``plan``, where a layout change that keeps the
    micro-batch axis's placement moves nothing over it: when the other axes' steps in the
    plan's order are not valid (a dim several axes split), ``plan_steps`` gathers every axis
    and slices again, and a gather over the micro-batches is not one a rank can make. Each
    micro-batch's piece is the other axes' whole (the axis is outermost), so their steps
    alone change it."""
    raw = lower_raw(plan, rank, device=device)
    sizes, coords = raw.sizes, raw.coords
    out = []
    for ins in raw.instrs:
        if isinstance(ins, Reshard) and ins.src[0] == ins.dst[0] and any(
                st.axis == 0 for st in ins.steps):
            steps, _ = plan_steps(ins.src[1:], ins.dst[1:], sizes[1:], coords[1:])
            ins = replace(ins, exact=False, steps=tuple(
                replace(st, axis=st.axis + 1, group=axis_group(coords, st.axis + 1, sizes))
                for st in steps))
        out.append(ins)
    return replace(raw, instrs=tuple(out))


def _real_step(s: Any, world: int) -> Any:
    return replace(s, group=tuple(g % world for g in s.group))


def _real_groups(ins: Any, world: int) -> Any:
    """The instruction with its collectives' groups in real ranks (rank ``c`` of the plan
    without the micro-batch axis, of ``world`` ranks, is rank ``j * world + c`` of the plan
    with it, for micro-batch ``j``)."""
    if isinstance(ins, Reshard):
        return replace(ins, steps=tuple(_real_step(s, world) for s in ins.steps))
    return ins


def _inputs_read(graph: Any, instrs: Sequence[Any], tail: set[str] = frozenset()
                 ) -> dict[str, str]:
    """The inputs ``instrs`` read, and those of ``tail`` (read at the end: a buffer the step
    returns unchanged as its new state)."""
    names = {n.name: n.target for n in graph.inputs}
    read: set[str] = set(tail)
    for ins in instrs:
        if isinstance(ins, Compute):
            read.update(r.node for r in ins.node.refs())
        elif isinstance(ins, (Reshard, Send)):
            read.add(ins.ref.node)
    return {n: t for n, t in names.items() if n in read}


def _with_frees(instrs: Sequence[Any], keep: set[str]) -> list[Any]:
    """``instrs`` (``Free``s dropped) with a ``Free`` after each node's last reader, or after
    the node where nothing reads it; ``keep``: read after the end."""
    body = [i for i in instrs if not isinstance(i, Free)]
    last: dict[str, int] = {}
    for k, ins in enumerate(body):
        if isinstance(ins, Compute):
            last.setdefault(ins.node.name, k)
            for r in ins.node.refs():
                last[r.node] = k
        elif isinstance(ins, (Reshard, Send)):
            last[ins.ref.node] = k
        elif isinstance(ins, Recv):
            last.setdefault(ins.ref.node, k)
    at: dict[int, list[str]] = {}
    for name, k in last.items():
        if name not in keep:
            at.setdefault(k, []).append(name)
    out: list[Any] = []
    for k, ins in enumerate(body):
        out.append(ins)
        if k in at:
            out.append(Free(tuple(at[k])))
    return out


@dataclass
class _Cut:
    per_mb: list[int]
    per_step: list[int]
    reductions: set[int]
    partials: tuple[tuple[Ref, ReduceOp], ...]
    hoisted: list[int]
    hoist_makers: dict[int, int | None]    # None: the value is an input
    hoist_ancestors: dict[int, list[int]]
    shapes: dict[int, list[tuple[Ref, Layout | None]]]     # reads of a shape only
    reads_of: dict[int, list[tuple]]      # instruction -> (value key, its maker then) read
    reduce_ops: dict[int, ReduceOp]       # reduction -> how its partials make the whole


def _cut(plan: Plan, raw: RawProgram, ax: int) -> _Cut:
    """Which instructions run per micro-batch, which once per step (module docstring)."""
    graph = plan.graph
    instrs = raw.instrs
    varies: dict[tuple, bool] = {}        # value key -> differs per micro-batch
    after: dict[tuple, bool] = {}         # value key -> made from a sum over micro-batches
    maker: dict[tuple, int] = {}          # value key -> the instruction that made it
    data: dict[tuple, bool] = {}          # value key -> made from the data inputs alone
    for n in graph.inputs:
        layout = plan.input_layouts[n.target]
        varies[("v", n.name, 0)] = isinstance(layout[ax], Shard)
        after[("v", n.name, 0)] = False
        data[("v", n.name, 0)] = isinstance(n.outputs[0], TensorMeta) and \
            n.outputs[0].role is Role.DATA
    reductions: dict[int, ReduceOp] = {}
    hoisted: set[int] = set()
    reads: dict[int, list[tuple]] = {}
    shapes: dict[int, list[tuple[Ref, Layout | None]]] = {}

    def key_of(ref: Ref, layout: Layout | None, copies: set[tuple]) -> tuple:
        c = ("c", ref.node, ref.index, layout)
        return c if layout is not None and c in copies else ("v", ref.node, ref.index)

    def where(i: int) -> str:
        ins = instrs[i]
        node = graph.node(ins.consumer) if isinstance(ins, Reshard) and \
            not ins.consumer.startswith("<") else getattr(ins, "node", None)
        if node is None:
            return f"{ins.consumer}"
        return f"{node.target} ({node.name})" + (f" at {node.source}" if node.source else "")

    def gathered(i: int) -> PlanError:
        ins = instrs[i]
        if isinstance(ins, Reshard) and ins.consumer == "<result>":
            return _refused(
                f"micro-batches: the step returns {ins.ref}, a value of the whole batch (one "
                "row per sample); the parts run one after another and hand back values "
                "reduced over the batch, not rows of it",
                "return a loss or another value reduced over the batch (a mean, a sum); on a "
                "mesh with a 'pp' axis per-sample results are not built yet")
        bad = {s.kind for s in ins.steps if s.axis == ax} - {"all_reduce", *_LOCAL_KINDS}
        why, fix = _culprit(graph)
        return _refused(
            f"micro-batches: the step does not split over its batch: {why}. So {where(i)} "
            f"reads {ins.ref} whole over the batch ({', '.join(sorted(bad))} over the "
            "micro-batches), which running them one after another cannot make", fix)

    while True:                            # again once a coupling is hoisted
        copies: set[tuple] = set()
        whole: dict[tuple, int] = {}       # value key -> the hoisted gather it is made from
        coupled: list[tuple[int, int | None]] = []
        for i, ins in enumerate(instrs):
            if isinstance(ins, Compute):
                keys = [key_of(r, layout, copies) for r, layout in zip(ins.node.refs(),
                                                                       ins.reads)]
                if ins.node.target in _LIKE:    # its input's shape only: a stand-in serves
                    reads[i] = [(k, None) for k in keys]
                    shapes[i] = [(r, layout) for r, layout in zip(ins.node.refs(), ins.reads)]
                    keys = []
                else:
                    reads[i] = [(k, maker.get(k)) for k in keys]   # the maker when read
                v = any(varies.get(k, False) for k in keys)
                if ins.stream is not None:       # a random op drawing per micro-batch
                    v = v or any(layout is not None and isinstance(layout[ax], Shard)
                                 for layout in plan.placement(ins.node.name).outputs)
                a = any(after.get(k, False) for k in keys)
                if v and a:             # a value of the whole batch read per micro-batch
                    coupled.extend((i, maker.get(k)) for k in keys if after.get(k, False))
                d = ins.stream is None and all(data.get(k, False) for k in keys)
                w = None if v else next((whole[k] for k in keys if k in whole), None)
                if w is not None and not all(data.get(k, False) or after.get(k, False)
                                             for k in keys):
                    # the model itself on the whole batch (a sequence-first Linear's input
                    # gathered, read with its weights): the micro-batches would not split
                    # its work at all (a loss's sum divided by a count is no such work)
                    raise gathered(w)
                for k in range(max(1, len(ins.node.outputs))):
                    key = ("v", ins.node.name, k)
                    varies[key], after[key], maker[key], data[key] = v, a, i, d
                    if w is not None:
                        whole[key] = w
            elif isinstance(ins, Reshard):
                src = ("v", ins.ref.node, ins.ref.index)
                reads[i] = [(src, maker.get(src))]
                kinds = {s.kind for s in ins.steps if s.axis == ax}
                bad = kinds - {"all_reduce", *_LOCAL_KINDS}
                key = ("c", ins.ref.node, ins.ref.index, ins.dst)
                if bad and i not in hoisted and _hoistable(ins, ax, kinds, data.get(src)):
                    hoisted.add(i)      # the data's whole, made before the micro-batches
                if i in hoisted and i not in reductions:
                    copies.add(key)
                    maker[key] = whole[key] = i
                    varies[key], after[key], data[key] = False, False, True
                    continue
                if bad:
                    raise gathered(i)
                copies.add(key)
                maker[key] = i
                data[key] = data.get(src, False)
                if src in whole:
                    whole[key] = whole[src]
                if "all_reduce" in kinds:
                    reductions[i] = ins.src[ax].op
                    varies[key], after[key] = False, i not in hoisted
                else:
                    varies[key] = varies.get(src, False) or bool(kinds)
                    after[key] = after.get(src, False)
        new = False
        bad = []

        def can_hoist(red: int) -> bool:
            r = instrs[red]
            node = graph.node(r.ref.node)
            return (node.target in _TOTAL_WEIGHT and r.ref.index == 1 and
                    reductions[red] is ReduceOp.SUM) or _hoistable(
                        r, ax, {"all_reduce"}, data.get(("v", r.ref.node, r.ref.index)))

        for reader, red in coupled:
            if red is None or red in hoisted:
                continue
            # the sums over the whole batch the value read is made from (itself, or what it
            # was computed from: a backward's 1 / count), all made before the parts or none
            sums = _sums_behind(red, reads, reductions, hoisted, after)
            if sums and all(can_hoist(j) for j in sums):
                hoisted.update(sums)
                new = True
                continue
            j = next((j for j in sums if not can_hoist(j)), None)
            if j is not None:
                r = instrs[j]
                what = f"{r.ref} summed over the whole batch ({graph.node(r.ref.node).target})"
                bad.append((reader, what if j == red else
                            f"{_value(instrs[red])}, made from {what}"))
            else:
                bad.append((reader, f"{_value(instrs[red])}, made from a sum over the whole "
                                    "batch"))
        if bad and not new:             # (a hoist clears what it made: look again first)
            reader, what = bad[0]
            why, fix = _culprit(graph)
            raise _refused(
                f"micro-batches: {where(reader)} reads {what}, so every micro-batch would "
                "have to run up to it before any goes on, which running them one after "
                f"another cannot: {why}", fix)
        if not new:
            break
    state_keys = [("c", r.node, r.index, layout) for r, layout in raw.state_out.values()]
    rep = tuple(Replicate() for _ in raw.sizes)
    result_keys = [("c", r.node, r.index, rep) for r in raw.results]
    ends = []
    for k in [*state_keys, *result_keys]:
        k = k if k in maker else ("v", k[1], k[2])
        if varies.get(k, False):
            raise _refused(f"micro-batches: the step's new state or result {k[1]} differs "
                          "from one micro-batch to the next and is not summed over them")
        ends.append(k)

    def closure(roots: Sequence[int], stop: set[int]) -> set[int]:
        seen: set[int] = set()
        todo = list(roots)
        while todo:
            i = todo.pop()
            if i in seen:
                continue
            seen.add(i)
            if i in stop:
                continue
            for _, j in reads.get(i, ()):
                if j is not None:
                    todo.append(j)
        return seen

    red_set = set(reductions)
    ends_at = red_set | hoisted            # (a hoisted value is preset in both parts)
    per_value = [i for i in reads if i not in ends_at and _at(i, instrs, varies)]
    partial_makers = [reads[i][0][1] for i in reductions if i not in hoisted
                      and reads[i][0][1] is not None]
    mb = closure([*per_value, *partial_makers], ends_at) - ends_at
    late = sorted(i for i in mb if _at(i, instrs, after))
    if late:
        raise _refused(f"micro-batches: {where(late[0])} runs per micro-batch but reads a sum "
                      "over the whole batch")
    step_roots = [i for i in reads if i not in mb and i not in red_set and _at(i, instrs, after)]
    step_roots += [maker[k] for k in ends if k in maker]
    step_roots += [i for i in reductions if i not in hoisted]
    step = closure(step_roots, ends_at)
    crossing = sorted(i for i in step if i not in ends_at and _at(i, instrs, varies))
    if crossing:
        raise _refused(f"micro-batches: {where(crossing[0])} runs once per step but reads a "
                      "value of one micro-batch")
    seen_partials: dict[Ref, ReduceOp] = {}
    for i in sorted(reductions):
        if i not in hoisted:
            seen_partials.setdefault(instrs[i].ref, reductions[i])
    hoist_makers, hoist_ancestors = {}, {}
    for i in sorted(hoisted):
        made = reads[i][0][1]
        hoist_makers[i] = made
        if made is None:                   # an input itself (a mask the step is given)
            hoist_ancestors[i] = []
            continue
        node = instrs[made].node
        earlier = hoisted - {i}            # made before this one: read, not made again
        if node.target in _TOTAL_WEIGHT and instrs[i].ref.index == 1:
            anc = closure([j for _, j in reads[made][1:3] if j is not None], earlier)
        else:                              # the data alone make it (_hoistable)
            anc = closure([made], earlier)
        if any(after.get(("v", instrs[j].node.name, 0), False) for j in anc
               if isinstance(instrs[j], Compute)):
            raise _refused(f"micro-batches: the targets of {node.target} ({node.name}) are "
                          "made from a sum over the batch")
        if any(isinstance(instrs[j], Reshard) and j not in hoisted and any(
                st.axis == ax and st.kind not in _LOCAL_KINDS for st in instrs[j].steps)
               for j in anc):
            raise _refused(f"micro-batches: {where(i)} reads a value made from the batch's "
                          f"data alone ({node.target}, {node.name}) that needs another such "
                          "value whole over the batch first")
        hoist_ancestors[i] = sorted(anc)
    return _Cut(sorted(mb), sorted(step), set(reductions), tuple(seen_partials.items()),
                sorted(hoisted), hoist_makers, hoist_ancestors, shapes, reads, reductions)


def _sums_behind(i: int, reads: Mapping[int, list[tuple]], reductions: Mapping[int, Any],
                 hoisted: set[int], after: Mapping[tuple, bool]) -> list[int]:
    """The sums over the micro-batches (reductions not made before them) that what
    instruction ``i`` makes is computed from, ``i`` itself included."""
    out, seen, todo = [], set(), [i]
    while todo:
        j = todo.pop()
        if j in seen:
            continue
        seen.add(j)
        if j in reductions:
            if j not in hoisted:
                out.append(j)
            continue
        todo.extend(m for k, m in reads.get(j, ()) if m is not None and after.get(k, False))
    return sorted(out)


def _value(ins: Any) -> str:
    """The value an instruction makes, for a message: a node's result or a copy's value."""
    return f"%{ins.node.name}" if isinstance(ins, Compute) else f"{ins.ref}"


def _hoistable(ins: Reshard, ax: int, kinds: set[str], data_only: bool | None) -> bool:
    """Can the copy ``ins`` makes, whole over the micro-batches (a gather or a sum of them),
    be made before them? Where its value is made from the data inputs alone (the targets'
    mask, their count for a mean): the rank has all of its batch before the first part runs,
    so no micro-batch has to run first (``hoisted_value`` runs what makes it per micro-batch
    and joins them)."""
    return bool(data_only) and isinstance(ins.dst[ax], Replicate) and kinds <= {
        "all_gather", "all_reduce", *_LOCAL_KINDS}


def _at(i: int, instrs: Sequence[Any], flags: dict[tuple, bool]) -> bool:
    """The flag of what instruction ``i`` makes (its node's first output, or its copy)."""
    ins = instrs[i]
    if isinstance(ins, Compute):
        return flags.get(("v", ins.node.name, 0), False)
    if isinstance(ins, Reshard):
        return flags.get(("c", ins.ref.node, ins.ref.index, ins.dst), False)
    return False


def split_microbatched(plan: Plan, rank: int, values: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Rank ``rank``'s pieces of whole data inputs for ``microbatch_plan``'s ``plan``: every
    micro-batch's piece of each, joined on the dim the micro-batches cut (``run_microbatched``
    cuts them apart again); an input the micro-batches share, its one piece."""
    from ._layout import local_part

    sizes = plan.mesh.sizes
    m, world = sizes[0], math.prod(sizes[1:])
    out = {}
    for k, v in values.items():
        layout = plan.input_layouts[k]
        parts = [local_part(v, layout, sizes, rank_coords(j * world + rank, sizes))
                 for j in range(m if isinstance(layout[0], Shard) else 1)]
        out[k] = parts[0] if len(parts) == 1 else torch.cat(parts, layout[0].dim)
    return out


# ---- running --------------------------------------------------------------------------------

def run_microbatched(program: MicrobatchProgram, comm: Any, state: Mapping[str, Tensor],
                     data: Mapping[str, Tensor], observer: Any = None, *,
                     donate: bool = False,
                     rng: StepRNG | None = None) -> tuple[list[Tensor], dict[str, Tensor]]:
    """One step of ``program`` on this rank, as ``run`` runs one (the same arguments; ``data``
    holds this rank's pieces of the whole batch): the micro-batches one after another, their
    partial values summed, then the step part once."""
    m = program.m
    pieces = [{k: (v.chunk(m, program.split[k])[j].contiguous() if k in program.split else v)
               for k, v in data.items()} for j in range(m)]
    preset = _stand_ins(program.part_stand_ins, program.device)
    for h in program.hoisted:
        preset[h.key] = hoisted_value(h, comm, state, pieces, rng, program.device,
                                      program.parts[0].coords, [program.hoist_inputs] * m,
                                      preset)
    sums = Sums(dict(program.partials), m)
    counter = observer.memory() if getattr(observer, "track_memory", False) else None
    for j, part in enumerate(program.parts):
        held = sums.held()                             # the sums so far: live through the part
        if counter is not None:
            counter.add(held)
        got, _ = run(part, comm, state, pieces[j], observer, donate=False, rng=rng,
                     preset=preset)
        if counter is not None:
            counter.remove(held)
        sums.add([ref for ref, _ in program.partials], got)
        del got
    step_preset = _stand_ins(program.step_stand_ins, program.device)
    for h in program.hoisted:              # the step part may read it too
        step_preset[h.key] = preset[h.key]
        if h.count:
            step_preset[(h.node.name, 1, None)] = preset[h.key]
    step_preset.update(sums.whole())
    return run(program.step, comm, state, data, observer, donate=donate, rng=rng,
               preset=step_preset)


class Sums:
    """Partial values summed over the micro-batches, by ``Ref``: in fp32 for 16-bit values
    (one process sums inside one matmul in fp32 too), then made whole by their ``ReduceOp``
    (``AVG``: over the ``m`` micro-batches; ``NORM2``: the root of the squares' sum) and cast
    back, as the presets of the step part."""

    def __init__(self, ops: Mapping[Ref, ReduceOp], m: int) -> None:
        self.ops, self.m = ops, m
        self.total: dict[Ref, Tensor] = {}
        self.dtype: dict[Ref, torch.dtype] = {}

    def held(self) -> list[Tensor]:
        return list(self.total.values())

    def add(self, refs: Sequence[Ref], values: Sequence[Tensor]) -> None:
        for ref, v in zip(refs, values):
            self.dtype[ref] = v.dtype
            wide = v.float() if v.dtype in (torch.float16, torch.bfloat16) else v
            if self.ops[ref] is ReduceOp.NORM2:
                wide = wide * wide
            have = self.total.get(ref)
            self.total[ref] = wide.clone() if have is None else have.add_(wide)

    def whole(self) -> dict[tuple[str, int, None], Tensor]:
        out = {}
        for ref, total in self.total.items():
            if self.ops[ref] is ReduceOp.AVG:
                total = total.div_(self.m)
            elif self.ops[ref] is ReduceOp.NORM2:
                total = total.sqrt_()
            out[(ref.node, ref.index, None)] = total.to(self.dtype[ref])
        return out


def _stand_ins(spec: Sequence[tuple[Any, ...]],
               device: str) -> dict[tuple[str, int, Layout | None], Tensor]:
    return {(node, index, layout): torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            for node, index, layout, shape, dtype in spec}


def hoisted_value(h: _Hoist, comm: Any, state: Mapping[str, Tensor],
                  pieces: list[dict[str, Tensor]], rng: StepRNG | None, device: str,
                  coords: tuple[int, ...], input_nodes: Sequence[Mapping[str, str]],
                  made: Mapping[tuple, Tensor] | None = None) -> Tensor:
    """``h``'s value whole over the micro-batches, before they run: what makes it, run on each
    micro-batch's data (for ``nll_loss``'s ``total_weight``: the count, or the class weights'
    sum, of its targets), then joined over the micro-batches here (a sum, a concatenation)
    and changed over the other axes as the plan has it. ``made``: the values hoisted before
    it (by ``_Hoist.key``), which it may read."""
    made = made or {}
    vals = []
    for j, instrs in enumerate(h.ancestors):
        at = (j, *coords[1:])                 # micro-batch j's coordinates
        env: dict[str, tuple] = {}
        copies: dict[str, dict] = {}
        inputs = {**state, **pieces[j]}
        env.update({name: (inputs[t],) for name, t in input_nodes[j].items() if t in inputs})
        for ins in instrs:
            if isinstance(ins, Compute):
                op = _Op(ins, device)
                got = [_read(env, copies, n, i, layout) for n, i, layout in op.reads]
                env[op.name] = op(got) if op.stream is None else op(
                    got, op_seed(rng, op.stream))           # type: ignore[arg-type]
            elif isinstance(ins, Reshard):
                key = (ins.ref.node, ins.ref.index, ins.dst)
                copies.setdefault(ins.ref.node, {})[(ins.ref.index, ins.dst)] = (
                    made[key] if key in made else
                    reshard(env[ins.ref.node][ins.ref.index], ins.steps, comm, at))
        vals.append(_count(h, env, copies) if h.count else env[h.node.name][h.index])
    return _join_microbatches(vals, h.steps, comm, coords)


def _count(h: _Hoist, env: dict, copies: dict) -> Tensor:
    """One micro-batch's part of ``nll_loss``'s ``total_weight``."""
    node = h.node
    args = list(node.args) + [None] * (5 - len(node.args))
    ignore = dict(node.kwargs).get("ignore_index", args[4])
    refs = list(node.refs())
    target = _read(env, copies, refs[1].node, refs[1].index, h.reads[1])
    weight = (_read(env, copies, refs[2].node, refs[2].index, h.reads[2])
              if len(refs) > 2 else None)
    valid = target != ignore
    dtype = getattr(torch, node.outputs[1].dtype)
    if weight is None:
        return valid.sum().to(dtype)
    return (weight[target.masked_fill(~valid, 0)] * valid).sum().to(dtype)


def _join_microbatches(vals: list[Tensor], steps: Sequence[Any], comm: Any,
                       coords: tuple[int, ...]) -> Tensor:
    """``steps`` on the micro-batches' pieces ``vals`` of one value: a step over the
    micro-batch axis (axis 0) joins them here (the micro-batches are this rank's), the
    others run as ``reshard`` runs them, once while the pieces are one."""
    m = len(vals)
    for s in steps:
        if s.axis != 0:
            one = all(v is vals[0] for v in vals)
            vals = ([reshard(vals[0], (s,), comm, coords)] * m if one else
                    [reshard(v, (s,), comm, coords) for v in vals])
        elif s.kind == "all_gather":
            vals = [torch.cat(vals, s.src.dim)] * m
        elif s.kind == "all_reduce":
            op = s.src.op
            total = sum(v * v for v in vals) if op is ReduceOp.NORM2 else sum(vals)
            total = (total.sqrt() if op is ReduceOp.NORM2 else
                     total / m if op is ReduceOp.AVG else total)
            vals = [total] * m
        elif s.kind == "slice":
            vals = [v.chunk(m, s.dst.dim)[j].contiguous() for j, v in enumerate(vals)]
        elif s.kind == "partial" and s.dst.op is not ReduceOp.AVG:
            vals = [v if j == 0 else torch.zeros_like(v) for j, v in enumerate(vals)]
        elif s.kind != "partial":
            raise LoweringError(f"internal: a value made before the micro-batches takes "
                                f"{s.kind} over them")
    return vals[0]


def _read(env: dict, copies: dict, node: str, index: int, layout: Layout | None) -> Any:
    v = env[node][index]
    if layout is not None:
        v = copies.get(node, {}).get((index, layout), v)
    return v


__all__ = ["MB_AXIS", "MicrobatchProgram", "Sums", "check_microbatched",
           "check_microbatches", "hoisted_value", "lower_microbatched", "microbatch_plan",
           "run_microbatched", "split_microbatched"]
