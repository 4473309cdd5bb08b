"""Kernels: the compute kernels a lowering picks from.

Owns Triton kernels (GPU; tested on CPU with the Triton interpreter), numba CPU kernels, and the
registry that lowering chooses kernels from. Imports only `meshplan.ir` (and `meshplan._errors`,
`meshplan.telemetry`).

Built in a later issue; this package is a placeholder so the layout and import direction hold.
"""

__all__: list[str] = []
