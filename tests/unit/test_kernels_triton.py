"""Triton kernels against their torch references, forward and backward, fp32 and fp16.

Without a GPU the kernels run under the Triton interpreter: ``TRITON_INTERPRET=1`` is set here
before any kernel module is imported (Triton reads it when a ``@triton.jit`` function is
defined). bfloat16 is checked only on a GPU (the interpreter computes bf16 wrongly).

Tolerances: fp32 results must agree to 1e-5 relative (the kernels reorder float32 sums);
fp16 kernels compute in float32 and round once, so they are compared with a float32 torch
reference at fp16 resolution (2e-3 relative; parameters after AdamW at 4e-3 absolute, the
rounding of values near 2). Sizes avoid block multiples: 1, 7, 129 and 1000 columns, vocab 1000
in chunks of 256.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from meshplan import kernels  # noqa: E402
from meshplan.kernels import _triton_act, _triton_norm  # noqa: E402
from meshplan.kernels._common import interpreting  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLOATS = [torch.float32, torch.float16]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}

pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not interpreting(),
    reason="triton kernels were defined without TRITON_INTERPRET=1 in this process")


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def _leaf(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(DEVICE, dtype).requires_grad_()


def _ref(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().requires_grad_()


def test_kernels_run_under_the_interpreter_or_on_a_gpu() -> None:
    assert DEVICE == "cuda" or type(_triton_act._bias_gelu_fwd).__name__ == "InterpretedFunction"


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("cols", [1, 129])
def test_bias_gelu_forward_backward(dtype, approximate, cols) -> None:
    torch.manual_seed(cols)
    x, b = _leaf(torch.randn(5, cols) * 2, dtype), _leaf(torch.randn(cols), dtype)
    dy = torch.randn(5, cols).to(DEVICE, dtype)
    y = kernels.bias_gelu(x, b, approximate)
    y.backward(dy)
    xr, br = _ref(x), _ref(b)
    yr = F.gelu(xr + br, approximate=approximate)
    yr.backward(dy.float())
    _close(y, yr, dtype)
    _close(x.grad, xr.grad, dtype)
    torch.testing.assert_close(b.grad.float(), br.grad, rtol=1e-2 if dtype != torch.float32
                               else 1e-5, atol=1e-2 if dtype != torch.float32 else 1e-5)


@pytest.mark.parametrize("dtype", FLOATS)
def test_bias_gelu_without_bias(dtype) -> None:
    x = torch.randn(3, 7).to(DEVICE, dtype)
    _close(kernels.bias_gelu(x), F.gelu(x.float()), dtype)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(1,), (3, 7), (2, 1000)])
def test_swiglu_forward_backward(dtype, shape) -> None:
    torch.manual_seed(len(shape))
    a, b = _leaf(torch.randn(shape), dtype), _leaf(torch.randn(shape), dtype)
    dy = torch.randn(shape).to(DEVICE, dtype)
    y = kernels.swiglu(a, b)
    y.backward(dy)
    ar, br = _ref(a), _ref(b)
    (F.silu(ar) * br).backward(dy.float())
    _close(y, F.silu(ar) * br, dtype)
    _close(a.grad, ar.grad, dtype)
    _close(b.grad, br.grad, dtype)


def _norm_case(kind: str, dtype: torch.dtype, cols: int, rows: int = 3) -> None:
    torch.manual_seed(cols)
    x = _leaf(torch.randn(rows, cols) * 3 + 1, dtype)
    w = _leaf(torch.randn(cols), dtype)
    b = _leaf(torch.randn(cols), dtype)
    dy = torch.randn(rows, cols).to(DEVICE, dtype)
    xr, wr, br = _ref(x), _ref(w), _ref(b)
    if kind == "layer":
        y = kernels.layer_norm(x, w, b, 1e-5)
        yr = F.layer_norm(xr, (cols,), wr, br, 1e-5)
    else:
        y = kernels.rms_norm(x, w, 1e-6)
        yr = F.rms_norm(xr, (cols,), wr, 1e-6)
    y.backward(dy)
    yr.backward(dy.float())
    _close(y, yr, dtype)
    # a one-column LayerNorm's dx and dweight are ~0 computed from 1/sqrt(eps)-sized terms: absolute check.
    tol = dict(rtol=TOL[dtype]["rtol"], atol=1e-4 if cols == 1 else TOL[dtype]["atol"])
    torch.testing.assert_close(x.grad.float(), xr.grad, **tol)
    # dweight/dbias sum over rows of products rounded to fp16: compare with a looser bound.
    wtol = dict(rtol=1e-2, atol=1e-2) if dtype != torch.float32 else tol
    torch.testing.assert_close(w.grad.float(), wr.grad, **wtol)
    if kind == "layer":
        torch.testing.assert_close(b.grad.float(), br.grad, **wtol)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("cols", [1, 7, 129, 1000])
def test_layer_norm_forward_backward(dtype, cols) -> None:
    _norm_case("layer", dtype, cols)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("cols", [1, 7, 129, 1000])
def test_rms_norm_forward_backward(dtype, cols) -> None:
    _norm_case("rms", dtype, cols)


def test_norm_backward_sums_weight_grads_across_programs() -> None:
    """More rows than one backward program handles (16): partial dweight rows are summed."""
    _norm_case("layer", torch.float32, 7, rows=37)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("cols", [1, 129])
def test_rms_norm_input_gradient_alone_with_a_residual(dtype, cols) -> None:
    """What the lowering's ``rms_norm_backward`` calls: ``dx`` alone (no weight-gradient
    partial sums) from the saved rstd, plus a residual stream's gradient in the same pass."""
    torch.manual_seed(cols)
    x = _leaf(torch.randn(37, cols) * 3 + 1, dtype)
    w = torch.randn(cols).to(DEVICE, dtype)
    dy, res = (torch.randn(37, cols).to(DEVICE, dtype) for _ in range(2))
    xr = _ref(x)
    F.rms_norm(xr, (cols,), w.float(), 1e-6).backward(dy.float())
    rstd = torch.rsqrt(xr.detach().pow(2).mean(-1) + 1e-6)
    dx, dw, db = _triton_norm.norm_backward(dy, x.detach(), w, None, rstd, rms=True,
                                            weight_grads=False, residual=res)
    assert dw is None and db is None
    tol = dict(rtol=TOL[dtype]["rtol"], atol=1e-4 if cols == 1 else TOL[dtype]["atol"])
    torch.testing.assert_close(dx.float(), xr.grad + res.float(), **tol)


@pytest.mark.parametrize("dtype", FLOATS)
def test_cross_entropy_matches_torch_with_ignore_index(dtype) -> None:
    torch.manual_seed(1)
    x = _leaf(torch.randn(6, 1000) * 3, dtype)
    target = torch.tensor([3, -100, 999, 0, 512, 255], device=DEVICE)
    loss = kernels.cross_entropy(x, target, ignore_index=-100, chunk=256)
    loss.backward()
    xr = _ref(x)
    ref = F.cross_entropy(xr, target, ignore_index=-100)
    ref.backward()
    _close(loss, ref, dtype)
    _close(x.grad, xr.grad, dtype)
    assert torch.all(x.grad[1] == 0)


def test_cross_entropy_fwd_bwd_and_custom_ignore_index() -> None:
    x = torch.randn(4, 129, device=DEVICE)
    target = torch.tensor([7, 7, 128, 0], device=DEVICE)
    loss, grad = kernels.cross_entropy_fwd_bwd(x, target, ignore_index=7, chunk=64)
    xr = x.clone().requires_grad_()
    ref = F.cross_entropy(xr, target, ignore_index=7)
    ref.backward()
    _close(loss, ref, torch.float32)
    _close(grad, xr.grad, torch.float32)


def test_cross_entropy_over_vocab_shards_combines_to_the_full_loss() -> None:
    """Three uneven vocab shards (tp=3): per-shard stats, combine, per-shard grads."""
    torch.manual_seed(2)
    x = torch.randn(5, 1000, device=DEVICE) * 4
    target = torch.tensor([0, 299, 300, 999, -100], device=DEVICE)
    bounds = [(0, 300), (300, 700), (700, 1000)]
    stats = [kernels.shard_stats(x[:, a:b].contiguous(), target, vocab_start=a, chunk=256)
             for a, b in bounds]
    lse, target_logit = kernels.combine_shard_stats(*(torch.stack(s) for s in zip(*stats)))
    valid = target != -100
    loss = (lse - target_logit)[valid].sum() / valid.sum()
    xr = x.clone().requires_grad_()
    ref = F.cross_entropy(xr, target)
    ref.backward()
    _close(loss, ref, torch.float32)
    scale = torch.tensor(1.0 / valid.sum().item())
    grads = [kernels.shard_grad(x[:, a:b].contiguous(), target, lse, scale, vocab_start=a)
             for a, b in bounds]
    _close(torch.cat(grads, dim=1), xr.grad, torch.float32)


SHAPES = [(1,), (7, 3), (129,), (33, 31)]


@pytest.mark.parametrize("dtype", FLOATS)
def test_adamw_matches_torch_adamw_over_three_steps(dtype) -> None:
    """fp16 params and exp_avg with fp32 exp_avg_sq (fp16 squares underflow) against torch's
    AdamW run in float32; fp32 against torch's fp32 AdamW."""
    torch.manual_seed(3)
    params = [torch.randn(s).to(DEVICE, dtype) for s in SHAPES]
    ref = [p.float().requires_grad_() for p in params]
    opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1,
                            foreach=False)
    exp_avg = [torch.zeros_like(p) for p in params]
    exp_avg_sq = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    for step in (1, 2, 3):
        grads = [torch.randn(s).to(DEVICE, dtype) for s in SHAPES]
        for r, g in zip(ref, grads):
            r.grad = g.float()
        opt.step()
        kernels.adamw_step_(params, grads, exp_avg, exp_avg_sq, step, lr=1e-2, beta1=0.8,
                            beta2=0.99, eps=1e-6, weight_decay=0.1)
    tol = TOL[dtype] if dtype == torch.float32 else dict(rtol=0, atol=4e-3)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.float(), r.detach(), **tol)
    for m, v, r in zip(exp_avg, exp_avg_sq, ref):
        _close(m, opt.state[r]["exp_avg"], dtype)
        _close(v, opt.state[r]["exp_avg_sq"], torch.float32)


def test_adamw_one_launch_per_dtype_group_equals_one_launch_per_shard() -> None:
    """Mixed groups (fp32 and fp16 params, one empty shard, per-shard steps): the pointer-table
    launch and the per-shard launches do the same float32 math, so results are bit-equal."""
    torch.manual_seed(5)
    dtypes = [torch.float32, torch.float16, torch.float32, torch.float16, torch.float32]
    shapes = [(1,), (7, 3), (0,), (1500,), (33, 31)]

    def state():
        params = [torch.randn(s).to(DEVICE, d) for s, d in zip(shapes, dtypes)]
        return (params, [torch.randn(s).to(DEVICE, d) for s, d in zip(shapes, dtypes)],
                [torch.randn(s).to(DEVICE, d) for s, d in zip(shapes, dtypes)],
                [torch.rand(s, device=DEVICE) for s in shapes])

    torch.manual_seed(6)
    a = state()
    torch.manual_seed(6)
    b = state()
    steps = [1, 2, 3, 4, 5]
    kernels.adamw_step_(*a, steps, lr=1e-2, weight_decay=0.1)
    kernels.adamw_step_(*b, steps, lr=1e-2, weight_decay=0.1, multi_tensor=False)
    for xs, ys in zip(a, b):
        assert all(torch.equal(x, y) for x, y in zip(xs, ys))


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_one_launch_per_dtype_group_equals_one_launch_per_shard(momentum) -> None:
    """Mixed groups (fp32 and fp16 params, one empty shard), first step then a second: the
    pointer-table launch and the per-shard launches do the same float32 math, bit-equal."""
    dtypes = [torch.float32, torch.float16, torch.float32, torch.float16, torch.float32]
    shapes = [(1,), (7, 3), (0,), (1500,), (33, 31)]

    def run(multi_tensor: bool):
        torch.manual_seed(7)
        params = [torch.randn(s).to(DEVICE, d) for s, d in zip(shapes, dtypes)]
        bufs: list = [None] * len(params)
        for _ in range(2):
            grads = [torch.randn(s).to(DEVICE, d) for s, d in zip(shapes, dtypes)]
            bufs = kernels.sgd_step_(params, grads, bufs, lr=0.1, momentum=momentum,
                                     dampening=0.1, weight_decay=0.01,
                                     multi_tensor=multi_tensor)
        return params, bufs

    (pa, ba), (pb, bb) = run(True), run(False)
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(ba, bb))


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("dtype", FLOATS)
def test_sgd_momentum_matches_torch(dtype, nesterov) -> None:
    torch.manual_seed(4)
    params = [torch.randn(s).to(DEVICE, dtype) for s in SHAPES]
    ref = [p.float().requires_grad_() for p in params]
    opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9, dampening=0.0 if nesterov else 0.1,
                          weight_decay=0.01, nesterov=nesterov, foreach=False)
    bufs: list = [None] * len(params)
    for _ in range(3):
        grads = [torch.randn(s).to(DEVICE, dtype) for s in SHAPES]
        for r, g in zip(ref, grads):
            r.grad = g.float()
        opt.step()
        bufs = kernels.sgd_step_(params, grads, bufs, lr=0.1, momentum=0.9,
                                 dampening=0.0 if nesterov else 0.1, weight_decay=0.01,
                                 nesterov=nesterov)
    tol = TOL[dtype] if dtype == torch.float32 else dict(rtol=0, atol=4e-3)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.float(), r.detach(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64])
def test_pack_unpack_strided_views_round_trip(dtype) -> None:
    base = torch.arange(6 * 10 * 7, device=DEVICE).to(dtype).reshape(6, 10, 7)
    views = [*kernels.narrow_shards(base, 1, 5), base.transpose(0, 2)[:, 1:5],
             base[::2, 3, ::3], base[0, 0, :1]]
    buf = kernels.pack_views(views)
    assert torch.equal(buf, torch.cat([v.reshape(-1) for v in views]))
    target = torch.zeros_like(base)
    kernels.unpack_views(buf[:base.numel()], kernels.narrow_shards(target, 1, 5))
    assert torch.equal(target, base)


def test_kernel_errors_name_the_problem() -> None:
    with pytest.raises(kernels.KernelError, match="not contiguous"):
        kernels.layer_norm(torch.randn(4, 6, device=DEVICE).t())
    with pytest.raises(kernels.KernelError, match="bias of shape"):
        kernels.bias_gelu(torch.randn(3, 4, device=DEVICE), torch.randn(5, device=DEVICE))
    with pytest.raises(kernels.KernelError, match="steps count from 1"):
        kernels.adamw_step_([torch.ones(2, device=DEVICE)], [torch.ones(2, device=DEVICE)],
                            [torch.zeros(2, device=DEVICE)], [torch.zeros(2, device=DEVICE)], 0,
                            lr=0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("cols", [7, 1000])
def test_bf16_on_gpu(cols) -> None:
    dtype = torch.bfloat16
    x = _leaf(torch.randn(4, cols), dtype)
    w, b = _leaf(torch.randn(cols), dtype), _leaf(torch.randn(cols), dtype)
    _close(kernels.layer_norm(x, w, b), F.layer_norm(_ref(x), (cols,), _ref(w), _ref(b)), dtype)
    _close(_triton_norm.rms_norm(x, w), F.rms_norm(_ref(x), (cols,), _ref(w), 1e-6), dtype)
    _close(kernels.bias_gelu(x, b), F.gelu(_ref(x) + _ref(b)), dtype)
    _close(kernels.swiglu(x, x), F.silu(_ref(x)) * _ref(x), dtype)
    target = torch.randint(0, cols, (4,), device=DEVICE)
    _close(kernels.cross_entropy(x, target), F.cross_entropy(_ref(x), target), dtype)


@pytest.mark.parametrize("kernel", ["adamw", "sgd"])
def test_the_lowerings_optimizer_adapters_take_strided_shards_too(kernel: str) -> None:
    """What the lowering calls (``kernels/_apply.py``): contiguous shards go through the Triton
    kernel, strided views (a transposed shard) through the in-place foreach ops; both end equal
    to the graph's op chain (fp32: the Triton kernel computes in fp32 in its own order, so
    rtol 1e-5 / atol 1e-6) and the strided ones are updated in place."""
    from meshplan.kernels._apply import ADAPTERS

    gen = torch.Generator().manual_seed(5)
    mk = lambda *s: torch.randn(*s, generator=gen).to(DEVICE)  # noqa: E731
    shapes = [(7, 5), (33,), (5, 7)]
    params = [mk(*s) for s in shapes]
    params[2] = mk(7, 5).t()                         # strided: a transposed shard
    grads = [mk(*p.shape) for p in params]
    if kernel == "adamw":
        ms = [mk(*p.shape) for p in params]
        vs = [mk(*p.shape).abs() for p in params]
        vs[2] = mk(7, 5).abs().t()
        ops = {"param": params, "grad": grads, "exp_avg": ms, "exp_avg_sq": vs,
               "neg_step_size": [-1e-2] * 3, "bias_correction2_sqrt": [0.3] * 3}
        attrs = {"decay": 0.999, "lerp_weight": 0.1, "beta2": 0.999,
                 "addcmul_value": 1 - 0.999, "eps": 1e-8, "beta1": 0.9}
        want = []
        for p, g, m, v in zip(params, grads, ms, vs):
            m2 = torch.lerp(m, g, 0.1)
            v2 = torch.addcmul(v * 0.999, g, g, value=1 - 0.999)
            want.append((torch.addcdiv(p * 0.999, m2, v2.sqrt() / 0.3 + 1e-8, value=-1e-2),
                         m2, v2))
        names = ("param", "exp_avg", "exp_avg_sq")
    else:
        bufs = [mk(*p.shape) for p in params]
        ops = {"param": params, "grad": grads, "momentum_buffer": bufs}
        attrs = {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "neg_lr": -0.1,
                 "grad_alpha": 1.0}
        want = []
        for p, g, b in zip(params, grads, bufs):
            b2 = b * 0.9 + g
            want.append((p - 0.1 * b2, b2))
        names = ("param", "momentum_buffer")
    before = [p.data_ptr() for p in params]
    out = ADAPTERS[kernel](ops, attrs)
    for i, w in enumerate(want):
        for name, expect in zip(names, w):
            torch.testing.assert_close(out[name][i], expect, rtol=1e-5, atol=1e-6,
                                       msg=f"{name}[{i}]")
    assert [p.data_ptr() for p in out["param"]] == before     # in place, strided one too
