"""Kernel benchmarks (issue 8), GPU part: each fused Triton kernel of ``meshplan.kernels``
against the unfused torch ops it replaces, timed, checked and related to the copy bandwidth.

    python benchmarks/kernels_gpu.py [--json PATH] [--markdown PATH] [--kernels adamw,sgd,...]
                                     [--dtypes bfloat16,float32,float16] [--quick] [--budget-s S]

Rows (one per kernel, dtype and pass; dtypes float32, float16, bfloat16 - bf16 on CUDA only):

- ``adamw`` step: ``adamw_step_`` (one launch per dtype group through a pointer table) over 64
  tensors of mixed shapes (~64M elements), param/grad/state in the row's dtype, vs
  ``torch.optim.AdamW(foreach=False)`` (the single-tensor op chain the IR decomposes to; the
  baseline) and torch's own ``foreach=True`` and ``fused=True`` (references; what happens with
  each dtype is recorded). ``launch-only ms`` is the same fused kernel with its chunk/pointer
  tables built once outside the timed region (the rest of ``fused ms`` is host work).
- ``sgd`` step (momentum 0.9, buffers exist): ``sgd_step_`` vs ``torch.optim.SGD``
  ``foreach=False`` (baseline) and ``foreach=True``.
- ``cross_entropy`` fwd (``cross_entropy``) and fwd+bwd (``cross_entropy_fwd_bwd``), 8192
  tokens x vocab 50304 (every 97th target ignored), vs ``F.cross_entropy`` (+ autograd).
- ``bias_gelu`` (8192 x 16384, erf form), ``swiglu`` (8192 x 11008), ``layer_norm`` and
  ``rms_norm`` (16384 x 4096), fwd and fwd+bwd (``torch.autograd.grad`` of the output with a
  random ``dy``, wrt every input) vs ``gelu(x + b)``, ``silu(a) * b``, ``F.layer_norm``, the
  decomposed RMSNorm ``x * rsqrt(mean(x^2) + eps) * w`` (baseline) and ``F.rms_norm``.
- ``pack_views`` pack / unpack: tp=4 column shards (strided ``narrow`` views) of 16 weight
  matrices 4096 x 4096 to and from one flat buffer, vs one strided ``copy_`` per view
  (baseline) and, for pack, ``torch.cat([v.reshape(-1) ...], out=)``.

Timing: on CUDA, CUDA events around each call, the L2 cache flushed (256 MB memset) before
each; one warm-up call, an estimate from two calls, then as many calls as fit in ``--rep-ms``
(5..50); the median is reported. The check (below) makes the first fused call, so its time
``check_s`` includes the Triton JIT compile. Host work inside a call (Python, table building)
counts when it is longer than the GPU work. Without CUDA (``--quick`` only) the kernels run
under the Triton interpreter (``TRITON_INTERPRET=1`` is set before triton loads), tiny sizes,
fp32/fp16, ``time.perf_counter`` medians of 3 calls: that checks the script and the numerics,
not the speed.

Bytes: the minimum the fused kernel (as implemented) must read plus write, from the shapes
(formula per kernel in ``case_*``); achieved GB/s = bytes / fused median; ``of copy BW`` =
that over the device-to-device ``copy_`` bandwidth measured at the start (1 GiB copied,
counted as 2 GiB moved).

Correctness: each row runs the fused kernel once from the same inputs as a float32 torch
reference (inputs upcast) and records, over every output (loss, grads, param and state),
``max abs err`` and ``max rel err`` = max|fused - ref| / max|ref| per output (the worst output
is named); ``torch rel err`` is the same for the torch baseline in the row's dtype, for scale.
``ok`` = rel err <= 1e-4 (fp32), 4e-3 (fp16), 3e-2 (bf16). A failure is a row value, never an
exception: each measurement runs in its own try/except, the error text lands in the row, and
the run goes on. After a sticky CUDA error the remaining rows are marked skipped. A row that
would start after ``--budget-s`` seconds (default 95) is skipped. The JSON is rewritten after
every row, so an interrupted run still leaves its rows. The exit status is 1 when any row
failed (an error in any of its measurements, or ``ok`` false) or the run was interrupted, with
the failed rows named on stderr (``failures``); rows skipped for the time budget or for bf16
without CUDA are counted on stderr but do not fail the run.

Default dtype order is bfloat16, float32, float16: bf16 had never run on a GPU, fp16 matters
least if the budget cuts the run short.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

T_START = time.perf_counter()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

CUDA = torch.cuda.is_available()
if not CUDA:  # Triton reads this when a @triton.jit function is defined: before kernels load
    os.environ.setdefault("TRITON_INTERPRET", "1")

KERNELS = ["adamw", "sgd", "cross_entropy", "bias_gelu", "swiglu", "layer_norm", "rms_norm",
           "pack_views"]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOL = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}  # max|fused - ref| / max|ref|


# ---- sizes --------------------------------------------------------------------------------
@dataclass
class Sizes:
    opt_shapes: list[tuple[int, ...]]      # adamw / sgd tensors
    xent: tuple[int, int]                  # tokens, vocab
    gelu: tuple[int, int]                  # rows, cols
    swiglu: tuple[int, int]
    norm: tuple[int, int]
    pack: tuple[int, int, int]             # matrices, side, tp
    copy_bytes: int


def sizes_for(cuda: bool, quick: bool) -> Sizes:
    if not cuda:  # Triton interpreter: tiny, and not block multiples
        return Sizes(opt_shapes=[(32, 32), (48, 16), (7, 3), (129,), (5,)], xent=(8, 600),
                     gelu=(16, 129), swiglu=(16, 200), norm=(17, 129), pack=(2, 32, 4),
                     copy_bytes=64 << 20)
    # 16 x [2048x1024, 1024x1024, 1024x960, 4096] = 64 tensors, 63.8M elements (all multiples
    # of 16: one Triton specialisation per dtype)
    opt = [(2048, 1024), (1024, 1024), (1024, 960), (4096,)] * 16
    if quick:
        return Sizes(opt_shapes=opt[:16], xent=(2048, 50304), gelu=(2048, 16384),
                     swiglu=(2048, 11008), norm=(4096, 4096), pack=(4, 4096, 4),
                     copy_bytes=1 << 30)
    return Sizes(opt_shapes=opt, xent=(8192, 50304), gelu=(8192, 16384), swiglu=(8192, 11008),
                 norm=(16384, 4096), pack=(16, 4096, 4), copy_bytes=1 << 30)


# ---- kernels ------------------------------------------------------------------------------
def load_kernel_modules() -> dict[str, object]:
    """The five Triton kernel modules. Through ``meshplan.kernels`` when meshplan imports; if
    the package's ``__init__`` cannot import (a dependency missing on the benchmark machine),
    the kernel modules are loaded under a bare ``meshplan`` package (they need only torch,
    triton and ``meshplan._errors``)."""
    import importlib

    names = ["_triton_optim", "_triton_xent", "_triton_act", "_triton_norm", "_triton_pack"]
    try:
        return {n: importlib.import_module(f"meshplan.kernels.{n}") for n in names}
    except Exception as e:  # noqa: BLE001 - any failure of meshplan's own imports
        if isinstance(e, ImportError) and (e.name or "").startswith("triton"):
            raise
        print(f"note: `import meshplan.kernels` failed ({e}); loading the kernel modules under a "
              "bare package", file=sys.stderr)
    import types

    root = Path(__file__).resolve().parents[1]
    for name, path in (("meshplan", root), ("meshplan.kernels", root / "kernels")):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(path)]
        sys.modules[name] = pkg
    return {n: importlib.import_module(f"meshplan.kernels.{n}") for n in names}


# ---- timing -------------------------------------------------------------------------------
class Timer:
    def __init__(self, cuda: bool, rep_ms: float, cpu_reps: int = 3):
        self.cuda, self.rep_ms, self.cpu_reps = cuda, rep_ms, cpu_reps
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda") if cuda else None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def first_call(self, fn: Callable[[], object]) -> float:
        """Seconds of the first call (JIT compile, state allocation), synchronised."""
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0

    def median_s(self, fn: Callable[[], object]) -> float:
        """Median seconds per call after the warm-up (call ``first_call`` before)."""
        if not self.cuda:
            times = []
            for _ in range(self.cpu_reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(2):
            fn()
        end.record()
        end.synchronize()
        est_ms = max(start.elapsed_time(end) / 2, 1e-3)
        n = int(min(50, max(5, self.rep_ms / est_ms)))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for s, e in zip(starts, ends):
            self.flush.zero_()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) / 1e3


def copy_bandwidth(timer: Timer, device: str, nbytes: int) -> dict:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.random_(0, 255)
    dst = torch.empty_like(src)
    timer.first_call(lambda: dst.copy_(src))
    t = timer.median_s(lambda: dst.copy_(src))
    assert torch.equal(dst[:4096], src[:4096])
    return {"bytes_copied": nbytes, "ms": t * 1e3, "GBps": 2 * nbytes / t / 1e9}


# ---- cases --------------------------------------------------------------------------------
Maker = Callable[[], Callable[[], object]]  # builds (untimed) the callable that is timed


@dataclass
class Spec:
    shape: str
    bytes: int                 # minimum bytes the fused kernel reads + writes
    fused: Maker
    torch: dict[str, Maker]    # torch variants; the first is the baseline of `speedup`
    # -> list of (output name, fused result, float32 reference, torch baseline result or None)
    check: Callable[[], list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]]]
    extra: dict[str, Maker] = field(default_factory=dict)   # more fused variants (ms only)
    note: str = ""


def _just(fn: Callable[[], object]) -> Maker:
    return lambda: fn


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().clone()


def _leaves(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in ts]


def case_adamw(K, dt, sz: Sizes, dev: str) -> Spec:
    # bytes: param, exp_avg, exp_avg_sq read + written, grad read: 7 * N * sizeof(dtype)
    # (the chunk/address tables, 16 bytes per 1024-element chunk, are left out)
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)
    topt = dict(lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                weight_decay=hp["weight_decay"])
    p0 = [torch.randn(s, device=dev, dtype=dt) for s in sz.opt_shapes]
    g = [torch.randn(s, device=dev, dtype=dt) for s in sz.opt_shapes]
    n = sum(p.numel() for p in p0)
    optim = K["_triton_optim"]

    def fused() -> Callable[[], object]:
        p = [x.clone() for x in p0]
        m, v = [torch.zeros_like(x) for x in p0], [torch.zeros_like(x) for x in p0]
        return lambda: optim.adamw_step_(p, g, m, v, 1, **hp)

    def launch_only() -> Callable[[], object]:
        """The `_adamw_multi` launch of adamw_step_ with its tables built once."""
        p = [x.clone() for x in p0]
        m, v = [torch.zeros_like(x) for x in p0], [torch.zeros_like(x) for x in p0]
        block = optim._BLOCK
        chunk_t, chunk_s = [], []
        for t, x in enumerate(p):
            starts = range(0, x.numel(), block)
            chunk_t += [t] * len(starts)
            chunk_s += starts
        i64 = lambda xs: torch.tensor(xs, dtype=torch.int64, device=dev)  # noqa: E731
        f32 = lambda xs: torch.tensor(xs, dtype=torch.float32, device=dev)  # noqa: E731
        table = i64([[x.data_ptr() for x in xs] for xs in (p, g, m, v)]).reshape(-1)
        numels, ct, cs = i64([x.numel() for x in p]), i64(chunk_t), i64(chunk_s)
        step_size = f32([hp["lr"] / (1 - hp["beta1"])] * len(p))
        bc2 = f32([math.sqrt(1 - hp["beta2"])] * len(p))
        decay = 1.0 - hp["lr"] * hp["weight_decay"]
        grid = (len(chunk_t),)
        return lambda: optim._adamw_multi[grid](
            p[0], g[0], m[0], v[0], table, numels, ct, cs, step_size, bc2, decay, hp["beta1"],
            hp["beta2"], hp["eps"], len(p), BLOCK=block)

    def torch_opt(**kw) -> Maker:
        def make() -> Callable[[], object]:
            ps = [x.clone().requires_grad_() for x in p0]
            for x, gx in zip(ps, g):
                x.grad = gx
            opt = torch.optim.AdamW(ps, **topt, **kw)
            return opt.step
        return make

    def check():
        p = [x.clone() for x in p0]
        m, v = [torch.zeros_like(x) for x in p0], [torch.zeros_like(x) for x in p0]
        optim.adamw_step_(p, g, m, v, 1, **hp)
        outs = []
        for kind, dtype in (("ref", torch.float32), ("native", dt)):
            ps = [x.detach().to(dtype).clone().requires_grad_() for x in p0]
            for x, gx in zip(ps, g):
                x.grad = gx.to(dtype)
            opt = torch.optim.AdamW(ps, **topt, foreach=False)
            opt.step()
            outs.append((torch.cat([x.detach().reshape(-1) for x in ps]),
                         torch.cat([opt.state[x]["exp_avg"].reshape(-1) for x in ps]),
                         torch.cat([opt.state[x]["exp_avg_sq"].reshape(-1) for x in ps])))
        flat = lambda xs: torch.cat([x.reshape(-1) for x in xs])  # noqa: E731
        got = (flat(p), flat(m), flat(v))
        return [(name, got[i], outs[0][i], outs[1][i])
                for i, name in enumerate(("param", "exp_avg", "exp_avg_sq"))]

    return Spec(shape=f"{len(p0)} tensors, {n / 1e6:.1f}M el", bytes=7 * n * p0[0].element_size(),
                fused=fused, extra={"launch-only": launch_only},
                torch={"foreach=False": torch_opt(foreach=False),
                       "foreach=True": torch_opt(foreach=True),
                       "fused=True": torch_opt(fused=True)},
                check=check,
                note="check: step 1 from zero state" + (
                    "; torch's own fp16 AdamW keeps fp16 state and eps=1e-8 rounds to 0 in fp16:"
                    " where exp_avg_sq underflows its params go inf (torch rel err)"
                    if dt == torch.float16 else ""))


def case_sgd(K, dt, sz: Sizes, dev: str) -> Spec:
    # bytes: param and momentum buffer read + written, grad read: 5 * N * sizeof(dtype)
    # (momentum buffers exist: the steady-state step, FIRST=False)
    hp = dict(lr=1e-2, momentum=0.9)
    p0 = [torch.randn(s, device=dev, dtype=dt) for s in sz.opt_shapes]
    g = [torch.randn(s, device=dev, dtype=dt) for s in sz.opt_shapes]
    b0 = [torch.randn(s, device=dev, dtype=dt) for s in sz.opt_shapes]
    n = sum(p.numel() for p in p0)
    optim = K["_triton_optim"]

    def fused(**kw) -> Callable[[], object]:
        p, b = [x.clone() for x in p0], [x.clone() for x in b0]
        return lambda: optim.sgd_step_(p, g, b, **hp, **kw)

    def torch_opt(dtype, **kw):
        ps = [x.detach().to(dtype).clone().requires_grad_() for x in p0]
        opt = torch.optim.SGD(ps, **hp, **kw)
        for x, gx, bx in zip(ps, g, b0):
            x.grad = gx.to(dtype)
            opt.state[x]["momentum_buffer"] = bx.to(dtype).clone()
        return ps, opt

    def maker(**kw) -> Maker:
        return lambda: torch_opt(dt, **kw)[1].step

    def check():
        p, b = [x.clone() for x in p0], [x.clone() for x in b0]
        optim.sgd_step_(p, g, b, **hp)
        res = []
        for dtype in (torch.float32, dt):
            ps, opt = torch_opt(dtype, foreach=False)
            opt.step()
            res.append((torch.cat([x.detach().reshape(-1) for x in ps]),
                        torch.cat([opt.state[x]["momentum_buffer"].reshape(-1) for x in ps])))
        got = (torch.cat([x.reshape(-1) for x in p]), torch.cat([x.reshape(-1) for x in b]))
        return [(name, got[i], res[0][i], res[1][i])
                for i, name in enumerate(("param", "momentum_buffer"))]

    return Spec(shape=f"{len(p0)} tensors, {n / 1e6:.1f}M el", bytes=5 * n * p0[0].element_size(),
                fused=fused, extra={"per-shard": lambda: fused(multi_tensor=False)},
                torch={"foreach=False": maker(foreach=False),
                       "foreach=True": maker(foreach=True)}, check=check)


def _targets(n: int, v: int, dev: str) -> torch.Tensor:
    t = torch.randint(0, v, (n,), device=dev)
    t[::97] = -100
    return t


def case_xent(K, dt, sz: Sizes, dev: str, bwd: bool) -> Spec:
    # bytes, s = sizeof(dtype): fwd = N*V*s (logits read once by the stats kernel) + 8N
    # (targets) + 12N (per-row m, s, t); fwd+bwd (cross_entropy_fwd_bwd) adds the gradient
    # kernel's second read of the logits and its write of dlogits: 3*N*V*s + 32N (targets
    # twice, stats, lse)
    xe = K["_triton_xent"]
    n, v = sz.xent
    x = torch.randn(n, v, device=dev, dtype=dt)
    tgt = _targets(n, v, dev)
    s = x.element_size()
    if not bwd:
        def check():
            ref = F.cross_entropy(x.float(), tgt)
            return [("loss", xe.cross_entropy(x, tgt), ref, F.cross_entropy(x, tgt))]
        return Spec(shape=f"{n}x{v}", bytes=n * v * s + 20 * n,
                    fused=_just(lambda: xe.cross_entropy(x, tgt)),
                    torch={"F.cross_entropy": _just(lambda: F.cross_entropy(x, tgt))},
                    check=check)
    (xg,) = _leaves(x)

    def torch_fb(inp):
        loss = F.cross_entropy(inp, tgt)
        return loss, torch.autograd.grad(loss, inp)[0]

    def check():
        loss, dx = xe.cross_entropy_fwd_bwd(x, tgt)
        rl, rdx = torch_fb(x.detach().float().requires_grad_())
        nl, ndx = torch_fb(xg)
        return [("loss", loss, rl, nl), ("dlogits", dx, rdx, ndx)]

    return Spec(shape=f"{n}x{v}", bytes=3 * n * v * s + 32 * n,
                fused=_just(lambda: xe.cross_entropy_fwd_bwd(x, tgt)),
                torch={"F.cross_entropy+autograd": _just(lambda: torch_fb(xg))}, check=check)


def _fwd_bwd_spec(shape: str, nbytes: int, fused_fn, torch_fns: dict, inputs, names, dy,
                  bwd: bool) -> Spec:
    """fwd: ``f(*inputs)``; fwd+bwd: ``autograd.grad(f(*leaves), leaves, dy)``. The check
    compares output (and grads) with the first torch function on float32 copies."""
    if not bwd:
        fwd_torch = {k: _just(lambda f=f: f(*inputs)) for k, f in torch_fns.items()}
        base = next(iter(torch_fns.values()))

        def check():
            return [("y", fused_fn(*inputs), base(*[_f32(t) for t in inputs]), base(*inputs))]
        return Spec(shape=shape, bytes=nbytes, fused=_just(lambda: fused_fn(*inputs)),
                    torch=fwd_torch, check=check)
    leaves = _leaves(*inputs)

    def fb(f, xs, d):
        y = f(*xs)
        return (y, *torch.autograd.grad(y, xs, d))

    base = next(iter(torch_fns.values()))

    def check():
        got = fb(fused_fn, leaves, dy)
        ref = fb(base, _leaves(*[_f32(t) for t in inputs]), dy.float())
        nat = fb(base, leaves, dy)
        return [(nm, a.detach(), b.detach(), c.detach())
                for nm, a, b, c in zip(["y"] + [f"d{n}" for n in names], got, ref, nat)]

    return Spec(shape=shape, bytes=nbytes, fused=_just(lambda: fb(fused_fn, leaves, dy)),
                torch={k: _just(lambda f=f: fb(f, leaves, dy)) for k, f in torch_fns.items()},
                check=check)


def case_bias_gelu(K, dt, sz: Sizes, dev: str, bwd: bool) -> Spec:
    # bytes, R x D, s = sizeof(dtype): fwd = read x + write y + read b = 2*R*D*s + D*s;
    # fwd+bwd adds the backward kernel (read dy, x, b; write dx: 3*R*D*s + D*s) and the
    # entry's dbias = dx.sum(0) in torch (read dx, write dbias: R*D*s + D*s) = 6*R*D*s + 3*D*s
    act = K["_triton_act"]
    r, d = sz.gelu
    x = torch.randn(r, d, device=dev, dtype=dt)
    b = torch.randn(d, device=dev, dtype=dt)
    dy = torch.randn(r, d, device=dev, dtype=dt)
    s = x.element_size()
    nbytes = (6 * r * d * s + 3 * d * s) if bwd else (2 * r * d * s + d * s)
    return _fwd_bwd_spec(f"{r}x{d}", nbytes, lambda x_, b_: act.bias_gelu(x_, b_),
                         {"gelu(x+b)": lambda x_, b_: F.gelu(x_ + b_)}, [x, b], "xb", dy, bwd)


def case_swiglu(K, dt, sz: Sizes, dev: str, bwd: bool) -> Spec:
    # bytes, s = sizeof(dtype), n = R*D: fwd = read a, b + write y = 3*n*s;
    # fwd+bwd adds read dy, a, b + write da, db = 8*n*s
    act = K["_triton_act"]
    r, d = sz.swiglu
    a, b, dy = (torch.randn(r, d, device=dev, dtype=dt) for _ in range(3))
    s = a.element_size()
    return _fwd_bwd_spec(f"{r}x{d}", (8 if bwd else 3) * r * d * s, act.swiglu,
                         {"silu(a)*b": lambda a_, b_: F.silu(a_) * b_}, [a, b], "ab", dy, bwd)


def _norm_bytes(r: int, d: int, s: int, bwd: bool, n_params: int) -> int:
    # fwd: read x + write y (2*R*D*s), read weight/bias (n_params*D*s), write per-row mean and
    # rstd in fp32 (8R). bwd: read dy, x (2*R*D*s), weight (D*s), mean/rstd (8R); write dx
    # (R*D*s) and fp32 partial dweight AND dbias rows (2 * ceil(R/16) * D * 4, also for RMSNorm),
    # which torch reads back to sum (same again) and writes as 2 x D fp32, then casts to dtype.
    fwd = 2 * r * d * s + n_params * d * s + 8 * r
    if not bwd:
        return fwd
    partial = 2 * -(-r // 16) * d * 4
    return fwd + 3 * r * d * s + d * s + 8 * r + 2 * partial + 2 * d * 4 + n_params * d * (4 + s)


def case_layer_norm(K, dt, sz: Sizes, dev: str, bwd: bool) -> Spec:
    # bytes: see _norm_bytes (weight and bias)
    nm = K["_triton_norm"]
    r, d = sz.norm
    x = torch.randn(r, d, device=dev, dtype=dt) * 2 + 0.5
    w = torch.randn(d, device=dev, dtype=dt)
    b = torch.randn(d, device=dev, dtype=dt)
    dy = torch.randn(r, d, device=dev, dtype=dt)
    return _fwd_bwd_spec(
        f"{r}x{d}", _norm_bytes(r, d, x.element_size(), bwd, 2),
        lambda x_, w_, b_: nm.layer_norm(x_, w_, b_, 1e-5),
        {"F.layer_norm": lambda x_, w_, b_: F.layer_norm(x_, (d,), w_, b_, 1e-5)},
        [x, w, b], "xwb", dy, bwd)


def case_rms_norm(K, dt, sz: Sizes, dev: str, bwd: bool) -> Spec:
    # bytes: see _norm_bytes (weight only; the kernel still writes mean = 0 and dbias partials)
    nm = K["_triton_norm"]
    r, d = sz.norm
    eps = 1e-6
    x = torch.randn(r, d, device=dev, dtype=dt) * 2 + 0.5
    w = torch.randn(d, device=dev, dtype=dt)
    dy = torch.randn(r, d, device=dev, dtype=dt)
    ref = {"decomposed": lambda x_, w_: x_ * torch.rsqrt(x_.pow(2).mean(-1, keepdim=True) + eps)
           * w_}
    if hasattr(F, "rms_norm"):
        ref["F.rms_norm"] = lambda x_, w_: F.rms_norm(x_, (d,), w_, eps)
    return _fwd_bwd_spec(f"{r}x{d}", _norm_bytes(r, d, x.element_size(), bwd, 1),
                         lambda x_, w_: nm.rms_norm(x_, w_, eps), ref, [x, w], "xw", dy, bwd)


def case_pack(K, dt, sz: Sizes, dev: str, unpack: bool) -> Spec:
    # bytes: every element of the views read once and written once: 2 * total * sizeof(dtype)
    pk = K["_triton_pack"]
    m, side, tp = sz.pack
    mats = [torch.randn(side, side, device=dev, dtype=dt) for _ in range(m)]
    views = [v for mat in mats for v in pk.narrow_shards(mat, 1, tp)]
    total = sum(v.numel() for v in views)
    buf = torch.empty(total, device=dev, dtype=dt)
    offs = [0]
    for v in views:
        offs.append(offs[-1] + v.numel())
    slices = [buf[a:b].view(v.shape) for a, b, v in zip(offs, offs[1:], views)]
    shape = f"{m}x{side}x{side}, tp={tp}, {len(views)} views"
    nbytes = 2 * total * buf.element_size()

    def copy_pack():
        for v, sl in zip(views, slices):
            sl.copy_(v)

    def copy_unpack():
        for v, sl in zip(views, slices):
            v.copy_(sl)

    if not unpack:
        def check():
            got = pk.pack_views(views, out=torch.empty_like(buf)).clone()
            want = torch.cat([v.reshape(-1) for v in views])
            return [("buffer", got, want, None)]
        return Spec(shape=shape, bytes=nbytes, fused=_just(lambda: pk.pack_views(views, out=buf)),
                    torch={"copy_ per view": _just(copy_pack),
                           "torch.cat": _just(lambda: torch.cat([v.reshape(-1) for v in views],
                                                                out=buf))},
                    check=check)
    src = torch.randn(total, device=dev, dtype=dt)

    def check():
        target = [torch.zeros_like(mat) for mat in mats]
        tviews = [v for mat in target for v in pk.narrow_shards(mat, 1, tp)]
        pk.unpack_views(src, tviews)
        want = torch.cat([src[a:b].view(v.shape).reshape(-1)
                          for a, b, v in zip(offs, offs[1:], views)])
        got = torch.cat([v.reshape(-1) for v in tviews])
        return [("views", got, want, None)]

    def fused_unpack():
        buf.copy_(src)
        return lambda: pk.unpack_views(buf, views)

    return Spec(shape=shape, bytes=nbytes, fused=fused_unpack,
                torch={"copy_ per view": _just(copy_unpack)}, check=check)


def _fwd_and_bwd(case: Callable) -> list[tuple[str, Callable]]:
    return [("fwd", lambda *a: case(*a, bwd=False)), ("fwd+bwd", lambda *a: case(*a, bwd=True))]


def cases(kernel: str) -> list[tuple[str, Callable]]:
    """(pass, case function) of each requested kernel name."""
    return {
        "adamw": [("step", case_adamw)],
        "sgd": [("step", case_sgd)],
        "cross_entropy": _fwd_and_bwd(case_xent),
        "bias_gelu": _fwd_and_bwd(case_bias_gelu),
        "swiglu": _fwd_and_bwd(case_swiglu),
        "layer_norm": _fwd_and_bwd(case_layer_norm),
        "rms_norm": _fwd_and_bwd(case_rms_norm),
        "pack_views": [("pack", lambda *a: case_pack(*a, unpack=False)),
                       ("unpack", lambda *a: case_pack(*a, unpack=True))],
    }[kernel]


# ---- running one row ----------------------------------------------------------------------
def _err(e: BaseException) -> str:
    lines = traceback.format_exception_only(type(e), e)
    text = " ".join(x.strip() for x in lines)
    return text[:500]


def _errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    got, ref = got.detach().float().reshape(-1), ref.detach().float().reshape(-1).to(got.device)
    if got.shape != ref.shape:
        raise ValueError(f"fused result has {got.numel()} elements, reference {ref.numel()}")
    if got.numel() == 0:
        return 0.0, 0.0
    max_abs = (got - ref).abs().max().item()
    scale = ref.abs().max().item()
    return max_abs, (max_abs / scale if scale > 0 else max_abs)


def check_row(row: dict, spec: Spec, tol: float) -> None:
    outs = spec.check()
    worst, worst_torch = None, None
    for name, got, ref, nat in outs:
        a, r = _errors(got, ref)
        if worst is None or not (r <= worst[2]):   # NaN counts as worst
            worst = (name, a, r)
        if nat is not None:
            _, tr = _errors(nat, ref)
            worst_torch = tr if worst_torch is None or tr > worst_torch else worst_torch
    del outs
    row["worst_output"], row["max_abs_err"], row["max_rel_err"] = worst
    row["torch_rel_err"] = worst_torch
    row["tol"] = tol
    row["ok"] = bool(worst[2] <= tol)


def run_row(row: dict, spec: Spec, timer: Timer, copy_gbps: float | None, tol: float) -> None:
    row["shape"], row["bytes"], row["note"] = spec.shape, spec.bytes, spec.note
    t0 = time.perf_counter()
    try:
        check_row(row, spec, tol)   # the first fused call: includes Triton's JIT compile
    except Exception as e:  # noqa: BLE001 - recorded in the row
        row["ok"] = False
        row["check_error"] = _err(e)
    try:
        timer.sync()
    finally:
        row["check_s"] = time.perf_counter() - t0
    try:
        fn = spec.fused()
        timer.first_call(fn)
        row["fused_ms"] = timer.median_s(fn) * 1e3
    except Exception as e:  # noqa: BLE001
        row["fused_error"] = _err(e)
    fn = None
    for name, make in spec.extra.items():
        try:
            fn = make()
            timer.first_call(fn)
            row.setdefault("fused_variants_ms", {})[name] = timer.median_s(fn) * 1e3
        except Exception as e:  # noqa: BLE001
            row.setdefault("fused_variants_ms", {})[name] = _err(e)
        fn = None
    row["torch_ms"] = {}
    for name, make in spec.torch.items():
        try:
            fn = make()
            timer.first_call(fn)
            row["torch_ms"][name] = timer.median_s(fn) * 1e3
        except Exception as e:  # noqa: BLE001
            row["torch_ms"][name] = _err(e)
        fn = None
        gc.collect()
    row["baseline"] = next(iter(spec.torch))
    fused = row.get("fused_ms")
    if isinstance(fused, float) and fused > 0:
        row["speedup"] = {k: v / fused for k, v in row["torch_ms"].items()
                          if isinstance(v, float)}
        row["GBps"] = spec.bytes / (fused / 1e3) / 1e9
        if copy_gbps:
            row["frac_copy_bw"] = row["GBps"] / copy_gbps


# ---- output -------------------------------------------------------------------------------
def _clean(x):
    """JSON without NaN/inf (written as strings)."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_json(path: str | None, report: dict) -> None:
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(_clean(report), f, indent=1)
    os.replace(tmp, path)


def _fmt(x, spec: str = ".3f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) else ("-" if x is None else str(x))


def markdown(report: dict) -> str:
    cb = report.get("copy_bandwidth") or {}
    how = "Triton interpreter, timings meaningless" if report["interpret"] else "CUDA events"
    lines = [f"device: {report['device']}; torch {report['torch']}, triton {report['triton']}; "
             f"copy bandwidth {_fmt(cb.get('GBps'), '.0f')} GB/s "
             f"({_fmt(cb.get('bytes_copied', 0) / 2**30, '.2f')} GiB copy_); "
             f"{how}; {report.get('elapsed_s', 0):.1f} s", "",
             "| kernel | dtype | pass | shape | fused ms | torch ms | speedup vs baseline | "
             "GB/s | of copy BW | max abs err | max rel err | torch rel err | ok | notes |",
             "|---|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in report["rows"]:
        torch_ms = "; ".join(f"{k}{' (base)' if k == r.get('baseline') else ''} "
                             f"{_fmt(v) if isinstance(v, float) else 'ERROR'}"
                             for k, v in (r.get("torch_ms") or {}).items())
        sp = (r.get("speedup") or {}).get(r.get("baseline"))
        notes = [r[k] for k in ("skipped", "error", "fused_error", "check_error") if r.get(k)]
        notes += [f"{k}: {v}" for k, v in (r.get("torch_ms") or {}).items()
                  if not isinstance(v, float)]
        for k, v in (r.get("fused_variants_ms") or {}).items():
            notes.append(f"fused {k} {_fmt(v)} ms")
        if isinstance(r.get("check_s"), float):
            notes.append(f"check incl. JIT {r['check_s']:.2f} s")
        if r.get("note"):
            notes.append(r["note"])
        if r.get("worst_output"):
            notes.append(f"worst output {r['worst_output']}")
        lines.append(
            f"| {r['kernel']} | {r['dtype']} | {r['pass']} | {r.get('shape', '-')} | "
            f"{_fmt(r.get('fused_ms'))} | {torch_ms or '-'} | "
            f"{_fmt(sp, '.2f') + 'x' if sp is not None else '-'} | {_fmt(r.get('GBps'), '.0f')} | "
            f"{_fmt(r.get('frac_copy_bw'), '.2f')} | {_fmt(r.get('max_abs_err'), '.2e')} | "
            f"{_fmt(r.get('max_rel_err'), '.2e')} | {_fmt(r.get('torch_rel_err'), '.2e')} | "
            f"{'yes' if r.get('ok') else 'NO'} | "
            f"{' / '.join(str(n).replace('|', '/') for n in notes)} |")
    return "\n".join(lines)


# ---- main ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the report here (rewritten after every row)")
    ap.add_argument("--markdown", help="write the markdown table here")
    ap.add_argument("--kernels", default=",".join(KERNELS),
                    help=f"comma-separated subset of {','.join(KERNELS)}")
    ap.add_argument("--dtypes", default="bfloat16,float32,float16",
                    help="comma-separated, in run order (bfloat16 only on CUDA)")
    ap.add_argument("--quick", action="store_true",
                    help="smaller sizes (required without CUDA: tiny sizes, Triton interpreter)")
    ap.add_argument("--budget-s", type=float, default=95.0,
                    help="skip rows that would start after this many seconds (from start)")
    ap.add_argument("--rep-ms", type=float, default=25.0, help="timed milliseconds per variant")
    args = ap.parse_args(argv)
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [k for k in kernels if k not in KERNELS] + [d for d in dtypes if d not in DTYPES]
    if bad:
        ap.error(f"unknown kernel/dtype {bad}; kernels: {KERNELS}, dtypes: {list(DTYPES)}")
    if not CUDA and not args.quick:
        print("no CUDA device: running --quick on the CPU under the Triton interpreter",
              file=sys.stderr)
        args.quick = True

    import triton

    dev = "cuda" if CUDA else "cpu"
    report: dict = {
        "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if CUDA else f"cpu ({platform.processor()})",
        "cuda": CUDA, "interpret": os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        "args": vars(args), "tolerances": TOL, "copy_bandwidth": None, "rows": [],
    }
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        run(report, args, kernels, dtypes, dev)
    except KeyboardInterrupt:
        report["interrupted"] = True
    finally:
        report["elapsed_s"] = time.perf_counter() - T_START
        write_json(args.json, report)
        table = markdown(report)
        print(table)
        if args.markdown:
            Path(args.markdown).write_text(table + "\n")
    return report


def run(report: dict, args, kernels: list[str], dtypes: list[str], dev: str) -> None:
    sz = sizes_for(CUDA, args.quick)
    timer = Timer(CUDA, args.rep_ms)
    try:
        report["copy_bandwidth"] = copy_bandwidth(timer, dev, sz.copy_bytes)
    except Exception as e:  # noqa: BLE001
        report["copy_bandwidth"] = {"error": _err(e)}
    copy_gbps = report["copy_bandwidth"].get("GBps")
    t = time.perf_counter()
    K = load_kernel_modules()
    report["kernel_import_s"] = time.perf_counter() - t
    print(f"# {report['device']}, torch {report['torch']}, triton {report['triton']}, copy "
          f"{_fmt(copy_gbps, '.0f')} GB/s; start {time.perf_counter() - T_START:.1f} s",
          file=sys.stderr)
    lost = None
    for dname in dtypes:           # dtype-major: a budget cut drops whole dtypes, last first
        for kernel in kernels:
            for pas, fn in cases(kernel):
                row = {"kernel": kernel, "dtype": dname, "pass": pas}
                report["rows"].append(row)
                elapsed = time.perf_counter() - T_START
                if lost:
                    row["skipped"] = f"CUDA context lost earlier: {lost}"
                elif dname == "bfloat16" and not CUDA:
                    row["skipped"] = ("bfloat16 runs only on CUDA (the interpreter computes it "
                                      "wrongly)")
                elif elapsed > args.budget_s:
                    row["skipped"] = (f"time budget: {elapsed:.0f} s > --budget-s "
                                      f"{args.budget_s:.0f}")
                else:
                    t0 = time.perf_counter()
                    try:
                        spec = fn(K, DTYPES[dname], sz, dev)
                        run_row(row, spec, timer, copy_gbps, TOL[dname])
                    except Exception as e:  # noqa: BLE001
                        row["error"] = _err(e)
                    spec = None
                    gc.collect()
                    if CUDA:
                        try:
                            torch.cuda.synchronize()
                            torch.cuda.empty_cache()
                        except Exception as e:  # noqa: BLE001
                            lost = f"{kernel} {dname} {pas}: {_err(e)}"
                            row.setdefault("error", lost)
                    row["row_s"] = time.perf_counter() - t0
                    print(f"  {kernel:13s} {dname:8s} {pas:7s} {row['row_s']:5.1f} s  fused "
                          f"{_fmt(row.get('fused_ms'))} ms  ok={row.get('ok')}"
                          f"{'  ' + row['error'] if row.get('error') else ''}", file=sys.stderr)
                report["elapsed_s"] = time.perf_counter() - T_START
                write_json(args.json, report)


def failures(report: dict) -> list[str]:
    """One line per failed row (an error in the check, the fused timing, a fused variant or a
    torch baseline, or ``ok`` false) and one if the run was interrupted; empty if all is right."""
    bad = ["run interrupted before every row ran"] if report.get("interrupted") else []
    for r in (r for r in report["rows"] if "skipped" not in r or "error" in r):
        errors = [f"{k}: {r[k]}" for k in ("error", "check_error", "fused_error") if k in r]
        errors += [f"{kind} {name}: {v}" for kind in ("fused_variants_ms", "torch_ms")
                   for name, v in r.get(kind, {}).items() if isinstance(v, str)]
        if r.get("ok") is not True and not errors:
            errors.append(f"max rel err {r.get('max_rel_err')} > tol {r.get('tol')}")
        bad += [f"{r['kernel']} {r['dtype']} {r['pass']}: {e.splitlines()[0][:300]}"
                for e in errors]
    return bad


if __name__ == "__main__":
    _report = main()
    _skipped = sorted({r["skipped"] for r in _report["rows"] if "skipped" in r})
    if _skipped:
        print(f"skipped, not failures: {_skipped}", file=sys.stderr)
    for _line in failures(_report):
        print(f"FAILED {_line}", file=sys.stderr)
    sys.exit(1 if failures(_report) else 0)
