"""Micro-batches (``distribute(microbatches=m)``, ``backends/_microbatch.py``): each rank runs
its batch in ``m`` parts, the gradients summed, the optimizer once, equal to the whole batch
at once.

Tolerances: the losses ``rtol=1e-5, atol=1e-6`` and the state ``1e-5``, as the mesh runs
without micro-batches (``test_distribute.py``): summing ``m`` partial gradients instead of one
matmul over the batch changes only the summation order (float32 rounding, ~1e-7 relative per
step), which AdamW amplifies to a few 1e-6 where the true gradient is near zero.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from test_distribute import check_equal_to_one_process  # noqa: E402
from test_lower import _example, _inputs, _plan, _reference  # noqa: E402

from meshplan.backends import ThreadMesh  # noqa: E402
from meshplan.backends._layout import assemble, rank_coords  # noqa: E402
from meshplan.backends._lower import split_inputs  # noqa: E402
from meshplan.backends._microbatch import (  # noqa: E402
    lower_microbatched,
    microbatch_plan,
    run_microbatched,
    split_microbatched,
)
from meshplan.planner import PlanError  # noqa: E402


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "axes", "strategy", "m"), [
    ("gpt", {"dp": 2}, "dp", 2),
    ("gpt-b16", {"dp": 2}, "fsdp", 4),
    ("gpt", {"dp": 2, "tp": 2}, "megatron_tp", 2),
], ids=["gpt-dp2-m2", "gpt-fsdp2-m4", "gpt-dp2tp2-m2"])
def test_microbatched_steps_equal_the_whole_batch(name, axes, strategy, m) -> None:
    """Three steps on a thread mesh against the single-process interpreter: every rank's loss
    each step, then the state. The micro-batch part of a rank's program holds no optimizer
    op and the step part no op that reads the batch; nll_loss's count is worked out first."""
    ex, traced = _example(name)
    graph = traced.graph
    plan = _plan(name, axes, strategy)
    mb = microbatch_plan(plan, m)
    world = int(torch.tensor(plan.mesh.sizes).prod())
    programs = [lower_microbatched(mb, r) for r in range(world)]
    p0 = programs[0]
    assert len(p0.parts) == m and len(p0.hoisted) == 1 and p0.partials
    update = {n.name for n in graph.nodes if n.phase.value == "update"}
    assert not any(getattr(i, "node", None) is not None and i.node.name in update
                   for i in p0.parts[0].instructions)
    assert "x" not in p0.step.input_nodes.values()
    full = {n.target: t.clone() for n, t in zip(graph.inputs, _inputs(traced, ex))}
    state_names = [n.target for n in graph.inputs if n.meta.role.value != "data"]
    reference, ref_state = _reference(name)
    local = [split_inputs(plan, r, {k: full[k] for k in state_names}) for r in range(world)]
    mesh = ThreadMesh(world, timeout_s=60)
    for step in range(3):
        batch = dict(zip([n.target for n in graph.inputs if n.meta.role.value == "data"],
                         ex.batch(step + 2)))

        def one(comm, batch=batch):
            r = comm.rank
            return run_microbatched(programs[r], comm, local[r], split_microbatched(mb, r, batch))

        got = mesh.run(one)
        for r in range(world):
            local[r] = {**local[r], **got[r][1]}
            for g, w in zip(got[r][0], reference[step]):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    sizes = plan.mesh.sizes
    for k in state_names:
        whole = assemble({rank_coords(r, sizes): local[r][k] for r in range(world)},
                         plan.input_layouts[k], sizes)
        torch.testing.assert_close(whole, ref_state[k], rtol=1e-5, atol=1e-5, msg=k)


@pytest.mark.timeout(300)
def test_distribute_with_microbatches_equals_one_process() -> None:
    """Local processes, ``distribute(microbatches=2)``: losses every step, parameters and AdamW
    state after the steps, as one process (``check_equal_to_one_process``'s tolerances)."""
    check_equal_to_one_process("gpt", {"dp": 2}, "dp", microbatches=2)


def test_what_cannot_run_in_microbatches_is_refused_by_name() -> None:
    # batch norm: its statistics are the whole batch's, so no micro-batch can go on alone
    plan = _plan("cnn", {"dp": 2}, "dp")
    with pytest.raises(PlanError, match=r"micro-batches: .*cnn.py:\d+.*microbatches=1"):
        lower_microbatched(microbatch_plan(plan, 2), 0)
    plan = _plan("gpt", {"dp": 2}, "dp")            # 4 sequences: 2 per rank
    with pytest.raises(PlanError, match=r"microbatches=4: input 'x' of shape \[4, 16\] gives "
                                        r"each rank 2 rows.*divisor of 2"):
        microbatch_plan(plan, 4)
    for bad in (0, 1.5, True):
        with pytest.raises(PlanError, match="positive int"):
            microbatch_plan(plan, bad)
    # mse_loss's mean: its backward divides by the count it sees
    plan = _plan("mlp-sgd", {"dp": 2}, "dp")
    with pytest.raises(PlanError, match=r"mlp.py:\d+.*reduction='mean'.*microbatches=1"):
        lower_microbatched(microbatch_plan(plan, 2), 0)
    import meshplan

    with pytest.raises(meshplan.RuntimeFailure, match=r"microbatches=2, calibrate=True"):
        meshplan.distribute(lambda x: x, mesh={"dp": 2}, microbatches=2, calibrate=True)
    with pytest.raises(meshplan.RuntimeFailure, match=r"distribute\(microbatches=0"):
        meshplan.distribute(lambda x: x, mesh={"dp": 2}, microbatches=0)


@pytest.mark.timeout(300)
def test_a_user_step_in_microbatches_equals_one_process() -> None:
    """A step written for one process (an MLP, ``mse_loss(reduction="sum") / batch``, SGD
    with momentum, the automatic plan) in 4 parts on 2 ranks: losses and parameters as one
    process. Its backward's seed, ``ones_like(loss)``, reads the loss's shape only, so the
    micro-batches need no sum of the loss before their backward."""
    import copy

    import meshplan

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    twin = copy.deepcopy(model)

    def make(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

        def step(x, y):
            loss = torch.nn.functional.mse_loss(model(x), y, reduction="sum") / x.shape[0]
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step

    one = make(twin)
    mesh = meshplan.distribute(make(model), mesh={"dp": 2}, microbatches=4, telemetry=False)
    g = torch.Generator().manual_seed(1)
    with mesh:
        for i in range(4):
            x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
            torch.testing.assert_close(mesh(x, y).detach(), one(x, y).detach(), rtol=1e-5,
                                       atol=1e-6, msg=f"loss at step {i}")
        mesh.sync()
    for (k, a), b in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-5, msg=k)
