"""Matchers: find the IR patterns each built-in kernel replaces in a traced joint graph.

Each matcher is ``Graph -> list[Match]``. They read the aten-level graph ``meshplan.trace``
produces (foreach optimizer ops already split into per-tensor ops, so foreach and
single-tensor optimizers look the same), skipping view-like nodes where layouts differ.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..ir import Graph, Node, NodeKind, Phase, Ref, Role, ScalarMeta, TensorMeta
from ._registry import Match

__all__ = ["match_adamw", "match_sgd", "match_bias_gelu", "match_swiglu", "match_swiglu_backward",
           "match_layer_norm", "match_layer_norm_backward", "match_rms_norm",
           "match_rms_norm_backward", "match_cross_entropy", "match_cross_entropy_backward",
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


def _is_scalar(graph: Graph, x: Any) -> bool:
    """A number the update reads: a constant, or a host scalar computed at run time (an
    optimizer hyperparameter is a graph input, ``frontend/_hyper.py``)."""
    return _is_float(x) or (isinstance(x, Ref) and graph.meta(x) == ScalarMeta("float"))


def _derived(f: Callable[[float], float], x: Any) -> float | None:
    """``f(x)`` for a constant; None (not known before the step runs) for a host scalar."""
    return f(x) if _is_float(x) else None


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
    attrs = (("beta1", _derived(lambda w: 1.0 - w, lerp.args[2])), ("beta2", v_mul.args[1]),
             ("eps", eps_add.args[1]), ("decay", decay.args[1] if decay else 1.0),
             # the graph's own values, for kernels that must compute exactly what it does
             ("lerp_weight", lerp.args[2]), ("addcmul_value", _kw(addcmul, "value", 1.0)))
    if not all(_is_scalar(graph, v) for k, v in attrs if k != "beta1"):
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
                or not _is_scalar(graph, _kw(node, "alpha"))):
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
            attrs = (("momentum", buf_mul.args[1]), ("neg_lr", _kw(node, "alpha")),
                     ("grad_alpha", _kw(upd, "alpha", 1.0)))
            if not all(_is_scalar(graph, v) for _, v in attrs):
                continue
        else:
            nodes, results = (node.name,), (("param", Ref(node.name)),)
            operands = (("param", Ref(param.name)), ("grad", node.args[1]))
            attrs = (("momentum", 0.0), ("neg_lr", _kw(node, "alpha")), ("grad_alpha", 1.0))
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
    """``mul(silu(gate), up)`` (either order), the forward alone. Its backward reads
    ``silu(gate)``; :func:`match_swiglu_backward` recomputes it instead, so the forward hands
    over nothing in the silu's slot (``private``: the pair is substituted together) and the
    ``silu(gate)`` activation is never kept."""
    found = []
    for silu, mul, up in _swiglu_forwards(graph):
        found.append(Match("swiglu", mul.name, (silu.name, mul.name),
                           (("gate", silu.args[0]), ("up", up)),
                           (("out", Ref(mul.name)), ("silu", Ref(silu.name))), (),
                           _dtype(graph, silu.args[0]), private=("silu",)))
    return found


def match_swiglu_backward(graph: Graph) -> list[Match]:
    """The backward of a :func:`match_swiglu` forward: ``grad_up = mul(dy, silu(gate))`` and
    ``grad_gate = silu_backward(mul(dy, up), gate)`` (multiplications in either order), from
    ``dy``, ``gate`` and ``up`` in one pass."""
    found = []
    for silu, _, up in _swiglu_forwards(graph):
        gate = silu.args[0]
        for grad_up in _readers(graph, Ref(silu.name), "aten.mul.Tensor"):
            if grad_up.phase is not Phase.BACKWARD:
                continue
            dy = _other(grad_up, Ref(silu.name))
            for grad_silu in _readers(graph, up, "aten.mul.Tensor"):
                if grad_silu.phase is not Phase.BACKWARD or _other(grad_silu, up) != dy:
                    continue
                grad_gate = [b for b in _readers(graph, Ref(grad_silu.name),
                                                 "aten.silu_backward.default")
                             if tuple(b.args[:2]) == (Ref(grad_silu.name), gate)]
                if len(grad_gate) != 1 or dy is None:
                    continue
                found.append(Match(
                    "swiglu_backward", grad_gate[0].name,
                    (grad_up.name, grad_silu.name, grad_gate[0].name),
                    (("grad_out", dy), ("gate", gate), ("up", up), ("silu", Ref(silu.name))),
                    (("grad_gate", Ref(grad_gate[0].name)), ("grad_up", Ref(grad_up.name))),
                    (), _dtype(graph, gate), private=("silu",)))
    return found


def _swiglu_forwards(graph: Graph) -> list[tuple[Node, Node, Ref]]:
    """``(silu node, forward mul node, up operand)`` of every ``silu(gate) * up``."""
    found = []
    for silu in graph.nodes:
        if silu.target != "aten.silu.default":
            continue
        for mul in _readers(graph, Ref(silu.name), "aten.mul.Tensor"):
            up = _other(mul, Ref(silu.name))
            if mul.phase is Phase.FORWARD and _same_meta(graph, up, Ref(silu.name)):
                found.append((silu, mul, up))
    return found


def _other(mul: Node, ref: Ref) -> Any:
    """The operand of a two-operand ``mul`` that is not ``ref`` (None if ``ref`` is not one
    of exactly two operands, or both are ``ref``)."""
    a, b = mul.args[:2]
    if a == ref and b != ref:
        return b
    if b == ref and a != ref:
        return a
    return None


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
        forward = _rms_forward(graph, rsqrt)
        if forward is None:
            continue
        pow_, mean, add = forward
        x = pow_.args[0]
        for norm, scaled in _rms_normed(graph, Ref(rsqrt.name), x):
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


def match_rms_norm_backward(graph: Graph) -> list[Match]:
    """The input gradient of an RMSNorm as aten decomposes it, 12 to 14 nodes:
    ``add(mul(a, rstd), mul(div(expand(mul(mul(sum(mul(a, x), [-1], keepdim), -0.5),
    pow(rstd, 3))), D), mul(pow(x, 1.0), 2.0)))`` with ``a = mul(dy, weight)`` (or ``dy``
    without a weight), ``rstd`` a :func:`match_rms_norm` forward's ``rsqrt``; in a residual
    block the first term is first added to the residual stream's gradient
    (``add(add(residual, mul(a, rstd)), chain)``), which the kernel adds in its pass. The
    weight's gradient (``sum(mul(dy, normed))``) stays aten's: its reduction depends on the
    batch dims."""
    found = []
    for rsqrt in graph.nodes:
        forward = _rms_forward(graph, rsqrt)
        if forward is None:
            continue
        x = forward[0].args[0]
        width = graph.meta(x).shape[-1]
        r = Ref(rsqrt.name)
        weights = [m.args[1] for _, scaled in _rms_normed(graph, r, x) for m in scaled]
        cubes = [p for p in _readers(graph, r, "aten.pow.Tensor_Scalar")
                 if p.args[0] == r and p.args[1] == 3]
        for direct in _readers(graph, r, "aten.mul.Tensor"):
            if direct.phase is not Phase.BACKWARD or direct.args[1] != r:
                continue
            a = direct.args[0]
            for add in _readers(graph, Ref(direct.name), "aten.add.Tensor"):
                if _kw(add, "alpha", 1) != 1:
                    continue
                # either add(direct, chain), or add(add(residual, direct), chain): the
                # gradient of a residual stream the norm's input also feeds, accumulated
                residual, adds, last = None, (add.name,), add
                chain = _rms_grad_chain(graph, _other(add, Ref(direct.name)), a, x, r, width,
                                        cubes)
                if chain is None:
                    residual = _other(add, Ref(direct.name))
                    for add2 in _readers(graph, Ref(add.name), "aten.add.Tensor"):
                        chain = _rms_grad_chain(graph, _other(add2, Ref(add.name)), a, x, r,
                                                width, cubes)
                        if chain is not None and _kw(add2, "alpha", 1) == 1:
                            adds, last = (add.name, add2.name), add2
                            break
                if chain is None or (residual is not None and not _same_meta(graph, residual, x)):
                    continue
                scale = _op(graph, a, "aten.mul.Tensor")
                weighted = (scale is not None and scale.phase is Phase.BACKWARD
                            and scale.args[1] in weights)
                nodes = ((scale.name,) if weighted else ()) + (direct.name, *chain, *adds)
                found.append(Match(
                    "rms_norm_backward", last.name, nodes,
                    (("grad_out", scale.args[0] if weighted else a), ("input", x),
                     ("weight", scale.args[1] if weighted else None), ("rstd", r),
                     ("residual", residual)),
                    (("grad_input", Ref(last.name)),), (), _dtype(graph, x)))
    return found


def _rms_normed(graph: Graph, rstd: Ref, x: Ref) -> list[tuple[Node, list[Node]]]:
    """Each forward ``norm = mul(x, rstd)`` with the ``mul(norm, weight)`` nodes that scale it
    by a parameter."""
    return [(norm, [m for m in _readers(graph, Ref(norm.name), "aten.mul.Tensor")
                    if _input(graph, m.args[1], Role.PARAM)])
            for norm in _readers(graph, rstd, "aten.mul.Tensor")
            if norm.phase is Phase.FORWARD and norm.args[0] == x]


def _same_meta(graph: Graph, a: Any, b: Any) -> bool:
    ma, mb = (graph.meta(r) if isinstance(r, Ref) else None for r in (a, b))
    return (isinstance(ma, TensorMeta) and isinstance(mb, TensorMeta)
            and (ma.shape, ma.dtype) == (mb.shape, mb.dtype))


def _rms_forward(graph: Graph, rsqrt: Node) -> tuple[Node, Node, Node] | None:
    """The ``pow``, ``mean`` and ``add`` nodes when ``rsqrt`` is
    ``rsqrt(add(mean(pow(x, 2), [-1], keepdim), eps))``."""
    if rsqrt.target != "aten.rsqrt.default":
        return None
    add = _op(graph, rsqrt.args[0], "aten.add.Tensor")
    mean = add and _op(graph, add.args[0], "aten.mean.dim")
    pow_ = mean and _op(graph, mean.args[0], "aten.pow.Tensor_Scalar")
    if not (pow_ and pow_.args[1] == 2 and _arg(mean, 2, "keepdim", False)):
        return None
    if tuple(mean.args[1]) not in ((-1,), (len(graph.meta(pow_.args[0]).shape) - 1,)):
        return None
    return pow_, mean, add


def _rms_grad_chain(graph: Graph, ref: Any, a: Any, x: Ref, rstd: Ref, width: int,
                    cubes: list[Node]) -> tuple[str, ...] | None:
    """The nodes of ``mul(div(expand(mul(mul(sum(mul(a, x), [-1], keepdim), -0.5), pow(rstd,
    3))), D), mul(pow(x, 1.0), 2.0))`` ending at ``ref``, or None."""
    outer = _op(graph, ref, "aten.mul.Tensor")
    if outer is None:
        return None
    div = _op(graph, outer.args[0], "aten.div.Tensor")
    two = _op(graph, outer.args[1], "aten.mul.Tensor")
    ident = two and _op(graph, two.args[0], "aten.pow.Tensor_Scalar")
    expand = div and _op(graph, div.args[0], "aten.expand.default")
    inner = expand and _op(graph, expand.args[0], "aten.mul.Tensor")
    half = inner and _op(graph, inner.args[0], "aten.mul.Tensor")
    cube = inner and _op(graph, inner.args[1], "aten.pow.Tensor_Scalar")
    total = half and _op(graph, half.args[0], "aten.sum.dim_IntList")
    ax = total and _op(graph, total.args[0], "aten.mul.Tensor")
    if not (ident and ax and cube and cube.name in {c.name for c in cubes}
            and div.args[1] == width and two.args[1] == 2 and tuple(ident.args) == (x, 1.0)
            and half.args[1] == -0.5 and tuple(ax.args[:2]) == (a, x)
            and tuple(total.args[1]) in ((-1,), (len(graph.meta(x).shape) - 1,))
            and _arg(total, 2, "keepdim", False)):
        return None
    return tuple(n.name for n in (ax, total, half, cube, inner, expand, div, ident, two, outer))


def match_cross_entropy(graph: Graph) -> list[Match]:
    """``nll_loss_forward(_log_softmax(x, 1), target, None, mean, ignore_index)`` over 2-D
    logits: the forward alone. Results: the loss and total weight, and, privately, the rows'
    log-sum-exp in the log-softmax's slot, which :func:`match_cross_entropy_backward` reads
    instead of the ``(N, V)`` log-probabilities (the pair is substituted together)."""
    return [Match("cross_entropy", nll.name, (lsm.name, nll.name),
                  (("logits", lsm.args[0]), ("target", nll.args[1])),
                  (("loss", Ref(nll.name)), ("total_weight", Ref(nll.name, 1)),
                   ("lse", Ref(lsm.name))),
                  (("ignore_index", _arg(nll, 4, "ignore_index", -100)),
                   ("reduction", _arg(nll, 3, "reduction"))),
                  _dtype(graph, lsm.args[0]), private=("lse",))
            for lsm, nll in _cross_entropy_forwards(graph)]


def match_cross_entropy_backward(graph: Graph) -> list[Match]:
    """``_log_softmax_backward_data(nll_loss_backward(dy, lsm, target, None, mean, ignore_index,
    total_weight), lsm, 1)`` of a :func:`match_cross_entropy` forward: the gradient wrt the
    logits, ``(softmax - onehot(target)) * dy / total_weight``, from the logits and the
    forward's private log-sum-exp."""
    forwards: dict[str, list[Node]] = {}
    for lsm, nll in _cross_entropy_forwards(graph):
        forwards.setdefault(lsm.name, []).append(nll)
    found = []
    for name, nlls in forwards.items():
        lsm = graph.node(name)
        for nll_b in _readers(graph, Ref(lsm.name), "aten.nll_loss_backward.default"):
            if not (_plain_mean_nll(nll_b, offset=1) and nll_b.args[1] == Ref(lsm.name)):
                continue
            twin = [f for f in nlls if f.args[1] == nll_b.args[2]
                    and _arg(f, 4, "ignore_index", -100) == _arg(nll_b, 5, "ignore_index", -100)]
            lsm_b = [b for b in _readers(graph, Ref(nll_b.name),
                                         "aten._log_softmax_backward_data.default")
                     if tuple(b.args[:2]) == (Ref(nll_b.name), Ref(lsm.name))
                     and _arg(b, 2, "dim") in (1, -1)]
            if not (twin and len(lsm_b) == 1):
                continue
            found.append(Match(
                "cross_entropy_backward", lsm_b[0].name, (nll_b.name, lsm_b[0].name),
                (("grad_loss", nll_b.args[0]), ("logits", lsm.args[0]),
                 ("target", nll_b.args[2]), ("total_weight", _arg(nll_b, 6, "total_weight")),
                 ("lse", Ref(lsm.name))),
                (("grad_logits", Ref(lsm_b[0].name)),),
                (("ignore_index", _arg(nll_b, 5, "ignore_index", -100)),),
                _dtype(graph, lsm.args[0]), private=("lse",),
                layout_from=(("logits", lsm.name),)))
    return found


def _cross_entropy_forwards(graph: Graph) -> list[tuple[Node, Node]]:
    """``(_log_softmax node, nll_loss_forward node)`` of every plain cross-entropy forward:
    2-D logits, log-softmax over the classes, no class weights, ``mean`` reduction (as
    traced: ``sum`` divided by its count, ``frontend/_decomp.py``)."""
    return [(lsm, nll) for lsm in graph.nodes if _log_softmax_2d(graph, lsm)
            for nll in _readers(graph, Ref(lsm.name), "aten.nll_loss_forward.default")
            if (_plain_mean_nll(nll) or _traced_mean_nll(graph, nll))
            and nll.args[0] == Ref(lsm.name)]


def _traced_mean_nll(graph: Graph, node: Node) -> bool:
    """An ``nll_loss_forward`` without class weights, with ``sum`` reduction, whose sum is
    divided by its count: a mean as the trace writes it."""
    return (_arg(node, 2, "weight") is None and _arg(node, 3, "reduction") == 2
            and any(tuple(d.args[:2]) == (Ref(node.name), Ref(node.name, 1))
                    for d in _readers(graph, Ref(node.name), "aten.div.Tensor")))


def _log_softmax_2d(graph: Graph, node: Node) -> bool:
    if node.target != "aten._log_softmax.default":
        return False
    meta = graph.meta(node.args[0])
    return (isinstance(meta, TensorMeta) and len(meta.shape) == 2
            and _arg(node, 1, "dim") in (1, -1)
            and not _arg(node, 2, "half_to_float", False))     # not the pattern


def _plain_mean_nll(node: Node, offset: int = 0) -> bool:
    """An ``nll_loss_forward`` (``offset`` 0) / ``nll_loss_backward`` (1, after ``grad_output``)
    without class weights and with ``mean`` reduction."""
    return (_arg(node, 2 + offset, "weight") is None
            and _arg(node, 3 + offset, "reduction") == 1)
