"""Snapshot keepers: where the in-memory snapshots of ranks on other hosts live.

Under ``distribute(fault_tolerance=True)`` every rank copies its state pieces into a memory
file after every ``snapshot_every``-th step (``_snapshot.py``). The file must outlive the
rank, and the rank's own process cannot hold it: mpiexec (and srun) end every rank of a job
once one dies, so a failure takes all of them. On the controller's host the controller holds
the files. For every other host of the mesh the controller starts a *keeper* with the ranks'
launcher, in a job of its own, one process per host (``mpiexec -disable-auto-cleanup -hosts
a:1,b:1``: a lost keeper leaves the others up; under Slurm a step of its own in the run's
allocation, ``srun --overlap --nodelist=a,b``): a meshplan worker that creates its host's
ranks' memory files, holds them for the run, and serves:

- ``keep_open {ranks}``: create the files; reply where each rank opens its own
  (``/proc/<keeper pid>/fd/<fd>``);
- ``keep_held {ranks}``: the steps each file holds a snapshot of;
- ``keep_read {step, want}``: pieces of a snapshot, to the controller (a shrink,
  ``distribute(elastic=)``, reads the whole mesh's state before it plans the smaller mesh).

With two hosts of keepers or more, each keeper also holds copies of the previous host's
ranks' files, which those ranks send it after each snapshot (``_snapshot.Replica``; Gemini's
ring, SOSP '23): a lost host's snapshots are read from the next host's keeper (``lose``).
With one host of keepers (every rank on one host besides the controller's), the controller
holds the copies, so that a spare host can take that host's ranks over when it is lost.

A rank that dies, or the whole rank job, leaves its host's keeper and files alone: the
restarted ranks (the launcher puts rank r on the same host again) read their pieces back from
them. A keeper dies with the controller as every worker does (heartbeats, the stdin guard), so
nothing is left behind. A host lost together with the next one (which held its copies) loses
its snapshots: one error names the rank whose snapshot is gone.
"""

from __future__ import annotations

import logging
import secrets
import socket
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from .._errors import RuntimeFailure
from ._channel import address_toward
from ._snapshot import SnapshotFiles, serve_replica
from ._worker import WorkerState, register

__all__ = ["KEEPER_PLUGIN", "MeshSnapshots"]

KEEPER_PLUGIN = "meshplan.runtime._keepers"
logger = logging.getLogger("meshplan.runtime")
_CONTROLLER = -1       # "keeper" index of this process, where it holds replicas


# ---- the keeper's side ------------------------------------------------------------------------

@register("keep_open")
def _keep_open(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    """Create this host's ranks' files, and when ``copies`` names ranks of another host, the
    files that hold their replicas and a listener the ranks send them to."""
    ns = state.ns
    ranks = [int(r) for r in header["ranks"]]
    ns.files = files = SnapshotFiles(ranks)
    reply: dict[str, Any] = {"paths": {str(r): files.path(r) for r in ranks}}
    copies = [int(r) for r in header.get("copies", ())]
    if copies:
        ns.copies = SnapshotFiles(copies)
        controller = str(header["controller"])
        bind = address_toward(socket.AF_INET6 if ":" in controller else socket.AF_INET,
                              (controller, 9))
        listener = socket.create_server((bind, 0))
        threading.Thread(target=_accept, args=(listener, bytes.fromhex(header["key"]),
                                               ns.copies.path),
                         name="meshplan-replicas", daemon=True).start()
        reply["replicas"] = [bind, listener.getsockname()[1]]
    return reply, []


_MAX_PENDING = 16      # replica connections not yet past their MAC'd hello, at once


def _accept(listener: socket.socket, key: bytes, path_of: Callable[[int], str]) -> None:
    """Take replica connections until the listener is closed (a keeper's: its life), each in
    a thread of its own; past ``_MAX_PENDING`` connections that have not said their hello,
    the next is closed at once (a flood of silent connections cannot pile up threads)."""
    pending = threading.BoundedSemaphore(_MAX_PENDING)
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:                 # closed: the controller's copies are done with
            return
        if not pending.acquire(blocking=False):
            conn.close()
            continue
        threading.Thread(target=_serve, args=(conn, key, path_of, pending), daemon=True,
                         name="meshplan-replica").start()


def _serve(conn: socket.socket, key: bytes, path_of: Callable[[int], str],
           pending: threading.BoundedSemaphore) -> None:
    held = [True]

    def vetted() -> None:
        held[0] = False
        pending.release()
    try:
        serve_replica(conn, key, path_of, vetted=vetted)
    except (OSError, RuntimeFailure, ValueError, KeyError) as exc:
        # the rank goes on without its copy (its next write finds the connection closed)
        print(f"meshplan keeper: a replica connection ended: {exc}", file=sys.stderr, flush=True)
    finally:
        if held[0]:
            pending.release()
        conn.close()


def _split(state: WorkerState, header: dict[str, Any], ranks: Iterable[int]
           ) -> list[tuple[SnapshotFiles, list[int]]]:
    """``ranks`` by the files that hold them: the ranks' own, and for those in ``copies``,
    the replicas this keeper holds."""
    copies = {int(r) for r in header.get("copies", ())}
    ranks = [int(r) for r in ranks]
    return [(files, mine) for files, mine in (
        (state.ns.files, [r for r in ranks if r not in copies]),
        (getattr(state.ns, "copies", None), [r for r in ranks if r in copies])) if mine]


@register("keep_close")
def _keep_close(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    """Close this keeper's files (a keeper that lives on: a k8s pod's agent, when its mesh's
    snapshots are done with)."""
    for name in ("files", "copies"):
        files = getattr(state.ns, name, None)
        if files is not None:
            files.close()
            delattr(state.ns, name)
    return {}, []


@register("keep_held")
def _keep_held(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    held: dict[str, Any] = {}
    for files, mine in _split(state, header, header["ranks"]):
        held.update({str(r): steps for r, steps in files.held(mine).items()})
    return {"held": held}, []


@register("keep_read")
def _keep_read(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    want = {int(r): names for r, names in header["want"].items()}
    got: dict[int, dict[str, torch.Tensor]] = {}
    for files, mine in _split(state, header, want):
        got.update(files.read(int(header["step"]), {r: want[r] for r in mine}))
    names = [[r, n] for r in sorted(got) for n in sorted(got[r])]
    return {"names": names}, [got[r][n] for r, n in names]


# ---- the controller's side --------------------------------------------------------------------

class MeshSnapshots:
    """Every rank's snapshot file: the files of ranks on the controller's host (``hosts[r]``
    None; all of them on one host) in this process, the others' in their host's keeper, and
    a replica of each file of a keeper's host (``replica``): with two hosts of keepers or
    more in the keeper of the next host, with one in this process (the controller's host is
    then the only other one: without it, losing that host would lose every snapshot of its
    ranks, and a spare host could not take them over). ``launch(names)`` starts one keeper
    per named host, in that order, and returns their ``Workers`` (``own``: they are stopped
    with the files; a k8s pod's agent, which keeps its pod's, is not). Reads as ``SnapshotFiles``
    does (``_snapshot.Held``), from a replica where the file's own keeper is lost
    (``lose``)."""

    def __init__(self, hosts: Sequence[str | None],
                 launch: Callable[[list[str]], Any], timeout_s: float, *,
                 own: bool = True) -> None:
        self.timeout_s = timeout_s
        self.own = own            # the keepers end with these files (else: their launcher's)
        self.local = SnapshotFiles([r for r, h in enumerate(hosts) if h is None])
        self._paths = {r: self.local.path(r) for r in self.local.fds}
        remote = list(dict.fromkeys(h for h in hosts if h is not None))
        self.hosts = remote
        self._keeper = {r: remote.index(h) for r, h in enumerate(hosts) if h is not None}
        self.dead: set[int] = set()            # keepers lost with their host
        self._listeners: dict[int, list[Any]] = {}
        self.key = secrets.token_bytes(32)
        self.keepers = None
        # one host of keepers: the replicas of its ranks' files, held here, and where its
        # ranks send them
        self.copies: SnapshotFiles | None = None
        self._copies_at: socket.socket | None = None
        if not remote:
            return
        try:
            self.keepers = keepers = launch(remote)
            keepers.keep_on_failure = True     # a lost keeper leaves the others serving
            for k in range(len(remote)):
                header: dict[str, Any] = {"ranks": self._ranks_of(k)}
                if len(remote) > 1:            # and the previous host's replicas
                    header.update(copies=self._ranks_of(k - 1), key=self.key.hex(),
                                  controller=keepers.master_addr)
                keepers.send(k, "keep_open", header)
            for k, reply in enumerate(keepers.gather("keep_open", timeout_s)):
                self._paths.update({int(r): p for r, p in reply.header["paths"].items()})
                if reply.header.get("replicas"):
                    self._listeners[k] = reply.header["replicas"]
            if len(remote) == 1:
                self._hold_copies(keepers.master_addr)
        except BaseException:
            self.close()
            raise

    def _hold_copies(self, controller: str) -> None:
        """Hold the replicas of the one keeper host's ranks in this process: their files, and
        a listener on the address the ranks reach the controller at, served as a keeper
        serves its own (``_accept``: MAC'd hellos, one thread per rank)."""
        self.copies = SnapshotFiles(self._ranks_of(0))
        listener = socket.create_server((controller, 0),
                                        family=socket.AF_INET6 if ":" in controller
                                        else socket.AF_INET)
        self._copies_at = listener
        threading.Thread(target=_accept, args=(listener, self.key, self.copies.path),
                         name="meshplan-replicas", daemon=True).start()
        self._listeners[_CONTROLLER] = [controller, listener.getsockname()[1]]

    def _ranks_of(self, keeper: int, ranks: Iterable[int] | None = None) -> list[int]:
        keeper %= max(1, len(self.hosts))
        return sorted(r for r in (self._keeper if ranks is None else ranks)
                      if self._keeper.get(r) == keeper)

    def path(self, rank: int) -> str:
        """Where rank ``rank`` opens its file, on its own host."""
        return self._paths[rank]

    def _successor(self, keeper: int) -> int:
        """Who holds the replicas of ``keeper``'s ranks: the next host's keeper, or with one
        host of keepers, this process (``_CONTROLLER``)."""
        return (keeper + 1) % len(self.hosts) if len(self.hosts) > 1 else _CONTROLLER

    def replica(self, rank: int) -> dict[str, Any] | None:
        """Where rank ``rank`` sends the copy of each snapshot (the next host's keeper; this
        process, where there is one host of keepers), or None (a rank on the controller's
        host, a keeper lost)."""
        k = self._keeper.get(rank)
        if k is None:
            return None
        succ = self._successor(k)
        if succ in self.dead or succ not in self._listeners:
            return None
        return {"address": self._listeners[succ], "key": self.key.hex()}

    def lose(self, ranks: Iterable[int]) -> None:
        """The hosts of ``ranks`` are lost (no heartbeat), their keepers with them: reads of
        their ranks' files go to the replicas from now on."""
        self.dead |= {self._keeper[r] for r in ranks if r in self._keeper}

    def _where(self, rank: int) -> tuple[int, bool]:
        """The keeper that holds rank ``rank``'s snapshot (``_CONTROLLER``: this process),
        and whether as a replica."""
        k = self._keeper[rank]
        if k not in self.dead:
            return k, False
        succ = self._successor(k)
        if succ == _CONTROLLER and self.copies is not None:
            return succ, True
        if succ != _CONTROLLER and succ not in self.dead:
            return succ, True
        raise RuntimeFailure(
            f"rank {rank}'s snapshot is lost: its host {self.hosts[k]} is gone"
            + (f", and so is {self.hosts[succ]}, which held its copy" if succ != _CONTROLLER
               else ", and the controller held no copy of it"))

    def _copied_here(self, ranks: Iterable[int]) -> list[int]:
        """Of ``ranks``, those read from the replicas this process holds."""
        return [r for r in ranks if r in self._keeper and self._where(r)[0] == _CONTROLLER]

    def _ask(self, kind: str, ranks: Iterable[int], header: Callable[[list[int]], dict]
             ) -> list[Any]:
        """Ask each keeper that holds files of ``ranks`` (their own, or replicas: ``copies``)
        ``kind``, with ``header(its ranks)``; their replies."""
        by: dict[int, tuple[list[int], list[int]]] = {}
        for r in sorted(ranks):
            if r in self._keeper:
                k, copy = self._where(r)
                if k == _CONTROLLER:          # read here (``_copied_here``)
                    continue
                by.setdefault(k, ([], []))[0].append(r)
                if copy:
                    by[k][1].append(r)
        if not by:
            return []
        if self.keepers is None or self.keepers.closed:
            raise RuntimeFailure("the snapshot keepers are gone: the snapshots of the ranks "
                                 f"on {', '.join(self.hosts)} went with them")
        for k, (mine, copies) in sorted(by.items()):
            self.keepers.send(k, kind, {**header(mine), "copies": copies})
        return self.keepers.gather(kind, self.timeout_s, ranks=sorted(by))

    def held(self, ranks: Iterable[int]) -> dict[int, list[int] | None]:
        ranks = list(ranks)
        out = self.local.held(r for r in ranks if r in self.local.fds)
        if self.copies is not None:
            out.update(self.copies.held(self._copied_here(ranks)))
        for reply in self._ask("keep_held", ranks, lambda mine: {"ranks": mine}):
            out.update({int(r): steps for r, steps in reply.header["held"].items()})
        return out

    def read(self, step: int, want: Mapping[int, Sequence[str]]
             ) -> dict[int, dict[str, torch.Tensor]]:
        out = self.local.read(step, {r: n for r, n in want.items() if r in self.local.fds})
        if self.copies is not None:
            out.update(self.copies.read(step, {r: want[r] for r in self._copied_here(want)}))
        for reply in self._ask("keep_read", want, lambda mine: {
                "step": step, "want": {str(r): list(want[r]) for r in mine}}):
            for (r, name), tensor in zip(reply.header["names"], reply.tensors):
                out.setdefault(int(r), {})[name] = tensor
        return out

    def close(self) -> None:
        self.local.close()
        if self._copies_at is not None:
            self._copies_at.close()           # ends the accepting thread
            self._copies_at = None
        if self.copies is not None:
            self.copies.close()
            self.copies = None
        keepers, self.keepers = self.keepers, None
        if keepers is not None and not self.own:
            # they stay and their files are done with (a lost one's went with it); where a
            # keeper ended unforeseen, the run is ending (its launcher ends them all)
            live = [k for k in range(len(self.hosts)) if k not in self.dead]
            if live and not keepers.closed and not keepers.failed_ranks():
                try:
                    for k in live:
                        keepers.send(k, "keep_close", {})
                    keepers.gather("keep_close", self.timeout_s, ranks=live)
                except RuntimeFailure as exc:
                    logger.debug("closing the keepers' snapshot files: %s", exc)
        elif keepers is not None and self.dead:     # a lost keeper would not answer: stop now
            keepers.stop(grace_s=0.5)
        elif keepers is not None:
            keepers.shutdown(timeout_s=5.0)
