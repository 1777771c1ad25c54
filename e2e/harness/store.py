"""The object store behind the harness: kmock's versioned objects plus what an API server adds.

On top of kmock's ``ObjectsArray`` (every version of every object, for assertions) it keeps one
resourceVersion counter and an event log, so watches can resume from a resourceVersion, and it stamps
metadata (uid, resourceVersion, generation, creationTimestamp) the way the API server does.
"""

from __future__ import annotations

import asyncio
import copy
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import kmock

ObjectKey = tuple[kmock.resource, str | None, str]


@dataclass(frozen=True)
class Event:
    resource_version: int
    resource: kmock.resource
    type: str
    object: dict[str, Any]


def now_timestamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Store:
    def __init__(self, objects: kmock.ObjectsArray) -> None:
        self.objects = objects
        self.resource_version = 0
        self.events: list[Event] = []
        self._changed = asyncio.Condition()

    def get(self, key: ObjectKey) -> dict[str, Any] | None:
        if key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(self.objects[key].raw)

    def list(self, resource: kmock.resource, namespace: str | None) -> list[dict[str, Any]]:
        found = [
            copy.deepcopy(obj.raw)
            for (res, ns, _), obj in self.objects.items()
            if res == resource and not obj.deleted and (namespace is None or ns == namespace)
        ]
        return sorted(found, key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))

    def all_live(self) -> list[tuple[ObjectKey, dict[str, Any]]]:
        return [(key, obj.raw) for key, obj in self.objects.items() if not obj.deleted]

    async def _emit(self, resource: kmock.resource, kind: str, obj: dict[str, Any]) -> None:
        self.events.append(Event(self.resource_version, resource, kind, copy.deepcopy(obj)))
        async with self._changed:
            self._changed.notify_all()

    def _next_version(self) -> str:
        self.resource_version += 1
        return str(self.resource_version)

    async def create(self, key: ObjectKey, obj: dict[str, Any]) -> dict[str, Any]:
        metadata = obj.setdefault("metadata", {})
        metadata.update(
            uid=str(uuid.uuid4()),
            resourceVersion=self._next_version(),
            generation=1,
            creationTimestamp=now_timestamp(),
        )
        if key[1] is not None:
            metadata["namespace"] = key[1]
        if key in self.objects:
            self.objects[key].create(copy.deepcopy(obj))
        else:
            self.objects[key] = copy.deepcopy(obj)
        await self._emit(key[0], "ADDED", obj)
        return obj

    async def update(self, key: ObjectKey, obj: dict[str, Any], spec_changed: bool) -> dict[str, Any]:
        """Store a new version; a write that changes nothing keeps the old resourceVersion, as k8s does."""
        old = self.objects[key].raw
        candidate = copy.deepcopy(obj)
        candidate["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        candidate["metadata"]["generation"] = old["metadata"].get("generation", 1)
        if candidate == old:
            return copy.deepcopy(old)
        if spec_changed:
            candidate["metadata"]["generation"] += 1
        candidate["metadata"]["resourceVersion"] = self._next_version()
        self.objects[key].history.append(copy.deepcopy(candidate))
        await self._emit(key[0], "MODIFIED", candidate)
        return candidate

    async def remove(self, key: ObjectKey) -> dict[str, Any]:
        last = copy.deepcopy(self.objects[key].raw)
        last["metadata"]["resourceVersion"] = self._next_version()
        self.objects[key].delete()
        await self._emit(key[0], "DELETED", last)
        return last

    async def follow(self, since: int) -> AsyncIterator[Event]:
        """Every event after ``since``, then new ones as they come; ends only when cancelled."""
        index = next((i for i, e in enumerate(self.events) if e.resource_version > since), len(self.events))
        while True:
            while index < len(self.events):
                yield self.events[index]
                index += 1
            seen = index
            async with self._changed:
                await self._changed.wait_for(lambda seen=seen: seen < len(self.events))
