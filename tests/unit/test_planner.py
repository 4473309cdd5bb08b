"""The planner end to end on small models: plans are valid, auto beats or ties every hand plan
under the same cost model, plans persist exactly, and bad input gets one clear PlanError."""

from __future__ import annotations

import json
import math
import sys
from functools import lru_cache
from pathlib import Path

import pytest

import meshplan
from meshplan.examples import mlp
from meshplan.ir import Graph
from meshplan.planner import (
    HAND_STRATEGIES,
    Mesh,
    Plan,
    Partial,
    PlanError,
    Replicate,
    Shard,
    plan_graph,
)
from meshplan.planner._planning import axis_traffic
from meshplan.planner._summary import render_summary

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _traced_examples import default_gpt  # noqa: E402  (one GPT trace for the unit tests)


@lru_cache(maxsize=None)
def _graph(name: str) -> Graph:
    if name == "gpt":                      # gpt.build() at batch(0), shared with other files
        return default_gpt()[1].graph
    ex = {"mlp": lambda: mlp.build(optimizer="adamw")}[name]()
    return meshplan.trace(ex.step, *ex.batch(0)).graph


MESHES = [{"dp": 2}, {"dp": 2, "tp": 2}]


@pytest.mark.parametrize("name", ["mlp", "gpt"])
@pytest.mark.parametrize("axes", MESHES, ids=lambda a: ",".join(f"{k}{v}" for k, v in a.items()))
def test_auto_is_no_worse_than_any_feasible_hand_plan(name: str, axes: dict[str, int]) -> None:
    """The hand families are pins on the same ILP; the automatic search contains each of
    them, so under one cost model it can only tie or win (the solver runs to optimality on
    these sizes; 1e-9 s absorbs float summation order)."""
    g = _graph(name)
    auto = plan_graph(g, axes, topology="h100")
    assert auto.fits
    for strategy in HAND_STRATEGIES:
        if strategy == "megatron_tp" and "tp" not in axes:
            continue
        hand = plan_graph(g, axes, topology="h100", strategy=strategy)
        if hand.fits:
            assert auto.estimated_step_time_s <= hand.estimated_step_time_s + 1e-9, (
                strategy, auto, hand)


def test_every_node_is_placed_with_one_layout_per_mesh_axis() -> None:
    g = _graph("gpt")
    plan = plan_graph(g, {"dp": 2, "tp": 2}, topology="h100")
    placed = {p.node for p in plan.placements}
    for n in g.nodes:
        if n.kind.value in ("input", "op", "constant"):
            assert n.name in placed
    for p in plan.placements:
        for layout in (*p.inputs, *p.outputs):
            assert layout is None or len(layout) == 2


def test_dp_plan_replicates_state_and_shards_the_batch() -> None:
    g = _graph("mlp")
    plan = plan_graph(g, {"dp": 2}, topology="h100", strategy="dp")
    for n in g.inputs:
        layout = plan.placement(n.name).outputs[0]
        if n.meta.role.value == "data":
            assert layout == (Shard(0),)
        else:
            assert layout == (Replicate(),)


def test_a_family_penalty_is_scaled_to_the_model(monkeypatch) -> None:  # noqa: ANN001
    """A change outside a hand family's collectives costs a multiple of the model's whole cost,
    not a fixed 1e3 s: next to a small model's few-microsecond ops that left costs spanning
    4e-3..3e9 us and HiGHS stopped with status Unknown (the recompute planner's dp=2 GPT)."""
    from meshplan.planner import _solve
    seen = []
    real = _solve._Model.solve
    monkeypatch.setattr(_solve._Model, "solve", lambda self, *a: seen.append(self) or real(
        self, *a))
    plan = plan_graph(_graph("mlp"), {"dp": 2}, topology="h100", strategy="dp")
    model = seen[-1]
    assert model.penalized and plan.solver["status"] == "Optimal"
    cost = [c for c in model.cost if 0 < c < float("inf")]
    base = sum(c for v, c in enumerate(model.cost) if v not in model.penalized)
    assert all(model.cost[v] > _solve.FAMILY_PENALTY * base for v in model.penalized)
    assert max(cost) / min(cost) < 1e9


def test_fsdp_shards_state_and_gathers_it() -> None:
    g = _graph("mlp")
    plan = plan_graph(g, {"dp": 2}, topology="h100", strategy="fsdp")
    w = next(n for n in g.inputs if n.target.endswith("weight") and n.meta.role.value == "param")
    assert plan.placement(w.name).outputs[0] == (Shard(0),)
    kinds = {c[0] for r in plan.redistributions for c in r.collectives}
    assert "all_gather" in kinds


def test_plan_round_trips_exactly_and_checks_its_hash(tmp_path) -> None:  # noqa: ANN001
    plan = plan_graph(_graph("mlp"), {"dp": 2, "tp": 2}, topology="h100")
    path = tmp_path / "mlp.plan"
    plan.save(path)
    again = Plan.load(path)
    assert again.to_json() == plan.to_json()
    assert again.estimated_step_time_s == plan.estimated_step_time_s
    assert again.graph.to_json() == plan.graph.to_json()
    d = json.loads(path.read_text())
    d["body"]["estimated_step_time_s"] = 0.0
    path.write_text(json.dumps(d))
    with pytest.raises(PlanError, match="content hash"):
        Plan.load(path)


_STEP = """
import torch
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
def train_step(x, y):
    loss = torch.nn.functional.mse_loss(torch.ACT(model(x)), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss
"""


def test_a_compiled_plan_stays_good_where_only_the_steps_source_moved(tmp_path) -> None:
    """The graph hash ``check_compatible`` compares leaves out where each op was written:
    the same step with comments above it, in another file, is the same graph (a user trial:
    a comment line made the compiled plan 'changed since'); another op is not."""
    import importlib.util

    import torch

    from meshplan.planner._plan import graph_hash

    def traced(name: str, text: str) -> Graph:
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        torch.manual_seed(0)
        return meshplan.trace(module.train_step, torch.randn(4, 4), torch.randn(4, 1)).graph

    first = traced("first", _STEP.replace("ACT", "tanh"))
    moved = traced("moved", "# a comment\n# and another\n" + _STEP.replace("ACT", "tanh"))
    other = traced("other", _STEP.replace("ACT", "sigmoid"))
    assert [n.source.line for n in first.nodes if n.source] != [
        n.source.line for n in moved.nodes if n.source]
    assert graph_hash(first) == graph_hash(moved) != graph_hash(other)
    plan_graph(first, {"dp": 2}).check_compatible(graph=moved)


@pytest.mark.parametrize("text, match", [
    ("not json", "not JSON"),
    ('{"format": "something"}', "not a meshplan plan"),
    ('{"format": "meshplan.plan", "version": 99}', "version"),
])
def test_foreign_or_corrupt_plan_files(tmp_path, text: str, match: str) -> None:  # noqa: ANN001
    path = tmp_path / "bad.plan"
    path.write_text(text)
    with pytest.raises(PlanError, match=match):
        Plan.load(path)


def test_summary_names_the_mesh_time_and_memory() -> None:
    plan = plan_graph(_graph("gpt"), {"dp": 2, "tp": 2}, topology="h100", strategy="megatron_tp")
    text = plan.summary()
    assert "megatron_tp" in text and "dp=2,tp=2" in text
    assert "estimated step time" in text and "peak memory" in text


def test_unknown_topology_is_a_plan_error() -> None:
    with pytest.raises(PlanError, match="unknown topology 'tpu9'"):
        plan_graph(_graph("mlp"), {"dp": 2}, topology="tpu9")


def test_unknown_strategy_and_missing_tp_axis() -> None:
    with pytest.raises(PlanError, match="unknown strategy"):
        plan_graph(_graph("mlp"), {"dp": 2}, strategy="zero9")
    with pytest.raises(PlanError, match="axis named 'tp'"):
        plan_graph(_graph("mlp"), {"dp": 2}, strategy="megatron_tp")


def test_batch_that_does_not_divide_the_data_parallel_mesh() -> None:
    """The MLP's batch of 8 cannot be split 3 ways."""
    with pytest.raises(PlanError, match="does not divide"):
        plan_graph(_graph("mlp"), {"dp": 3}, strategy="dp")


def test_a_batch_smaller_than_the_mesh_is_split_over_the_axes_it_divides() -> None:
    """Pure DP of a batch of 8 on 4 x 4 ranks: split 4 ways on dp, repeated along tp."""
    plan = plan_graph(_graph("mlp"), {"dp": 4, "tp": 4}, topology="h100", strategy="dp")
    x = next(p for p in plan.placements if p.target == "x")
    assert x.outputs[0] == (Shard(0), Replicate())


def test_priced_out_columns_do_not_change_the_optimum() -> None:
    """Column generation starts the LP without reduce-scatters and all-to-alls and prices
    them in from the duals: the LP optimum must equal that of the whole model."""
    from meshplan.planner._mesh import Mesh as _Mesh
    from meshplan.planner._planning import _prepare
    from meshplan.planner._problem import build_problem
    from meshplan.planner._solve import _build

    problem = build_problem(_prepare(_graph("gpt")), _Mesh({"dp": 2, "tp": 2}, "h100"))
    lazy, _, _, _ = _build(problem, float("inf"), [])
    assert any(lazy.lazy)
    whole, _, _, _ = _build(problem, float("inf"), [])
    whole.lazy = [False] * len(whole.lazy)
    _, got = lazy.solve(60, 1e-9)
    _, want = whole.solve(60, 1e-9)
    assert got["columns"] < want["columns"]
    assert got["objective"] == pytest.approx(want["objective"], rel=1e-9)


def test_the_parallel_dual_simplex_finds_the_serial_plan(monkeypatch) -> None:
    """Large LPs run HiGHS's parallel dual (PAMI, 2 threads) where 2 CPUs are usable: forced
    here on the GPT's (small) LP, the plan is the serial one, layout for layout."""
    from meshplan.planner import _solve

    def plan():
        p = plan_graph(_graph("gpt"), {"dp": 2, "tp": 2}, topology="h100")
        return p.input_layouts, [(q.node, q.outputs) for q in p.placements], \
            p.estimated_step_time_s

    monkeypatch.setenv(_solve.ENV_LP_THREADS, "1")
    serial = plan()
    monkeypatch.setenv(_solve.ENV_LP_THREADS, "2")
    monkeypatch.setattr(_solve, "PAMI_MIN_COLUMNS", 0)
    assert _solve.lp_threads() == 2
    assert plan() == serial
    # unasked, PAMI only where a CPU is free beside this process (its threads wait for each
    # other: 20x slower than the serial dual beside a training job on 2 cores)
    monkeypatch.delenv(_solve.ENV_LP_THREADS)
    monkeypatch.setattr(_solve.os, "sched_getaffinity", lambda pid: {0, 1})
    for load, want in ((0.9, 2), (1.6, 1), (3.0, 1)):
        monkeypatch.setattr(_solve.os, "getloadavg", lambda load=load: (load, load, load))
        assert _solve.lp_threads() == want, load


def test_bad_pins() -> None:
    g = _graph("mlp")
    with pytest.raises(PlanError, match="unknown input 'nope'"):
        plan_graph(g, {"dp": 2}, pins={"nope": ("R",)})
    with pytest.raises(PlanError, match="1 axes"):
        plan_graph(g, {"dp": 2}, pins={"x": ("S(0)", "R")})
    with pytest.raises(PlanError, match="cannot parse placement"):
        plan_graph(g, {"dp": 2}, pins={"x": ("Q",)})


def test_pinned_batch_is_respected() -> None:
    g = _graph("mlp")
    plan = plan_graph(g, {"dp": 2}, topology="h100", pins={"x": ("S(0)",)})
    x = next(n for n in g.inputs if n.target == "x")
    assert plan.placement(x.name).outputs[0] == (Shard(0),)


def test_memory_limit_no_plan_meets_says_by_how_much() -> None:
    g = _graph("mlp")
    with pytest.raises(PlanError, match=r"fits 1.00 KiB .* best plan needs [\d.]+ KiB "
                                        r"\(misses by [\d.]+ KiB\)\. Searched: .*sharding\); "
                                        r"not searched yet: activation recompute"):
        plan_graph(g, {"dp": 2}, topology="h100", memory_limit_bytes=1024)


@pytest.mark.parametrize("axes", [{"dp": 2}, {"dp": 4}])
def test_peak_lower_bound_is_below_every_plan_and_spares_the_search(axes, monkeypatch) -> None:
    """``peak_lower_bound`` (the unsharded liveness peak over the device count) is at most the
    smallest peak any plan reaches (measured 0.74-1.0 of it on the example MLP, GPT, LLaMA
    and CNN, with and without recompute); a limit below it fails without building the
    search's decisions: one build, for the error's smallest peak."""
    from meshplan.planner import _planning
    from meshplan.planner._planning import _prepare
    from meshplan.planner._problem import build_problem
    from meshplan.planner._solve import min_peak_memory, peak_lower_bound

    g = _prepare(_graph("mlp"))
    mesh = Mesh(axes, "cpu")
    bound = peak_lower_bound(g, mesh)
    assert 0.7 * min_peak_memory(build_problem(g, mesh)) <= bound \
        <= min_peak_memory(build_problem(g, mesh))
    builds = []
    monkeypatch.setattr(_planning, "build_problem",
                        lambda *a, **k: builds.append(1) or build_problem(*a, **k))
    with pytest.raises(PlanError, match=r"best plan needs .* \(misses by"):
        plan_graph(_graph("mlp"), axes, topology="cpu", memory_limit_bytes=bound // 2,
                   recompute="none")
    assert len(builds) == 1


def test_memory_rows_enter_only_where_memory_may_bind(monkeypatch) -> None:
    """Far from the limit the first solve has no memory rows (they slowed the LP 4x on the
    8B step) and its plan, which fits, is the optimum under the limit too: the same objective
    as with the rows from the start. Near the limit the rows are there from the first round and
    the plan fits."""
    from meshplan.planner import _solve
    from meshplan.planner._planning import _prepare
    from meshplan.planner._problem import build_problem
    from meshplan.planner._solve import peak_lower_bound, solve

    g = _prepare(_graph("mlp"))
    mesh = Mesh({"dp": 4}, "cpu")
    problem = build_problem(g, mesh)
    bound = peak_lower_bound(g, mesh)
    far = solve(problem, bound * 100)
    assert far.solver["memory_points"] == 0 and far.peak_memory_bytes <= bound * 100
    near = solve(problem, bound * 2)
    assert near.solver["memory_points"] >= 6 and near.peak_memory_bytes <= bound * 2
    monkeypatch.setattr(_solve, "LAZY_MEMORY_SHARE", 0.0)      # rows from the first round
    forced = solve(problem, bound * 100)
    assert forced.solver["memory_points"] >= 6
    assert far.solver["objective"] == pytest.approx(forced.solver["objective"], rel=1e-9)


def test_mesh_object_and_public_compile() -> None:
    ex = mlp.build(optimizer="sgd")
    plan = meshplan.compile(ex.step, *ex.batch(0), mesh=Mesh({"dp": 2}, "cpu"))
    assert plan.mesh.names == ("dp",) and plan.fits


def _wide_mlp_graph() -> Graph:
    """Two 1024x4096 linears with plain SGD: 8M parameters, 32 MiB of fp32 weights and 32 MiB
    of gradients, tiny activations (batch 8)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(x, y):  # noqa: ANN001, ANN202
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    x = torch.empty(8, 1024, device="meta")
    return meshplan.trace(step, x, x).graph


def test_megatron_tensor_parallel_emerges_when_memory_forces_it() -> None:
    """Peaks per rank (the planner's, which the programs hold to within 0.1 MiB on thread
    ranks, counted by ``backends/_live.py``): data parallel 80 MiB (32 MiB of weights, a
    16 MiB gradient and the reduced copies of both), FSDP 40.4 MiB (16 MiB of shards, a
    gathered 16 MiB weight, gradient pieces), Megatron's split 32.1 MiB (16 MiB of shards and
    their own gradients, nothing to reduce). Under 36 MiB only the Megatron split fits: fc1
    by output features (column), fc2 split too, and no weight is ever gathered. fc2 by input
    features (row: its output all-reduced) and by output features (the 8 x 4096 activation
    gathered instead, the mean ``mse_loss`` and its backward on feature shards) are within
    3 % of each other; the solver takes the second, as it charges the row split's all-reduce
    once for the loss and once for its backward (they are in different groups), which the
    lowering runs once."""
    g = _wide_mlp_graph()
    limit = 36 * 2**20
    dp = plan_graph(g, {"tp": 2}, topology="h100", strategy="dp", memory_limit_bytes=limit)
    fsdp = plan_graph(g, {"tp": 2}, topology="h100", strategy="fsdp", memory_limit_bytes=limit)
    assert not dp.fits and not fsdp.fits
    plan = plan_graph(g, {"tp": 2}, topology="h100", memory_limit_bytes=limit)
    assert plan.fits
    w1 = next(n for n in g.inputs if n.target.endswith("0.weight") and n.meta.role.value == "param")
    w2 = next(n for n in g.inputs if n.target.endswith("2.weight") and n.meta.role.value == "param")
    assert plan.placement(w1.name).outputs[0] == (Shard(0),)
    assert plan.placement(w2.name).outputs[0] in ((Shard(0),), (Shard(1),))
    gathered = {r.value for r in plan.redistributions
                if any(c[0] == "all_gather" for c in r.collectives)}
    assert w1.name not in gathered and w2.name not in gathered


def test_bucket_size_follows_the_cost_model() -> None:
    """Without overlap (the ``cpu`` topology: gloo runs on the ranks' own cores) every extra
    bucket only adds latency: one bucket holds all gradients, the smallest size that does.
    With full overlap (NCCL) the size balances one more call's latency against the last
    bucket's exposed bandwidth time, near sqrt(total * latency * bandwidth), and grows with
    the gradients; every choice is the minimum of ``bucket_time`` over the candidates."""
    import math

    from meshplan.planner._comm import BUCKET_SIZES, best_bucket_bytes, bucket_time
    from meshplan.planner._mesh import PRESETS, Link

    cpu = PRESETS["cpu"]
    assert best_bucket_bytes(14e6, 2, cpu.intra_node, cpu.comm_overlap) == 16 << 20
    assert best_bucket_bytes(100e6, 4, cpu.intra_node, cpu.comm_overlap) == 128 << 20
    link = Link(bandwidth=100e9, latency=10e-6)
    sizes = [best_bucket_bytes(g, 8, link, 1.0) for g in (1e8, 1e9, 1e10)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
    for g, b in zip((1e8, 1e9, 1e10), sizes):
        ideal = math.sqrt(g * 2 * 7 * link.latency * link.bandwidth / (2 * 7 / 8))
        assert ideal / 4 <= b <= ideal * 4, (g, b, ideal)
        assert bucket_time(b, g, 8, link, 1.0) == min(bucket_time(c, g, 8, link, 1.0)
                                                      for c in BUCKET_SIZES)
    assert bucket_time(1 << 20, 1e8, 1, link, 1.0) == 0.0       # one rank: nothing to reduce


def test_plans_carry_their_bucket_size_and_lower_with_it(tmp_path) -> None:  # noqa: ANN001
    """A dp plan's gradient all-reduces get the cost model's bucket cap; it survives saving,
    ``plan show`` prints it, and the lowering uses it unless told otherwise. A plan with no
    gradient all-reduce has none (the lowering then uses DDP's 25 MiB)."""
    from meshplan.backends._bucket import Bucket
    from meshplan.backends._lower import lower
    from meshplan.planner._comm import best_bucket_bytes

    g = _graph("gpt")
    plan = plan_graph(g, {"dp": 2}, topology="cpu", strategy="dp")
    reduced = {(r.value, r.src, r.dst): r.collectives[0][2] * r.count
               for r in plan.redistributions if [c[0] for c in r.collectives] == ["all_reduce"]}
    total = sum(reduced.values())         # a value read by several consumers is reduced once
    assert total > 0
    assert plan.bucket_bytes == best_bucket_bytes(total, 2, plan.mesh.link(0), 0.0)
    path = tmp_path / "dp.plan"
    plan.save(path)
    assert Plan.load(path).bucket_bytes == plan.bucket_bytes
    assert "buckets of up to" in plan.summary()
    buckets = [i for i in lower(plan, 0).instructions if isinstance(i, Bucket)]
    assert max(b.nbytes for b in buckets) <= plan.bucket_bytes
    assert len([b for b in buckets if len(b.members) > 1]) == 1        # everything in one
    small = [i for i in lower(plan, 0, bucket_bytes=4096).instructions if isinstance(i, Bucket)]
    assert len(small) > len(buckets)
    assert plan_graph(g, {"dp": 2}, topology="cpu", strategy="fsdp").bucket_bytes is None


def test_the_axis_with_less_traffic_goes_across_nodes() -> None:
    """Issue 20, point 3: on nodes of 4, ``{"dp": 4, "tp": 4}`` lays tp inside a node and dp
    across. The Megatron family all-reduces this wide MLP's gradients over dp and moves
    nothing over tp, so the planner puts dp inside the nodes instead (the mesh comes back as
    tp, dp) and says so; ``axis_order="given"`` keeps the order and pays the fabric. The
    automatic plan already moves its traffic on the inner axis: it keeps the order."""
    g = _wide_mlp_graph()
    topo = "h100:gpus_per_node=4"
    given = plan_graph(g, {"dp": 4, "tp": 4}, topology=topo, strategy="megatron_tp",
                       axis_order="given")
    plan = plan_graph(g, {"dp": 4, "tp": 4}, topology=topo, strategy="megatron_tp")
    assert given.mesh.names == ("dp", "tp") and plan.mesh.names == ("tp", "dp")
    moved = axis_traffic(plan)
    assert moved.get("dp", 0) > moved.get("tp", 0)          # dp moves more: now inside a node
    assert plan.mesh.link(plan.mesh.index("dp")) == plan.mesh.topology.intra_node
    assert plan.mesh.link(plan.mesh.index("tp")) == plan.mesh.topology.inter_node
    assert plan.estimated_step_time_s < given.estimated_step_time_s
    assert "reordered dp,tp -> tp,dp" in render_summary(plan)
    plan.check_compatible(mesh={"dp": 4, "tp": 4})          # the same axes: accepted
    auto = plan_graph(g, {"dp": 4, "tp": 4}, topology=topo)
    assert auto.mesh.names == ("dp", "tp") and "axis_order" not in auto.solver
    with pytest.raises(PlanError, match="axis_order must be 'auto' or 'given'"):
        plan_graph(g, {"dp": 4, "tp": 4}, topology=topo, axis_order="inner")


def test_an_automatic_plan_far_from_its_bound_is_compared_with_the_families(monkeypatch) -> None:
    """When the search stops far from its bound (large models at the time limit), the families
    are planned too and a faster one that fits is kept; forced here on a small model by
    lowering the threshold below any gap."""
    from meshplan.planner import _planning

    monkeypatch.setattr(_planning, "FAMILY_FALLBACK_GAP", -1.0)
    g = _graph("mlp")
    plan = plan_graph(g, {"dp": 2}, topology="h100")
    note = plan.solver["families"]
    assert plan.strategy == "auto" and "families: dp " in note and "kept: " in note
    families = [plan_graph(g, {"dp": 2}, topology="h100", strategy=f) for f in HAND_STRATEGIES
                if f != "megatron_tp"]                       # needs a tp axis
    assert plan.estimated_step_time_s <= min(p.estimated_step_time_s for p in families if p.fits)
    assert "search vs families: " in plan.summary()


def test_gradient_clipping_on_a_2d_mesh_keeps_the_relaxation_integral() -> None:
    """Issue 20 regression: clipping stacks one 2-norm per gradient, and the stack needs one
    layout for all of them. While a norm of a replicated gradient could not join the pieces of
    sharded ones, the LP split every gradient half over dp and half over tp (a half-integral
    relaxation), and this GPT layer (d 512, vocab 8192, batch 16 x 512, on meta) planned in
    18 s of branch and bound on ``{"dp": 4, "tp": 2}`` (53-61 s with 4 layers). A whole value
    now becomes norm pieces for free (coordinate 0 keeps it), so the relaxation is integral
    and solves in well under a second; the lowering's equivalence is in
    tests/dist/test_lower.py."""
    import torch

    from meshplan.backends._lower import lower
    from meshplan.examples import gpt

    cfg = gpt.GPTConfig(vocab_size=8192, seq_len=512, n_layer=1, n_head=8, d_model=512,
                        batch_size=16)
    with torch.device("meta"):
        ex = gpt.build(config=cfg)
    graph = meshplan.trace(ex.step, *ex.batch(0)).graph
    plan = plan_graph(graph, {"dp": 4, "tp": 2}, topology="h100", strategy="fsdp")
    assert plan.solver["method"] == "lp-integral", plan.solver
    stacked = [p for p in plan.placements if p.target == "aten.stack.default"]
    assert stacked and all(isinstance(q, Partial) for q in stacked[0].outputs[0])
    lower(plan, 0)


@pytest.mark.parametrize(("topology", "kernel"), [("cpu", "kernel.adamw_cpu"),
                                                  ("h100", "kernel.adamw")])
def test_the_fused_kernels_the_lowering_runs_are_priced_as_kernels(topology, kernel) -> None:
    """The lowering runs each parameter's AdamW ops as one fused kernel (numba on CPU,
    Triton on GPUs): the plan prices the kernel's one pass over param, grad and moments,
    shared out over the chain's ops (each its own bytes' share; one launch floor), and with
    kernels switched off every op as itself again. The optimizer is replicated under dp, so
    dp's priced compute drops the most; priced op by op it made dp look 13 ms slower than the
    sharded plans on 2 CPU ranks (benchmarks/README.md, "Calibration")."""
    from meshplan.kernels import find_kernels, kernels_disabled
    from meshplan.planner._kernel_cost import fused_kernel_of, kernel_work
    from meshplan.planner._problem import _compute_time

    g = _graph("gpt")
    plan = plan_graph(g, {"dp": 2}, topology=topology, strategy="dp")
    topo = plan.mesh.topology
    work, member_of = kernel_work(g, topo), fused_kernel_of(g, topo)
    anchors = [n for n, w in work.items() if w[2] == kernel and w[3]]
    params = [n for n in g.inputs if n.meta.role.value == "param"]
    assert len(anchors) == len(params)                  # one AdamW match per parameter
    # (mul for the decay,) lerp, mul, addcmul, sqrt, div, add, addcdiv: 10 of the parameters
    # decay, 18 (biases, norms) do not
    chains = {dict(m.operands)["param"].node: m.nodes
              for m in find_kernels(g, topo.device, check_available=False)
              if "kernel." + m.kernel == kernel}
    assert all(member_of[n] == kernel for ns in chains.values() for n in ns)
    assert sorted(map(len, chains.values())) == [7] * 18 + [8] * 10
    by_node = {p.node: p for p in plan.placements}
    for param, members in chains.items():
        numel = math.prod(g.node(param).outputs[0].shape)
        # param, grad and the two moments read, three written, once each (the step size and
        # bias correction are host scalars here)
        assert sum(work[m][1] for m in members) == pytest.approx(7 * 4 * numel)
        # the kernel's time (memory-bound), with one launch floor at most; op by op, each of
        # the 7-8 ops would pay at least the floor
        kernel_s = _compute_time(0.0, 7 * 4 * numel, 1, "float32", topo, kernel, floor=False)
        got = sum(by_node[m].compute_s for m in members)
        assert max(kernel_s, topo.kernel_floor_s) * 0.999 <= got <= \
            (kernel_s + topo.kernel_floor_s) * 1.001, (param, got, kernel_s)
    with kernels_disabled():
        assert kernel_work(g, topo) == {}
        op_by_op = plan_graph(g, {"dp": 2}, topology=topology, strategy="dp")
    assert op_by_op.compute_time_s > plan.compute_time_s

