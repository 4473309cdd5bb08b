"""Abstract device meshes and the topology they sit on.

A ``Mesh`` is named axes with sizes, ranks laid out row-major (the last axis is innermost: its
ranks are consecutive, as in ``torch.distributed.DeviceMesh``). A ``Topology`` says what the
devices can do: FLOP/s, memory bandwidth and capacity, and the links inside a node and between
nodes. An axis whose rank group stays within one node uses the node's link; an axis that spans
nodes gets the slower link.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from .._errors import PlanError


@dataclass(frozen=True, slots=True)
class Link:
    """One direction of a link as a collective sees it: ``alpha`` seconds per message step,
    ``bandwidth`` bytes per second per device. ``kinds``: (collective kind, bandwidth,
    latency) for kinds measured apart (a calibration fits each: on shared memory an all-reduce
    reduces as it copies, an all-to-all only copies); other kinds use the link's own pair.
    ``wait``: seconds every blocking collective call adds when its members are busy computing,
    waiting for them to be scheduled again (ranks outnumbering cores); a calibration measures
    it (``backends/_probe.py``: ``probe_wait``), presets leave it at 0."""

    bandwidth: float
    latency: float
    kinds: tuple[tuple[str, float, float], ...] = ()
    wait: float = 0.0

    def __post_init__(self) -> None:
        if not (self.bandwidth > 0 and self.latency >= 0 and self.wait >= 0):
            raise PlanError(f"a link needs bandwidth > 0 and latency >= 0 (and wait >= 0), "
                            f"got {self}")
        kinds = tuple(sorted((str(k), float(b), float(a)) for k, b, a in self.kinds))
        if any(not (b > 0 and a >= 0) for _, b, a in kinds):
            raise PlanError(f"a link's per-kind bandwidths must be > 0 and latencies >= 0, "
                            f"got {kinds}")
        object.__setattr__(self, "kinds", kinds)

    def for_kind(self, kind: str) -> tuple[float, float]:
        """(bandwidth, latency) a collective of ``kind`` (``"all_reduce"``, ...) sees."""
        for k, b, a in self.kinds:
            if k == kind:
                return b, a
        return self.bandwidth, self.latency


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """What one device and its links can do. Numbers are achievable, not peak, where the
    preset says so."""

    name: str
    flops: tuple[tuple[str, float], ...]  # dtype -> FLOP/s per device; a Mapping is accepted
    memory_bandwidth: float               # bytes/s per device
    memory_bytes: int                     # per device
    devices_per_node: int
    intra_node: Link
    inter_node: Link
    compute_efficiency: float = 0.7       # fraction of peak a good kernel reaches
    kernel_floor_s: float = 5e-6          # no op takes less (launch/dispatch overhead)
    # fraction of a collective's time that can run under compute: 1 where collectives have
    # their own engine (NCCL, RDMA), 0 where they take the cores the compute needs
    comm_overlap: float = 1.0
    # per op (aten target): measured time / the roofline's, fitted to a run's sampled op times
    # (``meshplan calibrate --from-telemetry``); ops not listed take 1. Presets list none.
    op_factors: tuple[tuple[str, float], ...] = ()
    # time every step takes beyond its ops and collectives (the program's interpreter, views,
    # host arithmetic, the step's vote), fitted to a run; presets: 0
    step_overhead_s: float = 0.0
    # what the ranks compute on: "cuda" or "cpu". It picks the fused kernels the lowering will
    # run, which the cost model prices as kernels (``_kernel_cost.py``)
    device: str = "cuda"

    def __post_init__(self) -> None:
        if isinstance(self.flops, Mapping):
            object.__setattr__(self, "flops", tuple(sorted(self.flops.items())))
        if isinstance(self.op_factors, Mapping):
            object.__setattr__(self, "op_factors", tuple(sorted(self.op_factors.items())))
        if self.device not in ("cpu", "cuda"):
            raise PlanError(f"topology {self.name!r}: device must be 'cpu' or 'cuda', "
                            f"got {self.device!r}")
        if not self.step_overhead_s >= 0:
            raise PlanError(f"topology {self.name!r}: step_overhead_s must be >= 0")
        if any(not f > 0 for _, f in self.op_factors):
            raise PlanError(f"topology {self.name!r}: op_factors must be positive")
        if not self.flops or any(v <= 0 for _, v in self.flops):
            raise PlanError(f"topology {self.name!r}: flops must map dtypes to positive FLOP/s")
        if self.memory_bytes <= 0 or self.memory_bandwidth <= 0 or self.devices_per_node < 1:
            raise PlanError(f"topology {self.name!r}: memory and devices_per_node must be > 0")
        if not 0 < self.compute_efficiency <= 1:
            raise PlanError(f"topology {self.name!r}: compute_efficiency must be in (0, 1]")
        if not 0 <= self.comm_overlap <= 1:
            raise PlanError(f"topology {self.name!r}: comm_overlap must be in [0, 1]")

    def flops_for(self, dtype: str) -> float:
        table = dict(self.flops)
        return table[dtype] if dtype in table else min(table.values())

    def op_factor(self, target: str) -> float:
        return dict(self.op_factors).get(target, 1.0) if self.op_factors else 1.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["flops"] = dict(self.flops)
        d["op_factors"] = dict(self.op_factors)
        for link in ("intra_node", "inter_node"):       # a link without per-kind numbers
            if not d[link]["kinds"]:                    # writes as before they existed
                del d[link]["kinds"]
            else:
                d[link]["kinds"] = [list(k) for k in d[link]["kinds"]]
            if not d[link]["wait"]:                     # likewise a link without a wait
                del d[link]["wait"]
        return d

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Topology:
        try:
            return Topology(
                name=d["name"], flops=dict(d["flops"]), memory_bandwidth=float(d["memory_bandwidth"]),
                memory_bytes=int(d["memory_bytes"]), devices_per_node=int(d["devices_per_node"]),
                intra_node=Link(**d["intra_node"]), inter_node=Link(**d["inter_node"]),
                compute_efficiency=float(d.get("compute_efficiency", 0.7)),
                kernel_floor_s=float(d.get("kernel_floor_s", 5e-6)),
                comm_overlap=float(d.get("comm_overlap", 1.0)),
                op_factors={str(k): float(v) for k, v in dict(d.get("op_factors", {})).items()},
                step_overhead_s=float(d.get("step_overhead_s", 0.0)),
                # a file from before the field: the CPU machines were named so
                device=str(d.get("device") or ("cpu" if str(d["name"]).startswith(
                    ("cpu", "calibrated")) else "cuda")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"bad topology description ({type(e).__name__}: {e})") from None

    def save(self, path: str) -> None:
        from ..ir import atomic_write_text

        atomic_write_text(path, json.dumps(self.to_dict(), indent=2))


GB = 1e9
GiB = 1 << 30

PRESETS: dict[str, Topology] = {
    # This kind of machine: CPU processes on one host, gloo over TCP loopback. Measured here
    # (gloo all-reduce of 64 MB ~1.0 GB/s with 2 ranks); `meshplan calibrate`
    # replaces these with the local machine's numbers. No overlap: gloo's thread runs on the
    # core its rank computes on; on this 2-core machine small buckets started during backward
    # gained nothing over one bucket (benchmarks/bucket_size.py, benchmarks/README.md).
    "cpu": Topology(
        name="cpu", flops={"float32": 50e9, "float64": 25e9, "bfloat16": 10e9, "float16": 10e9},
        memory_bandwidth=10 * GB, memory_bytes=8 * GiB, devices_per_node=64,
        intra_node=Link(bandwidth=1.0 * GB, latency=50e-6),
        inter_node=Link(bandwidth=1.0 * GB, latency=50e-6),
        compute_efficiency=0.5, kernel_floor_s=10e-6, comm_overlap=0.0, device="cpu",
    ),
}


def _fabric(gbps: float, latency: float) -> Link:
    """The link between nodes for a NIC of ``gbps`` Gb/s per device: a collective moves ~95 %
    of the line rate (Gb/s -> bytes/s: / 8)."""
    return Link(bandwidth=0.95 * gbps / 8 * GB, latency=latency)


def _gpu(name: str, *, bf16_tflops: float, tf32_tflops: float, fp8_tflops: float | None,
         hbm_gb: float, hbm_tbps: float, nvlink_gbps: float, fabric_gbps: float) -> Topology:
    """A GPU node of 8 from its datasheet numbers: dense (not sparse) tensor FLOP/s, HBM in GB
    and TB/s, NVLink GB/s per GPU counting both directions (as NVIDIA states it) and the fabric
    in Gb/s per GPU. ``float32`` is priced at the TF32 tensor rate: matmuls run there once
    ``torch.set_float32_matmul_precision("high")`` is set, as large-model training does
    (PyTorch's default, "highest", keeps them at the plain FP32 rate, 5-15x slower)."""
    flops = {"bfloat16": bf16_tflops * 1e12, "float16": bf16_tflops * 1e12,
             "float32": tf32_tflops * 1e12}
    if fp8_tflops is not None:
        flops["float8_e4m3fn"] = flops["float8_e5m2"] = fp8_tflops * 1e12
    return Topology(
        name=name, flops=flops, memory_bandwidth=hbm_tbps * 1e12, memory_bytes=int(hbm_gb * 1e9),
        devices_per_node=8,
        intra_node=Link(bandwidth=nvlink_gbps / 2 * GB, latency=3e-6),       # one direction
        inter_node=_fabric(fabric_gbps, latency=10e-6),
        compute_efficiency=0.7, kernel_floor_s=7e-6,
    )


# The fabric between nodes: 400 Gb/s per GPU (one ConnectX-7 NIC per GPU, InfiniBand NDR or
# RoCE, as DGX H100/H200/B200 ship; DGX A100 shipped 200 Gb/s HDR). ``get_topology("a100:
# fabric=200")`` sets another rate, ``gpus_per_node=N`` another node size.
FABRIC_GBPS = 400.0

PRESETS.update({
    # A100 80GB SXM (NVIDIA A100 datasheet, 2021): BF16/FP16 tensor 312 TFLOPS dense, TF32 156,
    # no FP8; HBM2e 80 GB at 2,039 GB/s; NVLink 3 600 GB/s per GPU (both directions).
    "a100": _gpu("a100", bf16_tflops=312, tf32_tflops=156, fp8_tflops=None, hbm_gb=80,
                 hbm_tbps=2.039, nvlink_gbps=600, fabric_gbps=FABRIC_GBPS),
    # H100 SXM5 (NVIDIA H100 datasheet): BF16/FP16 989 TFLOPS dense, TF32 494, FP8 1,979;
    # HBM3 80 GB at 3.35 TB/s; NVLink 4 900 GB/s per GPU.
    "h100": _gpu("h100", bf16_tflops=989, tf32_tflops=494, fp8_tflops=1979, hbm_gb=80,
                 hbm_tbps=3.35, nvlink_gbps=900, fabric_gbps=FABRIC_GBPS),
    # H200 SXM (NVIDIA H200 datasheet): the H100's tensor cores (989 / 494 / 1,979 dense);
    # HBM3e 141 GB at 4.8 TB/s; NVLink 4 900 GB/s per GPU.
    "h200": _gpu("h200", bf16_tflops=989, tf32_tflops=494, fp8_tflops=1979, hbm_gb=141,
                 hbm_tbps=4.8, nvlink_gbps=900, fabric_gbps=FABRIC_GBPS),
    # B200 (NVIDIA DGX/HGX B200 datasheet, per GPU = system / 8, dense = sparse / 2): BF16/FP16
    # 2,250 TFLOPS, TF32 1,100, FP8 4,500; HBM3e 180 GB at 8 TB/s; NVLink 5 1.8 TB/s per GPU.
    "b200": _gpu("b200", bf16_tflops=2250, tf32_tflops=1100, fp8_tflops=4500, hbm_gb=180,
                 hbm_tbps=8.0, nvlink_gbps=1800, fabric_gbps=FABRIC_GBPS),
})


def _variant(spec: str) -> Topology:
    """``"h100:fabric=200,gpus_per_node=4"``: a preset with another fabric rate (Gb/s per GPU)
    or node size."""
    name, _, options = spec.partition(":")
    base = PRESETS.get(name.strip())
    if base is None:
        raise PlanError(f"unknown topology {name.strip()!r} in {spec!r}; use one of "
                        f"{sorted(PRESETS)}")
    changes: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in options.split(","))):
        key, eq, value = (x.strip() for x in part.partition("="))
        try:
            number = float(value) if eq else float("nan")
        except ValueError:
            number = float("nan")
        if key == "fabric" and number > 0:
            changes["inter_node"] = _fabric(number, base.inter_node.latency)
        elif key == "gpus_per_node" and number >= 1 and number == int(number):
            changes["devices_per_node"] = int(number)
        else:
            raise PlanError(f"topology {spec!r}: cannot read {part!r}; options are "
                            "fabric=GBITS_PER_S (per device, > 0) and gpus_per_node=N")
    return dataclasses.replace(base, name=spec.strip(), **changes)



def get_topology(topology: str | Topology | None) -> Topology:
    """A preset name, a path to a topology JSON file (``meshplan calibrate``), or a Topology."""
    if isinstance(topology, Topology):
        return topology
    name = topology or "cpu"
    if name in PRESETS:
        return PRESETS[name]
    if ":" in name and name.partition(":")[0].strip() in PRESETS:
        return _variant(name)
    if os.path.isfile(name):
        try:
            with open(name, encoding="utf-8") as f:
                return Topology.from_dict(json.load(f))
        except json.JSONDecodeError as e:
            raise PlanError(f"topology file {name!r} is not JSON ({e})") from None
    raise PlanError(f"unknown topology {name!r}; use one of {sorted(PRESETS)} (optionally "
                    "with options, e.g. 'h100:fabric=200,gpus_per_node=4') or the path of a "
                    "file written by `meshplan calibrate`")


@dataclass(frozen=True, slots=True, init=False)
class Mesh:
    """Named mesh axes over a topology. ``Mesh({"dp": 2, "tp": 2}, "h100")``."""

    axes: tuple[tuple[str, int], ...]
    topology: Topology
    names: tuple[str, ...]
    sizes: tuple[int, ...]

    def __init__(self, axes: Mapping[str, int] | tuple[tuple[str, int], ...],
                 topology: str | Topology | None = None) -> None:
        items = tuple(axes.items()) if isinstance(axes, Mapping) else tuple(axes)
        if not items:
            raise PlanError("a mesh needs at least one axis, e.g. {'dp': 2}")
        names = [a for a, _ in items]
        if len(set(names)) != len(names):
            raise PlanError(f"mesh axis names must be unique, got {names}")
        for a, n in items:
            if not isinstance(a, str) or not a.isidentifier():
                raise PlanError(f"mesh axis name {a!r} must be an identifier like 'dp'")
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise PlanError(f"mesh axis {a!r} must have a positive integer size, got {n!r}")
        object.__setattr__(self, "axes", items)
        object.__setattr__(self, "topology", get_topology(topology))
        object.__setattr__(self, "names", tuple(a for a, _ in items))
        object.__setattr__(self, "sizes", tuple(n for _, n in items))

    @property
    def size(self) -> int:
        return math.prod(self.sizes)

    def index(self, axis: str) -> int:
        try:
            return self.names.index(axis)
        except ValueError:
            raise PlanError(f"mesh has no axis {axis!r}; its axes are {list(self.names)}") from None

    def stride(self, axis: int) -> int:
        """Rank distance between neighbours on ``axis`` (row-major: the last axis is 1)."""
        return math.prod(self.sizes[axis + 1:])

    def link(self, axis: int) -> Link:
        """The link a collective on ``axis`` runs over: the node's own link if every rank group
        of the axis lies inside one node, else the slower link between nodes."""
        return _link(self, axis)

    def __str__(self) -> str:
        return ",".join(f"{a}={n}" for a, n in self.axes) + f" ({self.topology.name})"


@functools.lru_cache(maxsize=1024)
def _link(mesh: Mesh, axis: int) -> Link:
    """``Mesh.link``, once per mesh and axis (the solver asks for it per layout change)."""
    stride, n = mesh.stride(axis), mesh.sizes[axis]
    per_node = mesh.topology.devices_per_node
    for base in range(mesh.size):
        if (base // stride) % n:
            continue                      # not the first rank of its group
        if base // per_node != (base + (n - 1) * stride) // per_node:
            return mesh.topology.inter_node
    return mesh.topology.intra_node


def parse_mesh(text: str) -> dict[str, int]:
    """``"dp=2,tp=2"`` -> ``{"dp": 2, "tp": 2}`` (the CLI's mesh syntax)."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, size = part.partition("=")
        if not eq or not size.strip().isdecimal() or not size.strip().isascii():
            raise PlanError(f"mesh {text!r}: expected AXIS=SIZE[,AXIS=SIZE...] such as dp=2,tp=2")
        if name.strip() in out:
            raise PlanError(f"mesh {text!r} names axis {name.strip()!r} twice")
        out[name.strip()] = int(size)
    if not out:
        raise PlanError(f"mesh {text!r} names no axis")
    return out
