"""A stand-in Kubernetes API server and kubelet on loopback, for testing ``launcher="k8s"``
without a cluster (none can run here).

It speaks the API's wire format for what the launcher uses, over plain HTTP on 127.0.0.1:
create / get / list / delete of Secrets, Services, Pods and batch/v1 Jobs in namespaces,
label selectors (``k=v``, ``k!=v``, ``k``), port-forwards to a pod (``pods/NAME/portforward``
over a websocket, the ``v4.channel.k8s.io`` channels the Python client speaks), watches
(``?watch=true``: a stream of JSON lines
``{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": ...}`` after ``resourceVersion``,
``410 Gone`` as an ERROR event when that version is older than the server keeps, bookmarks
when asked, ``timeoutSeconds``), pod logs (``follow``), ``DELETE`` with ``propagationPolicy``
(the owner's dependents by ``ownerReferences`` go too), 404 / 409 as ``Status`` objects.

Its job controller makes an Indexed Job's pods (one per completion index, labelled and owned
as the real one does); its kubelet runs each pod's container command as a local process: the
image is not pulled (``python`` is this interpreter), the pod's Secret volumes are written to
a folder of their own and the variables that point into their mount path point there (a pod
waits in ``ContainerCreating`` until its Secret exists), ``JOB_COMPLETION_INDEX`` is set, the
output is the pod's log; phases go Pending -> Running -> Succeeded / Failed with the exit
code in ``containerStatuses``. Deleting a pod sends SIGTERM, then SIGKILL after its grace.
Its Job controller applies the Job's ``podFailurePolicy`` when a pod fails (``Ignore``:
the index made again; ``FailJob``, or ``backoffLimit`` spent: the Job gets its ``Failed``
condition and its running pods are deleted) and completes the Job when every index succeeded.
A Job's running pod that is deleted goes as through the real job-tracking finalizer:
Terminating until its process ends, then Failed / Succeeded, then gone.
A test can ask for pods that never schedule (``unschedulable``), an image that cannot be
pulled (``bad_images``) or evict a running pod (``evict``).

On the hosts of a sandbox (``runtime/_sandbox.py``): ``python _k8s_standin.py SANDBOX ROOT``
serves on the sandbox's controller host (run it there) and starts pod ``i`` on host ``i mod
hosts`` (in its namespaces, through ``nsenter``), keeping its files under ``ROOT`` (a folder
every host sees); it prints its kubeconfig's path, and stops when its stdin closes.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import itertools
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

_KINDS = {  # plural -> (apiVersion, kind)
    "secrets": ("v1", "Secret"), "services": ("v1", "Service"), "pods": ("v1", "Pod"),
    "jobs": ("batch/v1", "Job"),
}
_PATH = re.compile(r"^/(?:api/v1|apis/batch/v1)/namespaces/([^/]+)/([a-z]+)(?:/([^/]+))?"
                   r"(?:/(log))?$")
KEEP_EVENTS = 1000
_VERBS = ["create", "delete", "get", "list", "watch"]
_RESOURCES = {  # group version -> its resources, as discovery lists them (kubectl reads them)
    "v1": [("pods", "pod", "Pod", ["po"]), ("services", "service", "Service", ["svc"]),
           ("secrets", "secret", "Secret", []), ("namespaces", "namespace", "Namespace", ["ns"])],
    "batch/v1": [("jobs", "job", "Job", [])],
}


def _discovery(path: str, url: str) -> dict | None:
    """The legacy discovery documents (``/version``, ``/api``, ``/apis``, ``/api/v1``,
    ``/apis/batch/v1``), for kubectl."""
    if path == "/version":
        return {"major": "1", "minor": "37", "gitVersion": "v1.37.0-standin",
                "platform": "linux/amd64"}
    if path == "/api":
        return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
            {"clientCIDR": "0.0.0.0/0", "serverAddress": url.removeprefix("http://")}]}
    if path == "/apis":
        gv = {"groupVersion": "batch/v1", "version": "v1"}
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
            {"name": "batch", "versions": [gv], "preferredVersion": gv}]}
    gv = {"/api/v1": "v1", "/apis/batch/v1": "batch/v1"}.get(path)
    if gv is None:
        return None
    resources = []
    for plural, singular, kind, short in _RESOURCES[gv]:
        resources.append({"name": plural, "singularName": singular, "kind": kind,
                          "namespaced": plural != "namespaces", "shortNames": short,
                          "verbs": ["get", "list"] if plural == "namespaces" else _VERBS})
        if plural == "pods":
            resources.append({"name": "pods/log", "singularName": "", "kind": "Pod",
                              "namespaced": True, "verbs": ["get"]})
            resources.append({"name": "pods/portforward", "singularName": "",
                              "kind": "PodPortForwardOptions", "namespaced": True,
                              "verbs": ["create", "get"]})
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv,
            "resources": resources}


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


def _ws_send(sock, lock: threading.Lock, opcode: int, payload: bytes) -> None:
    """One websocket frame from the server (unmasked)."""
    n = len(payload)
    head = bytes([0x80 | opcode]) + (bytes([n]) if n < 126 else
                                      b"\x7e" + n.to_bytes(2, "big") if n < 1 << 16 else
                                      b"\x7f" + n.to_bytes(8, "big"))
    with lock:
        sock.sendall(head + payload)


def _ws_recv(rfile) -> tuple[int, bytes] | None:
    """One websocket frame from the client (masked): (opcode, payload), None at EOF."""
    head = rfile.read(2)
    if len(head) < 2:
        return None
    n = head[1] & 0x7F
    if n == 126:
        n = int.from_bytes(rfile.read(2), "big")
    elif n == 127:
        n = int.from_bytes(rfile.read(8), "big")
    mask = rfile.read(4) if head[1] & 0x80 else b"\0\0\0\0"
    data = rfile.read(n)
    if len(data) < n:
        return None
    keys = (mask * (n // 4 + 1))[:n]
    return head[0] & 0x0F, (int.from_bytes(data, "big") ^ int.from_bytes(keys, "big")
                            ).to_bytes(n, "big")


def _forward(rfile, sock, address: str, ports: list[int], asked: list[int]) -> None:
    """The port-forward streams of one websocket (``Handler._portforward``): ``asked`` the
    ports the client named, ``ports`` where they are here."""
    import socket as socket_

    lock = threading.Lock()
    conns: list = []
    for i, (port, named) in enumerate(zip(ports, asked)):
        number = named.to_bytes(2, "little")
        _ws_send(sock, lock, 2, bytes([2 * i]) + number)
        _ws_send(sock, lock, 2, bytes([2 * i + 1]) + number)
        try:
            conns.append(socket_.create_connection((address, port), timeout=5))
            conns[-1].settimeout(None)
        except OSError as exc:
            _ws_send(sock, lock, 2, bytes([2 * i + 1]) + (
                f"error forwarding port {port} to pod: dial tcp {address}:{port}: "
                f"{exc.strerror or exc}").encode())
            _ws_send(sock, lock, 8, b"")
            for c in conns:
                c.close()
            return

    def pump(i: int, conn) -> None:      # the pod's bytes to the client
        try:
            while data := conn.recv(1 << 16):
                _ws_send(sock, lock, 2, bytes([2 * i]) + data)
        except OSError:
            pass
        try:
            _ws_send(sock, lock, 8, b"")         # the connection ended: so does the stream
        except OSError:
            pass

    for i, conn in enumerate(conns):
        threading.Thread(target=pump, args=(i, conn), daemon=True).start()
    try:
        while (frame := _ws_recv(rfile)) is not None:
            opcode, data = frame
            if opcode == 8:
                break
            if opcode == 9:
                _ws_send(sock, lock, 10, data)
            elif opcode == 2 and data and data[0] % 2 == 0 and data[0] // 2 < len(conns):
                conns[data[0] // 2].sendall(data[1:])
    except OSError:
        pass
    finally:
        for conn in conns:
            try:
                conn.shutdown(socket_.SHUT_RDWR)
            except OSError:
                pass
            conn.close()


def _rule_matches(rule: dict, pod: dict) -> bool:
    """Whether a ``podFailurePolicy`` rule matches a failed pod: one of its
    ``onPodConditions`` (type, status default True) is on the pod, or ``onExitCodes`` (the
    named container's or any container's non-zero exit ``In`` / ``NotIn`` the values)."""
    conds = pod["status"].get("conditions", [])
    for want in rule.get("onPodConditions", []):
        if any(c["type"] == want["type"] and c["status"] == want.get("status", "True")
               for c in conds):
            return True
    codes = rule.get("onExitCodes")
    if codes is None:
        return False
    for cs in pod["status"].get("containerStatuses", []):
        term = cs.get("state", {}).get("terminated")
        if term is None or term["exitCode"] == 0 or codes.get("containerName") not in (
                None, cs["name"]):
            continue
        if (term["exitCode"] in codes["values"]) == (codes["operator"] == "In"):
            return True
    return False


def _matches(labels: dict, selector: str | None) -> bool:
    for term in filter(None, (selector or "").split(",")):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k) == v:
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k) != v:
                return False
        elif term not in labels:
            return False
    return True


class StandIn:
    """The server, its objects and its kubelet. ``with StandIn() as k: k.kubeconfig``."""

    def __init__(self, namespaces=("default",), *, host: str = "127.0.0.1",
                 place=None, root: str | None = None, pod_address=None) -> None:
        """``place(index, argv) -> argv``: how pod ``index``'s command starts (default: here);
        ``root``: the folder to keep pods' files in (default: a temporary one);
        ``pod_address(index)``: where a port-forward to pod ``index`` connects (default:
        127.0.0.1, the pods' processes run here)."""
        self.namespaces = set(namespaces)
        self.objects: dict[str, dict[tuple[str, str], dict]] = {p: {} for p in _KINDS}
        self.events: list[tuple[int, str, str, dict]] = []   # (rv, plural, type, object)
        self._rv = itertools.count(1)
        self.rv = 0
        self.lock = threading.Condition()
        self.procs: dict[tuple[str, str], subprocess.Popen] = {}
        self.unschedulable = False
        self.bad_images: set[str] = set()
        self.pod_quota: int | None = None     # pods the namespace's quota admits (None: any)
        self.keep_events = KEEP_EVENTS        # older versions than these are 410 Gone
        self.watch_epoch = 0                  # end_watches() ends every open watch
        self.root = tempfile.mkdtemp(prefix="k8s-standin-", dir=root)
        self.place = place
        self.pod_address = pod_address or (lambda index: "127.0.0.1")
        self.port_shift = 1 if pod_address is None else 0
        self.requests: list[tuple[str, str]] = []
        self._closing = False
        self.server = ThreadingHTTPServer((host, 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self.kubeconfig = os.path.join(self.root, "kubeconfig")
        with open(self.kubeconfig, "w") as f:
            json.dump({"apiVersion": "v1", "kind": "Config", "current-context": "standin",
                       "clusters": [{"name": "standin", "cluster": {"server": self.url}}],
                       "users": [{"name": "tester", "user": {"token": "standin"}}],
                       "contexts": [{"name": "standin", "context": {
                           "cluster": "standin", "user": "tester", "namespace": "default"}}]},
                      f)
        self._threads = [threading.Thread(target=self.server.serve_forever, daemon=True),
                         threading.Thread(target=self._kubelet, daemon=True)]
        for t in self._threads:
            t.start()

    def __enter__(self) -> StandIn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closing = True
        with self.lock:
            procs = list(self.procs.values())
            self.lock.notify_all()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        self.server.shutdown()
        self.server.server_close()
        shutil.rmtree(self.root, ignore_errors=True)

    # ---- the store --------------------------------------------------------------------

    def _event(self, plural: str, kind: str, obj: dict) -> None:
        rv = next(self._rv)
        self.rv = rv
        obj["metadata"]["resourceVersion"] = str(rv)
        self.events.append((rv, plural, kind, copy.deepcopy(obj)))
        del self.events[:-self.keep_events]
        self.lock.notify_all()

    def create(self, plural: str, ns: str, obj: dict) -> tuple[int, dict]:
        with self.lock:
            if ns not in self.namespaces:
                return 404, _status(404, "NotFound", f'namespaces "{ns}" not found')
            name = obj.get("metadata", {}).get("name")
            if not name and obj.get("metadata", {}).get("generateName"):
                name = obj["metadata"]["generateName"] + secrets.token_hex(3)[:5]
            if (ns, name) in self.objects[plural]:
                return 409, _status(409, "AlreadyExists",
                                    f'{plural} "{name}" already exists')
            if plural == "pods" and self.pod_quota is not None and \
                    len(self.objects["pods"]) >= self.pod_quota:
                return 403, _status(403, "Forbidden", f'pods "{name}" is forbidden: exceeded '
                                    'quota: pods, requested: pods=1, limited: pods='
                                    f'{self.pod_quota}')
            obj = copy.deepcopy(obj)
            api, kind = _KINDS[plural]
            obj.setdefault("apiVersion", api)
            obj.setdefault("kind", kind)
            meta = obj.setdefault("metadata", {})
            meta.update(name=name, namespace=ns, uid=secrets.token_hex(16),
                        creationTimestamp=_now())
            meta.setdefault("labels", {})
            if plural == "pods":
                obj["status"] = {"phase": "Pending", "conditions": []}
            if plural == "jobs":
                obj["status"] = {}
            self.objects[plural][(ns, name)] = obj
            self._event(plural, "ADDED", obj)
            if plural == "jobs" and not obj["spec"].get("suspend"):
                self._make_pods(obj)
            return 201, copy.deepcopy(obj)

    def _make_pods(self, job: dict, indexes=None) -> None:
        spec, meta = job["spec"], job["metadata"]
        for index in range(int(spec.get("completions", 1))) if indexes is None else indexes:
            tmpl = copy.deepcopy(spec["template"])
            labels = {**tmpl.get("metadata", {}).get("labels", {}),
                      "job-name": meta["name"], "batch.kubernetes.io/job-name": meta["name"],
                      "batch.kubernetes.io/job-completion-index": str(index),
                      "batch.kubernetes.io/controller-uid": meta["uid"]}
            pod = {"metadata": {"name": f"{meta['name']}-{index}-{secrets.token_hex(3)[:5]}",
                                "labels": labels,
                                "annotations": {"batch.kubernetes.io/job-completion-index":
                                                str(index)},
                                "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job",
                                                     "name": meta["name"], "uid": meta["uid"],
                                                     "controller": True}]},
                   "spec": {**tmpl["spec"], "hostname": f"{meta['name']}-{index}"}}
            self.create("pods", meta["namespace"], pod)

    def update_status(self, ns: str, name: str, **status) -> None:
        with self.lock:
            pod = self.objects["pods"].get((ns, name))
            if pod is None:
                return
            pod["status"].update(status)
            self._event("pods", "MODIFIED", pod)

    def delete(self, plural: str, ns: str, name: str, propagate: bool = True
               ) -> tuple[int, dict]:
        with self.lock:
            obj = self.objects[plural].get((ns, name))
            if obj is None:
                return 404, _status(404, "NotFound", f'{plural} "{name}" not found')
            proc = self.procs.get((ns, name)) if plural == "pods" else None
            if plural == "pods" and obj["status"]["phase"] in ("Pending", "Running") \
                    and self._job_of(obj) is not None:
                # a live Job's pod goes gracefully, as the job-tracking finalizer makes it:
                # Terminating (deletionTimestamp) until its container ends, then Failed /
                # Succeeded for the Job controller to see, then gone (the kubelet's loop)
                if "deletionTimestamp" not in obj["metadata"]:
                    obj["metadata"]["deletionTimestamp"] = _now()
                    self._event(plural, "MODIFIED", obj)
                    if proc is None:          # never started: it fails as it is
                        obj["status"]["phase"] = "Failed"
                        self._event(plural, "MODIFIED", obj)
                        self._job_sees(obj)
                        del self.objects[plural][(ns, name)]
                        self._event(plural, "DELETED", obj)
                    elif proc.poll() is None:
                        proc.terminate()
                        threading.Thread(target=_kill_after, args=(proc, 10.0),
                                         daemon=True).start()
                return 200, copy.deepcopy(obj)
            del self.objects[plural][(ns, name)]
            self._event(plural, "DELETED", obj)
            uid = obj["metadata"]["uid"]
            if propagate:
                for other in list(self.objects):
                    for (ons, oname), o in list(self.objects[other].items()):
                        owners = o["metadata"].get("ownerReferences", [])
                        if ons == ns and any(r.get("uid") == uid for r in owners):
                            self.delete(other, ons, oname)
            proc = self.procs.get((ns, name)) if plural == "pods" else None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            threading.Thread(target=_kill_after, args=(proc, 10.0), daemon=True).start()
        return 200, _status(200, "Deleted", "") | {"status": "Success"}

    def live(self) -> dict[str, list[str]]:
        """What is left: plural -> names, and the pods' processes still running."""
        with self.lock:
            left = {p: sorted(n for _, n in objs) for p, objs in self.objects.items() if objs}
        running = [n for (_, n), p in self.procs.items() if p.poll() is None]
        if running:
            left["processes"] = sorted(running)
        return left

    def end_watches(self) -> None:
        """End every open watch stream (a dropped connection, a proxy's timeout): clients
        watch again from the last version they saw."""
        with self.lock:
            self.watch_epoch += 1
            self.lock.notify_all()

    def evict(self, name: str, ns: str = "default") -> None:
        """As a node drain does: the pod gets DisruptionTarget and is deleted; once it has
        ended, its Job's controller applies the ``podFailurePolicy`` (``_job_sees``: the
        meshplan Job's ignores disruptions, so a pod of the same index takes its place)."""
        with self.lock:
            pod = self.objects["pods"].get((ns, name))
            if pod is not None:
                pod["status"]["conditions"].append({"type": "DisruptionTarget", "status": "True",
                                                    "reason": "EvictionByEvictionAPI"})
                self._event("pods", "MODIFIED", pod)
        self.delete("pods", ns, name)

    # ---- the Job controller -----------------------------------------------------------

    def _job_of(self, pod: dict) -> dict | None:
        """The live Job that owns ``pod``, if any."""
        owner = pod["metadata"].get("labels", {}).get("batch.kubernetes.io/job-name")
        job = self.objects["jobs"].get((pod["metadata"]["namespace"], owner))
        uid = pod["metadata"].get("labels", {}).get("batch.kubernetes.io/controller-uid")
        return job if job is not None and job["metadata"]["uid"] == uid else None

    def _job_sees(self, pod: dict) -> None:
        """Pod ``pod`` of a Job ended (Succeeded / Failed): what the Job controller does.
        A success completes its index (every index: the Job is Complete). A failure goes
        through the Job's ``podFailurePolicy`` rules in order (``onPodConditions``,
        ``onExitCodes`` with ``In`` / ``NotIn``): ``Ignore`` makes a pod of the same index
        again and counts nothing, ``FailJob`` fails the Job, ``Count`` (and no rule matched)
        counts against ``backoffLimit`` (default 6): past it the Job fails, else the index is
        made again. A failed Job gets its ``Failed`` condition and its running pods are
        deleted. Called with the lock held."""
        job = self._job_of(pod)
        if job is None or any(c["type"] in ("Failed", "Complete") and c["status"] == "True"
                              for c in job["status"].get("conditions", [])):
            return
        spec, status = job["spec"], job["status"]
        index = int(pod["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"])
        if pod["status"]["phase"] == "Succeeded":
            done = set(status.get("completedIndexes", [])) | {index}
            status["completedIndexes"] = sorted(done)
            status["succeeded"] = len(done)
            if len(done) >= int(spec.get("completions", 1)):
                status["conditions"] = [{"type": "Complete", "status": "True",
                                         "lastTransitionTime": _now()}]
            self._event("jobs", "MODIFIED", job)
            return
        action, why = "Count", ""
        for i, rule in enumerate(spec.get("podFailurePolicy", {}).get("rules", [])):
            if _rule_matches(rule, pod):
                action = rule["action"]
                why = (f"Pod {pod['metadata']['namespace']}/{pod['metadata']['name']} has "
                       f"condition or exit code matching {action} rule at index {i}")
                break
        if action == "Ignore":
            self._make_pods(job, [index])
            return
        if action == "Count":
            status["failed"] = status.get("failed", 0) + 1
            if status["failed"] <= int(spec.get("backoffLimit", 6)):
                self._event("jobs", "MODIFIED", job)
                self._make_pods(job, [index])
                return
            reason, why = "BackoffLimitExceeded", "Job has reached the specified backoff limit"
        else:
            reason = "PodFailurePolicy"
        status["failed"] = status.get("failed", 0) + (action != "Count")
        status["conditions"] = [{"type": "Failed", "status": "True", "reason": reason,
                                 "message": why, "lastTransitionTime": _now()}]
        self._event("jobs", "MODIFIED", job)
        uid = job["metadata"]["uid"]
        for (ons, oname), other in list(self.objects["pods"].items()):
            if other["metadata"]["labels"].get("batch.kubernetes.io/controller-uid") == uid \
                    and other["status"]["phase"] in ("Pending", "Running"):
                self.delete("pods", ons, oname)

    # ---- the kubelet ------------------------------------------------------------------

    def _kubelet(self) -> None:
        while not self._closing:
            with self.lock:
                pending = [p for p in self.objects["pods"].values()
                           if p["status"]["phase"] == "Pending"]
                running = [(k, p) for k, p in self.procs.items()]
            for pod in pending:
                self._try_start(pod)
            for (ns, name), proc in running:
                code = proc.poll()
                if code is None:
                    continue
                with self.lock:
                    pod = self.objects["pods"].get((ns, name))
                    if pod is None or pod["status"]["phase"] not in ("Running",):
                        continue
                    pod["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
                    pod["status"]["containerStatuses"] = [{
                        "name": "worker", "ready": False, "restartCount": 0,
                        "image": pod["spec"]["containers"][0]["image"], "imageID": "",
                        "state": {"terminated": {"exitCode": code if code >= 0 else 128 - code,
                                                 "reason": "Completed" if code == 0 else "Error",
                                                 "finishedAt": _now()}}}]
                    self._event("pods", "MODIFIED", pod)
                    self._job_sees(pod)
                    if "deletionTimestamp" in pod["metadata"]:   # Terminating: now gone
                        del self.objects["pods"][(ns, name)]
                        self._event("pods", "DELETED", pod)
            time.sleep(0.05)

    def _try_start(self, pod: dict) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        ns, name = meta["namespace"], meta["name"]
        (container,) = spec["containers"]
        with self.lock:
            if (ns, name) in self.procs or (ns, name) not in self.objects["pods"]:
                return
            if self.unschedulable:
                conds = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                          "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]
                if pod["status"].get("conditions") != conds:
                    pod["status"]["conditions"] = conds
                    self._event("pods", "MODIFIED", pod)
                return
            waiting = None
            if container["image"] in self.bad_images:
                waiting = {"reason": "ErrImagePull", "message": f'failed to pull image '
                           f'"{container["image"]}": not found'}
            secrets_ = {}
            for vol in spec.get("volumes", []):
                if "secret" in vol:
                    s = self.objects["secrets"].get((ns, vol["secret"]["secretName"]))
                    if s is None and waiting is None:
                        waiting = {"reason": "ContainerCreating", "message": ""}
                    secrets_[vol["name"]] = s
            if waiting is not None:
                status = [{"name": "worker", "ready": False, "restartCount": 0,
                           "image": container["image"], "imageID": "",
                           "state": {"waiting": waiting}}]
                if pod["status"].get("containerStatuses") != status:
                    pod["status"]["containerStatuses"] = status
                    self._event("pods", "MODIFIED", pod)
                return
            root = os.path.join(self.root, name)
            mounts = {}
            for m in container.get("volumeMounts", []):
                s = secrets_.get(m["name"])
                if s is None:
                    continue
                folder = os.path.join(root, m["name"])
                os.makedirs(folder, exist_ok=True)
                for k, v in {**s.get("stringData", {}), **{
                        k: __import__("base64").b64decode(v).decode()
                        for k, v in s.get("data", {}).items()}}.items():
                    with open(os.path.join(folder, k), "w") as f:
                        f.write(v)
                    os.chmod(os.path.join(folder, k), 0o400)
                mounts[m["mountPath"]] = folder
            # the pod's environment is its manifest's (the tests' fault plan passes through)
            env = {k: v for k, v in os.environ.items()
                   if not k.startswith("MESHPLAN_") or k.startswith("MESHPLAN_TEST_")}
            for e in container.get("env", []):
                value = e.get("value", "")
                for path, folder in mounts.items():
                    if value.startswith(path + "/"):
                        value = folder + value[len(path):]
                env[e["name"]] = value
            env["JOB_COMPLETION_INDEX"] = meta["annotations"][
                "batch.kubernetes.io/job-completion-index"]
            env["HOSTNAME"] = spec.get("hostname", name)
            # the pods share this host's network: a port-forward to pod i's port P reaches
            # P + i x port_shift here, where meshplan's relay is told to listen
            env["MESHPLAN_RELAY_PORT_SHIFT"] = str(int(env["JOB_COMPLETION_INDEX"])
                                                   * self.port_shift)
            cmd = list(container["command"]) + list(container.get("args", []))
            if cmd[0] in ("python", "python3"):
                cmd[0] = sys.executable
            index = int(env["JOB_COMPLETION_INDEX"])
            if self.place is not None:
                cmd = self.place(index, cmd)
            os.makedirs(root, exist_ok=True)
            log = open(os.path.join(root, "log"), "wb")
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            log.close()
            self.procs[(ns, name)] = proc
            pod["status"].update(
                phase="Running", podIP="127.0.0.1", startTime=_now(),
                conditions=[{"type": "PodScheduled", "status": "True"},
                            {"type": "Ready", "status": "True"}],
                containerStatuses=[{"name": "worker", "ready": True, "restartCount": 0,
                                    "image": container["image"], "imageID": "",
                                    "state": {"running": {"startedAt": _now()}}}])
            self._event("pods", "MODIFIED", pod)

    def log_path(self, name: str) -> str:
        return os.path.join(self.root, name, "log")

    # ---- HTTP ---------------------------------------------------------------------------

    def _handler(self):
        standin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self):
                url = urlparse(self.path)
                q = {k: v[-1] for k, v in parse_qs(url.query).items()}
                standin.requests.append((self.command, url.path))
                found = _discovery(url.path, standin.url) if self.command == "GET" else None
                if found is not None:
                    return self._send(200, found)
                if url.path == "/api/v1/namespaces":
                    return self._send(200, {"kind": "NamespaceList", "apiVersion": "v1",
                                            "metadata": {"resourceVersion": str(standin.rv)},
                                            "items": [{"metadata": {"name": n}}
                                                      for n in sorted(standin.namespaces)]})
                if url.path.startswith("/api/v1/namespaces/") and url.path.count("/") == 4:
                    ns = url.path.rsplit("/", 1)[1]
                    if ns in standin.namespaces:
                        return self._send(200, {"kind": "Namespace", "apiVersion": "v1",
                                                "metadata": {"name": ns}})
                    return self._send(404, _status(404, "NotFound",
                                                   f'namespaces "{ns}" not found'))
                m = _PATH.match(url.path)
                if not m or m.group(2) not in _KINDS:
                    return self._send(404, _status(404, "NotFound", f"no route {url.path}"))
                return m.group(1), m.group(2), m.group(3), m.group(4), q

            def do_POST(self) -> None:
                r = self._route()
                if r is None:
                    return
                ns, plural, name, _, _ = r
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self._send(*standin.create(plural, ns, body))

            def do_DELETE(self) -> None:
                r = self._route()
                if r is None:
                    return
                ns, plural, name, _, q = r
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}") if length else {}
                policy = body.get("propagationPolicy") or q.get("propagationPolicy")
                # a Job's default (no policy) orphans its pods, as the real API does
                propagate = policy in ("Background", "Foreground") or plural != "jobs"
                self._send(*standin.delete(plural, ns, name, propagate))

            def do_GET(self) -> None:
                if self.headers.get("Upgrade", "").lower() == "websocket":
                    return self._portforward()
                r = self._route()
                if r is None:
                    return
                ns, plural, name, log, q = r
                if log:
                    return self._log(ns, name, q)
                if name:
                    with standin.lock:
                        obj = standin.objects[plural].get((ns, name))
                    if obj is None:
                        return self._send(404, _status(404, "NotFound",
                                                       f'{plural} "{name}" not found'))
                    return self._send(200, obj)
                if q.get("watch") in ("true", "1"):
                    return self._watch(ns, plural, q)
                with standin.lock:
                    items = [copy.deepcopy(o) for (ons, _), o in standin.objects[plural].items()
                             if ons == ns and _matches(o["metadata"].get("labels", {}),
                                                        q.get("labelSelector"))]
                    rv = standin.rv
                api, kind = _KINDS[plural]
                self._send(200, {"kind": f"{kind}List", "apiVersion": api,
                                 "metadata": {"resourceVersion": str(rv)}, "items": items})

            def _portforward(self) -> None:
                """``pods/NAME/portforward?ports=P`` over a websocket (subprotocol
                ``v4.channel.k8s.io``), as the kubelet's streaming server does behind the
                API server: per port a data channel (2i) and an error channel (2i + 1), each
                opened with a frame of the port number (2 bytes, little-endian), then the
                bytes of one TCP connection to that port in the pod's network (the pod's
                address, ``pod_address``); a refused connection is said on the error
                channel. The websocket ends with the connection, and the connection with
                the websocket."""
                url = urlparse(self.path)
                standin.requests.append(("PORTFORWARD", url.path))
                m = re.match(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)/portforward$",
                             url.path)
                q = {k: v[-1] for k, v in parse_qs(url.query).items()}
                if m is None or "ports" not in q:
                    return self._send(400, _status(400, "BadRequest", "no ports to forward"))
                ns, name = m.group(1), m.group(2)
                with standin.lock:
                    pod = standin.objects["pods"].get((ns, name))
                    running = pod is not None and pod["status"]["phase"] == "Running"
                if not running:
                    return self._send(404 if pod is None else 400, _status(
                        404 if pod is None else 400, "NotFound" if pod is None else
                        "BadRequest", f'pod "{name}" not found' if pod is None else
                        f'pod "{name}" is not running'))
                ports = [int(x) for x in q["ports"].split(",")]
                accept = base64.b64encode(hashlib.sha1(
                    self.headers["Sec-WebSocket-Key"].encode()
                    + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest()).decode()
                self.send_response(101)
                self.send_header("Upgrade", "websocket")
                self.send_header("Connection", "Upgrade")
                self.send_header("Sec-WebSocket-Accept", accept)
                self.send_header("Sec-WebSocket-Protocol", "v4.channel.k8s.io")
                self.end_headers()
                self.wfile.flush()
                self.close_connection = True
                index = int(pod["metadata"]["labels"].get(
                    "batch.kubernetes.io/job-completion-index", "0"))
                _forward(self.rfile, self.connection, standin.pod_address(index),
                         [p + index * standin.port_shift for p in ports], ports)

            def _stream_start(self) -> None:
                """A streamed answer, in chunks as the API server sends them (a client
                reads each chunk as it comes)."""
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def _stream_end(self) -> None:
                try:
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def _line(self, obj: dict) -> None:
                self._chunk((json.dumps(obj) + "\n").encode())

            def _watch(self, ns: str, plural: str, q: dict) -> None:
                since = int(q.get("resourceVersion") or 0)
                deadline = time.monotonic() + float(q.get("timeoutSeconds") or 1800)
                bookmarks = q.get("allowWatchBookmarks") in ("true", "1")
                self._stream_start()
                with standin.lock:
                    oldest = standin.events[0][0] if standin.events else standin.rv + 1
                if since and since < oldest - 1:
                    self._line({"type": "ERROR", "object": _status(
                        410, "Expired", f"too old resource version: {since} ({oldest - 1})")})
                    return self._stream_end()
                last_bookmark = time.monotonic()
                epoch = standin.watch_epoch
                try:
                    while time.monotonic() < deadline and not standin._closing and \
                            standin.watch_epoch == epoch:
                        with standin.lock:
                            out = [(rv, t, o) for rv, p, t, o in standin.events
                                   if rv > since and p == plural
                                   and o["metadata"]["namespace"] == ns
                                   and _matches(o["metadata"].get("labels", {}),
                                                q.get("labelSelector"))]
                            if not out:
                                standin.lock.wait(0.2)
                        for rv, t, o in out:
                            self._line({"type": t, "object": o})
                            since = rv
                        if bookmarks and time.monotonic() - last_bookmark > 1.0:
                            last_bookmark = time.monotonic()
                            api, kind = _KINDS[plural]
                            self._line({"type": "BOOKMARK", "object": {
                                "kind": kind, "apiVersion": api,
                                "metadata": {"resourceVersion": str(max(since, 1))}}})
                except (BrokenPipeError, ConnectionResetError):
                    return
                self._stream_end()

            def _log(self, ns: str, name: str, q: dict) -> None:
                path = standin.log_path(name)
                follow = q.get("follow") in ("true", "1")
                with standin.lock:
                    pod = standin.objects["pods"].get((ns, name))
                if pod is None:
                    return self._send(404, _status(404, "NotFound", f'pods "{name}" not found'))
                self._stream_start()
                pos = 0
                try:
                    while True:
                        data = b""
                        if os.path.exists(path):
                            with open(path, "rb") as f:
                                f.seek(pos)
                                data = f.read()
                        if data:
                            pos += len(data)
                            self._chunk(data)
                        proc = standin.procs.get((ns, name))
                        gone = (ns, name) not in standin.objects["pods"]
                        if not follow or gone or standin._closing or (
                                proc is not None and proc.poll() is not None and not data):
                            return self._stream_end()
                        time.sleep(0.1)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        return Handler


def _kill_after(proc: subprocess.Popen, grace_s: float) -> None:
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            proc.kill()
        proc.wait()


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    from meshplan.runtime._sandbox import Sandbox

    box = Sandbox.open(sys.argv[1])
    hosts = [h.name for h in box.hosts]
    standin = StandIn(host=box.ctl.address, root=sys.argv[2],
                      place=lambda i, cmd: box.argv(cmd, host=hosts[i % len(hosts)]))
    print(standin.kubeconfig, flush=True)
    sys.stdin.read()
    standin.close()
