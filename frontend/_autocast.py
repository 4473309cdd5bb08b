"""Tracing a step's ``torch.autocast("cuda", ...)`` regions for GPUs on a machine without one.

Planning for GPUs from a laptop (``meshplan.compile(..., topology="h100")``) traces the step
on the CPU or on the meta device. There torch turns a ``torch.autocast(device_type="cuda")``
region off with a warning, so a bf16 training step would be traced, priced and planned as
fp32: twice the activation memory, the fp32 FLOP rate. A step traced under
``autocast_for("cuda")`` (``meshplan.compile`` and ``meshplan compile`` for a GPU topology)
enters such a region as CPU autocast with the same dtype (CUDA's default, float16, when none
is given) whenever it is traced (``honoured``), so the graph holds the casts a GPU makes.

The two autocast policies agree where the FLOPs are: matmuls (``mm``, ``bmm``, ``addmm``,
``baddbmm``, ``matmul``, ``linear``), convolutions and scaled-dot-product attention run in the
low dtype under both, and losses, norms and softmax in fp32. They differ in a few ops: CUDA
also lowers ``addmv``, ``addr``, ``mv`` and the RNN cells, which CPU autocast leaves in fp32,
so a step that relies on those is priced slightly high.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator

import torch

__all__ = ["autocast_for", "honoured", "target"]

logger = logging.getLogger(__name__)

_CUDA_DEFAULT = torch.float16          # torch.get_autocast_dtype("cuda") out of the box
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("meshplan_autocast",
                                                                    default=None)
_depth = 0                             # nested honoured() contexts patch once


@contextlib.contextmanager
def autocast_for(device_type: str | None) -> Iterator[None]:
    """Steps traced inside (``meshplan.trace``) run their ``torch.autocast(device_type)``
    regions as that device would, whenever they trace, even after the context has ended."""
    token = _TARGET.set(device_type)
    try:
        yield
    finally:
        _TARGET.reset(token)


def target() -> str | None:
    """The device type ``autocast_for`` set here (None: torch's own behaviour)."""
    return _TARGET.get()


@contextlib.contextmanager
def honoured(device_type: str | None) -> Iterator[list[torch.dtype]]:
    """While active, and only when ``device_type`` is ``"cuda"`` and this process has no CUDA,
    ``torch.autocast("cuda", dtype)`` (and ``torch.cuda.amp.autocast``) enter CPU autocast with
    that dtype. Yields the list of dtypes of the regions so entered."""
    global _depth
    mapped: list[torch.dtype] = []
    if device_type != "cuda" or torch.cuda.is_available() or _depth:
        yield mapped
        return
    cls = torch.amp.autocast_mode.autocast
    original = cls.__init__

    def __init__(self, device_type: str, dtype: torch.dtype | None = None,  # noqa: ANN001
                 enabled: bool = True, cache_enabled: bool | None = None) -> None:
        if device_type == "cuda":
            dtype = dtype or _CUDA_DEFAULT
            if enabled:
                mapped.append(dtype)
            device_type = "cpu"
        original(self, device_type, dtype, enabled, cache_enabled)

    cls.__init__ = __init__
    _depth += 1
    try:
        yield mapped
    finally:
        _depth -= 1
        cls.__init__ = original
        if mapped:
            kinds = sorted({str(d).removeprefix("torch.") for d in mapped})
            logger.info("meshplan: traced %d torch.autocast('cuda') region%s (%s) as CPU autocast "
                        "for a GPU plan (the op lists agree on matmuls, convolutions and "
                        "attention; see meshplan/frontend/_autocast.py)", len(mapped),
                        "s" * (len(mapped) != 1), ", ".join(kinds))
