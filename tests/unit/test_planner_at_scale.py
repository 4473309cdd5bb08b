"""Issue 3's acceptance at scale: LLaMA-3 8B (32 layers, d 4096, GQA 32/8, SwiGLU 14336,
vocab 128256, AdamW, batch 8 x 2048) traced on the meta device and planned on 64 H100s
({"dp": 8, "tp": 8}). How long it takes is measured in benchmarks/planner.py, not here."""

from __future__ import annotations

import meshplan
from meshplan.examples import llama
from meshplan.ir import Role
from meshplan.planner import plan_graph

MESH = {"dp": 8, "tp": 8}


def test_llama3_8b_pure_dp_does_not_fit_and_the_automatic_plan_does() -> None:
    ex = llama.build(config="llama3_8b", device="meta")
    graph = meshplan.trace(ex.step, *ex.batch(0)).graph
    params = sum(n.meta.numel for n in graph.inputs_with_role(Role.PARAM))
    assert 8.0e9 < params < 8.1e9

    dp = plan_graph(graph, MESH, topology="h100", strategy="dp")
    # fp32 weights, grads and two AdamW moments alone are 16 bytes x 8.03e9 = 120 GiB
    assert not dp.fits and dp.peak_memory_bytes > 16 * params

    auto = plan_graph(graph, MESH, topology="h100")
    assert auto.fits
    assert auto.solver["mip_gap"] <= 0.01
    assert auto.solver["groups"] < 500            # 32 layers share one set of decisions
    megatron = plan_graph(graph, MESH, topology="h100", strategy="megatron_tp")
    assert auto.estimated_step_time_s <= megatron.estimated_step_time_s * (1 + 1e-9)
    # weights end up split over the whole mesh: no rank holds a full matrix
    wq = next(p for p in auto.placements if p.target == "model.layers.0.attention.wq.weight")
    assert any(p != meshplan.planner.Replicate() for p in wq.outputs[0])
