"""How the lowering calls a substituted kernel: one adapter per registry entry.

An adapter takes ``operands`` (operand name -> one value per match, in match order; a value is a
local tensor piece or a host scalar) and ``attrs`` (the matches' shared constants) and returns
result name -> one tensor per match. Kernels whose spec lists ``mutates`` update those operands
in place and return them as the results of the same name; the lowering hands them tensors it
may overwrite (``backends/_kernels.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor

__all__ = ["ADAPTERS"]

Operands = Mapping[str, Sequence[Any]]
Results = dict[str, list[Tensor]]


def _adamw(fn: Callable[..., None]) -> Callable[[Operands, Mapping[str, Any]], Results]:
    def call(ops: Operands, attrs: Mapping[str, Any]) -> Results:
        fn(ops["param"], ops["grad"], ops["exp_avg"], ops["exp_avg_sq"], ops["neg_step_size"],
           ops["bias_correction2_sqrt"], decay=attrs["decay"], lerp_weight=attrs["lerp_weight"],
           beta2=attrs["beta2"], addcmul_value=attrs["addcmul_value"], eps=attrs["eps"])
        return {"param": list(ops["param"]), "exp_avg": list(ops["exp_avg"]),
                "exp_avg_sq": list(ops["exp_avg_sq"])}
    return call


def _split(ops: Operands, mutated: tuple[str, ...]) -> tuple[list[int], list[int]]:
    """Members whose updated tensors are all contiguous (a kernel writes them through flat
    pointers) and the rest (strided views: the foreach ops update them in place)."""
    n = len(ops["param"])
    flat = [i for i in range(n) if all(ops[k][i].is_contiguous() for k in mutated if k in ops)]
    return flat, [i for i in range(n) if i not in flat]


def _pick(ops: Operands, members: list[int], contiguous: tuple[str, ...] = ()) -> dict:
    return {k: [(v[i].contiguous() if k in contiguous else v[i]) for i in members]
            for k, v in ops.items()}


def _adamw_triton(ops: Operands, attrs: Mapping[str, Any]) -> Results:
    from ._cpu_optim import adamw_foreach_
    from ._triton_optim import adamw_apply_
    flat, strided = _split(ops, ("param", "exp_avg", "exp_avg_sq"))
    if flat:
        _adamw(adamw_apply_)(_pick(ops, flat, contiguous=("grad",)), attrs)
    if strided:
        _adamw(adamw_foreach_)(_pick(ops, strided), attrs)
    return {k: list(ops[k]) for k in ("param", "exp_avg", "exp_avg_sq")}


def _adamw_numba(ops: Operands, attrs: Mapping[str, Any]) -> Results:
    from ._cpu_optim import adamw_fused_cpu_
    return _adamw(adamw_fused_cpu_)(ops, attrs)


def _adamw_foreach(ops: Operands, attrs: Mapping[str, Any]) -> Results:
    from ._cpu_optim import adamw_foreach_
    return _adamw(adamw_foreach_)(ops, attrs)


def _sgd_results(ops: Operands) -> Results:
    out = {"param": list(ops["param"])}
    if "momentum_buffer" in ops:
        out["momentum_buffer"] = list(ops["momentum_buffer"])
    return out


def _sgd_triton(ops: Operands, attrs: Mapping[str, Any]) -> Results:
    from ._triton_optim import sgd_step_
    flat, strided = _split(ops, ("param", "momentum_buffer"))
    if flat:
        part = _pick(ops, flat, contiguous=("grad",))
        bufs = part.get("momentum_buffer", [None] * len(flat))
        sgd_step_(part["param"], part["grad"], bufs, lr=attrs["lr"],
                  momentum=attrs["momentum"], dampening=attrs["dampening"])
    if strided:
        _sgd_foreach(_pick(ops, strided), attrs)
    return _sgd_results(ops)


def _sgd_foreach(ops: Operands, attrs: Mapping[str, Any]) -> Results:
    from ._cpu_optim import sgd_foreach_
    bufs = ops.get("momentum_buffer", [None] * len(ops["param"]))
    sgd_foreach_(ops["param"], ops["grad"], bufs, neg_lr=attrs["neg_lr"],
                 momentum=attrs["momentum"], grad_alpha=attrs["grad_alpha"])
    return _sgd_results(ops)


def _layer_norm(ops: Operands, attrs: Mapping[str, Any]) -> Results:
    """aten's ``native_layer_norm`` results: the output, and mean and rstd of shape
    ``input.shape[:-1] + (1,)`` in fp32 (what ``native_layer_norm_backward`` reads)."""
    from ._triton_norm import norm_forward
    out: Results = {"out": [], "mean": [], "rstd": []}
    for x, w, b in zip(ops["input"], ops["weight"], ops["bias"]):
        y, mean, rstd = norm_forward(x.contiguous(), w, b, float(attrs["eps"]), rms=False)
        stats = (*x.shape[:-1], 1)
        out["out"].append(y)
        out["mean"].append(mean.view(stats))
        out["rstd"].append(rstd.view(stats))
    return out


def _layer_norm_backward(ops: Operands, attrs: Mapping[str, Any]) -> Results:
    """aten's ``native_layer_norm_backward`` results (every one computed; the graph reads only
    those its ``output_mask`` asks for), weight and bias gradients in the weight's dtype."""
    from ._triton_norm import norm_backward
    out: Results = {"grad_input": [], "grad_weight": [], "grad_bias": []}
    for dy, x, mean, rstd, w in zip(ops["grad_out"], ops["input"], ops["mean"], ops["rstd"],
                                    ops["weight"]):
        dx, dw, db = norm_backward(dy, x.contiguous(), w, mean.reshape(-1).contiguous(),
                                   rstd.reshape(-1).contiguous(), rms=False)
        dtype = x.dtype if w is None else w.dtype
        out["grad_input"].append(dx)
        out["grad_weight"].append(dw.to(dtype))
        out["grad_bias"].append(db.to(dtype))
    return out


def _rms_norm(ops: Operands, attrs: Mapping[str, Any]) -> Results:
    """The decomposed RMSNorm's forward values: ``out``; ``rstd`` (the ``rsqrt``, shape
    ``x.shape[:-1] + (1,)``, in x's dtype as aten's); with a weight, ``normed`` = x * rstd (what
    the weight's gradient reads)."""
    from ._triton_norm import norm_forward
    out: Results = {"out": [], "rstd": [], "normed": []}
    for x, w in zip(ops["input"], ops["weight"]):
        y, _, rstd = norm_forward(x.contiguous(), w, None, float(attrs["eps"]), rms=True)
        rstd = rstd.view(*x.shape[:-1], 1).to(x.dtype)
        out["out"].append(y)
        out["rstd"].append(rstd)
        out["normed"].append(x * rstd if w is not None else y)
    return out


# registry name -> adapter
ADAPTERS: dict[str, Callable[[Operands, Mapping[str, Any]], Results]] = {
    "adamw": _adamw_triton,
    "adamw_cpu": _adamw_numba,
    "adamw_foreach": _adamw_foreach,
    "sgd": _sgd_triton,
    "sgd_foreach": _sgd_foreach,
    "layer_norm": _layer_norm,
    "layer_norm_backward": _layer_norm_backward,
    "rms_norm": _rms_norm,
}
