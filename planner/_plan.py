"""The Plan: where every value lives on the mesh, what moves between layouts, what it costs.

Saved as versioned JSON with a content hash that ``load`` checks; the traced graph travels
inside the plan, so a saved plan runs without re-tracing. The file also records the graph's
hash and the torch and meshplan versions it was made with (absent, i.e. unknown, in older
files); ``check_compatible`` refuses a plan for another step, torch or mesh.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from .._errors import IRError, PlanError
from ..ir import Graph, Role, atomic_write_text, recompute
from ..ir._serialize import graph_from_dict, graph_to_dict, read_text
from ._mesh import Mesh, Topology
from ._placement import Layout, Replicate, format_layout, parse_placement

FORMAT = "meshplan.plan"
VERSION = 1
# the inputs whose layouts say whether a plan is fully replicated (state and batch)
_REPLICATION_ROLES = frozenset({Role.PARAM, Role.GRAD, Role.OPT_STATE, Role.BUFFER, Role.DATA})


@dataclass(frozen=True, slots=True)
class NodePlacement:
    node: str
    target: str
    inputs: tuple[Layout | None, ...]     # per Ref read (node.refs() order)
    outputs: tuple[Layout | None, ...]    # per output
    compute_s: float


@dataclass(frozen=True, slots=True)
class Redistribution:
    """A value changing layout on its way to a consumer (``"<result>"``: back to the user)."""

    value: str                 # "node" or "node[i]"
    consumer: str
    src: Layout
    dst: Layout
    collectives: tuple[tuple[str, str, int], ...]   # (collective, mesh axis, bytes)
    time_s: float
    count: int = 1             # identical instances (repeated layers)


@dataclass(frozen=True, slots=True)
class PlanEstimate:
    """A plan's headline numbers without its placements (a plan it was compared with)."""

    strategy: str
    estimated_step_time_s: float
    compute_time_s: float
    comm_time_s: float
    peak_memory_bytes: int
    fits: bool


@dataclass(frozen=True, slots=True)
class ShardedAlternatives:
    """What a fully replicated ``auto`` plan was chosen over: the hand-written sharded families
    (``dp``, ``fsdp``, ``megatron_tp``) planned for the same step, mesh, memory limit and cost
    model. ``plans`` fastest first; ``skipped``: (family, why it has no sharded plan here)."""

    plans: tuple[PlanEstimate, ...]
    skipped: tuple[tuple[str, str], ...] = ()

    @property
    def best(self) -> PlanEstimate | None:
        """The fastest plan that fits the memory limit (the fastest of all if none fits)."""
        fitting = [p for p in self.plans if p.fits]
        return min(fitting or self.plans, key=lambda p: p.estimated_step_time_s, default=None)

    def to_dict(self) -> dict[str, Any]:
        return {"plans": [{"strategy": p.strategy,
                           "estimated_step_time_s": p.estimated_step_time_s,
                           "compute_time_s": p.compute_time_s, "comm_time_s": p.comm_time_s,
                           "peak_memory_bytes": p.peak_memory_bytes, "fits": p.fits}
                          for p in self.plans],
                "skipped": [list(s) for s in self.skipped]}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> ShardedAlternatives:
        return ShardedAlternatives(
            tuple(PlanEstimate(str(p["strategy"]), float(p["estimated_step_time_s"]),
                               float(p["compute_time_s"]), float(p["comm_time_s"]),
                               int(p["peak_memory_bytes"]), bool(p["fits"]))
                  for p in d["plans"]),
            tuple((str(f), str(why)) for f, why in d["skipped"]))


@dataclass(frozen=True)
class Plan:
    mesh: Mesh
    strategy: str
    graph: Graph
    placements: tuple[NodePlacement, ...]
    redistributions: tuple[Redistribution, ...]
    estimated_step_time_s: float
    compute_time_s: float
    comm_time_s: float
    peak_memory_bytes: int
    memory_limit_bytes: int
    fallbacks: tuple[str, ...]
    solver: dict[str, Any] = field(default_factory=dict)
    # gradient bucket cap the cost model chose for the lowering (planner/_comm.py:
    # best_bucket_bytes); None: no bucketable all-reduce, or a plan written before it was chosen
    bucket_bytes: int | None = None
    # what the plan was made with; None: unknown (a file written before these were recorded)
    torch_version: str | None = field(default_factory=lambda: _torch_version())
    meshplan_version: str | None = field(default_factory=lambda: _meshplan_version())
    # a fully replicated ``auto`` plan's comparison with the sharded families; None: not
    # compared (not fully replicated, made with input pins, or saved before this was recorded)
    sharded_alternatives: ShardedAlternatives | None = None
    # activation recompute: (policy, layers) the planner applied to the traced graph (``graph``
    # holds the copies it made); None: nothing is recomputed
    recompute: tuple[str, tuple[str, ...]] | None = None

    @cached_property
    def graph_hash(self) -> str:
        """sha256 of the plan's graph as canonical JSON (what ``check_compatible`` compares)."""
        return graph_hash(self.graph)

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.memory_limit_bytes

    def check_compatible(self, graph: Graph | None = None,
                         mesh: Mesh | Mapping[str, int] | None = None) -> None:
        """Raise PlanError (saying how to fix it) unless this plan can run ``graph`` (the step
        as traced now) on ``mesh`` with the running torch."""
        if self.torch_version is not None:
            import torch

            made, now = _major_minor(self.torch_version), _major_minor(torch.__version__)
            if made != now:
                raise PlanError(f"plan was compiled with torch {self.torch_version}, running "
                                f"torch {torch.__version__}: recompile it with `meshplan "
                                "compile FILE.py:STEP -o PLAN`")
        if mesh is not None:
            axes = mesh.axes if isinstance(mesh, Mesh) else tuple(dict(mesh).items())
            # the same axes in another order: the planner reordered them (``axis_order``), and
            # the plan's order is the one ranks are laid out in
            if dict(axes) != dict(self.mesh.axes) or len(axes) != len(self.mesh.axes):
                raise PlanError(f"plan is for mesh {_axes_str(self.mesh.axes)}; you asked for "
                                f"{_axes_str(axes)}: pass --mesh {_axes_str(self.mesh.axes)} "
                                "or recompile for the new mesh")
        if graph is not None:
            from ._planning import _prepare

            if graph_hash(self.applied(_prepare(graph))) != self.graph_hash:
                raise PlanError(f"the step {graph.info.name!r} changed since the plan was "
                                "compiled (its graph hash differs; or it was compiled with "
                                "another --precision): recompile with `meshplan compile "
                                "FILE.py:STEP -o PLAN`")

    def applied(self, graph: Graph) -> Graph:
        """``graph`` (as traced and prepared) with this plan's activation recompute."""
        if self.recompute is None:
            return graph
        try:
            return recompute(graph, self.recompute[0], self.recompute[1])
        except IRError:      # another step: its layers differ; the hash check says so
            return graph

    @functools.cached_property
    def input_layouts(self) -> dict[str, Layout]:
        """Input name (state or data) -> the layout ranks hold it in."""
        inputs = {n.name for n in self.graph.inputs}
        return {p.target: p.outputs[0] for p in self.placements if p.node in inputs}

    @functools.cached_property
    def fully_replicated(self) -> bool:
        """True when the mesh has more than one rank and every state and data input is
        Replicate on every mesh axis: each rank holds all the state and runs the whole batch,
        so the ranks repeat one another's work (no data, tensor or sharded-state parallelism)."""
        if self.mesh.size <= 1:
            return False
        layouts = [self.input_layouts.get(n.target) for n in self.graph.inputs
                   if n.meta.role in _REPLICATION_ROLES]
        layouts = [l for l in layouts if l is not None]
        return bool(layouts) and all(isinstance(p, Replicate) for l in layouts for p in l)

    def estimate(self) -> PlanEstimate:
        """This plan's headline numbers."""
        return PlanEstimate(self.strategy, self.estimated_step_time_s, self.compute_time_s,
                            self.comm_time_s, self.peak_memory_bytes, self.fits)

    def placement(self, node: str) -> NodePlacement:
        for p in self.placements:
            if p.node == node:
                return p
        raise PlanError(f"plan has no node {node!r}")

    # ---- persistence --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        body = {
            "mesh": {"axes": [[a, n] for a, n in self.mesh.axes],
                     "topology": self.mesh.topology.to_dict()},
            "strategy": self.strategy,
            "graph": graph_to_dict(self.graph),
            "placements": [
                {"node": p.node, "target": p.target, "inputs": [_enc(l) for l in p.inputs],
                 "outputs": [_enc(l) for l in p.outputs], "compute_s": p.compute_s}
                for p in self.placements
            ],
            "redistributions": [
                {"value": r.value, "consumer": r.consumer, "src": _enc(r.src), "dst": _enc(r.dst),
                 "collectives": [list(c) for c in r.collectives], "time_s": r.time_s,
                 "count": r.count}
                for r in self.redistributions
            ],
            "estimated_step_time_s": self.estimated_step_time_s,
            "compute_time_s": self.compute_time_s,
            "comm_time_s": self.comm_time_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_limit_bytes": self.memory_limit_bytes,
            "fallbacks": list(self.fallbacks),
            "solver": self.solver,
            "bucket_bytes": self.bucket_bytes,
            "graph_hash": self.graph_hash,
            "torch_version": self.torch_version,
            "meshplan_version": self.meshplan_version,
        }
        if self.sharded_alternatives is not None:   # absent otherwise: older plans hash alike
            body["sharded_alternatives"] = self.sharded_alternatives.to_dict()
        if self.recompute is not None:
            body["recompute"] = {"policy": self.recompute[0], "layers": list(self.recompute[1])}
        text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
        return {"format": FORMAT, "version": VERSION,
                "sha256": hashlib.sha256(text.encode()).hexdigest(), "body": body}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def save(self, path: str | os.PathLike[str]) -> None:
        atomic_write_text(path, self.to_json())

    @staticmethod
    def from_json(text: str, where: str = "plan") -> Plan:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"{where} is not a meshplan plan (not JSON: {e})") from None
        if isinstance(d, dict) and d.get("format") == "meshplan.pipeline-plan":
            raise PlanError(f"{where} is a pipeline plan (a 'pp' mesh axis): read it with "
                            "PipelinePlan.load; `meshplan run --plan`, `meshplan plan show` "
                            "and distribute(mesh={'pp': ...}, plan=) take it; `plan diff` "
                            "and `plan explain` do not read one yet")
        body = checked_body(d, where, FORMAT, VERSION, "plan", "--mesh dp=2")
        try:
            return _plan_from_body(body)
        except (KeyError, TypeError, ValueError, IRError) as e:
            raise PlanError(f"{where} is corrupt ({type(e).__name__}: {e})") from None

    @staticmethod
    def load(path: str | os.PathLike[str]) -> Plan:
        return Plan.from_json(read_text(path, "plan", PlanError), where=os.fspath(path))

    def summary(self, width: int = 100) -> str:
        from ._summary import render_summary

        return render_summary(self, width)

    def __repr__(self) -> str:
        return (f"Plan({self.strategy}, mesh {self.mesh}, {self.estimated_step_time_s * 1e3:.3f} "
                f"ms/step, peak {self.peak_memory_bytes / 2**30:.2f} GiB, fits={self.fits})")


def _enc(layout: Layout | None) -> list[str] | None:
    return None if layout is None else [str(p) for p in layout]


def _dec(v: list[str] | None) -> Layout | None:
    return None if v is None else tuple(parse_placement(p) for p in v)


def body_hash(body: Any) -> str:
    """The ``sha256`` a plan file keeps of its body (canonical JSON)."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def checked_body(d: Any, where: str, fmt: str, version: int, what: str,
                 mesh_example: str) -> dict[str, Any]:
    """The body of a plan file's JSON ``d`` (format ``fmt``, ``version``, a content hash), or
    one ``PlanError`` naming the file and what to do."""
    if not isinstance(d, dict) or d.get("format") != fmt:
        raise PlanError(f"{where} is not a meshplan {what}; make one with `meshplan compile "
                        f"FILE.py:STEP {mesh_example} -o step.plan`")
    if d.get("version") != version:
        raise PlanError(f"{where} has {what} format version {d.get('version')!r}; this "
                        f"meshplan reads version {version}: compile the plan again")
    body = d.get("body")
    if not isinstance(body, dict) or body_hash(body) != d.get("sha256"):
        raise PlanError(f"{where} does not match its content hash: the file was modified "
                        "or damaged; compile the plan again")
    return body


def _plan_from_body(b: dict[str, Any]) -> Plan:
    mesh = Mesh(tuple((a, int(n)) for a, n in b["mesh"]["axes"]),
                Topology.from_dict(b["mesh"]["topology"]))
    return Plan(
        mesh=mesh,
        strategy=b["strategy"],
        graph=graph_from_dict(b["graph"]),
        placements=tuple(
            NodePlacement(p["node"], p["target"], tuple(_dec(l) for l in p["inputs"]),
                          tuple(_dec(l) for l in p["outputs"]), float(p["compute_s"]))
            for p in b["placements"]
        ),
        redistributions=tuple(
            Redistribution(r["value"], r["consumer"], _dec(r["src"]), _dec(r["dst"]),
                           tuple((c[0], c[1], int(c[2])) for c in r["collectives"]),
                           float(r["time_s"]), int(r["count"]))
            for r in b["redistributions"]
        ),
        estimated_step_time_s=float(b["estimated_step_time_s"]),
        compute_time_s=float(b["compute_time_s"]),
        comm_time_s=float(b["comm_time_s"]),
        peak_memory_bytes=int(b["peak_memory_bytes"]),
        memory_limit_bytes=int(b["memory_limit_bytes"]),
        fallbacks=tuple(b["fallbacks"]),
        solver=dict(b["solver"]),
        bucket_bytes=None if b.get("bucket_bytes") is None else int(b["bucket_bytes"]),
        torch_version=b.get("torch_version"),
        meshplan_version=b.get("meshplan_version"),
        sharded_alternatives=(None if b.get("sharded_alternatives") is None
                              else ShardedAlternatives.from_dict(b["sharded_alternatives"])),
        recompute=(None if b.get("recompute") is None
                   else (str(b["recompute"]["policy"]),
                         tuple(str(k) for k in b["recompute"]["layers"]))),
    )


def graph_hash(graph: Graph) -> str:
    """sha256 of ``graph`` as canonical JSON (sorted keys), without where its ops were
    written (file, line, code): a comment added above the step, or the step's file moved,
    runs the same ops, and a compiled plan stays good for it."""
    d = graph_to_dict(graph)
    d["info"] = {**d["info"], "source": None}
    d["nodes"] = [{**n, "source": None} for n in d["nodes"]]
    text = json.dumps(d, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _meshplan_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("meshplan")
    except PackageNotFoundError:
        return None


def _major_minor(v: str) -> tuple[str, ...]:
    return tuple(v.split("+")[0].split(".")[:2])


def _axes_str(axes: tuple[tuple[str, int], ...]) -> str:
    return ",".join(f"{a}={n}" for a, n in axes)


def layout_str(layout: Layout | None) -> str:
    return "-" if layout is None else format_layout(layout)
