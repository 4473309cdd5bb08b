"""Issue 20, point 2: activation recompute as a graph pass and a planner decision.

The pass is checked against the interpreter with no tolerance: the copies run the same ops on
the same inputs in the same order, so every output is the same bits. What each policy keeps
across the forward/backward boundary is checked against Korthikanti et al. ("Reducing
Activation Recomputation in Large Transformer Models", 2022): full recompute keeps one
(batch, seq, hidden) tensor per layer, the layer's input (their 2sbh bytes at 16 bits); the
selective policy keeps the outputs of the matrix products and the attention kernel. Runs on
ranks: tests/dist/test_lower.py.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
import torch

import meshplan
from meshplan._errors import IRError, PlanError
from meshplan.examples import gpt
from meshplan.ir import NodeKind, Phase, interpret, is_random, recompute, repeated_layers
from meshplan.ir._recompute import PREFIX, is_heavy
from meshplan.planner import Plan, plan_graph, recompute_cost
from meshplan.planner._planning import _prepare
from meshplan.planner._problem import is_follower

CFG = gpt.GPTConfig(vocab_size=64, seq_len=16, n_layer=3, n_head=2, d_model=32, batch_size=4)


@functools.lru_cache(maxsize=None)
def _traced(dropout: float = 0.0):
    ex = gpt.build(optimizer="sgd", clip=None, config=dataclasses.replace(CFG, dropout=dropout))
    return ex, meshplan.trace(ex.step, *ex.batch(0))


def _kept(graph, layer: str) -> set[str]:
    """The layer's forward values that the backward still reads from the forward (through
    views, which hold no memory of their own): what the layer holds across the boundary."""
    start = next(i for i, n in enumerate(graph.nodes) if n.phase is Phase.BACKWARD)
    kept = set()
    for n in graph.nodes[start:]:
        for r in n.refs():
            src = graph.node(r.node)
            while is_follower(graph, src):
                src = graph.node(next(src.refs()).node)
            if src.kind is NodeKind.OP and src.phase is Phase.FORWARD and (
                    src.module_path == layer or src.module_path.startswith(layer + ".")):
                kept.add(src.name)
    return kept


def _bytes(graph, names: set[str]) -> int:
    return sum(m.nbytes for n in names for m in graph.node(n).outputs if hasattr(m, "nbytes"))


def test_recomputed_graphs_replay_to_the_same_bits() -> None:
    ex, traced = _traced()
    graph = traced.graph
    assert repeated_layers(graph) == tuple(f"model.transformer.h.{i}" for i in range(3))
    inputs = traced.input_values(*ex.batch(0))
    want = interpret(graph, inputs)
    for policy, which in (("full", None), ("selective", None),
                          ("full", ("model.transformer.h.1",))):
        g = recompute(graph, policy, which)
        copies = [n for n in g.nodes if n.name.startswith(PREFIX)]
        assert copies and all(n.phase is Phase.BACKWARD for n in copies)
        if which:
            assert {n.module_path.split(".")[3] for n in copies} == {"1"}
        got = interpret(g, inputs)
        assert all(torch.equal(a, b) for a, b in zip(want, got)), (policy, which)
    assert recompute(graph, "none") is graph
    with pytest.raises(IRError, match=r"no layer 'model.h.7'; its layers are model.transformer"):
        recompute(graph, "full", ("model.h.7",))
    with pytest.raises(IRError, match="policy must be one of"):
        recompute(graph, "some")


def test_what_each_policy_keeps_matches_korthikanti() -> None:
    """Full: per layer only the values a later layer reads (its output, the next layer's
    input: one b*s*h tensor). Selective: those and the matrix products' and attention's
    outputs. Random draws are never recomputed (their outputs are kept)."""
    _, traced = _traced()
    graph = _prepare(traced.graph)
    b, s, h = CFG.batch_size, CFG.seq_len, CFG.d_model
    full = recompute(graph, "full")
    sel = recompute(graph, "selective")
    for layer in repeated_layers(graph)[:-1]:        # the last one's output feeds the head
        kept = _kept(full, layer)
        assert len(kept) == 1, kept
        assert full.node(kept.pop()).meta.numel == b * s * h
        kept_sel = _kept(sel, layer)
        assert kept_sel and all(is_heavy(sel.node(k)) or sel.node(k).target == "aten.add.Tensor"
                                for k in kept_sel), kept_sel
        kept_none = _kept(graph, layer)
        assert _bytes(graph, kept_none) > _bytes(sel, kept_sel) > b * s * h * 4, layer
    _, with_dropout = _traced(dropout=0.1)
    g = recompute(with_dropout.graph, "full")
    random = [n.name for n in with_dropout.graph.nodes if is_random(n)]
    assert random and not any(PREFIX + r in g for r in random)


def test_the_planner_recomputes_when_memory_is_short_and_says_so(tmp_path) -> None:
    ex, traced = _traced()
    graph = traced.graph
    none = plan_graph(graph, {"dp": 2}, topology="h100", strategy="dp", recompute="none")
    assert none.recompute is None and recompute_cost(none) == (0.0, 0)
    full = plan_graph(graph, {"dp": 2}, topology="h100", strategy="dp", recompute="full")
    seconds, freed = recompute_cost(full)
    assert full.peak_memory_bytes < none.peak_memory_bytes and seconds > 0 and freed > 0
    assert full.compute_time_s > none.compute_time_s
    # auto under a limit that only recompute meets: the plan fits and says what it recomputes
    limit = (none.peak_memory_bytes + full.peak_memory_bytes) // 2
    auto = plan_graph(graph, {"dp": 2}, topology="h100", strategy="dp",
                      memory_limit_bytes=limit)
    assert auto.fits and auto.recompute is not None, auto.solver
    # (the family's plan without recompute is not solved: its lower bound misses the limit)
    assert re.search(r"without recompute: (peak|at least \S+ \S+ per device, over the)",
                     auto.solver["recompute"]), auto.solver["recompute"]
    assert "activation recompute: " in auto.summary()
    from meshplan.planner import plan_report
    rep = plan_report(auto)["recompute"]
    assert rep["policy"] == auto.recompute[0] and rep["freed_bytes"] > 0
    # auto with room: nothing is recomputed
    roomy = plan_graph(graph, {"dp": 2}, topology="h100", strategy="dp")
    assert roomy.recompute is None
    # a saved plan keeps its choice and still matches the step as traced
    path = tmp_path / "rc.plan"
    auto.save(path)
    loaded = Plan.load(path)
    assert loaded.recompute == auto.recompute and loaded.graph_hash == auto.graph_hash
    loaded.check_compatible(graph=graph, mesh={"dp": 2})
    copy = next(n.name for n in loaded.graph.nodes if n.name.startswith(PREFIX))
    from meshplan.planner import explain
    assert explain(loaded, copy)["recompute"].startswith("recomputed: this is ")
    assert "freed after its last forward use" in explain(loaded, copy[len(PREFIX):])["recompute"]
    with pytest.raises(PlanError, match="recompute must be 'auto'"):
        plan_graph(graph, {"dp": 2}, recompute="most")


def test_when_nothing_fits_the_error_says_recompute_was_tried() -> None:
    _, traced = _traced()
    with pytest.raises(PlanError, match=r"Searched: .*; activation recompute \(selective and full "
                                        r"of the 3 layers.*not searched yet: "
                                        r"pipeline stages"):
        plan_graph(traced.graph, {"dp": 2}, topology="h100", memory_limit_bytes=64 << 10,
                   time_limit_s=5)
    from meshplan.examples import mlp
    ex = mlp.build(optimizer="sgd")
    flat = meshplan.trace(ex.step, *ex.batch(0)).graph
    with pytest.raises(PlanError, match="has no repeated layers to recompute"):
        plan_graph(flat, {"dp": 2}, recompute="full")
