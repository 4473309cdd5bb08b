"""meshplan: put ``@meshplan.distribute`` on an ordinary PyTorch training step and run it on a
device mesh.

The pipeline runs one way: ``frontend`` traces the step into ``ir``; ``planner`` shards it;
``backends`` lower the plan to per-rank programs; ``runtime`` runs them from one controller;
``telemetry`` records every rank. This module exports the small public surface.
"""

from ._errors import (
    IRError,
    LoweringError,
    MeshplanError,
    PlanError,
    RuntimeFailure,
    TelemetryError,
    TraceError,
)
from ._compile import compile
from .frontend import TracedStep, trace
from .ir import Graph
from .planner import Mesh, Plan

__version__ = "0.1.0"

__all__ = [
    "Graph",
    "Mesh",
    "Plan",
    "compile",
    "IRError",
    "LoweringError",
    "MeshplanError",
    "PlanError",
    "RuntimeFailure",
    "TelemetryError",
    "TraceError",
    "TracedStep",
    "__version__",
    "trace",
]
