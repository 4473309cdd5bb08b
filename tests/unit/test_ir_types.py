"""The IR's typed metadata validates itself on construction.

Pins down that ``TensorMeta``, ``ScalarMeta``, ``Node`` and ``ResultSpec`` reject malformed
values with :class:`IRError` (never a bare ``TypeError``/``ValueError``) and that the derived
facts (``numel``, ``nbytes``, ``Ref.__str__``, ``SourceLocation.__str__``) are right.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from meshplan import MeshplanError
from meshplan.ir import (
    ConstantValue,
    IRError,
    Node,
    NodeKind,
    Ref,
    ResultSpec,
    Role,
    ScalarMeta,
    SourceLocation,
    TensorMeta,
)

F32_SCALAR = ConstantValue("float32", (), b"\x00\x00\x80?")


# ---- TensorMeta ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float", "torch.float32", "fp32", "", "Float32"])
def test_tensor_meta_rejects_unknown_dtype(dtype: str) -> None:
    """Only the IR's dtype names (``float32``, not ``torch.float32``) are accepted; the error
    names the bad dtype."""
    with pytest.raises(IRError, match="unknown dtype"):
        TensorMeta((2,), dtype)


@pytest.mark.parametrize("shape", [(-1,), (2, -3), (2.0,), ("2",), (None,)])
def test_tensor_meta_rejects_bad_shape(shape: tuple[Any, ...]) -> None:
    """Shapes are non-negative ints; a negative or non-int entry raises IRError."""
    with pytest.raises(IRError, match="non-negative ints"):
        TensorMeta(shape, "float32")


@pytest.mark.parametrize("role", ["param", None, 3])
def test_tensor_meta_rejects_non_role(role: Any) -> None:
    """The role must be a ``Role`` member, never a bare string (house style: enums, not str)."""
    with pytest.raises(IRError, match="must be a Role"):
        TensorMeta((2,), "float32", role)


def test_tensor_meta_accepts_zero_sized_and_scalar_shapes() -> None:
    """A zero-sized dim and the empty shape (a 0-d tensor) are valid."""
    assert TensorMeta((0, 5), "float32").numel == 0
    assert TensorMeta((), "int64").numel == 1


@pytest.mark.parametrize(
    ("shape", "dtype", "numel", "nbytes"),
    [
        ((2, 3), "float32", 6, 24),
        ((), "float64", 1, 8),
        ((4, 0, 7), "float16", 0, 0),
        ((3, 5), "bfloat16", 15, 30),
        ((10,), "bool", 10, 10),
        ((2, 2), "int64", 4, 32),
        ((3,), "complex128", 3, 48),
        ((7,), "uint8", 7, 7),
    ],
)
def test_tensor_meta_numel_and_nbytes(
    shape: tuple[int, ...], dtype: str, numel: int, nbytes: int
) -> None:
    """``numel`` is the product of the shape and ``nbytes`` is numel times the element size."""
    m = TensorMeta(shape, dtype)
    assert m.numel == numel
    assert m.nbytes == nbytes


def test_tensor_meta_defaults_and_with_role() -> None:
    """The default role is ACTIVATION; ``with_role`` returns a new meta with only the role
    changed, and metadata is frozen and hashable."""
    m = TensorMeta((2,), "float32")
    assert m.role is Role.ACTIVATION
    p = m.with_role(Role.PARAM)
    assert (p.shape, p.dtype, p.role) == ((2,), "float32", Role.PARAM)
    assert m.role is Role.ACTIVATION
    assert hash(p) == hash(TensorMeta((2,), "float32", Role.PARAM))
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.shape = (3,)  # type: ignore[misc]


def test_ir_error_is_a_meshplan_error() -> None:
    """Callers can catch every deliberate failure with MeshplanError."""
    assert issubclass(IRError, MeshplanError)


# ---- ScalarMeta ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float", "int", "bool"])
def test_scalar_meta_accepts_python_scalar_types(dtype: str) -> None:
    """Host scalars are Python floats, ints or bools."""
    assert ScalarMeta(dtype).dtype == dtype


@pytest.mark.parametrize("dtype", ["float32", "double", "complex", ""])
def test_scalar_meta_rejects_other_dtypes(dtype: str) -> None:
    """A tensor dtype is not a scalar dtype; the error lists the allowed ones."""
    with pytest.raises(IRError, match="scalar dtype must be one of"):
        ScalarMeta(dtype)


# ---- Node ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["", "a-b", "a.b", "x y", "%x", "a[0]", "w/b"])
def test_node_rejects_bad_names(name: str) -> None:
    """Node names are identifiers (they appear as ``%name`` in listings and as JSON keys)."""
    with pytest.raises(IRError, match="node name must be a non-empty identifier"):
        Node(name, NodeKind.OP, "aten.mm.default", outputs=(TensorMeta((1,), "float32"),))


@pytest.mark.parametrize("name", ["x", "p_model_fc1_weight", "mm_12", "_tmp", "X9"])
def test_node_accepts_identifier_names(name: str) -> None:
    """Names like the ones the tracer makes are accepted."""
    assert Node(name, NodeKind.OP, "aten.mm.default").name == name


def test_node_rejects_non_kind() -> None:
    """The kind must be a NodeKind member; the message names the node."""
    with pytest.raises(IRError, match="node n: kind must be a NodeKind"):
        Node("n", "op", "aten.mm.default")  # type: ignore[arg-type]


def test_constant_node_requires_value() -> None:
    """A CONSTANT node without a value is rejected, naming the node."""
    with pytest.raises(IRError, match="node c: a value is carried by CONSTANT nodes"):
        Node("c", NodeKind.CONSTANT, "", outputs=(TensorMeta((), "float32", Role.CONSTANT),))


@pytest.mark.parametrize("kind", [NodeKind.INPUT, NodeKind.OP, NodeKind.HOST])
def test_value_only_on_constant_nodes(kind: NodeKind) -> None:
    """A value on any non-constant node is rejected."""
    with pytest.raises(IRError, match="node n: a value is carried by CONSTANT nodes"):
        Node("n", kind, "x", value=F32_SCALAR)


def test_constant_node_with_value_and_accessors() -> None:
    """A well-formed constant builds; ``meta`` and ``role`` read output 0."""
    n = Node("c", NodeKind.CONSTANT, "", outputs=(TensorMeta((), "float32", Role.CONSTANT),),
             value=F32_SCALAR)
    assert n.meta == TensorMeta((), "float32", Role.CONSTANT)
    assert n.role is Role.CONSTANT
    assert Node("h", NodeKind.HOST, "operator.mul", outputs=(ScalarMeta("float"),)).role is None
    assert Node("o", NodeKind.OP, "aten.mm.default").meta is None


def test_node_refs_walks_nested_args_and_kwargs() -> None:
    """``refs()`` yields every Ref in args (nested tuples included), then kwargs, in order."""
    n = Node("n", NodeKind.OP, "aten.cat.default",
             args=((Ref("a"), (Ref("b", 2), 3)), 1.0),
             kwargs=(("out_like", Ref("c")), ("k", None)))
    assert list(n.refs()) == [Ref("a"), Ref("b", 2), Ref("c")]


# ---- ResultSpec, Ref, SourceLocation ------------------------------------------------------

@pytest.mark.parametrize("kind", ["none", "tensor", "tuple", "list", "dict"])
def test_result_spec_accepts_known_kinds(kind: str) -> None:
    """The five result shapes a step may return."""
    assert ResultSpec(kind).kind == kind


@pytest.mark.parametrize("kind", ["scalar", "Tensor", "", "set"])
def test_result_spec_rejects_unknown_kind(kind: str) -> None:
    """Any other result kind is an IRError naming it."""
    with pytest.raises(IRError, match="unknown result kind"):
        ResultSpec(kind)


@pytest.mark.parametrize(
    ("ref", "text"), [(Ref("mm"), "%mm"), (Ref("split", 0), "%split"), (Ref("split", 2), "%split[2]")]
)
def test_ref_str(ref: Ref, text: str) -> None:
    """Output 0 prints as ``%name``; other outputs as ``%name[i]``."""
    assert str(ref) == text


def test_ref_equality_and_hash() -> None:
    """Refs are values: equal when node and index are, usable as dict keys."""
    assert Ref("a") == Ref("a", 0)
    assert Ref("a", 1) != Ref("a", 0)
    assert {Ref("a"): 1}[Ref("a", 0)] == 1


def test_source_location_str() -> None:
    """``file:line in function`` when the function is known, ``file:line`` otherwise."""
    assert str(SourceLocation("train.py", 42, "forward", "y = f(x)")) == "train.py:42 in forward"
    assert str(SourceLocation("train.py", 7)) == "train.py:7"
