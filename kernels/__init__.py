"""Kernels: the compute kernels a lowering picks from, and the registry it picks them through.

Triton kernels (GPU; on CPU they run only under the Triton interpreter, ``TRITON_INTERPRET=1``,
which is how they are tested here), numba CPU kernels for gradient buckets, and pure-torch
fallbacks. Importing this package imports neither triton nor numba: the kernel functions below
are loaded on first attribute access, so set ``TRITON_INTERPRET`` before touching them.

Registry (for the lowering)::

    matches = find_kernels(graph, "cuda", {"float32"})     # list[Match]
    fn = load_kernel(matches[0].kernel)                    # the kernel's entry function
    buckets = plan_buckets(sizes_bytes, dtypes, 25 << 20)  # list[Bucket]
    flatten_into(buffer, grads, bucket.offsets); ...; unflatten_from(buffer, grads, bucket.offsets)

``MESHPLAN_KERNELS=off`` or ``set_kernels_enabled(False)`` turns every kernel off. See
``kernels/README.md`` for each kernel's devices, dtypes and what was tested where.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import _builtin  # noqa: F401  (registers the built-in kernels)
from ._buckets import Bucket, dtype_name, plan_buckets
from ._flatten_torch import (
    flatten_into_torch, pack_strided_torch, unflatten_from_torch, unpack_strided_torch,
)
from ._registry import (
    Backend, Device, KernelSpec, Match, find_kernels, get_kernel, kernels_disabled,
    kernels_enabled, load_kernel, register_kernel, registered_kernels, set_kernels_enabled,
    unregister_kernel,
)
from ._common import KernelError, triton_available

# name -> submodule holding it; imported on first access (triton / numba are heavy, and triton
# must see TRITON_INTERPRET before its kernels are defined).
_LAZY = {
    "adamw_step_": "_triton_optim", "sgd_step_": "_triton_optim",
    "bias_gelu": "_triton_act", "swiglu": "_triton_act",
    "layer_norm": "_triton_norm", "rms_norm": "_triton_norm",
    "cross_entropy": "_triton_xent", "cross_entropy_fwd_bwd": "_triton_xent",
    "shard_stats": "_triton_xent", "shard_grad": "_triton_xent",
    "combine_shard_stats": "_triton_xent",
    "pack_views": "_triton_pack", "unpack_views": "_triton_pack", "narrow_shards": "_triton_pack",
    "flatten_into": "_numba", "unflatten_from": "_numba", "pack_strided": "_numba",
    "unpack_strided": "_numba",
}

__all__ = [
    "Backend", "Bucket", "Device", "KernelError", "KernelSpec", "Match", "dtype_name",
    "find_kernels", "flatten_into_torch", "get_kernel", "kernels_disabled", "kernels_enabled",
    "load_kernel", "pack_strided_torch", "plan_buckets", "register_kernel", "registered_kernels",
    "set_kernels_enabled", "triton_available", "unflatten_from_torch", "unpack_strided_torch",
    "unregister_kernel", "adamw_step_", "sgd_step_", "bias_gelu", "swiglu", "layer_norm",
    "rms_norm", "cross_entropy", "cross_entropy_fwd_bwd", "shard_stats", "shard_grad",
    "combine_shard_stats", "pack_views", "unpack_views", "narrow_shards", "flatten_into",
    "unflatten_from", "pack_strided", "unpack_strided",
]


def warm_cpu() -> None:
    """Load the CPU optimizer kernel a plan's lowering may call (numba's fused AdamW, compiled
    at its first call and cached on disk; loading it takes about 0.9 s in a fresh process) by
    running it on a few float32 elements. A fault-tolerance spare does this while it waits, so
    the rank it replaces does not pay for it in its first step. The bucket copies' parallel
    kernel is left alone (its first call costs ~6 ms; started in a spare, its OpenMP team made
    the rank slower at every step after). Best effort: without numba, nothing."""
    import torch

    try:
        from . import _cpu_optim
    except ImportError:
        return
    p, g, m, v = (torch.zeros(8) for _ in range(4))
    _cpu_optim.adamw_fused_cpu_([p], [g], [m], [v], [0.0], [1.0], decay=1.0, lerp_weight=0.1,
                                beta2=0.999, addcmul_value=1e-3, eps=1e-8)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
