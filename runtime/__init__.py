"""Runtime: running per-rank programs on a process mesh.

Owns the controller, the workers, the launchers (local subprocesses, mpiexec, Kubernetes Job), file
distribution to hosts, checkpoints and failure handling (restore after a rank dies). Control
messages travel over ZeroMQ signed with a per-run HMAC secret. May import every stage above it:
`ir`, `frontend`, `planner`, `kernels`, `backends` (and `meshplan._errors`, `meshplan.telemetry`).
"""

from typing import Any

from ._channel import ControllerChannel, Message, Secret, WorkerChannel
from ._files import FILES_PLUGIN, PushResult, RankStatus, push_files
from ._launch import LocalLauncher, StepFailed, WorkerFailure, Workers

__all__ = [
    "ControllerChannel",
    "FILES_PLUGIN",
    "LocalLauncher",
    "Message",
    "PushResult",
    "RankStatus",
    "Secret",
    "StepFailed",
    "WorkerChannel",
    "WorkerFailure",
    "WorkerState",
    "Workers",
    "push_files",
    "register",
]

_FROM_WORKER = ("WorkerState", "register")


def __getattr__(name: str) -> Any:
    # Imported on first use: an eager import would make `python -m meshplan.runtime._worker`
    # find its own module already loaded (runpy's RuntimeWarning, and two handler tables).
    if name in _FROM_WORKER:
        from . import _worker

        return getattr(_worker, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
