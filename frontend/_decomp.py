"""Ops whose schemas hide a mutation, replaced while tracing by functional ops plus an explicit
``copy_`` that functionalisation turns into a state output.

``aten.native_batch_norm`` updates ``running_mean`` and ``running_var`` in place in training
mode although its schema does not say so; left in the graph it would be a hidden mutation.
The replacements run the same CPU kernels, so replay stays bit-identical.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

aten = torch.ops.aten


def _native_batch_norm(x: torch.Tensor, weight: Any, bias: Any, running_mean: Any,
                       running_var: Any, training: bool, momentum: float,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if training and running_mean is not None and running_var is not None:
        out, mean, rstd, new_mean, new_var = aten._native_batch_norm_legit_functional.default(
            x, weight, bias, running_mean, running_var, training, momentum, eps)
        running_mean.copy_(new_mean)
        running_var.copy_(new_var)
        return out, mean, rstd
    if running_mean is not None and running_var is not None:
        return aten._native_batch_norm_legit_no_training.default(
            x, weight, bias, running_mean, running_var, momentum, eps)
    return aten._native_batch_norm_legit.no_stats(x, weight, bias, training, momentum, eps)


DECOMPOSITIONS: dict[Any, Callable[..., Any]] = {
    aten.native_batch_norm.default: _native_batch_norm,
}
