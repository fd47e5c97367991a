"""A small Kubernetes API client over aiohttp, using the credentials kopf logged in with.

kopf talks to the API for the TrainingRuns it watches; the controller also creates and
deletes RayJobs and patches TrainingRuns it is not handling at that moment. Rather than a
second client library with its own idea of credentials, this client reuses kopf's
:class:`kopf.ConnectionInfo` (service account in the cluster, kubeconfig outside).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf


@dataclass(frozen=True)
class Resource:
    group: str
    version: str
    plural: str

    def path(self, namespace: str | None, name: str | None = None, subresource: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if namespace:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name:
            base += f"/{name}"
        if subresource:
            base += f"/{subresource}"
        return base


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class KubeApi:
    """Create, get, merge-patch and delete objects with one set of credentials."""

    def __init__(self, info: kopf.ConnectionInfo) -> None:
        self.info = info

    async def _request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> dict[str, Any]:
        server = self.info.server.rstrip("/")
        headers = {"Accept": "application/json", **self.info.as_http_headers()}
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)
        ssl: Any = None
        if server.startswith("https://"):
            ssl = self.info.as_ssl_context()
        timeout = aiohttp.ClientTimeout(total=30)
        async with (
            aiohttp.ClientSession(timeout=timeout, trust_env=self.info.trust_env) as session,
            session.request(method, server + path, data=data, headers=headers, ssl=ssl) as response,
        ):
            text = await response.text()
            if response.status >= 400:
                try:
                    message = json.loads(text).get("message", text)
                except (ValueError, AttributeError):
                    message = text
                raise ApiError(response.status, str(message))
            result: dict[str, Any] = json.loads(text) if text else {}
            return result

    async def get(self, resource: Resource, namespace: str, name: str) -> dict[str, Any]:
        return await self._request("GET", resource.path(namespace, name))

    async def list(self, resource: Resource, namespace: str | None) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = (await self._request("GET", resource.path(namespace))).get(
            "items"
        ) or []
        return items

    async def create(self, resource: Resource, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._request("POST", resource.path(namespace), body)

    async def merge_patch(
        self,
        resource: Resource,
        namespace: str,
        name: str,
        body: dict[str, Any],
        subresource: str | None = None,
    ) -> dict[str, Any]:
        return await self._request(
            "PATCH", resource.path(namespace, name, subresource), body, "application/merge-patch+json"
        )

    async def delete(
        self, resource: Resource, namespace: str, name: str, propagation: str = "Background"
    ) -> dict[str, Any]:
        """Delete an object; ``Foreground`` keeps it (with a deletionTimestamp) until its dependents are gone."""
        return await self._request(
            "DELETE",
            resource.path(namespace, name),
            {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": propagation},
        )
