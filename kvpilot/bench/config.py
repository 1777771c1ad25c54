"""Typed configuration of ``kvpilot bench serve``, validated once at the boundary.

Every field is documented where it is declared. ``validate()`` raises :class:`ConfigError` with a message
that names the offending flag, so the CLI can turn it into an argparse error (exit code 2).
"""

from __future__ import annotations

import argparse
import math
import os
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

API_KINDS = ("completions", "chat")
WORKLOAD_KINDS = ("random", "shared-prefix", "sharegpt")
LOAD_MODES = ("open", "closed")
# Latency figures the saturation rule may watch: <metric>_<percentile>.
SATURATION_LATENCIES = tuple(
    f"{metric}_{pct}" for metric in ("ttft", "tpot", "itl", "e2e") for pct in ("p50", "p90", "p99")
)


def length_range(text: str) -> tuple[int, int]:
    """argparse type: ``N`` or ``MIN:MAX`` → (MIN, MAX); bounds are checked where the range is used."""
    try:
        low, _, high = text.partition(":")
        return (int(low), int(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX, got {text!r}") from None


def rates_list(text: str) -> tuple[float, ...]:
    """argparse type: ``R[,R...]`` request rates, ``inf`` for all at once."""
    try:
        return tuple(math.inf if part.strip().lower() == "inf" else float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected rates like '4' or '1,2,4,inf', got {text!r}") from None


def levels_list(text: str) -> tuple[int, ...]:
    """argparse type: ``C[,C...]`` concurrency levels."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like '8' or '1,2,4,8', got {text!r}") from None


def length_range_error(flag: str, bounds: tuple[int, int]) -> str | None:
    """The message for a MIN:MAX range that breaks 1 <= MIN <= MAX (each caller reports it its own way)."""
    low, high = bounds
    return None if 1 <= low <= high else f"{flag} needs 1 <= MIN <= MAX (got {low}:{high})"


def url_error(flag: str, url: str) -> str | None:
    """Why ``url`` is no http(s)://HOST[:PORT] URL (checked here, not by the first request, which failed
    with an unrelated message, or for --ready-url polled until its timeout)."""
    if not url.startswith(("http://", "https://")):
        return f"{flag} must start with http:// or https:// (got {url!r})"
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises for a port out of range or not a number
    except ValueError as error:
        return f"{flag} is not a valid URL: {error} (got {url!r})"
    return None if parts.hostname else f"{flag} has no host (got {url!r})"


def output_path_error(flag: str, path: Path, *, directory: bool) -> str | None:
    """Why the report or plots could not be written to ``path`` (created with its parents at the end of a
    run): found before the run, not after it as a traceback."""
    if path.exists() and path.is_dir() != directory:
        return f"{flag} {path} is {'not ' if directory else ''}a directory"
    if not directory and path.exists():
        # an existing file is opened for writing in place: its own permission counts, not its directory's
        # (/dev/stdout, or a report file kept in a read-only directory)
        return None if os.access(path, os.W_OK) else f"{flag} {path} is not writable"
    parent = path if directory else path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        return f"{flag} {path}: {parent} is not a writable directory"
    return None


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the flag."""


@dataclass(frozen=True)
class EndpointConfig:
    base_url: str = "http://127.0.0.1:8000"  # server root, without /v1
    api: str = "completions"  # "completions" -> /v1/completions, "chat" -> /v1/chat/completions
    model: str | None = None  # None: take the first id that /v1/models lists
    api_key: str | None = None  # sent as "Authorization: Bearer <key>"
    request_timeout_s: float = 600.0  # whole request, first byte to end of stream
    connect_timeout_s: float = 10.0  # TCP connect only
    ready_url: str | None = None  # polled until HTTP 200 before anything else; time-to-ready is reported
    ready_timeout_s: float = 600.0  # give up polling ready_url after this long
    include_usage: bool = True  # send stream_options.include_usage so the server reports token counts
    ignore_eos: bool = False  # vLLM extra param: keep generating past EOS up to max_tokens
    min_tokens_equal_max: bool = False  # vLLM extra param: min_tokens = max_tokens (fixed output length)
    temperature: float = 0.0  # 0 = greedy, so runs are comparable
    # reuse connections; False: a new one per request (llama.cpp's server closes a connection after a
    # streamed response while announcing keep-alive, so a reused one fails: "Can not write request body")
    keep_alive: bool = True

    @property
    def request_path(self) -> str:
        return "/v1/chat/completions" if self.api == "chat" else "/v1/completions"

    def validate(self) -> None:
        for flag, url in (("--base-url", self.base_url), ("--ready-url", self.ready_url)):
            if url is not None and (error := url_error(flag, url)):
                raise ConfigError(error)
        if self.api not in API_KINDS:
            raise ConfigError(f"--api must be one of {API_KINDS} (got {self.api!r})")
        for flag, value in (
            ("--request-timeout", self.request_timeout_s),
            ("--connect-timeout", self.connect_timeout_s),
            ("--ready-timeout", self.ready_timeout_s),
        ):
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{flag} must be a positive number of seconds (got {value})")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"--temperature must be >= 0 (got {self.temperature})")


@dataclass(frozen=True)
class LoadConfig:
    mode: str = "open"  # "open": arrivals on a schedule; "closed": a fixed number of busy clients
    request_rates: tuple[float, ...] = (math.inf,)  # open loop, req/s; several = a sweep; inf = all at t=0
    concurrencies: tuple[int, ...] = ()  # closed loop: clients in flight; several = a sweep
    burstiness: float = 1.0  # gamma shape of inter-arrival times: 1 = Poisson, <1 burstier, >1 smoother
    max_concurrency: int | None = None  # open loop: client-side cap on requests in flight (None = no cap)
    num_requests: int | None = 200  # measured requests per load point (None: bounded by duration_s)
    duration_s: float | None = None  # stop issuing new requests after this long (None: by count only)
    warmup_requests: int = 2  # sent one at a time before the first point, excluded; reported as cold start

    def validate(self) -> None:
        if self.mode not in LOAD_MODES:
            raise ConfigError(f"load mode must be one of {LOAD_MODES} (got {self.mode!r})")
        if self.mode == "open":
            if not self.request_rates:
                raise ConfigError("--request-rate needs at least one value")
            for rate in self.request_rates:
                if not rate > 0:
                    raise ConfigError(f"--request-rate values must be > 0 or inf (got {rate})")
            if len(set(self.request_rates)) != len(self.request_rates):
                raise ConfigError(f"--request-rate lists a rate twice (got {self.request_rates})")
            if math.inf in self.request_rates and self.num_requests is None:
                raise ConfigError("--request-rate inf sends everything at once and needs --num-requests")
        else:
            if not self.concurrencies:
                raise ConfigError("--concurrency needs at least one value")
            for level in self.concurrencies:
                if level < 1:
                    raise ConfigError(f"--concurrency values must be >= 1 (got {level})")
            if len(set(self.concurrencies)) != len(self.concurrencies):
                raise ConfigError(f"--concurrency lists a level twice (got {self.concurrencies})")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ConfigError(f"--burstiness must be a positive finite number (got {self.burstiness})")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ConfigError(f"--max-concurrency must be >= 1 (got {self.max_concurrency})")
        if self.num_requests is None and self.duration_s is None:
            raise ConfigError("give --num-requests or --duration (or both)")
        if self.num_requests is not None and self.num_requests < 1:
            raise ConfigError(f"--num-requests must be >= 1 (got {self.num_requests})")
        if self.duration_s is not None and not (self.duration_s > 0 and math.isfinite(self.duration_s)):
            raise ConfigError(f"--duration must be a positive number of seconds (got {self.duration_s})")
        if self.warmup_requests < 0:
            raise ConfigError(f"--warmup-requests must be >= 0 (got {self.warmup_requests})")

    @property
    def levels(self) -> tuple[float, ...]:
        """The sweep's load levels in the order they run: rates (open) or concurrencies (closed)."""
        if self.mode == "open":
            return tuple(sorted(self.request_rates))
        return tuple(float(c) for c in sorted(self.concurrencies))


@dataclass(frozen=True)
class WorkloadConfig:
    kind: str = "random"  # "random" | "shared-prefix" | "sharegpt"
    input_len_range: tuple[int, int] = (128, 512)  # prompt words (≈ tokens), uniform, inclusive
    output_len_range: tuple[int, int] = (32, 128)  # max_tokens, uniform, inclusive
    num_tenants: int = 4  # shared-prefix: tenants, each with its own system prompt
    system_prompt_len: int = 1024  # shared-prefix: words in each tenant's shared system prompt
    dataset_path: Path | None = None  # sharegpt: the JSON file
    sharegpt_output_cap: int = 1024  # sharegpt: max_tokens = min(words of the gpt turn, this cap)
    # scale the lengths down to the context /v1/models reports, if they could exceed it (context_fit)
    fit_context: bool = True

    def validate(self) -> None:
        if self.kind not in WORKLOAD_KINDS:
            raise ConfigError(f"--workload must be one of {WORKLOAD_KINDS} (got {self.kind!r})")
        for flag, bounds in (("--input-len", self.input_len_range), ("--output-len", self.output_len_range)):
            if error := length_range_error(flag, bounds):
                raise ConfigError(error)
        if self.num_tenants < 1:
            raise ConfigError(f"--num-tenants must be >= 1 (got {self.num_tenants})")
        if self.system_prompt_len < 1:
            raise ConfigError(f"--system-prompt-len must be >= 1 (got {self.system_prompt_len})")
        if self.sharegpt_output_cap < 1:
            raise ConfigError(f"--sharegpt-output-cap must be >= 1 (got {self.sharegpt_output_cap})")
        if self.kind == "sharegpt":
            if self.dataset_path is None:
                raise ConfigError("--workload sharegpt needs --dataset-path")
            if not self.dataset_path.is_file():
                raise ConfigError(f"--dataset-path {self.dataset_path} is not a readable file")
        elif self.dataset_path is not None:
            raise ConfigError("--dataset-path is only used with --workload sharegpt")


@dataclass(frozen=True)
class SLOConfig:
    ttft_s: float | None = None  # a request meets the SLO only if TTFT <= this
    tpot_s: float | None = None  # ... and TPOT <= this (requests with one output token have no TPOT)

    @property
    def given(self) -> bool:
        return self.ttft_s is not None or self.tpot_s is not None

    def validate(self) -> None:
        for flag, value in (("--slo-ttft", self.ttft_s), ("--slo-tpot", self.tpot_s)):
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{flag} must be a positive number of seconds (got {value})")


@dataclass(frozen=True)
class SaturationRule:
    """How a sweep's saturation point is found; see ``kvpilot.bench.saturation`` for the rule itself."""

    latency: str = "ttft_p50"  # the latency figure watched, e.g. "ttft_p50", "e2e_p99"
    latency_factor: float = 2.0  # saturated once that latency exceeds this multiple of the lowest-load value
    min_throughput_gain: float = 0.05  # ... or achieved req/s rises by less than this fraction between points
    min_efficiency: float = 0.8  # ... or (open loop) achieved req/s falls below this fraction of offered

    def validate(self) -> None:
        if self.latency not in SATURATION_LATENCIES:
            raise ConfigError(f"--saturation-latency must be one of {SATURATION_LATENCIES}")
        if not self.latency_factor > 1:
            raise ConfigError(f"--saturation-latency-factor must be > 1 (got {self.latency_factor})")
        if not 0 <= self.min_throughput_gain < 1:
            raise ConfigError(f"--saturation-min-gain must be in [0, 1) (got {self.min_throughput_gain})")
        if not 0 < self.min_efficiency <= 1:
            raise ConfigError(f"min_efficiency must be in (0, 1] (got {self.min_efficiency})")


@dataclass(frozen=True)
class ServeBenchConfig:
    endpoint: EndpointConfig = field(default_factory=EndpointConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    slo: SLOConfig = field(default_factory=SLOConfig)
    saturation: SaturationRule = field(default_factory=SaturationRule)
    seed: int = 0  # seeds arrivals and prompts; the same seed gives the same run
    output_json: Path | None = None  # full report incl. per-request records
    plot_dir: Path | None = None  # PNG plots (throughput vs latency, latency CDFs)
    show_progress: bool = True  # tqdm progress bar on stderr

    def validate(self) -> None:
        self.endpoint.validate()
        self.load.validate()
        self.workload.validate()
        self.slo.validate()
        self.saturation.validate()
        if self.seed < 0:
            raise ConfigError(f"--seed must be >= 0 (got {self.seed})")
        for flag, path, directory in (
            ("--output-json", self.output_json, False),
            ("--plot-dir", self.plot_dir, True),
        ):
            if path is not None and (error := output_path_error(flag, path, directory=directory)):
                raise ConfigError(error)
