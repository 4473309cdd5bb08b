"""Fault injection for the fault-tolerance tests: a worker plugin (``MESHPLAN_WORKER_PLUGINS``).

``$MESHPLAN_TEST_FAULTS`` is a JSON list of faults, each ``{"rank": r, "step": s, "at": where,
"how": what, "marker": path}``: rank ``r`` fails ``how`` at ``where`` in step ``s`` (or in the
first such call after it), once: the first to fire creates ``marker`` and no process fires it
again, so the replacement mesh runs clean.

where: ``forward`` (the step handler's start, before any op), ``backward`` (the middle op of
the backward), ``optimizer`` (the middle op of the update, or the first kernel call when
kernels replaced it), ``allreduce`` (entering the step's first all-reduce), ``snapshot`` (half
way through copying the state into the snapshot), ``state`` (``get_state``: ``state_dict()``),
``restore`` (``restore_snapshot``: a fault during a recovery).
how: ``kill`` (SIGKILL), ``segv`` (SIGSEGV), ``exit`` (``os._exit(3)``), ``stop`` (SIGSTOP),
``hang`` (sleeps: alive and running, but never answers), ``drop`` (closes its control
socket, then as ``hang``: a connection lost while the process lives), ``raise`` (an exception
where it fires: at ``snapshot``, a copy that fails while the rank lives on).
"""

from __future__ import annotations

import json
import os
import signal
import time

from meshplan.backends import _lower
from meshplan.ir import Phase
from meshplan.runtime import _worker

_FAULTS = json.loads(os.environ.get("MESHPLAN_TEST_FAULTS", "[]"))


def _rank() -> int:
    """This worker's rank, read when a fault is due: a spare learns it after the import."""
    return int(os.environ.get("MESHPLAN_RANK", "-1"))


def _fire(fault: dict) -> None:
    try:
        os.close(os.open(fault["marker"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return                        # fired once already (in this process or an earlier one)
    how = fault["how"]
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "segv":
        signal.signal(signal.SIGSEGV, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGSEGV)
    elif how == "exit":
        os._exit(3)
    elif how == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif how == "hang":
        time.sleep(3600)
    elif how == "drop":                  # the control connection goes; the process stays
        import gc

        from meshplan.runtime._channel import WorkerChannel
        for obj in gc.get_objects():
            if isinstance(obj, WorkerChannel):
                obj._socket.close(linger=0)
        time.sleep(3600)
    elif how == "raise":
        raise MemoryError("injected: the snapshot copy ran out of memory")
    else:
        raise ValueError(f"unknown fault {how!r}")


def _due(at: str, step: int | None) -> dict | None:
    for f in _FAULTS:
        if f["rank"] == _rank() and f["at"] == at and (step is None or step >= f["step"]) \
                and not os.path.exists(f["marker"]):
            return f
    return None


class _Faulty:
    """A prepared op (``_lower._Op``) that fails before it computes."""

    def __init__(self, op, fault: dict) -> None:
        self._op, self._fault = op, fault
        self.name, self.reads, self.stream = op.name, op.reads, op.stream

    def __call__(self, *args):
        _fire(self._fault)
        return self._op(*args)


class _HalfCopy(dict):
    """The snapshot's views: the copy fails half way through."""

    def __init__(self, views: dict, fault: dict) -> None:
        super().__init__(views)
        self._fault = fault

    def items(self):
        items = list(super().items())
        for i, kv in enumerate(items):
            if i == len(items) // 2:
                _fire(self._fault)
            yield kv


def _arm(state, step: int) -> None:
    ns = state.ns
    program, _ = ns.programs[0]
    for at, phase in (("backward", Phase.BACKWARD), ("optimizer", Phase.UPDATE)):
        fault = _due(at, step)
        if fault is None:
            continue
        ops = [i for i, ins in enumerate(program.instructions)
               if isinstance(ins, _lower.Compute) and ins.node.phase is phase]
        if ops:
            i = ops[len(ops) // 2]
            prepared = list(program.prepared)
            prepared[i] = _Faulty(prepared[i], fault)
            program.__dict__["prepared"] = tuple(prepared)
        elif at == "optimizer":
            kernel = _lower.run_kernel

            def faulty_kernel(*args, _fault=fault, _kernel=kernel):
                _fire(_fault)
                return _kernel(*args)
            _lower.run_kernel = faulty_kernel
        else:
            raise AssertionError(f"rank {state.rank}: the program has no {phase.value} op")
    fault = _due("allreduce", step)
    if fault is not None:
        comm = ns.comm
        start = comm._all_reduce_start

        def faulty_start(*args, _fault=fault, _start=start, **kwargs):
            _fire(_fault)
            return _start(*args, **kwargs)
        comm._all_reduce_start = faulty_start
    fault = _due("snapshot", step)
    if fault is not None:
        snap = ns.snapshot
        views = snap._views
        snap._views = lambda slot, _f=fault, _v=views: _HalfCopy(_v(slot), _f)


def _wrap(kind: str, before) -> None:
    handler = _worker._HANDLERS[kind]

    def wrapped(state, header, tensors):
        before(state, header)
        return handler(state, header, tensors)
    _worker._HANDLERS[kind] = wrapped


def _before_step(state, header) -> None:
    step = int(header["step"])
    fault = _due("forward", step)
    if fault is not None:
        _fire(fault)
    _arm(state, step)


def _before(at: str):
    def hook(state, header) -> None:
        fault = _due(at, None)
        if fault is not None:
            _fire(fault)
    return hook


if _FAULTS:
    _wrap("step", _before_step)
    _wrap("get_state", _before("state"))
    _wrap("restore_snapshot", _before("restore"))
