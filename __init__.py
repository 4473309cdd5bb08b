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


def __getattr__(name: str):  # noqa: ANN202
    # the runtime (ZeroMQ, launchers) loads on first use: workers import meshplan too
    if name in ("distribute", "DistributedStep"):
        from .runtime import _distributed

        return getattr(_distributed, name)
    if name in ("transfer", "TransferReport"):
        from .runtime import _transfer

        return getattr(_transfer, name)
    raise AttributeError(f"module 'meshplan' has no attribute {name!r}")

__all__ = [
    "DistributedStep",
    "Graph",
    "Mesh",
    "Plan",
    "compile",
    "distribute",
    "IRError",
    "LoweringError",
    "MeshplanError",
    "PlanError",
    "RuntimeFailure",
    "TelemetryError",
    "TraceError",
    "TracedStep",
    "TransferReport",
    "__version__",
    "trace",
    "transfer",
]
