"""Shared helpers of the kernels: the error type, Triton availability, launch checks.

Triton decides at ``@triton.jit`` time whether a kernel is compiled for a GPU or run by its
interpreter (``TRITON_INTERPRET=1``), so the kernel modules are imported lazily (see
``meshplan.kernels.__getattr__``) and the flag must be set before the first of them is imported.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Sequence

import torch

from .._errors import LoweringError

__all__ = ["KernelError", "triton_available", "interpreting", "check_tensors", "next_pow2",
           "same_lengths"]


class KernelError(LoweringError):
    """A kernel was registered wrongly, asked for an unsupported input, or is unavailable."""


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton kernels run on the CPU through the interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available(device: str = "cuda") -> bool:
    """Whether Triton kernels can run on ``device``: triton importable and either a CUDA device
    (for ``cuda``) or the interpreter switched on (for ``cpu``)."""
    if not _triton_importable():
        return False
    if device == "cuda":
        return torch.cuda.is_available()
    return device == "cpu" and interpreting()


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def check_tensors(op: str, *tensors: torch.Tensor, contiguous: bool = True) -> None:
    """Raise KernelError unless every tensor is a float tensor on one device (and contiguous)."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise KernelError(f"{op}: tensors are on several devices {sorted(map(str, devices))}; "
                          "move them to one device first")
    for i, t in enumerate(tensors):
        if t.dtype not in _FLOATS:
            raise KernelError(f"{op}: argument {i} has dtype {t.dtype}; the kernel supports "
                              "float32, float16 and bfloat16 (bfloat16 on a GPU only)")
        if contiguous and not t.is_contiguous():
            raise KernelError(f"{op}: argument {i} (shape {tuple(t.shape)}) is not contiguous; "
                              "call .contiguous() or pack it with pack_views")
    device = next(iter(devices))
    if device.type == "cpu" and not interpreting():
        raise KernelError(f"{op}: CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 set "
                          "before triton is imported); on CPU use the torch op or a numba kernel")


def same_lengths(op: str, **lists: Sequence) -> None:
    """Raise KernelError unless the per-shard argument lists all have one length."""
    lengths = {k: len(v) for k, v in lists.items()}
    if len(set(lengths.values())) != 1:
        raise KernelError(f"{op}: lists differ in length {lengths}; pass one entry per shard")


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
