"""What a kubelet reads from the API server before it starts a container, for the pod runner.

:class:`PodMaterials` turns one pod's container into what a process needs:

* **volumes** as local folders, one per mount (``mountPath`` -> folder, ``subPath`` applied):
  a Secret, ConfigMap, downward API or ``projected`` volume becomes a folder of its files in
  the pod's folder (a projected service account token is a TokenRequest for the pod's
  account, as the kubelet makes: the API server's own ``kube-api-access-*`` volume); an
  ``emptyDir`` a folder of the pod's, shared by every container that mounts it; a
  ``hostPath`` the host's folder itself; a ``persistentVolumeClaim`` the folder of the
  PersistentVolume the claim is bound to, when that volume is a ``hostPath`` or ``local`` one
  (the local cluster's stand-in for a cluster's storage);
* **environment** with every reference resolved as the kubelet resolves it: ``envFrom``
  (Secrets and ConfigMaps, with their ``prefix``) first, then ``env`` in order, each a
  ``value`` or a ``valueFrom`` of a Secret key, a ConfigMap key or a pod field.

A reference that cannot be resolved (a missing Secret or key that is not ``optional``, a
claim that is not bound, a volume of a kind no host folder stands for) raises
:class:`MaterialError` naming the field, where a kubelet would leave the container waiting
(``CreateContainerConfigError``, ``ContainerCreating``).

Left out: other volume kinds (``nfs``, ``csi``, ...), ``resourceFieldRef``, token rotation,
``$(VAR)`` expansion in values, and read-only enforcement (a process sees the folder as it is).
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

Pod = dict[str, Any]  # a pod as the API serves it (JSON field names)

_FIELD = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")


class MaterialError(Exception):
    """A volume or an environment reference of a container that cannot be resolved."""


@dataclass
class PodMaterials:
    """Volumes and environment of ``pod``'s containers; ``folder`` is the pod's own folder
    (Secret, ConfigMap and ``emptyDir`` volumes live under ``folder/volumes``)."""

    core: client.CoreV1Api
    pod: Pod
    folder: Path

    @property
    def namespace(self) -> str:
        return str(self.pod["metadata"]["namespace"])

    # ------------------------------------------------------------------ volumes

    def volumes(self, container: Mapping[str, Any]) -> dict[str, Path]:
        """``mountPath`` -> local folder for each of the container's mounts."""
        declared = {v["name"]: v for v in self.pod["spec"].get("volumes") or []}
        mounts: dict[str, Path] = {}
        for mount in container.get("volumeMounts") or []:
            name = str(mount["name"])
            volume = declared.get(name)
            if volume is None:
                raise MaterialError(f"volumeMounts: no volume named {name!r} in the pod")
            folder = self._volume_folder(name, volume)
            sub = str(mount.get("subPath") or "")
            if sub:
                folder = folder / sub
                folder.mkdir(parents=True, exist_ok=True)  # as the kubelet creates a subPath
            mounts[str(mount["mountPath"])] = folder
        return mounts

    def _volume_folder(self, name: str, volume: Mapping[str, Any]) -> Path:
        own = self.folder / "volumes" / name
        if "secret" in volume:
            ref = volume["secret"]
            return _write_files(own, self._data("Secret", ref["secretName"],
                                                bool(ref.get("optional"))))
        if "configMap" in volume:
            ref = volume["configMap"]
            return _write_files(own, self._data("ConfigMap", ref["name"],
                                                bool(ref.get("optional"))))
        if "projected" in volume:
            files: dict[str, bytes] = {}
            for source in volume["projected"].get("sources") or []:
                files.update(self._projection(name, source))
            return _write_files(own, files)
        if "downwardAPI" in volume:
            return _write_files(own, self._projection(name, volume))
        if "emptyDir" in volume:
            own.mkdir(parents=True, exist_ok=True)
            own.chmod(0o700)
            return own
        if "hostPath" in volume:
            return _host_folder(f"volume {name!r}", volume["hostPath"])
        if "persistentVolumeClaim" in volume:
            return self._claim_folder(name, str(volume["persistentVolumeClaim"]["claimName"]))
        kinds = sorted(k for k in volume if k != "name")
        raise MaterialError(f"volume {name!r}: {', '.join(kinds) or 'no source'} is not run "
                            "here (secret, configMap, projected, downwardAPI, emptyDir, "
                            "hostPath, persistentVolumeClaim)")

    def _projection(self, volume: str, source: Mapping[str, Any]) -> dict[str, bytes]:
        """The files of one source of a ``projected`` volume (or a ``downwardAPI`` volume):
        a service account token (a TokenRequest for the pod's account, as the kubelet makes),
        a ConfigMap's or Secret's keys (``items`` pick keys and paths), pod fields."""
        if "serviceAccountToken" in source:
            sat = source["serviceAccountToken"]
            account = str(self.pod["spec"].get("serviceAccountName") or "default")
            audience = sat.get("audience")
            request = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(
                audiences=[audience] if audience else [],
                expiration_seconds=int(sat.get("expirationSeconds") or 3600)))
            token = self.core.create_namespaced_service_account_token(
                account, self.namespace, request)
            if token.status is None:
                raise MaterialError(f"volume {volume!r}: no token for service account "
                                    f"{account!r}")
            return {str(sat["path"]): str(token.status.token).encode()}
        if "configMap" in source or "secret" in source:
            ref = source.get("configMap") or source["secret"]
            kind = "ConfigMap" if "configMap" in source else "Secret"
            data = self._data(kind, ref["name"], bool(ref.get("optional")))
            items = ref.get("items")
            if not items:
                return data
            missing = [i["key"] for i in items if i["key"] not in data]
            if missing and not ref.get("optional"):
                raise MaterialError(f"volume {volume!r}: keys {missing} not in {kind} "
                                    f"{ref['name']!r}")
            return {str(i["path"]): data[i["key"]] for i in items if i["key"] in data}
        if "downwardAPI" in source:
            out: dict[str, bytes] = {}
            for item in source["downwardAPI"].get("items") or []:
                if "fieldRef" not in item:
                    raise MaterialError(f"volume {volume!r}: downwardAPI {item['path']!r} "
                                        "is not a fieldRef")
                out[str(item["path"])] = self._field(
                    f"volume {volume!r}", str(item["fieldRef"]["fieldPath"])).encode()
            return out
        if "clusterTrustBundle" in source or "podCertificate" in source:
            raise MaterialError(f"volume {volume!r}: {sorted(source)} is not run here")
        raise MaterialError(f"volume {volume!r}: projected source {sorted(source)} is not "
                            "run here")

    def _claim_folder(self, volume: str, claim_name: str) -> Path:
        try:
            claim = self.core.read_namespaced_persistent_volume_claim(claim_name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                raise MaterialError(f"volume {volume!r}: persistentvolumeclaim "
                                    f"{claim_name!r} not found") from exc
            raise
        bound = claim.spec.volume_name if claim.spec else None
        if (claim.status.phase if claim.status else None) != "Bound" or not bound:
            raise MaterialError(f"volume {volume!r}: persistentvolumeclaim {claim_name!r} "
                                "is not bound")
        pv = self.core.read_persistent_volume(bound)
        spec = pv.spec
        if spec is not None and spec.host_path is not None:
            return _host_folder(f"persistentvolume {bound!r}",
                                {"path": spec.host_path.path, "type": spec.host_path.type})
        if spec is not None and spec.local is not None:
            return _host_folder(f"persistentvolume {bound!r}", {"path": spec.local.path})
        raise MaterialError(f"volume {volume!r}: persistentvolume {bound!r} is neither hostPath "
                            "nor local; no folder of this host stands for it")

    # ------------------------------------------------------------------ environment

    def environment(self, container: Mapping[str, Any]) -> dict[str, str]:
        """The container's environment: ``envFrom`` first, then ``env`` (a later entry wins)."""
        env: dict[str, str] = {}
        for source in container.get("envFrom") or []:
            prefix = str(source.get("prefix") or "")
            for key, value in self._env_source(source).items():
                if _ENV_NAME.match(prefix + key):  # the kubelet skips keys that are no name
                    env[prefix + key] = value
        for entry in container.get("env") or []:
            name = str(entry["name"])
            if "valueFrom" in entry:
                found = self._value_from(name, entry["valueFrom"])
                if found is None:
                    continue  # an optional reference that is absent
                env[name] = found
            else:
                env[name] = str(entry.get("value", ""))
        return env

    def _env_source(self, source: Mapping[str, Any]) -> dict[str, str]:
        for field, kind in (("secretRef", "Secret"), ("configMapRef", "ConfigMap")):
            if field in source:
                ref = source[field]
                data = self._data(kind, ref["name"], bool(ref.get("optional")))
                return {k: v.decode() for k, v in data.items()}
        raise MaterialError(f"envFrom: {sorted(source)} names neither secretRef nor configMapRef")

    def _value_from(self, name: str, source: Mapping[str, Any]) -> str | None:
        for field, kind in (("secretKeyRef", "Secret"), ("configMapKeyRef", "ConfigMap")):
            if field in source:
                ref = source[field]
                optional = bool(ref.get("optional"))
                data = self._data(kind, ref["name"], optional)
                if ref["key"] in data:
                    return data[ref["key"]].decode()
                if optional:
                    return None
                raise MaterialError(f"env {name}: key {ref['key']!r} not in {kind} "
                                    f"{ref['name']!r}")
        if "fieldRef" in source:
            return self._field(name, str(source["fieldRef"]["fieldPath"]))
        raise MaterialError(f"env {name}: valueFrom {sorted(source)} is not run here "
                            "(secretKeyRef, configMapKeyRef, fieldRef)")

    def _field(self, name: str, path: str) -> str:
        meta, spec, status = (self.pod.get(k) or {} for k in ("metadata", "spec", "status"))
        simple = {"metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
                  "metadata.uid": meta.get("uid"), "spec.nodeName": spec.get("nodeName"),
                  "spec.serviceAccountName": spec.get("serviceAccountName"),
                  "status.podIP": status.get("podIP"), "status.hostIP": status.get("hostIP")}
        if path in simple:
            return str(simple[path] or "")
        m = _FIELD.match(path)
        if m:
            return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
        raise MaterialError(f"env {name}: fieldRef {path!r} is not run here")

    def _data(self, kind: str, name: str, optional: bool) -> dict[str, bytes]:
        """A Secret's (decoded) or ConfigMap's data; empty for an absent ``optional`` one."""
        read = (self.core.read_namespaced_secret if kind == "Secret"
                else self.core.read_namespaced_config_map)
        try:
            obj = read(name, self.namespace)
        except ApiException as exc:
            if exc.status == 404 and optional:
                return {}
            if exc.status == 404:
                raise MaterialError(f"{kind} {name!r} not found in namespace "
                                    f"{self.namespace!r}") from exc
            raise
        raw = obj.data or {}
        if kind == "Secret":
            return {k: base64.b64decode(v) for k, v in raw.items()}
        return {k: str(v).encode() for k, v in raw.items()}


def _write_files(folder: Path, data: Mapping[str, bytes]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for key, value in data.items():
        path = folder / key
        path.parent.mkdir(parents=True, exist_ok=True)  # an item's path may hold folders
        path.write_bytes(value)
        path.chmod(0o600)
    return folder


def _host_folder(what: str, source: Mapping[str, Any]) -> Path:
    """A host folder. Its ``type`` as the kubelet reads it: ``DirectoryOrCreate`` and none (the
    runtime creates a missing path as a folder) create it, ``Directory`` must exist; a file,
    socket or device type is no folder to run a container's mount from."""
    path = Path(str(source["path"]))
    kind = str(source.get("type") or "")
    if not path.is_absolute():
        raise MaterialError(f"{what}: hostPath {path} is not absolute")
    if kind in ("", "DirectoryOrCreate"):
        path.mkdir(parents=True, exist_ok=True)
    elif kind != "Directory":
        raise MaterialError(f"{what}: hostPath type {kind!r} is not run here "
                            "(Directory, DirectoryOrCreate)")
    if not path.is_dir():
        raise MaterialError(f"{what}: hostPath {path} is not a folder on this host")
    return path
