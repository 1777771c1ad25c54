"""Names that identify the InferenceService API and the objects the operator manages."""

from __future__ import annotations

GROUP = "kvpilot.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ("kvis",)
CRD_NAME = f"{PLURAL}.{GROUP}"

# Labels on every child; the selector label is the one part of a Deployment that can never change.
SELECTOR_LABEL = f"{GROUP}/inferenceservice"
MANAGED_BY = "kvpilot-operator"
# Where the operator keeps its own bookkeeping on the objects it manages.
LAST_APPLIED_ANNOTATION = f"{GROUP}/last-applied"

ENGINE_CONTAINER = "engine"
ROUTER_CONTAINER = "router"
FETCH_CONTAINER = "fetch-model"  # the init container of a fetched model source (model_delivery.py)
ENGINE_PORT = 8000
ROUTER_PORT = 8080
SERVICE_PORT = 80
DEFAULT_IMAGE = "ghcr.io/kvpilot/kvpilot:0.1.0"

# The per-InferenceService token that proves a request comes from a router sidecar (which may then set
# x-tenant): Secret <name>-router-token, key "token", given to both containers in this variable.
ROUTER_TOKEN_SECRET_SUFFIX = "-router-token"
ROUTER_TOKEN_KEY = "token"
ROUTER_TOKEN_ENV = "KVPILOT_ROUTER_TOKEN"
ROUTER_TOKEN_BYTES = 32  # random bytes, hex-encoded: 64 characters
