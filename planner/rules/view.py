"""Views, reshapes and their kin: view/_unsafe_view/reshape, t/transpose/permute, expand,
unsqueeze/squeeze, split/unbind/slice/select (and their backward ops), cat/stack. (``alias``
and ``detach`` are identities, with the copies in ``pointwise``.)

Each rule maps a tensor dim of the input to the output dim that holds the same elements. A
reshape is factored into groups of input and output dims with equal products (like DTensor's
view-op dim maps): a shard survives when it is on the OUTERMOST dim of its group and lands on
the outermost output dim of the group. Then both sides split the flat range of the group into
the same contiguous pieces, provided both dims divide (the planner checks divisibility of every
tensor). Cutting ops (split, slice, select, cat, stack) never split along the dim they cut.
Views are linear: partial values pass through unchanged.
"""

from __future__ import annotations

from typing import Iterator

from .._placement import P_NORM2, Placement, R, Shard
from ._registry import OpInfo, OpStrategy, default_localize, sharding_rule
from ._util import (
    PARTIALS,
    arg,
    is_float,
    literal_rule,
    localize_arg,
    norm_dim,
    out0,
    outs,
    shardable,
)

Groups = list[tuple[list[int], list[int]]]


def reshape_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> Groups:
    """Pair runs of input dims with runs of output dims of equal element count."""
    groups: Groups = []
    i = j = 0
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            groups.append(([i], []))
            i += 1
        elif j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            groups.append(([], [j]))
            j += 1
        elif i < len(src) and j < len(dst):
            a, b, pa, pb = [i], [j], src[i], dst[j]
            i, j = i + 1, j + 1
            while pa != pb and i <= len(src) and j <= len(dst):
                if pa < pb and i < len(src):
                    a.append(i); pa *= src[i]; i += 1  # noqa: E702
                elif pb < pa and j < len(dst):
                    b.append(j); pb *= dst[j]; j += 1  # noqa: E702
                else:
                    break
            groups.append((a, b))
        else:
            break
    return groups


def reshape_map(src: tuple[int, ...], dst: tuple[int, ...]) -> dict[int, int]:
    """Input dim -> output dim for the shards a reshape keeps."""
    out = {}
    for a, b in reshape_groups(src, dst):
        if a and b and src[a[0]] > 1 and dst[b[0]] > 1:
            out[a[0]] = b[0]
    return out


def mapped(info: OpInfo, dim_map: dict[int, int]) -> Iterator[OpStrategy]:
    """Strategies of a single-input view from an input-dim -> output-dim map (dims of size 1
    are skipped), plus partials passing through (views are linear)."""
    src = _src(info)
    for d_in, d_out in dim_map.items():
        if src[d_in] > 1:
            yield OpStrategy(_with(info, Shard(d_in)), outs(info, Shard(d_out)))
    if is_float(info.inputs[0]):
        for p in PARTIALS:
            yield OpStrategy(_with(info, p), outs(info, p))


def _with(info: OpInfo, p: Placement) -> tuple[Placement | None, ...]:
    """``p`` on the first tensor input, R on any other tensor, None on scalars."""
    return tuple(None if m is None else (p if i == 0 else R) for i, m in enumerate(info.inputs))


def _src(info: OpInfo) -> tuple[int, ...]:
    x = info.inputs[0]
    assert x is not None
    return x.shape


@sharding_rule("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default",
               localize=localize_arg("size", "shape"))
def view(info: OpInfo) -> Iterator[OpStrategy]:
    yield from mapped(info, reshape_map(_src(info), out0(info).shape))


@literal_rule("aten.t.default")
def t(info: OpInfo) -> Iterator[OpStrategy]:
    nd = len(_src(info))
    yield from mapped(info, {0: 0} if nd < 2 else {0: 1, 1: 0})


@literal_rule("aten.transpose.int")
def transpose(info: OpInfo) -> Iterator[OpStrategy]:
    nd = len(_src(info))
    a, b = (norm_dim(arg(info.node, n), nd) for n in ("dim0", "dim1"))
    yield from mapped(info, {d: (b if d == a else a if d == b else d) for d in range(nd)})


@literal_rule("aten.permute.default")
def permute(info: OpInfo) -> Iterator[OpStrategy]:
    nd = len(_src(info))
    dims = [norm_dim(d, nd) for d in arg(info.node, "dims")]
    yield from mapped(info, {d: dims.index(d) for d in range(nd)})


@sharding_rule("aten.expand.default", localize=localize_arg("size"))
def expand(info: OpInfo) -> Iterator[OpStrategy]:
    """Non-broadcast dims keep their shard; a broadcast dim of the output may be split while the
    input stays replicated (each rank expands to its local size)."""
    src, dst = _src(info), out0(info).shape
    off = len(dst) - len(src)
    yield from mapped(info, {d: d + off for d in range(len(src))
                             if src[d] == dst[d + off] and src[d] > 1})
    for d, size in enumerate(dst):
        if size > 1 and (d < off or src[d - off] == 1):
            yield OpStrategy(_with(info, R), outs(info, Shard(d)))


@literal_rule("aten.unsqueeze.default")
def unsqueeze(info: OpInfo) -> Iterator[OpStrategy]:
    nd = len(_src(info))
    at = norm_dim(arg(info.node, "dim"), nd + 1)
    yield from mapped(info, {d: d + (d >= at) for d in range(nd)})


@literal_rule("aten.squeeze.default", "aten.squeeze.dim", "aten.squeeze.dims")
def squeeze(info: OpInfo) -> Iterator[OpStrategy]:
    src = _src(info)
    if info.node.target == "aten.squeeze.default":
        gone = {d for d, s in enumerate(src) if s == 1}
    else:
        dims = arg(info.node, "dim")
        dims = (dims,) if isinstance(dims, int) else dims
        gone = {norm_dim(d, len(src)) for d in dims if src[norm_dim(d, len(src))] == 1}
    yield from mapped(info, {d: d - sum(g < d for g in gone) for d in range(len(src))
                             if d not in gone})


def _cut_dim(info: OpInfo) -> int:
    return norm_dim(arg(info.node, "dim"), len(_src(info)))


@literal_rule("aten.split.Tensor", "aten.split_with_sizes.default", "aten.slice.Tensor",
               "aten.narrow.default")
def split(info: OpInfo) -> Iterator[OpStrategy]:
    """Pieces along ``dim``: every other dim keeps its shard (each piece is split alike)."""
    cut = _cut_dim(info)
    yield from mapped(info, {d: d for d in shardable(info.inputs[0]) if d != cut})


@literal_rule("aten.select.int")
def select(info: OpInfo) -> Iterator[OpStrategy]:
    cut = _cut_dim(info)
    yield from mapped(info, {d: d - (d > cut) for d in shardable(info.inputs[0]) if d != cut})


@literal_rule("aten.unbind.int")
def unbind(info: OpInfo) -> Iterator[OpStrategy]:
    cut = _cut_dim(info)
    yield from mapped(info, {d: d - (d > cut) for d in shardable(info.inputs[0]) if d != cut})


@sharding_rule("aten.slice_backward.default", "aten.select_backward.default",
               localize=default_localize)
def cut_backward(info: OpInfo) -> Iterator[OpStrategy]:
    """Zero-padding the gradient of a slice/select back to the input's shape (``input_sizes``,
    localized): dims other than ``dim`` keep their shard."""
    full = out0(info).shape
    cut = norm_dim(arg(info.node, "dim"), len(full))
    selected = info.node.target == "aten.select_backward.default"
    dim_map = {}
    for d in shardable(info.inputs[0]):
        od = d + (selected and d >= cut)
        if od != cut:
            dim_map[d] = od
    yield from mapped(info, dim_map)


@literal_rule("aten.cat.default")
def cat(info: OpInfo) -> Iterator[OpStrategy]:
    """All pieces split alike on a dim other than the concatenation dim."""
    out = out0(info)
    cut = norm_dim(arg(info.node, "dim"), len(out.shape))
    for d in shardable(out):
        if d != cut and all(m is None or (len(m.shape) == len(out.shape) and m.shape[d] > 1)
                            for m in info.inputs):
            yield OpStrategy(tuple(None if m is None else Shard(d) for m in info.inputs),
                             outs(info, Shard(d)))
    yield from _all_partial(info)


@literal_rule("aten.stack.default")
def stack(info: OpInfo) -> Iterator[OpStrategy]:
    first = info.inputs[0]
    assert first is not None
    at = norm_dim(arg(info.node, "dim"), len(first.shape) + 1)
    for d in shardable(first):
        yield OpStrategy(tuple(None if m is None else Shard(d) for m in info.inputs),
                         outs(info, Shard(d + (d >= at))))
    yield from _all_partial(info, (*PARTIALS, P_NORM2))   # stacked norms' pieces stay pieces


def _all_partial(info: OpInfo, partials: tuple = PARTIALS) -> Iterator[OpStrategy]:
    if all(m is None or is_float(m) for m in info.inputs):
        for p in partials:
            yield OpStrategy(tuple(None if m is None else p for m in info.inputs), outs(info, p))


@literal_rule("aten.flip.default")
def flip(info: OpInfo) -> Iterator[OpStrategy]:
    """Reversal along ``dims``: a split dim would change which rank holds which half."""
    x = info.inputs[0]
    assert x is not None
    flipped = {norm_dim(d, len(x.shape)) for d in arg(info.node, "dims")}
    yield from mapped(info, {d: d for d in shardable(x) if d not in flipped})


@literal_rule("aten.repeat.default")
def repeat(info: OpInfo) -> Iterator[OpStrategy]:
    """Tiling: a dim repeated once keeps its shard (a tiled split dim would interleave)."""
    src = _src(info)
    reps = arg(info.node, "repeats")
    off = len(reps) - len(src)
    yield from mapped(info, {d: d + off for d in shardable(info.inputs[0]) if reps[d + off] == 1})
