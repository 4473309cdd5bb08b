"""The worker process: ``python -m meshplan.runtime._worker``.

A launcher starts it with its rank, the world size, the controller's address and the run id in
the environment (``MESHPLAN_*``) and the channel secret as the first line (hex) of stdin, never in
argv or the environment. Under the ``mpi`` launcher (``MESHPLAN_MPI=1``) the rank comes from MPI
and the secret from a private file instead (``_mpi_launch.worker_start``); under ``slurm``
(``MESHPLAN_SLURM=1``) the rank is ``$SLURM_PROCID`` and srun passes stdin to every task. The worker connects,
says ``hello``, then serves: receive a message, dispatch on its kind to a handler, send the reply.

A handler is ``fn(state, header, tensors) -> (reply_header, reply_tensors)`` registered with
``@register(kind)``; modules named in ``MESHPLAN_WORKER_PLUGINS`` (comma-separated) are imported
at start so other parts of meshplan (or tests) can add handlers. An exception in a handler becomes
an ``error`` reply (type, message, formatted traceback, and the ``meshplan_where`` attribute a
handler may set on the exception, e.g. the user's ``file:line``); the worker keeps serving and the
controller decides what to do.

The worker never outlives its controller: a daemon thread blocks on stdin, whose write end only
the controller holds, and calls ``os._exit`` on EOF (the controller exited, even by ``kill -9``); on
Linux ``PR_SET_PDEATHSIG`` is a second guard when the controller launched from its main thread.
"""

from __future__ import annotations

import importlib
import logging
import os
import select
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from ._logs import ENV_LOGS, LogCapture, python_stacks
from ._channel import (
    ENV_ADDRESS,
    ENV_PARENT_PID,
    ENV_PDEATHSIG,
    ENV_PLUGINS,
    ENV_RANK,
    ENV_RUN_ID,
    ENV_WORLD_SIZE,
    ERROR,
    HELLO,
    PING,
    SHUTDOWN,
    Message,
    Secret,
    WorkerChannel,
    controller_elsewhere,
    lost_after_s,
    store_prefix,
)

__all__ = ["Handler", "WorkerState", "keep_freed_memory", "main", "register"]

logger = logging.getLogger(__name__)

EXIT_ORPHANED = 86      # the controller went away
EXIT_BAD_START = 87     # no secret on stdin or a broken environment


@dataclass(eq=False)
class WorkerState:
    """What a handler sees of its worker. ``ns`` is free for handlers to keep things in."""

    rank: int
    world_size: int
    run_id: str
    master_addr: str | None = None
    master_port: int | None = None
    store_prefix: str = ""        # the run's keys in the rendezvous store (_launch.store_prefix)
    hostname: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ), repr=False)
    ns: SimpleNamespace = field(default_factory=SimpleNamespace, repr=False)
    stopping: bool = False
    doing: str = "starting"       # what the rank serves now (its stacks say it)


Handler = Callable[[WorkerState, dict[str, Any], list[torch.Tensor]],
                   tuple[dict[str, Any], list[torch.Tensor]]]
_HANDLERS: dict[str, Handler] = {}


def register(kind: str) -> Callable[[Handler], Handler]:
    """Decorator: ``fn`` answers messages of ``kind``. Registering a kind twice is an error."""
    if not isinstance(kind, str) or not kind or kind in (HELLO, ERROR):
        raise ValueError(f"cannot register a handler for kind {kind!r}"
                         + (": the protocol's own kind; use another name"
                            if kind in (HELLO, ERROR) else ""))

    def deco(fn: Handler) -> Handler:
        if kind in _HANDLERS:
            raise ValueError(f"a worker handler for {kind!r} is already registered "
                             f"({_HANDLERS[kind].__module__}.{_HANDLERS[kind].__qualname__})")
        _HANDLERS[kind] = fn
        return fn

    return deco


@register(PING)
def _ping(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    return dict(header, rank=state.rank), tensors


@register(SHUTDOWN)
def _shutdown(state: WorkerState, header: dict[str, Any], tensors: list[torch.Tensor]):
    state.stopping = True
    # a pipeline's one-sided windows (``MESHPLAN_STAGE_TRANSFERS=rma``): freed with every
    # rank (collective, as every rank is told to stop), not left to MPI's finalisation
    mail = getattr(getattr(state.ns, "comm", None), "_stage_mail", None)
    if mail is not None:
        state.ns.comm._stage_mail = None
        mail[1].close()
    return {"rank": state.rank}, []


# ---------------------------------------------------------------------------------------------
# serving


def error_reply(exc: BaseException, kind: str) -> dict[str, Any]:
    """The header of an ``error`` reply for ``exc`` raised while handling ``kind``."""
    where = getattr(exc, "meshplan_where", None)
    return {
        "kind": kind,
        "type": type(exc).__qualname__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
        "where": None if where is None else str(where),
        # the step was applied on no rank: this rank's state is as before it (backends.run)
        "intact": bool(getattr(exc, "meshplan_intact", False)),
    }


def handle(state: WorkerState, message: Message) -> tuple[str, dict[str, Any], list[torch.Tensor]]:
    """Run the handler for ``message``: the reply's (kind, header, tensors)."""
    fn = _HANDLERS.get(message.kind)
    try:
        if fn is None:
            raise LookupError(f"rank {state.rank} has no handler for {message.kind!r} "
                              f"(known: {', '.join(sorted(_HANDLERS))})")
        out = fn(state, dict(message.header), list(message.tensors))
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], dict)):
            raise TypeError(f"handler for {message.kind!r} returned {type(out).__name__}; "
                            "it must return (header: dict, tensors: list[Tensor])")
        return message.kind, out[0], list(out[1])
    except Exception as exc:  # noqa: BLE001 - every handler failure goes back to the controller
        return ERROR, error_reply(exc, message.kind), []


def serve(state: WorkerState, channel: WorkerChannel) -> None:
    """Answer messages until a ``shutdown``."""
    while not state.stopping:
        state.doing = "waiting for the controller"
        message = channel.recv()
        step = message.header.get("step") if isinstance(message.header, dict) else None
        state.doing = f"{message.kind!r}" + (f" of step {step}" if step is not None else "")
        kind, header, tensors = handle(state, message)
        state.doing = "waiting for the controller"    # before the reply: it may be asked next
        try:
            channel.send(kind, header, tensors)
        except Exception as exc:  # noqa: BLE001 - e.g. a reply header that is not JSON-able
            channel.send(ERROR, error_reply(exc, message.kind))


# ---------------------------------------------------------------------------------------------
# start-up


def _read_secret_line(fd: int) -> bytes:
    """The first line of ``fd``, read unbuffered so nothing past it is consumed."""
    line = bytearray()
    while not line.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            break
        line += chunk
    return bytes(line)


def _exit_on_eof(fd: int) -> None:
    """Block on the controller's stdin pipe; EOF means the controller is gone: exit at once."""
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass
    os._exit(EXIT_ORPHANED)


def _guard_against_orphaning(parent_pid: int | None, pdeathsig: bool,
                             spare: bool = False) -> Secret:
    """Read the secret, start the stdin watcher and (Linux) ask for SIGKILL on parent death.

    ``spare`` (``MESHPLAN_SPARE=1``, the local launcher's warm spare for fault tolerance):
    import torch and the plugins first, then wait for a second line, the rank this process is
    to be (``Workers.respawn``; a k8s pod's agent adds its local rank), and set it in the
    environment; EOF instead means the controller is gone or does not need the spare: exit."""
    if pdeathsig and sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:    # 1 = PR_SET_PDEATHSIG
            logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(EXIT_ORPHANED)     # the controller died before the guard was set
    pipe = os.dup(0)                # keep the pipe; fd 0 becomes /dev/null for user code
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    line = _read_secret_line(pipe)
    if spare:
        base = _lower_priority()
        try:
            _load_plugins(os.environ.get(ENV_PLUGINS, ""))   # main() reports a failure
        except Exception:  # noqa: BLE001 - loaded again, and reported, once connected
            pass
        if not select.select([pipe], [], [], 0)[0]:    # no rank to take yet: time to spare
            _warm_kernels()
        # "RANK" or "RANK LOCAL_RANK" (a pod's agent: its ranks' local ranks start at 0)
        told = _read_secret_line(pipe).decode(errors="replace").split()
        if not 1 <= len(told) <= 2 or not all(t.isdigit() for t in told):
            os._exit(EXIT_ORPHANED)
        rank, local = told[0], told[-1]
        if base is not None:               # a rank now: back to its peers' priority
            try:
                os.setpriority(os.PRIO_PROCESS, 0, base)
            except OSError as exc:
                logger.warning("a spare taking rank %s stays at nice 19: %s", rank, exc)
        os.environ.update({ENV_RANK: rank, "RANK": rank, "LOCAL_RANK": local})
        _rename_spare(rank)
    threading.Thread(target=_exit_on_eof, args=(pipe,), name="meshplan-orphan-guard",
                     daemon=True).start()
    return Secret.from_hex(line.decode())


def _rename_spare(rank: str) -> None:
    """A spare the zygote forked is named ``meshplan-spare``; as a rank, ``meshplan-r<N>``."""
    try:
        with open("/proc/self/comm") as f:
            if f.read().strip() != "meshplan-spare":
                return
    except OSError:
        return
    from ._zygote import _name

    _name(f"meshplan-r{rank}")


def _lower_priority() -> int | None:
    """A spare imports torch and loads kernels (2-3 s of a core) while the ranks train: it does
    so at the lowest priority (nice 19), so that on a host whose cores the ranks fill it takes
    only what they leave; returns the priority to go back to when it becomes a rank, or None
    (left as it is) where the process could not go back to it (without CAP_SYS_NICE, which
    root in a container often lacks, and RLIMIT_NICE does not allow it: a rank at nice 19
    would slow its whole mesh)."""
    import resource

    try:
        base = os.getpriority(os.PRIO_PROCESS, 0)
        soft = resource.getrlimit(resource.RLIMIT_NICE)[0]
        if not _may_raise_priority() and soft != resource.RLIM_INFINITY and 20 - soft > base:
            return None
        os.setpriority(os.PRIO_PROCESS, 0, 19)
        return base
    except (OSError, ValueError):
        return None


def _may_raise_priority() -> bool:
    """Whether this process holds CAP_SYS_NICE (bit 23 of its effective capabilities; where
    /proc says nothing, whether it is root)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> 23 & 1)
    except (OSError, ValueError, IndexError):
        pass
    return os.geteuid() == 0


def _warm_kernels() -> None:
    """A spare loads the CPU AdamW kernel while it waits (``kernels.warm_cpu``: about 0.9 s in
    a fresh process, which the replaced rank's first step paid before; kill -> next step
    1.31 -> 1.02 s p50 in ``benchmarks/faults.py --gap 6``); best effort."""
    try:
        from ..kernels import kernels_enabled, warm_cpu

        if kernels_enabled():
            warm_cpu()
    except Exception:  # noqa: BLE001 - the rank loads them when it needs them, as ever
        pass


def _load_plugins(spec: str) -> None:
    for name in filter(None, (part.strip() for part in spec.split(","))):
        importlib.import_module(name)


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse; returns whether it did. Every step allocates
    and frees the same large buffers (activations, gradients, the buckets' flat buffers); by
    default glibc returns blocks above its mmap threshold to the kernel on free and trims the
    heap's top, so the next step faults the same pages in again: 4,400-7,200 page faults a
    step per rank for ``benchmarks/step_time.py``'s GPT on 4 ranks (3-340 with this), a few ms
    of kernel time each step, none in eager PyTorch in one process. Blocks up to 32 MiB (glibc's largest mmap threshold) now come
    from the heap and the heap is not trimmed; the resident set stays at its peak, which is
    what a step needs anyway. ``MESHPLAN_MALLOC=default`` keeps glibc's policy; other C
    libraries are left alone."""
    if os.environ.get("MESHPLAN_MALLOC") == "default" or not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3          # glibc's <malloc.h>
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 1 << 30))


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C is the controller's to handle
    keep_freed_memory()
    env = os.environ
    try:
        parent = int(env[ENV_PARENT_PID]) if ENV_PARENT_PID in env else None
        if env.get("MESHPLAN_MPI") == "1":     # started by mpiexec: see _mpi_launch
            from ._mpi_launch import worker_start

            secret, rank = worker_start(env, parent, env.get(ENV_PDEATHSIG) == "1")
        elif env.get("MESHPLAN_SLURM") == "1":  # started by srun: see _slurm_launch
            from ._slurm_launch import worker_rank

            rank = worker_rank(env)
            secret = _guard_against_orphaning(None, env.get(ENV_PDEATHSIG) == "1")
        else:
            secret = _guard_against_orphaning(parent, env.get(ENV_PDEATHSIG) == "1",
                                              spare=env.get("MESHPLAN_SPARE") == "1")
            rank = int(env[ENV_RANK])
        world_size = int(env[ENV_WORLD_SIZE])
        address, run_id = env[ENV_ADDRESS], env[ENV_RUN_ID]
    except (KeyError, ValueError, OSError) as exc:
        print(f"meshplan worker: bad start ({exc!r}); start workers with a meshplan launcher",
              file=sys.stderr)
        return EXIT_BAD_START
    # a k8s pod: its log keeps them (``kubectl logs``), which the controller streams itself
    mode = env.get(ENV_LOGS) or ("off" if env.get("MESHPLAN_K8S") == "1" else "stream")
    capture = LogCapture(tee=mode == "tee") if mode in ("stream", "tee") else None
    # the controller prefixes streamed lines with the rank itself
    logging.basicConfig(level=logging.WARNING,
                        format=("%(levelname)s %(name)s: %(message)s" if capture else
                                f"[rank {rank}] %(levelname)s %(name)s: %(message)s"))
    port = env.get("MASTER_PORT")
    state = WorkerState(rank, world_size, run_id, env.get("MASTER_ADDR"),
                        int(port) if port else None, store_prefix(secret))
    channel = WorkerChannel(address, secret, run_id, rank)
    # on another host than the controller: no pid or stdin to watch; the heartbeat tells the
    # controller this host is alive, and this rank that the controller still is. On every
    # host: the rank's output lines, and its stacks when asked (runtime/_logs.py)
    side = channel.start_side(beats=controller_elsewhere(env), lost_after_s=lost_after_s(env),
                              on_lost=_controller_lost,
                              stacks=lambda: python_stacks(lambda: state.doing),
                              rows=lambda tables: recent_rows(state, tables),
                              lines=capture.lines if capture is not None else None)
    if capture is not None:
        capture.wake = side.wake
    try:
        _load_plugins(env.get(ENV_PLUGINS, ""))
    except Exception as exc:  # noqa: BLE001 - reported to the controller instead of a hello
        channel.send(ERROR, error_reply(exc, HELLO))
        _close(channel, capture)
        return 1
    channel.send(HELLO, {"rank": rank, "pid": state.pid, "hostname": state.hostname})
    serve(state, channel)
    _close(channel, capture)
    return 0


def recent_rows(state: WorkerState, tables: list[str]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """This rank's recent telemetry rows of ``tables`` (flushed or not; the last
    ``live_rows`` of each), each as an Arrow IPC stream in a uint8 tensor: the side thread's
    answer to ``ROWS`` (``meshplan serve``'s ``live_`` tables, runtime/_live.py). Read while
    the main thread may record: the recorder's locks keep it whole."""
    from ..telemetry._recorder import arrow_ipc
    from ..telemetry._schema import TABLES

    tel = getattr(state.ns, "telemetry", None)
    if tel is None:
        return {"error": f"rank {state.rank} records no telemetry (not set up yet, or the run "
                         "has telemetry off)"}, []
    unknown = [t for t in tables if t not in TABLES]
    if unknown:
        return {"error": f"no telemetry table {unknown[0]!r}"}, []
    return {"tables": tables}, [
        torch.frombuffer(bytearray(arrow_ipc(tel.rec.recent(t))), dtype=torch.uint8)
        for t in tables]


def _close(channel: WorkerChannel, capture: LogCapture | None) -> None:
    """The last lines go out, then the last reply (``linger_s``)."""
    if capture is not None:
        capture.close()
    channel.close(linger_s=5.0)


def _controller_lost() -> None:
    """The connection to the controller has been down for ``$MESHPLAN_LOST_AFTER_S``: the
    run is over for this rank. Under mpiexec its hydra proxy goes too (its own link to
    mpiexec is as dead; it would wait for a TCP timeout of many minutes)."""
    print("meshplan worker: lost the controller (no connection for "
          f"{lost_after_s()} s); exiting", file=sys.stderr, flush=True)
    try:
        with open(f"/proc/{os.getppid()}/comm") as f:
            if f.read().strip().startswith("hydra_pmi_proxy"):
                os.kill(os.getppid(), signal.SIGKILL)
    except OSError:
        pass
    os._exit(EXIT_ORPHANED)


def _finalize_mpi() -> None:
    """Finalize MPI if a rank used it: mpi4py finalizes at interpreter teardown, which the
    quick exit below skips, and MPICH then leaves its ``/dev/shm/mpich_shm_*`` file behind."""
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()
    except Exception as exc:  # noqa: BLE001 - exiting anyway; say why the file may remain
        print(f"meshplan worker: MPI_Finalize failed: {exc}", file=sys.stderr)


def run_and_exit() -> None:
    """``main()``, then exit without the interpreter's teardown of torch (most of a second);
    atexit hooks still run. What ``python -m meshplan.runtime._worker`` and a worker forked
    by the local launcher's zygote (``_zygote.py``) run."""
    import atexit

    code = main()
    atexit._run_exitfuncs()
    _finalize_mpi()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    # Run the canonical module, not this __main__ copy, so plugins that import
    # meshplan.runtime._worker register into the same handler table.
    from meshplan.runtime._worker import run_and_exit as _run

    _run()
