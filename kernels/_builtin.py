"""The built-in kernels, registered when ``meshplan.kernels`` is imported."""

from __future__ import annotations

from ..ir import Graph
from ._patterns import (
    match_adamw, match_bias_gelu, match_cross_entropy, match_cross_entropy_backward,
    match_grad_buckets, match_layer_norm,
    match_layer_norm_backward, match_rms_norm, match_rms_norm_backward, match_sgd, match_swiglu, match_swiglu_backward,
)
from ._registry import Backend, Device, KernelSpec, Match, register_kernel

__all__ = ["BUILTIN_KERNELS"]

_GPU = frozenset({Device.CUDA})
_FLOATS = frozenset({"float32", "float16", "bfloat16"})
_FP32 = frozenset({"float32"})
_ALL_WIDTHS = frozenset({"float64", "float32", "float16", "bfloat16", "int64", "int32", "int16",
                         "int8", "uint8", "bool", "complex64"})


_ADAMW_TARGETS = frozenset({"aten.addcdiv.default", "aten.lerp.Scalar", "aten.addcmul.default",
                            "aten.sqrt.default", "aten.div.Tensor", "aten.add.Tensor",
                            "aten.mul.Tensor"})
_ADAMW_STATE = frozenset({"param", "exp_avg", "exp_avg_sq"})
_SGD_STATE = frozenset({"param", "momentum_buffer"})


def _called_directly(graph: Graph) -> list[Match]:
    """Packing has no IR pattern of its own: the lowering calls it around collectives."""
    return []


BUILTIN_KERNELS = tuple(register_kernel(spec) for spec in (
    KernelSpec(name="adamw", backend=Backend.TRITON, devices=_GPU, dtypes=_FLOATS,
               targets=_ADAMW_TARGETS, matcher=match_adamw, entry="._triton_optim:adamw_step_",
               doc="fused AdamW over all shards, one launch per dtype group (torch.optim.AdamW)",
               mutates=_ADAMW_STATE, batch=True),
    KernelSpec(name="sgd", backend=Backend.TRITON, devices=_GPU, dtypes=_FLOATS,
               targets=frozenset({"aten.add.Tensor", "aten.mul.Tensor"}),
               matcher=match_sgd, entry="._triton_optim:sgd_step_",
               doc="fused SGD (momentum, dampening, nesterov, weight decay) update",
               mutates=_SGD_STATE, batch=True),
    # CPU: AdamW in one vectorised pass per shard (numba); torch foreach ops as the fallback
    # (bit-identical to the graph's op chain, in place), on any device
    KernelSpec(name="adamw_cpu", backend=Backend.NUMBA, devices=frozenset({Device.CPU}),
               dtypes=frozenset({"float32", "float64"}), targets=_ADAMW_TARGETS,
               matcher=match_adamw, entry="._cpu_optim:adamw_fused_cpu_",
               doc="AdamW in one pass per shard, in place (numba, vectorised)",
               mutates=_ADAMW_STATE, batch=True),
    KernelSpec(name="adamw_foreach", backend=Backend.TORCH,
               devices=frozenset({Device.CPU, Device.CUDA}), dtypes=_FLOATS | {"float64"},
               targets=_ADAMW_TARGETS, matcher=match_adamw, entry="._cpu_optim:adamw_foreach_",
               doc="the graph's AdamW ops as in-place torch._foreach_* calls (bit-identical)",
               mutates=_ADAMW_STATE, batch=True),
    KernelSpec(name="sgd_foreach", backend=Backend.TORCH,
               devices=frozenset({Device.CPU, Device.CUDA}), dtypes=_FLOATS | {"float64"},
               targets=frozenset({"aten.add.Tensor", "aten.mul.Tensor"}), matcher=match_sgd,
               entry="._cpu_optim:sgd_foreach_",
               doc="the graph's SGD ops as in-place torch._foreach_* calls (bit-identical)",
               mutates=_SGD_STATE, batch=True),
    KernelSpec(name="bias_gelu", backend=Backend.TRITON, devices=_GPU, dtypes=_FLOATS,
               targets=frozenset({"aten.gelu.default", "aten.gelu_backward.default"}),
               matcher=match_bias_gelu, entry="._triton_act:bias_gelu",
               doc="gelu(x + bias), erf and tanh forms, forward and backward"),
    # SwiGLU: forward and backward are two calls; the backward recomputes silu(gate), so the
    # pair never keeps that activation (substituted together or not at all)
    KernelSpec(name="swiglu", backend=Backend.TRITON, devices=_GPU, dtypes=_FLOATS,
               targets=frozenset({"aten.silu.default", "aten.mul.Tensor"}),
               matcher=match_swiglu, entry="._triton_act:swiglu",
               doc="silu(gate) * up in one pass (silu(gate) is not kept for the backward)"),
    KernelSpec(name="swiglu_backward", backend=Backend.TRITON, devices=_GPU, dtypes=_FLOATS,
               targets=frozenset({"aten.mul.Tensor", "aten.silu_backward.default"}),
               matcher=match_swiglu_backward, entry="._triton_act:swiglu_backward",
               doc="SwiGLU's gate and up gradients in one pass from dy, gate and up"),
    # LayerNorm: offered for fp32 only, where it beat aten on an H200 (1.35-1.7x); in fp16 and
    # bf16 it took 1.5-1.75x aten's time (benchmarks/README.md), so programs keep aten's there
    # (``layer_norm()`` itself takes all three)
    KernelSpec(name="layer_norm", backend=Backend.TRITON, devices=_GPU, dtypes=_FP32,
               targets=frozenset({"aten.native_layer_norm.default"}),
               matcher=match_layer_norm, entry="._triton_norm:norm_forward",
               doc="LayerNorm over the last dim, forward (saves mean and rstd as aten does)"),
    KernelSpec(name="layer_norm_backward", backend=Backend.TRITON, devices=_GPU, dtypes=_FP32,
               targets=frozenset({"aten.native_layer_norm_backward.default"}),
               matcher=match_layer_norm_backward, entry="._triton_norm:norm_backward",
               doc="LayerNorm over the last dim, backward from the saved mean and rstd"),
    KernelSpec(name="rms_norm", backend=Backend.TRITON, devices=_GPU, dtypes=_FLOATS,
               targets=frozenset({"aten.pow.Tensor_Scalar", "aten.mean.dim", "aten.add.Tensor",
                                  "aten.rsqrt.default", "aten.mul.Tensor"}),
               matcher=match_rms_norm, entry="._triton_norm:norm_forward",
               doc="RMSNorm over the last dim: its decomposed forward in one pass (the "
                   "backward's ops read the rstd and normalised values it returns)"),
    KernelSpec(name="rms_norm_backward", backend=Backend.TRITON, devices=_GPU, dtypes=_FLOATS,
               targets=frozenset({"aten.mul.Tensor", "aten.sum.dim_IntList",
                                  "aten.pow.Tensor_Scalar", "aten.expand.default",
                                  "aten.div.Tensor", "aten.add.Tensor"}),
               matcher=match_rms_norm_backward, entry="._triton_norm:norm_backward",
               doc="RMSNorm's input gradient (aten's 12-14 decomposed nodes) in one pass "
                   "from the saved rstd"),
    # cross-entropy: forward and backward are two calls that hand each other the rows'
    # log-sum-exp (the lowering substitutes both or neither), so the (N, V) log-probabilities
    # are never written; ``cross_entropy()`` itself is the autograd function for direct use.
    # Offered for fp32 only: on an H200 forward+backward was 1.76x F.cross_entropy in fp32 but
    # 0.9x in fp16/bf16 (the vocabulary loop reads the logits twice; benchmarks/README.md)
    KernelSpec(name="cross_entropy", backend=Backend.TRITON, devices=_GPU, dtypes=_FP32,
               targets=frozenset({"aten._log_softmax.default", "aten.nll_loss_forward.default"}),
               matcher=match_cross_entropy, entry="._triton_xent:cross_entropy",
               doc="cross-entropy forward by chunked online log-sum-exp (keeps the lse, not "
                   "the log-softmax)"),
    KernelSpec(name="cross_entropy_backward", backend=Backend.TRITON, devices=_GPU,
               dtypes=_FP32,
               targets=frozenset({"aten.nll_loss_backward.default",
                                  "aten._log_softmax_backward_data.default"}),
               matcher=match_cross_entropy_backward, entry="._triton_xent:shard_grad",
               doc="cross-entropy gradient (softmax - onehot) * dy / n from the logits and the "
                   "forward's lse"),
    KernelSpec(name="pack_views", backend=Backend.TRITON, devices=_GPU, dtypes=_FLOATS,
               targets=frozenset(), matcher=_called_directly, entry="._triton_pack:pack_views",
               doc="gather strided shards into one buffer (unpack_views scatters back)"),
    KernelSpec(name="grad_buckets", backend=Backend.NUMBA, devices=frozenset({Device.CPU}),
               dtypes=_ALL_WIDTHS, targets=frozenset(), matcher=match_grad_buckets,
               entry="._numba:flatten_into",
               doc="flatten gradients into all-reduce buckets (unflatten_from copies back)"),
    KernelSpec(name="grad_buckets_torch", backend=Backend.TORCH,
               devices=frozenset({Device.CPU, Device.CUDA}), dtypes=_ALL_WIDTHS | {"complex128"},
               targets=frozenset(), matcher=match_grad_buckets,
               entry="._flatten_torch:flatten_into_torch",
               doc="torch.cat/copy_ fallback of grad_buckets, any device"),
))
