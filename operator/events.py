"""Kubernetes Events about an InferenceService (core/v1), for what a person should see in
``kubectl describe kvis``: the autoscaler's scale changes and capacity warnings.

Posting is best effort: a failed Event is logged and never fails the reconcile that decided.
"""

from __future__ import annotations

import logging
import time

from kvpilot.operator import api_names
from kvpilot.operator.kube_api import KubeApi, KubeApiError
from kvpilot.operator.spec import InferenceService

log = logging.getLogger(__name__)


def event_object(isvc: InferenceService, type_: str, reason: str, message: str, now: float) -> dict:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
    return {
        "apiVersion": "v1",
        "kind": "Event",
        # <object>.<unique suffix>, as client-go's recorder names them
        "metadata": {"name": f"{isvc.name}.{int(now * 1e9):x}", "namespace": isvc.namespace},
        "involvedObject": {
            "apiVersion": api_names.API_VERSION,
            "kind": api_names.KIND,
            "name": isvc.name,
            "namespace": isvc.namespace,
            "uid": isvc.uid,
        },
        "type": type_,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": api_names.MANAGED_BY},
        "reportingComponent": api_names.MANAGED_BY,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


def post_event(api: KubeApi, isvc: InferenceService, type_: str, reason: str, message: str) -> None:
    try:
        api.create(event_object(isvc, type_, reason, message, time.time()))
    except KubeApiError as error:
        log.warning("%s/%s: event %s not posted: %s", isvc.namespace, isvc.name, reason, error)
