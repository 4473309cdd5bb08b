"""``meshplan.distribute``: the user's step, run by one controller on a process mesh.

The first call traces the step (``meshplan.trace``), plans it (or loads ``plan=PATH``), starts
the workers, and ships each rank the plan and only its own pieces of the state. Every call then
splits the batch as the plan lays out the data inputs, runs one step on every rank and returns
the results as ordinary tensors on the controller.

Before the optimizer holds state, the controller gives it the zeros its first step would
create (Adam, AdamW, SGD without dampening: the steady step from them IS the first step), so
the mesh runs from the first call. Other optimizers take their first step on the controller
through the traced first-step graph, exactly as one process would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import tempfile
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .._errors import LoweringError, MeshplanError, PlanError, RuntimeFailure
from ..backends import assemble, holds_zeros, local_slices, rank_coords, split_inputs
from ..backends._microbatch import (check_microbatched, check_microbatches, microbatch_plan,
                                    split_microbatched)
from ..backends._pipeline_run import RUNS, STAGE_TRANSFERS, Stages, lower_pipeline
from ..frontend import trace
from ..frontend._precision import check as check_precision
from ..frontend._precision import precision as precision_policy
from ..ir import RANDOM_SEMANTICS, STATE_ROLES, Role
from ..planner import Plan, check_recompute, plan_graph
from ..planner._pipeline import POST, PP_AXIS, PRE, PipelinePlan, plan_pipeline
from ..planner._summary import format_bytes
from ..telemetry import Level, TelemetryConfig
from ._checks import check_indices
from ._files import FILES_PLUGIN
from ._k8s import K8sOptions
from ._k8s_launch import K8sLauncher, K8sPods
from ._live import LiveEndpoint
from . import _zygote
from ._launch import (STOPPED_S, LocalLauncher, StepFailed, WorkerFailure, Workers,
                      install_stack_signal, where_lines)
from ._logs import Stacks, launching
from ._keepers import KEEPER_PLUGIN, MeshSnapshots
from ._mpi_launch import MPILauncher, host_slots, is_this_host, parse_hosts
from ._recovery import RECOVERABLE, Recovery, Remembered, smaller_meshes
from ._slurm_launch import Allocation, SlurmLauncher, SlurmOptions, slurm_nodes
from ._snapshot import read_mesh
from ._telemetry import (
    ControllerTelemetry,
    QueryResult,
    SegmentShipper,
    ingest,
    merge_answers,
    steps_timer,
)
from ._variants import MAX_VARIANTS, Variant, call_inputs, what_changed

logger = logging.getLogger(__name__)

LAUNCHERS = ("local", "mpi", "slurm", "k8s")
SHIP_EVERY_S = 10.0     # how often ranks on a disk this host does not see send their segments
_SYNC_S = 5.0           # how long survivors of a failure may take to leave their step

_HANDLERS = "meshplan.runtime._handlers"


class DistributedStep:
    """A training step bound to a mesh; see ``distribute``."""

    def __init__(self, fn: Callable[..., Any], *, mesh: Mapping[str, int], launcher: str,
                 topology: Any, strategy: str, plan: str | Plan | None,
                 example_inputs: Any, memory_limit_bytes: int | None, timeout_s: float,
                 telemetry: Any = None, kernels: bool | None = None,
                 checkpoint: str | os.PathLike | None = None, seed: int | None = None,
                 precision: str | None = None, recompute: Any = "auto",
                 calibrate: bool | int = False, hosts: Any = None, slurm: Any = None,
                 device: str | None = None, fault_tolerance: bool | None = None,
                 max_restarts: int = 3, snapshot_every: int = 1,
                 hang_s: float = STOPPED_S, elastic: bool | int = False,
                 k8s: Any = None, microbatches: int | None = None,
                 schedule: str | None = None) -> None:
        if launcher not in LAUNCHERS:
            raise RuntimeFailure(f"launcher {launcher!r} is not available; use one of "
                                 f"{', '.join(map(repr, LAUNCHERS))}")
        if hosts is not None and launcher != "mpi":
            where = ("launcher='slurm' runs the ranks on the Slurm allocation's nodes"
                     if launcher == "slurm" else
                     f"launcher={launcher!r} runs every rank on this host")
            raise RuntimeFailure(f"hosts= places ranks under launcher='mpi'; {where} (drop "
                                 "hosts=, or pass launcher='mpi')")
        if k8s is not None and launcher != "k8s":
            raise RuntimeFailure(f"k8s= sets the Kubernetes launcher's options; launcher="
                                 f"{launcher!r} does not use Kubernetes (pass launcher='k8s', "
                                 "or drop k8s=)")
        if launcher == "k8s" and k8s is None:
            raise RuntimeFailure("launcher='k8s' needs k8s={'image': ...}: the container "
                                 "image the pods run, and how many (README, \"Kubernetes\")")
        if slurm is not None and launcher != "slurm":
            raise RuntimeFailure(f"slurm= sets the Slurm launcher's options; launcher="
                                 f"{launcher!r} does not use Slurm (pass launcher='slurm', or "
                                 "drop slurm=)")
        self.launcher, self.hosts = launcher, hosts
        self.hang_s = _positive("hang_s", hang_s)
        self.k8s = K8sOptions.parse(k8s) if launcher == "k8s" else None
        if self.k8s is not None and device is None:    # the pods' GPUs, not this host's
            device = "cuda" if self.k8s.gpus_per_pod else "cpu"
        self.device, self._device_note = resolve_device(device, launcher)
        # None: on where it was measured to cost under 3 % (_fault_tolerance_default)
        self._ft_asked = fault_tolerance
        # a pp axis: pipeline stages (backends/_pipeline_run.py), planned by plan_pipeline
        self._pp = dict(mesh).get(PP_AXIS, 1) > 1
        if self._pp:
            _refuse_in_pipeline(mesh, fault_tolerance=fault_tolerance, elastic=elastic,
                                calibrate=calibrate)
            plan = _pipeline_plan_arg(plan, mesh)
            fault_tolerance, self._ft_note = False, PP_FT_OFF
        elif isinstance(plan, PipelinePlan):
            raise RuntimeFailure(
                f"distribute(plan=...) on mesh {_mesh_text(mesh)}: the plan is a pipeline's, "
                f"for mesh {_mesh_text(dict(plan.mesh.axes))}; pass that mesh (with its "
                f"'{PP_AXIS}' axis), or a plan of this mesh")
        else:
            fault_tolerance, self._ft_note = _fault_tolerance_default(
                fault_tolerance, elastic, launcher, self.device)
        # on by the default alone: the first launch may still turn it off (memory)
        self._ft_auto = self._ft_note == AUTO_ON
        self._ft = _fault_tolerance(fault_tolerance, launcher, max_restarts,
                                    snapshot_every, self.hang_s, elastic)
        self.slurm = SlurmOptions.parse(slurm) if launcher == "slurm" else None
        # under fault tolerance, the Slurm allocation every launch of the run uses (restarted
        # ranks go back to their nodes, where their snapshots are); given back at shutdown
        self._allocation: Allocation | None = None
        # under fault tolerance, the pods every launch of the run uses (their agents keep
        # the snapshots and start the ranks); deleted at shutdown
        self._pods: K8sPods | None = None
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.mesh = dict(mesh)
        try:
            self.microbatches = 1 if microbatches is None else check_microbatches(microbatches)
        except PlanError as e:
            raise RuntimeFailure(f"distribute({e})") from None
        # with a pp axis: the stages' number of micro-batches, the planner's when not given
        self._mb_asked = microbatches
        if schedule is not None and (not self._pp or schedule not in RUNS):
            why = (f"the stages run {' or '.join(map(repr, RUNS))}" if self._pp else
                   f"a schedule is for a mesh with a '{PP_AXIS}' axis (pipeline stages)")
            raise RuntimeFailure(f"distribute(schedule={schedule!r}): {why}")
        self._schedule = schedule
        self._pipeline: PipelinePlan | None = None
        self._stages: Stages | None = None
        if self.microbatches > 1 and calibrate:
            raise RuntimeFailure(
                f"distribute(microbatches={self.microbatches}, calibrate={calibrate!r}): the "
                "calibration fits the cost model to whole-batch op times, and in micro-batches "
                "the ops run on parts; calibrate a run without microbatches= (or with "
                "`meshplan calibrate --from-telemetry` on one), then pass its topology")
        # each plan's micro-batch plan (backends/_microbatch.py), by the plan's id
        self._mb_plans: dict[int, tuple[Plan, Plan]] = {}
        self._plan_texts: dict[int, tuple[Plan, str, str]] = {}
        self.topology = topology or (gpu_topology() if self.device == "cuda" else "cpu")
        self.strategy = strategy
        check_precision(precision)
        self.precision = precision
        check_recompute(recompute)
        self.recompute = recompute
        self.example_inputs = example_inputs
        self.memory_limit_bytes = memory_limit_bytes
        self.timeout_s = timeout_s
        # None: whatever the registry says (MESHPLAN_KERNELS); False: the plan's ops only
        from ..kernels import kernels_enabled
        self.kernels = kernels_enabled() if kernels is None else bool(kernels)
        self._plan_arg = plan
        self._plan: Plan | None = None
        self._stage_owners: dict[str, int] | None = None
        self._traced = None
        self._workers: Workers | None = None
        self.last_comm: list[list[dict[str, Any]]] = []
        self.telemetry: TelemetryConfig | None = TelemetryConfig.resolve(telemetry)
        self._tel: ControllerTelemetry | None = None
        self._live: LiveEndpoint | None = None     # for meshplan serve (runtime/_live.py)
        self._shipper: SegmentShipper | None = None
        self._step_no = 0
        if seed is not None and not isinstance(seed, int):
            raise RuntimeFailure(f"distribute(seed={seed!r}): the seed must be an int or None")
        self._seed: int | None = seed       # random ops' run seed; None: drawn when first needed
        self._random_said = False
        # the running mesh's programs, by what their graph is specialised on (call_key)
        self._variants: dict[tuple, Variant] = {}
        self._primary_key: tuple | None = None
        # a checkpoint to apply once the step is traced: (path, push)
        self._pending_checkpoint: tuple[str, bool | None] | None = None
        # the checkpoint the live state came from, for the launch: (path, names, push, stamp)
        self._launch_from: tuple[str, list[str], bool | None, tuple] | None = None
        # distribute(calibrate=): mesh steps left before the cost model is fitted to them
        self._calibrate_left = _calibration_steps(calibrate, self.telemetry, plan)
        self._watched: set[str] = set()     # plan nodes whose values the ranks keep (watch)
        # the mesh's state differs from the live model on this process (steps ran on it since
        # the last sync()): after shutdown() that state is gone (transfer refuses to read it)
        self._local_stale = False
        self._resume_step = 0               # the step number a re-launch continues from
        self.calibration: RunCalibration | None = None
        if isinstance(plan, PipelinePlan):   # its options against these, before any trace
            self._check_pipeline_options(plan)
        if checkpoint is not None:
            self.load_checkpoint(checkpoint)

    # ---- the public surface --------------------------------------------------------------------

    @property
    def plan(self) -> Plan:
        if self._plan is None:
            if self.example_inputs is None:
                raise RuntimeFailure(f"{self.__name__}: no plan yet; call the step once or pass "
                                     "example_inputs= to distribute")
            ex = self.example_inputs() if callable(self.example_inputs) else self.example_inputs
            self._prepare(tuple(ex))
        assert self._plan is not None
        return self._plan

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._traced is None:
            if self.launcher == "local" and self.device == "cpu":
                _zygote.prestart()        # its imports overlap the tracing and planning
            self._prepare(args, kwargs)
        if self._pending_checkpoint is not None:
            path, push = self._pending_checkpoint
            self._pending_checkpoint = None
            self._apply_checkpoint(path, push)
        traced = self._traced
        if not self._has_opt_state() and not self._zero_state():
            logger.info("meshplan: first step (creates optimizer state) runs on the controller")
            self._launch_from = None          # the mesh starts from the state this step makes
            return traced(*args, **kwargs)
        if self._workers is None:
            self._launch()
        if self._variants:          # before a new signature is traced and planned for it
            first = next(iter(self._variants.values()))       # id 0
            names = [n.target for n in first.plan.graph.inputs_with_role(Role.DATA)]
            check_indices(first.checks, dict(zip(names, traced.data_tensors(*args, **kwargs))),
                          self.__name__)
        out = self._step(self._variant(args, kwargs), args, kwargs)
        self._local_stale = True
        if self._calibrate_left:
            self._calibrate_left -= 1
            if not self._calibrate_left:
                self._recalibrate()
        return out

    @property
    def pipeline(self) -> PipelinePlan | None:
        """With a ``pp`` axis in the mesh: the pipeline plan (``planner.plan_pipeline``: the
        stage split, schedule, micro-batches and their estimates); ``plan`` is then every
        stage's layouts on the other axes. None without a ``pp`` axis."""
        self.plan
        return self._pipeline

    @property
    def seed(self) -> int | None:
        """The run's seed for random ops (README, "Random ops on a mesh"): ``distribute(seed=)``,
        else drawn from the controller's CPU generator (``torch.manual_seed`` before the run
        fixes it) at the first mesh step whose program has random ops; None until then."""
        return self._seed

    @property
    def variants(self) -> int:
        """How many input signatures the running mesh holds a program for (``MAX_VARIANTS``
        at most): the first call's, and one more for each call whose arguments' shapes,
        dtypes or Python values, or whose hyperparameters' zero/non-zero pattern, differed."""
        return len(self._variants)

    def state_dict(self) -> dict[str, Any]:
        """The whole model and optimizer state, gathered from every rank, in torch's formats:
        ``{"model": model.state_dict(), "optim": opt.state_dict()}`` as the step's own module
        and optimizer would return them (several modules: their keys under ``<variable>.``;
        several optimizers: ``{variable: opt.state_dict()}``; ``frontend/_state_dict.py``).
        The tensors are copies; the live model is not changed (``sync()`` does that)."""
        from ..frontend._state_dict import to_torch

        return to_torch(self._traced_or_prepared().inventory, self._named_state())

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Give every rank its pieces of a state dict in the formats ``state_dict()`` returns
        (also the param groups' hyperparameters, as ``opt.load_state_dict`` sets them). A key
        the step lacks or a tensor of another shape is one RuntimeFailure; nothing changes."""
        from .._errors import MeshplanError
        from ..frontend._state_dict import from_torch

        plan = self.plan
        metas = {n.target: n.meta for n in plan.graph.inputs if n.meta.role in STATE_ROLES}
        try:
            values, groups = from_torch(self._traced.inventory, sd, set(metas))
        except MeshplanError as exc:
            raise RuntimeFailure(f"{self.__name__}: {exc}") from None
        for name, v in values.items():
            meta = metas.get(name)
            if meta is None or tuple(v.shape) != tuple(meta.shape):
                want = "not a state tensor of this step" if meta is None else (
                    f"shape {list(meta.shape)} expected")
                raise RuntimeFailure(f"{self.__name__}: load_state_dict: {name} has shape "
                                     f"{list(v.shape)}: {want}")
        for live, saved in groups:
            live.update({k: v for k, v in saved.items() if k != "params"})
        self._put_state(values)

    def _put_state(self, values: Mapping[str, torch.Tensor]) -> None:
        """Whole state tensors (internal names) into the running ranks' pieces, or into the
        live model and optimizer before the mesh runs."""
        if self._workers is None:
            self._write_local(values)
            self._launch_from = None
            return
        with self._recording_failures():
            self._send_state("set_state", values, lambda rank, names: {"names": names})
        self._local_stale = True
        if self._ft is not None:          # every rank's snapshot is this state now
            self._ft.started(self._step_no)

    def _traced_or_prepared(self) -> Any:
        self.plan                          # traces first if only example_inputs were given
        return self._traced

    def _named_state(self, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Every state tensor (parameters, buffers, gradients, optimizer state; ``names``:
        only those) by its graph input name, gathered from every rank while the mesh runs."""
        self.plan
        if self._workers is not None:
            return self._gather_state(names)
        local = self._local_state()
        return local if names is None else {k: local[k] for k in names if k in local}

    def save_checkpoint(self, path: str | os.PathLike) -> str:
        """Write the whole model and optimizer state (``state_dict()``: gathered from every
        rank while the mesh runs) to one safetensors file at ``path``, atomically; returns its
        absolute path. The file does not depend on the mesh: any mesh and plan of the same
        step loads it. Format: ``meshplan/runtime/_checkpoint.py``."""
        from ._checkpoint import save_checkpoint

        values = self._named_state()
        plan = self.plan
        roles = {n.target: n.meta.role.value for n in plan.graph.inputs if n.target in values}
        return save_checkpoint(path, values, roles,
                               {"mesh": dict(self.mesh) if self._pp else dict(plan.mesh.axes),
                                "strategy": plan.strategy})

    def load_checkpoint(self, path: str | os.PathLike, *, push: bool | None = None) -> None:
        """Continue from a file written by ``save_checkpoint`` (on any mesh).

        Every rank reads only its own pieces of the file. Under the local launcher they read
        it in place (one machine); under ``mpi``, or with ``push=True``, the controller first
        ships it to every host through the chain of ``meshplan files push`` into
        ``$MESHPLAN_CACHE/<host>/checkpoints`` (default ``<tmp>/meshplan-cache-<uid>``), where
        an unchanged copy from an earlier run is not sent again. Before the mesh runs, the
        state is also written into the live model and optimizer (the controller's copy), and
        the launch starts every rank from the file. Called before the step is first traced
        (and without ``example_inputs``), it checks the file now and applies it at the first
        call. A foreign, corrupt or mismatched file is one RuntimeFailure; nothing is changed.
        """
        from ._checkpoint import read_info

        if self._traced is None and self.example_inputs is None:
            self._pending_checkpoint = (read_info(path).path, push)     # checked now
            return
        self._apply_checkpoint(path, push)

    def sync(self) -> None:
        """Write the mesh's state back into the live model and optimizer on the controller."""
        if self._workers is not None:
            self._write_local(self._gather_state())
            self._local_stale = False

    @property
    def run_id(self) -> str | None:
        """The running mesh's id (the ``run_id`` of its telemetry rows, which a restart after a
        rank failure keeps); None before launch."""
        if self._workers is None:
            return None
        return self._tel.run_id if self._tel is not None else self._workers.run_id

    @property
    def restarts(self) -> int:
        """How many times fault tolerance restarted the mesh after a rank failed."""
        return 0 if self._ft is None else self._ft.restarts

    @property
    def fault_tolerance(self) -> bool:
        """Whether a failed rank is restarted from the snapshots (``distribute(
        fault_tolerance=)``; the default turns it on for CPU ranks); ``fault_tolerance_note``
        says why, as the plan summary does."""
        return self._ft is not None

    @property
    def fault_tolerance_note(self) -> str:
        return self._ft_note

    def query(self, sql: str, *, merge: str | None = None,
              timeout_s: float = 10.0) -> QueryResult:
        """Run ``sql`` on every live worker over its recent in-memory events (the tables of
        ``telemetry/SCHEMA.md``; each rank holds only its own rows) and concatenate the
        answers; ``merge``, if given, is SQL run on the controller over that concatenation,
        named ``result`` (e.g. ``SELECT kind, sum(n) FROM result GROUP BY kind``). Workers
        that do not answer within ``timeout_s`` are listed in ``missing``, not fatal.
        Workers answer between steps: call it from the thread that runs the steps."""
        import pyarrow as pa

        from ..telemetry._recorder import read_ipc

        workers = self._workers
        if workers is None:
            raise RuntimeFailure(f"{self.__name__}: no mesh is running; call the step first "
                                 "(or query the store: meshplan telemetry sql)")
        if self.telemetry is None:
            raise RuntimeFailure(f"{self.__name__}: telemetry is off for this run; pass "
                                 "telemetry=None (the default) or a path to distribute")
        workers.broadcast("telemetry_query", {"sql": sql})
        got, errors, missing = workers.gather_some("telemetry_query", timeout_s)
        tables = [read_ipc(got[r].tensors[0].numpy()) for r in sorted(got)]
        if tables:
            table = pa.concat_tables(tables, promote_options="permissive")
        else:
            table = pa.table({})
        if merge is not None:
            table = merge_answers(table, merge)
        if missing:
            logger.warning("meshplan: %s did not answer the live query within %s s",
                           ", ".join(f"rank {r}" for r in missing), timeout_s)
        return QueryResult(table, tuple(missing),
                           {r: f"{h.get('type')}: {h.get('message')}" for r, h in errors.items()})

    def watch(self, *nodes: str) -> None:
        """From the next step on, every rank also keeps its pieces of these plan nodes'
        values from the last step, for ``inspect``; ``watch()`` with none stops watching
        every node (README, "Live debugging")."""
        from ._inspect import watch

        watch(self, nodes)

    def inspect(self, name: str, rank: int | None = None, *, index: int = 0) -> torch.Tensor:
        """A tensor the ranks hold now: a state tensor (a ``state_dict()`` key of the model,
        or an internal name such as an optimizer state's) or a watched node's value in the
        last step (output ``index``); with ``rank``, that rank's piece as it holds it, else
        the whole tensor (``runtime/_inspect.py``)."""
        from ._inspect import inspect

        return inspect(self, name, rank, index)

    def stacks(self, timeout_s: float = 3.0) -> Stacks:
        """Every rank's Python stacks now, as ``{rank: {"text", "frame", "doing"}}`` (``str()``
        prints them, ranks in the same place together); a run with telemetry also stores them
        (table ``stacks``, reason ``request``). Each rank's side thread answers, also while
        the rank computes or waits in a collective; one that does not within ``timeout_s``
        (stopped, gone, stuck in C code holding Python's lock) is left out. Without a call:
        ``kill -USR1 <this process>`` prints them while a call waits for the ranks, and a
        call whose ranks time out stores them before it fails (README, "Live debugging")."""
        workers = self._workers
        if workers is None:
            raise RuntimeFailure(f"{self.__name__}: no mesh is running; call the step first")
        got = Stacks(workers.stacks(timeout_s), n=workers.n, label=self.__name__)
        self._record_stacks(got, "request")
        return got

    def _record_stacks(self, stacks: Mapping[int, Mapping[str, Any]], reason: str) -> None:
        """Into telemetry, with the step in flight (a signal comes during a call) or, for a
        request between calls, the last step done (None before the first)."""
        if self._tel is not None and stacks:
            step = self._step_no if reason != "request" else (self._step_no - 1 if
                                                               self._step_no else None)
            self._tel.stacks(stacks, step, reason)

    def flush_telemetry(self, timeout_s: float = 30.0) -> None:
        """Make every rank (and the controller) write its pending telemetry rows now (and
        fetch those of ranks whose disk this host does not see)."""
        if self._workers is not None and self.telemetry is not None:
            self._workers.broadcast("telemetry_flush")
            self._workers.gather("telemetry_flush", timeout_s)
            self._ship_segments(timeout_s)
        if self._tel is not None:
            self._tel.rec.flush()

    def _ship_segments(self, timeout_s: float | None = None) -> None:
        """Fetch the finished telemetry segments of the ranks that write them on another
        host's disk (``SegmentShipper``) into this host's folder, where ``ingest`` finds them:
        every ``SHIP_EVERY_S`` between steps, at ``flush_telemetry`` and before shutdown. A
        rank that fails keeps what it wrote since the last fetch on its host."""
        shipper, workers = self._shipper, self._workers
        if shipper is None or not shipper.ranks or workers is None:
            return
        wanted = set(shipper.ranks)
        more = True
        while more:
            for rank in range(workers.n):
                workers.send(rank, "telemetry_ship", {"ship": rank in wanted})
            replies = workers.gather("telemetry_ship", timeout_s or self.timeout_s)
            for rank, reply in enumerate(replies):
                shipper.write(rank, reply.header["names"], reply.tensors)
            more = any(r.header.get("more") for r in replies)
        shipper.shipped_at = time.monotonic()

    def shutdown(self) -> None:
        if self._workers is not None:
            # every rank writes its rows before any rank is told to exit: a rank's own flush
            # at exit can be cut short. Under mpiexec across hosts (the sandbox's two-host
            # test) a rank still flushing at exit was SIGKILLed in ~1 run of 4 and its rows
            # were lost; with the workers' PR_SET_PDEATHSIG off, 12 of 12 runs kept them, so
            # its hydra proxy's end is the likely sender. With this flush: 12 of 12 kept.
            try:
                if not self._workers.closed:
                    self.flush_telemetry(self.timeout_s)
            except RuntimeFailure as exc:
                logger.warning("meshplan: could not fetch the ranks' last telemetry segments "
                               "before shutdown: %s", exc)
            self._workers.shutdown()       # and what they record after, as they exit
            self._workers = None
            self._shipper = None
        if self._ft is not None:
            self._ft.close()               # the snapshots go with the mesh
        if self._allocation is not None:
            self._allocation.release()
            self._allocation = None
        if self._pods is not None:
            self._pods.close()
            self._pods = None
        if self._live is not None:
            self._live.close()
            self._live = None
        if self._tel is not None:
            run_id = self._tel.run_id
            self._tel.close()
            self._tel = None
            ingest(self.telemetry, run_id)

    def __enter__(self) -> DistributedStep:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "running" if self._workers is not None else "idle"
        return f"DistributedStep({self.__name__}, mesh={self.mesh}, {state})"

    # ---- internals ---------------------------------------------------------------------------

    def _prepare(self, args: tuple, kwargs: Mapping[str, Any] | None = None) -> None:
        with precision_policy(self.precision):
            self._traced = trace(self.fn, *args, **dict(kwargs or {}))
        self._primary_key = self._traced.call_key(*args, **dict(kwargs or {}))
        if isinstance(self._plan_arg, Plan):
            self._plan = self._plan_arg
        elif self._plan_arg is not None and not self._pp:
            self._plan = Plan.load(self._plan_arg)
        if self._pp:
            self._plan_pipeline(self._traced.graph)
        elif self._plan is not None:   # a saved plan: for this step, this mesh, this torch?
            self._plan.check_compatible(graph=self._traced.graph, mesh=self.mesh)
        else:
            self._plan = self._plan_on(self._traced.graph)
        self._plan.solver["device"] = self._device_note
        self._plan.solver["fault_tolerance"] = self._ft_note
        if self.microbatches > 1 and not self._pp:    # refused here, by name, before launch
            self._program_plan(self._plan)
            m = self.microbatches
            self._plan.solver["microbatches"] = (
                f"{m}: each rank runs its batch in {m} parts one after another, their "
                "gradients summed, the optimizer once; the estimates above are for the "
                "whole batch at once")

    def _plan_pipeline(self, graph: Any) -> None:
        """A ``pp`` mesh: the stages planned (``plan_pipeline``, among the schedules the ranks
        run: ``RUNS``), ``plan`` every stage's layouts, and what the stages' micro-batches
        cannot do refused here, by name, before any rank starts."""
        from ..kernels import kernels_disabled

        m = None if self._mb_asked is None else self.microbatches
        named = _mesh_text(self.mesh)
        fallback = None
        if os.environ.get(STAGE_TRANSFERS) == "rma" and self.launcher != "mpi":
            raise RuntimeFailure(
                f"{self.__name__}: {STAGE_TRANSFERS}=rma (the stages' transfers as one-sided "
                f"puts) needs launcher='mpi', whose ranks have MPI RMA windows; this run's "
                f"launcher is {self.launcher!r}: pass launcher='mpi', or unset it")
        if m == 1:
            raise RuntimeFailure(
                f"{self.__name__}: distribute(microbatches=1) on mesh {named}: the stages run "
                "in micro-batches (one would leave every stage but one idle, and the stage "
                "programs are cut by micro-batch); pass microbatches=2 or more (a divisor of "
                "each data-parallel rank's batch), or None for the planner's choice")

        given = self._plan_arg if isinstance(self._plan_arg, PipelinePlan) else None
        if given is not None:
            self._given_pipeline(graph, given)
            return

        def planned(m: int | None, schedule: Any = self._schedule or RUNS) -> PipelinePlan:
            with contextlib.nullcontext() if self.kernels else kernels_disabled():
                return plan_pipeline(graph, self.mesh, topology=self.topology,
                                     strategy=self.strategy, schedule=schedule,
                                     microbatches=m,
                                     memory_limit_bytes=self.memory_limit_bytes,
                                     recompute=self.recompute)
        try:
            pplan = planned(m)
            if pplan.microbatches == 1:       # the planner's choice: the least that runs
                pplan = planned(2)
            try:
                check_microbatched(microbatch_plan(pplan.inner, pplan.microbatches))
            except PlanError as e:            # microbatches=1 is no way out on stages
                if not hasattr(e, "why"):
                    raise
                raise PlanError(f"{e.why}. On mesh {named} the stages always run in "
                                f"micro-batches: {e.fix or 'change that op'}, or run without "
                                f"'{PP_AXIS}'") from None
            if pplan.schedule != "gpipe":     # what its order cannot run, said here
                try:
                    lower_pipeline(Stages.of(pplan), 0, kernels=False, free_early=False)
                except LoweringError as e:
                    if self._schedule is not None:
                        raise
                    fallback = str(e).split("; run it")[0]
                    # interleaved's failure may be its chunks': 1F1B, then GPipe
                    alts = ("1f1b", "gpipe") if pplan.schedule == "interleaved" else ("gpipe",)
                    for alt in alts:
                        pplan = planned(pplan.microbatches, alt)
                        try:
                            lower_pipeline(Stages.of(pplan), 0, kernels=False,
                                           free_early=False)
                            break
                        except LoweringError:
                            if alt == alts[-1]:
                                raise
                    logger.warning("meshplan: %s: %s; planning %s instead", self.__name__,
                                   fallback, pplan.schedule)
        except (PlanError, LoweringError) as e:     # as a mesh without stages raises it
            raise (PlanError if isinstance(e, PlanError) else LoweringError)(
                f"{self.__name__}: {e}") from None
        self._use_pipeline(pplan, f"{pplan.schedule}, as asked, " if self._schedule else
                           f"{pplan.schedule} ({fallback}), " if fallback else
                           f"{pplan.schedule} (the fastest of {', '.join(RUNS)}, the "
                           "schedules the ranks run), ")

    def _given_pipeline(self, graph: Any, pplan: PipelinePlan) -> None:
        """``plan=`` a pipeline plan (``PipelinePlan`` or its file): run it as compiled, once
        it is known to fit this step, this mesh and what the ranks run."""
        self._check_pipeline_options(pplan)
        try:
            pplan.inner.check_compatible(graph=graph)
        except PlanError as e:
            raise RuntimeFailure(
                f"{self.__name__}: the pipeline plan given: {e} (this plan's options: --mesh "
                f"{_mesh_text(dict(pplan.mesh.axes))} --schedule {pplan.schedule} "
                f"--microbatches {pplan.microbatches})") from None
        try:
            lower_pipeline(Stages.of(pplan), 0, kernels=False,   # what the ranks would
                           free_early=False)                 # refuse, here
        except LoweringError as e:
            raise RuntimeFailure(f"{self.__name__}: the pipeline plan given: {e}") from None
        self._use_pipeline(pplan, f"{pplan.schedule}, as compiled (plan=), ")

    def _check_pipeline_options(self, pplan: PipelinePlan) -> None:
        """A pipeline plan given for another mesh, schedule or micro-batch count than asked
        is refused at ``distribute``, before the step is traced."""
        named = _mesh_text(self.mesh)
        problems = []
        if dict(pplan.mesh.axes) != dict(self.mesh):
            problems.append(f"it is for mesh {_mesh_text(dict(pplan.mesh.axes))}")
        if pplan.schedule not in RUNS:
            problems.append(f"its schedule {pplan.schedule!r} is not one the stages run "
                            f"({', '.join(RUNS)})")
        if self._schedule is not None and self._schedule != pplan.schedule:
            problems.append(f"it runs {pplan.schedule!r}, not schedule={self._schedule!r}")
        if self._mb_asked is not None and self._mb_asked != pplan.microbatches:
            problems.append(f"it runs {pplan.microbatches} micro-batches, not "
                            f"microbatches={self._mb_asked}")
        if problems:
            raise RuntimeFailure(f"{self.__name__}: distribute(plan=...) on mesh {named}: "
                                 f"{'; '.join(problems)}: compile it again for this mesh and "
                                 "these options, or drop plan= (distribute plans the stages)")

    def _use_pipeline(self, pplan: PipelinePlan, chosen: str) -> None:
        self._pipeline, self._stages = pplan, Stages.of(pplan)
        self._plan = pplan.inner
        self.microbatches = pplan.microbatches
        sizes = " / ".join(str(sum(1 for u in s.units if u not in (PRE, POST)))
                           for s in pplan.stages)
        self._plan.solver["pipeline"] = (
            f"{pplan.pp} stages on mesh {pplan.mesh} (layers per stage {sizes}), " + chosen +
            f"{pplan.microbatches} micro-batches, estimated step "
            f"{pplan.estimated_step_time_s * 1e3:.3f} ms (bubble "
            f"{pplan.bubble_s * 1e3:.3f} ms); this plan is every stage's layouts, each stage "
            "holds its own state (step.pipeline.summary() for the rest)")

    def _world(self) -> int:
        """How many ranks the mesh runs on (a pipeline's: every stage's)."""
        return math.prod(self.mesh.values()) if self._pp else math.prod(self.plan.mesh.sizes)

    def _held_by(self, rank: int, names: Sequence[str]) -> list[str]:
        """Which of the state ``names`` rank ``rank`` holds pieces of (a pipeline rank: its
        stage's)."""
        if self._stages is None:
            return list(names)
        owner, stage = self._owners(), self._stages.stage(rank)
        return [n for n in names if owner.get(n, stage) == stage]

    def _owners(self) -> dict[str, int]:
        assert self._stages is not None
        if self._stage_owners is None:
            self._stage_owners = self._stages.owners()
        return self._stage_owners

    def _apply_checkpoint(self, path: str | os.PathLike, push: bool | None) -> None:
        from ._checkpoint import check_matches, read_info, read_whole

        info = read_info(path)            # a foreign file fails before any tracing
        path = info.path
        plan = self.plan
        expected = {n.target: (n.meta.shape, n.meta.dtype) for n in plan.graph.inputs
                    if n.meta.role in STATE_ROLES}
        names = check_matches(info, expected, self.__name__)
        if self._workers is None:
            self._write_local(read_whole(path))
            self._launch_from = (path, names, push, _stamp(path))
            return
        paths = self._checkpoint_on_ranks(path, push)
        with self._recording_failures():
            for rank in range(self._workers.n):
                self._workers.send(rank, "load_checkpoint", {
                    "path": paths[rank], "names": self._held_by(rank, names)})
            self._workers.gather("load_checkpoint", self.timeout_s)
        if self._ft is not None:
            self._ft.started(self._step_no)

    def _checkpoint_on_ranks(self, path: str, push: bool | None) -> list[str]:
        """Where each rank reads the checkpoint ``path``: in place under the local launcher,
        else (or with ``push=True``) its host's copy, pushed through the chain first."""
        assert self._workers is not None
        if not (self.launcher != "local" if push is None else push):
            return [path] * self._workers.n
        return self._on_every_host(path, "checkpoints")

    def _on_every_host(self, path: str, folder: str) -> list[str]:
        """Push the file ``path`` through the chain to ``$MESHPLAN_CACHE/<host>/<folder>`` on
        every host (a copy there with the same content is not sent again); returns the path
        of each rank's copy."""
        from ._files import push_files

        cache = os.environ.get("MESHPLAN_CACHE") or os.path.join(
            tempfile.gettempdir(), f"meshplan-cache-{os.getuid()}")
        result = push_files(path, os.path.join(cache, "{host}", folder), workers=self._workers,
                            timeout_s=self.timeout_s)
        logger.info("meshplan: %s on every host (%d of %d bytes sent)", path,
                    result.bytes_sent, result.bytes)
        return [os.path.join(r.dest, os.path.basename(path)) for r in result.ranks]

    def _program_plan(self, plan: Plan) -> Plan | None:
        """The plan the ranks lower: ``plan`` itself, or with ``microbatches=`` its
        micro-batch plan (``backends/_microbatch.py``), made once per plan (a pipeline's
        stages make their own from ``plan``: None)."""
        if self.microbatches == 1 or self._pp:
            return None
        got = self._mb_plans.get(id(plan))
        if got is None or got[0] is not plan:
            mb = microbatch_plan(plan, self.microbatches)
            check_microbatched(mb)          # what the ranks would refuse, said here
            got = self._mb_plans[id(plan)] = (plan, mb)
        return got[1]

    def _plan_json(self, plan: Plan) -> str:
        """``plan.to_json()``, kept while ``plan`` and its solver notes stay as they were: a
        replaced rank's setup sends it again (35-100 ms for the fault benchmark's GPT)."""
        notes = json.dumps(plan.solver, sort_keys=True, default=str)
        got = self._plan_texts.get(id(plan))
        if got is None or got[0] is not plan or got[1] != notes:
            got = self._plan_texts[id(plan)] = (plan, notes, plan.to_json())
        return got[2]

    def _plans_for_ranks(self, plan: Plan) -> list[dict[str, str]]:
        """``_plan_for_ranks`` of ``plan``, with its micro-batch plan under ``mb_`` keys, or
        a pipeline's stages (``stages``)."""
        out = self._plan_for_ranks(self._plan_json(plan))
        if self._stages is not None:
            stages = self._stages.to_json()
            return [{**a, "stages": stages} for a in out]
        mb = self._program_plan(plan)
        if mb is None:
            return out
        extra = self._plan_for_ranks(mb.to_json())
        return [{**a, **{f"mb_{k}": v for k, v in b.items()}} for a, b in zip(out, extra)]

    def _plan_for_ranks(self, text: str) -> list[dict[str, str]]:
        """What each rank's setup carries of the plan: the JSON itself under the local launcher
        (one machine); under ``mpi`` the path of its host's copy, pushed through the chain once
        (not once per rank through the controller's channel), named by its content hash."""
        assert self._workers is not None
        if self.launcher == "local":
            return [{"plan": text}] * self._workers.n
        import hashlib

        with tempfile.TemporaryDirectory(prefix="meshplan-plan-") as folder:
            path = os.path.join(folder, f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.plan")
            with open(path, "w") as f:
                f.write(text)
            return [{"plan_path": p} for p in self._on_every_host(path, "plans")]

    def _send_state(self, kind: str, values: Mapping[str, Any],
                    header: Callable[[int, list[str]], dict[str, Any]]) -> list[Any]:
        """Send every rank its pieces of ``values`` with the message ``kind`` (``header(rank,
        names)`` is its header; the pieces follow in ``names`` order) and wait for all. Under
        the mpi launcher each distinct piece goes once, to its owner, and the ranks holding a
        replica then read it from there (``_replica_owners``, ``_share_replicas``)."""
        plan, workers = self.plan, self._workers
        assert workers is not None
        owners = self._replica_owners(values)
        for rank in range(workers.n):
            if self._stages is not None:      # its stage's state, as every stage's plan lays it
                mine = {k: values[k] for k in self._held_by(rank, list(values))}
                pieces = split_inputs(plan, self._stages.inner_rank(rank), mine)
            else:
                pieces = split_inputs(plan, rank, _owned(values, owners, rank))
            names = sorted(pieces)
            workers.send(rank, kind, header(rank, names), [pieces[n] for n in names])
        replies = workers.gather(kind, self.timeout_s)
        self._share_replicas(owners)
        return replies

    def _replica_owners(self, values: Mapping[str, Any]) -> dict[tuple[int, str], int] | None:
        """Under the mpi launcher: (rank, name) -> the lowest rank that holds the same piece of
        ``name`` (itself when none lower does). The controller sends each distinct piece once,
        to its owner; the others read it from there one-sidedly (``_share_replicas``). None
        (send every rank its pieces) under the local launcher."""
        if self.launcher != "mpi" or self._pp:
            return None
        first: dict[tuple, int] = {}
        return {(rank, name): first.setdefault(key, rank)
                for (rank, name), key in _piece_keys(self.plan, list(values)).items()}

    def _share_replicas(self, owners: dict[tuple[int, str], int] | None) -> None:
        names = sorted({name for (rank, name), owner in (owners or {}).items() if owner != rank})
        if not names:                     # no owners (local launcher), or no replicas
            return
        assert owners is not None
        workers = self._workers
        assert workers is not None
        for rank in range(workers.n):
            workers.send(rank, "share_state", {"names": names, "fetch": {
                name: owners[(rank, name)] for name in names if owners[(rank, name)] != rank}})
        workers.gather("share_state", self.timeout_s)

    def _has_opt_state(self) -> bool:
        graph = self.plan.graph
        return (not graph.inputs_with_role(Role.OPT_STATE)
                or any(opt.state for _, opt in self._traced.inventory.optimizers))

    def _zero_state(self) -> bool:
        """Give the optimizers the state their first step would create, when the steady step
        from it is exactly that first step: Adam and AdamW create zeros (and step 0) and run
        their usual update; SGD's first step copies the gradient into the momentum buffer,
        which the steady update from a zero buffer reproduces only without dampening.
        Returns False (the first step then runs on the controller) otherwise."""
        for _, opt in self._traced.inventory.optimizers:
            exact = isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)) or (
                isinstance(opt, torch.optim.SGD)
                and all(g.get("dampening", 0) == 0 for g in opt.param_groups))
            if not exact:
                return False
        zeros = {n.target: torch.zeros(n.meta.shape, dtype=getattr(torch, n.meta.dtype))
                 for n in self.plan.graph.inputs_with_role(Role.OPT_STATE)}
        self._write_local(zeros)
        return True

    def _state_names(self) -> list[str]:
        return [n.target for n in self.plan.graph.inputs if n.meta.role in STATE_ROLES]

    def _local_state(self) -> dict[str, torch.Tensor]:
        values = self._traced.input_values(*self._example_data())
        return {k: values[k].detach().clone() for k in self._state_names() if k in values}

    def _example_data(self) -> tuple:
        ex = self.example_inputs
        if ex is None:     # state only: data inputs are not read
            return tuple(torch.empty(n.meta.shape, dtype=getattr(torch, n.meta.dtype))
                         for n in self.plan.graph.inputs_with_role(Role.DATA))
        return tuple(ex() if callable(ex) else ex)

    def _launch(self, *, restore: bool = False) -> list[Any]:
        """Start the workers and set every rank up: its plan, its pieces of the state (from
        the controller, or from a checkpoint file the ranks read themselves) and its telemetry.
        ``restore``: a restart after a rank failure (``_recover``): the ranks get no state,
        they read it back from their snapshots; the run's telemetry and step numbers go on.
        Returns the setup replies."""
        plan = self.plan
        world = self._world()
        state = {} if restore else self._launch_state()
        data = call_inputs(plan)
        if self._ft is not None and self._ft_auto:
            self._snapshot_memory_check(world)
        if self.launcher == "local" and os.environ.get("MESHPLAN_HOSTS") and not restore:
            logger.warning("meshplan: $MESHPLAN_HOSTS names hosts (%s), and launcher='local' "
                           "runs every rank on this one; pass launcher='mpi' or 'slurm' to "
                           "use them", os.environ["MESHPLAN_HOSTS"])
        launcher = (MPILauncher(hosts=self.hosts) if self.launcher == "mpi"
                    else self._slurm_launcher(world) if self.launcher == "slurm"
                    else self._k8s_launcher() if self.launcher == "k8s"
                    else LocalLauncher(fork=self.device == "cpu"))
        plugins = ",".join(filter(None, (_HANDLERS, FILES_PLUGIN,
                                         os.environ.get("MESHPLAN_WORKER_PLUGINS"))))
        with launching(self.__name__):        # the ranks' first lines carry its name too
            self._workers = workers = launcher.launch(
                world, env={"MESHPLAN_WORKER_PLUGINS": plugins})
        workers.stopped_s = self.hang_s
        workers.keep_on_failure = self._ft is not None    # _recover decides what to stop
        workers.logs.label = self.__name__                # "[train r0-3] <line>"
        if self._watched:
            workers.broadcast("watch", {"nodes": sorted(self._watched)})
            workers.gather("watch", self.timeout_s)
        workers.on_stacks = self._record_stacks
        install_stack_signal()
        ckpt: list[dict[str, Any]] = [{}] * world
        if self._launch_from is not None and not restore:
            path, in_file, push, stamp = self._launch_from
            self._launch_from = None
            if _stamp(path) != stamp:
                logger.warning("meshplan: %s changed since it was loaded; the ranks get the "
                               "state it held from the controller instead", path)
            else:                             # the ranks read the state it holds themselves
                with self._recording_failures():
                    ckpt = [{"path": p, "names": self._held_by(rank, in_file)}
                            for rank, p in enumerate(self._checkpoint_on_ranks(path, push))]
                state = {k: v for k, v in state.items() if k not in in_file}
        if self.telemetry is not None and self._tel is None:
            self._tel = ControllerTelemetry(
                self.telemetry, workers.run_id, plan, step_name=self.__name__,
                strategy=plan.strategy,
                mesh=None if self._pipeline is None else self._pipeline.mesh)
            me = weakref.ref(self)        # the endpoint's thread must not keep the step alive
            self._live = LiveEndpoint(
                run_id=self._tel.run_id, step=self.__name__,
                folder=self.telemetry.segments / self._tel.run_id,
                workers=lambda: getattr(me(), "_workers", None))
        header = self._setup_header()
        if not restore:
            self._step_no, self._resume_step = self._resume_step, 0
            if self._ft is not None:
                self._ft.generation = 0
                self._ft.started(self._step_no)
        with self._recording_failures():
            plans = self._plans_for_ranks(plan)
            replies = self._send_state("setup", state, lambda rank, names: {
                **header, **plans[rank], "state": names, "checkpoint": ckpt[rank],
                "snapshot": self._snapshot_header(rank, restore),
                "generation": 0 if self._ft is None else self._ft.generation})
        if self.telemetry is not None:
            self._shipper = SegmentShipper(self.telemetry, self._tel.run_id, [
                r.header.get("segments_marker") for r in replies])
            if self._shipper.ranks:
                logger.info("meshplan: %d ranks record telemetry on disks this host does not "
                            "see; the controller fetches their segments every %g s and at "
                            "the end", len(self._shipper.ranks), SHIP_EVERY_S)
        if not restore:
            assert self._primary_key is not None
            self._variants = {self._primary_key: Variant.of(0, plan, tuple(data))}
        if self._ft is not None:
            workers.keep_spare()       # started now, so that replacing a rank skips start-up
        return replies

    def _setup_header(self) -> dict[str, Any]:
        """What every rank's ``setup`` carries besides its plan and state."""
        header: dict[str, Any] = {"data": call_inputs(self.plan), "timeout_s": self.timeout_s,
                                  "kernels": self.kernels, "device": self.device}
        if self.telemetry is not None:
            assert self._tel is not None
            config = self.telemetry
            if self._calibrate_left:      # time every op of the steps the fit reads, only them
                config = dataclasses.replace(
                    config, level=max(config.level, Level.OPS), ops_first=self._calibrate_left,
                    ops_every=config.ops_every if config.level >= Level.OPS else 2**62)
            header["telemetry"] = {**config.to_json(), "run_id": self._tel.run_id}
        return header

    def _snapshot_header(self, rank: int, restore: bool) -> dict[str, Any]:
        """Where rank ``rank`` keeps its snapshots (fault tolerance; else nothing), and
        whether it reads them back (``restore``) or starts them from its state."""
        ft = self._ft
        if ft is None:
            return {}
        world = math.prod(self.plan.mesh.sizes)
        if ft.files is None or ft.owners is None:     # once per launched mesh
            hosts = self._rank_hosts(world)
            if ft.files is None:
                ft.files = self._snapshot_files(hosts)
            if ft.owners is None:
                ft.owners = self._snapshot_owners(hosts)
        files = ft.files
        names = sorted(n for r, n in ft.owners if r == rank)
        return {"path": files.path(rank), "paths": [files.path(r) for r in range(world)],
                "own": [n for n in names if ft.owners[(rank, n)] == rank],
                "from": {n: ft.owners[(rank, n)] for n in names},
                "replica": files.replica(rank),
                "restore": restore, "step": self._step_no - 1}

    def _plan_on(self, graph: Any, mesh: Mapping[str, int] | None = None, *,
                 pins: Any = None, topology: Any = None) -> Plan:
        """``graph`` planned with the run's options (strategy, memory limit, recompute) on
        ``mesh`` (default: the run's) and ``topology`` (default: the run's); ``pins``: state
        layouts to keep (``_state_pins``)."""
        from ..kernels import kernels_disabled

        # kernels=False: the cost model prices the ops the program runs instead of the kernels
        with contextlib.nullcontext() if self.kernels else kernels_disabled():
            return plan_graph(graph, self.mesh if mesh is None else mesh,
                              topology=self.topology if topology is None else topology,
                              strategy=self.strategy, memory_limit_bytes=self.memory_limit_bytes,
                              pins=pins, recompute=self.recompute)

    def _slurm_launcher(self, world: int) -> SlurmLauncher:
        """The Slurm launcher of a launch; under fault tolerance, in the allocation the run
        keeps (asked for at the first launch when the controller runs outside one)."""
        if self._ft is None:
            return SlurmLauncher(self.slurm)
        if self._allocation is None:      # one that outlives a node failing (--no-kill)
            self._allocation = SlurmLauncher(self.slurm).allocation(world, no_kill=True)
        return SlurmLauncher(self.slurm, env=self._allocation.environ())

    def _k8s_launcher(self) -> K8sLauncher | K8sPods:
        """The k8s launcher of a launch; under fault tolerance, the run's pods (made at the
        first launch, their agents keep the snapshots and start every launch's ranks)."""
        assert self.k8s is not None
        if self._ft is None:
            return K8sLauncher(self.k8s)
        if self._pods is None:
            self._pods = K8sPods(self.k8s)
        return self._pods

    def _slurm_nodes(self, world: int) -> list[str]:
        """The nodes of the run's Slurm allocation that ``world`` ranks use (the first ones;
        the others are spares)."""
        assert self._allocation is not None and self.slurm is not None
        return self._allocation.nodes[:slurm_nodes(self._allocation, world, self.slurm.nodes,
                                                   say=False)]

    def _slurm_owners(self, world: int) -> list[str]:
        """Every rank's node (``_slurm_nodes``, consecutive ranks on one)."""
        nodes = self._slurm_nodes(world)
        return [nodes[r * len(nodes) // world] for r in range(world)]

    def _rank_hosts(self, world: int) -> list[str | None]:
        """The host of every rank, None for the controller's own (where the controller holds
        the snapshot files): the mpi launcher's placement (``host_slots``), or the Slurm
        allocation's nodes, consecutive ranks on one."""
        if self.launcher == "slurm" and self._allocation is not None:
            names = self._slurm_owners(world)
        elif self._pods is not None:           # pods: never the controller's host
            return list(self._pods.hosts(world))
        else:
            placement = host_slots(self.hosts, world) if self.launcher == "mpi" else None
            if placement is None:
                return [None] * world
            names = [h for h, k in placement for _ in range(k)]
        here = {h: is_this_host(h) for h in set(names)}      # a name lookup per host
        return [None if here[h] else h for h in names]

    def _snapshot_files(self, hosts: list[str | None]) -> MeshSnapshots:
        """Every rank's snapshot file (``hosts``: ``_rank_hosts``): memory files this process
        holds, and for ranks on other hosts, one snapshot keeper per host started with the
        ranks' launcher (``_keepers.py``)."""
        env = {"MESHPLAN_WORKER_PLUGINS": KEEPER_PLUGIN}

        def launch(names: list[str]) -> Workers:
            if self._pods is not None:          # the pods' agents keep their snapshots
                assert self._pods.agents is not None
                return self._pods.agents
            if self.launcher == "slurm":       # a step of its own, beside the ranks' steps
                assert self.slurm is not None and self._allocation is not None
                options = dataclasses.replace(self.slurm, nodes=len(names), srun_args=(
                    *self.slurm.srun_args, "--overlap", f"--nodelist={','.join(names)}",
                    "--kill-on-bad-exit=0"))
                return SlurmLauncher(options, env=self._allocation.environ()).launch(
                    len(names), env=env)
            # one job for every keeper, which goes on when one of them (its host) is lost
            return MPILauncher(hosts=[f"{h}:1" for h in names],
                               mpiexec_args=("-disable-auto-cleanup",)).launch(
                len(names), env=env)
        return MeshSnapshots(hosts, launch, self.timeout_s, own=self._pods is None)

    def _snapshot_memory_check(self, world: int) -> None:
        """Under the default (``fault_tolerance=None``), leave fault tolerance off when the
        snapshots the ranks of this host would keep (two slots of every distinct piece they
        hold) take more than ``AUTO_MEMORY_SHARE`` of this host's available memory; says so
        once. Asked for explicitly, fault tolerance is never turned off here."""
        self._ft_auto = False                  # once: the first launch decides
        if self.launcher == "slurm":            # the ranks' nodes are not this host
            return
        free = _available_memory()
        if free is None:
            return
        _, nbytes = self._host_pieces(self._rank_hosts(world))
        need = 2 * sum(b for key, b in nbytes.items() if key[0] is None)     # this host's
        if need <= AUTO_MEMORY_SHARE * free:
            return
        assert self._ft is not None
        self._ft.close()
        self._ft = None
        self._ft_note = (f"off: its snapshots would take {format_bytes(need)} of this host's "
                         f"{format_bytes(free)} available memory (more than "
                         f"{AUTO_MEMORY_SHARE:.0%}); fault_tolerance=True turns it on anyway")
        self.plan.solver["fault_tolerance"] = self._ft_note
        logger.warning("meshplan: %s: fault tolerance %s", self.__name__, self._ft_note)

    def _host_pieces(self, hosts: list[str | None]) -> tuple[dict[tuple, list[int]],
                                                              dict[tuple, int]]:
        """The distinct state pieces on each host (``hosts``: every rank's, ``_rank_hosts``),
        keyed ``(host, *_piece_keys' key)``: the ranks holding each, and its bytes."""
        plan = self.plan
        dtypes = {n.target: getattr(torch, n.meta.dtype) for n in plan.graph.inputs}
        holders: dict[tuple, list[int]] = {}
        for (rank, _), key in _piece_keys(plan, self._state_names()).items():
            holders.setdefault((hosts[rank], *key), []).append(rank)
        nbytes = {key: math.prod(b - a for a, b in key[2]) * dtypes[key[1]].itemsize
                  for key in holders}
        return holders, nbytes

    def _snapshot_owners(self, hosts: list[str | None]) -> dict[tuple[int, str], int]:
        """(rank, state name) -> the rank whose snapshot holds that rank's piece. Ranks of one
        host holding the same piece (data-parallel replicas, tensor-parallel replicated norms)
        share its snapshot out: each distinct piece is copied by one of its holders on every
        host that has one (a restarted rank reads its pieces on its own host), the largest
        pieces first, each to the holder that copies the fewest bytes so far. So under data
        parallelism every rank copies about 1/n of its host's state per snapshot, not all of
        it. ``hosts``: every rank's (``_rank_hosts``)."""
        holders, nbytes = self._host_pieces(hosts)
        load = [0] * math.prod(self.plan.mesh.sizes)
        owners = {}
        for key in sorted(holders, key=lambda k: (-nbytes[k], k[1:], k[0] or "")):
            owner = min(holders[key], key=lambda r: (load[r], r))
            load[owner] += nbytes[key]
            owners.update({(rank, key[1]): owner for rank in holders[key]})
        return owners

    def _launch_state(self) -> dict[str, torch.Tensor]:
        """The state a fresh mesh starts from: the live model's and optimizer's."""
        state = self._local_state()
        for n in self.plan.graph.inputs_with_role(Role.GRAD):
            # a gradient the steady step reads that does not exist yet (None before the first
            # backward, or zero_grad() at the start of the step): zeros, which the backward's
            # accumulation into it leaves exactly as a fresh gradient
            state.setdefault(n.target, torch.zeros(n.meta.shape,
                                                   dtype=getattr(torch, n.meta.dtype)))
        return state

    def _recover(self, failure: WorkerFailure, in_flight: int
                 ) -> tuple[WorkerFailure, int, float]:
        """``fault_tolerance=True``: a rank failed (``failure``) while the controller ran step
        ``in_flight`` (or between steps, before it): replace it, or start the whole mesh again,
        every rank back at the newest snapshot all of them hold, and re-run the kept steps
        after it, up to (not including) ``in_flight``, which the caller sends again. A failure
        while doing so is one more restart. Raises (after stopping every worker) when a
        restart cannot cure the failure (a handler's error) or ``max_restarts`` is spent.
        Returns the last failure, the snapshot's step and when the recovery started."""
        ft = self._ft
        if ft is None or failure.reason not in RECOVERABLE:
            self._stop_workers()
            raise failure
        started = time.monotonic()
        while True:
            if ft.restarts >= ft.max_restarts:
                self._stop_workers()
                raise RuntimeFailure(
                    f"{self.__name__}: the mesh failed again after {ft.restarts} restart"
                    f"{'s' * (ft.restarts != 1)} (max_restarts={ft.max_restarts}); the last "
                    f"failure:\n{failure}") from failure
            moving = ft.relocating if ft.held is not None else self._relocatable(failure)
            if failure.reason == "lost" and ft.elastic is None and not moving and (
                    self.launcher == "slurm" or self.launcher == "mpi" and parse_hosts(self.hosts)):
                self._stop_workers(lost=True)     # starting on the same hosts would wait on it
                spares = ("slurm={'nodes': N, 'spare_nodes': K} asks for K spare nodes; inside "
                          "an allocation, its nodes beyond nodes= are spares"
                          if self.launcher == "slurm" else "hosts= may list more hosts, or "
                          "slots, than the mesh needs: they are its spares")
                raise RuntimeFailure(
                    f"{self.__name__}: {str(failure).splitlines()[0]}; no spare "
                    f"{'node' if self.launcher == 'slurm' else 'host'} can take its ranks "
                    f"({spares}) and elastic= is off (elastic=True goes on without them, on a "
                    "smaller mesh)") from failure
            ft.restarts += 1
            logger.warning("meshplan: %s: %s; %s from its in-memory snapshots (restart %d of "
                           "at most %d)", self.__name__,
                           str(failure).splitlines()[0] + where_lines(failure),
                           "starting the mesh again in the pods (the Job makes a pod in "
                           "place of the lost one)," if moving and self._pods is not None else
                           "moving the mesh to the hosts left, a spare host taking the "
                           "lost one's ranks," if moving else
                           "restoring the mesh" if ft.elastic is None else
                           "going on without the failed ranks: a smaller mesh starts",
                           ft.restarts, ft.max_restarts)
            try:
                with self._recording_failures():
                    restored = self._restart(failure, in_flight, moving)
                break
            except WorkerFailure as again:
                if again.reason not in RECOVERABLE:
                    self._stop_workers()
                    raise
                failure = again
        ft.restarted()
        return failure, restored, started

    def _stop_workers(self, lost: bool = False) -> None:
        """Stop every worker now; ``lost``: some are on a lost host, whose launcher processes
        would not answer a polite end (a short grace, then the kill)."""
        if self._workers is not None:
            self._workers.stop(grace_s=0.5 if lost else None)

    def _restart(self, failure: WorkerFailure, in_flight: int, moving: bool) -> int:
        """Replace the failed ranks (``_replace``), or when that cannot be done, start every
        rank again; restore every rank to the newest common snapshot before ``in_flight``,
        give the new ranks the programs of the other call signatures, replay the kept steps.
        ``moving``: the mesh moves to spare hosts (``_relocatable``, or a move under way).
        Returns the snapshot's step."""
        ft = self._ft
        assert ft is not None
        if moving or ft.held is not None:    # a move under way goes on as it began
            return self._shrink(failure, in_flight, relocate=moving)
        if ft.elastic is not None:
            return self._shrink(failure, in_flight)
        held, new = self._replace(failure)
        if held is None:
            self._stop_workers()
            replies = self._launch(restore=True)
            held = [r.header.get("snapshots", []) for r in replies]
            new = list(range(len(replies)))
        ft.replaced = new
        workers = self._workers
        assert workers is not None
        restored = ft.restore_point(held, in_flight)
        if restored is None:
            self._stop_workers()
            raise RuntimeFailure(f"{self.__name__}: no step before {in_flight} has a snapshot "
                                 f"on every rank (they hold {dict(enumerate(held))}); the run "
                                 "cannot go on from memory: load the last checkpoint")
        phase = _Phases(ft.phases)
        workers.broadcast("restore_snapshot", {"step": restored})
        workers.gather("restore_snapshot", self.timeout_s)
        phase("snapshots read")
        for variant in sorted(self._variants.values(), key=lambda v: v.id):
            if variant.id != 0:
                self._add_program(variant, new)
        self._rerun(ft.replay(restored, in_flight))
        phase("kept steps re-run")
        return restored

    def _shrink(self, failure: WorkerFailure, in_flight: int, relocate: bool = False) -> int:
        """``distribute(elastic=)``: go on without the failed ranks. Read the newest snapshot
        every rank's file holds into the controller's live model, stop every worker, plan the
        step again for the best mesh the survivors can form (``_smaller_plan``), start that
        mesh from the live model and re-run the kept steps on it. A failure while it starts is
        one more restart that shrinks again, from the live model (``ft.held``). ``relocate``:
        hosts were lost and spare hosts take their ranks: the same mesh and plans start on
        the hosts left (``_relocatable``). Returns the snapshot's step."""
        ft, workers = self._ft, self._workers
        assert ft is not None
        n = math.prod(self.plan.mesh.sizes) if workers is None else workers.n
        failed = set(failure.ranks)
        if self.launcher == "local" and workers is not None and not workers.closed:
            failed |= set(workers.failed_ranks())     # another rank that died with it
        # (mpiexec ends every rank once one dies: there the failure's ranks are the failed)
        moved: list[str] = []
        if failure.reason == "lost" and self.launcher in ("mpi", "slurm"):
            found = self._lost_hosts(failure.ranks, n)
            if found is not None:      # their snapshots: the copies on the next hosts
                gone, left, moved = found
                if self.launcher == "mpi":
                    self.hosts = left
                else:                  # the same number of nodes, or as many as split
                    assert self._allocation is not None and self.slurm is not None
                    count = len(self._slurm_nodes(n))
                    self._allocation.lose(moved)
                    self.slurm = dataclasses.replace(self.slurm,
                                                     nodes=count if relocate else None)
                failed |= gone
                ft.files.lose(sorted(gone))
                logger.warning("meshplan: %s: host%s %s lost; the mesh goes on without %s",
                               self.__name__, "s" * (len(moved) != 1), ", ".join(moved),
                               "them" if len(moved) != 1 else "it")
        if self._pods is not None and relocate:     # pods lost: the Job makes others
            moved = self._pods.lose()
            if ft.held is None:               # their snapshots: the copies on the next pods
                ft.files.lose([r for r in range(n) if r // self._pods.per in self._pods.waiting])
            if moved:
                logger.warning("meshplan: %s: lost %s; the mesh starts again once the Job has "
                               "made a pod in place of each", self.__name__, ", ".join(moved))
        if ft.held is None:                   # the state is still in the mesh's snapshots
            assert ft.files is not None and ft.owners is not None
            try:
                found = read_mesh(ft.files, ft.owners,
                                  lambda held: ft.restore_point(held, in_flight))
            except RuntimeFailure as exc:
                if self._pods is None:
                    raise
                self._stop_workers()         # say how the pods went, and the Job's end
                raise RuntimeFailure(f"{self.__name__}: {exc} ({self._pods.why_lost()}); "
                                     "the run cannot go on from memory: load the last "
                                     "checkpoint") from exc
            if found is None:
                self._stop_workers()
                raise RuntimeFailure(f"{self.__name__}: no step before {in_flight} has a "
                                     "snapshot on every rank; the run cannot go on from "
                                     "memory: load the last checkpoint")
            restored, held = found
            self._stop_workers(lost=failure.reason == "lost")
            self._write_local(_assemble_state(self.plan, held))
            ft.held, ft.relocating = (restored, ft.kept_after(restored)), relocate
        else:
            self._stop_workers(lost=failure.reason == "lost")
        restored, kept = ft.held
        before = dict(self.mesh)
        old = sorted(self._variants.items(), key=lambda kv: kv[1].id)
        if relocate:
            mesh, plans = before, [v.plan for _, v in old] or [self.plan]
        else:
            mesh, plans = self._smaller_plan(n - len(failed))
        ft.close()                            # the old mesh's snapshot files
        if self._pods is not None:
            self._pods.replace()              # the lost pods' successors, their agents up
        self.mesh, self._plan = mesh, plans[0]
        self._resume_step = restored + 1
        self._launch()                        # its first snapshot: the state after `restored`
        for (key, variant), plan in zip(old[1:], plans[1:]):
            new = Variant.of(variant.id, plan, tuple(call_inputs(plan)))
            self._add_program(new)
            self._variants[key] = new
        for step in kept:
            ft.remember(step.step, step.variant, step.header, step.batch)
        self._rerun([k for k in kept if k.step < in_flight])
        ft.held, ft.shrunk = None, None if relocate else (before, mesh)
        ft.moved = moved if relocate else []
        ft.replaced = list(range(self._workers.n))
        return restored

    def _lost_hosts(self, ranks: Sequence[int], world: int
                    ) -> tuple[set[int], list[str], list[str]] | None:
        """Hosts were lost (no heartbeat from ``ranks``, under the mpi or slurm launcher):
        every rank on them, the hosts a new mesh may use without them (mpi: ``host:slots``,
        each with its own slots, or as many as it ran, spare hosts of ``hosts=`` too; slurm:
        the allocation's other nodes, spares too), and their names; None when the ranks do
        not run on listed hosts."""
        if self.launcher == "slurm":
            if self._allocation is None:
                return None
            owner = self._slurm_owners(world)
            lost = sorted({owner[r] for r in ranks})
            return ({r for r, h in enumerate(owner) if h in lost},
                    [h for h in self._allocation.nodes if h not in lost], lost)
        found = parse_hosts(self.hosts)
        placement = host_slots(self.hosts, world)
        if found is None or placement is None:
            return None
        owner = [h for h, k in placement for _ in range(k)]
        lost = sorted({owner[r] for r in ranks})
        ran = dict(placement)
        left = [f"{h}:{k if k is not None else ran[h]}" for h, k in found[0]
                if h not in lost and (k is not None or h in ran)]
        return {r for r, h in enumerate(owner) if h in lost}, left, lost

    def _relocatable(self, failure: WorkerFailure) -> bool:
        """Whether the mesh can start again as it is on the hosts left after a host loss
        (spare hosts in ``hosts=`` take the lost ones' ranks): then it moves instead of
        shrinking, and its results stay bit for bit the fault-free run's."""
        if self._pods is not None:            # a lost pod: the Job makes another
            return bool(self._pods.lost())
        if failure.reason != "lost" or self.launcher not in ("mpi", "slurm"):
            return False
        world = math.prod(self.plan.mesh.sizes)
        found = self._lost_hosts(failure.ranks, world)
        if found is None or not found[1]:
            return False
        if self.launcher == "slurm":            # as many nodes left as the mesh ran on
            return len(found[1]) >= len(self._slurm_nodes(world))
        try:
            host_slots(found[1], world)
        except RuntimeFailure:
            return False
        return True

    def _rerun(self, steps: list[Remembered]) -> None:
        """Run the kept ``steps`` (``Recovery.replay``) again on every rank, in order."""
        ft, workers = self._ft, self._workers
        assert ft is not None and workers is not None
        by_id = {v.id: v for v in self._variants.values()}
        for kept in steps:
            self._send_step(by_id[kept.variant], kept.header, kept.batch)
            self._snapshots_lost(workers.gather("step", self.timeout_s))
            ft.committed(kept.step, None)

    def _smaller_plan(self, alive: int) -> tuple[dict[str, int], list[Plan]]:
        """The mesh a shrink goes on with, and its plan for every program the run holds (the
        first call's first): the largest mesh ``alive`` ranks can form (``smaller_meshes``)
        that the step can be planned on, the lowest estimated step time among those of that
        size. Raises when none is left (fewer than ``elastic=`` ranks, or no plan)."""
        ft = self._ft
        assert ft is not None and ft.elastic is not None
        programs = [v.plan.graph for v in sorted(self._variants.values(), key=lambda v: v.id)]
        if not programs:
            programs = [self._traced.graph]
        tried: list[str] = []
        best: tuple[float, dict[str, int], list[Plan]] | None = None
        size = None
        for mesh in smaller_meshes(self.mesh, alive, ft.elastic):
            if best is not None and math.prod(mesh.values()) < size:
                break
            size = math.prod(mesh.values())
            try:
                if self.launcher == "mpi":       # the hosts must split the smaller mesh too
                    host_slots(self.hosts, size)
                elif self.launcher == "slurm" and self._allocation is not None:
                    slurm_nodes(self._allocation, size, self.slurm.nodes, say=False)
                first = self._plan_on(programs[0], mesh)
                pins = _state_pins(first)
                plans = [first, *(self._plan_on(g, mesh, pins=pins) for g in programs[1:])]
            except MeshplanError as exc:
                tried.append(f"{mesh}: {str(exc).splitlines()[0]}")
                continue
            if best is None or first.estimated_step_time_s < best[0]:
                best = (first.estimated_step_time_s, mesh, plans)
        if best is None:
            survive = f"{alive} rank{'s survive' if alive != 1 else ' survives'}"
            if not tried:
                raise RuntimeFailure(
                    f"{self.__name__}: {survive} of the mesh {self.mesh}, and elastic="
                    f"{ft.elastic} goes on with no fewer than {ft.elastic}; the run stops")
            raise RuntimeFailure(
                f"{self.__name__}: {survive} of the mesh {self.mesh}, and the step cannot be "
                f"planned on any mesh they can form: {'; '.join(tried)}")
        plans = best[2]
        for plan in plans:
            plan.solver["device"] = self._device_note
            plan.solver["fault_tolerance"] = self._ft_note
        return best[1], plans

    def _replace(self, failure: WorkerFailure) -> tuple[list[list[int]] | None, list[int]]:
        """Start only the failed ranks again while the others stay up: kill the failed ones
        (exited, stopped, or alive without their control connection), wait until every
        survivor has finished what it was doing (a survivor waiting on a dead peer in a
        collective gives up by itself: the shared-memory groups see the peer die, gloo its
        sockets close), start the replacements, set them up
        from their predecessors' snapshots, and build a new communicator on every rank.
        Returns the snapshot steps every rank holds and the new ranks, or ``(None, [])`` when
        this cannot be done (the caller starts every rank again)."""
        workers = self._workers
        if workers is None or workers.closed or not workers.can_respawn \
                or failure.reason not in ("exit", "stopped", "dropped"):
            return None, []
        ft = self._ft
        assert ft is not None
        failed = sorted(set(failure.ranks) | set(workers.failed_ranks()))
        workers.kill(failed)
        survivors = [r for r in range(workers.n) if r not in failed]
        phase = _Phases(ft.phases)
        if not workers.sync(survivors, max(_SYNC_S, 2 * self.hang_s)):
            logger.warning("meshplan: %s: a surviving rank did not come out of its step; "
                           "starting every rank again", self.__name__)
            return None, []
        phase("survivors out of their step")
        try:
            workers.respawn(failed, self.timeout_s)
            phase("replacement started")
            ft.generation += 1
            header, plans = self._setup_header(), self._plans_for_ranks(self.plan)
            for rank in failed:
                workers.send(rank, "setup", {
                    **header, **plans[rank], "state": [], "checkpoint": {}, "comm": False,
                    "snapshot": self._snapshot_header(rank, True)})
            workers.gather("setup", self.timeout_s, ranks=failed)
            phase("replacement set up")
            workers.broadcast("rejoin", {"generation": ft.generation})
            replies = workers.gather("rejoin", self.timeout_s)
            phase("communicator built")
        except (WorkerFailure, StepFailed) as exc:
            logger.warning("meshplan: %s: replacing %s failed (%s); starting every rank again",
                           self.__name__, _ranks_text(failed), str(exc).splitlines()[0])
            return None, []
        return [r.header["snapshots"] for r in replies], failed

    def _variant(self, args: tuple, kwargs: Mapping[str, Any]) -> Variant:
        """The mesh's program for a call with these arguments: traced, planned and sent to
        every rank the first time its key (``TracedStep.call_key``) is seen. The new plan keeps
        every state tensor where the running plan holds it, so no state moves."""
        key = self._traced.call_key(*args, **kwargs)
        known = self._variants.get(key)
        if known is not None:
            return known
        what = what_changed(self._primary_key, key)
        if self._pp:
            raise RuntimeFailure(
                f"{self.__name__}: this call differs from the first ({what} changed), and on "
                f"a mesh with a '{PP_AXIS}' axis the stages run the first call's program only "
                "(planning another for the same stages is not built yet): keep shapes, dtypes "
                "and Python arguments the same from call to call (DataLoader(drop_last=True), "
                "sequences padded to one length)")
        if len(self._variants) >= MAX_VARIANTS:
            raise RuntimeFailure(
                f"{self.__name__}: a call with new {what}, and the mesh already holds programs "
                f"for {MAX_VARIANTS} different calls; meshplan traces and plans each new one "
                "(as torch.compile recompiles), so a value that changes at every call makes "
                "every call a new program: keep shapes steady (DataLoader(drop_last=True), "
                "pad sequences to a few fixed lengths), pass changing numbers as tensors, and "
                "do not branch in Python on values of the arguments that change from call to "
                "call (use torch.where or masks)")
        graph = self._traced.steady_graph_for(*args, **kwargs)
        key = self._traced.call_key(*args, **kwargs)    # with the values the new graph read
        known = self._variants.get(key)
        if known is not None:
            return known
        logger.warning("meshplan: %s: a call with new %s; tracing and planning it (program "
                       "%d of at most %d on this mesh)", self.__name__,
                       what_changed(self._primary_key, key), len(self._variants) + 1,
                       MAX_VARIANTS)
        plan = self._plan_on(graph, pins=_state_pins(self.plan))
        variant = Variant.of(len(self._variants), plan, tuple(call_inputs(plan)))
        with self._recording_failures():
            self._add_program(variant)
        self._variants[key] = variant
        return variant

    def _add_program(self, variant: Variant, ranks: list[int] | None = None) -> None:
        """Send the ranks (all, or ``ranks``) the program of another call signature."""
        workers = self._workers
        assert workers is not None
        plans = self._plans_for_ranks(variant.plan)
        for rank in range(workers.n) if ranks is None else ranks:
            workers.send(rank, "add_program", {**plans[rank], "variant": variant.id,
                                               "data": list(variant.inputs)})
        workers.gather("add_program", self.timeout_s, ranks=ranks)

    def _step(self, variant: Variant, args: tuple, kwargs: Mapping[str, Any]) -> Any:
        plan, names = variant.plan, list(variant.inputs)
        data = [n.target for n in plan.graph.inputs_with_role(Role.DATA)]
        flat = self._traced.data_tensors(*args, **kwargs)
        if len(flat) != len(data):
            raise RuntimeFailure(f"{self.__name__}: expected {len(data)} tensor arguments "
                                 f"({', '.join(data)}), got {len(flat)}")
        batch = {**dict(zip(data, flat)), **self._traced.hyper_values()}
        if variant.id != 0:         # the first program's checks ran before it was chosen
            check_indices(variant.checks, batch, self.__name__)
        batch = {n: batch[n] for n in names}
        header = {"step": self._step_no, "variant": variant.id}
        if variant.random:
            header["seed"] = self._random_seed(variant)
        ft = self._ft
        if ft is not None:
            header["snapshot"] = ft.wants_snapshot(self._step_no)
            ft.remember(self._step_no, variant.id, header, batch)
        start_us, t0 = steps_timer()
        recovered = None
        while True:
            try:
                with self._recording_failures():
                    self._send_step(variant, header, batch)
                    limit = self.timeout_s if ft is None else ft.deadline(self.timeout_s)
                    replies = self._workers.gather(
                        "step", limit, advice=None if limit >= self.timeout_s else (
                            f"fault tolerance's step deadline ({limit:.1f} s: ten times the "
                            f"usual step, at least hang_s={self.hang_s:g}) passed; if the "
                            "step is just slow, raise hang_s"))
                break
            except WorkerFailure as exc:
                recovered = self._recover(exc, self._step_no)
                # a shrink (elastic=) planned every program again for the smaller mesh
                variant = next(v for v in self._variants.values() if v.id == variant.id)
        dur_s = time.perf_counter() - t0
        if ft is not None:
            self._snapshots_lost(replies)
            ft.committed(self._step_no, None if recovered else dur_s)
            if recovered:
                self._said_recovered(*recovered, step=self._step_no)
        self.last_comm = [list(r.header["comm"]) for r in replies]
        results = list(replies[0 if self._stages is None else self._stages.result_rank].tensors)
        if self._tel is not None:
            self._tel.step(self._step_no, start_us, int(dur_s * 1e6), results)
        shipper = self._shipper
        if shipper is not None and shipper.ranks and \
                time.monotonic() - shipper.shipped_at >= SHIP_EVERY_S:
            with self._recording_failures():
                self._ship_segments()
        self._step_no += 1
        return self._traced.pack_results(results, plan.graph)

    def _snapshots_lost(self, replies: list[Any]) -> None:
        """Ranks whose snapshot copy of an earlier step failed (``Snapshot.settle``): that
        step is not a snapshot to go back to; the one before it is, and the batches since it
        stay kept. Said once per failed copy, and kept as a ``failures`` row (kind
        ``snapshot``)."""
        ft = self._ft
        assert ft is not None
        for rank, reply in enumerate(replies):
            if reply.header.get("replica_lost"):
                why = reply.header["replica_lost"]
                logger.warning("meshplan: %s: rank %d: %s; its snapshots go on without a copy "
                               "on another host (a loss of its host now loses them)",
                               self.__name__, rank, why)
                if self._tel is not None:
                    self._tel.snapshot_lost(rank, self._step_no, f"replica: {why}")
            for step, why in reply.header.get("snapshots_lost", ()):
                ft.lost(int(step))
                logger.warning("meshplan: %s: rank %d could not copy its snapshot of step %d "
                               "(%s); a recovery now goes back to the snapshot before it, and "
                               "the run goes on", self.__name__, rank, step, why)
                if self._tel is not None:
                    self._tel.snapshot_lost(rank, int(step), why)

    def _send_step(self, variant: Variant, header: Mapping[str, Any],
                   batch: Mapping[str, torch.Tensor]) -> None:
        """Send every rank its pieces of ``batch`` for one step of ``variant``."""
        workers, names = self._workers, list(variant.inputs)
        assert workers is not None
        mb, stages = self._program_plan(variant.plan), self._stages
        for rank in range(workers.n):
            # a pipeline: every stage gets its rank's pieces of the whole batch (the first
            # reads the inputs, the last the targets), cut into micro-batches there
            pieces = (split_inputs(variant.plan, stages.inner_rank(rank), batch)
                      if stages is not None else split_inputs(variant.plan, rank, batch)
                      if mb is None else split_microbatched(mb, rank, batch))
            workers.send(rank, "step", dict(header), [pieces[n] for n in names])

    def _said_recovered(self, failure: WorkerFailure, restored: int, started: float,
                        step: int | None = None) -> None:
        """One line and one ``recoveries`` row once the interrupted call has gone through
        (``step``: the step it was, None between steps)."""
        took = time.monotonic() - started
        replayed = self._step_no - restored - (step is None)
        ft = self._ft
        assert ft is not None and self._workers is not None
        new = ft.replaced
        how = (f"started {_ranks_text(new)} again" if len(new) < self._workers.n
               else "started every rank again")
        if ft.shrunk is not None:
            before, after = ft.shrunk
            how = (f"the mesh shrank from {before} to {after} ({self.plan.strategy} plan, "
                   f"estimated {self.plan.estimated_step_time_s * 1e3:.1f} ms per step)")
        elif ft.moved and self.launcher == "k8s":
            how = (f"every rank started again, those of {', '.join(ft.moved)} in the pod"
                   f"{'s' * (len(ft.moved) != 1)} the Job made in "
                   f"{'their' if len(ft.moved) != 1 else 'its'} place")
        elif ft.moved:
            now = (f"Slurm nodes now {', '.join(self._slurm_nodes(self._workers.n))}"
                   if self.launcher == "slurm" else f"hosts now {self.hosts}")
            how = (f"every rank started again, those of {', '.join(ft.moved)} on spare "
                   f"{'nodes' if self.launcher == 'slurm' else 'hosts'} ({now})")
        logger.warning("meshplan: %s: recovered %.1f s after the failure was seen: %s, every "
                       "rank went back to its snapshot after step %d and re-ran %d step%s%s",
                       self.__name__, took, how, restored, replayed, "s" * (replayed != 1),
                       "" if step is None else " (the interrupted one included)")
        if ft.phases:
            logger.info("meshplan: %s: the recovery's parts: %s, then the interrupted step",
                        self.__name__, ", ".join(f"{k} {v * 1e3:.0f} ms"
                                                 for k, v in ft.phases.items()))
            ft.phases = {}
        if self._tel is not None:
            self._tel.recovery(failure, step=step, restart=self.restarts, restored=restored,
                               replayed=replayed, took_s=took, plan=self.plan)
        ft.shrunk, ft.moved = None, []

    def _recalibrate(self) -> None:
        """``distribute(calibrate=)``: fit the cost model to the steps just run (their op times
        and collectives, ``from_telemetry``), plan again with the fitted machine, and when the
        plan changes, move the state to it (gathered here, the mesh started again on the new
        plan at the next call; step numbers, so random ops, carry on). Says what it did in one
        line and keeps it in ``self.calibration``."""
        from ..planner._calibrate import from_telemetry
        from ..telemetry import Store

        before, run = self.plan, self.run_id
        # the ranks write what the steps recorded first: a flush (Parquet, and the writer's
        # first imports) running beside the probes slowed whole probe series 5-6x here
        self.flush_telemetry()
        self._probe_links()
        self.flush_telemetry()
        try:
            with Store.open(self.telemetry.db) as store:
                fit = from_telemetry(store, run, base=self.topology)
        except MeshplanError as exc:
            logger.warning("meshplan: %s: calibration skipped (%s); the plan stays as it is",
                           self.__name__, exc)
            return
        plan = self._plan_on(self._traced.graph, topology=fit.topology)
        replanned = _program_key(plan) != _program_key(before)
        if not replanned and plan.bucket_bytes != before.bucket_bytes:
            # the same layouts and collectives: a new gradient bucket cap alone is not worth
            # starting the mesh again for; the running program's cap stays
            plan = dataclasses.replace(plan, bucket_bytes=before.bucket_bytes)
        self.calibration = RunCalibration(
            fit=fit, run_id=run, measured_step_s=fit.measured_step_s, before=before.estimate(),
            after=plan.estimate(), replanned=replanned)
        logger.warning("meshplan: %s: %s", self.__name__, self.calibration.summary())
        self.topology = fit.topology          # programs planned from now on use it too
        if not replanned:
            self._plan = plan                 # the same program; its estimates fitted
            return
        self.sync()                           # the state, whole, on the controller
        self._resume_step = self._step_no
        self.shutdown()
        self._plan, self._variants = plan, {}

    def _probe_links(self) -> None:
        """Every rank times blocking collectives on its mesh axes (``backends/_probe.py``):
        what the links are fitted to, since the calibrating steps' own collectives hold
        compute (gradient buckets) or skew (the loss). The samples go to the run's
        ``link_probes`` rows, where ``from_telemetry`` (here and in ``meshplan calibrate
        --from-telemetry``) finds them. Nothing on a mesh of one rank."""
        from ..backends._probe import SIZES

        workers = self._workers
        if workers is None or workers.n < 2 or self._tel is None:
            return
        workers.broadcast("probe_links", {"bytes": list(SIZES)})
        names = self.plan.mesh.names
        for rank, reply in enumerate(workers.gather("probe_links", self.timeout_s)):
            for s in reply.header["samples"]:
                self._tel.rec.add("link_probes", (
                    s["kind"], names[int(s["axis"])], int(s["group_size"]), int(s["bytes"]),
                    float(s["seconds"]) * 1e6), rank=rank)

    def _random_seed(self, variant: Variant) -> int:
        """The run's seed, drawn from the controller's CPU generator the first time a program
        with random ops runs (unless given); says once that random ops differ from one process."""
        if self._seed is None:
            self._seed = int(torch.randint(0, 2**63 - 1, ()).item())
        if not self._random_said:
            self._random_said = True
            nodes = {n.name: n for n in variant.plan.graph.nodes}
            first = nodes[variant.random[0]]
            where = f", first {first.target} at {first.source}" if first.source else ""
            n = len(variant.random)
            logger.warning("meshplan: %s has %d random op%s%s; %s; this run's seed is %d",
                           self.__name__, n, "s" * (n != 1), where, RANDOM_SEMANTICS,
                           self._seed)
        return self._seed

    @contextlib.contextmanager
    def _recording_failures(self):
        try:
            yield
        except (WorkerFailure, StepFailed) as exc:
            if self._tel is not None:
                self._tel.failure(exc, self._step_no)
            raise

    def _gather_state(self, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        while True:
            try:
                with self._recording_failures():
                    return self._gather_state_once(names)
            except WorkerFailure as exc:
                self._said_recovered(*self._recover(exc, self._step_no))

    def _gather_state_once(self, names: Sequence[str] | None = None
                           ) -> dict[str, torch.Tensor]:
        workers, plan = self._workers, self.plan
        assert workers is not None
        # under mpi rank 0 reads every rank's pieces by RMA (the same names on every rank:
        # not a pipeline's, whose stages hold different state)
        header: dict[str, Any] = {"rma": self.launcher == "mpi" and not self._pp}
        if names is not None:
            header["names"] = sorted(names)
        workers.broadcast("get_state", header)
        replies = workers.gather("get_state", self.timeout_s)
        held = [dict(zip(msg.header["names"], msg.tensors)) for msg in replies]
        if replies[0].header.get("ranks"):      # mpi: rank 0 read every rank's pieces by RMA
            got, ts = replies[0].header["names"], replies[0].tensors
            held = [dict(zip(got, ts[r * len(got):(r + 1) * len(got)]))
                    for r in range(workers.n)]
        if self._stages is not None:            # each tensor from its stage's ranks
            stages, owners, out = self._stages, self._owners(), {}
            for name, stage in owners.items():
                if names is not None and name not in names:
                    continue
                out.update(_assemble_state(plan, [{name: held[r][name]}
                                                  for r in stages.ranks_of(stage)]))
            return out
        return _assemble_state(plan, held)

    def _write_local(self, values: Mapping[str, torch.Tensor]) -> None:
        self._traced.write_state(dict(values), *self._example_data())


def resolve_device(device: str | None, launcher: str) -> tuple[str, str]:
    """``distribute(device=)`` -> ("cpu" | "cuda", the plan summary's note on it)."""
    seen = torch.cuda.is_available()
    if device is None:
        device = "cuda" if seen and launcher != "mpi" else "cpu"
        how = ("the default under launcher='mpi', whose MPI takes host memory"
               if seen and launcher == "mpi" else "the default")
    else:
        how = "as asked"
    if device not in ("cpu", "cuda"):
        raise RuntimeFailure(f"distribute(device={device!r}): pass 'cuda' (each rank takes "
                             "the GPU of its local rank) or 'cpu'; a rank's GPU is chosen by "
                             "its launcher, not by an index here")
    if device == "cuda" and not seen and launcher in ("slurm", "k8s"):
        # a login node or a laptop often has no GPU: each rank checks its own node or pod
        # (handlers._rank_device)
        where = "node" if launcher == "slurm" else "pod (k8s gpus_per_pod)"
        return device, (f"cuda ({how}; the controller sees no GPU, each rank needs one in its "
                        f"{where}), NCCL between ranks with their own GPU, gloo through host "
                        "memory between ranks that share one")
    if device == "cuda" and not seen:
        build = torch.version.cuda or "none: a CPU build"
        raise RuntimeFailure(f"distribute(device='cuda'): torch sees no GPU on this host "
                             f"(torch {torch.__version__}, CUDA {build}; "
                             "torch.cuda.is_available() is False); pass device='cpu', or run "
                             "where a GPU and a CUDA build of torch are")
    if device == "cuda" and launcher == "mpi":
        raise RuntimeFailure("distribute(device='cuda', launcher='mpi'): the mpi launcher's "
                             "collectives and one-sided transfers take host memory (meshplan's "
                             "MPI is not CUDA-aware); use launcher='local' or 'slurm' (NCCL "
                             "between GPUs), or device='cpu'")
    if device == "cuda":
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        return device, (f"cuda ({how}; this host sees {torch.cuda.device_count()} GPU"
                        f"{'s' * (torch.cuda.device_count() != 1)}: {', '.join(names)}); "
                        "each rank takes the GPU of its local rank, NCCL between ranks with "
                        "their own GPU, gloo through host memory between ranks that share one")
    between = "MPI" if launcher == "mpi" else "gloo"
    return device, (f"cpu ({how}{'' if seen else '; this host sees no GPU'}), {between} "
                    "between ranks")


def gpu_topology() -> str:
    """The cost model's machine for ranks on this host's GPUs: the preset named like the
    GPU (a100, h100, h200, b200), else h100 with a warning."""
    from ..planner._mesh import PRESETS

    name = torch.cuda.get_device_name(0).lower() if torch.cuda.is_available() else \
        "GPUs the controller does not see"
    for preset in ("b200", "h200", "h100", "a100"):
        if preset in name and preset in PRESETS:
            return preset
    logger.warning("meshplan: no cost-model preset for %s; planning with h100's numbers "
                   "(pass topology=, or calibrate=True to fit this machine)", name)
    return "h100"


def distribute(fn: Callable[..., Any] | None = None, *, mesh: Mapping[str, int],
               launcher: str = "local", topology: Any = None, strategy: str = "auto",
               plan: str | Plan | PipelinePlan | None = None, example_inputs: Any = None,
               memory_limit_bytes: int | None = None, timeout_s: float = 300.0,
               telemetry: Any = None, kernels: bool | None = None,
               checkpoint: str | os.PathLike | None = None, seed: int | None = None,
               precision: str | None = None, recompute: Any = "auto",
               calibrate: bool | int = False, hosts: Any = None, slurm: Any = None,
               device: str | None = None, fault_tolerance: bool | None = None,
               max_restarts: int = 3, snapshot_every: int = 1,
               hang_s: float = STOPPED_S, elastic: bool | int = False,
               k8s: Any = None, microbatches: int | None = None,
               schedule: str | None = None) -> Any:
    """Run ``fn`` (an ordinary training step: forward, ``loss.backward()``, ``opt.step()``)
    on a mesh of processes, e.g. ``@meshplan.distribute(mesh={"dp": 2, "tp": 2})``.

    ``strategy``: ``"auto"`` (the planner's search) or a hand family (``"dp"``, ``"fsdp"``,
    ``"megatron_tp"``); ``plan``: a saved plan (path) or a ``Plan`` to run instead of
    planning (on a mesh with a ``pp`` axis: a ``PipelinePlan`` or its file, run as
    compiled); ``topology``: the cost model's machine (default ``"cpu"``); ``timeout_s``: how
    long any rank may take to answer before the run is stopped with ``RuntimeFailure``;
    ``telemetry``: where and how much every rank records (``telemetry/SCHEMA.md``): None (the
    default: level ``collectives`` into ``.meshplan/telemetry.duckdb``, or wherever
    ``$MESHPLAN_TELEMETRY`` says; ``off`` there turns it off), False, a database path, or a
    ``meshplan.telemetry.TelemetryConfig``; ``kernels``: let the lowering substitute the
    registry's kernels for matching op chains (``meshplan.kernels``; the default follows
    ``MESHPLAN_KERNELS``, on unless it says ``off``), False for the plan's ops only;
    ``checkpoint``: a file from ``save_checkpoint`` to start from (see ``load_checkpoint``);
    ``seed``: the seed of random ops such as dropout, which on the mesh do not match one process
    bit for bit (README, "Random ops on a mesh"); None (the default) draws it from torch's CPU
    generator at the first call that needs it, so ``torch.manual_seed(s)`` before the run
    reproduces it. The same seed, mesh and plan give the same results. ``precision``:
    ``"bf16"`` (or ``"fp16"``) runs the step as FSDP2's mixed precision does (16-bit compute
    copies of fp32 parameters, fp32 gradient reductions; ``frontend/_precision.py``); None or
    ``"fp32"``: as written. ``recompute``: activation recompute of the repeated layers,
    ``"auto"`` (the planner decides when memory is short), ``"none"``, ``"selective"``,
    ``"full"`` or ``(policy, layers)`` (``plan_graph``; README, "Activation recompute").
    ``calibrate``: True (16 steps) or a number of mesh steps: time every op of the first mesh
    steps, fit the cost model's machine to those times and the collectives' (``meshplan
    calibrate --from-telemetry`` does the same from a store), plan again with it, and if the
    plan changes, go on with the new one (the state moves through the controller once); one
    line says what happened, ``step.calibration`` holds it. Needs telemetry; not with ``plan=``.
    ``hosts``: under ``launcher="mpi"``, where the ranks run: host names (``["a", "b"]``,
    ``"a:4,b:4"`` with slots) or a hostfile (``host[:slots]`` per line); consecutive ranks
    share a host, so the innermost mesh axes stay inside one. None (the default) reads
    ``$MESHPLAN_HOSTS`` (``meshplan sandbox run`` sets it), else runs every rank here.
    ``launcher="slurm"``: the ranks start with ``srun`` on the nodes of the Slurm allocation the
    controller runs in (``salloc``, ``sbatch``), or, outside one, of one it asks ``salloc`` for
    and gives back at shutdown; ``slurm``: its options, e.g. ``{"nodes": 2, "partition": "gpu",
    "time": 30}`` (``runtime._slurm_launch.SlurmOptions``). ``device``: where the ranks compute,
    ``"cuda"`` (each rank takes ``cuda:<local rank>``; its state moves there once, batches once
    per step, losses come back; NCCL between ranks with a GPU each, gloo through host memory
    between ranks that share one) or ``"cpu"``; None (the default): ``"cuda"`` when this host
    sees a GPU, else ``"cpu"``; the plan summary says which. Not under ``launcher="mpi"``.
    ``fault_tolerance``: None (the default) turns it on for CPU ranks under the local, mpi
    and slurm launchers, where it was measured to cost under 3 % of the step, unless the
    snapshots would take more than half of this host's available memory; off on GPU ranks
    (not measured yet) and under k8s (not measured on a cluster);
    ``$MESHPLAN_FAULT_TOLERANCE`` (``auto``, ``on``, ``off``) changes that default;
    ``step.fault_tolerance`` and the plan summary say which holds. On (True) it keeps every
    rank's state in memory after every ``snapshot_every``-th step (a copy per rank, in memory
    files the controller holds, or on another host a snapshot keeper there, with a copy on
    the next host's keeper) and the batches since; when a rank exits, is killed, stays
    stopped for ``hang_s`` or a step outlives ten times the usual step time (never less than
    ``hang_s``), the controller restarts the mesh, brings every rank back to the newest
    snapshot and re-runs the steps since: the call returns what it would have, the state is
    bit for bit the fault-free run's, and a warning line and the telemetry's ``failures``
    and ``recoveries`` rows say what happened. After ``max_restarts`` restarts in one run,
    ``RuntimeFailure``. Every launcher: local, mpi
    (``hosts=`` too), slurm, and k8s (each pod's agent keeps its ranks' snapshots and starts
    them again; an evicted pod's ranks start in the pod the Job makes in its place; README,
    "Fault tolerance"). ``hang_s``: how
    long a rank may stay stopped (SIGSTOP) while
    the controller waits for it before it counts as failed (default 10 s). ``elastic``
    (with fault tolerance): True, or the fewest ranks to go on with, makes a failure shrink
    the mesh instead of starting the failed ranks again: the step is planned again for the
    largest mesh the surviving ranks can form (the same axes, none larger; the lowest
    estimated step time among meshes of that size), the newest snapshot's state moves to it
    through the controller, the kept steps re-run on it, and the run goes on there, with the
    same global batch; the results then follow the smaller mesh's sums, not bit for bit the
    old mesh's. The warning line and the ``recoveries`` row name the new mesh. Under mpi with
    ``hosts=``, a lost host (no heartbeat) is dropped, its ranks' snapshots read from their
    copies on the next host: hosts the mesh leaves unused are spares, on which the same mesh
    starts again (bit for bit); without one, ``elastic`` shrinks it onto the hosts left, and
    without ``elastic``, ``RuntimeFailure`` says so.
    ``launcher="k8s"``: the ranks run in the pods of an Indexed Job (with a headless Service
    and a Secret holding the channel key) made with the ``kubernetes`` client from
    ``$KUBECONFIG``; ``k8s``: its options (``runtime._k8s.K8sOptions``), e.g. ``{"image":
    "registry/train:1", "pods": 4, "gpus_per_pod": 8, "namespace": "ml"}``; the pods must
    reach this machine (README, "Kubernetes").
    ``microbatches``: run each rank's batch in that many parts, one after another, their
    gradients summed, the optimizer once (gradient accumulation; README, "Micro-batches"):
    the activations of one part at a time, and results equal to the whole batch at once (the
    mean loss's count is the whole batch's). It must divide each rank's batch; a step whose
    ops need the whole batch at once (a batch norm's statistics) is refused by name. None
    or 1: the whole batch at once.
    A ``pp`` axis in ``mesh`` (``{"pp": 2, "dp": 2}``): pipeline stages, ranges of the step's
    repeated layers planned by ``planner.plan_pipeline`` and run in GPipe's, 1F1B's,
    interleaved 1F1B's or ZB-H1's order (the fastest by the cost model), each
    stage's ranks holding that stage's state (README, "Pipeline stages"); ``microbatches``
    is then the stages' micro-batch count (None: the planner's choice), ``schedule``
    ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or ``"zb-h1"`` (None: the fastest by the cost
    model; the
    planner picks interleaved's chunks per device), ``step.pipeline`` the pipeline plan, and
    ``plan=`` a compiled one. Not yet with fault tolerance or ``calibrate``.
    """
    def wrap(f: Callable[..., Any]) -> DistributedStep:
        return DistributedStep(f, mesh=mesh, launcher=launcher, topology=topology,
                               strategy=strategy, plan=plan, example_inputs=example_inputs,
                               memory_limit_bytes=memory_limit_bytes, timeout_s=timeout_s,
                               telemetry=telemetry, kernels=kernels, checkpoint=checkpoint,
                               seed=seed, precision=precision, recompute=recompute,
                               calibrate=calibrate, hosts=hosts, slurm=slurm, device=device,
                               fault_tolerance=fault_tolerance, max_restarts=max_restarts,
                               snapshot_every=snapshot_every, hang_s=hang_s,
                               elastic=elastic, k8s=k8s, microbatches=microbatches,
                               schedule=schedule)

    return wrap(fn) if fn is not None else wrap


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RunCalibration:
    """What ``distribute(calibrate=)`` did: the fit (``planner._calibrate.TelemetryFit``),
    the calibrating run's median measured step (slowest rank, the first mesh step left out),
    the plan's estimate before and after, and whether the step now runs a new plan."""

    fit: Any
    run_id: str | None
    measured_step_s: float | None
    before: Any                       # PlanEstimate
    after: Any
    replanned: bool

    def summary(self) -> str:
        got = (f"measured {self.measured_step_s * 1e3:.1f} ms per step, "
               if self.measured_step_s else "")
        what = (f"re-planned ({self.after.strategy}), the mesh restarts on the new plan"
                if self.replanned else "the plan is unchanged")
        return (f"calibrated on run {self.run_id}: {got}estimated "
                f"{self.before.estimated_step_time_s * 1e3:.1f} ms before, "
                f"{self.after.estimated_step_time_s * 1e3:.1f} ms with the fitted machine; {what}")


class _Phases:
    """Times a recovery's parts into ``into`` (name -> seconds since the previous one)."""

    def __init__(self, into: dict[str, float]) -> None:
        self.into, self.last = into, time.monotonic()

    def __call__(self, name: str) -> None:
        now = time.monotonic()
        self.into[name] = self.into.get(name, 0.0) + now - self.last
        self.last = now


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise RuntimeFailure(f"distribute({name}={value!r}): pass a positive number of seconds")
    return float(value)


ENV_FAULT_TOLERANCE = "MESHPLAN_FAULT_TOLERANCE"   # auto (the default), on or off
# the most of this host's available memory (/proc/meminfo) the snapshots of a run that did not
# ask for fault tolerance may take: past it, the default leaves fault tolerance off
AUTO_MEMORY_SHARE = 0.5
AUTO_ON = ("on (the default for CPU ranks: snapshots every step, a failed rank restarted from "
           "them; fault_tolerance=False turns it off)")


PP_FT_OFF = ("off: snapshots and recovery of pipeline stages are not built yet (a failed rank "
             "stops the run with RuntimeFailure; save_checkpoint() and load_checkpoint() work)")


def _refuse_in_pipeline(mesh: Mapping[str, int], *, fault_tolerance: Any, elastic: Any,
                        calibrate: Any) -> None:
    """What ``distribute`` does not do yet on a mesh with a ``pp`` axis: one error each,
    before tracing."""
    named = _mesh_text(mesh)
    if fault_tolerance is True or (elastic is not None and elastic is not False):
        asked = "fault_tolerance=True" if fault_tolerance is True else f"elastic={elastic!r}"
        raise RuntimeFailure(
            f"distribute({asked}) on mesh {named}: snapshots and recovery of pipeline stages "
            f"are not built yet; drop {asked.split('=')[0]}= (the run then stops on a failed "
            f"rank; save_checkpoint() and load_checkpoint() work), or fold '{PP_AXIS}' into "
            "dp to keep fault tolerance")
    if calibrate:
        raise RuntimeFailure(
            f"distribute(calibrate={calibrate!r}) on mesh {named}: the calibration fits the "
            "cost model to whole-batch op times and the stages run micro-batches; calibrate a "
            f"run without '{PP_AXIS}' and pass its topology")


def _pipeline_plan_arg(plan: Any, mesh: Mapping[str, int]) -> PipelinePlan | None:
    """``plan=`` on a mesh with a ``pp`` axis: a ``PipelinePlan``, or the path of one's file
    (``PipelinePlan.save``, ``meshplan compile --mesh pp=...``), read now; a plan of a mesh
    without stages is refused by name."""
    if plan is None or isinstance(plan, PipelinePlan):
        return plan
    named = _mesh_text(mesh)
    if isinstance(plan, Plan):
        raise RuntimeFailure(
            f"distribute(plan=...) on mesh {named}: the plan holds one mesh's layouts "
            f"({plan.mesh}), not a pipeline's stages; pass a pipeline plan (`meshplan compile "
            f"FILE.py:STEP --mesh {named} -o step.plan` writes one) or drop plan= "
            "(distribute plans the stages itself)")
    try:
        return PipelinePlan.load(plan)
    except PlanError as e:
        raise RuntimeFailure(f"distribute(plan={os.fspath(plan)!r}) on mesh {named}: {e}") \
            from None


def _mesh_text(mesh: Mapping[str, int]) -> str:
    return ",".join(f"{a}={n}" for a, n in dict(mesh).items())


def _fault_tolerance_default(on: Any, elastic: Any, launcher: str,
                             device: str) -> tuple[Any, str]:
    """What ``distribute(fault_tolerance=None)`` (the default) means here, and the plan
    summary's line on it: on for CPU ranks under the local, mpi and slurm launchers, where
    snapshots after every step were measured to cost under 3 % of the step (README, "Fault
    tolerance"); off under k8s (its cost on a cluster is not measured) and on GPU ranks (the
    copy of their state to host memory every step is not measured yet).
    ``$MESHPLAN_FAULT_TOLERANCE`` (``auto``, ``on``, ``off``) changes the default; ``elastic=``
    asks for it."""
    if on is not None:
        return on, "on, as asked" if on is True else "off, as asked"
    if elastic is not None and elastic is not False:
        return True, "on (elastic= needs it)"
    env = os.environ.get(ENV_FAULT_TOLERANCE, "auto").strip().lower() or "auto"
    if env not in ("auto", "on", "off"):
        raise RuntimeFailure(f"${ENV_FAULT_TOLERANCE}={env!r}: set it to auto (the default: "
                             "on for CPU ranks), on or off")
    if env == "off":
        return False, f"off (${ENV_FAULT_TOLERANCE}=off)"
    if env == "on":
        return True, f"on (${ENV_FAULT_TOLERANCE}=on)"
    if launcher == "k8s":
        return False, ("off: the default under launcher='k8s' until its cost on a cluster is "
                       "measured (each pod's agent keeps its ranks' snapshots, copied to the "
                       "next pod's); fault_tolerance=True turns it on")
    if device != "cpu":
        return False, ("off: the default on GPU ranks until the cost of copying their state "
                       "to host memory every step is measured; fault_tolerance=True turns it on")
    return True, AUTO_ON


def _available_memory() -> int | None:
    """MemAvailable of /proc/meminfo, in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _fault_tolerance(on: Any, launcher: str, max_restarts: Any,
                     snapshot_every: Any, hang_s: float, elastic: Any = False
                     ) -> Recovery | None:
    if not (elastic is None or isinstance(elastic, bool) or
            (isinstance(elastic, int) and elastic >= 1)):
        raise RuntimeFailure(f"distribute(elastic={elastic!r}): pass True (go on with the "
                             "surviving ranks, down to one) or the fewest ranks to go on with "
                             "(an int >= 1)")
    if on is False or on is None:
        if elastic is not None and elastic is not False:
            raise RuntimeFailure(f"distribute(elastic={elastic!r}) shrinks the mesh when a "
                                 "rank fails, which needs fault_tolerance=True (its snapshots "
                                 "are what the smaller mesh starts from)")
        return None
    if on is not True:
        raise RuntimeFailure(f"distribute(fault_tolerance={on!r}): pass True or False")
    if launcher == "k8s" and elastic is not None and elastic is not False:
        raise RuntimeFailure(
            f"distribute(elastic={elastic!r}, launcher='k8s'): shrinking the mesh is not built "
            "for pods (their Job keeps its pod count; a failed rank is started again in its "
            "pod); drop elastic=, or use launcher='local', 'mpi' or 'slurm'")
    for name, value in (("max_restarts", max_restarts), ("snapshot_every", snapshot_every)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (
                0 if name == "max_restarts" else 1):
            least = 0 if name == "max_restarts" else 1
            raise RuntimeFailure(f"distribute({name}={value!r}): pass an int >= {least}")
    least = None if elastic is None or elastic is False else 1 if elastic is True else elastic
    return Recovery(max_restarts=max_restarts, snapshot_every=snapshot_every, hang_s=hang_s,
                    elastic=least)


# distribute(calibrate=True): the fit reads the median of the steps after the first. Of 15,
# a slow step or two (a rank's first telemetry flush, 2 s in, made one 30-50 % slower on 4
# ranks sharing 2 cores) move it little, and the 2-4 s they take are less often all inside
# one of a machine's slow periods than 4 steps were (benchmarks/README.md, "Calibration")
CALIBRATION_STEPS = 16


def _calibration_steps(calibrate: Any, telemetry: TelemetryConfig | None,
                       plan: Any) -> int:
    if calibrate is False or calibrate is None or calibrate == 0:
        return 0
    steps = CALIBRATION_STEPS if calibrate is True else calibrate
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 2:
        raise RuntimeFailure(f"distribute(calibrate={calibrate!r}): pass True "
                             f"({CALIBRATION_STEPS} steps) or the number of mesh steps to fit "
                             "to, at least 2 (the first warms up)")
    if telemetry is None:
        raise RuntimeFailure("distribute(calibrate=...) fits the cost model to the op and "
                             "collective times the ranks record, and telemetry is off: pass "
                             "telemetry=None (the default) or a database path")
    if plan is not None:
        raise RuntimeFailure("distribute(calibrate=...) plans again with the fitted machine, "
                             "and plan= fixes the plan: drop one of them")
    return steps


def _program_key(plan: Plan) -> tuple:
    """What the lowering makes a program from, but for the bucket cap: layouts and
    redistributions."""
    return (tuple((p.node, p.inputs, p.outputs) for p in plan.placements),
            tuple((r.value, r.consumer, r.src, r.dst) for r in plan.redistributions))


def _piece_keys(plan: Plan, names: list[str]) -> dict[tuple[int, str], tuple]:
    """(rank, name) -> what identifies the piece of ``name`` that rank holds: the name, where
    the piece lies in the whole tensor, and whether it is a Partial axis's zeros. Ranks with
    equal keys hold equal pieces (replicas)."""
    sizes, layouts = plan.mesh.sizes, plan.input_layouts
    shapes = {n.target: n.meta.shape for n in plan.graph.inputs}
    keys = {}
    for rank in range(math.prod(sizes)):
        coords = rank_coords(rank, sizes)
        for name in names:
            where = tuple((s.start, s.stop) for s in
                          local_slices(shapes[name], layouts[name], sizes, coords))
            keys[(rank, name)] = (name, where, holds_zeros(layouts[name], coords))
    return keys


def _assemble_state(plan: Plan, held: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Whole state tensors from every rank's pieces (``held[rank]``: name -> its piece)."""
    sizes = plan.mesh.sizes
    coords = [rank_coords(rank, sizes) for rank in range(len(held))]
    return {name: assemble({c: h[name] for c, h in zip(coords, held)},
                           plan.input_layouts[name], sizes)
            for name in held[0]}


def _state_pins(plan: Plan) -> dict[str, Any]:
    """Where ``plan`` holds every state tensor: the pins that keep another program's state
    where this one's is."""
    return {n.target: plan.input_layouts[n.target] for n in plan.graph.inputs
            if n.meta.role in STATE_ROLES}


def _owned(values: Mapping[str, Any], owners: dict[tuple[int, str], int] | None,
           rank: int) -> dict[str, Any]:
    """The values whose piece ``rank`` gets from the controller (all of them without owners)."""
    if owners is None:
        return dict(values)
    return {k: v for k, v in values.items() if owners[(rank, k)] == rank}


def _stamp(path: str) -> tuple[int, int, int] | None:
    """Identity and version of a file (inode, size, mtime), None if it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns
