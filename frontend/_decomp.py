"""Ops replaced while tracing, by ops that run the same CPU kernels (replay stays
bit-identical):

- ``aten.native_batch_norm`` updates ``running_mean`` and ``running_var`` in place in training
  mode although its schema does not say so; left in the graph it would be a hidden mutation.
  It becomes functional ops plus an explicit ``copy_`` that functionalisation turns into a
  state output.
- ``nll_loss`` with ``reduction="mean"`` (so ``F.cross_entropy``'s default) becomes the op with
  ``reduction="sum"`` divided by its ``total_weight`` (the count of targets not equal to
  ``ignore_index``, or the class weights' sum): aten's mean is that one division. Split over
  the batch, the sum and the count are sums of the pieces and the division takes the whole
  count, so the loss is the whole batch's mean however its ignored targets fall; a mean per
  piece averaged (DTensor's ``Partial(avg)``) is not, where the pieces count differently. The
  backward stays aten's, which already divides by the whole count.
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


_MEAN, _SUM = 1, 2


def _nll_loss_mean(op: Any) -> Callable[..., Any]:
    def mean_as_sum(x: torch.Tensor, target: torch.Tensor, weight: Any, reduction: int,
                    ignore_index: int) -> Any:
        if reduction != _MEAN:
            return NotImplemented          # traced as it is (the sum below, too)
        total, count = op(x, target, weight, _SUM, ignore_index)
        return total / count, count
    return mean_as_sum


DECOMPOSITIONS: dict[Any, Callable[..., Any]] = {
    aten.native_batch_norm.default: _native_batch_norm,
    aten.nll_loss_forward.default: _nll_loss_mean(aten.nll_loss_forward.default),
    aten.nll_loss2d_forward.default: _nll_loss_mean(aten.nll_loss2d_forward.default),
}
