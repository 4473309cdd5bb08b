"""Device twins of device-specific aten ops a traced graph may hold.

A step traced on the CPU records the CPU's choice of kernel for some ops: scaled dot-product
attention becomes ``_scaled_dot_product_flash_attention_for_cpu`` (and its ``_backward``), which
no other backend implements. A program lowered for another device runs these twins instead:
the same outputs (``output``, and ``logsumexp`` of shape (..., L) in float32, which the backward
reads) computed from plain matmuls and a softmax, in float32, on any device. They materialise the
(L, S) score matrix, so they suit the sequence lengths of tests and small models; tracing on the
target device (not done yet) would keep the device's own fused kernel.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .._errors import LoweringError

__all__ = ["DEVICE_TWINS"]


def _scores(q: Tensor, k: Tensor, is_causal: bool, attn_mask: Tensor | None,
            scale: float | None) -> tuple[Tensor, float]:
    s = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = (q.float() @ k.float().transpose(-2, -1)) * s
    if is_causal:
        L, S = scores.shape[-2:]
        keep = torch.ones(L, S, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask.float())
    return scores, s


def _no_dropout(dropout_p: float) -> None:
    if dropout_p:
        raise LoweringError(f"attention with dropout_p={dropout_p} traced on the CPU cannot run on "
                            "another device (its random stream is the CPU's); trace without "
                            "dropout or on the target device")


def sdpa_flash_for_cpu(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0,
                       is_causal: bool = False, *, attn_mask: Tensor | None = None,
                       scale: float | None = None) -> tuple[Tensor, Tensor]:
    _no_dropout(dropout_p)
    scores, _ = _scores(q, k, is_causal, attn_mask, scale)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.unsqueeze(-1))
    return (p @ v.float()).to(q.dtype), lse


def sdpa_flash_for_cpu_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                                lse: Tensor, dropout_p: float, is_causal: bool, *,
                                attn_mask: Tensor | None = None,
                                scale: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    _no_dropout(dropout_p)
    scores, s = _scores(q, k, is_causal, attn_mask, scale)
    p = torch.exp(scores - lse.float().unsqueeze(-1))
    do = grad_out.float()
    dv = p.transpose(-2, -1) @ do
    dp = do @ v.float().transpose(-2, -1)
    d = (do * out.float()).sum(-1, keepdim=True)
    ds = p * (dp - d)
    dq = (ds @ k.float()) * s
    dk = (ds.transpose(-2, -1) @ q.float()) * s
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# target -> the function a program for a non-CPU device calls instead
DEVICE_TWINS: dict[str, Any] = {
    "aten._scaled_dot_product_flash_attention_for_cpu.default": sdpa_flash_for_cpu,
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default":
        sdpa_flash_for_cpu_backward,
}
