"""The hand-written plan families, expressed as pins on the same ILP and cost model.

``dp``: every parameter, gradient, optimizer-state tensor and buffer replicated; the batch
(dim 0 of each data input) split over all axes (over those it divides if it is smaller). ``fsdp``: the same, with every state tensor
sharded on its first dimension that divides the mesh (ZeRO-3 / FSDP2's dim-0 sharding).
``megatron_tp``: Megatron-LM's column/row split of linear layers on the ``tp`` axis (named the
way torchtitan's and Megatron's plans name them), data parallel on the other axes.
``megatron_zero``: ``megatron_tp`` with the optimizer state (and persistent gradients) sharded
over the data-parallel axes too, as Megatron's distributed optimizer and DeepSpeed's ZeRO-1/2
with tensor parallelism run (LLaMA-3 405B's training: weights over ``tp`` only, the rest over
``dp``): the gradients are reduce-scattered over ``dp``, each rank updates its shard and the
new weights are all-gathered. Not among the families the automatic search compares itself
with (``HAND_STRATEGIES``), nor tried by ``plan_pipeline`` yet; ``strategy="megatron_zero"``
plans it.

Every family updates the optimizer state where it lives (``hand_update_reads``), and ``dp`` and
``fsdp`` use only their own collectives (``FAMILY_COLLECTIVES``: DDP's all-reduce; FSDP's
all-gather, reduce-scatter and all-reduce): without these the solver would shard DDP's update
and all-gather it back, or move activations between ranks, which the cost model may price
lower but which is not the family (and on gloo was measured slower).
"""

from __future__ import annotations

import itertools
import math
import re

from .._errors import PlanError
from ..ir import Graph, Role, TensorMeta
from ._comm import Collective
from ._mesh import Mesh
from ._placement import Layout, R, Shard, divides

HAND_STRATEGIES = ("dp", "fsdp", "megatron_tp")
FAMILIES = (*HAND_STRATEGIES, "megatron_zero")        # what ``strategy=`` may name
_MEGATRON = ("megatron_tp", "megatron_zero")

# The collectives a family uses: DDP all-reduces gradients (and the loss); FSDP gathers
# parameters and reduce-scatters gradients. The solver avoids any other layout change for them
# (``Problem.collectives``), so a "dp" plan is DDP's and not a plan of the solver's invention
# that reshuffles activations. Megatron's (all-reduces, gathers of vocabulary shards) is left
# to the solver.
FAMILY_COLLECTIVES = {
    "dp": frozenset({Collective.ALL_REDUCE}),
    "fsdp": frozenset({Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_REDUCE}),
}

# Linear weights are (out_features, in_features): column-parallel splits dim 0, row dim 1.
_COLUMN = re.compile(r"(^|\.)(q_proj|k_proj|v_proj|query|key|value|qkv|c_attn|wq|wk|wv|"
                     r"gate_proj|up_proj|w1|w3|c_fc|fc1|lm_head|output)\.(weight|bias)$")
_ROW = re.compile(r"(^|\.)(o_proj|out_proj|c_proj|wo|down_proj|w2|fc2|dense)\.weight$")
_VOCAB = re.compile(r"(^|\.)(wte|embed_tokens|tok_embeddings|embedding)\.weight$")


def _batch(meta: TensorMeta, mesh: Mesh, axes: list[int]) -> Layout:
    """Dim 0 split over the data-parallel ``axes``; a batch smaller than all of them is split
    over those it divides, in mesh order, and the ranks along the others repeat the same work
    (what running the family on a mesh wider than the batch means). A 0-d input (a count
    the step is given) has no batch: every rank holds it."""
    if not meta.shape:
        return tuple(R for _ in mesh.sizes)
    used: list[int] = []
    for a in axes:
        layout = tuple(Shard(0) if i in used + [a] else R for i in range(len(mesh.sizes)))
        if meta.shape and divides(meta.shape, layout, mesh.sizes):
            used.append(a)
    layout = tuple(Shard(0) if i in used else R for i in range(len(mesh.sizes)))
    if axes and not used:
        raise PlanError(
            f"data input of shape {list(meta.shape)}: batch dim does not divide over mesh "
            f"axes {[mesh.names[i] for i in axes]} ({math.prod(mesh.sizes[i] for i in axes)} "
            "ranks); use a batch that is a multiple of the data-parallel size")
    return layout


def _fsdp_layout(meta: TensorMeta, mesh: Mesh, axes: list[int]) -> Layout:
    rep = tuple(R for _ in mesh.sizes)
    for d in range(len(meta.shape)):
        layout = tuple(Shard(d) if i in axes else R for i in range(len(mesh.sizes)))
        if divides(meta.shape, layout, mesh.sizes):
            return layout
    return rep


def _zero_layout(base: Layout, meta: TensorMeta, mesh: Mesh, axes: list[int]) -> Layout:
    """``base`` (a Megatron layout) with its first dim that divides split over the
    data-parallel ``axes`` too, where ``base`` replicates (ZeRO's shard of the state)."""
    for d in range(len(meta.shape)):
        layout = tuple(Shard(d) if i in axes and base[i] == R else p for i, p in enumerate(base))
        if layout != base and divides(meta.shape, layout, mesh.sizes):
            return layout
    return base


def _param_of(name: str, params: dict[str, TensorMeta]) -> str | None:
    """``opt.state.model.fc.weight.exp_avg`` -> ``model.fc.weight``; ``x.grad`` -> ``x``."""
    if name.endswith(".grad") and name[:-5] in params:
        return name[:-5]
    best = None
    text = f".{name}"
    at = text.find(".state.")
    while at >= 0:                # the longest parameter p with ".state.{p}." in the name
        rest = text[at + 7:]
        dot = rest.rfind(".")
        while dot > 0:
            p = rest[:dot]
            if p in params and (best is None or len(p) > len(best)):
                best = p
            dot = rest.rfind(".", 0, dot)
        at = text.find(".state.", at + 1)
    return best


def hand_reads(graph: Graph, mesh: Mesh, strategy: str,
               pins: dict[str, set[Layout]]) -> dict[str, Layout]:
    """How the family's forward and backward read each parameter: DP and FSDP read whole
    (FSDP all-gathers its shards first), Megatron reads its tensor-parallel shard on ``tp``
    and whole on the other axes. Without this the solver would turn 'FSDP' state layouts
    into tensor parallelism of its own invention, and the comparison would be meaningless."""
    reads: dict[str, Layout] = {}
    tp = mesh.index("tp") if strategy in _MEGATRON else None
    for n in graph.inputs_with_role(Role.PARAM):
        (layout,) = pins[n.target]
        reads[n.target] = tuple(p if i == tp else R for i, p in enumerate(layout))
    return reads


def hand_update_reads(graph: Graph, pins: dict[str, set[Layout]]) -> dict[str, Layout]:
    """How the family's optimizer reads each parameter and its state: where they live. DDP
    updates replicated state on every rank, FSDP its shards, Megatron its tensor-parallel
    pieces; none all-gathers an update computed on shards of replicated state (that is
    weight-update sharding), except ``megatron_zero``, whose optimizer state is sharded over
    ``dp`` where its parameter is not: a parameter is updated where its state lives (the
    layout of its first state tensor of its shape), and written back whole over ``dp``."""
    roles = (Role.PARAM, Role.OPT_STATE)
    reads = {n.target: next(iter(pins[n.target])) for n in graph.inputs
             if n.meta.role in roles and len(pins.get(n.target, ())) == 1}
    params = {n.target: n.meta for n in graph.inputs_with_role(Role.PARAM)}
    for n in graph.inputs_with_role(Role.OPT_STATE):
        owner = _param_of(n.target, params)
        if (owner in reads and n.target in reads and params[owner].shape == n.meta.shape
                and reads[n.target] != next(iter(pins[owner]))):
            reads[owner] = reads[n.target]
    return reads


def hand_pins(graph: Graph, mesh: Mesh, strategy: str) -> dict[str, set[Layout]]:
    """Input layouts the hand-written family ``strategy`` fixes (one layout per input)."""
    if strategy not in FAMILIES:
        raise PlanError(f"unknown strategy {strategy!r}; use 'auto' or one of {FAMILIES}")
    all_axes = list(range(len(mesh.sizes)))
    dp_axes = all_axes
    if strategy in _MEGATRON:
        tp = mesh.index("tp") if "tp" in mesh.names else None
        if tp is None:
            raise PlanError(f"strategy {strategy!r} needs a mesh axis named 'tp'; the mesh has "
                            f"{list(mesh.names)}")
        dp_axes = [i for i in all_axes if i != tp]
    params = {n.target: n.meta for n in graph.inputs_with_role(Role.PARAM)}
    pins: dict[str, Layout] = {}
    for n in graph.inputs_with_role(Role.PARAM):
        pins[n.target] = _state_layout(n.target, n.meta, mesh, strategy, dp_axes)
    for n in graph.inputs:
        role = n.meta.role
        if role is Role.DATA:
            pins[n.target] = _batch(n.meta, mesh, dp_axes)
        elif role in (Role.OPT_STATE, Role.GRAD, Role.BUFFER):
            owner = _param_of(n.target, params)
            if owner is not None and params[owner].shape == n.meta.shape:
                pins[n.target] = pins[owner]
                if strategy == "megatron_zero" and role is not Role.BUFFER:
                    pins[n.target] = _zero_layout(pins[owner], n.meta, mesh, dp_axes)
            else:
                pins[n.target] = _state_layout(n.target, n.meta, mesh, strategy, dp_axes)
    return {k: {v} for k, v in pins.items()}


def _state_layout(name: str, meta: TensorMeta, mesh: Mesh, strategy: str,
                  dp_axes: list[int]) -> Layout:
    rep = tuple(R for _ in mesh.sizes)
    if strategy == "dp":
        return rep
    if strategy == "fsdp":
        return _fsdp_layout(meta, mesh, dp_axes)
    tp = mesh.index("tp")
    want = None
    if _COLUMN.search(name) or _VOCAB.search(name):
        want = Shard(0)
    elif _ROW.search(name):
        want = Shard(1)
    if want is None or want.dim >= len(meta.shape):
        return rep
    layout = tuple(want if i == tp else R for i in range(len(mesh.sizes)))
    return layout if divides(meta.shape, layout, mesh.sizes) else rep


def product_layouts(meta: TensorMeta, mesh: Mesh) -> list[Layout]:
    per_axis = [R] + [Shard(d) for d in range(len(meta.shape))]
    return [tuple(l) for l in itertools.product(per_axis, repeat=len(mesh.sizes))
            if divides(meta.shape, tuple(l), mesh.sizes)]
