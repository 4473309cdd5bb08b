"""Lowering: from a `Plan` to one program per rank.

Owns lowering a plan to per-rank programs (local shapes, explicit collective nodes, chosen
kernels) and the communicators and transfers: torch.distributed (gloo on CPU, NCCL on GPU) and MPI
(mpi4py, one-sided RMA windows). Imports `meshplan.ir`, `meshplan.planner` and
`meshplan.kernels` (and `meshplan._errors`, `meshplan.telemetry`).
"""

from ._comm import (
    CollectiveKind,
    CommRecord,
    Communicator,
    HostStagedCommunicator,
    TorchCommunicator,
)
from ._layout import all_axis_groups, assemble, holds_zeros, local_part, local_slices, rank_coords
from ._lower import Program, RunObserver, StepAborted, lower, run, split_inputs
from ._mpi import MPICommunicator
from ._rma import Transfer, TransferRecord
from ._rng import StepRNG
from ._threadcomm import ThreadMesh

__all__: list[str] = [
    "CollectiveKind",
    "CommRecord",
    "Communicator",
    "MPICommunicator",
    "Program",
    "RunObserver",
    "StepAborted",
    "StepRNG",
    "ThreadMesh",
    "TorchCommunicator",
    "HostStagedCommunicator",
    "Transfer",
    "TransferRecord",
    "all_axis_groups",
    "assemble",
    "holds_zeros",
    "local_part",
    "local_slices",
    "lower",
    "rank_coords",
    "run",
    "split_inputs",
]
