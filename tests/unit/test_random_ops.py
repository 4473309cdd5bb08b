"""Random ops on a mesh (``ir/_random.py``, ``backends/_rng.py``, ``planner/rules/random_ops.py``):
which nodes are random, the per-rank seed derivation (replicas draw equal values, shards
different ones), that the seeded call draws what the seed says without touching the process's
own random state, and that no rule gives a random op a partial output."""

from __future__ import annotations

import pytest
import torch

from meshplan import LoweringError
from meshplan.backends._rng import StepRNG, call_seeded, op_seed, stream
from meshplan.ir import Graph, Node, NodeKind, Ref, Role, TensorMeta, is_random, random_nodes
from meshplan.planner import Partial, Replicate, Shard
from meshplan.planner.rules import strategies_for
from meshplan.planner.rules.random_ops import RANDOM

R, S0, S1 = Replicate(), Shard(0), Shard(1)
SIZES = (2, 3)                                   # a dp=2 x tp=3 mesh
COORDS = [(a, b) for a in range(2) for b in range(3)]


def _node(target: str, *args, kwargs=(), name: str = "op") -> Node:
    return Node(name, NodeKind.OP, target, args, tuple(kwargs),
                (TensorMeta((6, 4), "float32"),))


def _streams(layout, name: str = "bernoulli") -> dict[tuple[int, int], int]:
    node = _node("aten.bernoulli.p", Ref("x"), 0.9, name=name)
    return {c: stream(node, (layout,), c, SIZES) for c in COORDS}


def test_replicated_axes_share_a_seed_and_sharded_axes_do_not() -> None:
    """Output (S(0), R): the batch split on dp, replicated on tp. The three tp ranks of one dp
    coordinate hold replicas and get one stream; the two dp coordinates hold different rows and
    get different streams. Fully replicated: one stream everywhere; sharded on both axes: six.
    The per-step seed then differs by step, run seed and op, never by anything else."""
    s = _streams((S0, R))
    for a in range(2):
        assert len({s[(a, b)] for b in range(3)}) == 1
    assert s[(0, 0)] != s[(1, 0)]
    assert len(set(_streams((R, R)).values())) == 1
    assert len(set(_streams((S0, S1)).values())) == 6
    assert len(set(_streams((R, S1)).values())) == 3
    assert _streams((S0, R), "bernoulli_1")[(0, 0)] != s[(0, 0)]     # another op: another stream
    base = op_seed(StepRNG(7, 3), s[(0, 0)])
    assert base == op_seed(StepRNG(7, 3), s[(0, 1)])                  # replicas: equal seeds
    assert 0 <= base < 2**63
    assert len({base, op_seed(StepRNG(7, 4), s[(0, 0)]), op_seed(StepRNG(8, 3), s[(0, 0)]),
                op_seed(StepRNG(7, 3), s[(1, 0)])}) == 4
    # an axis of size 1 splits nothing: its placement does not matter
    node = _node("aten.bernoulli.p", Ref("x"), 0.9)
    assert stream(node, ((S0, R),), (0, 0), (1, 3)) == stream(node, ((R, R),), (0, 0), (1, 3))


def test_a_partial_random_output_is_refused_with_the_node_and_the_fix() -> None:
    node = _node("aten.bernoulli.p", Ref("x"), 0.9)
    with pytest.raises(LoweringError, match=r"bernoulli\.p \(op\).*partial.*plan the step again"):
        stream(node, ((Partial(), R),), (0, 0), SIZES)


def test_no_rule_gives_a_random_op_a_partial_output() -> None:
    """Every strategy of every random rule, on inputs of every kind: outputs are Replicate or
    Shard (a partial input of a shape-only op gives a replicated output)."""
    x = Node("x", NodeKind.INPUT, "x", outputs=(TensorMeta((6, 4), "float32", Role.DATA),))
    cases = {"aten.bernoulli.p": (Ref("x"), 0.5), "aten.bernoulli.default": (Ref("x"),),
             "aten.rand_like.default": (Ref("x"),), "aten.randn_like.default": (Ref("x"),),
             "aten.randint_like.default": (Ref("x"), 5), "aten.randint_like.low_dtype":
             (Ref("x"), 0, 5), "aten.rand.default": ((6, 4),), "aten.randn.default": ((6, 4),)}
    assert set(cases) == RANDOM
    for target, args in cases.items():
        op = _node(target, *args)
        graph = Graph((x, op), ())
        strategies, has_rule = strategies_for(op, graph)
        assert has_rule and len(strategies) > 1, target
        assert is_random(op), target
        for s in strategies:
            assert not any(isinstance(p, Partial) for p in s.outputs), (target, s)


def test_random_nodes_are_tagged_ops_but_not_attention_without_dropout() -> None:
    q = Ref("q")
    flash = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    assert not is_random(_node(flash, q, q, q, 0.0, True))
    assert not is_random(_node(flash, q, q, q))                      # dropout_p defaults to 0
    assert is_random(_node(flash, q, q, q, 0.1, True))
    assert is_random(_node(flash, q, q, q, kwargs=(("dropout_p", 0.1),)))
    assert not is_random(_node("aten.empty_like.default", q))
    assert not is_random(_node("aten.mul.Tensor", q, q))
    graph = Graph((_node("aten.mul.Tensor", q, q, name="a"),
                   _node("aten.rand_like.default", q, name="b")), ())
    assert [n.name for n in random_nodes(graph)] == ["b"]


@pytest.mark.parametrize("target", ["aten.bernoulli.p", "aten.rand_like.default"])
def test_a_seeded_call_draws_from_its_seed_and_leaves_the_global_generator(target: str) -> None:
    """``bernoulli.p`` takes a generator argument; ``rand_like`` has none and draws from the
    default generator, seeded around the call and restored."""
    from meshplan.ir import resolve_op
    from meshplan.ir._random import takes_generator

    fn, x = resolve_op(target), torch.empty(64)
    args = (x, 0.5) if target == "aten.bernoulli.p" else (x,)
    before = torch.random.get_rng_state()
    a = call_seeded(fn, args, {}, 11, "cpu", takes_generator(target))
    b = call_seeded(fn, args, {}, 11, "cpu", takes_generator(target))
    c = call_seeded(fn, args, {}, 12, "cpu", takes_generator(target))
    assert torch.equal(torch.random.get_rng_state(), before)
    assert torch.equal(a, b) and not torch.equal(a, c)
