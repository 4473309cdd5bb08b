"""Versioned JSON (de)serialisation of graphs: exact round trip, no pickle."""

from __future__ import annotations

import base64
import json
import math
import os
import tempfile
from typing import Any

import torch

from .._errors import IRError
from ._graph import ConstantValue, Graph, GraphInfo, Node, Output, ResultSpec
from ._types import NodeKind, OutputKind, Phase, Ref, Role, ScalarMeta, SourceLocation, TensorMeta

FORMAT = "meshplan.ir"
VERSION = 1

_LAYOUTS = {name: v for name in dir(torch) if isinstance(v := getattr(torch, name), torch.layout)}
_MEMORY_FORMATS = {
    name: v for name in dir(torch) if isinstance(v := getattr(torch, name), torch.memory_format)
}


# ---- arguments ---------------------------------------------------------------------------

def encode_arg(a: Any) -> Any:
    if a is None or isinstance(a, (bool, int, str)):
        return a
    if isinstance(a, float):
        return a if math.isfinite(a) else {"$float": repr(a)}
    if isinstance(a, Ref):
        return {"$ref": [a.node, a.index]}
    if isinstance(a, tuple):
        return [encode_arg(x) for x in a]
    if isinstance(a, torch.dtype):
        return {"$dtype": str(a).removeprefix("torch.")}
    if isinstance(a, torch.device):
        return {"$device": str(a)}
    if isinstance(a, torch.layout):
        return {"$layout": str(a).removeprefix("torch.")}
    if isinstance(a, torch.memory_format):
        return {"$memory_format": str(a).removeprefix("torch.")}
    raise IRError(f"cannot serialise argument {a!r} of type {type(a).__name__}")


def decode_arg(a: Any) -> Any:
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    if isinstance(a, list):
        return tuple(decode_arg(x) for x in a)
    if isinstance(a, dict) and len(a) == 1:
        (tag, v), = a.items()
        if tag == "$ref":
            return Ref(str(v[0]), int(v[1]))
        if tag == "$float":
            return float(v)
        if tag == "$dtype":
            return _torch_attr(v, torch.dtype)
        if tag == "$device":
            try:
                return torch.device(v)
            except (RuntimeError, TypeError):
                raise IRError(f"unknown device {v!r}") from None
        if tag == "$layout" and v in _LAYOUTS:
            return _LAYOUTS[v]
        if tag == "$memory_format" and v in _MEMORY_FORMATS:
            return _MEMORY_FORMATS[v]
    raise IRError(f"cannot decode argument {a!r}")


def _torch_attr(name: str, kind: type) -> Any:
    v = getattr(torch, name, None)
    if not isinstance(v, kind):
        raise IRError(f"unknown torch {kind.__name__} {name!r}")
    return v


# ---- metadata ----------------------------------------------------------------------------

def _enc_meta(m: Any) -> Any:
    if isinstance(m, TensorMeta):
        return {"shape": list(m.shape), "dtype": m.dtype, "role": m.role.value}
    if isinstance(m, ScalarMeta):
        return {"scalar": m.dtype}
    return None


def _dec_meta(d: Any) -> Any:
    if d is None:
        return None
    if "scalar" in d:
        return ScalarMeta(d["scalar"])
    return TensorMeta(tuple(d["shape"]), d["dtype"], Role(d["role"]))


def _enc_src(s: SourceLocation | None) -> Any:
    if s is None:
        return None
    return {"file": s.file, "line": s.line, "function": s.function, "code": s.code}


def _dec_src(d: Any) -> SourceLocation | None:
    return None if d is None else SourceLocation(d["file"], d["line"], d["function"], d["code"])


def _enc_node(n: Node) -> dict[str, Any]:
    d: dict[str, Any] = {
        "name": n.name,
        "kind": n.kind.value,
        "target": n.target,
        "args": [encode_arg(a) for a in n.args],
        "kwargs": [[k, encode_arg(v)] for k, v in n.kwargs],
        "outputs": [_enc_meta(m) for m in n.outputs],
        "phase": n.phase.value,
        "source": _enc_src(n.source),
        "module": n.module_path,
    }
    if n.value is not None:
        data = n.value.data
        d["value"] = {
            "dtype": n.value.dtype,
            "shape": list(n.value.shape),
            "data": None if data is None else base64.b64encode(data).decode("ascii"),
        }
    return d


def _dec_node(d: dict[str, Any]) -> Node:
    value = None
    if "value" in d:
        v = d["value"]
        raw = None if v["data"] is None else base64.b64decode(v["data"])
        value = ConstantValue(v["dtype"], tuple(v["shape"]), raw)
    return Node(
        name=d["name"],
        kind=NodeKind(d["kind"]),
        target=d["target"],
        args=tuple(decode_arg(a) for a in d["args"]),
        kwargs=tuple((k, decode_arg(v)) for k, v in d["kwargs"]),
        outputs=tuple(_dec_meta(m) for m in d["outputs"]),
        phase=Phase(d["phase"]),
        source=_dec_src(d["source"]),
        module_path=d["module"],
        value=value,
    )


# ---- graphs ------------------------------------------------------------------------------

def graph_to_dict(g: Graph) -> dict[str, Any]:
    info = g.info
    return {
        "format": FORMAT,
        "version": VERSION,
        "info": {
            "name": info.name,
            "source": _enc_src(info.source),
            "result": {"kind": info.result.kind, "keys": list(info.result.keys)},
            "torch_version": info.torch_version,
        },
        "nodes": [_enc_node(n) for n in g.nodes],
        "outputs": [
            {"ref": [o.ref.node, o.ref.index], "kind": o.kind.value, "name": o.name,
             "role": None if o.role is None else o.role.value}
            for o in g.outputs
        ],
    }


def graph_from_dict(d: dict[str, Any]) -> Graph:
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise IRError(
            f"not a meshplan graph (format {d.get('format') if isinstance(d, dict) else None!r}, "
            f"expected {FORMAT!r}); make one with `meshplan trace FILE.py:STEP --out graph.json`"
        )
    if d.get("version") != VERSION:
        raise IRError(
            f"graph format version {d.get('version')!r} is not supported by this meshplan "
            f"(reads version {VERSION}); re-trace the step with this version"
        )
    try:
        i = d["info"]
        info = GraphInfo(
            name=i["name"],
            source=_dec_src(i["source"]),
            result=ResultSpec(i["result"]["kind"], tuple(i["result"]["keys"])),
            torch_version=i["torch_version"],
        )
        nodes = tuple(_dec_node(n) for n in d["nodes"])
        outputs = tuple(
            Output(Ref(o["ref"][0], o["ref"][1]), OutputKind(o["kind"]), o["name"],
                   None if o["role"] is None else Role(o["role"]))
            for o in d["outputs"]
        )
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise IRError(f"corrupt meshplan graph: {type(e).__name__}: {e}") from None
    return Graph(nodes, outputs, info)


def graph_to_json(g: Graph, *, indent: int | None = None) -> str:
    return json.dumps(graph_to_dict(g), indent=indent, allow_nan=False)


def graph_from_json(text: str) -> Graph:
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise IRError(f"graph is not valid JSON ({e})") from None
    return graph_from_dict(d)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the new one, never half."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_graph(g: Graph, path: str | os.PathLike[str]) -> None:
    atomic_write_text(path, graph_to_json(g))


def read_text(path: str | os.PathLike[str], what: str,
              error: type[Exception] = IRError) -> str:
    """The file's text, or one ``error`` naming ``what`` could not be read and why."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise error(f"cannot read {what} {os.fspath(path)!r}: {e.strerror}") from None


def load_graph(path: str | os.PathLike[str]) -> Graph:
    text = read_text(path, "graph file")
    try:
        return graph_from_json(text)
    except IRError as e:
        raise IRError(f"{os.fspath(path)}: {e}") from None
