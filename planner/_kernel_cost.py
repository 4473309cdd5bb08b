"""The fused kernels the lowering will run, priced as the kernels they are.

The lowering replaces matched op chains by one kernel call where a kernel for the program's
device exists (``backends/_kernels.py``: AdamW's eight element-wise ops per parameter become one
pass over param, grad and the two moments; on GPUs also layer norm, GELU, cross-entropy). Priced
op by op, such a chain reads and writes its tensors once per op: on the benchmark GPT's ``dp``
step on 2 CPU ranks that put 27 ms on an optimizer update the fused kernel runs in 6, and since
a replicated plan updates every parameter on every rank and a sharded one only its shard, the
error made replicated plans look slower than they are.

``kernel_work(graph, topology)`` is what the planner prices instead: for each match of a fused
kernel (Triton or numba; the torch ``foreach`` fallbacks run op by op and keep their ops'
prices), the kernel's work is its members' FLOPs and the bytes of the tensors it reads and of
the ones it writes, once each. Each member keeps its FLOPs and carries its share of those
bytes (its own bytes scaled by the kernel's over the members' together), under the target
``kernel.<name>`` (the op factor a calibration fits to the kernel's measured calls); only the
anchor pays the kernel floor (one launch). Where the members share a layout, as they must for
the lowering to substitute, their times add up to the kernel's. Spread over the members
rather than put on the anchor alone, no member is free: zero-cost ops made the ILP of LLaMA-3
405B's Megatron stages (75k variables) miss its 120 s limit, where it had solved in 40 s.
Matches are taken as the lowering takes them (registration order, a node in one match at
most). The lowering may still keep a match's ops where the plan reads its operands in
different layouts (``backends/_kernels.py`` lists when); the planner does not know the
layouts before it solves, and prices the kernel.

The device is the topology's (``Topology.device``: ``cpu`` for the ``cpu`` preset and machines
measured on CPUs, ``cuda`` for the GPU presets). Kernels switched off (``MESHPLAN_KERNELS=off``,
``distribute(kernels=False)``) leave every op priced as itself.
"""

from __future__ import annotations

from typing import Any

from ..ir import Graph, NodeKind, Ref, TensorMeta, node_bytes, node_flops

KERNEL_PREFIX = "kernel."          # a kernel's op target, as the ops telemetry names its calls

# (FLOPs, bytes, target priced under, whether the kernel floor applies: one launch per kernel)
Work = tuple[float, float, str, bool]


def kernel_work(graph: Graph, topology: Any) -> dict[str, Work]:
    """Node name -> the work the planner prices it at, for the nodes a fused kernel replaces
    on ``topology``'s device (each its share of the kernel's). Nodes not listed are priced as
    their own op. Cached on the graph per device and kernel switch."""
    return _fused(graph, topology)[0]


def fused_kernel_of(graph: Graph, topology: Any) -> dict[str, str]:
    """Node name -> the target (``kernel.<name>``) of the fused kernel that replaces it, for
    every member of every match ``kernel_work`` prices."""
    return _fused(graph, topology)[1]


def _fused(graph: Graph, topology: Any) -> tuple[dict[str, Work], dict[str, str]]:
    from .. import kernels as _kernels

    device = getattr(topology, "device", "cuda")
    enabled = _kernels.kernels_enabled()
    cache = graph.__dict__.setdefault("_meshplan_kernel_work", {})
    key = (device, enabled)
    if key not in cache:
        cache[key] = _kernel_work(graph, device) if enabled else ({}, {})
    return cache[key]


def _kernel_work(graph: Graph, device: str) -> tuple[dict[str, Work], dict[str, str]]:
    from .. import kernels as _kernels

    if any(n.target.startswith("aten._foreach_") for n in graph.nodes):
        return {}, {}                  # not the planner's (split) graph: nothing matches
    fused = {_kernels.Backend.TRITON, _kernels.Backend.NUMBA}
    # a CPU kernel must load here (numba); a GPU one is planned for from machines without one
    matches = _kernels.find_kernels(graph, device, check_available=device == "cpu")
    taken: set[str] = set()
    out: dict[str, Work] = {}
    member_of: dict[str, str] = {}
    for m in matches:
        if not m.nodes or taken.intersection(m.nodes):
            continue
        taken.update(m.nodes)
        if _kernels.get_kernel(m.kernel).backend not in fused:
            continue
        members = [graph.node(n) for n in m.nodes]
        tensors = {ref: graph.meta(ref) for _, ref in (*m.operands, *m.results)
                   if isinstance(ref, Ref) and isinstance(graph.meta(ref), TensorMeta)}
        own = [float(node_bytes(graph, n)) for n in members]
        kernel_bytes = float(sum(meta.nbytes for meta in tensors.values()))
        share = kernel_bytes / sum(own) if sum(own) > 0 else 1.0
        target = KERNEL_PREFIX + m.kernel
        for n, b in zip(members, own):
            out[n.name] = (float(node_flops(graph, n)), b * share, target, n.name == m.anchor)
            member_of[n.name] = target
    return out, member_of


def node_work_of(graph: Graph, node: Any, work: dict[str, Work]) -> Work:
    """(FLOPs, bytes, target, floor) the planner prices ``node`` at: its share of a kernel
    from ``work`` (``kernel_work``), else the op's own."""
    if node.name in work:
        return work[node.name]
    if node.kind is not NodeKind.OP:
        return 0.0, 0.0, node.target, True
    return float(node_flops(graph, node)), float(node_bytes(graph, node)), node.target, True
