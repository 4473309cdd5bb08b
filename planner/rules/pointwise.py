"""Elementwise ops with broadcasting: unary math, binary and ternary arithmetic, activations and
their backward ops, copies, and the optimizer update ops (lerp, addcmul, addcdiv, sqrt...).

Sharding: output dim ``d`` may be split when every tensor operand either has the same size on
its aligned dim (it is split there too) or broadcasts along it (size 1 or a missing leading dim:
it stays replicated). Host scalars and literals are the same on every rank.

Partial values pass through an op only where the op is linear in them:

* ``P(sum)``: f(sum_r x_r) = sum_r f(x_r) needs f linear and without a constant term. ``a + b``
  with both partial is partial, ``a * b`` with ONE partial factor (the other replicated) is
  partial, ``neg``, ``x * 2``, ``x / r`` and the backward ops of activations (linear in the
  incoming gradient) keep it. ``x + 1`` or ``gelu(x)`` do not.
* ``P(avg)``: f(mean_r x_r) = mean_r f(x_r) holds for every affine f, so ``x + c`` and
  ``x + r`` (replicated ``r``) also keep an average.

Integer and boolean values never carry partials.
"""

from __future__ import annotations

from typing import Iterator

from ...ir import Ref
from ...ir._types import DTYPE_BYTES
from .._placement import P_AVG, Partial, R, Shard
from ._registry import OpInfo, OpStrategy
from ._util import PARTIALS, arg, is_float, literal_rule, out0, ref_slots

# A group: schema argument names that carry the same partial together (all other tensor
# operands must be replicated), and which partials may pass.
Group = tuple[tuple[str, ...], tuple[Partial, ...]]
BOTH, AVG = PARTIALS, (P_AVG,)


def _additive(*names: str) -> list[Group]:
    """Sum-like ops (``a + b``, ``lerp``): jointly linear; one partial term alone is affine."""
    return [(names, BOTH), *(((n,), AVG) for n in names)]


def _linear_in(*names: str) -> list[Group]:
    """Linear in each of ``names`` separately (the others replicated): ``a * b``, ``a / b``."""
    return [((n,), BOTH) for n in names]


LINEAR: dict[str, list[Group]] = {
    "aten.neg.default": _linear_in("self"),
    "aten.clone.default": _linear_in("self"),
    "aten.alias.default": _linear_in("self"),
    "aten.detach.default": _linear_in("self"),
    "aten.lift_fresh_copy.default": _linear_in("self"),
    "aten._to_copy.default": _linear_in("self"),
    "aten.copy.default": _linear_in("src"),
    "aten.mul.Scalar": _linear_in("self"),
    "aten.div.Scalar": _linear_in("self"),
    "aten.mul.Tensor": _linear_in("self", "other"),
    "aten.div.Tensor": _linear_in("self"),
    "aten.add.Tensor": _additive("self", "other"),
    "aten.sub.Tensor": _additive("self", "other"),
    "aten.add.Scalar": [(("self",), AVG)],
    "aten.sub.Scalar": [(("self",), AVG)],
    "aten.rsub.Scalar": [(("self",), AVG)],
    "aten.rsub.Tensor": _additive("self", "other"),
    "aten.lerp.Scalar": _additive("self", "end"),
    "aten.lerp.Tensor": _additive("self", "end"),
    "aten.addcmul.default": [(("self", "tensor1"), BOTH), (("self", "tensor2"), BOTH),
                             (("self",), AVG), (("tensor1",), AVG), (("tensor2",), AVG)],
    "aten.addcdiv.default": [(("self", "tensor1"), BOTH), (("self",), AVG), (("tensor1",), AVG)],
    "aten.where.self": _additive("self", "other"),
    "aten.gelu_backward.default": _linear_in("grad_output"),
    "aten.silu_backward.default": _linear_in("grad_output"),
    "aten.threshold_backward.default": _linear_in("grad_output"),
    "aten.sigmoid_backward.default": _linear_in("grad_output"),
    "aten.tanh_backward.default": _linear_in("grad_output"),
    "aten.hardtanh_backward.default": _linear_in("grad_output"),
    "aten.leaky_relu_backward.default": _linear_in("grad_output"),
    "aten.softplus_backward.default": _linear_in("grad_output"),
    "aten.hardswish_backward.default": _linear_in("grad_output"),
    "aten.hardsigmoid_backward.default": _linear_in("grad_output"),
    "aten.mish_backward.default": _linear_in("grad_output"),
    "aten.elu_backward.default": _linear_in("grad_output"),
}

_UNARY = (
    "abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "bitwise_not", "ceil", "cos",
    "cosh", "erf", "erfc", "erfinv", "exp", "exp2", "expm1", "floor", "frac", "gelu",
    "hardsigmoid", "hardswish", "isinf", "isnan", "lgamma", "log", "log10", "log1p", "log2",
    "logical_not", "mish", "reciprocal", "relu", "round", "rsqrt", "sigmoid", "sign", "sgn",
    "silu", "sin", "sinh", "sqrt", "square", "tan", "tanh", "trunc", "nan_to_num", "clamp",
    "clamp_min", "clamp_max", "maximum", "minimum", "fmax", "fmin", "logical_and",
    "logical_or", "logical_xor", "atan2",
    "hardtanh", "leaky_relu", "softplus", "elu", "relu6",
)
NONLINEAR: tuple[str, ...] = (
    *(f"aten.{u}.default" for u in _UNARY),
    "aten.clamp.Tensor", "aten.clamp_min.Tensor", "aten.clamp_max.Tensor", "aten.xlogy.Tensor",
    "aten.pow.Tensor_Scalar", "aten.pow.Tensor_Tensor", "aten.pow.Scalar",
    "aten.div.Tensor_mode", "aten.div.Scalar_mode", "aten.remainder.Tensor",
    "aten.remainder.Scalar", "aten.fmod.Tensor", "aten.fmod.Scalar", "aten.floor_divide.default",
    "aten.masked_fill.Scalar", "aten.masked_fill.Tensor", "aten.where.ScalarOther",
    "aten.where.ScalarSelf", "aten.where.Scalar",
    *(f"aten.{c}.{o}" for c in ("eq", "ne", "lt", "le", "gt", "ge", "bitwise_and", "bitwise_or",
                                "bitwise_xor") for o in ("Scalar", "Tensor")),
)


def shard_strategies(info: OpInfo) -> Iterator[OpStrategy]:
    """Split output dim ``d``: aligned operands of full size split too, broadcast ones stay R."""
    out = out0(info)
    nd = len(out.shape)
    for d, size in enumerate(out.shape):
        if size <= 1:
            continue
        ins = []
        for m in info.inputs:
            if m is None:
                ins.append(None)
                continue
            a = d - (nd - len(m.shape))
            ins.append(Shard(a) if a >= 0 and m.shape[a] == size else R)
        yield OpStrategy(tuple(ins), tuple(None if m is None else Shard(d)
                                           for m in info.outputs))


def partial_strategies(info: OpInfo, groups: list[Group]) -> Iterator[OpStrategy]:
    """One strategy per group and allowed partial: the group's tensors partial, others R."""
    if not all(m is None or is_float(m) for m in info.outputs):
        return
    slots = [name for name, _ in ref_slots(info.node)]
    for names, kinds in groups:
        members = [i for i, n in enumerate(slots) if n in names and info.inputs[i] is not None]
        if not members or not all(is_float(info.inputs[i]) for i in members):
            continue
        if len(names) > 1 and not all(_is_tensor_arg(info, n) for n in names):
            kinds = tuple(k for k in kinds if k == P_AVG)  # a constant term: affine only
        if info.node.target == "aten._to_copy.default" and not _widening_float_cast(info):
            continue      # a narrowing cast reduces first, in the wider dtype (_problem.reduce_wide)
        for p in kinds:
            ins = tuple(None if m is None else (p if i in members else R)
                        for i, m in enumerate(info.inputs))
            yield OpStrategy(ins, tuple(None if m is None else p for m in info.outputs))


def _is_tensor_arg(info: OpInfo, name: str) -> bool:
    v = arg(info.node, name)
    return isinstance(v, Ref) and any(
        n == name and m is not None for (n, _), m in zip(ref_slots(info.node), info.inputs))


def _widening_float_cast(info: OpInfo) -> bool:
    """A cast between float dtypes to as many bytes or more: partial sums may pass it."""
    a, b = info.inputs[0], info.outputs[0]
    return is_float(a) and is_float(b) and DTYPE_BYTES[b.dtype] >= DTYPE_BYTES[a.dtype]


@literal_rule(*LINEAR)
def linear_pointwise(info: OpInfo) -> Iterator[OpStrategy]:
    """Elementwise and linear in some operands: every shard split, plus partials by linearity."""
    yield from shard_strategies(info)
    yield from partial_strategies(info, LINEAR[info.node.target])


@literal_rule(*NONLINEAR)
def nonlinear_pointwise(info: OpInfo) -> Iterator[OpStrategy]:
    """Elementwise and nonlinear: shards only; a partial operand must be reduced first."""
    yield from shard_strategies(info)
