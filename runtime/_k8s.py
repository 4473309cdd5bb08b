"""Kubernetes resources for a mesh (issue 23, first part): the options, the manifests, their
checks. ``meshplan k8s manifest PLAN --image IMG --pods N`` prints them for review or GitOps.

What a run on a cluster is made of, by default (``kind="Job"``):

- an **Indexed Job**: ``completions = parallelism = pods``, ``completionMode: Indexed`` (each pod
  gets ``JOB_COMPLETION_INDEX``; rank = index x ranks per pod + local rank), ``restartPolicy:
  Never``, ``backoffLimit: 0`` and a ``podFailurePolicy`` that fails the Job on a container's
  non-zero exit (the controller decides what a failure means) but ignores disruptions (an
  evicted or preempted pod is made again by the Job controller and does not count) and,
  under fault tolerance, a pod deleted outright or killed (exit 143 or 137: made again, the
  controller counting it against ``max_restarts``),
  ``activeDeadlineSeconds`` when asked, ``ttlSecondsAfterFinished`` so a finished Job goes by
  itself. One container, ``worker``, runs ``python -m meshplan.runtime._k8s_pod``, which
  starts the pod's ranks (``_k8s_pod.py``). ``/dev/shm`` is a memory ``emptyDir`` (the
  ranks of a pod share memory through it); GPUs are limits (``nvidia.com/gpu``); an RDMA
  device resource and ``IPC_LOCK`` when asked; one pod per node by default (a required
  pod anti-affinity on ``kubernetes.io/hostname``); a Kueue queue label when asked.
- a **headless Service** (``clusterIP: None``, ``publishNotReadyAddresses: true``) of the same
  name, the pods' ``subdomain``: every pod's hostname resolves (``<job>-<index>.<service>``)
  as soon as it exists, not when it is Ready, so no rank waits on DNS that is not there yet
  (torch.distributed's gloo finds its address by the hostname). The controller makes the Job
  its owner once both exist, so deleting the Job deletes it.
- a **Secret** ``<name>-key`` holding the run's channel key, mounted read-only into the pods
  (mode 0400): the workers authenticate to the controller with it (CURVE over TCP, as across
  hosts under mpi and Slurm). The controller creates it at launch; ``meshplan k8s manifest``
  prints the Job and the Service only, which name it.
- ``kind="JobSet"``: the same pod template in a JobSet (``jobset.x-k8s.io/v1alpha2``, one
  replicated Job, DNS hostnames on), for clusters that run JobSet.

Every object carries ``app.kubernetes.io/managed-by: meshplan``, the run's label
(``meshplan.dev/run``) and its owner's (``meshplan.dev/owner``), which a sweep selects on.

Checked here: the manifests against the real OpenAPI schemas of three Kubernetes minors
(``kubernetes-validate``, strict; tests/unit/test_k8s.py); the pod entry by running it as the
manifest says, against a real controller. Not yet: the controller's flow against an API
server (``launcher="k8s"``), which no test here can reach.
"""

from __future__ import annotations

import dataclasses
import getpass
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .._errors import RuntimeFailure
from ._k8s_relay import ENV_RELAY_PORT, RELAY_PORT

__all__ = ["K8sOptions", "KINDS", "manifests", "resource_name", "secret_manifest", "to_yaml"]

KINDS = ("Job", "JobSet")
MANAGED_BY = "meshplan"
RUN_LABEL = "meshplan.dev/run"
OWNER_LABEL = "meshplan.dev/owner"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
SECRET_DIR = "/var/run/meshplan"
SECRET_KEY = "key"
GPU_RESOURCE = "nvidia.com/gpu"
POD_ENTRY = "meshplan.runtime._k8s_pod"
ENV_RANKS_PER_POD = "MESHPLAN_RANKS_PER_POD"
ENV_SECRET_FILE = "MESHPLAN_SECRET_FILE"
ENV_K8S = "MESHPLAN_K8S"
ENV_AGENT = "MESHPLAN_POD_AGENT"        # fault tolerance: the pod runs its agent
REACHES = ("direct", "port-forward")
TERMINATED = 143                        # a pod's exit when it was sent SIGTERM (deleted)
KILLED = 137                            # SIGKILL: the grace ran out, or the OOM killer
# the agent's worker plugins: the snapshot keeper and the agent (``_k8s_agent.py``)
AGENT_PLUGINS = "meshplan.runtime._keepers,meshplan.runtime._k8s_agent"

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")


@dataclasses.dataclass(frozen=True)
class K8sOptions:
    """``distribute(launcher="k8s", k8s={...})`` / ``meshplan k8s manifest``: where and how the
    pods run. Every field but ``image`` has a default.

    image: the container image (meshplan and torch installed, as on the controller).
    namespace: where the objects go (``"default"``).
    pods: how many pods; None: the mesh's ranks over ``ranks_per_pod``.
    ranks_per_pod: ranks (processes) per pod; None: ``gpus_per_pod`` when set, else 1.
    gpus_per_pod: GPUs each pod asks for (limits ``nvidia.com/gpu``); 0: none.
    cpu, memory: each pod's requests (``"8"``, ``"64Gi"``), also its limits when set.
    shm: the size limit of ``/dev/shm`` (a memory emptyDir); None: no limit but the pod's.
    queue: a Kueue ``LocalQueue`` name: the Job is labelled for it (and starts suspended, as
        Kueue wants, which admits the whole gang at once).
    node_selector: labels the nodes must have; tolerations: the pod's tolerations (as in the
        API: ``[{"key": ..., "operator": ..., "effect": ...}]``).
    rdma: an RDMA device resource, e.g. ``{"rdma/hca": 1}``: a limit per pod, and the
        container gets ``IPC_LOCK`` (pinned memory).
    one_per_node: one pod per node (a required anti-affinity on the hostname); default True.
    kind: ``"Job"`` (an Indexed Job) or ``"JobSet"``.
    active_deadline_s: the Job's ``activeDeadlineSeconds`` (None: none).
    ttl_s: ``ttlSecondsAfterFinished`` (default 600: a finished Job is deleted 10 min later).
    service_account, image_pull_secrets, labels, annotations, env: as in the pod spec.
    python: the interpreter in the image (``"python"``).
    controller_host: the address the controller listens on and the pods connect to; None:
        this machine's address on its route to the API server (in a pod: the pod's IP).
    reach: how the ranks reach the controller. ``"direct"``: they connect to it (it runs in
        the cluster, or on a network the pods route to). ``"port-forward"``: it runs outside
        (a laptop): each pod runs a relay on ``127.0.0.1:relay_port`` and the controller
        reaches it through the API server's port-forward (``_k8s_relay.py``); it needs the
        ``pods/portforward`` permission (create) besides the others.
    relay_port: the relay's port in each pod (29400).
    """

    image: str
    namespace: str = "default"
    pods: int | None = None
    ranks_per_pod: int | None = None
    gpus_per_pod: int = 0
    cpu: str | None = None
    memory: str | None = None
    shm: str | None = None
    queue: str | None = None
    node_selector: Mapping[str, str] = dataclasses.field(default_factory=dict)
    tolerations: Sequence[Mapping[str, Any]] = ()
    rdma: Mapping[str, int] = dataclasses.field(default_factory=dict)
    one_per_node: bool = True
    kind: str = "Job"
    active_deadline_s: int | None = None
    ttl_s: int | None = 600
    service_account: str | None = None
    image_pull_secrets: Sequence[str] = ()
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    annotations: Mapping[str, str] = dataclasses.field(default_factory=dict)
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    python: str = "python"
    controller_host: str | None = None
    reach: str = "direct"
    relay_port: int = RELAY_PORT

    @classmethod
    def parse(cls, value: Any) -> K8sOptions:
        """``k8s=`` as given (a dict, or K8sOptions) -> checked options; one error per
        mistake, naming the key and how to fix it."""
        if isinstance(value, K8sOptions):
            value = dataclasses.asdict(value)
        if isinstance(value, str):
            value = _from_text(value)
        if not isinstance(value, Mapping):
            raise RuntimeFailure(f"k8s={value!r}: pass a dict of options, e.g. "
                                 "{'image': 'registry/train:1', 'pods': 4}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise RuntimeFailure(f"k8s= has no option {unknown[0]!r}; the options are "
                                 f"{', '.join(sorted(known))}")
        if not value.get("image") or not isinstance(value.get("image"), str):
            raise RuntimeFailure("k8s= needs 'image': the container image the pods run "
                                 "(meshplan and torch installed, as on the controller)")
        opts = cls(**{k: v for k, v in value.items()})
        opts._check()
        return opts

    def _check(self) -> None:
        def bad(key: str, why: str) -> RuntimeFailure:
            return RuntimeFailure(f"k8s={{{key!r}: {getattr(self, key)!r}}}: {why}")

        if not _DNS_LABEL.match(self.namespace) or len(self.namespace) > 63:
            raise bad("namespace", "a namespace is a DNS label: lower-case letters, digits "
                      "and '-', at most 63")
        for key in ("pods", "ranks_per_pod"):
            v = getattr(self, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise bad(key, "pass an int >= 1 (or leave it out)")
        for key in ("gpus_per_pod",):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad(key, "pass an int >= 0")
        for key in ("active_deadline_s", "ttl_s"):
            v = getattr(self, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise bad(key, "pass a number of seconds (an int >= 0) or None")
        for key in ("cpu", "memory", "shm"):
            v = getattr(self, key)
            if v is not None and not (isinstance(v, str) and _QUANTITY.match(v)):
                raise bad(key, "pass a Kubernetes quantity as a string, e.g. '8', '500m', "
                          "'64Gi'")
        if self.kind not in KINDS:
            raise bad("kind", f"pass one of {', '.join(map(repr, KINDS))}")
        if self.queue is not None and not (isinstance(self.queue, str)
                                           and _DNS_LABEL.match(self.queue)):
            raise bad("queue", "pass the name of a Kueue LocalQueue in the namespace")
        for key in ("node_selector", "labels", "annotations", "env"):
            v = getattr(self, key)
            if not isinstance(v, Mapping) or not all(
                    isinstance(k, str) and isinstance(x, str) for k, x in v.items()):
                raise bad(key, "pass a dict of strings to strings")
        if not isinstance(self.rdma, Mapping) or not all(
                isinstance(k, str) and "/" in k and isinstance(n, int) and n >= 1
                for k, n in self.rdma.items()):
            raise bad("rdma", "pass {resource name: count}, e.g. {'rdma/hca': 1}")
        if not isinstance(self.tolerations, (list, tuple)) or not all(
                isinstance(t, Mapping) for t in self.tolerations):
            raise bad("tolerations", "pass a list of tolerations as the API spells them, "
                      "e.g. [{'key': 'gpu', 'operator': 'Exists', 'effect': 'NoSchedule'}]")
        if self.reach not in REACHES:
            raise bad("reach", f"pass one of {', '.join(map(repr, REACHES))}")
        if isinstance(self.relay_port, bool) or not isinstance(self.relay_port, int) or not (
                1024 <= self.relay_port < 65536):
            raise bad("relay_port", "pass a port number from 1024 to 65535")
        if self.controller_host is not None and self.reach == "port-forward":
            raise bad("controller_host", "with reach='port-forward' the pods do not connect "
                      "to the controller's address (the relay does it for them): leave it out")
        if self.controller_host is not None and not (
                isinstance(self.controller_host, str) and self.controller_host.strip()):
            raise bad("controller_host", "pass this machine's address the pods can reach "
                      "(an IP or a host name), or leave it out")
        taken = {ENV_RANKS_PER_POD, ENV_SECRET_FILE, ENV_K8S}
        clash = sorted(k for k in self.env if k in taken or k.startswith("MESHPLAN_"))
        if clash:
            raise bad("env", f"{clash[0]} is meshplan's own variable; name yours otherwise")

    def layout(self, world: int) -> tuple[int, int]:
        """(pods, ranks per pod) for a mesh of ``world`` ranks, or one error saying what does
        not fit."""
        per, pods = self.ranks_per_pod, self.pods
        if per is None:
            per = -(-world // pods) if pods is not None else (self.gpus_per_pod or 1)
        if pods is None:
            pods = -(-world // per)
        if pods * per != world:
            fit = (f"pods={world // per}, ranks_per_pod={per}" if world % per == 0
                   else f"pods={world}, ranks_per_pod=1")
            raise RuntimeFailure(
                f"the mesh has {world} ranks and k8s= gives {pods} pod{'s' * (pods != 1)} x "
                f"{per} rank{'s' * (per != 1)}; make pods x ranks_per_pod equal {world} "
                f"(e.g. {fit})")
        if self.gpus_per_pod and per > self.gpus_per_pod:
            raise RuntimeFailure(
                f"k8s= runs {per} ranks per pod on {self.gpus_per_pod} GPU"
                f"{'s' * (self.gpus_per_pod != 1)}; each rank takes a GPU: set gpus_per_pod="
                f"{per}, or more pods")
        return pods, per


_INTS = ("pods", "ranks_per_pod", "gpus_per_pod", "active_deadline_s", "ttl_s", "relay_port")


def _from_text(text: str) -> dict[str, Any]:
    """``meshplan run --k8s image=IMG,pods=2,...``: the scalar options as key=value pairs."""
    out: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise RuntimeFailure(f"--k8s {text!r}: {item!r} is not key=value (e.g. "
                                 "image=registry/train:1,pods=2)")
        key = key.strip()
        if key in _INTS:
            try:
                out[key] = int(value)
            except ValueError:
                raise RuntimeFailure(f"--k8s {key}={value!r}: pass an int") from None
        elif key == "one_per_node":
            out[key] = value.lower() in ("1", "true", "yes")
        else:
            out[key] = value
    return out


def resource_name(run_id: str) -> str:
    """The Job's, Service's and pods' base name for a run (a DNS label)."""
    name = f"meshplan-{run_id.lower()}"
    if not _DNS_LABEL.match(name) or len(name) > 52:    # pods add "-<index>-<suffix>"
        raise RuntimeFailure(f"run id {run_id!r} does not make a Kubernetes name")
    return name


def owner() -> str:
    """This user, as a label value (the sweep's selector)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    value = re.sub(r"[^A-Za-z0-9_.-]", "-", user)[:63].strip("-_.")
    return value or "unknown"


def labels(run_id: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "meshplan", "app.kubernetes.io/managed-by": MANAGED_BY,
            RUN_LABEL: run_id.lower(), OWNER_LABEL: owner()}


def manifests(opts: K8sOptions, *, world: int, run_id: str, address: str,
              store: tuple[str, int] | None, controller_host: str,
              extra_env: Mapping[str, str] | None = None, agent: bool = False
              ) -> list[dict[str, Any]]:
    """The Job (or JobSet) and the headless Service that run ``world`` ranks for run
    ``run_id``, whose workers connect to the controller at ``address`` (``tcp://host:port``)
    and rendezvous through its store at ``store`` (host, port); ``extra_env``: the
    launcher's own variables for the workers (the worker plugins). ``agent``: each pod runs
    its agent (fault tolerance, ``_k8s_agent.py``), which connects to ``address`` and starts
    the ranks when told."""
    pods, per = opts.layout(world)
    name = resource_name(run_id)
    meta_labels = {**opts.labels, **labels(run_id)}
    meta = {"name": name, "namespace": opts.namespace, "labels": meta_labels}
    if opts.annotations:
        meta["annotations"] = dict(opts.annotations)
    template = _pod_template(opts, name=name, run_id=run_id, world=world, per=per,
                             address=address, store=store, controller_host=controller_host,
                             pod_labels=meta_labels,
                             extra_env={**(extra_env or {}), **({ENV_AGENT: "1"} if agent
                                                                else {}),
                                        **({ENV_RELAY_PORT: str(opts.relay_port)}
                                           if opts.reach == "port-forward" else {})})
    job_spec: dict[str, Any] = {
        "completionMode": "Indexed", "completions": pods, "parallelism": pods,
        "backoffLimit": 0,
        "podFailurePolicy": {"rules": [
            # evicted, preempted, node drained: the Job controller makes the pod again
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
            # under fault tolerance, a pod deleted outright (kubectl delete pod: SIGTERM, no
            # DisruptionTarget) or killed (the OOM killer, the grace spent): made again too,
            # the controller counts it against max_restarts
            *([{"action": "Ignore", "onExitCodes": {
                "containerName": "worker", "operator": "In", "values": [KILLED, TERMINATED]}}]
              if agent else []),
            # a rank that exits non-zero: the controller's to handle, not a retry
            {"action": "FailJob", "onExitCodes": {"containerName": "worker",
                                                  "operator": "NotIn", "values": [0]}}]},
        "template": template,
    }
    if opts.active_deadline_s is not None:
        job_spec["activeDeadlineSeconds"] = opts.active_deadline_s
    if opts.ttl_s is not None:
        job_spec["ttlSecondsAfterFinished"] = opts.ttl_s
    if opts.queue is not None:
        meta_labels[QUEUE_LABEL] = opts.queue
        job_spec["suspend"] = True            # Kueue admits the whole gang, then resumes it
    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": opts.namespace, "labels": dict(meta_labels)},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": {RUN_LABEL: run_id.lower()}},
    }
    if opts.kind == "Job":
        work = {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": job_spec}
    else:
        job_spec.pop("suspend", None)
        job_spec.pop("ttlSecondsAfterFinished", None)
        spec: dict[str, Any] = {
            "network": {"enableDNSHostnames": True, "subdomain": name},
            "failurePolicy": {"maxRestarts": 0},
            "replicatedJobs": [{"name": "workers", "replicas": 1,
                                "template": {"metadata": {"labels": dict(meta_labels)},
                                             "spec": job_spec}}],
        }
        if opts.ttl_s is not None:
            spec["ttlSecondsAfterFinished"] = opts.ttl_s
        if opts.queue is not None:
            spec["suspend"] = True
        work = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": meta,
                "spec": spec}
    return [work, service]


def _pod_template(opts: K8sOptions, *, name: str, run_id: str, world: int, per: int,
                  address: str, store: tuple[str, int] | None, controller_host: str,
                  pod_labels: Mapping[str, str], extra_env: Mapping[str, str]
                  ) -> dict[str, Any]:
    env = [{"name": k, "value": str(v)} for k, v in sorted({**opts.env, **extra_env}.items())]
    env += [{"name": k, "value": str(v)} for k, v in (
        ("MESHPLAN_CONTROLLER", address), ("MESHPLAN_RUN_ID", run_id),
        ("MESHPLAN_WORLD_SIZE", world), (ENV_RANKS_PER_POD, per),
        (ENV_SECRET_FILE, f"{SECRET_DIR}/{SECRET_KEY}"), (ENV_K8S, "1"),
        ("MESHPLAN_CONTROLLER_HOST", controller_host),
        ("WORLD_SIZE", world), ("LOCAL_WORLD_SIZE", per),
        *((("MASTER_ADDR", store[0]), ("MASTER_PORT", store[1])) if store else ()))]
    limits: dict[str, str] = {}
    requests: dict[str, str] = {}
    if opts.cpu:
        requests["cpu"] = limits["cpu"] = opts.cpu
    if opts.memory:
        requests["memory"] = limits["memory"] = opts.memory
    if opts.gpus_per_pod:
        limits[GPU_RESOURCE] = str(opts.gpus_per_pod)
    for res, n in opts.rdma.items():
        limits[res] = str(n)
    container: dict[str, Any] = {
        "name": "worker", "image": opts.image,
        "command": [opts.python, "-m", POD_ENTRY], "env": env,
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                         {"name": "key", "mountPath": SECRET_DIR, "readOnly": True}],
    }
    if limits or requests:
        container["resources"] = {k: v for k, v in (("limits", limits),
                                                     ("requests", requests)) if v}
    if opts.rdma:
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    shm: dict[str, Any] = {"medium": "Memory"}
    if opts.shm:
        shm["sizeLimit"] = opts.shm
    spec: dict[str, Any] = {
        "restartPolicy": "Never", "subdomain": name, "containers": [container],
        "volumes": [{"name": "dshm", "emptyDir": shm},
                    {"name": "key", "secret": {"secretName": f"{name}-key",
                                               "defaultMode": 0o400}}],
        "terminationGracePeriodSeconds": 10,
    }
    if opts.one_per_node:
        spec["affinity"] = {"podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [{
                "labelSelector": {"matchLabels": {RUN_LABEL: run_id.lower()}},
                "topologyKey": "kubernetes.io/hostname"}]}}
    if opts.node_selector:
        spec["nodeSelector"] = dict(opts.node_selector)
    if opts.tolerations:
        spec["tolerations"] = [dict(t) for t in opts.tolerations]
    if opts.service_account:
        spec["serviceAccountName"] = opts.service_account
    if opts.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in opts.image_pull_secrets]
    return {"metadata": {"labels": dict(pod_labels)}, "spec": spec}


def secret_manifest(opts: K8sOptions, run_id: str, key_hex: str) -> dict[str, Any]:
    """The Secret with the run's channel key (the controller creates it at launch)."""
    name = resource_name(run_id)
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": f"{name}-key", "namespace": opts.namespace,
                         "labels": labels(run_id)},
            "stringData": {SECRET_KEY: key_hex}}


def to_yaml(objects: Sequence[Mapping[str, Any]]) -> str:
    """The objects as one YAML stream (``kubectl apply -f -`` reads it)."""
    import yaml

    return "".join("---\n" + yaml.safe_dump(dict(o), sort_keys=False) for o in objects)
