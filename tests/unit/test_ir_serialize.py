"""Versioned JSON (de)serialisation of graphs: an exact round trip, strict JSON, clear errors.

Pins down that ``Graph.from_json(g.to_json())`` reproduces every node, output and fact of the
traced example graphs (constants, host scalars, multi-output nodes, torch dtype/device/
memory_format literals) and of hand-built graphs with non-finite floats and nested tuples; that
every torch enum literal survives the trip; that ``save`` writes atomically; and that corrupt
or foreign files fail with an IRError that says what is wrong (and, for ``load``, which file).
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import meshplan
from meshplan.examples import cnn, mlp
from meshplan.ir import (
    FORMAT,
    VERSION,
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
    SourceLocation,
    TensorMeta,
    atomic_write_text,
    verify,
)
from meshplan.ir._serialize import decode_arg, encode_arg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _traced_examples import default_gpt  # noqa: E402  (one GPT trace for the unit tests)

INF, NAN = float("inf"), float("nan")
_BUILDERS: dict[str, Callable[[], Any]] = {
    "mlp-sgd": lambda: mlp.build("sgd"),
    "mlp-adamw": lambda: mlp.build("adamw", clip=1.0),
    "cnn": lambda: cnn.build(),
}
TRACED_CASES = ["mlp-sgd/steady", "mlp-adamw/steady", "mlp-adamw/first", "gpt/steady",
                "gpt/first", "cnn/steady", "cnn/first"]


def _strict_json(text: str) -> Any:
    """Parse ``text`` refusing NaN/Infinity tokens, which are not JSON."""
    def refuse(token: str) -> Any:
        raise AssertionError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def traced_graph() -> Callable[[str], Graph]:
    """``case -> Graph`` for ``example/steady|first``; each example is traced once per module."""
    cache: dict[str, meshplan.TracedStep] = {}

    def get(case: str) -> Graph:
        example, which = case.split("/")
        if example not in cache:
            if example == "gpt":             # gpt.build(), traced once for the unit tests
                cache[example] = default_gpt()[1]
            else:
                ex = _BUILDERS[example]()
                cache[example] = meshplan.trace(ex.step, *ex.batch(0))
        tr = cache[example]
        g = tr.graph if which == "steady" else tr.first_step_graph
        assert g is not None
        return g

    return get


# ---- traced graphs --------------------------------------------------------------------------

@pytest.mark.parametrize("case", TRACED_CASES)
def test_traced_graph_round_trip_is_exact(traced_graph: Callable[[str], Graph], case: str) -> None:
    """JSON -> Graph -> JSON is the identity, and the decoded nodes, outputs and info are equal
    to the originals (so no literal changes type: tuples stay tuples, dtypes stay dtypes)."""
    g = traced_graph(case)
    text = g.to_json()
    _strict_json(text)
    back = Graph.from_json(text)
    assert back.to_json() == text
    assert back.nodes == g.nodes
    assert back.outputs == g.outputs
    assert back.info == g.info
    assert Graph.from_json(g.to_json(indent=2)).to_json() == text


def test_traced_graphs_cover_the_interesting_cases(traced_graph: Callable[[str], Graph]) -> None:
    """The round trip above really exercises constants (with bytes), host scalars,
    multi-output nodes and dtype/device/memory_format literals."""
    seen: set[str] = set()
    for case in TRACED_CASES:
        for n in traced_graph(case).nodes:
            if n.kind is NodeKind.CONSTANT and n.value is not None and n.value.data is not None:
                seen.add("constant")
            if n.kind is NodeKind.HOST:
                seen.add("host")
            if len(n.outputs) > 1:
                seen.add("multi-output")
            for v in list(n.args) + [v for _, v in n.kwargs]:
                for cls in (torch.dtype, torch.device, torch.memory_format):
                    if isinstance(v, cls):
                        seen.add(cls.__name__)
    assert seen == {"constant", "host", "multi-output", "dtype", "device", "memory_format"}


# ---- hand-built graphs ----------------------------------------------------------------------

def literal_graph() -> Graph:
    """A small verifiable graph full of awkward literals: inf, -inf, nan, nested tuples of Refs,
    torch dtype/device/layout/memory_format kwargs, a constant and a host scalar."""
    f32, cpu = torch.float32, torch.device("cpu")
    factory = (("dtype", f32), ("layout", torch.strided), ("device", cpu), ("pin_memory", False))
    t = lambda *s: TensorMeta(tuple(s), "float32")  # noqa: E731
    nodes = (
        Node("d_x", NodeKind.INPUT, "x", outputs=(TensorMeta((2, 3), "float32", Role.DATA),)),
        Node("c", NodeKind.CONSTANT, "", outputs=(TensorMeta((3,), "float32", Role.CONSTANT),),
             value=ConstantValue("float32", (3,), struct.pack("<3f", 1.0, -0.0, 3.5))),
        Node("full_inf", NodeKind.OP, "aten.full.default", ((2, 3), INF), factory, (t(2, 3),)),
        Node("full_nan", NodeKind.OP, "aten.full.default", ((2, 3), NAN), factory, (t(2, 3),)),
        Node("empty", NodeKind.OP, "aten.empty.memory_format", ((2, 3),),
             factory + (("memory_format", torch.contiguous_format),), (t(2, 3),)),
        Node("clamp", NodeKind.OP, "aten.clamp.default", (Ref("d_x"), -INF, INF), (),
             (t(2, 3),), source=SourceLocation("train.py", 3, "step", "x.clamp(-inf, inf)"),
             module_path="model.fc"),
        Node("fix", NodeKind.OP, "aten.nan_to_num.default", (Ref("full_nan"),),
             (("nan", 0.0), ("posinf", 1e308), ("neginf", -INF)), (t(2, 3),)),
        Node("cat", NodeKind.OP, "aten.cat.default",
             ((Ref("clamp"), Ref("fix"), Ref("full_inf"), Ref("empty")), 0), (), (t(8, 3),)),
        Node("add", NodeKind.OP, "aten.add.Tensor", (Ref("cat"), Ref("c")), (), (t(8, 3),)),
        Node("bf", NodeKind.OP, "aten._to_copy.default", (Ref("add"),),
             (("dtype", torch.bfloat16), ("memory_format", torch.preserve_format)),
             (TensorMeta((8, 3), "bfloat16"),)),
        Node("sum", NodeKind.OP, "aten.sum.dim_IntList", (Ref("add"), (0, 1), False), (), (t(),)),
        Node("item", NodeKind.OP, "aten._local_scalar_dense.default", (Ref("sum"),), (),
             (ScalarMeta("float"),)),
        Node("h", NodeKind.HOST, "operator.mul", (Ref("item"), -INF), (),
             (ScalarMeta("float"),)),
    )
    outputs = (Output(Ref("sum"), OutputKind.RESULT, "a"), Output(Ref("bf"), OutputKind.RESULT, "b"))
    info = GraphInfo("hand.step", SourceLocation("train.py", 1, "step"),
                     ResultSpec("dict", ("a", "b")), torch.__version__)
    return Graph(nodes, outputs, info)


def test_hand_built_graph_round_trip_with_non_finite_floats() -> None:
    """inf, -inf and nan survive as floats (compared by repr since nan != nan), the JSON stays
    strict, and the decoded graph still verifies on meta tensors."""
    g = verify(literal_graph(), shapes=True)
    text = g.to_json()
    doc = _strict_json(text)
    assert doc["format"] == FORMAT and doc["version"] == VERSION
    back = Graph.from_json(text)
    assert back.to_json() == text
    assert repr(back.nodes) == repr(g.nodes)
    assert back.outputs == g.outputs and back.info == g.info
    fill = back.node("full_nan").args[1]
    assert isinstance(fill, float) and math.isnan(fill)
    assert back.node("clamp").args[1:] == (-INF, INF)
    assert back.node("cat").args[0] == (Ref("clamp"), Ref("fix"), Ref("full_inf"), Ref("empty"))
    assert dict(back.node("empty").kwargs)["memory_format"] is torch.contiguous_format
    assert dict(back.node("empty").kwargs)["layout"] is torch.strided
    assert dict(back.node("bf").kwargs)["dtype"] is torch.bfloat16
    verify(back, shapes=True)


def test_meta_constant_without_bytes_round_trips() -> None:
    """A constant traced from meta tensors carries no bytes (``data=None``); that survives."""
    node = Node("c", NodeKind.CONSTANT, "", outputs=(TensorMeta((2,), "int64", Role.CONSTANT),),
                value=ConstantValue("int64", (2,), None))
    g = Graph((node,), (Output(Ref("c"), OutputKind.RESULT, "0"),))
    assert Graph.from_json(g.to_json()).nodes == g.nodes


# ---- arguments ------------------------------------------------------------------------------

def _every(kind: type) -> list[Any]:
    return sorted({v for v in vars(torch).values() if isinstance(v, kind)}, key=str)


def _json_trip(a: Any) -> Any:
    return decode_arg(json.loads(json.dumps(encode_arg(a), allow_nan=False)))


@pytest.mark.parametrize("value", _every(torch.layout) + _every(torch.memory_format), ids=str)
def test_every_torch_layout_and_memory_format_round_trips(value: Any) -> None:
    """``encode_arg`` accepts every torch.layout and torch.memory_format, so ``decode_arg`` must
    give each one back (e.g. ``channels_last_3d`` from a Conv3d model in channels-last)."""
    assert _json_trip(value) == value


@pytest.mark.parametrize("value", _every(torch.dtype), ids=str)
def test_every_torch_dtype_round_trips(value: torch.dtype) -> None:
    """Every dtype, including float8 and quantised ones, comes back as itself."""
    assert _json_trip(value) is value


_DEVICES = [torch.device("cpu"), torch.device("meta"), torch.device("cuda"),
            torch.device("cuda", 1)]
_names = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
_leaves = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
           | st.sampled_from(_every(torch.dtype)) | st.sampled_from(_DEVICES)
           | st.builds(Ref, _names, st.integers(0, 5)))
_args = st.recursive(_leaves, lambda kids: st.lists(kids, max_size=4).map(tuple), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(_args)
def test_random_argument_trees_round_trip(a: Any) -> None:
    """Any tree of literals and Refs encodes to strict JSON and decodes to an equal tree of the
    same types (repr equality: distinguishes True from 1 and tuples from lists, and nan from
    nan)."""
    encoded = json.dumps(encode_arg(a), allow_nan=False)
    assert repr(decode_arg(json.loads(encoded))) == repr(a)


@pytest.mark.parametrize("bad", [[1, 2], {"a": 1}, {1, 2}, object(), torch.zeros(1), 1j])
def test_encode_rejects_unsupported_arguments(bad: Any) -> None:
    """Only tuples (not lists), scalars, strings, Refs and torch enums are arguments."""
    with pytest.raises(IRError, match="cannot serialise argument"):
        encode_arg(bad)


# ---- files ----------------------------------------------------------------------------------

def test_save_and_load_through_a_file(tmp_path: Path) -> None:
    """``save`` then ``load`` gives the same graph; overwriting works; no temp file is left."""
    g = literal_graph()
    path = tmp_path / "graph.json"
    path.write_text("old contents")
    g.save(str(path))
    assert Graph.load(str(path)).to_json() == g.to_json()
    g.save(str(path))
    assert sorted(os.listdir(tmp_path)) == ["graph.json"]


def test_atomic_write_failure_leaves_no_temp_file(tmp_path: Path) -> None:
    """When the final rename fails (the target is a directory), the temp file is removed and
    the error propagates."""
    target = tmp_path / "taken"
    target.mkdir()
    with pytest.raises(OSError):
        atomic_write_text(target, "text")
    assert sorted(os.listdir(tmp_path)) == ["taken"]


def _valid_doc() -> dict[str, Any]:
    return json.loads(literal_graph().to_json())


def _without(*path: Any) -> dict[str, Any]:
    doc = _valid_doc()
    d: Any = doc
    for k in path[:-1]:
        d = d[k]
    del d[path[-1]]
    return doc


def _node_field(field: str, value: Any) -> dict[str, Any]:
    doc = _valid_doc()
    doc["nodes"][3][field] = value     # the 'full_nan' node
    return doc


def _dumps(doc: Any) -> str:
    return json.dumps(doc)


CORRUPT: list[tuple[str, str, str]] = [
    ("not-json", "this is {not json", "graph is not valid JSON"),
    ("empty-file", "", "graph is not valid JSON"),
    ("foreign", _dumps({"format": "other"}),
     r"not a meshplan graph \(format 'other', expected 'meshplan\.ir'\).*meshplan trace"),
    ("json-list", _dumps([1, 2]), r"not a meshplan graph \(format None"),
    ("wrong-version", _dumps({**_valid_doc(), "version": 99}),
     r"graph format version 99 is not supported.*re-trace"),
    ("no-version", _dumps(_without("version")), "graph format version None is not supported"),
    ("no-nodes", _dumps(_without("nodes")), "corrupt meshplan graph: KeyError: 'nodes'"),
    ("no-info", _dumps(_without("info")), "corrupt meshplan graph: KeyError: 'info'"),
    ("no-outputs", _dumps(_without("outputs")), "corrupt meshplan graph: KeyError: 'outputs'"),
    ("node-no-kind", _dumps(_without("nodes", 0, "kind")), "KeyError: 'kind'"),
    ("bad-kind", _dumps(_node_field("kind", "weird")), "'weird' is not a valid NodeKind"),
    ("bad-dtype", _dumps(_node_field("outputs", [{"shape": [2], "dtype": "f", "role": "data"}])),
     "unknown dtype 'f'"),
    ("bad-name", _dumps(_node_field("name", "a b")), "node name must be a non-empty identifier"),
    ("bad-memory-format", _dumps(_node_field("kwargs", [["memory_format",
                                                         {"$memory_format": "sideways"}]])),
     "sideways"),
    ("bad-tag", _dumps(_node_field("args", [{"$pickle": "x"}])), "cannot decode argument"),
    # A file is data: malformed values must be reported as a corrupt graph, never as a bare
    # RuntimeError/AttributeError (the CLI would print a traceback).
    ("bad-device", _dumps(_node_field("kwargs", [["device", {"$device": "bogus"}]])), "bogus"),
    ("non-string-name", _dumps(_node_field("name", 5)), "5"),
]


@pytest.mark.parametrize(("text", "message"), [c[1:] for c in CORRUPT], ids=[c[0] for c in CORRUPT])
def test_corrupt_text_raises_ir_error(text: str, message: str) -> None:
    """``Graph.from_json`` on corrupt or foreign text raises IRError saying what is wrong."""
    with pytest.raises(IRError, match=message):
        Graph.from_json(text)


@pytest.mark.parametrize(("text", "message"), [c[1:] for c in CORRUPT[:6]],
                         ids=[c[0] for c in CORRUPT[:6]])
def test_load_names_the_file(tmp_path: Path, text: str, message: str) -> None:
    """``Graph.load`` prefixes the error with the file's path."""
    path = tmp_path / "broken.json"
    path.write_text(text)
    with pytest.raises(IRError, match=message) as err:
        Graph.load(str(path))
    assert str(err.value).startswith(f"{path}: ")


def test_load_missing_file(tmp_path: Path) -> None:
    """A file that does not exist is an IRError naming it, not a FileNotFoundError."""
    path = tmp_path / "nowhere.json"
    with pytest.raises(IRError, match=r"cannot read graph file .*nowhere\.json"):
        Graph.load(str(path))
