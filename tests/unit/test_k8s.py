"""Kubernetes resources (``runtime/_k8s.py``, ``meshplan k8s manifest``) and the pod entry
(``runtime/_k8s_pod.py``).

No cluster can run here. The manifests are checked, strictly (an unknown field is an error),
against the OpenAPI schemas of three Kubernetes minors that ``kubernetes-validate`` carries;
the pod entry is run as the manifest's container would run it (its command and environment,
the Job's ``JOB_COMPLETION_INDEX``, the Secret's file) against a real controller channel.
"""

from __future__ import annotations

import json

import copy
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from meshplan import RuntimeFailure
from meshplan.runtime._k8s import (
    GPU_RESOURCE,
    QUEUE_LABEL,
    RUN_LABEL,
    K8sOptions,
    manifests,
    resource_name,
    secret_manifest,
    to_yaml,
)
from meshplan.runtime._mpi_launch import _alive

kv = pytest.importorskip("kubernetes_validate", reason="pip install 'meshplan[k8s]'")
VERSIONS = ("1.35.0", "1.36.0", "1.37.0")
RUN = "0123456789abcdef"


def _make(world: int = 4, agent: bool = False, **options):
    opts = K8sOptions.parse({"image": "registry.example/train:1", **options})
    return opts, manifests(opts, world=world, run_id=RUN, address="tcp://10.0.0.5:5555",
                           store=("10.0.0.5", 29500), controller_host="ctl", agent=agent)


def _validate(obj: dict) -> None:
    for version in VERSIONS:
        kv.validate(obj, version, strict=True)


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"]}


@pytest.mark.parametrize("options", [
    {},
    {"pods": 2, "gpus_per_pod": 2, "rdma": {"rdma/hca": 1}, "shm": "64Gi", "cpu": "16",
     "memory": "256Gi", "queue": "team-a", "node_selector": {"pool": "h100"},
     "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
     "active_deadline_s": 3600, "service_account": "trainer", "image_pull_secrets": ["regcred"],
     "labels": {"team": "a"}, "annotations": {"note": "x"}, "env": {"NCCL_DEBUG": "WARN"}},
    {"pods": 1, "ranks_per_pod": 4, "one_per_node": False, "ttl_s": None},
    {"pods": 2, "agent": True},
])
def test_every_manifest_validates_strictly_against_three_kubernetes_minors(options) -> None:
    opts, (job, service) = _make(**options)
    _validate(job)
    _validate(service)
    _validate(secret_manifest(opts, RUN, "ab" * 32))


def test_strict_validation_refuses_an_unknown_field() -> None:
    """The check above can fail: a misspelt field of the pod spec is an error."""
    _, (job, _) = _make()
    bad = copy.deepcopy(job)
    bad["spec"]["template"]["spec"]["restartPolicyy"] = "Never"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, VERSIONS[-1], strict=True)


def test_an_indexed_job_with_a_headless_service_and_the_ranks_laid_out() -> None:
    opts, (job, service) = _make(world=8, pods=2, gpus_per_pod=4, rdma={"rdma/hca": 1},
                                 queue="team-a")
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 2, 2)
    assert spec["backoffLimit"] == 0 and spec["suspend"] is True     # Kueue admits the gang
    assert job["metadata"]["labels"][QUEUE_LABEL] == "team-a"
    rules = spec["podFailurePolicy"]["rules"]
    assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
    assert [r["action"] for r in rules] == ["Ignore", "FailJob"]
    # under fault tolerance (the pods run agents) a deleted or killed pod is made again too
    agent_rules = _make(world=8, pods=2, agent=True)[1][0]["spec"]["podFailurePolicy"]["rules"]
    assert [r["action"] for r in agent_rules] == ["Ignore", "Ignore", "FailJob"]
    assert agent_rules[1]["onExitCodes"] == {"containerName": "worker", "operator": "In",
                                             "values": [137, 143]}
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["subdomain"] == service["metadata"]["name"]
    (container,) = pod["containers"]
    env = _env(container)
    assert env["MESHPLAN_WORLD_SIZE"] == "8" and env["MESHPLAN_RANKS_PER_POD"] == "4"
    assert env["MESHPLAN_CONTROLLER"] == "tcp://10.0.0.5:5555"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.5", "29500")
    assert container["command"][-1] == "meshplan.runtime._k8s_pod"
    assert container["resources"]["limits"] == {GPU_RESOURCE: "4", "rdma/hca": "1"}
    assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    key = next(v for v in pod["volumes"] if v["name"] == "key")
    assert key["secret"] == {"secretName": f"{resource_name(RUN)}-key", "defaultMode": 0o400}
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
    assert service["spec"] == {"clusterIP": "None", "publishNotReadyAddresses": True,
                               "selector": {RUN_LABEL: RUN}}


def test_a_jobset_carries_the_same_pod_template() -> None:
    """No JobSet schema ships with kubernetes-validate: its Job template is checked as a Job."""
    _, (jobset, service) = _make(kind="JobSet", pods=2, ranks_per_pod=2)
    _, (job, _) = _make(pods=2, ranks_per_pod=2)
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    assert jobset["spec"]["network"] == {"enableDNSHostnames": True,
                                         "subdomain": service["metadata"]["name"]}
    (rj,) = jobset["spec"]["replicatedJobs"]
    assert rj["template"]["spec"]["template"] == job["spec"]["template"]
    _validate({"apiVersion": "batch/v1", "kind": "Job",
               "metadata": {"name": "x", "namespace": "default"}, "spec": rj["template"]["spec"]})


@pytest.mark.parametrize("options, message", [
    ({"image": ""}, "needs 'image'"),
    ({"pods": 3}, "make pods x ranks_per_pod equal 4"),
    ({"pods": 2, "gpus_per_pod": 1}, "each rank takes a GPU"),
    ({"cpu": "lots"}, "a Kubernetes quantity"),
    ({"kind": "Deployment"}, "'Job', 'JobSet'"),
    ({"namespace": "Team_A"}, "a DNS label"),
    ({"rdma": {"hca": 1}}, "resource name"),
    ({"env": {"MESHPLAN_RANK": "0"}}, "meshplan's own variable"),
    ({"gpu": 1}, "no option 'gpu'"),
    ({"reach": "tunnel"}, "'direct', 'port-forward'"),
    ({"relay_port": 80}, "a port number from 1024"),
    ({"reach": "port-forward", "controller_host": "10.0.0.1"}, "leave it out"),
])
def test_bad_options_get_one_error_naming_the_key(options, message) -> None:
    with pytest.raises(RuntimeFailure, match=message):
        _make(**options)


def test_meshplan_k8s_manifest_prints_yaml_that_validates(tmp_path, capsys) -> None:
    from meshplan import cli
    from meshplan.examples import mlp
    from meshplan.frontend import trace
    from meshplan.planner import plan_graph

    ex = mlp.build(optimizer="adamw")
    ex.step(*ex.batch(0))
    path = tmp_path / "mlp.plan"
    plan_graph(trace(ex.step, *ex.batch(1)).graph, {"dp": 2, "tp": 2}).save(path)
    assert cli.main(["k8s", "manifest", str(path), "--image", "img:1", "--pods", "2",
                     "--node-selector", "pool=cpu", "--shm", "8Gi"]) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert [d["kind"] for d in docs] == ["Job", "Service"]
    for d in docs:
        _validate(d)
    assert docs[0]["spec"]["completions"] == 2
    assert cli.main(["k8s", "manifest", str(path), "--image", "img:1", "--pods", "2",
                     "--node-selector", "pool=cpu", "--shm", "8Gi", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["kind"] == "List" and [d["kind"] for d in listed["items"]] == ["Job", "Service"]
    job = listed["items"][0]["spec"]                 # the same Job (another run id)
    assert job["completions"] == 2
    assert job["template"]["spec"]["nodeSelector"] == {"pool": "cpu"}
    assert cli.main(["k8s", "manifest", str(path), "--image", "img:1", "--pods", "3"]) == 1
    assert "equal 4" in capsys.readouterr().err


def test_the_pod_entry_starts_its_ranks_and_ends_with_the_first_that_fails(tmp_path) -> None:
    """Two pods x two ranks, each pod its container's command and environment, against a
    controller channel on TCP (CURVE, as across hosts): every rank says hello with its rank;
    a rank killed ends its pod with 128+9 and the pod's other rank with it; the other pod
    ends cleanly when the controller says goodbye."""
    from meshplan.runtime import _channel as P
    from meshplan.runtime._channel import ControllerChannel, Secret
    from meshplan.runtime._launch import RendezvousStore, Workers, _Group
    from meshplan.runtime._mpi_launch import _RankProc

    secret, run_id = Secret.new(), RUN
    group = _Group(ControllerChannel(secret, run_id, "127.0.0.1", transport="tcp"),
                   RendezvousStore("127.0.0.1"))
    opts, (job, _) = _make(pods=2, ranks_per_pod=2)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    key = tmp_path / "key"
    key.write_text(secret.hex() + "\n")
    env = {**os.environ, **_env(container), "MESHPLAN_CONTROLLER": group.channel.address,
           "MESHPLAN_SECRET_FILE": str(key), "MESHPLAN_LOST_AFTER_S": "30"}
    assert container["command"][1:] == ["-m", "meshplan.runtime._k8s_pod"]
    pods = [subprocess.Popen([sys.executable, *container["command"][1:]],
                             env={**env, "JOB_COMPLETION_INDEX": str(i)}) for i in range(2)]
    try:
        group.procs = [_RankProc(pods[r // 2]) for r in range(4)]
        workers = Workers(group, run_id=run_id, master_addr="127.0.0.1",
                          master_port=group.store.port, log_dir=None)
        hellos = workers.gather(P.HELLO, timeout_s=60)
        assert [h.header["rank"] for h in hellos] == [0, 1, 2, 3]
        pids = [int(h.header["pid"]) for h in hellos]
        os.kill(pids[3], signal.SIGKILL)
        assert pods[1].wait(20) == 128 + 9
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(pids[2]):
            time.sleep(0.05)
        assert not _alive(pids[2]), "the pod's other rank outlived its pod"
        for rank in (0, 1):
            workers.send(rank, P.SHUTDOWN)
        assert pods[0].wait(20) == 0
    finally:
        for p in pods:
            if p.poll() is None:
                p.kill()
        group.stop()



def test_to_yaml_is_one_stream_kubectl_reads() -> None:
    opts, objs = _make()
    docs = [d for d in yaml.safe_load_all(to_yaml(objs)) if d]
    assert docs == objs


def test_the_relay_carries_a_ranks_connection_and_only_for_the_key() -> None:
    """``_k8s_relay``: over plain TCP in place of port-forwards, the controller's tunnel
    exposes an endpoint of its own in the "pod"; a connection to the exposed port reaches
    it (bytes both ways, then the end); a tunnel with another key gets nothing exposed."""
    import socket
    import threading

    from meshplan.runtime._k8s_relay import Relay, Tunnel

    server = socket.create_server(("127.0.0.1", 0))

    def echo() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            while data := conn.recv(1024):
                conn.sendall(data[::-1])
            conn.close()
    threading.Thread(target=echo, daemon=True).start()
    relay = Relay(b"k" * 64, 0)
    port = relay.listener.getsockname()[1]
    try:
        def forward():
            return socket.create_connection(("127.0.0.1", port))
        with pytest.raises(RuntimeFailure, match="refused the controller's key"):
            Tunnel(forward, b"x" * 64).connect(5)
        tunnel = Tunnel(forward, b"k" * 64)
        tunnel.connect(5)
        local = tunnel.expose("channel", server.getsockname())
        assert relay.exposed(["channel"], 1) == {"channel": local}
        with socket.create_connection(("127.0.0.1", local), timeout=5) as rank:
            rank.sendall(b"hello")
            assert rank.recv(5) == b"olleh"
            rank.shutdown(socket.SHUT_WR)
            assert rank.recv(5) == b""           # the endpoint's end reaches the rank
        # the control stream cut (an idle timeout on the way): a rank that connects now is
        # told at once (its connection ends) rather than left waiting; a new tunnel (as
        # Tunnels makes for a running pod) finds the same port exposed, and it works again
        tunnel.close()
        deadline = time.monotonic() + 5
        while relay._control is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        with socket.create_connection(("127.0.0.1", local), timeout=5) as rank:
            assert rank.recv(5) == b""
        again = Tunnel(forward, b"k" * 64)
        again.connect(5)
        assert again.expose("channel", server.getsockname()) == local
        again.close()
    finally:
        relay.close()
        server.close()
