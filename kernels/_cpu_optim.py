"""Optimizer updates for the CPU path, in place over a rank's local shards.

The traced step holds an optimizer update as ~8 functional aten ops per parameter (AdamW:
``mul, lerp, mul, addcmul, sqrt, div, add, addcdiv``), each of which allocates and writes a
new tensor. The lowering replaces them (``kernels/_patterns.py`` finds them) by one call here:

- ``adamw_fused_cpu_`` (numba): one pass over each shard, reading param, grad, exp_avg and
  exp_avg_sq once and writing param, exp_avg and exp_avg_sq once, in float32 arithmetic.
  Measured on this 2-core VM on the GPT of ``benchmarks/step_time.py`` (52 tensors, 3.7M
  parameters): ~5.6 ms against ~24 ms for the op chain (single runs; ``benchmarks/README.md``,
  "Kernels").
- ``adamw_foreach_`` / ``sgd_foreach_`` (torch): the same ops as the traced graph, in the same
  order, as in-place ``torch._foreach_*`` calls, so the results are bit-identical to running the
  graph op by op; they only save the allocations. Used where numba is missing, for half
  precision, and for non-contiguous shards.

Every function takes the graph's own constants (the ``lerp`` weight, the ``addcmul`` value,
...) and the per-shard host scalars the traced step computed (``neg_step_size``,
``bias_correction2_sqrt``), so nothing is re-derived from ``lr`` or the step count.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

from ._common import KernelError, same_lengths

__all__ = ["adamw_foreach_", "adamw_fused_cpu_", "sgd_foreach_"]


def adamw_foreach_(params: Sequence[Tensor], grads: Sequence[Tensor],
                   exp_avgs: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor],
                   neg_step_sizes: Sequence[float], bc2_sqrts: Sequence[float], *,
                   decay: float, lerp_weight: float, beta2: float, addcmul_value: float,
                   eps: float) -> None:
    """AdamW in place, op for op the traced graph's: ``p *= decay`` (skipped when 1.0),
    ``m.lerp_(g, lerp_weight)``, ``v *= beta2``, ``v.addcmul_(g, g, addcmul_value)``,
    ``d = sqrt(v) / bc2_sqrt + eps``, ``p.addcdiv_(m, d, neg_step_size)``."""
    same_lengths("adamw_foreach_", params=params, grads=grads, exp_avgs=exp_avgs,
                 exp_avg_sqs=exp_avg_sqs, neg_step_sizes=neg_step_sizes, bc2_sqrts=bc2_sqrts)
    if not params:
        return
    params, grads, exp_avgs, exp_avg_sqs = map(list, (params, grads, exp_avgs, exp_avg_sqs))
    if decay != 1.0:
        torch._foreach_mul_(params, decay)
    torch._foreach_lerp_(exp_avgs, grads, lerp_weight)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=addcmul_value)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, [float(b) for b in bc2_sqrts])
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, [float(s) for s in neg_step_sizes])


def sgd_foreach_(params: Sequence[Tensor], grads: Sequence[Tensor],
                 bufs: Sequence[Tensor | None], *, neg_lr: float, momentum: float,
                 grad_alpha: float) -> None:
    """SGD in place as the traced graph computes it: ``buf = buf * momentum + grad_alpha * g``
    (``grad_alpha`` = 1 - dampening) then ``p += neg_lr * buf``; without buffers
    ``p += neg_lr * g``."""
    same_lengths("sgd_foreach_", params=params, grads=grads, bufs=bufs)
    if not params:
        return
    params, grads = list(params), list(grads)
    if all(b is None for b in bufs):
        torch._foreach_add_(params, grads, alpha=neg_lr)
        return
    if any(b is None for b in bufs):
        raise KernelError("sgd_foreach_: give every shard a momentum buffer or none")
    bufs = list(bufs)
    torch._foreach_mul_(bufs, momentum)
    torch._foreach_add_(bufs, grads, alpha=grad_alpha)
    torch._foreach_add_(params, bufs, alpha=neg_lr)


@functools.cache
def _numba_kernel():
    import numba
    import numpy as np

    # Scalars arrive as numpy scalars of the arrays' dtype, so float32 shards compute in
    # float32 (a Python float would promote every product to float64).
    @numba.njit(cache=True, nogil=True, error_model="numpy")  # no zero-division checks: vectorises
    def adamw(p, g, m, v, decay, w, one_minus_w, low_w, beta2, value, inv_bc2, eps,
              step):  # pragma: no cover
        for i in range(p.shape[0]):
            gi = g[i]
            mi = m[i]
            if low_w:                        # torch's lerp: exact at both ends
                mi = mi + w * (gi - mi)
            else:
                mi = gi - (gi - mi) * one_minus_w
            vi = v[i] * beta2 + value * gi * gi
            d = np.sqrt(vi) * inv_bc2 + eps
            p[i] = p[i] * decay + step * (mi / d)
            m[i] = mi
            v[i] = vi

    return adamw


def adamw_fused_cpu_(params: Sequence[Tensor], grads: Sequence[Tensor],
                     exp_avgs: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor],
                     neg_step_sizes: Sequence[float], bc2_sqrts: Sequence[float], *,
                     decay: float, lerp_weight: float, beta2: float, addcmul_value: float,
                     eps: float) -> None:
    """AdamW in place, one pass per shard (numba, float32/float64 CPU shards whose param and
    moments are contiguous; a strided gradient is copied once); other shards go through
    :func:`adamw_foreach_`. Same arguments. The arithmetic is the
    graph's in the shard's dtype except that the division by ``bc2_sqrt`` is a multiplication
    by its reciprocal (as torch's CPU division by a scalar is), so results agree with the op
    chain to a few ulps (not bit for bit)."""
    same_lengths("adamw_fused_cpu_", params=params, grads=grads, exp_avgs=exp_avgs,
                 exp_avg_sqs=exp_avg_sqs, neg_step_sizes=neg_step_sizes, bc2_sqrts=bc2_sqrts)
    kernel = _numba_kernel()
    rest: list[int] = []
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        ts = (p, g, m, v)
        if (p.device.type != "cpu" or p.dtype not in (torch.float32, torch.float64)
                or any(t.dtype != p.dtype or t.shape != p.shape for t in ts)
                or not all(t.is_contiguous() for t in (p, m, v))):
            rest.append(i)          # the updated tensors are written through flat views
            continue
        if not g.is_contiguous():   # a transposed weight gradient: read through one copy
            g = g.contiguous()
            ts = (p, g, m, v)
        if p.numel():
            a, b, c, d = (t.view(-1).numpy(force=t.requires_grad) for t in ts)
            cast = a.dtype.type          # numpy float32 / float64
            kernel(a, b, c, d, cast(decay), cast(lerp_weight), cast(1.0 - lerp_weight),
                   lerp_weight < 0.5, cast(beta2), cast(addcmul_value),
                   cast(1.0 / float(bc2_sqrts[i])), cast(eps), cast(neg_step_sizes[i]))
    if rest:
        pick = lambda xs: [xs[i] for i in rest]  # noqa: E731
        adamw_foreach_(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs),
                       pick(neg_step_sizes), pick(bc2_sqrts), decay=decay,
                       lerp_weight=lerp_weight, beta2=beta2, addcmul_value=addcmul_value,
                       eps=eps)
