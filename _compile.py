"""``meshplan.compile``: trace a step and plan it on a mesh, ahead of time."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

from .frontend import trace
from .frontend._autocast import autocast_for
from .frontend._precision import precision as mixed_precision
from .planner import PRESETS, Mesh, Plan, Topology, get_topology, plan_graph


def compile(  # noqa: A001 - the public name users call
    step_fn: Callable[..., Any],
    *example_args: Any,
    mesh: Mesh | Mapping[str, int],
    topology: str | Topology | None = None,
    strategy: str = "auto",
    memory_limit_bytes: int | None = None,
    pins: Mapping[str, Any] | None = None,
    precision: str | None = None,
    recompute: Any = "auto",
) -> Plan:
    """Trace ``step_fn`` on ``example_args`` and plan it on ``mesh`` (see ``plan_graph``).
    For a GPU topology, ``torch.autocast("cuda", ...)`` regions are traced as a GPU would run
    them even where this process has no CUDA (``frontend/_autocast.py``). ``precision``:
    ``"bf16"``/``"fp16"`` plans the step under FSDP2-style mixed precision
    (``frontend/_precision.py``). ``recompute``: activation recompute (``plan_graph``)."""
    with autocast_for(cuda_regions(topology)), mixed_precision(precision):
        graph = trace(step_fn, *example_args).graph
    return plan_graph(graph, mesh, topology=topology or "cpu", strategy=strategy,
                      memory_limit_bytes=memory_limit_bytes, pins=pins, compare_sharded=True,
                      recompute=recompute)


def cuda_regions(topology: str | Topology | None) -> str | None:
    """``"cuda"`` when ``topology`` (a preset name, optionally with options, or a Topology)
    describes GPUs: its ``torch.autocast("cuda")`` regions are then traced as a GPU runs them
    (``frontend/_autocast.py``). None for the CPU preset and for calibrated files."""
    try:
        topo = get_topology(topology)
    except Exception:  # noqa: BLE001 - a bad topology fails where it is planned, with its error
        return None
    base = topo.name.partition(":")[0]
    return "cuda" if base in PRESETS and base != "cpu" else None
