"""State from one running mesh into another: ``meshplan.transfer`` (README, "Several meshes in
one program").

An RL system runs a generator step and a trainer step at once, each ``distribute``d on its own
mesh and plan (and its own processes); after every update the trainer's weights go to the
generator. ``transfer(src, dst)`` copies state tensors from the ranks of ``src`` to those of
``dst``, resharding on the way (any layouts: a replicated generator from an FSDP trainer, a
column-split from a row-split), without the tensors passing through the controller:

- the controller plans the copies from the two plans alone (``plan_copies``): every rank's
  piece of a tensor is a box of it (``backends.local_slices``), and each destination piece is
  the intersections of its box with the distinct source boxes; among replicas of a source
  piece, destination piece ``i`` reads from replica ``i mod n``, so the reads spread;
- each source rank copies the pieces it was chosen for into one staging buffer (a
  ``/dev/shm`` file under ``shm``, an MPI window under ``rma``), and each destination rank
  reads only the regions it needs, straight into its new pieces (``shm``: slices of the mapped
  file; ``rma``: one ``MPI_Get`` per region with a subarray datatype, so the region's bytes
  and no others cross);
- ``rma`` joins the two meshes' MPI worlds once (``MPI_Open_port`` on the source's rank 0,
  ``MPI_Comm_accept``/``MPI_Comm_connect``, ``MPI_Intercomm_merge``; kept for later transfers
  between the same running meshes), so it works across hosts; ``shm`` needs every rank of
  both meshes on this host (it checks: the file carries a random token the reader must find);
- ``tcp``, for ranks on other hosts without MPI (slurm, k8s, mixed launchers): each source
  rank stages its pieces in memory and serves reads of them from a thread on a port of its
  own (the rank's main thread is free meanwhile); each destination rank connects to the
  source ranks it needs, in parallel, and asks for exactly its regions, which the source cuts
  from its pieces and sends, received straight into the destination's tensors. Connections are
  authenticated both ways (HMAC-SHA256 challenges under a random key per transfer, sent to
  both meshes over their control channels); the bytes then travel as gloo's do, unsigned.

Which: ``rma`` when both steps run under ``launcher="mpi"``, ``shm`` when both meshes run on
this host (local launcher, or mpi without other hosts), else ``tcp``; ``controller`` (gathered
into this process and sent out again, as ``state_dict()`` + ``load_state_dict()`` would) for a
step that is not running, which takes the values into its live model on this process.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import hmac
import json
import math
import os
import secrets
import socket
import struct
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._errors import RuntimeFailure
from ..backends import local_slices, rank_coords
from ._launch import WorkerFailure
from ._worker import WorkerState, register

ALIGN = 64                  # bytes: where each piece starts in a staging buffer
TOKEN_BYTES = 16            # a shm file's first bytes: proof the reader mapped the writer's file
METHODS = ("shm", "rma", "tcp", "controller")
_TCP_MAX_REQUEST = 64 << 20  # bytes of one connection's list of regions (JSON)

Box = tuple[tuple[int, int], ...]          # [start, stop) per dim, in the whole tensor
Copy = tuple[int, Box, Box]                # source rank, region in its piece, region in ours


@dataclasses.dataclass(frozen=True, slots=True)
class TransferReport:
    """What one ``transfer`` did."""

    method: str                 # "shm", "rma", "tcp" or "controller"
    tensors: int                # destination state tensors written
    nbytes: int                 # bytes the destination ranks read (their pieces' regions)
    controller_bytes: int       # tensor bytes that passed through this process
    seconds: float
    why: str                    # why this method

    def __str__(self) -> str:
        from ..planner._summary import format_bytes

        if self.method == "controller":
            return (f"transfer: {self.tensors} tensors, {format_bytes(self.nbytes)}, through "
                    f"the controller ({format_bytes(self.controller_bytes)} in and out) in "
                    f"{self.seconds * 1e3:.1f} ms ({self.why})")
        return (f"transfer: {self.tensors} tensors, {format_bytes(self.nbytes)} read by the "
                f"destination ranks in {self.seconds * 1e3:.1f} ms by {self.method} "
                f"({self.why})")


# ---- the plan of the copies (pure) ---------------------------------------------------------

def _volume(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def _meet(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) or not out else None


def _within(region: Box, box: Box) -> Box:
    return tuple((lo - s, hi - s) for (lo, hi), (s, _) in zip(region, box))


def plan_copies(shape: Sequence[int], src: Sequence[tuple[int, Box]],
                dst: Sequence[tuple[int, Box]]) -> dict[int, list[Copy]]:
    """For every destination rank (``dst``: its rank and the box its piece is of the whole
    tensor of ``shape``): the copies that make its piece, each (source rank, region of that
    rank's piece, region of the destination piece). ``src``: every source rank's box; ranks
    with equal boxes hold replicas, and destination piece ``i`` reads from the ``i``-th of
    them (mod their number). Raises ``RuntimeFailure`` if the sources leave part of a
    destination piece uncovered."""
    holders: dict[Box, list[int]] = {}
    for rank, box in src:
        holders.setdefault(box, []).append(rank)
    out: dict[int, list[Copy]] = {}
    for i, (rank, box) in enumerate(dst):
        copies, covered = [], 0
        for sbox, ranks in holders.items():
            region = _meet(sbox, box)
            if region is None:
                continue
            copies.append((ranks[i % len(ranks)], _within(region, sbox), _within(region, box)))
            covered += _volume(region)
        if covered != _volume(box):
            raise RuntimeFailure(
                f"transfer: the source pieces of a tensor of shape {list(shape)} cover "
                f"{covered} of the {_volume(box)} elements destination rank {rank} needs "
                f"(boxes {sorted(holders)}); this is a bug in meshplan, please report it")
        out[rank] = copies
    return out


# ---- the controller ------------------------------------------------------------------------

def _pieces(step: Any, name: str) -> list[tuple[int, Box]]:
    """Every rank of ``step``'s mesh that holds a piece of state ``name``, with its box (a
    pipeline's: the ranks of the stage that holds it, under every stage's plan)."""
    plan = step.plan
    meta = next(n.meta for n in plan.graph.inputs if n.target == name)
    layout, sizes = plan.input_layouts[name], plan.mesh.sizes
    out = []
    for rank in range(step._world()):
        if step._stages is not None:
            if not step._held_by(rank, [name]):
                continue
            inner = step._stages.inner_rank(rank)
        else:
            inner = rank
        coords = rank_coords(inner, sizes)
        box = tuple((s.start, s.stop) for s in local_slices(meta.shape, layout, sizes, coords))
        out.append((rank, box))
    return out


def _model_keys(step: Any) -> dict[str, str]:
    from ..frontend._state_dict import _model_keys as keys

    return keys(step._traced_or_prepared().inventory)


def _pairs(src: Any, dst: Any, names: Any) -> list[tuple[str, str, str]]:
    """(source internal name, destination internal name, what the user called it) for every
    tensor to copy; ``names`` as ``transfer`` takes it."""
    skeys, dkeys = _model_keys(src), _model_keys(dst)
    if names is None:
        wanted = {k: k for k in skeys if k in dkeys}
        if not wanted:
            raise RuntimeFailure(
                f"transfer({src.__name__} -> {dst.__name__}): the two steps' models share no "
                f"state_dict key ({_some(skeys)} against {_some(dkeys)}); pass names={{source "
                "key: destination key}")
    elif isinstance(names, Mapping):
        wanted = {str(k): str(v) for k, v in names.items()}
    elif isinstance(names, (list, tuple, set, frozenset)) and all(isinstance(n, str)
                                                                   for n in names):
        wanted = {n: n for n in names}
    else:
        raise RuntimeFailure(f"transfer(names={names!r}): pass None (every key both models "
                             "have), a list of state_dict keys, or a dict {source key: "
                             "destination key}")
    pairs: dict[str, tuple[str, str, str]] = {}
    into: dict[str, str] = {}
    for skey, dkey in wanted.items():
        if dkey in into:
            raise RuntimeFailure(f"transfer(names=...): {into[dkey]!r} and {skey!r} both go to "
                                 f"{dst.__name__}'s {dkey!r}; map one source key to it")
        into[dkey] = skey
        for key, keys, step in ((skey, skeys, src), (dkey, dkeys, dst)):
            if key not in keys:
                raise RuntimeFailure(
                    f"transfer: {key!r} is not a state_dict key of {step.__name__}'s model "
                    f"(it has {_some(keys)}); use the keys of step.state_dict()['model']")
        sname, dname = skeys[skey], dkeys[dkey]
        seen = pairs.get(dname)
        if seen is not None and seen[0] != sname:     # tied on the destination only
            raise RuntimeFailure(
                f"transfer: {dst.__name__}'s {dkey!r} is one tensor with {seen[2]!r} (tied), "
                f"and the source gives them different values ({skey!r}, {seen[2]!r}); map "
                "only one of them")
        pairs[dname] = (sname, dname, skey)
    smeta = {n.target: n.meta for n in src.plan.graph.inputs}
    dmeta = {n.target: n.meta for n in dst.plan.graph.inputs}
    for sname, dname, key in pairs.values():
        if tuple(smeta[sname].shape) != tuple(dmeta[dname].shape):
            raise RuntimeFailure(
                f"transfer: {key!r} has shape {list(smeta[sname].shape)} in {src.__name__} and "
                f"{list(dmeta[dname].shape)} in {dst.__name__}; only equal shapes copy")
    return sorted(pairs.values())


def _some(keys: Mapping[str, str] | Sequence[str]) -> str:
    keys = list(keys)
    more = f", ... {len(keys) - 4} more" if len(keys) > 4 else ""
    return "[" + ", ".join(map(repr, keys[:4])) + more + "]"


def _on_this_host(step: Any) -> bool:
    from ._mpi_launch import is_this_host, parse_hosts

    if step.launcher == "local":
        return True
    if step.launcher != "mpi":
        return False
    hosts = parse_hosts(step.hosts)
    return hosts is None or all(is_this_host(h) for h, _ in hosts[0])


def _choose(src: Any, dst: Any, method: str | None) -> tuple[str, str]:
    """(method, why)."""
    if method is not None and method not in METHODS:
        raise RuntimeFailure(f"transfer(method={method!r}): pass None (the fastest that "
                             f"works), or one of {', '.join(map(repr, METHODS))}")
    idle = [s.__name__ for s in (src, dst) if s._workers is None]
    if idle:
        who = f"{' and '.join(idle)} {'has' if len(idle) == 1 else 'have'} no running mesh"
        if method not in (None, "controller"):
            raise RuntimeFailure(f"transfer(method={method!r}): {who} (call it once first)")
        return "controller", f"{who}: the live model on this process instead"
    rma = src.launcher == dst.launcher == "mpi"
    shm = _on_this_host(src) and _on_this_host(dst) and os.access("/dev/shm", os.W_OK)
    if method == "rma" and not rma:
        raise RuntimeFailure("transfer(method='rma'): both steps must run under "
                             f"launcher='mpi' (they run under {src.launcher!r} and "
                             f"{dst.launcher!r})")
    if method == "shm" and not shm:
        raise RuntimeFailure("transfer(method='shm'): every rank of both meshes must run on "
                             "this host (launcher='local', or 'mpi' without other hosts)")
    if method is not None:
        return method, "as asked"
    if rma:
        return "rma", "both meshes run under launcher='mpi'"
    if shm:
        return "shm", "both meshes run on this host"
    return "tcp", (f"launchers {src.launcher!r} and {dst.launcher!r}, ranks on other hosts: "
                   "each destination rank reads its regions from the source ranks over TCP")


def transfer(src: Any, dst: Any, names: Any = None, *, method: str | None = None,
             timeout_s: float | None = None) -> TransferReport:
    """Copy state tensors of ``src``'s model into ``dst``'s, each step ``distribute``d on its
    own mesh and plan: from ``src``'s ranks to ``dst``'s, resharded from one layout to the
    other on the way, one-sidedly (module docstring). ``names``: None (every ``state_dict()``
    key both models have), a list of keys, or ``{source key: destination key}`` (the keys of
    ``step.state_dict()["model"]``); shapes must be equal, dtypes may differ (cast on the
    way). ``method``: None (``rma``, else ``shm``, else ``tcp``: whichever works first; a
    step not running: ``controller``), or one of them. Both steps must have been traced (called once, or given
    ``example_inputs``). Returns a ``TransferReport``; a failure is one ``RuntimeFailure``."""
    from ._distributed import DistributedStep

    for what, step in (("src", src), ("dst", dst)):
        if not isinstance(step, DistributedStep):
            raise RuntimeFailure(f"transfer({what}=...): pass a step made by "
                                 f"meshplan.distribute, not a {type(step).__name__}")
    if src is dst:
        raise RuntimeFailure(f"transfer: {src.__name__} is both the source and the destination")
    for step in (src, dst):
        if step._traced is None and step.example_inputs is None:
            raise RuntimeFailure(f"transfer: {step.__name__} has no plan yet: call it once, or "
                                 "pass example_inputs= to distribute")
    if src._workers is None and src._local_stale:
        raise RuntimeFailure(
            f"transfer: {src.__name__}'s mesh was shut down, and what it trained there was not "
            f"written back (its live model on this process is from before); call "
            f"{src.__name__}.sync() before shutdown(), or transfer while it runs")
    pairs = _pairs(src, dst, names)
    how, why = _choose(src, dst, method)
    timeout = timeout_s if timeout_s is not None else max(src.timeout_s, dst.timeout_s)
    t0 = time.perf_counter()
    if how == "controller":
        nbytes = _through_controller(src, dst, pairs)
        through = nbytes * ((src._workers is not None) + (dst._workers is not None))
    else:
        while True:
            try:
                nbytes = _one_sided(src, dst, pairs, how, timeout)
                break
            except WorkerFailure as exc:
                _recovered_or_raise(exc)
        through = 0
        dst._local_stale = True
        if dst._ft is not None:           # every rank's snapshot is this state now
            dst._ft.started(dst._step_no)
    return TransferReport(how, len(pairs), nbytes, through, time.perf_counter() - t0, why)


def _recovered_or_raise(exc: WorkerFailure) -> None:
    """A rank of one of the meshes failed during the transfer (``_gather`` names which):
    under fault tolerance its mesh is brought back to its snapshots (the transfer then runs
    again); without, the failure stands (its workers are stopped)."""
    step = getattr(exc, "meshplan_step", None)
    if step is None or step._ft is None or step._workers is None or step._workers.closed:
        raise exc
    step._said_recovered(*step._recover(exc, step._step_no))


def _gather(step: Any, kind: str, timeout: float, ranks: list[int] | None = None) -> Any:
    """``step``'s ranks' replies; a failure says whose mesh it is (``_recovered_or_raise``)
    and is recorded in its telemetry."""
    try:
        with step._recording_failures():
            return step._workers.gather(kind, timeout, ranks=ranks)
    except WorkerFailure as exc:
        exc.meshplan_step = step
        raise


def _through_controller(src: Any, dst: Any, pairs: list[tuple[str, str, str]]) -> int:
    values = src._named_state(sorted({s for s, _, _ in pairs}))
    dmeta = {n.target: n.meta for n in dst.plan.graph.inputs}
    moved = {d: values[s].to(getattr(torch, dmeta[d].dtype)) for s, d, _ in pairs}
    dst._put_state(moved)
    return sum(v.nbytes for v in moved.values())


def _staging(pairs: list[tuple[str, str, str]], plans: dict[str, dict[int, list[Copy]]],
             src_boxes: dict[str, dict[int, Box]], dtypes: dict[str, torch.dtype]
             ) -> tuple[dict[int, list[list[Any]]], dict[int, int]]:
    """Per source rank: [name, offset, shape, dtype] of each piece it stages (those some copy
    reads from it), in one order, offsets from ``ALIGN`` (the token before); and the bytes
    of its staging buffer."""
    wanted: dict[int, set[str]] = {}
    for (sname, dname, _) in pairs:
        for copies in plans[dname].values():
            for rank, _, _ in copies:
                wanted.setdefault(rank, set()).add(sname)
    out: dict[int, list[list[Any]]] = {}
    sizes: dict[int, int] = {}
    for rank, snames in wanted.items():
        at, rows = ALIGN, []
        for sname in sorted(snames):
            box = src_boxes[sname][rank]
            shape = [b - a for a, b in box]
            dt = dtypes[sname]
            rows.append([sname, at, shape, str(dt).removeprefix("torch.")])
            at += -(-math.prod(shape) * dt.itemsize // ALIGN) * ALIGN
        out[rank], sizes[rank] = rows, at
    return out, sizes


def _one_sided(src: Any, dst: Any, pairs: list[tuple[str, str, str]], how: str,
               timeout: float) -> int:
    sdt = {n.target: getattr(torch, n.meta.dtype) for n in src.plan.graph.inputs}
    ddt = {n.target: getattr(torch, n.meta.dtype) for n in dst.plan.graph.inputs}
    shapes = {n.target: list(n.meta.shape) for n in dst.plan.graph.inputs}
    plans, src_boxes, dst_boxes = {}, {}, {}
    for sname, dname, _ in pairs:
        spieces, dpieces = _pieces(src, sname), _pieces(dst, dname)
        src_boxes[sname] = dict(spieces)
        dst_boxes[dname] = dict(dpieces)
        plans[dname] = plan_copies(shapes[dname], spieces, dpieces)
    staged, sizes = _staging(pairs, plans, src_boxes, sdt)
    offsets = {(rank, row[0]): row[1] for rank, rows in staged.items() for row in rows}
    recipes: dict[int, list[list[Any]]] = {}
    nbytes = 0
    for sname, dname, _ in pairs:
        for drank, copies in plans[dname].items():
            box = dst_boxes[dname][drank]
            parts = []
            for srank, sreg, dreg in copies:
                sbox = src_boxes[sname][srank]
                parts.append([srank, offsets[(srank, sname)], [b - a for a, b in sbox],
                              str(sdt[sname]).removeprefix("torch."),
                              [list(r) for r in sreg], [list(r) for r in dreg]])
                nbytes += _volume(sreg) * sdt[sname].itemsize
            recipes.setdefault(drank, []).append(
                [dname, [b - a for a, b in box], str(ddt[dname]).removeprefix("torch."), parts])
    if how == "shm":
        _by_shm(src, dst, staged, sizes, recipes, timeout)
    elif how == "tcp":
        _by_tcp(src, dst, staged, sizes, recipes, timeout)
    else:
        _by_rma(src, dst, staged, sizes, recipes, timeout)
    return nbytes


def _by_shm(src: Any, dst: Any, staged: dict[int, list[list[Any]]], sizes: dict[int, int],
            recipes: dict[int, list[list[Any]]], timeout: float) -> None:
    sw, dw = src._workers, dst._workers
    tag = secrets.token_hex(6)
    files = {rank: (f"/dev/shm/meshplan-{sw.run_id}-r{rank}-xfer-{tag}", sizes[rank],
                    secrets.token_hex(TOKEN_BYTES)) for rank in staged}
    try:
        for rank in staged:
            path, size, token = files[rank]
            sw.send(rank, "xfer_export", {"path": path, "size": size, "token": token,
                                          "pieces": staged[rank]})
        _gather(src, "xfer_export", timeout, list(staged))
        for rank in range(dw.n):
            dw.send(rank, "xfer_import", {"files": {str(r): list(f) for r, f in files.items()},
                                          "pieces": recipes.get(rank, [])})
        _gather(dst, "xfer_import", timeout)
    finally:
        for path, _, _ in files.values():
            try:
                os.unlink(path)
            except OSError:
                pass


# src Workers -> {dst Workers -> the link's key}: the joined MPI worlds of two running meshes
_LINKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _link(src: Any, dst: Any, timeout: float) -> str:
    sw, dw = src._workers, dst._workers
    links = _LINKS.setdefault(sw, weakref.WeakKeyDictionary())
    key = links.get(dw)
    if key is not None:
        return key
    key = f"{sw.run_id}-{dw.run_id}-{secrets.token_hex(4)}"
    sw.send(0, "xfer_port", {"key": key})
    port = _gather(src, "xfer_port", timeout, [0])[0].header["port"]
    for rank in range(sw.n):
        sw.send(rank, "xfer_link", {"key": key, "port": port, "accept": True})
    for rank in range(dw.n):
        dw.send(rank, "xfer_link", {"key": key, "port": port, "accept": False})
    _gather(src, "xfer_link", timeout)
    _gather(dst, "xfer_link", timeout)
    links[dw] = key
    return key


def _by_rma(src: Any, dst: Any, staged: dict[int, list[list[Any]]], sizes: dict[int, int],
            recipes: dict[int, list[list[Any]]], timeout: float) -> None:
    sw, dw = src._workers, dst._workers
    key = _link(src, dst, timeout)
    for rank in range(sw.n):          # every rank: the window is collective
        sw.send(rank, "xfer_send", {"key": key, "size": sizes.get(rank, 0),
                                    "pieces": staged.get(rank, [])})
    for rank in range(dw.n):
        dw.send(rank, "xfer_recv", {"key": key, "offset": sw.n,
                                    "pieces": recipes.get(rank, [])})
    _gather(src, "xfer_send", timeout)
    _gather(dst, "xfer_recv", timeout)


def _by_tcp(src: Any, dst: Any, staged: dict[int, list[list[Any]]], sizes: dict[int, int],
            recipes: dict[int, list[list[Any]]], timeout: float) -> None:
    sw, dw = src._workers, dst._workers
    key, tag = secrets.token_hex(32), secrets.token_hex(6)
    served: list[int] = []

    def unserve() -> None:            # the source ranks stop serving, free their buffers
        if served and not sw.closed:
            for rank in served:
                sw.send(rank, "xfer_unserve", {"tag": tag})
            _gather(src, "xfer_unserve", timeout, served)
    try:
        for rank in staged:
            sw.send(rank, "xfer_serve", {"tag": tag, "key": key, "size": sizes[rank],
                                         "pieces": staged[rank], "timeout_s": timeout})
            served.append(rank)
        where = {rank: m.header for rank, m in
                 zip(sorted(staged), _gather(src, "xfer_serve", timeout, sorted(staged)))}
        for rank in range(dw.n):
            dw.send(rank, "xfer_fetch", {"key": key, "timeout_s": timeout,
                                         "sources": {str(r): where[r] for r in where},
                                         "pieces": recipes.get(rank, [])})
        _gather(dst, "xfer_fetch", timeout)
    except BaseException:
        try:
            unserve()
        except Exception:  # noqa: BLE001 - the first failure is the one to report
            pass
        raise
    unserve()


# ---- the ranks -----------------------------------------------------------------------------

def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise RuntimeFailure(f"transfer: unknown dtype {name!r}")
    return dt


def _stage_into(buf: torch.Tensor, held: Mapping[str, torch.Tensor],
                pieces: list[list[Any]]) -> None:
    """Copy this rank's pieces named in ``pieces`` into the byte buffer ``buf``."""
    for name, offset, shape, dtype in pieces:
        t = held[name]
        if list(t.shape) != list(shape):
            raise RuntimeFailure(f"transfer: this rank holds {name} as {list(t.shape)}, the "
                                 f"controller planned {list(shape)}; this is a bug in meshplan")
        dt = _dtype(dtype)
        n = math.prod(shape) * dt.itemsize
        buf[offset:offset + n].view(dt).view(shape).copy_(t)


def _view(buf: torch.Tensor, offset: int, shape: list[int], dtype: str) -> torch.Tensor:
    dt = _dtype(dtype)
    return buf[offset:offset + math.prod(shape) * dt.itemsize].view(dt).view(shape)


def _slices(region: list[list[int]]) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in region)


def _took(state: WorkerState, pieces: dict[str, torch.Tensor]) -> dict[str, Any]:
    from ._handlers import _state_changed
    from ._telemetry import state_device

    ns = state.ns
    device = state_device(ns.state)
    ns.state.update({k: v.to(device) for k, v in pieces.items()})
    _state_changed(ns)
    return {"rank": state.rank, "tensors": len(pieces)}


@register("xfer_export")
def _export(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    """shm, a source rank: write the planned pieces into a new ``/dev/shm`` file."""
    from ._handlers import _settled

    _settled(state.ns)
    path, size = str(header["path"]), int(header["size"])
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        os.pwrite(fd, bytes.fromhex(header["token"]), 0)
    finally:
        os.close(fd)
    buf = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    _stage_into(buf, state.ns.state, header["pieces"])
    return {"rank": state.rank}, []


@register("xfer_import")
def _import(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    """shm, a destination rank: make its new pieces from the regions of the source files."""
    from ._handlers import _settled

    _settled(state.ns)
    files: dict[int, torch.Tensor] = {}
    out = {}
    for name, shape, dtype, parts in header["pieces"]:
        piece = torch.empty(shape, dtype=_dtype(dtype))
        for srank, offset, sshape, sdtype, sreg, dreg in parts:
            if srank not in files:
                path, size, token = header["files"][str(srank)]
                try:
                    buf = torch.from_file(path, shared=False, size=int(size), dtype=torch.uint8)
                except (OSError, RuntimeError) as exc:
                    raise RuntimeFailure(
                        f"transfer: rank {state.rank} cannot map {path} ({exc}): it does not "
                        "see the source mesh's /dev/shm (another host or container); use "
                        "launcher='mpi' on both meshes (method='rma')") from None
                if bytes(buf[:TOKEN_BYTES].numpy()) != bytes.fromhex(token):
                    raise RuntimeFailure(
                        f"transfer: rank {state.rank} mapped {path}, but not the source rank's "
                        "file (another host's /dev/shm); use launcher='mpi' on both meshes")
                files[srank] = buf
            piece[_slices(dreg)] = _view(files[srank], offset, sshape, sdtype)[_slices(sreg)]
        out[name] = piece
    return _took(state, out), []


@register("xfer_port")
def _port(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    """rma, the source's rank 0: open the port the destination's ranks connect to."""
    comm = _mpi_comm(state)
    port = comm._MPI.Open_port()
    state.ns.xfer_ports = {**getattr(state.ns, "xfer_ports", {}), header["key"]: port}
    return {"port": port}, []


def _mpi_comm(state: WorkerState) -> Any:
    from ..backends import MPICommunicator

    comm = getattr(state.ns, "comm", None)
    if not isinstance(comm, MPICommunicator):
        raise RuntimeFailure(f"transfer: rank {state.rank} does not run under "
                             "launcher='mpi' (no MPI communicator)")
    return comm


@register("xfer_link")
def _link_worlds(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    """rma, every rank of both meshes: join the two MPI worlds (sources first)."""
    comm = _mpi_comm(state)
    key, port = header["key"], header["port"]
    if header["accept"]:
        inter = comm.world.Accept(port if comm.rank == 0 else None, root=0)
        merged = inter.Merge(high=False)
        ports = getattr(state.ns, "xfer_ports", {})
        if key in ports:
            comm._MPI.Close_port(ports.pop(key))
    else:
        inter = comm.world.Connect(port, root=0)
        merged = inter.Merge(high=True)
    inter.Free()
    merged.Set_errhandler(comm._MPI.ERRORS_RETURN)
    state.ns.xfer_links = {**getattr(state.ns, "xfer_links", {}), key: merged}
    return {"rank": state.rank, "size": merged.Get_size()}, []


def _merged(state: WorkerState, key: str) -> Any:
    merged = getattr(state.ns, "xfer_links", {}).get(key)
    if merged is None:
        raise RuntimeFailure(f"transfer: rank {state.rank} has no link {key!r} to the other "
                             "mesh (it was restarted?)")
    return merged


@register("xfer_send")
def _send(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    """rma, a source rank: expose the planned pieces in a window; wait for the reads."""
    from ._handlers import _settled

    _settled(state.ns)
    MPI = _mpi_comm(state)._MPI
    merged = _merged(state, header["key"])
    buf = torch.empty(max(int(header["size"]), 1), dtype=torch.uint8)
    _stage_into(buf, state.ns.state, header["pieces"])
    win = MPI.Win.Create(buf.numpy(), 1, comm=merged)
    win.Set_errhandler(MPI.ERRORS_RETURN)     # a peer's failure raises here, not aborts
    try:
        merged.Barrier()                  # every destination rank has read what it needs
    finally:
        win.Free()
    return {"rank": state.rank}, []


@register("xfer_recv")
def _recv(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    """rma, a destination rank: read the regions it needs, one ``MPI_Get`` each."""
    from ._handlers import _settled

    _settled(state.ns)
    MPI = _mpi_comm(state)._MPI
    merged = _merged(state, header["key"])
    win = MPI.Win.Create(torch.empty(1, dtype=torch.uint8).numpy(), 1, comm=merged)
    win.Set_errhandler(MPI.ERRORS_RETURN)
    out, held = {}, []
    try:
        win.Lock_all()
        try:
            for name, shape, dtype, parts in header["pieces"]:
                piece = torch.empty(shape, dtype=_dtype(dtype))
                for srank, offset, sshape, sdtype, sreg, dreg in parts:
                    part = _get(MPI, win, srank, offset, sshape, _dtype(sdtype), sreg)
                    held.append((piece, dreg, part))
                out[name] = piece
            win.Flush_all()
        finally:
            win.Unlock_all()
        for piece, dreg, (part, datatype) in held:
            piece[_slices(dreg)] = part
            if datatype is not None:
                datatype.Free()
        merged.Barrier()
    finally:
        win.Free()
    return _took(state, out), []


def _get(MPI: Any, win: Any, srank: int, offset: int, sshape: list[int], dt: torch.dtype,
         sreg: list[list[int]]) -> tuple[torch.Tensor, Any]:
    """Start reading region ``sreg`` of source rank ``srank``'s piece (``sshape`` at byte
    ``offset`` of its window) into a new tensor; (tensor, datatype to free)."""
    shape = [b - a for a, b in sreg]
    part = torch.empty(shape, dtype=dt)
    mine = [part.reshape(-1).view(torch.uint8).numpy(), MPI.BYTE]
    if shape == list(sshape):         # the whole piece: contiguous bytes
        win.Get(mine, srank, (offset, part.nbytes, MPI.BYTE))
        return part, None
    isz = dt.itemsize
    datatype = MPI.BYTE.Create_subarray(list(sshape) + [isz], shape + [isz],
                                        [a for a, _ in sreg] + [0]).Commit()
    win.Get(mine, srank, (offset, 1, datatype))
    return part, datatype


# ---- tcp: a source rank serves its staged pieces, a destination rank reads its regions ----------

def _mac(key: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, b"meshplan-xfer " + role + b" " + nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        got += n


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


class _Server:
    """A source rank's staged pieces, served from threads: per connection, the challenge both
    ways, then one JSON list of ``[offset, shape, dtype, region]`` reads, answered in order,
    each region's bytes after their 8-byte length."""

    def __init__(self, buf: torch.Tensor, key: bytes, timeout_s: float) -> None:
        self.buf, self.key, self.timeout_s = buf, key, timeout_s
        self.sock = socket.create_server(("", 0), family=socket.AF_INET, backlog=128)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True,
                                       name="meshplan-xfer-serve")
        self.thread.start()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:                   # stopped (``stop`` shuts the socket down)
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="meshplan-xfer-conn").start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(self.timeout_s)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                nonce = secrets.token_bytes(16)
                conn.sendall(nonce)
                proof, theirs = _recv_exact(conn, 32), _recv_exact(conn, 16)
                if not hmac.compare_digest(proof, _mac(self.key, b"reader", nonce)):
                    return                   # not a reader of this transfer: say nothing
                conn.sendall(_mac(self.key, b"server", theirs))
                (size,) = struct.unpack("<Q", _recv_exact(conn, 8))
                if size > _TCP_MAX_REQUEST:
                    return
                for offset, shape, dtype, region in json.loads(_recv_exact(conn, size)):
                    part = self._region(int(offset), shape, dtype, region)
                    conn.sendall(struct.pack("<Q", part.nbytes))
                    conn.sendall(_bytes_of(part))
            except (OSError, ValueError, TypeError, RuntimeFailure):
                pass                # the reader's own error says what went wrong

    def _region(self, offset: int, shape: Any, dtype: str, region: Any) -> torch.Tensor:
        dt = _dtype(dtype)
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
                and offset >= 0 and offset + math.prod(shape) * dt.itemsize <= self.buf.numel()
                and isinstance(region, list) and len(region) == len(shape)
                and all(0 <= a <= b <= d for (a, b), d in zip(region, shape))):
            raise ValueError(f"a read outside the staged pieces: {offset} {shape} {region}")
        return _view(self.buf, offset, shape, dtype)[_slices(region)]

    def stop(self) -> None:
        self.stopped.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)     # wakes the accept at once (Linux)
        except OSError:
            pass
        self.sock.close()
        self.thread.join(2.0)


def _addresses(state: WorkerState) -> list[str]:
    """Where readers on other hosts may reach this rank: its address on the route to the
    controller and to its mesh's rendezvous host (the addresses its peers use), and its
    host name's; loopback ones left out (a reader on this host tries 127.0.0.1 first)."""
    from ._channel import ENV_ADDRESS, address_toward

    out: list[str] = []
    ctl = state.env.get(ENV_ADDRESS, "")
    hosts = [ctl.removeprefix("tcp://").rpartition(":")[0]] if ctl.startswith("tcp://") else []
    hosts.append(state.master_addr or "")
    for host in hosts:
        try:
            out.append(address_toward(socket.AF_INET, (socket.gethostbyname(host), 9)))
        except OSError:
            pass
    try:
        out.append(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    return [a for a in dict.fromkeys(out) if a and not a.startswith("127.")]


@register("xfer_serve")
def _serve_pieces(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    """tcp, a source rank: stage the planned pieces in memory and serve reads of them."""
    from ._handlers import _settled

    _settled(state.ns)
    buf = torch.empty(max(int(header["size"]), 1), dtype=torch.uint8)
    _stage_into(buf, state.ns.state, header["pieces"])
    server = _Server(buf, bytes.fromhex(header["key"]), float(header["timeout_s"]))
    state.ns.xfer_servers = {**getattr(state.ns, "xfer_servers", {}), header["tag"]: server}
    return {"host": state.hostname, "port": server.sock.getsockname()[1],
            "addresses": _addresses(state)}, []


@register("xfer_unserve")
def _unserve(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    server = getattr(state.ns, "xfer_servers", {}).pop(header["tag"], None)
    if server is not None:
        server.stop()
    return {}, []


@register("xfer_fetch")
def _fetch(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    """tcp, a destination rank: read its regions from the source ranks (one connection to
    each, in parallel), each straight into a tensor, then put them in its new pieces."""
    from ._handlers import _settled

    _settled(state.ns)
    key, timeout = bytes.fromhex(header["key"]), float(header["timeout_s"])
    out: dict[str, torch.Tensor] = {}
    reads: dict[int, list[tuple[list[Any], torch.Tensor]]] = {}
    places: list[tuple[torch.Tensor, list[list[int]], torch.Tensor]] = []
    for name, shape, dtype, parts in header["pieces"]:
        piece = out[name] = torch.empty(shape, dtype=_dtype(dtype))
        for srank, offset, sshape, sdtype, sreg, dreg in parts:
            into = piece[_slices(dreg)]
            if into.is_contiguous() and into.dtype == _dtype(sdtype):
                part = into                     # received in place (rows, or all of it)
            else:
                part = torch.empty([b - a for a, b in sreg], dtype=_dtype(sdtype))
                places.append((piece, dreg, part))
            reads.setdefault(srank, []).append(([offset, sshape, sdtype, sreg], part))
    if reads:
        with concurrent.futures.ThreadPoolExecutor(min(len(reads), 16)) as pool:
            for done in [pool.submit(_read_from, state, header["sources"][str(srank)], key,
                                     timeout, srank, got) for srank, got in reads.items()]:
                done.result()
    for piece, dreg, part in places:
        piece[_slices(dreg)] = part
    return _took(state, out), []


def _read_from(state: WorkerState, source: dict[str, Any], key: bytes, timeout: float,
               srank: int, reads: list[tuple[list[Any], torch.Tensor]]) -> None:
    """Source rank ``srank``'s regions into their tensors, over one connection."""
    addresses = list(source["addresses"])
    if source["host"] == state.hostname:
        addresses.insert(0, "127.0.0.1")
    tried = []
    for address in addresses:
        try:
            conn = socket.create_connection((address, int(source["port"])),
                                            timeout=min(timeout, 10.0))
        except OSError as exc:
            tried.append(f"{address}: {exc.strerror or exc}")
            continue
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            mine = secrets.token_bytes(16)
            try:               # another service on that port may say nothing: not long
                nonce = _recv_exact(conn, 16)
                conn.sendall(_mac(key, b"reader", nonce) + mine)
                proof = _recv_exact(conn, 32)
            except OSError:
                proof = b""
            if not hmac.compare_digest(proof, _mac(key, b"server", mine)):
                tried.append(f"{address}: not the source rank's server (no proof of the key)")
                continue
            conn.settimeout(timeout)
            request = json.dumps([r for r, _ in reads]).encode()
            conn.sendall(struct.pack("<Q", len(request)) + request)
            for _, part in reads:
                (size,) = struct.unpack("<Q", _recv_exact(conn, 8))
                if size != part.nbytes:
                    raise RuntimeFailure(f"transfer: source rank {srank} sent {size} bytes for "
                                         f"a region of {part.nbytes}; this is a bug in meshplan")
                if size:
                    _recv_into(conn, memoryview(part.reshape(-1).view(torch.uint8).numpy()))
            return
    raise RuntimeFailure(
        f"transfer: rank {state.rank} cannot reach source rank {srank} on "
        f"{source['host']} port {source['port']} ({'; '.join(tried) or 'no address'}); the "
        "two meshes' hosts must reach each other over TCP (or use launcher='mpi' on both, "
        "method='rma')")
