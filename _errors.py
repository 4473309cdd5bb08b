"""The one error hierarchy of meshplan.

Every user-facing failure is a :class:`MeshplanError`; each pipeline stage raises its own
subclass so callers can tell a tracing problem from a planning or runtime one. A message names
what went wrong, where (op, the user's ``file:line``, argument), and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "MeshplanError",
    "IRError",
    "TraceError",
    "PlanError",
    "LoweringError",
    "RuntimeFailure",
    "TelemetryError",
]


class MeshplanError(Exception):
    """Base class of every error meshplan raises on purpose."""


class IRError(MeshplanError):
    """A graph is malformed: failed verification, or a corrupt or foreign serialised graph."""


class TraceError(MeshplanError):
    """The user's step could not be captured into the IR."""


class PlanError(MeshplanError):
    """No valid plan: unknown mesh axes, an impossible pin, a corrupt plan file."""


class LoweringError(MeshplanError):
    """A plan could not be lowered to per-rank programs."""


class RuntimeFailure(MeshplanError):
    """A rank, a launcher or the controller failed while running a plan."""


class TelemetryError(MeshplanError):
    """The telemetry store could not be written or queried."""
