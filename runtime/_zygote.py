"""A warm parent for local workers: ``python -m meshplan.runtime._zygote FD``.

Starting a worker as a new interpreter is mostly importing: torch (1.3 s of a core here) and
meshplan's runtime (0.6 s), for every rank of every mesh start, restart, re-plan and spare. The
local launcher instead keeps one zygote per controller process: a process that imported them
once, ran nothing (no tensor op, so no thread pool and no CUDA context), and forks a worker on
request, as ``multiprocessing``'s forkserver and Android's zygote do. A forked worker starts in
milliseconds and runs exactly the code ``python -m meshplan.runtime._worker`` runs.

Protocol, over a ``SOCK_SEQPACKET`` socket pair (one message per packet, file descriptors with
it): the controller sends ``{"env": {...}, "cwd": ...}`` with the worker's stdin (the read end of
the pipe whose write end only the controller holds), stdout and stderr; the zygote forks and
answers ``{"pid": ...}`` with a pidfd of the child (signals go to that process, never to a
recycled pid); when a child ends the zygote reaps it and sends ``{"exit": pid, "code": ...}``
(``subprocess``'s convention: ``-N`` for signal N). EOF on the socket (the controller exited,
even by ``kill -9``) ends the zygote.

What a forked worker inherits that a new interpreter would not, and what is done about it:

- modules imported under the zygote's environment: the launcher forks only when every variable
  read at import time (``IMPORT_ENV``: torch's, OpenMP's, the loader's, Python's) is the same
  in the worker's environment, and starts a new interpreter otherwise. ``OMP_NUM_THREADS``,
  which the launcher sets per mesh, is applied with ``torch.set_num_threads`` instead;
- ``sys.path``: the worker's is what ``python -m`` would make of its own working directory and
  ``PYTHONPATH`` (test handlers and user plugins come that way); the zygote refuses the fork
  (and the launcher starts a new interpreter) when an entry the worker has and the zygote had
  not would shadow a module the zygote already imported, or one it imported from is gone;
- random states (Python's ``random``, torch's default generator): reseeded from the OS in
  the child, as each new interpreter has its own;
- signal dispositions: back to a new interpreter's; ``sys.argv[0]``: the worker module's file;
- what it cannot change: ``/proc/<pid>/environ`` and ``cmdline`` show the zygote's (the
  worker's ``os.environ`` is its own); the process is named ``meshplan-r<rank>`` (``top``,
  ``ps -o comm``).

A zygote that dies (killed, out of memory) takes its workers along: each then reads as killed,
its failure saying that its zygote ended first, and the next launch starts a new zygote.

Every fork comes after ``gc.freeze()`` (as Python's ``gc`` documentation advises for a fork
without exec): the objects the zygote made are left out of the child's collections, which
otherwise write to every one of them and so copy every page they lie on. Measured on this
2-core VM, a forked worker's first lowering of the fault benchmark's GPT plan: 236 ms and
21,900 page faults without, 70 ms and 3,500 with (``benchmarks/README.md``, "Churn").

Before its first fault-tolerance spare (``MESHPLAN_SPARE=1``), the zygote loads the CPU AdamW
kernel (numba, serial: no thread starts), so no spare after it spends the ~0.9 s of a core that
loading it takes, beside ranks that are running steps (``_warm_once``).

``MESHPLAN_ZYGOTE=0`` turns it off (every worker a new interpreter, as before).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

from .._errors import RuntimeFailure

ENV_ZYGOTE = "MESHPLAN_ZYGOTE"          # "0": never fork workers from a zygote
# imported once, in the zygote, before any fork (nothing that reads the environment when imported
# beyond IMPORT_ENV: kernels, plugins and the launchers' modules load in the worker)
PRELOAD = ("torch", "meshplan.runtime._worker", "meshplan.runtime._handlers")
# environment variables read while those modules import: a worker whose values differ is started
# as a new interpreter
IMPORT_ENV = ("TORCH", "PYTORCH", "OMP_", "GOMP_", "KMP_", "MKL", "OPENBLAS", "LD_", "CUDA",
              "NVIDIA", "HIP", "ROCM", "PYTHON", "MALLOC", "TRITON", "NUMBA")
APPLIED_IN_CHILD = frozenset({"OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONPATH"})
READY_TIMEOUT_S = 120.0
_MAX_MSG = 1 << 20


def import_signature(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of ``env`` the preloaded modules read when imported."""
    return tuple(sorted((k, v) for k, v in env.items()
                        if k.startswith(IMPORT_ENV) and k not in APPLIED_IN_CHILD))


# ---- the controller's side ---------------------------------------------------------------------

class ForkedProc:
    """A worker the zygote forked, as much of ``subprocess.Popen`` as the launcher uses: ``pid``,
    ``stdin``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``."""

    local = True
    ended: str | None = None        # what the launcher knows of its end (_check_exits says it)

    def __init__(self, zygote: Zygote, pid: int, pidfd: int | None, stdin: Any) -> None:
        self.pid, self.stdin, self.returncode = pid, stdin, None
        self.args = [f"<forked by the zygote, pid {zygote.pid}>"]
        self._zygote, self._pidfd = zygote, pidfd

    def poll(self) -> int | None:
        if self.returncode is None:
            zygote = self._zygote
            zygote.pump(0.0)
            if self.returncode is None and self._ended():
                # gone, the zygote's report on its way: wait for it (it reaps on SIGCHLD)
                zygote.pump_until(lambda: self.returncode is not None, 2.0)
                if self.returncode is None:     # the zygote is gone too: no status to read
                    self.ended = (f"the zygote that forked it (pid {zygote.pid}) ended "
                                  f"first ({zygote.dead}); a worker dies with it")
                    self._exited(-signal.SIGKILL)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            step = 0.05 if left is None else min(left, 0.05)
            if self._pidfd is not None:
                select.select([self._pidfd], [], [], step)
            else:
                time.sleep(step)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None:
            return
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, sig)
            else:
                os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _ended(self) -> bool:
        if self._pidfd is None:               # no pidfd (old kernel): the zygote's word only
            return self._zygote.dead is not None
        return bool(select.select([self._pidfd], [], [], 0)[0])

    def _exited(self, code: int) -> None:
        self.returncode = code
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def __del__(self) -> None:
        if self._pidfd is not None:
            try:
                os.close(self._pidfd)
            except OSError:
                pass


class RefusedFork(Exception):
    """The zygote cannot serve this worker (it would run other code than a new interpreter
    would): start one."""


class Zygote:
    """The controller's handle on one zygote process (``get`` keeps one per python)."""

    def __init__(self, python: str) -> None:
        self.python = python
        self.signature = import_signature(os.environ)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [python, "-m", "meshplan.runtime._zygote", str(theirs.fileno())],
                stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),), close_fds=True)
        finally:
            theirs.close()
        self.pid = self.proc.pid
        self._sock, self._lock = mine, threading.RLock()
        self._procs: dict[int, ForkedProc] = {}
        self._exits: dict[int, int] = {}     # reported before their spawn answer was read
        self._ready = False
        self.failed: str | None = None      # why it may not be used any more
        self.dead: str | None = None        # how it ended, once it has
        # at exit, after the worker groups started since (finalizers run newest first), so
        # that they stop their workers politely before the zygote's end takes them along
        self._finalizer = weakref.finalize(self, _close_ends, mine, self.proc)

    def usable(self, python: str, env: Mapping[str, str]) -> bool:
        return (self.failed is None and self.dead is None and python == self.python
                and self.proc.poll() is None and import_signature(env) == self.signature)

    def spawn(self, env: Mapping[str, str], cwd: str | None, stdin_fd: int, out_fd: int,
              err_fd: int, stdin: Any) -> ForkedProc:
        """Fork a worker with ``env`` in ``cwd`` on those descriptors (sent, not kept)."""
        with self._lock:
            self._wait_ready()
            request = json.dumps({"env": dict(env), "cwd": cwd}).encode()
            try:
                socket.send_fds(self._sock, [request], [stdin_fd, out_fd, err_fd])
            except OSError as exc:
                raise self._broken(f"sending a request failed: {exc}") from None
            reply, fds = self._recv_reply()
            if "pid" not in reply:
                for fd in fds:
                    os.close(fd)
                if "refused" in reply:
                    raise RefusedFork(reply["refused"])
                raise self._broken(f"the fork failed: {reply.get('error', reply)}")
            pid = int(reply["pid"])
            proc = ForkedProc(self, pid, fds[0] if fds else None, stdin)
            self._procs[pid] = proc
            if pid in self._exits:
                proc._exited(self._exits.pop(pid))
            return proc

    def pump(self, timeout: float | None) -> None:
        """Read the zygote's exit reports (waiting up to ``timeout`` for the first). Never
        raises: a zygote that ended is marked ``dead`` and reads as having nothing more."""
        with self._lock:
            while self.dead is None:
                got = self._recv(timeout)
                if got is None:
                    return
                self._route(got[0], got[1])
                timeout = 0.0

    def pump_until(self, done, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done():
            left = None if deadline is None else deadline - time.monotonic()
            if (left is not None and left <= 0) or self.dead is not None:
                return done()
            self.pump(0.05 if left is None else min(left, 0.05))
        return True

    def close(self) -> None:
        self._finalizer()

    # -- internals -----------------------------------------------------------------------------

    def _wait_ready(self) -> None:
        if self._ready:
            return
        got = self._recv(READY_TIMEOUT_S)
        if got is None or "ready" not in got[0]:
            raise self._broken(f"it ended before it was ready ({self.dead})" if self.dead
                               else f"it did not start within {READY_TIMEOUT_S:g} s"
                               if got is None else f"it said {got[0]}")
        self._ready = True

    def _recv_reply(self) -> tuple[dict, list[int]]:
        while True:
            got = self._recv(READY_TIMEOUT_S)
            if got is None:
                raise self._broken(f"it ended ({self.dead})" if self.dead else
                                   f"no answer to a fork within {READY_TIMEOUT_S:g} s")
            msg, fds = got
            if "exit" in msg:
                self._route(msg, fds)
                continue
            return msg, fds

    def _recv(self, timeout: float | None) -> tuple[dict, list[int]] | None:
        """The zygote's next message, None after ``timeout``, or None once it has ended
        (then ``dead`` says how)."""
        if self.dead is not None:
            return None
        try:
            if not select.select([self._sock], [], [], timeout)[0]:
                return None
            data, fds, _flags, _addr = socket.recv_fds(self._sock, _MAX_MSG, 4)
        except (OSError, ValueError) as exc:      # ValueError: closed here (at exit)
            self._die(f"its socket failed: {exc}")
            return None
        if not data:
            try:
                code = self.proc.wait(1.0)
                self._die(f"it exited with code {code}" if code >= 0 else
                          f"it was killed by {_signal_name(-code)}")
            except subprocess.TimeoutExpired:
                self._die("it closed its socket")
            return None
        return json.loads(data), fds

    def _die(self, how: str) -> None:
        self.dead = how
        self.failed = self.failed or how
        self._forget()

    def _forget(self) -> None:
        """Not this process's zygote any more: the next launch starts another."""
        with _ZYGOTES_LOCK:
            if _ZYGOTES.get(self.python) is self:
                _ZYGOTES.pop(self.python)

    def _route(self, msg: dict, fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)
        if "exit" not in msg:
            return
        pid, code = int(msg["exit"]), int(msg["code"])
        proc = self._procs.pop(pid, None)
        if proc is None:
            self._exits[pid] = code
        else:
            proc._exited(code)

    def _broken(self, why: str) -> RuntimeFailure:
        self.failed = why
        self._forget()
        return RuntimeFailure(f"the worker zygote (pid {self.pid}, {self.python} -m "
                              f"meshplan.runtime._zygote) failed: {why}; set {ENV_ZYGOTE}=0 to "
                              "start every worker as a new interpreter")


_ZYGOTES: dict[str, Zygote] = {}
_ZYGOTES_LOCK = threading.Lock()


def enabled() -> bool:
    return (os.environ.get(ENV_ZYGOTE, "1") != "0" and sys.platform.startswith("linux")
            and hasattr(socket, "send_fds"))


def get(python: str, env: Mapping[str, str]) -> Zygote | None:
    """This process's zygote for ``python``, started on first use; None when it is off or
    cannot serve ``env`` (a variable read at import differs: start a new interpreter)."""
    if not enabled():
        return None
    with _ZYGOTES_LOCK:
        zygote = _ZYGOTES.get(python)
        if zygote is not None and zygote.proc.poll() is not None:
            _ZYGOTES.pop(python)
            zygote = None
        if zygote is None:
            if import_signature(env) != import_signature(os.environ):
                return None
            zygote = _ZYGOTES[python] = Zygote(python)
    return zygote if zygote.usable(python, env) else None


def prestart(python: str = sys.executable) -> None:
    """Start this process's zygote now, without waiting for it: its imports then overlap
    with whatever the controller does before its first launch (tracing, planning)."""
    try:
        get(python, os.environ)
    except OSError:
        pass


def _close_ends(sock: socket.socket, proc: subprocess.Popen) -> None:
    """End a zygote: close its socket (it exits on EOF, and its workers with it) and give it
    half a second (one still importing reads nothing yet: killed, it has no children)."""
    try:
        sock.close()
    except OSError:
        pass
    try:
        proc.wait(0.5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# ---- the zygote's side -------------------------------------------------------------------------

def _serve(sock: socket.socket) -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)     # wakes select through the pipe
    try:
        sock.send(json.dumps({"ready": os.getpid()}).encode())
    except OSError:
        return                                  # the controller ended while this imported
    while True:
        ready = select.select([sock, wake_r], [], [])[0]
        if wake_r in ready:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
            _reap(sock)
        if sock in ready:
            try:
                data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MSG, 4)
            except OSError:
                return
            if not data:
                return                          # the controller is gone
            _fork(sock, json.loads(data), fds, (wake_r, wake_w))
            _reap(sock)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        try:
            sock.send(json.dumps({"exit": pid, "code": code}).encode())
        except OSError:
            return


def _worker_path(env: Mapping[str, str], cwd: str) -> list[str] | str:
    """The ``sys.path`` ``python -m`` would give a worker in ``cwd`` with ``env``'s
    ``PYTHONPATH``; or why forking would run other code than that (a new entry shadows a
    module this process imported, or a module came from an entry the worker lacks)."""
    def entries(value: str, base: str) -> list[str]:
        return [os.path.abspath(os.path.join(base, p)) for p in value.split(os.pathsep) if p]

    mine = entries(os.environ.get("PYTHONPATH", ""), _START_CWD)
    theirs = entries(env.get("PYTHONPATH", ""), cwd)
    rest = [p for p in sys.path[1:] if p not in mine]
    path = [cwd, *theirs, *rest]
    new = [p for p in path if p not in sys.path]
    gone = [p for p in sys.path if p not in path]
    if not new and not gone:
        return path
    from importlib.machinery import PathFinder

    loaded = {name.partition(".")[0] for name in list(sys.modules)}
    for name in sorted(loaded):
        module = sys.modules.get(name)
        where = getattr(module, "__file__", None) or ""
        if any(_came_from(name, where, g) for g in gone):
            return f"module {name} was imported from {where}, not on the worker's path"
        found = PathFinder.find_spec(name, new) if new else None
        # (a folder without __init__.py is a namespace portion: a module found later wins)
        if found is not None and found.origin is not None:
            return f"the worker's path would import {name} from another place than {where}"
    return path


def _came_from(name: str, where: str, entry: str) -> bool:
    """Whether module ``name`` (its file ``where``) was found in path entry ``entry``."""
    if not where.startswith(os.path.join(entry, "")):
        return False
    first = where[len(os.path.join(entry, "")):].split(os.sep)[0]
    return first == name or first.split(".")[0] == name


_START_CWD = ""         # the zygote's working directory when it started (main() sets it)


def _fork(sock: socket.socket, request: dict, fds: list[int], wake: tuple[int, int]) -> None:
    path = _worker_path(request["env"], request["cwd"])
    if isinstance(path, str):
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"refused": path}).encode())
        return
    request["path"] = path
    if request["env"].get("MESHPLAN_SPARE") == "1":
        _warm_once(request["env"])
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()         # what is here now is never collected in the child (see the docstring)
    try:
        pid = os.fork()
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"error": str(exc)}).encode())
        return
    if pid == 0:
        _child(request, fds, [sock.fileno(), *wake])      # never returns
    for fd in fds:
        os.close(fd)
    pidfd = []
    try:
        pidfd = [os.pidfd_open(pid)]
    except (OSError, AttributeError):
        pass
    try:
        socket.send_fds(sock, [json.dumps({"pid": pid}).encode()], pidfd)
    except OSError:
        pass                                    # the controller is gone: so is the child
    for fd in pidfd:
        os.close(fd)


_WARMED: list[bool] = []


def _warm_once(env: Mapping[str, str]) -> None:
    """Load the CPU AdamW kernel here, once, before the first spare's fork, so that every later
    spare inherits it compiled instead of loading it itself (``kernels.warm_cpu``: ~0.9 s of a
    core per spare, taken from the ranks running beside it on a busy host). Only numba and
    numpy run: no tensor op, so no thread pool is started in this process (numba's njit kernel
    is serial). Best effort, and never again after a failure; the spare then loads it itself."""
    if _WARMED:
        return
    _WARMED.append(True)
    if env.get("MESHPLAN_KERNELS", "on").strip().lower() in ("off", "0", "false", "no"):
        return
    try:
        import numpy as np

        from meshplan.kernels import _cpu_optim

        kernel = _cpu_optim._numba_kernel()
        a, b, c, d = (np.zeros(8, dtype=np.float32) for _ in range(4))
        one = np.float32(1.0)
        kernel(a, b, c, d, one, one, one, False, one, one, one, one, one)
    except Exception:  # noqa: BLE001 - numba missing or broken: each spare tries on its own
        pass


def _child(request: dict, fds: list[int], close: list[int]) -> None:
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for fd in close:
            os.close(fd)
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        cwd = request.get("cwd")
        if cwd:
            os.chdir(cwd)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[:] = request["path"]
        env = request["env"]
        _name(f"meshplan-r{env['MESHPLAN_RANK']}" if env.get("MESHPLAN_RANK", "").isdigit()
              else "meshplan-spare")
        import random

        random.seed()
        import torch

        # what torch makes of them when it loads: MKL's count where set, else OpenMP's
        threads = os.environ.get("MKL_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))
        torch.seed()            # as a new interpreter: its own seed, not the zygote's
        from meshplan.runtime import _worker

        sys.argv = [_worker.__file__]           # as `python -m` sets it
        _worker.run_and_exit()
    except BaseException:  # noqa: BLE001 - a child must never return into the zygote's loop
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
    os._exit(1)


def _name(name: str) -> None:
    """This process's name as ``top`` and ``ps -o comm`` show it (15 bytes at most; its
    command line stays the zygote's)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)     # 15 = PR_SET_NAME
    except (OSError, AttributeError):
        pass


def main() -> None:
    global _START_CWD
    _START_CWD = os.getcwd()
    _name("meshplan-zygote")
    sock = socket.socket(fileno=int(sys.argv[1]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # Ctrl-C is the controller's to handle
    import warnings

    # torch's import leaves an idle native thread; the fork happens with it parked, and the
    # child runs only the forking thread (as multiprocessing's forkserver does after its preload)
    warnings.filterwarnings("ignore", message=".*use of fork\\(\\) may lead to deadlocks.*")
    try:
        for name in PRELOAD:
            importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - the controller falls back to new interpreters
        sock.send(json.dumps({"error": f"preloading failed: {exc!r}"}).encode())
        return
    _serve(sock)


if __name__ == "__main__":
    main()
