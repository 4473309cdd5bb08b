"""Issue 20, point 1: ``precision="bf16"`` (FSDP2's param_dtype=bf16, reduce_dtype=fp32) on a step
written in fp32, against the same policy written by hand in eager PyTorch: 16-bit copies of the
fp32 parameters through ``torch.func.functional_call``, the model's input cast to 16 bits,
AdamW on the fp32 masters.

Tolerance: none. The traced step replays the same aten ops in the same order as the
hand-written policy, so losses and parameters are bit-equal after three steps.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import meshplan
from meshplan._errors import TraceError
from meshplan.frontend._precision import precision
from meshplan.planner._problem import reduce_wide

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_autocast import _program  # noqa: E402


def _user(loss_fn=None):
    """The step as written: fp32 throughout (a 64-256-64 GELU MLP, AdamW)."""
    return _program(None, None) if loss_fn is None else _program(None, None, loss_fn=loss_fn)


def _by_hand(dtype: torch.dtype):
    """The policy written by hand: compute copies, the input cast, fp32 master weights."""
    def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        copies = {n: p.to(dtype) for n, p in model.named_parameters()}
        return torch.func.functional_call(model, copies, (x.to(dtype),))

    return _program(None, None, forward=forward)


def _batches(n: int = 3, rows: int = 32):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 64, generator=g), torch.randn(rows, 64, generator=g))
            for _ in range(n)]


@pytest.mark.parametrize(("name", "dtype", "loss_fn"), [
    ("bf16", torch.bfloat16, None), ("fp16", torch.float16, None),
    ("bf16", torch.bfloat16, nn.MSELoss()),        # a loss module: its target is not cast
], ids=["bf16", "fp16", "bf16-loss-module"])
def test_the_policy_replays_equal_to_it_written_by_hand(name, dtype, loss_fn) -> None:
    batches = _batches()
    m1, hand = _by_hand(dtype)
    m2, step = _user(loss_fn)
    with precision(name):
        traced = meshplan.trace(step, *batches[0])
    for x, y in batches:                  # the first call traces its graph after the context
        assert torch.equal(traced(x, y), hand(x, y))
    for (n, p), q in zip(m1.named_parameters(), m2.parameters()):
        assert p.dtype == q.dtype == torch.float32 and torch.equal(p, q), n
    graph = traced.graph
    mm = {n.meta.dtype for n in graph.nodes if str(n.target) in ("aten.addmm.default",
                                                                   "aten.mm.default")}
    assert mm == {str(dtype).removeprefix("torch.")}
    params = [n for n in graph.inputs if n.meta.role.value in ("param", "opt_state")]
    assert params and {n.meta.dtype for n in params} == {"float32"}    # masters and AdamW
    with pytest.raises(TraceError, match=r"precision='bf15'.*\['fp32', 'bf16', 'fp16'\]"):
        with precision("bf15"):
            pass


def test_a_data_parallel_plan_reduces_the_gradients_in_fp32() -> None:
    """The weight gradients' partial sums pass the cast to the fp32 masters and are all-reduced
    in fp32 (a run on a mesh: tests/dist/test_user_programs.py)."""
    x = torch.randn(512, 64)
    plan = meshplan.compile(_user()[1], x, x, mesh={"dp": 2}, strategy="dp", precision="bf16")
    wide = {name for name, _ in reduce_wide(plan.graph)}
    reduced = {r.value.split("[")[0] for r in plan.redistributions
               if any(c[0] == "all_reduce" for c in r.collectives)}
    assert wide and reduced and not wide & reduced


def test_gradients_are_cast_and_reduce_scattered_where_the_backward_makes_them() -> None:
    """The traced step lists the fp32 casts of the weight gradients after the whole backward;
    the planner moves each to right after its 16-bit gradient (``ir.hoist_casts``, bit-equal:
    the same ops on the same inputs), so under FSDP the lowering reduce-scatters each fp32
    gradient there and no 16-bit gradient lives, unreduced, through the rest of the backward
    (FSDP2's post-backward hook does the same)."""
    from meshplan.backends import lower
    from meshplan.backends._early import Drop
    from meshplan.backends._lower import Compute, Free, Reshard

    x = torch.randn(512, 64)
    plan = meshplan.compile(_user()[1], x, x, mesh={"dp": 2}, strategy="fsdp", precision="bf16")
    nodes = plan.graph.nodes
    at = {n.name: i for i, n in enumerate(nodes)}
    casts = [n for n in nodes if n.target == "aten._to_copy.default"
             and n.phase.value == "backward" and n.outputs[0].dtype == "float32"]
    assert casts
    for n in casts:                               # right after the gradient it casts
        src = next(n.refs()).node
        between = nodes[at[src] + 1:at[n.name]]
        assert all(m.target == "aten._to_copy.default" for m in between), n.name
    ins = lower(plan, 0).instructions
    made = {i.node.name: k for k, i in enumerate(ins) if isinstance(i, Compute)}
    scattered = [k for k, i in enumerate(ins) if isinstance(i, Reshard)
                 and i.steps[0].kind == "reduce_scatter" and i.ref.node in {c.name for c in casts}]
    weights = {c.name for c in casts if len(c.outputs[0].shape) == 2}
    assert weights and weights <= {ins[k].ref.node for k in scattered}
    for k in scattered:
        assert all(isinstance(i, (Free, Drop, Reshard)) for i in ins[made[ins[k].ref.node] + 1:k])
