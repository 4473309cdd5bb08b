"""The reference interpreter, the networkx view, FLOP/byte counts and the pure graph passes.

The interpreter is the oracle for every distributed run, so on a hand-built graph it must give
eager PyTorch's result bit for bit (same aten ops, same order, one process) and reject bad
inputs with an IRError naming the input. Counts use torch's FLOP formulas; passes must keep
``verify`` true and ``run_passes(check=True)`` must verify after every single pass.
"""

from __future__ import annotations

import dataclasses

import networkx as nx
import pytest
import torch

import meshplan
from meshplan.examples import mlp
from meshplan.ir import (
    ConstantValue,
    Graph,
    GraphInfo,
    IRError,
    Node,
    NodeKind,
    Output,
    OutputKind,
    Ref,
    ResultSpec,
    Role,
    ScalarMeta,
    TensorMeta,
    eliminate_dead_code,
    interpret,
    node_bytes,
    node_flops,
    remove_identity_ops,
    run_passes,
    verify,
)

aten = torch.ops.aten
BIAS = torch.tensor([0.5, -1.0, 2.0, 0.25])


def _t(*shape: int, role: Role = Role.ACTIVATION, dtype: str = "float32") -> TensorMeta:
    return TensorMeta(tuple(shape), dtype, role)


def _op(name: str, target: str, *args: object, out: TensorMeta | ScalarMeta) -> Node:
    return Node(name, NodeKind.OP, target, args=tuple(args), outputs=(out,))


def step_graph(extra: tuple[Node, ...] = ()) -> Graph:
    """loss = sum((x @ w + c) * (2 * step.item())); w <- w * 0.5; step <- step + 1."""
    nodes = (
        Node("p_w", NodeKind.INPUT, "model.w", outputs=(_t(3, 4, role=Role.PARAM),)),
        Node("s_step", NodeKind.INPUT, "opt.step", outputs=(_t(role=Role.OPT_STATE),)),
        Node("d_x", NodeKind.INPUT, "x", outputs=(_t(2, 3, role=Role.DATA),)),
        Node("c", NodeKind.CONSTANT, "", outputs=(_t(4, role=Role.CONSTANT),),
             value=ConstantValue("float32", (4,), BIAS.numpy().tobytes())),
        _op("mm", "aten.mm.default", Ref("d_x"), Ref("p_w"), out=_t(2, 4)),
        _op("add", "aten.add.Tensor", Ref("mm"), Ref("c"), out=_t(2, 4)),
        _op("item", "aten._local_scalar_dense.default", Ref("s_step"), out=ScalarMeta("float")),
        Node("scale", NodeKind.HOST, "operator.mul", args=(Ref("item"), 2.0),
             outputs=(ScalarMeta("float"),)),
        _op("mul", "aten.mul.Tensor", Ref("add"), Ref("scale"), out=_t(2, 4)),
        _op("loss", "aten.sum.default", Ref("mul"), out=_t()),
        _op("new_w", "aten.mul.Tensor", Ref("p_w"), 0.5, out=_t(3, 4)),
        _op("new_step", "aten.add.Tensor", Ref("s_step"), 1, out=_t()),
    ) + extra
    outputs = (
        Output(Ref("loss"), OutputKind.RESULT, "0"),
        Output(Ref("new_w"), OutputKind.STATE, "model.w", Role.PARAM),
        Output(Ref("new_step"), OutputKind.STATE, "opt.step", Role.OPT_STATE),
    )
    return Graph(nodes, outputs, GraphInfo("hand", result=ResultSpec("tensor")))


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"model.w": torch.randn(3, 4, generator=g), "x": torch.randn(2, 3, generator=g),
            "opt.step": torch.tensor(3.0)}


@pytest.fixture(scope="module")
def traced_mlp() -> Graph:
    """The steady-state graph of the MLP example with AdamW (host scalars, optimizer state)."""
    ex = mlp.build("adamw")
    return meshplan.trace(ex.step, *ex.batch(0)).graph


# ---- interpreter ----------------------------------------------------------------------------

def test_interpreter_matches_eager_bit_for_bit() -> None:
    """Outputs come back in graph-output order and equal eager aten calls exactly; the inputs
    are not modified (new state leaves through the outputs)."""
    inp = _inputs()
    before = {k: v.clone() for k, v in inp.items()}
    loss, new_w, new_step = interpret(verify(step_graph()), inp)
    w, x, step = before["model.w"], before["x"], before["opt.step"]
    scale = step.item() * 2.0
    expect_loss = aten.sum.default(aten.mul.Tensor(aten.add.Tensor(aten.mm.default(x, w), BIAS),
                                                   scale))
    assert torch.equal(loss, expect_loss)
    assert torch.equal(new_w, w * 0.5)
    assert torch.equal(new_step, torch.tensor(4.0))
    for k, v in inp.items():
        assert torch.equal(v, before[k]), f"interpret modified input {k}"


def test_interpreter_missing_input_names_it() -> None:
    """A missing input is an IRError naming the state, not a KeyError."""
    inp = _inputs()
    del inp["x"]
    with pytest.raises(IRError, match="missing graph input 'x'"):
        interpret(step_graph(), inp)


@pytest.mark.parametrize("bad", [torch.randn(3, 2), torch.randn(2, 3, dtype=torch.float64),
                                 [[1.0, 2.0, 3.0]] * 2])
def test_interpreter_wrong_input_names_it(bad: object) -> None:
    """A wrong shape, dtype or type is an IRError naming the input and the expected metadata."""
    inp = _inputs()
    inp["x"] = bad  # type: ignore[assignment]
    with pytest.raises(IRError, match=r"input 'x': expected float32\[2, 3\], got"):
        interpret(step_graph(), inp)


# ---- networkx ------------------------------------------------------------------------------

def test_networkx_view_of_traced_graph(traced_mlp: Graph) -> None:
    """One vertex per node carrying the node, one edge per distinct read, and a DAG."""
    g = traced_mlp
    view = g.to_networkx()
    assert nx.is_directed_acyclic_graph(view)
    assert view.number_of_nodes() == len(g.nodes)
    assert set(view.nodes) == {n.name for n in g.nodes}
    assert all(view.nodes[n.name]["node"] is n for n in g.nodes)
    assert view.number_of_edges() == sum(len(set(n.refs())) for n in g.nodes)
    order = {n.name: i for i, n in enumerate(g.nodes)}
    assert all(order[u] < order[v] for u, v in view.edges())


# ---- FLOPs and bytes ------------------------------------------------------------------------

def _mm_graph(m: int, k: int, n: int, dtype: str) -> Graph:
    nodes = (
        Node("a", NodeKind.INPUT, "a", outputs=(_t(m, k, role=Role.DATA, dtype=dtype),)),
        Node("b", NodeKind.INPUT, "b", outputs=(_t(k, n, role=Role.DATA, dtype=dtype),)),
        _op("mm", "aten.mm.default", Ref("a"), Ref("b"), out=_t(m, n, dtype=dtype)),
        _op("v", "aten.view.default", Ref("mm"), (m * n,), out=_t(m * n, dtype=dtype)),
        _op("tr", "aten.t.default", Ref("mm"), out=_t(n, m, dtype=dtype)),
        _op("relu", "aten.relu.default", Ref("mm"), out=_t(m, n, dtype=dtype)),
    )
    return verify(Graph(nodes, (Output(Ref("relu"), OutputKind.RESULT, "0"),)), shapes=True)


@pytest.mark.parametrize(("m", "k", "n"), [(2, 3, 4), (1, 1, 1), (64, 32, 128), (7, 5, 3)])
def test_mm_flops_and_bytes(m: int, k: int, n: int) -> None:
    """mm [m,k]x[k,n] costs 2*m*k*n FLOPs and moves (m*k + k*n + m*n) * 4 bytes in float32."""
    g = _mm_graph(m, k, n, "float32")
    assert node_flops(g, g.node("mm")) == 2 * m * k * n
    assert node_bytes(g, g.node("mm")) == (m * k + k * n + m * n) * 4


def test_mm_bytes_follow_dtype() -> None:
    """Bytes scale with the element size (bfloat16: 2 bytes)."""
    g = _mm_graph(2, 3, 4, "bfloat16")
    assert node_bytes(g, g.node("mm")) == (6 + 12 + 8) * 2


def test_views_inputs_and_pointwise_counts() -> None:
    """Views and inputs cost nothing; a pointwise op counts one FLOP per element and reads
    plus writes its tensors."""
    g = _mm_graph(2, 3, 4, "float32")
    for name in ("v", "tr", "a", "b"):
        assert node_flops(g, g.node(name)) == 0
        assert node_bytes(g, g.node(name)) == 0
    assert node_flops(g, g.node("relu")) == 8
    assert node_bytes(g, g.node("relu")) == 2 * 8 * 4


def test_host_nodes_cost_nothing() -> None:
    """Host scalar arithmetic runs on the CPU and is not counted."""
    g = step_graph()
    assert node_flops(g, g.node("scale")) == 0 and node_bytes(g, g.node("scale")) == 0


# ---- passes ---------------------------------------------------------------------------------

def test_eliminate_dead_code_drops_unused_values_but_keeps_inputs() -> None:
    """An unused op, host scalar and constant go; an unused input stays (calling convention);
    the live nodes keep their order and the result still verifies and computes the same."""
    extra = (
        Node("d_unused", NodeKind.INPUT, "unused", outputs=(_t(5, role=Role.DATA),)),
        _op("dead", "aten.neg.default", Ref("mm"), out=_t(2, 4)),
        _op("dead2", "aten.exp.default", Ref("dead"), out=_t(2, 4)),
        Node("dead_h", NodeKind.HOST, "operator.add", args=(Ref("item"), 1.0),
             outputs=(ScalarMeta("float"),)),
        Node("dead_c", NodeKind.CONSTANT, "", outputs=(_t(role=Role.CONSTANT),),
             value=ConstantValue("float32", (), b"\x00\x00\x00\x00")),
    )
    g = verify(step_graph(extra))
    out = eliminate_dead_code(g)
    verify(out, shapes=True)
    assert [n.name for n in out.nodes] == [n.name for n in step_graph().nodes] + ["d_unused"]
    assert out.outputs == g.outputs
    assert len(g.nodes) == len(step_graph().nodes) + 5, "the pass must not modify its input"
    inp = {**_inputs(), "unused": torch.zeros(5)}
    assert all(torch.equal(a, b) for a, b in zip(interpret(out, inp), interpret(g, inp)))


def test_remove_identity_ops_forwards_detach() -> None:
    """Chains of detach/alias vanish; readers and graph outputs are rewired to the source."""
    extra = (
        _op("det", "aten.detach.default", Ref("mm"), out=_t(2, 4)),
        _op("det2", "aten.alias.default", Ref("det"), out=_t(2, 4)),
        _op("neg", "aten.neg.default", Ref("det2"), out=_t(2, 4)),
        _op("cat", "aten.cat.default", (Ref("det"), Ref("neg")), out=_t(4, 4)),
    )
    g = step_graph(extra)
    g = Graph(g.nodes, g.outputs + (Output(Ref("det2"), OutputKind.RESULT, "1"),
                                    Output(Ref("cat"), OutputKind.RESULT, "2")),
              dataclasses.replace(g.info, result=ResultSpec("tuple")))
    out = remove_identity_ops(verify(g))
    verify(out, shapes=True)
    assert "det" not in out and "det2" not in out
    assert out.node("neg").args == (Ref("mm"),)
    assert out.node("cat").args == ((Ref("mm"), Ref("neg")),)
    assert out.outputs[3].ref == Ref("mm")
    inp = _inputs()
    assert all(torch.equal(a, b) for a, b in zip(interpret(out, inp), interpret(g, inp)))


def test_passes_keep_traced_graph_valid(traced_mlp: Graph) -> None:
    """The tracer's own passes are idempotent on its output and keep it valid."""
    out = run_passes(traced_mlp, (remove_identity_ops, eliminate_dead_code), check=True)
    verify(out, shapes=True)
    assert out.to_json() == traced_mlp.to_json()


def _drop_mm(g: Graph) -> Graph:
    return Graph(tuple(n for n in g.nodes if n.name != "mm"), g.outputs, g.info)


def _restore_mm(g: Graph) -> Graph:
    return step_graph()


def test_run_passes_check_verifies_after_each_pass() -> None:
    """A pass that breaks the graph is caught right after it runs, even when a later pass
    would repair it; without ``check`` the same pipeline runs through."""
    g = step_graph()
    with pytest.raises(IRError, match="node add reads %mm"):
        run_passes(g, (_drop_mm, _restore_mm), check=True)
    with pytest.raises(IRError, match="node add reads %mm"):
        run_passes(g, (_drop_mm,), check=True)
    assert run_passes(g, (_drop_mm,), check=False).nodes == _drop_mm(g).nodes
    assert run_passes(g, (_drop_mm, _restore_mm), check=False).nodes == g.nodes
