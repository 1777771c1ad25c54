"""Kopf handlers for InferenceService: registered with a config, then run by ``kvpilot operator run``.

- create / update / resume: reconcile now (children and status);
- a timer: reconcile again every ``status_interval_seconds``, which refreshes the phase from the pods and
  reverts manual edits of managed fields;
- delete: children go by owner-reference garbage collection; the handler only drops the metrics series.
  It is optional, but the timer makes Kopf keep a finalizer anyway (to stop the timer first); see
  ``_configure_kopf`` for how long a deletion can wait on a running timer.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf

from kvpilot.operator import api_names, metrics
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.kube_api import KubeApi, KubeApiError, load_client_configuration
from kvpilot.operator.reconcile import reconcile

RETRY_DELAY_SECONDS = 10
#: how often Kopf re-checks a refresh timer that was mid-reconcile when its InferenceService was deleted
TIMER_EXIT_POLL_SECONDS = 1.0
RESOURCE = (api_names.GROUP, api_names.VERSION, api_names.PLURAL)


def _configure_kopf(settings: kopf.OperatorSettings) -> None:
    # Keep Kopf's bookkeeping under the project's own prefix, in annotations (the status schema is closed).
    settings.persistence.finalizer = f"{api_names.GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=api_names.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=api_names.GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING  # Kubernetes Events only for what a user must look at
    settings.watching.server_timeout = 300  # reconnect watches regularly, as long-lived clients should
    # The refresh timer makes Kopf hold a finalizer. A timer that is mid-reconcile when its object is
    # deleted does not exit within Kopf's instant-exit cycles, and Kopf then re-checks it only every
    # `cancellation_polling` seconds - 60 by default - keeping the finalizer, the children and a waiting
    # `kubectl delete` that long. A reconcile takes well under a second: re-check every second.
    settings.background.cancellation_polling = TIMER_EXIT_POLL_SECONDS


def register(config: OperatorConfig, registry: kopf.OperatorRegistry | None = None) -> kopf.OperatorRegistry:
    """Register every handler into ``registry`` (Kopf's default one if None) and return it."""
    registry = registry if registry is not None else kopf.get_default_registry()
    api_holder: list[KubeApi] = []

    def api() -> KubeApi:
        return api_holder[0]

    @kopf.on.startup(registry=registry)
    def start(settings: kopf.OperatorSettings, **_: Any) -> None:
        _configure_kopf(settings)
        load_client_configuration()
        api_holder.append(KubeApi())
        if config.metrics_port is not None:
            metrics.serve(config.metrics_port)

    async def reconcile_into(body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger) -> None:
        if body.metadata.get("deletionTimestamp"):
            return  # going away: garbage collection takes the children; never re-create them now
        try:
            # Blocking API calls run in a thread; the handler stays async so Kopf can cancel a timer at once
            # when the object is deleted (a sync timer would hold the deletion until it returns).
            result = await asyncio.to_thread(reconcile, api(), dict(body), config)
        except KubeApiError as error:
            metrics.RECONCILIATIONS.labels("error").inc()
            raise kopf.TemporaryError(str(error), delay=RETRY_DELAY_SECONDS) from error
        if result.error is not None:
            logger.warning("invalid spec: %s", result.error)
        if result.status_patch:
            patch["status"] = result.status_patch

    @kopf.on.resume(*RESOURCE, registry=registry)
    @kopf.on.create(*RESOURCE, registry=registry)
    @kopf.on.update(*RESOURCE, field="spec", registry=registry)
    async def on_change(body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, **_: Any) -> None:
        await reconcile_into(body, patch, logger)

    @kopf.timer(
        *RESOURCE,
        interval=config.status_interval_seconds,
        initial_delay=config.status_interval_seconds,
        registry=registry,
    )
    async def refresh(body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, **_: Any) -> None:
        await reconcile_into(body, patch, logger)

    @kopf.on.delete(*RESOURCE, optional=True, registry=registry)
    def on_delete(namespace: str | None, name: str, **_: Any) -> None:
        if namespace is not None:  # always, for the namespaced InferenceService (kopf's type allows None)
            metrics.forget(namespace, name)

    return registry
