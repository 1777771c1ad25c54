"""Kopf handlers for InferenceService: registered with a config, then run by ``kvpilot operator run``.

Every reconcile goes through one queue (``requeue``: one at a time per service, triggers coalesced) and
reads the InferenceService afresh, so whatever asked for it, the pass sees the current object
(docs/architecture.md#watches-and-resync). What asks:

- create / spec update / resume of an InferenceService;
- a watch event on a child it owns (Deployment, Services, PodDisruptionBudget, the pods): a deleted or
  edited child is put back, and a pod or rollout change reaches the status, at once;
- a follow-up after ``status_interval_seconds`` while an engine is loading or warming up: its progress
  is in its ``/ready`` body, which no watch sees;
- in autoscaling.mode operator, the autoscaler's next evaluation (``autoscaling.intervalSeconds``);
- a slow resync timer (``resync_interval_seconds``) for what is not watched: the router's
  ServiceAccount, Role and RoleBinding and the token Secret (never listed or watched: the operator must
  not be able to enumerate Secrets; a pod waiting for a missing one shows up in the pod watch anyway).

delete: children go by owner-reference garbage collection; the handler only drops the metrics series and
the queue's state. It is optional, but the timer makes Kopf keep a finalizer anyway (to stop the timer
first); see ``_configure_kopf`` for how long a deletion can wait on a running timer.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf

from kvpilot.operator import api_names, metrics
from kvpilot.operator.autoscaler import Autoscaler
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.kube_api import KubeApi, KubeApiError, ObjectRef, load_client_configuration
from kvpilot.operator.reconcile import reconcile
from kvpilot.operator.requeue import Key, Requeue

RETRY_DELAY_SECONDS = 10
#: a child the API server refuses or another owner holds: retried after 10 s, 20 s, 40 s ... at most this
MAX_BACKOFF_SECONDS = 300
#: how often Kopf re-checks a refresh timer that was mid-reconcile when its InferenceService was deleted
TIMER_EXIT_POLL_SECONDS = 1.0
RESOURCE = (api_names.GROUP, api_names.VERSION, api_names.PLURAL)
# The children whose changes are watched, as (group, version, plural); every one carries the labels of
# children.common_labels (pods through the Deployment's template).
WATCHED_CHILDREN = (
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("", "v1", "pods"),
)
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
log = logging.getLogger(__name__)


def _configure_kopf(settings: kopf.OperatorSettings) -> None:
    # Keep Kopf's bookkeeping under the project's own prefix, in annotations (the status schema is closed).
    settings.persistence.finalizer = f"{api_names.GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=api_names.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=api_names.GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING  # Kubernetes Events only for what a user must look at
    settings.watching.server_timeout = 300  # reconnect watches regularly, as long-lived clients should
    # The API server filters the children's watches: only the operator's own objects reach it.
    for child in WATCHED_CHILDREN:
        settings.watching.label_selectors[child] = f"{MANAGED_BY_LABEL}={api_names.MANAGED_BY}"
    # The refresh timer makes Kopf hold a finalizer. A timer that is mid-reconcile when its object is
    # deleted does not exit within Kopf's instant-exit cycles, and Kopf then re-checks it only every
    # `cancellation_polling` seconds - 60 by default - keeping the finalizer, the children and a waiting
    # `kubectl delete` that long. A reconcile takes well under a second: re-check every second.
    settings.background.cancellation_polling = TIMER_EXIT_POLL_SECONDS


def backoff_delay(failures: int) -> float:
    """Seconds before the next try after ``failures`` passes in a row found a child blocked."""
    return float(min(MAX_BACKOFF_SECONDS, RETRY_DELAY_SECONDS * 2 ** min(failures - 1, 16)))


def _reconcile_pass(
    api: KubeApi,
    key: Key,
    config: OperatorConfig,
    autoscaler: Autoscaler,
    blocked: dict[Key, tuple[int, int]],
) -> float | None:
    """One reconcile of the InferenceService as it is now; the seconds until a follow-up is due, if one is.

    ``blocked``: per service, (generation, passes in a row) that could not apply a child; the delay grows
    with the count and starts again for a new generation (the status says why, so no tight retry)."""
    ref = ObjectRef(api_names.API_VERSION, api_names.KIND, *key)
    body = api.get(ref)
    if body is None or body.get("metadata", {}).get("deletionTimestamp"):
        return None  # gone or going: garbage collection takes the children; never re-create them now
    result = reconcile(api, body, config, autoscaler)
    if result.error is not None:
        log.warning("%s/%s: invalid spec: %s", *key, result.error)
    if result.status_patch:
        api.merge_patch(ref, {"status": result.status_patch}, subresource="status")
    # The autoscaler's next evaluation and an engine's progress both need a pass that no watch triggers.
    delays = [config.status_interval_seconds] if result.follow_up else []
    if result.autoscale_in is not None:
        delays.append(result.autoscale_in)
    if result.blocked is None:
        blocked.pop(key, None)
    else:
        generation = int(body["metadata"].get("generation", 0))
        before, count = blocked.get(key, (generation, 0))
        blocked[key] = (generation, count + 1 if before == generation else 1)
        delays.append(backoff_delay(blocked[key][1]))
    return min(delays) if delays else None


def register(config: OperatorConfig, registry: kopf.OperatorRegistry | None = None) -> kopf.OperatorRegistry:
    """Register every handler into ``registry`` (Kopf's default one if None) and return it."""
    registry = registry if registry is not None else kopf.get_default_registry()
    state: dict[str, Any] = {}
    blocked: dict[Key, tuple[int, int]] = {}

    async def reconcile_key(key: Key) -> None:
        try:
            # Blocking API calls run in a thread, so Kopf's loop (watches, timers) keeps going meanwhile.
            follow_up = await asyncio.to_thread(
                _reconcile_pass, state["api"], key, config, state["autoscaler"], blocked
            )
        except KubeApiError as error:
            metrics.RECONCILIATIONS.labels("error").inc()
            log.warning("%s/%s: %s; retrying in %ss", *key, error, RETRY_DELAY_SECONDS)
            state["queue"].trigger(key, RETRY_DELAY_SECONDS)
            return
        if follow_up is not None:
            state["queue"].trigger(key, follow_up)

    def queue() -> Requeue:
        return state["queue"]

    @kopf.on.startup(registry=registry)
    def start(settings: kopf.OperatorSettings, **_: Any) -> None:
        _configure_kopf(settings)
        load_client_configuration()
        state["api"] = KubeApi()
        state["queue"] = Requeue(reconcile_key, retry_delay=RETRY_DELAY_SECONDS)
        state["autoscaler"] = Autoscaler()
        if config.metrics_port is not None:
            metrics.serve(config.metrics_port)

    @kopf.on.resume(*RESOURCE, registry=registry)
    @kopf.on.create(*RESOURCE, registry=registry)
    @kopf.on.update(*RESOURCE, field="spec", registry=registry)
    async def on_change(namespace: str | None, name: str, **_: Any) -> None:
        if namespace is not None:  # always, for the namespaced InferenceService (kopf's type allows None)
            queue().trigger((namespace, name))

    @kopf.timer(
        *RESOURCE,
        interval=config.resync_interval_seconds,
        initial_delay=config.resync_interval_seconds,
        registry=registry,
    )
    async def resync(namespace: str | None, name: str, **_: Any) -> None:
        if namespace is not None:
            queue().trigger((namespace, name))

    for child in WATCHED_CHILDREN:

        @kopf.on.event(
            *child,
            id=f"{child[2]}-changed",
            labels={MANAGED_BY_LABEL: api_names.MANAGED_BY},
            registry=registry,
        )
        async def on_child_event(namespace: str | None, labels: kopf.Labels, **_: Any) -> None:
            owner = labels.get(api_names.SELECTOR_LABEL)
            if namespace is not None and owner:
                queue().trigger((namespace, owner))

    @kopf.on.delete(*RESOURCE, optional=True, registry=registry)
    async def on_delete(namespace: str | None, name: str, **_: Any) -> None:
        if namespace is not None:
            metrics.forget(namespace, name)
            queue().forget((namespace, name))
            blocked.pop((namespace, name), None)
            state["autoscaler"].forget((namespace, name))

    return registry
