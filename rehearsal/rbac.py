"""The API server's authentication and RBAC authorization, in front of kmock (which has neither), as
much as the rehearsal needs: a bearer token names a user (a ServiceAccount's tokens are minted here,
as the TokenRequest API would); the RoleBindings and ClusterRoleBindings of the rendered chart grant
that user the rules of their Role or ClusterRole; a request that no rule allows gets 403 Forbidden
with the API server's message, an unknown token 401. Every request is recorded (user, verb, resource),
so that a test can show what a component really calls.

The verb of a request is the API server's: GET of a collection is `list`, with `watch=true` `watch`,
of an object `get`; POST `create`; PUT `update`; PATCH `patch`; DELETE `delete` (of a collection,
`deletecollection`). Discovery (`/api`, `/apis`, `/version`, `/openapi`) is open to every
authenticated user, as `system:discovery` makes it.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from rehearsal.api_validation import Validator, merge_patch

ADMIN = "kubernetes-admin"  # a person's kubeconfig (kubectl in the tests): everything


@dataclass(frozen=True)
class Request:
    user: str
    verb: str
    group: str
    resource: str  # with its subresource: "trainingruns/status"
    namespace: str
    name: str


def describe(method: str, url: str) -> tuple[str, str, str, str, str] | None:
    """(verb, group, resource, namespace, name) of an API request; None for discovery."""
    parts = urlsplit(url)
    segments = [s for s in parts.path.split("/") if s]
    if not segments or segments[0] not in ("api", "apis"):
        return None
    rest = segments[2:] if segments[0] == "api" else segments[3:]
    group = "" if segments[0] == "api" else (segments[1] if len(segments) > 1 else "")
    if not rest:
        return None  # /api/v1, /apis/group/version: discovery
    namespace = ""
    if rest[0] == "namespaces" and len(rest) > 2:
        namespace, rest = rest[1], rest[2:]
    resource, name, sub = rest[0], rest[1] if len(rest) > 1 else "", rest[2] if len(rest) > 2 else ""
    if rest[0] == "namespaces" and len(rest) <= 2:
        resource, name = "namespaces", rest[1] if len(rest) > 1 else ""
    query = parse_qs(parts.query)
    watching = query.get("watch", ["false"])[0] in ("true", "1")
    verb = {"GET": ("watch" if watching else "get" if name else "list"), "POST": "create", "PUT": "update",
            "PATCH": "patch", "DELETE": "delete" if name else "deletecollection"}.get(method.upper(), method.lower())
    return verb, group, f"{resource}/{sub}" if sub else resource, namespace, name


class Authorizer:
    def __init__(self, objects: list[dict[str, Any]]) -> None:
        self.roles = {(o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): o.get("rules") or []
                      for o in objects if o["kind"] in ("Role", "ClusterRole")}
        self.bindings = [o for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")]
        self.tokens: dict[str, str] = {}

    def token_for(self, user: str) -> str:
        token = secrets.token_urlsafe(24)
        self.tokens[token] = user
        return token

    def rules_of(self, user: str, namespace: str) -> list[dict[str, Any]]:
        rules: list[dict[str, Any]] = []
        for binding in self.bindings:
            bound_here = binding["kind"] == "ClusterRoleBinding" or binding["metadata"].get("namespace") == namespace
            subjects = binding.get("subjects") or []
            if not bound_here or not any(_names(s, binding) == user for s in subjects):
                continue
            ref = binding["roleRef"]
            scope = binding["metadata"].get("namespace", "") if ref["kind"] == "Role" else ""
            rules += self.roles.get((ref["kind"], scope, ref["name"]), [])
        return rules

    def allowed(self, request: Request) -> bool:
        if request.user == ADMIN:
            return True
        for rule in self.rules_of(request.user, request.namespace):
            if (_any(rule.get("apiGroups"), request.group) and _any(rule.get("resources"), request.resource)
                    and _any(rule.get("verbs"), request.verb)
                    and (not rule.get("resourceNames") or request.name in rule["resourceNames"])):
                return True
        return False


def _names(subject: dict[str, Any], binding: dict[str, Any]) -> str:
    if subject.get("kind") == "ServiceAccount":
        namespace = subject.get("namespace") or binding["metadata"].get("namespace", "")
        return f"system:serviceaccount:{namespace}:{subject['name']}"
    return str(subject.get("name"))


def _any(allowed: list[str] | None, value: str) -> bool:
    return allowed is not None and ("*" in allowed or value in allowed)


async def _validate(validator: Validator, request: Any, body: bytes, session: Any, upstream: str) -> Any:
    """The API server's answer refusing a write to a custom kind that its schema does not allow; None
    to let it through. Unknown fields are refused only with `fieldValidation=Strict` (what kubectl
    asks for); other clients' unknown fields are pruned by the server (kmock keeps them)."""
    from aiohttp import web

    kind = validator.kind_at(request.path)
    if kind is None or request.method not in ("POST", "PUT", "PATCH"):
        return None
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if request.method == "PATCH":
        if request.content_type != "application/merge-patch+json":
            return None
        async with session.get(upstream + request.path, headers={"Accept": "application/json"}) as current:
            if current.status != 200:
                return None
            obj = merge_patch(await current.json(), obj)
    strict = parse_qs(request.query_string).get("fieldValidation", [""])[0] == "Strict"
    problem = validator.check(kind, obj, strict)
    if problem is None:
        return None
    code, message = problem
    return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
                              "reason": "BadRequest" if code == 400 else "Invalid", "code": code}, status=code)


def serving_certificate(addresses: list[str]) -> tuple[bytes, bytes]:
    """A self-signed certificate (PEM) and key for the API server at these IP addresses and the names
    `kubernetes.default.svc`: clients (kubectl, client-go, kopf) send their tokens over TLS only."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")])
    now = datetime.datetime.now(datetime.UTC)
    names: list[x509.GeneralName] = [x509.DNSName(n) for n in ("kubernetes", "kubernetes.default.svc", "localhost")]
    names += [x509.IPAddress(ipaddress.ip_address(a)) for a in addresses]
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


async def serve(authorizer: Authorizer, upstream: str, host: str, port: int, log: list[Request],
                stop: Any, certificate: tuple[bytes, bytes], validator: Validator | None = None) -> None:
    """The authorizing front, on HTTPS with `certificate` (PEM certificate, key): forwards what it
    allows to `upstream` (kmock), streaming the answer (watches are long-lived), until `stop` (a
    threading.Event) is set. With a `validator`, it also serves the OpenAPI v3 documents of its
    custom kinds and validates what is written to them (api_validation.py)."""
    import ssl
    import tempfile

    import aiohttp
    from aiohttp import web

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    with tempfile.TemporaryDirectory() as directory:  # the ssl module loads PEM from files only
        cert_file, key_file = f"{directory}/tls.crt", f"{directory}/tls.key"
        Path(cert_file).write_bytes(certificate[0])
        Path(key_file).write_bytes(certificate[1])
        context.load_cert_chain(cert_file, key_file)

    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=None))

    async def handle(request: web.Request) -> web.StreamResponse:
        header = request.headers.get("Authorization", "")
        user = authorizer.tokens.get(header.removeprefix("Bearer ").strip()) if header.startswith("Bearer ") else None
        if user is None:
            return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                      "message": "Unauthorized", "reason": "Unauthorized", "code": 401}, status=401)
        described = describe(request.method, str(request.rel_url))
        if described is not None:
            verb, group, resource, namespace, name = described
            entry = Request(user, verb, group, resource, namespace, name)
            log.append(entry)
            if not authorizer.allowed(entry):
                where = f' in the namespace "{namespace}"' if namespace else " at the cluster scope"
                message = (f'{resource.split("/")[0]}{"." + group if group else ""}'
                           f'{" " + repr(name).replace(chr(39), chr(34)) if name else ""} is forbidden: User "{user}" '
                           f'cannot {verb} resource "{resource}" in API group "{group}"{where}')
                return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                          "message": message, "reason": "Forbidden", "code": 403}, status=403)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "authorization")}
        body = await request.read()
        if validator is not None:
            if request.path == "/openapi/v3":
                return web.json_response(validator.discovery())
            if request.path.startswith("/openapi/v3/"):
                doc = validator.group_versions().get(request.path.removeprefix("/openapi/v3/"))
                return web.json_response(doc) if doc else web.json_response(
                    {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": "not found",
                     "reason": "NotFound", "code": 404}, status=404)
            refused = await _validate(validator, request, body, session, upstream)
            if refused is not None:
                return refused
        async with session.request(request.method, upstream + str(request.rel_url), headers=headers,
                                   data=body) as reply:
            response = web.StreamResponse(status=reply.status, headers={
                k: v for k, v in reply.headers.items() if k.lower() in ("content-type",)})
            await response.prepare(request)
            async for data in reply.content.iter_any():
                await response.write(data)
            await response.write_eof()
            return response

    app = web.Application(client_max_size=64 << 20)
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, ssl_context=context).start()
    try:
        while not stop.is_set():
            await asyncio.sleep(0.2)
    finally:
        await runner.cleanup()
        await session.close()
