"""Fused bias + GELU (erf and tanh forms) and SwiGLU, forward and backward, in Triton.

Elementwise kernels over the flattened tensor; math in float32, results in the input dtype.
``bias_gelu(x, bias, approximate)`` equals ``F.gelu(x + bias, approximate=approximate)``;
``swiglu(a, b)`` equals ``F.silu(a) * b``. Both are ``torch.autograd.Function``s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import KernelError, check_tensors

__all__ = ["bias_gelu", "swiglu", "swiglu_forward", "swiglu_backward", "BiasGelu", "SwiGLU"]

_BLOCK = 1024
_SQRT_2_OVER_PI = 0.7978845608028654
_INV_SQRT_2 = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327


@triton.jit
def _tanh(z):
    return 2.0 / (1.0 + tl.exp(-2.0 * z)) - 1.0


@triton.jit
def _bias_gelu_fwd(x_ptr, b_ptr, y_ptr, n, d, HAS_BIAS: tl.constexpr, TANH: tl.constexpr,
                   BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    z = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(b_ptr + offs % d, mask=mask, other=0.0).to(tl.float32)
    if TANH:
        y = 0.5 * z * (1.0 + _tanh(0.7978845608028654 * (z + 0.044715 * z * z * z)))
    else:
        y = 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd(dy_ptr, x_ptr, b_ptr, dx_ptr, n, d, HAS_BIAS: tl.constexpr,
                   TANH: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    z = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(b_ptr + offs % d, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if TANH:
        inner = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        t = _tanh(inner)
        dinner = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * z * z)
        g = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * dinner
    else:
        cdf = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476))
        pdf = 0.3989422804014327 * tl.exp(-0.5 * z * z)
        g = cdf + z * pdf
    tl.store(dx_ptr + offs, (dy * g).to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_fwd(a_ptr, b_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = a * tl.sigmoid(a) * b
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(dy_ptr, a_ptr, b_ptr, da_ptr, db_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(a)
    silu = a * s
    da = dy * b * s * (1.0 + a * (1.0 - s))
    tl.store(da_ptr + offs, da.to(da_ptr.dtype.element_ty), mask=mask)
    tl.store(db_ptr + offs, (dy * silu).to(db_ptr.dtype.element_ty), mask=mask)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, _BLOCK),)


def _approx(approximate: str) -> bool:
    if approximate not in ("none", "tanh"):
        raise KernelError(f"bias_gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return approximate == "tanh"


def bias_gelu_forward(x: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> torch.Tensor:
    tanh = _approx(approximate)
    check_tensors("bias_gelu", x, *(() if bias is None else (bias,)))
    if bias is not None and (bias.dim() != 1 or bias.numel() != x.shape[-1]):
        raise KernelError(f"bias_gelu: bias of shape {tuple(bias.shape)} does not match the last "
                          f"dim of x {tuple(x.shape)}; pass a 1-D bias of size {x.shape[-1]}")
    y = torch.empty_like(x)
    n, d = x.numel(), max(1, x.shape[-1] if x.dim() else 1)
    if n:
        _bias_gelu_fwd[_grid(n)](x, x if bias is None else bias, y, n, d, HAS_BIAS=bias is not None,
                                 TANH=tanh, BLOCK=_BLOCK)
    return y


def bias_gelu_backward(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None,
                       approximate: str) -> torch.Tensor:
    """Gradient wrt the pre-activation ``x + bias`` (= grad of x; grad of bias is its row sum)."""
    tanh = _approx(approximate)
    dy = dy.contiguous()
    dx = torch.empty_like(x)
    n, d = x.numel(), max(1, x.shape[-1] if x.dim() else 1)
    if n:
        _bias_gelu_bwd[_grid(n)](dy, x, x if bias is None else bias, dx, n, d,
                                 HAS_BIAS=bias is not None, TANH=tanh, BLOCK=_BLOCK)
    return dx


class BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, approximate):  # type: ignore[override]
        ctx.save_for_backward(x, bias)
        ctx.approximate = approximate
        return bias_gelu_forward(x, bias, approximate)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, bias = ctx.saved_tensors
        dx = bias_gelu_backward(dy, x, bias, ctx.approximate)
        dbias = None
        if bias is not None and ctx.needs_input_grad[1]:
            dbias = dx.reshape(-1, x.shape[-1]).sum(0, dtype=torch.float32).to(bias.dtype)
        return dx, dbias, None


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None = None,
              approximate: str = "none") -> torch.Tensor:
    """``F.gelu(x + bias, approximate=approximate)`` in one pass; differentiable."""
    return BiasGelu.apply(x, bias, approximate)


def swiglu_forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``F.silu(a) * b`` in one pass (no autograd)."""
    check_tensors("swiglu", a, b)
    if a.shape != b.shape:
        raise KernelError(f"swiglu: gate {tuple(a.shape)} and up {tuple(b.shape)} differ in "
                          "shape; split the fused projection with .chunk(2, -1) first")
    a, b = a.contiguous(), b.contiguous()
    y = torch.empty_like(a)
    if a.numel():
        _swiglu_fwd[_grid(a.numel())](a, b, y, a.numel(), BLOCK=_BLOCK)
    return y


def swiglu_backward(dy: torch.Tensor, a: torch.Tensor,
                    b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``F.silu(a) * b`` wrt the gate ``a`` and the up projection ``b``, in one
    pass from ``a`` and ``b`` (``silu(a)`` is recomputed, not read)."""
    a, b, dy = a.contiguous(), b.contiguous(), dy.contiguous()
    da, db = torch.empty_like(a), torch.empty_like(b)
    if a.numel():
        _swiglu_bwd[_grid(a.numel())](dy, a, b, da, db, a.numel(), BLOCK=_BLOCK)
    return da, db


class SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):  # type: ignore[override]
        y = swiglu_forward(a, b)
        ctx.save_for_backward(a, b)
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        return swiglu_backward(dy, *ctx.saved_tensors)


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``F.silu(a) * b`` (gate ``a``, up projection ``b``) in one pass; differentiable."""
    return SwiGLU.apply(a, b)
