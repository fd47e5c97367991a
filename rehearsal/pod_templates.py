"""Pod templates from the rendered pod specs, as the kubelet reads them: command and environment (Secrets,
ConfigMaps, fieldRefs), volumes and their sources, security, probes, the image a container names."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rehearsal.container import process_of
from rehearsal.pods import (
    NAMESPACE,
    OBJECT_STORE_IMAGE,
    POD_IP,
    REPO,
    PodTemplate,
    Timing,
    Volume,
    dockerfile_entrypoint,
    home_of,
    probe_of,
    quantity,
    security_of,
)
from rehearsal.port_forwards import PortForwards

if TYPE_CHECKING:
    pass


class PodTemplates(PortForwards):
    def template_from_pod_spec(self, pod_spec: dict[str, Any], labels: dict[str, str],
                               claims: dict[str, Path] | None = None) -> PodTemplate:
        """A PodTemplate from a rendered pod spec: its first container, volumes, probe, hooks."""
        container = pod_spec["containers"][0]
        reference = container.get("image", "")
        image = self.images.get(reference)
        if OBJECT_STORE_IMAGE in reference:  # the stand-in's own program, on the chart's port and volume
            port = next(p["containerPort"] for p in container["ports"] if p["name"] == "s3")
            arguments = ["--port", str(port), "--data", "/data"]
            container = {**container, "command": None if image else [sys.executable, str(REPO / "rehearsal" / "s3_pod.py")],
                         "args": arguments}
        env = self.container_env(container.get("env") or [])
        security = security_of(pod_spec, container, image)
        volumes = self._volumes(pod_spec, container, claims or {}, security.fs_group)
        pre_stop = (((container.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}).get("command")
        workdir = "/"
        if image is not None:
            process = process_of(container, image, env)
            argv, env, workdir = process.argv, process.env, process.workdir
            env.setdefault("HOME", home_of(image, security.uid))
        else:
            argv = [*(container.get("command") or dockerfile_entrypoint(reference)), *(container.get("args") or [])]
            if argv and argv[0] in ("python", "python3"):
                argv[0] = sys.executable
            if pre_stop and pre_stop[0] in ("python", "python3"):
                pre_stop = [sys.executable, *pre_stop[1:]]
        ports = {p.get("name"): p["containerPort"] for p in container.get("ports") or []}
        readiness = probe_of(container.get("readinessProbe") or {}, ports)
        liveness = probe_of(container.get("livenessProbe") or {}, ports)
        startup = probe_of(container.get("startupProbe") or {}, ports)
        resources = container.get("resources") or {}
        extended = {k: int(quantity(v)) for k, v in {**(resources.get("requests") or {}),
                                                      **(resources.get("limits") or {})}.items() if "/" in k}
        return PodTemplate(labels=dict(labels), argv=argv, env=env, volumes=volumes,
                           grace=float(pod_spec.get("terminationGracePeriodSeconds", 30)),
                           restart=pod_spec.get("restartPolicy", "Always"), pre_stop=pre_stop,
                           readiness=readiness, security=security, ports=ports,
                           readiness_timing=Timing.of(container.get("readinessProbe") or {}), liveness=liveness,
                           liveness_timing=Timing.of(container.get("livenessProbe") or {}), extended=extended,
                           startup=startup, startup_timing=Timing.of(container.get("startupProbe") or {}),
                           image=image, workdir=workdir, container=container.get("name", ""))

    def container_env(self, items: list[dict[str, Any]]) -> dict[str, str]:
        env: dict[str, str] = {}
        for item in items:
            if "valueFrom" in item:
                source = item["valueFrom"]
                if "secretKeyRef" in source:
                    ref = source["secretKeyRef"]
                    env[item["name"]] = self.secrets[ref["name"]][ref["key"]]
                elif source.get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
                    env[item["name"]] = NAMESPACE
                elif source.get("fieldRef", {}).get("fieldPath") == "status.podIP":
                    env[item["name"]] = POD_IP  # the pod's address, known when it starts
                else:
                    raise NotImplementedError(f"env {item['name']}: {source}")
            else:
                env[item["name"]] = str(item.get("value", ""))
        return env

    def _volumes(self, pod_spec: dict[str, Any], container: dict[str, Any],
                 claims: dict[str, Path], fs_group: int | None = None) -> list[Volume]:
        declared = {v["name"]: v for v in pod_spec.get("volumes") or []}
        volumes = []
        for mount in container.get("volumeMounts") or []:
            name = mount["name"]
            volume = declared.get(name)
            if name in claims:
                volumes.append(Volume(mount["mountPath"], "dir", claims[name]))
            elif volume is not None and "configMap" in volume:
                source = self.workdir / "config-maps" / volume["configMap"]["name"]
                source.mkdir(parents=True, exist_ok=True)
                for key, text in self.config_maps[volume["configMap"]["name"]].items():
                    (source / key).write_text(text)
                volumes.append(Volume(mount["mountPath"], "dir", source, read_only=True))
            elif volume is not None and "secret" in volume:
                # Secret and ConfigMap volumes are read-only whatever the mount says (the kubelet's)
                volumes.append(Volume(mount["mountPath"], "dir", self._secret_files(volume["secret"], fs_group),
                                      read_only=True))
            elif volume is not None and (volume.get("emptyDir") or {}).get("medium") == "Memory":
                volumes.append(Volume(mount["mountPath"], "memory"))
            elif volume is not None and "emptyDir" in volume:
                volumes.append(Volume(mount["mountPath"], "dir"))
            else:
                raise NotImplementedError(f"volume {name}: {volume}")
        return volumes

    def _secret_files(self, source: dict[str, Any], fs_group: int | None) -> Path:
        """A Secret volume: one file per key with the volume's defaultMode, owned by root and, when the
        pod has an fsGroup, by that group (as the kubelet writes them)."""
        name = source["secretName"]
        directory = self.workdir / "secrets" / f"{name}-{'root' if fs_group is None else fs_group}"
        directory.mkdir(parents=True, exist_ok=True)
        for key, text in self.secrets[name].items():
            path = directory / key
            path.write_text(text)
            os.chown(path, 0, 0 if fs_group is None else fs_group)
            mode = int(source.get("defaultMode", 0o644))
            path.chmod(mode | (0o440 if fs_group is not None else 0))  # the kubelet lets the fsGroup read it
        return directory
