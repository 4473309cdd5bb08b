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
prices), the anchor node carries the kernel's work (its members' FLOPs; the bytes of the
tensors it reads and of the ones it writes, once each) under the target ``kernel.<name>``, the
op factor a calibration fits to the kernel's measured calls; the other members cost nothing.
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

Work = tuple[float, float, str | None]      # (FLOPs, bytes, target priced under; None: free)


def kernel_work(graph: Graph, topology: Any) -> dict[str, Work]:
    """Node name -> the work the planner prices it at, for the nodes a fused kernel replaces
    on ``topology``'s device (anchors: the kernel's; other members: nothing). Nodes not listed
    are priced as their own op. Cached on the graph per device and kernel switch."""
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
        flops = float(sum(node_flops(graph, n) for n in members))
        tensors = {ref: graph.meta(ref) for _, ref in (*m.operands, *m.results)
                   if isinstance(ref, Ref) and isinstance(graph.meta(ref), TensorMeta)}
        nbytes = float(sum(meta.nbytes for meta in tensors.values()))
        if nbytes == 0:                # a match of views only: nothing to price differently
            nbytes = float(sum(node_bytes(graph, n) for n in members))
        for n in members:
            out[n.name] = (0.0, 0.0, None)
            member_of[n.name] = KERNEL_PREFIX + m.kernel
        out[m.anchor] = (flops, nbytes, KERNEL_PREFIX + m.kernel)
    return out, member_of


def node_work_of(graph: Graph, node: Any, work: dict[str, Work]) -> Work:
    """(FLOPs, bytes, target) the planner prices ``node`` at: a kernel's share from ``work``
    (``kernel_work``), else the op's own."""
    if node.name in work:
        return work[node.name]
    if node.kind is not NodeKind.OP:
        return 0.0, 0.0, node.target
    return float(node_flops(graph, node)), float(node_bytes(graph, node)), node.target
