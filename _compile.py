"""``meshplan.compile``: trace a step and plan it on a mesh, ahead of time."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

from .frontend import trace
from .planner import Mesh, Plan, Topology, plan_graph


def compile(  # noqa: A001 - the public name users call
    step_fn: Callable[..., Any],
    *example_args: Any,
    mesh: Mesh | Mapping[str, int],
    topology: str | Topology | None = None,
    strategy: str = "auto",
    memory_limit_bytes: int | None = None,
    pins: Mapping[str, Any] | None = None,
) -> Plan:
    """Trace ``step_fn`` on ``example_args`` and plan it on ``mesh`` (see ``plan_graph``)."""
    graph = trace(step_fn, *example_args).graph
    return plan_graph(graph, mesh, topology=topology or "cpu", strategy=strategy,
                      memory_limit_bytes=memory_limit_bytes, pins=pins, compare_sharded=True)
