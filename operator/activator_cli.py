"""``kvpilot operator activator``'s flags and process: the Ready replicas' routers looked up from the
EndpointSlices, the ``activator`` app served until a signal (docs/architecture.md#scale-to-zero).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import aiohttp.web

from kvpilot.operator import api_names
from kvpilot.operator.activator import Activator, ActivatorConfig, Upstreams
from kvpilot.operator.cli_checks import dns_label, positive_int, positive_seconds, tcp_port
from kvpilot.router.connections import RouterRunner
from kvpilot.router.server import until_signalled


def endpoint_slice_upstreams(namespace: str, name: str) -> Upstreams:
    """The Ready replicas' routers from the EndpointSlices of ``<name>-engines`` (router port 8080)."""
    from kvpilot.operator.kube_api import KubeApi, ObjectRef, load_client_configuration

    load_client_configuration()
    api = KubeApi()
    ref = ObjectRef("discovery.k8s.io/v1", "EndpointSlice", namespace)
    selector = f"kubernetes.io/service-name={name}-engines"

    def lookup() -> list[str]:
        found = []
        for slice_ in api.list(ref, selector):
            for endpoint in slice_.get("endpoints") or []:
                # The engines' Service publishes not-ready addresses, so `ready` is always true there;
                # `serving` is the pod's readiness (its router's, which needs its engine's).
                conditions = endpoint.get("conditions") or {}
                if conditions.get("serving", conditions.get("ready")):
                    found += [f"http://{a}:{api_names.ROUTER_PORT}" for a in endpoint.get("addresses", [])]
        return sorted(found)

    async def upstreams() -> list[str]:
        return await asyncio.to_thread(lookup)

    return upstreams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", type=dns_label, required=True)
    parser.add_argument("--name", type=dns_label, required=True, help="the InferenceService")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=tcp_port, default=api_names.ROUTER_PORT)
    parser.add_argument("--queue-size", type=positive_int, default=256)
    parser.add_argument("--hold-timeout", type=positive_seconds, default=300.0, metavar="SECONDS")


def run(args: argparse.Namespace) -> int:
    from kubernetes.config import ConfigException

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ActivatorConfig(
        namespace=args.namespace,
        name=args.name,
        queue_size=args.queue_size,
        hold_timeout_seconds=args.hold_timeout,
    )
    # Runtime failures (no cluster configuration, an address that cannot be bound) are one line, exit 1.
    try:
        upstreams = endpoint_slice_upstreams(args.namespace, args.name)
    except (ConfigException, OSError) as error:
        print(f"kvpilot operator activator: no Kubernetes configuration: {error}", file=sys.stderr)
        return 1
    try:
        asyncio.run(_serve(Activator(config, upstreams).runner(), args.host, args.port))
    except OSError as error:
        print(
            f"kvpilot operator activator: cannot listen on {args.host}:{args.port}: {error}", file=sys.stderr
        )
        return 1
    return 0


async def _serve(runner: RouterRunner, host: str, port: int) -> None:
    await runner.setup()
    try:
        await aiohttp.web.TCPSite(runner, host, port).start()
        await until_signalled()
    finally:
        await runner.cleanup()
