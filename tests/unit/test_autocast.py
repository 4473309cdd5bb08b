"""Issue 20, point 1: a step written with ``torch.autocast("cuda", dtype=...)``, planned for GPUs on
a machine without CUDA (this one), is traced as a GPU would run it (``frontend/_autocast.py``):
its matmuls in the low dtype, priced at that dtype's FLOP rate with 2-byte activations.

Replay: the graph traced that way runs on the CPU equal, bit for bit, to eager PyTorch running
the same step under ``torch.autocast("cpu")`` with that dtype (the same casts, the same aten
kernels in the same order; three AdamW steps).
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshplan
from meshplan._compile import cuda_regions
from meshplan.frontend._autocast import autocast_for

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="tests the no-CUDA path")


def _program(device_type: str | None, dtype: torch.dtype | None, meta: bool = False,
             width: int = 64, forward=None, loss_fn=F.mse_loss):
    """The step, with its forward (``forward(model, x)``, default ``model(x)``) under
    ``torch.autocast(device_type, dtype)`` (None: none), then ``loss_fn(out.float(), y)``."""
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(x, y):
        with (torch.autocast(device_type, dtype=dtype) if device_type
              else contextlib.nullcontext()):
            out = model(x) if forward is None else forward(model, x)
        loss = loss_fn(out.float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return model, step


def _matmul_dtypes(graph) -> set[str]:
    return {n.meta.dtype for n in graph.nodes
            if str(n.target) in ("aten.addmm.default", "aten.mm.default")}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_cuda_region_replays_as_autocast_does(dtype) -> None:
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g))
               for _ in range(3)]
    m1, eager = _program("cpu", dtype)
    m2, step = _program("cuda", dtype)
    with autocast_for("cuda"):
        traced = meshplan.trace(step, *batches[0])
    # the first call traces the first-step graph now, after the context: the step keeps it
    for x, y in batches:
        assert torch.equal(traced(x, y), eager(x, y))
    assert traced.first_step_graph is not None
    for graph in (traced.graph, traced.first_step_graph):
        assert _matmul_dtypes(graph) == {str(dtype).removeprefix("torch.")}
    for (name, p), q in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(p, q), name
    # outside the context torch's own behaviour is back: the region is off, with its warning
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        plain = meshplan.trace(_program("cuda", dtype)[1], *batches[0]).graph
    assert _matmul_dtypes(plain) == {"float32"}
    assert any("CUDA is not available" in str(w.message) for w in said)


def test_a_gpu_plan_prices_the_region_in_bf16() -> None:
    """On the meta device (a model too big for this machine), for h100: the autocast step's
    matmuls are bf16, so its plan is faster and, with 32k tokens of activations, holds less
    than the same step in fp32 (fp32 master weights and a bf16 copy of each: more state);
    without a dtype, CUDA's default (float16). A CPU topology follows torch (the region is
    off)."""
    x = torch.empty(32768, 4096, device="meta")    # 32k tokens through a 4096-wide MLP

    def plan(device_type, dtype, topology="h100"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return meshplan.compile(_program(device_type, dtype, True, 4096)[1], x, x,
                                    mesh={"dp": 2}, topology=topology, strategy="dp")

    fp32, bf16 = plan(None, None), plan("cuda", torch.bfloat16)
    assert _matmul_dtypes(fp32.graph) == {"float32"}
    assert _matmul_dtypes(bf16.graph) == {"bfloat16"}
    assert bf16.compute_time_s < fp32.compute_time_s
    assert bf16.peak_memory_bytes < fp32.peak_memory_bytes
    assert _matmul_dtypes(plan("cuda", None).graph) == {"float16"}
    assert _matmul_dtypes(plan("cuda", torch.bfloat16, "cpu").graph) == {"float32"}
    assert cuda_regions("h100:fabric=200") == "cuda" and cuda_regions("cpu") is None


def test_gradients_under_autocast_are_reduced_in_fp32() -> None:
    """A bf16 matmul's weight gradient is cast to the fp32 parameter's dtype; on a
    data-parallel plan its partial sums pass the cast and are all-reduced in fp32, as one
    process accumulates them and as DDP reduces ``.grad``, never as 16-bit sums."""
    from meshplan.planner._problem import reduce_wide

    x = torch.randn(512, 64)
    plan = meshplan.compile(_program("cpu", torch.bfloat16)[1], x, x, mesh={"dp": 2},
                            strategy="dp")
    wide = {name for name, _ in reduce_wide(plan.graph)}
    reduced = {r.value.split("[")[0]: plan.graph.node(r.value.split("[")[0]).meta.dtype
               for r in plan.redistributions if any(c[0] == "all_reduce" for c in r.collectives)}
    assert wide and not wide & set(reduced), reduced
    grads = [n for n, dtype in reduced.items() if dtype == "float32" and n.startswith("to_copy")]
    assert len(grads) >= 3, reduced          # both weights' and a bias's gradient, in fp32
