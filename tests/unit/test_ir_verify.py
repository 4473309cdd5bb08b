"""``verify`` accepts a well-formed graph and rejects each broken invariant with a clear IRError.

Every graph here is built by hand (no tracing), so each test breaks exactly one invariant of an
otherwise good graph and checks that the message names the culprit: the node, the state name or
the op target. ``verify(g, shapes=True)`` additionally re-runs every op on meta tensors.
"""

from __future__ import annotations

import dataclasses
import re
import struct

import pytest

from meshplan.ir import (
    ConstantValue,
    Graph,
    GraphInfo,
    IRError,
    Node,
    NodeKind,
    Output,
    OutputKind,
    Phase,
    Ref,
    ResultSpec,
    Role,
    ScalarMeta,
    TensorMeta,
    verify,
)

F32 = "float32"
W = "model.w"
STEP = "opt.state.model.w.step"


def _t(*shape: int, role: Role = Role.ACTIVATION) -> TensorMeta:
    return TensorMeta(tuple(shape), F32, role)


def _input(name: str, target: str, meta: TensorMeta) -> Node:
    return Node(name, NodeKind.INPUT, target, outputs=(meta,))


def _op(name: str, target: str, *args: object, out: TensorMeta | ScalarMeta) -> Node:
    return Node(name, NodeKind.OP, target, args=tuple(args), outputs=(out,))


def good_nodes() -> list[Node]:
    """x[2,3] @ w[3,4] + c[4], scaled by 2 * step.item(); w and step are updated."""
    bias = struct.pack("<4f", 0.5, -1.0, 2.0, 0.25)
    return [
        _input("p_w", W, _t(3, 4, role=Role.PARAM)),
        _input("s_step", STEP, _t(role=Role.OPT_STATE)),
        _input("d_x", "x", _t(2, 3, role=Role.DATA)),
        Node("c", NodeKind.CONSTANT, "", outputs=(_t(4, role=Role.CONSTANT),),
             value=ConstantValue(F32, (4,), bias)),
        _op("mm", "aten.mm.default", Ref("d_x"), Ref("p_w"), out=_t(2, 4)),
        _op("add", "aten.add.Tensor", Ref("mm"), Ref("c"), out=_t(2, 4)),
        _op("item", "aten._local_scalar_dense.default", Ref("s_step"), out=ScalarMeta("float")),
        Node("scale", NodeKind.HOST, "operator.mul", args=(Ref("item"), 2.0),
             outputs=(ScalarMeta("float"),), phase=Phase.UPDATE),
        _op("mul", "aten.mul.Tensor", Ref("add"), Ref("scale"), out=_t(2, 4)),
        _op("loss", "aten.sum.default", Ref("mul"), out=_t()),
        _op("new_w", "aten.mul.Tensor", Ref("p_w"), 0.5, out=_t(3, 4)),
        _op("new_step", "aten.add.Tensor", Ref("s_step"), 1, out=_t()),
    ]


def good_outputs() -> list[Output]:
    return [
        Output(Ref("loss"), OutputKind.RESULT, "0"),
        Output(Ref("new_w"), OutputKind.STATE, W, Role.PARAM),
        Output(Ref("new_step"), OutputKind.STATE, STEP, Role.OPT_STATE),
    ]


def make(nodes: list[Node] | None = None, outputs: list[Output] | None = None,
         result: ResultSpec = ResultSpec("tensor")) -> Graph:
    return Graph(tuple(good_nodes() if nodes is None else nodes),
                 tuple(good_outputs() if outputs is None else outputs),
                 GraphInfo(name="hand", result=result))


def replaced(name: str, **changes: object) -> list[Node]:
    """The good nodes with node ``name`` changed."""
    return [dataclasses.replace(n, **changes) if n.name == name else n for n in good_nodes()]


# ---- accepted -------------------------------------------------------------------------------

def test_good_graph_verifies_and_is_returned_unchanged() -> None:
    """A well-formed graph passes, structurally and on meta tensors, and verify returns it."""
    g = make()
    assert verify(g) is g
    assert verify(g, shapes=True) is g


def test_new_state_without_input_is_allowed() -> None:
    """A state output with no matching input (optimizer state created by the first step) is
    fine."""
    outs = good_outputs() + [Output(Ref("mul"), OutputKind.STATE, "opt.state.model.w.exp_avg",
                                    Role.OPT_STATE)]
    verify(make(outputs=outs))


@pytest.mark.parametrize(("kind", "keys", "n"), [("none", (), 0), ("tuple", (), 2),
                                                 ("list", (), 3), ("dict", ("a", "b"), 2)])
def test_result_specs_with_matching_counts(kind: str, keys: tuple[str, ...], n: int) -> None:
    """none takes no results, dict one per key, tuple/list any number."""
    results = [Output(Ref("loss"), OutputKind.RESULT, str(i)) for i in range(n)]
    verify(make(outputs=results + good_outputs()[1:], result=ResultSpec(kind, keys)))


# ---- structure ------------------------------------------------------------------------------

def test_duplicate_node_name() -> None:
    """Two nodes with one name: the name is reported."""
    nodes = good_nodes()
    nodes.insert(5, _op("mm", "aten.mm.default", Ref("d_x"), Ref("p_w"), out=_t(2, 4)))
    with pytest.raises(IRError, match="duplicate node name 'mm'"):
        verify(make(nodes))


def test_use_before_definition() -> None:
    """A node reading a value defined after it breaks topological order; reader and value are
    named."""
    nodes = good_nodes()
    mm = nodes.pop(4)
    nodes.insert(2, mm)     # before d_x
    with pytest.raises(IRError, match=r"node mm reads %d_x, which is not defined before it"):
        verify(make(nodes))


def test_read_of_undefined_node() -> None:
    """A read of a node that does not exist at all is the same error."""
    nodes = replaced("add", args=(Ref("mm"), Ref("ghost")))
    with pytest.raises(IRError, match=r"node add reads %ghost"):
        verify(make(nodes))


def test_ref_to_missing_output_index() -> None:
    """``%mm[1]`` when mm has one output: the reader, the ref and the producer are named."""
    nodes = replaced("add", args=(Ref("mm", 1), Ref("c")))
    with pytest.raises(IRError, match=r"node add reads %mm\[1\], which mm does not produce"):
        verify(make(nodes))


@pytest.mark.parametrize("target", ["aten.nosuch.default", "aten.mm.nosuch", "mm"])
def test_unknown_op_target(target: str) -> None:
    """An op that does not exist in this torch (another version, a corrupt file) is named."""
    with pytest.raises(IRError, match=re.escape(repr(target))):
        verify(make(replaced("mm", target=target)))


def test_mutating_op_rejected() -> None:
    """The IR is pure: an in-place op is rejected, naming the node and the op."""
    nodes = replaced("add", target="aten.add_.Tensor")
    with pytest.raises(IRError, match=r"node add calls mutating op aten\.add_\.Tensor"):
        verify(make(nodes))


def test_out_variant_rejected() -> None:
    """``out=`` forms write into an argument and are rejected like in-place ops."""
    with pytest.raises(IRError, match=r"mutating op aten\.mm\.out"):
        verify(make(replaced("mm", target="aten.mm.out")))


def test_unknown_host_function() -> None:
    """Host nodes are a closed set of scalar functions; anything else is named."""
    with pytest.raises(IRError, match=r"node scale: unknown host function 'os\.system'"):
        verify(make(replaced("scale", target="os.system")))


def test_host_node_must_produce_a_scalar() -> None:
    """A host node recorded as producing a tensor is rejected."""
    with pytest.raises(IRError, match="host node scale must produce one scalar"):
        verify(make(replaced("scale", outputs=(_t(),))))


def test_op_without_outputs() -> None:
    """Every op node records at least one output."""
    with pytest.raises(IRError, match="op node loss has no outputs"):
        verify(make(replaced("loss", outputs=())))


def test_constant_value_must_match_metadata() -> None:
    """A constant's bytes must have the size its metadata says."""
    bad = ConstantValue(F32, (4,), b"\x00" * 12)
    with pytest.raises(IRError, match="constant c: 12 bytes for 16 expected"):
        verify(make(replaced("c", value=bad)))
    with pytest.raises(IRError, match="constant c: value does not match its metadata"):
        verify(make(replaced("c", value=ConstantValue(F32, (2, 2), b"\x00" * 16))))


# ---- inputs ---------------------------------------------------------------------------------

@pytest.mark.parametrize("role", [Role.ACTIVATION, Role.CONSTANT])
def test_input_role_must_be_state_or_data(role: Role) -> None:
    """An input without a role (the default ACTIVATION) or with CONSTANT is rejected."""
    with pytest.raises(IRError, match=f"input d_x has role {role.value}"):
        verify(make(replaced("d_x", outputs=(_t(2, 3, role=role),))))


def test_input_without_role_default() -> None:
    """A TensorMeta built without a role defaults to ACTIVATION, which no input may have."""
    with pytest.raises(IRError, match="input d_x has role activation"):
        verify(make(replaced("d_x", outputs=(TensorMeta((2, 3), F32),))))


def test_input_with_arguments_or_scalar_output() -> None:
    """Inputs take no arguments and produce one tensor."""
    with pytest.raises(IRError, match="input d_x must have no arguments"):
        verify(make(replaced("d_x", args=(1,))))
    with pytest.raises(IRError, match="input d_x must have no arguments"):
        verify(make(replaced("d_x", outputs=(ScalarMeta("float"),))))


def test_duplicate_state_input() -> None:
    """Two input nodes for one state name: the state and both nodes are named."""
    nodes = good_nodes()
    nodes.insert(1, _input("p_w2", W, _t(3, 4, role=Role.PARAM)))
    with pytest.raises(IRError, match=r"two inputs for state 'model\.w': p_w2, p_w"):
        verify(make(nodes))


# ---- outputs --------------------------------------------------------------------------------

def test_state_output_written_twice() -> None:
    """One state may receive one new value."""
    outs = good_outputs() + [Output(Ref("new_w"), OutputKind.STATE, W, Role.PARAM)]
    with pytest.raises(IRError, match=r"state 'model\.w' is written twice"):
        verify(make(outputs=outs))


def test_state_output_shape_differs_from_input() -> None:
    """A new value must have its input's shape and dtype; both are printed."""
    outs = good_outputs()
    outs[1] = Output(Ref("mm"), OutputKind.STATE, W, Role.PARAM)
    with pytest.raises(IRError, match=r"state 'model\.w': new value float32\[2, 4\] differs "
                                      r"from input float32\[3, 4\]"):
        verify(make(outputs=outs))


def test_state_output_dtype_differs_from_input() -> None:
    """A dtype change is as wrong as a shape change."""
    nodes = good_nodes() + [_op("half", "aten._to_copy.default", Ref("new_w"),
                                out=TensorMeta((3, 4), "float16"))]
    outs = good_outputs()
    outs[1] = Output(Ref("half"), OutputKind.STATE, W, Role.PARAM)
    with pytest.raises(IRError, match=r"state 'model\.w': new value float16\[3, 4\]"):
        verify(make(nodes, outs))


@pytest.mark.parametrize(("name", "role"), [("", Role.PARAM), (W, None), (W, Role.DATA)])
def test_state_output_needs_name_and_state_role(name: str, role: Role | None) -> None:
    """A STATE output without a state name or with a non-state role is rejected."""
    outs = good_outputs()
    outs[1] = Output(Ref("new_w"), OutputKind.STATE, name, role)
    with pytest.raises(IRError, match="needs a state name and a state role"):
        verify(make(outputs=outs))


def test_graph_output_reading_missing_node() -> None:
    """A graph output pointing nowhere is named."""
    outs = good_outputs() + [Output(Ref("ghost"), OutputKind.RESULT, "1")]
    with pytest.raises(IRError, match=r"graph output 1 reads %ghost, which does not exist"):
        verify(make(outputs=outs, result=ResultSpec("tuple")))


@pytest.mark.parametrize(("spec", "n", "expected"), [
    (ResultSpec("tensor"), 0, 1), (ResultSpec("tensor"), 2, 1), (ResultSpec("none"), 1, 0),
    (ResultSpec("dict", ("a", "b", "c")), 2, 3),
])
def test_wrong_result_count(spec: ResultSpec, n: int, expected: int) -> None:
    """The RESULT outputs must match the ResultSpec; kind and both counts are printed."""
    results = [Output(Ref("loss"), OutputKind.RESULT, str(i)) for i in range(n)]
    with pytest.raises(IRError, match=f"result spec {spec.kind} expects {expected} results, "
                                      f"graph has {n}"):
        verify(make(outputs=results + good_outputs()[1:], result=spec))


# ---- shapes=True ----------------------------------------------------------------------------

def test_shapes_catches_wrong_recorded_shape() -> None:
    """mm of [2,3] x [3,4] recorded as [3,3]: structural verify passes, the meta re-run names
    the node, the recorded and the real shape."""
    g = make(replaced("mm", outputs=(_t(3, 3),)))
    verify(g)
    with pytest.raises(IRError, match=r"node mm output 0: recorded float32\[3, 3\], "
                                      r"op gives float32\[2, 4\]"):
        verify(g, shapes=True)


def test_shapes_catches_wrong_recorded_dtype() -> None:
    """The dtype is part of the check."""
    g = make(replaced("loss", outputs=(TensorMeta((), "float64"),)))
    with pytest.raises(IRError, match=r"node loss output 0: recorded float64\[\], "
                                      r"op gives float32\[\]"):
        verify(g, shapes=True)
