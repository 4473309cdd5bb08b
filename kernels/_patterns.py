"""Matchers: find the IR patterns each built-in kernel replaces in a traced joint graph.

Each matcher is ``Graph -> list[Match]``. They read the aten-level graph ``meshplan.trace``
produces (foreach optimizer ops already split into per-tensor ops, so foreach and
single-tensor optimizers look the same), skipping view-like nodes where layouts differ.
"""

from __future__ import annotations

from typing import Any

from ..ir import Graph, Node, NodeKind, Phase, Ref, Role, TensorMeta
from ._registry import Match

__all__ = ["match_adamw", "match_sgd", "match_bias_gelu", "match_swiglu", "match_layer_norm",
           "match_layer_norm_backward", "match_rms_norm", "match_cross_entropy",
           "match_grad_buckets", "raw_gradient"]

_VIEWS = frozenset({"aten.view.default", "aten._unsafe_view.default", "aten.t.default",
                    "aten.reshape.default", "aten.transpose.int"})


# ---- graph helpers -----------------------------------------------------------------------
def _op(graph: Graph, arg: Any, target: str) -> Node | None:
    """The node producing ``arg`` when it is an op with ``target`` or its ``.Scalar``/``.Tensor``
    twin (split foreach ops and Python-scalar operands give the ``.Scalar`` overloads)."""
    if not isinstance(arg, Ref) or arg.node not in graph:
        return None
    node = graph.node(arg.node)
    return node if node.kind is NodeKind.OP and node.target in _twins(target) else None


def _twins(target: str) -> tuple[str, ...]:
    for a, b in ((".Tensor", ".Scalar"), (".Scalar", ".Tensor")):
        if target.endswith(a):
            return target, target[: -len(a)] + b
    return (target,)


def _input(graph: Graph, arg: Any, role: Role) -> Node | None:
    if not isinstance(arg, Ref) or arg.node not in graph:
        return None
    node = graph.node(arg.node)
    return node if node.kind is NodeKind.INPUT and node.role is role else None


def _kw(node: Node, name: str, default: Any = None) -> Any:
    return dict(node.kwargs).get(name, default)


def _arg(node: Node, index: int, name: str, default: Any = None) -> Any:
    return node.args[index] if len(node.args) > index else _kw(node, name, default)


def _dtype(graph: Graph, ref: Any) -> str:
    meta = graph.meta(ref) if isinstance(ref, Ref) else None
    return meta.dtype if isinstance(meta, TensorMeta) else "float32"


def _through_views(graph: Graph, ref: Ref) -> Ref:
    while True:
        node = graph.node(ref.node)
        if node.kind is not NodeKind.OP or node.target not in _VIEWS:
            return ref
        ref = node.args[0]


def _readers(graph: Graph, ref: Ref, target: str) -> list[Node]:
    return [graph.node(u) for u in graph.users[ref.node]
            if graph.node(u).target in _twins(target) and ref in graph.node(u).refs()]


def _is_float(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def raw_gradient(graph: Graph, ref: Ref) -> Ref:
    """The backward value a (clipped, re-viewed) gradient operand comes from: follows views and
    multiplications by a 0-d tensor (``clip_grad_norm_``'s coefficient) back out of the update
    phase. That value is what a data-parallel all-reduce reduces."""
    while True:
        node = graph.node(ref.node)
        if node.kind is not NodeKind.OP or node.phase is not Phase.UPDATE:
            return ref
        if node.target in _VIEWS:
            ref = node.args[0]
            continue
        other = node.args[1] if node.target == "aten.mul.Tensor" else None
        meta = graph.meta(other) if isinstance(other, Ref) else None
        if isinstance(meta, TensorMeta) and meta.shape == ():
            ref = node.args[0]
            continue
        return ref


# ---- optimizers --------------------------------------------------------------------------
def match_adamw(graph: Graph) -> list[Match]:
    """Per parameter: ``addcdiv(mul(p, 1-lr*wd) | p, lerp(m, g, 1-b1),
    add(div(sqrt(addcmul(mul(v, b2), g, g, value=1-b2)), bc2), eps), value=-step_size)``."""
    found = []
    for node in graph.nodes:
        if node.target != "aten.addcdiv.default" or node.phase is not Phase.UPDATE:
            continue
        match = _adamw_at(graph, node)
        if match is not None:
            found.append(match)
    return found


def _adamw_at(graph: Graph, node: Node) -> Match | None:
    p_arg, m_arg, d_arg = node.args[:3]
    lerp = _op(graph, m_arg, "aten.lerp.Scalar")
    eps_add = _op(graph, d_arg, "aten.add.Tensor")
    div = eps_add and _op(graph, eps_add.args[0], "aten.div.Tensor")
    sqrt = div and _op(graph, div.args[0], "aten.sqrt.default")
    addcmul = sqrt and _op(graph, sqrt.args[0], "aten.addcmul.default")
    v_mul = addcmul and _op(graph, addcmul.args[0], "aten.mul.Tensor")
    if not (lerp and v_mul and _input(graph, lerp.args[0], Role.OPT_STATE)
            and _input(graph, v_mul.args[0], Role.OPT_STATE)):
        return None
    decay = _op(graph, p_arg, "aten.mul.Tensor")
    param = _input(graph, decay.args[0] if decay else p_arg, Role.PARAM)
    if param is None:
        return None
    nodes = [n.name for n in (decay, lerp, v_mul, addcmul, sqrt, div, eps_add, node) if n]
    attrs = (("beta1", 1.0 - lerp.args[2]), ("beta2", v_mul.args[1]), ("eps", eps_add.args[1]),
             ("decay", decay.args[1] if decay else 1.0),
             # the graph's own constants, for kernels that must compute exactly what it does
             ("lerp_weight", lerp.args[2]), ("addcmul_value", _kw(addcmul, "value", 1.0)))
    if not all(_is_float(v) for _, v in attrs):
        return None                   # a tensor lr / betas: not the pattern the kernels take
    return Match(
        kernel="adamw", anchor=node.name, nodes=tuple(nodes),
        operands=(("param", Ref(param.name)), ("grad", lerp.args[1]),
                  ("exp_avg", lerp.args[0]), ("exp_avg_sq", v_mul.args[0]),
                  ("neg_step_size", _kw(node, "value")), ("bias_correction2_sqrt", div.args[1])),
        results=(("param", Ref(node.name)), ("exp_avg", Ref(lerp.name)),
                 ("exp_avg_sq", Ref(addcmul.name))),
        attrs=attrs, dtype=param.meta.dtype)


def match_sgd(graph: Graph) -> list[Match]:
    """Per parameter: ``add(p, d, alpha=-lr)`` with ``d = add(mul(buf, momentum), g[, alpha])``
    (momentum) or ``d = g`` (plain SGD)."""
    found = []
    for node in graph.nodes:
        if (node.target not in _twins("aten.add.Tensor") or node.phase is not Phase.UPDATE
                or not _is_float(_kw(node, "alpha"))):
            continue
        param = _input(graph, node.args[0], Role.PARAM)
        if param is None:
            continue
        upd = _op(graph, node.args[1], "aten.add.Tensor")
        buf_mul = upd and _op(graph, upd.args[0], "aten.mul.Tensor")
        buf = buf_mul and _input(graph, buf_mul.args[0], Role.OPT_STATE)
        if buf:
            nodes = (buf_mul.name, upd.name, node.name)
            operands = (("param", Ref(param.name)), ("grad", upd.args[1]),
                        ("momentum_buffer", Ref(buf.name)))
            results = (("param", Ref(node.name)), ("momentum_buffer", Ref(upd.name)))
            attrs = (("lr", -_kw(node, "alpha")), ("momentum", buf_mul.args[1]),
                     ("dampening", 1.0 - _kw(upd, "alpha", 1.0)),
                     ("neg_lr", _kw(node, "alpha")), ("grad_alpha", _kw(upd, "alpha", 1.0)))
            if not all(_is_float(v) for _, v in attrs):
                continue
        else:
            nodes, results = (node.name,), (("param", Ref(node.name)),)
            operands = (("param", Ref(param.name)), ("grad", node.args[1]))
            attrs = (("lr", -_kw(node, "alpha")), ("momentum", 0.0), ("dampening", 0.0),
                     ("neg_lr", _kw(node, "alpha")), ("grad_alpha", 1.0))
        found.append(Match("sgd", node.name, nodes, operands, results, attrs, param.meta.dtype))
    return found


def match_grad_buckets(graph: Graph) -> list[Match]:
    """One match per graph: the raw gradient of every parameter an AdamW/SGD update reads, in
    the order backward produces them (the order they are ready for an all-reduce). ``attrs``
    carry ``sizes_bytes`` and ``dtypes`` for :func:`plan_buckets`; ``operands`` are named
    ``grad:<param input>``. Replaces no node: the lowering inserts flatten/all-reduce/unflatten."""
    grads: dict[str, Ref] = {}
    for match in match_adamw(graph) + match_sgd(graph):
        grads.setdefault(match.operand("param").node, raw_gradient(graph, match.operand("grad")))
    if not grads:
        return []
    position = {n.name: i for i, n in enumerate(graph.nodes)}
    ordered = sorted(grads.items(), key=lambda kv: -position[kv[1].node])
    metas = [graph.meta(ref) for _, ref in ordered]
    attrs = (("sizes_bytes", tuple(m.nbytes for m in metas)),
             ("dtypes", tuple(m.dtype for m in metas)))
    return [Match("grad_buckets", ordered[0][1].node, (),
                  tuple((f"grad:{p}", ref) for p, ref in ordered), (), attrs, metas[0].dtype)]


# ---- activations -------------------------------------------------------------------------
def match_bias_gelu(graph: Graph) -> list[Match]:
    """``gelu(x + b)`` where ``x + b`` is an ``addmm`` (a Linear's bias) or an ``add`` of a
    1-D bias, seen through views; the matching ``gelu_backward`` nodes join the match."""
    found = []
    for node in graph.nodes:
        if node.target != "aten.gelu.default":
            continue
        pre = node.args[0]
        bias, source = _bias_of(graph, _through_views(graph, pre))
        if bias is None:
            continue
        backward = [b.name for b in _readers(graph, pre, "aten.gelu_backward.default")
                    if b.args[1] == pre]
        found.append(Match(
            "bias_gelu", node.name, (node.name, *backward),
            (("pre_activation", pre), ("bias", bias)),
            (("out", Ref(node.name)), *((f"grad_pre:{b}", Ref(b)) for b in backward)),
            (("approximate", _kw(node, "approximate", "none")), ("bias_from", source)),
            _dtype(graph, pre)))
    return found


def _bias_of(graph: Graph, ref: Ref) -> tuple[Ref | None, str]:
    addmm = _op(graph, ref, "aten.addmm.default")
    if addmm is not None:
        return addmm.args[0], addmm.name
    add = _op(graph, ref, "aten.add.Tensor")
    if add is None:
        return None, ""
    for arg in add.args[:2]:
        meta = graph.meta(arg) if isinstance(arg, Ref) else None
        if isinstance(meta, TensorMeta) and len(meta.shape) == 1:
            return arg, add.name
    return None, ""


def match_swiglu(graph: Graph) -> list[Match]:
    """``mul(silu(a), b)`` and, when present, its backward ``silu_backward(mul(dy, b), a)`` and
    ``mul(dy, silu(a))``."""
    found = []
    for silu in graph.nodes:
        if silu.target != "aten.silu.default":
            continue
        gate = silu.args[0]
        for mul in _readers(graph, Ref(silu.name), "aten.mul.Tensor"):
            if mul.phase is not Phase.FORWARD or mul.args[0] != Ref(silu.name):
                continue
            up = mul.args[1]
            backward = [b.name for b in _readers(graph, gate, "aten.silu_backward.default")]
            backward += [b.name for b in _readers(graph, Ref(silu.name), "aten.mul.Tensor")
                         if b.phase is Phase.BACKWARD]
            found.append(Match("swiglu", mul.name, (silu.name, mul.name, *backward),
                               (("gate", gate), ("up", up)), (("out", Ref(mul.name)),), (),
                               _dtype(graph, gate)))
    return found


# ---- norms and loss ----------------------------------------------------------------------
def match_layer_norm(graph: Graph) -> list[Match]:
    """``native_layer_norm`` over the last dim: the forward alone. Its backward is
    ``match_layer_norm_backward``'s: a kernel call runs at one point of a program, and the
    forward's results are read long before the backward runs."""
    found = []
    for node in graph.nodes:
        if node.target != "aten.native_layer_norm.default" or len(node.args[1]) != 1:
            continue
        found.append(Match(
            "layer_norm", node.name, (node.name,),
            (("input", node.args[0]), ("weight", _arg(node, 2, "weight")),
             ("bias", _arg(node, 3, "bias"))),
            (("out", Ref(node.name)), ("mean", Ref(node.name, 1)), ("rstd", Ref(node.name, 2))),
            (("eps", _arg(node, 4, "eps", 1e-5)),), _dtype(graph, node.args[0])))
    return found


def match_layer_norm_backward(graph: Graph) -> list[Match]:
    """``native_layer_norm_backward`` over the last dim whose mean and rstd are a
    ``native_layer_norm``'s (the statistics the forward saved)."""
    found = []
    for node in graph.nodes:
        if node.target != "aten.native_layer_norm_backward.default" or len(node.args[2]) != 1:
            continue
        mean, rstd = node.args[3], node.args[4]
        forward = _op(graph, mean, "aten.native_layer_norm.default")
        if forward is None or mean != Ref(forward.name, 1) or rstd != Ref(forward.name, 2):
            continue
        found.append(Match(
            "layer_norm_backward", node.name, (node.name,),
            (("grad_out", node.args[0]), ("input", node.args[1]), ("mean", mean),
             ("rstd", rstd), ("weight", _arg(node, 5, "weight"))),
            (("grad_input", Ref(node.name)), ("grad_weight", Ref(node.name, 1)),
             ("grad_bias", Ref(node.name, 2))),
            (("output_mask", tuple(_arg(node, 7, "output_mask", (True, True, True)))),),
            _dtype(graph, node.args[1])))
    return found


def match_rms_norm(graph: Graph) -> list[Match]:
    """nn.RMSNorm's decomposition ``mul(mul(x, rsqrt(add(mean(pow(x, 2), [-1], keepdim), eps))),
    w)``, forward nodes only. Its backward is aten's own decomposition, which reads the
    forward's ``rsqrt`` and (with a weight) the normalised ``mul``: the match returns both
    (``rstd``, ``normed``) beside ``out``, so the backward runs unchanged on them."""
    found = []
    for rsqrt in graph.nodes:
        if rsqrt.target != "aten.rsqrt.default":
            continue
        add = _op(graph, rsqrt.args[0], "aten.add.Tensor")
        mean = add and _op(graph, add.args[0], "aten.mean.dim")
        pow_ = mean and _op(graph, mean.args[0], "aten.pow.Tensor_Scalar")
        if not (pow_ and pow_.args[1] == 2 and tuple(mean.args[1]) in ((-1,), (len(
                graph.meta(pow_.args[0]).shape) - 1,)) and _arg(mean, 2, "keepdim", False)):
            continue
        x = pow_.args[0]
        for norm in _readers(graph, Ref(rsqrt.name), "aten.mul.Tensor"):
            if norm.args[0] != x:
                continue
            scaled = [m for m in _readers(graph, Ref(norm.name), "aten.mul.Tensor")
                      if _input(graph, m.args[1], Role.PARAM)]
            last = scaled[0] if scaled else norm
            results = [("out", Ref(last.name)), ("rstd", Ref(rsqrt.name))]
            if scaled:
                results.append(("normed", Ref(norm.name)))
            found.append(Match(
                "rms_norm", last.name,
                tuple(n.name for n in (pow_, mean, add, rsqrt, norm, *scaled[:1])),
                (("input", x), ("weight", scaled[0].args[1] if scaled else None)),
                tuple(results), (("eps", add.args[1]),), _dtype(graph, x)))
    return found


def match_cross_entropy(graph: Graph) -> list[Match]:
    """``nll_loss_forward(_log_softmax(x, 1), target, None, mean, ignore_index)`` over 2-D
    logits, with ``nll_loss_backward`` and ``_log_softmax_backward_data`` when present."""
    found = []
    for lsm in graph.nodes:
        if lsm.target != "aten._log_softmax.default" or len(graph.meta(lsm.args[0]).shape) != 2:
            continue
        for nll in _readers(graph, Ref(lsm.name), "aten.nll_loss_forward.default"):
            if _arg(nll, 2, "weight") is not None or _arg(nll, 3, "reduction") != 1:
                continue
            nll_b = [b for b in _readers(graph, Ref(lsm.name), "aten.nll_loss_backward.default")]
            lsm_b = [b for nb in nll_b
                     for b in _readers(graph, Ref(nb.name), "aten._log_softmax_backward_data.default")]
            results = [("loss", Ref(nll.name))] + [("grad_logits", Ref(b.name)) for b in lsm_b]
            found.append(Match(
                "cross_entropy", nll.name,
                (lsm.name, nll.name, *(b.name for b in nll_b), *(b.name for b in lsm_b)),
                (("logits", lsm.args[0]), ("target", nll.args[1])), tuple(results),
                (("ignore_index", _arg(nll, 4, "ignore_index", -100)),),
                _dtype(graph, lsm.args[0])))
    return found
