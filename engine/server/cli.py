"""``kvpilot serve``: the OpenAI-compatible engine server (the ``engine`` container of every serving pod).

Engine flags carry vLLM's names (``kvpilot.engine.arg_utils``); the server flags below are the HTTP side.
Exit status: 0 after a clean drain, 1 when the model cannot load, the engine fails or the address cannot be
bound, 2 for bad flags.
"""

from __future__ import annotations

import argparse
import os

from kvpilot.engine.arg_utils import add_engine_args, config_from_namespace
from kvpilot.engine.server.config import (
    DEFAULT_WARMUP_BUCKETS,
    ServerConfig,
    ServerConfigError,
    parse_warmup_buckets,
)
from kvpilot.engine.tenancy import ROUTER_TOKEN_ENV, TenantError, key_bindings, read_api_keys_file

API_KEY_ENV = "KVPILOT_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    d = ServerConfig()
    # No prefix abbreviations: "--served-model" or "--por" in spec.engine.extraArgs would otherwise override
    # a flag the operator sets from the spec (operator/crd_rules.py refuses the exact spellings).
    p = argparse.ArgumentParser(
        prog="kvpilot serve",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    add_engine_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default=d.host, help="address to listen on")
    s.add_argument("--port", type=int, default=d.port)
    s.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients pass as 'model' (default: the --model value)",
    )
    s.add_argument(
        "--api-key",
        action="append",
        default=None,
        help=f"accepted bearer key for /v1/*, KEY or KEY:TENANT to bind it to a tenant (repeat for "
        f"several; also ${API_KEY_ENV})",
    )
    s.add_argument(
        "--api-keys-file",
        default=None,
        help="file of accepted keys, one KEY or KEY:TENANT per line ('#' comments), e.g. from a Secret",
    )
    s.add_argument(
        "--trust-tenant-header",
        action="store_true",
        help="with API keys, still believe any client's x-tenant header (behind a proxy that sets it)",
    )
    s.add_argument(
        "--router-token",
        default=os.environ.get(ROUTER_TOKEN_ENV),
        help=f"shared token of the router sidecar, which may name the tenant (default: ${ROUTER_TOKEN_ENV})",
    )
    s.add_argument(
        "--trace-user",
        action="store_true",
        help="record the request's 'user' field on its trace span (off: it is often an e-mail)",
    )
    s.add_argument(
        "--max-queue-len",
        type=int,
        default=d.max_queue_len,
        help="most requests accepted but not yet scheduled; more get 429",
    )
    s.add_argument(
        "--queue-timeout",
        type=float,
        default=d.queue_timeout_s,
        help="seconds a request may wait to be scheduled before it gets 503 (0 = no limit)",
    )
    s.add_argument(
        "--max-body-bytes", type=int, default=d.max_body_bytes, help="larger request bodies get 413"
    )
    s.add_argument(
        "--body-read-timeout",
        type=float,
        default=d.body_read_timeout_s,
        help="seconds a request body may take to arrive; then 408",
    )
    s.add_argument(
        "--slo-ttft",
        type=float,
        default=None,
        help="TTFT objective in seconds (SLO attainment / goodput metrics)",
    )
    s.add_argument(
        "--slo-tpot",
        type=float,
        default=None,
        help="TPOT objective in seconds (SLO attainment / goodput metrics)",
    )
    s.add_argument(
        "--tenant-rate-limit",
        type=float,
        default=d.tenant_rate_limit,
        help="requests per second per tenant (x-tenant header, else API key); 0 = off",
    )
    s.add_argument(
        "--tenant-burst", type=float, default=None, help="token-bucket size (default: max(1, rate))"
    )
    s.add_argument(
        "--drain-grace-seconds",
        type=float,
        default=d.drain_grace_s,
        help="after SIGTERM, how long in-flight requests may finish",
    )
    s.add_argument(
        "--warmup-buckets",
        default=",".join(f"{b.batch_size}x{b.prompt_len}" for b in DEFAULT_WARMUP_BUCKETS),
        help="warm-up passes before /ready: BATCHxPROMPT_TOKENS,... ('none' to skip)",
    )
    s.add_argument(
        "--stream-buffer-chunks",
        type=int,
        default=d.stream_buffer_chunks,
        help="chunks buffered per request before a slow client's request is paused",
    )
    s.add_argument(
        "--stream-buffer-bytes",
        type=int,
        default=d.stream_buffer_bytes,
        help="bytes of a stream held for a client that does not read (queue, write and socket buffers)",
    )
    s.add_argument(
        "--write-stall-timeout",
        type=float,
        default=d.write_stall_timeout_s,
        help="close a connection whose client accepts no bytes for this long (0 = never)",
    )
    s.add_argument(
        "--backpressure-timeout",
        type=float,
        default=d.backpressure_timeout_s,
        help="cancel a request paused this long for a client that does not read (0 = never)",
    )
    s.add_argument("--retry-after", type=int, default=d.retry_after_s, help="Retry-After seconds on 429/503")
    s.add_argument(
        "--loop-stall-timeout",
        type=float,
        default=d.loop_stall_timeout_s,
        help="/health fails when one engine iteration runs longer than this",
    )
    s.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=d.timeout_keep_alive_s,
        help="seconds an idle keep-alive connection stays open (a router reuses them)",
    )
    s.add_argument(
        "--log-level", default=d.log_level, choices=("critical", "error", "warning", "info", "debug", "trace")
    )
    s.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=d.access_log)
    return p


def _api_key_specs(ns: argparse.Namespace) -> list[str]:
    specs = list(ns.api_key or [])
    if ns.api_keys_file:
        try:
            specs += read_api_keys_file(ns.api_keys_file)
        except OSError as err:
            raise ServerConfigError(f"--api-keys-file {ns.api_keys_file}: {err.strerror}") from None
    if not specs and os.environ.get(API_KEY_ENV):
        specs = [os.environ[API_KEY_ENV]]
    return specs


def server_config_from_namespace(ns: argparse.Namespace) -> ServerConfig:
    try:
        keys, bindings = key_bindings(_api_key_specs(ns))
    except TenantError as err:
        raise ServerConfigError(str(err)) from None
    return ServerConfig(
        host=ns.host,
        port=ns.port,
        api_keys=keys,
        api_key_tenants=bindings,
        trust_tenant_header=ns.trust_tenant_header,
        router_token=ns.router_token or None,
        trace_user=ns.trace_user,
        max_queue_len=ns.max_queue_len,
        queue_timeout_s=ns.queue_timeout,
        max_body_bytes=ns.max_body_bytes,
        body_read_timeout_s=ns.body_read_timeout,
        slo_ttft_s=ns.slo_ttft,
        slo_tpot_s=ns.slo_tpot,
        tenant_rate_limit=ns.tenant_rate_limit,
        tenant_burst=ns.tenant_burst,
        drain_grace_s=ns.drain_grace_seconds,
        warmup_buckets=parse_warmup_buckets(ns.warmup_buckets),
        stream_buffer_chunks=ns.stream_buffer_chunks,
        backpressure_timeout_s=ns.backpressure_timeout,
        stream_buffer_bytes=ns.stream_buffer_bytes,
        write_stall_timeout_s=ns.write_stall_timeout,
        retry_after_s=ns.retry_after,
        loop_stall_timeout_s=ns.loop_stall_timeout,
        timeout_keep_alive_s=ns.timeout_keep_alive,
        log_level=ns.log_level,
        access_log=ns.access_log,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    engine_config = config_from_namespace(parser, ns, served_model_name=ns.served_model_name)
    try:
        config = server_config_from_namespace(ns)
    except ServerConfigError as err:
        parser.error(str(err))
    from kvpilot.engine.server.runner import serve  # uvicorn, FastAPI: only once the flags are valid

    return serve(engine_config, config)
