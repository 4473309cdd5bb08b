"""Fused cross-entropy over a (possibly vocab-sharded) logits matrix, in Triton.

Never materialises the softmax: one program per row walks the vocabulary in ``CHUNK``-wide
chunks keeping an online max ``m`` and rescaled sum ``s = sum exp(x - m)`` (online logsumexp),
and picks up the target's logit when the target falls in this shard. A second kernel writes the
gradient ``(softmax(x) - onehot(target)) * dloss / n_valid`` chunk by chunk from the row's
logsumexp.

Vocab sharded over ``tp`` (shard ``k`` holds columns ``[start_k, start_k + V_k)``): each rank
runs :func:`shard_stats` on its shard with ``vocab_start=start_k`` and gets per-row
``(m_k, s_k, t_k)`` (``t_k`` = target logit, 0 when the target is elsewhere). The rows'
logsumexp and target logit are then ::

    M   = max_k m_k                        all_reduce(MAX)   of m
    S   = sum_k s_k * exp(m_k - M)         all_reduce(SUM)   of s * exp(m - M)
    lse = M + log(S);  t = sum_k t_k        all_reduce(SUM)   of t

:func:`combine_shard_stats` does exactly this in torch on stacked per-shard stats (the
lowering replaces the stacking by the three collectives). With the global ``lse`` each rank
runs :func:`shard_grad` on its own shard; no logits cross ranks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import KernelError, check_tensors

__all__ = ["cross_entropy", "CrossEntropy", "shard_stats", "combine_shard_stats", "shard_grad",
           "cross_entropy_fwd_bwd", "loss_and_lse"]

CHUNK = 256


@triton.jit
def _stats(x_ptr, tgt_ptr, m_ptr, s_ptr, t_ptr, v, vocab_start, ignore_index,
           CHUNK: tl.constexpr):
    row = tl.program_id(0)
    tgt = tl.load(tgt_ptr + row)
    local = tgt - vocab_start
    m = -float("inf")
    s = 0.0
    t = 0.0
    start = 0
    while start < v:  # a while loop: the interpreter cannot range() over a runtime bound
        cols = start + tl.arange(0, CHUNK)
        mask = cols < v
        x = tl.load(x_ptr + row.to(tl.int64) * v + cols, mask=mask,
                    other=-float("inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
        m = new_m
        t += tl.sum(tl.where((cols == local) & mask, x, 0.0), axis=0)
        start += CHUNK
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    tl.store(t_ptr + row, tl.where(tgt == ignore_index, 0.0, t))


@triton.jit
def _grad(x_ptr, tgt_ptr, lse_ptr, scale_ptr, dx_ptr, v, vocab_start, ignore_index,
          CHUNK: tl.constexpr):
    row = tl.program_id(0)
    tgt = tl.load(tgt_ptr + row)
    local = tgt - vocab_start
    lse = tl.load(lse_ptr + row)
    scale = tl.load(scale_ptr)
    scale = tl.where(tgt == ignore_index, 0.0, scale)
    start = 0
    while start < v:  # a while loop: the interpreter cannot range() over a runtime bound
        cols = start + tl.arange(0, CHUNK)
        mask = cols < v
        x = tl.load(x_ptr + row.to(tl.int64) * v + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - lse) - tl.where(cols == local, 1.0, 0.0)
        tl.store(dx_ptr + row.to(tl.int64) * v + cols, (p * scale).to(dx_ptr.dtype.element_ty),
                 mask=mask)
        start += CHUNK


def _check(logits: torch.Tensor, target: torch.Tensor) -> None:
    check_tensors("cross_entropy", logits)
    if logits.dim() != 2 or target.shape != logits.shape[:1] or target.dtype != torch.int64:
        raise KernelError(f"cross_entropy: want logits (N, V) and int64 targets (N,), got "
                          f"{tuple(logits.shape)} and {target.dtype}{tuple(target.shape)}; "
                          "flatten batch dims with .view(-1, V) first")


def shard_stats(logits: torch.Tensor, target: torch.Tensor, *, vocab_start: int = 0,
                ignore_index: int = -100, chunk: int = CHUNK):
    """Per-row ``(max, sumexp relative to max, target logit or 0)`` of one vocab shard, float32."""
    _check(logits, target)
    n, v = logits.shape
    m, s, t = (torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(3))
    if n:
        _stats[(n,)](logits, target.contiguous(), m, s, t, v, vocab_start, ignore_index,
                     CHUNK=chunk)
    return m, s, t


def combine_shard_stats(m: torch.Tensor, s: torch.Tensor, t: torch.Tensor):
    """Combine stacked per-shard stats ``(tp, N)`` into per-row ``(lse, target_logit)``."""
    big = m.max(0).values
    safe = torch.where(torch.isfinite(big), big, torch.zeros_like(big))
    lse = safe + torch.log((s * torch.exp(m - safe)).sum(0))
    return lse, t.sum(0)


def shard_grad(logits, target, lse, scale, *, vocab_start: int = 0, ignore_index: int = -100,
               chunk: int = CHUNK):
    """Gradient of ``scale * sum_rows(lse - target_logit)`` wrt one shard's logits
    (``scale`` a number or 0-d tensor, e.g. ``dloss / n_valid``, on any device: it is moved to
    the logits' device); ignored rows get zeros."""
    n, v = logits.shape
    dx = torch.empty_like(logits)
    scale = torch.as_tensor(scale, dtype=torch.float32).reshape(1).to(logits.device)
    if n:
        _grad[(n,)](logits, target.contiguous(), lse.contiguous(), scale, dx, v, vocab_start,
                    ignore_index, CHUNK=chunk)
    return dx


def loss_and_lse(logits, target, ignore_index: int = -100, chunk: int = CHUNK,
                 mean: bool = True):
    """Mean cross-entropy over the rows whose target is not ``ignore_index`` (float32, 0-d;
    ``mean=False``: their sum), each row's log-sum-exp (float32, ``(N,)``) and the count of
    those rows (float32, 0-d)."""
    m, s, t = shard_stats(logits, target, ignore_index=ignore_index, chunk=chunk)
    lse, tl_ = combine_shard_stats(m[None], s[None], t[None])
    valid = target != ignore_index
    n_valid = valid.sum().to(torch.float32)
    loss = torch.where(valid, lse - tl_, torch.zeros_like(lse)).sum()
    return (loss / n_valid if mean else loss), lse, n_valid


class CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, chunk):  # type: ignore[override]
        loss, lse, n_valid = loss_and_lse(logits, target, ignore_index, chunk)
        ctx.save_for_backward(logits, target, lse, n_valid)
        ctx.ignore_index, ctx.chunk = ignore_index, chunk
        return loss.to(logits.dtype)

    @staticmethod
    def backward(ctx, dloss):  # type: ignore[override]
        logits, target, lse, n_valid = ctx.saved_tensors
        scale = dloss.to(torch.float32) / n_valid
        dx = shard_grad(logits, target, lse, scale, ignore_index=ctx.ignore_index, chunk=ctx.chunk)
        return dx, None, None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                  chunk: int = CHUNK) -> torch.Tensor:
    """``F.cross_entropy(logits, target, ignore_index=ignore_index)`` (mean over non-ignored
    rows) without materialising the softmax; differentiable wrt ``logits``."""
    return CrossEntropy.apply(logits, target, ignore_index, chunk)


def cross_entropy_fwd_bwd(logits, target, ignore_index: int = -100, chunk: int = CHUNK):
    """Loss and its gradient wrt ``logits`` (for ``dloss = 1``) in one call, no autograd."""
    loss, lse, n_valid = loss_and_lse(logits, target, ignore_index, chunk)
    dx = shard_grad(logits, target, lse, 1.0 / n_valid, ignore_index=ignore_index, chunk=chunk)
    return loss, dx
