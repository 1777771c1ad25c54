"""``kvpilot router``: parse and validate flags into a :class:`RouterConfig`, load the tokenizer, serve.

Every invalid input ends in a one-line ``kvpilot router: error: ...`` and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from kvpilot.engine.tenancy import ROUTER_TOKEN_ENV, TenantError, key_bindings, read_api_keys_file
from kvpilot.router.app import RouterApp
from kvpilot.router.config import (
    POLICIES,
    ConfigError,
    DiscoveryConfig,
    PollConfig,
    RouterConfig,
    ScoringWeights,
    UpstreamConfig,
)
from kvpilot.router.endpointslices import SliceApi
from kvpilot.router.server import RouterServer, load_profiler

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def _default(config_class: type, name: str) -> Any:
    return next(f.default for f in fields(config_class) if f.name == name)


def build_parser() -> argparse.ArgumentParser:
    poll, upstream = PollConfig(), UpstreamConfig()
    parser = argparse.ArgumentParser(
        prog="kvpilot router",
        allow_abbrev=False,  # "--por 1" must not be --port 1 (as kvpilot serve)
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Cache-aware routing sidecar: proxies the OpenAI endpoints to the engine replica with "
        "the lowest estimated completion cost (queued + uncached prefill over the learned prefill rate, "
        "plus a decode term), among replicas with KV headroom.",
    )
    parser.add_argument("--host", default=_default(RouterConfig, "host"), help="address to listen on")
    parser.add_argument("--port", type=int, default=_default(RouterConfig, "port"), help="port to listen on")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--replicas", metavar="URL,URL", help="static engine base URLs, comma-separated")
    source.add_argument(
        "--endpointslices", metavar="SERVICE", help="watch this Service's EndpointSlices for engine replicas"
    )
    parser.add_argument(
        "--namespace", help="namespace of --endpointslices (default: the pod's own namespace)"
    )
    parser.add_argument("--engine-port-name", default="http", help="EndpointSlice port name of the engines")
    parser.add_argument(
        "--model",
        default=_default(RouterConfig, "model"),
        help="model spec whose tokenizer and chat template to use (as kvpilot serve --model)",
    )
    parser.add_argument(
        "--policy", choices=POLICIES, default=_default(RouterConfig, "policy"), help="routing policy"
    )
    parser.add_argument(
        "--weights",
        default="",
        metavar="k=v,...",
        help="cache_aware knobs: queue, prefill, decode, balance, balance_floor, tie_ms "
        f"(defaults: {_weights_text(ScoringWeights())})",
    )
    parser.add_argument(
        "--poll-interval",
        type=float,
        default=poll.interval_s,
        metavar="S",
        help="seconds between /load and /kv/events polls of each replica",
    )
    parser.add_argument(
        "--poll-timeout",
        type=float,
        default=poll.timeout_s,
        metavar="S",
        help="a slower poll ejects the replica",
    )
    parser.add_argument(
        "--trust-tenant-header",
        action="store_true",
        help="believe clients' x-tenant (behind a gateway that sets it) and vouch for it to the "
        "engines with the router token",
    )
    parser.add_argument(
        "--router-token",
        default=os.environ.get(ROUTER_TOKEN_ENV),
        help=f"the deployment's shared token (default: ${ROUTER_TOKEN_ENV})",
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY[:TENANT]",
        help="an API key the engines accept, as their --api-key (repeat for several): the router then "
        "predicts the tenant from the key as the engines do, for exact prefix-cache affinity",
    )
    parser.add_argument(
        "--api-keys-file", help="the engines' --api-keys-file (one KEY or KEY:TENANT per line)"
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=upstream.connect_timeout_s,
        metavar="S",
        help="TCP connect to an engine",
    )
    parser.add_argument(
        "--body-read-timeout",
        type=float,
        default=upstream.body_read_timeout_s,
        metavar="S",
        help="a client request body slower than this gets 408",
    )
    parser.add_argument(
        "--stream-buffer-bytes",
        type=int,
        default=upstream.stream_buffer_bytes,
        metavar="N",
        help="bytes of a stream held for a client that does not read (socket and read buffers)",
    )
    parser.add_argument(
        "--write-stall-timeout",
        type=float,
        default=upstream.write_stall_timeout_s,
        metavar="S",
        help="close a client connection that accepts no bytes for this long (0 = never)",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=upstream.request_timeout_s,
        metavar="S",
        help="whole upstream request, streaming included",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=upstream.max_body_bytes,
        metavar="N",
        help="largest request body accepted",
    )
    parser.add_argument(
        "--prefill-rate-prior",
        type=float,
        default=_default(RouterConfig, "prefill_rate_prior"),
        metavar="TOK/S",
        help="prefill tokens/s assumed before any replica has measured one",
    )
    parser.add_argument(
        "--per-replica-prefill-rate",
        action="store_true",
        help="cost each replica's work at its own measured prefill rate, not the fleet's median "
        "(for replicas on different hardware; a rate measured under load flatters busy "
        "replicas)",
    )
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return parser


def _weights_text(weights: ScoringWeights) -> str:
    return ",".join(f"{k}={v:g}" for k, v in vars(weights).items())


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    replicas = (
        tuple(u.strip().rstrip("/") for u in args.replicas.split(",") if u.strip()) if args.replicas else ()
    )
    if args.replicas is not None and not replicas:
        raise ConfigError("--replicas needs at least one URL")
    specs = list(args.api_key or [])
    if args.api_keys_file:
        try:
            specs += read_api_keys_file(args.api_keys_file)
        except OSError as error:
            raise ConfigError(f"--api-keys-file {args.api_keys_file}: {error.strerror}") from None
    try:
        _, bindings = key_bindings(specs)
    except TenantError as error:
        raise ConfigError(str(error)) from None
    namespace = args.namespace
    if args.endpointslices and not namespace and SERVICE_ACCOUNT_NAMESPACE.is_file():
        namespace = SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    return RouterConfig(
        discovery=DiscoveryConfig(
            replicas=replicas,
            endpointslice_service=args.endpointslices,
            namespace=namespace,
            port_name=args.engine_port_name,
        ),
        host=args.host,
        port=args.port,
        model=args.model,
        policy=args.policy,
        weights=ScoringWeights.parse(args.weights),
        poll=PollConfig(interval_s=args.poll_interval, timeout_s=args.poll_timeout),
        upstream=UpstreamConfig(
            connect_timeout_s=args.connect_timeout,
            request_timeout_s=args.request_timeout,
            max_body_bytes=args.max_body_bytes,
            body_read_timeout_s=args.body_read_timeout,
            stream_buffer_bytes=args.stream_buffer_bytes,
            write_stall_timeout_s=args.write_stall_timeout,
        ),
        prefill_rate_prior=args.prefill_rate_prior,
        per_replica_prefill_rate=args.per_replica_prefill_rate,
        trust_tenant_header=args.trust_tenant_header,
        router_token=args.router_token or None,
        api_keys_known=bool(specs),
        api_key_tenants=bindings,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse already printed usage and the message
        return int(exit_.code or 0)
    try:
        config = config_from_args(args)
        # Only cache_aware needs prompts; the baselines route without tokenizing.
        profiler = load_profiler(config.model) if config.policy == "cache_aware" else None
        slice_api = _kubernetes_api() if config.discovery.endpointslice_service else None
    except (ConfigError, ValueError, OSError) as error:
        print(f"kvpilot router: error: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    server = RouterServer(RouterApp(config, profiler, slice_api), config.host, config.port)
    try:
        asyncio.run(server.serve_until_signalled())
    except OSError as error:  # e.g. the port is taken
        print(f"kvpilot router: error: {error}", file=sys.stderr)
        return 1
    return 0


def _kubernetes_api() -> Callable[[], SliceApi]:
    """The EndpointSlice API, configured now so that a missing kubeconfig is a CLI error, not a crash."""
    from kubernetes.config import ConfigException

    from kvpilot.router.endpointslices import KubernetesSliceApi

    try:
        api = KubernetesSliceApi()
    except ConfigException as error:
        raise ConfigError(f"no Kubernetes configuration (in-cluster or kubeconfig): {error}") from None
    return lambda: api
