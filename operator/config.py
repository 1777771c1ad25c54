"""Settings of one operator process (from `kvpilot operator run` flags; the chart sets them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.operator.api_names import DEFAULT_IMAGE
from kvpilot.operator.child_validation import is_dns_subdomain

#: the cluster's DNS domain when neither --cluster-domain nor $CLUSTER_DOMAIN says (Kubernetes' default)
DEFAULT_CLUSTER_DOMAIN = "cluster.local"


@dataclass(frozen=True)
class OperatorConfig:
    default_image: str = DEFAULT_IMAGE  # engine/router image when spec.engine.image is not set
    #: while an engine loads or warms up, how often its /ready progress is read into the status
    status_interval_seconds: float = 10.0
    #: the slow full pass over every InferenceService (watches cover the rest: handlers.py)
    resync_interval_seconds: float = 300.0
    engine_probe_timeout_seconds: float = 1.0  # per /ready call to a not-yet-ready engine
    metrics_port: int | None = None  # Prometheus endpoint of the operator itself; None: off
    #: the DNS domain of status.endpoint (<name>.<namespace>.svc.<domain>); kubelet's --cluster-domain
    cluster_domain: str = DEFAULT_CLUSTER_DOMAIN

    def __post_init__(self) -> None:
        # "nan" and "inf" parse as floats; nan compares false with everything, so it passed "<= 0"
        for flag, seconds in (
            ("--status-interval", self.status_interval_seconds),
            ("--resync-interval", self.resync_interval_seconds),
            ("--engine-probe-timeout", self.engine_probe_timeout_seconds),
        ):
            if not (math.isfinite(seconds) and seconds > 0):
                raise ValueError(f"{flag} must be positive")
        if self.metrics_port is not None and not 0 < self.metrics_port < 65536:
            raise ValueError("--metrics-port must be a TCP port (1-65535)")
        if not is_dns_subdomain(self.cluster_domain):
            raise ValueError(
                f"--cluster-domain must be a DNS domain like cluster.local, got {self.cluster_domain!r}"
            )
