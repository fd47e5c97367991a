"""The rehearsal's API server front (rehearsal/rbac.py) refuses as Kubernetes' RBAC refuses, in
seconds: the run-controller's ServiceAccount, with the chart's Role, gets the calls the Role grants and
403 Forbidden (the API server's status and message) for the rest; the same Role with a verb or a
resource taken out refuses that call; an unknown token gets 401. An authorizer that allows everything
fails here."""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import ssl
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from overworld.core.net import free_port
from rehearsal.api_validation import Validator
from rehearsal.kube_api import kubernetes_api
from rehearsal.rbac import Authorizer, serving_certificate
from rehearsal.rbac import serve as serve_rbac
from tests.deploy.deploy_support import by_kind, chart_crds, render

NAMESPACE = "rl"
ACCOUNT = f"system:serviceaccount:{NAMESPACE}:overworld-run-controller"
RAYJOBS = f"/apis/ray.io/v1/namespaces/{NAMESPACE}/rayjobs"
RUNS = f"/apis/overworld.dev/v1alpha1/namespaces/{NAMESPACE}/trainingruns"
RAYJOB = {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": "run-a1", "namespace": NAMESPACE},
          "spec": {"entrypoint": "true"}}


class Api:
    def __init__(self, url: str, session: aiohttp.ClientSession, authorizer: Authorizer) -> None:
        self.url, self.session, self.authorizer = url, session, authorizer

    async def call(self, method: str, path: str, user: str | None = ACCOUNT, body: Any = None,
                   content_type: str = "application/json") -> tuple[int, dict[str, Any]]:
        headers = {"Content-Type": content_type}
        if user is not None:
            headers["Authorization"] = f"Bearer {self.authorizer.token_for(user)}"
        async with self.session.request(method, self.url + path, headers=headers,
                                        data=None if body is None else json.dumps(body)) as reply:
            text = await reply.text()
            return reply.status, json.loads(text) if text.startswith("{") else {}


@asynccontextmanager
async def api_server(objects: list[dict[str, Any]]) -> AsyncIterator[Api]:
    """kmock behind the rehearsal's front, authorizing with the RBAC objects of `objects`."""
    authorizer, stop = Authorizer(objects), threading.Event()
    certificate = serving_certificate(["127.0.0.1"])
    context = ssl.create_default_context(cadata=certificate[0].decode())
    async with kubernetes_api(NAMESPACE) as (_, url):
        port = free_port()
        front = asyncio.create_task(serve_rbac(authorizer, url.rstrip("/"), "127.0.0.1", port, [], stop,
                                               certificate, Validator(chart_crds())))
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as session:
                api = Api(f"https://127.0.0.1:{port}", session, authorizer)
                for _ in range(100):  # the front listening
                    try:
                        await api.call("GET", "/version", user=None)
                        break
                    except aiohttp.ClientConnectionError:
                        await asyncio.sleep(0.1)
                yield api
        finally:
            stop.set()
            await front


@functools.cache
def rendered() -> list[dict[str, Any]]:
    return render({}, namespace=NAMESPACE)


def chart() -> list[dict[str, Any]]:
    return copy.deepcopy(rendered())


def without(objects: list[dict[str, Any]], resource: str, verb: str | None) -> list[dict[str, Any]]:
    """The objects with the run-controller's Role lacking `verb` on `resource` (None: the resource)."""
    objects = copy.deepcopy(objects)
    (role,) = by_kind(objects, "Role").values()
    for rule in role["rules"]:
        if resource in rule["resources"]:
            if verb is None:
                rule["resources"].remove(resource)
            else:
                rule["verbs"].remove(verb)
    role["rules"] = [r for r in role["rules"] if r["resources"] and r["verbs"]]
    return objects


def forbidden(reply: tuple[int, dict[str, Any]], verb: str, resource: str, group: str) -> bool:
    code, status = reply
    return code == 403 and status.get("reason") == "Forbidden" and (
        f'User "{ACCOUNT}" cannot {verb} resource "{resource}" in API group "{group}" in the namespace "{NAMESPACE}"'
        in status.get("message", ""))


def test_the_charts_role_grants_the_controllers_calls_and_refuses_the_rest() -> None:
    async def check() -> None:
        async with api_server(chart()) as api:
            assert (await api.call("POST", RAYJOBS, body=RAYJOB))[0] in (200, 201)
            assert (await api.call("GET", RAYJOBS))[0] == 200
            assert (await api.call("GET", RUNS))[0] == 200
            assert forbidden(await api.call("GET", f"/api/v1/namespaces/{NAMESPACE}/secrets"), "list", "secrets", "")
            assert forbidden(await api.call("DELETE", f"{RUNS}/run"), "delete", "trainingruns", "overworld.dev")
            assert forbidden(await api.call("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", body={}), "create", "pods", "")
            code, status = await api.call("GET", RAYJOBS, user=None)
            assert (code, status.get("reason")) == (401, "Unauthorized")

    asyncio.run(asyncio.wait_for(check(), timeout=120))


@pytest.mark.parametrize(("resource", "verb", "method", "path", "body"), [
    ("rayjobs", "create", "POST", RAYJOBS, RAYJOB),
    ("rayjobs", "list", "GET", RAYJOBS, None),
    ("trainingruns", "get", "GET", f"{RUNS}/run", None),
    ("trainingruns/status", None, "PATCH", f"{RUNS}/run/status", {"status": {}}),
], ids=["no-create-rayjobs", "no-list-rayjobs", "no-get-trainingruns", "no-trainingruns-status"])
def test_a_role_without_a_verb_or_a_resource_is_refused(resource: str, verb: str | None, method: str, path: str,
                                                         body: Any) -> None:
    """The chart's Role with one verb (or one resource) taken out: that call gets 403 Forbidden, naming
    the user, the verb and the resource, where the whole Role let it through."""
    request_verb = verb or "patch"
    group = "ray.io" if resource.startswith("rayjobs") else "overworld.dev"
    content_type = "application/merge-patch+json" if method == "PATCH" else "application/json"

    async def check() -> None:
        async with api_server(chart()) as api:
            assert not forbidden(await api.call(method, path, body=body, content_type=content_type),
                                 request_verb, resource, group)
        async with api_server(without(chart(), resource, verb)) as api:
            assert forbidden(await api.call(method, path, body=body, content_type=content_type),
                             request_verb, resource, group)

    asyncio.run(asyncio.wait_for(check(), timeout=120))
