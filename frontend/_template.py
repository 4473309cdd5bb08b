"""Repeated blocks: trace a few of a model's identical blocks and stamp out the rest.

A model that keeps ``n`` blocks of one class with identically shaped parameters in an
``nn.ModuleList`` (or ``nn.Sequential``) is traced with only its first ``TRACED_BLOCKS`` blocks
in the list (``len()`` of the list still says ``n``; indexing a missing block aborts), against
an inventory without the other blocks' state. ``_stamp.stamp`` then verifies that the traced
blocks repeat exactly and builds the graph of all ``n``. Anything unusual (hooks, shared
tensors, blocks in different optimizer groups, state that differs between blocks, a step that
indexes the list) means no template: the step is traced whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from ._capture import OptEntry, StateSpec
from ._discover import Inventory, Slot

TRACED_BLOCKS = 3          # first block, one interior block, last block
MIN_BLOCKS = 5             # below this a whole trace is about as cheap


class NotTemplatable(Exception):
    """The step cannot be traced through a template; trace it whole."""


@dataclass(frozen=True)
class Repeat:
    """``n`` identical blocks at module path ``path`` (``model.layers``)."""

    path: str
    container: nn.Module = dataclasses.field(repr=False)
    n: int
    param_block: tuple[int | None, ...] = dataclasses.field(repr=False)  # per parameter
    buffer_block: tuple[int | None, ...] = dataclasses.field(repr=False)
    # (submodule path inside a block, Python attributes whose values differ between blocks)
    guarded: tuple[tuple[str, frozenset[str]], ...] = ()

    def naming(self, inv: Inventory) -> BlockNaming:
        opts = "|".join(re.escape(name) for name, _ in inv.optimizers) or "(?!)"
        p = re.escape(self.path)
        return BlockNaming(
            re.compile(rf"^(?P<pre>(?:(?:{opts})\.state\.)?{p}\.)(?P<i>\d+)(?P<post>\..+)$"),
            re.compile(rf"^(?P<pre>{p}\.)(?P<i>\d+)(?P<post>(?:\..+)?)$"),
        )


@dataclass(frozen=True)
class BlockNaming:
    """Which block a state name or module path belongs to, and the same name in another block."""

    state: re.Pattern[str]
    module: re.Pattern[str]

    def state_block(self, name: str) -> int | None:
        m = self.state.match(name)
        return int(m["i"]) if m else None

    def module_block(self, path: str) -> int | None:
        m = self.module.match(path)
        return int(m["i"]) if m else None

    def rename_state(self, name: str, block: int | str) -> str:
        m = self.state.match(name)
        return f"{m['pre']}{block}{m['post']}" if m else name

    def rename_module(self, path: str, block: int | str) -> str:
        m = self.module.match(path)
        return f"{m['pre']}{block}{m['post']}" if m else path


# ---- finding the blocks ---------------------------------------------------------------------

def find_repeat(inv: Inventory) -> Repeat | None:
    """The largest list of identical blocks the step's modules hold, or None."""
    best: Repeat | None = None
    best_size = 0
    seen: set[int] = set()
    for _, root in inv.roots:
        for mod in root.modules():
            if id(mod) in seen or type(mod) not in (nn.ModuleList, nn.Sequential):
                continue
            seen.add(id(mod))
            blocks = list(mod._modules.values())
            if len(blocks) < MIN_BLOCKS or list(mod._modules) != [str(i) for i in
                                                                  range(len(blocks))]:
                continue
            path = inv.module_paths.get(id(mod))
            rep = _check(inv, mod, path, blocks) if path else None
            size = sum(p.numel() for p in mod.parameters())
            if rep is not None and size > best_size:
                best, best_size = rep, size
    return best


def _shape_key(mod: nn.Module) -> tuple:
    mods = tuple((n, type(m), m.training) for n, m in mod.named_modules(remove_duplicate=False))
    params = tuple((n, tuple(p.shape), p.dtype, p.device, p.requires_grad)
                   for n, p in mod.named_parameters(remove_duplicate=False))
    bufs = tuple((n, tuple(b.shape), b.dtype, b.device)
                 for n, b in mod.named_buffers(remove_duplicate=False))
    return mods, params, bufs


_MODULE_INTERNALS = frozenset(vars(nn.Module()))


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values count as different
        return False


def _differing_attrs(blocks: list[nn.Module]) -> tuple[tuple[str, frozenset[str]], ...] | None:
    """Per submodule, the plain Python attributes whose values differ between blocks (a
    ``layer_idx``, a per-layer flag); None if the blocks do not even have the same ones."""
    subs = [dict(b.named_modules(remove_duplicate=False)) for b in blocks]
    out = []
    for rel, m0 in subs[0].items():
        attrs = {k: v for k, v in vars(m0).items() if k not in _MODULE_INTERNALS}
        differ = set()
        for other in subs[1:]:
            theirs = {k: v for k, v in vars(other[rel]).items() if k not in _MODULE_INTERNALS}
            if theirs.keys() != attrs.keys():
                return None
            differ |= {k for k, v in attrs.items() if not _same(v, theirs[k])}
        if differ:
            out.append((rel, frozenset(differ)))
    return tuple(out)


def _has_hooks(mod: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
               or m._backward_pre_hooks for m in mod.modules())


def _check(inv: Inventory, container: nn.Module, path: str,
           blocks: list[nn.Module]) -> Repeat | None:
    key = _shape_key(blocks[0])
    if any(type(b) is not type(blocks[0]) or _has_hooks(b) or _shape_key(b) != key
           for b in blocks) or not key[1]:
        return None
    guarded = _differing_attrs(blocks)
    if guarded is None:
        return None
    owner = {id(m): i for i, b in enumerate(blocks) for m in b.modules()}
    param_block = _slot_blocks(inv.params, path, owner)
    buffer_block = _slot_blocks(inv.buffers, path, owner)
    if param_block is None or buffer_block is None:
        return None
    if any(g.get("foreach") for _, opt in inv.optimizers for g in opt.param_groups):
        return None     # one update op over all parameters: not stamped yet (traced whole)
    rep = Repeat(path, container, len(blocks), param_block, buffer_block, guarded)
    return rep if _groups_repeat(inv, rep) else None


def _slot_blocks(slots: list[Slot], path: str,
                 owner: dict[int, int]) -> tuple[int | None, ...] | None:
    """Each slot's block; None if a tensor is shared across blocks or named from elsewhere."""
    out: list[int | None] = []
    for s in slots:
        homes = {owner.get(id(m)) for m, _ in s.homes}
        if homes == {None} or not homes:
            out.append(None)
            continue
        if len(homes) != 1 or None in homes:
            return None
        i = homes.pop()
        if not s.name.startswith(f"{path}.{i}."):
            return None
        out.append(i)
    return tuple(out)


def _groups_repeat(inv: Inventory, rep: Repeat) -> bool:
    """Every optimizer group holds the blocks' parameters as one run per block, blocks in
    order, each run naming the same parameters in the same order."""
    for _, opt in inv.optimizers:
        for group in opt.param_groups:
            runs: list[tuple[int, list[str]]] = []
            ended = False
            for p in group["params"]:
                pi = inv.param_index[id(p)]
                b = rep.param_block[pi]
                if b is None:
                    ended = ended or bool(runs)
                    continue
                if ended:
                    return False
                rel = inv.params[pi].name[len(f"{rep.path}.{b}."):]
                if runs and runs[-1][0] == b:
                    runs[-1][1].append(rel)
                else:
                    runs.append((b, [rel]))
            if runs and ([b for b, _ in runs] != list(range(rep.n))
                         or any(r != runs[0][1] for _, r in runs)):
                return False
    return True


# ---- the partial inventory and its state ------------------------------------------------------

@dataclass(frozen=True)
class Partial:
    """The inventory of the first ``k`` blocks, and how its parameters map to the full one."""

    inv: Inventory
    k: int
    to_full: tuple[int, ...]             # partial parameter index -> full index
    source: tuple[int, ...]              # full parameter index -> the partial parameter it copies

    def restrict(self, spec: StateSpec) -> StateSpec:
        back = {f: i for i, f in enumerate(self.to_full)}
        grads = tuple(back[g] for g in spec.grads if g in back)
        opt = tuple(OptEntry(e.opt, back[e.param], e.key, e.shape, e.dtype)
                    for e in spec.opt if e.param in back)
        return StateSpec(grads, opt)

    def extend(self, spec: StateSpec) -> StateSpec:
        """The full model's state, each block repeating its template block's structure."""
        grads = set(spec.grads)
        by_param: dict[int, list[OptEntry]] = {}
        for e in spec.opt:
            by_param.setdefault(e.param, []).append(e)
        full_grads = tuple(f for f, s in enumerate(self.source) if s in grads)
        opt = tuple(OptEntry(e.opt, f, e.key, e.shape, e.dtype)
                    for f, s in enumerate(self.source) for e in by_param.get(s, ()))
        return StateSpec(full_grads, tuple(sorted(opt, key=lambda e: (e.opt, e.param, e.key))))

    def extend_pairs(self, pairs: frozenset[tuple[int, int]]) -> frozenset[tuple[int, int]]:
        return frozenset((o, f) for f, s in enumerate(self.source) for o, p in pairs if p == s)


def partial(inv: Inventory, rep: Repeat, k: int) -> Partial:
    """The inventory without blocks ``k..n-1``; block ``i`` of the full model copies block 0,
    ``k-1`` (the last) or 1 (an interior block) of the partial one."""
    def src_block(i: int) -> int:
        return 0 if i == 0 else k - 1 if i == rep.n - 1 else 1

    keep = [i for i, b in enumerate(rep.param_block) if b is None or b < k]
    params = [inv.params[i] for i in keep]
    buffers = [s for s, b in zip(inv.buffers, rep.buffer_block) if b is None or b < k]
    index = {id(s.tensor): i for i, s in enumerate(params)}
    sub = Inventory(params, buffers, inv.optimizers, inv.module_paths, index, inv.roots)
    at = {(rep.param_block[f], _rel(rep, inv.params[f].name, rep.param_block[f])): i
          for i, f in enumerate(keep)}
    position = {f: i for i, f in enumerate(keep)}
    source = []
    for f, b in enumerate(rep.param_block):
        if b is None:
            source.append(position[f])
        else:
            source.append(at[(src_block(b), _rel(rep, inv.params[f].name, b))])
    return Partial(sub, k, tuple(keep), tuple(source))


def _rel(rep: Repeat, name: str, block: int | None) -> str:
    return name if block is None else name[len(f"{rep.path}.{block}."):]


@contextlib.contextmanager
def truncated(rep: Repeat, k: int) -> Iterator[None]:
    """The container holds only its first ``k`` blocks; ``len()`` still says ``n``. Reaching a
    missing block, or reading an attribute whose value differs between blocks (it could make
    the untraced blocks compute differently), raises NotTemplatable: the step is traced whole."""
    box = rep.container
    cls, modules = type(box), box._modules
    blocks = [modules[str(i)] for i in range(k)]
    guards = [(b.get_submodule(rel), names) for rel, names in rep.guarded for b in blocks]
    saved = [(m, type(m)) for m, _ in guards]
    box._modules = type(modules)((str(i), b) for i, b in enumerate(blocks))
    box.__class__ = _truncated_class(cls, rep.n, k)
    try:
        for m, names in guards:
            m.__class__ = _guarded_class(type(m), names)
        yield
    finally:
        for m, c in saved:
            m.__class__ = c
        box.__class__ = cls
        box._modules = modules


def _guarded_class(cls: type[nn.Module], names: frozenset[str]) -> type[nn.Module]:
    def __getattribute__(self: nn.Module, name: str) -> object:
        if name in names:
            raise NotTemplatable(f"the step reads {cls.__name__}.{name}, which differs "
                                 "between blocks")
        return cls.__getattribute__(self, name)

    return type(cls.__name__, (cls,), {"__getattribute__": __getattribute__})


def _truncated_class(cls: type[nn.Module], n: int, k: int) -> type[nn.Module]:
    def __len__(self: nn.Module) -> int:
        return n

    def __getitem__(self: nn.Module, idx: object) -> nn.Module:
        if isinstance(idx, int) and -n <= idx < n and idx % n < k:
            return self._modules[str(idx % n)]
        raise NotTemplatable(f"the step indexes the block list with {idx!r}")

    return type(f"_Truncated{cls.__name__}", (cls,),
                {"__len__": __len__, "__getitem__": __getitem__})
