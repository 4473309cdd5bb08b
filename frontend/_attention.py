"""``nn.MultiheadAttention`` traced batch-major: the same math, with every reshape keeping the
batch outermost, so that data parallelism and micro-batches split it.

``F.multi_head_attention_forward`` works in the ``(sequence, batch, features)`` layout: its
input projection runs on ``(sequence x batch, features)`` and its output projection on the
same merge. A piece of the batch is no contiguous piece of that merged dim (it is every
``batch``-th row), which no placement in meshplan's vocabulary describes (DTensor calls it a
strided shard), so the plan replicated the attention and micro-batches refused it. While
meshplan traces a step, ``batch_major_attention`` replaces that function with
``multi_head_attention_forward`` below: the inputs turned to ``(batch, sequence, features)``
(a transpose, no copy where ``batch_first=True``), the projections on ``(batch x sequence,
features)``, the heads as ``(batch, heads, sequence, head_dim)``, the output turned back.
Every op is the one torch runs (the same linears, the same ``scaled_dot_product_attention``
or ``baddbmm``/``softmax``/``bmm``, the same masks and dropout); only the order of the rows
in the projections' matmuls differs, which changes no row's value.

The options it does not rewrite (unbatched inputs, ``static_k``/``static_v``, ``bias_k`` /
``bias_v``, ``add_zero_attn``) run torch's own function, traced as it is. The user's program
outside ``meshplan.trace`` is untouched.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

_TORCH_MHA = F.multi_head_attention_forward
_HELPERS = ("_mha_shape_check", "_canonical_mask", "_none_or_dtype")


@contextlib.contextmanager
def batch_major_attention() -> Iterator[None]:
    """While tracing: ``F.multi_head_attention_forward`` is the batch-major one (module
    docstring). Left as it is where this torch lacks the private helpers it reuses."""
    if not all(hasattr(F, h) for h in _HELPERS):
        yield
        return
    saved = F.multi_head_attention_forward
    F.multi_head_attention_forward = multi_head_attention_forward
    try:
        yield
    finally:
        F.multi_head_attention_forward = saved


def multi_head_attention_forward(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, embed_dim_to_check: int,
        num_heads: int, in_proj_weight: torch.Tensor | None, in_proj_bias: torch.Tensor | None,
        bias_k: torch.Tensor | None, bias_v: torch.Tensor | None, add_zero_attn: bool,
        dropout_p: float, out_proj_weight: torch.Tensor, out_proj_bias: torch.Tensor | None,
        training: bool = True, key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True, attn_mask: torch.Tensor | None = None,
        use_separate_proj_weight: bool = False, q_proj_weight: torch.Tensor | None = None,
        k_proj_weight: torch.Tensor | None = None, v_proj_weight: torch.Tensor | None = None,
        static_k: torch.Tensor | None = None, static_v: torch.Tensor | None = None,
        average_attn_weights: bool = True, is_causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``F.multi_head_attention_forward``'s signature and results (module docstring)."""
    if (query.dim() != 3 or static_k is not None or static_v is not None
            or bias_k is not None or bias_v is not None or add_zero_attn):
        return _TORCH_MHA(
            query, key, value, embed_dim_to_check, num_heads, in_proj_weight, in_proj_bias,
            bias_k, bias_v, add_zero_attn, dropout_p, out_proj_weight, out_proj_bias,
            training=training, key_padding_mask=key_padding_mask, need_weights=need_weights,
            attn_mask=attn_mask, use_separate_proj_weight=use_separate_proj_weight,
            q_proj_weight=q_proj_weight, k_proj_weight=k_proj_weight,
            v_proj_weight=v_proj_weight, static_k=static_k, static_v=static_v,
            average_attn_weights=average_attn_weights, is_causal=is_causal)
    # torch's checks and mask canonicalisation, as it runs them
    F._mha_shape_check(query, key, value, key_padding_mask, attn_mask, num_heads)
    tgt_len, bsz, embed_dim = query.shape
    src_len = key.shape[0]
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask, mask_name="key_padding_mask",
        other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
        target_type=query.dtype)
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the "
                           "Transformer module method `generate_square_subsequent_mask` to "
                           "create this mask.")
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None
    else:
        attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None,
                                      other_name="", target_type=query.dtype,
                                      check_other=False)
        if key_padding_mask is not None:
            is_causal = False
    if embed_dim != embed_dim_to_check:
        raise AssertionError(f"was expecting embedding dimension of {embed_dim_to_check}, "
                             f"but got {embed_dim}")
    head_dim = embed_dim // num_heads
    if head_dim * num_heads != embed_dim:
        raise AssertionError(f"embed_dim {embed_dim} not divisible by num_heads {num_heads}")
    if use_separate_proj_weight:
        if key.shape[:2] != value.shape[:2]:
            raise AssertionError(f"key's sequence and batch dims {key.shape[:2]} do not match "
                                 f"value's {value.shape[:2]}")
    elif key.shape != value.shape:
        raise AssertionError(f"key shape {key.shape} does not match value shape {value.shape}")

    q, k, v = _projections(query, key, value, embed_dim, in_proj_weight, in_proj_bias,
                           use_separate_proj_weight, q_proj_weight, k_proj_weight,
                           v_proj_weight)

    def heads(t: torch.Tensor) -> torch.Tensor:   # (batch, seq, E) -> (batch, heads, seq, hd)
        return t.unflatten(-1, (num_heads, head_dim)).transpose(1, 2)

    q, k, v = heads(q), heads(k), heads(v)
    if attn_mask is not None:
        if attn_mask.dim() == 2:
            if attn_mask.shape != (tgt_len, src_len):
                raise RuntimeError(f"The shape of the 2D attn_mask is {attn_mask.shape}, but "
                                   f"should be {(tgt_len, src_len)}.")
            attn_mask = attn_mask.unsqueeze(0)
        elif attn_mask.dim() == 3:
            if attn_mask.shape != (bsz * num_heads, tgt_len, src_len):
                raise RuntimeError(f"The shape of the 3D attn_mask is {attn_mask.shape}, but "
                                   f"should be {(bsz * num_heads, tgt_len, src_len)}.")
        else:
            raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")
    if key_padding_mask is not None:
        if key_padding_mask.shape != (bsz, src_len):
            raise AssertionError(f"expecting key_padding_mask shape of {(bsz, src_len)}, but "
                                 f"got {key_padding_mask.shape}")
        key_padding_mask = (key_padding_mask.view(bsz, 1, 1, src_len)
                            .expand(-1, num_heads, -1, -1).reshape(bsz * num_heads, 1, src_len))
        attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
    if not training:
        dropout_p = 0.0

    if need_weights:
        # torch's (batch x heads, seq, hd) merge keeps the batch outermost already
        q = q.reshape(bsz * num_heads, tgt_len, head_dim)
        k = k.reshape(bsz * num_heads, src_len, head_dim)
        v = v.reshape(bsz * num_heads, src_len, head_dim)
        if is_causal and attn_mask is None:
            raise AssertionError("FIXME: is_causal not implemented for need_weights")
        q_scaled = q * math.sqrt(1.0 / float(head_dim))
        weights = (torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1))
                   if attn_mask is not None else torch.bmm(q_scaled, k.transpose(-2, -1)))
        weights = F.softmax(weights, dim=-1)
        if dropout_p > 0.0:
            weights = F.dropout(weights, p=dropout_p)
        out = torch.bmm(weights, v).view(bsz, num_heads, tgt_len, head_dim)
        weights = weights.view(bsz, num_heads, tgt_len, src_len)
        if average_attn_weights:
            weights = weights.mean(dim=1)
    else:
        if attn_mask is not None:
            if attn_mask.size(0) == 1 and attn_mask.dim() == 3:
                attn_mask = attn_mask.unsqueeze(0)
            else:
                attn_mask = attn_mask.view(bsz, num_heads, -1, src_len)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
        weights = None
    out = out.transpose(1, 2).reshape(bsz, tgt_len, embed_dim)
    out = F.linear(out, out_proj_weight, out_proj_bias)
    return out.transpose(0, 1), weights


def _projections(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, e: int,
                 w: Any, b: Any, separate: bool, w_q: Any, w_k: Any,
                 w_v: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v projected, each ``(batch, seq, E)``: torch's ``_in_projection_packed`` /
    ``_in_projection`` (the same weight slices, one linear for a shared input) on the inputs
    turned batch-major."""
    xq = query.transpose(0, 1)
    xk = xq if key is query else key.transpose(0, 1)
    xv = xk if value is key else value.transpose(0, 1)
    if separate:
        b_q, b_k, b_v = (None, None, None) if b is None else b.chunk(3)
        return F.linear(xq, w_q, b_q), F.linear(xk, w_k, b_k), F.linear(xv, w_v, b_v)
    if xk is xv:
        if xq is xk:
            proj = F.linear(xq, w, b).unflatten(-1, (3, e))
            return proj[..., 0, :], proj[..., 1, :], proj[..., 2, :]
        w_q, w_kv = w.split([e, e * 2])
        b_q, b_kv = (None, None) if b is None else b.split([e, e * 2])
        kv = F.linear(xk, w_kv, b_kv).unflatten(-1, (2, e))
        return F.linear(xq, w_q, b_q), kv[..., 0, :], kv[..., 1, :]
    w_q, w_k, w_v = w.chunk(3)
    b_q, b_k, b_v = (None, None, None) if b is None else b.chunk(3)
    return F.linear(xq, w_q, b_q), F.linear(xk, w_k, b_k), F.linear(xv, w_v, b_v)
