"""Mixed precision as a plan option: FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`` for a step written in fp32.

``distribute(..., precision="bf16")`` (or ``compile``, ``meshplan compile --precision``) traces
the step with:

* every floating-point parameter used through a 16-bit copy made at the start of the step
  (``p.to(bfloat16)``): the forward and backward compute in 16 bits, while the parameters, their
  gradients and the optimizer state stay fp32 (master weights);
* the floating-point tensor arguments of the step's modules (the ones the step names and that
  hold parameters, as ``fully_shard``'s ``cast_forward_inputs`` does for the root; not a loss
  module's) cast to 16 bits on the way in;
  outputs are left as the model makes them (FSDP2's ``output_dtype=None``);
* gradients reduced in fp32: a 16-bit gradient is cast back to the fp32 parameter's dtype, and
  the planner sums partial gradients only after that cast (``planner/_problem.reduce_wide``).

Equal to the same policy written by hand in eager PyTorch (``tests/unit/test_precision.py``).
Buffers keep their dtype, as FSDP2 leaves them; an op inside the model that mixes a 16-bit
activation with an fp32 buffer follows torch's type promotion, as it would under FSDP2.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from .._errors import TraceError

__all__ = ["POLICIES", "applied", "check", "compute_copies", "inputs_cast", "policy", "precision"]

POLICIES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
_POLICY: contextvars.ContextVar[torch.dtype | None] = contextvars.ContextVar(
    "meshplan_precision", default=None)


def check(name: str | None) -> torch.dtype | None:
    """The compute dtype of policy ``name`` (None or ``"fp32"``: no policy)."""
    if name is None or name == "fp32":
        return None
    if name not in POLICIES:
        raise TraceError(f"precision={name!r}: expected one of {['fp32', *POLICIES]} (bf16: "
                         "16-bit compute copies of fp32 parameters, fp32 gradient reductions)")
    return POLICIES[name]


def precision(name: str | None) -> contextlib.AbstractContextManager[None]:
    """Steps traced inside (``meshplan.trace``) use policy ``name`` whenever they trace."""
    return applied(check(name))


@contextlib.contextmanager
def applied(dtype: torch.dtype | None) -> Iterator[None]:
    """Trace with the compute dtype ``dtype`` (a TracedStep's own, set when it was made)."""
    token = _POLICY.set(dtype)
    try:
        yield
    finally:
        _POLICY.reset(token)


def policy() -> torch.dtype | None:
    """The compute dtype ``precision`` set here (None: the step as written)."""
    return _POLICY.get()


def compute_copies(params: Sequence[torch.Tensor], dtype: torch.dtype | None) -> list[torch.Tensor]:
    """What the modules use in place of ``params`` (inside the traced function): a ``dtype``
    copy of each floating-point parameter, the parameter itself otherwise."""
    if dtype is None:
        return list(params)
    return [p.to(dtype) if p.is_floating_point() and p.dtype != dtype else p for p in params]


@contextlib.contextmanager
def inputs_cast(roots: Sequence[tuple[str, nn.Module]], dtype: torch.dtype | None) -> Iterator[None]:
    """Cast the floating-point tensor arguments of the step's modules to ``dtype`` on entry."""
    if dtype is None:
        yield
        return

    def cast(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return pytree.tree_map(cast, args), pytree.tree_map(cast, kwargs)

    # modules with parameters only: a loss module (``nn.MSELoss()``) gets its target as written
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for _, m in roots
               if isinstance(m, nn.Module)
               and any(p.is_floating_point() for p in m.parameters())]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
