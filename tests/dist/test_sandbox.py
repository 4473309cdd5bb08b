"""``meshplan sandbox`` (``runtime/_sandbox.py``): hosts on this machine as Linux namespaces.

What a multi-host test needs from them, checked for real: each host has its own hostname, its
own ``/dev/shm`` and ``/tmp``, an address on a bridge that only the sandbox sees, and reaches
the others by name; ``mpiexec -hosts`` started by ``sandbox run`` puts ranks on the hosts
(MPICH's launcher is the sandbox's ``ssh`` stand-in); ``down`` leaves nothing running, and a
sandbox whose owner is killed takes itself down. Needs root and namespaces (as CI runs);
skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from meshplan._errors import RuntimeFailure
from meshplan.cli import main
from meshplan.runtime._sandbox import ROOT, Sandbox


def _why_not() -> str | None:
    try:
        Sandbox.check()
    except RuntimeFailure as exc:
        return str(exc)
    return None


_REASON = _why_not()
needs_namespaces = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def _name(tag: str) -> str:
    return f"t{tag}{os.getpid() % 100000}"


@pytest.fixture
def box():
    b = Sandbox.up(2, _name("a"), owner=os.getpid())
    try:
        yield b
    finally:
        b.down()


def _out(b: Sandbox, cmd: list[str], host: str | None = None, timeout: float = 60,
         **kwargs) -> str:
    done = b.run(cmd, host=host, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _gone(pids: list[int], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(os.path.exists(f"/proc/{p}") and _not_zombie(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def _not_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@needs_namespaces
def test_hosts_are_separate_and_reach_each_other_by_name(box, tmp_path) -> None:
    h0, h1 = (h.name for h in box.hosts)
    assert _out(box, ["hostname"]) == box.ctl.name
    assert [_out(box, ["hostname"], h) for h in (h0, h1)] == [h0, h1]
    # its own /dev/shm and /tmp: a file made on h0 is not on h1 nor on the machine
    mark = f"meshplan-sandbox-{os.getpid()}"
    _out(box, ["sh", "-c", f"touch /dev/shm/{mark} /tmp/{mark}"], h0)
    assert _out(box, ["sh", "-c", f"ls /dev/shm/{mark} /tmp/{mark} 2>/dev/null | wc -l"],
                h1) == "0"
    assert not os.path.exists(f"/dev/shm/{mark}") and not os.path.exists(f"/tmp/{mark}")
    # the code is shared (as a cluster's home): the working directory is the same path
    assert _out(box, ["pwd"], h1) == os.getcwd()
    # TCP from h0 to h1 by name, over the sandbox's bridge
    server = subprocess.Popen(box.argv([sys.executable, "-c", (
        "import socket; s = socket.create_server(('0.0.0.0', 7781)); print('up', flush=True); "
        "c, a = s.accept(); c.sendall(socket.gethostname().encode() + b' ' + a[0].encode())")],
        h1), stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "up"
        got = _out(box, [sys.executable, "-c", (
            f"import socket; c = socket.create_connection(('{h1}', 7781), timeout=10); "
            "print(c.recv(100).decode())")], h0)
    finally:
        server.kill()
        server.wait()
    assert got == f"{h1} {box.hosts[0].address}"
    # the sandbox's addresses exist only inside it
    mine = subprocess.run(["ip", "-br", "addr"], capture_output=True, text=True).stdout
    assert "10.213." not in mine


@needs_namespaces
@pytest.mark.skipif(shutil.which("mpiexec", path=os.path.dirname(sys.executable)) is None,
                    reason="needs MPICH's mpiexec beside this Python (pip install mpich)")
def test_mpiexec_from_the_controller_runs_ranks_on_the_hosts(box) -> None:
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    hosts = _out(box, ["sh", "-c", "echo $MESHPLAN_HOSTS"])
    assert hosts == ",".join(h.name for h in box.hosts)
    out = _out(box, [mpiexec, "-hosts", hosts, "-n", "2", sys.executable, "-c", (
        "from mpi4py import MPI; import socket; c = MPI.COMM_WORLD; "
        "got = c.gather((socket.gethostname(), c.allreduce(c.rank + 1))); "
        "c.rank or print(got, flush=True)")])
    assert out == str([(box.hosts[0].name, 3), (box.hosts[1].name, 3)])


@needs_namespaces
def test_down_stops_what_runs_on_the_hosts() -> None:
    b = Sandbox.up(1, _name("b"))
    sleeper = subprocess.Popen(b.argv(["sleep", "300"], b.hosts[0].name))
    time.sleep(0.2)
    holders = [b.hosts[0].pid, b.ctl.pid, b.switch_pid]
    b.down()
    assert sleeper.wait(10) == -signal.SIGKILL
    assert _gone(holders, 5.0) and not (ROOT / b.name).exists()
    b.down()                                            # twice is fine
    with pytest.raises(RuntimeFailure, match="no sandbox named"):
        Sandbox.open(b.name)
    # the hint for a sandbox host name used outside the sandbox
    from meshplan.runtime._mpi_launch import controller_address

    c = Sandbox.up(1, _name("d"))
    try:
        with pytest.raises(RuntimeFailure, match=f"is a host of the sandbox '{c.name}'"):
            controller_address([c.hosts[0].name])
    finally:
        c.down()


@needs_namespaces
def test_a_killed_owner_takes_its_sandbox_down() -> None:
    """The fixture's guarantee after a crash: the holders watch their owner."""
    name = _name("c")
    code = ("import os, sys, time; sys.path[:0] = %r; "
            "from meshplan.runtime._sandbox import Sandbox; "
            "b = Sandbox.up(1, %r, owner=os.getpid()); "
            "print(b.hosts[0].pid, b.ctl.pid, b.switch_pid, flush=True); time.sleep(300)"
            % (sys.path, name))
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in owner.stdout.readline().split()]
    assert len(pids) == 3 and Sandbox.open(name).alive()
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    assert _gone(pids, 5.0)
    again = Sandbox.up(1, name)             # the stale state is cleared on the next `up`
    again.down()


def test_cli_bad_input(capsys) -> None:
    assert main(["sandbox", "run", "--name", "Bad", "--", "true"]) == 1
    assert "sandbox name 'Bad'" in capsys.readouterr().err
    assert main(["sandbox", "status", "--name", "nosuchbox"]) == 1
    assert "no sandbox named 'nosuchbox' is up" in capsys.readouterr().err
    assert main(["sandbox", "down", "--name", "nosuchbox"]) == 0      # cleanup is idempotent
    assert "nothing to do" in capsys.readouterr().out
    assert main(["sandbox", "up", "--hosts", "2", "--cpus", "2"]) == 1
    assert "--cpus sets the Slurm nodes' CPUs; add --slurm" in capsys.readouterr().err


@needs_namespaces
def test_slurm_without_its_daemons_is_one_error(monkeypatch) -> None:
    import meshplan.runtime._sandbox as sandbox

    monkeypatch.setattr(sandbox, "_which", lambda tool: None)
    with pytest.raises(RuntimeFailure, match="--slurm needs munged, slurmctld, slurmd, srun.*"
                       "apt-get install slurmctld slurmd slurm-client munge"):
        Sandbox.up(2, _name("x"), owner=os.getpid(), slurm=True)
    assert not (ROOT / _name("x")).exists()                 # nothing was made


def _a_kill(rank: int, work: str) -> tuple[list[dict], dict[str, str]]:
    """``rank`` SIGKILLed mid-backward in step 1 (``_faults.py``, fired once: its marker in
    ``work``, which every host sees): the faults and the environment that loads the plugin."""
    faults = [{"rank": rank, "step": 1, "at": "backward", "how": "kill",
               "marker": os.path.join(work, "fired")}]
    return faults, dict(os.environ, MESHPLAN_WORKER_PLUGINS="_faults", PYTHONPATH=os.pathsep.join(
        filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])))


@needs_namespaces
@pytest.mark.timeout(240)
@pytest.mark.skipif(shutil.which("mpiexec", path=os.path.dirname(sys.executable)) is None,
                    reason="needs MPICH's mpiexec beside this Python (pip install mpich)")
def test_gpt_on_two_hosts_under_mpi_equals_one_process_through_a_killed_rank(box) -> None:
    """The controller on NAME-ctl, ranks 0-1 on h0 and 2-3 on h1 (``hosts=None`` reads
    ``$MESHPLAN_HOSTS``): the control channel is TCP with CURVE over the sandbox's bridge, the
    plan goes through the files chain, MPI runs between hosts. Telemetry lives on /var/tmp,
    which the hosts share (their /tmp is their own).

    With ``fault_tolerance=True``, rank 2 (on h1) is killed mid-backward in step 1 (the
    failure names it, from mpiexec's report): mpiexec ends every rank, the snapshots outlive them in a keeper on each host (``_keepers.py``),
    and the restarted ranks go on from them. The run still equals one process: a lost or
    repeated step, or a rank restored to another step's state, is off by an optimizer step,
    far more than the tolerance. (Bit for bit against the same run without a fault:
    ``test_faults.py`` under mpiexec on one host.) Nothing stays running, keepers included."""
    import json

    work = tempfile.mkdtemp(prefix="meshplan-mh-", dir="/var/tmp")
    faults, env = _a_kill(2, work)
    try:
        job = Path(__file__).with_name("_multihost_job.py")
        out = _out(box, [sys.executable, str(job), json.dumps({"dp": 2, "tp": 2}), "auto",
                         os.path.join(work, "t.duckdb"), "3", "mpi",
                         json.dumps({"distribute": {"fault_tolerance": True},
                                     "faults": faults})], env=env)
        assert os.path.exists(faults[0]["marker"]), "the fault did not fire"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    r = json.loads(out.splitlines()[-1])
    h0, h1 = (h.name for h in box.hosts)
    assert r["controller"] == box.ctl.name
    assert r["hosts"] == [h0, h0, h1, h1], r     # consecutive ranks (the tp groups) share a host
    assert r["restarts"] == 1 and r["keeper_hosts"] == [h0, h1]
    # hydra's report (pid and host) names the killed rank, though it ran on another host
    # than the controller, where no pidfd could see which rank ended first
    assert r["failed"] == [[2, "exit"]]
    # dp x tp splits the batch and the matmuls: float32 sums in another order than one
    # process (tests/dist/test_distribute.py's tolerances); a wrong plan is off by far more
    assert r["got"] == pytest.approx(r["want"], rel=1e-5)
    assert r["param_diff"] < 3e-5
    assert _gone(r["pids"], 10.0), "a rank or keeper outlived the run"


@needs_namespaces
@pytest.mark.timeout(240)
def test_gpt_on_two_pods_on_two_hosts_equals_one_process(box, monkeypatch) -> None:
    """``launcher="k8s"`` across hosts: the stand-in API server (``_k8s_standin.py``) serves
    on NAME-ctl and its kubelet starts pod 0 on h0 and pod 1 on h1; the controller, on
    NAME-ctl, reaches it over the bridge, and the pods' ranks reach the controller (TCP with
    CURVE, heartbeats: another host) and each other (gloo between hosts, shared memory inside
    a pod). Equal to one process; the Job and its pods are gone at the end.

    With ``fault_tolerance=True``: each pod runs its agent (``_k8s_agent.py``), which keeps
    its ranks' snapshots (copied to the other pod's agent, across hosts) and starts them.
    Rank 2 (pod 1, on h1) is killed mid-backward in step 1; its agent starts it again from
    its snapshot and the run still equals one process (a lost or repeated step is off by far
    more than the tolerance; bit for bit against the fault-free run: test_k8s_launch.py).
    Nothing stays running, agents included."""
    import json

    pytest.importorskip("kubernetes", reason="pip install 'meshplan[k8s]'")
    work = tempfile.mkdtemp(prefix="meshplan-k8s-", dir="/var/tmp")
    faults, env = _a_kill(2, work)
    here = Path(__file__).parent
    # the pods' environment is the stand-in's (its kubelet's): the fault plan goes there
    server = subprocess.Popen(box.argv([sys.executable, str(here / "_k8s_standin.py"),
                                        box.name, work]),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=dict(env, MESHPLAN_TEST_FAULTS=json.dumps(faults)))
    try:
        kubeconfig = server.stdout.readline().strip()
        assert kubeconfig, "the stand-in did not start"
        monkeypatch.setenv("KUBECONFIG", kubeconfig)
        out = _out(box, [sys.executable, str(here / "_multihost_job.py"),
                         json.dumps({"dp": 2, "tp": 2}), "auto", os.path.join(work, "t.duckdb"),
                         "3", "k8s", json.dumps({"image": "registry.example/train:1",
                                                 "pods": 2, "distribute": {
                                                     "fault_tolerance": True}})],
                   env=dict(env, KUBECONFIG=kubeconfig))
        assert os.path.exists(faults[0]["marker"]), "the fault did not fire"
        left = _out(box, ["kubectl", "--kubeconfig", kubeconfig, "get", "jobs,pods", "-n", "default",
                          "-o", "name"]) if shutil.which("kubectl") else ""
    finally:
        server.stdin.close()
        server.wait(30)
        shutil.rmtree(work, ignore_errors=True)
    r = json.loads(out.splitlines()[-1])
    h0, h1 = (h.name for h in box.hosts)
    assert r["controller"] == box.ctl.name
    assert r["hosts"] == [h0, h0, h1, h1]          # pod 0 (ranks 0-1) on h0, pod 1 on h1
    assert r["restarts"] == 1 and r["keeper_hosts"] == ["pod0", "pod1"]
    # the survivors stay up (only rank 2 starts again): each records the step it could not
    # finish, its collective's peer gone, as under the local launcher
    assert [f for f in r["failed"] if f[1] != "error"] == [[2, "exit"]], r["failed"]
    assert r["got"] == pytest.approx(r["want"], rel=1e-5)      # as under mpi
    assert r["param_diff"] < 3e-5
    assert left == ""
    assert _gone(r["pids"], 10.0), "a rank or agent outlived the run"


@needs_namespaces
@pytest.mark.timeout(180)
@pytest.mark.skipif(shutil.which("mpiexec", path=os.path.dirname(sys.executable)) is None,
                    reason="needs MPICH's mpiexec beside this Python (pip install mpich)")
def test_transfer_by_tcp_between_meshes_on_two_hosts(box) -> None:
    """``meshplan.transfer(method="tcp")`` between an FSDP mesh on h0 and a Megatron-style
    mesh on h1, each its own mpiexec world: every destination rank reads its regions from the
    source ranks over the sandbox's network (not loopback, not MPI), bit for bit."""
    out = _out(box, [sys.executable, str(Path(__file__).with_name("_multihost_job.py")),
                     "transfer"], timeout=150)
    r = json.loads(out.splitlines()[-1])
    h0, h1 = (h.name for h in box.hosts)
    assert r["hosts"] == [[h0, h0], [h1, h1]], r
    assert r["method"] == "tcp" and r["controller_bytes"] == 0 and r["nbytes"] > 0, r
    assert r["changed"] and r["equal"], r


def _in_netns(holder: int) -> list[str]:
    """The processes in the network namespace ``holder`` holds, the holder aside."""
    st = os.stat(f"/proc/{holder}/ns/net")
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == holder:
            continue
        try:
            mine = os.stat(f"/proc/{pid}/ns/net")
            if (mine.st_dev, mine.st_ino) == (st.st_dev, st.st_ino) and _not_zombie(int(pid)):
                found.append(Path(f"/proc/{pid}/comm").read_text().strip())
        except OSError:
            continue
    return found


@needs_namespaces
@pytest.mark.timeout(240)
@pytest.mark.skipif(shutil.which("mpiexec", path=os.path.dirname(sys.executable)) is None,
                    reason="needs MPICH's mpiexec beside this Python (pip install mpich)")
def test_a_host_that_loses_its_network_is_named_and_nothing_stays_running(box) -> None:
    """h1's link goes down between two steps: the next step fails within
    ``$MESHPLAN_LOST_AFTER_S`` (5 s here) plus a beat, naming h1, not at the 120 s timeout;
    h1's ranks, which cannot hear from the controller any more, end by themselves, their
    hydra proxy with them."""
    _cut_a_host(box, "mpi")


@needs_namespaces
@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("mpiexec", path=os.path.dirname(sys.executable)) is None,
                    reason="needs MPICH's mpiexec beside this Python (pip install mpich)")
def test_lost_hosts_move_to_a_spare_then_the_mesh_shrinks() -> None:
    """``fault_tolerance=True, elastic=True``, FSDP on dp4 with ``hosts=h0:2,h1:2,h2:2``: h2
    is a spare. A host's snapshots went with it, but every snapshot of its ranks was also
    copied to the next host's keeper (``_snapshot.Replica``), so the controller reads the
    whole state from the hosts left.

    - h1's link goes down before step 2: the same mesh and plan start again on h0 and h2 (h1's
      snapshots from their copies on h0), and the first four steps and the state after them
      equal the same run on h0 and h1 without a fault, with no tolerance at all (the same
      plan on the same mesh: every sum in the same order).
    - h2's link goes down before step 4: no spare is left, so the mesh shrinks to dp2 on h0
      (h2's snapshots from their copies on h0), and after six steps the run equals one
      process (FSDP sums in another order: ``test_gpt_on_two_hosts...``'s tolerance; a step
      lost, repeated, or restored from another step's state is off by far more).

    Nothing is left running on h0 after."""
    _lose_two_hosts("mpi")


@needs_namespaces
@pytest.mark.timeout(240)
@pytest.mark.skipif(shutil.which("mpiexec", path=os.path.dirname(sys.executable)) is None,
                    reason="needs MPICH's mpiexec beside this Python (pip install mpich)")
def test_the_one_host_of_ranks_is_lost_and_a_spare_takes_it_over(box) -> None:
    """Every rank on h0, h1 a spare (``hosts=h0:4,h1:4``, FSDP on dp4): h0 is the one host
    of keepers, so the controller holds the copies of its ranks' snapshots. h0's link goes
    down before step 2; the mesh starts again on h1 from those copies, and the four steps and
    the state after them equal the same run on h0 without a fault (the same plan on the same
    mesh: every sum in the same order)."""
    h0, h1 = box.hosts
    r = _job_with_a_cut(box, h0, ["lose-only-host"], [], 200)
    assert r["after"]["hosts"] == [h1.name] * 4 and r["after"]["restarts"] >= 1, r
    assert r["equal"], r


def _lose_two_hosts(launcher: str) -> None:
    import json

    b = Sandbox.up(3, _name("p" if launcher == "mpi" else "q"), owner=os.getpid(),
                   **({"slurm": True, "cpus": 2} if launcher == "slurm" else {}))
    work = tempfile.mkdtemp(prefix="meshplan-lose-", dir="/var/tmp")
    try:
        h0, h1, h2 = b.hosts
        result = os.path.join(work, "result.json")
        job = Path(__file__).with_name("_multihost_job.py")
        proc = subprocess.Popen(b.argv(["env", "MESHPLAN_LOST_AFTER_S=5", sys.executable,
                                        str(job), "lose", result, launcher]),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            for host in (h1, h2):
                # (mpiexec writes on the same stdout: hydra's lines on the ranks it ended)
                while (line := proc.stdout.readline()) and line.strip() != "cut-now":
                    pass
                assert line, "the job ended before it asked for a cut"
                subprocess.run(["nsenter", "--target", str(host.pid), "--net", "--", "ip",
                                "link", "set", "eth0", "down"], check=True)
                proc.stdin.write("go\n")
                proc.stdin.flush()
            assert proc.wait(240) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
        with open(result) as f:
            r = json.load(f)
        moved, shrunk = r["after"][1], r["after"][2]
        # (a start of the moved mesh that fails is tried again, as any failure in a
        # recovery: seen once in five runs here, mpiexec ending at once on the new hosts)
        assert moved["mesh"] == {"dp": 4} and moved["restarts"] >= 1, r
        assert moved["hosts"] == [h0.name, h0.name, h2.name, h2.name], r
        assert r["equal_first_four"], r
        assert shrunk == {"mesh": {"dp": 2}, "restarts": moved["restarts"] + 1,
                          "hosts": [h0.name, h0.name]}, r
        assert r["got"] == pytest.approx(r["one"], rel=1e-5)
        assert r["param_diff"] < 3e-5
        def left() -> list[str]:       # the run is over: no rank, keeper or proxy left
            return [c for c in _in_netns(h0.pid) if not c.startswith("slurm")]  # but slurmd

        deadline = time.monotonic() + 10
        while left() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left() == []
    finally:
        shutil.rmtree(work, ignore_errors=True)
        b.down()


def _job_with_a_cut(box: Sandbox, host, mode: list[str], more: list[str],  # noqa: ANN001
                    wait_s: float, ready=lambda: True) -> dict:  # noqa: ANN001
    """``_multihost_job.py MODE RESULT MORE`` on the controller host, rank hosts counted lost
    after 5 s without a word: when it prints ``cut-now`` (and ``ready()``), ``host``'s link
    goes down and the job is told to go on; what it wrote to RESULT (JSON)."""
    import json

    work = tempfile.mkdtemp(prefix="meshplan-cut-", dir="/var/tmp")
    result = os.path.join(work, "result.json")
    job = Path(__file__).with_name("_multihost_job.py")
    proc = subprocess.Popen(box.argv(["env", "MESHPLAN_LOST_AFTER_S=5", sys.executable,
                                      str(job), *mode, result, *more]),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        while (line := proc.stdout.readline()) and line.strip() != "cut-now":
            pass
        assert line, "the job ended before it asked for a cut"
        assert ready()
        subprocess.run(["nsenter", "--target", str(host.pid), "--net", "--", "ip", "link",
                        "set", "eth0", "down"], check=True)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.wait(wait_s) == 0
        with open(result) as f:
            return json.load(f)
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(work, ignore_errors=True)


def _cut_a_host(box: Sandbox, launcher: str) -> None:
    h1 = box.hosts[1]
    r = _job_with_a_cut(box, h1, ["cut"], [launcher], 120,
                        lambda: "python" in _in_netns(h1.pid))       # h1's ranks run
    assert r["type"] == "WorkerFailure" and r["reason"] == "lost", r
    assert r["hosts"] == [h1.name] and f"lost host {h1.name} (ranks 2, 3)" in r["message"]
    assert 5 <= r["after_s"] < 30
    deadline = time.monotonic() + 20        # they hear nothing for 5 s, then exit

    def left() -> list[str]:       # but the node's slurmd (and a slurmstepd, whose job
        return [c for c in _in_netns(h1.pid)   # Slurm still counts as completing there)
                if not c.startswith("slurm")]

    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left() == []


@needs_namespaces
@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("mpiexec", path=os.path.dirname(sys.executable)) is None,
                    reason="needs MPICH's mpiexec beside this Python (pip install mpich)")
def test_an_unreachable_host_is_one_error_naming_it(box) -> None:
    import json

    work = tempfile.mkdtemp(prefix="meshplan-ur-", dir="/var/tmp")
    try:
        result = os.path.join(work, "result.json")
        job = Path(__file__).with_name("_multihost_job.py")
        box.run([sys.executable, str(job), "unreachable", result], timeout=100,
                capture_output=True)
        with open(result) as f:
            r = json.load(f)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert r["type"] == "WorkerFailure", r
    assert "mpiexec ended" in r["message"] and "10.213.0.99 (1 rank)" in r["message"]
    assert f"{box.name}: no host 10.213.0.99" in r["message"], r["message"]   # its own words
    deadline = time.monotonic() + 15          # h0's hydra proxy ends once mpiexec has
    while _in_netns(box.hosts[0].pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _in_netns(box.hosts[0].pid) == []                     # nothing left on h0


@needs_namespaces
@pytest.mark.timeout(180)
@pytest.mark.skipif(shutil.which("mpiexec", path=os.path.dirname(sys.executable)) is None,
                    reason="needs MPICH's mpiexec beside this Python (pip install mpich)")
def test_files_push_reaches_three_hosts() -> None:
    """``meshplan files push --launcher mpi`` from the controller's host: one rank per host
    (``$MESHPLAN_HOSTS``), each host's copy in its own /tmp, byte for byte the source."""
    import hashlib
    import json

    b = Sandbox.up(3, _name("f"), owner=os.getpid())
    work = tempfile.mkdtemp(prefix="meshplan-fp-", dir="/var/tmp")
    try:
        src = Path(work, "src")
        (src / "sub").mkdir(parents=True)
        (src / "a.bin").write_bytes(os.urandom(3 << 20))
        (src / "sub" / "b.txt").write_text("hello\n")
        meshplan = os.path.join(os.path.dirname(sys.executable), "meshplan")
        done = b.run([meshplan, "files", "push", str(src), "--dest", "/tmp/got/{host}",
                      "--ranks", "3", "--launcher", "mpi", "--json"],
                     capture_output=True, text=True, timeout=150)
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout)
        want = hashlib.sha256((src / "a.bin").read_bytes()).hexdigest()
        for h in b.hosts:
            got = _out(b, ["sh", "-c", f"sha256sum /tmp/got/{h.name}/a.bin; "
                                       f"cat /tmp/got/{h.name}/sub/b.txt"], h.name)
            assert got.split() == [want, f"/tmp/got/{h.name}/a.bin", "hello"]
        assert not os.path.exists("/tmp/got")            # not on this machine's own /tmp
        assert result["bytes"] == (3 << 20) + 6
    finally:
        b.down()
        shutil.rmtree(work, ignore_errors=True)


# ---- Slurm: `sandbox up --slurm` and launcher="slurm" ------------------------------------------

def _why_no_slurm() -> str | None:
    try:
        Sandbox.check(slurm=True)
    except RuntimeFailure as exc:
        return str(exc)
    return None


_NO_SLURM = _why_no_slurm()
needs_slurm = pytest.mark.skipif(_NO_SLURM is not None, reason=_NO_SLURM or "")


@pytest.fixture(scope="module")
def cluster():
    """Two hosts with a real slurmctld (on NAME-ctl) and a slurmd each, 2 CPUs per node."""
    b = Sandbox.up(2, _name("s"), owner=os.getpid(), slurm=True, cpus=2)
    try:
        yield b
    finally:
        b.down()


@needs_namespaces
@needs_slurm
@pytest.mark.timeout(300)
def test_lost_slurm_nodes_move_to_a_spare_then_the_mesh_shrinks() -> None:
    """As under mpi (``test_lost_hosts_move_to_a_spare...``), with ``slurm={"nodes": 2, "spare_nodes": 1}``: the launcher asks
    Slurm for three nodes (``--no-kill``: the job outlives a node failing), srun names the
    two the ranks use, and a lost node is taken out of the ones srun may use; the third node
    takes its ranks, then the mesh shrinks onto the one node left."""
    _lose_two_hosts("slurm")


def _job(b: Sandbox, *args: str, timeout: float = 150, salloc: list[str] | None = None,
         env: list[str] = ()) -> dict:
    """Run ``_multihost_job.py ARGS... RESULT`` as the controller (under ``salloc`` when
    given); the JSON it wrote to RESULT."""
    import json

    work = tempfile.mkdtemp(prefix="meshplan-sl-", dir="/var/tmp")
    try:
        result = os.path.join(work, "result.json")
        job = Path(__file__).with_name("_multihost_job.py")
        done = b.run(["env", *env, *(salloc or []), sys.executable, str(job), *args, result],
                     capture_output=True, text=True, timeout=timeout)
        assert os.path.exists(result), done.stderr[-3000:]
        with open(result) as f:
            return json.load(f)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _queue_empty(b: Sandbox, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _out(b, ["squeue", "-h"]) == "":
            return True
        time.sleep(0.2)
    return False


@needs_namespaces
@needs_slurm
@pytest.mark.timeout(240)
def test_gpt_on_two_slurm_nodes_equals_one_process_through_a_killed_rank(cluster) -> None:
    """Outside an allocation, ``slurm={"nodes": 2}``: salloc grants the two nodes, srun starts
    ranks 0-1 on h0 and 2-3 on h1, the losses and parameters match one process, and the
    allocation is given back at shutdown. The telemetry store is in the controller's own
    /tmp, which the nodes do not see: their segments reach it through the channel.

    With ``fault_tolerance=True``, rank 3 (on h1) is killed mid-backward in step 1: srun ends
    every rank; the run keeps its allocation, the snapshots outlive the ranks in a keeper per
    node (a step of its own, ``--overlap``), and the ranks started again on the same nodes go
    on from them (as under mpi: ``test_gpt_on_two_hosts...``)."""
    import json

    work = tempfile.mkdtemp(prefix="meshplan-sf-", dir="/var/tmp")
    faults, env = _a_kill(3, work)
    try:
        job = Path(__file__).with_name("_multihost_job.py")
        out = _out(cluster, [sys.executable, str(job), json.dumps({"dp": 2, "tp": 2}), "auto",
                             "/tmp/tel/t.duckdb", "3", "slurm", json.dumps({
                                 "nodes": 2, "distribute": {"fault_tolerance": True},
                                 "faults": faults})], env=env)
        assert os.path.exists(faults[0]["marker"]), "the fault did not fire"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert not os.path.exists("/tmp/tel/t.duckdb")        # the ctl host's /tmp, not ours
    r = json.loads(out.splitlines()[-1])
    h0, h1 = (h.name for h in cluster.hosts)
    assert r["controller"] == cluster.ctl.name
    assert r["hosts"] == [h0, h0, h1, h1]          # telemetry's ranks.host, as srun placed them
    assert r["restarts"] == 1 and r["keeper_hosts"] == [h0, h1]
    assert r["got"] == pytest.approx(r["want"], rel=1e-5)   # as under mpi (same tolerance)
    assert r["param_diff"] < 3e-5
    assert _queue_empty(cluster)


@needs_namespaces
@needs_slurm
@pytest.mark.timeout(180)
def test_in_an_allocation_a_killed_rank_is_named_with_its_node(cluster) -> None:
    """Inside ``salloc -N2 -n4`` the launcher uses that allocation; rank 3 killed between
    steps: one WorkerFailure naming rank 3, h1 and SIGKILL (srun's own report), not rank 0
    (srun ends every task at once)."""
    r = _job(cluster, "die", salloc=["salloc", "-N2", "-n4"])
    h0, h1 = (h.name for h in cluster.hosts)
    assert r["hostnames"] == [h0, h0, h1, h1]
    assert r["type"] == "WorkerFailure" and r["reason"] == "exit", r
    assert r["ranks"] == [3] and r["hosts"] == [h1] and r["exit_code"] == -9, r
    assert f"rank 3 (on {h1}) was killed by SIGKILL" in r["message"]
    assert r["after_s"] < 30
    assert _queue_empty(cluster)


@needs_namespaces
@needs_slurm
@pytest.mark.timeout(120)
def test_a_killed_controller_gives_its_allocation_back(cluster) -> None:
    """``kill -9`` of the controller: salloc's holding shell sees its stdin close and srun's
    tasks see theirs close, so the allocation ends and nothing runs on the nodes."""
    job = Path(__file__).with_name("_multihost_job.py")
    proc = subprocess.Popen(cluster.argv([sys.executable, str(job), "hold"]),
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().split()
        assert line[:1] == ["ready"], line
        assert _out(cluster, ["squeue", "-h", "-o", "%T"]) == "RUNNING"
        ctl = [p for p in _pids_in_netns(cluster.ctl.pid) if "_multihost_job" in _cmdline(p)]
        assert ctl
        for pid in ctl:
            os.kill(pid, signal.SIGKILL)
        assert _queue_empty(cluster, 15)

        def left() -> list[list[str]]:          # what runs on the nodes but their slurmd
            return [[c for c in _in_netns(h.pid) if c != "slurmd"] for h in cluster.hosts]

        deadline = time.monotonic() + 15
        while any(left()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left() == [[], []]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def _pids_in_netns(holder: int) -> list[int]:
    st = os.stat(f"/proc/{holder}/ns/net")
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            mine = os.stat(f"/proc/{pid}/ns/net")
        except OSError:
            continue
        if (mine.st_dev, mine.st_ino) == (st.st_dev, st.st_ino) and int(pid) != holder:
            out.append(int(pid))
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@needs_namespaces
@needs_slurm
@pytest.mark.timeout(240)
def test_a_slurm_node_that_loses_its_network_is_named() -> None:
    """As under mpi (above), with the ranks started by srun: the node is named within
    ``$MESHPLAN_LOST_AFTER_S`` and its ranks end by themselves. (Slurm itself keeps the job
    completing on the node it cannot reach, as on a cluster: its own sandbox, then.)"""
    b = Sandbox.up(2, _name("c"), owner=os.getpid(), slurm=True, cpus=2)
    try:
        _cut_a_host(b, "slurm")
    finally:
        b.down()


@needs_namespaces
@needs_slurm
@pytest.mark.timeout(120)
def test_slurm_requests_that_cannot_run_are_one_error_each(cluster) -> None:
    """More nodes than the partition has (Slurm would queue it for ever: the launcher reads
    squeue's reason and cancels it), and an allocation with fewer CPUs per node than ranks."""
    r = _job(cluster, "refused", '{"dp": 4}', '{"nodes": 4}')
    # slurmctld says PartitionConfig instead while its nodes have not registered yet (a
    # cluster just started: this test alone); either way the request can never run
    assert r["type"] == "RuntimeFailure" and ("PartitionNodeLimit" in r["message"]
                                              or "PartitionConfig" in r["message"]), r
    assert "it was cancelled" in r["message"] and r["after_s"] < 20
    assert _queue_empty(cluster)
    r = _job(cluster, "refused", '{"dp": 4}', "{}", salloc=["salloc", "-N2"])
    assert r["type"] == "RuntimeFailure", r
    assert "is too small for the mesh: 4 ranks over 2 nodes need 2 CPUs on each" in r["message"]
    assert _queue_empty(cluster)
