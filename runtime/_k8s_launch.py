"""The ``k8s`` launcher: the ranks run in the pods of an Indexed Job (``_k8s.py``), made and
watched with the official ``kubernetes`` client.

``K8sLauncher(options).launch(n)`` returns the same :class:`Workers` as the other launchers.
What it does, in order:

1. **Access.** The kubeconfig (``$KUBECONFIG`` or ``~/.kube/config``), or the pod's service
   account when the controller runs in the cluster; the namespace must exist. A missing
   config, a refused credential, a missing namespace: one error each, before anything exists.
2. **Objects.** The Job first, then the headless Service and the Secret with the channel key,
   both owned by the Job (``ownerReferences``): deleting the Job deletes them. The pods wait
   for the Secret (their volume) before they start.
3. **Watch.** One thread lists the run's pods (label ``meshplan.dev/run``) and watches from
   the list's ``resourceVersion``; an expired version (``410 Gone``) re-lists and goes on from
   the new one; the watch is renewed every few minutes, so no proxy timeout ends it silently.
   A pod's phase becomes its ranks' state for :class:`Workers`: a pod that failed, succeeded,
   or was deleted is its ranks' exit (``podFailurePolicy`` ignores disruptions, so an evicted
   pod is made again by the Job controller; the run in progress still sees its ranks go).
4. **Gang deadline.** Every rank must say hello within ``start_timeout_s`` (default 300 s),
   else every object is deleted and one error names the pods that did not start and why
   (unschedulable, image pull errors, waiting for a volume).
5. **Logs.** Each pod's log is streamed to the controller's stderr, each line prefixed with the
   pod's ranks.
6. **Shutdown.** The ranks are told to stop; the Job is deleted with background propagation
   (its pods, Service and Secret go with it), and the launcher waits, bounded, for the pods to
   be gone. ``meshplan k8s delete --all-mine`` sweeps what a controller killed before that
   left (every object labelled with this user as its owner).

Under fault tolerance the run's pods outlive their ranks: ``K8sPods`` (below) makes the Job
once, with each pod running its agent (``_k8s_agent.py``), and starts every launch's ranks
through the agents.

The control channel listens on TCP (CURVE, the run's keys) on this machine's address toward
the API server, or on ``k8s={"controller_host": ...}``: the pods must be able to reach it (a
controller in the cluster, or on a network the pods route to). Not built: reaching pods
through a port-forward from a laptop.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

from .._errors import RuntimeFailure
from . import _channel as P
from ._channel import ControllerChannel, Secret
from ._k8s import (
    MANAGED_BY,
    OWNER_LABEL,
    RUN_LABEL,
    TERMINATED,
    K8sOptions,
    manifests,
    owner,
    resource_name,
    secret_manifest,
)
from ._k8s_relay import Tunnels
from ._launch import RendezvousStore, WorkerFailure, Workers, _Group

__all__ = ["K8sLauncher", "K8sPods", "delete_all_mine", "logs_of_mine", "status_of_mine"]

logger = logging.getLogger("meshplan.runtime")

K8S_FIX = "pip install 'meshplan[k8s]' (the kubernetes client)"
WATCH_RENEW_S = 240          # a watch is renewed this often (servers and proxies end idle ones)
DELETE_WAIT_S = 30.0


def _clients() -> tuple[Any, Any, str]:
    """(CoreV1Api, BatchV1Api, the API server's URL) from the kubeconfig, or the service
    account in a pod."""
    try:
        from kubernetes import client, config
    except ImportError as exc:
        raise RuntimeFailure(f"launcher='k8s' needs the kubernetes client: {K8S_FIX}") from exc
    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG"):
            config.load_incluster_config()
        else:
            # $KUBECONFIG as it is now (the client reads it once, when first imported)
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG")
                                    or os.path.expanduser("~/.kube/config"))
    except Exception as exc:  # noqa: BLE001 - the config loaders raise many kinds
        where = os.environ.get("KUBECONFIG") or "~/.kube/config"
        raise RuntimeFailure(f"launcher='k8s': no usable kubeconfig ({where}: {exc}); set "
                             "$KUBECONFIG to a cluster's config (kubectl config view shows "
                             "the current one), or run the controller in a pod") from exc
    api = client.ApiClient()
    return client.CoreV1Api(api), client.BatchV1Api(api), api.configuration.host


def _api_error(exc: Exception, doing: str, namespace: str) -> RuntimeFailure:
    status = getattr(exc, "status", None)
    if status in (401, 403):
        why = (f"the cluster refused this user ({status}): it needs to create Jobs, Services "
               f"and Secrets and to list, watch and read the logs of Pods in {namespace!r}")
    elif status == 404:
        why = f"namespace {namespace!r} does not exist (kubectl create namespace {namespace})"
    elif status is None:
        why = f"the API server cannot be reached ({exc})"
    else:
        why = f"{status} {getattr(exc, 'reason', '')}: {getattr(exc, 'body', '')}"[:400]
    return RuntimeFailure(f"launcher='k8s': {doing}: {why}")


class _Pods:
    """The run's pods as the watch last saw them, by completion index, and a thread that keeps
    them so (list, then watch; re-list on 410)."""

    def __init__(self, core: Any, namespace: str, run_id: str, pods: int,
                 batch: Any = None, job: str | None = None) -> None:
        self.core, self.namespace, self.n = core, namespace, pods
        self.batch, self.job = batch, job        # the Job, read when a pod is missing
        self._job_why: str | None = None
        self._job_read = 0.0
        self.selector = f"{RUN_LABEL}={run_id.lower()}"
        self.by_index: dict[int, dict[str, Any]] = {}
        self.gone: dict[int, int] = {}            # index -> exit code it ended with
        self.ended: dict[int, str] = {}           # index -> what ended its pod
        self.old: set[str] = set()                # pods forgotten (``forget``): ignored
        self.gone_name: dict[int, str] = {}       # index -> the pod whose end ``gone`` holds
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.relists = 0
        self._thread = threading.Thread(target=self._run, name="meshplan-k8s-watch",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.rest import ApiException

        version = None
        while not self.stopped.is_set():
            try:
                if version is None:
                    listed = self.core.list_namespaced_pod(self.namespace,
                                                           label_selector=self.selector)
                    for pod in listed.items:
                        self._see("MODIFIED", pod)
                    version = listed.metadata.resource_version
                w = watch.Watch()
                for event in w.stream(self.core.list_namespaced_pod, self.namespace,
                                      label_selector=self.selector, resource_version=version,
                                      allow_watch_bookmarks=True,
                                      timeout_seconds=WATCH_RENEW_S):
                    if self.stopped.is_set():
                        w.stop()
                        break
                    if event["type"] != "BOOKMARK":
                        self._see(event["type"], event["object"])
                    version = w.resource_version or version
            except ApiException as exc:
                if exc.status == 410:            # expired: list again, watch from there
                    self.relists += 1
                    version = None
                    continue
                logger.warning("meshplan: watching the pods failed (%s); trying again", exc)
                self.stopped.wait(1.0)
            except Exception as exc:  # noqa: BLE001 - a dropped connection: watch again
                if not self.stopped.is_set():
                    logger.debug("meshplan: the pod watch ended (%s); watching again", exc)
                    self.stopped.wait(0.5)

    def _see(self, kind: str, pod: Any) -> None:
        labels = pod.metadata.labels or {}
        try:
            index = int(labels.get("batch.kubernetes.io/job-completion-index", ""))
        except ValueError:
            return
        with self.lock:
            held = self.by_index.get(index)
            if pod.metadata.name in self.old or (
                    held is not None and held["name"] != pod.metadata.name
                    and kind == "DELETED"):
                return                           # an older pod of this index
            phase = "Deleted" if kind == "DELETED" else (pod.status.phase or "Pending")
            self.by_index[index] = {"name": pod.metadata.name, "phase": phase,
                                    "why": _why_waiting(pod), "pod": pod}
            going = pod.metadata.deletion_timestamp is not None   # Terminating: SIGTERM next
            if (going or phase in ("Failed", "Succeeded", "Deleted")) and index not in self.gone:
                self.gone[index] = TERMINATED if going and phase in ("Pending", "Running") \
                    else _exit_code(pod, phase)
                self.ended[index] = _why_ended(pod, phase)
                self.gone_name[index] = pod.metadata.name

    def exit_code(self, index: int) -> int | None:
        """The code pod ``index`` ended with, None while it runs or is still to come. A pod
        that is not there (written off by ``forget``, or never made) once the Job has failed
        will not come: it counts as ended, with the Job's failure as its reason."""
        with self.lock:
            code = self.gone.get(index)
            missing = code is None and self.by_index.get(index, {}).get("phase") in (
                None, "Pending")
        if not missing or self.job_failed() is None:
            return code
        with self.lock:
            if index not in self.gone:
                self.gone[index] = 1
                self.ended[index] = (f"{self._job_why}; no pod of index {index} will run")
            return self.gone[index]

    def job_failed(self, fresh: bool = False) -> str | None:
        """Why the Job failed (its ``Failed`` condition: a pod's exit that the
        ``podFailurePolicy`` fails it on, the backoff limit, the active deadline), or None
        while it has not. Read from the API at most once a second, unless ``fresh``."""
        now = time.monotonic()
        if self._job_why is None and self.job is not None and (
                fresh or now - self._job_read >= 1.0):
            self._job_read = now
            try:
                job = self.batch.read_namespaced_job(self.job, self.namespace,
                                                     _request_timeout=5)
            except Exception:  # noqa: BLE001 - deleted or unreachable: the pods tell the rest
                return None
            for c in (job.status.conditions or []) if job.status else []:
                # (since 1.31 FailureTarget comes first, Failed once every pod has ended)
                if c.type in ("Failed", "FailureTarget") and c.status == "True":
                    self._job_why = (f"Job {self.namespace}/{self.job} failed ({c.reason}"
                                     + (f": {c.message}" if c.message else "") + ")")
        return self._job_why

    def forget(self, index: int) -> str | None:
        """Pod ``index`` ended and the Job makes another in its place (it may have already):
        forget the one that ended (its events are ignored from now on). Returns its name."""
        with self.lock:
            name = self.gone_name.pop(index, None)
            self.gone.pop(index, None)
            self.ended.pop(index, None)
            if name is not None:
                self.old.add(name)
                if self.by_index.get(index, {}).get("name") == name:
                    del self.by_index[index]
            return name

    def not_started(self) -> list[str]:
        """'<pod>: why' for every pod not Running yet (or never seen)."""
        out = []
        with self.lock:
            for i in range(self.n):
                held = self.by_index.get(i)
                if held is None:
                    out.append(f"pod {i}: not created (the Job controller made no pod; a "
                               "quota or admission webhook may have refused it: kubectl "
                               "describe job)")
                elif held["phase"] != "Running":
                    out.append(f"{held['name']}: {held['phase']}"
                               + (f" ({held['why']})" if held["why"] else ""))
        return out

    def names(self) -> list[str]:
        with self.lock:
            return [v["name"] for v in self.by_index.values()]

    def stop(self) -> None:
        self.stopped.set()


def _why_waiting(pod: Any) -> str:
    status = pod.status
    bits = []
    for cond in (status.conditions or []) if status else []:
        if cond.status == "False" and cond.reason:
            bits.append(f"{cond.reason}: {cond.message or ''}".strip(": "))
    for cs in (status.container_statuses or []) if status else []:
        waiting = cs.state.waiting if cs.state else None
        if waiting is not None and waiting.reason:
            bits.append(f"{waiting.reason}: {waiting.message or ''}".strip(": "))
    return "; ".join(bits)


def _why_ended(pod: Any, phase: str) -> str:
    """One line on how a pod ended: evicted or preempted (its DisruptionTarget condition),
    deleted, or its container's end (OOMKilled, Error, Completed)."""
    name, status = pod.metadata.name, pod.status
    for cond in (status.conditions or []) if status else []:
        if cond.type == "DisruptionTarget" and cond.status == "True":
            return (f"pod {name} was disrupted ({cond.reason or 'DisruptionTarget'}: evicted, "
                    "preempted or its node drained); its ranks went with it")
    if pod.metadata.deletion_timestamp is not None or phase == "Deleted":
        return (f"pod {name} was deleted (kubectl delete pod, or its Job was, or the Job "
                "failed); its ranks went with it")
    for cs in (status.container_statuses or []) if status else []:
        term = cs.state.terminated if cs.state else None
        if term is not None:
            said = f": {term.message.strip()}" if term.message else ""
            return (f"pod {name} {phase.lower()}: its container ended ({term.reason}, exit "
                    f"{term.exit_code}{said})")
    return f"pod {name} {phase.lower()}"


def _exit_code(pod: Any, phase: str) -> int:
    for cs in (pod.status.container_statuses or []) if pod.status else []:
        term = cs.state.terminated if cs.state else None
        if term is not None and term.exit_code is not None:
            return int(term.exit_code)
    return 0 if phase == "Succeeded" else 137          # deleted, evicted: killed


class _PodRank:
    """What :class:`Workers` sees of one rank: the state of the pod that runs it."""

    stdin = None

    def __init__(self, pods: _Pods, index: int, group: _K8sGroup, ranks: range) -> None:
        self.pods, self.index, self.group = pods, index, group
        self.ranks = ranks                 # the ranks of its pod
        self.pid: int | None = None
        self.local = False                 # another host: only the pod's end ends it
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.pods.exit_code(self.index)
        return self.returncode

    @property
    def ended(self) -> str | None:
        """How its pod ended, and the pod's ranks, which went with it (``Workers`` adds it to
        the failure's message: which of them was seen to end first is chance)."""
        with self.pods.lock:
            why = self.pods.ended.get(self.index)
        if why is None:
            return None
        ranks = list(self.ranks)
        return (f"{why} (the pod ran rank{'s' if len(ranks) > 1 else ''} "
                f"{', '.join(map(str, ranks))})")

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                import subprocess
                raise subprocess.TimeoutExpired("pod", timeout)
            time.sleep(0.05)
        return self.returncode or 0

    def terminate(self) -> None:
        self.group.delete()

    kill = terminate


class _K8sGroup(_Group):
    """A launch's pods: stopping it deletes the Job (and with it the pods, the Service and
    the Secret) and waits, bounded, until the pods are gone."""

    def __init__(self, channel: ControllerChannel, store: RendezvousStore, batch: Any,
                 namespace: str, name: str) -> None:
        super().__init__(channel, store)
        self.batch, self.namespace, self.name = batch, namespace, name
        self.pods: _Pods | None = None
        self.tunnels: Tunnels | None = None     # reach="port-forward": the pods' relays
        self._deleted = False
        self.waiting: list[str] = []        # the pods not running when it was stopped

    def delete(self) -> None:
        if self._deleted:
            return
        self._deleted = True
        from kubernetes.client import V1DeleteOptions
        from kubernetes.client.rest import ApiException
        try:
            self.batch.delete_namespaced_job(
                self.name, self.namespace,
                body=V1DeleteOptions(propagation_policy="Background", grace_period_seconds=5))
        except ApiException as exc:
            if exc.status != 404:
                logger.warning("meshplan: deleting Job %s/%s failed (%s); delete it with "
                               "meshplan k8s delete --all-mine", self.namespace, self.name,
                               exc.status)
        except Exception as exc:  # noqa: BLE001 - the API server gone: say what is left
            logger.warning("meshplan: could not delete Job %s/%s (%s); delete it with "
                           "meshplan k8s delete --all-mine", self.namespace, self.name, exc)

    def stop(self, grace_s: float = 2.0) -> None:
        if self.closed:
            return
        self.closed = True
        if self.pods is not None:
            self.waiting = self.pods.not_started()
        self.delete()
        deadline = time.monotonic() + DELETE_WAIT_S
        seen = set() if self.pods is None else set(self.pods.by_index)
        for proc in self.procs:
            if getattr(proc, "index", None) not in seen:
                continue                  # its pod was never made: nothing to wait for
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - bounded: what is left, the sweep removes
                break
        if self.pods is not None:
            self.pods.stop()
        if self.tunnels is not None:
            self.tunnels.close()
        self.close_ends()


class K8sLauncher:
    """Start ``n`` ranks in the pods of a Kubernetes Job; see the module docstring."""

    def __init__(self, options: K8sOptions | Mapping[str, Any], *,
                 start_timeout_s: float = 300.0) -> None:
        self.options = K8sOptions.parse(options)
        self.start_timeout_s = start_timeout_s

    def launch(self, n: int, *, env: Mapping[str, str] | None = None,
               cwd: str | os.PathLike | None = None) -> Workers:
        return self.make(n, env)

    def make(self, n: int, env: Mapping[str, str] | None = None, *, agent: bool = False
             ) -> Workers:
        """The Job, Service and Secret for ``n`` ranks, and their workers once every one
        has said hello: the ranks, or with ``agent`` the pods' agents (one per pod, rank =
        the pod's index; ``K8sPods`` starts the ranks through them)."""
        from kubernetes.client.rest import ApiException

        opts = self.options
        if opts.kind != "Job":
            raise RuntimeFailure(
                f"launcher='k8s' runs Indexed Jobs; k8s={{'kind': {opts.kind!r}}} is for "
                "meshplan k8s manifest --kind JobSet (printed to apply yourself: a controller "
                "attaching to pods it did not make is not built yet)")
        pods_n, per = opts.layout(n)
        core, batch, url = _clients()
        ns = opts.namespace
        try:
            core.read_namespace(ns)
        except ApiException as exc:
            if exc.status not in (401, 403):     # may not read namespaces: creating says
                raise _api_error(exc, f"checking namespace {ns!r}", ns) from exc
        except Exception as exc:  # noqa: BLE001 - urllib3's connection errors
            raise _api_error(exc, "reaching the API server", ns) from exc
        secret, run_id = Secret.new(), secrets.token_hex(8)
        outside = opts.reach == "port-forward"
        # outside the cluster nothing connects here but the tunnels: listen on loopback
        host = "127.0.0.1" if outside else opts.controller_host or _address_toward(url)
        group = _K8sGroup(ControllerChannel(secret, run_id, host, transport="tcp"),
                          RendezvousStore(host), batch, ns, resource_name(run_id))
        extra = {k: v for k, v in (env or {}).items()}
        job, service = manifests(opts, world=n, run_id=run_id, address=group.channel.address,
                                 store=(host, group.store.port),
                                 controller_host=socket.gethostname(), extra_env=extra,
                                 agent=agent)
        try:
            try:
                made = batch.create_namespaced_job(ns, job)
            except ApiException as exc:
                raise _api_error(exc, "creating the Job", ns) from exc
            group.pods = _Pods(core, ns, run_id, pods_n, batch, made.metadata.name)
            if outside:                # each pod's relay, through a port-forward
                group.tunnels = Tunnels(group.pods, _port_forwarder(ns), secret.hex().encode(),
                                        opts.relay_port, self.start_timeout_s)
                group.tunnels.expose("channel", _endpoint(group.channel.address))
                group.tunnels.expose("store", (host, group.store.port))
            owned = [{"apiVersion": "batch/v1", "kind": "Job", "name": made.metadata.name,
                      "uid": made.metadata.uid, "controller": False,
                      "blockOwnerDeletion": True}]
            service["metadata"]["ownerReferences"] = owned
            key = secret_manifest(opts, run_id, secret.hex())
            key["metadata"]["ownerReferences"] = owned
            try:
                core.create_namespaced_service(ns, service)
                core.create_namespaced_secret(ns, key)
            except ApiException as exc:
                raise _api_error(exc, "creating the Service and Secret", ns) from exc
            indexes = range(pods_n) if agent else [r // per for r in range(n)]
            group.procs = [_PodRank(group.pods, i, group, range(i * per, min(n, i * per + per)))
                           for i in indexes]
            workers = Workers(group, run_id=run_id, master_addr=host,
                              master_port=group.store.port, log_dir=None)
            _stream_logs(core, ns, group, per)
            try:
                hellos = workers.gather(P.HELLO, timeout_s=self.start_timeout_s)
            except WorkerFailure as exc:
                group.stop()
                waiting = group.waiting
                if exc.reason == "timeout" and waiting:
                    raise RuntimeFailure(
                        f"launcher='k8s': not every pod of Job {ns}/{made.metadata.name} "
                        f"started within {self.start_timeout_s:g} s (start_timeout_s); "
                        "everything was deleted. Not started:\n  " + "\n  ".join(waiting)
                    ) from exc
                raise
        except BaseException:
            group.stop()
            raise
        _met(workers, hellos)
        return workers


TERM_SETTLE_S = 2.0   # how long a rank's SIGTERM exit waits for its pod's end to be watched


class _AgentRank:
    """What :class:`Workers` sees of one rank that a pod's agent runs (``K8sPods``): its
    exit and whether it is stopped, which the controller on another host learns from the
    agent (asked when the rank's control connection ends, or its heartbeats stop), or from
    its pod's end."""

    stdin = None
    local = False

    def __init__(self, pods: K8sPods, channel: ControllerChannel, rank: int, index: int
                 ) -> None:
        self.pods, self.channel, self.rank, self.index = pods, channel, rank, index
        self.pid: int | None = None
        self.returncode: int | None = None
        self._asked = -math.inf
        self._stopped = False

    def _ask(self, every_s: float) -> None:
        now = time.monotonic()
        if now - self._asked < every_s:
            return
        self._asked = now
        reply = self.pods.ask(self.index, "pod_poll", {"ranks": [self.rank]})
        if reply is None:
            return
        state = reply["ranks"][str(self.rank)]
        if state.get("code") is not None:
            self.returncode = int(state["code"])
        self._stopped = bool(state.get("stopped"))

    def poll(self) -> int | None:
        if self.returncode is None:
            code = self.pods.pod_code(self.index)        # the pod ended, its ranks with it
            if code is not None:
                self.returncode = code
            elif self.rank in self.channel.ended:      # exited, or closed its connection
                self._ask(0.1)
        return self.returncode

    def stopped(self) -> bool:
        """Whether the rank is stopped (SIGSTOP): asked of the agent at most once a second,
        once its heartbeats have paused (a stopped process cannot beat; a rank on the
        controller's host does not beat at all)."""
        beat = self.channel.last_beat.get(self.rank)
        if self.returncode is not None or (
                beat is not None and time.monotonic() - beat < 2.5 * P.BEAT_INTERVAL_S):
            return False
        self._ask(1.0)
        return self._stopped

    @property
    def ended(self) -> str | None:
        """How this rank's pod ended, or None. A rank ended by SIGTERM is what the kubelet
        does to a pod that is evicted, preempted or deleted, and its agent may report the
        rank's exit before the pod's watch event comes: wait for that event up to
        ``TERM_SETTLE_S``, so the failure (and a recovery's choice) knows the pod is gone."""
        why = self.pods.pod_ended(self.index)
        if why is None and self.returncode in (143, -15):
            deadline = time.monotonic() + TERM_SETTLE_S
            while why is None and time.monotonic() < deadline:
                time.sleep(0.05)
                why = self.pods.pod_ended(self.index)
        return why

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                import subprocess
                raise subprocess.TimeoutExpired(f"rank {self.rank}", timeout)
            self._ask(0.1)
            time.sleep(0.05)
        return self.returncode or 0

    def kill(self) -> None:
        reply = self.pods.ask(self.index, "pod_kill", {"ranks": [self.rank]})
        if self.returncode is None:
            code = None if reply is None else reply["codes"].get(str(self.rank))
            self.returncode = 137 if code is None else int(code)

    terminate = kill


class _Spares:
    """What ``Workers.keep_spare`` holds for the pods' spares: they live in the agents, which
    hand one to ``pod_start`` themselves (no stdin here to tell it a rank)."""

    stdin = None

    def poll(self) -> int | None:
        return None


class _AgentGroup(_Group):
    """One launch of ranks through the pods' agents: stopping it kills the ranks (through
    the agents) and closes the ranks' channel; the pods stay (``K8sPods.close`` ends them)."""

    def __init__(self, channel: ControllerChannel, store: RendezvousStore, pods: K8sPods,
                 start: dict[str, Any]) -> None:
        super().__init__(channel, store)
        self.k8s, self.start = pods, start

    def stop(self, grace_s: float = 2.0) -> None:
        if self.closed:
            return
        self.closed = True
        self.k8s.kill_ranks()
        self.close_ends()


class K8sPods:
    """``launcher="k8s"`` under fault tolerance: pods that outlive their ranks. The first
    ``launch`` makes the Job with each pod running its agent (``_k8s_agent.py``: the pod's
    snapshot keeper, which starts its ranks when told), and every launch (the first, and a
    restart of every rank after a failure) starts the ranks through the agents on a fresh
    channel; ``Workers.respawn`` starts one rank again in its pod. The ranks' snapshots live
    in their pod's agent (``MeshSnapshots`` with the agents as its keepers), so a rank's
    replacement reads its state back there. A lost pod (evicted: the Job makes another of
    its index) is written off (``lose``) and its successor's agent waited for (``replace``)
    before the mesh starts again. ``close`` ends the pods (deletes the Job)."""

    def __init__(self, options: K8sOptions | Mapping[str, Any], *,
                 start_timeout_s: float = 300.0) -> None:
        self.launcher = K8sLauncher(options, start_timeout_s=start_timeout_s)
        self.agents: Workers | None = None
        self.world: int | None = None
        self._lock = threading.Lock()
        self.waiting: set[int] = set()        # pods lost, their successors not yet here
        self.lost_why: list[str] = []         # how each pod written off ended

    @property
    def per(self) -> int:
        assert self.world is not None
        return self.launcher.options.layout(self.world)[1]

    def hosts(self, world: int) -> list[str]:
        """Every rank's "host" (its pod) for the snapshot keepers: ``pod<index>``."""
        per = self.launcher.options.layout(world)[1]
        return [f"pod{r // per}" for r in range(world)]

    def launch(self, n: int, *, env: Mapping[str, str] | None = None,
               cwd: str | os.PathLike | None = None) -> Workers:
        if self.agents is None:
            self.agents = self.launcher.make(n, env, agent=True)
            self.agents.keep_on_failure = True     # a pod's end is the ranks' to report
            self.world = n
        elif n != self.world:
            raise RuntimeFailure(f"launcher='k8s': the run's pods hold {self.world} ranks; a "
                                 f"mesh of {n} cannot start in them")
        agents, per = self.agents, self.per
        host = agents.master_addr
        secret, run_id = Secret.new(), secrets.token_hex(8)
        start = {"address": "", "run_id": run_id, "key": secret.hex(), "world": n, "per": per,
                 "env": dict(env or {})}
        group = _AgentGroup(ControllerChannel(secret, run_id, host, transport="tcp"),
                            RendezvousStore(host), self, start)
        start.update(address=group.channel.address, store=[host, group.store.port])
        group.channel.sees_drops = True     # the agents tell a closed connection from an exit
        tunnels = agents._group.tunnels
        if tunnels is not None:             # outside the cluster: through each pod's relay
            tunnels.expose(f"channel-{run_id}", _endpoint(group.channel.address))
            tunnels.expose(f"store-{run_id}", (host, group.store.port))
        try:
            for i in range(len(agents._group.procs)):
                agents.send(i, "pod_start", {
                    **self._start_for(group, i),
                    "ranks": list(range(i * per, min(n, i * per + per)))})
            agents.gather("pod_start", self.launcher.start_timeout_s)
            group.procs = [_AgentRank(self, group.channel, r, r // per) for r in range(n)]
            group.respawn = lambda rank: self._respawn(group, rank)
            group.start_spare = lambda: self._spares(group)
            workers = Workers(group, run_id=run_id, master_addr=host,
                              master_port=group.store.port, log_dir=None)
            hellos = workers.gather(P.HELLO, timeout_s=self.launcher.start_timeout_s)
        except BaseException:
            group.stop()
            raise
        _met(workers, hellos)
        return workers

    def _start_for(self, group: _AgentGroup, index: int) -> dict[str, Any]:
        """The launch's ``pod_start`` header for pod ``index``: outside the cluster, the
        channel's and store's addresses are the ports its relay exposes them on."""
        tunnels = self.agents._group.tunnels if self.agents is not None else None
        if tunnels is None:
            return dict(group.start)
        run = group.start["run_id"]
        return {**group.start,
                "address": f"tcp://127.0.0.1:{tunnels.port(index, f'channel-{run}')}",
                "store": ["127.0.0.1", tunnels.port(index, f"store-{run}")]}

    def _respawn(self, group: _AgentGroup, rank: int) -> _AgentRank:
        index = rank // self.per
        reply = self.ask(index, "pod_start", {**self._start_for(group, index), "ranks": [rank]},
                         timeout_s=30.0)
        if reply is None:
            raise RuntimeFailure(f"launcher='k8s': the agent of pod {index} did not start "
                                 f"rank {rank} again ({self.pod_ended(index) or 'no answer'})")
        proc = _AgentRank(self, group.channel, rank, index)
        proc.pid = int(reply["pids"][str(rank)])
        return proc

    def _spares(self, group: _AgentGroup) -> _Spares:
        """Every pod's agent keeps a warm spare of this launch (``Workers.keep_spare``, once
        the ranks are set up and after each replacement); a replacement takes it there."""
        for index in range(len(self.agents._group.procs) if self.agents else 0):
            self.ask(index, "pod_spare", self._start_for(group, index))
        return _Spares()

    def ask(self, index: int, kind: str, header: dict[str, Any], timeout_s: float = 5.0
            ) -> dict[str, Any] | None:
        """Ask pod ``index``'s agent ``kind``; its reply's header, or None when it cannot
        answer (its pod is gone, or it did not answer within ``timeout_s``)."""
        agents = self.agents
        if agents is None or agents.closed or self.pod_code(index) is not None:
            return None
        with self._lock:
            nonce = secrets.token_hex(8)
            try:
                agents.channel.send(index, kind, {**header, "nonce": nonce})
            except RuntimeFailure:
                return None
            deadline = time.monotonic() + timeout_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    rank, message = agents.channel.recv(left)
                except TimeoutError:
                    break
                if message.kind == P.HELLO:          # a pod's successor, up meanwhile
                    agents.stash_hello(rank, message)
                elif rank == index and message.header.get("nonce") == nonce:
                    return message.header if message.kind == kind else None
            return None

    def pod_code(self, index: int) -> int | None:
        """The exit code pod ``index`` ended with (its agent's), or None while it runs."""
        group = None if self.agents is None else self.agents._group
        pods = getattr(group, "pods", None)
        return None if pods is None else pods.exit_code(index)

    def pod_ended(self, index: int) -> str | None:
        """How pod ``index`` ended, naming its ranks (``_PodRank.ended``), or None."""
        if self.agents is None:
            return None
        return self.agents._group.procs[index].ended

    def lost(self) -> list[int]:
        """The pods that ended (evicted, deleted, failed)."""
        if self.agents is None:
            return []
        return [i for i in range(len(self.agents._group.procs)) if self.pod_code(i) is not None]

    def lose(self) -> list[str]:
        """The pods that ended (``lost``) are written off: their agents' places wait for the
        pods the Job makes instead (an evicted or preempted pod: ``podFailurePolicy``
        ignores disruptions), which ``replace`` waits for. Returns their names."""
        agents = self.agents
        if agents is None:
            return []
        group = agents._group
        names = []
        for index in self.lost():
            why = self.pod_ended(index)
            if why is not None:
                self.lost_why.append(why)
            names.append(group.pods.forget(index) or f"pod {index}")
            group.procs[index] = _PodRank(group.pods, index, group, group.procs[index].ranks)
            agents.channel.forget(index)
            agents.channel.last_beat.pop(index, None)
            self.waiting.add(index)
        return names

    def why_lost(self) -> str:
        """How the pods written off ended, and the Job's failure when it failed (then no
        pod takes their place): for an error that says the run cannot go on."""
        pods = None if self.agents is None else self.agents._group.pods
        failed = None if pods is None else pods.job_failed(fresh=True)
        return "; ".join(self.lost_why + ([f"{failed}: no pod takes their place"]
                                          if failed else []))

    def replace(self) -> None:
        """Wait (``start_timeout_s``) until every pod written off (``lose``) has a successor
        whose agent said hello; else one error naming them and why they did not start."""
        agents, waiting = self.agents, sorted(self.waiting)
        if agents is None or not waiting:
            return
        try:
            hellos = agents.gather(P.HELLO, self.launcher.start_timeout_s, ranks=waiting)
        except WorkerFailure as exc:
            pods = agents._group.pods
            failed = None if pods is None else pods.job_failed()
            if failed is not None:
                raise RuntimeFailure(
                    f"launcher='k8s': {failed}, so no pod takes the place of lost pod"
                    f"{'s' * (len(waiting) > 1)} {', '.join(map(str, waiting))} and the run "
                    "cannot go on (the Job fails on a pod's exit other than a disruption, a "
                    "deletion or a kill: kubectl describe job, and the pods' logs)") from exc
            why = [] if pods is None else pods.not_started()
            raise RuntimeFailure(
                f"launcher='k8s': no pod took the place of lost pod{'s' * (len(waiting) > 1)} "
                f"{', '.join(map(str, waiting))} within {self.launcher.start_timeout_s:g} s "
                "(start_timeout_s; the Job makes one for an evicted, preempted, deleted or "
                "killed pod)" + (":\n  " + "\n  ".join(why) if why else "")
                + f"\n  {str(exc).splitlines()[0]}") from exc
        _met(agents, hellos, waiting)
        self.waiting.clear()
        self.lost_why.clear()

    def kill_ranks(self) -> None:
        """Kill every rank in every pod that still runs (a mesh stopping)."""
        if self.agents is None:
            return
        for i in range(len(self.agents._group.procs)):
            self.ask(i, "pod_kill", {})

    def close(self) -> None:
        """End the run's pods: the agents exit (their ranks with them), the Job is deleted."""
        agents, self.agents = self.agents, None
        if agents is not None:
            agents.shutdown(timeout_s=5.0)



def _met(workers: Workers, hellos: list[Any], ranks: list[int] | None = None) -> None:
    """What the hellos of ``ranks`` (default: every one) say: each process's pid and host;
    one on another host than this one beats from now on (``_worker``)."""
    group = workers._group
    ranks = list(range(len(group.procs))) if ranks is None else ranks
    here, now = socket.gethostname(), time.monotonic()
    names = list(workers.hostnames) or [""] * len(group.procs)
    for rank, hello in zip(ranks, hellos):
        group.procs[rank].pid = int(hello.header["pid"])
        names[rank] = str(hello.header.get("hostname"))
        if names[rank] != here:
            group.channel.last_beat.setdefault(rank, now)
    workers.pids = tuple(p.pid for p in group.procs)
    workers.hostnames = tuple(names)


def _port_forwarder(namespace: str) -> Any:
    """``open(pod, port)``: a port-forward to ``port`` of ``pod`` through the API server, a
    socket-like object. Each on an API client of its own: the client's ``portforward`` swaps
    its ``call_api`` while it connects, which would send any other call on a shared client
    (the pod watch, another port-forward) through a websocket, or leave it swapped."""
    from kubernetes import client
    from kubernetes.stream import portforward

    def open_(pod: str, port: int) -> Any:
        core = client.CoreV1Api(client.ApiClient())
        forward = portforward(core.connect_get_namespaced_pod_portforward, pod, namespace,
                              ports=str(port))
        return forward.socket(port)
    return open_


def _endpoint(address: str) -> tuple[str, int]:
    """``tcp://host:port`` -> (host, port)."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return host.strip("[]"), int(port)


def _address_toward(url: str) -> str:
    """This machine's address on the route to the API server (where pods reach it)."""
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 443
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        return P.address_toward(info[0], info[4])
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _copy_log(core: Any, namespace: str, name: str, prefix: str, follow: bool,
              write: Any) -> None:
    """Pass every line of pod ``name``'s log to ``write``, ``prefix`` in front; ``follow``:
    until the pod ends. The API's errors are the caller's."""
    resp = core.read_namespaced_pod_log(name, namespace, follow=follow, _preload_content=False)
    for line in resp:
        write(prefix + line.decode(errors="replace"))


def _stream_logs(core: Any, namespace: str, group: _K8sGroup, per: int) -> None:
    """A thread per pod, once it runs, copying its log to stderr with its ranks in front."""
    pods = group.pods
    assert pods is not None
    started: set[str] = set()

    def follow(name: str, index: int) -> None:
        prefix = (f"[rank {index * per}] " if per == 1
                  else f"[ranks {index * per}-{index * per + per - 1}] ")
        try:
            _copy_log(core, namespace, name, prefix, True, sys.stderr.write)
        except Exception:  # noqa: BLE001 - the pod went; its log ends here
            pass

    def watch_for_running() -> None:
        while not pods.stopped.is_set():
            with pods.lock:
                running = [(v["name"], i) for i, v in pods.by_index.items()
                           if v["phase"] in ("Running", "Succeeded", "Failed")
                           and v["name"] not in started]
            for name, index in running:
                started.add(name)
                t = threading.Thread(target=follow, args=(name, index), daemon=True,
                                     name=f"meshplan-k8s-log-{index}")
                t.start()
            pods.stopped.wait(0.2)
    threading.Thread(target=watch_for_running, daemon=True, name="meshplan-k8s-logs").start()


def delete_all_mine(namespace: str | None = None) -> list[str]:
    """Delete every Job, Service and Secret meshplan made for this user (label
    ``meshplan.dev/owner``), in ``namespace`` or every namespace the config allows; the
    pods go with their Jobs. Returns what was deleted, as ``kind/namespace/name``."""
    from kubernetes.client import V1DeleteOptions

    core, batch, _ = _clients()
    selector = _mine()
    done = []
    body = V1DeleteOptions(propagation_policy="Background")
    for kind, lister, deleter in (
            ("job", batch.list_namespaced_job, batch.delete_namespaced_job),
            ("service", core.list_namespaced_service, core.delete_namespaced_service),
            ("secret", core.list_namespaced_secret, core.delete_namespaced_secret)):
        for ns in _namespaces(core, namespace):
            for obj in lister(ns, label_selector=selector).items:
                deleter(obj.metadata.name, ns, body=body)
                done.append(f"{kind}/{ns}/{obj.metadata.name}")
    return done


def _mine() -> str:
    """The label selector of what meshplan made for this user."""
    return f"{OWNER_LABEL}={owner()},app.kubernetes.io/managed-by={MANAGED_BY}"


def _namespaces(core: Any, namespace: str | None) -> list[str]:
    if namespace:
        return [namespace]
    return [n.metadata.name for n in core.list_namespace().items]


def status_of_mine(namespace: str | None = None) -> list[dict[str, Any]]:
    """This user's meshplan Jobs: ``namespace``, ``job``, ``run``, ``conditions`` (those
    true; none: active) and ``pods`` (``name``, ``phase``)."""
    core, batch, _ = _clients()
    selector = _mine()
    rows = []
    for ns in _namespaces(core, namespace):
        for job in batch.list_namespaced_job(ns, label_selector=selector).items:
            run = (job.metadata.labels or {}).get(RUN_LABEL, "")
            pods = core.list_namespaced_pod(ns, label_selector=f"{RUN_LABEL}={run}").items
            conds = [c.type for c in (job.status.conditions or []) if c.status == "True"] \
                if job.status else []
            rows.append({"namespace": ns, "job": job.metadata.name, "run": run,
                         "conditions": conds,
                         "pods": [{"name": p.metadata.name,
                                   "phase": p.status.phase if p.status else None}
                                  for p in pods]})
    return rows


def logs_of_mine(namespace: str | None = None, run: str | None = None,
                 follow: bool = False, out: Any = None, *, as_json: bool = False) -> int:
    """Write the logs of this user's meshplan pods (of run ``run`` only, when given) to
    ``out`` (stdout), each line prefixed with its pod (``as_json``: one JSON object per line,
    ``{"namespace", "pod", "line"}``); ``follow``: until the pods end. Returns how many pods
    there were."""
    core, _, _ = _clients()
    out = out or sys.stdout
    selector = _mine()
    if run:
        selector += f",{RUN_LABEL}={run.lower()}"
    pods = [(ns, p.metadata.name) for ns in _namespaces(core, namespace)
            for p in core.list_namespaced_pod(ns, label_selector=selector).items]
    lock = threading.Lock()

    def write(text: str) -> None:
        with lock:
            out.write(text)

    def copy(ns: str, name: str) -> None:
        def line(text: str) -> None:
            write(json.dumps({"namespace": ns, "pod": name, "line": text.rstrip("\n")}) + "\n")

        try:
            _copy_log(core, ns, name, "" if as_json else f"[{name}] ", follow,
                      line if as_json else write)
        except Exception as exc:  # noqa: BLE001 - a pod gone, a log not there yet
            with lock:
                why = getattr(exc, "reason", exc)
                out.write(json.dumps({"namespace": ns, "pod": name, "line": None,
                                      "error": f"no log: {why}"}) + "\n" if as_json
                          else f"[{name}] (no log: {why})\n")

    threads = [threading.Thread(target=copy, args=pod, daemon=True) for pod in pods]
    for t in threads:
        t.start()
        if not follow:
            t.join()                      # one pod after the other, in order
    for t in threads:
        t.join()
    out.flush()
    return len(pods)
