"""Runtime: running per-rank programs on a process mesh.

Owns the controller, the workers, the launchers (local subprocesses, mpiexec, Kubernetes Job), file
distribution to hosts, checkpoints and failure handling (restore after a rank dies). Control
messages travel over ZeroMQ signed with a per-run HMAC secret. May import every stage above it:
`ir`, `frontend`, `planner`, `kernels`, `backends` (and `meshplan._errors`, `meshplan.telemetry`).

Built in a later issue; this package is a placeholder so the layout and import direction hold.
"""

__all__: list[str] = []
