"""LayerNorm and RMSNorm over the last dim, forward and backward, in Triton.

One program per row (the whole row in one block, ``BLOCK = next_pow2(D)``); statistics in float32.
Backward writes ``dx`` per row and per-program partial sums of ``dweight``/``dbias`` over
``ROWS`` rows, which torch then sums (float32) - no N x D temporary.
``layer_norm(x, w, b, eps)`` equals ``F.layer_norm(x, (D,), w, b, eps)``;
``rms_norm(x, w, eps)`` equals ``F.rms_norm(x, (D,), w, eps)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import KernelError, check_tensors, next_pow2

__all__ = ["layer_norm", "rms_norm", "LayerNorm", "RMSNorm"]

_ROWS = 16  # rows per program in backward (partial dweight/dbias per program)


@triton.jit
def _norm_fwd(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, d, eps, RMS: tl.constexpr,
              HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    x = tl.load(x_ptr + row * d + cols, mask=mask, other=0.0).to(tl.float32)
    if RMS:
        mean = 0.0
        xc = x
    else:
        mean = tl.sum(x, axis=0) / d
        xc = tl.where(mask, x - mean, 0.0)
    var = tl.sum(xc * xc, axis=0) / d
    rstd = 1.0 / tl.sqrt(var + eps)
    y = xc * rstd
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * d + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _norm_bwd(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, res_ptr, dx_ptr, dw_ptr, db_ptr, n, d,
              RMS: tl.constexpr, HAS_W: tl.constexpr, WB_GRADS: tl.constexpr,
              HAS_RES: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        w = tl.where(mask, 1.0, 0.0)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    db = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(ROWS):
        row = pid * ROWS + i
        if row < n:
            x = tl.load(x_ptr + row * d + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * d + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            if RMS:
                xhat = tl.where(mask, x * rstd, 0.0)
            else:
                xhat = tl.where(mask, (x - tl.load(mean_ptr + row)) * rstd, 0.0)
            wdy = w * dy
            c1 = tl.sum(xhat * wdy, axis=0) / d
            if RMS:
                dx = (wdy - xhat * c1) * rstd
            else:
                c2 = tl.sum(wdy, axis=0) / d
                dx = (wdy - (xhat * c1 + c2)) * rstd
            if HAS_RES:                 # a residual branch's gradient, added in the pass
                dx += tl.load(res_ptr + row * d + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_ptr + row * d + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if WB_GRADS:
                dw += dy * xhat
                db += dy
    if WB_GRADS:
        tl.store(dw_ptr + pid * d + cols, dw, mask=mask)
        tl.store(db_ptr + pid * d + cols, db, mask=mask)


def _check(op: str, x: torch.Tensor, *params: torch.Tensor | None) -> int:
    check_tensors(op, x, *(p for p in params if p is not None))
    d = x.shape[-1] if x.dim() else 0
    for p in params:
        if p is not None and tuple(p.shape) != (d,):
            raise KernelError(f"{op}: weight/bias of shape {tuple(p.shape)} must be ({d},), the "
                              f"last dim of x {tuple(x.shape)}; only last-dim norms are fused")
    return d


def norm_forward(x, weight, bias, eps, rms):
    d = _check("rms_norm" if rms else "layer_norm", x, weight, bias)
    n = x.numel() // d if d else 0
    y = torch.empty_like(x)
    mean = torch.empty(n, dtype=torch.float32, device=x.device)
    rstd = torch.empty(n, dtype=torch.float32, device=x.device)
    if n:
        _norm_fwd[(n,)](x, x if weight is None else weight, x if bias is None else bias, y, mean,
                        rstd, d, eps, RMS=rms, HAS_W=weight is not None, HAS_B=bias is not None,
                        BLOCK=next_pow2(d))
    return y, mean, rstd


def norm_backward(dy, x, weight, mean, rstd, rms, weight_grads=True, residual=None):
    """``(dx, dweight, dbias)`` from the forward's per-row ``mean`` and ``rstd`` (float32,
    ``(N,)``; ``mean`` is not read for RMSNorm and may be None). ``weight_grads=False``
    computes ``dx`` alone and returns None for the other two; ``residual`` (x's shape) is
    added to ``dx`` in the same pass (a residual stream's gradient)."""
    d = x.shape[-1]
    n = x.numel() // d if d else 0
    dx = torch.empty_like(x)
    progs = triton.cdiv(n, _ROWS)
    shape = (max(progs, 1), d) if weight_grads else (1, 1)
    dw = torch.empty(shape, dtype=torch.float32, device=x.device)
    db = torch.empty_like(dw)
    if n:
        _norm_bwd[(progs,)](dy.contiguous(), x, x if weight is None else weight,
                            rstd if mean is None else mean, rstd,
                            dx if residual is None else residual.contiguous(), dx, dw, db, n, d,
                            RMS=rms, HAS_W=weight is not None, WB_GRADS=weight_grads,
                            HAS_RES=residual is not None, ROWS=_ROWS, BLOCK=next_pow2(d))
    else:
        dw.zero_(), db.zero_()
    if not weight_grads:
        return dx, None, None
    return dx, dw.sum(0), db.sum(0)


class LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):  # type: ignore[override]
        y, mean, rstd = norm_forward(x, weight, bias, eps, rms=False)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dw, db = norm_backward(dy, x, weight, mean, rstd, rms=False)
        return (dx, None if weight is None else dw.to(weight.dtype),
                None if bias is None else db.to(bias.dtype), None)


class RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):  # type: ignore[override]
        y, mean, rstd = norm_forward(x, weight, None, eps, rms=True)
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, _ = norm_backward(dy, x, weight, mean, rstd, rms=True)
        return dx, None if weight is None else dw.to(weight.dtype), None


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm(x, (x.shape[-1],), weight, bias, eps)``; differentiable."""
    return LayerNorm.apply(x, weight, bias, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """``F.rms_norm(x, (x.shape[-1],), weight, eps)``; differentiable."""
    return RMSNorm.apply(x, weight, eps)
