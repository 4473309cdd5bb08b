"""Activation recompute as a graph pass: the backward reads copies of forward values that are
computed again just before it, from saved inputs, so the originals die after their last
forward use.

A *layer* is a repeated block: the nodes whose module path runs through one numbered child
of a module that has several (``model.transformer.h.3``). Per chosen layer, a policy says
which of its forward values are recomputed:

* ``"full"``: every value of the layer except its outputs (values a later layer or the rest
  of the forward reads: the next layer's checkpointed input) and random draws. What stays
  from the forward is the layer's input, as in ``torch.utils.checkpoint`` around each block;
* ``"selective"``: as ``"full"`` but the outputs of the compute-heavy ops (matrix products,
  convolutions, attention kernels) are kept too, so what is recomputed is the cheap,
  memory-heavy rest: norms, pointwise ops, softmax, views (torchtitan's op-level policy;
  Korthikanti et al.'s keeps the linear layers' outputs and recomputes the core attention,
  which an attention kernel does not store in the first place).

A random op is never recomputed (a copy would draw again): the copies read its saved output.
Only BACKWARD reads move to the copies; the forward, the update and the step's results read
the originals. Each layer's copies (named ``rc_<original>``, phase BACKWARD, the original's
module path) run just before the first backward node that reads one of them. The copies
compute the same ops on the same inputs, so the values are the same bits on a deterministic
device.
"""

from __future__ import annotations

import re
from collections import Counter

from .._errors import IRError
from ._graph import Graph, Node
from ._passes import rewrite_refs
from ._random import is_random
from ._types import NodeKind, Phase, Ref

POLICIES = ("none", "selective", "full")
PREFIX = "rc_"

# ops whose outputs the selective policy keeps: the FLOPs are in them
_HEAVY = re.compile(r"^aten\.(mm|addmm|bmm|baddbmm|matmul|linear|convolution|_convolution|"
                    r"_scaled_dot_product_\w+|scaled_dot_product_\w+|_flash_attention\w*|"
                    r"_efficient_attention\w*)\.")


def is_heavy(node: Node) -> bool:
    """True for the ops whose outputs the selective policy keeps."""
    return bool(_HEAVY.match(node.target))


def _layer_key(path: str) -> str | None:
    parts = path.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return None


def _parent(key: str) -> str:
    return key.rsplit(".", 1)[0] if "." in key else ""


def _layer_of(graph: Graph) -> dict[str, str]:
    """Forward op -> the numbered module it runs in (``model.layers.3``), in forward order."""
    out: dict[str, str] = {}
    for n in graph.nodes:
        if n.kind is NodeKind.OP and n.phase is Phase.FORWARD and n.module_path:
            key = _layer_key(n.module_path)
            if key is not None:
                out[n.name] = key
    return out


def layers(graph: Graph) -> tuple[str, ...]:
    """The repeated layers of ``graph`` in forward order: module paths up to a numbered child
    of a module with at least two numbered children (``model.layers.0``, ``model.layers.1``)."""
    keys = dict.fromkeys(_layer_of(graph).values())
    siblings = Counter(_parent(k) for k in keys)
    return tuple(k for k in keys if siblings[_parent(k)] >= 2)


def recompute(graph: Graph, policy: str, which: tuple[str, ...] | None = None) -> Graph:
    """``graph`` with the layers ``which`` (default: every layer) recomputed under ``policy``.

    ``policy="none"`` or no layer returns ``graph`` itself."""
    if policy not in POLICIES:
        raise IRError(f"recompute policy must be one of {POLICIES}, got {policy!r}")
    known = layers(graph)
    chosen = known if which is None else tuple(which)
    unknown = [k for k in chosen if k not in known]
    if unknown:
        raise IRError(f"recompute: {graph.info.name!r} has no layer {unknown[0]!r}; its layers "
                      f"are {', '.join(known[:4]) or 'none'}{', ...' if len(known) > 4 else ''}")
    if policy == "none" or not chosen:
        return graph
    chosen_set = set(chosen)
    names = {n.name for n in graph.nodes}
    layer_of = {name: key for name, key in _layer_of(graph).items() if key in chosen_set}
    # a value the forward reads outside its layer (or a result) is the layer's output: kept
    outputs = {o.ref.node for o in graph.outputs}
    escapes = set(outputs)
    for n in graph.nodes:
        if n.phase is Phase.BACKWARD:
            continue
        for r in n.refs():
            if r.node in layer_of and layer_of.get(n.name) != layer_of[r.node]:
                escapes.add(r.node)
    candidates = {name for name, key in layer_of.items()
                  if name not in escapes and not is_random(graph.node(name))
                  and not (policy == "selective" and is_heavy(graph.node(name)))}
    # what the backward reads of the candidates, and what those copies read in turn
    needed: set[str] = set()
    stack = [r.node for n in graph.nodes if n.phase is Phase.BACKWARD
             for r in n.refs() if r.node in candidates]
    while stack:
        name = stack.pop()
        if name in needed:
            continue
        needed.add(name)
        stack.extend(r.node for r in graph.node(name).refs() if r.node in candidates)
    if not needed:
        return graph
    copy_name: dict[str, str] = {}
    for name in needed:
        new = PREFIX + name
        while new in names:
            new = PREFIX + new
        names.add(new)
        copy_name[name] = new
    subst = {Ref(name, i): Ref(copy_name[name], i)
             for name in needed for i in range(len(graph.node(name).outputs))}
    copies: dict[str, list[Node]] = {}
    for n in graph.nodes:                     # forward order: a copy's inputs come first
        if n.name in needed:
            copies.setdefault(layer_of[n.name], []).append(rewrite_refs(
                n, subst, name=copy_name[n.name], phase=Phase.BACKWARD))
    nodes: list[Node] = []
    placed: set[str] = set()
    for n in graph.nodes:
        if n.phase is Phase.BACKWARD:
            for r in n.refs():
                key = layer_of.get(r.node)
                if r.node in needed and key not in placed:
                    placed.add(key)
                    nodes.extend(copies[key])
            n = rewrite_refs(n, subst)
        nodes.append(n)
    return Graph(tuple(nodes), graph.outputs, graph.info)
