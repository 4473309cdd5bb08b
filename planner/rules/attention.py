"""Fused scaled-dot-product attention on CPU (``_scaled_dot_product_flash_attention_for_cpu``
and its backward). The math path traces to matmuls, softmax and pointwise ops, covered by their
families.

Inputs are ``[B, H, L, E]`` (query) and ``[B, H, S, E]`` (key, value): batch and heads are
independent, so dim 0 or dim 1 may split everywhere (outputs and ``logsumexp [B, H, L]``
follow; an attention mask splits where it is not broadcast). Without a causal mask the query
length (dim 2) may split too, with keys and values replicated; in the backward the key and value
gradients then sum over ranks. The backward is linear in the output gradient.
"""

from __future__ import annotations

from typing import Iterator

from .._placement import P_SUM, Placement, R, Shard
from ._registry import OpInfo, OpStrategy
from ._util import PARTIALS, arg, is_float, literal_rule, outs, strategy, tensor_in

_QKV = ("query", "key", "value")


def _mask(info: OpInfo, d: int) -> Placement:
    """The attn_mask's placement when query dim ``d`` splits (R where it broadcasts)."""
    q, m = tensor_in(info, "query"), tensor_in(info, "attn_mask")
    if m is None or q is None:
        return R
    a = d - (len(q.shape) - len(m.shape))
    return Shard(a) if a >= 0 and m.shape[a] == q.shape[d] else R


def _head_dims(info: OpInfo) -> list[int]:
    q, k, v = (tensor_in(info, n) for n in _QKV)
    assert q is not None and k is not None and v is not None
    return [d for d in (0, 1) if q.shape[d] > 1 and q.shape[d] == k.shape[d] == v.shape[d]]


def _query_split_ok(info: OpInfo) -> bool:
    q = tensor_in(info, "query")
    return (q is not None and q.shape[2] > 1 and not arg(info.node, "is_causal")
            and not arg(info.node, "dropout_p"))


@literal_rule("aten._scaled_dot_product_flash_attention_for_cpu.default")
def flash_cpu(info: OpInfo) -> Iterator[OpStrategy]:
    for d in _head_dims(info):
        s = Shard(d)
        yield strategy(info, {"query": s, "key": s, "value": s, "attn_mask": _mask(info, d)}, s)
    if _query_split_ok(info):
        s = Shard(2)
        yield strategy(info, {"query": s, "attn_mask": _mask(info, 2)}, s)


@literal_rule("aten._scaled_dot_product_flash_attention_for_cpu_backward.default")
def flash_cpu_backward(info: OpInfo) -> Iterator[OpStrategy]:
    for d in _head_dims(info):
        s = Shard(d)
        spec = {n: s for n in ("grad_out", *_QKV, "out", "logsumexp")}
        yield strategy(info, {**spec, "attn_mask": _mask(info, d)}, s)
    if _query_split_ok(info):
        s = Shard(2)
        spec = {n: s for n in ("grad_out", "query", "out", "logsumexp")}
        yield OpStrategy(strategy(info, {**spec, "attn_mask": _mask(info, 2)}, s).inputs,
                         outs(info, s, P_SUM, P_SUM))
    if is_float(tensor_in(info, "grad_out")):
        for p in PARTIALS:
            yield strategy(info, {"grad_out": p}, p)
