"""The ``mpi`` launcher: workers started by ``mpiexec``, driven like local ones.

``MPILauncher().launch(n)`` runs ONE ``mpiexec -n N python -m meshplan.runtime._worker`` as a
child of the controller and returns the same :class:`Workers` as ``LocalLauncher``: the
controller model (signed ZeroMQ channel, hello, send / gather, failures) does not change. What
does:

- **Rank.** The worker takes its rank from MPI (``PMI_RANK``, set by hydra for every process;
  ``MESHPLAN_MPI=1`` tells it to), not from ``MESHPLAN_RANK``. Its communicator is then an
  ``MPICommunicator`` (``runtime/_handlers.py``).
- **Secret.** Hydra forwards stdin to rank 0 only, so the secret cannot come on stdin. It is
  written to a file in a fresh private directory (``mkdtemp``: 0700; the file 0600) whose path is
  in ``MESHPLAN_SECRET_FILE``; every worker reads it before it connects, and the controller
  deletes it as soon as all ranks said hello (or the launch failed). Trade-off: for those
  seconds the key rests on disk readable by this user (who can also read our memory and
  ``/proc``); it never appears in argv or the environment. On several hosts the directory must
  be on a file system every host sees: ``~/.meshplan/secrets`` by default then (``secret_dir=``).
- **Several hosts** (``hosts=``, ``host_slots``): ``-hosts a:k,b:k``, consecutive ranks on one
  host; the control channel on TCP with CURVE at this machine's address toward the hosts; a
  rank on another host watches no controller pid (it is another machine's) and beats instead
  (``_channel._Side``), and the controller judges it by its beats, not by a local pid.
- **Orphans.** The controller does not hold the workers' stdin, so the stdin-EOF guard of
  ``_worker`` is replaced by a watcher thread that polls the controller's pid (twice a second)
  and exits the worker when it is gone; on Linux ``PR_SET_PDEATHSIG`` additionally kills each
  worker when its hydra proxy dies, and mpiexec itself gets ``PR_SET_PDEATHSIG=SIGTERM``
  (from ``preexec_fn``) so a killed controller takes mpiexec down, which takes down its ranks.
  ``tests/dist/test_mpi.py`` kills a controller with ``kill -9`` and checks that every rank exits
  (launched from the main thread, and from a thread: there only the watcher applies). Each guard
  was also checked alone by hand: with the watcher switched off, mpiexec's PDEATHSIG took
  mpiexec and both ranks down within 3 s of the controller's ``kill -9``.
- **Exits.** The controller sees one process, mpiexec. A rank counts as exited when its pid
  (from its hello) is gone; its exit code is mpiexec's if mpiexec then ends within a moment
  (hydra aborts the job when a rank exits non-zero and returns that code), else 0. Each rank's
  stdout/stderr go to ``log_dir/rank{r}.out|.err`` (``-outfile-pattern``), as locally.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import logging
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from .._errors import RuntimeFailure
from ..backends._shm import SHM_DIR
from . import _channel as P
from ._channel import ControllerChannel, Secret
from ._launch import LocalLauncher, WorkerFailure, Workers, _Group

logger = logging.getLogger("meshplan.runtime")

__all__ = ["MPILauncher", "find_mpiexec", "host_slots", "parse_hosts", "worker_start"]

ENV_MPI = "MESHPLAN_MPI"                  # "1": started by mpiexec; rank from MPI
ENV_SECRET_FILE = "MESHPLAN_SECRET_FILE"
ENV_HOSTS = "MESHPLAN_HOSTS"              # comma-separated hosts when hosts= is not given
MPI_FIX = "pip install 'meshplan[mpi]' (mpi4py and the mpich wheel, which brings mpiexec)"
_EXIT_WAIT_S = 1.5        # after a rank's pid vanished: how long mpiexec may take to end the job
_WATCH_S = 0.5


def find_mpiexec(explicit: str | os.PathLike | None = None) -> str:
    """``explicit``, or ``mpiexec`` next to ``sys.executable`` (the mpich wheel), or on PATH."""
    if explicit is not None:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise RuntimeFailure(f"mpiexec {str(path)!r} does not exist or is not executable; "
                                 f"{MPI_FIX}, or pass mpiexec= the path of yours")
        return str(path)
    near = Path(sys.executable).parent / "mpiexec"
    found = str(near) if near.is_file() else shutil.which("mpiexec")
    if found is None:
        raise RuntimeFailure(f"the mpi launcher needs mpiexec, which is neither next to "
                             f"{sys.executable} nor on PATH; {MPI_FIX}")
    return found


# ---- hosts ------------------------------------------------------------------------------------

def host_slots(hosts: str | os.PathLike | Sequence[str] | None, n: int,
               env: Mapping[str, str] = os.environ) -> list[tuple[str, int]] | None:
    """Where the ``n`` ranks go: ``[(host, ranks on it), ...]`` in rank order, consecutive
    ranks on one host (the innermost mesh axes, whose groups are consecutive ranks, stay inside
    a host), or None for "this host only" (no ``hosts`` and no ``$MESHPLAN_HOSTS``).

    ``hosts``: names (``"a"`` or ``"a:4"``, slots after the colon, as mpiexec's ``-hosts``), a
    comma-separated string of them, or the path of a hostfile (one ``host[:slots]`` per line,
    ``#`` comments, as mpiexec's ``-f``). Hosts without slots share the ranks evenly. Ranks
    fill the hosts in order; a host left without ranks is not used."""
    found = parse_hosts(hosts, env)
    if found is None:
        return None
    parsed, where = found
    if all(k is None for _, k in parsed):
        if n % len(parsed):
            raise RuntimeFailure(
                f"{n} ranks do not split evenly over the {len(parsed)} hosts of {where}; give "
                "each host its slots (host:slots) or a mesh whose size they divide")
        parsed = [(name, n // len(parsed)) for name, _ in parsed]
    total = sum(k for _, k in parsed if k is not None)
    if total < n:
        raise RuntimeFailure(f"the mesh has {n} ranks but {where} has {total} slots "
                             f"({', '.join(f'{h}:{k}' for h, k in parsed)}); add hosts or "
                             "slots, or use a smaller mesh")
    out, left = [], n
    for name, k in parsed:
        if left:
            out.append((name, min(k, left)))
            left -= out[-1][1]
    return out


def parse_hosts(hosts: str | os.PathLike | Sequence[str] | None,
                env: Mapping[str, str] = os.environ
                ) -> tuple[list[tuple[str, int | None]], str] | None:
    """``hosts`` (or ``$MESHPLAN_HOSTS``) as ``[(name, slots or None), ...]`` in order, every
    host (those a mesh leaves unused too), and where they came from for errors; None for
    "this host only". Raises on a malformed list (see ``host_slots``)."""
    if hosts is None:
        hosts = env.get(ENV_HOSTS) or None
        if hosts is None:
            return None
        where = f"${ENV_HOSTS}"
    else:
        where = "hosts="
    if isinstance(hosts, os.PathLike) or (isinstance(hosts, str) and os.path.isfile(hosts)):
        path = Path(hosts)
        where = f"hostfile {path}"
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise RuntimeFailure(f"cannot read the hostfile {path}: {exc}") from None
        names = [ln.split("#", 1)[0].strip() for ln in lines]
        names = [x for x in names if x]
    elif isinstance(hosts, str):
        names = [x.strip() for x in hosts.split(",") if x.strip()]
    else:
        names = [str(x).strip() for x in hosts]
    if not names:
        raise RuntimeFailure(f"{where} names no host; give host names (a, b or a:4,b:4) or a "
                             "hostfile with one host[:slots] per line")
    parsed: list[tuple[str, int | None]] = []
    for entry in names:
        name, _, slots = entry.partition(":")
        if not name or any(c.isspace() for c in entry) or (slots and not slots.isdigit()):
            raise RuntimeFailure(f"{where}: {entry!r} is not host or host:slots")
        if slots and int(slots) < 1:
            raise RuntimeFailure(f"{where}: {entry!r} has no slots; give it 1 or more")
        parsed.append((name, int(slots) if slots else None))
    if len({name for name, _ in parsed}) != len(parsed):
        raise RuntimeFailure(f"{where} names a host twice ({', '.join(names)}); give each "
                             "once, with its slots (host:slots)")
    if any(k is None for _, k in parsed) and not all(k is None for _, k in parsed):
        raise RuntimeFailure(f"{where} gives slots for some hosts only; give every host its "
                             "slots (host:slots) or none")
    return parsed, where


def is_this_host(name: str) -> bool:
    """Whether ``name`` is this machine (its hostname, or an address of it)."""
    if name in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        mine = {i[4][0] for i in socket.getaddrinfo(socket.gethostname(), None)}
        theirs = {i[4][0] for i in socket.getaddrinfo(name, None)}
    except OSError:
        return False
    return bool(theirs & mine) or all(ipaddress.ip_address(a.split("%")[0]).is_loopback
                                      for a in theirs)


def controller_address(hosts: Sequence[str], where: str = "hosts=") -> str:
    """The address of this machine that the other ``hosts`` reach it on: the source address
    of its route to the first of them (no packet is sent). Every host must resolve;
    ``where`` names the hosts' source in the error."""
    infos = {}
    for name in hosts:
        try:
            infos[name] = socket.getaddrinfo(name, 9, type=socket.SOCK_DGRAM)
        except OSError as exc:
            raise RuntimeFailure(f"host {name!r} does not resolve ({exc}); fix the name in "
                                 f"{where}, or add it to DNS / /etc/hosts"
                                 f"{_sandbox_hint(name)}") from None
    for name in hosts:
        if is_this_host(name):
            continue
        family, _, _, _, addr = infos[name][0]
        try:
            return P.address_toward(family, addr)
        except OSError as exc:
            raise RuntimeFailure(f"no route from this host to {name!r} ({addr[0]}: {exc}); "
                                 "the controller must reach every host") from None
    return "127.0.0.1"


def _sandbox_hint(name: str) -> str:
    """A note when ``name`` is a host of a ``meshplan sandbox`` that is up: its names resolve
    only inside it."""
    from ._sandbox import ROOT

    try:
        for hosts in ROOT.glob("*/hosts"):
            if name in hosts.read_text().split():
                return (f" ({name} is a host of the sandbox {hosts.parent.name!r}: its names "
                        f"resolve inside it; run the script with `meshplan sandbox run --name "
                        f"{hosts.parent.name} -- ...`)")
    except OSError:
        pass
    return ""


class _RankProc:
    """What ``Workers`` sees of one rank: a Popen-like view over the one process that started
    every rank (``job``: mpiexec, srun). A rank on another host (``local`` False) has no pid
    here: only the job's end ends it."""

    stdin = None

    def __init__(self, job: subprocess.Popen) -> None:
        self.job = job
        self.local = True
        self.pid: int | None = None         # known after hello
        self.returncode: int | None = None
        self._gone_at: float | None = None
        self.exit_order: int | None = None  # 0 for the rank whose process ended first...

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        code = self.job.poll()
        if code is not None:
            self.returncode = code
        elif self.local and self.pid is not None and not _alive(self.pid):
            now = time.monotonic()
            self._gone_at = self._gone_at or now
            if now - self._gone_at >= _EXIT_WAIT_S:
                self.returncode = 0        # mpiexec did not end the job: a clean exit
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self.job.wait(timeout)
        return self.poll() or 0

    def terminate(self) -> None:
        if self.job.poll() is None:
            self.job.terminate()

    def kill(self) -> None:
        if self.job.poll() is None:
            self.job.kill()


def _watch_exits(procs: list[_RankProc]) -> None:
    """Number the ranks' processes in the order they end (``exit_order``), as it happens: when
    one rank dies, mpiexec kills the others and exits, and by the time the controller polls,
    every rank looks gone; the first to end is the cause. Linux pidfds (not children of this
    process) wake a thread the moment each ends; elsewhere the order stays unknown."""
    if not hasattr(os, "pidfd_open"):
        return
    fds: dict[int, _RankProc] = {}
    for proc in procs:
        if not proc.local:
            continue
        try:
            fds[os.pidfd_open(proc.pid)] = proc
        except (OSError, TypeError):
            pass

    def watch() -> None:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        order = 0
        while fds:
            for fd, _ in poller.poll():
                poller.unregister(fd)
                fds.pop(fd).exit_order = order
                os.close(fd)
            order += 1

    threading.Thread(target=watch, name="meshplan-mpi-exits", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


KEEP_FIRST = 10        # a launcher's first stderr lines, kept with its last 50
PROBE_S = 10.0         # how long probe_hosts waits for the launcher to reach a host


def probe_hosts(hosts: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """After mpiexec gave up before every rank started: run MPICH's launcher (ssh, or
    ``$HYDRA_LAUNCHER_EXEC``) with ``true`` on each host but this one, all at once, and
    return ``HOST: what it said`` for each host it did not reach (empty when it reached
    them all). Where the launcher is not ssh-like, nothing is probed."""
    launcher = env.get("HYDRA_LAUNCHER", "ssh")
    if launcher not in ("ssh", "rsh"):
        return []
    exe = env.get("HYDRA_LAUNCHER_EXEC") or shutil.which(launcher)
    if not exe:
        return []
    opts = ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(PROBE_S)}"] \
        if not env.get("HYDRA_LAUNCHER_EXEC") and launcher == "ssh" else []
    procs = {}
    for h in dict.fromkeys(hosts):
        if is_this_host(h):
            continue
        try:
            procs[h] = subprocess.Popen([exe, *opts, h, "true"], env=dict(env),
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True)
        except OSError as exc:
            return [f"{launcher} ({exe}) could not be run: {exc}"]
    out = []
    deadline = time.monotonic() + PROBE_S + 2
    for h, proc in procs.items():
        try:
            _, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            out.append(f"{h}: {launcher} did not answer within {PROBE_S:g} s")
            continue
        if proc.returncode != 0:
            words = " / ".join(x.strip() for x in err.splitlines() if x.strip())[:300]
            out.append(f"{h}: {launcher} exited {proc.returncode}"
                       + (f": {words}" if words else ""))
    return out


def _last_words(tail: list[str], n: int = 10) -> list[str]:
    """The last ``n`` lines of a launcher's stderr (mpiexec's, srun's), after the launcher's
    own lines that came before them (ssh's, the sandbox's, srun's: those that are not
    bracketed, as hydra's ``[mpiexec@...]``, ``[proxy:...]`` and the ranks' ``[rank N]``
    are), which name the host best and which later lines must not push out (seen under
    load: the "no host" line was gone from the last 10): the first three of them (the cause;
    a rank's traceback on a host that did start comes later) and the last three."""
    own = [line for line in tail[:-n] if line.strip() and not line.startswith("[")]
    first = own[:3]
    return first + own[3:][-3:] + tail[-n:]


def _tee(stream, on_line=None) -> tuple[list[str], threading.Thread]:  # noqa: ANN001
    """Copy a launcher's stderr (mpiexec's or srun's own messages, and the ranks' without a
    log_dir) to ours as it comes, keeping its last lines for an error message and passing each
    to ``on_line``; the thread ends at its end."""
    tail: list[str] = []

    def copy() -> None:
        for raw in iter(stream.readline, b""):
            try:
                os.write(2, raw)
            except OSError:
                pass
            tail.append(raw.decode(errors="replace").rstrip())
            if len(tail) > KEEP_FIRST + 50:      # the first lines stay: they name the cause
                del tail[KEEP_FIRST:-50]
            if on_line is not None:
                on_line(tail[-1])
        stream.close()

    thread = threading.Thread(target=copy, name="meshplan-launcher-stderr", daemon=True)
    thread.start()
    return tail, thread


class _MPIGroup(_Group):
    """The mpiexec process, the per-rank views and the secret's directory."""

    def __init__(self, channel: ControllerChannel, secret_dir: Path) -> None:
        super().__init__(channel)
        self.mpiexec: subprocess.Popen | None = None
        self.stderr_tail: list[str] = []
        self.stderr_thread: threading.Thread | None = None
        self.secret_dir = secret_dir
        self.mpich_before = _mpich_files()

    def running(self) -> bool:
        """The ranks, and mpiexec itself: it exits after the last rank's MPI_Finalize, which
        unlinks MPICH's /dev/shm file (a shutdown that stopped waiting at the ranks' exits and
        terminated mpiexec left that file once on a loaded 2-core machine)."""
        return super().running() or (self.mpiexec is not None and self.mpiexec.poll() is None)

    def forget_secret(self) -> None:
        shutil.rmtree(self.secret_dir, ignore_errors=True)

    def stop(self, grace_s: float = 5.0) -> None:
        if self.closed:
            return
        self.closed = True
        self.forget_secret()
        proc = self.mpiexec
        # ranks that were asked to exit finalize MPI first (MPICH unlinks its /dev/shm file
        # then); SIGTERM after that: hydra forwards it to every rank and cleans up
        end_job(proc, grace_s)
        self.close_ends()
        if proc is not None and proc.poll() is not None:
            for name in _unmapped(_mpich_files() - self.mpich_before):
                try:
                    os.unlink(os.path.join(SHM_DIR, name))
                except OSError:
                    continue
                logger.info("meshplan: removed /dev/shm/%s that MPICH left behind", name)


def _mpich_files() -> set[str]:
    """MPICH's shared-memory files now in /dev/shm. MPICH unlinks its file when the last local
    rank finalizes; a rank that ends otherwise (terminated, killed, or finalizing while
    mpiexec is stopped) leaves it, 4 MiB each, until reboot."""
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith("mpich_shm_")}
    except OSError:
        return set()


def _unmapped(names: set[str]) -> set[str]:
    """Those of ``names`` that no process on this host has mapped (``/proc/*/maps``): after our
    mpiexec ended, a new file that nobody maps is ours and dead; one another job started
    meanwhile is mapped by its ranks and stays."""
    if not names:
        return names
    mapped: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps", "rb") as f:
                text = f.read()
        except OSError:
            continue
        mapped.update(n for n in names if n.encode() in text)
    return names - mapped


def _pdeathsig_setter():
    """A ``preexec_fn`` that asks for SIGTERM when the controller dies (None off Linux). The
    libc lookup happens here, in the parent: between fork and exec the child only calls prctl,
    nothing that takes a lock another thread might hold."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    term = int(signal.SIGTERM)
    return lambda: prctl(1, term, 0, 0, 0)                # 1 = PR_SET_PDEATHSIG


class MPILauncher(LocalLauncher):
    """Start ``n`` workers with ``mpiexec`` on this host (see the module docstring).

    ``mpiexec``: its path (default: next to ``sys.executable``, then PATH); ``mpiexec_args``:
    extra arguments placed before ``-n``; ``hosts``: where the ranks go (``host_slots``;
    default ``$MESHPLAN_HOSTS``, else this host only). When a host is another machine, the
    control channel listens on this machine's address toward the hosts (TCP with CURVE
    encryption and the run's keys, instead of a local socket), and the secret's directory
    must be on a file system every host sees: ``secret_dir``, default
    ``~/.meshplan/secrets`` then (the system temp dir on one host)."""

    def __init__(self, *, mpiexec: str | os.PathLike | None = None,
                 mpiexec_args: tuple[str, ...] = (), secret_dir: str | os.PathLike | None = None,
                 hosts: str | os.PathLike | Sequence[str] | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.mpiexec_arg, self.mpiexec_args = mpiexec, tuple(mpiexec_args)
        self.secret_dir, self.hosts = secret_dir, hosts

    def launch(self, n: int, *, env: Mapping[str, str] | None = None,
               cwd: str | os.PathLike | None = None) -> Workers:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"launch needs at least one worker, got n={n!r}")
        mpiexec = find_mpiexec(self.mpiexec_arg)
        if importlib.util.find_spec("mpi4py") is None:
            raise RuntimeFailure(f"the mpi launcher needs mpi4py in {self.python}; {MPI_FIX}")
        placement = host_slots(self.hosts, n)
        secret_dir = self.secret_dir
        if placement is not None and not all(is_this_host(h) for h, _ in placement):
            P.lost_after_s()                    # a bad $MESHPLAN_LOST_AFTER_S: say so now
            self.host = controller_address([h for h, _ in placement],
                                           "hosts=" if self.hosts is not None
                                           else f"${ENV_HOSTS}")
            if secret_dir is None:
                secret_dir = Path.home() / ".meshplan" / "secrets"
                secret_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        secret, run_id = Secret.new(), secrets.token_hex(8)
        group = _MPIGroup(ControllerChannel(secret, run_id, self.host),
                          Path(tempfile.mkdtemp(prefix="meshplan-", dir=secret_dir)))
        try:
            secret_file = group.secret_dir / "secret"
            fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secret.hex() + "\n")
            master_port = 0      # the ranks talk through MPI: no torch.distributed store
            base = self._environment(n, env, run_id, group.channel.address, master_port)
            base.update({ENV_MPI: "1", ENV_SECRET_FILE: str(secret_file),
                         P.ENV_CONTROLLER_HOST: socket.gethostname()})
            self._start_mpiexec(mpiexec, n, placement, base, cwd, group)
            workers = Workers(group, run_id=run_id, master_addr=self.host,
                              master_port=master_port, log_dir=self.log_dir)
            hellos = workers.gather(P.HELLO, timeout_s=self.hello_timeout_s)
        except WorkerFailure as exc:
            group.stop()
            if placement is None or group.mpiexec is None or group.mpiexec.poll() is None:
                raise
            # mpiexec itself gave up: a host it could not reach or start ranks on; what it
            # (and its launcher, ssh) said names the host better than a rank's exit code
            if group.stderr_thread is not None:      # its last lines, to the end
                group.stderr_thread.join(5.0)
            said = "\n".join(f"    {line}" for line in _last_words(group.stderr_tail))
            where = ", ".join(f"{h} ({k} rank{'s' * (k != 1)})" for h, k in placement)
            # mpiexec does not always pass its launcher's words on before it ends: ask the
            # launcher itself whether it reaches each host
            probed = "".join(f"\n    {line}" for line in probe_hosts(
                [h for h, _ in placement], {**os.environ, **base}))
            raise WorkerFailure(
                f"mpiexec ended (code {group.mpiexec.returncode}) before every rank started on "
                f"{where}: a host "
                "is unreachable, refused the launcher, or could not start Python there; "
                + (f"its launcher, asked again:{probed}\n" if probed else "")
                + f"mpiexec's last lines:\n{said}", reason="exit", ranks=exc.ranks,
                kind=exc.kind, exit_code=group.mpiexec.returncode) from exc
        except BaseException:
            group.stop()
            raise
        group.forget_secret()                   # every rank has read it
        here, now = socket.gethostname(), time.monotonic()
        for rank, (proc, hello) in enumerate(zip(group.procs, hellos)):
            proc.pid = int(hello.header["pid"])
            proc.local = hello.header.get("hostname") == here
            if not proc.local:                  # it beats from now on (_worker.main)
                group.channel.last_beat.setdefault(rank, now)
        workers.pids = tuple(p.pid for p in group.procs)
        _watch_exits(group.procs)
        workers.hostnames = tuple(str(h.header.get("hostname")) for h in hellos)
        return workers

    def _start_mpiexec(self, mpiexec: str, n: int, placement: list[tuple[str, int]] | None,
                       env: dict[str, str], cwd: str | os.PathLike | None,
                       group: _MPIGroup) -> None:
        cmd = [mpiexec, *self.mpiexec_args]
        if placement is not None:
            cmd += ["-hosts", ",".join(f"{h}:{k}" for h, k in placement)]
        cmd += ["-n", str(n)]
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            cmd += ["-outfile-pattern", str(self.log_dir / "rank%r.out"),
                    "-errfile-pattern", str(self.log_dir / "rank%r.err")]
        cmd += [self.python, "-m", "meshplan.runtime._worker"]
        proc, group.stderr_tail, group.stderr_thread = start_job(cmd, env, cwd,
                                                                 subprocess.DEVNULL, MPI_FIX)
        group.mpiexec = proc
        group.procs.extend(_RankProc(proc) for _ in range(n))


def end_job(proc: subprocess.Popen | None, grace_s: float) -> None:
    """End the one process that started every rank: up to 2 s for it to end by itself (its
    ranks were asked to exit), then EOF on its stdin when we hold it (the ranks' guard), then
    SIGTERM (it signals its ranks) and ``grace_s`` more, then SIGKILL."""
    if proc is None:
        return
    if proc.poll() is None:
        try:
            proc.wait(min(grace_s, 2.0))
        except subprocess.TimeoutExpired:
            pass
    if proc.stdin is not None:
        try:
            proc.stdin.close()
        except OSError:
            pass
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_job(cmd: list[str], env: Mapping[str, str], cwd: str | os.PathLike | None,
              stdin: int, fix: str, on_line=None,  # noqa: ANN001 - a callable or None
              ) -> tuple[subprocess.Popen, list[str], threading.Thread]:
    """Start the one process that starts every rank (mpiexec, srun): its stderr copied to ours
    and its last lines kept (``_tee``), and SIGTERM for it when the controller dies (when
    launched from the main thread: Linux sends it when the launching thread ends)."""
    main_thread = threading.current_thread() is threading.main_thread()
    try:
        proc = subprocess.Popen(
            cmd, stdin=stdin, stderr=subprocess.PIPE, env=env, cwd=cwd, close_fds=True,
            preexec_fn=_pdeathsig_setter() if main_thread else None)  # noqa: PLW1509
    except OSError as exc:
        raise RuntimeFailure(f"could not start {' '.join(cmd)}: {exc}; {fix}") from exc
    tail, thread = _tee(proc.stderr, on_line)
    return proc, tail, thread


# ---- the worker's side -----------------------------------------------------------------------

def mpi_rank(env: Mapping[str, str]) -> int:
    """This process's rank in MPI_COMM_WORLD, from the process manager's environment."""
    for name in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK"):
        if name in env:
            return int(env[name])
    from ..backends._mpi import import_mpi

    return import_mpi().COMM_WORLD.Get_rank()


def _watch_controller(pid: int) -> None:
    while _alive(pid):
        time.sleep(_WATCH_S)
    os._exit(86)                                  # _worker.EXIT_ORPHANED


def worker_start(env: Mapping[str, str], parent_pid: int | None,
                 pdeathsig: bool) -> tuple[Secret, int]:
    """For ``_worker.main`` under mpiexec: (the secret from its file, the rank from MPI). Starts
    the controller watcher and, on Linux, SIGKILL on the death of the hydra proxy."""
    if pdeathsig and sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
    if P.controller_elsewhere(env):
        parent_pid = None     # its pid is another machine's: the hydra proxy's end ends us
    if parent_pid is not None:
        if not _alive(parent_pid):
            os._exit(86)
        threading.Thread(target=_watch_controller, args=(parent_pid,), daemon=True,
                         name="meshplan-orphan-guard").start()
    with open(env[ENV_SECRET_FILE], encoding="ascii") as f:
        secret = Secret.from_hex(f.readline())
    rank = mpi_rank(env)
    os.environ[P.ENV_RANK] = os.environ["RANK"] = str(rank)
    return secret, rank
