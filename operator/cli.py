"""``kvpilot operator``: run the Kopf operator, render an InferenceService's children, print the CRD.

- ``run``: registers the handlers, then hands over to Kopf's own ``kopf run`` command with the Kopf flags
  passed through (namespaces, --all-namespaces, --standalone, --liveness, logging); with
  ``--leader-elect`` it first waits to hold the operator's Lease (``leader``) and keeps renewing it;
- ``render -f isvc.yaml``: prints the objects the operator would apply, like ``helm template``; an invalid
  spec exits 2 with the field named;
- ``crd``: prints the CustomResourceDefinition YAML (``crds/`` and the chart hold exactly this);
- ``fetch-model``: what the pods' init container runs for a fetched model source (``fetch``);
- ``activator``: the always-on Deployment of a service that scales to zero (``activator``).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

import yaml

from kvpilot.operator.activator_cli import add_arguments as add_activator_arguments
from kvpilot.operator.api_names import DEFAULT_IMAGE
from kvpilot.operator.cli_checks import dns_label, image_ref, liveness_url, run_flags_problem
from kvpilot.operator.config import DEFAULT_CLUSTER_DOMAIN, OperatorConfig
from kvpilot.operator.fetch import add_arguments as add_fetch_arguments

if TYPE_CHECKING:
    from kvpilot.operator.leader import LeaseSettings

EXIT_RUNTIME = 1
EXIT_INVALID = 2
EXIT_LOST_LEADERSHIP = 3  # the Lease was lost: exit at once, Kubernetes restarts this replica as a candidate


def build_parser() -> argparse.ArgumentParser:
    # No prefix abbreviations anywhere ("--metrics-p" is no flag); add_parser does not inherit allow_abbrev,
    # so every subcommand is given it.
    parser = argparse.ArgumentParser(
        prog="kvpilot operator", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser(
        "run", help="run the operator (Kopf) against the current cluster", allow_abbrev=False
    )
    scope = run.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        dest="namespaces",
        default=[],
        help="watch this namespace (repeatable)",
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    run.add_argument("--standalone", action="store_true", help="no peering: this is the only operator")
    run.add_argument(
        "--liveness",
        type=liveness_url,
        metavar="URL",
        help="Kopf liveness endpoint, e.g. http://0.0.0.0:8080/healthz",
    )
    run.add_argument("--verbose", action="store_true")
    run.add_argument("--debug", action="store_true")
    run.add_argument("--log-format", choices=("plain", "full", "json"), default="full")
    run.add_argument(
        "--engine-image", type=image_ref, default=DEFAULT_IMAGE, help="image when spec.engine.image is unset"
    )
    run.add_argument(
        "--status-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="while an engine loads or warms up, how often its progress is read into the status",
    )
    run.add_argument(
        "--resync-interval",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="full reconcile of every InferenceService (child changes are watched, this is the safety net)",
    )
    run.add_argument("--engine-probe-timeout", type=float, default=1.0, metavar="SECONDS")
    run.add_argument("--metrics-port", type=int, help="serve the operator's Prometheus metrics on this port")
    run.add_argument(
        "--cluster-domain",
        default=os.environ.get("CLUSTER_DOMAIN") or DEFAULT_CLUSTER_DOMAIN,
        help="the cluster's DNS domain, for status.endpoint (default: $CLUSTER_DOMAIN, else cluster.local)",
    )
    election = run.add_argument_group("leader election (one of several replicas reconciles)")
    election.add_argument(
        "--leader-elect", action="store_true", help="reconcile only while holding a coordination.k8s.io Lease"
    )
    election.add_argument("--lease-name", default="kvpilot-operator")
    election.add_argument(
        "--lease-namespace",
        type=dns_label,
        # empty is unset (as for --identity): argparse checks a string default with the type even without
        # --leader-elect, so POD_NAMESPACE="" refused every operator run
        default=os.environ.get("POD_NAMESPACE") or None,
        help="namespace of the Lease (default: $POD_NAMESPACE)",
    )
    election.add_argument(
        "--identity",
        default=os.environ.get("POD_NAME") or f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}",
        help="this candidate's name in the Lease (default: $POD_NAME, else host name and a random suffix)",
    )
    election.add_argument("--lease-duration", type=float, default=15.0, metavar="SECONDS")
    election.add_argument("--lease-renew-deadline", type=float, default=10.0, metavar="SECONDS")
    election.add_argument("--lease-retry-period", type=float, default=2.0, metavar="SECONDS")
    run.set_defaults(command_parser=run)  # for the cross-flag check's error line

    render = commands.add_parser(
        "render", help="print the objects the operator would apply", allow_abbrev=False
    )
    render.add_argument("-f", "--filename", required=True, help="InferenceService YAML ('-' for stdin)")
    render.add_argument(
        "-n", "--namespace", type=dns_label, default="default", help="namespace when the file names none"
    )
    render.add_argument("--engine-image", type=image_ref, default=DEFAULT_IMAGE)

    commands.add_parser("crd", help="print the InferenceService CustomResourceDefinition", allow_abbrev=False)

    activator = commands.add_parser(
        "activator",
        help="hold requests of a service scaled to zero until a replica is Ready",
        allow_abbrev=False,
    )
    add_activator_arguments(activator)

    fetch = commands.add_parser(
        "fetch-model",
        help="download a model source into the model cache (the pods' init container)",
        allow_abbrev=False,
    )
    add_fetch_arguments(fetch)
    return parser


def _kopf_args(args: argparse.Namespace) -> list[str]:
    kopf_args = ["run"]
    kopf_args += (
        ["--all-namespaces"]
        if args.all_namespaces
        else [flag for namespace in args.namespaces for flag in ("--namespace", namespace)]
    )
    if args.standalone or args.leader_elect:  # the Lease elects; Kopf's peering would only pause replicas
        kopf_args.append("--standalone")
    if args.liveness:
        kopf_args += ["--liveness", args.liveness]
    if args.verbose:
        kopf_args.append("--verbose")
    if args.debug:
        kopf_args.append("--debug")
    return [*kopf_args, "--log-format", args.log_format]


def _lease_settings(args: argparse.Namespace) -> LeaseSettings:
    from kvpilot.operator.leader import LeaseSettings

    return LeaseSettings(
        namespace=args.lease_namespace or "",
        identity=args.identity,
        name=args.lease_name,
        duration_s=args.lease_duration,
        renew_deadline_s=args.lease_renew_deadline,
        retry_period_s=args.lease_retry_period,
    )


def _lose_leadership() -> None:
    # Another replica may take the Lease as soon as it expires; a graceful Kopf shutdown (handlers
    # finishing, watches closing) could outlast that, so this process stops at once, as client-go's
    # leader election does; the Deployment restarts it as a candidate.
    logging.shutdown()
    os._exit(EXIT_LOST_LEADERSHIP)


def _run(args: argparse.Namespace) -> int:
    import kopf  # the operator's heavy imports stay out of render and crd
    import kopf.cli
    from kubernetes.config import ConfigException

    from kvpilot.operator import leader
    from kvpilot.operator.handlers import register
    from kvpilot.operator.kube_api import KubeApi, load_client_configuration

    try:
        config = OperatorConfig(
            default_image=args.engine_image,
            status_interval_seconds=args.status_interval,
            resync_interval_seconds=args.resync_interval,
            engine_probe_timeout_seconds=args.engine_probe_timeout,
            metrics_port=args.metrics_port,
            cluster_domain=args.cluster_domain,
        )
        lease = _lease_settings(args) if args.leader_elect else None
    except ValueError as error:
        print(f"kvpilot operator run: {error}", file=sys.stderr)
        return EXIT_INVALID
    try:  # as Kopf's login will (in-cluster, then kubeconfig); with neither, Kopf retries it for ever
        load_client_configuration()
    except ConfigException as error:
        print(
            f"kvpilot operator run: no Kubernetes configuration (in-cluster or kubeconfig): {error}",
            file=sys.stderr,
        )
        return EXIT_RUNTIME
    register(config)
    renewer = None
    if lease is not None:
        # Kopf's own log set-up now, so the election's lines look like the rest (kopf run redoes it).
        kopf.configure(
            debug=args.debug, verbose=args.verbose, log_format=kopf.LogFormat[args.log_format.upper()]
        )
        # Each request must end well within the renew deadline, or one hung call could outlast it.
        lock = leader.LeaseLock(KubeApi(request_timeout=lease.renew_deadline_s / 3), lease)
        try:
            with leader.standby_health(args.liveness):
                leader.campaign(lock)
        except leader.StandbyHealthError as error:
            print(f"kvpilot operator run: {error}", file=sys.stderr)
            return EXIT_RUNTIME
        renewer = leader.Renewer(lock, on_lost=_lose_leadership)
        renewer.start()
    try:
        kopf.cli.main(args=_kopf_args(args), prog_name="kvpilot operator run", standalone_mode=False)
    finally:
        if renewer is not None:
            renewer.stopping.set()
            renewer.join()
            renewer.lock.release()
    return 0


def _read_documents(filename: str, stdin: TextIO) -> list[Any]:
    if filename == "-":
        return [doc for doc in yaml.safe_load_all(stdin) if doc is not None]
    with open(filename, encoding="utf-8") as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc is not None]


def _render(args: argparse.Namespace, out: TextIO, err: TextIO, stdin: TextIO) -> int:
    from kvpilot.operator.children import build_children
    from kvpilot.operator.manifest_yaml import dump_documents
    from kvpilot.operator.spec import InferenceService, SpecError

    try:
        documents = _read_documents(args.filename, stdin)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:  # a binary file is no UTF-8
        print(f"error: cannot read {args.filename}: {error}", file=err)
        return EXIT_INVALID
    objects: list[dict[str, Any]] = []
    for index, document in enumerate(documents):
        try:
            if not isinstance(document, dict):
                raise SpecError("kind", "expected a YAML mapping (an InferenceService object)")
            isvc = InferenceService.from_manifest(document, default_namespace=args.namespace)
        except SpecError as error:
            print(f"error: {args.filename} (document {index + 1}): {error}", file=err)
            return EXIT_INVALID
        children = build_children(isvc, args.engine_image)
        print(f"# {isvc.namespace}/{isvc.name}: {children.sizing.formula}", file=err)
        objects += children.objects
    out.write(dump_documents(objects))
    return 0


def main(
    argv: Sequence[str] | None = None,
    *,
    out: TextIO | None = None,
    err: TextIO | None = None,
    stdin: TextIO | None = None,
) -> int:
    out, err, stdin = out or sys.stdout, err or sys.stderr, stdin or sys.stdin
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    if args.command == "run":
        if problem := run_flags_problem(args):
            args.command_parser.error(problem)
        return _run(args)
    if args.command == "render":
        return _render(args, out, err, stdin)
    if args.command == "activator":
        from kvpilot.operator.activator_cli import run as run_activator

        return run_activator(args)
    if args.command == "fetch-model":
        from kvpilot.operator.fetch import run as fetch_model

        return fetch_model(args)
    from kvpilot.operator.crd import crd_yaml

    out.write(crd_yaml())
    return 0
