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
from .frontend import TracedStep, trace
from .ir import Graph

__version__ = "0.1.0"

__all__ = [
    "Graph",
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
