"""``meshplan k8s``: Kubernetes resources for a plan (``meshplan/runtime/_k8s.py``).

    meshplan k8s manifest PLAN --image IMG [--pods N] [--ranks-per-pod K] [--gpus-per-pod G]
                          [--namespace NS] [--queue Q] [--kind Job|JobSet] [--shm SIZE]
                          [--cpu C] [--memory M] [--node-selector K=V ...] [--controller ADDR]
        print the Indexed Job (or JobSet) and the headless Service that run PLAN's mesh, as
        YAML, for review or GitOps; the Secret with the run's key is the controller's to make
    meshplan k8s status [--namespace NS]
        this user's meshplan Jobs and their pods' phases
    meshplan k8s logs [--run RUN] [--namespace NS] [--follow]
        the logs of this user's meshplan pods, each line prefixed with its pod
    meshplan k8s delete --all-mine [--namespace NS]
        delete this user's meshplan Jobs (their pods go with them), Services and Secrets:
        what a controller killed before its shutdown left
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys

from ._cli_run import _guarded
from ._errors import RuntimeFailure

PLACEHOLDER = "tcp://CONTROLLER:PORT"


def add_k8s_commands(sub: argparse._SubParsersAction) -> None:
    k = sub.add_parser("k8s", help="Kubernetes resources for a plan")
    k_sub = k.add_subparsers(dest="k8s_command", required=True)
    m = k_sub.add_parser("manifest", help="print the Job (or JobSet) and Service that run "
                         "PLAN's mesh, as YAML")
    m.add_argument("plan", help="a plan file (meshplan compile): its mesh sets the ranks")
    m.add_argument("--image", required=True, help="the container image (meshplan and torch "
                   "installed)")
    m.add_argument("--pods", type=int, default=None, help="pods (default: ranks / ranks per "
                   "pod)")
    m.add_argument("--ranks-per-pod", type=int, default=None,
                   help="ranks per pod (default: --gpus-per-pod, else 1)")
    m.add_argument("--gpus-per-pod", type=int, default=0)
    m.add_argument("--namespace", default="default")
    m.add_argument("--queue", default=None, help="a Kueue LocalQueue to submit to")
    m.add_argument("--kind", default="Job", help="Job (default) or JobSet")
    m.add_argument("--shm", default=None, help="size limit of /dev/shm, e.g. 64Gi")
    m.add_argument("--cpu", default=None, help="CPU per pod, e.g. 16")
    m.add_argument("--memory", default=None, help="memory per pod, e.g. 256Gi")
    m.add_argument("--node-selector", action="append", default=[], metavar="KEY=VALUE")
    m.add_argument("--controller", default=PLACEHOLDER,
                   help="the controller's channel address the pods connect to (default: a "
                   "placeholder the controller fills at launch)")
    m.add_argument("--json", action="store_true",
                   help="a JSON List of the objects instead of YAML (kubectl reads both)")
    m.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    m.set_defaults(func=_guarded(cmd_manifest))
    st = k_sub.add_parser("status", help="this user's meshplan Jobs and their pods")
    st.add_argument("--namespace", default=None, help="one namespace (default: every one)")
    st.add_argument("--json", action="store_true", help="the jobs and their pods as JSON")
    st.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    st.set_defaults(func=_guarded(cmd_status))
    lg = k_sub.add_parser("logs", help="the logs of this user's meshplan pods")
    lg.add_argument("--run", default=None, help="one run's pods (its run id)")
    lg.add_argument("--namespace", default=None, help="one namespace (default: every one)")
    lg.add_argument("--follow", "-f", action="store_true", help="until the pods end")
    lg.add_argument("--json", action="store_true",
                    help="one JSON object per line: namespace, pod, line")
    lg.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    lg.set_defaults(func=_guarded(cmd_logs))
    d = k_sub.add_parser("delete", help="delete what meshplan made for this user")
    d.add_argument("--all-mine", action="store_true", required=True,
                   help="every Job, Service and Secret labelled with this user as owner")
    d.add_argument("--namespace", default=None, help="one namespace (default: every one)")
    d.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    d.set_defaults(func=_guarded(cmd_delete))


def cmd_manifest(args: argparse.Namespace) -> int:
    import math

    from .planner import Plan
    from .runtime._k8s import K8sOptions, manifests, to_yaml

    selector = {}
    for item in args.node_selector:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise RuntimeFailure(f"--node-selector {item!r}: pass KEY=VALUE")
        selector[key] = value
    opts = K8sOptions.parse({
        "image": args.image, "namespace": args.namespace, "pods": args.pods,
        "ranks_per_pod": args.ranks_per_pod, "gpus_per_pod": args.gpus_per_pod,
        "queue": args.queue, "kind": args.kind, "shm": args.shm, "cpu": args.cpu,
        "memory": args.memory, "node_selector": selector})
    plan = Plan.load(args.plan)
    world = math.prod(plan.mesh.sizes)
    host = args.controller.removeprefix("tcp://").rpartition(":")[0] or "CONTROLLER"
    objects = manifests(opts, world=world, run_id=secrets.token_hex(8),
                        address=args.controller, store=None,
                        controller_host=host)
    if args.json:
        print(json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)},
                         indent=2))
        return 0
    sys.stdout.write(f"# meshplan: {plan.mesh} ({world} ranks) from {args.plan}; the run's "
                     "Secret (<name>-key) is made by the controller at launch\n")
    sys.stdout.write(to_yaml(objects))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from .runtime._k8s_launch import status_of_mine

    rows = status_of_mine(args.namespace)
    if args.json:
        print(json.dumps({"jobs": rows}))
        return 0
    if not rows:
        print("no meshplan Jobs of this user")
    for job in rows:
        print(f"{job['namespace']}/{job['job']}: {', '.join(job['conditions']) or 'active'}")
        for pod in job["pods"]:
            print(f"  {pod['name']}: {pod['phase'] or '?'}")
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    from .runtime._k8s_launch import delete_all_mine

    done = delete_all_mine(args.namespace)
    for what in done:
        print(f"deleted {what}")
    if not done:
        print("nothing of this user's to delete")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from .runtime._k8s_launch import logs_of_mine

    if not logs_of_mine(args.namespace, args.run, args.follow, as_json=args.json):
        print("no meshplan pods of this user" + (f" in run {args.run}" if args.run else ""),
              file=sys.stderr)
    return 0
