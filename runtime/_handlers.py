"""What a worker does for the controller: set up its program and communicator from a plan,
run steps, hand out or take in its pieces of the state, and answer live telemetry queries.
Loaded into every worker through ``MESHPLAN_WORKER_PLUGINS``."""

from __future__ import annotations

import time
import traceback
from typing import Any

import torch

from ..backends import (
    HostStagedCommunicator,
    MPICommunicator,
    StepAborted,
    StepRNG,
    TorchCommunicator,
    Transfer,
    all_axis_groups,
    holds_zeros,
    local_slices,
    lower,
    rank_coords,
    run,
)
from .._errors import RuntimeFailure
from ..backends._microbatch import MicrobatchProgram, lower_microbatched, run_microbatched
from ..backends._pipeline_run import StageProgram, Stages, lower_pipeline, run_pipeline
from ..ir import STATE_ROLES
from ..planner import Plan
from ..telemetry import TelemetryConfig
from ._telemetry import WorkerTelemetry, state_device, steps_timer
from ._worker import WorkerState, register
from . import _transfer  # noqa: F401  (registers the transfer handlers)


@register("setup")
def _setup(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    plan = _header_plan(header, "plan")
    ns = state.ns
    ns.plan = plan
    # a pipeline mesh (a pp axis): this rank runs one stage and holds that stage's state, its
    # pieces laid out by every stage's plan at its rank there (backends/_pipeline_run.py)
    ns.stages = Stages.from_json(header["stages"], plan) if header.get("stages") else None
    ns.piece_rank = state.rank if ns.stages is None else ns.stages.inner_rank(state.rank)
    ns.sizes = plan.mesh.sizes if ns.stages is None else ns.stages.mesh.sizes
    ns.result_rank = 0 if ns.stages is None else ns.stages.result_rank
    ns.device, shared_gpu = _rank_device(state, str(header.get("device", "cpu")))
    ns.state = {k: v.to(ns.device) for k, v in zip(header["state"], tensors)}
    if header.get("checkpoint"):          # the rest of the state: this rank's pieces of a file
        ns.state.update({k: v.to(ns.device) for k, v in
                         _checkpoint_pieces(ns.piece_rank, plan, header["checkpoint"]).items()})
    ns.shared_gpu, ns.timeout_s = shared_gpu, float(header.get("timeout_s", 300.0))
    snap = header.get("snapshot")
    if snap:                              # distribute(fault_tolerance=True): _snapshot.py
        _open_snapshot(state, snap)
    ns.kernels = bool(header.get("kernels", True))
    ns.program = _program(state, plan, header)
    ns.programs = {0: (ns.program, list(header["data"]))}
    # a replacement rank (distribute(fault_tolerance=True)) builds it with the others: rejoin
    if getattr(ns, "comm", None) is None and header.get("comm", True):
        ns.comm = _communicator(state, int(header.get("generation", 0)))
    tel = header.get("telemetry")
    reply: dict[str, Any] = {"rank": state.rank}
    if tel is not None and getattr(ns, "telemetry", None) is None:
        ns.telemetry = WorkerTelemetry(TelemetryConfig.from_json(tel), tel["run_id"],
                                       state.rank, plan, str(ns.device))
        reply["segments_marker"] = ns.telemetry.mark_folder()
    if snap:
        reply["snapshots"] = ns.snapshot.steps()
    return reply, []


def _program(state: WorkerState, plan: Plan, header: dict[str, Any]) -> Any:
    """This rank's program of ``plan``; with ``distribute(microbatches=)``, of its micro-batch
    plan (``mb_plan`` / ``mb_plan_path``), in parts (``backends/_microbatch.py``)."""
    ns = state.ns
    if ns.stages is not None:
        return lower_pipeline(ns.stages, state.rank, device=str(ns.device), kernels=ns.kernels)
    if "mb_plan_path" in header or "mb_plan" in header:
        mb = _header_plan(header, "mb_plan")
        return lower_microbatched(mb, state.rank, device=str(ns.device), kernels=ns.kernels)
    return lower(plan, state.rank, device=str(ns.device), kernels=ns.kernels)


def _header_plan(header: dict[str, Any], key: str) -> Plan:
    """The plan a message carries under ``key``: its JSON (the local launcher), or under the
    mpi launcher the path of this host's copy (``<key>_path``), pushed by the chain."""
    if f"{key}_path" in header:
        return Plan.load(header[f"{key}_path"])
    what = "the micro-batch plan" if key == "mb_plan" else "the plan"
    return Plan.from_json(header[key], where=f"{what} the controller sent")


def _open_snapshot(state: WorkerState, snap: dict[str, Any]) -> None:
    """Map this rank's snapshot file (the controller's, ``_snapshot.py``), laid out for the
    state pieces its plan gives it. A first launch writes the state it was given as the
    snapshot of the step before its first; a replacement (``restore``) only checks that the
    file holds its pieces: ``restore_snapshot`` then reads them."""
    from ._snapshot import Replica, Snapshot

    ns = state.ns
    plan, sizes = ns.plan, ns.plan.mesh.sizes
    coords = rank_coords(state.rank, sizes)
    pieces = {}
    for n in plan.graph.inputs:
        if n.meta.role in STATE_ROLES:
            slices = local_slices(n.meta.shape, plan.input_layouts[n.target], sizes, coords)
            pieces[n.target] = (tuple(s.stop - s.start for s in slices),
                                getattr(torch, n.meta.dtype))
    # the pieces this rank snapshots (replicas are shared out among their holders) and which
    # rank's file holds each of the pieces it restores
    own = set(snap.get("own", pieces))
    ns.snap_from = {name: int(owner) for name, owner in
                    snap.get("from", {n: state.rank for n in pieces}).items()}
    ns.snap_paths = list(snap.get("paths", ()))
    ns.snapshot = Snapshot(str(snap["path"]), {n: p for n, p in pieces.items() if n in own},
                           rank=state.rank)
    replica = snap.get("replica")
    if replica:                           # a copy of every snapshot on the next host too
        ns.snapshot.replica = Replica(replica["address"], bytes.fromhex(replica["key"]),
                                      state.rank, ns.snapshot.text, ns.timeout_s)
    ns.last_step = int(snap["step"])
    # under mpi the replicated pieces come after setup (share_state), which snapshots then
    if not snap.get("restore") and all(n in ns.state for n in own):
        ns.snapshot.write(ns.last_step, ns.state)


def _state_changed(ns: Any) -> None:
    """The state changed outside a step: under fault tolerance it is the snapshot now."""
    snap = getattr(ns, "snapshot", None)
    if snap is not None:
        snap.reset(ns.last_step, ns.state)


@register("restore_snapshot")
def _restore_snapshot(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    """Take the state of snapshot ``step`` (every rank the same step), each piece from the
    file of the rank that snapshots it, and drop newer snapshots of its own."""
    from ._snapshot import Snapshot

    ns = state.ns
    step = ns.last_step = int(header["step"])
    by_owner: dict[int, list[str]] = {}
    for name, owner in ns.snap_from.items():
        by_owner.setdefault(owner, []).append(name)
    restored = ns.snapshot.read(step, by_owner.pop(state.rank, []))
    for owner, names in sorted(by_owner.items()):
        peer = Snapshot.existing(ns.snap_paths[owner], rank=owner)
        try:
            restored.update(peer.read(step, names, mine=False))
        finally:
            peer.close()
    ns.state = {k: v.to(ns.device) for k, v in restored.items()}
    return {"rank": state.rank}, []


def _communicator(state: WorkerState, generation: int) -> Any:
    """This rank's communicator for its plan's mesh: MPI under the mpi launcher, else
    torch.distributed on the controller's store (NCCL between GPUs, gloo otherwise).
    ``generation``: how many times the ranks built one after a failure (its keys in the
    store are new each time)."""
    ns = state.ns
    groups = all_axis_groups(ns.sizes)
    if state.env.get("MESHPLAN_MPI") == "1":
        return MPICommunicator(groups, timeout_s=ns.timeout_s)
    store = _rendezvous(state, ns.timeout_s, generation)
    if ns.device.type == "cuda" and ns.shared_gpu:
        return HostStagedCommunicator(state.rank, state.world_size, groups, device=ns.device,
                                      timeout_s=ns.timeout_s, store=store)
    return TorchCommunicator(state.rank, state.world_size, groups, timeout_s=ns.timeout_s,
                             store=store, backend="nccl" if ns.device.type == "cuda" else "gloo",
                             device=ns.device)


@register("rejoin")
def _rejoin(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    """After a rank was replaced (``distribute(fault_tolerance=True)``): drop the communicator
    (a peer of it is gone) and build a new one with every rank, the replacement included.
    Replies with the steps this rank's snapshots hold."""
    ns = state.ns
    old, ns.comm = getattr(ns, "comm", None), None
    if old is not None:
        old.abort()
        old.close()
    ns.comm = _communicator(state, int(header["generation"]))
    return {"rank": state.rank, "snapshots": ns.snapshot.steps()}, []


def _rank_device(state: WorkerState, want: str) -> tuple[torch.device, bool]:
    """This rank's device for ``distribute(device=want)``, and whether it shares its GPU with
    another rank of this host (NCCL refuses that: the collectives then go through host
    memory). A rank takes ``cuda:<local rank % GPUs seen>``; a launcher that hands each rank
    one GPU through ``CUDA_VISIBLE_DEVICES`` makes that ``cuda:0``."""
    if want != "cuda":
        return torch.device("cpu"), False
    count = torch.cuda.device_count()
    if count == 0:
        raise RuntimeFailure(
            f"rank {state.rank} on {state.hostname}: device='cuda' but torch sees no GPU on "
            f"this host (CUDA_VISIBLE_DEVICES={state.env.get('CUDA_VISIBLE_DEVICES', 'unset')},"
            f" torch {torch.__version__}, CUDA {torch.version.cuda or 'none: a CPU build'})")
    local = int(state.env.get("LOCAL_RANK", state.rank))
    ranks_here = int(state.env.get("LOCAL_WORLD_SIZE", state.world_size))
    device = torch.device("cuda", local % count)
    torch.cuda.set_device(device)
    return device, ranks_here > count


def _rendezvous(state: WorkerState, timeout_s: float, generation: int = 0) -> Any:
    """The controller's store (``_launch.RendezvousStore``), under the run's secret prefix
    (and the communicator's generation after a rank was replaced)."""
    from datetime import timedelta

    import torch.distributed as dist

    if not state.master_addr or not state.master_port:
        raise RuntimeFailure(f"rank {state.rank}: no rendezvous store (MASTER_ADDR/MASTER_PORT "
                             "unset); start workers with a meshplan launcher")
    client = dist.TCPStore(state.master_addr, state.master_port, state.world_size, False,
                           timedelta(seconds=timeout_s))
    prefix = state.store_prefix if not generation else f"{state.store_prefix}/g{generation}"
    return dist.PrefixStore(prefix, client)


@register("load_checkpoint")
def _load_checkpoint(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    ns = state.ns
    pieces = _checkpoint_pieces(ns.piece_rank, ns.plan, header)
    device = state_device(ns.state)
    ns.state.update({k: v.to(device) for k, v in pieces.items()})
    _state_changed(ns)
    return {"rank": state.rank, "names": len(pieces)}, []


def _checkpoint_pieces(rank: int, plan: Plan, ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    """This rank's pieces of the state named ``ckpt["names"]``, read from the checkpoint file
    ``ckpt["path"]`` on this host (only the bytes of its own pieces)."""
    from ._checkpoint import read_pieces

    sizes, coords = plan.mesh.sizes, rank_coords(rank, plan.mesh.sizes)
    layouts, shapes = plan.input_layouts, {n.target: n.meta.shape for n in plan.graph.inputs}
    names = list(ckpt["names"])
    pieces = read_pieces(ckpt["path"], names, {
        n: local_slices(shapes[n], layouts[n], sizes, coords) for n in names})
    return {n: torch.zeros_like(t) if holds_zeros(layouts[n], coords) else t
            for n, t in pieces.items()}


@register("add_program")
def _add_program(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    """Lower one more plan of the same step (another input signature); its state layouts are
    the running plan's, so the state stays where it is."""
    ns = state.ns
    plan = _header_plan(header, "plan")
    ns.programs[int(header["variant"])] = (_program(state, plan, header),
                                           list(header["data"]))
    return {"rank": state.rank}, []


def _settled(ns: Any) -> None:
    """Before a handler changes the state in place or hands it out: the snapshot copy of
    the last step (``Snapshot.write_behind``) is done."""
    snap = getattr(ns, "snapshot", None)
    if snap is not None:
        snap.settle()


@register("step")
def _step(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    ns = state.ns
    _settled(ns)
    program, names = ns.programs[int(header.get("variant", 0))]
    data = dict(zip(names, (t.to(ns.device, non_blocking=True) for t in tensors)))
    tel: WorkerTelemetry | None = getattr(ns, "telemetry", None)
    ns.comm.records.clear()
    if tel is not None:
        tel.begin(int(header.get("step", tel.step + 1)))
    # random ops: the run's seed and the step's number seed them (backends/_rng.py)
    rng = StepRNG(int(header["seed"]), int(header["step"])) if "seed" in header else None
    start_us, perf0 = steps_timer()
    try:
        # the worker owns its state (fresh tensors from the channel): in-place kernels may
        # update it instead of copying
        runner = (run_microbatched if isinstance(program, MicrobatchProgram)
                  else run_pipeline if isinstance(program, StageProgram) else run)
        watched = getattr(ns, "watch", None)
        extra: dict[str, Any] = {}
        if watched and runner is run:     # DistributedStep.watch: the nodes' values kept
            extra["keep"] = dict.fromkeys(watched)
        results, new_state = runner(program, ns.comm, ns.state, data, observer=tel,
                                    donate=True, rng=rng, **extra)
        if "keep" in extra:
            ns.kept = {k: v for k, v in extra["keep"].items() if v is not None}
    except Exception as exc:
        if tel is not None and not isinstance(exc, StepAborted):   # the failing rank records it
            tel.failure(exc, traceback.format_exc())
        if getattr(ns, "snapshot", None) is not None and \
                not getattr(exc, "meshplan_intact", False):
            # fault tolerance: the ranks are inconsistent and the controller will restore
            # them; peers that wait for this rank in a collective stop waiting now
            getattr(ns.comm, "abort", lambda: None)()
        raise
    dur_us = int((time.perf_counter() - perf0) * 1e6)
    ns.state.update(new_state)
    ns.last_step = int(header.get("step", -1))
    reply: dict[str, Any] = {}
    snap = getattr(ns, "snapshot", None)
    if snap is not None and snap.lost:    # an earlier step's copy failed: the controller
        reply["snapshots_lost"], snap.lost = snap.lost, []    # counts on the one before
    replica = getattr(snap, "replica", None)
    if replica is not None and replica.broken and not replica.said:   # said once
        reply["replica_lost"], replica.said = replica.broken, True
    if header.get("snapshot"):            # the state after this step, for a restart: copied
        ns.snapshot.write_behind(int(header["step"]), ns.state)    # while the reply goes
    if tel is not None:
        tel.end(ns.comm.records, start_us, perf0, dur_us, results, ns.state)
    reply["comm"] = [{"kind": r.kind.value, "group": list(r.group), "nbytes": r.nbytes,
                      "dur_s": r.dur_s} for r in ns.comm.records]
    if state.rank == ns.result_rank:
        return reply, [r.cpu() for r in results if isinstance(r, torch.Tensor)]
    return reply, []


@register("probe_links")
def _probe_links(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    """Time blocking collectives on this rank's mesh-axis groups (``backends/_probe.py``):
    what a calibration fits the links to, and the wait a blocking collective adds when every
    rank is busy (``probe_wait``). Its calls are not a step's: nothing is recorded."""
    from ..backends._probe import probe_links, probe_wait

    ns = state.ns
    repeats, device = int(header.get("repeats", 3)), state_device(ns.state)
    samples = probe_links(ns.comm, state.rank, ns.plan.mesh.sizes,
                          nbytes=tuple(int(b) for b in header["bytes"]),
                          repeats=repeats, device=device)
    samples += probe_wait(ns.comm, state.rank, ns.plan.mesh.sizes, device=device)
    ns.comm.records.clear()
    return {"samples": samples}, []


@register("get_state")
def _get_state(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    """Every piece this rank holds (``names``: only those of them)."""
    wanted = header.get("names")
    names = sorted(state.ns.state if wanted is None else
                   [n for n in wanted if n in state.ns.state])
    comm = getattr(state.ns, "comm", None)
    if header.get("rma") and isinstance(comm, MPICommunicator):
        return _get_state_rma(comm, state.ns.state, names)
    return {"names": names}, [state.ns.state[n].cpu() for n in names]


def _get_state_rma(comm: MPICommunicator, held: dict[str, torch.Tensor], names: list[str]):
    """The mpi launcher: every rank exposes its pieces in RMA windows and rank 0 reads them all
    one-sidedly, then replies with every rank's pieces (rank-major, ``ranks`` of them); the
    other ranks reply with none. Freeing the windows (collective) waits for rank 0's reads."""
    with Transfer(comm) as tr:
        for name in names:                      # same names, same order on every rank
            tr.expose(name, held[name])
        if comm.rank != 0:
            return {"names": names, "ranks": 0}, []
        pieces = [tr.get(r, name) for r in range(comm.world_size) for name in names]
    return {"names": names, "ranks": comm.world_size}, pieces


@register("share_state")
def _share_state(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    """The mpi launcher: ranks whose piece of a state value equals another rank's (a replica)
    read it from that rank one-sidedly instead of getting it from the controller. For every
    name in ``names`` (same order on every rank) each rank exposes its piece, or nothing when it
    fetches that piece (``fetch``: name -> the rank that holds it); then it reads what it
    fetches. Freeing the windows (collective) waits for every read."""
    ns = state.ns
    fetch = header["fetch"]
    dtypes = {n.target: getattr(torch, n.meta.dtype) for n in ns.plan.graph.inputs}
    got = {}
    with Transfer(ns.comm) as tr:
        for name in header["names"]:
            tr.expose(name, torch.empty(0, dtype=dtypes[name]) if name in fetch
                      else ns.state[name])
        for name, owner in fetch.items():
            got[name] = tr.get(int(owner), name)
    device = state_device(ns.state)
    ns.state.update({k: v.to(device) for k, v in got.items()})
    _state_changed(ns)
    return {"rank": state.rank, "fetched": len(got)}, []


@register("watch")
def _watch(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    """Keep the values of ``nodes`` (this rank's pieces) from each step on (none: stop)."""
    state.ns.watch = set(header.get("nodes") or ())
    state.ns.kept = {}
    return {}, []


@register("inspect")
def _inspect(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    """This rank's piece of output ``index`` of a watched node, as the last step made it."""
    node, index = str(header["node"]), int(header.get("index", 0))
    kept = getattr(state.ns, "kept", {})
    if node not in kept:
        return {"held": False}, []
    value = kept[node][index]
    if not isinstance(value, torch.Tensor):
        value = torch.tensor(value)
    return {"held": True}, [value.detach().cpu()]


@register("set_state")
def _set_state(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    device = getattr(state.ns, "device", torch.device("cpu"))
    state.ns.state.update({k: v.to(device) for k, v in zip(header["names"], tensors)})
    _state_changed(state.ns)
    return {}, []


@register("telemetry_query")
def _telemetry_query(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    """Run the controller's SQL over this rank's recent events; the answer travels as an Arrow
    IPC stream in a uint8 tensor."""
    from ..telemetry._recorder import arrow_ipc

    tel: WorkerTelemetry | None = getattr(state.ns, "telemetry", None)
    if tel is None:
        raise RuntimeError(f"rank {state.rank} records no telemetry (the run has telemetry off)")
    table = tel.rec.query(str(header["sql"]))
    return {"rows": table.num_rows}, [torch.frombuffer(bytearray(arrow_ipc(table)),
                                                       dtype=torch.uint8)]


@register("telemetry_ship")
def _telemetry_ship(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    """This rank's finished segments the controller has not had yet (its folder is on a disk
    the controller does not see): flushed first, then at most ``limit`` bytes of them, whole
    files as uint8 tensors; ``more`` says that others wait for the next call."""
    tel: WorkerTelemetry | None = getattr(state.ns, "telemetry", None)
    if tel is None or not header.get("ship"):
        return {"names": [], "more": False}, []
    names, files, more = tel.unshipped(int(header.get("limit", 32 << 20)))
    return {"names": names, "more": more}, [
        torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in files]


@register("telemetry_flush")
def _telemetry_flush(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    tel: WorkerTelemetry | None = getattr(state.ns, "telemetry", None)
    return {"rows": tel.rec.flush() if tel is not None else 0}, []
