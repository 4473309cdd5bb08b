"""Lowering: from a `Plan` to one program per rank.

Owns lowering a plan to per-rank programs (local shapes, explicit collective nodes, chosen
kernels) and the communicators and transfers: torch.distributed (gloo on CPU, NCCL on GPU) and MPI
(mpi4py, one-sided RMA windows). Imports `meshplan.ir`, `meshplan.planner` and
`meshplan.kernels` (and `meshplan._errors`, `meshplan.telemetry`).

Built in a later issue; this package is a placeholder so the layout and import direction hold.
"""

__all__: list[str] = []
