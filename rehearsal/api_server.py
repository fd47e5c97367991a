"""The emulated API server: kmock behind an HTTPS front that authenticates bearer tokens and authorizes
with the chart's RBAC (rbac.py), kubeconfigs for it, and kubectl."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rehearsal.rbac import ADMIN
from rehearsal.rbac import serve as serve_rbac

if TYPE_CHECKING:
    pass
from rehearsal.dns import ServicesDns
from rehearsal.pods import NAMESPACE


class ApiServer(ServicesDns):
    def _serve_api(self) -> None:
        import asyncio

        from rehearsal.api_validation import Validator
        from rehearsal.chart import chart_crds
        from rehearsal.kube_api import kubernetes_api

        async def serve() -> None:
            async with kubernetes_api(NAMESPACE, host="127.0.0.1", port=self.store_port) as (_, url):
                await serve_rbac(self.authorizer, url.rstrip("/"), "0.0.0.0", self.api_port, self.api_requests,
                                 self._stop, self.api_certificate, Validator(chart_crds()))

        asyncio.run(serve())

    def _api_up(self) -> bool:
        assert self.control is not None
        out = subprocess.run(["ip", "netns", "exec", self.control.netns, "python3", "-c",
                              f"import socket; socket.create_connection(('127.0.0.1', {self.api_port}), 1)"],
                             capture_output=True, timeout=10)
        return out.returncode == 0

    def api(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        """A request to the API server; only from the control namespace (the controllers' thread)."""
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"http://127.0.0.1:{self.store_port}{path}", data=data, method=method,
                                         headers={"Content-Type": content_type})
        with urllib.request.urlopen(request, timeout=10) as response:
            text = response.read()
        return json.loads(text) if text else {}

    def kubeconfig(self, server_host: str, user: str = ADMIN, path: Path | None = None) -> Path:
        """A kubeconfig for `user` (a person: everything; a ServiceAccount,
        `system:serviceaccount:<namespace>:<name>`: what its bindings grant) with a token of its own."""
        from rehearsal.kube_api import write_kubeconfig

        path = path or self.workdir / f"kubeconfig-{server_host}-{user.replace(':', '-')}"
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_kubeconfig(path, f"https://{server_host}:{self.api_port}", NAMESPACE,
                                token=self.authorizer.token_for(user), ca_pem=self.api_certificate[0])

    def service_account_kubeconfig(self, pod_spec: dict[str, Any]) -> Path | None:
        """What the kubelet gives a pod to reach the API server: a token of its ServiceAccount (as a
        kubeconfig here, alone in its directory: the pod mounts that) when the ServiceAccount exists and
        its token is mounted (the pod's `automountServiceAccountToken`, else the ServiceAccount's); None
        otherwise."""
        name = pod_spec.get("serviceAccountName", "default")
        accounts = {o["metadata"]["name"]: o for o in self.objects if o["kind"] == "ServiceAccount"}
        if name not in accounts:
            return None
        mounted = pod_spec.get("automountServiceAccountToken", accounts[name].get("automountServiceAccountToken", True))
        if not mounted:
            return None
        assert self.control is not None
        return self.kubeconfig(self.control.address, user=f"system:serviceaccount:{NAMESPACE}:{name}",
                               path=self.workdir / "serviceaccounts" / name / "kubeconfig")

    def kubectl_as(self, user: str, *args: str) -> subprocess.CompletedProcess[str]:
        """kubectl in the control namespace with a token of `user` (a ServiceAccount:
        `system:serviceaccount:<namespace>:<name>`)."""
        from rehearsal.kube_api import kubectl

        assert self.control is not None
        return subprocess.run(["ip", "netns", "exec", self.control.netns, kubectl(), "--kubeconfig",
                               str(self.kubeconfig("127.0.0.1", user=user)), "--request-timeout=10s", *args],
                              capture_output=True, text=True, timeout=60)

    def kubectl(self, *args: str, check: bool = True) -> str:
        result = self.kubectl_as(ADMIN, *args)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {result.stderr}")
        return result.stdout
