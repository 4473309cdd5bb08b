"""The kernel registry the lowering consults.

A :class:`KernelSpec` names a kernel, the backend it is written in, the devices and dtypes it
supports, the aten targets its pattern replaces, a matcher ``Graph -> list[Match]`` and the
entry point (``"_module:function"`` inside ``meshplan.kernels``, imported only when asked for,
so that importing the registry never imports triton). :func:`find_kernels` runs every
available kernel's matcher and returns what could substitute; the lowering decides.

Kernels are switched off globally by ``MESHPLAN_KERNELS=off`` (also ``0``/``false``/``no``) in
the environment or by :func:`set_kernels_enabled`; then :func:`find_kernels` returns nothing.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import importlib.util
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..ir import Graph, Ref
from ._common import KernelError, interpreting

__all__ = ["Backend", "Device", "KernelSpec", "Match", "register_kernel", "unregister_kernel",
           "registered_kernels", "get_kernel", "find_kernels", "kernels_enabled",
           "set_kernels_enabled", "kernels_disabled", "load_kernel"]


class Device(enum.Enum):
    CPU = "cpu"
    CUDA = "cuda"


class Backend(enum.Enum):
    TRITON = "triton"
    NUMBA = "numba"
    TORCH = "torch"


@dataclass(frozen=True, slots=True)
class Match:
    """One place in a graph where ``kernel`` can substitute.

    ``nodes`` are the nodes the kernel replaces (``anchor`` among them; empty for kernels that
    add work rather than replace it, like bucket flattening). ``operands`` and ``results`` name
    the values the kernel reads and the values of the replaced nodes it produces (readers of a
    replaced node are rewired to those). ``attrs`` are the constants read off the graph
    (``eps``, ``approximate``, betas, ...). ``dtype`` is the dtype the kernel would run at.

    Two kernels may hand each other a value of their own: ``private`` names results and operands
    whose slot (a replaced node's ``Ref``) carries the kernel's value instead of the graph's
    (cross-entropy's forward leaves the rows' log-sum-exp where the log-softmax was, and its
    backward reads it there). The lowering substitutes such a pair together or not at all.
    ``layout_from`` names, for an operand none of ``nodes`` reads, the node whose read layout it
    takes (the backward reads the logits as the forward's first node did)."""

    kernel: str
    anchor: str
    nodes: tuple[str, ...]
    operands: tuple[tuple[str, Ref], ...]
    results: tuple[tuple[str, Ref], ...] = ()
    attrs: tuple[tuple[str, Any], ...] = ()
    dtype: str = "float32"
    private: tuple[str, ...] = ()
    layout_from: tuple[tuple[str, str], ...] = ()

    def operand(self, name: str) -> Ref:
        return _lookup(self.operands, name, self, "operand")

    def result(self, name: str) -> Ref:
        return _lookup(self.results, name, self, "result")

    def attr(self, name: str) -> Any:
        return _lookup(self.attrs, name, self, "attr")


def _lookup(pairs, name, match, what):
    for key, value in pairs:
        if key == name:
            return value
    raise KernelError(f"match of {match.kernel} at {match.anchor} has no {what} {name!r}; it has "
                      f"{[k for k, _ in pairs]}")


Matcher = Callable[[Graph], list[Match]]


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelSpec:
    """A kernel: what it replaces (``targets`` + ``matcher``), where it runs, how to call it."""

    name: str
    backend: Backend
    devices: frozenset[Device]
    dtypes: frozenset[str]
    targets: frozenset[str]
    matcher: Matcher
    entry: str
    doc: str = ""
    # operands the kernel updates in place and returns as the results of the same name
    mutates: frozenset[str] = frozenset()
    # matches with equal attrs may run as ONE call (multi-tensor optimizer updates)
    batch: bool = False

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise KernelError(f"kernel name must be an identifier, got {self.name!r}")
        if not self.devices or not all(isinstance(d, Device) for d in self.devices):
            raise KernelError(f"kernel {self.name}: devices must be a non-empty set of Device")
        if not isinstance(self.backend, Backend):
            raise KernelError(f"kernel {self.name}: backend must be a Backend, got {self.backend!r}")
        if ":" not in self.entry:
            raise KernelError(f"kernel {self.name}: entry must be '_module:function', got "
                              f"{self.entry!r}")

    def available(self, device: Device) -> bool:
        """Can this kernel run on ``device`` in this process (library importable, device present)?"""
        if device not in self.devices:
            return False
        if self.backend is Backend.TORCH:
            return device is Device.CPU or torch.cuda.is_available()
        if self.backend is Backend.NUMBA:
            return device is Device.CPU and _importable("numba")
        if not _importable("triton"):
            return False
        return torch.cuda.is_available() if device is Device.CUDA else interpreting()


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


_REGISTRY: dict[str, KernelSpec] = {}
_ENABLED: list[bool | None] = [None]  # None: follow the environment


def register_kernel(spec: KernelSpec) -> KernelSpec:
    """Add a kernel; registering a name twice is an error."""
    if spec.name in _REGISTRY:
        raise KernelError(f"kernel {spec.name!r} is already registered (entry "
                          f"{_REGISTRY[spec.name].entry}); pick another name or unregister it")
    _REGISTRY[spec.name] = spec
    return spec


def unregister_kernel(name: str) -> KernelSpec:
    return _REGISTRY.pop(get_kernel(name).name)


def get_kernel(name: str) -> KernelSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KernelError(f"no kernel named {name!r}; registered: {sorted(_REGISTRY)}") from None


def registered_kernels() -> tuple[KernelSpec, ...]:
    return tuple(_REGISTRY.values())


def load_kernel(spec: KernelSpec | str) -> Callable[..., Any]:
    """Import and return the kernel's entry function (imports triton/numba on first use)."""
    spec = get_kernel(spec) if isinstance(spec, str) else spec
    module, _, function = spec.entry.partition(":")
    return getattr(importlib.import_module(module, package=__package__), function)


def kernels_enabled() -> bool:
    if _ENABLED[0] is not None:
        return _ENABLED[0]
    return os.environ.get("MESHPLAN_KERNELS", "on").strip().lower() not in ("off", "0", "false",
                                                                           "no")


def set_kernels_enabled(enabled: bool | None) -> None:
    """Turn kernels on or off for this process; ``None`` follows ``MESHPLAN_KERNELS`` again."""
    _ENABLED[0] = enabled


@contextmanager
def kernels_disabled() -> Iterator[None]:
    before = _ENABLED[0]
    _ENABLED[0] = False
    try:
        yield
    finally:
        _ENABLED[0] = before


def find_kernels(graph: Graph, device: str | Device, dtypes: Iterable[str] | None = None, *,
                 check_available: bool = True) -> list[Match]:
    """Every place in ``graph`` a registered kernel supporting ``device`` and the match's dtype
    (one of ``dtypes``; any when None) could substitute, in registration then graph order.

    ``check_available=False`` lists matches for a device this process does not have (planning
    for a GPU cluster on a laptop). Returns [] when kernels are switched off. The graph must be
    free of foreach ops (``meshplan.ir.split_foreach``), so foreach and single-tensor optimizers
    match alike."""
    if not kernels_enabled():
        return []
    try:
        device = Device(device) if not isinstance(device, Device) else device
    except ValueError:
        raise KernelError(f"unknown device {device!r}; use 'cpu' or 'cuda'") from None
    foreach = next((n for n in graph.nodes if n.target.startswith("aten._foreach_")), None)
    if foreach is not None:
        raise KernelError(f"find_kernels: node {foreach.name} ({foreach.target}) is a foreach op; "
                          "patterns are per tensor - run meshplan.ir.split_foreach(graph) first "
                          "(the planner's graph is already split)")
    wanted = None if dtypes is None else {str(d).removeprefix("torch.") for d in dtypes}
    found: list[Match] = []
    for spec in _REGISTRY.values():
        if device not in spec.devices or (check_available and not spec.available(device)):
            continue
        for match in spec.matcher(graph):
            if match.kernel != spec.name:  # one matcher may serve several kernels
                match = dataclasses.replace(match, kernel=spec.name)
            if match.dtype in spec.dtypes and (wanted is None or match.dtype in wanted):
                found.append(match)
    return found
