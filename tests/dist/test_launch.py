"""The local launcher and the worker skeleton (runtime/_launch.py, runtime/_worker.py) with real
worker processes, 2 and 4 of them.

Test handlers come from a small module in a temp dir, loaded by the workers through
``MESHPLAN_WORKER_PLUGINS``. Every failure must stop all workers (checked by pid), and workers
must die with their controller, even when it is killed with SIGKILL. Tensors are only echoed, so
the checks demand bit-equality.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from meshplan._errors import RuntimeFailure
from meshplan.runtime import (
    LocalLauncher,
    Message,
    WorkerFailure,
    WorkerState,
    _worker,
    register,
)

HANDLERS = '''
import os, sys, time
from meshplan.runtime._worker import register

@register("boom")
def boom(state, header, tensors):
    if state.rank == header["rank"]:
        exc = ValueError("bad thing on purpose")
        exc.meshplan_where = "train.py:42"
        raise exc
    return {}, []

@register("die")
def die(state, header, tensors):
    if state.rank == header["rank"]:
        print("rank", state.rank, "about to die", file=sys.stderr, flush=True)
        os._exit(3)
    return {}, []

@register("hang")
def hang(state, header, tensors):
    if state.rank == header["rank"]:
        time.sleep(600)
    return {}, []

@register("info")
def info(state, header, tensors):
    with open("/proc/self/cmdline", "rb") as f:
        argv = f.read().decode()
    import torch
    return {"world_size": state.world_size, "env": dict(os.environ), "argv": argv,
            "cwd": os.getcwd(), "ppid": os.getppid(), "threads": torch.get_num_threads(),
            "path0": sys.path[0]}, []
'''


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("plugins")
    (folder / "mp_test_handlers.py").write_text(HANDLERS)
    path = os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, "MESHPLAN_WORKER_PLUGINS": "mp_test_handlers"}


def _alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie counts as gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids, within_s: float) -> list[int]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _ping_and_info(workers, n: int, cwd: Path) -> None:
    per_rank = [[torch.full((r + 1, 2), float(r), dtype=torch.bfloat16), torch.arange(r)]
                for r in range(n)]
    workers.broadcast("ping", {"tag": "x"}, per_rank)
    replies = workers.gather("ping", timeout_s=30)
    assert [m.header for m in replies] == [{"tag": "x", "rank": r} for r in range(n)]
    for sent, got in zip(per_rank, replies):
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(sent, got.tensors))
    workers.broadcast("info")
    infos = [m.header for m in workers.gather("info", timeout_s=30)]
    secret = workers.channel.secret.hex()
    for r, h in enumerate(infos):
        assert h["world_size"] == n and h["env"]["RANK"] == str(r)
        assert h["env"]["MASTER_ADDR"] == "127.0.0.1"
        assert h["env"]["MASTER_PORT"] == str(workers.master_port)
        assert h["cwd"] == str(cwd)
        assert secret not in h["argv"] and secret not in repr(h["env"])


@pytest.mark.timeout(60)
def test_two_workers_ping_and_shut_down_politely(plugin_env, tmp_path) -> None:
    with LocalLauncher().launch(2, env=plugin_env, cwd=tmp_path) as workers:
        assert workers.n == 2 and len(set(workers.pids)) == 2
        _ping_and_info(workers, 2, tmp_path)
        # what a rank killed between creating its shared-memory group file and unlinking it
        # leaves (issue 19, point 4): the controller removes it when the group stops
        left = Path("/dev/shm") / f"meshplan-{workers.run_id}-r1-0123456789abcdef"
        left.write_bytes(b"x")
    assert not left.exists()
    assert workers.closed and not _wait_gone(workers.pids, 0)
    assert [p.returncode for p in workers._group.procs] == [0, 0]       # polite exit
    workers.shutdown()                                                  # idempotent
    with pytest.raises(RuntimeFailure, match="shut down"):
        workers.gather("ping", timeout_s=1)


@pytest.mark.timeout(60)
def test_workers_fork_from_the_zygote_as_a_new_interpreter_would_start(plugin_env, tmp_path,
                                                                       monkeypatch) -> None:
    """Local workers are forked by this process's zygote (``runtime/_zygote.py``) with the
    environment, working directory, ``sys.path`` and thread count a new interpreter would
    have; a worker whose import-time environment differs, or ``MESHPLAN_ZYGOTE=0``, starts as
    a new interpreter (its parent is this process)."""
    from meshplan.runtime import _zygote

    def infos(env):
        with LocalLauncher().launch(2, env=env, cwd=tmp_path) as workers:
            workers.broadcast("info")
            return [m.header for m in workers.gather("info", timeout_s=30)]

    forked = infos(dict(plugin_env, OMP_NUM_THREADS="1"))
    zygote = _zygote._ZYGOTES[sys.executable]
    assert [h["ppid"] for h in forked] == [zygote.pid] * 2
    assert [h["threads"] for h in forked] == [1, 1]          # the launcher's, not the zygote's
    assert {h["path0"] for h in forked} == {str(tmp_path)}   # as `python -m` puts it
    assert all(h["env"]["OMP_NUM_THREADS"] == "1" and "MESHPLAN_SPARE" not in h["env"]
               for h in forked)
    other = infos(dict(plugin_env, PYTORCH_MESHPLAN_TEST="1"))      # read when torch imports
    assert [h["ppid"] for h in other] == [os.getpid()] * 2
    monkeypatch.setenv("MESHPLAN_ZYGOTE", "0")
    assert [h["ppid"] for h in infos(plugin_env)] == [os.getpid()] * 2


@pytest.mark.timeout(60)
def test_a_killed_zygote_is_a_failure_of_its_workers_and_the_next_launch_starts_another(
        plugin_env) -> None:
    """The zygote killed under a running group: its workers die with it, the controller's
    wait fails naming the rank, its signal and the zygote's end (not a crash in the
    launcher), stopping the group raises nothing, and the next launch forks from a new one."""
    from meshplan.runtime import _zygote

    workers = LocalLauncher().launch(2, env=plugin_env)
    zygote = _zygote._ZYGOTES[sys.executable]
    os.kill(zygote.pid, signal.SIGKILL)
    assert not _wait_gone(workers.pids, 5)           # PR_SET_PDEATHSIG: they die with it
    with pytest.raises(WorkerFailure, match=r"(?s)killed by SIGKILL.*the zygote that forked it "
                       rf"\(pid {zygote.pid}\) ended first \(it was killed by SIGKILL\)"):
        workers.broadcast("hang", {"rank": -1})
        workers.gather("hang", timeout_s=30)
    workers.shutdown()
    assert not _wait_gone(workers.pids, 2)
    with LocalLauncher().launch(2, env=plugin_env) as again:
        assert _zygote._ZYGOTES[sys.executable].pid != zygote.pid
        again.broadcast("info")
        assert {m.header["ppid"] for m in again.gather("info", timeout_s=30)} == {
            _zygote._ZYGOTES[sys.executable].pid}


def test_the_zygote_refuses_a_path_that_would_import_other_code(tmp_path, monkeypatch) -> None:
    """A worker's ``sys.path`` is its own working directory and ``PYTHONPATH``; where an entry
    the zygote lacked would shadow a module it imported (a ``json.py`` in the worker's
    folder), forking would run other code than a new interpreter: refused, with the name."""
    from meshplan.runtime._zygote import _worker_path

    # this process is the zygote here: test modules that other tests imported from this
    # folder (test_mpi imports test_comm) would be rightly refused first
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "")
    monkeypatch.setattr(sys, "path", [p for p in sys.path
                                      if not os.path.join(os.path.abspath(p), "").startswith(here)])
    for name, module in list(sys.modules.items()):
        if (getattr(module, "__file__", None) or "").startswith(here):
            monkeypatch.delitem(sys.modules, name)

    extra = tmp_path / "extra"
    extra.mkdir()
    path = _worker_path({"PYTHONPATH": "extra"}, str(tmp_path))
    assert isinstance(path, list) and path[:2] == [str(tmp_path), str(extra)]
    (tmp_path / "json.py").write_text("")
    why = _worker_path({}, str(tmp_path))
    assert isinstance(why, str) and "import json from another place" in why


@pytest.mark.timeout(60)
def test_four_workers_ping_and_a_forgotten_group_is_reaped(plugin_env, tmp_path) -> None:
    workers = LocalLauncher().launch(4, env=plugin_env, cwd=tmp_path)
    _ping_and_info(workers, 4, tmp_path)
    pids = workers.pids
    del workers                 # no shutdown(): the weakref finalizer stops them
    gc.collect()
    assert not _wait_gone(pids, 5)


@pytest.mark.timeout(60)
def test_handler_error_reaches_controller_with_rank_traceback_and_where(plugin_env) -> None:
    workers = LocalLauncher().launch(2, env=plugin_env)
    workers.broadcast("boom", {"rank": 1})
    with pytest.raises(WorkerFailure) as info:
        workers.gather("boom", timeout_s=30)
    err = info.value
    assert isinstance(err, RuntimeFailure)
    assert err.reason == "error" and err.rank == 1 and err.where == "train.py:42"
    assert err.remote_type == "ValueError" and "mp_test_handlers.py" in err.remote_traceback
    text = str(err)
    assert "rank 1" in text and "bad thing on purpose" in text and "at train.py:42" in text
    assert "Traceback (most recent call last)" in text and "all 2 workers were stopped" in text
    assert workers.closed and not _wait_gone(workers.pids, 0)


@pytest.mark.timeout(60)
def test_exiting_worker_is_named_quickly_with_its_stderr(plugin_env, tmp_path) -> None:
    workers = LocalLauncher(log_dir=tmp_path / "logs").launch(2, env=plugin_env)
    workers.broadcast("die", {"rank": 1})
    t0 = time.monotonic()
    with pytest.raises(WorkerFailure) as info:
        workers.gather("die")                   # no timeout: the exit alone must end the wait
    assert time.monotonic() - t0 < 5
    err = info.value
    assert err.reason == "exit" and err.rank == 1 and err.exit_code == 3
    assert "rank 1 exited with code 3" in str(err) and "about to die" in str(err)
    assert not _wait_gone(workers.pids, 0)


@pytest.mark.timeout(60)
def test_hanging_worker_times_out_by_name(plugin_env) -> None:
    workers = LocalLauncher().launch(2, env=plugin_env)
    workers.broadcast("hang", {"rank": 1})
    t0 = time.monotonic()
    with pytest.raises(WorkerFailure) as info:
        workers.gather("hang", timeout_s=1.5)
    assert 1.5 <= time.monotonic() - t0 < 6
    assert info.value.reason == "timeout" and info.value.ranks == (1,)
    assert "rank 1 did not answer 'hang' within 1.5 s" in str(info.value)
    assert "rank 1: waiting (sleeping)" in str(info.value)
    assert not _wait_gone(workers.pids, 0)


@pytest.mark.timeout(60)
def test_a_stopped_rank_is_named_as_stopped_before_the_timeout(plugin_env, monkeypatch) -> None:
    """Issue 19, point 7: a rank stopped with SIGSTOP while the controller waits is named as
    the cause (not "ranks 0, 1 did not answer" after the whole timeout)."""
    from meshplan.runtime import _launch

    monkeypatch.setattr(_launch, "STOPPED_S", 1.0)
    workers = LocalLauncher().launch(2, env=plugin_env)
    workers.broadcast("hang", {"rank": 1})
    os.kill(workers.pids[1], signal.SIGSTOP)
    with pytest.raises(WorkerFailure) as info:
        workers.gather("hang", timeout_s=50)
    assert info.value.reason == "stopped" and info.value.ranks == (1,), info.value
    assert "rank 1 is stopped (state T" in str(info.value)
    assert not _wait_gone(workers.pids, 0)


@pytest.mark.timeout(60)
def test_bad_plugin_fails_the_launch(plugin_env) -> None:
    env = dict(plugin_env, MESHPLAN_WORKER_PLUGINS="mp_no_such_module")
    with pytest.raises(WorkerFailure, match="failed in 'hello': ModuleNotFoundError"):
        LocalLauncher().launch(1, env=env)


CONTROLLER = '''
import sys, threading, time
from meshplan.runtime import LocalLauncher

box = {}
def go():
    box["w"] = LocalLauncher().launch(int(sys.argv[2]))
if sys.argv[1] == "thread":
    t = threading.Thread(target=go)
    t.start()
    t.join()
    time.sleep(0.5)           # workers must outlive the thread that launched them
else:
    go()
w = box["w"]
w.broadcast("ping")
w.gather("ping", timeout_s=30)
print(*w.pids, flush=True)
time.sleep(600)
'''


@pytest.mark.timeout(60)
@pytest.mark.parametrize("launched_from, n", [("main", 2), ("thread", 1)])
def test_workers_die_with_a_killed_controller(launched_from: str, n: int, tmp_path: Path) -> None:
    """From the main thread both guards apply (PR_SET_PDEATHSIG and the stdin pipe); from a
    thread only the stdin pipe does (one worker is enough to check that guard on its own)."""
    script = tmp_path / "controller.py"
    script.write_text(textwrap.dedent(CONTROLLER))
    ctrl = subprocess.Popen([sys.executable, str(script), launched_from, str(n)],
                            stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        line = ctrl.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == n and all(_alive(p) for p in pids), line
        os.kill(ctrl.pid, signal.SIGKILL)
        ctrl.wait(10)
        assert not _wait_gone(pids, 10)
    finally:
        ctrl.kill()
        ctrl.wait()
        ctrl.stdout.close()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_handler_failures_become_error_replies_in_process() -> None:
    """The worker keeps serving after a handler raises: `handle` returns an error reply."""
    state = WorkerState(rank=3, world_size=4, run_id="r")

    def bad(state, header, tensors):
        exc = KeyError("k")
        exc.meshplan_where = "user.py:7"
        raise exc

    _worker._HANDLERS["t-bad"] = bad
    try:
        kind, header, tensors = _worker.handle(state, Message("t-bad", {}, ()))
        assert kind == "error" and header["type"] == "KeyError" and header["where"] == "user.py:7"
        assert header["kind"] == "t-bad" and "Traceback" in header["traceback"] and tensors == []
        kind, header, _ = _worker.handle(state, Message("t-unknown", {}, ()))
        assert kind == "error" and "no handler for 't-unknown'" in header["message"]
        assert _worker.handle(state, Message("ping", {"a": 1}, ()))[:2] == ("ping", {"a": 1, "rank": 3})
        with pytest.raises(ValueError, match="already registered"):
            register("ping")(bad)
    finally:
        del _worker._HANDLERS["t-bad"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_workers_keep_freed_memory_unless_told_not_to() -> None:
    """A worker tells glibc to keep freed blocks (no page faults re-touching the same buffers
    each step); ``MESHPLAN_MALLOC=default`` leaves glibc's policy. Checked in fresh processes:
    a "step" that holds four 12 MiB buffers at once and frees them faults no pages again once
    the worker's setting is made. (Under glibc's default it faulted all ~123,000 of them in
    most runs here, when the freed heap top exceeded the trim threshold, but not in all: the
    default's thresholds move with the process's history, so that side is not asserted.)"""
    probe = textwrap.dedent('''
        import resource, torch
        from meshplan.runtime._worker import keep_freed_memory
        kept = keep_freed_memory()
        def step():
            bufs = [torch.ones(3 << 20) for _ in range(4)]
            del bufs
        for _ in range(3):
            step()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(10):
            step()
        print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    ''')
    out = {}
    for mode in ("keep", "default"):
        env = {**os.environ, "MESHPLAN_MALLOC": mode}
        res = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        kept, faults = res.stdout.split()
        out[mode] = (kept == "True", int(faults))
    assert out["keep"][0] and not out["default"][0]
    assert out["keep"][1] < 1000, out            # of 10 x 4 x 3072 pages touched


def _listening(port: int) -> set[str]:
    """The local addresses with a TCP socket listening on ``port`` (from /proc/net/tcp*)."""
    out = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            addr, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:       # 0A: LISTEN
                raw = bytes.fromhex(addr)
                out.add(".".join(str(b) for b in raw[::-1]) if width == 8 else raw.hex())
    return out


@pytest.mark.timeout(60)
def test_the_rendezvous_store_listens_where_the_ranks_are_under_a_secret_prefix() -> None:
    """Issue 19, point 2: the controller serves the torch.distributed store from a socket it
    bound itself (no bind-close-reuse race), on loopback only (torch's own listens on every
    interface), and the run's keys live under a prefix only the secret's holders know."""
    from datetime import timedelta

    import torch.distributed as dist
    from meshplan.runtime._channel import Secret, store_prefix
    from meshplan.runtime._launch import RendezvousStore

    store = RendezvousStore("127.0.0.1")
    try:
        assert _listening(store.port) == {"127.0.0.1"}
        secret = Secret.new()
        client = dist.TCPStore("127.0.0.1", store.port, None, False, timedelta(seconds=5))
        dist.PrefixStore(store_prefix(secret), client).set("rank0", "addr")
        assert dist.PrefixStore(store_prefix(secret), client).get("rank0") == b"addr"
        other = dist.PrefixStore(store_prefix(Secret.new()), client)
        other.set_timeout(timedelta(seconds=0.5))
        with pytest.raises(Exception, match="(?i)timeout|wait"):
            other.get("rank0")                       # another run's prefix: not there
        assert not store_prefix(secret).startswith(store_prefix(Secret.new()))
    finally:
        store.close()
    assert _listening(store.port) == set()
