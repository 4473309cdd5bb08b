"""The ``slurm`` launcher: workers started by ``srun`` on the nodes of a Slurm allocation.

``SlurmLauncher(options).launch(n)`` returns the same :class:`Workers` as the other launchers:
the controller model (one controller, an authenticated channel, hello, send / gather,
failures) does not change. What does:

- **The allocation.** Inside one (``salloc``, ``sbatch``: ``$SLURM_JOB_ID`` is set) the ranks run
  on its nodes. Outside one, the launcher asks for one with ``salloc`` (``slurm=`` options:
  ``nodes``, ``partition``, ``time``, ``account``, ``qos``, ``constraint``, ``args``), waits
  for it with progress (``wait_s`` bounds the wait) and gives it back at shutdown. What holds
  the allocation is salloc's command, run on this machine: a shell that prints the allocation
  and then waits for the end of its stdin, a pipe only the controller holds. So the
  allocation ends with the controller however it ends (``kill -9`` included: the pipe closes;
  salloc also gets SIGTERM from ``PR_SET_PDEATHSIG``), and ``scancel`` follows when salloc
  does not give it back by itself.
- **Placement.** ``srun --nodes N --ntasks n --ntasks-per-node n/N --distribution block``:
  consecutive ranks on one node, so the innermost mesh axes (whose groups are consecutive
  ranks) stay inside a node. The rank is ``$SLURM_PROCID``, the local rank ``$SLURM_LOCALID``.
  A mesh that does not split evenly over the nodes, or that needs more CPUs per node than the
  allocation has (without ``overcommit``), is refused before anything starts.
- **Secret.** srun sends its stdin to every task (``--input all``): the secret's line, then
  nothing until the controller goes. Every worker keeps the local launcher's guard (EOF on
  stdin: the controller is gone, exit at once). The key never rests on disk, and no file
  system needs to be shared.
- **Channel and collectives.** The control channel listens on this machine's address toward
  the nodes (TCP with CURVE and the run's keys), or on a local socket when every node is this
  machine; collectives are torch.distributed's (gloo between CPU ranks) through the
  controller's rendezvous store, and shared memory between the ranks of one node. MPI's
  one-sided transfers belong to ``launcher="mpi"``.
- **Failures.** ``--kill-on-bad-exit``: a rank that exits non-zero ends the step, and srun's own
  line (``srun: error: NODE: task K: Exited with exit code C``) tells which task ended first
  and on which node. Ranks on other nodes beat (``_channel._Side``): a node whose beats
  stop is named within ``$MESHPLAN_LOST_AFTER_S``.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .._errors import RuntimeFailure
from . import _channel as P
from ._channel import ControllerChannel, Secret
from ._launch import LocalLauncher, RendezvousStore, WorkerFailure, Workers, _Group
from ._mpi_launch import (
    _last_words,
    _pdeathsig_setter,
    _RankProc,
    _watch_exits,
    controller_address,
    end_job,
    is_this_host,
    start_job,
)

__all__ = ["Allocation", "SlurmLauncher", "SlurmOptions", "slurm_nodes", "worker_rank"]

logger = logging.getLogger("meshplan.runtime")

ENV_SLURM = "MESHPLAN_SLURM"              # "1": started by srun; rank from $SLURM_PROCID
ENV_LOST = "MESHPLAN_SLURM_LOST"          # the allocation's nodes fault tolerance lost
SLURM_FIX = ("install Slurm's client commands (Debian: apt-get install slurm-client) or run "
             "where they are on PATH")
# salloc's command: say what was allocated, then hold it until the controller's pipe closes
_HOLD = ('echo "meshplan-allocation $SLURM_JOB_ID $SLURM_JOB_NODELIST '
         '$SLURM_JOB_CPUS_PER_NODE"; exec cat >/dev/null')
_SRUN_ERROR = re.compile(r"srun: error: (\S+): tasks? ([0-9,\-]+): (.*)")
_JOB_ID = re.compile(r"job(?: allocation)? (\d+)")
# squeue's reasons for a pending job that cannot start as asked, whatever else ends: with
# EnforcePartLimits=NO (Slurm's default) such a request waits in the queue for ever
_NEVER = {"PartitionNodeLimit": "more nodes than the partition allows",
          "PartitionTimeLimit": "a longer time than the partition allows",
          "PartitionConfig": "more CPUs or memory per node than the partition's nodes have",
          "BadConstraints": "constraints no node satisfies",
          "InvalidAccount": "an account that does not exist",
          "InvalidQOS": "a QOS that does not exist",
          "QOSMaxNodePerJobLimit": "more nodes than the QOS allows a job",
          "QOSMaxWallDurationPerJobLimit": "a longer time than the QOS allows a job",
          "AssocMaxNodesPerJobLimit": "more nodes than the account may use in a job",
          "AssocMaxWallDurationPerJobLimit": "a longer time than the account may use"}
_POLL_S = 2.0             # how often a pending request's reason is read
_NODES = "slurm={'nodes': N}, on the command line --slurm nodes=N"


@dataclass(frozen=True, slots=True)
class SlurmOptions:
    """``distribute(slurm=...)``: how many nodes, and what to ask Slurm for when there is no
    allocation yet. ``nodes``: how many nodes the ranks spread over (default: a new allocation
    takes 1; inside one, as many of its nodes as split the ranks evenly); ``partition``,
    ``time`` (minutes or Slurm's ``[D-]HH:MM:SS``), ``account``, ``qos``, ``constraint``:
    salloc's options of those names; ``args``: more salloc arguments; ``srun_args``: more srun
    arguments; ``overcommit``: run more ranks on a node than it has CPUs (``--overcommit``);
    ``wait_s``: how long to wait for a pending allocation (default: until it starts; Ctrl-C
    cancels it); ``job_name``: the allocation's name in ``squeue``; ``spare_nodes``: nodes a
    new allocation holds beyond ``nodes`` (which it needs), idle until a node of the ranks is
    lost, when fault tolerance moves the mesh onto them (inside an allocation, its nodes
    beyond ``nodes`` are the spares)."""

    nodes: int | None = None
    spare_nodes: int = 0
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    args: tuple[str, ...] = ()
    srun_args: tuple[str, ...] = ()
    overcommit: bool = False
    wait_s: float | None = None
    job_name: str = "meshplan"

    @classmethod
    def parse(cls, value: Any, where: str = "slurm=") -> SlurmOptions:
        """From None, a ``SlurmOptions``, a mapping, or ``"nodes=2,partition=gpu"``."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            pairs = [p.partition("=") for p in value.split(",") if p.strip()]
            bad = [k for k, eq, _ in pairs if not eq]
            if bad:
                raise RuntimeFailure(f"{where}: {bad[0]!r} is not key=value; e.g. "
                                     "nodes=2,partition=gpu,time=30")
            value = {k.strip(): v.strip() for k, _, v in pairs}
        if not isinstance(value, Mapping):
            raise RuntimeFailure(f"{where}: pass a dict such as {{'nodes': 2, 'time': 30}}, "
                                 f"not {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise RuntimeFailure(f"{where}: unknown option {unknown[0]!r}; the options are "
                                 f"{', '.join(sorted(known))}")
        kw: dict[str, Any] = {}
        for key, v in value.items():
            if v is None:
                continue
            if key in ("nodes", "spare_nodes"):
                least = 1 if key == "nodes" else 0
                try:
                    kw[key] = int(v)
                except (TypeError, ValueError):
                    kw[key] = -1
                if kw[key] < least or isinstance(v, bool):
                    raise RuntimeFailure(f"{where}: {key}={v!r}; give a whole number >= "
                                         f"{least}")
            elif key == "wait_s":
                try:
                    kw[key] = float(v)
                except (TypeError, ValueError):
                    kw[key] = -1.0
                if not kw[key] > 0:
                    raise RuntimeFailure(f"{where}: wait_s={v!r}; give seconds > 0")
            elif key == "overcommit":
                kw[key] = v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes")
            elif key in ("args", "srun_args"):
                kw[key] = tuple(v.split()) if isinstance(v, str) else tuple(str(a) for a in v)
            else:
                kw[key] = str(v)
        if kw.get("spare_nodes") and "nodes" not in kw:
            raise RuntimeFailure(f"{where}: spare_nodes={kw['spare_nodes']} needs nodes= too "
                                 "(the nodes the ranks run on; the spares come on top)")
        return cls(**kw)

    def salloc_args(self) -> list[str]:
        out = [f"--{name}={getattr(self, name)}" for name in
               ("partition", "time", "account", "qos", "constraint")
               if getattr(self, name) is not None]
        return out + (["--overcommit"] if self.overcommit else []) + list(self.args)


def find_command(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeFailure(f"the slurm launcher needs `{name}`, which is not on PATH; "
                             f"{SLURM_FIX}")
    return path


def expand_nodelist(nodelist: str) -> list[str]:
    """``"node[01-03],gpu7"`` -> the node names, as Slurm itself expands them."""
    done = subprocess.run([find_command("scontrol"), "show", "hostnames", nodelist],
                          capture_output=True, text=True, timeout=60)
    names = done.stdout.split()
    if done.returncode or not names:
        raise RuntimeFailure(f"scontrol show hostnames {nodelist!r} failed: "
                             f"{done.stderr.strip() or 'no names'}")
    return names


def cpus_per_node(spec: str, nodes: int) -> list[int]:
    """``$SLURM_JOB_CPUS_PER_NODE`` (``"4(x2),2"``) -> one count per node; unknown: zeros."""
    out: list[int] = []
    for part in filter(None, spec.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            return [0] * nodes
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out if len(out) == nodes else [0] * nodes


@dataclass
class Allocation:
    """A Slurm job's nodes: the one we run in (``current``), or one we asked for
    (``request``; ``holder`` is its salloc, ``release`` gives it back)."""

    job_id: str
    nodes: list[str]                # the nodes the ranks may use: lost ones are taken out
    cpus: list[int]
    holder: subprocess.Popen | None = field(default=None, repr=False)
    pending_reason: str = ""        # squeue's, while a request waits
    lost: list[str] = field(default_factory=list)

    def lose(self, names: list[str]) -> None:
        """``names`` are lost (fault tolerance: no heartbeat): no rank starts there again.
        The job keeps them (Slurm decides when a node is down); ``environ()`` leaves them
        out, and srun's ``--nodelist`` names only the nodes the ranks use."""
        keep = [k for k, h in enumerate(self.nodes) if h not in names]
        self.lost += [h for h in self.nodes if h in names]
        self.nodes = [self.nodes[k] for k in keep]
        self.cpus = [self.cpus[k] for k in keep]

    @classmethod
    def current(cls, env: Mapping[str, str] = os.environ) -> Allocation | None:
        job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not job:
            return None
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise RuntimeFailure(f"inside Slurm job {job} but $SLURM_JOB_NODELIST is unset; "
                                 "run the controller in the job's own environment (salloc, "
                                 "sbatch)")
        nodes = expand_nodelist(nodelist)
        return cls(job, nodes, cpus_per_node(env.get("SLURM_JOB_CPUS_PER_NODE", ""),
                                             len(nodes)),
                   lost=[h for h in env.get(ENV_LOST, "").split(",") if h])

    @classmethod
    def request(cls, options: SlurmOptions, nodes: int, per_node: int,
                no_kill: bool = False) -> Allocation:
        """Ask for ``nodes`` nodes with ``per_node`` tasks each and wait (module docstring).
        ``no_kill``: the allocation outlives a node failing (``--no-kill``: fault tolerance
        goes on on the other nodes; without it Slurm ends the job once it calls the node
        down)."""
        salloc = find_command("salloc")
        find_command("srun")
        cmd = [salloc, f"--nodes={nodes}", f"--ntasks-per-node={per_node}",
               f"--job-name={options.job_name}", *(["--no-kill"] if no_kill else []),
               *options.salloc_args(), "/bin/sh", "-c", _HOLD]
        try:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                close_fds=True, preexec_fn=_pdeathsig_setter()  # noqa: PLW1509
                if threading.current_thread() is threading.main_thread() else None)
        except OSError as exc:
            raise RuntimeFailure(f"could not start {' '.join(cmd)}: {exc}") from exc
        alloc = cls("", [], [], proc)
        said: list[str] = []
        start = time.monotonic()
        try:
            line = _wait_granted(proc, said, options.wait_s, nodes, alloc)
        except BaseException:
            alloc.release()
            raise
        if line is None:
            waited_out = (options.wait_s is not None and proc.poll() is None
                          and time.monotonic() - start >= options.wait_s)
            alloc.release()
            text = "\n".join(f"    {s}" for s in said[-10:]) or "    (nothing)"
            if alloc.pending_reason in _NEVER:
                raise RuntimeFailure(
                    f"Slurm cannot start the request for {nodes} node{'s' * (nodes != 1)} x "
                    f"{per_node} task{'s' * (per_node != 1)} (job {alloc.job_id} pending: "
                    f"{alloc.pending_reason}, {_NEVER[alloc.pending_reason]}); it was "
                    "cancelled. Ask for fewer nodes (slurm={'nodes': N}; on the command "
                    "line --slurm nodes=N, or files push --ranks N), or another partition or "
                    "account (`sinfo` lists the partitions)")
            if waited_out:
                raise RuntimeFailure(
                    f"Slurm did not grant {nodes} node{'s' * (nodes != 1)} within wait_s="
                    f"{options.wait_s:g} s (job {alloc.job_id or '?'} pending"
                    f"{f': {alloc.pending_reason}' if alloc.pending_reason else ''}); it was "
                    f"cancelled. salloc said:\n{text}")
            raise RuntimeFailure(
                f"salloc failed (exit {proc.returncode}) asked for {nodes} node"
                f"{'s' * (nodes != 1)} x {per_node} task{'s' * (per_node != 1)}: {_why(said)}; "
                f"salloc said:\n{text}")
        _, job, nodelist, cpus = (line.split() + ["", "", "", ""])[:4]
        alloc.job_id = job
        alloc.nodes = expand_nodelist(nodelist)
        alloc.cpus = cpus_per_node(cpus, len(alloc.nodes))
        return alloc

    def environ(self, base: Mapping[str, str] = os.environ) -> dict[str, str]:
        """``base`` with this allocation as the one we run in (``current``): a launcher given
        it uses these nodes and leaves the allocation to whoever holds it."""
        return {**base, "SLURM_JOB_ID": self.job_id, "SLURM_JOB_NODELIST": ",".join(self.nodes),
                "SLURM_JOB_CPUS_PER_NODE": ",".join(map(str, self.cpus)),
                ENV_LOST: ",".join(self.lost)}

    def release(self, grace_s: float = 10.0) -> None:
        """Give back an allocation we asked for (nothing for one we run in). Idempotent."""
        proc, self.holder = self.holder, None
        if proc is None:
            return
        clean = False
        try:
            if proc.stdin is not None:
                proc.stdin.close()           # the holding shell ends; salloc gives the nodes back
            if not self.nodes:
                proc.terminate()             # not granted yet: salloc withdraws the request
            proc.wait(grace_s)
            clean = proc.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            proc.terminate()
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        if self.job_id and not clean and shutil.which("scancel"):
            subprocess.run(["scancel", "--quiet", self.job_id], capture_output=True,
                           timeout=60)


def _wait_granted(proc: subprocess.Popen, said: list[str], wait_s: float | None,
                  nodes: int, alloc: Allocation) -> str | None:
    """salloc's ``meshplan-allocation`` line once granted; None when salloc ended without
    one or ``wait_s`` passed. What salloc says goes to ``said``; progress to stderr."""
    assert proc.stdout is not None and proc.stderr is not None
    start = polled = time.monotonic()
    progress = _Progress(nodes)
    out = b""
    streams = [proc.stdout, proc.stderr]
    try:
        while streams:
            waited = time.monotonic() - start
            if wait_s is not None and waited >= wait_s:
                return None
            if alloc.job_id and time.monotonic() - polled >= _POLL_S:
                polled = time.monotonic()
                alloc.pending_reason = _pending_reason(alloc.job_id)
                if alloc.pending_reason in _NEVER:
                    return None
            ready, _, _ = select.select(streams, [], [], 0.5)
            for stream in ready:
                chunk = os.read(stream.fileno(), 65536)
                if not chunk:
                    streams.remove(stream)
                elif stream is proc.stdout:
                    out += chunk
                    *lines, out = out.split(b"\n")      # whole lines only: a nodelist may
                    for raw in lines:                   # come in two reads
                        line = raw.decode(errors="replace")
                        if line.startswith("meshplan-allocation "):
                            return line
                else:
                    for line in chunk.decode(errors="replace").splitlines():
                        said.append(line.rstrip())
                        m = _JOB_ID.search(line)
                        if m and not alloc.job_id:
                            alloc.job_id = m.group(1)
            progress.show(alloc.job_id, alloc.pending_reason, time.monotonic() - start)
        proc.wait()
        return None
    finally:
        progress.close()


def _why(said: list[str]) -> str:
    """What salloc's words most likely mean, for the error's first line."""
    text = " ".join(said).lower()
    if "configuration source" in text or "slurm.conf" in text:
        return ("there is no Slurm configuration here: run on a login node of the cluster, "
                "or point $SLURM_CONF at its slurm.conf")
    if "unable to contact slurm controller" in text or "connection refused" in text:
        return "the Slurm controller (slurmctld) does not answer"
    return "Slurm refused the request (its reason is in salloc's words below)"


def _pending_reason(job: str) -> str:
    """squeue's reason why ``job`` is pending ("" when it is not, or squeue cannot say)."""
    try:
        done = subprocess.run([find_command("squeue"), "-h", "-j", job, "-t", "PD", "-o",
                               "%r"], capture_output=True, text=True, timeout=30)
    except (RuntimeFailure, OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


class _Progress:
    """While Slurm keeps the request pending: a spinner on a terminal, else a line at the start
    and every 30 s."""

    def __init__(self, nodes: int) -> None:
        self.nodes, self.last, self.status = nodes, -1.0, None
        self.tty = sys.stderr.isatty()

    def show(self, job: str, reason: str, waited: float) -> None:
        because = f", {reason}" if reason else ""
        what = (f"waiting for Slurm to allocate {self.nodes} node{'s' * (self.nodes != 1)}"
                f"{f' (job {job} pending{because})' if job else ''}: {waited:.0f} s")
        if self.tty:
            if self.status is None and waited >= 1.0:
                from rich.console import Console

                self.status = Console(stderr=True).status(what)
                self.status.start()
            elif self.status is not None:
                self.status.update(what)
        elif waited >= 2.0 and (self.last < 0 or waited - self.last >= 30.0):
            self.last = waited
            print(f"meshplan: {what}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.status is not None:
            self.status.stop()


class _TaskProc(_RankProc):
    """A rank as ``Workers`` sees it: a view over the one srun. Once srun has ended, its last
    words are read before the exit counts (they say which task ended first)."""

    def __init__(self, job: subprocess.Popen, group: _SlurmGroup) -> None:
        super().__init__(job)
        self.group = group
        self.task_code: int | None = None      # as srun reported this task's end
        self.node: str | None = None           # where srun said it ended

    def poll(self) -> int | None:
        if self.returncode is None and self.job.poll() is not None:
            thread = self.group.stderr_thread
            if thread is not None:
                thread.join(2.0)
        code = super().poll()
        if code is not None and self.task_code is not None:
            self.returncode = code = self.task_code
        return code


def _task_code(how: str) -> int | None:
    """srun's words for a task's end -> its exit code (negative: the signal), None if unsure."""
    m = re.search(r"[Ee]xit(?:ed with exit)? code (\d+)", how)
    if m:
        return int(m.group(1))
    names = {s.name[3:].lower(): int(s) for s in signal.Signals}
    names.update(killed=int(signal.SIGKILL), terminated=int(signal.SIGTERM),
                 segmentation=int(signal.SIGSEGV), aborted=int(signal.SIGABRT))
    word = how.split()[0].lower().rstrip(":") if how.split() else ""
    return -names[word] if word in names else None


class _SlurmGroup(_Group):
    """srun, the per-rank views, the rendezvous store and the allocation."""

    def __init__(self, channel: ControllerChannel, store: RendezvousStore,
                 allocation: Allocation) -> None:
        super().__init__(channel, store)
        self.allocation = allocation
        self.srun: subprocess.Popen | None = None
        self.stderr_tail: list[str] = []
        self.stderr_thread: threading.Thread | None = None
        self._order = 0

    def running(self) -> bool:
        return self.srun is not None and self.srun.poll() is None

    def on_stderr(self, line: str) -> None:
        """srun names each task that ended badly: the first ones named are the cause."""
        m = _SRUN_ERROR.search(line)
        if m is None:
            return
        node, tasks, how = m.group(1), m.group(2), m.group(3).strip()
        code = _task_code(how)
        named = False
        for part in tasks.split(","):
            lo, _, hi = part.partition("-")
            for task in range(int(lo), int(hi or lo) + 1):
                if task < len(self.procs) and self.procs[task].exit_order is None:
                    self.procs[task].exit_order = self._order
                    self.procs[task].task_code = code
                    self.procs[task].node = node
                    named = True
        self._order += named

    def stop(self, grace_s: float = 5.0) -> None:
        if self.closed:
            return
        self.closed = True
        end_job(self.srun, grace_s)        # EOF on srun's stdin ends every rank's guard
        self.close_ends()
        self.allocation.release()


class SlurmLauncher(LocalLauncher):
    """Start ``n`` workers with ``srun`` on a Slurm allocation (see the module docstring).

    ``options``: a :class:`SlurmOptions` (or what ``SlurmOptions.parse`` takes); ``env``: where
    to look for the allocation the controller runs in (default ``os.environ``)."""

    def __init__(self, options: Any = None, *, env: Mapping[str, str] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.options = SlurmOptions.parse(options)
        self.env = os.environ if env is None else env

    def allocation(self, n: int, no_kill: bool = False) -> Allocation:
        """The allocation ``n`` ranks would run in: the one we run in, or a new one (with
        ``spare_nodes`` more nodes; ``no_kill``: ``Allocation.request``), which the caller
        gives back (``release``) once done with it; launchers given its ``environ()`` run in
        it as in their own (``distribute(fault_tolerance=True)`` keeps one for the run, so
        that restarted ranks find their nodes and snapshots again)."""
        alloc = Allocation.current(self.env)
        if alloc is not None:
            return alloc
        nodes = self.options.nodes or 1
        return Allocation.request(self.options, nodes + self.options.spare_nodes,
                                  _per_node(n, nodes, _NODES), no_kill)

    def launch(self, n: int, *, env: Mapping[str, str] | None = None,
               cwd: str | os.PathLike | None = None) -> Workers:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"launch needs at least one worker, got n={n!r}")
        srun = find_command("srun")
        opts = self.options
        alloc = Allocation.current(self.env)
        if alloc is not None:
            nodes = slurm_nodes(alloc, n, opts.nodes)
            per = n // nodes
            _check_fits(alloc, nodes, per, opts.overcommit)
        else:                        # a new one: the options' nodes, n / nodes tasks on each
            alloc = self.allocation(n)
            nodes = opts.nodes or 1
            per = n // nodes
        try:
            return self._start(srun, alloc, n, nodes, per, env, cwd)
        except BaseException:
            alloc.release()
            raise

    def _start(self, srun: str, alloc: Allocation, n: int, nodes: int, per: int,
               env: Mapping[str, str] | None, cwd: str | os.PathLike | None) -> Workers:
        used = alloc.nodes[:nodes]
        where = f"Slurm job {alloc.job_id}'s nodes"
        if not all(is_this_host(h) for h in used):
            P.lost_after_s()                     # a bad $MESHPLAN_LOST_AFTER_S: say so now
            self.host = controller_address(used, where)
        secret, run_id = Secret.new(), secrets.token_hex(8)
        channel = ControllerChannel(secret, run_id, self.host)
        try:
            store = RendezvousStore(self.host)
        except BaseException:
            channel.close()
            raise
        group = _SlurmGroup(channel, store, alloc)
        try:
            base = self._environment(n, env, run_id, channel.address, store.port)
            base.pop(P.ENV_PARENT_PID, None)    # a rank's parent is slurmstepd, not us
            base.update({ENV_SLURM: "1", P.ENV_CONTROLLER_HOST: socket.gethostname(),
                         "LOCAL_WORLD_SIZE": str(per)})
            if "OMP_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in (env or {}):
                cpus = min(alloc.cpus[:nodes]) or os.cpu_count() or 1
                base["OMP_NUM_THREADS"] = str(max(1, cpus // per))
            # the nodes by name: the allocation may hold spares, and lost nodes Slurm has
            # not called down yet (``Allocation.lose``)
            named = any(a.startswith(("--nodelist", "-w")) for a in self.options.srun_args)
            cmd = [srun, f"--jobid={alloc.job_id}", f"--nodes={nodes}",
                   *([] if named else [f"--nodelist={','.join(used)}"]), f"--ntasks={n}",
                   f"--ntasks-per-node={per}", "--distribution=block", "--kill-on-bad-exit=1",
                   "--input=all", "--mpi=none", f"--job-name={self.options.job_name}",
                   *(["--overcommit"] if self.options.overcommit else []),
                   # the controller itself runs in a step (`srun python train.py`): its CPUs
                   # are that step's, and a new step would wait for them for ever; so it
                   # would for the CPUs of the steps that ran on a lost node, which Slurm
                   # counts as completing until it hears from the node again
                   *(["--overlap"] if "SLURM_STEP_ID" in self.env or alloc.lost else []),
                   *self.options.srun_args]
            if self.log_dir is not None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                cmd += [f"--output={self.log_dir / 'rank%t.out'}",
                        f"--error={self.log_dir / 'rank%t.err'}"]
            cmd += [self.python, "-m", "meshplan.runtime._worker"]
            proc, group.stderr_tail, group.stderr_thread = start_job(
                cmd, base, cwd, subprocess.PIPE, SLURM_FIX, group.on_stderr)
            group.srun = proc
            group.procs.extend(_TaskProc(proc, group) for _ in range(n))
            assert proc.stdin is not None
            try:
                proc.stdin.write(secret.hex().encode() + b"\n")    # srun gives it every task
                proc.stdin.flush()
            except BrokenPipeError:
                pass             # srun ended at once: the hellos' wait reports it
            workers = Workers(group, run_id=run_id, master_addr=self.host,
                              master_port=store.port, log_dir=self.log_dir)
            hellos = workers.gather(P.HELLO, timeout_s=self.hello_timeout_s)
        except WorkerFailure as exc:
            group.stop()
            if group.srun is None or group.srun.poll() is None:
                raise
            if group.stderr_thread is not None:
                group.stderr_thread.join(5.0)
            said = "\n".join(f"    {line}" for line in _last_words(group.stderr_tail))
            raise WorkerFailure(
                f"srun ended (code {group.srun.returncode}) before every rank started on "
                f"{', '.join(used)} ({per} rank{'s' * (per != 1)} each, Slurm job "
                f"{alloc.job_id}): a node could not start Python there or reach this "
                f"controller; srun's last lines:\n{said}", reason="exit", ranks=exc.ranks,
                kind=exc.kind, exit_code=group.srun.returncode,
                hosts=sorted({p.node for p in group.procs if p.node})) from exc
        except BaseException:
            group.stop()
            raise
        here, now = socket.gethostname(), time.monotonic()
        for rank, (proc_view, hello) in enumerate(zip(group.procs, hellos)):
            proc_view.pid = int(hello.header["pid"])
            proc_view.local = hello.header.get("hostname") == here
            if not proc_view.local:
                group.channel.last_beat.setdefault(rank, now)
        workers.pids = tuple(p.pid for p in group.procs)
        _watch_exits(group.procs)
        workers.hostnames = tuple(str(h.header.get("hostname")) for h in hellos)
        return workers


def _per_node(n: int, nodes: int, where: str) -> int:
    if n % nodes:
        raise RuntimeFailure(f"the mesh's {n} ranks do not split evenly over {nodes} nodes; "
                             f"ask for a number of nodes that divides {n} ({where})")
    return n // nodes


def slurm_nodes(alloc: Allocation, n: int, asked: int | None, say: bool = True) -> int:
    """How many of the allocation's nodes the ``n`` ranks use (``asked``: ``slurm={"nodes"}``);
    raises when they do not split over them. ``say``: warn when some nodes stay unused."""
    have = len(alloc.nodes)
    if asked is not None:
        if asked > have:
            raise RuntimeFailure(
                f"{asked} nodes asked (slurm={{'nodes': {asked}}} or --slurm nodes={asked}) "
                f"but Slurm job {alloc.job_id} has {have} node"
                f"{'s' * (have != 1)} ({', '.join(alloc.nodes)}); ask salloc/sbatch for "
                f"--nodes={asked}, or use fewer")
        _per_node(n, asked, _NODES)
        return asked
    nodes = max(d for d in range(1, min(have, n) + 1) if n % d == 0)
    if nodes < have and say:
        logger.warning("meshplan: %d ranks over %d of Slurm job %s's %d nodes (the most that "
                       "split them evenly); %s sets another count", n, nodes, alloc.job_id,
                       have, _NODES)
    return nodes


def _check_fits(alloc: Allocation, nodes: int, per: int, overcommit: bool) -> None:
    cpus = alloc.cpus[:nodes]
    short = [(h, c) for h, c in zip(alloc.nodes, cpus) if 0 < c < per]
    if short and not overcommit:
        h, c = short[0]
        raise RuntimeFailure(
            f"Slurm job {alloc.job_id} is too small for the mesh: {nodes * per} ranks over "
            f"{nodes} node{'s' * (nodes != 1)} need {per} CPUs on each, and {h} has {c} "
            f"(SLURM_JOB_CPUS_PER_NODE); ask for more nodes or CPUs (salloc --nodes / "
            "--ntasks-per-node), use a smaller mesh, or pass slurm={'overcommit': True}")


# ---- the worker's side -----------------------------------------------------------------------

def worker_rank(env: Mapping[str, str]) -> int:
    """For ``_worker.main`` under srun: the rank (``$SLURM_PROCID``); sets ``RANK`` and
    ``LOCAL_RANK`` (``$SLURM_LOCALID``) as torch.distributed reads them."""
    rank = int(env["SLURM_PROCID"])
    os.environ[P.ENV_RANK] = os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    return rank
