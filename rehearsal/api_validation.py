"""The API server's field validation of custom resources, for the rehearsal's API front (rbac.py):
what kmock lacks and `kubectl create` needs without `--validate=false`.

kubectl validates by asking the server to (`?fieldValidation=Strict`) once the server's OpenAPI v3
says a kind's PATCH takes that parameter (k8s.io/cli-runtime's queryParamVerifierV3); otherwise it
downloads the OpenAPI document to validate itself, and fails where there is none. So, for every CRD
it is given, the front serves the OpenAPI v3 discovery document (`/openapi/v3`) and one document per
group/version whose operations carry `x-kubernetes-group-version-kind` and the `fieldValidation`
parameter, and checks what is created, replaced or merge-patched against the CRD's
`openAPIV3Schema` as a structural schema with strict decoding: an unknown field is refused with
400 ("strict decoding error: unknown field ..."), a value the schema does not allow with 422
("... is invalid: spec.x: Invalid value ...").
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import jsonschema

KUBERNETES_EXTENSIONS = ("x-kubernetes-preserve-unknown-fields", "x-kubernetes-int-or-string",
                         "x-kubernetes-embedded-resource", "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
                         "x-kubernetes-map-type", "x-kubernetes-validations")


def _structural(schema: Any) -> Any:
    """A CRD schema as JSON Schema with strict decoding: objects that list their properties are
    closed to others unless they keep unknown fields; int-or-string and nullable as the API server
    reads them. Unknown fields are reported apart (see Validator.unknown_fields)."""
    if isinstance(schema, list):
        return [_structural(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _structural(v) for k, v in schema.items() if k not in KUBERNETES_EXTENSIONS and k != "nullable"}
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out = {"anyOf": [{"type": "integer"}, {"type": "string"}], **out}
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


@dataclass
class CustomKind:
    group: str
    version: str
    kind: str
    plural: str
    namespaced: bool
    schema: dict[str, Any]

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"


class Validator:
    def __init__(self, crds: list[dict[str, Any]]) -> None:
        self.kinds: dict[tuple[str, str, str], CustomKind] = {}  # (group, version, plural)
        for crd in crds:
            spec = crd["spec"]
            for version in spec["versions"]:
                kind = CustomKind(spec["group"], version["name"], spec["names"]["kind"], spec["names"]["plural"],
                                  spec.get("scope", "Namespaced") == "Namespaced",
                                  version["schema"]["openAPIV3Schema"])
                self.kinds[(kind.group, kind.version, kind.plural)] = kind
        self._checkers = {key: jsonschema.Draft4Validator(_structural(kind.schema)) for key, kind in self.kinds.items()}
        self._documents = self._group_versions()

    def group_versions(self) -> dict[str, dict[str, Any]]:
        """/openapi/v3/apis/GROUP/VERSION -> its document."""
        return self._documents

    # --- OpenAPI v3, as much as kubectl reads ------------------------------------------------------
    def _group_versions(self) -> dict[str, dict[str, Any]]:
        docs: dict[str, dict[str, Any]] = {}
        for kind in self.kinds.values():
            doc = docs.setdefault(f"apis/{kind.group}/{kind.version}", {
                "openapi": "3.0.0", "info": {"title": "Kubernetes CRD Swagger", "version": "v0.1.0"},
                "paths": {}, "components": {"schemas": {}}})
            gvk = {"group": kind.group, "version": kind.version, "kind": kind.kind}
            params = [{"name": "fieldValidation", "in": "query", "schema": {"type": "string", "uniqueItems": True}}]
            scope = "/namespaces/{namespace}" if kind.namespaced else ""
            base = f"/apis/{kind.group}/{kind.version}{scope}/{kind.plural}"
            doc["paths"][base] = {"post": {"x-kubernetes-group-version-kind": gvk, "x-kubernetes-action": "post",
                                           "parameters": params, "responses": {}}}
            doc["paths"][base + "/{name}"] = {
                verb: {"x-kubernetes-group-version-kind": gvk, "x-kubernetes-action": action, "parameters": params,
                       "responses": {}}
                for verb, action in (("put", "put"), ("patch", "patch"))}
            name = ".".join(reversed(kind.group.split("."))) + f".{kind.version}.{kind.kind}"
            doc["components"]["schemas"][name] = {**kind.schema, "x-kubernetes-group-version-kind": [gvk]}
        return docs

    def discovery(self) -> dict[str, Any]:
        """/openapi/v3: where each group/version's document is."""
        return {"paths": {path: {"serverRelativeURL": f"/openapi/v3/{path}?hash={_hash(doc)}"}
                          for path, doc in self.group_versions().items()}}

    # --- validation -----------------------------------------------------------------------------
    def kind_at(self, path: str) -> CustomKind | None:
        segments = [s for s in path.split("/") if s]
        if len(segments) < 4 or segments[0] != "apis":
            return None
        rest = segments[3:]
        if rest[0] == "namespaces" and len(rest) > 2:
            rest = rest[2:]
        if len(rest) > 2:  # a subresource (status): its own rules, not checked here
            return None
        return self.kinds.get((segments[1], segments[2], rest[0]))

    def check(self, kind: CustomKind, obj: Any, strict: bool = True) -> tuple[int, str] | None:
        """None if `obj` is a valid `kind`; else (HTTP status, the API server's message). Unknown
        fields only when `strict` (fieldValidation=Strict); without, the server drops them."""
        name = obj.get("metadata", {}).get("name", "") if isinstance(obj, dict) else ""
        unknown = sorted(unknown_fields(kind.schema, obj)) if strict else []
        if unknown:
            fields = ", ".join(f'unknown field "{u}"' for u in unknown)
            return 400, f"{kind.kind} in version \"{kind.version}\" cannot be handled as a {kind.kind}: " \
                        f"strict decoding error: {fields}"
        errors = sorted(self._checkers[(kind.group, kind.version, kind.plural)].iter_errors(obj),
                        key=lambda e: list(e.absolute_path))
        if errors:
            causes = "; ".join(f"{_field(e.absolute_path)}: Invalid value: {json.dumps(e.instance)[:80]}: {e.message}"
                               for e in errors[:5])
            return 422, f'{kind.kind}.{kind.group} "{name}" is invalid: {causes}'
        return None


def unknown_fields(schema: dict[str, Any], obj: Any, path: str = "") -> list[str]:
    """Fields of `obj` its structural schema does not know (apiVersion, kind and metadata at the root
    are the API server's)."""
    if not isinstance(obj, dict) or schema.get("x-kubernetes-preserve-unknown-fields"):
        if isinstance(obj, list) and isinstance(schema.get("items"), dict):
            return [u for i, item in enumerate(obj) for u in unknown_fields(schema["items"], item, f"{path}[{i}]")]
        return []
    properties = schema.get("properties")
    extra = schema.get("additionalProperties")
    out: list[str] = []
    for key, value in obj.items():
        where = f"{path}.{key}" if path else key
        if not path and key in ("apiVersion", "kind", "metadata"):
            continue
        if properties is not None and key in properties:
            out += unknown_fields(properties[key], value, where)
        elif isinstance(extra, dict):
            out += unknown_fields(extra, value, where)
        elif properties is not None or extra is False:
            out.append(where)
    return out


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (what `kubectl patch --type merge` sends)."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _field(path: Any) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".") or "<root>"


def _hash(doc: dict[str, Any]) -> str:
    return hashlib.sha512(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:64].upper()
