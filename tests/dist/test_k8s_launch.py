"""``launcher="k8s"`` end to end against the loopback stand-in API server and kubelet
(``_k8s_standin.py``; no real cluster can run here): the official ``kubernetes`` client makes
the Job, Service and Secret, watches the pods, streams their logs, deletes everything at
shutdown. Tolerances as ``test_mpi.py``: losses rel 1e-5, parameters 3e-5 (the mesh sums in
another order than one process).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

import meshplan
from meshplan.examples import gpt

pytest.importorskip("kubernetes", reason="pip install 'meshplan[k8s]'")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _k8s_standin import StandIn  # noqa: E402


@pytest.fixture
def cluster(monkeypatch):
    with StandIn(namespaces=("default", "ml")) as k:
        monkeypatch.setenv("KUBECONFIG", k.kubeconfig)
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield k
        deadline = time.monotonic() + 15
        while k.live() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert k.live() == {}, f"left in the cluster: {k.live()}"


@pytest.mark.timeout(240)
def test_gpt_on_two_pods_of_two_ranks_equals_one_process(cluster, capfd) -> None:
    torch.manual_seed(0)
    ex, ref = gpt.build(seed=0), gpt.build(seed=0)
    step = meshplan.distribute(ex.step, mesh={"dp": 2, "tp": 2}, launcher="k8s",
                               k8s={"image": "registry.example/train:1", "pods": 2,
                                    "namespace": "ml", "controller_host": "127.0.0.1"},
                               telemetry=False, timeout_s=120)
    got, want = [], []
    with step:
        for i in range(3):
            got.append(float(step(*ex.batch(i)).detach()))
            want.append(float(ref.step(*ref.batch(i)).detach()))
        kinds = {p: sorted(n) for p, n in cluster.live().items()}
        step.sync()
    assert got == pytest.approx(want, rel=1e-5)
    diff = max(float((p - q).abs().max().detach()) for p, q in zip(ex.model.parameters(),
                                                                   ref.model.parameters()))
    assert diff < 3e-5
    name = kinds["jobs"][0]
    assert kinds["services"] == [name] and kinds["secrets"] == [f"{name}-key"]
    assert len(kinds["pods"]) == 2
    assert any(m == "POST" and p.endswith("/namespaces/ml/jobs") for m, p in cluster.requests)


@pytest.mark.timeout(180)
def test_a_controller_outside_the_cluster_reaches_the_pods_through_port_forwards(
        cluster) -> None:
    """``reach="port-forward"`` (a controller on a laptop the pods cannot connect to): the
    controller listens on loopback only, each pod runs a relay, and every connection of every
    rank (its control channel, its rendezvous store) comes through a port-forward the
    controller opened (the stand-in's ``pods/portforward`` websocket); the GPT on 2 pods x 2
    ranks equals one process (``test_gpt_on_two_pods...``'s tolerance)."""
    ex, ref = gpt.build(seed=0), gpt.build(seed=0)
    step = meshplan.distribute(ex.step, mesh={"dp": 2, "tp": 2}, launcher="k8s",
                               k8s={"image": "img:1", "pods": 2, "reach": "port-forward",
                                    "relay_port": _free_port()},
                               telemetry=False, timeout_s=120)
    got, want = [], []
    with step:
        for i in range(2):
            got.append(float(step(*ex.batch(i)).detach()))
            want.append(float(ref.step(*ref.batch(i)).detach()))
        assert step._workers.channel.address.startswith("tcp://127.0.0.1:")
    assert got == pytest.approx(want, rel=1e-5)
    forwards = [p for m, p in cluster.requests if m == "PORTFORWARD"]
    # per pod its control stream, per rank at least its channel's and its store's streams
    assert len(forwards) >= 2 + 2 * 4, forwards


def _free_port() -> int:
    """A base port with the next one free too (the stand-in puts pod i's relay at +i)."""
    import socket
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            if port + 1 < 65536:
                return port
    raise RuntimeError("no two free ports")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("trouble, said", [
    ("unschedulable", "Pending (Unschedulable: 0/3 nodes are available"),
    ("image", "Pending (ErrImagePull: failed to pull image"),
    ("quota", "pod 1: not created"),
])
def test_pods_that_never_start_are_named_and_nothing_is_left(cluster, trouble, said) -> None:
    """The gang deadline: no node fits the pods, the image cannot be pulled, or a quota lets
    one pod of two be made; one error names the pods and why, and the Job (with its pods,
    Service, Secret) is gone."""
    from meshplan.runtime._k8s_launch import K8sLauncher

    cluster.unschedulable = trouble == "unschedulable"
    cluster.bad_images = {"img:1"} if trouble == "image" else set()
    cluster.pod_quota = 1 if trouble == "quota" else None
    launcher = K8sLauncher({"image": "img:1", "pods": 2}, start_timeout_s=3)
    with pytest.raises(meshplan.RuntimeFailure) as err:
        launcher.launch(2, env={})
    text = str(err.value)
    assert "not every pod" in text and said in text, text


@pytest.mark.timeout(120)
def test_an_expired_watch_lists_again_and_goes_on(cluster) -> None:
    """The server keeps only the last few versions; churn moves them on while the watch's
    connection drops: watching again from its version is 410 Gone, so the launcher lists
    again, watches from there, and still sees its pods end at shutdown."""
    from meshplan.runtime._k8s_launch import K8sLauncher

    cluster.keep_events = 2
    workers = K8sLauncher({"image": "img:1", "pods": 2}).launch(2, env={})
    pods = workers._group.pods
    for _ in range(6):             # churn: versions move on while the watch waits
        cluster.create("secrets", "default", {"metadata": {"name": f"churn-{_}"}})
        cluster.delete("secrets", "default", f"churn-{_}")
    cluster.end_watches()
    deadline = time.monotonic() + 20
    while pods.relists == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    workers.shutdown()
    assert pods.relists >= 1
    assert all(pods.exit_code(i) == 0 for i in range(2))


@pytest.mark.timeout(60)
def test_bad_access_and_input_say_what_is_wrong(cluster, monkeypatch, tmp_path) -> None:
    from meshplan.runtime._k8s_launch import K8sLauncher

    with pytest.raises(meshplan.RuntimeFailure, match="namespace 'nope' does not exist"):
        K8sLauncher({"image": "img:1", "namespace": "nope"}).launch(2)
    with pytest.raises(meshplan.RuntimeFailure, match="make pods x ranks_per_pod equal 4"):
        K8sLauncher({"image": "img:1", "pods": 3}).launch(4)
    with pytest.raises(meshplan.RuntimeFailure, match="runs Indexed Jobs"):
        K8sLauncher({"image": "img:1", "kind": "JobSet"}).launch(2)
    step = meshplan.distribute(gpt.build().step, mesh={"dp": 2}, launcher="k8s",
                               k8s={"image": "img:1", "gpus_per_pod": 1})
    assert step.device == "cuda"            # the pods' GPUs, whatever this host has
    with pytest.raises(meshplan.RuntimeFailure, match="needs k8s="):
        meshplan.distribute(gpt.build().step, mesh={"dp": 2}, launcher="k8s")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    with pytest.raises(meshplan.RuntimeFailure, match="no usable kubeconfig"):
        K8sLauncher({"image": "img:1"}).launch(2)


@pytest.mark.timeout(120)
def test_an_evicted_pod_fails_the_run_cleanly(cluster) -> None:
    """A node drain evicts pod 1 mid-run: the next call raises naming its ranks, and the
    shutdown leaves nothing (no Job, pod, Service, Secret or process)."""
    ex = gpt.build(seed=0)
    step = meshplan.distribute(ex.step, mesh={"dp": 4}, launcher="k8s",
                               k8s={"image": "img:1", "pods": 2}, telemetry=False,
                               timeout_s=60)
    with step:
        step(*ex.batch(0))
        pod = next(n for n in cluster.live()["pods"] if "-1-" in n)
        cluster.evict(pod)
        with pytest.raises(meshplan.RuntimeFailure) as err:
            for i in range(1, 4):
                step(*ex.batch(i))
    text = str(err.value)
    # (rank 2 or 3 is seen to end first, by chance; the message names both)
    assert f"pod {pod} was disrupted (EvictionByEvictionAPI" in text, text
    assert "(the pod ran ranks 2, 3)" in text, text


@pytest.mark.timeout(120)
def test_a_killed_controller_leaves_what_the_sweep_deletes(cluster, tmp_path) -> None:
    """``kill -9`` of a controller between steps leaves its Job running (its ranks wait for
    it); ``meshplan k8s status`` shows it and ``meshplan k8s delete --all-mine`` deletes the
    Job, whose pods, Service and Secret go with it."""
    import json
    import os
    import signal
    import subprocess

    script = tmp_path / "ctl.py"
    script.write_text(
        "import sys, time\n"
        "from meshplan.runtime._k8s_launch import K8sLauncher\n"
        "w = K8sLauncher({'image': 'img:1', 'pods': 2}).launch(2)\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n")
    ctl = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "KUBECONFIG": cluster.kubeconfig})
    try:
        assert ctl.stdout.readline().strip() == "ready"
    finally:
        ctl.send_signal(signal.SIGKILL)
        ctl.wait()
    assert len(cluster.live().get("pods", [])) == 2
    cli = [sys.executable, "-m", "meshplan", "k8s"]
    env = {**os.environ, "KUBECONFIG": cluster.kubeconfig}
    out = subprocess.run([*cli, "status"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "default/meshplan-" in out.stdout, out.stderr
    assert out.stdout.count(": Running") == 2, out.stdout
    out = subprocess.run([*cli, "status", "--json"], env=env, capture_output=True, text=True,
                         timeout=60)
    (job,) = json.loads(out.stdout)["jobs"]
    assert job["namespace"] == "default" and job["job"].startswith("meshplan-")
    assert [p["phase"] for p in job["pods"]] == ["Running", "Running"], job
    out = subprocess.run([*cli, "delete", "--all-mine"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "deleted job/default/meshplan-" in out.stdout, out.stdout


@pytest.mark.timeout(180)
def test_meshplan_run_with_the_k8s_launcher(cluster, tmp_path, capsys, monkeypatch) -> None:
    """``meshplan compile`` then ``meshplan run --launcher k8s --k8s image=...,pods=2``, as a
    user runs a compiled plan on a cluster; the losses are the JSON lines it prints."""
    import json
    import shutil

    from meshplan import cli

    repo = Path(__file__).resolve().parents[2]
    for name in ("gpt_distributed.py", "gpt.py", "_common.py"):
        shutil.copy(repo / "examples" / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    step = str(tmp_path / "gpt_distributed.py:train_step")
    assert cli.main(["compile", step, "-o", "gpt.plan"]) == 0
    capsys.readouterr()
    assert cli.main(["run", step, "--plan", "gpt.plan", "--steps", "2", "--json",
                     "--telemetry", "off", "--launcher", "k8s",
                     "--k8s", "image=registry.example/train:1,pods=2"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert len([x for x in lines if "loss" in x]) == 2, lines
    assert cli.main(["run", step, "--plan", "gpt.plan", "--k8s", "image=x"]) == 1
    assert "add --launcher k8s" in capsys.readouterr().err


@pytest.mark.timeout(120)
@pytest.mark.skipif(__import__("shutil").which("kubectl") is None, reason="needs kubectl")
def test_kubectl_sees_and_deletes_what_the_launcher_made(cluster, tmp_path, monkeypatch):
    """The stand-in cross-checked with the real kubectl (discovery, lists with label
    selectors, logs, a cascading delete): the Job, its two pods with their completion
    indexes, a pod's log (a worker plugin prints into it; ``meshplan k8s logs`` shows it
    too), and ``kubectl delete job --cascade=background`` taking the pods, Service and
    Secret with it."""
    import json
    import subprocess

    (tmp_path / "_say_rank.py").write_text(
        "import os, sys\nprint('rank', os.environ['MESHPLAN_RANK'], 'up', file=sys.stderr, "
        "flush=True)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    from meshplan.runtime._k8s_launch import K8sLauncher

    workers = K8sLauncher({"image": "img:1", "pods": 2}).launch(
        2, env={"MESHPLAN_WORKER_PLUGINS": "_say_rank"})

    def kubectl(*args: str) -> str:
        r = subprocess.run(["kubectl", "--kubeconfig", cluster.kubeconfig, *args],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout

    try:
        run = workers.run_id
        jobs = json.loads(kubectl("get", "jobs", "-o", "json"))["items"]
        assert [j["spec"]["completionMode"] for j in jobs] == ["Indexed"]
        pods = json.loads(kubectl("get", "pods", "-l", f"meshplan.dev/run={run}",
                                  "-o", "json"))["items"]
        index = "batch.kubernetes.io/job-completion-index"
        assert sorted(p["metadata"]["labels"][index] for p in pods) == ["0", "1"]
        assert {p["status"]["phase"] for p in pods} == {"Running"}
        first = next(p["metadata"]["name"] for p in pods
                     if p["metadata"]["labels"][index] == "1")
        deadline = time.monotonic() + 20
        while "rank 1 up" not in kubectl("logs", first) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "rank 1 up" in kubectl("logs", first)
        import io

        from meshplan.runtime._k8s_launch import logs_of_mine
        buf = io.StringIO()                      # meshplan k8s logs --run RUN
        assert logs_of_mine(run=run, out=buf) == 2
        assert f"[{first}] rank 1 up" in buf.getvalue(), buf.getvalue()
        buf = io.StringIO()                      # meshplan k8s logs --run RUN --json
        assert logs_of_mine(run=run, out=buf, as_json=True) == 2
        lines = [json.loads(line) for line in buf.getvalue().splitlines()]
        assert {"namespace": "default", "pod": first, "line": "rank 1 up"} in lines, lines
        kubectl("delete", "job", jobs[0]["metadata"]["name"], "--cascade=background")
        deadline = time.monotonic() + 20
        while cluster.live() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cluster.live() == {}
    finally:
        workers.shutdown()


# ---- fault tolerance: each pod's agent keeps its ranks' snapshots and starts them again -----

_FAULT_STEPS = 4
_REFERENCE: dict[str, tuple] = {}        # the fault-free run, made once for the module


def _ft_run(cluster, monkeypatch, faults=(), before=None, k8s=None, **options):
    """``_FAULT_STEPS`` steps of the GPT (AdamW, clipping) on 2 pods of one rank each (dp=2),
    then its state_dict(); the losses, the state, and what the recovery did. ``before(i)``
    runs before step ``i``; ``k8s``: options instead of the controller's address."""
    import json

    monkeypatch.setenv("MESHPLAN_TEST_FAULTS", json.dumps(list(faults)))
    ex = gpt.build(optimizer="adamw", clip=1.0)
    step = meshplan.distribute(ex.step, mesh={"dp": 2}, launcher="k8s", topology="h100",
                               k8s={"image": "img:1", "pods": 2,
                                    **(k8s or {"controller_host": "127.0.0.1"})},
                               telemetry=False, timeout_s=12, hang_s=1.5, **options)
    losses = []
    with step:
        for i in range(_FAULT_STEPS):
            if before is not None:
                before(i)
            losses.append(step(*ex.batch(i)).detach())
        sd = step.state_dict()
        done = (step.restarts, step._ft.replaced if step._ft is not None else None)
    return losses, sd, done


@pytest.fixture
def faults_plugin(monkeypatch):
    here = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", here)      # the pods' ranks import the plugin too
    monkeypatch.setenv("MESHPLAN_WORKER_PLUGINS", "_faults")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("at, how, when, replaced", [
    ("backward", "kill", 2, [1]), ("forward", "stop", 2, [1]), ("allreduce", "hang", 3, [0, 1])])
def test_a_failed_rank_in_a_pod_is_started_again_there_bit_for_bit(
        cluster, monkeypatch, faults_plugin, tmp_path, at, how, when, replaced) -> None:
    """``fault_tolerance=True`` under k8s: rank 1 is killed mid-backward, stopped (SIGSTOP)
    in step 2, or hangs in an all-reduce in step 3 (after three measured steps: the step's
    deadline is ten of them, not ``timeout_s``). Its pod's agent, which holds the pod's
    snapshots, starts it again (the hang: every rank, past the deadline) and the run is
    ``torch.equal`` to the same run without fault tolerance and without the fault (same
    pods, same collectives in the same order: any difference is a lost or doubled step)."""
    marker = tmp_path / "fired"
    got = _ft_run(cluster, monkeypatch, [{"rank": 1, "step": when, "at": at, "how": how,
                                          "marker": str(marker)}], fault_tolerance=True)
    assert marker.exists(), "the fault never fired"
    assert got[2] == (1, replaced)
    _same(got, _reference(cluster, monkeypatch))


@pytest.mark.timeout(240)
def test_a_failed_rank_is_started_again_through_the_relay_bit_for_bit(
        cluster, monkeypatch, faults_plugin, tmp_path) -> None:
    """The same as above with the controller outside the cluster (``reach="port-forward"``):
    the pods' agents and ranks reach it through their relays; rank 1, killed mid-backward, is
    started again by its agent on the new launch's channel, exposed by the relay, and the run
    stays ``torch.equal`` to the fault-free one."""
    marker = tmp_path / "fired"
    got = _ft_run(cluster, monkeypatch, [{"rank": 1, "step": 2, "at": "backward",
                                          "how": "kill", "marker": str(marker)}],
                  k8s={"reach": "port-forward", "relay_port": _free_port()},
                  fault_tolerance=True)
    assert marker.exists(), "the fault never fired"
    assert got[2] == (1, [1])
    assert any(m == "PORTFORWARD" for m, _ in cluster.requests)
    _same(got, _reference(cluster, monkeypatch))


def _reference(cluster, monkeypatch) -> tuple:
    """The fault-free run, without fault tolerance (made once)."""
    if "dp2" not in _REFERENCE:
        _REFERENCE["dp2"] = _ft_run(cluster, monkeypatch, fault_tolerance=False)
    return _REFERENCE["dp2"]


def _same(got, want) -> None:
    for i, (a, b) in enumerate(zip(got[0], want[0], strict=True)):
        assert torch.equal(a, b), f"loss of step {i}: {a} != {b}"
    for k, v in want[1]["model"].items():
        assert torch.equal(got[1]["model"][k], v), k
    a = {f"{i}.{k}": v for i, e in got[1]["optim"]["state"].items() for k, v in e.items()}
    b = {f"{i}.{k}": v for i, e in want[1]["optim"]["state"].items() for k, v in e.items()}
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["evict", "delete"])
def test_an_evicted_pod_is_made_again_and_the_run_goes_on_bit_for_bit(cluster, monkeypatch,
                                                                      how) -> None:
    """A node drain evicts pod 1, or ``kubectl delete pod`` deletes it (no DisruptionTarget:
    the pod ends with 143, which the Job's ``podFailurePolicy`` ignores under fault
    tolerance; its agent, its rank and the snapshots it held go with it) before step 2; the
    Job makes a pod of the same index in its place. The controller reads
    the state from the snapshots (pod 1's rank from its copy on pod 0's agent), waits for
    the new pod's agent, starts the mesh again in the pods and re-runs the kept steps:
    ``torch.equal`` to the fault-free run, and nothing left behind. The loop waits before
    step 2 while the new pod's agent starts and says hello (a user's loop busy between
    steps): that hello, which comes before anything asks for it, is kept for the recovery
    (before, an agent's question dropped it and the restarted ranks' setup failed)."""
    def evict(i: int) -> None:
        if i == 2:
            pod = next(n for n in cluster.live()["pods"] if "-1-" in n)
            cluster.evict(pod) if how == "evict" else cluster.delete("pods", "default", pod)
            time.sleep(6.0)          # the new pod's agent starts and says hello (~3 s here)

    got = _ft_run(cluster, monkeypatch, before=evict, fault_tolerance=True)
    assert got[2] == (1, [0, 1])
    _same(got, _reference(cluster, monkeypatch))


@pytest.mark.timeout(120)
def test_a_pod_the_job_fails_on_ends_the_run_at_once(cluster, monkeypatch) -> None:
    """Pod 1's entry (its container's main process) dies of SIGSEGV (exit 139: neither a
    disruption, a deletion nor a kill) under fault tolerance: the Job's ``podFailurePolicy``
    fails the Job (``FailJob``), whose controller deletes pod 0 too, so no pod will take pod
    1's place. The next call raises at once (not after ``start_timeout_s``, 300 s) naming
    the Job's failure and the rule, and nothing is left."""
    import signal

    ex = gpt.build(optimizer="adamw")
    step = meshplan.distribute(ex.step, mesh={"dp": 2}, launcher="k8s",
                               k8s={"image": "img:1", "pods": 2,
                                    "controller_host": "127.0.0.1"},
                               telemetry=False, timeout_s=12, hang_s=1.5,
                               fault_tolerance=True)
    with step:
        step(*ex.batch(0))
        pod = next(n for n in cluster.live()["pods"] if "-1-" in n)
        cluster.procs[("default", pod)].send_signal(signal.SIGSEGV)
        started = time.monotonic()
        with pytest.raises(meshplan.RuntimeFailure) as err:
            for i in range(1, 3):
                step(*ex.batch(i))
        took = time.monotonic() - started
    text = str(err.value)
    assert "failed (PodFailurePolicy" in text and "FailJob rule" in text, text
    assert "no pod takes" in text, text
    assert f"pod {pod} failed: its container ended (Error, exit 139)" in text, text
    assert took < 60, f"the failure took {took:.0f} s to raise"
