"""Pipeline stages on ranks (issue 24): a ``PipelinePlan``'s step as per-stage programs.

The plan's stages are ranges of the step's units (``planner._pipeline.unit_map``: the
embedding side, the repeated layers, the head and loss). Each rank of the ``pp`` axis runs the
ops of its stage, and holds the state of its stage only. The micro-batches are
``_microbatch.py``'s: the inner plan with an outermost ``microbatch`` axis, each rank's program
cut into the part that reads the batch (per micro-batch) and the step part (once, on the sums
of the partial gradients). Here each part is cut again by stage, and in three:

- **forward** of micro-batch ``j`` (the part's instructions before its first backward one),
- **backward** of micro-batch ``j`` (the rest; it reads what the forward kept),
- the **step** part, once.

Under interleaved 1F1B a device holds several chunks (virtual stage ``k`` on device
``k % pp``), and its forward and backward are cut once more, by chunk: a device's parts of a
micro-batch are ``(F, 0) .. (F, v - 1), (B, v - 1) .. (B, 0)``, each a program of its own. An
instruction that runs on several devices (the data's, an op of the state alone) goes with
the chunk of the next of the device's own instructions. A value one part makes and a later
part of the same micro-batch reads is a result of the first (``StageProgram.carry``), held
until the last part that reads it (``after``).

A value one stage makes and another reads travels between the two ranks of the same inner
coordinates (``Send`` / ``Recv`` in both programs, at the place in the part where it is made,
tagged with the sender's part and chunk: ``TAGS``); the receiver takes what one part of its
peer sends in one part of its own (the first that reads any of it), so both meet a tag's
values in one order. State one stage owns and another reads (a tied embedding's
weight in the head) is sent once per step, before the micro-batches. The stages run the parts
in the schedule's order (``device_orders``): GPipe (every forward before any backward),
1F1B (forward ``j + 1`` before backward ``j`` where the warm-up is over) or interleaved 1F1B
(Megatron's: micro-batches in groups of ``pp``, each group through every chunk).

Sends do not wait for their receiver (``Communicator.send_start``): a stage runs on while its
neighbour is busy, and waits for its sends at the end of the step. A receive takes only what
was sent with its part's tag, so the interleaved parts of 1F1B never take each other's
values; in each part, the two stages of a pair meet their transfers in the same order. The
lowering runs every stage's transfers on paper in the schedule's order (``_check_order``) and
refuses, by name, an order that would wait forever or deliver a value for another.

Ops of the step part outside the layers (gradient clipping's norms and scaling) run where
most of what they read is made (``_follow_the_bytes``), so only scalars cross stages there.

``distribute`` runs these programs on a mesh with a ``pp`` axis (``Stages``: what a rank's
setup carries; the controller splits the state by each tensor's stage).

Under ZB-H1 each backward part is cut once more (``_split_weight_grads``): what makes the
gradient the stage sends back stays, its weights' gradients become a part ``(W, chunk)`` that
the schedule runs later.

Not yet: other zero-bubble orders (ZB-H2, ZB-V); the all-or-nothing vote of a step
(a failing op on one stage leaves its peers waiting until the communicator's timeout);
gradient buckets in the stage programs (each part runs ``lower``'s kernels and early frees:
``kernels=``, ``free_early=``).
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from .._errors import LoweringError
from ..ir import STATE_ROLES, NodeKind, Phase, Ref, Role, TensorMeta
from ..planner import Layout, Mesh, Plan, ReduceOp, Replicate
from ..planner._pipeline import POST, PP_AXIS, PRE, PipelinePlan, device_orders, unit_map
from ..planner._placement import local_shape
from ._layout import coords_rank, rank_coords
from ._lower import Compute, Program, Recv, Reshard, Send, StepRNG, finish, plan_steps, run
from ._microbatch import (Sums, _cut, _Hoist, _inputs_read, _stand_ins, _with_frees,
                          hoist_source, hoisted_value, lower_parts, microbatch_plan,
                          stand_in_spec)
from ._microbatch import hoist_inputs as hoisted_inputs

Key = tuple[str, int, Layout | None]        # a value as made (layout None) or a copy of it

# the schedules the stages run: each stage's order of forwards and backwards
# (``device_orders``); sends do not wait for their receiver, and ``_check_order`` makes sure
# that a step's transfers neither wait forever nor cross in the schedule's order
RUNS = ("gpipe", "1f1b", "interleaved", "zb-h1")
# the tag of each part's transfers (``Communicator.send_start(tag=)``): the state a stage
# sends before the micro-batches (0), each micro-batch's forward and backward (the kind's
# number plus len(TAGS) times the sender's virtual stage), the step part. A receive takes only
# its part's values, so parts that a schedule interleaves (1F1B: forward j + 1 before
# backward j) never take each other's; within a part, the two sides of a pair of stages meet
# their transfers in the same order (``_check_order`` checks it)
TAGS = {"F": 1, "B": 2, "S": 3, "W": 4}


@dataclass(frozen=True)
class Stages:
    """What the ranks of a pipeline mesh lower (``lower_pipeline`` takes it as it takes a
    ``PipelinePlan``) and what the controller splits the state and the batch by: the whole
    mesh, every stage's layouts (``inner``), the units of each chunk, the schedule and the
    micro-batches. ``to_json`` / ``from_json``: the part a rank's setup carries beside the
    inner plan."""

    mesh: Mesh                      # the whole mesh, pp included
    inner: Plan
    chunks: tuple[tuple[str, ...], ...]
    schedule: str
    microbatches: int
    virtual_stages: int

    @classmethod
    def of(cls, pplan: PipelinePlan) -> Stages:
        return cls(pplan.mesh, pplan.inner, pplan.chunks, pplan.schedule, pplan.microbatches,
                   pplan.virtual_stages)

    @property
    def pp(self) -> int:
        return self.mesh.sizes[self.mesh.index(PP_AXIS)]

    def to_json(self) -> dict[str, Any]:
        return {"axes": [list(a) for a in self.mesh.axes],
                "chunks": [list(c) for c in self.chunks], "schedule": self.schedule,
                "microbatches": self.microbatches, "virtual_stages": self.virtual_stages}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], inner: Plan) -> Stages:
        return cls(Mesh(tuple((str(n), int(k)) for n, k in d["axes"]), inner.mesh.topology),
                   inner, tuple(tuple(c) for c in d["chunks"]), str(d["schedule"]),
                   int(d["microbatches"]), int(d["virtual_stages"]))

    def stage(self, rank: int) -> int:
        return rank_coords(rank, self.mesh.sizes)[self.mesh.index(PP_AXIS)]

    def inner_rank(self, rank: int) -> int:
        """``rank``'s rank in every stage's plan (its coordinates but for ``pp``)."""
        a, cs = self.mesh.index(PP_AXIS), rank_coords(rank, self.mesh.sizes)
        return coords_rank(cs[:a] + cs[a + 1:], self.inner.mesh.sizes)

    def rank(self, stage: int, inner_rank: int) -> int:
        a = self.mesh.index(PP_AXIS)
        ic = rank_coords(inner_rank, self.inner.mesh.sizes)
        return coords_rank(ic[:a] + (stage,) + ic[a:], self.mesh.sizes)

    @property
    def result_rank(self) -> int:
        """The rank whose step results the controller reads: the last stage's first."""
        return self.rank(self.pp - 1, 0)

    def vstage_of_unit(self) -> dict[str, int]:
        """Each unit's virtual stage: the index of its chunk (chunk ``k`` on device
        ``k % pp``)."""
        return {u: k for k, chunk in enumerate(self.chunks) for u in chunk}

    def stage_of_unit(self) -> dict[str, int]:
        """Each unit's stage (``unit_map``'s units): the device of its chunk."""
        return {u: k % self.pp for k, chunk in enumerate(self.chunks) for u in chunk}

    def owners(self) -> dict[str, int]:
        """Each state tensor's stage (by input target): the stage of its unit's chunk."""
        graph = self.inner.graph
        _, unit = unit_map(graph)
        stage_of_unit = self.stage_of_unit()
        return {n.target: stage_of_unit[unit[n.name]] for n in graph.inputs
                if n.meta.role in STATE_ROLES}

    def ranks_of(self, stage: int) -> list[int]:
        return [self.rank(stage, c) for c in range(math.prod(self.inner.mesh.sizes))]


@dataclass(frozen=True)
class StageProgram:
    """What rank ``rank`` (stage ``stage`` of ``stages``) runs for one step: the programs of
    its parts of each micro-batch (``parts[(kind, chunk)][j]``, kind ``F`` or ``B``; one chunk
    per device but under interleaved 1F1B), then the step part once."""

    rank: int
    stage: int
    stages: int
    m: int
    v: int                                # chunks per device
    schedule: str
    parts: dict[tuple[str, int], tuple[Program, ...]]
    step: Program
    carry: dict[tuple[str, int], tuple[Key, ...]]    # what a part returns for later parts
    after: dict[tuple[str, int], frozenset[Key]]     # what later parts of its micro-batch read
    partials: tuple[tuple[Ref, ReduceOp, tuple[str, int]], ...]   # this stage's, the part
    prologue: tuple[tuple[str, str, int, tuple[int, ...], tuple[int, ...], str], ...]
    split: dict[str, int]
    hoisted: tuple[_Hoist, ...]
    hoist_inputs: dict[str, str]
    stand_ins: tuple[tuple[Any, ...], ...]
    device: str


def lower_pipeline(pplan: PipelinePlan | Stages, rank: int, *,
                   device: str = "cpu", kernels: bool = True,
                   free_early: bool = True) -> StageProgram:
    """Rank ``rank``'s programs (ranks row-major over ``pplan.mesh``, ``pp`` included), each
    part with ``lower``'s kernels and early frees unless ``kernels`` / ``free_early`` is
    False (the transfers and their order are the same either way)."""
    if pplan.schedule not in RUNS:
        raise LoweringError(f"pipeline schedule {pplan.schedule!r}: not lowered yet (only "
                            f"{', '.join(map(repr, RUNS))} run); plan with one of them")
    pipe = pplan if isinstance(pplan, Stages) else Stages.of(pplan)
    p, m, v = pipe.pp, pipe.microbatches, pipe.virtual_stages
    if pipe.schedule != "interleaved" and v != 1:
        raise LoweringError(f"pipeline schedule {pipe.schedule!r} with {v} chunks per device: "
                            "only 'interleaved' runs several chunks on a device")
    if pipe.schedule == "interleaved" and m % p:
        raise LoweringError(f"interleaved 1F1B runs the micro-batches in groups of {PP_AXIS}="
                            f"{p}; {m} micro-batches is not a multiple: plan a multiple of {p}")
    if len(pipe.chunks) != p * v:
        raise LoweringError(f"pipeline plan with {len(pipe.chunks)} chunks for {PP_AXIS}={p} "
                            f"and {v} chunks per device (it needs {p * v})")
    s, c = pipe.stage(rank), pipe.inner_rank(rank)
    inner = pipe.inner
    world = math.prod(inner.mesh.sizes)

    def real(stage: int, inner_rank: int) -> int:
        """The rank of ``stage`` at inner rank ``inner_rank`` (a micro-batch plan's rank:
        its micro-batch's part taken off)."""
        return pipe.rank(stage, inner_rank % world)

    graph = inner.graph
    plan = microbatch_plan(inner, m)
    raws = [lower_parts(plan, j * world + c, device=device) for j in range(m)]
    cut = _cut(plan, raws[0], 0)
    instrs0 = raws[0].instrs
    _, unit = unit_map(graph)
    vstage_of_unit = pipe.vstage_of_unit()
    last = p * v - 1
    inputs = {n.name: n for n in graph.inputs}
    by_target = {n.target: n.name for n in graph.inputs}

    def node_vstage(name: str) -> int:
        """The virtual stage (chunk ``k``, on device ``k % p``) of a node, -1 for every one."""
        n = graph.node(name)
        if n.kind in (NodeKind.HOST, NodeKind.CONSTANT):
            return -1                         # cheap, and maybe not a tensor: everywhere
        if n.kind is NodeKind.INPUT and n.outputs[0].role in (Role.DATA, Role.HYPER):
            return -1                         # every rank gets the step's data
        return vstage_of_unit[unit[name]]

    def node_stage(name: str) -> int:
        k = node_vstage(name)
        return k if k < 0 else k % p

    # a backward op outside the layers that reads nothing of the head (the position
    # embedding's gradient, summed over the batch from the first layer's) runs where what it
    # reads is made, not with the head
    for i, ins in enumerate(instrs0):
        if isinstance(ins, Compute) and ins.node.phase is Phase.BACKWARD \
                and unit.get(ins.node.name) == POST:
            units = [unit.get(instrs0[j].node.name if isinstance(instrs0[j], Compute)
                              else instrs0[j].ref.node)
                     for _, j in cut.reads_of.get(i, ()) if j is not None]
            if units and POST not in units:
                unit[ins.node.name] = units[0]
    maker_of_partial = {i: cut.reads_of[i][0][1] for i in cut.reductions}
    vst: dict[int, Any] = {}                  # instruction -> its virtual stage (-1: everywhere)
    for i, ins in enumerate(instrs0):
        if isinstance(ins, Compute):
            vst[i] = node_vstage(ins.node.name)
        elif isinstance(ins, Reshard):
            if i in cut.reductions and maker_of_partial.get(i) is not None:
                vst[i] = None                 # below: where its partials are made
            elif ins.consumer == "<result>":
                vst[i] = last
            elif ins.consumer.startswith("<state "):
                vst[i] = node_vstage(by_target[ins.consumer[len("<state "):-1]])
            else:
                vst[i] = node_vstage(ins.consumer)
    for i in cut.reductions:                  # a sum is taken where its partials are made
        j = maker_of_partial.get(i)
        if j is not None:
            vst[i] = vst[j] if vst[j] != -1 else last
    # the device of each instruction: an int (-1: every device), or (below) a set of them
    stage: dict[int, Any] = {i: k if k is None or k < 0 else k % p for i, k in vst.items()}
    new_state = {ref.node for ref, _ in raws[0].state_out.values()}
    _follow_the_bytes(cut, instrs0, graph, stage, unit, inputs, node_stage, new_state)
    for i in cut.hoisted:                     # made before the parts, by each stage reading it
        stage[i] = -1
    all_stages = frozenset(range(p))

    def made(i: int) -> list[tuple]:
        ins = instrs0[i]
        if isinstance(ins, Compute):
            return [("v", ins.node.name, k) for k in range(max(1, len(ins.node.outputs)))]
        if isinstance(ins, Reshard):
            return [("c", ins.ref.node, ins.ref.index, ins.dst)]
        return []

    # an op of the state alone (a weight's cast or transpose: the tied embedding's in the
    # head) runs on each stage that reads it, from the state sent there once per step,
    # rather than on its owner's with its result sent every micro-batch
    of_state: set[int] = set()
    for i, ins in enumerate(instrs0):
        if (isinstance(ins, Reshard) or isinstance(ins, Compute) and ins.stream is None) \
                and i not in cut.shapes and i not in cut.reductions and cut.reads_of.get(i) \
                and all((k[0] == "v" and k[1] in inputs and node_stage(k[1]) != -1)
                        or (j is not None and j in of_state) for k, j in cut.reads_of[i]):
            of_state.add(i)
    read_at: dict[tuple, list[int]] = {}
    for r, keys in cut.reads_of.items():
        for k, _ in keys:
            read_at.setdefault(k, []).append(r)
    for i in sorted(of_state, reverse=True):       # readers first: a chain follows its end
        users: set[int] = set()
        for k in made(i):
            for r in read_at.get(k, ()):
                if r in stage and r not in cut.shapes:
                    st = stage[r]
                    users.update(st if isinstance(st, frozenset) else
                                 (range(p) if st == -1 else (st,)))
        if users:
            stage[i] = frozenset(users)


    def key_of(k: tuple) -> Key:
        return (k[1], k[2], None) if k[0] == "v" else (k[1], k[2], k[3])

    def meta_shape(k: tuple) -> tuple[tuple[int, ...], str]:
        ref = Ref(k[1], k[2])
        meta = graph.meta(ref)
        if not isinstance(meta, TensorMeta):          # a host scalar: as a 0-d tensor
            return (), f"scalar:{meta.dtype}"
        layout = raws[0].out_layout[k[1]][k[2]] if k[0] == "v" else k[3]
        return local_shape(meta.shape, layout, plan.mesh.sizes), meta.dtype

    def runs_on(i: int) -> frozenset[int]:
        st = stage[i]
        return all_stages if st == -1 else st if isinstance(st, frozenset) else frozenset((st,))

    def readers(indices: Sequence[int]) -> dict[tuple[tuple, int | None], set[int]]:
        """The devices that read each value as one instruction makes it: ``(key, maker)``
        (a parameter's copy is made once for the forward and again for the backward)."""
        out: dict[tuple[tuple, int | None], set[int]] = {}
        for i in indices:
            if i in cut.shapes:
                continue
            for k, j in cut.reads_of.get(i, ()):
                out.setdefault((k, j), set()).update(runs_on(i))
        return out

    def on_stage(ins: Any) -> Any:
        if isinstance(ins, Reshard):
            return replace(ins, steps=tuple(replace(st, group=tuple(real(s, g) for g in st.group))
                                            for st in ins.steps))
        return ins

    def moves(i: int, at: int, read_by: dict[tuple, set[int]]) -> list[tuple[str, int, tuple]]:
        """Stage ``at``'s transfers of what instruction ``i`` makes: ``("S", to, k)`` where
        ``at`` makes it (the lowest of the stages that do), ``("R", from, k)`` where ``at``
        reads it and does not make it."""
        where = runs_on(i)
        sender = min(where)                   # the lowest of the devices that make it
        out: list[tuple[str, int, tuple]] = []
        for k in made(i):
            need = read_by.get((k, i), set()) - where
            if at == sender:
                out.extend(("S", u, k) for u in sorted(need))
            elif at in need:
                out.append(("R", sender, k))
        return out

    def stream(indices: Sequence[int], raw_instrs: Sequence[Any],
               read_by: dict[tuple, set[int]], tag: int, modify: Any = None) -> list[Any]:
        """Stage ``s``'s instructions of ``indices`` with the transfers at their makers."""
        out: list[Any] = []
        for i in indices:
            if s in runs_on(i):
                ins = raw_instrs[i] if modify is None else modify(i, raw_instrs[i])
                if ins is not None:
                    out.append(on_stage(ins))
            out.extend(transfer(way, peer, tag, k) for way, peer, k in moves(i, s, read_by))
        return out

    def transfer(way: str, peer: int, tag: int, k: tuple) -> Send | Recv:
        """Stage ``s``'s send of value ``k`` to stage ``peer`` (``way`` "S"), or receive."""
        if way == "S":
            return Send(Ref(k[1], k[2]), key_of(k)[2], real(peer, c), tag)
        shape, dtype = meta_shape(k)
        return Recv(Ref(k[1], k[2]), key_of(k)[2], real(peer, c), shape, dtype, tag)

    # the parts of micro-batch j: forward before the first backward instruction, and each
    # cut by chunk (virtual stage) on its device
    def phase(i: int) -> Phase:
        ins = instrs0[i]
        if isinstance(ins, Compute):
            return ins.node.phase
        if isinstance(ins, Reshard) and not ins.consumer.startswith("<"):
            return graph.node(ins.consumer).phase
        return Phase.UPDATE

    per_mb = cut.per_mb
    first_b = next((k for k, i in enumerate(per_mb) if phase(i) is Phase.BACKWARD), len(per_mb))
    f_idx, b_idx = per_mb[:first_b], per_mb[first_b:]
    mb_readers = readers(per_mb)
    st_readers = readers(cut.per_step)
    # a device's parts of one micro-batch, in the order it runs them (``device_orders``)
    order = [("F", k) for k in range(v)] + [("B", k) for k in reversed(range(v))]
    if pipe.schedule == "zb-h1":
        order += [("W", k) for k in reversed(range(v))]
    rank_of_part = {part: n for n, part in enumerate(order)}
    part_of = [_parts_of(f_idx, b_idx, t, p, v, runs_on, vst) for t in range(p)]
    if pipe.schedule == "zb-h1":
        for t in range(p):
            _split_weight_grads(t, b_idx, part_of[t], runs_on, cut.reads_of,
                                lambda i, t=t: any(way == "S" for way, _, _ in
                                                   moves(i, t, mb_readers)))
    # which parts of each device read each value (the reads of a shape only: stand-ins)
    reader_parts: list[dict[tuple[tuple, int], set[tuple[str, int]]]] = [{} for _ in range(p)]
    for i in per_mb:
        if i in cut.shapes:
            continue
        for t in runs_on(i):
            for k, j in cut.reads_of.get(i, ()):
                reader_parts[t].setdefault((k, j), set()).add(part_of[t][i])
    # what a part sends to one device, that device receives in one part: the first of its
    # parts that reads any of it (so that both sides meet a tag's values in one order)
    recv_part: dict[tuple[int, tuple[str, int], int], tuple[str, int]] = {}
    for i in per_mb:
        src = min(runs_on(i))
        for _, peer, k in moves(i, src, mb_readers):
            at = min(reader_parts[peer].get((k, i), ()), key=rank_of_part.__getitem__,
                     default=None)
            if at is None:
                raise LoweringError(f"pipeline stage {peer} is sent {k[1]} of "
                                    f"{graph.info.name!r} and reads it nowhere (a meshplan "
                                    "bug: please report it with the step)")
            ch = (src, part_of[src][i], peer)
            if ch not in recv_part or rank_of_part[at] < rank_of_part[recv_part[ch]]:
                recv_part[ch] = at

    def tag_of(part: tuple[str, int], device: int) -> int:
        """The tag of what a part of chunk ``part[1]`` of ``device`` sends: its kind and its
        virtual stage, so that a receive takes only that part's values."""
        return TAGS[part[0]] + len(TAGS) * (part[1] * p + device)

    def device_moves(t: int) -> dict[tuple[str, int], list[tuple[int, str, int, int, tuple]]]:
        """Device ``t``'s transfers in each part of a micro-batch, in program order:
        ``(at, way, peer, tag, value key)``, ``at`` the instruction that makes the value
        (sent in its maker's part, received in the part ``recv_part`` names)."""
        out: dict[tuple[str, int], list[tuple[int, str, int, int, tuple]]] = {
            part: [] for part in order}
        for i in per_mb:
            if t in runs_on(i):
                part = part_of[t][i]
                out[part].extend((i, "S", u, tag_of(part, t), k)
                                 for way, u, k in moves(i, t, mb_readers) if way == "S")
                continue
            src = min(runs_on(i))
            sent_in = part_of[src][i]
            for _, u, k in moves(i, t, mb_readers):      # receives only: t does not make it
                out[recv_part[(src, sent_in, t)]].append((i, "R", u, tag_of(sent_in, src), k))
        return out

    every_moves = [device_moves(t) for t in range(p)]
    _check_order(pipe.schedule, graph.info.name, p, m, v, [
        {**{part: [(way, peer, tag, key_of(k)) for _, way, peer, tag, k in got[part]]
            for part in order},
         "S": [(way, peer, TAGS["S"], key_of(k)) for i in cut.per_step
               for way, peer, k in moves(i, t, st_readers)]}
        for t, got in enumerate(every_moves)], lambda name: _op_at(graph.node(name)))
    mine = lambda idx: [i for i in idx if s in runs_on(i)]    # noqa: E731
    partial_here = [(instrs0[i].ref, cut.reduce_ops[i], maker_of_partial[i])
                    for i in sorted(cut.reductions) if i not in cut.hoisted
                    and stage[i] == s]
    seen: dict[Ref, tuple[ReduceOp, int]] = {}
    for ref, op, maker in partial_here:
        seen.setdefault(ref, (op, maker))
    partials = tuple((ref, op, part_of[s][maker]) for ref, (op, maker) in seen.items())

    # state other stages own, read here: sent once per step before the micro-batches
    state_readers: dict[str, set[int]] = {}
    for i in [*per_mb, *cut.per_step]:
        for k, _ in cut.reads_of.get(i, ()):
            if k[0] == "v" and k[1] in inputs and node_stage(k[1]) != -1 \
                    and i not in cut.shapes:
                state_readers.setdefault(k[1], set()).update(runs_on(i))
    prologue = []
    received: set[str] = set()
    for name, who in state_readers.items():
        owner = node_stage(name)
        others = sorted(t for t in who if t != owner)
        if not others:
            continue
        shape = local_shape(inputs[name].outputs[0].shape, inner.input_layouts[inputs[name].target],
                            inner.mesh.sizes)
        prologue.append((name, inputs[name].target, real(owner, c),
                         tuple(real(t, c) for t in others), shape, inputs[name].outputs[0].dtype))
        if s in others:
            received.add(name)

    def input_nodes(instrs: Sequence[Any], tail: set[str]) -> dict[str, str]:
        return {n: t for n, t in _inputs_read(graph, instrs, tail).items()
                if n not in received}

    def program(raw: Any, instrs: list[Any], results: Sequence[tuple[Ref, Layout | None]],
                state_out: dict | None = None, whole: Sequence[Ref] = ()) -> Program:
        keep = {r.node for r, _ in results} | {r.node for r in whole} | {
            r.node for r, _ in (state_out or {}).values()}
        instrs = _with_frees(instrs, keep=keep)
        refs = [r for r, _ in results] + list(whole)
        layouts = tuple(lay for _, lay in results) + tuple(
            tuple(Replicate() for _ in plan.mesh.sizes) for _ in whole)
        return finish(plan, replace(raw, rank=rank), instrs, state_out or {}, refs,
                      result_layouts=layouts, input_nodes=input_nodes(instrs, keep),
                      kernels=kernels, bucket_bytes=0, free_early=free_early)

    # what each part makes (or receives) and reads, on this device: a value a later part of
    # the micro-batch reads is a result of the part that makes it, kept until its last part
    my_moves = every_moves[s]
    in_mb = set(per_mb)

    def made_in(j: int) -> tuple[str, int]:
        """The part of this device where instruction ``j``'s values are: made, or received."""
        if s in runs_on(j):
            return part_of[s][j]
        src = min(runs_on(j))
        return recv_part[(src, part_of[src][j], s)]

    ext: dict[tuple[str, int], set[Key]] = {part: set() for part in order}
    carry_: dict[tuple[str, int], set[Key]] = {part: set() for part in order}
    for i in per_mb:
        if s not in runs_on(i) or i in cut.shapes:
            continue
        part = part_of[s][i]
        for k, j in cut.reads_of.get(i, ()):
            if j not in in_mb:               # an input, or a count hoisted before the parts
                continue
            at = made_in(j)
            if at == part:
                continue
            if rank_of_part[at] > rank_of_part[part]:
                raise LoweringError(
                    f"pipeline stage {s} of {graph.info.name!r}: its {_part_name(part, 0, v)} "
                    f"reads {_value_name((key_of(k), 0))}, which it has only in its "
                    f"{_part_name(at, 0, v)} (a meshplan bug: please report it with the step)")
            ext[part].add(key_of(k))
            carry_[at].add(key_of(k))
    after: dict[tuple[str, int], frozenset[Key]] = {}
    later: set[Key] = set()
    for part in reversed(order):
        after[part] = frozenset(later)
        later |= ext[part]
    carry = {part: tuple(sorted(carry_[part], key=str)) for part in order}

    def part_instrs(part: tuple[str, int], raw_instrs: Sequence[Any]) -> list[Any]:
        out: list[Any] = []
        moved: dict[int, list] = {}
        for i, way, peer, tag, k in my_moves[part]:
            moved.setdefault(i, []).append((way, peer, tag, k))
        for i in per_mb:
            if s in runs_on(i) and part_of[s][i] == part:
                out.append(on_stage(raw_instrs[i]))
            out.extend(transfer(way, peer, tag, k) for way, peer, tag, k in moved.get(i, ()))
        return out

    parts: dict[tuple[str, int], tuple[Program, ...]] = {}
    for part in order:
        results = [(Ref(k[0], k[1]), k[2]) for k in carry[part]] + [
            (ref, None) for ref, _, where in partials if where == part]
        parts[part] = tuple(program(raw, part_instrs(part, raw.instrs), results)
                            for raw in raws)

    def modify(i: int, ins: Any) -> Any:
        if i in cut.hoisted:
            return None
        if i in cut.reductions:
            src = (Replicate(), *ins.src[1:])
            if src == ins.dst:
                return None
            steps, exact = plan_steps(src, ins.dst, plan.mesh.sizes, raws[0].coords)
            return Reshard(ins.ref, src, ins.dst, steps, exact, ins.consumer)
        return ins

    st = stream(cut.per_step, raws[0].instrs, st_readers, TAGS["S"], modify)
    raw0 = raws[0]
    owned = {n: v for n, v in raw0.state_out.items()
             if node_stage(by_target[n]) == s}
    made_at = {ins.node.name: i for i, ins in enumerate(instrs0) if isinstance(ins, Compute)}
    for name, (ref, _) in owned.items():      # what a stage keeps, it makes or receives
        i = made_at.get(ref.node)
        if i is not None and s not in runs_on(i) and not any(
                s in by.get((k, i), ()) for k in made(i) for by in (st_readers, mb_readers)):
            raise LoweringError(
                f"pipeline stage {s} keeps {name!r} of {graph.info.name!r}, but its new value "
                f"({ref.node}) is made on stage {sorted(runs_on(i))} and not sent to it "
                "(a meshplan bug: please report it with the step)")
    step = program(raw0, st, [], owned, raw0.results if s == p - 1 else ())
    hoisted, hoist_inputs = [], {}
    needed = {i for i in cut.hoisted if any(
        s in by.get((("c", instrs0[i].ref.node, instrs0[i].ref.index, instrs0[i].dst), i), ())
        for by in (mb_readers, st_readers))}
    for i in sorted(needed, reverse=True):    # and what they are made from, made first
        needed.update(j for j in cut.hoist_ancestors[i] if j in cut.hoisted)
    for i in sorted(needed):
        r = instrs0[i]
        node, node_reads = hoist_source(graph, instrs0, r, cut.hoist_makers[i])
        hoisted.append(_Hoist(node, r.ref.index, node_reads,
                              tuple(tuple(on_stage(rw.instrs[k]) for k in cut.hoist_ancestors[i])
                                    for rw in raws),
                              tuple(replace(x, group=tuple(real(s, g) for g in x.group))
                                    for x in r.steps), r.dst))
        hoist_inputs.update(hoisted_inputs(graph, cut, instrs0, only=(i,)))
    split = {n.target: lay[0].dim for n in graph.inputs
             if hasattr((lay := plan.input_layouts[n.target])[0], "dim")}
    stand = stand_in_spec(cut, mine([*per_mb, *cut.per_step]), plan, raws[0])
    return StageProgram(rank, s, p, m, v, pipe.schedule, parts, step, carry, after, partials,
                        tuple(prologue), split, tuple(hoisted), hoist_inputs, stand, device)


def _part_name(part: tuple[str, int] | str, j: int, v: int) -> str:
    if part == "S":
        return "the step part"
    kind, chunk = part
    return (f"micro-batch {j}'s "
            + {"F": "forward", "B": "backward", "W": "weight gradients"}[kind]
            + (f" of chunk {chunk}" if v > 1 else ""))


def _check_order(schedule: str, step: str, p: int, m: int, v: int,
                 moves: Sequence[Mapping[Any, list[tuple[str, int, int, Key]]]],
                 where_of: Any = None) -> None:
    """Run the stages' transfers on paper, in the schedule's order, before any rank does.
    ``moves[t][part]``: device ``t``'s sends ``("S", to, tag, key)`` and receives ``("R",
    from, tag, key)`` in one micro-batch's part ``(kind, chunk)`` (kind ``F`` or ``B``) and in
    the step part (``"S"``), in program order. Sends never wait (``send_start``); a receive
    takes the oldest value its peer sent with its tag. Raises, naming the stages and values,
    where the order would leave a stage waiting forever, or where a receive would take another
    value than the one its program reads there (stages that pass a part's values back and
    forth, as when the layers' activations ran with the head, can wait forever in 1F1B's
    order). ``where_of(node)``: its op and source line, named beside it (only in an
    error)."""
    instead = ("schedule='1f1b' or 'gpipe'" if schedule == "interleaved" else
               "schedule='gpipe'")

    def named(key: tuple[Key, int]) -> str:
        at = where_of(key[0][0]) if where_of is not None else ""
        return _value_name(key) + (f" ({at})" if at else "")

    events: list[list[tuple[str, int, int, tuple[Key, int], str]]] = []
    for t, order in enumerate(device_orders(schedule, p, m, v)):
        seq = [(way, peer, tag, (key, j), _part_name((kind, chunk), j, v))
               for kind, chunk, j in order for way, peer, tag, key in moves[t][(kind, chunk)]]
        seq += [(way, peer, tag, (key, -1), _part_name("S", -1, v))
                for way, peer, tag, key in moves[t]["S"]]
        events.append(seq)
    boxes: dict[tuple[int, int, int], deque] = {}
    at = [0] * p
    moved = True
    while moved:
        moved = False
        for t in range(p):
            while at[t] < len(events[t]):
                way, peer, tag, want, where = events[t][at[t]]
                if way == "S":
                    boxes.setdefault((t, peer, tag), deque()).append((want, where))
                else:
                    box = boxes.get((peer, t, tag))
                    if not box:
                        break
                    got, sent_in = box.popleft()
                    if got != want:
                        raise LoweringError(
                            f"pipeline schedule {schedule!r}: stage {t} would take "
                            f"{named(got)} that stage {peer} sent in {sent_in} for "
                            f"{named(want)} in {where} of {step!r}; run it with {instead}")
                at[t] += 1
                moved = True
    stuck = [t for t in range(p) if at[t] < len(events[t])]
    if stuck:
        waits = "; ".join(
            f"stage {t} waits in {events[t][at[t]][4]} for {named(events[t][at[t]][3])} "
            f"from stage {events[t][at[t]][1]}" for t in stuck)
        raise LoweringError(f"pipeline schedule {schedule!r}: the stages would wait for each "
                            f"other forever in {step!r} ({waits}); run it with {instead}")


def _split_weight_grads(t: int, b_idx: Sequence[int], part_of: dict[int, tuple[str, int]],
                        runs_on: Any, reads_of: Mapping[int, Sequence[tuple]],
                        sends: Any) -> None:
    """ZB-H1 (Qi et al., zero-bubble pipeline parallelism): each backward part keeps what the
    previous stage waits for, the instructions that make what it sends (the gradient of its
    input) and what they read in that part; the rest (the gradients of its own weights) move
    to a part of their own, ``("W", chunk)``, which the schedule runs later, in what would
    otherwise be the drain's bubble. ``sends(i)``: whether instruction ``i`` sends a value
    from device ``t``. Changes ``part_of`` in place."""
    by_chunk: dict[int, list[int]] = {}
    for i in b_idx:
        if t in runs_on(i) and part_of[i][0] == "B":
            by_chunk.setdefault(part_of[i][1], []).append(i)
    for chunk, here in by_chunk.items():
        members = set(here)
        keep: set[int] = set()
        stack = [i for i in here if sends(i)]
        while stack:
            i = stack.pop()
            if i in keep:
                continue
            keep.add(i)
            stack.extend(j for _, j in reads_of.get(i, ()) if j in members and j not in keep)
        for i in here:
            if i not in keep:
                part_of[i] = ("W", chunk)


def _parts_of(f_idx: Sequence[int], b_idx: Sequence[int], t: int, p: int, v: int,
              runs_on: Any, vst: Mapping[int, Any]) -> dict[int, tuple[str, int]]:
    """Device ``t``'s part ``(kind, chunk)`` of each micro-batch instruction it runs: a
    layer's, its chunk's; one that runs on several devices (the data's, the state's alone),
    the chunk of the next of ``t``'s own instructions (the previous one's at the end), which
    on one device never runs before what it reads."""
    out: dict[int, tuple[str, int]] = {}
    for kind, idx in (("F", f_idx), ("B", b_idx)):
        on = [i for i in idx if t in runs_on(i)]
        own = {i: vst[i] // p for i in on
               if isinstance(vst.get(i), int) and vst[i] >= 0 and vst[i] % p == t
               and runs_on(i) == {t}}
        chunk = None
        for i in reversed(on):
            chunk = own.get(i, chunk)
            if chunk is not None:
                out[i] = (kind, chunk)
        chunk = 0 if kind == "F" else v - 1     # nothing of its own: its first part
        for i in on:
            if i in own:
                chunk = own[i]
            out.setdefault(i, (kind, chunk))
    return out


def _op_at(node: Any) -> str:
    """An op node's op and source line, for messages ("" for another node)."""
    if node.kind is not NodeKind.OP:
        return ""
    return node.target + (f" at {node.source}" if node.source else "")


def _value_name(key: tuple[Key, int]) -> str:
    (node, index, layout), _ = key
    name = node if index == 0 else f"{node}[{index}]"
    return name if layout is None else f"a copy of {name}"


def _follow_the_bytes(cut: Any, instrs: Sequence[Any], graph: Any, stage: dict[int, Any],
                      unit: Mapping[str, str], inputs: Mapping[str, Any], node_stage: Any,
                      new_state: set[str]) -> None:
    """Ops of the step part outside the layers (``unit_map`` puts them before the first
    layer or after the last: gradient clipping's per-gradient norms and scaling, the step
    counters read to the host) run on the stage that makes the most bytes of what they read,
    not on the first or last stage, which would receive every other stage's gradients and
    send them back scaled. A redistribution moves with the op it feeds. In order, so that a
    chain follows its start. An op that makes new state (``new_state``) stays with its
    state's stage, which keeps it."""
    maker = {ins.node.name: i for i, ins in enumerate(instrs) if isinstance(ins, Compute)}
    at: dict[str, int] = {}
    for i in cut.per_step:
        ins = instrs[i]
        if isinstance(ins, Compute) and unit.get(ins.node.name) in (PRE, POST) \
                and i not in cut.shapes and ins.node.name not in new_state:
            weight: dict[int, int] = {}
            for k, j in cut.reads_of.get(i, ()):
                while j is not None and isinstance(instrs[j], Reshard) \
                        and j not in cut.reductions and cut.reads_of.get(j):
                    k, j = cut.reads_of[j][0]     # a copy in another layout: where its value is
                # made here, an input (state), or a sum of the micro-batches' partial values
                # (kept where its partials are made)
                where = (stage.get(j) if j is not None else
                         node_stage(k[1]) if k[1] in inputs else stage.get(maker.get(k[1])))
                if not isinstance(where, int) or where < 0:
                    continue
                meta = graph.meta(Ref(k[1], k[2]))
                size = math.prod(meta.shape) if isinstance(meta, TensorMeta) else 1
                weight[where] = weight.get(where, 0) + max(1, size)
            if weight:
                best = max(sorted(weight), key=weight.__getitem__)
                if weight[best] > weight.get(stage[i], 0):
                    stage[i] = best
            at[ins.node.name] = i
    for i in cut.per_step:
        ins = instrs[i]
        if isinstance(ins, Reshard) and ins.consumer in at and i not in cut.reductions:
            stage[i] = stage[at[ins.consumer]]


def run_pipeline(sp: StageProgram, comm: Any, state: Mapping[str, Tensor],
                 data: Mapping[str, Tensor], observer: Any = None, *,
                 rng: StepRNG | None = None,
                 donate: bool = False) -> tuple[list[Tensor], dict[str, Tensor]]:
    """One step of stage ``sp.stage`` on this rank: ``state`` its stage's pieces, ``data`` its
    pieces of the whole batch (every stage gets the batch). Returns the results (on the last
    stage; none elsewhere) and this stage's new state. ``observer``: ``run``'s, told of every
    part's ops and transfers. Under ``MESHPLAN_STAGE_TRANSFERS=rma`` on an MPI communicator
    the stages' transfers are one-sided puts (``_rma.Mailbox``), else MPI's (or the
    communicator's) sends and receives."""
    mail = _mailbox(sp, comm)
    if mail is None:
        return _run_stage(sp, comm, state, data, observer, rng, donate)
    mail.begin()
    comm.mailbox = mail
    try:
        out = _run_stage(sp, comm, state, data, observer, rng, donate)
        mail.end()                           # every rank's puts done and taken
        return out
    finally:
        comm.mailbox = None


STAGE_TRANSFERS = "MESHPLAN_STAGE_TRANSFERS"


def _mailbox(sp: StageProgram, comm: Any) -> Any:
    """The one-sided mailbox of ``sp`` on ``comm`` (made on the step that first runs it:
    collective over every rank, as every rank runs each step), or None."""
    how = os.environ.get(STAGE_TRANSFERS, "p2p")
    if how not in ("p2p", "rma"):
        raise LoweringError(f"{STAGE_TRANSFERS}={how!r}: use 'rma' (one-sided puts, under "
                            "launcher='mpi') or 'p2p' (sends and receives, the default)")
    if how != "rma":
        return None
    if not hasattr(comm, "mailbox"):                     # an MPICommunicator's
        raise LoweringError(f"{STAGE_TRANSFERS}=rma: one-sided transfers are MPI RMA windows, "
                            f"and this rank talks through {type(comm).__name__}; run with "
                            "launcher='mpi', or unset it")
    from ._rma import Mailbox

    have = getattr(comm, "_stage_mail", None)
    if have is not None and have[0] is sp:
        return have[1]
    if have is not None:
        have[1].close()
    mail = Mailbox(comm, stage_receives(sp, comm.rank))
    comm._stage_mail = (sp, mail)
    return mail


def stage_receives(sp: StageProgram, rank: int) -> list[tuple[int, int, int]]:
    """``(src, tag, nbytes)`` of every receive of one step of ``sp`` on ``rank``, in the order
    ``run_pipeline`` makes them (the state other stages send once, then each part's, then the
    step part's)."""
    def size(shape: Sequence[int], dtype: str) -> int:
        if dtype.startswith("scalar:"):               # a host scalar: sent as float64
            return 8
        return math.prod(shape) * getattr(torch, dtype).itemsize

    out = [(owner, 0, size(shape, dtype)) for _, _, owner, readers, shape, dtype
           in sp.prologue if rank in readers]
    programs = [sp.parts[(kind, chunk)][j] for kind, chunk, j in
                device_orders(sp.schedule, sp.stages, sp.m, sp.v)[sp.stage]] + [sp.step]
    for program in programs:
        out.extend((ins.peer, ins.tag, size(ins.shape, ins.dtype))
                   for ins in program.instructions if isinstance(ins, Recv))
    return out


def _run_stage(sp: StageProgram, comm: Any, state: Mapping[str, Tensor],
               data: Mapping[str, Tensor], observer: Any, rng: StepRNG | None,
               donate: bool) -> tuple[list[Tensor], dict[str, Tensor]]:
    m = sp.m
    pieces = [{k: (v.chunk(m, sp.split[k])[j].contiguous() if k in sp.split else v)
               for k, v in data.items()} for j in range(m)]
    base: dict[Key, Tensor] = _stand_ins(sp.stand_ins, sp.device)
    for name, target, owner, readers, shape, dtype in sp.prologue:
        if owner == comm.rank:
            for r in readers:
                comm.send(state[target].contiguous(), r)
        elif comm.rank in readers:
            base[(name, 0, None)] = comm.recv(shape, getattr(torch, dtype), owner)
    for h in sp.hoisted:
        base[h.key] = hoisted_value(h, comm, state, pieces, rng, sp.device, sp.step.coords,
                                    [sp.hoist_inputs] * m, base)
        if h.count:
            base[(h.node.name, 1, None)] = base[h.key]
    sums = Sums({ref: op for ref, op, _ in sp.partials}, m)

    made_in = {part: [ref for ref, _, where in sp.partials if where == part] for part in sp.parts}
    env: dict[int, dict[Key, Tensor]] = {j: {} for j in range(m)}    # a micro-batch's values
    # sends do not wait for their receiver (a stage runs on while its neighbour is busy);
    # they are waited for at the end of the step, so what they read stays alive until then
    sends: list[Any] = []
    for kind, chunk, j in device_orders(sp.schedule, sp.stages, m, sp.v)[sp.stage]:
        part = (kind, chunk)
        got, _ = run(sp.parts[part][j], comm, state, pieces[j], observer, rng=rng,
                     preset={**base, **env[j]}, vote=False, sends=sends)
        n = len(sp.carry[part])
        keep = sp.after[part]
        env[j] = {k: t for k, t in (*env[j].items(), *zip(sp.carry[part], got[:n]))
                  if k in keep}
        sums.add(made_in[part], got[n:])
    step_preset = {**base, **sums.whole()}
    out = run(sp.step, comm, state, data, observer, rng=rng, preset=step_preset,
              donate=donate, vote=False, sends=sends)
    for pending in sends:
        pending.wait()
    return out


__all__ = ["STAGE_TRANSFERS", "StageProgram", "Stages", "lower_pipeline", "run_pipeline",
           "stage_receives"]
