"""The runtime's side of telemetry: what the controller and every worker record, as rows of the
tables in ``telemetry/SCHEMA.md``.

The controller (rank -1) records the run, the plan's estimates (``plan_nodes``,
``plan_collectives``), its own view of each step (split, send, wait for every rank: the
controller's overhead is its ``dur_us`` minus the ranks'), and the failures it sees (a rank that
exits or stops answering cannot record its own). Each worker records its rank, and per step its
time, loss, every collective (tagged with the IR value and the consumer the plan priced it for),
sampled op timings and memory.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..backends import CommRecord, rank_coords
from ..backends._live import Counter
from ..backends._lower import Bucket, Reshard
from ..ir import Node
from ..planner import Plan
from ..planner._calibrate import node_work
from ..planner._kernel_cost import fused_kernel_of
from ..planner._comm import Collective, collective_time
from ..planner._plan import layout_str
from ..planner._planning import reduction_buckets
from ..telemetry import Level, Recorder, TelemetryConfig, now_us
from ..telemetry._recorder import rank_dir

logger = logging.getLogger(__name__)

BUCKET = "<bucket>"      # the value of a bucketed all-reduce's row (it serves many values)
VOTE, COMMIT = "<vote>", "<commit>"   # the step's all-or-nothing vote (backends/_lower.py)
VOTE_BYTES = 8


# ---- the controller ----------------------------------------------------------------------------

class ControllerTelemetry:
    """Rows the controller writes for one run."""

    def __init__(self, config: TelemetryConfig, run_id: str, plan: Plan, *, step_name: str,
                 strategy: str, mesh: Any = None) -> None:
        """``mesh``: the run's whole mesh when it is not ``plan``'s (a pipeline's, whose
        ``plan`` is every stage's)."""
        self.config, self.run_id = config, run_id
        self.rec = Recorder(config.segments, run_id, -1, level=config.level,
                            flush_interval_s=config.flush_interval_s, live_rows=config.live_rows)
        mesh = plan.mesh if mesh is None else mesh
        self.rec.add("runs", (
            now_us(), step_name, json.dumps(dict(mesh.axes)), mesh.size, strategy,
            mesh.topology.name, plan.graph_hash, plan.estimated_step_time_s * 1e6,
            int(plan.peak_memory_bytes), config.level.name.lower(), socket.gethostname(),
            os.getpid(), plan.meshplan_version, plan.torch_version))
        self.rec.add_many("plan_nodes", plan_node_rows(plan))
        self.rec.add_many("plan_collectives", plan_collective_rows(plan))
        self.rec.flush()         # the run's description survives whatever happens next

    def step(self, step: int, start_us: int, dur_us: int, results: Sequence[Any]) -> None:
        """The controller's view of one step; the loss is read from the results as the
        ranks read it."""
        self.rec.add("steps", (step, start_us, dur_us, _loss(results), None, None, None))

    def failure(self, exc: BaseException, step: int | None) -> None:
        ranks = getattr(exc, "ranks", ()) or (-1,)
        kind = getattr(exc, "reason", "error")
        tb = getattr(exc, "remote_traceback", None)
        for rank in ranks:
            self.rec.add("failures", (now_us(), step, kind, str(exc), getattr(exc, "where", None),
                                      tb), rank=rank)
        stacks = getattr(exc, "stacks", None)
        if stacks:                        # where every rank was when it failed (a timeout)
            self.stacks(stacks, step, kind)
        self.rec.flush()

    def stacks(self, stacks: Mapping[int, Mapping[str, Any]], step: int | None,
               reason: str) -> None:
        """Every rank's stacks (``Workers.stacks``), one row per rank that answered."""
        t = now_us()
        for rank, got in sorted(stacks.items()):
            self.rec.add("stacks", (t, step, reason, got.get("doing"), got.get("frame"),
                                    got.get("text")), rank=rank)
        self.rec.flush()

    def snapshot_lost(self, rank: int, step: int, why: str) -> None:
        """Rank ``rank``'s snapshot copy of ``step`` failed; the run went on."""
        self.rec.add("failures", (now_us(), step, "snapshot", why, None, None), rank=rank)

    def recovery(self, failure: BaseException, *, step: int | None, restart: int,
                 restored: int, replayed: int, took_s: float, plan: Plan) -> None:
        """The mesh is running again after ``failure`` (``distribute(fault_tolerance=True)``),
        on ``plan`` (another mesh's after a shrink, ``elastic=``)."""
        ranks = ",".join(map(str, getattr(failure, "ranks", ()) or ()))
        mesh = plan.mesh
        self.rec.add("recoveries", (now_us(), step, ranks, getattr(failure, "reason", "error"),
                                    restart, restored, replayed, int(took_s * 1e6),
                                    json.dumps(dict(mesh.axes)), mesh.size, plan.strategy,
                                    plan.estimated_step_time_s * 1e6))
        self.rec.flush()

    def close(self) -> None:
        self.rec.close()


def plan_node_rows(plan: Plan) -> list[tuple]:
    """One row per placed node: where it came from, its layouts, the cost model's time and the
    work behind it (one rank's FLOPs and bytes, the dtype it was priced at), which
    ``meshplan calibrate --from-telemetry`` fits compute rates to."""
    graph = plan.graph
    kernel_of = fused_kernel_of(graph, plan.mesh.topology)
    rows = []
    for p in plan.placements:
        n = graph.node(p.node)
        flops, nbytes, dtype = node_work(graph, p, plan.mesh)
        rows.append((p.node, p.target, n.kind.value, n.phase.value, n.module_path,
                     f"{n.source.file}:{n.source.line}" if n.source else None,
                     " ".join(layout_str(x) for x in p.inputs),
                     " ".join(layout_str(x) for x in p.outputs), p.compute_s * 1e6,
                     flops, nbytes, dtype, kernel_of.get(p.node)))
    return rows


def plan_collective_rows(plan: Plan) -> list[tuple]:
    """One row per collective of each redistribution the plan priced, with the cost model's
    time for that one collective; an all-reduce the lowering merges into a bucket also names
    its bucket (numbered per step; the plan prices one call per bucket) and whether the cost
    model lets the bucket's wire time run under compute."""
    mesh = plan.mesh
    in_bucket = {i: (k, int(b.overlaps))
                 for k, b in enumerate(reduction_buckets(plan.graph, mesh, plan.redistributions,
                                                         plan.bucket_bytes))
                 for i in b.members}
    rows = []
    for i, r in enumerate(plan.redistributions):
        bucket, overlaps = in_bucket.get(i, (None, None))
        for seq, (kind, axis, nbytes) in enumerate(r.collectives):
            a = mesh.index(axis)
            n = mesh.sizes[a]
            est = collective_time(Collective(kind), nbytes, n, mesh.link(a)) * 1e6
            rows.append((r.value, r.consumer, seq, kind, axis, n, int(nbytes), est, bucket,
                         overlaps))
    world = math.prod(mesh.sizes)
    if world > 1:           # the step's vote (backends/_lower.py), priced on the slowest axis
        axes = [a for a, n in enumerate(mesh.sizes) if n > 1]
        est = max(collective_time(Collective.ALL_REDUCE, VOTE_BYTES, world, mesh.link(a))
                  for a in axes) * 1e6
        rows.append((VOTE, COMMIT, 0, Collective.ALL_REDUCE.value,
                     "+".join(mesh.names[a] for a in axes), world, VOTE_BYTES, est, None, None))
    return rows


# ---- a worker ----------------------------------------------------------------------------------

class WorkerTelemetry:
    """A rank's recorder and the ``RunObserver`` its program runs with (see ``backends.run``)."""

    def __init__(self, config: TelemetryConfig, run_id: str, rank: int, plan: Plan,
                 device: str) -> None:
        self.config = config
        # journaled: a rank SIGKILLed (mpiexec ends every rank once one dies) keeps its steps
        self.rec = Recorder(config.segments, run_id, rank, level=config.level,
                            flush_interval_s=config.flush_interval_s, live_rows=config.live_rows,
                            journal=True)
        # a rank started again (fault tolerance): its killed predecessor's journal becomes
        # segments here, which ship with this rank's when the controller cannot see them
        from ..telemetry._recorder import recover_journals

        try:
            recover_journals(self.rec.dir.parent, gone_here=True, ranks=self.rec.dir.name)
        except OSError as exc:
            logger.warning("telemetry: could not read an earlier process's journal: %s", exc)
        self.sizes = plan.mesh.sizes
        self.names = plan.mesh.names
        self.coords = rank_coords(rank, self.sizes)
        self.device = device
        self.step = -1
        self.time_ops = False
        self.track_memory = False
        self._live: Counter | None = None
        self._axes: dict[tuple[int, ...], str] = {}
        self._reshards: list[tuple[int, int, str, str]] = []
        self._ops: list[tuple[str, str, float, float]] = []
        coords = ",".join(f"{a}={c}" for a, c in zip(self.names, self.coords))
        self.rec.add("ranks", (socket.gethostname(), os.getpid(), coords, device, now_us()))
        self._shipped: set[str] = set()

    # shipping to a controller that does not see this rank's folder (runtime/_distributed.py)
    def mark_folder(self) -> str:
        """Leave a file in this rank's segment folder whose name the controller looks for at
        its own path of that folder: found, they share the disk; not, it fetches segments."""
        import secrets

        name = f".here-{secrets.token_hex(8)}"
        (self.rec.dir / name).touch()
        return name

    def unshipped(self, limit: int) -> tuple[list[str], list[bytes], bool]:
        """Flush, then the names and bytes of finished segments not shipped yet, up to
        ``limit`` bytes (at least one file), and whether others wait for the next call. The
        copies stay here: this rank's own record."""
        if not self._shipped:            # asked: the controller did not see the marker
            for marker in self.rec.dir.glob(".here-*"):
                marker.unlink(missing_ok=True)
        self.rec.flush()
        names, files, size = [], [], 0
        for path in sorted(self.rec.dir.glob("*.parquet")):
            if path.name in self._shipped:
                continue
            data = path.read_bytes()
            if files and size + len(data) > limit:
                return names, files, True
            self._shipped.add(path.name)
            if data:
                names.append(path.name)
                files.append(data)
                size += len(data)
        return names, files, False

    # RunObserver
    def reshard(self, ins: Reshard | Bucket, first: int, last: int) -> None:
        if last <= first:
            return
        if isinstance(ins, Bucket) and len(ins.members) > 1:
            self._reshards.append((first, last, BUCKET, f"<{len(ins.members)} values>"))
        elif isinstance(ins, Bucket):          # a lone value started early: its own row
            m = ins.members[0]
            self._reshards.append((first, last, m.ref.label, m.consumer))
        else:
            self._reshards.append((first, last, ins.ref.label, ins.consumer))

    def vote(self, first: int, last: int) -> None:
        if last > first:
            self._reshards.append((first, last, VOTE, COMMIT))

    def memory(self) -> Counter:
        assert self._live is not None
        return self._live

    def compute(self, node: Node, start_s: float, dur_s: float) -> None:
        self._ops.append((node.name, node.target, start_s, dur_s))

    def begin(self, step: int) -> None:
        self.step = step
        self._reshards.clear()
        self._ops.clear()
        # level ops: every ops_every-th step times its ops and counts its tensor memory; the
        # first ops_first steps (a calibration's) time their ops but do not count memory, so
        # the counting does not slow the steps the fit measures
        sampled = self.rec.wants(Level.OPS) and step % self.config.ops_every == 0
        self.time_ops = sampled or (self.rec.wants(Level.OPS) and step < self.config.ops_first)
        self.track_memory = sampled
        self._live = Counter() if sampled else None
        if self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        else:
            _reset_peak_rss()

    def end(self, records: Sequence[CommRecord], start_us: int, perf0: float, dur_us: int,
            results: Sequence[Any], state: Mapping[str, torch.Tensor]) -> None:
        step = self.step
        comm_us = _busy_us(records)
        comm_bytes = sum(r.nbytes for r in records)
        self.rec.add("steps", (step, start_us, dur_us, _loss(results), comm_us, comm_bytes,
                               len(records)))
        if self.rec.wants(Level.COLLECTIVES) and records:
            self.rec.add_many("collectives", self._collective_rows(records))
        if self._ops:
            self.rec.add_many("ops", [
                (step, seq, name, target, start_us + int((t0 - perf0) * 1e6), int(d * 1e6))
                for seq, (name, target, t0, d) in enumerate(self._ops)])
        self.rec.add("memory", (step, self.device, *_memory(self.device, state),
                                self._live.peak if self._live is not None else None))
        self.rec.journal_soon()

    def failure(self, exc: BaseException, tb: str) -> None:
        self.rec.add("failures", (now_us(), self.step, "error", f"{type(exc).__name__}: {exc}",
                                  getattr(exc, "meshplan_where", None), tb))
        self.rec.flush()

    def close(self) -> None:
        self.rec.close()

    def _collective_rows(self, records: Sequence[CommRecord]) -> list[tuple]:
        owner: list[tuple[str | None, str | None]] = [(None, None)] * len(records)
        for first, last, value, consumer in self._reshards:
            for i in range(first, min(last, len(records))):
                owner[i] = (value, consumer)
        return [(self.step, seq, r.kind.value, self._axis(r.group), len(r.group), r.nbytes,
                 int(r.start_s * 1e6), int(r.dur_s * 1e6), *owner[seq])
                for seq, r in enumerate(records)]

    def _axis(self, group: tuple[int, ...]) -> str:
        """The mesh axes along which the group's ranks differ (``dp``, ``tp``, ``dp+tp``)."""
        name = self._axes.get(group)
        if name is None:
            coords = [rank_coords(r, self.sizes) for r in group]
            name = "+".join(a for i, a in enumerate(self.names)
                            if len({c[i] for c in coords}) > 1) or "-"
            self._axes[group] = name
        return name


def _loss(results: Sequence[Any]) -> float | None:
    for r in results:
        if isinstance(r, torch.Tensor) and r.ndim == 0 and r.is_floating_point():
            return float(r)
    return None


def _busy_us(records: Sequence[CommRecord]) -> int:
    """Microseconds with at least one of ``records`` in flight: the union of their intervals,
    so that bucketed all-reduces overlapping one another count once (their sum exceeded the
    step's own duration on a loaded machine)."""
    busy, end = 0.0, float("-inf")
    for r in sorted(records, key=lambda r: r.start_s):
        stop = r.start_s + r.dur_s
        if stop > end:
            busy += stop - max(r.start_s, end)
            end = stop
    return round(busy * 1e6)


def _reset_peak_rss() -> None:
    """Start the process's peak-RSS count (``VmHWM``) afresh (Linux >= 4.0); else a no-op."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _rss() -> tuple[int, int]:
    """(RSS, peak RSS since the last reset) of this process in bytes."""
    rss = hwm = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("VmHWM:"):
                    hwm = int(line.split()[1]) * 1024
    except OSError:       # not Linux: the lifetime peak (which, on Linux, would include the
        import resource   # parent's peak from before exec)
        hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        hwm *= 1 if sys.platform == "darwin" else 1024
        rss = hwm
    return rss, max(hwm, rss)


def _memory(device: str, state: Mapping[str, torch.Tensor]) -> tuple[int, int, int]:
    """(state bytes, allocated, peak within the step): the CUDA allocator's numbers, or on CPU
    the process's RSS and its peak RSS since the step began."""
    state_bytes = sum(t.numel() * t.element_size() for t in state.values()
                      if isinstance(t, torch.Tensor))
    if device.startswith("cuda"):
        return state_bytes, torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    rss, peak = _rss()
    return state_bytes, rss, peak


def state_device(state: Mapping[str, torch.Tensor]) -> str:
    for t in state.values():
        if isinstance(t, torch.Tensor):
            return str(t.device) if t.device.type != "cuda" else f"cuda:{t.device.index or 0}"
    return "cpu"


def steps_timer() -> tuple[int, float]:
    """(wall-clock µs, perf_counter) at the start of a step."""
    return now_us(), time.perf_counter()





@dataclass(frozen=True)
class QueryResult:
    """A live query's answer: every answering rank's rows in one Arrow table (``table``),
    the ranks that did not answer in time (``missing``) and those whose query failed
    (``errors``: rank -> message)."""

    table: Any                     # pyarrow.Table
    missing: tuple[int, ...] = ()
    errors: dict[int, str] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return not self.missing and not self.errors


# Recorder._write's names (``-j<journal>-`` where it journals), and a journal's recovered
_SEGMENT_NAME = re.compile(r"^[a-z_]+-\d+-(j\d+-)?(\d+|journal)\.parquet$")


class SegmentShipper:
    """The controller's side of shipping: which ranks write their segments on a disk it does
    not see (their marker file is not at its own path of their folder), and writing what
    they send into its folder, as the Recorder would have (atomically, under the same name)."""

    def __init__(self, config: TelemetryConfig, run_id: str,
                 markers: Sequence[str | None]) -> None:
        self.config, self.run_id = config, run_id
        self.ranks: list[int] = []
        for rank, marker in enumerate(markers):
            if not marker or not _SEGMENT_MARKER.match(marker):
                continue
            seen = config.segments / run_id / rank_dir(rank) / marker
            if seen.exists():
                seen.unlink()
            else:
                self.ranks.append(rank)
        self.shipped_at = time.monotonic()

    def write(self, rank: int, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
        folder = self.config.segments / self.run_id / rank_dir(rank)
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in zip(names, tensors):
            if not _SEGMENT_NAME.match(str(name)):
                raise ValueError(f"rank {rank} shipped a telemetry segment named {name!r}")
            tmp = folder / f".{name}.tmp"            # as Recorder._write names its own
            tmp.write_bytes(data.numpy().tobytes())
            os.replace(tmp, folder / name)


_SEGMENT_MARKER = re.compile(r"^\.here-[0-9a-f]{16}$")


def ingest(config: TelemetryConfig | None, run_id: str | None = None) -> None:
    """Load the run's segments into the DuckDB store, best effort: a store another process
    holds open is left for later (``meshplan telemetry ingest``); the segments stay either way.
    ``run_id``: its processes have all ended: first turn the journals of those killed before
    their last flush into segments (``telemetry._recorder.recover_journals``)."""
    if config is None:
        return
    from .._errors import TelemetryError
    from ..telemetry import Store
    from ..telemetry._recorder import recover_journals

    if run_id is not None:
        try:
            got = recover_journals(config.segments / run_id)
        except OSError as exc:
            logger.warning("meshplan: could not read the ranks' telemetry journals: %s", exc)
        else:
            if got:
                logger.info("meshplan: %d telemetry rows recovered from the journals of "
                            "ranks killed before their last flush", got)

    from ..telemetry._store import DatabaseLocked

    try:
        with Store.open(config.db, if_locked="raise") as store:
            logger.info("meshplan: telemetry in %s", store.source)
    except DatabaseLocked as exc:
        logger.warning("meshplan: this run's telemetry stays in its segments (%s) for now: the "
                       "database %s is open in another process%s (meshplan serve, top or "
                       "telemetry sql, which load them as they read); whoever opens it next "
                       "loads them, or run meshplan telemetry ingest", config.segments,
                       config.db, f", PID {exc.holder}" if exc.holder else "")
    except TelemetryError as exc:
        logger.warning("meshplan: telemetry not loaded into %s yet (%s); its segments are "
                       "in %s", config.db, exc, config.segments)


def merge_answers(result: Any, sql: str) -> Any:
    """``sql`` over the workers' concatenated answers (the table ``result``), in DuckDB, on a
    connection that cannot read or write files nor load extensions (``telemetry/_sandbox.py``)."""
    import duckdb

    from .._errors import TelemetryError
    from ..telemetry._sandbox import connect

    con = connect()
    try:
        con.register("result", result)
        return con.sql(sql).to_arrow_table()
    except duckdb.Error as exc:
        raise TelemetryError(f"the merge query failed: {exc}") from None
    finally:
        con.close()


__all__ = ["ControllerTelemetry", "QueryResult", "WorkerTelemetry", "ingest", "merge_answers",
           "plan_collective_rows", "plan_node_rows", "state_device", "steps_timer"]
