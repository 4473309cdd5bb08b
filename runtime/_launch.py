"""Starting worker processes on this machine and driving them from the controller.

``LocalLauncher().launch(n)`` starts ``n`` workers (``python -m meshplan.runtime._worker``), waits
for each to say hello and returns :class:`Workers`: send, broadcast, gather the replies, shut down.
Every failure (a handler that raised, a worker that exited, a timeout) stops all workers and
raises :class:`WorkerFailure`; nothing is left running, even when the controller is killed
(see ``_worker``: a stdin pipe and ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import torch

from .._errors import RuntimeFailure
from . import _channel as P  # the protocol: message kinds, environment names
from ._channel import ControllerChannel, Message, Secret
from ._logs import ENV_LOGS, LogLines, stacks_text

__all__ = ["LocalLauncher", "StepFailed", "WorkerFailure", "Workers"]

_POLL_S = 0.05          # how often a waiting controller looks at its worker processes
EXIT_GRACE_S = 3.0      # a rank whose connection is gone: how long its launcher may take to say why
STOPPED_S = 10.0        # a rank stopped (SIGSTOP, state T) this long while awaited fails the call
_DRAIN_S = 0.2          # after an exit, how long to wait for messages the rank sent before dying
_STDERR_TAIL_LINES = 20

logger = logging.getLogger(__name__)


class WorkerFailure(RuntimeFailure):
    """One or more ranks failed; all workers have been stopped.

    ``reason`` is ``"error"`` (a handler raised: ``remote_type``, ``remote_traceback``, ``where``
    are set), ``"exit"`` (a process ended: ``exit_code``; negative is a signal), ``"timeout"``,
    ``"stopped"`` (a rank stopped by SIGSTOP for ``STOPPED_S``), ``"dropped"`` (a rank closed
    its control connection while its process lives; on one host), ``"lost"`` (ranks on another
    host sent no heartbeat for ``$MESHPLAN_LOST_AFTER_S``: ``hosts`` names them) or
    ``"protocol"`` (an unexpected reply).
    """

    def __init__(self, message: str, *, reason: str, ranks: Sequence[int], kind: str,
                 remote_type: str | None = None, remote_traceback: str | None = None,
                 where: str | None = None, exit_code: int | None = None,
                 hosts: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.hosts = tuple(hosts)
        self.reason, self.ranks, self.kind = reason, tuple(ranks), kind
        self.rank = self.ranks[0] if len(self.ranks) == 1 else None
        self.remote_type, self.remote_traceback, self.where = remote_type, remote_traceback, where
        self.exit_code = exit_code


class StepFailed(RuntimeFailure):
    """A rank failed inside a step and no rank applied it: every rank's state is as before the
    call and the workers are running, ready for the next one (``backends.run``). ``ranks``: the
    ranks that failed; ``remote_type``, ``remote_traceback`` and ``where`` are the first's."""

    def __init__(self, message: str, *, ranks: Sequence[int], kind: str,
                 remote_type: str | None = None, remote_traceback: str | None = None,
                 where: str | None = None) -> None:
        super().__init__(message)
        self.reason, self.ranks, self.kind = "not_applied", tuple(ranks), kind
        self.rank = self.ranks[0]
        self.remote_type, self.remote_traceback, self.where = remote_type, remote_traceback, where


class _Group:
    """The processes, pipes, log files and channel of one launch; what the finalizer stops."""

    def __init__(self, channel: ControllerChannel, store: RendezvousStore | None = None) -> None:
        self.channel = channel
        self.store = store
        self.procs: list[subprocess.Popen] = []
        self.logs: list[IO[bytes]] = []
        self.closed = False
        # start rank r again (``Workers.respawn``); None where the launcher cannot
        self.respawn: Callable[[int], subprocess.Popen] | None = None
        # a worker started ahead, torch imported, waiting to be told its rank (local only)
        self.spare: subprocess.Popen | None = None
        self.start_spare: Callable[[], subprocess.Popen] | None = None

    def running(self) -> bool:
        """Whether a process of this launch has not exited yet."""
        return any(p.poll() is None for p in self.procs)

    def stop(self, grace_s: float = 2.0) -> None:
        """Terminate every worker still running (then kill), close pipes, logs and channel."""
        if self.closed:
            return
        self.closed = True
        if self.spare is not None:
            self.procs.append(self.spare)     # stopped with the others
            self.spare = None
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                if getattr(proc, "local", True) and proc.pid is not None:
                    try:            # a stopped rank acts on SIGTERM now (not a pid elsewhere)
                        os.kill(proc.pid, signal.SIGCONT)
                    except OSError:
                        pass
        _close_pipes(self.procs)        # EOF on stdin: the worker's guard exits at once
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.close_ends()
        _remove_leftovers(self.channel.run_id)

    def close_ends(self) -> None:
        """Close what the controller holds of the launch once its processes are gone: the
        log files, the channel and the rendezvous store."""
        for log in self.logs:
            log.close()
        self.channel.close()
        if self.store is not None:
            self.store.close()


def _remove_leftovers(run_id: str) -> None:
    """What ranks stopped mid-way can leave: a shared-memory group file a rank created and
    had not unlinked yet (``backends/_shm.py``)."""
    from ..backends._shm import remove_run_files

    for name in remove_run_files(run_id):
        logger.info("meshplan: removed /dev/shm/%s left by a stopped rank", name)


_STATES = {"R": "running", "S": "waiting (sleeping)", "D": "in uninterruptible I/O",
           "T": "stopped (SIGSTOP)", "t": "held by a debugger", "Z": "exited (zombie)",
           "X": "exited", None: "gone"}


def _proc_state(pid: int) -> str | None:
    """The state letter of a local process (``/proc/PID/stat``), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:][:1] or None


def _is_stopped(proc: Any) -> bool:
    """Whether a rank's process is stopped (state ``T``): read here on this host, asked of its
    launcher where that can tell for another host (``proc.stopped()``: a k8s pod's agent)."""
    if hasattr(proc, "stopped"):
        return bool(proc.stopped())
    return getattr(proc, "local", True) and _proc_state(proc.pid) == "T"


def _close_pipes(procs: Sequence[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.stdin is not None and not proc.stdin.closed:
            try:
                proc.stdin.close()
            except OSError:
                pass


class RendezvousStore:
    """The torch.distributed store of one launch, served by the controller for its lifetime.

    The controller binds the listening socket itself, on ``host`` only (loopback for one host),
    and hands it to ``TCPStore`` (``master_listen_fd``), so the port is never closed and
    re-opened (no race with another process picking it) and the store never listens on other
    interfaces. The store has no authentication of its own: every rank wraps it in a
    ``PrefixStore`` whose prefix is derived from the run's secret (``_channel.store_prefix``), so a peer
    without the secret can reach the port but not name, read or overwrite the run's keys.
    """

    def __init__(self, host: str) -> None:
        import datetime

        import torch.distributed as dist

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, 0))
            sock.listen(128)
            self.host, self.port = host, sock.getsockname()[1]
            self._store: Any = dist.TCPStore(
                host, self.port, None, True, datetime.timedelta(seconds=300),
                wait_for_workers=False, master_listen_fd=sock.fileno())
            sock.detach()              # the store owns the descriptor and closes it

    def close(self) -> None:
        self._store = None             # the server stops (and closes its socket) with it


def _by_signal(proc: Any) -> bool:
    """Whether a process of this host ended by a signal (a negative return code); a job's
    code (mpiexec, srun: ranks on other hosts) says nothing of how its first rank ended."""
    code = proc.returncode
    return getattr(proc, "local", True) and getattr(proc, "exit_order", 0) is not None \
        and code is not None and code < 0


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _tail(path: Path | None) -> str:
    if path is None or not path.exists():
        return ""
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - 8192))
        lines = f.read().decode(errors="replace").splitlines()[-_STDERR_TAIL_LINES:]
    return "\n".join("    " + line for line in lines)


def _remote_error(head: str, rank: int, header: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """The lines that report rank ``rank``'s ``error`` reply (``head`` + type: message, where,
    its traceback) and the failure's ``remote_type``, ``remote_traceback`` and ``where``."""
    remote_type, text = header.get("type", "Exception"), header.get("message", "")
    where, tb = header.get("where"), header.get("traceback", "")
    lines = [f"{head}{remote_type}: {text}"]
    if where:
        lines.append(f"  at {where}")
    if tb:
        lines += [f"  remote traceback (rank {rank}):", _indent(tb)]
    return lines, {"remote_type": remote_type, "remote_traceback": tb, "where": where}


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines())


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


_DEATH_GRACE_S = 0.2
STACKS_ON_HANG_S = 3.0     # how long a timeout waits for every rank's stacks before it fails
STACKS_LEAD_S = 1.0        # how long before a wait's deadline they are taken
# set by SIGUSR1 (``install_stack_signal``): the next poll of a wait dumps every rank's stacks
_DUMP_ASKED = threading.Event()


def install_stack_signal() -> bool:
    """``kill -USR1 <controller pid>``: the controller prints every rank's Python stacks (and
    a run with telemetry stores them) at its next poll while it waits for the ranks. Only
    from the main thread, and only where SIGUSR1 has no handler yet; returns whether it is
    installed."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None, _on_usr1):
        return False
    signal.signal(signal.SIGUSR1, _on_usr1)
    return True


def _on_usr1(signum: int, frame: Any) -> None:  # noqa: ARG001
    _DUMP_ASKED.set()


# an error with these words says a peer went away: the exit of the peer is waited for longer
# ("died": the shared-memory group's word for a member whose process is gone)
_PEER_LOST = ("reset by peer", "connection closed", "broken pipe", "connection refused",
              "end of file", "timed out", "timeout", "died")


def where_lines(failure: BaseException) -> str:
    """``"\n  rank R was in FILE:LINE in FN (what it served)"`` for each failed rank whose
    stacks the failure carries (a timeout's), else ``""``."""
    return _where(getattr(failure, "stacks", None) or {}, getattr(failure, "ranks", ()))


def _where(stacks: Mapping[int, Mapping[str, Any]], ranks: Sequence[int]) -> str:
    return "".join(f"\n  rank {r} was in {stacks[r].get('frame') or '?'} "
                   f"({stacks[r].get('doing') or '?'})" for r in ranks if r in stacks)


def _stop_group(group: _Group, logs: LogLines) -> None:
    group.stop()
    logs.close()


class Workers:
    """The controller's handle on ``n`` running workers. Use from one thread at a time.

    ``send``/``broadcast`` queue requests; ``gather`` waits for one reply per rank. Every failure
    stops all workers and raises :class:`WorkerFailure`. ``shutdown`` (also on ``with`` exit, at
    interpreter exit, or when the object is collected) stops them for good.
    """

    def __init__(self, group: _Group, *, run_id: str, master_addr: str, master_port: int,
                 log_dir: Path | None) -> None:
        self._group = group
        self.channel = group.channel
        self.n = len(group.procs)
        self.pids = tuple(p.pid for p in group.procs)
        self.run_id, self.master_addr, self.master_port = run_id, master_addr, master_port
        self.log_dir = log_dir
        self.hostnames: tuple[str, ...] = ()
        self._late: dict[int, list[str]] = {}   # per rank: kinds of replies given up on
        # a new process's hello that came while the controller waited for something else (a
        # k8s pod made again: its agent connects when it is up, whatever is under way); the
        # next gather of hellos takes it
        self._hellos: dict[int, Message] = {}
        self._stopped_since: dict[int, float] = {}
        self.stopped_s = STOPPED_S     # how long an awaited rank may stay stopped (state T)
        # a failure raises without stopping the workers: the caller replaces the failed ranks
        # or stops them all (``distribute(fault_tolerance=True)``)
        self.keep_on_failure = False
        self._stopped_checked = 0.0
        # the ranks' output, rank-prefixed and collapsed (runtime/_logs.py); ``label`` names
        # the mesh in each line
        self.logs = LogLines(self.n)
        self.channel.on_log = self.logs.add
        # between calls too (the program runs its own code): lines printed as they come
        self.channel.start_pump()
        self._early_stacks: dict[int, dict[str, Any]] | None = None
        # where the stacks a hang or SIGUSR1 brings go (``DistributedStep`` records them)
        self.on_stacks: Callable[[dict[int, dict[str, Any]], str], None] | None = None
        self._finalizer = weakref.finalize(self, _stop_group, group, self.logs)

    @property
    def closed(self) -> bool:
        return self._group.closed

    def __repr__(self) -> str:
        state = "closed" if self.closed else "running"
        return f"Workers(n={self.n}, run_id={self.run_id!r}, {state})"

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- requests ---------------------------------------------------------------------------

    def send(self, rank: int, kind: str, header: dict[str, Any] | None = None,
             tensors: Sequence[torch.Tensor] = ()) -> None:
        self._check_open()
        if not 0 <= rank < self.n:
            raise ValueError(f"rank {rank} is outside 0..{self.n - 1}")
        try:
            self.channel.send(rank, kind, header, tensors)
        except RuntimeFailure as exc:       # the rank is gone: say why, stop everyone
            # its connection may close before its launcher has seen it end (a pod's eviction
            # reaches the watch a moment later): wait for that a little, it says why
            deadline = time.monotonic() + EXIT_GRACE_S
            while True:
                self._check_exits(kind)
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
            self._fail(WorkerFailure(f"{exc}\n  all {self.n} workers were stopped",
                                     reason="protocol", ranks=[rank], kind=kind))

    def broadcast(self, kind: str, header: dict[str, Any] | None = None,
                  tensors_per_rank: Sequence[Sequence[torch.Tensor]] | None = None) -> None:
        """Send ``kind`` with the same header to every rank; rank r gets ``tensors_per_rank[r]``."""
        if tensors_per_rank is not None and len(tensors_per_rank) != self.n:
            raise ValueError(f"tensors_per_rank has {len(tensors_per_rank)} entries for {self.n} ranks")
        for rank in range(self.n):
            self.send(rank, kind, header, () if tensors_per_rank is None else tensors_per_rank[rank])

    def gather(self, kind_expected: str, timeout_s: float | None = None,
               ranks: Sequence[int] | None = None, *, advice: str | None = None
               ) -> list[Message]:
        """One ``kind_expected`` reply per rank (of ``ranks`` when given), ordered by rank.

        Raises WorkerFailure (after stopping all workers) when a rank replies ``error``, a worker
        process exits, or ``timeout_s`` passes (None: no limit; exits are still noticed); and
        StepFailed, with the workers left running, when every rank replies an ``error`` that
        says its state is intact (a step no rank applied, ``backends.run``).
        """
        self._check_open()
        started = time.monotonic()
        deadline = None if timeout_s is None else started + timeout_s
        # the stacks a timeout reports are taken STACKS_LEAD_S before it: by then the ranks'
        # own collectives (whose limit is the same timeout_s) have not yet given up
        self._early_stacks = None
        early = None if timeout_s is None or timeout_s < 2 * STACKS_LEAD_S else \
            deadline - STACKS_LEAD_S
        got: dict[int, Message] = {}
        if ranks is not None:       # the others count as answered: nothing is asked of them
            got = {r: Message(kind_expected, {}, []) for r in range(self.n) if r not in ranks}
        if kind_expected == P.HELLO:
            for rank in [r for r in self._hellos if r not in got]:
                got[rank] = self._hellos.pop(rank)
        while len(got) < self.n:
            wait = _POLL_S if deadline is None else max(0.0, min(_POLL_S, deadline - time.monotonic()))
            try:
                rank, message = self.channel.recv(wait)
            except TimeoutError:
                pass
            else:
                if not self._is_late(rank, message):
                    self._take(rank, message, kind_expected, got)
            if _DUMP_ASKED.is_set():
                self._dump_on_signal()
            self._check_exits(kind_expected)
            self._check_dropped(kind_expected, got)
            self._check_stopped(kind_expected, got)
            self._check_lost(kind_expected, got, started)
            if early is not None and time.monotonic() >= early and len(got) < self.n:
                early = None
                self._early_stacks = self.stacks(timeout_s=STACKS_LEAD_S / 2)
            if deadline is not None and time.monotonic() >= deadline and len(got) < self.n:
                self._timeout(kind_expected, timeout_s, got, advice)
        failed = {r: m.header for r, m in got.items() if m.kind == P.ERROR}
        if failed:
            raise self._not_applied(failed, kind_expected)
        return [got[rank] for rank in (range(self.n) if ranks is None else sorted(ranks))]

    def gather_some(self, kind_expected: str, timeout_s: float
                    ) -> tuple[dict[int, Message], dict[int, dict[str, Any]], list[int]]:
        """Best effort: the ``kind_expected`` replies that arrive within ``timeout_s``.

        Returns ``(replies, errors, missing)``: replies by rank, the ``error`` reply headers of
        ranks whose handler raised (not fatal here), and the ranks that did not answer in time.
        A missing rank's reply, when it comes later, is dropped, so later requests still pair
        with their own replies. A worker process that exits still stops the run.
        """
        self._check_open()
        deadline = time.monotonic() + timeout_s
        got: dict[int, Message] = {}
        errors: dict[int, dict[str, Any]] = {}
        while len(got) + len(errors) < self.n and (left := deadline - time.monotonic()) > 0:
            try:
                rank, message = self.channel.recv(min(_POLL_S, left))
            except TimeoutError:
                pass
            else:
                if self._is_late(rank, message):
                    continue
                if message.kind == P.ERROR and message.header.get("kind") == kind_expected \
                        and rank not in got and rank not in errors:
                    errors[rank] = dict(message.header)
                else:
                    self._take(rank, message, kind_expected, got)
            self._check_exits(kind_expected)
        missing = [r for r in range(self.n) if r not in got and r not in errors]
        for rank in missing:
            self._late.setdefault(rank, []).append(kind_expected)
        return got, errors, missing

    def stacks(self, timeout_s: float = 3.0, ranks: Sequence[int] | None = None
               ) -> dict[int, dict[str, Any]]:
        """Every rank's Python stacks now (``runtime/_logs.python_stacks``: ``text``,
        ``frame``, ``doing``), asked of its side thread, which answers while the rank computes
        or waits in a collective (not while it is stopped, or stuck in C code that holds
        Python's lock). Ranks that do not answer within ``timeout_s`` are left out. Replies
        that come meanwhile are kept for the next read."""
        if self.closed:
            return {}
        ranks = [r for r in (range(self.n) if ranks is None else ranks)
                 if (proc := self._group.procs[r]).poll() is None and not _is_stopped(proc)]
        got = self.channel.ask_sides(ranks, P.STACKS, timeout_s=timeout_s)
        return {r: {k: v for k, v in m.header.items() if k != "req"}
                for r, m in sorted(got.items())}

    def _dump_on_signal(self) -> None:
        """SIGUSR1 to the controller (``install_stack_signal``): every rank's stacks, printed
        and handed to ``on_stacks``."""
        _DUMP_ASKED.clear()
        got = self.stacks()
        print(stacks_text(got, self.n, self.logs.label), file=sys.stderr, flush=True)
        if self.on_stacks is not None:
            self.on_stacks(got, "signal")

    def _is_late(self, rank: int, message: Message) -> bool:
        """Is this the reply to a request ``gather_some`` gave up on? (Then drop it.)"""
        late = self._late.get(rank)
        if not late:
            return False
        kind = message.header.get("kind") if message.kind == P.ERROR else message.kind
        if kind != late[0]:
            return False
        late.pop(0)
        return True

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask every worker to exit, wait up to ``timeout_s``, then terminate the rest. Idempotent."""
        if self.closed:
            return
        for rank, proc in enumerate(self._group.procs):
            if proc.poll() is None:
                try:
                    self.channel.send(rank, P.SHUTDOWN)
                except RuntimeFailure:
                    pass
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._group.running():
            try:                  # the ranks' last output lines come as they exit
                self.channel.recv(0.02)
            except (TimeoutError, RuntimeFailure):
                time.sleep(0.02)
        try:                      # what they sent before they ended is here already
            while True:
                self.channel.recv(0.001)
        except (TimeoutError, RuntimeFailure):
            pass
        self._finalizer()       # stop(): terminate/kill stragglers, close pipes and channel

    # -- replacing failed ranks (distribute(fault_tolerance=True)) -------------------------

    @property
    def can_respawn(self) -> bool:
        return self._group.respawn is not None and not self.closed

    def failed_ranks(self) -> list[int]:
        """Ranks whose process has exited, or is stopped (``_is_stopped``)."""
        return [r for r, p in enumerate(self._group.procs)
                if p.poll() is not None or _is_stopped(p)]

    def stop(self, grace_s: float | None = None) -> None:
        """Stop every worker now (terminate, then kill): no goodbye, nothing waited for.
        ``grace_s``: how long terminated workers get before the kill (default: the
        launcher's), short when some cannot answer anyway (their host is lost)."""
        if grace_s is None or not self._finalizer.alive:
            self._finalizer()
            return
        self._finalizer.detach()
        self._group.stop(grace_s)
        self.logs.close()

    def kill(self, ranks: Sequence[int]) -> None:
        """SIGKILL ``ranks`` (stopped ones too) and reap them."""
        for rank in ranks:
            self.channel.forget(rank)
            proc = self._group.procs[rank]
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                pass
            self._stopped_since.pop(rank, None)

    def sync(self, ranks: Sequence[int], timeout_s: float) -> bool:
        """Make sure ``ranks`` have nothing in flight: ping each and drop every other message
        until each has answered (a worker answers in order, so every earlier reply has come).
        False when one of them exits or does not answer within ``timeout_s`` (it is stuck:
        waiting in a collective for a peer that is gone)."""
        nonce = secrets.token_hex(8)
        try:
            for rank in ranks:
                self.channel.send(rank, P.PING, {"sync": nonce})
        except RuntimeFailure:
            return False
        waiting, deadline = set(ranks), time.monotonic() + timeout_s
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0 or any(self._group.procs[r].poll() is not None for r in waiting):
                return False
            try:
                rank, message = self.channel.recv(min(_POLL_S, left))
            except TimeoutError:
                continue
            if message.kind == P.PING and message.header.get("sync") == nonce:
                waiting.discard(rank)
        for rank in ranks:
            self._late.pop(rank, None)
        return True

    def keep_spare(self) -> None:
        """Start a spare worker (the local launcher), which imports torch and the plugins
        now and waits to be told its rank: ``respawn`` then costs no start-up."""
        group = self._group
        if group.start_spare is not None and not self.closed and (
                group.spare is None or group.spare.poll() is not None):
            group.spare = group.start_spare()

    def respawn(self, ranks: Sequence[int], timeout_s: float) -> None:
        """Start ``ranks`` again (after ``kill``) with the launch's environment and secret (the
        spare becomes the first of them when one is ready), and wait for their hello. A start
        that fails raises ``WorkerFailure`` as a launch does."""
        group = self._group
        if group.respawn is None:
            raise RuntimeFailure("this launcher cannot start a single rank again")
        for rank in ranks:
            self.channel.forget(rank)
            spare, group.spare = group.spare, None
            if spare is not None and spare.poll() is None and spare.stdin is not None:
                try:
                    spare.stdin.write(f"{rank}\n".encode())
                    spare.stdin.flush()
                    group.procs[rank] = spare
                    continue
                except OSError:
                    pass
            group.procs[rank] = group.respawn(rank)
        self.pids = tuple(p.pid for p in self._group.procs)
        hellos = self.gather(P.HELLO, timeout_s, ranks=ranks)
        names = list(self.hostnames) or [""] * self.n
        for rank, hello in zip(sorted(ranks), hellos):
            names[rank] = str(hello.header.get("hostname"))
        self.hostnames = tuple(names)
        if group.start_spare is not None:
            self.keep_spare()                 # for the next failure

    # -- failures ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeFailure(f"{self!r}: the workers were shut down; launch new ones")

    def _fail(self, failure: WorkerFailure) -> None:
        if not self.keep_on_failure:
            self._finalizer()
        raise failure

    def stash_hello(self, rank: int, message: Message) -> None:
        """Keep a hello that came while something else was awaited, for the next gather of
        hellos (``_hellos``)."""
        if 0 <= rank < self.n:
            self._hellos[rank] = message

    def _take(self, rank: int, message: Message, kind: str, got: dict[int, Message]) -> None:
        if message.kind == P.HELLO and kind != P.HELLO:
            self.stash_hello(rank, message)
            return
        intact = message.kind == P.ERROR and message.header.get("intact") is True \
            and message.header.get("kind") == kind
        if intact and rank not in got and 0 <= rank < self.n:
            if any(m.kind != P.ERROR for m in got.values()):
                self._fail(self._split(kind))
            got[rank] = message
            return
        if message.kind == P.ERROR:
            self._fail(self._dead_first(rank, kind, message.header)
                       or self._error(rank, message.header, kind))
        if any(m.kind == P.ERROR for m in got.values()):
            self._fail(self._split(kind))
        if message.kind != kind or rank in got or not 0 <= rank < self.n:
            what = "a second reply" if rank in got else f"{message.kind!r}"
            self._fail(WorkerFailure(
                f"rank {rank} sent {what} while the controller waited for {kind!r}\n"
                f"  all {self.n} workers were stopped", reason="protocol", ranks=[rank], kind=kind))
        got[rank] = message

    def _dead_first(self, rank: int, kind: str,
                    header: dict[str, Any] | None = None) -> WorkerFailure | None:
        """A peer that died explains a rank's error better than the error does (a collective
        with a dead peer fails with 'connection reset'): name the dead rank as the cause."""
        # A peer killed just now may still be tearing down (its sockets close before it
        # becomes a zombie); an error that says a connection broke waits longer for that.
        text = str(header.get("message", "")).lower() if header else ""
        grace = _DEATH_GRACE_S * (10 if any(w in text for w in _PEER_LOST) else 1)
        deadline = time.monotonic() + grace
        while True:
            dead = [r for r, p in enumerate(self._group.procs)
                    if r != rank and p.poll() is not None]
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        if not dead:
            return None
        first = self._first_exited(dead)
        code = self._group.procs[first].returncode
        host = self._host_of(first)
        on = f" (on {host})" if host else ""
        why = getattr(self._group.procs[first], "ended", None)   # what the launcher knows
        return WorkerFailure(
            f"rank {first}{on} {_describe_exit(code)} while the controller waited for {kind!r} "
            f"(rank {rank} then failed talking to it)" + (f"\n  {why}" if why else "")
            + f"\n  all {self.n} workers were stopped",
            reason="exit", ranks=[first], kind=kind, exit_code=code,
            hosts=[host] if host else [])

    def _error(self, rank: int, header: dict[str, Any], kind: str) -> WorkerFailure:
        lines, remote = _remote_error(f"rank {rank} failed in {header.get('kind', kind)!r}: ",
                                      rank, header)
        lines.append(f"  all {self.n} workers were stopped")
        return WorkerFailure("\n".join(lines), reason="error", ranks=[rank], kind=kind, **remote)

    def _not_applied(self, failed: dict[int, dict[str, Any]], kind: str) -> StepFailed:
        """Every rank answered ``kind`` with an intact error: name the ranks whose own op
        failed (the others only followed the vote) and say that nothing was applied."""
        causes = {r: h for r, h in failed.items() if h.get("type") != "StepAborted"} or failed
        rank = min(causes)
        lines, remote = _remote_error(f"{_ranks(sorted(causes))} failed in {kind!r}; rank {rank}: ",
                                      rank, causes[rank])
        lines.append(f"  no rank applied this {kind}: every rank's state is as before the call, "
                     f"and all {self.n} workers are running, ready for the next call")
        return StepFailed("\n".join(lines), ranks=sorted(causes), kind=kind, **remote)

    def _split(self, kind: str) -> WorkerFailure:
        return WorkerFailure(
            f"the ranks disagree on {kind!r}: some applied it, others report it applied nowhere"
            f"\n  all {self.n} workers were stopped", reason="protocol", ranks=[], kind=kind)

    def _check_exits(self, kind: str) -> None:
        exited = [r for r, p in enumerate(self._group.procs) if p.poll() is not None]
        if not exited:
            return
        rank = self._first_exited(exited)
        if not all(_by_signal(self._group.procs[r]) for r in exited):
            # an error a rank sent before it exited explains more than its exit; a process a
            # signal ended (SIGKILL, SIGSEGV) sent none, and waiting would only delay a recovery
            self._drain_errors(exited)
        proc = self._group.procs[rank]
        code = proc.returncode
        host = self._host_of(rank)
        on = f" (on {host})" if host else ""
        lines = [f"rank {rank}{on} {_describe_exit(code)} while the controller waited for "
                 f"{kind!r}"]
        if getattr(proc, "exit_order", 0) is None and not getattr(proc, "local", True):
            # one job (mpiexec) ran every rank and ended: its code is the job's; no pid of
            # another host's ranks can be watched here, but their control connections can
            lines = [f"rank {rank}{on} ended first (its control connection closed first) and "
                     f"the ranks' job ended the others (code {code}) while the controller "
                     f"waited for {kind!r}"] if rank in self.channel.ended else [
                     f"the ranks' job ended (code {code}) while the controller waited for "
                     f"{kind!r}: a rank ended and the job ended the others; which one ended "
                     f"first is not known here (ranks on other hosts); rank {rank}{on} is "
                     "named for it"]
        why = getattr(proc, "ended", None)   # what the launcher knows
        if why:
            lines.append(f"  {why}")
        tail = _tail(self.log_dir / f"rank{rank}.err" if self.log_dir else None)
        if tail:
            lines += [f"  stderr of rank {rank} (last lines, {self.log_dir}/rank{rank}.err):", tail]
        elif self.log_dir is None:
            lines.append("  (its stderr went to the controller's stderr above)")
        lines.append(f"  all {self.n} workers were stopped")
        self._fail(WorkerFailure("\n".join(lines), reason="exit", ranks=[rank], kind=kind,
                                 exit_code=code, hosts=[host] if host else []))

    def _first_exited(self, ranks: Sequence[int]) -> int:
        """The cause among exited ``ranks`` (mpiexec and srun end every rank once one dies):
        the first whose control connection ended, else the first to end where the launcher
        knows the order, else the lowest."""
        self.channel.poll_connections()
        ended = self.channel.ended

        def order(r: int) -> tuple[float, bool, int, int]:
            seen = getattr(self._group.procs[r], "exit_order", None)
            return ended.get(r, math.inf), seen is None, seen or 0, r

        return min(ranks, key=order)

    def _host_of(self, rank: int) -> str | None:
        """Where ``rank`` ran when the ranks span hosts (the launcher's word for a rank that
        ended first, else its hello's hostname); None on one host."""
        named = getattr(self._group.procs[rank], "node", None)
        if named:
            return named
        if len(set(self.hostnames)) > 1 and rank < len(self.hostnames):
            return self.hostnames[rank]
        return None

    def _drain_errors(self, exited: Sequence[int]) -> None:
        """Report an error an exited rank sent before it died. Errors of ranks still alive
        are effects (a collective lost its peer), not the cause: the exit is reported."""
        deadline = time.monotonic() + _DRAIN_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                rank, message = self.channel.recv(left)
            except TimeoutError:
                return
            if message.kind == P.ERROR and rank in exited:
                self._fail(self._error(rank, message.header, message.header.get("kind", "?")))

    def _state(self, rank: int) -> str:
        """What this host can tell of ``rank``'s process: its state, or where it runs when
        that is another host (its pid means nothing here)."""
        proc = self._group.procs[rank]
        if not getattr(proc, "local", True):
            host = self.hostnames[rank] if rank < len(self.hostnames) else "another host"
            return f"on {host}"
        return _STATES.get(_proc_state(proc.pid), "unknown")

    def _check_lost(self, kind: str, got: dict[int, Message], started: float) -> None:
        """Fail at once, naming the hosts, when the awaited ranks of another host have sent no
        heartbeat for ``lost_after_s`` (its network is cut, or it is down): the others wait
        for them in a collective, and a timeout would name every rank, much later. Ranks on
        this host are judged by their processes instead (``_check_exits``). Silence counts
        from the start of this wait at the earliest: beats queue while nobody reads them."""
        beats = self.channel.last_beat
        if not beats:
            return
        now, limit = time.monotonic(), P.lost_after_s()
        silent = {r: now - max(t, started) for r, t in beats.items() if r not in got}
        lost = [r for r, quiet in sorted(silent.items()) if quiet >= limit]
        if not lost:
            return
        hosts: dict[str, list[int]] = {}
        for r in lost:
            hosts.setdefault(self.hostnames[r] if r < len(self.hostnames) else "?", []).append(r)
        where = "; ".join(f"host {h} ({_ranks(rs)})" for h, rs in hosts.items())
        self._fail(WorkerFailure(
            f"lost {where}: no heartbeat for {min(silent[r] for r in lost):.0f} s while "
            f"the controller waited for {kind!r}; the host is down or unreachable from this "
            f"one\n  all {self.n} workers were stopped (ranks on a host the controller cannot "
            f"reach stop by themselves once they lose it, after ${P.ENV_LOST_AFTER} = "
            f"{limit:g} s)", reason="lost", ranks=lost, kind=kind, hosts=list(hosts)))

    def _check_dropped(self, kind: str, got: dict[int, Message]) -> None:
        """Fail at once, naming it, when an awaited rank's control connection has closed while
        its process lives (``channel.ended``, where the channel ``sees_drops``: on one host):
        it can neither be told what to do nor answer, and would otherwise be caught by the
        step's deadline, with every rank blamed. A rank whose process ended is left to
        ``_check_exits`` (its exit says more)."""
        ended = self.channel.ended
        if not ended or not self.channel.sees_drops:
            return
        now = time.monotonic()
        for rank, since in sorted(ended.items()):
            if rank in got or not 0 <= rank < self.n or now - since < _DEATH_GRACE_S:
                continue
            proc = self._group.procs[rank]
            if proc.poll() is not None or (getattr(proc, "local", True) and proc.pid
                                           and _proc_state(proc.pid) in (None, "Z", "X")):
                continue            # it ended: the launcher will say so (mpiexec: soon)
            self._fail(WorkerFailure(
                f"rank {rank} closed its control connection to the controller while its "
                f"process lives ({self._state(rank)}, pid {proc.pid}), while the controller "
                f"waited for its {kind!r} reply, which it can no longer send\n  all {self.n} "
                "workers were stopped", reason="dropped", ranks=[rank], kind=kind))

    def _timeout(self, kind: str, timeout_s: float | None, got: dict[int, Message],
                 advice: str | None = None) -> None:
        missing = [r for r in range(self.n) if r not in got]
        states = [f"rank {r}: {self._state(r)}" for r in missing]
        # where the ranks are: the ones that did not answer, and the others (waiting)
        stacks = (self._early_stacks if self._early_stacks is not None
                  else self.stacks(timeout_s=STACKS_ON_HANG_S))
        failure = WorkerFailure(
            f"{_ranks(missing)} did not answer {kind!r} within {timeout_s:g} s"
            f" ({len(got)} of {self.n} answered; {', '.join(states)})"
            + _where(stacks, missing) + f"\n  all {self.n} workers were stopped; "
            f"{advice or 'if the work is just slow, raise timeout_s'}"
            + ("; with telemetry on, every rank's stacks are in its stacks table"
               if stacks else ""),
            reason="timeout", ranks=missing, kind=kind)
        failure.stacks = stacks
        self._fail(failure)

    def _check_stopped(self, kind: str, got: dict[int, Message]) -> None:
        """Fail at once, naming it, when an awaited rank has been stopped (SIGSTOP or SIGTSTP:
        state ``T``) for ``STOPPED_S``: the others wait for it in a collective, and a timeout
        would name them all much later. A rank held by a debugger (``t``) is left alone. A
        rank on another host is judged by its launcher where that can tell
        (``proc.stopped()``: a k8s pod's agent)."""
        now = time.monotonic()
        if now - self._stopped_checked < 1.0:
            return
        self._stopped_checked = now
        for rank in range(self.n):
            proc = self._group.procs[rank]
            if rank in got or not _is_stopped(proc):
                self._stopped_since.pop(rank, None)
                continue
            since = self._stopped_since.setdefault(rank, now)
            if now - since >= self.stopped_s:
                self._fail(WorkerFailure(
                    f"rank {rank} is stopped (state T: SIGSTOP or SIGTSTP; pid "
                    f"{self._group.procs[rank].pid}) and has been for {now - since:.0f} s while "
                    f"the controller waited for {kind!r}; the other ranks wait for it\n"
                    f"  all {self.n} workers were stopped; resume it with SIGCONT next time "
                    "before the call's timeout",
                    reason="stopped", ranks=[rank], kind=kind))


class LocalLauncher:
    """Start workers as subprocesses of this process, connected over loopback.

    ``log_dir``: capture each rank's stdout/stderr to ``log_dir/rank{r}.out|.err`` (default: the
    workers inherit this process's stdout and stderr). ``hello_timeout_s`` bounds start-up.
    A launch from a thread other than the main thread skips ``PR_SET_PDEATHSIG`` (Linux sends it
    when the launching *thread* ends); the stdin guard still applies.

    ``fork``: fork the workers from this process's zygote (``_zygote.py``: a process that
    imported torch and meshplan's runtime once; a worker then starts in milliseconds instead
    of ~2 s of imports), where it can serve them (Linux; ``$MESHPLAN_ZYGOTE`` not ``0``; the
    same python and import-time environment). Only for CPU ranks: a CUDA runtime must not be
    touched before a fork, and nothing here proves that no import in the zygote did.
    """

    def __init__(self, *, host: str = "127.0.0.1", log_dir: str | os.PathLike | None = None,
                 hello_timeout_s: float = 120.0, python: str = sys.executable,
                 fork: bool = True) -> None:
        self.host, self.hello_timeout_s, self.python = host, hello_timeout_s, python
        self.fork = fork
        self.log_dir = None if log_dir is None else Path(log_dir)

    def launch(self, n: int, *, env: Mapping[str, str] | None = None,
               cwd: str | os.PathLike | None = None) -> Workers:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"launch needs at least one worker, got n={n!r}")
        secret, run_id = Secret.new(), secrets.token_hex(8)
        group = _Group(ControllerChannel(secret, run_id, self.host), RendezvousStore(self.host))
        master_port = group.store.port
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        base = self._environment(n, env, run_id, group.channel.address, master_port)
        try:
            for rank in range(n):
                group.procs.append(self._start(rank, base, cwd, group, secret))
        except BaseException:
            group.stop()
            raise
        group.respawn = lambda rank: self._start(rank, base, cwd, group, secret, again=True)
        if self.log_dir is None:      # a spare's output goes where the ranks' goes
            group.start_spare = lambda: self._start(-1, base, cwd, group, secret)
        workers = Workers(group, run_id=run_id, master_addr=self.host, master_port=master_port,
                          log_dir=self.log_dir)
        hellos = workers.gather(P.HELLO, timeout_s=self.hello_timeout_s)
        workers.hostnames = tuple(str(h.header.get("hostname")) for h in hellos)
        return workers

    def _environment(self, n: int, env: Mapping[str, str] | None, run_id: str, address: str,
                     master_port: int) -> dict[str, str]:
        out = dict(os.environ)
        out.update({str(k): str(v) for k, v in (env or {}).items()})
        if "OMP_NUM_THREADS" not in out:       # n workers share this machine's cores
            out["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
        if self.log_dir is not None:       # the files keep every line of every rank
            out.setdefault(ENV_LOGS, "off")
        main_thread = threading.current_thread() is threading.main_thread()
        out.update({
            P.ENV_WORLD_SIZE: str(n), P.ENV_ADDRESS: address, P.ENV_RUN_ID: run_id,
            P.ENV_PARENT_PID: str(os.getpid()), P.ENV_PDEATHSIG: "1" if main_thread else "0",
            "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n),
            "MASTER_ADDR": self.host, "MASTER_PORT": str(master_port),
        })
        return out

    def _fork(self, env: dict[str, str], cwd: str | os.PathLike | None, out: IO[bytes] | None,
              err: IO[bytes] | None) -> Any:
        """The worker forked by this process's zygote (``_zygote.py``: torch already imported),
        or None where it cannot be (off, another python, an import-time variable differs, the
        zygote failed: the caller starts a new interpreter)."""
        from . import _zygote

        if not self.fork:
            return None
        try:
            zygote = _zygote.get(self.python, env)
            if zygote is None:
                return None
            where = os.fspath(cwd) if cwd is not None else os.getcwd()
        except OSError as exc:              # the zygote could not start; cwd deleted
            logger.debug("no zygote: %s", exc)
            return None
        read, write = os.pipe()
        stdin = os.fdopen(write, "wb")
        try:
            env = dict(env, **{P.ENV_PARENT_PID: str(zygote.pid)})
            return zygote.spawn(env, where, read, out.fileno() if out else 1,
                                err.fileno() if err else 2, stdin)
        except _zygote.RefusedFork as exc:
            stdin.close()
            logger.debug("the zygote cannot fork this worker (%s): a new interpreter", exc)
            return None
        except RuntimeFailure as exc:
            stdin.close()
            logger.warning("meshplan: %s; this worker starts as a new interpreter", exc)
            return None
        finally:
            os.close(read)

    def _start(self, rank: int, base: dict[str, str], cwd: str | os.PathLike | None,
               group: _Group, secret: Secret, again: bool = False) -> subprocess.Popen:
        env = dict(base, **{P.ENV_RANK: str(rank), "RANK": str(rank), "LOCAL_RANK": str(rank)}
                   ) if rank >= 0 else dict(base, MESHPLAN_SPARE="1")    # -1: a spare
        out = err = None
        if self.log_dir is not None:      # a rank started again appends to its logs
            out = open(self.log_dir / f"rank{rank}.out", "ab" if again else "wb")
            group.logs.append(out)
            err = open(self.log_dir / f"rank{rank}.err", "ab" if again else "wb")
            group.logs.append(err)
        proc = self._fork(env, cwd, out, err)
        if proc is None:
            try:
                proc = subprocess.Popen([self.python, "-m", "meshplan.runtime._worker"],
                                        stdin=subprocess.PIPE, stdout=out, stderr=err, env=env,
                                        cwd=cwd, close_fds=True)
            except OSError as exc:
                raise RuntimeFailure(f"could not start worker rank {rank} ({self.python} -m "
                                     f"meshplan.runtime._worker, cwd={cwd}): {exc}") from exc
        assert proc.stdin is not None
        try:
            proc.stdin.write(secret.hex().encode() + b"\n")     # the secret never hits argv/env
            proc.stdin.flush()
        except BrokenPipeError:
            pass        # it died at once; gather("hello") reports its exit
        return proc
