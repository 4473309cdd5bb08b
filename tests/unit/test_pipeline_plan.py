"""Pipeline stages in the planner (``planner/_pipeline.py``; issue 24, planning only).

- The schedules' closed forms against running their per-device op orders event by event: equal
  for equal stages (GPipe and 1F1B ``(m + p - 1) t``, interleaved ``(m + (p - 1) / v) t``,
  ZB-H1 ``m t + (p - 1) f``, the bubbles of Narayanan et al. 2021 and Qi et al. 2023), and
  GPipe's for any stages; the simulation also checks that each device runs every op once and
  never two at a time.
- The units of a traced GPT conserve the inner plan's cost (their times sum to its compute and
  communication to 1e-9 relative: each cost is charged once), every layer alike, the optimizer
  state with its parameter.
- Stage splits: even on a uniform model, moved by a memory limit, and a plan that cannot fit
  says so; bad input (more stages than layers, micro-batches that do not divide the batch, an
  unknown schedule, a model without repeated layers) gets one error naming the fix; and
  ``plan_graph`` / ``distribute`` refuse a ``pp`` axis by name instead of treating it as one
  more data axis.
"""

from __future__ import annotations

import pytest

import meshplan
from meshplan.examples import gpt, mlp
from meshplan.planner import PlanError, plan_graph
from meshplan.planner._pipeline import (
    PRE, POST, SCHEDULES, device_orders, in_flight, pipeline_time, plan_pipeline, simulate,
    units_of,
)

CONFIG = gpt.GPTConfig(n_layer=4, d_model=32, n_head=2, seq_len=16, vocab_size=64,
                       batch_size=8)


@pytest.fixture(scope="module")
def graph():
    ex = gpt.build(config=CONFIG, optimizer="adamw", clip=1.0)
    return meshplan.trace(ex.step, *ex.batch(0)).graph


CASES = [(s, p, m, v) for s in SCHEDULES for p, m, v in
         ((2, 4, 1), (4, 8, 1), (3, 7, 1), (4, 4, 2), (4, 8, 2), (8, 16, 4), (2, 2, 1))
         if (v > 1) == (s == "interleaved") and (s != "interleaved" or m % p == 0)]


@pytest.mark.parametrize(("schedule", "p", "m", "v"), CASES,
                         ids=[f"{s}-p{p}-m{m}-v{v}" for s, p, m, v in CASES])
def test_closed_forms_are_the_simulated_schedules_for_equal_stages(schedule, p, m, v) -> None:
    f, b = 1.0, 2.0
    span, timeline = simulate(schedule, [f] * p, [b] * p, m, v)
    assert pipeline_time(schedule, [f] * p, [b] * p, m, v) == pytest.approx(span, rel=1e-12)
    published = {"gpipe": (m + p - 1) * (f + b), "1f1b": (m + p - 1) * (f + b),
                 "interleaved": (m + (p - 1) / v) * (f + b),
                 "zb-h1": m * (f + b) + (p - 1) * (f + b / 2 - b / 2)}[schedule]
    assert span == pytest.approx(published, rel=1e-12)
    orders = device_orders(schedule, p, m, v)
    for d, events in enumerate(timeline):
        assert len(events) == len(orders[d]) == len(set(orders[d]))   # every op once
        for (_, end, _), (start, _, _) in zip(events, events[1:]):
            assert start >= end - 1e-12                               # one at a time
    per_mb = 3 if schedule == "zb-h1" else 2
    assert sum(len(o) for o in orders) == per_mb * p * v * m


def test_gpipe_closed_form_holds_for_unequal_stages_and_the_others_come_close() -> None:
    fwd, bwd = [1.0, 0.5, 1.5, 0.8], [2.2, 1.0, 2.9, 1.7]
    for schedule in SCHEDULES:
        m, v = 8, (2 if schedule == "interleaved" else 1)
        span = simulate(schedule, fwd, bwd, m, v)[0]
        form = pipeline_time(schedule, fwd, bwd, m, v)
        if schedule == "gpipe":
            assert form == pytest.approx(span, rel=1e-12)
        else:                   # the reason the planner simulates its best candidates
            assert form == pytest.approx(span, rel=0.15)


def test_activations_in_flight_per_schedule() -> None:
    assert [in_flight("gpipe", s, 4, 8) for s in range(4)] == [8, 8, 8, 8]
    assert [in_flight("1f1b", s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight("zb-h1", s, 4, 2) for s in range(4)] == [2, 2, 2, 1]
    # Megatron's interleaved schedule: the first device holds p (1 + (p - 1) / (p v))
    assert in_flight("interleaved", 0, 4, 8, 2) == pytest.approx(4 * (1 + 3 / 8))
    # ... but never more than every micro-batch it runs (a user saw 5.5 of 4 in flight)
    assert in_flight("interleaved", 0, 4, 4, 2) == 4


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_units_conserve_the_inner_plan_and_layers_are_alike(graph, strategy) -> None:
    inner = plan_graph(graph, {"dp": 2}, topology="h100", strategy=strategy)
    units, crossing = units_of(inner)
    names = [u.name for u in units]
    assert names[0] == PRE and names[-1] == POST and len(names) == CONFIG.n_layer + 2
    total = sum(u.fwd_s + u.bwd_s + u.fixed_fwd_s + u.fixed_bwd_s + u.update_s for u in units)
    assert total == pytest.approx(inner.compute_time_s + inner.comm_time_s, rel=1e-9)
    layers = units[1:-1]
    for u in layers[1:]:
        assert u.state_bytes == layers[0].state_bytes > 0
        assert u.act_bytes == layers[0].act_bytes > 0
        assert u.fwd_s == pytest.approx(layers[0].fwd_s, rel=1e-9)
    # the tied embedding and its Adam moments sit with its first use, before the layers; after
    # them only the final norm's (the head is the embedding)
    assert units[0].state_bytes > units[-1].state_bytes > 0
    assert len(crossing) == len(units) - 1 and min(crossing) > 0


@pytest.mark.parametrize(("mesh", "per_stage"), [({"pp": 2, "dp": 2}, 2), ({"pp": 4}, 1)])
def test_a_uniform_model_splits_evenly(graph, mesh, per_stage) -> None:
    plan = plan_pipeline(graph, mesh, topology="h100")
    assert plan.fits and plan.schedule in SCHEDULES and plan.tried
    for s in plan.stages:
        assert sum(u not in (PRE, POST) for u in s.units) == per_stage
    assert PRE in plan.stages[0].units and POST in plan.stages[-1].units
    assert plan.estimated_step_time_s == min(t.step_time_s for t in plan.tried if t.fits)
    text = plan.summary() + "\n" + plan.schedule_text()
    assert text.count("stage ") >= 2 * len(plan.stages)


def test_gpipe_holds_every_micro_batch_and_a_tight_limit_says_it_does_not_fit(graph) -> None:
    free = plan_pipeline(graph, {"pp": 2}, topology="h100", schedule="gpipe", microbatches=4)
    onef = plan_pipeline(graph, {"pp": 2}, topology="h100", schedule="1f1b", microbatches=4)
    assert free.stages[0].in_flight == 4 and onef.stages[0].in_flight == 2
    assert onef.peak_memory_bytes < free.peak_memory_bytes
    # the same time in the closed form; run event by event on these unequal stages (the
    # first holds the embedding, the last the head and loss) they differ by well under 2 %
    assert onef.estimated_step_time_s == pytest.approx(free.estimated_step_time_s, rel=0.02)
    # between the two peaks: automatic planning must not pick GPipe
    limit = int((onef.peak_memory_bytes + free.peak_memory_bytes) / 2)
    got = plan_pipeline(graph, {"pp": 2}, topology="h100", microbatches=4,
                        memory_limit_bytes=limit)
    assert got.fits and got.schedule != "gpipe"
    # nothing fits: the best plan's peak, where and why, and what was tried
    with pytest.raises(PlanError, match=r"fits 2.00 KiB per device on pp=2 .* needs .* on "
                                        r"stage \d \(misses by .* in flight\)\. Tried"):
        plan_pipeline(graph, {"pp": 2}, topology="h100", memory_limit_bytes=2 << 10)


def test_bad_input_is_named(graph) -> None:
    with pytest.raises(PlanError, match=r"pp=8 .* 4\) *; use pp=4|more pipeline stages"):
        plan_pipeline(graph, {"pp": 8}, topology="h100")
    with pytest.raises(PlanError, match=r"interleaved 1F1B on pp=4 holds 2 chunks of at least "
                       r"one layer per device \(8 layers\), and .* has 4: use "
                       r"schedule='1f1b' \(one chunk per device\), or pp=2 or fewer"):
        plan_pipeline(graph, {"pp": 4}, topology="h100", schedule="interleaved")
    with pytest.raises(PlanError, match="microbatches=3 does not divide"):
        plan_pipeline(graph, {"pp": 2}, topology="h100", microbatches=3)
    with pytest.raises(PlanError, match="schedule 'zb-v'"):
        plan_pipeline(graph, {"pp": 2}, topology="h100", schedule="zb-v")
    with pytest.raises(PlanError, match="needs a 'pp' mesh axis"):
        plan_pipeline(graph, {"dp": 2}, topology="h100")
    ex = mlp.build(optimizer="sgd")
    flat = meshplan.trace(ex.step, *ex.batch(0)).graph
    with pytest.raises(PlanError, match="no repeated layers"):
        plan_pipeline(flat, {"pp": 2}, topology="h100")


def test_plan_graph_refuses_a_pp_axis_and_distribute_what_stages_lack(graph,
                                                                      monkeypatch) -> None:
    """``plan_graph`` makes one mesh's layouts, no stages: it names ``plan_pipeline``.
    ``distribute`` runs stages, and refuses by name what they do not do yet, and one-sided
    stage transfers off MPI before any rank starts."""
    with pytest.raises(PlanError, match="plan_pipeline"):
        plan_graph(graph, {"pp": 2, "dp": 2}, topology="h100")
    ex = gpt.build(config=CONFIG)
    for kw, what in (({"fault_tolerance": True}, "snapshots and recovery of pipeline"),
                     ({"elastic": True}, "drop elastic="),
                     ({"calibrate": True}, "calibrate a run without 'pp'"),
                     ({"plan": plan_graph(graph, {"dp": 2})}, "not a pipeline's stages"),
                     ({"plan": "x.plan"}, "x.plan"),
                     ({"schedule": "zb-v"}, "the stages run 'gpipe' or '1f1b' or "
                                            "'interleaved' or 'zb-h1'")):
        with pytest.raises(meshplan.RuntimeFailure, match=what):
            meshplan.distribute(ex.step, mesh={"pp": 2}, **kw)
    step = meshplan.distribute(ex.step, mesh={"pp": 2})        # the default: off, and said
    assert not step.fault_tolerance and "pipeline stages are not built" in \
        step.fault_tolerance_note
    monkeypatch.setenv("MESHPLAN_STAGE_TRANSFERS", "rma")
    with pytest.raises(meshplan.RuntimeFailure, match=r"=rma .* needs launcher='mpi'.* "
                                                      r"launcher is 'local'"):
        meshplan.distribute(ex.step, mesh={"pp": 2}, example_inputs=ex.batch(0)).plan
    plan_graph(graph, {"pp": 1, "dp": 2}, topology="h100")      # one stage: an ordinary mesh


def test_gathered_parameters_are_kept_through_the_step_unless_they_do_not_fit(graph) -> None:
    """FSDP layouts inside the stages: gathering each stage's parameters once a step and
    keeping them is faster than gathering them for every micro-batch, and takes more memory;
    where the kept copies do not fit, the copies gathered again do."""
    from meshplan.planner import Mesh
    from meshplan.planner._pipeline import _price

    inner = plan_graph(graph, {"dp": 2}, topology="h100", strategy="fsdp")
    units, crossing = units_of(inner)
    assert sum(u.kept_bytes for u in units) > 0 and sum(u.fixed_fwd_s for u in units) > 0
    mesh = Mesh({"pp": 2, "dp": 2}, "h100")
    args = (mesh, inner, units, crossing, 2, "1f1b", 4, 1)
    link = mesh.link(0)
    keep = _price(*args, 1 << 40, link, keep=True)
    again = _price(*args, 1 << 40, link, keep=False)
    assert keep.estimated_step_time_s < again.estimated_step_time_s
    assert again.peak_memory_bytes < keep.peak_memory_bytes
    limit = int((again.peak_memory_bytes + keep.peak_memory_bytes) / 2)
    assert not _price(*args, limit, link, keep=True).fits
    tight = _price(*args, limit, link, keep=False)
    assert tight.fits and "again for every micro-batch" in tight.summary()


def test_the_transfer_check_finds_an_order_that_waits_forever_or_crosses_values() -> None:
    """``_check_order`` runs the stages' transfers on paper in the schedule's order: a receive
    no send can satisfy in that order is a wait forever, and a receive that would take
    another value than its program reads is refused too; the plain chain passes."""
    from meshplan.backends._pipeline_run import _check_order
    from meshplan import LoweringError

    x, g, y = ("x", 0, None), ("g", 0, None), ("y", 0, None)
    F, B = ("F", 0), ("B", 0)
    chain = [{F: [("S", 1, 1, x)], B: [("R", 1, 2, g)], "S": []},
             {F: [("R", 0, 1, x)], B: [("S", 0, 2, g)], "S": []}]
    for schedule in ("gpipe", "1f1b"):
        _check_order(schedule, "step", 2, 4, 1, chain)
    # interleaved, 2 chunks per device: the activations go round (device 1's first chunk to
    # device 0's second) and the gradients back, each part's with its own tag
    F1, B1 = ("F", 1), ("B", 1)
    ring = [{F: [("S", 1, 1, x)], F1: [("R", 1, 4, y), ("S", 1, 7, y)],
             B1: [("R", 1, 11, g), ("S", 1, 8, g)], B: [("R", 1, 5, g)], "S": []},
            {F: [("R", 0, 1, x), ("S", 0, 4, y)], F1: [("R", 0, 7, y)],
             B1: [("S", 0, 11, g)], B: [("R", 0, 8, g), ("S", 0, 5, g)], "S": []}]
    _check_order("interleaved", "step", 2, 4, 2, ring)
    # stage 1's backward waits for a value stage 0 makes only after it has heard from it
    cycle = [{F: [("S", 1, 1, x)], B: [("R", 1, 2, g), ("S", 1, 2, y)], "S": []},
             {F: [("R", 0, 1, x)], B: [("R", 0, 2, y), ("S", 0, 2, g)], "S": []}]
    with pytest.raises(LoweringError, match=r"'gpipe': the stages would wait for each other "
                       r"forever in 'step' \(stage 0 waits in micro-batch 0's backward for g "
                       r"from stage 1; stage 1 waits in micro-batch 0's backward for y"):
        _check_order("gpipe", "step", 2, 2, 1, cycle)
    # two values sent in one order and read in the other
    crossed = [{F: [("S", 1, 1, x), ("S", 1, 1, y)], B: [], "S": []},
               {F: [("R", 0, 1, y), ("R", 0, 1, x)], B: [], "S": []}]
    with pytest.raises(LoweringError, match="stage 1 would take x that stage 0 sent in "
                       "micro-batch 0's forward for y in micro-batch 0's forward"):
        _check_order("1f1b", "step", 2, 2, 1, crossed)


def test_the_parents_code_between_layers_goes_with_the_layer_it_follows() -> None:
    """``x = torch.relu(block(x))`` in the parent's forward: the activation and its backward
    are the parent module's ops, yet they belong with the block whose output they read (the
    head's unit would put them on the last stage, every layer's output going there and back);
    the loss and the ops after the last layer stay with the head."""
    import torch

    from meshplan.planner._pipeline import unit_map

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = torch.nn.Linear(8, 16)
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
            self.out = torch.nn.Linear(16, 4)

        def forward(self, x):
            x = self.inp(x)
            for block in self.blocks:
                x = torch.relu(block(x))
            return self.out(x)

    model = Wrapped()
    train_step = _sgd_mse_step(model)

    g = meshplan.trace(train_step, torch.randn(4, 8), torch.randn(4, 4)).graph
    order, unit = unit_map(g)
    assert order == [PRE, "model.blocks.0", "model.blocks.1", "model.blocks.2", POST]
    relus = [n for n in g.nodes if "relu" in n.name or "threshold_backward" in n.name]
    assert len(relus) == 6
    # the last relu comes after the last layer's ops, and its backward before any layer's:
    # both stay with the head (the last stage, where the last block runs too)
    for phase in ("forward", "backward"):
        assert sorted(unit[n.name] for n in relus if n.phase.value == phase) == [
            POST, "model.blocks.0", "model.blocks.1"], phase
    assert unit[next(n.name for n in g.nodes if "mse_loss" in n.name)] == POST

    # one LayerNorm of the parent applied after every block: in each gap it runs with the
    # block it follows, forward and backward (with its parameters' unit, the head's, every
    # gap's norm ran on the last stage and 1F1B waited forever); its state stays one unit's
    class SharedNorm(Wrapped):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.LayerNorm(16)

        def forward(self, x):
            x = self.inp(x)
            for block in self.blocks:
                x = self.norm(x + block(x))
            return self.out(x)

    g = meshplan.trace(_sgd_mse_step(SharedNorm()), torch.randn(4, 8), torch.randn(4, 4)).graph
    _, unit = unit_map(g)
    for phase in ("forward", "backward"):
        assert sorted(unit[n.name] for n in g.nodes if "native_layer_norm" in n.name
                      and n.phase.value == phase) == [
            POST, "model.blocks.0", "model.blocks.1"], phase
    assert {unit[n.name] for n in g.inputs if ".norm." in n.target} == {POST}

    # a parameter of the model itself read before the first layer (a learned position
    # table: h = self.inp(x) + self.pos) goes with the embedding side, its update and its
    # optimizer state too; one read only after the last layer stays with the head (a user's
    # trial: with the table on the last stage, interleaved 1F1B's first chunk waited for it)
    class Positions(Wrapped):
        def __init__(self) -> None:
            super().__init__()
            self.pos = torch.nn.Parameter(torch.zeros(16))
            self.scale = torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            x = self.inp(x) + self.pos
            for block in self.blocks:
                x = block(x)
            return self.out(x) * self.scale

    model = Positions()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def adam_step(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    adam_step(torch.randn(4, 8), torch.randn(4, 4))
    g = meshplan.trace(adam_step, torch.randn(4, 8), torch.randn(4, 4)).graph
    _, unit = unit_map(g)
    of = lambda name: [unit[n.name] for n in g.inputs                       # noqa: E731
                       if n.target.endswith(name) or f".{name}." in n.target]
    # the parameter, Adam's two moments and its step count
    assert of("pos") == [PRE] * 4 and of("scale") == [POST] * 4

    # zero_grad() first keeps the gradients, and clip_grad_norm_ makes their kept value in
    # the update (the gradient times the clipping coefficient): each is kept where that
    # product is made, its layer's unit (a user's trial: a KeyError, on every pp mesh)
    model = Wrapped()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def clipped(x, y):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    clipped(torch.randn(4, 8), torch.randn(4, 4))
    g = meshplan.trace(clipped, torch.randn(4, 8), torch.randn(4, 4)).graph
    _, unit = unit_map(g)
    grads = {n.target: unit[n.name] for n in g.inputs if n.target.endswith(".grad")}
    assert grads["model.blocks.1.weight.grad"] == "model.blocks.1", grads
    assert grads["model.out.weight.grad"] == POST, grads


def test_distribute_runs_a_given_pipeline_plan_as_compiled(tmp_path) -> None:
    """``plan=`` a pipeline plan (the object, or the file ``save`` wrote) on its mesh: the
    stages are not planned again; a plan for other options than those asked is refused by
    name, as is a pipeline plan on a mesh without ``pp``. Planned only: no rank starts."""
    from meshplan.planner import PipelinePlan

    ex = gpt.build(config=CONFIG, optimizer="adamw")
    batch = ex.batch(0)
    first = meshplan.distribute(ex.step, mesh={"pp": 2}, microbatches=2, schedule="gpipe",
                                example_inputs=batch)
    pplan = first.pipeline
    pplan.save(tmp_path / "pp.plan")
    again = PipelinePlan.load(tmp_path / "pp.plan")
    assert again.to_dict() == pplan.to_dict()
    for given in (pplan, str(tmp_path / "pp.plan")):
        step = meshplan.distribute(ex.step, mesh={"pp": 2}, plan=given, example_inputs=batch)
        assert step.pipeline.to_dict() == pplan.to_dict()
        assert "as compiled (plan=)" in step.plan.solver["pipeline"]
    with pytest.raises(meshplan.RuntimeFailure, match="it runs 2 micro-batches, not "
                                                      "microbatches=4"):
        meshplan.distribute(ex.step, mesh={"pp": 2}, plan=pplan, microbatches=4,
                            example_inputs=batch).plan
    with pytest.raises(meshplan.RuntimeFailure, match="it is for mesh pp=2"):
        meshplan.distribute(ex.step, mesh={"pp": 2, "dp": 2}, plan=pplan,
                            example_inputs=batch).plan
    with pytest.raises(meshplan.RuntimeFailure, match="the plan is a pipeline's"):
        meshplan.distribute(ex.step, mesh={"dp": 2}, plan=pplan)


def test_a_step_that_does_not_split_over_micro_batches_is_refused_on_stages() -> None:
    """A loss without a sharding rule (``multi_margin_loss``) runs on the whole batch at once,
    so no micro-batch can go on alone: on a ``pp`` mesh, where the stages always run
    micro-batches, the refusal names the op and says what to do there, without the
    ``microbatches=1`` a mesh without stages offers, as the ``PlanError`` a mesh without
    stages raises."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Sequential(
        *(torch.nn.Linear(8, 8) for _ in range(2))), torch.nn.Linear(8, 3))
    train_step = _sgd_mse_step(model, torch.nn.functional.multi_margin_loss)

    step = meshplan.distribute(train_step, mesh={"pp": 2}, microbatches=2,
                               example_inputs=(torch.randn(8, 8), torch.randint(0, 3, (8,))))
    with pytest.raises(meshplan.PlanError) as got:
        step.plan
    text = str(got.value)
    assert "multi_margin_loss" in text and "has no sharding rule" in text, text
    assert "microbatches=1" not in text, text
    assert "On mesh pp=2 the stages always run in micro-batches: change that op" in text, text


def _sgd_mse_step(model, loss_fn=None):
    """A plain training step of ``model``: a mean mse loss (or ``loss_fn``), SGD."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = loss_fn or torch.nn.functional.mse_loss

    def train_step(x, y):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return train_step


def test_explain_and_diff_say_why_this_split_and_what_changed(graph) -> None:
    """``explain_pipeline``: the plan's chunks with their time per micro-batch (the slowest
    named), each cut moved one unit either way and priced as the planner prices a split (no
    neighbour has a slower chunk than the plan's slowest: the split minimises it), and the
    schedules tried; ``diff_pipeline``: the schedule and the units that changed stage."""
    from meshplan.planner._pipeline_explain import (diff_pipeline, explain_pipeline,
                                                    explain_pipeline_text)

    a = plan_pipeline(graph, {"pp": 2}, topology="h100", schedule="1f1b", microbatches=4)
    b = plan_pipeline(graph, {"pp": 2}, topology="h100", schedule="interleaved",
                      microbatches=4)
    ex = explain_pipeline(a)
    assert [u for c in ex["chunks"] for u in c["units"]] == [u for c in a.chunks for u in c]
    slowest = ex["chunks"][ex["slowest_chunk"]]["time_per_microbatch_s"]
    assert slowest == max(c["time_per_microbatch_s"] for c in ex["chunks"])
    # one cut, 4 layers split 2 + 2: h.1 can move to stage 1, h.2 to stage 0
    assert {(x["moves"], x["to_chunk"]) for x in ex["moves"]} == {
        ("model.transformer.h.1", 1), ("model.transformer.h.2", 0)}
    assert all(x["slowest_chunk_s"] >= slowest * (1 - 1e-9) for x in ex["moves"])
    assert sum(t["chosen"] for t in ex["tried"]) == 1
    text = explain_pipeline_text(ex)
    assert "why this split: 2 stages x 1 chunk per device" in text and "<- slowest" in text
    d = diff_pipeline(a, b)
    assert d["schedule"] == {"before": "1f1b", "after": "interleaved"}
    assert d["virtual_stages"] == {"before": 1, "after": 2} and not d["identical"]
    assert {m["unit"] for m in d["units_moved"]} == {"model.transformer.h.1",
                                                      "model.transformer.h.2"}
    assert diff_pipeline(a, a)["identical"]
