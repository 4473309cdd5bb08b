"""Planning: how every value of a traced step is laid out across a device mesh.

Meshes and topologies, placements (Replicate / Shard / Partial), one registry of sharding
rules, an alpha-beta and roofline cost model, a per-rank memory model, and a global ILP (HiGHS)
whose outcomes include data parallel, ZeRO/FSDP, Megatron tensor parallel and sequence
parallel. Imports nothing of meshplan's but ``ir``.
"""

from .._errors import PlanError
from ._calibrate import calibrate
from ._comm import Collective, collective_time
from ._hand import HAND_STRATEGIES
from ._mesh import PRESETS, Link, Mesh, Topology, get_topology, parse_mesh
from ._placement import Layout, Partial, Placement, ReduceOp, Replicate, Shard
from ._plan import NodePlacement, Plan, Redistribution
from ._pipeline import SCHEDULES, PipelinePlan, plan_pipeline
from ._planning import check_recompute, plan_graph, recompute_cost
from ._report import diff, explain, plan_report, render_html

__all__ = [
    "HAND_STRATEGIES",
    "PRESETS",
    "Collective",
    "Layout",
    "Link",
    "Mesh",
    "NodePlacement",
    "Partial",
    "PipelinePlan",
    "Placement",
    "Plan",
    "PlanError",
    "Redistribution",
    "SCHEDULES",
    "ReduceOp",
    "Replicate",
    "Shard",
    "Topology",
    "calibrate",
    "collective_time",
    "diff",
    "explain",
    "get_topology",
    "parse_mesh",
    "check_recompute",
    "plan_graph",
    "plan_pipeline",
    "recompute_cost",
    "plan_report",
    "render_html",
]
