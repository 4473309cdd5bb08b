"""Pipeline stages in the planner: a mesh with a ``pp`` axis (issue 24, first part).

``plan_pipeline(graph, {"pp": 4, "dp": 8, "tp": 8})`` plans the step as ``pp`` pipeline
stages, each a contiguous range of the model's repeated layers (the embedding side before the
first layer goes with the first stage, the head and loss with the last), every stage sharded
over the other axes (the inner mesh) by the same ILP ``plan_graph`` runs. It chooses the
stage split, the schedule, the number of micro-batches and, for the interleaved schedule, the
chunks per device, under the per-device memory limit, and says why.

How a plan is priced:

1. The inner plan: ``plan_graph`` on the inner mesh for the whole step (its layouts are the
   ones every stage uses for its layers), with the memory limit times ``pp`` (each device
   holds about 1/pp of the state; the activations are checked below, per stage).
2. Units: each node of the inner plan belongs to the ``<pre>`` unit, a repeated layer
   (``ir.repeated_layers``) or ``<post>``: forward and backward ops by their module; the
   optimizer's ops and the state by the parameter they update. Per unit, for one device of
   the inner mesh: the forward and backward time that scales with the batch (ops that read
   the data, and their collectives), the time that does not (parameters cast to 16 bits and
   gathered: once per step, the copies kept through all micro-batches, as FSDP2 runs under
   pipelining with ``reshard_after_forward=False``; their bytes count in the stage's
   memory), the update (gradient reductions for it and the optimizer, once per step:
   gradients accumulate over micro-batches), the state bytes (parameters, their gradients,
   optimizer state, buffers), the forward values the backward reads (whole batch) and what
   crosses each unit boundary (the p2p payload).
3. Stages: the split into contiguous ranges that minimises the slowest stage's time per
   micro-batch under each device's memory limit (a bisection on that time with a greedy
   fill, which is exact for contiguous min-max splits). The memory of device ``s`` is its
   state plus its activations per micro-batch times the micro-batches in flight there.
4. The schedule's step time, with ``t_s = f_s + b_s`` a stage's time per micro-batch
   (``f`` forward, ``b`` backward; ``b = b_in + b_w`` split evenly for the zero-bubble
   schedule) and ``m`` micro-batches, on ``p`` stages:

   - ``gpipe`` (Huang et al. 2019): ``(m - 1) max t + sum t``, every micro-batch's
     activations in flight (``m``);
   - ``1f1b`` (PipeDream-flush, Narayanan et al. 2021): the same time, ``min(m, p - s)`` in
     flight on device ``s``; with equal stages both are ``(m + p - 1) t``: bubble
     ``(p - 1) / m`` of the ideal;
   - ``interleaved`` (Megatron-LM, Narayanan et al. 2021, section 2.2): ``v`` chunks per
     device, ``m`` a multiple of ``p``: ``(m - 1) max t + max t + (sum t - max t) / v``
     (bubble ``(p - 1) / (v m)``), in flight ``min(m, p - s) (1 + (p - 1) / (p v))``, and
     ``v`` times the p2p transfers;
   - ``zb-h1`` (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): weight gradients
     deferred into the drain, the 1F1B memory: ``(m - 1) max t + sum f + max b`` (with equal
     stages ``m t + (p - 1) f``: the bubble ``(p - 1)(f + b_in - b_w)`` of the paper).

   Plus the p2p transfers: the fill and the drain pay one transfer per stage boundary each
   way on the critical path; in the steady state a fraction ``comm_overlap`` of the
   transfers runs under compute. Plus the slowest stage's once-a-step work (the update, its
   parameters cast and gathered).

``simulate`` runs the schedules' per-device op orders event by event (the drawing of
``PipelinePlan.schedule_text`` and the check of the formulas above in the tests).

Lowered (GPipe and 1F1B) by ``backends/_pipeline_run.py`` and run by ``distribute`` on a
mesh with a ``pp`` axis. Not built yet: one ILP per stage (the
inner plan is one plan of the whole step); recompute chosen per stage (it is the inner
plan's); the price of the cross-stage transfers of gradient clipping's norms and of a tied
embedding's gradient (the runtime sends them: a few bytes per parameter once per step, and
the head's share of the embedding's gradient every micro-batch).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._errors import PlanError
from ..ir import (Graph, NodeKind, OutputKind, Phase, Ref, Role, TensorMeta,
                  repeated_layers)
from ..ir._recompute import _layer_key
from ._comm import Collective, collective_time
from ._mesh import Mesh, Topology
from ._placement import layout_fraction
from ._plan import Plan, body_hash, checked_body
from ._planning import _planning_session, reduction_buckets
from ._summary import format_bytes

PP_AXIS = "pp"
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zb-h1")
PRE, POST = "<pre>", "<post>"
VIRTUAL_STAGES: tuple[int, ...] = (2, 4)       # chunks per device tried for "interleaved"
EXACT_CANDIDATES = 4        # the candidates the closed forms rank best, then simulated


@dataclass(frozen=True, slots=True)
class Unit:
    """One unit of the stage split (``<pre>``, a repeated layer, ``<post>``): what it costs
    one device of the inner mesh for the whole batch."""

    name: str
    fwd_s: float = 0.0          # scales with the micro-batch
    bwd_s: float = 0.0
    fixed_fwd_s: float = 0.0    # independent of the batch: parameters cast and gathered
    fixed_bwd_s: float = 0.0
    update_s: float = 0.0       # once per step
    state_bytes: float = 0.0
    act_bytes: float = 0.0      # forward values the backward reads (whole batch)
    kept_bytes: float = 0.0     # the batch-independent copies (cast, gathered parameters)


@dataclass(frozen=True, slots=True)
class Stage:
    """One device's stage (for ``interleaved``: its ``v`` chunks together)."""

    units: tuple[str, ...]
    fwd_s: float                # per micro-batch
    bwd_s: float
    update_s: float
    fixed_s: float              # once per step: its parameters cast and gathered (kept)
    state_bytes: float          # with the kept copies
    act_bytes_per_mb: float
    in_flight: float            # micro-batches of activations held at the peak
    peak_bytes: float


@dataclass(frozen=True, slots=True)
class PipelineEstimate:
    inner: str                  # the strategy of every stage's layouts
    schedule: str
    microbatches: int
    virtual_stages: int
    keep_params: bool
    step_time_s: float
    bubble_s: float
    p2p_s: float
    peak_memory_bytes: float
    fits: bool


@dataclass(frozen=True)
class PipelinePlan:
    """A pipeline plan: ``pp`` stages of the inner plan's layouts, a schedule and its
    micro-batches, with the cost model's step time and per-device memory."""

    mesh: Mesh                      # the whole mesh, pp axis included
    inner: Plan                     # every stage's layouts (the mesh without pp)
    schedule: str
    microbatches: int
    virtual_stages: int
    keep_params: bool                       # parameters gathered once a step, not per micro-batch
    chunks: tuple[tuple[str, ...], ...]     # units per chunk (pp * virtual_stages chunks)
    stages: tuple[Stage, ...]               # per device
    estimated_step_time_s: float
    bubble_s: float
    p2p_s: float
    update_s: float
    peak_memory_bytes: float
    memory_limit_bytes: int
    boundary_bytes: tuple[float, ...]       # p2p payload per micro-batch after each chunk
    tried: tuple[PipelineEstimate, ...] = field(default=())

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.memory_limit_bytes

    @property
    def pp(self) -> int:
        return self.mesh.sizes[self.mesh.index(PP_AXIS)]

    def summary(self) -> str:
        return pipeline_summary(self)

    def schedule_text(self, width: int = 96) -> str:
        return schedule_text(self, width)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON (format ``meshplan.pipeline-plan``, with the whole inner
        plan and a hash of its content), atomically: ``PipelinePlan.load``, ``meshplan run
        --plan``, ``meshplan plan show`` and ``distribute(plan=)`` read it."""
        from ..ir import atomic_write_text

        body = self.to_dict()
        atomic_write_text(path, json.dumps({"format": PIPELINE_FORMAT,
                                            "version": PIPELINE_VERSION,
                                            "sha256": body_hash(body), "body": body},
                                           allow_nan=False))

    @staticmethod
    def load(path: str | os.PathLike[str]) -> PipelinePlan:
        """A plan ``save`` wrote; ``PlanError`` naming the file for anything else (another
        format or version, a modified or damaged file)."""
        from ..ir._serialize import read_text

        where = os.fspath(path)
        text = read_text(path, "pipeline plan", PlanError)
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"{where} is not a meshplan pipeline plan (not JSON: {e})") from None
        body = checked_body(d, where, PIPELINE_FORMAT, PIPELINE_VERSION, "pipeline plan",
                            "--mesh pp=2,dp=2")
        try:
            return PipelinePlan.from_dict(body, where)
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"{where} is corrupt ({type(e).__name__}: {e})") from None

    @staticmethod
    def from_dict(d: dict[str, Any], where: str = "pipeline plan") -> PipelinePlan:
        inner = Plan.from_json(json.dumps(d["inner_plan"]), where=f"{where} (its inner plan)")
        return PipelinePlan(
            mesh=Mesh(tuple((str(a), int(n)) for a, n in d["mesh"]), inner.mesh.topology),
            inner=inner, schedule=str(d["schedule"]), microbatches=int(d["microbatches"]),
            virtual_stages=int(d["virtual_stages"]), keep_params=bool(d["keep_params"]),
            chunks=tuple(tuple(c) for c in d["chunks"]),
            stages=tuple(Stage(**{**st, "units": tuple(st["units"])}) for st in d["stages"]),
            estimated_step_time_s=float(d["estimated_step_time_s"]),
            bubble_s=float(d["bubble_s"]), p2p_s=float(d["p2p_s"]),
            update_s=float(d["update_s"]), peak_memory_bytes=float(d["peak_memory_bytes"]),
            memory_limit_bytes=int(d["memory_limit_bytes"]),
            boundary_bytes=tuple(float(b) for b in d["boundary_bytes"]),
            tried=tuple(PipelineEstimate(**t) for t in d["tried"]))

    def to_dict(self) -> dict[str, Any]:
        return {
            "mesh": [list(a) for a in self.mesh.axes], "topology": self.mesh.topology.name,
            "schedule": self.schedule, "microbatches": self.microbatches,
            "virtual_stages": self.virtual_stages, "keep_params": self.keep_params,
            "chunks": [list(c) for c in self.chunks],
            "stages": [dataclasses.asdict(s) for s in self.stages],
            "estimated_step_time_s": self.estimated_step_time_s, "bubble_s": self.bubble_s,
            "p2p_s": self.p2p_s, "update_s": self.update_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_limit_bytes": self.memory_limit_bytes, "fits": self.fits,
            "inner": {"mesh": [list(a) for a in self.inner.mesh.axes],
                      "strategy": self.inner.strategy,
                      "estimated_step_time_s": self.inner.estimated_step_time_s},
            "boundary_bytes": list(self.boundary_bytes),
            "tried": [dataclasses.asdict(t) for t in self.tried],
            "inner_plan": self.inner.to_dict(),
        }


PIPELINE_FORMAT = "meshplan.pipeline-plan"


def is_pipeline_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a pipeline plan (``PipelinePlan.save``); any other file,
    readable or not, is for ``Plan.load`` to judge and name."""
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(d, dict) and d.get("format") == PIPELINE_FORMAT
# 2: the whole inner plan in the file (``inner_plan``), a content hash, the boundary bytes
PIPELINE_VERSION = 2


# ---- units ----------------------------------------------------------------------------------

def unit_map(graph: Graph) -> tuple[list[str], dict[str, str]]:
    """The step's units in forward order (``<pre>``, its repeated layers, ``<post>``) and the
    unit of every input and op node: a layer's forward and backward ops by their module;
    the state and the optimizer's ops by the parameter they update; ops outside the layers
    with the parameter they read, else with the layer they follow when they run between two
    (``_between_layers``), else by where they run (before the first layer, or after)."""
    layers = repeated_layers(graph)
    if not layers:
        raise PlanError(f"{graph.info.name!r} has no repeated layers (modules numbered under one "
                        "parent, such as model.layers.0, model.layers.1): pipeline stages are "
                        "ranges of layers; use a mesh without a 'pp' axis")
    layer_set = set(layers)
    order = [PRE, *layers, POST]
    unit: dict[str, str] = {}
    nodes = graph.nodes
    first = next((i for i, n in enumerate(nodes) if n.kind is NodeKind.OP
                  and n.phase is Phase.FORWARD and n.module_path
                  and _layer_key(n.module_path) in layer_set), len(nodes))
    # modules the forward runs before the first layer (the embedding side), not counting
    # the layers' ancestors ("model" runs code before its layers and after them)
    pre_modules = {n.module_path for n in nodes[:first]
                   if n.kind is NodeKind.OP and n.phase is Phase.FORWARD and n.module_path
                   and not any(k.startswith(n.module_path + ".") for k in layers)}

    # parameters of no embedding-side module (a learned position table on the model itself:
    # ``h = self.emb(idx) + self.pos``) that the forward reads before the first layer go
    # with the embedding side too, else their ops would run on the last stage and the first
    # layer would wait for them there
    at = {n.name: i for i, n in enumerate(nodes)}
    early: set[str] = set()

    def by_path(path: str) -> str:
        key = _layer_key(path)
        if key in layer_set:
            return key
        return PRE if any(path == m or path.startswith(m + ".")
                          for m in (*pre_modules, *early)) else POST

    for n in nodes:
        meta = n.outputs[0] if n.kind is NodeKind.INPUT and n.outputs else None
        if isinstance(meta, TensorMeta) and meta.role is Role.PARAM \
                and by_path(n.target) == POST:
            reads = [at[u] for u in graph.users.get(n.name, ())
                     if graph.node(u).phase is Phase.FORWARD]
            if reads and min(reads) < first:
                early.add(n.target)

    for n in nodes:                     # the state: by the module of its parameter
        if n.kind is NodeKind.INPUT:
            path = n.target
            meta = n.outputs[0] if n.outputs else None
            if isinstance(meta, TensorMeta) and meta.role is Role.OPT_STATE and ".state." in path:
                path = path.split(".state.", 1)[1]     # "<optimizer>.state.<param>.<name>"
            unit[n.name] = by_path(path)
    in_layer = [i for i, n in enumerate(nodes) if n.kind is NodeKind.OP and n.module_path
                and _layer_key(n.module_path) in layer_set]
    last_f = max((i for i in in_layer if nodes[i].phase is Phase.FORWARD), default=-1)
    layer_b = [i for i in in_layer if nodes[i].phase is Phase.BACKWARD]
    rank = {u: k for k, u in enumerate(order)}
    for i, n in enumerate(nodes):
        if n.kind is not NodeKind.OP or n.phase is Phase.UPDATE:
            continue
        key = _layer_key(n.module_path) if n.module_path else None
        if key in layer_set:            # forward and backward ops of a layer
            unit[n.name] = key
            continue
        # outside the layers: with the parameter it reads (a mixed-precision cast, the
        # embedding, a tied head), else the embedding side's modules, else by where it runs
        # (before the first layer, or after: the final norm, the loss, their backward). A
        # module outside the layers that runs between them (one LayerNorm applied after every
        # layer) runs with the layer it follows there, on that layer's stage: its parameters
        # are sent to the stages that read them once a step, and its gradient passes back
        # down the chain with the layers' (with its parameters' unit, every gap's op ran on
        # the last stage, and 1F1B's order could not run it)
        state = next((unit[r.node] for r in n.refs()
                      if graph.node(r.node).kind is NodeKind.INPUT and r.node in unit
                      and graph.node(r.node).outputs[0].role is not Role.DATA), None)
        if state is None and n.module_path and by_path(n.module_path) == PRE:
            state = PRE
        if state is None or state in (PRE, POST):
            state = _between_layers(n, i, first, last_f, layer_b, unit, rank) or state
        unit[n.name] = state or (PRE if n.phase is Phase.FORWARD and i < first else POST)
    # a gradient the step keeps (``zero_grad()`` at its start, or none) is kept where its new
    # value is made: a shared module's, summed in the gap between two layers, is made on that
    # layer's stage, not its parameter's (the update there reads it as it reads any gradient)
    input_of = {n.target: n.name for n in nodes if n.kind is NodeKind.INPUT}
    late = []                   # kept gradients made by the update (clipped): below
    for o in graph.outputs:
        src = input_of.get(o.name) if o.kind is OutputKind.STATE and o.role is Role.GRAD else None
        if src is not None and graph.node(o.ref.node).kind is NodeKind.OP:
            if o.ref.node in unit:
                unit[src] = unit[o.ref.node]
            else:
                late.append((src, o.ref.node))
    for n in nodes:             # the update: the unit of the state it reads (its parameter's
        if n.name in unit:      # first), else of its largest operand
            continue
        refs = [r for r in n.refs() if r.node in unit]
        owner = next((unit[r.node] for role in _OWNERS for r in refs
                      if graph.node(r.node).kind is NodeKind.INPUT
                      and graph.node(r.node).outputs[0].role is role), None)
        if owner is None and refs:
            # a gradient scaled by clipping's coefficient goes with the gradient's parameter:
            # the coefficient, a scalar made from every gradient's norm, goes with the first
            # parameter's, and the parameter's update (on its own stage) reads the product
            owner = unit[max(refs, key=lambda r: _numel(graph.meta(r))).node]
        unit[n.name] = owner or POST
    for src, made in late:      # clip_grad_norm_'s product, kept: where the product is made
        unit[src] = unit[made]

    return order, unit


_OWNERS = (Role.PARAM, Role.OPT_STATE, Role.BUFFER, Role.GRAD)


def _numel(meta: Any) -> int:
    return math.prod(meta.shape) if isinstance(meta, TensorMeta) else 0


def _between_layers(n: Any, i: int, first: int, last_f: int, layer_b: Sequence[int],
                    unit: Mapping[str, str], rank: Mapping[str, int]) -> str | None:
    """The layer an op of the parent module's code between two layers goes with (``x =
    torch.relu(block(x))``: the activation is the parent's, not the block's): in the
    forward, between the first layer's first op and the last layer's last, the latest layer
    it reads from; in the backward, between the layers' backward ops, the earliest (its
    gradient comes from the next layer, what it saved from this one). Without it the op would
    go with the head, on the last stage, and every layer's output would travel there and
    back (and 1F1B's order could not run it)."""
    if n.phase is Phase.FORWARD:
        if not first <= i < last_f:
            return None
        pick = max
    elif n.phase is Phase.BACKWARD and layer_b and layer_b[0] < i < layer_b[-1]:
        pick = min
    else:
        return None
    layers = [unit[r.node] for r in n.refs()
              if unit.get(r.node) not in (None, PRE, POST)]
    return pick(layers, key=rank.__getitem__) if layers else None


def units_of(plan: Plan) -> tuple[list[Unit], list[float]]:
    """The inner plan's units in forward order (``<pre>``, the layers, ``<post>``) and the
    bytes per device that cross each boundary between consecutive units (whole batch)."""
    graph, mesh = plan.graph, plan.mesh
    order, unit = unit_map(graph)
    index = {u: k for k, u in enumerate(order)}
    batch = _batch_dependent(graph)
    placed = {p.node: p for p in plan.placements}
    acc = {u: dict(fwd_s=0.0, bwd_s=0.0, fixed_fwd_s=0.0, fixed_bwd_s=0.0, update_s=0.0,
                   state_bytes=0.0, act_bytes=0.0, kept_bytes=0.0) for u in order}

    def charge(u: str, phase: Phase | None, scales: bool, t: float) -> None:
        a = acc[u]
        if phase is Phase.FORWARD:
            a["fwd_s" if scales else "fixed_fwd_s"] += t
        elif phase is Phase.BACKWARD:
            a["bwd_s" if scales else "fixed_bwd_s"] += t
        else:
            a["update_s"] += t

    for p in plan.placements:
        n = graph.node(p.node)
        if n.kind is NodeKind.OP:
            charge(unit[n.name], n.phase, n.name in batch, p.compute_s)
    _charge_comm(plan, unit, batch, charge)

    kept: set[tuple] = set()      # parameters' copies in another layout, for the fwd/bwd
    for r in plan.redistributions:
        src = Ref.parse(r.value).node
        if src in batch or r.consumer.startswith("<") or (r.value, r.dst) in kept:
            continue
        c = graph.node(r.consumer)
        meta = graph.meta(Ref.parse(r.value))
        if c.phase is not Phase.UPDATE and isinstance(meta, TensorMeta):
            kept.add((r.value, r.dst))
            acc[unit[c.name]]["kept_bytes"] += meta.nbytes / layout_fraction(r.dst, mesh.sizes)
    crossing = [0.0] * (len(order) - 1)
    for n in graph.nodes:
        if n.kind is NodeKind.INPUT:
            meta = n.outputs[0] if n.outputs else None
            if isinstance(meta, TensorMeta) and meta.role in (Role.PARAM, Role.OPT_STATE,
                                                              Role.BUFFER):
                k = layout_fraction(placed[n.name].outputs[0], mesh.sizes)
                mult = 2 if meta.role is Role.PARAM else 1      # and its gradient
                acc[unit[n.name]]["state_bytes"] += mult * meta.nbytes / k
            continue
        if n.kind is not NodeKind.OP or n.phase is not Phase.FORWARD:
            continue
        size = sum(m.nbytes / layout_fraction(lay, mesh.sizes)
                   for m, lay in zip(n.outputs, placed[n.name].outputs)
                   if isinstance(m, TensorMeta) and lay is not None)
        if n.name not in batch:          # a parameter's cast: kept for the step with it
            acc[unit[n.name]]["kept_bytes"] += size
            continue
        users = graph.users.get(n.name, ())
        if any(graph.node(u).phase is Phase.BACKWARD for u in users):
            acc[unit[n.name]]["act_bytes"] += size
        later = [index[unit[u]] for u in users if graph.node(u).phase is Phase.FORWARD
                 and u in unit]
        here = index[unit[n.name]]
        for k in range(here, max(later, default=here)):
            crossing[k] += size
    return [Unit(u, **acc[u]) for u in order], crossing


def _batch_dependent(graph: Graph) -> set[str]:
    """Nodes that read the step's data (its batch), directly or through other nodes."""
    out: set[str] = set()
    for n in graph.nodes:
        if n.kind is NodeKind.INPUT:
            meta = n.outputs[0] if n.outputs else None
            if isinstance(meta, TensorMeta) and meta.role is Role.DATA:
                out.add(n.name)
        elif any(r.node in out for r in n.refs()):
            out.add(n.name)
    return out


def _charge_comm(plan: Plan, unit: dict[str, str], batch: set[str], charge) -> None:
    """Each redistribution's time to the unit and phase of its consumer (an all-reduce the
    lowering merges: its share of its bucket's call, by bytes)."""
    graph, mesh, rs = plan.graph, plan.mesh, plan.redistributions
    share: dict[int, float] = {}
    for b in reduction_buckets(graph, mesh, rs, plan.bucket_bytes):
        t = b.time_s(mesh)
        seen: set[str] = set()
        for i in b.members:
            r = rs[i]
            if r.value in seen:
                share[i] = 0.0
                continue
            seen.add(r.value)
            share[i] = t * r.collectives[0][2] * r.count / max(b.nbytes, 1.0)
    for i, r in enumerate(rs):
        t = share.get(i, r.time_s * r.count)
        src = Ref.parse(r.value).node
        if r.consumer == "<result>":
            charge(POST, Phase.FORWARD, False, t)
        elif r.consumer.startswith("<state "):
            charge(unit.get(src, POST), Phase.UPDATE, False, t)
        else:
            c = graph.node(r.consumer)
            charge(unit[c.name], c.phase, src in batch, t)


# ---- schedules ------------------------------------------------------------------------------

def in_flight(schedule: str, stage: int, p: int, m: int, v: int = 1) -> float:
    """Micro-batches of activations device ``stage`` holds at its peak."""
    if schedule == "gpipe":
        return float(m)
    held = float(min(m, p - stage))
    if schedule == "interleaved":     # at most every micro-batch of every chunk it holds
        held = min(held * (1 + (p - 1) / (p * v)), float(m))
    return held


def pipeline_time(schedule: str, fwd: Sequence[float], bwd: Sequence[float], m: int,
                  v: int = 1) -> float:
    """Seconds for ``m`` micro-batches through stages whose per-micro-batch forward and
    backward times are ``fwd`` and ``bwd`` (one entry per device), transfers aside."""
    t = [f + b for f, b in zip(fwd, bwd)]
    top = max(t)
    if schedule in ("gpipe", "1f1b"):
        return (m - 1) * top + sum(t)
    if schedule == "interleaved":
        return (m - 1) * top + top + (sum(t) - top) / v
    if schedule == "zb-h1":
        return (m - 1) * top + sum(fwd) + max(bwd)
    raise PlanError(f"unknown pipeline schedule {schedule!r}; use one of {SCHEDULES}")


def _chunk_split(units: Sequence[Unit], chunks: int, m: int, limit_check) -> list[int] | None:
    """Cut points (indices into ``units``, ``chunks - 1`` of them) of the contiguous split
    whose slowest chunk per micro-batch is least, every chunk holding at least one layer;
    ``limit_check(chunk_index, units)`` says whether a chunk's memory fits. None when no
    split fits."""
    layers = [k for k, u in enumerate(units) if u.name not in (PRE, POST)]
    if chunks > len(layers):
        return None

    def cost(us: Sequence[Unit]) -> float:
        return sum((u.fwd_s + u.bwd_s + u.fixed_fwd_s + u.fixed_bwd_s) / m for u in us)

    def greedy(cap: float) -> list[int] | None:
        cuts, start = [], 0
        for c in range(chunks - 1):
            # the chunk must leave a layer for each chunk after it
            last_allowed = layers[len(layers) - (chunks - 1 - c)] - 1
            end = None
            for k in range(layers[c] if not cuts else start, last_allowed + 1):
                us = units[start:k + 1]
                if not any(u.name not in (PRE, POST) for u in us):
                    continue
                if cost(us) > cap or not limit_check(c, us):
                    break
                end = k
            if end is None:
                return None
            cuts.append(end + 1)
            start = end + 1
        rest = units[start:]
        if cost(rest) > cap or not limit_check(chunks - 1, rest):
            return None
        return cuts

    hi = cost(units)
    lo = max(cost([u]) for u in units if u.name not in (PRE, POST))
    best = greedy(hi * (1 + 1e-9))
    if best is None:
        # memory may fail at any time cap: try the cap that holds the fewest units per chunk
        best = greedy(math.inf)
        if best is None:
            return None
    for _ in range(48):
        mid = (lo + hi) / 2
        got = greedy(mid)
        if got is None:
            lo = mid
        else:
            best, hi = got, mid
        if hi - lo <= 1e-6 * hi:
            break
    return best


def _candidates(local_batch: int, p: int, schedule: str,
                given: int | None) -> list[int]:
    if given is not None:
        return [given]
    divs = [d for d in range(1, local_batch + 1) if local_batch % d == 0]
    if schedule == "interleaved":
        return [d for d in divs if d % p == 0]
    if schedule == "gpipe":
        return divs
    return [d for d in divs if d >= p] or divs[-1:]


# ---- planning -------------------------------------------------------------------------------

def plan_pipeline(graph: Graph, mesh: Mesh | Mapping[str, int], *,
                  topology: str | Topology | None = None, strategy: str = "auto",
                  schedule: str | Sequence[str] = "auto", microbatches: int | None = None,
                  virtual_stages: int | None = None, memory_limit_bytes: int | None = None,
                  time_limit_s: float = 60.0, recompute: Any = "auto") -> PipelinePlan:
    """Plan ``graph`` on a mesh with a ``pp`` axis (see the module docstring): the inner plan
    of the other axes (``strategy``, as ``plan_graph`` takes it), then the stage split,
    ``schedule`` (one of ``SCHEDULES``, or a list of them, or ``"auto"``: the fastest that
    fits of those), the number of
    micro-batches (``microbatches``: it must divide each data-parallel rank's batch; default:
    the fastest that fits) and, for ``interleaved``, the chunks per device. With
    ``strategy="auto"`` and a ``tp`` axis, Megatron's layouts (``megatron_tp``) are tried for
    the stages too, and the faster pipeline that fits is kept. (``megatron_zero``, the
    optimizer state sharded over ``dp`` too, is not: on LLaMA-3 405B's stages it priced
    19.2 s against the chosen 18.2 s, at no lower a peak, and cost a minute of planning.)"""
    m_ = mesh if isinstance(mesh, Mesh) else Mesh(mesh, topology)
    if PP_AXIS not in m_.names:
        raise PlanError(f"plan_pipeline needs a '{PP_AXIS}' mesh axis, got {list(m_.names)}")
    a = m_.index(PP_AXIS)
    p = m_.sizes[a]
    schedules = (SCHEDULES if schedule == "auto" else (schedule,) if isinstance(schedule, str)
                 else tuple(schedule))
    if not schedules or any(x not in SCHEDULES for x in schedules):
        raise PlanError(f"pipeline schedule {schedule!r}: use one of {list(SCHEDULES)}, "
                        "'auto', or a list of them")
    if microbatches is not None and (not isinstance(microbatches, int)
                                     or isinstance(microbatches, bool) or microbatches < 1):
        raise PlanError(f"microbatches must be a positive integer, got {microbatches!r}")
    limit = int(memory_limit_bytes if memory_limit_bytes is not None
                else m_.topology.memory_bytes)
    inner_axes = tuple((n, s) for n, s in m_.axes if n != PP_AXIS) or (("dp", 1),)
    inner_mesh = Mesh(inner_axes, m_.topology)
    n_layers = len(repeated_layers(graph))
    if n_layers and p > n_layers:
        raise PlanError(f"mesh {PP_AXIS}={p} asks for more pipeline stages than "
                        f"{graph.info.name!r} has repeated layers ({n_layers}); use "
                        f"{PP_AXIS}={n_layers} or fewer (each stage holds at least one layer)")
    # every stage's layouts: the automatic plan, and where there is a 'tp' axis Megatron's
    # (weights split over tp, the batch over dp): a plan made for one pass of the whole
    # batch may gather weights that, kept through the micro-batches, do not fit
    strategies = [strategy]
    if strategy == "auto" and dict(inner_mesh.axes).get("tp", 1) > 1:
        strategies.append("megatron_tp")
    inners: dict[str, tuple[Plan, list[Unit], list[float], int]] = {}
    with _planning_session():           # both share the prepared and recomputed graphs
        for strat in strategies:
            try:
                inner = _inner_plan(graph, inner_mesh, strat, limit * p, time_limit_s,
                                    recompute)
            except PlanError:
                if strat == strategy:
                    raise
                continue                # the alternative does not fit at all: not a candidate
            units, crossing = units_of(inner)
            inners[strat] = (inner, units, crossing, _local_batch(inner))
    local_batch = inners[strategy][3]
    if microbatches is not None and local_batch % microbatches:
        raise PlanError(f"microbatches={microbatches} does not divide the batch of "
                        f"{local_batch} each data-parallel rank runs; use a divisor of "
                        f"{local_batch}")
    link = m_.link(a)
    tried: list[PipelineEstimate] = []
    best: PipelinePlan | None = None
    if tuple(schedules) == ("interleaved",) and n_layers and not any(
            p * v <= n_layers for v in ([virtual_stages] if virtual_stages else VIRTUAL_STAGES)):
        least = p * (virtual_stages or min(VIRTUAL_STAGES))
        raise PlanError(f"interleaved 1F1B on {PP_AXIS}={p} holds {least // p} chunks of at "
                        f"least one layer per device ({least} layers), and "
                        f"{graph.info.name!r} has {n_layers}: use schedule='1f1b' (one chunk "
                        f"per device), or {PP_AXIS}={max(1, n_layers // min(VIRTUAL_STAGES))} "
                        "or fewer")
    for strat, (inner, units, crossing, batch) in inners.items():
        n_layers = sum(u.name not in (PRE, POST) for u in units)
        for sch in schedules:
            vs = ([virtual_stages] if virtual_stages else
                  [v for v in VIRTUAL_STAGES if p * v <= n_layers]) \
                if sch == "interleaved" else [1]
            for v in vs:
                for m in _candidates(batch, p, sch, microbatches):
                    if sch == "interleaved" and m % p or batch % m:
                        continue
                    # gathering again differs only where something is cast or gathered
                    gathers = any(u.fixed_fwd_s or u.fixed_bwd_s or u.kept_bytes
                                  for u in units)
                    for keep in ((True, False) if gathers else (True,)):
                        got = _price(m_, inner, units, crossing, p, sch, m, v, limit, link,
                                     keep)
                        if got is None:
                            continue
                        tried.append(PipelineEstimate(strat, sch, m, v, keep,
                                                      got.estimated_step_time_s, got.bubble_s,
                                                      got.p2p_s, got.peak_memory_bytes,
                                                      got.fits))
                        if best is None or (got.fits, -got.estimated_step_time_s) > (
                                best.fits, -best.estimated_step_time_s):
                            best = got
    if best is None:
        raise PlanError(f"no pipeline schedule fits {graph.info.name!r} on {m_}: the "
                        f"interleaved schedule needs micro-batches in multiples of {p}; "
                        f"each data-parallel rank runs a batch of {local_batch}")
    # the closed forms ranked them; the best few are run event by event, which prices
    # unequal stages and the transfers exactly, and the fastest of those is the plan
    tried.sort(key=lambda t: (not t.fits, t.step_time_s))
    exact = []
    for t in tried[:EXACT_CANDIDATES]:
        inner, units, crossing, _ = inners[t.inner]
        got = _price(m_, inner, units, crossing, p, t.schedule, t.microbatches,
                     t.virtual_stages, limit, link, t.keep_params, exact=True)
        if got is not None:
            exact.append(got)
    best = min(exact, key=lambda g: (not g.fits, g.estimated_step_time_s), default=best)

    def key(x: Any) -> tuple:
        strat = x.inner if isinstance(x, PipelineEstimate) else x.inner.strategy
        return (strat, x.schedule, x.microbatches, x.virtual_stages, x.keep_params)

    keys = {key(g): g for g in exact}
    tried = [dataclasses.replace(t, step_time_s=g.estimated_step_time_s, bubble_s=g.bubble_s,
                                 p2p_s=g.p2p_s) if (g := keys.get(key(t))) else t
             for t in tried]
    tried.sort(key=lambda t: (not t.fits, t.step_time_s))
    if not best.fits:
        worst = max(range(p), key=lambda d: best.stages[d].peak_bytes)
        st = best.stages[worst]
        raise PlanError(
            f"no pipeline plan of {graph.info.name} fits {format_bytes(limit)} per device on "
            f"{m_}: the best ({best.schedule}, {best.microbatches} micro-batches) needs "
            f"{format_bytes(int(best.peak_memory_bytes))} on stage {worst} (misses by "
            f"{format_bytes(int(best.peak_memory_bytes - limit))}: state "
            f"{format_bytes(int(st.state_bytes))}, activations "
            f"{format_bytes(int(st.act_bytes_per_mb))} per micro-batch x {st.in_flight:g} in "
            f"flight). Tried: schedules {', '.join(schedules)}; micro-batch counts "
            f"{sorted({t.microbatches for t in tried})}; every split of the layers into "
            f"{p} stages. Use more stages, a larger mesh, activation recompute "
            "(recompute='full'), or raise memory_limit_bytes")
    return dataclasses.replace(best, tried=tuple(tried))


def _inner_plan(graph: Graph, mesh: Mesh, strategy: str, limit: int, time_limit_s: float,
                recompute: Any) -> Plan:
    """Every stage's layouts: ``plan_graph`` on the mesh without ``pp`` for the whole step,
    under ``limit`` (the device's times the stages). The batch is split over ``dp`` only:
    each pipeline replica runs whole sequences, which it cuts into micro-batches (the other
    axes may still split the activations inside)."""
    from ._planning import plan_graph

    dp = math.prod(n for a, n in mesh.axes if a == "dp")
    pins = {n.target: tuple("S(0)" if a == "dp" else "R" for a in mesh.names)
            for n in graph.inputs
            if isinstance(n.outputs[0], TensorMeta) and n.outputs[0].role is Role.DATA
            and n.outputs[0].shape and n.outputs[0].shape[0] % dp == 0} \
        if strategy == "auto" else None
    try:
        return plan_graph(graph, mesh, strategy=strategy, memory_limit_bytes=limit,
                          time_limit_s=time_limit_s, recompute=recompute, pins=pins)
    except PlanError as e:
        if "fits" not in str(e):
            raise
    # the whole step misses the limit on this mesh, yet its stages may fit: plan the
    # layouts without it (with full recompute where that was the planner's to choose) and
    # let the stages' memory decide
    return plan_graph(graph, mesh, strategy=strategy, memory_limit_bytes=1 << 62,
                      time_limit_s=time_limit_s, pins=pins,
                      recompute="full" if recompute == "auto" else recompute)


def _local_batch(inner: Plan) -> int:
    """The batch (dim 0 of the data inputs) one rank of the inner mesh runs."""
    sizes = []
    for n in inner.graph.inputs:
        meta = n.outputs[0] if n.outputs else None
        if isinstance(meta, TensorMeta) and meta.role is Role.DATA and meta.shape:
            lay = inner.placement(n.name).outputs[0]
            k = 1
            for pl, s in zip(lay, inner.mesh.sizes):
                if getattr(pl, "dim", None) == 0:
                    k *= s
            sizes.append(meta.shape[0] // k)
    return min(sizes) if sizes else 1


def _held(us: Sequence[Unit], keep: bool) -> float:
    """State bytes of ``us`` with their parameters' cast and gathered copies: all of them
    when kept through the step, else one unit's at a time."""
    return (sum(u.state_bytes for u in us)
            + (sum(u.kept_bytes for u in us) if keep else max(u.kept_bytes for u in us)))


def _price(mesh: Mesh, inner: Plan, units: list[Unit], crossing: list[float], p: int,
           schedule: str, m: int, v: int, limit: int, link, keep: bool = True,
           exact: bool = False, cuts: Sequence[int] | None = None) -> PipelinePlan | None:
    """The plan for one schedule, micro-batch count, chunks per device and ``keep`` (the
    parameters cast and gathered once per step and kept, or gathered again for every
    micro-batch, as FSDP's reshard after forward does); its time by the closed forms
    (``pipeline_time``), or with ``exact`` by running the schedule (``simulate``: the closed
    forms are exact for equal stages, within ~10 % otherwise). ``cuts``: the split to price
    (indices into ``units`` where chunks 1.. start; default: the best, ``_chunk_split``)."""
    chunks = p * v
    if not keep:            # paid by every micro-batch: part of its forward and backward
        units = [dataclasses.replace(u, fwd_s=u.fwd_s + m * u.fixed_fwd_s,
                                     bwd_s=u.bwd_s + m * u.fixed_bwd_s, fixed_fwd_s=0.0,
                                     fixed_bwd_s=0.0) for u in units]

    def device_of(c: int) -> int:
        return c % p

    def mem(c: int, us: Sequence[Unit]) -> bool:
        if v > 1:
            return True                  # checked per device once the chunks are known
        act = sum(u.act_bytes for u in us) / m
        return _held(us, keep) + act * in_flight(schedule, device_of(c), p, m, v) <= limit

    if cuts is None:
        cuts = _chunk_split(units, chunks, m, mem)
    if cuts is None:
        cuts = _chunk_split(units, chunks, m, lambda c, us: True)   # the best that does not fit
        if cuts is None:
            return None
    bounds = [0, *cuts, len(units)]
    chunk_units = [units[bounds[c]:bounds[c + 1]] for c in range(chunks)]
    stages = []
    for d in range(p):
        us = [u for c in range(chunks) if device_of(c) == d for u in chunk_units[c]]
        f = sum(u.fwd_s / m for u in us)
        b = sum(u.bwd_s / m for u in us)
        state = _held(us, keep)
        act = sum(u.act_bytes for u in us) / m
        held = in_flight(schedule, d, p, m, v)
        stages.append(Stage(tuple(u.name for u in us), f, b, sum(u.update_s for u in us),
                            sum(u.fixed_fwd_s + u.fixed_bwd_s for u in us),
                            state, act, held, state + act * held))
    fwd, bwd = [s.fwd_s for s in stages], [s.bwd_s for s in stages]
    ideal = m * max(f + b for f, b in zip(fwd, bwd))
    boundary = [crossing[bounds[c + 1] - 1] / m for c in range(chunks - 1)]
    one = max((collective_time(Collective.SEND_RECV, x, 2, link) for x in boundary),
              default=0.0)
    overlap = mesh.topology.comm_overlap
    steady = (1 - overlap) * 2 * (m - 1) * v * one     # transfers not hidden under compute
    if exact:
        body = simulate(schedule, fwd, bwd, m, v)[0]
        p2p = simulate(schedule, fwd, bwd, m, v, transfer_s=one)[0] - body + steady
    else:
        body = pipeline_time(schedule, fwd, bwd, m, v)
        p2p = 2 * (chunks - 1) * one / v + steady
    update = max(s.update_s + s.fixed_s for s in stages)
    peak = max(s.peak_bytes for s in stages)
    return PipelinePlan(mesh=mesh, inner=inner, schedule=schedule, microbatches=m,
                        virtual_stages=v, keep_params=keep, chunks=tuple(tuple(u.name for u in c)
                                                       for c in chunk_units),
                        stages=tuple(stages), estimated_step_time_s=body + p2p + update,
                        bubble_s=body - ideal, p2p_s=p2p, update_s=update,
                        peak_memory_bytes=peak, memory_limit_bytes=limit,
                        boundary_bytes=tuple(boundary))


# ---- simulation and drawing -----------------------------------------------------------------

def device_orders(schedule: str, p: int, m: int, v: int = 1) -> list[list[tuple[str, int, int]]]:
    """Each device's ops in the order it runs them: ``(kind, chunk, micro-batch)`` with kind
    ``F`` (forward), ``B`` (backward; for ``zb-h1`` the input gradient only) or ``W`` (the
    weight gradient, ``zb-h1``); chunk ``c`` of device ``d`` is virtual stage ``c * p + d``."""
    orders = []
    for d in range(p):
        if schedule == "gpipe":
            orders.append([("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)])
            continue
        if schedule == "interleaved":
            fs = [(c, i) for g in range(0, m, p) for c in range(v) for i in range(g, g + p)]
            bs = [(c, i) for g in range(0, m, p) for c in reversed(range(v))
                  for i in range(g, g + p)]
            warm = min(len(fs), (p - d - 1) * 2 + (v - 1) * p)
        else:
            fs = [(0, i) for i in range(m)]
            bs = [(0, i) for i in range(m)]
            warm = min(m, p - d - 1)
        order = [("F", c, i) for c, i in fs[:warm]]
        for k in range(len(fs) - warm):
            order.append(("F", *fs[warm + k]))
            order.append(("B", *bs[k]))
        order += [("B", c, i) for c, i in bs[len(fs) - warm:]]
        if schedule == "zb-h1":
            # weight gradients deferred: device d keeps d of them back (the last device the
            # most), so input gradients reach the devices before it sooner, and the kept
            # ones fill the drain
            delay, out, ws = d, [], []
            for op in order:
                out.append(op)
                if op[0] == "B":
                    ws.append(("W", 0, op[2]))
                    if len(ws) > delay:
                        out.append(ws.pop(0))
            order = out + ws
        orders.append(order)
    return orders


def simulate(schedule: str, fwd: Sequence[float], bwd: Sequence[float], m: int, v: int = 1,
             transfer_s: float = 0.0) -> tuple[float, list[list[tuple[float, float, str]]]]:
    """Run the schedule event by event: each device runs its ops in order, each as soon as
    its inputs exist (a forward after the previous virtual stage's forward of that
    micro-batch, a backward after the next one's backward and its own forward), ``transfer_s``
    between devices. ``fwd`` / ``bwd``: per device and micro-batch (a device's chunks share
    them equally). Returns the makespan and, per device, ``(start, end, label)`` (``F3``: the
    forward of micro-batch 3; ``F3 (chunk 2)`` with several chunks per device, virtual stage
    2)."""
    p = len(fwd)
    orders = device_orders(schedule, p, m, v)
    last = p * v - 1
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    pos = [0] * p
    timeline: list[list[tuple[float, float, str]]] = [[] for _ in range(p)]
    split = schedule == "zb-h1"
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for d in range(p):
            while pos[d] < len(orders[d]):     # this device's ops, while their inputs exist
                kind, c, i = orders[d][pos[d]]
                k = c * p + d
                if kind == "F":
                    dep = [] if k == 0 else [(("F", k - 1, i), (k - 1) % p != d)]
                    dur = fwd[d] / v
                elif kind == "B":
                    dep = [(("F", k, i), False)] if k == last else [(("B", k + 1, i),
                                                                     (k + 1) % p != d)]
                    dur = bwd[d] / v / (2 if split else 1)
                else:
                    dep = [(("B", k, i), False)]
                    dur = bwd[d] / v / 2
                if any(key not in done for key, _ in dep):
                    break
                start = max([free[d]] + [done[key] + (transfer_s if remote else 0.0)
                                         for key, remote in dep])
                end = start + dur
                done[(kind, k, i)] = end
                free[d] = end
                timeline[d].append((start, end, f"{kind}{i}" + (f" (chunk {k})" if v > 1
                                                               else "")))
                pos[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise PlanError(f"internal: the {schedule} order deadlocks (p={p}, m={m}, v={v})")
    return max(free), timeline


def idle_share(span: float, timeline: Sequence[Sequence[tuple[float, float, str]]]) -> float:
    """The share of device time ``simulate``'s timeline leaves idle over its ``span``."""
    busy = sum(e - s for ev in timeline for s, e, _ in ev)
    return 1 - busy / (span * len(timeline)) if span else 0.0


def schedule_text(plan: PipelinePlan, width: int = 96) -> str:
    """The plan's schedule drawn one row per device: ``F`` forward, ``B`` backward, ``W``
    weight gradient, ``.`` idle (time runs left to right, to scale)."""
    fwd = [s.fwd_s for s in plan.stages]
    bwd = [s.bwd_s for s in plan.stages]
    m = plan.microbatches
    span, timeline = simulate(plan.schedule, fwd, bwd, m, plan.virtual_stages)
    cols = max(16, width - 12)
    rows = []
    for d, events in enumerate(timeline):
        line = ["."] * cols
        for start, end, label in events:
            a = int(start / span * cols)
            b = max(a + 1, int(end / span * cols))
            for x in range(a, min(b, cols)):
                line[x] = label[0]
        rows.append(f"stage {d:>3} |{''.join(line)}|")
    idle = idle_share(span, timeline)
    rows.append(f"{plan.schedule}, {m} micro-batches"
                + (f", {plan.virtual_stages} chunks per device" if plan.virtual_stages > 1
                   else "") + f": idle {idle:.1%} of device time (simulated, transfers aside)")
    return "\n".join(rows)


def pipeline_summary(plan: PipelinePlan) -> str:
    ms = lambda s: f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.3f} s"   # noqa: E731
    lines = [
        f"pipeline plan on {plan.mesh}: {plan.pp} stages, {plan.schedule}, "
        f"{plan.microbatches} micro-batches"
        + (f", {plan.virtual_stages} chunks per device" if plan.virtual_stages > 1 else ""),
        f"  estimated step {ms(plan.estimated_step_time_s)} (bubble {ms(plan.bubble_s)}, "
        f"p2p {ms(plan.p2p_s)}, once a step {ms(plan.update_s)}: update"
        + (", parameters cast and gathered" if plan.keep_params else "") + "); peak memory "
        f"{format_bytes(int(plan.peak_memory_bytes))} of {format_bytes(plan.memory_limit_bytes)}"
        + ("" if plan.fits else "  DOES NOT FIT"),
        "  parameters cast and gathered " + ("once a step and kept through the micro-batches"
                                             if plan.keep_params else
                                             "again for every micro-batch (kept, they would "
                                             "not fit)"),
        f"  every stage's layouts: {plan.inner.strategy} plan on "
        f"{','.join(f'{a}={n}' for a, n in plan.inner.mesh.axes)}"
        + (f", {plan.inner.recompute[0]} recompute on {len(plan.inner.recompute[1])} layers"
           if plan.inner.recompute else ""),
    ]
    p = plan.pp
    for d, s in enumerate(plan.stages):
        layers = [u for u in s.units if u not in (PRE, POST)]
        extra = [u for u in s.units if u in (PRE, POST)]
        spans = []
        for c in range(d, len(plan.chunks), p):        # this device's chunks, in order
            ls = [u for u in plan.chunks[c] if u not in (PRE, POST)]
            spans.append(f"{ls[0]} .. {ls[-1]}" if len(ls) > 1 else ls[0])
        lines.append(f"  stage {d}: {len(layers)} layer{'s' * (len(layers) != 1)} "
                     f"({'; '.join(spans)})" + (f" + {' '.join(extra)}" if extra else "")
                     + f"; per micro-batch fwd {ms(s.fwd_s)} bwd {ms(s.bwd_s)}; "
                     f"{format_bytes(int(s.peak_bytes))} ({s.in_flight:g} micro-batch"
                     f"{'es' * (s.in_flight != 1)} in flight)")
    if plan.tried:
        lines.append("  tried (fastest first): " + "; ".join(
            (f"{t.inner}: " if len({x.inner for x in plan.tried}) > 1 else "")
            + f"{t.schedule} m={t.microbatches}" + (f" v={t.virtual_stages}"
                                                  if t.virtual_stages > 1 else "")
            + ("" if t.keep_params else " regather")
            + f" {ms(t.step_time_s)}" + ("" if t.fits else " (does not fit)")
            for t in plan.tried[:6]))
    return "\n".join(lines)


def refuse_pp(mesh: Mesh | Mapping[str, int], what: str) -> None:
    """``plan_graph`` on a mesh with a ``pp`` axis of more than one rank: one error that
    says where pipelines are planned and run."""
    axes = dict(mesh.axes) if isinstance(mesh, Mesh) else dict(mesh)
    if axes.get(PP_AXIS, 1) > 1:
        named = mesh if isinstance(mesh, Mesh) else ",".join(f"{a}={n}" for a, n in axes.items())
        raise PlanError(
            f"{what}: mesh {named} has a '{PP_AXIS}' axis: pipeline stages are planned by "
            "meshplan.planner.plan_pipeline (stage split, schedule, micro-batches, cost and "
            "memory), and distribute(mesh=...) plans and runs them itself (GPipe); one plan "
            f"of one mesh's layouts has no stages: plan without '{PP_AXIS}', or call "
            "plan_pipeline")


__all__ = ["PP_AXIS", "SCHEDULES", "PipelinePlan", "device_orders", "in_flight",
           "pipeline_time", "plan_pipeline", "refuse_pp", "simulate", "unit_map", "units_of"]
