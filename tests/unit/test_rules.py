"""The generated validator of every sharding rule, against single-process ground truth.

For each example step (mlp, gpt with layer norm + GELU and RMSNorm + SiLU, cnn, a LLaMA-style
model and a "zoo" of ops the examples do not reach, both defined here), traced and passed
through ``split_foreach``, the graph is run once on real inputs while recording the inputs and
outputs of every node. Then for EVERY op node with a rule
and EVERY strategy the rule returns, on a mesh axis of size 2 and of size 3 (where shapes
divide), the sharded computation is simulated in this process: each input is split by its
placement (``Shard``: ``torch.chunk``; ``Replicate``: the same tensor on every rank;
``P(sum)``: random, asymmetric addends that sum to it; ``P(avg)``: addends whose mean is it),
the op runs per rank on local tensors with arguments from ``Rule.local_args`` (the rule's
``localize``, or the node's own arguments), and the outputs are put back together (``Shard``: concatenate;
``Replicate``: every rank must agree, take rank 0; ``P(sum)``: sum; ``P(avg)``: mean) and
compared with the unsharded output. Inputs an op mutates (batch norm's running statistics) are
compared the same way.

Tolerance: ``rtol=1e-4`` and ``atol=1e-5 * scale``, ``scale`` the largest magnitude among the
reference output and the per-rank outputs. Sharded float32 runs reorder reductions (a sum over
a split dim becomes local sums plus a cross-rank sum), and partial inputs are random addends of
the same magnitude as the value, so rounding is ~1e-7 relative to the addends' magnitude, times
the reduction length; 1e-5 leaves a margin of ~100 ulps yet is far below any error a wrong rule
makes (a wrong rule is off by O(1) relative). Integer and boolean outputs must be equal.
Nodes that differ only in their values (repeated layers, per-parameter optimizer updates) are
checked once per signature to keep the run short.
"""

from __future__ import annotations

import dataclasses

import functools
import hashlib
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import meshplan
from meshplan import PlanError
from meshplan.examples import cnn, gpt, llama, mlp
from meshplan.examples._common import Example, batch_generator, make_optimizer, seeded
from meshplan.frontend._traced import _Args
from meshplan.ir import (
    Graph,
    Node,
    NodeKind,
    Ref,
    Role,
    TensorMeta,
    resolve_op,
    split_foreach,
    verify,
)
from meshplan.ir._interpret import constant_tensor
from meshplan.ir._ops import resolve
from meshplan.planner._placement import Partial, Placement, ReduceOp, Replicate, Shard, divides
from meshplan.planner.rules import (
    OpStrategy,
    op_info,
    registered,
    rule_for,
    sharding_rule,
    strategies_for,
)
from meshplan.planner.rules.creation import UNINITIALIZED
from meshplan.planner.rules.random_ops import RANDOM

RTOL, ATOL = 1e-4, 1e-5
MESH_SIZES = (2, 3)
# Ops that may appear in the example graphs without a rule, with the reason. Empty: every op
# the examples trace to has a rule.
NO_RULE_ALLOWED: dict[str, str] = {}


# ---- a LLaMA-style step ------------------------------------------------------------------

def build_llama(foreach: bool = True) -> Example:
    """One block of examples/llama.py (RMSNorm, GQA with RoPE, SwiGLU, untied head), AdamW."""
    config = dataclasses.replace(llama.PRESETS["tiny"], n_layer=1)
    return llama.build(config=config, foreach=foreach, clip=None)


class Zoo(nn.Module):
    """Ops the examples do not reach: biased and grouped convolutions, eval-mode batch norm,
    average pools, affine-free layer norm, tanh/sigmoid/leaky-relu/hardtanh, unbind/stack/
    select/repeat, masked non-causal attention, softmax, amax/logsumexp/var/cumsum, where,
    clamp/maximum, weighted cross-entropy, a summed MSE."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 6, 3, padding=1)
        self.gconv = nn.Conv2d(6, 6, 3, padding=1, groups=2, bias=False)
        self.bn = nn.BatchNorm2d(6).eval()
        self.ln = nn.LayerNorm(24, elementwise_affine=False)
        self.qkv = nn.Linear(24, 72)
        self.head = nn.Linear(24, 10)
        self.register_buffer("mask", torch.linspace(-1.0, 1.0, 9).view(3, 3))
        self.register_buffer("class_weight", torch.linspace(0.5, 1.5, 10))

    def forward(self, x: Tensor, y: Tensor, target: Tensor) -> Tensor:
        h = F.leaky_relu(self.conv(x), 0.1)
        h = F.hardtanh(self.bn(self.gconv(h)), -2.0, 2.0)
        h = F.adaptive_avg_pool2d(F.avg_pool2d(h, 2), 2)                 # [6, 6, 2, 2]
        s = self.ln(h.flatten(1))                                        # [6, 24]
        s = torch.tanh(s) * torch.sigmoid(s)
        q, k, v = self.qkv(s).view(6, 3, 2, 3, 4).unbind(1)              # [6, 2, 3, 4]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask).reshape(6, 24)
        o = o - o.amax(-1, keepdim=True)
        sm = F.softmax(o, -1)
        st = torch.stack(torch.unbind(o.view(6, 2, 12), 1), 2)          # [6, 12, 2]
        w = torch.where(o > 0, o, o * 0.5)
        w = torch.maximum(torch.clamp(w, min=-1.0), st.select(2, 0).repeat(1, 2))
        loss = F.cross_entropy(self.head(w + sm), y, weight=self.class_weight)
        loss = loss + F.mse_loss(torch.cumsum(sm, -1), target, reduction="sum")
        return loss + torch.logsumexp(o, -1).mean() + o.var(-1).mean()


def build_zoo() -> Example:
    with seeded(0):
        model = Zoo()
    opt = make_optimizer(model.parameters(), "sgd", foreach=False, lrs={"sgd": 0.01},
                         momentum=0.9)

    def step(x: Tensor, y: Tensor, target: Tensor) -> Tensor:
        loss = model(x, y, target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    def batch(i: int) -> tuple[Tensor, Tensor, Tensor]:
        g = batch_generator(11, i)
        return (torch.randn(6, 4, 4, 4, generator=g), torch.randint(0, 10, (6,), generator=g),
                torch.rand(6, 24, generator=g))

    return Example(model=model, opt=opt, step=step, batch=batch)


CASES: dict[str, Callable[[], Example]] = {
    "mlp-adamw-foreach-clip": lambda: mlp.build("adamw", foreach=True, clip=0.5),
    "mlp-sgd-loop": lambda: mlp.build("sgd", foreach=False),
    "gpt-layernorm-gelu-foreach": lambda: gpt.build(
        "adamw", foreach=True, config=gpt.GPTConfig(n_layer=1)),
    "gpt-rmsnorm-silu-loop": lambda: gpt.build(
        "sgd", foreach=False, config=gpt.GPTConfig(n_layer=1, norm="rms", activation="silu")),
    "cnn-sgd-foreach": lambda: cnn.build("sgd", foreach=True),
    "cnn-adamw-loop": lambda: cnn.build("adamw", foreach=False),
    "llama-adamw-foreach": build_llama,
    "zoo-sgd-loop": build_zoo,
}


# ---- recording one single-process run ------------------------------------------------------

@dataclass
class Recorded:
    graph: Graph
    env: dict[str, tuple]                         # node -> its outputs
    mutated: dict[str, dict[int, Tensor]]         # node -> {ref position: input after the op}


def _fill(a: Any, vals: Iterator[Any]) -> Any:
    """Replace each Ref in ``a`` (refs order) by the next value; tuples become lists."""
    if isinstance(a, Ref):
        return next(vals)
    if isinstance(a, tuple):
        return [_fill(x, vals) for x in a]
    return a


def run_op(node: Node, args: tuple, kwargs: tuple, vals: Sequence[Any]) -> tuple:
    it = iter(vals)
    a = [_fill(x, it) for x in args]
    kw = {k: _fill(v, it) for k, v in kwargs}
    rule = rule_for(node.target)
    out = (rule.local_op if rule is not None and rule.local_op else resolve(node))(*a, **kw)
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


@contextmanager
def single_thread() -> Iterator[None]:
    """Tiny ops run several times faster on one thread than with OpenMP workers spinning on a
    busy 2-core machine; restore the caller's setting afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _clone(v: Any) -> Any:
    return v.clone() if isinstance(v, Tensor) else v


@functools.lru_cache(maxsize=None)
def recorded(case: str) -> Recorded:
    with single_thread():
        return _record(case)


def _record(case: str) -> Recorded:
    ex = CASES[case]()
    ex.step(*ex.batch(0))                      # warm up: optimizer state exists
    args = ex.batch(1)
    traced = meshplan.trace(ex.step, *args)
    graph = verify(split_foreach(traced.graph))
    return record(graph, traced._inputs(traced.graph, _Args.of(args)))


def record(graph: Graph, inputs: dict[str, Tensor]) -> Recorded:
    """Run ``graph`` node by node; every op gets clones, so recorded values stay pristine and
    in-place updates (batch norm's running statistics) show up as ``mutated``."""
    env: dict[str, tuple] = {}
    mutated: dict[str, dict[int, Tensor]] = {}
    with torch.no_grad():
        for node in graph.nodes:
            if node.kind is NodeKind.INPUT:
                env[node.name] = (inputs[node.target].clone(),)
            elif node.kind is NodeKind.CONSTANT:
                env[node.name] = (constant_tensor(node),)
            else:
                before = [env[r.node][r.index] for r in node.refs()]
                vals = [_clone(v) for v in before]
                env[node.name] = run_op(node, node.args, node.kwargs, vals)
                changed = {i: v for i, (v, b) in enumerate(zip(vals, before))
                           if isinstance(v, Tensor) and not torch.equal(v, b)}
                if changed:
                    mutated[node.name] = changed
    return Recorded(graph, env, mutated)


def op_graph(target: str, *args: Any, **kwargs: Any) -> Recorded:
    """A one-op graph of ``target`` applied to ``args`` (tensors become inputs), recorded."""
    nodes: list[Node] = []
    inputs: dict[str, Tensor] = {}

    def lift(a: Any) -> Any:
        if isinstance(a, Tensor):
            name = f"in{len(inputs)}"
            inputs[name] = a
            meta = TensorMeta(tuple(a.shape), str(a.dtype).removeprefix("torch."), Role.DATA)
            nodes.append(Node(name, NodeKind.INPUT, name, outputs=(meta,)))
            return Ref(name)
        return tuple(lift(x) for x in a) if isinstance(a, (list, tuple)) else a

    node_args = tuple(lift(a) for a in args)
    node_kwargs = tuple((k, lift(v)) for k, v in kwargs.items())
    res = resolve_op(target)(*args, **kwargs)
    res = tuple(res) if isinstance(res, (tuple, list)) else (res,)
    metas = tuple(TensorMeta(tuple(r.shape), str(r.dtype).removeprefix("torch."))
                  if isinstance(r, Tensor) else None for r in res)
    nodes.append(Node("op", NodeKind.OP, target, node_args, node_kwargs, metas))
    return record(Graph(tuple(nodes), ()), inputs)


# ---- simulating one strategy ---------------------------------------------------------------

def split(v: Any, p: Placement | None, n: int, gen: torch.Generator) -> list[Any]:
    """The per-rank pieces of ``v`` under placement ``p``."""
    if p is None or not isinstance(v, Tensor):
        return [v] * n
    if isinstance(p, Replicate):
        return [v.clone() for _ in range(n)]
    if isinstance(p, Shard):
        return [c.clone() for c in torch.chunk(v, n, dim=p.dim)]
    assert isinstance(p, Partial)
    if not v.is_floating_point():
        raise AssertionError(f"a partial placement on a {v.dtype} tensor")
    if p.op is ReduceOp.NORM2:                 # non-negative pieces whose squares sum to v's
        share = torch.rand((n,), generator=gen, dtype=v.dtype) + 0.1
        share = share / share.sum()
        return [v * s.sqrt() for s in share]
    scale = float(v.abs().max()) or 1.0
    noise = [torch.randn(v.shape, generator=gen, dtype=v.dtype) * scale * (r + 1)
             for r in range(n - 1)]
    rest = -torch.stack(noise).sum(0) if noise else torch.zeros_like(v)
    if p.op is ReduceOp.SUM:                   # addends: noise_r, and v minus their sum
        return [*noise, v + rest]
    return [v + e for e in (*noise, rest)]     # zero-mean noise around v


def combine(parts: list[Any], p: Placement | None) -> tuple[Any, str]:
    """Put per-rank outputs back together; also a complaint if replicas disagree."""
    if p is None or not isinstance(parts[0], Tensor):
        bad = any(not _close(x, parts[0]) for x in parts[1:])
        return parts[0], "ranks disagree on a non-tensor output" if bad else ""
    if isinstance(p, Shard):
        return torch.cat(parts, dim=p.dim), ""
    if isinstance(p, Replicate):
        bad = any(not _close(x, parts[0]) for x in parts[1:])
        return parts[0], "replicated output differs across ranks" if bad else ""
    stacked = torch.stack(parts)
    total = (stacked.sum(0) if p.op is ReduceOp.SUM else stacked.mean(0)
             if p.op is ReduceOp.AVG else stacked.square().sum(0).sqrt())
    return total, ""


def _close(got: Any, want: Any, scale: float = 0.0) -> bool:
    if not isinstance(want, Tensor):
        return got == want or (isinstance(got, float) and math.isclose(got, want, rel_tol=RTOL))
    if not isinstance(got, Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        return False
    if not want.is_floating_point():
        return torch.equal(got, want)
    scale = max(scale, _magnitude([want]))
    return torch.allclose(got, want, rtol=RTOL, atol=ATOL * scale + 1e-30, equal_nan=True)


def _local_shape(shape: tuple[int, ...], p: Placement | None, n: int) -> tuple[int, ...]:
    if isinstance(p, Shard):
        return tuple(s // n if d == p.dim else s for d, s in enumerate(shape))
    return shape


def _fits(info, s: OpStrategy, n: int) -> bool:
    pairs = list(zip(info.inputs, s.inputs)) + list(zip(info.outputs, s.outputs))
    return all(m is None or p is None or divides(m.shape, (p,), (n,)) for m, p in pairs)


def simulate(rec: Recorded, node: Node, s: OpStrategy, n: int) -> str:
    """Run ``node`` under strategy ``s`` on ``n`` simulated ranks; '' or what went wrong."""
    info = op_info(node, rec.graph)
    seed = int(hashlib.sha256(f"{node.name}{s}{n}".encode()).hexdigest()[:8], 16)
    gen = torch.Generator().manual_seed(seed)
    ins = [rec.env[r.node][r.index] for r in node.refs()]
    pieces = [split(v, p, n, gen) for v, p in zip(ins, s.inputs)]
    in_shapes = [None if m is None else _local_shape(m.shape, p, n)
                 for m, p in zip(info.inputs, s.inputs)]
    out_shapes = [None if m is None else _local_shape(m.shape, p, n)
                  for m, p in zip(info.outputs, s.outputs)]
    rule = rule_for(node.target)
    args, kwargs = rule.local_args(node, in_shapes, out_shapes)
    with torch.no_grad():
        per_rank = [run_op(node, args, kwargs, [pc[r] for pc in pieces]) for r in range(n)]
    problems = []
    for k, (want, p) in enumerate(zip(rec.env[node.name], s.outputs)):
        parts = [o[k] for o in per_rank]
        if isinstance(want, Tensor) and any(x.shape != out_shapes[k] for x in parts):
            problems.append(f"output {k}: local shape {tuple(parts[0].shape)}, "
                            f"expected {out_shapes[k]}")
            continue
        if node.target in UNINITIALIZED or node.target in RANDOM:
            continue                           # unspecified or random values: shapes only
        got, why = combine(parts, p)
        if why:
            problems.append(f"output {k}: {why}")
        elif not _close(got, want, _magnitude(parts)):
            problems.append(f"output {k} ({p}): {_diff(got, want)}")
    for i, after in rec.mutated.get(node.name, {}).items():
        got, why = combine(pieces[i], s.inputs[i])
        if why or not _close(got, after):
            problems.append(f"mutated input {i} ({s.inputs[i]}): {why or _diff(got, after)}")
    return "; ".join(problems)


def _magnitude(parts: list[Any]) -> float:
    return max((float(x.nan_to_num(0.0, 0.0, 0.0).abs().max()) for x in parts
                if isinstance(x, Tensor) and x.is_floating_point() and x.numel()), default=0.0)


def _diff(got: Any, want: Any) -> str:
    if isinstance(got, Tensor) and isinstance(want, Tensor) and got.shape == want.shape:
        d = (got.double() - want.double()).abs().max().item()
        return f"max abs diff {d:.3g} (reference max {want.double().abs().max().item():.3g})"
    return f"got {got!r:.80}, want {want!r:.80}"


def _signature(rec: Recorded, node: Node) -> str:
    def lit(a: Any) -> Any:
        if isinstance(a, Ref):
            m = rec.graph.meta(a)
            return getattr(m, "shape", "s"), getattr(m, "dtype", "")
        return tuple(lit(x) for x in a) if isinstance(a, tuple) else repr(a)
    return repr((node.target, lit(node.args), tuple((k, lit(v)) for k, v in node.kwargs)))


_SEEN: set[str] = set()


def check_case(case: str) -> tuple[list[str], int]:
    """Every strategy of every ruled op node of ``case``: failures and the number checked."""
    rec = recorded(case)
    with single_thread():
        return check_graph(rec, _SEEN)


def check_graph(rec: Recorded, seen: set[str]) -> tuple[list[str], int]:
    failures, checked = [], 0
    for node in rec.graph.nodes:
        if node.kind is not NodeKind.OP or rule_for(node.target) is None:
            continue
        sig = _signature(rec, node)
        if sig in seen:
            continue
        seen.add(sig)
        try:
            strategies, _ = strategies_for(node, rec.graph)
        except PlanError as e:
            failures.append(f"{node.target} [{node.name}] at {node.source}: {e}")
            continue
        for s in strategies[1:]:                # the first is the implied all-Replicate
            if not _holds(rec, node, s):
                continue
            for n in MESH_SIZES:
                if not _fits(op_info(node, rec.graph), s, n):
                    continue
                checked += 1
                why = _attempt(rec, node, s, n)
                if why:
                    failures.append(f"{node.target} {s} on {n} ranks [{node.name}] at "
                                    f"{node.source}: {why}")
    return failures, checked


def _holds(rec: Recorded, node: Node, s: OpStrategy) -> bool:
    """Whether every input of ``node`` can be in its layout under ``s``: a ``P(norm2)`` value
    is a 2-norm's pieces, never negative (only a norm makes one; the planner never changes
    another layout into it), so a strategy reading one applies to non-negative values only
    (a stack of per-gradient norms, not of signed tensors)."""
    for r, p in zip(node.refs(), s.inputs):
        v = rec.env[r.node][r.index]
        if (isinstance(p, Partial) and p.op is ReduceOp.NORM2 and isinstance(v, Tensor)
                and bool((v < 0).any())):
            return False
    return True


def _attempt(rec: Recorded, node: Node, s: OpStrategy, n: int) -> str:
    try:
        return simulate(rec, node, s, n)
    except Exception as e:  # noqa: BLE001 - a rule that makes the local op fail is wrong
        return f"{type(e).__name__}: {str(e)[:200]}"


# ---- single-op graphs: rules the example steps do not reach --------------------------------

_GEN = torch.Generator()


def rn(*shape: int) -> Tensor:
    return torch.randn(*shape, generator=_GEN)


def ri(high: int, *shape: int) -> Tensor:
    return torch.randint(0, high, shape, generator=_GEN)


def _flash(causal: bool) -> tuple:
    q, k, v = rn(6, 2, 12, 4), rn(6, 2, 9, 4), rn(6, 2, 9, 4)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return rn(6, 2, 12, 4), q, k, v, out, lse, 0.0, causal


def _bn_inputs() -> tuple:
    return rn(4, 6, 5, 5), rn(6), rn(6), rn(6), rn(6).abs() + 0.5


def _logp(*shape: int) -> Tensor:
    return rn(*shape).log_softmax(1)


# id -> (target, thunk returning the args); sizes divide by 2 and by 3 where it matters.
OP_CASES: dict[str, tuple[str, Callable[[], tuple]]] = {
    "permute": ("aten.permute.default", lambda: (rn(6, 4, 12), (2, 0, 1))),
    "reshape-merge": ("aten.reshape.default", lambda: (rn(6, 4, 12), (24, 12))),
    "view-split": ("aten.view.default", lambda: (rn(6, 4, 12), (6, 2, 2, 12))),
    "view-infer": ("aten.view.default", lambda: (rn(6, 4, 12), (-1, 12))),
    "view-outer-split": ("aten.view.default", lambda: (rn(12, 5), (3, 4, 5))),
    "view-ones": ("aten.view.default", lambda: (rn(1, 6, 4), (6, 1, 4))),
    "squeeze": ("aten.squeeze.default", lambda: (rn(6, 1, 4, 1),)),
    "squeeze-dims": ("aten.squeeze.dims", lambda: (rn(6, 1, 4, 1), (1, 3))),
    "unsqueeze": ("aten.unsqueeze.default", lambda: (rn(6, 4), -1)),
    "split-sizes": ("aten.split_with_sizes.default", lambda: (rn(6, 10), (4, 6), 1)),
    # int tuples that equal an output's shape but are not shapes: must not be localized
    "split-sizes-like-shape": ("aten.split_with_sizes.default", lambda: (rn(4, 10), (4, 6), 1)),
    "sum-dims-like-shape": ("aten.sum.dim_IntList", lambda: (rn(2, 3, 2, 3), (2, 3))),
    "narrow": ("aten.narrow.default", lambda: (rn(6, 10), 1, 2, 6)),
    "slice-dim0": ("aten.slice.Tensor", lambda: (rn(6, 12), 0, 0, 3)),
    "select": ("aten.select.int", lambda: (rn(6, 4, 12), 1, 2)),
    "cat": ("aten.cat.default", lambda: ((rn(6, 4), rn(6, 8)), 1)),
    "expand-new-dims": ("aten.expand.default", lambda: (rn(4), (6, 3, 4))),
    "sum-all": ("aten.sum.default", lambda: (rn(6, 12),)),
    "mean-all": ("aten.mean.default", lambda: (rn(6, 12),)),
    "sum-dims": ("aten.sum.dim_IntList", lambda: (rn(6, 4, 12), (0, 2))),
    "amin": ("aten.amin.default", lambda: (rn(6, 12), (1,))),
    "max-dim": ("aten.max.dim", lambda: (rn(6, 12), 1)),
    "argmax": ("aten.argmax.default", lambda: (rn(6, 12), 1, True)),
    "std": ("aten.std.correction", lambda: (rn(6, 12), (1,))),
    "var-mean": ("aten.var_mean.correction", lambda: (rn(6, 12), (0,))),
    "any": ("aten.any.dim", lambda: (rn(6, 12) > 0, 1)),
    "norm-dim": ("aten.linalg_vector_norm.default", lambda: (rn(6, 12), 2, (1,))),
    # the 2-norm of a split tensor (gradient clipping on shards): P(norm2) out, and in
    "norm-all": ("aten.linalg_vector_norm.default", lambda: (rn(6, 12),)),
    "stack-norms": ("aten.stack.default", lambda: ((rn(6).abs(), rn(6).abs()),)),
    "new-zeros": ("aten.new_zeros.default", lambda: (rn(6, 4), (6, 12))),
    "zeros": ("aten.zeros.default", lambda: ((6, 12),)),
    "full": ("aten.full.default", lambda: ((6, 12), 2.5)),
    "full-like": ("aten.full_like.default", lambda: (rn(6, 12), 3.0)),
    "fill": ("aten.fill.Scalar", lambda: (rn(6, 12), 2.0)),
    "empty-like": ("aten.empty_like.default", lambda: (rn(6, 12),)),
    "zeros-like": ("aten.zeros_like.default", lambda: (rn(6, 12),)),
    "copy": ("aten.copy.default", lambda: (rn(6, 4), rn(4))),
    "bernoulli-p": ("aten.bernoulli.p", lambda: (rn(6, 12), 0.7)),
    "bernoulli-probs": ("aten.bernoulli.default", lambda: (torch.rand(6, 12, generator=_GEN),)),
    "rand-like": ("aten.rand_like.default", lambda: (rn(6, 12),)),
    "randn-like": ("aten.randn_like.default", lambda: (rn(6, 12),)),
    "randint-like": ("aten.randint_like.default", lambda: (rn(6, 12), 5)),
    "randint-like-low": ("aten.randint_like.low_dtype", lambda: (rn(6, 12), 2, 5)),
    "rand": ("aten.rand.default", lambda: ((6, 12),)),
    "randn": ("aten.randn.default", lambda: ((6, 12),)),
    "lerp-tensor": ("aten.lerp.Tensor", lambda: (rn(6, 4), rn(6, 4), rn(4))),
    "rsub": ("aten.rsub.Tensor", lambda: (rn(6, 4), rn(4))),
    "sub-scalar": ("aten.sub.Scalar", lambda: (rn(6, 4), 0.5)),
    "pow-tt": ("aten.pow.Tensor_Tensor", lambda: (rn(6, 4).abs() + 0.5, rn(4))),
    "clamp-tensor": ("aten.clamp.Tensor", lambda: (rn(6, 4), -rn(4).abs(), rn(4).abs())),
    "to-double": ("aten._to_copy.default", lambda: (rn(6, 4),), {"dtype": torch.float64}),
    "to-int": ("aten._to_copy.default", lambda: (rn(6, 4) * 5,), {"dtype": torch.int64}),
    "safe-softmax": ("aten._safe_softmax.default", lambda: (rn(6, 4, 12), -1)),
    "nll2d-mean": ("aten.nll_loss2d_forward.default",
                   lambda: (_logp(6, 5, 4, 4), ri(5, 6, 4, 4), None, 1, -100)),
    "nll2d-backward": ("aten.nll_loss2d_backward.default",
                       lambda: (torch.tensor(0.7), _logp(6, 5, 4, 4), ri(5, 6, 4, 4), None, 1,
                                -100, torch.tensor(96.0))),
    "nll-weighted-sum": ("aten.nll_loss_forward.default",
                         lambda: (_logp(6, 5), ri(5, 6), rn(5).abs(), 2, -100)),
    "nll-weighted-mean": ("aten.nll_loss_forward.default",
                          lambda: (_logp(6, 5), ri(5, 6), rn(5).abs(), 1, -100)),
    "nll-none": ("aten.nll_loss_forward.default", lambda: (_logp(6, 5), ri(5, 6), None, 0, -100)),
    "nll-none-backward": ("aten.nll_loss_backward.default",
                          lambda: (rn(6), _logp(6, 5), ri(5, 6), None, 0, -100, torch.tensor(0.))),
    "mse-none": ("aten.mse_loss.default", lambda: (rn(6, 4), rn(6, 4), 0)),
    "mse-sum": ("aten.mse_loss.default", lambda: (rn(6, 4), rn(6, 4), 2)),
    "mse-backward-none": ("aten.mse_loss_backward.default",
                          lambda: (rn(6, 4), rn(6, 4), rn(6, 4), 0)),
    "mse-backward-sum": ("aten.mse_loss_backward.default",
                         lambda: (torch.tensor(0.3), rn(6, 4), rn(6, 4), 2)),
    "mse-backward-mean": ("aten.mse_loss_backward.default",
                          lambda: (torch.tensor(0.3), rn(6, 4), rn(6, 4), 1)),
    "smooth-l1-mean": ("aten.smooth_l1_loss.default", lambda: (rn(6, 4), rn(6, 4), 1, 0.5)),
    "smooth-l1-backward-mean": ("aten.smooth_l1_loss_backward.default",
                                lambda: (torch.tensor(0.3), rn(6, 4), rn(6, 4), 1, 0.5)),
    "huber-none": ("aten.huber_loss.default", lambda: (rn(6, 4), rn(6, 4), 0, 0.5)),
    "huber-backward-sum": ("aten.huber_loss_backward.default",
                           lambda: (torch.tensor(0.3), rn(6, 4), rn(6, 4), 2, 0.5)),
    "bce-weighted-mean": ("aten.binary_cross_entropy.default",
                          lambda: (rn(6, 4).sigmoid(), rn(6, 4).sigmoid(), rn(4).abs(), 1)),
    "bce-backward-weighted-mean": ("aten.binary_cross_entropy_backward.default",
                                   lambda: (torch.tensor(0.3), rn(6, 4).sigmoid(),
                                            rn(6, 4).sigmoid(), rn(4).abs(), 1)),
    "soft-margin-backward-mean": ("aten.soft_margin_loss_backward.default",
                                  lambda: (torch.tensor(0.3), rn(6, 4), rn(6, 4).sign(), 1)),
    "xlogy": ("aten.xlogy.Tensor", lambda: (rn(6, 4), rn(6, 4).abs())),
    "emb-backward-freq": ("aten.embedding_dense_backward.default",
                          lambda: (rn(6, 4, 12), ri(10, 6, 4), 10, -1, True)),
    "bn-functional": ("aten._native_batch_norm_legit_functional.default",
                      lambda: (*_bn_inputs(), True, 0.1, 1e-5)),
    "bn-legit": ("aten._native_batch_norm_legit.default", lambda: (*_bn_inputs(), True, 0.1, 1e-5)),
    "bn-no-stats": ("aten._native_batch_norm_legit.no_stats",
                    lambda: (*_bn_inputs()[:3], True, 0.1, 1e-5)),
    "bn-no-training": ("aten._native_batch_norm_legit_no_training.default",
                       lambda: (*_bn_inputs(), 0.1, 1e-5)),
    "avg-pool3d": ("aten.avg_pool3d.default", lambda: (rn(2, 6, 4, 4, 4), (2, 2, 2))),
    "max-pool3d": ("aten.max_pool3d_with_indices.default", lambda: (rn(2, 6, 4, 4, 4), (2, 2, 2))),
    "adaptive-pool3d": ("aten._adaptive_avg_pool3d.default",
                        lambda: (rn(2, 6, 4, 4, 4), (2, 2, 2))),
    "bmm": ("aten.bmm.default", lambda: (rn(6, 4, 12), rn(6, 12, 3))),
    "baddbmm": ("aten.baddbmm.default", lambda: (rn(6, 1, 3), rn(6, 4, 12), rn(6, 12, 3))),
    "flash-noncausal": ("aten._scaled_dot_product_flash_attention_for_cpu.default",
                        lambda: (rn(6, 2, 12, 4), rn(6, 2, 9, 4), rn(6, 2, 9, 4))),
    "flash-noncausal-backward": ("aten._scaled_dot_product_flash_attention_for_cpu_backward"
                                 ".default", lambda: _flash(False)),
    "conv-transposed": ("aten.convolution.default",
                        lambda: (rn(6, 4, 5, 5), rn(4, 6, 3, 3), rn(6), (1, 1), (1, 1), (1, 1),
                                 True, (0, 0), 1)),
    "conv-backward-bias": ("aten.convolution_backward.default",
                           lambda: (rn(6, 6, 5, 5), rn(6, 4, 5, 5), rn(6, 4, 3, 3), (6,), (1, 1),
                                    (1, 1), (1, 1), False, (0, 0), 1, (True, True, True))),
}


def op_case(case: str) -> Recorded:
    target, thunk, *kw = OP_CASES[case]
    _GEN.manual_seed(0)
    return op_graph(target, *thunk(), **(kw[0] if kw else {}))


# ---- tests ---------------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_every_strategy_matches_single_process(case: str) -> None:
    """Simulated sharded execution of every strategy equals the unsharded op (see module doc)."""
    failures, checked = check_case(case)
    assert not failures, f"{len(failures)} of {checked} sharded runs are wrong:\n" + "\n".join(
        failures)


def test_rules_of_single_ops_match_single_process() -> None:
    """The same check on one-op graphs for rules and argument variants the steps do not reach
    (reshape kinds, factories, 3-D pools, 2-D nll, weighted and unreduced losses, batch norm
    variants, non-causal attention, transposed convolution, batched matmuls...)."""
    failures, checked = [], 0
    with single_thread():
        for case in OP_CASES:
            rec = op_case(case)
            f, c = check_graph(rec, set())
            failures += [f"{case}: {x}" for x in f]
            checked += c
    assert checked > 150
    assert not failures, f"{len(failures)} of {checked} sharded runs are wrong:\n" + "\n".join(
        failures)


S0, S1, S2 = Shard(0), Shard(1), Shard(2)
P_SUM, P_AVG, P_NORM2 = Partial(ReduceOp.SUM), Partial(ReduceOp.AVG), Partial(ReduceOp.NORM2)
R = Replicate()
# Plausible but wrong strategies: the validator must reject every one of them.
WRONG: list[tuple[str, Callable[[], tuple], OpStrategy]] = [
    ("aten.gelu.default", lambda: (rn(6, 4),), OpStrategy((P_SUM,), (P_SUM,))),
    ("aten.add.Tensor", lambda: (rn(6, 4), rn(6, 4)), OpStrategy((P_SUM, R), (P_SUM,))),
    ("aten.mul.Tensor", lambda: (rn(6, 4), rn(6, 4)), OpStrategy((P_SUM, P_SUM), (P_SUM,))),
    ("aten.add.Scalar", lambda: (rn(6, 4), 1.5), OpStrategy((P_SUM,), (P_SUM,))),
    ("aten.mean.dim", lambda: (rn(6, 12), (1,)), OpStrategy((S1,), (P_SUM,))),
    ("aten.linalg_vector_norm.default", lambda: (rn(6, 12),), OpStrategy((S0,), (P_SUM,))),
    ("aten.linalg_vector_norm.default", lambda: (rn(6, 12), 1), OpStrategy((S0,), (P_NORM2,))),
    ("aten.linalg_vector_norm.default", lambda: (rn(6, 12),), OpStrategy((P_SUM,), (P_NORM2,))),
    ("aten.amax.default", lambda: (rn(6, 12), (1,)), OpStrategy((S1,), (P_SUM,))),
    ("aten.view.default", lambda: (rn(6, 4, 12), (6, 48)), OpStrategy((S2,), (S1,))),
    ("aten.transpose.int", lambda: (rn(6, 12), 0, 1), OpStrategy((S0,), (S0,))),
    ("aten._softmax.default", lambda: (rn(6, 12), 1, False), OpStrategy((S1,), (S1,))),
    ("aten.native_layer_norm.default", lambda: (rn(6, 12), (12,), rn(12), rn(12), 1e-5),
     OpStrategy((S1, S0, S0), (S1, S1, S1))),
    ("aten.native_batch_norm.default", lambda: (*_bn_inputs(), True, 0.1, 1e-5),
     OpStrategy((S0, R, R, R, R), (S0, R, R))),
    ("aten.mse_loss_backward.default", lambda: (torch.tensor(0.3), rn(6, 4), rn(6, 4), 1),
     OpStrategy((P_SUM, S0, S0), (S0,))),
    ("aten.smooth_l1_loss_backward.default",
     lambda: (torch.tensor(0.3), rn(6, 4), rn(6, 4), 1, 0.5), OpStrategy((P_SUM, S0, S0), (S0,))),
    ("aten.binary_cross_entropy.default",
     lambda: (rn(6, 4).sigmoid(), rn(6, 4).sigmoid(), rn(4).abs(), 1),
     OpStrategy((S1, S1, R), (P_AVG,))),
    ("aten.nll_loss_forward.default", lambda: (_logp(6, 5), ri(5, 6), None, 1, -100),
     OpStrategy((S0, S0), (P_SUM, P_SUM))),
    ("aten.nll_loss_forward.default", lambda: (_logp(6, 5), ri(5, 6), rn(5).abs(), 1, -100),
     OpStrategy((S0, S0, R), (P_AVG, P_SUM))),
    # the mean of the pieces' means (DTensor's P(avg)) where padding targets fall unevenly
    ("aten.nll_loss_forward.default",
     lambda: (_logp(6, 5), torch.tensor([-100, -100, 1, 2, 3, 4]), None, 1, -100),
     OpStrategy((S0, S0), (P_AVG, P_SUM))),
    ("aten.embedding_dense_backward.default",
     lambda: (rn(6, 4, 12), ri(10, 6, 4), 10, -1, True), OpStrategy((S0, S0), (P_SUM,))),
    ("aten.mm.default", lambda: (rn(6, 12), rn(12, 4)), OpStrategy((S1, S0), (P_AVG,))),
    ("aten.cat.default", lambda: ((rn(6, 4), rn(6, 8)), 1), OpStrategy((S1, S1), (S1,))),
    ("aten.max_pool2d_with_indices.default", lambda: (rn(2, 6, 6, 6), (3, 3), (2, 2)),
     OpStrategy((S2,), (S2, S2))),
    ("aten._scaled_dot_product_flash_attention_for_cpu.default",
     lambda: (rn(6, 2, 12, 4), rn(6, 2, 12, 4), rn(6, 2, 12, 4), 0.0, True),
     OpStrategy((S2, R, R), (S2, S2))),
]


@pytest.mark.parametrize("target,args,wrong", WRONG, ids=[w[0] for w in WRONG])
def test_validator_rejects_wrong_rules(target: str, args: Callable[[], tuple],
                                       wrong: OpStrategy) -> None:
    """Inputs are asymmetric enough that a wrong rule cannot pass by luck."""
    _GEN.manual_seed(0)
    rec = op_graph(target, *args())
    assert _attempt(rec, rec.graph.nodes[-1], wrong, 2), f"{target} {wrong} was accepted"


@pytest.mark.parametrize("case", list(CASES))
def test_every_op_has_a_rule(case: str) -> None:
    """Each op of the example graphs has a rule (none falls back to replicate silently)."""
    graph = recorded(case).graph
    missing = sorted({n.target for n in graph.nodes if n.kind is NodeKind.OP
                      and rule_for(n.target) is None and n.target not in NO_RULE_ALLOWED})
    assert not missing, f"ops without a sharding rule in {case}: {missing}"
    assert not any(n.target.startswith("aten._foreach_") for n in graph.nodes)


def test_registering_an_op_twice_is_an_error() -> None:
    before = rule_for("aten.mm.default")
    with pytest.raises(PlanError, match="aten.mm.default"):
        sharding_rule("aten.mm.default")(lambda info: [])
    assert rule_for("aten.mm.default") == before


def test_every_registered_target_is_a_real_op() -> None:
    for target in registered():
        resolve_op(target)


def test_rules_offer_the_classic_layouts() -> None:
    """Spot checks that the flows the planner needs exist: data parallel (batch split through
    the loss), Megatron column/row parallel, and sequence parallel through RMSNorm's ops."""
    rec = recorded("llama-adamw-foreach")
    have: dict[str, set[str]] = {}
    for node in rec.graph.nodes:
        if node.kind is NodeKind.OP:
            ss, _ = strategies_for(node, rec.graph)
            have.setdefault(node.target, set()).update(str(s) for s in ss)
    # (the trace writes the mean as the sum over its count: frontend/_decomp.py)
    assert "(S(0), S(0)) -> (P(sum), P(sum))" in have["aten.nll_loss_forward.default"]
    assert "(S(0), S(0)) -> (P(sum))" in have["aten.embedding_dense_backward.default"]
    assert "(S(1), S(1), S(1)) -> (S(1), S(1))" in have[
        "aten._scaled_dot_product_flash_attention_for_cpu.default"]
    assert "(S(2)) -> (P(avg))" in have["aten.mean.dim"]          # RMSNorm over a split dim
    assert "(P(sum), R) -> (P(sum))" in have["aten.mul.Tensor"]
    assert "(P(sum), P(sum)) -> (P(sum))" in have["aten.add.Tensor"]
