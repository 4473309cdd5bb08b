"""How the lowering calls a substituted kernel: one adapter per registry entry.

An adapter takes ``operands`` (operand name -> one value per match, in match order; a value is a
local tensor piece or a host scalar) and ``attrs`` (the matches' shared scalars: constants, or
host scalars of the step such as a hyperparameter, read when the call runs) and returns
result name -> one tensor per match. Kernels whose spec lists ``mutates`` update those operands
in place and return them as the results of the same name; the lowering hands them tensors it
may overwrite (``backends/_kernels.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
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
        sgd_step_(part["param"], part["grad"], bufs, lr=-attrs["neg_lr"],
                  momentum=attrs["momentum"], dampening=1.0 - attrs["grad_alpha"])
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


def _rms_norm_backward(ops: Operands, attrs: Mapping[str, Any]) -> Results:
    """The decomposed RMSNorm backward's input gradient (plus the residual stream's gradient
    when the match has one), from the forward's rstd (x's dtype, shape ``x.shape[:-1] + (1,)``,
    as the ``rsqrt`` node made it)."""
    from ._triton_norm import norm_backward
    out: Results = {"grad_input": []}
    for dy, x, w, rstd, res in zip(ops["grad_out"], ops["input"], ops["weight"], ops["rstd"],
                                   ops["residual"]):
        dx, _, _ = norm_backward(dy, x.contiguous(), w, None,
                                 rstd.reshape(-1).to(torch.float32).contiguous(), rms=True,
                                 weight_grads=False, residual=res)
        out["grad_input"].append(dx)
    return out


def _cross_entropy(ops: Operands, attrs: Mapping[str, Any]) -> Results:
    """``nll_loss_forward(_log_softmax(logits))``'s results, ``loss`` (the mean over the rows
    whose target is not ``ignore_index``, or their sum for ``reduction`` 2) and
    ``total_weight`` (their count), both 0-d in the logits' dtype as aten's, and the rows'
    log-sum-exp ``lse`` (float32, ``(N,)``) for the backward."""
    from ._triton_xent import loss_and_lse
    ignore = int(attrs["ignore_index"])
    mean = attrs.get("reduction", 1) == 1
    out: Results = {"loss": [], "total_weight": [], "lse": []}
    for logits, target in zip(ops["logits"], ops["target"]):
        loss, lse, count = loss_and_lse(logits.contiguous(), target, ignore_index=ignore,
                                        mean=mean)
        out["loss"].append(loss.to(logits.dtype))
        out["total_weight"].append(count.to(logits.dtype))
        out["lse"].append(lse)
    return out


def _cross_entropy_backward(ops: Operands, attrs: Mapping[str, Any]) -> Results:
    """``_log_softmax_backward_data(nll_loss_backward(...))``'s result: ``(softmax - onehot) *
    grad_loss / total_weight`` per row, zero where the target is ``ignore_index``."""
    from ._triton_xent import shard_grad
    out: Results = {"grad_logits": []}
    for dy, logits, target, total, lse in zip(ops["grad_loss"], ops["logits"], ops["target"],
                                              ops["total_weight"], ops["lse"]):
        scale = dy.to(torch.float32) / total.to(torch.float32)
        out["grad_logits"].append(shard_grad(logits.contiguous(), target, lse, scale,
                                             ignore_index=int(attrs["ignore_index"])))
    return out


def _swiglu(ops: Operands, attrs: Mapping[str, Any]) -> Results:
    """``silu(gate) * up``; the silu's slot gets an empty tensor (its only readers are the
    backward kernel's, which recomputes it)."""
    from ._triton_act import swiglu_forward
    out: Results = {"out": [], "silu": []}
    for gate, up in zip(ops["gate"], ops["up"]):
        out["out"].append(swiglu_forward(gate, up))
        out["silu"].append(gate.new_empty(0))
    return out


def _swiglu_backward(ops: Operands, attrs: Mapping[str, Any]) -> Results:
    from ._triton_act import swiglu_backward
    out: Results = {"grad_gate": [], "grad_up": []}
    for dy, gate, up in zip(ops["grad_out"], ops["gate"], ops["up"]):
        da, db = swiglu_backward(dy, gate, up)
        out["grad_gate"].append(da)
        out["grad_up"].append(db)
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
    "rms_norm_backward": _rms_norm_backward,
    "cross_entropy": _cross_entropy,
    "cross_entropy_backward": _cross_entropy_backward,
    "swiglu": _swiglu,
    "swiglu_backward": _swiglu_backward,
}
