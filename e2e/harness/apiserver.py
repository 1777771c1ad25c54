"""The API-server harness: kmock's KubernetesEmulator, extended with what Kopf and kubectl rely on.

kmock serves discovery (from its bundled list of built-in resources), records every request and keeps
every object version. This class answers all resource requests itself: create/get/list/watch/patch/
put/delete with resourceVersions, generations, status subresources, finalizers, owner-reference garbage
collection, label/field selectors, server-side tables and CRD-declared resources with schema validation.
README.md beside this package lists what it does differently from a real API server.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from typing import Any

import aiohttp.web
import attrs
import kmock
from harness import builtin_validation
from harness import custom_resources as crs
from harness import scale as scales
from harness.patches import (
    PatchError,
    json_patch,
    matches_field_selector,
    matches_label_selector,
    merge_patch,
    strategic_merge_patch,
)
from harness.store import ObjectKey, Store, now_timestamp
from kmock._internal import parsing as kmock_parsing

CRD_RESOURCE = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
NAMESPACES = kmock.resource("", "v1", "namespaces")
_kmock_parse_path = kmock_parsing.parse_path


def _parse_path(path: str) -> kmock_parsing.ParsedPath:
    """kmock reads /api/v1/namespaces[/NAME] as a namespace scope; here they are Namespace objects.

    (kmock 0.8 even fails on the bare collection path, so ``kubectl create namespace`` could not work.)
    """
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and (len(parts) <= 4 or parts[4] in ("status", "finalize")):
        return kmock_parsing.ParsedPath(
            group="",
            version="v1",
            plural="namespaces",
            name=parts[3] if len(parts) > 3 else None,
            subresource=parts[4] if len(parts) > 4 else None,
        )
    return _kmock_parse_path(path)


kmock_parsing.parse_path = _parse_path
_NOT_SPEC = frozenset({"apiVersion", "kind", "metadata", "status"})


def _status(
    code: int, reason: str, message: str, causes: list[tuple[str, str]] | None = None
) -> kmock.KubernetesError:
    details = {"causes": [{"field": f, "message": m, "reason": "FieldValueInvalid"} for f, m in causes or []]}
    return kmock.KubernetesError(status=code, reason=reason, message=message, details=details)


@attrs.define(kw_only=True)
class ApiServerHarness(kmock.KubernetesEmulator):
    store: Store = attrs.field(init=False)
    custom: dict[kmock.resource, crs.CustomResource] = attrs.field(factory=dict, init=False)
    on_change: list[Any] = attrs.field(factory=list, init=False)  # callbacks(resource, key) after writes

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.resources.load_bundled()
        self.store = Store(self._objects)
        self["get /openapi/v3"] << (lambda request: self._openapi_index())
        self["get", re.compile(r"/openapi/v3/.+")] << self._openapi_document

    async def _serve_version(self, request: kmock.Request) -> dict[str, Any]:
        # kmock repeats a resource's short names on its subresources; kubectl then calls "svc" ambiguous.
        # It also lists connect subresources (proxy, exec, token...) with the parent's kind and verbs, which
        # kubectl's REST mapper trips over; only status and scale are served here, listed after the parent.
        listing = await super()._serve_version(request)
        kept = [
            entry
            for entry in listing["resources"]
            if "/" not in entry["name"] or entry["name"].split("/", 1)[1] in ("status", "scale")
        ]
        for entry in kept:
            if "/" in entry["name"]:
                entry.update(shortNames=[], categories=[], verbs=["get", "patch", "update"])
            if entry["name"].endswith("/scale"):  # kubectl's scale client needs the Scale kind
                entry.update(group="autoscaling", version="v1", kind="Scale")
        listing["resources"] = sorted(kept, key=lambda entry: entry["name"])
        listing["groupVersion"] = listing["groupVersion"].lstrip("/")  # kmock says "/v1" for the core group
        return listing

    # ---- routing -------------------------------------------------------------------------------------
    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if (
            request.resource is None
            or request.resource.plural is None
            or request.url.path.startswith("/openapi")
        ):
            return await super()._handle(request)
        try:
            return await self._serve(request)
        except kmock.KubernetesError as error:
            return await self._render_error(error)

    def _info(self, resource: kmock.resource) -> kmock.ResourceInfo:
        if resource not in self.resources:
            raise _status(
                404, "NotFound", f"the server could not find the requested resource ({resource.plural})"
            )
        return self.resources[resource]

    async def _serve(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        resource, method = request.resource, request.method.value
        if "protobuf" in request.headers.get("Content-Type", "") or "cbor" in request.headers.get(
            "Content-Type", ""
        ):
            # Only JSON is spoken here; client-go retries in JSON after a 415, as with old servers.
            raise _status(415, "UnsupportedMediaType", "only JSON bodies are emulated")
        info = self._info(resource)
        namespace = request.namespace if info.namespaced else None
        if method == "GET" and request.params.get("watch") in ("true", "1"):
            return await self._watch(request, resource, namespace)
        if method == "GET" and request.name is None:
            return self._list(request, resource, namespace)
        if method == "POST" and request.name is None:
            return aiohttp.web.json_response(
                await self.create(resource, namespace, request.data, strict=self._strict(request)), status=201
            )
        key: ObjectKey = (resource, namespace, request.name)
        if request.subresource == "scale" and resource in self.custom:
            return aiohttp.web.json_response(await self._scale(request, key, method))
        if method == "GET":
            return self._respond(request, resource, self._existing(key))
        if method in ("PUT", "PATCH"):
            body = await self._write(request, key, method)
            return aiohttp.web.json_response(body)
        if method == "DELETE":
            options = request.data if isinstance(request.data, dict) else {}
            policy = (
                request.params.get("propagationPolicy") or options.get("propagationPolicy") or "Background"
            )
            return aiohttp.web.json_response(await self.delete(key, policy))
        raise _status(405, "MethodNotAllowed", f"{method} is not supported on {request.url.path}")

    @staticmethod
    def _strict(request: kmock.Request) -> bool:
        return request.params.get("fieldValidation", "") == "Strict"

    def _existing(self, key: ObjectKey) -> dict[str, Any]:
        obj = self.store.get(key)
        if obj is None:
            raise _status(404, "NotFound", f'{key[0].plural} "{key[2]}" not found')
        return obj

    def _typed(self, resource: kmock.resource, obj: dict[str, Any]) -> dict[str, Any]:
        info = self.resources[resource]
        group_version = f"{resource.group}/{resource.version}" if resource.group else resource.version
        return {"apiVersion": group_version, "kind": info.kind, **obj}

    def _respond(
        self, request: kmock.Request, resource: kmock.resource, obj: dict[str, Any]
    ) -> aiohttp.web.Response:
        if "as=Table" in request.headers.get("Accept", ""):
            columns = self.custom[resource].printer_columns if resource in self.custom else []
            return aiohttp.web.json_response(crs.table([obj], columns, str(self.store.resource_version)))
        return aiohttp.web.json_response(self._typed(resource, obj))

    # ---- reads ---------------------------------------------------------------------------------------
    def _select(self, request: kmock.Request, resource: kmock.resource, namespace: str | None) -> list[dict]:
        try:
            return [
                obj
                for obj in self.store.list(resource, namespace)
                if matches_label_selector(
                    obj["metadata"].get("labels", {}), request.params.get("labelSelector")
                )
                and matches_field_selector(obj, request.params.get("fieldSelector"))
            ]
        except PatchError as error:
            raise _status(400, "BadRequest", str(error)) from error

    def _list(
        self, request: kmock.Request, resource: kmock.resource, namespace: str | None
    ) -> aiohttp.web.Response:
        objects = self._select(request, resource, namespace)
        version = str(self.store.resource_version)
        if "as=Table" in request.headers.get("Accept", ""):
            columns = self.custom[resource].printer_columns if resource in self.custom else []
            return aiohttp.web.json_response(crs.table(objects, columns, version))
        info = self.resources[resource]
        group_version = f"{resource.group}/{resource.version}" if resource.group else resource.version
        return aiohttp.web.json_response(
            {
                "apiVersion": group_version,
                "kind": f"{info.kind}List",
                "metadata": {"resourceVersion": version},
                "items": [self._typed(resource, obj) for obj in objects],
            }
        )

    async def _watch(
        self, request: kmock.Request, resource: kmock.resource, namespace: str | None
    ) -> aiohttp.web.StreamResponse:
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request._raw_request)
        since = request.params.get("resourceVersion", "")
        labels, fields = request.params.get("labelSelector"), request.params.get("fieldSelector")

        def wanted(obj: dict[str, Any]) -> bool:
            in_namespace = namespace is None or obj["metadata"].get("namespace") == namespace
            return (
                in_namespace
                and matches_label_selector(obj["metadata"].get("labels", {}), labels)
                and matches_field_selector(obj, fields)
            )

        async def send(kind: str, obj: dict[str, Any]) -> None:
            await response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

        start = self.store.resource_version
        if since in ("", "0") or request.params.get("sendInitialEvents") == "true":
            for obj in self.store.list(resource, namespace):
                if wanted(obj):
                    await send("ADDED", self._typed(resource, obj))
            if request.params.get("sendInitialEvents") == "true":
                await send(
                    "BOOKMARK",
                    {
                        "kind": self.resources[resource].kind,
                        "metadata": {
                            "resourceVersion": str(start),
                            "annotations": {"k8s.io/initial-events-end": "true"},
                        },
                    },
                )
        else:
            start = int(since)
        timeout = float(request.params.get("timeoutSeconds") or 0) or None
        try:
            async with asyncio.timeout(timeout):
                async for event in self.store.follow(start):
                    if event.resource == resource and wanted(event.object):
                        await send(event.type, self._typed(resource, event.object))
        except (TimeoutError, ConnectionError):
            pass
        return response

    # ---- writes --------------------------------------------------------------------------------------
    def _admit(self, resource: kmock.resource, obj: dict[str, Any], strict: bool) -> dict[str, Any]:
        kind, name = self.resources[resource].kind, obj.get("metadata", {}).get("name")
        causes = builtin_validation.causes(kind, obj, custom=resource in self.custom)
        if causes:
            message = ", ".join(f"{field}: {text}" for field, text in causes)
            raise _status(422, "Invalid", f'{kind} "{name}" is invalid: {message}', causes)
        if resource not in self.custom:
            return obj
        try:
            return crs.admit(self.custom[resource], obj, strict)
        except crs.InvalidObject as error:
            raise _status(
                422, "Invalid", f'{kind}.{resource.group} "{name}" is invalid: {error}', error.causes
            ) from error

    async def create(
        self, resource: kmock.resource, namespace: str | None, obj: Any, strict: bool = False
    ) -> dict[str, Any]:
        if not isinstance(obj, dict):
            raise _status(400, "BadRequest", "the body of a create must be an object")
        obj = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}
        metadata = obj.setdefault("metadata", {})
        if not metadata.get("name") and metadata.get("generateName"):
            metadata["name"] = metadata["generateName"] + "".join(
                random.choices("bcdfghjklmnpqrstvwxz2456789", k=5)
            )
        if not metadata.get("name"):
            raise _status(422, "Invalid", "metadata.name: Required value")
        if self.resources[resource].subresources and "status" in self.resources[resource].subresources:
            obj.pop("status", None)  # status is written through its subresource only
        obj = self._admit(resource, obj, strict)
        key: ObjectKey = (resource, namespace, metadata["name"])
        if namespace is not None and self.store.get((NAMESPACES, None, namespace)) is None:
            raise _status(404, "NotFound", f'namespaces "{namespace}" not found')
        if self.store.get(key) is not None:
            raise _status(409, "AlreadyExists", f'{resource.plural} "{metadata["name"]}" already exists')
        if (
            resource == kmock.resource("", "v1", "services")
            and obj.get("spec", {}).get("clusterIP") != "None"
        ):
            obj.setdefault("spec", {})["clusterIP"] = (
                f"10.96.{random.randint(0, 255)}.{random.randint(1, 254)}"
            )
        created = await self.store.create(key, obj)
        if resource == CRD_RESOURCE:
            created = await self._establish(key, created)
        self._notify(resource, key)
        owners = {ref.get("uid") for ref in created["metadata"].get("ownerReferences", [])}
        if owners and not owners & {o["metadata"]["uid"] for _, o in self.store.all_live()}:
            # Created after every owner was gone (a controller racing a deletion): the garbage collector
            # deletes such a dependent, as it would have had it existed when its owner went.
            await self.delete(key)
        return self._typed(resource, created)

    async def _write(self, request: kmock.Request, key: ObjectKey, method: str) -> dict[str, Any]:
        old = self._existing(key)
        content_type = request.headers.get("Content-Type", "").split(";")[0]
        try:
            if method == "PUT":
                new = {k: v for k, v in (request.data or {}).items() if k not in ("apiVersion", "kind")}
                sent = new.get("metadata", {}).get("resourceVersion")
                if sent and sent != old["metadata"]["resourceVersion"]:
                    raise _status(
                        409,
                        "Conflict",
                        "the object has been modified; please apply your changes "
                        "to the latest version and try again",
                    )
            elif content_type == "application/json-patch+json":
                new = json_patch(self._typed(key[0], old), request.data)
            elif content_type == "application/merge-patch+json":
                new = merge_patch(old, request.data)
            elif content_type == "application/strategic-merge-patch+json":
                new = strategic_merge_patch(old, request.data)
            else:
                raise _status(
                    415, "UnsupportedMediaType", f"{content_type} is not emulated (no server-side apply)"
                )
        except PatchError as error:
            raise _status(422, "Invalid", str(error)) from error
        new.pop("apiVersion", None)
        new.pop("kind", None)
        return self._typed(
            key[0],
            await self.update(key, new, subresource=request.subresource or "", strict=self._strict(request)),
        )

    async def _scale(self, request: kmock.Request, key: ObjectKey, method: str) -> dict[str, Any]:
        """The CRD's scale subresource (``harness.scale``): read or write spec.replicas as a Scale."""
        paths = self.custom[key[0]].subresources.get("scale")
        if paths is None:
            raise _status(404, "NotFound", f"{key[0].plural} has no scale subresource")
        obj = self._existing(key)
        scale = scales.scale_of(paths, obj)
        if method == "GET":
            return scale
        content_type = request.headers.get("Content-Type", "").split(";")[0]
        try:
            if method == "PUT":
                new_scale = request.data or {}
            elif content_type == "application/json-patch+json":
                new_scale = json_patch(scale, request.data)
            else:
                new_scale = merge_patch(scale, request.data)
            new = scales.with_replicas(paths, obj, new_scale)
        except (PatchError, ValueError) as error:
            raise _status(422, "Invalid", str(error)) from error
        return scales.scale_of(paths, await self.update(key, new))

    async def update(
        self, key: ObjectKey, new: dict[str, Any], subresource: str = "", strict: bool = False
    ) -> dict[str, Any]:
        old = self._existing(key)
        info = self.resources[key[0]]
        if subresource == "status":
            new = {**old, "status": new.get("status", {})}
        elif "status" in info.subresources:
            new = (
                {**new, "status": old["status"]}
                if "status" in old
                else {k: v for k, v in new.items() if k != "status"}
            )
        for field in ("uid", "creationTimestamp", "namespace", "name", "deletionTimestamp"):
            if field in old["metadata"]:
                new.setdefault("metadata", {})[field] = old["metadata"][field]
        new = self._admit(key[0], new, strict)
        spec_changed = any(new.get(k) != old.get(k) for k in set(new) | set(old) if k not in _NOT_SPEC)
        stored = await self.store.update(key, new, spec_changed)
        if stored["metadata"].get("deletionTimestamp") and not stored["metadata"].get("finalizers"):
            return await self._remove(key, "Background")
        self._notify(key[0], key)
        return stored

    async def delete(self, key: ObjectKey, policy: str = "Background") -> dict[str, Any]:
        obj = self._existing(key)
        if obj["metadata"].get("finalizers"):
            if not obj["metadata"].get("deletionTimestamp"):
                obj["metadata"]["deletionTimestamp"] = now_timestamp()
                obj = await self.store.update(key, obj, spec_changed=False)
                self._notify(key[0], key)
            return self._typed(key[0], obj)
        return self._typed(key[0], await self._remove(key, policy))

    async def _remove(self, key: ObjectKey, policy: str) -> dict[str, Any]:
        last = await self.store.remove(key)
        if key[0] == CRD_RESOURCE:
            for served in crs.from_crd(last):
                resource = kmock.resource(served.group, served.version, served.plural)
                self.custom.pop(resource, None)
                del self.resources[resource]
        self._notify(key[0], key)
        await self._collect_garbage(last["metadata"]["uid"], policy)
        return last

    async def _collect_garbage(self, owner_uid: str, policy: str) -> None:
        """Dependents whose every owner is gone are deleted (Orphan: they only lose the reference)."""
        live_uids = {obj["metadata"]["uid"] for _, obj in self.store.all_live()}
        for key, obj in self.store.all_live():
            owners = obj["metadata"].get("ownerReferences", [])
            if not any(ref.get("uid") == owner_uid for ref in owners):
                continue
            remaining = [ref for ref in owners if ref.get("uid") != owner_uid]
            if policy == "Orphan" or any(ref.get("uid") in live_uids for ref in remaining):
                orphan = json.loads(json.dumps(obj))
                orphan["metadata"]["ownerReferences"] = remaining
                await self.update(key, orphan)
            elif self.store.get(key) is not None:
                await self.delete(key, policy)

    async def _establish(self, key: ObjectKey, crd: dict[str, Any]) -> dict[str, Any]:
        for served in crs.from_crd(crd):
            resource = kmock.resource(served.group, served.version, served.plural)
            self.custom[resource] = served
            self.resources[resource] = kmock.ResourceInfo(
                kind=served.kind,
                namespaced=served.namespaced,
                singular=crd["spec"]["names"].get("singular"),
                shortnames=crd["spec"]["names"].get("shortNames", []),
                categories=crd["spec"]["names"].get("categories", []),
                subresources=set(served.subresources),
                verbs=["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"],
            )
        now = now_timestamp()
        crd["status"] = {
            "acceptedNames": crd["spec"]["names"],
            "storedVersions": [crd["spec"]["versions"][0]["name"]],
            "conditions": [
                {"type": t, "status": "True", "reason": t, "lastTransitionTime": now}
                for t in ("NamesAccepted", "Established")
            ],
        }
        return await self.store.update(key, crd, spec_changed=False)

    def _notify(self, resource: kmock.resource, key: ObjectKey) -> None:
        for callback in self.on_change:
            callback(resource, key)

    # ---- OpenAPI v3 (so kubectl asks the server to validate fields) ----------------------------------
    def _group_versions(self) -> dict[str, list[kmock.resource]]:
        grouped: dict[str, list[kmock.resource]] = {}
        for resource in self.resources:
            path = (
                f"apis/{resource.group}/{resource.version}" if resource.group else f"api/{resource.version}"
            )
            grouped.setdefault(path, []).append(resource)
        return grouped

    def _openapi_index(self) -> dict[str, Any]:
        return {
            "paths": {
                path: {"serverRelativeURL": f"/openapi/v3/{path}?hash={self.store.resource_version}"}
                for path in self._group_versions()
            }
        }

    def _openapi_document(self, request: kmock.Request) -> dict[str, Any]:
        path = request.url.path.removeprefix("/openapi/v3/")
        resources = self._group_versions().get(path, [])
        group, version = (
            (path.split("/")[1], path.split("/")[2]) if path.startswith("apis/") else ("", path[4:])
        )
        kinds = [
            (self.resources[r].kind, r.plural, bool(self.resources[r].namespaced))
            for r in resources
            if "/" not in (r.plural or "")
        ]
        schemas = {
            f"{'.'.join(reversed(group.split('.')))}.{version}.{self.custom[r].kind}": self.custom[r].schema
            for r in resources
            if r in self.custom
        }
        return crs.openapi_document(group, version, kinds, schemas)
